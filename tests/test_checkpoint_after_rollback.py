"""What a checkpoint written right after a rollback holds (``recover/checkpoint.py`` ``rebuild``,
``NaNGuard.on_save_checkpoint``), and what a fit resumed from it starts with.

A ModelCheckpoint that saves at the end of the step where the guard rolled back (eager), or whose save brings the
lagged step's verdict that rolls back (the checkpoint is then rebuilt from the restored state), writes the
snapshot's weights, AdamW moments and step counts, the LR scheduler's state with the guard's LR cut kept, the
GradScaler's restored state, and the guard's own state with its counters; never a NaN. ``trainer.fit(...,
ckpt_path=...)`` then resumes on those weights at the cut LR, with the guard's counters.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins import MixedPrecision

from lightning_nanguard import NaNGuard
from lightning_nanguard.testing import Fault, FaultInjector
from . import models

NAN = float("nan")
QUIET = {"verbose": False, "events_file": False, "reports": False}
MODES = ["eager", "lagged"]
LR, GAMMA = 0.02, 0.95
BAD = (12, 13, 14, 15)  # a NaN-loss burst: max_skips 3, so the fourth rolls back to the step-10 snapshot
SAVE_AT = 16  # global_step at the end of step 15: the checkpoint written right after the rollback


class Scheduled(models.Regression):
    """nn.Linear, AdamW (fused, so lagged reads can skip on the device; or not) with weight decay, and an
    ExponentialLR stepped every optimizer step; the loss is multiplied by NaN on the batches ``bad``."""

    def __init__(self, bad: tuple[int, ...] = (), fused: bool = True) -> None:
        super().__init__(lr=LR)
        self.bad, self.fused = set(bad), fused

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * NAN if batch_idx in self.bad else loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1, fused=self.fused)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=GAMMA)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class States(pl.Callback):
    """Listed after the guard: the training state at the end of every step (keyed by the step), as a checkpoint
    would hold it."""

    def __init__(self) -> None:
        self.after: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = copy.deepcopy({
            "state_dict": pl_module.state_dict(), "optimizer_states": [o.state_dict() for o in trainer.optimizers],
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]})


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two nested structures differ (tensors bitwise, floats exactly)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} len"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b or a != a and b != b else [path]  # (a float NaN equals a NaN)


def nonfinite(ckpt: dict) -> list[str]:
    """Every non-finite floating tensor of a checkpoint's weights and optimizer states."""
    out = []
    for key in ("state_dict", "optimizer_states"):
        stack = [(key, ckpt[key])]
        while stack:
            name, v = stack.pop()
            if isinstance(v, dict):
                stack += [(f"{name}.{k}", x) for k, x in v.items()]
            elif isinstance(v, (list, tuple)):
                stack += [(f"{name}[{i}]", x) for i, x in enumerate(v)]
            elif isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                out.append(name)
    return out


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def cut(scheduler_state: dict, scale: float) -> dict:
    """A scheduler's state with the absolute LRs a guard's cut scales (``base_lrs``, ``_last_lr``) times ``scale``."""
    return dict(scheduler_state, base_lrs=[v * scale for v in scheduler_state["base_lrs"]],
                _last_lr=[v * scale for v in scheduler_state["_last_lr"]])


def guarded_fit(fit, tmp_path: Path, sync: str, make_model: Callable[[], pl.LightningModule], steps: int = 20,
                every: int = SAVE_AT, before: tuple = (), plugins: Optional[list] = None, **recovery: Any):
    """A seeded fit of ``make_model()`` with a guard in ``sync`` mode (no restore at train end), a ``States`` probe
    and a ModelCheckpoint saving every ``every`` steps (after every other callback, as always); returns (guard,
    probe, checkpoint folder)."""
    pl.seed_everything(0, verbose=False)
    model = make_model()
    g = NaNGuard(check={"sync": sync}, logging=QUIET,
                 recovery=dict({"snapshot_every": 5, "max_skips": 3, "restore_at_end": False}, **recovery))
    probe = States()
    folder = tmp_path / sync / "ckpts"
    ckpt = ModelCheckpoint(dirpath=folder, every_n_train_steps=every, save_top_k=-1, filename="{step}")
    fit(model, models.regression_data(n=512), [*before, g, probe, ckpt], subdir=sync, batch_size=16, steps=steps,
        enable_checkpointing=True, plugins=plugins or [])
    assert g.lagged is (sync == "lagged")
    return g, probe, folder


# ------------------------------------------------------------------------ the checkpoint's contents


@pytest.mark.parametrize("sync", MODES)
@pytest.mark.parametrize("reduce_lr_after, cuts", [(0, 1), (1, 4)], ids=["cut_at_rollback", "cuts_before"])
def test_a_checkpoint_written_right_after_a_rollback_holds_the_restored_state(fit, tmp_path, sync, reduce_lr_after,
                                                                              cuts):
    """The burst 12-15 rolls back to the step-10 snapshot (taken at the end of step 9). The checkpoint written at
    the end of step 15 holds, eager (the rollback came first) and lagged (the save reads step 15's verdict, rolls
    back, and rebuilds the checkpoint): the snapshot's weights, AdamW moments and step counts, its scheduler state
    and param group with every LR cut kept (the rollback's own, and, with reduce_lr_after 1, the three cuts made
    since the snapshot, re-applied to its state), and the guard's state after the rollback."""
    g, probe, folder = guarded_fit(fit, tmp_path, sync, lambda: Scheduled(BAD), reduce_lr_after=reduce_lr_after)
    scale = 0.5 ** cuts
    (e,) = [e for e in g.events if "rollback" in e.actions]
    assert (e.step, e.actions, e.details["restored_step"]) == (15, ["skip_step", "rollback", "reduce_lr"], 10)
    assert g.lr_scale == scale
    ckpt = load(folder / f"step={SAVE_AT}.ckpt")
    snapshot = probe.after[9]
    assert differences(ckpt["state_dict"], snapshot["state_dict"]) == []
    opt, snap_opt = ckpt["optimizer_states"][0], snapshot["optimizer_states"][0]
    assert differences(opt["state"], snap_opt["state"]) == []  # exp_avg, exp_avg_sq, step
    assert {float(s["step"]) for s in opt["state"].values()} == {10.0}
    group, snap_group = opt["param_groups"][0], snap_opt["param_groups"][0]
    assert group["lr"] == pytest.approx(snap_group["lr"] * scale, rel=1e-12)
    assert group["initial_lr"] == pytest.approx(LR * scale, rel=1e-12)
    (sched,) = ckpt["lr_schedulers"]
    assert sched["last_epoch"] == snapshot["lr_schedulers"][0]["last_epoch"] == 10
    assert differences(sched, cut(snapshot["lr_schedulers"][0], scale)) == []
    state = ckpt["callbacks"]["NaNGuard"]
    assert state["counters"]["rollbacks"] == 1 and state["recovery"]["lr_scale"] == scale
    assert state["counters"]["incidents"] == 4 and state["counters"]["skipped_steps"] == 4
    assert state["counters"]["lr_cuts"] == cuts
    assert state["recovery"]["ladder"]["failed_rollbacks"] == 1
    assert nonfinite(ckpt) == []
    for path in folder.glob("*.ckpt"):
        assert nonfinite(load(path)) == [], path.name


def test_the_checkpoint_after_a_rollback_is_the_same_in_both_modes(fit, tmp_path):
    out = {}
    for sync in MODES:
        out[sync] = load(guarded_fit(fit, tmp_path, sync, lambda: Scheduled(BAD))[2] / f"step={SAVE_AT}.ckpt")
    for key in ("state_dict", "optimizer_states", "lr_schedulers"):
        assert differences(out["eager"][key], out["lagged"][key]) == [], key
    assert differences(out["eager"]["callbacks"]["NaNGuard"], out["lagged"]["callbacks"]["NaNGuard"]) == []


def test_a_lagged_verdict_at_checkpoint_time_rolls_back_an_applied_nan_step_before_the_write(fit, tmp_path):
    """check.sync: lagged with a non-fused AdamW cannot skip on the device: the NaN step 13 is applied (NaN weights
    and moments at its end) and its verdict arrives when the checkpoint at the end of step 13 is written. The guard
    rolls back to the step-10 snapshot and rebuilds the checkpoint: no NaN reaches the file, and the one event is
    the step's own (no second, 'parameter' incident at the checkpoint)."""
    g, probe, folder = guarded_fit(fit, tmp_path, "lagged", lambda: Scheduled(bad=(13,), fused=False), every=14)
    assert nonfinite(probe.after[13])  # the bad step was applied: what Lightning had to save
    (e,) = g.events
    assert (e.step, e.kind, e.actions, e.details["restored_step"]) == (13, "loss", ["clip", "rollback"], 10)
    ckpt = load(folder / "step=14.ckpt")
    assert nonfinite(ckpt) == []
    assert differences(ckpt["state_dict"], probe.after[9]["state_dict"]) == []
    assert differences(ckpt["optimizer_states"][0]["state"], probe.after[9]["optimizer_states"][0]["state"]) == []
    assert differences(ckpt["lr_schedulers"], probe.after[9]["lr_schedulers"]) == []  # a one-off: no LR cut
    assert ckpt["callbacks"]["NaNGuard"]["counters"]["rollbacks"] == 1
    assert ckpt["callbacks"]["NaNGuard"]["counters"]["incidents"] == 1


@pytest.mark.parametrize("sync", MODES)
def test_a_nan_weight_found_at_checkpoint_time_is_replaced_by_the_snapshot_in_the_file(fit, tmp_path, sync):
    """A NaN written into a weight after step 13's update, with a checkpoint due at its end: the checkpoint check
    finds it (detected_at: checkpoint), rolls back to the step-10 snapshot and rebuilds the checkpoint from it,
    optimizer moments and guard state included."""
    injector = FaultInjector([Fault("parameter", steps=[13], target="linear.weight")])
    g, probe, folder = guarded_fit(fit, tmp_path, sync, Scheduled, every=14, before=(injector,))
    (e,) = g.events
    assert (e.step, e.kind, e.details["detected_at"], e.details["restored_step"]) == (14, "parameter", "checkpoint", 10)
    ckpt = load(folder / "step=14.ckpt")
    assert nonfinite(ckpt) == []
    assert differences(ckpt["state_dict"], probe.after[9]["state_dict"]) == []
    assert differences(ckpt["optimizer_states"][0]["state"], probe.after[9]["optimizer_states"][0]["state"]) == []
    assert differences(ckpt["lr_schedulers"], probe.after[9]["lr_schedulers"]) == []
    state = ckpt["callbacks"]["NaNGuard"]
    assert state["counters"]["rollbacks"] == 1 and state["counters"]["incidents"] == 1


def test_the_grad_scaler_state_in_a_rebuilt_checkpoint_is_the_restored_one(fit, tmp_path):
    """16-mixed (a GradScaler on the CPU), lagged, fused AdamW: each skipped step of the burst joins the scaler's
    found_inf, which halves the scale (256 -> 16). The rollback, read when the checkpoint is written, restores the
    snapshot's scaler (256: no routine overflow was under way), and the rebuilt checkpoint holds that scale, not
    the 16 Lightning had dumped before the verdict; the eager run writes the same scaler state."""
    out = {}
    for sync in MODES:
        plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000))
        g, probe, folder = guarded_fit(fit, tmp_path, sync, lambda: Scheduled(BAD), plugins=[plugin])
        assert [e.details.get("restored_step") for e in g.events if "rollback" in e.actions] == [10]
        ckpt = load(folder / f"step={SAVE_AT}.ckpt")
        assert ckpt["MixedPrecision"]["scale"] == 256.0, sync
        assert float(plugin.scaler.get_scale()) == 256.0  # and the live scaler went on from it
        assert nonfinite(ckpt) == [] and differences(ckpt["state_dict"], probe.after[9]["state_dict"]) == []
        out[sync] = ckpt
    assert differences(out["eager"]["MixedPrecision"], out["lagged"]["MixedPrecision"]) == []


# ------------------------------------------------------------------------------------------- resume


class AtStart(pl.Callback):
    """Listed after the guard: the weights, the LR and the guard's counters when the resumed fit starts, and the
    learning rate of its first optimizer step."""

    def __init__(self, guard: NaNGuard) -> None:
        self.guard = guard
        self.weights: Optional[dict] = None
        self.first_lr: Optional[list] = None
        self.counters: Optional[dict] = None

    def on_train_start(self, trainer, pl_module):
        self.weights = copy.deepcopy(pl_module.state_dict())
        self.counters = dict(self.guard.counters, lr_scale=self.guard.lr_scale)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.first_lr is None:
            self.first_lr = (trainer.global_step, [group["lr"] for group in optimizer.param_groups])


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("sync", MODES)
def test_a_fit_resumed_from_the_checkpoint_starts_on_the_restored_weights_at_the_cut_lr(fit, tmp_path, sync):
    """trainer.fit(..., ckpt_path=...) from the checkpoint written after the rollback: the new fit starts on the
    snapshot's weights, its first update uses the cut LR (scheduled on from the snapshot's step), and the new guard
    carries on with the counters and LR scale the checkpoint holds."""
    _, probe, folder = guarded_fit(fit, tmp_path, sync, lambda: Scheduled(BAD))
    path = folder / f"step={SAVE_AT}.ckpt"
    saved = load(path)
    guard = NaNGuard(check={"sync": sync}, logging=QUIET, recovery={"snapshot_every": 5, "max_skips": 3})
    at_start = AtStart(guard)
    pl.seed_everything(0, verbose=False)
    model = Scheduled()
    fit(model, models.regression_data(n=512), [guard, at_start], subdir=f"{sync}-resumed", batch_size=16, steps=24,
        ckpt_path=str(path))
    assert differences(at_start.weights, probe.after[9]["state_dict"]) == []
    expected_lr = LR * GAMMA ** 10 * 0.5  # the snapshot's schedule (10 steps), with the guard's cut
    assert at_start.first_lr == (SAVE_AT, [pytest.approx(expected_lr, rel=1e-9)])
    counters = at_start.counters
    assert {k: counters[k] for k in ("rollbacks", "lr_cuts", "incidents", "skipped_steps", "lr_scale")} == dict(
        rollbacks=1, lr_cuts=1, incidents=4, skipped_steps=4, lr_scale=0.5)
    held = saved["callbacks"]["NaNGuard"]["counters"]
    assert counters["snapshots"] == held["snapshots"] + 1  # and one of the resumed state, at train start
    assert guard.events == [] and guard.lr_scale == 0.5 and models.all_finite(model)
