#!/usr/bin/env bash
# Creates (once) and activates-by-path the project's virtual environment in .venv.
# mace-torch pins e3nn==0.4.4 while nequip needs e3nn>=0.6: cgforge works with both, so mace-torch
# is installed with --no-deps after its real dependencies (requirements-dev.txt).
# Usage: bash scripts/dev-env.sh   (idempotent; reinstalls when requirements-dev.txt changes)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=.venv
stamp=$venv/.cgforge-env-$(sha1sum requirements-dev.txt pyproject.toml scripts/dev-env.sh | sha1sum | cut -c1-12)
if [ -f "$stamp" ]; then exit 0; fi
[ -x $venv/bin/python ] || python3 -m venv $venv
py=$venv/bin/python
$py -m pip install -q --upgrade pip
# CPU build of torch (a local wheel on this project's machines); a GPU machine brings its own torch.
$py -m pip install -q "torch==2.13.0" || $py -m pip install -q "torch>=2.4"
$py -m pip install -q -r requirements-dev.txt
$py -m pip install -q --no-deps mace-torch==0.3.16
$py -m pip install -q --no-deps -e .
rm -f $venv/.cgforge-env-*
touch "$stamp"
echo "dev environment ready: $root/$venv"
