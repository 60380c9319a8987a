#!/usr/bin/env bash
# The GPU session's runs, by stage, on the device machine (after `source .device/base/env.sh`; cuEquivariance
# installed by .device/cueq-a then .device/cueq-b). Logs and JSON go to $OUT. TESTS= narrows the tests stage.
#   bash benchmarks/run_h100.sh tests|md|md64|ab|models|stability|engine|capacity|ranges|harmonics|atomic|layer|envab|large|lammps
# For benchmark numbers to keep, prefer `python benchmarks/run.py SUITE...` (a run folder with manifest.json: commit,
# device, versions); this script stays for the sharded CUDA test suite (`tests`) and the A/B stages.
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
md)     # end-to-end step: cgforge on every size, then the peers on the 5184-atom box
    python3 benchmarks/bench_md.py --systems 1k,5k,20k,50k,dhfr --models mace-mp-medium,bundled-mace,bundled-nequip,nequip-M \
        --dtypes float32 --backends cgforge --steps 10 --warmup 3 2>&1 | tee "$OUT/md-cgforge.log" | tail -25
    python3 benchmarks/bench_md.py --systems 5k --models mace-mp-medium,nequip-M --dtypes float32 \
        --backends e3nn,cueq,oeq,hybrid --steps 5 --warmup 2 2>&1 | tee "$OUT/md-peers.log" | tail -12 ;;
md64)   # FP64 on the 5184-atom box: cgforge and the cuEquivariance/OpenEquivariance peers
    python3 benchmarks/bench_md.py --systems 5k --models mace-mp-medium,nequip-M,bundled-mace,bundled-nequip \
        --dtypes float64 --backends cgforge --steps 10 --warmup 3 2>&1 | tee "$OUT/md64-cgforge.log" | tail -8
    python3 benchmarks/bench_md.py --systems 5k --models mace-mp-medium,nequip-M --dtypes float64 \
        --backends cueq,oeq --steps 5 --warmup 2 2>&1 | tee "$OUT/md64-peers.log" | tail -8 ;;
ab)     # A/B in one run: per-species self-connections (vs cgforge-e3nn-sc), the edge topology (vs cgforge-sorted),
        # radial-MLP precision modes
    python3 benchmarks/bench_md.py --systems 5k --models mace-mp-medium,nequip-M --dtypes float32 \
        --backends cgforge,cgforge-e3nn-sc,cgforge-sorted,cgforge-3xtf32,cgforge-tf32 --steps 10 --warmup 3 2>&1 \
        | tee "$OUT/md-ab.log" | tail -12 ;;
models) # model calls: MACE-MP-medium (E+F+stress, as MACECalculator asks) and NequIP, with the peers
    python3 benchmarks/bench_mace.py 12 float32 cgforge,cueq,oeq,hybrid,e3nn medium 2>&1 | tee "$OUT/mace.log" | tail -12
    python3 benchmarks/bench_nequip.py 12 M e3nn,cgforge,oeq,cueq,cgforge-calc 2>&1 | tee "$OUT/nequip-M.log" | tail -10
    python3 benchmarks/bench_nequip.py 12 l1 e3nn,cgforge,oeq,cueq,cgforge-calc 2>&1 | tee "$OUT/nequip-l1.log" | tail -10 ;;
stability)  # 10 ps NVT of the bundled models on the 1728-molecule box
    for m in mace nequip; do
        python3 benchmarks/investigations/md_stability.py --model $m --molecules 1728 --ps "${PS:-10}" 2>&1 | tee "$OUT/stability-$m.log" | tail -14
    done ;;
engine) # whole MD steps on the 5184-atom box (~5 min): cgforge's engine (NVT, NPT), our Calculator under ASE's
        # Langevin, FastMACE 1.0 (NVT, its own process, setup ~1 min each, reported apart); one table, printed last
    python3 benchmarks/bench_md.py --systems 5k --models bundled-mace,mace-mp-medium --dtypes float32 \
        --backends cgforge-engine,cgforge-ase,fastmace --ensembles nvt,npt --fastmace-ensembles nvt \
        --md-steps "${MD_STEPS:-200}" --md-warmup 20 2>&1 | tee "$OUT/md-engine.log" | tail -12 ;;
capacity)  # issue 18's large boxes (~8 min, no variable set: the calculator plans its own memory): the default
        # calculator at 5k, 500k and 1.03M atoms, MACE streaming at 1.03M beside it, NequIP M's default at 1.03M
    python3 benchmarks/bench_md.py --systems 5k,500k,1m --models mace-mp-medium --dtypes float32 --backends cgforge \
        --steps 3 --warmup 1 --nvt-only 2>&1 | tee "$OUT/capacity-mace.log" | tail -4
    python3 benchmarks/bench_md.py --systems 1m --models mace-mp-medium --dtypes float32 --backends cgforge-streaming \
        --steps 3 --warmup 1 --nvt-only 2>&1 | tee "$OUT/capacity-mace-streaming-1m.log" | tail -2
    python3 benchmarks/bench_md.py --systems 1m --models nequip-M --dtypes float32 --backends cgforge \
        --steps 3 --warmup 1 --nvt-only 2>&1 | tee "$OUT/capacity-nequip-1m.log" | tail -2 ;;
ranges) # the row chunks' backward by receiver ranges (TPTuning.backward_range_bytes, off by default: it did not pay
        # on an H100): its CUDA tests, then the 1.03M-atom stored call with the whole gradient and with 5 GB ranges
        # (bench_md --kernel-tuning), one run
    python3 -m pytest -m cuda -q -p no:cacheprovider tests/kernels/test_conv_table.py tests/patches/test_row_chunks.py \
        -k "ranges or rows" 2>&1 | tee "$OUT/ranges-tests.log" | tail -3
    echo '{"tp": {"backward_range_bytes": 5000000000}}' > "$OUT/ranges-5gb.json"
    for tuning in "" "$OUT/ranges-5gb.json"; do
        tag=${tuning:+5gb} tag=${tag:-whole}
        python3 benchmarks/bench_md.py --systems 1m --models mace-mp-medium --dtypes float32 --backends cgforge \
            --steps 3 --warmup 1 --nvt-only ${tuning:+--kernel-tuning "$tuning"} 2>&1 | tee "$OUT/ranges-md-$tag.log" | tail -1
    done ;;
harmonics)  # the harmonics kernel (KernelTuning.harmonics, off by default until this has run): its CUDA tests, the
        # kernel against e3nn's module (bench_harmonics), then the engine's 5k step and the 1M-atom call with and
        # without it (bench_md --kernel-tuning), one run
    python3 -m pytest -m cuda -q -p no:cacheprovider tests/kernels/test_harmonics.py tests/patches/test_harmonics_patch.py \
        2>&1 | tee "$OUT/harmonics-tests.log" | tail -3
    python3 benchmarks/bench_harmonics.py 2>&1 | tee "$OUT/harmonics-kernel.log" | tail -8
    echo '{"harmonics": true}' > "$OUT/harmonics-on.json"
    for tuning in "" "$OUT/harmonics-on.json"; do
        tag=${tuning:+on} tag=${tag:-off}
        python3 benchmarks/bench_md.py --systems 5k --models bundled-mace,mace-mp-medium --dtypes float32 \
            --backends cgforge-engine ${tuning:+--kernel-tuning "$tuning"} 2>&1 | tee "$OUT/harmonics-md-$tag.log" | tail -3
        python3 benchmarks/bench_md.py --systems 1m --models mace-mp-medium --dtypes float32 --backends cgforge \
            --steps 3 --warmup 1 --nvt-only ${tuning:+--kernel-tuning "$tuning"} 2>&1 | tee "$OUT/harmonics-1m-$tag.log" | tail -1
    done ;;
atomic) # the table backward over the receivers with grad x by atomics (TPTuning.receiver_backward_atomic, off: forces
        # not bitwise reproducible; results/atomic-ab-h100-20261127i): its CUDA tests, bench_layer on MACE-MP-medium's second-layer shape (default beside the
        # candidate in the segments order, where the row's grad-out block is staged once, and in the chunks order),
        # then the 5k engine step of MACE-MP-medium: default / candidate (segments) / default, one run
    python3 -m pytest -m cuda -q -p no:cacheprovider tests/kernels/test_conv_table.py -k "atomic or receiver or grad_x" \
        2>&1 | tee "$OUT/atomic-tests.log" | tail -3
    python3 benchmarks/bench_layer.py mace-medium --tuning "receiver_backward_atomic=true,backward_loop_order=segments" \
        --tuning "receiver_backward_atomic=true" 2>&1 | tee "$OUT/atomic-layer.log" | tail -12
    echo '{"tp": {"receiver_backward_atomic": true, "backward_loop_order": "segments"}}' > "$OUT/atomic-on.json"
    for tuning in "" "$OUT/atomic-on.json" ""; do
        tag=${tuning:+on} tag=${tag:-off}
        python3 benchmarks/bench_md.py --systems 5k --models mace-mp-medium --dtypes float32 --ensembles nvt \
            --backends cgforge-engine ${tuning:+--kernel-tuning "$tuning"} 2>&1 | tee -a "$OUT/atomic-md-$tag.log" | tail -1
    done ;;
layer)  # issue 18's per layer: radial weights + convolution, cgforge's table kernels vs MLP + cuEquivariance's fused
        # convolution (needs cuEquivariance installed), mace-medium and mace-large, 5184-atom water
    python3 benchmarks/bench_layer.py 2>&1 | tee "$OUT/layer.log" | tail -5 ;;
envab)  # A/B of one tuning variable on the 5k step, alternating ROUNDS times: AB_VAR (default
        # CGFORGE_BACKWARD_MIN_BLOCKS) over AB_VALUES (default "0 auto"); MACE-MP-medium and NequIP M; LAYER=1 adds
        # bench_layer's per-layer times
    var=${AB_VAR:-CGFORGE_BACKWARD_MIN_BLOCKS}
    for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
        for value in ${AB_VALUES:-0 auto}; do
            echo "== $var=$value, round $round"
            env "$var=$value" python3 benchmarks/bench_md.py --systems 5k --models mace-mp-medium,nequip-M \
                --dtypes float32 --backends cgforge --steps 20 --warmup 5 2>&1 | tee "$OUT/ab-$var-$value-$round.log" \
                | grep -E "^5k "
            if [ "${LAYER:-0}" = 1 ]; then
                env "$var=$value" python3 benchmarks/bench_layer.py 2>&1 | tee "$OUT/ab-layer-$var-$value-$round.log" \
                    | tail -3
            fi
        done
    done ;;
large)  # per-layer kernel choices in one process each (bench_layer --tuning; the backward = fwd+bwd - fwd): the
        # default (chunks of 32 in both directions, launch bound 5 on the backward) against the orders and bounds
        # it replaced, on mace-large and MACE-MP-medium's real second convolution, then NequIP M and the bundled MACE
    python3 benchmarks/bench_layer.py mace-large mace-mp-medium-l2 --tuning backward_min_blocks=0 \
        --tuning backward_loop_order=segments --tuning loop_order=edges,backward_loop_order=segments \
        --tuning forward_chunk=64 2>&1 | tee "$OUT/large.log" | tail -11
    python3 benchmarks/bench_layer.py nequip-presetM mace-water-l2 --tuning backward_loop_order=chunks \
        --tuning loop_order=edges,backward_loop_order=segments 2>&1 | tee "$OUT/nequip-medium.log" | tail -8 ;;
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
*) echo "usage: $0 tests|md|md64|ab|models|stability|engine|capacity|ranges|harmonics|atomic|layer|envab|large|lammps" >&2; exit 2 ;;
esac
