"""The model runtime: a model's adapter, the Verlet neighbour list, the edge layout, the captured step, the
memory plan and compile mode. The ASE calculator, the MD engine and LAMMPS all evaluate models through it."""
