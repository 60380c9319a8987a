#!/usr/bin/env bash
# Builds LAMMPS for the GPU machine with `pair_style mliap unified` (ML-IAP + ML-SNAP + PYTHON), as a shared
# library plus its Python module, into DEST. Made for calls that are cut off (the device calls stop at 10 min):
# run the same command again on the same machine and it goes on where it stopped. Nothing is downloaded.
#
#   bash scripts/lammps_gpu.sh [--plain | --kokkos-host] DEST
#
#   (default)      KOKKOS with CUDA for Hopper (Kokkos_ARCH_HOPPER90): `-k on g 1 -sf kk`, device arrays
#                  (mliap/kk's update_pair_forces_gpu). Needs nvcc and the Kokkos source (below).
#   --plain        no Kokkos (a few minutes): a CPU LAMMPS whose Python model may still run on the GPU
#                  through host arrays (update_pair_forces).
#   --kokkos-host  KOKKOS with the Serial backend only, built by the host compiler: the Kokkos ML-IAP code path
#                  (its data object; arrays are numpy on the host) on a machine without nvcc, for tests.
#
# Sources (git-ignored; GPL-2.0 LAMMPS and Apache-2.0 Kokkos, never commit them):
#   CGFORGE_LAMMPS_TARBALL  default .device/lammps/lammps-29Aug2024u3-src.tar.gz (LAMMPS stable 29Aug2024 u3,
#                           a copy without lib/, so Kokkos comes from the next one); lammps-22Jul2025u2-src.tar.gz
#                           brings its own lib/kokkos (4.6.2, which handles CUDA 13 itself: no edits, no next one)
#   CGFORGE_KOKKOS_TARBALL  default .device/lammps/kokkos-4.3.01.tar.gz (the Kokkos release that LAMMPS
#                           29Aug2024 bundles, 2.4 MB; a tarball with a top folder kokkos/). Not needed for --plain.
#   Put them in place with:  mkdir -p .device/lammps && cp ../shared/lammps/*.tar.gz .device/lammps/
#   and, from a clone of github.com/kokkos/kokkos (the `fetch` tool brings one to /work/.mirror/kokkos+kokkos/repo):
#     git --git-dir=KOKKOS/.git archive --format=tar --prefix=kokkos/ 4.3.01 | gzip > .device/lammps/kokkos-4.3.01.tar.gz
# Other settings: CGFORGE_LAMMPS_PYTHON (python3), CGFORGE_LAMMPS_JOBS (16), CGFORGE_LAMMPS_BUDGET (seconds this
# call may spend, 540: the compile step stops cleanly before that so the next call resumes it), CGFORGE_LAMMPS_OPT
# (the compiler's optimisation flag, default CMake Release's -O3; the CPU test build takes -O1: a shorter build).
# MPI: LAMMPS's serial stubs (one rank; no MPI library needed) unless `mpicxx` is on PATH.
# CUDA >= 13 (the GPU machine has 13.0) changed cudaMemAdvise/cudaMemPrefetchAsync to take a cudaMemLocation;
# and cudaGraphAddDependencies to take edge data; Kokkos 4.3.01 predates that, so its three wrappers are edited
# (guarded by CUDART_VERSION), and nvcc_wrapper's default sm_70, below CUDA 13's minimum, becomes sm_90.
# The last line says BUILT, NOT FINISHED (run again) or FAILED (with the log's tail above it).
set -uo pipefail
start=$(date +%s)
log() { echo "[$(date -u +%H:%M:%S)] lammps_gpu: $*"; }
fail() { log "$*"; echo "FAILED: $*"; exit 1; }

mode=kokkos
case "${1:-}" in
  --plain) mode=plain; shift ;;
  --kokkos-host) mode=kokkos-host; shift ;;
  -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
  -*) fail "unknown option ${1} (expected --plain or --kokkos-host, or none for KOKKOS+CUDA)" ;;
esac
[ $# -eq 1 ] || fail "usage: bash scripts/lammps_gpu.sh [--plain | --kokkos-host] DEST"
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" || fail "DEST: cannot create $1"
dest=$(cd "$1" && pwd)
tarball=${CGFORGE_LAMMPS_TARBALL:-$root/.device/lammps/lammps-29Aug2024u3-src.tar.gz}
kokkos_tarball=${CGFORGE_KOKKOS_TARBALL:-$root/.device/lammps/kokkos-4.3.01.tar.gz}
jobs=${CGFORGE_LAMMPS_JOBS:-16}
budget=${CGFORGE_LAMMPS_BUDGET:-540}
opt=${CGFORGE_LAMMPS_OPT:-}
py=$(command -v "${CGFORGE_LAMMPS_PYTHON:-python3}") || fail "CGFORGE_LAMMPS_PYTHON: ${CGFORGE_LAMMPS_PYTHON:-python3} not found"
src=$dest/src          # the LAMMPS tree (cmake/, src/, python/, lib/kokkos)
build=$dest/src/build  # bench_lammps.py and tests find liblammps.so here and the module in $dest/src/python
mkdir -p "$dest/logs"
log "mode $mode, DEST $dest, python $py, $jobs jobs, budget ${budget}s"

# One DEST holds one kind of build: a second mode there would reuse the wrong CMake cache.
if [ -f "$dest/.mode" ] && [ "$(cat "$dest/.mode")" != "$mode" ]; then
  fail "DEST $dest holds a '$(cat "$dest/.mode")' build; give another DEST for '$mode'"
fi
echo "$mode" > "$dest/.mode"

if [ "$mode" = kokkos ]; then  # nvcc_wrapper calls `nvcc` from PATH, at configure and at every compile
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | head -n 1)
  [ -n "$nvcc" ] || fail "nvcc not found on PATH or in /usr/local/cuda*/bin (the KOKKOS CUDA build needs it; --plain needs none)"
  export PATH="$(dirname "$nvcc"):$PATH"
fi

environment_line() {
  echo "export PYTHONPATH=$src/python:\$PYTHONPATH LD_LIBRARY_PATH=$build:\$LD_LIBRARY_PATH"
}

check_import() {  # the module loads, has the packages, and the ML-IAP Python coupling activates
  local probe
  probe="import lammps, lammps.mliap as m
l = lammps.lammps(cmdargs=['-log', 'none', '-screen', 'none', '-nocite'])
need = ['ML-IAP', 'ML-SNAP', 'PYTHON'] + (['KOKKOS'] if '$mode' != 'plain' else [])
missing = [p for p in need if not l.has_package(p)]
assert not missing, f'packages missing: {missing}'
m.activate_mliappy(l)
if '$mode' != 'plain':
    assert hasattr(m, 'activate_mliappy_kokkos'), 'lammps.mliap has no activate_mliappy_kokkos'
print('lammps', l.version(), 'packages ok:', ' '.join(need))
l.close()"
  PYTHONPATH="$src/python${PYTHONPATH:+:$PYTHONPATH}" LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$py" -c "$probe"
}

if [ -f "$dest/.built" ]; then
  log "already built"
  check_import || fail "the build in $dest does not import (see above)"
  echo "BUILT: $dest ($mode; $(environment_line))"
  exit 0
fi

# --- 1. sources ---------------------------------------------------------------------------------------
if [ ! -f "$src/.extracted" ]; then
  [ -f "$tarball" ] || fail "CGFORGE_LAMMPS_TARBALL: $tarball not found (mkdir -p .device/lammps && cp ../shared/lammps/*.tar.gz .device/lammps/)"
  log "extracting $(basename "$tarball")"
  rm -rf "$src" && mkdir -p "$src"
  tar -xzf "$tarball" -C "$src" || fail "cannot extract $tarball"
  if [ ! -f "$src/cmake/CMakeLists.txt" ]; then  # a tarball with a top folder (lammps-29Aug2024/...)
    top=$(find "$src" -mindepth 2 -maxdepth 3 -path '*/cmake/CMakeLists.txt' | head -n 1)
    [ -n "$top" ] || fail "$tarball holds no cmake/CMakeLists.txt"
    top=$(dirname "$(dirname "$top")")
    (shopt -s dotglob && mv "$top"/* "$src"/) && rmdir "$top" 2>/dev/null || true
  fi
  touch "$src/.extracted"
fi
if [ "$mode" != plain ] && [ ! -f "$src/lib/kokkos/.ready" ]; then
  if [ ! -f "$src/lib/kokkos/CMakeLists.txt" ]; then
    [ -f "$kokkos_tarball" ] || fail "CGFORGE_KOKKOS_TARBALL: $kokkos_tarball not found (the LAMMPS tarball has no lib/kokkos; see the header of $0)"
    log "extracting $(basename "$kokkos_tarball") into lib/kokkos"
    rm -rf "$src/lib/kokkos" "$src/lib/.kokkos-tmp" && mkdir -p "$src/lib/.kokkos-tmp"
    tar -xzf "$kokkos_tarball" -C "$src/lib/.kokkos-tmp" || fail "cannot extract $kokkos_tarball"
    found=$(find "$src/lib/.kokkos-tmp" -maxdepth 2 -name CMakeLists.txt -path '*/CMakeLists.txt' | head -n 1)
    [ -n "$found" ] && [ -d "$(dirname "$found")/core/src" ] || fail "$kokkos_tarball holds no Kokkos source (core/src)"
    mv "$(dirname "$found")" "$src/lib/kokkos" && rm -rf "$src/lib/.kokkos-tmp"
  fi
  # Kokkos 4.3.01 + CUDA 13: the runtime's cudaMemAdvise and cudaMemPrefetchAsync take a cudaMemLocation now
  # (the int-device forms are gone) and cudaGraphAddDependencies edge data; the wrappers pick the form by
  # CUDART_VERSION, so older CUDA is unchanged.
  # And nvcc_wrapper's default target, sm_70 (used for CMake's compiler checks), is below CUDA 13's minimum, sm_75.
  "$py" - "$src/lib/kokkos" <<'EOF' || fail "could not adapt Kokkos to CUDA 13 (see above)"
import sys
kokkos = sys.argv[1]
path = kokkos + "/bin/nvcc_wrapper"
text = open(path).read()
if 'default_arch="sm_70"' in text:
    open(path, "w").write(text.replace('default_arch="sm_70"', 'default_arch="sm_90"  # CGFORGE_CUDA13', 1))
path = kokkos + "/core/src/Cuda/Kokkos_Cuda_Instance.hpp"
text = open(path).read()
if "CUDART_VERSION >= 13000" in text and "CGFORGE_CUDA13" not in text:
    # a Kokkos that handles CUDA 13 itself (4.6.2, bundled with LAMMPS 22 Jul 2025): nothing to edit
    print("lammps_gpu: this Kokkos handles CUDA >= 13 itself: no edits")
    sys.exit(0)
edits = [
    ("    return cudaMemAdvise(devPtr, count, advice, device);\n",
     "#if CUDART_VERSION >= 13000  // CGFORGE_CUDA13: the location form\n"
     "    cudaMemLocation loc{};\n"
     "    loc.type = device == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;\n"
     "    loc.id = device == cudaCpuDeviceId ? 0 : device;\n"
     "    return cudaMemAdvise(devPtr, count, advice, loc);\n"
     "#else\n"
     "    return cudaMemAdvise(devPtr, count, advice, device);\n"
     "#endif\n"),
    ("    return cudaMemPrefetchAsync(devPtr, count, dstDevice,\n"
     "                                get_input_stream(stream));\n",
     "#if CUDART_VERSION >= 13000  // CGFORGE_CUDA13: the location form\n"
     "    cudaMemLocation loc{};\n"
     "    loc.type = dstDevice == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;\n"
     "    loc.id = dstDevice == cudaCpuDeviceId ? 0 : dstDevice;\n"
     "    return cudaMemPrefetchAsync(devPtr, count, loc, 0, get_input_stream(stream));\n"
     "#else\n"
     "    return cudaMemPrefetchAsync(devPtr, count, dstDevice,\n"
     "                                get_input_stream(stream));\n"
     "#endif\n"),
    ("    return cudaGraphAddDependencies(graph, from, to, numDependencies);\n",
     "#if CUDART_VERSION >= 13000  // CGFORGE_CUDA13: edge data (none: default edges)\n"
     "    return cudaGraphAddDependencies(graph, from, to, nullptr, numDependencies);\n"
     "#else\n"
     "    return cudaGraphAddDependencies(graph, from, to, numDependencies);\n"
     "#endif\n"),
]
for old, new in edits:
    if new in text:  # edited by an earlier call
        continue
    if text.count(old) != 1:
        sys.exit(f"{path}: expected one '{old.strip()[:60]}...' (not Kokkos 4.3.01?)")
    text = text.replace(old, new)
open(path, "w").write(text)
print("lammps_gpu: Kokkos wrappers adapted to CUDA >= 13 (cudaMemLocation)")
EOF
  touch "$src/lib/kokkos/.ready"
fi

# The KOKKOS package compiles a Kokkos twin of every enabled style it has one of (~80 files through nvcc, the
# longest part of the build, pair/snap/kk alone several minutes). This run needs only the ML-IAP pair, the
# integrators, thermo's compute temp and the neighbour/atom machinery: the twins of other pair, fix, compute and
# region styles are removed from the extracted tree (LAMMPS then uses their plain versions, were they asked for)
# unless a kept file includes them. CGFORGE_LAMMPS_TRIM=0 keeps all.
if [ "$mode" != plain ] && [ "${CGFORGE_LAMMPS_TRIM:-1}" != 0 ] && [ ! -f "$src/.trimmed" ] && [ ! -f "$dest/.configured" ]; then
  "$py" - "$src" <<'EOF' || fail "could not trim the KOKKOS styles (see above)"
import re, sys
from pathlib import Path
src = Path(sys.argv[1])
kk = src / "src" / "KOKKOS"
keep = re.compile(r"^(pair_(mliap|hybrid\w*)|fix_(nve|nh|nvt|npt|nph|langevin|momentum|minimize)|compute_temp)_kokkos")
drop = re.compile(r"^(pair|fix|compute|region)_\w+_kokkos$|^(pair_snap|sna)_kokkos(_impl)?$")
cmake = (src / "cmake" / "Modules" / "Packages" / "KOKKOS.cmake").read_text()
stems = {f.name.split(".")[0] for f in kk.iterdir() if f.suffix in (".cpp", ".h")}
gone = {s for s in stems if drop.match(s) and not keep.match(s) and f"/{s}.cpp" not in cmake}
def includes(path):
    return set(re.findall(r'#include\s+"([\w.]+)\.h"', path.read_text(errors="replace")))
changed = True
while changed:  # a dropped header still included by a kept file comes back (with what it includes)
    changed = False
    for f in list(kk.iterdir()) + list((src / "src").glob("*.[ch]*")) + list((src / "src" / "ML-IAP").iterdir()):
        if f.suffix in (".cpp", ".h") and f.name.split(".")[0] not in gone:
            back = includes(f) & gone
            if back:
                gone -= back
                changed = True
for s in sorted(gone):
    for suffix in (".cpp", ".h"):
        (kk / (s + suffix)).unlink(missing_ok=True)
(src / "trimmed-kokkos-styles.txt").write_text("\n".join(sorted(gone)) + "\n")
print(f"lammps_gpu: removed {len(gone)} unneeded KOKKOS style twins (listed in {src}/trimmed-kokkos-styles.txt)")
EOF
  touch "$src/.trimmed"
fi

# ML-IAP's exchange mode on several GPUs without GPU-aware MPI (`-pk kokkos gpu/aware off`, or LAMMPS turning it off
# when it detects none): LAMMPS then sends pair communication through the classic host path, whose
# PairMLIAPKokkos::pack_forward_comm reads the model's feature array (device memory) on the host: a segfault. Its
# device path has its own host staging for that case (CommKokkos::forward_comm_device / reverse_comm_device copy
# the packed buffer to the host around MPI); the edit keeps pair communication on that path (pair/only runs keep
# LAMMPS's choice).
if [ "$mode" != plain ] && [ ! -f "$src/.paircomm" ]; then
  "$py" - "$src/src/KOKKOS/kokkos.cpp" <<'EOF' || fail "could not edit kokkos.cpp's pair communication (see above)"
import sys
path = sys.argv[1]
text = open(path).read()
edits = [(f"    if ({kind}_pair_comm_classic == 0) {{\n      {kind}_pair_comm_classic = 1;\n",
          f"    if ({kind}_pair_comm_classic == 0 && lmp->pair_only_flag) {{  // CGFORGE_PAIRCOMM\n"
          f"      {kind}_pair_comm_classic = 1;\n") for kind in ("forward", "reverse")]
if all(new in text for _, new in edits):
    sys.exit(0)
if not all(text.count(old) == 1 for old, _ in edits):
    print("lammps_gpu: kokkos.cpp: no gpu/aware-off pair communication switch found: left as it is")
    sys.exit(0)
for old, new in edits:
    text = text.replace(old, new)
open(path, "w").write(text)
print("lammps_gpu: pair communication kept on the device path (host-staged MPI when gpu/aware is off)")
EOF
  touch "$src/.paircomm"
fi

# --- 2. configure (once) ------------------------------------------------------------------------------
if [ ! -f "$dest/.configured" ]; then
  command -v cmake > /dev/null || fail "cmake not found"
  command -v ninja > /dev/null || fail "ninja not found"
  # ML-IAP's Python coupling is Cython: cythonize next to the Python (CMake looks there), on PATH, or a
  # wrapper around the Python's own Cython module.
  cythonize=${CGFORGE_CYTHONIZE:-}
  for c in "$(dirname "$py")/cythonize" "$(command -v cythonize 2>/dev/null)"; do
    [ -z "$cythonize" ] && [ -n "$c" ] && [ -x "$c" ] && cythonize=$c
  done
  if [ -z "$cythonize" ]; then
    "$py" -c "import Cython" 2> /dev/null || fail "no Cython: neither cythonize nor '$py -c \"import Cython\"' (set CGFORGE_CYTHONIZE)"
    mkdir -p "$dest/tools"
    printf '#!/bin/sh\nexec "%s" -m Cython.Build.Cythonize "$@"\n' "$py" > "$dest/tools/cythonize"
    chmod +x "$dest/tools/cythonize" && cythonize=$dest/tools/cythonize
  fi
  opts=(-G Ninja -S "$src/cmake" -B "$build" -D CMAKE_BUILD_TYPE=Release -D BUILD_SHARED_LIBS=ON
        -D PKG_ML-IAP=ON -D PKG_ML-SNAP=ON -D PKG_PYTHON=ON -D MLIAP_ENABLE_PYTHON=ON
        -D Python_EXECUTABLE="$py" -D Cythonize_EXECUTABLE="$cythonize"
        -D BUILD_OMP=OFF -D BUILD_TOOLS=OFF -D BUILD_LAMMPS_GUI=OFF -D ENABLE_TESTING=OFF
        -D WITH_JPEG=OFF -D WITH_PNG=OFF -D WITH_FFMPEG=OFF -D WITH_GZIP=OFF -D WITH_CURL=OFF)
  if [ -n "$opt" ]; then
    opts+=(-D CMAKE_CXX_FLAGS_RELEASE="$opt -DNDEBUG" -D CMAKE_C_FLAGS_RELEASE="$opt -DNDEBUG"); log "optimisation: $opt"
  fi
  if command -v mpicxx > /dev/null; then
    opts+=(-D BUILD_MPI=ON); log "MPI: $(command -v mpicxx)"
  else
    opts+=(-D BUILD_MPI=OFF); log "MPI: none found, LAMMPS's serial stubs (one rank)"
  fi
  case "$mode" in
    kokkos)
      log "nvcc: $nvcc ($("$nvcc" --version | tail -n 2 | head -n 1))"
      # Kokkos links the driver library (libcuda.so): the toolkit's stub, else the driver's own libcuda.so.1
      # (CMake looks for the unversioned name only), else CGFORGE_CUDA_DRIVER.
      driver=${CGFORGE_CUDA_DRIVER:-}
      # the toolkit nvcc runs from (it may be a wrapper script elsewhere): its dry run prints TOP=
      cudadir=$(cd /tmp && "$nvcc" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
      [ -n "$cudadir" ] || cudadir=$(dirname "$(readlink -f "$nvcc")")/..
      for d in "$cudadir/lib64/stubs" "$cudadir/targets/x86_64-linux/lib/stubs" "$cudadir/lib64"; do
        [ -z "$driver" ] && [ -f "$d/libcuda.so" ] && driver=$d/libcuda.so
      done
      if [ -z "$driver" ]; then
        so1=$(ldconfig -p 2>/dev/null | awk '$1 == "libcuda.so.1" {print $NF; exit}')
        if [ -n "$so1" ]; then mkdir -p "$dest/tools/lib" && ln -sf "$so1" "$dest/tools/lib/libcuda.so" && driver=$dest/tools/lib/libcuda.so; fi
      fi
      if [ -n "$driver" ]; then opts+=(-D CUDA_cuda_driver_LIBRARY="$driver"); log "CUDA driver library: $driver"; fi
      # nvcc_wrapper compiles every C++ file (Kokkos' supported way for CUDA); Serial is Kokkos' host space
      opts+=(-D PKG_KOKKOS=ON -D Kokkos_ENABLE_CUDA=ON -D Kokkos_ENABLE_SERIAL=ON -D Kokkos_ENABLE_OPENMP=OFF
             -D Kokkos_ARCH_HOPPER90=ON -D Kokkos_ENABLE_DEPRECATION_WARNINGS=OFF
             -D CMAKE_CXX_COMPILER="$src/lib/kokkos/bin/nvcc_wrapper" -D CMAKE_CUDA_COMPILER="$nvcc") ;;
    kokkos-host)
      opts+=(-D PKG_KOKKOS=ON -D Kokkos_ENABLE_SERIAL=ON -D Kokkos_ENABLE_CUDA=OFF -D Kokkos_ENABLE_OPENMP=OFF
             -D Kokkos_ENABLE_DEPRECATION_WARNINGS=OFF) ;;
  esac
  log "configuring (log: $dest/logs/cmake.log)"
  if ! cmake "${opts[@]}" > "$dest/logs/cmake.log" 2>&1; then
    tail -n 30 "$dest/logs/cmake.log"
    rm -rf "$build/CMakeCache.txt"  # the next call configures from scratch
    fail "cmake configuration failed ($dest/logs/cmake.log)"
  fi
  grep -E "Enabled packages|^-- <<< Build configuration|Kokkos.*(Devices|Architectures)" -A 1 "$dest/logs/cmake.log" | head -n 12
  touch "$dest/.configured"
fi

# --- 3. build, within this call's budget ------------------------------------------------------------------
left=$(( budget - ($(date +%s) - start) ))
[ "$left" -gt 30 ] || { echo "NOT FINISHED: configured; no time left in this call's budget (${budget}s): run the same command again"; exit 3; }
log "building with ninja -j$jobs for at most ${left}s (log: $dest/logs/build.log)"
# SIGINT: ninja stops its compilers, which remove their half-written outputs; ninja's log then lists only the
# finished commands, so the next call redoes only the rest.
timeout --signal=INT --kill-after=30 "$left" ninja -C "$build" -j "$jobs" >> "$dest/logs/build.log" 2>&1
rc=$?
progress=$(grep -oE '^\[[0-9]+/[0-9]+\]' "$dest/logs/build.log" | tail -n 1)
if [ $rc -eq 124 ] || [ $rc -eq 130 ] || [ $rc -eq 137 ]; then
  log "stopped at the budget; ninja had reached ${progress:-?}"
  echo "NOT FINISHED: ${progress:-?} compiled; run the same command again on this machine to go on"
  exit 3
fi
if [ $rc -ne 0 ]; then
  grep -n -m 5 -E "error|Error" "$dest/logs/build.log" | head -n 5
  tail -n 40 "$dest/logs/build.log"
  fail "ninja exit $rc at ${progress:-?} ($dest/logs/build.log)"
fi
log "compiled (${progress:-up to date})"

# lammps.mliap checks for the Python library by its unversioned name (libpython3.X.so), which a runtime
# without the -dev package lacks: link it next to liblammps.so, which is on LD_LIBRARY_PATH.
pylib=$("$py" -c "import sysconfig; print('libpython' + sysconfig.get_config_var('VERSION') + sysconfig.get_config_var('abiflags') + '.so')")
linked=$(ldd "$build/liblammps.so" 2>/dev/null | awk -v n="$pylib" 'index($1, n) == 1 {print $3; exit}')
if [ -n "$linked" ] && [ -f "$linked" ] && [ ! -e "$build/$pylib" ] && [ "$(basename "$linked")" != "$pylib" ]; then
  ln -s "$linked" "$build/$pylib" && log "linked $build/$pylib -> $linked"
fi
check_import || fail "built, but the Python module does not load (see above)"
touch "$dest/.built"
log "done in $(( $(date +%s) - start ))s this call"
echo "BUILT: $dest ($mode; $(environment_line))"
