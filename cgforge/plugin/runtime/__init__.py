"""The model runtime: a model's adapter, the Verlet neighbour list, the edge layout, the captured step, the
memory plan and compile mode, behind one ``Potential`` built by ``load`` (``runtime.potential``). The ASE calculator,
the MD engine and LAMMPS all evaluate models through it. The package imports none of its modules, so ``import
cgforge.plugin.runtime.neighbours`` stays light.
"""
