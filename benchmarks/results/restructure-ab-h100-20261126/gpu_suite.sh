# usage: bash gpu_suite.sh "PATHS" SHARDS LIMIT  (run on the device machine from the repo root)
paths=$1; shards=${2:-4}; limit=${3:-520}
source .device/base/env.sh > $OUT/env.log 2>&1
# nequip finds cgforge's `nequip.extension` entry point only through a dist-info (the project is not installed)
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
ids=$(mktemp -d); logs=$OUT
python3 -m pytest -m cuda -q --collect-only -p no:cacheprovider $paths 2>$OUT/collect.err | grep '::' \
  | awk -v n="$shards" -v dir="$ids" '{ print > (dir "/" (NR - 1) % n) }'
echo "$(cat $ids/* | wc -l) CUDA tests in $shards shards"; tail -3 $OUT/collect.err
threads=$(( $(nproc) / shards )); export OMP_NUM_THREADS=$threads TORCHINDUCTOR_COMPILE_THREADS=$threads
for ((k = 0; k < shards; k++)); do mapfile -t shard < "$ids/$k"
  timeout -s INT -k 20 "$limit" python3 -m pytest -m cuda -q -rfE -p no:cacheprovider "${shard[@]}" > "$logs/shard$k.log" 2>&1 &
done; wait
for ((k = 0; k < shards; k++)); do echo "== shard $k: $(grep -E '(passed|failed|error)' $logs/shard$k.log | tail -1)"; grep -E '^(FAILED|ERROR) ' $logs/shard$k.log | cut -c1-300; done
