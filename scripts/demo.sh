#!/usr/bin/env bash
# Install everything (first run) and run the demo: a high-LR nn.Linear goes NaN and NaNGuard rescues it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${VENV:-.venv}/bin/python" examples/demo.py "$@"
