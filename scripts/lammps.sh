#!/usr/bin/env bash
# Builds (once, cached outside the clone) the CPU LAMMPS builds the real-LAMMPS tests run (tests/lammps/test_lammps_real.py):
#
#   .lammps/                   29 Aug 2024 Update 3: ML-IAP + ML-SNAP + PYTHON + MPI (the source's build.sh;
#                              ghost-neighbour mode only, host couple)
#   .lammps/kokkos-22Jul2025/  22 Jul 2025 Update 2: KOKKOS (Serial host backend) + ML-IAP + ML-SNAP + PYTHON + MPI
#                              (scripts/lammps_gpu.sh --kokkos-host): its host couple (`pair_style mliap unified`)
#                              and its Kokkos couple (`-k on t 1 -sf kk`), which has forward_exchange (exchange mode)
#
# The sources: $CGFORGE_LAMMPS_SRC (a folder holding build.sh and the tarballs), else ../shared/lammps next to the
# repository. A missing source or a failed build says so and goes on (the tests then skip with the reason).
# Where: a fresh clone links .lammps to $CGFORGE_LAMMPS_CACHE/KEY (default ~/.cache/cgforge/lammps/KEY), KEY a hash of
# the sources, the build scripts and the Python and NumPy versions, so later clones (CI) reuse a build made with
# the same inputs instead of building again; a .lammps that is a real folder (an older checkout) is used in place.
# Usage: bash scripts/lammps.sh [PYTHON] [--only 2024|2025]
# Time on 2 cores, once: ~5 min (2024) + ~10 min (2025 with Kokkos at -O1; its unused Kokkos styles are left out).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
only=
while [ $# -gt 0 ]; do
  case "$1" in
    --only) only=${2:?--only takes 2024 or 2025}; shift 2 ;;
    *) py=$1; shift ;;
  esac
done
# absolute: a relative Python_EXECUTABLE is not found by CMake, which then takes the build tools' own Python
# (no NumPy: "Could NOT find Python (missing: ... NumPy)", seen in a fresh-clone CI run)
py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")
src=${CGFORGE_LAMMPS_SRC:-$root/../shared/lammps}
jobs=$(nproc)

cache_key() {  # what a build depends on: sources (name and size), build scripts, Python and NumPy versions
  {
    stat -c '%n %s' "$src"/build.sh "$src"/*.tar.gz 2>/dev/null || true
    cat "$src/build.sh" "$root/scripts/lammps.sh" "$root/scripts/lammps_gpu.sh" 2>/dev/null || true
    "$py" -c 'import sys, numpy; print(sys.version.split()[0], numpy.__version__)'
  } | sha1sum | cut -c1-16
}

dest=$root/.lammps
if [ ! -d "$dest" ] || [ -L "$dest" ]; then
  cache=${CGFORGE_LAMMPS_CACHE:-${XDG_CACHE_HOME:-${HOME:-/nonexistent}/.cache}/cgforge/lammps}/$(cache_key)
  if mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ]; then
    ln -sfn "$cache" "$dest"
    echo "lammps: builds cached in $cache (.lammps links there)"
    # one build at a time per cache folder: a second clone's CI waits for the first instead of building beside it
    exec 9>"$cache/.lock"
    command -v flock > /dev/null && flock 9
  else
    echo "lammps: cannot write the cache $cache: building in $dest"
    rm -f "$dest"
    mkdir -p "$dest"
  fi
fi
dest=$(cd "$dest" && pwd -P)  # the real folder: the builds record absolute paths
dest25=$dest/kokkos-22Jul2025

tools() {  # the build tools both builds use (MPICH's mpicxx/mpirun, Cython, CMake, Ninja) in .lammps/tools
  if [ ! -x "$dest/tools/bin/mpicxx" ] || [ ! -x "$dest/tools/bin/ninja" ]; then
    mkdir -p "$dest"
    python3 -m venv "$dest/tools"
    "$dest/tools/bin/pip" install -q mpich cython==3.0.11 cmake ninja
  fi
}

build_2024() {
  if [ -f "$dest/src/build/liblammps.so" ]; then
    echo "lammps: using the 29Aug2024 build in $dest"
    return 0
  fi
  if [ ! -f "$src/build.sh" ]; then
    echo "lammps: no LAMMPS source ($src/build.sh not found; set CGFORGE_LAMMPS_SRC): the 29Aug2024 tests will skip"
    return 0
  fi
  echo "lammps: building LAMMPS 29Aug2024 from $src into $dest (once, ~5 minutes)"
  tools
  if ! bash "$src/build.sh" "$dest" "$py" > "$root/.lammps-build.log" 2>&1; then
    echo "lammps: the 29Aug2024 build failed (see .lammps-build.log, last lines below); its tests will skip"
    tail -n 20 "$root/.lammps-build.log"
    rm -f "$dest/src/build/liblammps.so"
  fi
}

build_2025() {
  local tarball=$src/lammps-22Jul2025u2-src.tar.gz log=$dest/build-22Jul2025.log
  if [ -f "$dest25/.built" ]; then
    echo "lammps: using the 22Jul2025 Kokkos build in $dest25"
    return 0
  fi
  if [ ! -f "$tarball" ]; then
    echo "lammps: no $tarball: the 22Jul2025 (exchange-mode) tests will skip"
    return 0
  fi
  echo "lammps: building LAMMPS 22Jul2025 with KOKKOS (Serial) into $dest25 (once, ~10 minutes; log: $log)"
  tools
  mkdir -p "$dest25"
  ln -sfn ../tools "$dest25/tools"  # the tests take mpirun from BUILD/tools/bin: the same MPICH as the build
  # the budget: lammps_gpu.sh stops a build at it (made for cut-off GPU calls); here there is no cut-off
  if ! PATH="$dest/tools/bin:$PATH" CGFORGE_LAMMPS_TARBALL="$tarball" CGFORGE_LAMMPS_PYTHON="$py" \
      CGFORGE_LAMMPS_JOBS="$jobs" CGFORGE_LAMMPS_OPT=-O1 CGFORGE_LAMMPS_BUDGET=5400 \
      CGFORGE_CYTHONIZE="$dest/tools/bin/cythonize" \
      bash "$root/scripts/lammps_gpu.sh" --kokkos-host "$dest25" > "$log" 2>&1; then
    echo "lammps: the 22Jul2025 Kokkos build failed (see $log, last lines below); its tests will skip"
    tail -n 20 "$log"
  fi
}

[ "$only" = 2025 ] || build_2024
[ "$only" = 2024 ] || build_2025
