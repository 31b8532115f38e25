#!/usr/bin/env bash
# Install everything (first run) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${VENV:-.venv}/bin/python" -m pytest -q "$@"
