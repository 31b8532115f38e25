"""The run ends while recovery is unfinished (``recovery.restore_at_end``): right after skipped incidents, or
before a rollback was confirmed, the newest known-good snapshot is restored and recorded (real pl.Trainer)."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard

from . import models

LR = 3.0  # far too high for this MLP: the loss overflows within a few dozen steps
SNAPSHOT_EVERY = 5


class MLP(models.Regression):
    def __init__(self, lr: float = LR) -> None:
        super().__init__(lr=lr)
        self.linear = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _data(batches: Optional[int] = None) -> TensorDataset:
    x, y = models.regression_data(n=1024).tensors
    n = len(x) if batches is None else 32 * batches
    return TensorDataset(x[:n], y[:n])


def _fit(tmp_path: Any, max_steps: int = -1, batches: Optional[int] = None, **recovery: Any):
    pl.seed_everything(0, verbose=False)
    # the divergence watch (issue 13) would roll this run back before its first NaN: these tests need the
    # skipped NaN incidents of a run left to diverge
    guard = NaNGuard(recovery={"snapshot_every": SNAPSHOT_EVERY, **recovery}, check={"divergence": "off"})
    spy = models.SnapshotSpy(guard)
    model = MLP()
    models.trainer(tmp_path, [guard, spy], max_steps=max_steps, max_epochs=1 if batches else 100).fit(
        model, models.loader(_data(batches)))
    return guard, spy, model


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """The same run, long enough: the steps of its incidents, and of its first rollback."""
    guard, _, _ = _fit(tmp_path_factory.mktemp("probe"), max_steps=30)
    assert all("train_end" != e.details.get("detected_at") for e in guard.events)  # recovery finished in time
    rollback = next(e.step for e in guard.events if "rollback" in e.actions)
    return [e.step for e in guard.events if e.actions[0] == "skip_step" and e.step < rollback], rollback


def _in_a_row(steps: list[int], k: int) -> int:
    """The last step of the first k incidents in a row."""
    return next(s + k - 1 for s in steps if all(s + i in steps for i in range(k)))


def _equal(state: dict, model: nn.Module) -> bool:
    return all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def _loss(model: nn.Module) -> float:
    x, y = _data().tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


@pytest.mark.parametrize("ends_by", ["max_steps", "max_epochs"])
@pytest.mark.parametrize("skipped", [1, 2])
def test_run_ending_right_after_skipped_incidents_restores_the_newest_snapshot(tmp_path, probe, ends_by, skipped):
    last = _in_a_row(probe[0], skipped)  # the run ends on the skipped-th incident in a row
    kwargs = {"max_steps": last + 1} if ends_by == "max_steps" else {"batches": last + 1}
    guard, spy, model = _fit(tmp_path, **kwargs)
    *incidents, end = guard.events
    assert [e.step for e in incidents] == [s for s in probe[0] if s <= last]  # the same run up to there
    newest = max(spy.states)
    assert end.details["detected_at"] == "train_end" and end.actions == ["rollback"]
    assert end.details["restored_step"] == newest and end.details["skipped_steps_in_a_row"] == skipped
    assert (end.kind, end.cause) == (incidents[-1].kind, incidents[-1].cause)
    assert _equal(spy.states[newest]["module"], model)
    for opt, state in zip(model.trainer.optimizers, spy.states[newest]["optimizers"]):  # the LR cuts are kept
        assert opt.param_groups[0]["lr"] == pytest.approx(state["param_groups"][0]["lr"] * guard.lr_scale)
    assert guard.lr_scale < 1 and guard.counters["rollbacks"] == 1 and not guard.stopped


@pytest.mark.parametrize("restore_at_end", [True, False])
def test_restore_at_end_decides_whether_the_broken_final_weights_are_kept(tmp_path, probe, restore_at_end):
    """Off, nothing is restored: those final weights are the finite-but-broken ones."""
    guard, spy, model = _fit(tmp_path, max_steps=probe[0][0] + 1, restore_at_end=restore_at_end)
    assert [e.step for e in guard.events] == probe[0][:1] + ([probe[0][0] + 1] if restore_at_end else [])
    newest = max(spy.states)
    assert _equal(spy.states[newest]["module"], model) == restore_at_end
    restored = MLP()
    restored.load_state_dict(spy.states[newest]["module"])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if not restore_at_end:
        assert _loss(model) > 100 * _loss(restored)  # finite, and far worse than the last known-good state


def test_run_ending_before_a_rollback_is_confirmed_restores_the_snapshot(tmp_path, probe):
    """A few healthy steps after a rollback, before the snapshot that confirms it: restored again."""
    guard, spy, model = _fit(tmp_path, max_steps=probe[1] + 3)
    rollback = next(e for e in guard.events if "rollback" in e.actions and e.details.get("detected_at") is None)
    end = guard.events[-1]
    assert end.details["detected_at"] == "train_end" and end.details["unconfirmed_rollbacks"] == 1
    assert end.details["skipped_steps_in_a_row"] == 0 and end.details["restored_step"] == rollback.details[
        "restored_step"]
    assert _equal(spy.states[end.details["restored_step"]]["module"], model)


def test_run_ending_on_its_rollback_step_needs_no_restore(tmp_path, probe):
    guard, spy, model = _fit(tmp_path, max_steps=probe[1] + 1)
    assert guard.events[-1].step == probe[1] and "rollback" in guard.events[-1].actions
    assert all(e.details.get("detected_at") != "train_end" for e in guard.events)
    assert _equal(spy.states[guard.events[-1].details["restored_step"]]["module"], model)


def test_skipped_bad_inputs_at_the_end_leave_the_weights_alone(tmp_path):
    """The weights never saw a skipped bad batch: nothing to restore (bitwise the run one step shorter)."""
    data = models.regression_data(n=256)
    x, y = (t.clone() for t in data.tensors)
    x[-1, 0] = float("nan")  # in the last batch
    weights = []
    for steps in (7, 8):
        pl.seed_everything(0, verbose=False)
        guard, model = NaNGuard(recovery={"snapshot_every": 2}), models.Regression()
        models.trainer(tmp_path / str(steps), [guard], max_steps=steps).fit(model, models.loader(TensorDataset(x, y)))
        weights.append(model.state_dict())
    assert [(e.step, e.kind) for e in guard.events] == [(7, "input")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_without_a_snapshot_the_unfinished_recovery_is_a_warning(tmp_path, probe):
    guard, _, model = _fit(tmp_path, max_steps=probe[0][0] + 1, snapshot="off")
    end = guard.events[-1]
    assert end.details["detected_at"] == "train_end" and end.actions == ["warn"]
    assert "restored_step" not in end.details and guard.counters["rollbacks"] == 0


class FlipWeight(pl.Callback):
    """Listed before the guard: one weight becomes inf after the optimizer step of ``step`` (a bit flip)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
        if trainer.global_step == self.step + 1:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("inf")


def test_healthy_steps_after_rolling_back_a_one_off_bad_parameter_are_kept(tmp_path):
    """An unconfirmed rollback of a bad parameter: the snapshot was fine, the healthy steps since are kept."""
    guard, flip = NaNGuard(recovery={"snapshot_every": 4}), FlipWeight(5)
    spy = models.SnapshotSpy(guard)
    model = models.Regression(lr=0.05)
    models.trainer(tmp_path, [flip, guard, spy], max_steps=10).fit(model, models.loader(models.regression_data()))
    (event,) = guard.events
    assert event.kind == "parameter" and "rollback" in event.actions and guard.state_dict()["recovery"]["ladder"]["failed_rollbacks"] == 1
    assert not _equal(spy.states[event.details["restored_step"]]["module"], model)  # trained on after it
