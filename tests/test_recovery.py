"""What the recovery ladder restores and changes, read back from the live objects of real Trainer runs:
the state a rollback loads, LR cuts across rollbacks and schedulers, the LR floor, the incident window, and
the snapshot keys."""

from __future__ import annotations

from typing import Any, Callable

from . import models
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.optim import lr_scheduler as S

from lightning_nanguard import NaNGuard, NaNGuardError
from lightning_nanguard.config import ClipConfig, RecoveryConfig
from lightning_nanguard.recover.ladder import RecoveryLadder
from lightning_nanguard.testing import Fault, FaultInjector

QUIET = {"verbose": False}


def fit(tmp_path, model: pl.LightningModule, callbacks: list, steps: int, data=None, batch_size: int = 16,
        **kwargs: Any) -> pl.Trainer:
    trainer = models.trainer(tmp_path, callbacks, max_steps=steps, max_epochs=-1, **kwargs)
    trainer.fit(model, models.loader(data if data is not None else models.regression_data(n=512), batch_size))
    return trainer


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Equal nested state: tensors bitwise (``torch.equal``), everything else with ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


class AtBatchStart(pl.Callback):
    """The training state at the start of every optimizer step (right after the previous step's rollback)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.states[trainer.global_step] = models.training_state(trainer, pl_module)


# --------------------------------------------------------------------------------------------- rollback


def test_rollback_loads_the_newest_snapshot_then_the_one_before(tmp_path):
    """Module (incl. BatchNorm buffers), AdamW moments and step, and the scheduler are, right after each
    rollback, bitwise the state captured when the snapshot was taken: the newest snapshot first, then (the
    rollback did not help) the one before it."""
    recovery = {"snapshot_every": 4, "keep_snapshots": 2, "max_skips": 3, "reduce_lr_on_rollback": False}
    burst = range(10, 10 + 2 * (recovery["max_skips"] + 1))  # two rollbacks, the second before any new snapshot
    guard = NaNGuard(recovery=recovery, logging=QUIET)
    snaps, starts = models.SnapshotSpy(guard), AtBatchStart()
    model = models.Classifier(scheduler="cosine")
    fit(tmp_path, model, [FaultInjector(Fault("loss", steps=burst)), guard, snaps, starts], steps=24,
        data=models.classification_data(n=1024), batch_size=32)
    rollbacks = [e for e in guard.events if "rollback" in e.actions]
    assert [e.step for e in rollbacks] == [burst[0] + recovery["max_skips"], burst[-1]]
    taken = sorted(s for s in snaps.states if s <= burst[0])
    expected = [taken[-1], taken[-2]]
    assert [e.details["restored_step"] for e in rollbacks] == expected
    for event, step in zip(rollbacks, expected):
        assert_same(starts.states[event.step + 1], snaps.states[step], f"rollback at {event.step}")
    # what was compared holds what the issue names
    opt_state = snaps.states[expected[0]]["optimizers"][0]["state"]
    assert opt_state and all({"exp_avg", "exp_avg_sq", "step"} <= s.keys() for s in opt_state.values())
    assert snaps.states[expected[0]]["schedulers"][0]["last_epoch"] == expected[0]
    assert "net.1.running_mean" in snaps.states[expected[0]]["module"]
    assert guard._recovery.ladder.failed_rollbacks == 0  # a snapshot after the second rollback confirmed it


class Scheduled(models.Regression):
    """SGD with a step-interval scheduler."""

    def __init__(self, make: Callable[[torch.optim.Optimizer], Any]) -> None:
        super().__init__(lr=0.05)
        self.make = make

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.make(opt), "interval": "step"}}


SCHEDULES = {
    "lambda": lambda o: S.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.1 * s)),
    "cosine": lambda o: S.CosineAnnealingLR(o, T_max=30, eta_min=0.005),
}


def uncut_lr(make, base_lr: float, steps: int) -> float:
    """The LR the schedule gives after ``steps`` scheduler steps, without any cut."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base_lr)
    sched = make(opt)
    for _ in range(steps):
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_lr_cut_made_after_the_snapshot_survives_the_rollback(tmp_path, schedule):
    """Snapshot at 10 (lr_scale 1), cut at 12, bad parameters at 15 roll back to 10: the optimizer LR and the
    scheduler's base_lrs stay at base x lr_scale, where base is the uncut schedule at the restored step."""
    factor, base_lr = 0.3, 0.05
    make = SCHEDULES[schedule]
    guard = NaNGuard(recovery={"snapshot_every": 10, "reduce_lr_after": 2, "lr_factor": factor}, logging=QUIET)
    faults = [Fault("loss", steps=[10, 12]), Fault("parameter", steps=[14])]
    starts = AtBatchStart()
    trainer = fit(tmp_path, Scheduled(make), [FaultInjector(faults), guard, starts], steps=24)
    assert [(e.step, "reduce_lr" in e.actions, "rollback" in e.actions) for e in guard.events] == [
        (10, False, False), (12, True, False), (15, False, True)]
    assert guard.events[2].details["restored_step"] == 10 and guard.lr_scale == factor
    after = starts.states[16]
    sched, group = after["schedulers"][0], after["optimizers"][0]["param_groups"][0]
    assert sched["last_epoch"] == 10  # the scheduler was rolled back too
    assert group["lr"] == pytest.approx(factor * uncut_lr(make, base_lr, 10), rel=1e-6)
    assert sched["base_lrs"] == [pytest.approx(factor * base_lr, rel=1e-9)]
    live = trainer.lr_scheduler_configs[0].scheduler  # and the schedule goes on from there, cut
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(
        factor * uncut_lr(make, base_lr, live.last_epoch), rel=1e-6)


# ------------------------------------------------------------------------------- LR floor, incident window


def test_lr_cuts_stop_at_min_lr_scale(tmp_path):
    """recovery.min_lr_scale: the scale goes 1 -> lr_factor -> the floor, then stays; a cut that cannot lower
    it any more is not recorded as reduce_lr (nor counted)."""
    factor, floor = 0.4, 0.3
    guard = NaNGuard(recovery={"reduce_lr_after": 1, "lr_factor": factor, "min_lr_scale": floor}, logging=QUIET)
    steps = [3, 6, 9, 12]
    trainer = fit(tmp_path, models.Regression(lr=0.05), [FaultInjector(Fault("loss", steps=steps)), guard], steps=16)
    scale, expected = 1.0, []
    for _ in steps:
        new = max(scale * factor, floor)
        expected.append((new < scale, new))
        scale = new
    assert expected == [(True, factor), (True, floor), (False, floor), (False, floor)]
    assert [("reduce_lr" in e.actions, e.details["lr_scale"]) for e in guard.events] == expected
    assert guard.lr_scale == floor and guard.counters["lr_cuts"] == 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * floor)


def test_incident_window_boundary_in_the_ladder():
    """An incident counts towards reduce_lr_after while it is less than incident_window steps old."""
    window = 5
    ladder = RecoveryLadder(RecoveryConfig(reduce_lr_after=2, incident_window=window, max_skips=10), ClipConfig())
    assert not ladder.incident(0, "loss", can_roll_back=True).reduce_lr
    ladder.healthy()
    assert not ladder.incident(window, "loss", can_roll_back=True).reduce_lr  # step 0 is exactly a window old
    ladder.healthy()
    assert ladder.incident(2 * window - 1, "loss", can_roll_back=True).reduce_lr  # step 5 is window - 1 old


def test_incident_window_boundary_in_a_trainer(tmp_path):
    window = 5
    guard = NaNGuard(recovery={"reduce_lr_after": 2, "incident_window": window}, logging=QUIET)
    steps = [3, 3 + window, 3 + 2 * window - 1]
    fit(tmp_path, models.Regression(), [FaultInjector(Fault("loss", steps=steps)), guard], steps=16)
    assert [(e.step, "reduce_lr" in e.actions) for e in guard.events] == [
        (steps[0], False), (steps[1], False), (steps[2], True)]
    assert guard.lr_scale == guard.config.recovery.lr_factor


def test_reduce_lr_on_rollback_off_rolls_back_without_a_cut():
    for on in (True, False):
        ladder = RecoveryLadder(RecoveryConfig(max_skips=1, reduce_lr_on_rollback=on), ClipConfig())
        plans = [ladder.incident(s, "loss", can_roll_back=True) for s in range(2)]
        assert [(p.rollback, p.reduce_lr) for p in plans] == [(False, False), (True, on)]


# ------------------------------------------------------------------------------------------- snapshots


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_snapshot_every_and_keep_snapshots_in_a_healthy_run(tmp_path, mode):
    """One snapshot at train start, then one every snapshot_every healthy steps; the newest keep_snapshots
    are kept (disk: as files in snapshot_dir, nothing in the default folder)."""
    every, keep, steps = 3, 3, 20
    folder = tmp_path / "my-snapshots"
    recovery = {"snapshot": mode, "snapshot_every": every, "keep_snapshots": keep, "snapshot_dir": str(folder)}
    guard = NaNGuard(recovery=recovery, logging=QUIET)
    snaps = models.SnapshotSpy(guard)
    fit(tmp_path, models.Regression(), [guard, snaps], steps=steps)
    expected = list(range(0, steps + 1, every))
    assert sorted(snaps.states) == expected and guard.counters["snapshots"] == len(expected)
    assert [s.step for s in guard._recovery.store.ring] == expected[-keep:]
    if mode == "disk":
        assert sorted(p.name for p in folder.iterdir()) == sorted(f"snapshot-step{s}.pt" for s in expected[-keep:])
        assert not (tmp_path / "nanguard" / "snapshots").exists()
    else:
        assert not folder.exists()


def test_confirm_after_takes_the_confirming_snapshot_sooner(tmp_path):
    """After a rollback, a snapshot confirms it after confirm_after healthy steps (not snapshot_every)."""
    recovery = {"snapshot_every": 20, "confirm_after": 3, "max_skips": 1}
    guard = NaNGuard(recovery=recovery, logging=QUIET)
    snaps = models.SnapshotSpy(guard)
    burst = [25, 26]
    fit(tmp_path, models.Regression(), [FaultInjector(Fault("loss", steps=burst)), guard, snaps], steps=52)
    rollback = burst[-1]
    assert [e.step for e in guard.events if "rollback" in e.actions] == [rollback]
    confirming = rollback + 1 + recovery["confirm_after"]
    after = [s for s in sorted(snaps.states) if s > rollback]
    assert after[:2] == [confirming, confirming + recovery["snapshot_every"]]  # then the usual interval again
    assert guard._recovery.ladder.failed_rollbacks == 0


def test_snapshot_off_takes_none_and_refuses_a_nonfinite_checkpoint(tmp_path):
    """recovery.snapshot: off keeps nothing to roll back to: a checkpoint that would hold a non-finite weight
    is refused with NaNGuardError and never written (with snapshots it is replaced by known-good state)."""
    bad = 3
    for mode in ("memory", "off"):
        guard = NaNGuard(recovery={"snapshot": mode}, logging=QUIET)
        ckpt = ModelCheckpoint(dirpath=tmp_path / mode, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        callbacks = [FaultInjector(Fault("parameter", steps=[bad])), guard, ckpt]
        run = lambda: fit(tmp_path / f"{mode}-run", models.Regression(), callbacks, steps=6,  # noqa: E731
                          enable_checkpointing=True)
        if mode == "off":
            with pytest.raises(NaNGuardError):
                run()
            assert guard.counters["snapshots"] == 0 and guard._recovery.store is None
        else:
            run()
            assert guard.counters["rollbacks"] == 1
        files = sorted(p.name for p in (tmp_path / mode).glob("*.ckpt"))
        written = range(1, bad + 1) if mode == "off" else range(1, 7)
        assert files == sorted(f"step={s}.ckpt" for s in written), (mode, files)
        for f in files:
            state = torch.load(tmp_path / mode / f, map_location="cpu", weights_only=False)["state_dict"]
            assert all(torch.isfinite(v).all() for v in state.values()), f
