"""Both Lightning packages: ``lightning_nanguard.lightning.NaNGuard`` is the same callback as a
``lightning.pytorch.Callback`` (and ``lightning_nanguard.NaNGuard`` as a ``pytorch_lightning.Callback``); each
package's LightningCLI accepts its own, reports a bad value as a one-line usage
error naming the key, and takes the documented spelling of a null (real LightningCLI runs in a subprocess)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import lightning_nanguard
import lightning_nanguard.lightning as unified
from lightning_nanguard.config import ConfigError

from . import models
from .cli_runs import run_cli_cases

ROOT = Path(__file__).resolve().parents[1]
NAN_BATCHES = (2, 5)


def test_unified_class_is_the_same_callback_with_the_same_constructor():
    """Each class subclasses its own package's Callback only (issue 29: importing ``lightning_nanguard.lightning``
    never imports ``pytorch_lightning``, see tests/test_good_guest.py) and the one implementation."""
    from lightning_nanguard.callback import NaNGuardBase

    cls = unified.NaNGuard
    assert issubclass(cls, L.Callback) and not issubclass(cls, pl.Callback)
    classic = lightning_nanguard.NaNGuard
    assert issubclass(classic, pl.Callback) and not issubclass(classic, L.Callback)
    assert issubclass(cls, NaNGuardBase) and issubclass(classic, NaNGuardBase)  # the implementation, not a copy
    assert inspect.signature(cls) == inspect.signature(lightning_nanguard.NaNGuard)
    assert cls(name="a").state_key == lightning_nanguard.NaNGuard(name="a").state_key  # checkpoints interchange
    assert cls().state_key == lightning_nanguard.NaNGuard().state_key
    with pytest.raises(ConfigError, match="recovery.lr_factor"):
        cls(recovery={"lr_factor": 1.5})


def _module(pkg):
    class Model(pkg.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx in NAN_BATCHES:
                x = x.clone()
                x[0, 0] = float("nan")
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Model()


def test_unified_class_behaves_the_same_in_a_lightning_pytorch_trainer(tmp_path):
    """The same run with each package's Trainer and guard: the same events and bitwise the same weights."""
    results = []
    for pkg, guard_cls in ((pl, lightning_nanguard.NaNGuard), (L, unified.NaNGuard)):
        pkg.seed_everything(3, verbose=False)
        model, guard = _module(pkg), guard_cls()
        trainer = pkg.Trainer(callbacks=[guard], max_epochs=1, accelerator="cpu", devices=1, logger=False,
                              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                              default_root_dir=str(tmp_path / pkg.__name__), deterministic=True)
        trainer.fit(model, models.loader(models.regression_data(n=256)))
        results.append(({k: v.clone() for k, v in model.state_dict().items()},
                        [e.to_dict() for e in guard.events]))
    (weights_pl, events_pl), (weights_l, events_l) = results
    assert [(e["step"], e["kind"], e["actions"][0]) for e in events_l] == [
        (b, "loss", "skip_step") for b in NAN_BATCHES]
    assert events_pl == events_l
    assert all(torch.equal(weights_pl[k], weights_l[k]) for k in weights_pl)


# ------------------------------------------------------------------------------------- LightningCLI

_SETUP = r"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as L
import pytorch_lightning as pl
from lightning.pytorch.cli import LightningCLI as UnifiedCLI
from pytorch_lightning.cli import LightningCLI as ClassicCLI

NAN_BATCHES = NAN_BATCHES_HERE

def classes(pkg):
    class Data(pkg.LightningDataModule):
        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(128, 4, generator=g), torch.randn(128, 1, generator=g)
            for b in NAN_BATCHES:
                x[b * 16, 0] = float("nan")
            return DataLoader(TensorDataset(x, y), batch_size=16)

    class Model(pkg.LightningModule):
        def __init__(self, lr: float = 0.05):
            super().__init__()
            self.lr = lr
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    return Model, Data

CLIS = {"classic": (ClassicCLI, *classes(pl)), "unified": (UnifiedCLI, *classes(L))}
"""

_CASE = """
cli_cls, model, data = CLIS[args[0]]
argv = args[1]
cli = cli_cls(model, data, args=argv, run=bool(argv) and argv[0] == "fit")
guard = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "NaNGuard")
out["config"] = guard.config.to_dict()
out["type"] = type(guard).__module__ + "." + type(guard).__qualname__
out["events"] = [(e.step, e.kind) for e in guard.events]
"""

UNIFIED = "lightning_nanguard.lightning.NaNGuard"
CLASSIC = "lightning_nanguard.NaNGuard"


def _config(tmp: Path, class_path: str) -> Path:
    path = tmp / f"{class_path.replace('.', '_')}.yaml"
    path.write_text(f"""trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {tmp}
  callbacks:
    - class_path: {class_path}
      init_args:
        clip: {{max_norm: 5.0, adaptive: always}}
        recovery: {{lr_factor: 0.25}}
""")
    return path


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packages")
    arg = "--trainer.callbacks.init_args."
    cases = {}
    for package, class_path in (("unified", UNIFIED), ("classic", CLASSIC)):
        key = f"{package}:{class_path}"
        cfg = ["--config", str(_config(tmp, class_path))]
        cases[f"{key}:append"] = (package, [f"--trainer.callbacks+={class_path}", f"{arg}recovery.lr_factor=0.25",
                                            f"--trainer.default_root_dir={tmp}", "--trainer.logger=false"])
        cases[f"{key}:range"] = (package, cfg + [f"{arg}recovery.lr_factor=1.5"])
        cases[f"{key}:dotted_null"] = (package, cfg + [f"{arg}clip.max_norm=null"])
        cases[f"{key}:section_null"] = (package, cfg + [f"{arg}clip={{max_norm: null}}"])
    cases["unified:fit"] = ("unified", ["fit", "--config", str(_config(tmp, UNIFIED)),
                                        f"--trainer.default_root_dir={tmp / 'fit'}"])
    cases["unified:fit_range"] = ("unified", ["fit", "--config", str(_config(tmp, UNIFIED)),
                                              f"{arg}recovery.max_rollbacks=-1"])
    return tmp, run_cli_cases(tmp, _SETUP.replace("NAN_BATCHES_HERE", repr(NAN_BATCHES)), _CASE, cases)


CLI_KEYS = [f"unified:{UNIFIED}", f"classic:{CLASSIC}"]


@pytest.mark.slow  # a LightningCLI subprocess
@pytest.mark.parametrize("key", CLI_KEYS)
def test_lightning_cli_of_each_package_accepts_the_class_path(cli_runs, key):
    run = cli_runs[1][f"{key}:append"]
    assert run["exit"] == 0, run["stderr"][-3000:]
    expected = unified.NaNGuard if key.endswith(UNIFIED) else lightning_nanguard.NaNGuard
    assert run["type"] == f"{expected.__module__}.{expected.__qualname__}"
    assert run["config"]["recovery"]["lr_factor"] == 0.25  # a dotted override after --trainer.callbacks+=


@pytest.mark.slow  # a LightningCLI subprocess
def test_unified_lightning_cli_fit_rescues_the_poisoned_batches(cli_runs):
    tmp, runs = cli_runs
    run = runs["unified:fit"]
    assert run["exit"] == 0, run["stderr"][-3000:]
    assert [tuple(e) for e in run["events"]] == [(b, "input") for b in NAN_BATCHES]
    lines = (tmp / "fit" / "nanguard" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(NAN_BATCHES)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow  # a LightningCLI subprocess
@pytest.mark.parametrize("case, key, allowed", [
    (f"{k}:range", "recovery.lr_factor: got 1.5", "(0.0, 1.0)") for k in CLI_KEYS] + [
    ("unified:fit_range", "recovery.max_rollbacks: got -1", "[0")])
def test_out_of_range_value_is_a_one_line_usage_error_naming_the_key(cli_runs, case, key, allowed):
    run = cli_runs[1][case]
    assert run["exit"] == 2 and run["config"] is None
    assert "Traceback" not in run["stderr"], run["stderr"][-3000:]
    (line,) = _error_lines(run["stderr"])
    assert key in line and allowed in line
    assert "usage:" in run["stderr"]


@pytest.mark.slow  # a LightningCLI subprocess
@pytest.mark.parametrize("key", CLI_KEYS)
def test_null_on_the_command_line_through_its_section_keeps_the_other_keys(cli_runs, key):
    """The documented spelling ``--...init_args.clip='{max_norm: null}'`` sets null and keeps clip.adaptive."""
    run = cli_runs[1][f"{key}:section_null"]
    assert run["exit"] == 0, run["stderr"][-3000:]
    assert run["config"]["clip"]["max_norm"] is None
    assert run["config"]["clip"]["adaptive"] == "always"  # from the YAML, not the default
    assert run["config"]["recovery"]["lr_factor"] == 0.25


@pytest.mark.slow  # a LightningCLI subprocess
@pytest.mark.parametrize("key", CLI_KEYS)
def test_dotted_null_is_a_usage_error_that_gives_the_working_spelling(cli_runs, key):
    """jsonargparse hands ``clip.max_norm=null`` over as the string 'None' and drops the section's other keys:
    refused (never a silently different config), with the spelling that works."""
    run = cli_runs[1][f"{key}:dotted_null"]
    assert run["exit"] == 2 and run["config"] is None
    assert "Traceback" not in run["stderr"]
    (line,) = _error_lines(run["stderr"])
    assert "clip.max_norm" in line and "--trainer.callbacks.init_args.clip='{max_norm: null}'" in line


def test_usage_errors_leave_config_errors_alone_outside_a_command_line():
    with pytest.raises(ConfigError, match="clip.max_norm: got 'None'.*max_norm: null"):
        lightning_nanguard.NaNGuard(clip={"max_norm": "None"})
    with pytest.raises(ConfigError, match="recovery.lr_factor"):
        unified.NaNGuard(recovery={"lr_factor": 1.5})
