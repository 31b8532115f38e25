"""Types for users (issue 36): the wheel ships ``py.typed``, a user's script type-checks against the public API
with mypy (and a wrong use of it is caught), and every ``on_*`` method of the callback is a hook of both Lightning
packages with a matching signature (a misspelt or mis-signed hook would silently never run)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl

from lightning_nanguard.callback import NaNGuardBase
from lightning_nanguard.testing import FaultInjectorBase

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = '''
from pathlib import Path

from lightning_nanguard import ConfigError, NaNEvent, NaNGuard, NaNGuardConfig, NaNGuardError
from lightning_nanguard.config import CheckConfig, ClipConfig, RecoveryConfig, iter_keys, load_yaml
from lightning_nanguard.testing import Fault, FaultInjector, Injection

guard = NaNGuard(recovery=RecoveryConfig(lr_factor=0.5), check=CheckConfig(), clip={"max_norm": 1.0})
other = NaNGuard(config=NaNGuardConfig.from_mapping({"check": {"spike_z": 8.0}}), name="second")
from_file: NaNGuard = NaNGuard.from_yaml("nanguard.yaml")
config: NaNGuardConfig = guard.config
factor: float = config.recovery.lr_factor
max_norm: float | None = config.clip.max_norm
clip: ClipConfig = other.config.clip
as_dict: dict[str, object] = dict(config.to_dict())
keys: list[str] = [key for key, _, _ in iter_keys()]
loaded: object = load_yaml(Path("nanguard.yaml"))
events: list[NaNEvent] = guard.events
steps: list[int] = [e.step for e in events]
culprits: list[str | None] = [e.culprit for e in events]
causes: list[str | None] = [e.cause for e in events]
actions: list[list[str]] = [e.actions for e in events]
lines: list[str] = [e.summary() for e in events]
records: list[dict[str, object]] = [dict(e.to_dict()) for e in events]
reports: list[Path] = [guard.report_path(e) for e in events]
counts: dict[str, int] = guard.counters
scale: float = guard.lr_scale
state: dict[str, object] = guard.state_dict()
errors: tuple[type[Exception], ...] = (ConfigError, NaNGuardError)

injector = FaultInjector(Fault("loss", steps=[3]))
drawn: FaultInjector = FaultInjector.at_rate(0.01, kinds=("gradient", "parameter"), seed=1, target="net.0.weight")
planned: list[tuple[str, str]] = drawn.fires_at(5)
fault: Fault = injector.faults[0]
target: str | None = fault.target
log: list[Injection] = injector.log
where: list[str | None] = [i.where for i in log]
applied: list[bool] = [i.applied for i in log]
'''


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """The wheel built from the checkout, and a folder it is installed into (as a user's site-packages would hold
    it: mypy then reads the package only if the wheel says it is typed)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out / "dist")], check=True, capture_output=True, timeout=300)
    (wheel,) = (out / "dist").glob("lightning_nanguard-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(out / "site"),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    return wheel, out / "site"


@pytest.mark.slow  # builds and installs the wheel (~3 s)
def test_the_wheel_ships_py_typed(installed):
    wheel, _ = installed
    assert "lightning_nanguard/py.typed" in zipfile.ZipFile(wheel).namelist()


def _mypy(tmp_path: Path, site: Path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(source)
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental",
                           "--cache-dir", str(tmp_path / ".mypy"), str(script)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=600)


# strict on the user's script and on what it reads of lightning_nanguard; the big typed dependencies are skipped
# (their types read as Any), which keeps one run to seconds instead of minutes
MYPY_INI = """[mypy]
strict = True
[mypy-torch.*,pytorch_lightning.*,lightning.*,lightning_fabric.*,lightning_utilities.*,torchmetrics.*,numpy.*,tensorboard.*,yaml.*]
follow_imports = skip
ignore_missing_imports = True
"""


@pytest.mark.slow  # mypy reads the installed package (~10-30 s)
def test_a_users_script_type_checks_against_the_installed_wheel_and_a_wrong_use_is_caught(installed, tmp_path):
    _, site = installed
    ok = _mypy(tmp_path, site, USER_SCRIPT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = _mypy(tmp_path, site, USER_SCRIPT + "wrong: str = guard.events[0].step\n")
    assert bad.returncode == 1 and 'Incompatible types in assignment (expression has type "int", variable has type ' \
                                   '"str")' in bad.stdout, bad.stdout


@pytest.mark.parametrize("cls", [NaNGuardBase, FaultInjectorBase], ids=["NaNGuard", "FaultInjector"])
@pytest.mark.parametrize("package", [pl, L], ids=["pytorch_lightning", "lightning.pytorch"])
def test_every_on_method_is_a_lightning_hook_with_its_signature(cls, package):
    ours = {n: f for n, f in vars(cls).items() if n.startswith("on_") and callable(f)}
    assert ours, cls
    for name, fn in ours.items():
        hook = getattr(package.Callback, name, None)
        assert hook is not None, f"{cls.__name__}.{name} is no hook of {package.__name__}.Callback: it never runs"
        theirs = list(inspect.signature(hook).parameters)
        mine = list(inspect.signature(fn).parameters)
        assert mine == theirs, (name, mine, theirs)
    for name in ("setup", "teardown", "state_dict", "load_state_dict"):
        if name in vars(cls):
            assert list(inspect.signature(vars(cls)[name]).parameters) == \
                list(inspect.signature(getattr(package.Callback, name)).parameters), name
