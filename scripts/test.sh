#!/usr/bin/env bash
# Sets up the dev environment if missing (.venv), builds LAMMPS for the real-LAMMPS test when a source is
# found (scripts/lammps.sh: cached outside the clone, .lammps links there), then runs ruff and the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-env.sh
bash scripts/lammps.sh .venv/bin/python
.venv/bin/ruff check cgforge tests examples benchmarks scripts
.venv/bin/python -m pytest -q --durations=30 "$@"
