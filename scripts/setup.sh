#!/usr/bin/env bash
# Set up a virtual environment with lightning-nanguard and its test, lint (ruff, mypy) and plots (matplotlib) extras.
# Source it: `. scripts/setup.sh`. Environment overrides:
#   VENV=path          where the venv lives (default: .venv)
#   PYTHON=python3.11  interpreter used to create it
#   TORCH_SPEC=...     torch requirement installed first when torch is absent (default: torch==2.13.0,
#                      a CPU build; e.g. TORCH_SPEC="torch" for the newest CUDA build)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing $TORCH_SPEC"
    "$PY" -m pip install -q "$TORCH_SPEC"
fi
"$PY" -m pip install -q -e ".[test,lint,plots]"
echo "[setup] ready: $("$PY" -c 'import torch, pytorch_lightning as pl; print(f"torch {torch.__version__}, pytorch-lightning {pl.__version__}")')"
