#!/usr/bin/env bash
# Install everything (first run) and run the demo: a high-LR nn.Linear goes NaN and NaNGuard rescues it
# (before the NaN with the defaults, and from the NaN itself with check.divergence off).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${VENV:-.venv}/bin/python" examples/demo.py "$@"
