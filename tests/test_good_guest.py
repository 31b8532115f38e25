"""A good guest in the user's Trainer (issue 29), in both Lightning packages: Lightning-style checks with the guard
injected.

- importing an entry point (in a fresh interpreter) imports no other Lightning package and changes no global of
  Lightning, lightning_utilities, logging, warnings or torch (``tests/guest_globals.py``); neither does a fit;
- on a healthy fit the user's ``progress_bar_metrics``, ``callback_metrics`` and ``logged_metrics``, the warnings,
  Lightning's own logger calls, the ModelCheckpoint files and EarlyStopping's decision are those of the same fit
  without the guard, and nothing is printed;
- the guard's ``nanguard/*`` scalars for a batch are logged at the step Lightning logs that batch's metrics at
  (``fit_loop.epoch_loop._batches_that_stepped``), under accumulation, manual optimization with two optimizers,
  and ``check.sync: lagged``; the steps a logger receives never decrease;
- ``nanguard/`` is never written inside a ModelCheckpoint folder.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch

import lightning_nanguard
import lightning_nanguard.lightning as unified

from .guest_globals import changed, snapshot
from .guest_models import data as _data, module as _module

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"classic": (pl, lightning_nanguard.NaNGuard), "unified": (L, unified.NaNGuard)}

pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")


def _recording_logger(pkg: Any) -> Any:
    """A real ``Logger`` subclass of ``pkg`` that keeps every ``log_metrics`` call: ``calls`` = [(step, keys)],
    ``values`` = [(step, metrics)]."""

    class Recording(pkg.loggers.Logger):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[int, tuple[str, ...]]] = []
            self.values: list[tuple[int, dict[str, float]]] = []

        @property
        def name(self):
            return "recording"

        @property
        def version(self):
            return 0

        def log_metrics(self, metrics, step=None):
            self.calls.append((step, tuple(sorted(metrics))))
            self.values.append((step, {k: float(v) for k, v in metrics.items()}))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    return Recording()


def _values(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


class _MetricsProbe:
    """Listed after the guard: what the user sees at every batch end, and the globals at the first batch (after
    every fit-start hook)."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict, dict, dict]] = []
        self.at_start: Optional[dict] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at_start is None:
            self.at_start = snapshot()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((_values(trainer.progress_bar_metrics), _values(trainer.callback_metrics),
                          _values(trainer.logged_metrics)))


def _probe(pkg: Any) -> Any:
    return type("Probe", (_MetricsProbe, pkg.Callback), {})()


# -------------------------------------------------------------------------------------------------- imports

_IMPORTS = r"""
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
import torch  # the user has it; its own import adds warning filters
from tests.guest_globals import changed, snapshot
case = json.loads(sys.argv[2])
for name in case["before"]:
    importlib.import_module(name)
out = {}
for entry, attrs in case["entries"]:  # one after the other, as a user's script would
    first = snapshot()
    module = importlib.import_module(entry)
    for attr in attrs:
        getattr(module, attr)
    out[entry] = {"changed": changed(first, snapshot()), "imported": [m for m in case["absent"] if m in sys.modules]}
print("IMPORTS", json.dumps(out))
if case.get("fit"):
    exec(open(case["fit"]).read())
"""

# what a unified-package user does after the imports: silence Lightning, filter its deprecations, fit with the guard
_UNIFIED_FIT = r"""
import logging, warnings
import lightning.pytorch as L
from lightning.fabric.utilities.rank_zero import LightningDeprecationWarning
import lightning_utilities.core.rank_zero as rank_zero
from lightning_nanguard.lightning import NaNGuard
from tests.guest_models import data, module

heard = []
class Keep(logging.Handler):
    def emit(self, record):
        heard.append((record.name, record.levelno, record.getMessage()))

lightning_logger = logging.getLogger("lightning.pytorch")
lightning_logger.addHandler(Keep())
warnings.filterwarnings("error", category=LightningDeprecationWarning)
for level in ("ERROR", "INFO"):
    lightning_logger.setLevel(level)
    heard.clear()
    guard = NaNGuard()
    trainer = L.Trainer(callbacks=[guard], max_epochs=1, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=sys.argv[3])
    trainer.fit(module(L), data(bad=(2,)))
    out = {"events": [e.step for e in guard.events], "rank_zero_log": rank_zero.log.name,
           "category_is_lightnings": rank_zero.rank_zero_deprecation_category is LightningDeprecationWarning,
           "heard": [h for h in heard if "nanguard" in h[2] or "GPU available" in h[2]]}
    try:
        rank_zero.rank_zero_deprecation("a deprecation of lightning.pytorch")
        out["filter_matched"] = False
    except LightningDeprecationWarning:
        out["filter_matched"] = True
    print("FIT", level, json.dumps(out))
"""

_ENTRIES = {
    # a unified-package user: the package root, the unified entry point, the fault injector's module
    "unified": {"before": ["lightning.pytorch"], "absent": ["pytorch_lightning", "lightning_fabric"],
                "entries": [["lightning_nanguard", ["NaNGuardConfig", "NaNEvent", "ConfigError"]],
                            ["lightning_nanguard.lightning", ["NaNGuard", "FaultInjector"]],
                            ["lightning_nanguard.testing", ["Fault", "FaultInjectorBase"]]]},
    "classic": {"before": ["pytorch_lightning"], "absent": ["lightning"],
                "entries": [["lightning_nanguard", ["NaNGuard"]], ["lightning_nanguard.testing", ["FaultInjector"]]]},
    "cli": {"before": [], "absent": ["lightning", "pytorch_lightning"],
            "entries": [["lightning_nanguard.report.cli", ["main"]]]},
}


@pytest.fixture(scope="module")
def fresh_interpreters(tmp_path_factory):
    """Each case of _ENTRIES in a fresh interpreter (all at once); the unified one then fits twice
    (_UNIFIED_FIT). Returns {case: {"imports": {entry: result}, "fits": {level: result}}}."""
    tmp = tmp_path_factory.mktemp("guest")
    (tmp / "fit.py").write_text(_UNIFIED_FIT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = {}
    for name, case in _ENTRIES.items():
        case = dict(case, fit=str(tmp / "fit.py") if name == "unified" else None)
        procs[name] = subprocess.Popen([sys.executable, "-c", _IMPORTS, str(ROOT), json.dumps(case), str(tmp)],
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-3000:]
        lines = stdout.splitlines()
        imports = json.loads(next(line for line in lines if line.startswith("IMPORTS "))[8:])
        fits = {line.split()[1]: json.loads(line.split(" ", 2)[2]) for line in lines if line.startswith("FIT ")}
        out[name] = {"imports": imports, "fits": fits}
    return out


@pytest.mark.slow  # three fresh interpreters importing torch and Lightning
@pytest.mark.parametrize("case", list(_ENTRIES))
def test_importing_an_entry_point_changes_no_global_and_imports_no_other_lightning(fresh_interpreters, case):
    imports = fresh_interpreters[case]["imports"]
    assert list(imports) == [entry for entry, _ in _ENTRIES[case]["entries"]]
    for entry, result in imports.items():
        assert result == {"changed": [], "imported": []}, entry


def test_the_probe_sees_what_importing_pytorch_lightning_does_to_the_unified_package():
    """The check the import test relies on: in this process both packages are imported, and the last one
    imported owns lightning_utilities' rank-zero logger and deprecation category (what the guard must not do to
    a unified-package user); rebinding it is seen."""
    import lightning_utilities.core.rank_zero as rank_zero

    assert rank_zero.log.name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero")
    before = snapshot()
    rank_zero.log = logging.getLogger("somebody.else")
    try:
        assert "lightning_utilities.core.rank_zero.log" in changed(before, snapshot())
    finally:
        rank_zero.log = logging.getLogger(before["rank_zero"][0])


@pytest.mark.slow  # the unified interpreter's fits
@pytest.mark.parametrize("level", ["ERROR", "INFO"])
def test_unified_user_logging_settings_and_warning_filters_hold_with_the_guard(fresh_interpreters, level):
    """Only ``lightning.pytorch`` imported: the user's level on ``logging.getLogger("lightning.pytorch")`` governs
    Lightning's messages and the guard's incident line alike, and a filter on Lightning's deprecation category
    matches ``lightning.pytorch``'s deprecations, with the guard imported and in the Trainer."""
    fit = fresh_interpreters["unified"]["fits"][level]
    assert fit["events"] == [2]
    assert fit["rank_zero_log"] == "lightning.pytorch.utilities.rank_zero"
    assert fit["category_is_lightnings"] and fit["filter_matched"]
    if level == "ERROR":
        assert fit["heard"] == []
    else:
        assert {name for name, _, _ in fit["heard"]} == {"lightning.pytorch.utilities.rank_zero"}
        assert any(msg.startswith("[nanguard] step 2 ") for _, _, msg in fit["heard"])
        assert any("GPU available" in msg for _, _, msg in fit["heard"])


# ------------------------------------------------------------------------------------------ a healthy fit


def _healthy_fit(pkg: Any, guard_cls: Any, root: Path, guarded: bool) -> dict[str, Any]:
    pkg.seed_everything(0, verbose=False)
    probe, logger = _probe(pkg), _recording_logger(pkg)
    ckpt = pkg.callbacks.ModelCheckpoint(dirpath=str(root / "ckpt"), monitor="val_loss", save_top_k=2,
                                         filename="{epoch}-{step}-{val_loss:.6f}")
    stop = pkg.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)  # stops after 2 epochs
    callbacks = ([guard_cls()] if guarded else []) + [probe, ckpt, stop]
    trainer = pkg.Trainer(callbacks=callbacks, max_epochs=4, accelerator="cpu", devices=1, logger=logger,
                          log_every_n_steps=2, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=str(root), deterministic=True)
    model = _module(pkg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _data(), _data(n=32, seed=1))
    return {
        "seen": probe.seen, "at_start": probe.at_start, "after": snapshot(),
        "final": (_values(trainer.progress_bar_metrics), _values(trainer.callback_metrics),
                  _values(trainer.logged_metrics)),
        "warnings": Counter((w.category.__name__, str(w.message).replace(str(root), "<root>")) for w in caught),
        "calls": logger.calls,
        "files": sorted(str(p.relative_to(root)) for p in root.rglob("*")),
        "stopping": (stop.stopped_epoch, stop.wait_count, float(stop.best_score), trainer.current_epoch),
        "best": (Path(ckpt.best_model_path).name, float(ckpt.best_model_score)),
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
    }


@pytest.mark.slow  # two fits with validation, per package
@pytest.mark.parametrize("package", list(PACKAGES))
def test_a_healthy_fit_looks_the_same_to_the_user_with_the_guard(tmp_path, capsys, caplog, package):
    caplog.set_level("DEBUG")
    pkg, guard_cls = PACKAGES[package]
    plain = _healthy_fit(pkg, guard_cls, tmp_path / "run", guarded=False)
    capsys.readouterr()
    lightning_lines = [r.getMessage().replace(str(tmp_path / "run"), "<root>") for r in caplog.records]
    caplog.clear()
    guarded = _healthy_fit(pkg, guard_cls, tmp_path / "run2", guarded=True)
    printed = capsys.readouterr()
    assert "[nanguard]" not in printed.out + printed.err  # nothing printed on a healthy fit, nor logged
    lines = [r.getMessage().replace(str(tmp_path / "run2"), "<root>") for r in caplog.records]
    assert lines == lightning_lines and lightning_lines
    # what the user reads, at every batch end and after fit: the same keys, the same values
    assert len(guarded["seen"]) == len(plain["seen"]) > 0
    assert guarded["seen"] == plain["seen"]
    assert guarded["final"] == plain["final"]
    assert not [k for k in guarded["final"][1] if k.startswith("ng_")]
    # warnings, checkpoints and early stopping as without the guard; no file of the guard on a healthy fit
    assert guarded["warnings"] == plain["warnings"]
    assert guarded["files"] == plain["files"] and not [f for f in guarded["files"] if "nanguard" in f]
    assert guarded["stopping"] == plain["stopping"] and guarded["stopping"][0] > 0  # EarlyStopping did stop
    assert guarded["best"] == plain["best"]
    assert all(torch.equal(guarded["weights"][k], plain["weights"][k]) for k in plain["weights"])
    # Lightning's own logger calls unchanged; the guard's own ones at Lightning's steps, steps never decrease
    ours = [(s, keys) for s, keys in guarded["calls"] if any(k.startswith("nanguard/") for k in keys)]
    assert [c for c in guarded["calls"] if c not in ours] == plain["calls"]
    assert ours and {s for s, _ in ours} == {s for s, keys in plain["calls"] if "train_loss" in keys}
    steps = [s for s, _ in guarded["calls"]]
    assert steps == sorted(steps)
    # no global changed at fit start or by the fit, beyond what the same fit without the guard changes
    assert changed(plain["at_start"], guarded["at_start"]) == []
    assert changed(plain["after"], guarded["after"]) == []


# --------------------------------------------------------------------------------------------- logger steps


def _nanguard_steps(calls: list, key: str) -> list[int]:
    return [s for s, keys in calls if key in keys]


def _incident_steps(values: list) -> list[int]:
    """The logger step of each incident: where ``nanguard/incidents`` first reads 1, 2, ..."""
    steps, seen = [], 0
    for step, metrics in values:
        count = int(metrics.get("nanguard/incidents", seen))
        steps += [step] * (count - seen)
        seen = max(seen, count)
    return steps


@pytest.mark.parametrize("setup", ["accumulate", "lagged", "manual"])
def test_guard_scalars_are_logged_at_lightnings_step_for_the_batch(tmp_path, setup):
    """Poisoned batches 3 and 6 of 12; ``log_every_n_steps=1``. Lightning logs batch b's metrics at
    ``_batches_that_stepped``: b // 2 under accumulation of 2, b with manual optimization (whatever the number of
    optimizers: global_step counts 2 per batch there), b otherwise."""
    bad = (3, 6)
    logger = _recording_logger(pl)
    kwargs: dict[str, Any] = {}
    if setup == "accumulate":
        model, kwargs, expected = _module(pl), {"accumulate_grad_batches": 2}, [b // 2 for b in bad]
    elif setup == "lagged":
        model, expected = _module(pl), list(bad)
    else:  # each optimizer's step is judged on its own: two incidents per poisoned batch
        model, expected = _module(pl, manual=True), [b for b in bad for _ in range(2)]
    guard = lightning_nanguard.NaNGuard(check={"sync": "lagged" if setup == "lagged" else "eager"},
                                        logging={"verbose": False})
    trainer = pl.Trainer(callbacks=[guard], max_epochs=1, accelerator="cpu", devices=1, logger=logger,
                         log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path), **kwargs)
    trainer.fit(model, _data(bad=bad))
    assert len(guard.events) == len(expected)
    if setup == "manual":
        assert trainer.global_step == 2 * 12  # two optimizer steps per batch
        assert [e.step for e in guard.events] == [2 * b + i for b in bad for i in range(2)]  # global_step
    assert _incident_steps(logger.values) == expected
    steps = [s for s, _ in logger.calls]
    assert steps == sorted(steps)  # the logger never goes back
    # the guard's healthy scalars sit at steps Lightning logs at too
    lightning = {s for s, keys in logger.calls if "train_loss" in keys}
    healthy = set(_nanguard_steps(logger.calls, "nanguard/grad_norm")) - set(expected)
    assert healthy and healthy <= lightning


def test_tensorboard_curves_of_guard_and_module_line_up_under_manual_optimization(tmp_path):
    """Two optimizers stepped by hand every other batch: the guard's incident at batch 5 and its healthy scalars
    are at the steps of the module's own ``train_loss`` for the same batches (read with EventAccumulator)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = pl.loggers.TensorBoardLogger(str(tmp_path), name="tb")
    guard = lightning_nanguard.NaNGuard(logging={"verbose": False})
    trainer = pl.Trainer(callbacks=[guard], max_epochs=1, accelerator="cpu", devices=1, logger=logger,
                         log_every_n_steps=2, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(_module(pl, manual=True, every=2), _data(bad=(5,)))
    assert [e.step for e in guard.events] == [4, 5]  # the 3rd stepping batch: global_step 4 and 5 (one per optimizer)
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    loss_steps = [s.step for s in acc.Scalars("train_loss")]
    # Lightning: batch b at step b, every 2nd batch; the rescued batch 5 leaves no trace in what the module logged
    assert loss_steps == [1, 3, 7, 9, 11]
    # the guard: its healthy scalars where Lightning logs, each of the two events at batch 5's step
    assert [s.step for s in acc.Scalars("nanguard/incidents")] == [1, 3, 5, 5, 7, 9, 11]
    assert [s.value for s in acc.Scalars("nanguard/incidents")] == [0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    text = [ev.step for tag in acc.Tags()["tensors"] if tag.startswith("nanguard/") for ev in acc.Tensors(tag)]
    assert text == [5, 5]  # both events at batch 5's step


# -------------------------------------------------------------------------------------------------- files


@pytest.mark.parametrize("where", ["checkpoints_in_root", "no_root_dir"])
def test_nanguard_folder_is_never_inside_a_checkpoint_folder(tmp_path, monkeypatch, where):
    """``logger=False``: ``<default_root_dir>/nanguard``, unless a ModelCheckpoint writes to ``default_root_dir``
    itself: then ``<that folder>-nanguard`` beside it. Without ``default_root_dir`` Lightning's own is the current
    directory, as for its ``checkpoints/`` folder."""
    root = tmp_path / "run"
    root.mkdir()
    if where == "no_root_dir":
        monkeypatch.chdir(root)
        ckpt_dir, expected, kwargs = tmp_path / "ckpts", root / "nanguard", {}
    else:
        ckpt_dir, expected, kwargs = root, tmp_path / "run-nanguard", {"default_root_dir": str(root)}
    guard = lightning_nanguard.NaNGuard(logging={"verbose": False})
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=4)
    trainer = pl.Trainer(callbacks=[guard, ckpt], max_steps=8, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, **kwargs)
    trainer.fit(_module(pl), _data(bad=(2,)))
    assert [e.step for e in guard.events] == [2]
    assert guard.report_dir == expected
    assert [json.loads(line)["step"] for line in (expected / "events.jsonl").read_text().splitlines()] == [2]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["epoch=0-step=8.ckpt"]  # only checkpoints there


def test_a_checkpoint_folder_whose_name_prefixes_the_root_dir_is_not_the_folder_it_is_inside(tmp_path, monkeypatch):
    """docs/events.md, where events go: the guard moves beside a checkpoint folder only when its folder would lie
    *inside* that folder's ``dirpath``, decided by path, not by string prefix: ``ModelCheckpoint(dirpath="runs/a")``
    with ``default_root_dir="runs/a2"`` (``runs/a2/nanguard`` starts with the string ``runs/a``, but is not inside
    ``runs/a``) writes to ``runs/a2/nanguard/``, not ``runs/a-nanguard/``."""
    monkeypatch.chdir(tmp_path)
    guard = lightning_nanguard.NaNGuard(logging={"verbose": False})
    ckpt = pl.callbacks.ModelCheckpoint(dirpath="runs/a", every_n_train_steps=4)
    trainer = pl.Trainer(callbacks=[guard, ckpt], max_steps=8, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir="runs/a2")
    trainer.fit(_module(pl), _data(bad=(2,)))
    assert [e.step for e in guard.events] == [2]
    assert Path(os.path.abspath(guard.report_dir)) == tmp_path / "runs" / "a2" / "nanguard"
    assert [json.loads(line)["step"] for line in (tmp_path / "runs/a2/nanguard/events.jsonl").read_text().splitlines()
            ] == [2]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["a", "a2"]  # no runs/a-nanguard
    assert sorted(p.name for p in (tmp_path / "runs" / "a").iterdir()) == ["epoch=0-step=8.ckpt"]


# --------------------------------------------------------------------------------- copied and pickled, any time


@pytest.mark.slow  # two fits with a disk store and activation hooks
def test_a_guard_deep_copies_and_pickles_fresh_during_a_fit_and_after_and_the_copy_works(tmp_path):
    """``copy.deepcopy`` and ``pickle`` of a guard at every point of its life: fresh, from a callback during a fit (the
    snapshot thread at work, a TensorBoard writer in its sinks, activation hooks on), after the fit; the unpickled guard
    handles an incident in a new Trainer and writes it to its new folder."""
    import copy
    import pickle

    from pytorch_lightning.loggers import TensorBoardLogger

    from . import models

    def guard_made(**kwargs: Any) -> Any:
        return lightning_nanguard.NaNGuard(logging={"verbose": False}, check={"activations": "always"},
                                           recovery={"snapshot": "disk"}, **kwargs)

    guard = guard_made()
    copies = [copy.deepcopy(guard), pickle.loads(pickle.dumps(guard))]
    failed: list[str] = []

    class CopyMidFit(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step in (2, 5):  # before and after the incident at step 3
                try:
                    copies.extend([copy.deepcopy(guard), pickle.loads(pickle.dumps(guard))])
                except Exception as exc:  # noqa: BLE001  (asserted below: none)
                    failed.append(f"step {trainer.global_step}: {type(exc).__name__}: {exc}")

    trainer = models.trainer(tmp_path / "first", [guard, CopyMidFit()], max_steps=8, max_epochs=-1,
                             logger=TensorBoardLogger(str(tmp_path / "first"), name="tb"))
    trainer.fit(models.NaNLossOnBatches(bad={3}), models.loader(models.regression_data(256), 32))
    assert failed == [] and len(copies) == 6
    assert [e.step for e in guard.events] == [3] and [e.step for e in copies[-1].events] == [3]
    copies += [copy.deepcopy(guard), pickle.loads(pickle.dumps(guard))]
    again = copies[-1]
    assert [e.to_dict() for e in again.events] == [e.to_dict() for e in guard.events]
    trainer = models.trainer(tmp_path / "second", [again], max_steps=6, max_epochs=-1)
    model = models.NaNLossOnBatches(bad={2})
    trainer.fit(model, models.loader(models.regression_data(256), 32))
    assert [(e.step, e.kind, e.actions[0]) for e in again.events] == [(2, "loss", "skip_step")]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    written = (tmp_path / "second" / "nanguard" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in written] == [2]
