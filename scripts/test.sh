#!/usr/bin/env bash
# Sets up the dev environment if missing (.venv), then runs ruff and the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-env.sh
.venv/bin/ruff check cgforge tests examples benchmarks scripts
.venv/bin/python -m pytest -q "$@"
