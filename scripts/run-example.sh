#!/usr/bin/env bash
# Sets up the environment if missing (.venv), then runs the main example: water-box MD with the bundled
# MACE model, GPU if present (5184 atoms) else CPU (96 atoms), 100 NVT steps at 300 K. Extra arguments go
# to examples/water_md.py (e.g. --model nequip --ensemble nve --steps 200).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-env.sh
out=$(mktemp -d "${TMPDIR:-/tmp}/cgforge-water-md.XXXXXX")
.venv/bin/python examples/water_md.py --trajectory "$out/water-md.traj" "$@"
