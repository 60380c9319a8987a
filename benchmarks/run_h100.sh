#!/usr/bin/env bash
# The GPU session's runs, by stage, on the device machine (after `source .device/base/env.sh`; cuEquivariance
# installed by .device/cueq-a then .device/cueq-b). Logs and JSON go to $OUT. TESTS= narrows the tests stage.
#   bash benchmarks/run_h100.sh tests|lammps
# Benchmark numbers: `python benchmarks/run.py SUITE...` (a run folder with manifest.json: commit, device, versions);
# A/Bs: investigations/tuning_ab.py. This script stays for the sharded CUDA test suite (`tests`) and the LAMMPS build
# and tests (`lammps`); its older stages (md, engine, ab, envab, ranges, harmonics, atomic, ...) are in commit 16a1f98.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
export OUT
# The project is on PYTHONPATH, not installed, so nequip would not find its `nequip.extension` entry point
# (the enable_cgforge modifier): a metadata-only dist-info written from pyproject.toml provides it.
EP_DIR=$(mktemp -d)
python3 - "$EP_DIR" <<'PY'
import sys, tomllib
from pathlib import Path
project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
info = Path(sys.argv[1]) / f"cgforge-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: cgforge\nVersion: {project['version']}\n")
groups = project.get("entry-points", {}) | {"console_scripts": project.get("scripts", {})}
text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
(info / "entry_points.txt").write_text(text)
PY
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$EP_DIR"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/device.txt"
case "${1:-}" in
tests)  # the CUDA suite: SHARDS pytest processes side by side on the one GPU (NVRTC and Inductor compile on the
        # CPU cores), the collected test ids dealt round-robin so that the slow ones spread; one log in $OUT.
        # TESTS=paths runs just those, in one process.
    limit=${TEST_LIMIT:-540}
    if [ -n "${TESTS:-}" ]; then
        # shellcheck disable=SC2086  # TESTS is a list of paths
        timeout "$limit" python3 -m pytest -m cuda -q -rfE -p no:cacheprovider --durations=15 $TESTS \
            > "$OUT/cuda-tests.log" 2>&1; tail -25 "$OUT/cuda-tests.log"; exit 0
    fi
    # PART=i/n (1-based) keeps every n-th test id from the i-th: the suite outgrew one 10-minute call.
    shards=${SHARDS:-4} part=${PART:-1/1}
    ids=$(mktemp -d) logs=$(mktemp -d)
    # SELECT=expr narrows the sharded suite to the tests pytest's -k selects
    python3 -m pytest -m cuda -q --collect-only -p no:cacheprovider ${SELECT:+-k "$SELECT"} tests 2>/dev/null \
        | grep '::' \
        | awk -v i="${part%/*}" -v n="${part#*/}" '(NR - i) % n == 0' \
        | awk -v n="$shards" -v dir="$ids" '{ print > (dir "/" (NR - 1) % n) }'
    echo "part $part: $(cat "$ids"/* | wc -l) CUDA tests in $shards shards"
    # the CPU cores shared out: each process's intra-op and Inductor compile threads (the default is all cores)
    threads=$(( $(nproc) / shards > 0 ? $(nproc) / shards : 1 ))
    export OMP_NUM_THREADS=$threads TORCHINDUCTOR_COMPILE_THREADS=$threads
    pids=()
    for ((k = 0; k < shards; k++)); do
        mapfile -t shard < "$ids/$k"
        timeout -s INT -k 30 "$limit" python3 -m pytest -m cuda -q -rfE -p no:cacheprovider --durations=5 \
            "${shard[@]}" > "$logs/$k.log" 2>&1 &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    for ((k = 0; k < shards; k++)); do
        echo "== shard $k: $(grep -E '(passed|failed|error)' "$logs/$k.log" | tail -1)"
        grep -E '^(FAILED|ERROR) ' "$logs/$k.log" | cut -c1-240
        grep -q KeyboardInterrupt "$logs/$k.log" && echo "   cut by the time limit ($limit s)" && status=1
        cat "$logs/$k.log" >> "$OUT/cuda-tests.log"
    done
    exit $status ;;
lammps) # issue 40 on a two-GPU machine (nvidia-h100-x2; carry .device/base and .device/lammps with the 22 Jul 2025
        # tarball, or .device/lmpkk): build LAMMPS (Kokkos CUDA, ~220 s on 32 cores; LMP=DEST, reused when built), its CUDA tests (one
        # and two GPUs), then bench_lammps in exchange mode on 1 and 2 GPUs with MACE's class and the engine.
        # Open MPI refuses root and binds ranks to one core unless told; the machine's has no CUDA support, so
        # LAMMPS runs with gpu/aware off (the build keeps ML-IAP's pair communication on its host-staged device path),
        # unless a CUDA-aware Open MPI is carried (.device/ompi/ompi-cuda.tar.xz from scripts/openmpi_cuda.sh, built
        # for /tmp/ompi-cuda): then it goes first on the paths and LAMMPS runs with gpu/aware on.
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_hwloc_base_binding_policy=none
    export CGFORGE_LAMMPS_GPU_AWARE=off
    if [ -f .device/ompi/ompi-cuda.tar.xz ]; then
        tar -xJf .device/ompi/ompi-cuda.tar.xz -C /tmp
        export PATH=/tmp/ompi-cuda/bin:$PATH LD_LIBRARY_PATH=/tmp/ompi-cuda/lib:${LD_LIBRARY_PATH:-}
        export CGFORGE_LAMMPS_GPU_AWARE=on
    fi
    export CGFORGE_LAMMPS_KOKKOS_DIR=${LMP:-/tmp/lmp-kk}
    # a build packed by an earlier call (tar.xz in parts: .device/lmpkk/lmpkk.part*, 7 MB; carry .device/lmpkk
    # instead of .device/lammps) is unpacked instead of built again: DEST must be /tmp/lmp-kk, where it was built
    if [ -d .device/lmpkk ] && [ ! -f "$CGFORGE_LAMMPS_KOKKOS_DIR/.built" ]; then
        cat .device/lmpkk/lmpkk.part* | xz -d | tar -xf - -C "$(dirname "$CGFORGE_LAMMPS_KOKKOS_DIR")"
    fi
    CGFORGE_LAMMPS_JOBS=$(nproc) CGFORGE_LAMMPS_TARBALL=$PWD/.device/lammps/lammps-22Jul2025u2-src.tar.gz \
        bash scripts/lammps_gpu.sh "$CGFORGE_LAMMPS_KOKKOS_DIR" > "$OUT/lammps-build.log" 2>&1
    tail -1 "$OUT/lammps-build.log"
    grep -q '^BUILT' "$OUT/lammps-build.log" || exit 1  # NOT FINISHED: run the stage again on this machine
    if [ -n "${PACK:-}" ] && [ ! -d .device/lmpkk ]; then  # PACK=1: the build into $OUT, for .device/lmpkk/
        (cd "$(dirname "$CGFORGE_LAMMPS_KOKKOS_DIR")" && d=$(basename "$CGFORGE_LAMMPS_KOKKOS_DIR") && tar -cf - \
            "$d/.mode" "$d/.built" "$d"/src/build/liblammps.so* "$d"/src/build/libpython3*.so "$d/src/python") \
            | xz -T0 -6 | split -b 15M -d - "$OUT/lmpkk.part"
    fi
    # the stand-in's CUDA tests and real LAMMPS on one and two GPUs (226 s for 11 tests on 2026-11-27)
    timeout -s INT -k 15 "${TEST_LIMIT:-330}" python3 -m pytest -m cuda -q -rfE -p no:cacheprovider \
        tests/lammps/test_lammps.py tests/lammps/test_lammps_real.py > "$OUT/lammps-tests.log" 2>&1
    tail -3 "$OUT/lammps-tests.log"
    python3 benchmarks/bench_lammps.py --lammps "$CGFORGE_LAMMPS_KOKKOS_DIR" --models ${MODELS:-mace mace-mp-medium} \
        --sizes ${SIZES:-1728} --classes cgforge cgforge-mlp mace-own engine --modes exchange ghost \
        --ranks 1 2 --steps 20 --gpu-aware "$CGFORGE_LAMMPS_GPU_AWARE" \
        --warmup 5 --timeout 150 --budget "${BENCH_BUDGET:-300}" 2>&1 | tee "$OUT/lammps-bench.log" | tail -25 ;;
*) echo "usage: $0 tests|lammps" >&2; exit 2 ;;
esac
