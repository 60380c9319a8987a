"""The model runtime: a model's adapter, the Verlet neighbour list, the edge layout, the captured step, the
memory plan and compile mode, behind one ``Potential`` built by ``load``. The ASE calculator, the MD engine and
LAMMPS all evaluate models through it.

    from cgforge.plugin.runtime.options import RuntimeOptions
    from cgforge.plugin.runtime.potential import load
    potential = load("mace", device="cuda", options=RuntimeOptions())

The package imports none of its modules, so ``import cgforge.plugin.runtime.neighbours`` stays light.
"""
