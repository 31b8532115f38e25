"""Real LightningCLI runs, many cases in one subprocess (starting torch and Lightning costs seconds per process).

:func:`run_cli_cases` writes a driver: the caller's ``setup`` (imports, model and data classes), then, for each
case, the caller's ``body`` with ``name``, ``args`` and ``out`` bound; a ``SystemExit`` or exception is captured
per case as ``out["exit"]`` and ``out["stderr"]``, as a user's terminal would show it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

_FRAME = r"""
import contextlib, io, json, sys, traceback
{setup}

def run_case(name, args, out):
{body}

results = {{}}
for name, args in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    out = {{"exit": 0, "config": None}}
    try:
        with contextlib.redirect_stderr(err):
            run_case(name, args, out)
    except SystemExit as exc:
        out["exit"] = exc.code if isinstance(exc.code, int) else 1
    except Exception:
        out["exit"] = 1
        err.write(traceback.format_exc())
    out["stderr"] = err.getvalue()
    results[name] = out
print("RESULTS=" + json.dumps(results))
"""


def run_cli_cases(tmp: Path, setup: str, body: str, cases: dict[str, Any]) -> dict[str, dict]:
    """Run every case of ``cases`` (name -> args, JSON) in one interpreter; returns name -> ``out``."""
    driver = tmp / "driver.py"
    driver.write_text(_FRAME.format(setup=textwrap.dedent(setup),
                                    body=textwrap.indent(textwrap.dedent(body).strip(), "    ")))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, str(driver), json.dumps(cases)], cwd=tmp, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "RESULTS=" in result.stdout, result.stderr[-3000:]
    return json.loads(result.stdout.split("RESULTS=", 1)[1].splitlines()[0])
