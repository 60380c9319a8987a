#!/usr/bin/env bash
# Sets up the environment if missing (.venv), then runs the main example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-env.sh
.venv/bin/python examples/tensor_product.py
