"""scripts/test_map.py: the test-to-module map, and the modules with logic that no test imports, which may only
shrink (a new module comes with a test file that imports it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("test_map_script", ROOT / "scripts" / "test_map.py")
assert _spec is not None and _spec.loader is not None
test_map_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(test_map_script)

# reached only through other modules today; take a name off when its module gets a test of its own
WITHOUT_A_TEST = {
    "lightning_nanguard.classic",
    "lightning_nanguard.core.console",
    "lightning_nanguard.core.diagnosis",
    "lightning_nanguard.core.domain_fixes",
    "lightning_nanguard.detect.evidence",
    "lightning_nanguard.diagnose.comms",
    "lightning_nanguard.diagnose.context",
    "lightning_nanguard.diagnose.culprit",
    "lightning_nanguard.diagnose.final_weights",
    "lightning_nanguard.diagnose.float64",
    "lightning_nanguard.diagnose.lockstep",
    "lightning_nanguard.diagnose.lr_probe",
    "lightning_nanguard.diagnose.passes",
    "lightning_nanguard.diagnose.probes",
    "lightning_nanguard.diagnose.replay",
    "lightning_nanguard.diagnose.rerun",
    "lightning_nanguard.faults",
    "lightning_nanguard.respond.account",
    "lightning_nanguard.respond.fit_end",
    "lightning_nanguard.respond.parts",
    "lightning_nanguard.respond.step",
    "lightning_nanguard.usage_errors",
}


def test_no_new_module_goes_without_a_test():
    missing = set(test_map_script.missing())
    assert missing <= WITHOUT_A_TEST, sorted(missing - WITHOUT_A_TEST)
    assert not WITHOUT_A_TEST - missing, f"now tested, take off WITHOUT_A_TEST: {sorted(WITHOUT_A_TEST - missing)}"


def test_the_map_reads_every_import_form(tmp_path):
    pkg = tmp_path / "lightning_nanguard"
    (pkg / "detect").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "detect" / "__init__.py").write_text("")
    for name in ("a", "b", "c", "d"):
        (pkg / "detect" / f"{name}.py").write_text("def f():\n    return 1\n")
    (pkg / "detect" / "consts.py").write_text("X = 1\n")  # no logic: not in the map
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import lightning_nanguard.detect.a\nfrom lightning_nanguard.detect.b import f\n"
        "from lightning_nanguard.detect import c\nfrom . import d\n")
    mapping = test_map_script.test_map(tmp_path)
    assert "lightning_nanguard.detect.consts" not in mapping
    assert {m for m, tests in mapping.items() if tests} == {f"lightning_nanguard.detect.{n}" for n in "abc"}
    assert test_map_script.missing(tmp_path) == ["lightning_nanguard.detect.d"]  # a relative import is not a test's
