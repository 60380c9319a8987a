#!/usr/bin/env bash
# Sets up the environment if missing (.venv), then runs the main example: water-box MD with the bundled
# MACE model, GPU if present (5184 atoms) else CPU (96 atoms), 100 NVT steps at 300 K. Extra arguments go
# to examples/water_md.py (e.g. --model nequip --ensemble nve --steps 200, or --ensemble npt --pressure 1000).
# The trajectory and the log go to a new temporary folder; the exit code is the example's (0 done, 1 error,
# 2 usage, 3 the run blew up, 130 Ctrl-C: the trajectory then ends at the last completed step).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-env.sh
out=$(mktemp -d "${TMPDIR:-/tmp}/cgforge-water-md.XXXXXX")
echo "trajectory and log: $out"
exec .venv/bin/python examples/water_md.py --trajectory "$out/water-md.traj" --log "$out/water-md.log" "$@"
