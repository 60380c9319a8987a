# x2, carry .device/base .device/lmpkk .device/ompi .device/s20-suite.sh. The whole CUDA suite at this tree (issue 40's
# last check): tests/lammps + tests/cli with both GPUs visible (the 2-GPU run), the rest in 8 shards, 4 a GPU.
set -o pipefail
T0=$(date +%s); left() { echo $(( ${LIMIT:-580} - ($(date +%s) - T0) )); }
L=$OUT/log.txt
source .device/base/env.sh > $L 2>&1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_hwloc_base_binding_policy=none \
  OMPI_MCA_btl_vader_single_copy_mechanism=none NCCL_NVLS_ENABLE=0
export CGFORGE_LAMMPS_KOKKOS_DIR=/tmp/lmp-kk PYTHONUNBUFFERED=1 CGFORGE_LAMMPS_GPU_AWARE=on
cat .device/lmpkk/lmpkk.part* | xz -d | tar -xf - -C /tmp
xz -d < .device/ompi/ompi-cuda.tar.xz | tar -xf - -C /tmp
export PATH=/tmp/ompi-cuda/bin:$PATH LD_LIBRARY_PATH=/tmp/ompi-cuda/lib:$LD_LIBRARY_PATH
EP_DIR=$(mktemp -d); python3 - "$EP_DIR" <<'PY'
import sys, tomllib
from pathlib import Path
project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
info = Path(sys.argv[1]) / f"cgforge-{project['version']}.dist-info"; info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: cgforge\nVersion: {project['version']}\n")
eps = project.get("entry-points", {})
(info / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items()) + "\n" for g, e in eps.items()))
PY
export PYTHONPATH="$PYTHONPATH:$EP_DIR"
J=$OUT/logs; mkdir -p $J
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $L
git log -1 --format=%h 2>/dev/null | tee -a $L
ids=$(mktemp -d)
python3 -m pytest -m cuda -q --collect-only -p no:cacheprovider tests --ignore=tests/lammps --ignore=tests/cli 2>$J/collect.err \
  | grep '::' | awk -v dir="$ids" '{ print > (dir "/" (NR - 1) % 8) }'
echo "$(cat $ids/* | wc -l) CUDA tests (not lammps/cli) in 8 shards; $(left) s left" | tee -a $L
lim=$(( $(left) - 40 ))
export OMP_NUM_THREADS=3 TORCHINDUCTOR_COMPILE_THREADS=3
timeout -s INT -k 20 $lim python3 -m pytest -m cuda -q -rfE -p no:cacheprovider --durations=8 tests/lammps tests/cli > $J/lammps-cli.log 2>&1 &
for k in 0 1 2 3 4 5 6 7; do mapfile -t shard < "$ids/$k"
  CUDA_VISIBLE_DEVICES=$(( k % 2 )) timeout -s INT -k 20 $lim python3 -m pytest -m cuda -q -rfE -p no:cacheprovider --durations=5 "${shard[@]}" > $J/shard$k.log 2>&1 &
done; wait
for f in $J/lammps-cli.log $J/shard*.log; do echo "== $(basename $f): $(grep -E '(passed|failed|error)' $f | tail -1)"; grep -E '^(FAILED|ERROR) ' $f | cut -c1-300; grep -q KeyboardInterrupt $f && echo "   cut by the time limit"; done | tee -a $L
echo "done, $(left) s left"
