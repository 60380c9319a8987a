#!/usr/bin/env bash
# Builds (once, cached in .lammps/) a LAMMPS with ML-IAP + PYTHON + MPI for the project's Python, for the
# real-LAMMPS test (tests/test_lammps_real.py). The source: $CGFORGE_LAMMPS_SRC (a folder holding build.sh and
# the LAMMPS tarball), else ../shared/lammps next to the repository. No source: says so and does nothing (the
# test then skips with that reason). Usage: bash scripts/lammps.sh [PYTHON]   (~4-6 minutes on 2 cores, once)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-$root/.venv/bin/python}
# absolute: a relative Python_EXECUTABLE is not found by CMake, which then takes the build tools' own Python
# (no NumPy: "Could NOT find Python (missing: ... NumPy)", seen in a fresh-clone CI run)
py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")
src=${CGFORGE_LAMMPS_SRC:-$root/../shared/lammps}
dest=$root/.lammps
if [ -f "$dest/src/build/liblammps.so" ]; then
  echo "lammps: using the build in $dest"
  exit 0
fi
if [ ! -f "$src/build.sh" ]; then
  echo "lammps: no LAMMPS source ($src/build.sh not found; set CGFORGE_LAMMPS_SRC): the real-LAMMPS test will skip"
  exit 0
fi
echo "lammps: building LAMMPS from $src into $dest (once, ~5 minutes)"
if ! bash "$src/build.sh" "$dest" "$py" > "$root/.lammps-build.log" 2>&1; then
  echo "lammps: the build failed (see .lammps-build.log, last lines below); the real-LAMMPS test will skip"
  tail -n 20 "$root/.lammps-build.log"
  rm -rf "$dest/src/build/liblammps.so"
fi
