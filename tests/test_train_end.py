"""The end of fit keeps the newest good weights (``recovery.restore_at_end``, real pl.Trainer).

A skipped step leaves the weights as they were and the healthy steps after a rollback are good steps: neither
is undone at the end. The newest known-good snapshot is restored only when the final weights are suspect: the
fit ended inside a streak of incidents that the weights themselves reproduce (finite but broken: a ``parameter``
event), or while the loss was running away after an unconfirmed rollback (a ``divergence`` event); either
event says what was restored, from which step and why (``details.detected_at: train_end``)."""

from __future__ import annotations

import copy
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
    # finite but broken: the last incident's batch is non-finite again on the final weights, finite on the snapshot's
    assert (end.kind, end.cause, end.details["source_step"]) == ("parameter", incidents[-1].cause, incidents[-1].step)
    assert end.details["rerun_at_end"] == {"final_weights": True, "snapshot_weights": False, "snapshot_step": newest}
    assert f"step {newest}" in end.suggestion and end.batch_idx == -1
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


def test_healthy_steps_after_an_unconfirmed_rollback_are_kept(tmp_path, probe):
    """A few healthy steps after a rollback (at the cut LR), before the snapshot that confirms it: good steps, kept
    (until issue 20 they were rolled back again at the end)."""
    guard, spy, model = _fit(tmp_path, max_steps=probe[1] + 3)
    rollback = guard.events[-1]
    assert rollback.step == probe[1] and "rollback" in rollback.actions  # the last event: nothing at train end
    assert all(e.details.get("detected_at") != "train_end" for e in guard.events)
    assert not _equal(spy.states[rollback.details["restored_step"]]["module"], model)  # trained on after it
    assert models.all_finite(model) and guard.counters["rollbacks"] == 1


def test_run_ending_on_its_rollback_step_needs_no_restore(tmp_path, probe):
    guard, spy, model = _fit(tmp_path, max_steps=probe[1] + 1)
    assert guard.events[-1].step == probe[1] and "rollback" in guard.events[-1].actions
    assert all(e.details.get("detected_at") != "train_end" for e in guard.events)
    assert _equal(spy.states[guard.events[-1].details["restored_step"]]["module"], model)


@pytest.mark.parametrize("anomaly", ["on_incident", "off"])
def test_skipped_bad_inputs_at_the_end_leave_the_weights_alone(tmp_path, anomaly):
    """The weights never saw a skipped bad batch: nothing to restore (bitwise the run one step shorter). Bad inputs
    never make the weights suspect, so this holds where the batch cannot be rerun too (anomaly.mode: off, where a
    streak of other incidents is taken as suspect)."""
    data = models.regression_data(n=256)
    x, y = (t.clone() for t in data.tensors)
    x[-1, 0] = float("nan")  # in the last batch
    weights = []
    for steps in (7, 8):
        pl.seed_everything(0, verbose=False)
        guard, model = NaNGuard(recovery={"snapshot_every": 2}, anomaly={"mode": anomaly}), models.Regression()
        models.trainer(tmp_path / str(steps), [guard], max_steps=steps).fit(model, models.loader(TensorDataset(x, y)))
        weights.append(model.state_dict())
    assert [(e.step, e.kind, e.cause) for e in guard.events] == [(7, "input", "input")]
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
    assert event.kind == "parameter" and "rollback" in event.actions
    assert guard.state_dict()["recovery"]["ladder"]["failed_rollbacks"] == 1
    assert not _equal(spy.states[event.details["restored_step"]]["module"], model)  # trained on after it


# ------------------------------------------------------------------- issue 20: the newest good weights are kept

NAN = float("nan")
SYNCS = ["eager", "lagged"]  # lagged on the CPU: the fused AdamW skips a bad step on the device


class StepWeights(pl.Callback):
    """Listed after a NaNGuard: ``states[step]`` is the module's state after the batch end of ``step`` (what the
    guard left there)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
        self.states[trainer.global_step - 1] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


class LossTrace(pl.Callback):
    """Every training-step loss as the Trainer saw it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


class NaNOn(models.Regression):
    """Regression with a fused AdamW whose loss is multiplied by NaN on the batches ``bad``: the batch's fault,
    reproduced on any weights."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__(lr=0.02, optimizer="adamw")
        self.bad = bad

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * NAN if batch_idx in self.bad else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)


class LogGain(NaNOn):
    """A learnable gain whose log is in the loss, unbounded below: AdamW pulls it down by about lr per step until
    it crosses zero (after step 9), and from then on every batch's loss is NaN while every weight stays finite."""

    def __init__(self) -> None:
        super().__init__(bad=set())
        self.lr = 0.1
        self.gain = nn.Parameter(torch.ones(()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + torch.log(self.gain)


def _guarded(tmp_path: Any, model: pl.LightningModule, sync: str, recovery: Optional[dict] = None,
             **trainer_kwargs: Any):
    """Fit ``model`` on batches of 16 with a guard (``check.sync: sync``) and a :class:`StepWeights` spy after it."""
    pl.seed_everything(0, verbose=False)
    guard = NaNGuard(check={"sync": sync}, recovery=recovery or {}, logging={"verbose": False, "reports": False})
    weights = StepWeights()
    models.trainer(tmp_path, [guard, weights], **trainer_kwargs).fit(
        model, models.loader(models.regression_data(n=1024), 16))
    assert guard.lagged == (sync == "lagged")
    return guard, weights


@pytest.mark.parametrize("sync", SYNCS)
def test_a_skipped_nan_loss_on_the_last_step_keeps_the_weights_of_the_step_before(tmp_path, sync):
    """The NaN loss of step 49, the last of 50: skipped, and nothing else. The final weights are bitwise those
    after step 48 (not the snapshot of step 40, the weights after step 39), and one event for one fault."""
    model = NaNOn(bad={49})
    guard, weights = _guarded(tmp_path, model, sync, recovery={"snapshot_every": 10}, max_steps=50, max_epochs=-1)
    assert [(e.step, e.kind, e.actions[0]) for e in guard.events] == [(49, "loss", "skip_step")]
    assert _equal(weights.states[48], model) and not _equal(weights.states[39], model)
    assert guard.counters["rollbacks"] == 0 and guard.lr_scale == 1.0 and not guard.stopped


@pytest.mark.parametrize("sync", SYNCS)
def test_healthy_steps_after_a_forced_rollback_and_lr_cut_are_kept(tmp_path, sync):
    """Four NaN steps in a row (2-5) force a rollback to step 0 and an LR cut; the healthy steps 6-11 at the cut
    LR are good steps, and the fit that ends at step 12 keeps them: bitwise the weights after step 11."""
    model = NaNOn(bad={2, 3, 4, 5})
    initial = copy.deepcopy(model.state_dict())
    guard, weights = _guarded(tmp_path, model, sync, max_steps=12, max_epochs=-1)
    assert [e.step for e in guard.events] == [2, 3, 4, 5]
    assert guard.events[-1].actions[-2:] == ["rollback", "reduce_lr"] and guard.events[-1].details["restored_step"] == 0
    assert _equal(weights.states[11], model) and not _equal(initial, model)  # trained on after the rollback
    assert guard.counters["rollbacks"] == 1 and guard.lr_scale < 1


@pytest.mark.parametrize("sync", SYNCS)
def test_fast_dev_run_with_a_nan_at_its_only_step_gives_one_event(tmp_path, sync):
    """The only step is skipped: the weights are the initial ones, which are the newest snapshot's already."""
    model = NaNOn(bad={0})
    initial = copy.deepcopy(model.state_dict())
    guard, _ = _guarded(tmp_path, model, sync, fast_dev_run=True)
    assert [(e.step, e.kind, e.actions) for e in guard.events] == [(0, "loss", ["skip_step", "clip"])]
    assert _equal(initial, model) and guard.counters["rollbacks"] == 0


@pytest.mark.parametrize("sync", SYNCS)
def test_finite_but_broken_weights_at_the_end_are_restored_to_the_newest_good_snapshot(tmp_path, sync):
    """The gain crossed zero: steps 11 and 12 are NaN and skipped, and the fit ends there, on finite weights that
    give a NaN loss on every batch. Rerun on them the last incident's batch is NaN again, on the snapshot of step
    8 it is not: restored to that snapshot, and said so (a ``parameter`` event, not a second ``loss``)."""
    model = LogGain()
    guard, weights = _guarded(tmp_path, model, sync, recovery={"snapshot_every": 4}, max_steps=13, max_epochs=-1)
    *incidents, end = guard.events
    assert [(e.step, e.kind) for e in incidents] == [(11, "loss"), (12, "loss")]
    assert float(weights.states[12]["gain"]) < 0 and models.all_finite(model)  # (what the fit ended on)
    assert (end.kind, end.actions, end.batch_idx) == ("parameter", ["rollback"], -1)
    assert end.details["detected_at"] == "train_end" and end.details["restored_step"] == 8
    assert end.details["source_step"] == 12 and "step 8" in end.details["reason"]
    assert end.details["rerun_at_end"] == {"final_weights": True, "snapshot_weights": False, "snapshot_step": 8}
    assert "restored" in end.suggestion and "step 8" in end.suggestion
    assert _equal(weights.states[7], model)  # the snapshot of step 8: the weights after step 7
    x, y = models.regression_data(n=1024).tensors
    with torch.no_grad():  # not broken: a finite loss on the data
        assert torch.isfinite(nn.functional.mse_loss(model(x), y) + torch.log(model.gain))


@pytest.mark.parametrize("sync", SYNCS)
def test_a_streak_the_weights_do_not_reproduce_is_not_restored(tmp_path, sync):
    """Steps 10 and 11 of a healthy model are NaN and the fit ends there: the same batches are NaN on the
    snapshot's weights too (the batch's fault, not the weights'), so the weights after step 9 are kept."""
    model = NaNOn(bad={10, 11})
    guard, weights = _guarded(tmp_path, model, sync, recovery={"snapshot_every": 4}, max_steps=12, max_epochs=-1)
    assert [e.step for e in guard.events] == [10, 11]
    assert _equal(weights.states[9], model)


class OneOff(NaNOn):
    """NaN the first time the batches ``bad`` are seen only (a hardware hiccup): a replay or rerun is finite."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__(bad)
        self.seen: set[int] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = models.Regression.training_step(self, batch, batch_idx)
        first = batch_idx in self.bad and batch_idx not in self.seen
        self.seen.add(batch_idx)
        return loss * NAN if first else loss


@pytest.mark.parametrize("sync", SYNCS)
def test_a_one_off_fault_at_the_end_is_not_restored(tmp_path, sync):
    """Rerun on the final weights the last incident's batch is finite: nothing the weights did."""
    model = OneOff(bad={10, 11})
    guard, weights = _guarded(tmp_path, model, sync, recovery={"snapshot_every": 4}, max_steps=12, max_epochs=-1)
    assert [e.step for e in guard.events] == [10, 11]
    assert guard.events[-1].details["replay"]["reproduced"] is False
    assert _equal(weights.states[9], model)


def test_a_streak_that_cannot_be_rerun_is_taken_as_suspect(tmp_path):
    """anomaly.mode: off (no rerun of the user's training_step): the safe side, the newest snapshot."""
    model = NaNOn(bad={10, 11})
    pl.seed_everything(0, verbose=False)
    guard = NaNGuard(anomaly={"mode": "off"}, recovery={"snapshot_every": 4}, logging={"verbose": False})
    spy = models.SnapshotSpy(guard)
    models.trainer(tmp_path, [guard, spy], max_steps=12).fit(model, models.loader(models.regression_data(), 16))
    *_, end = guard.events
    assert (end.kind, end.actions, end.details["restored_step"]) == ("parameter", ["rollback"], 8)
    assert "cannot be rerun (anomaly.mode: off)" in end.details["reason"] and "rerun_at_end" not in end.details
    assert _equal(spy.states[8]["module"], model)


@pytest.mark.parametrize("sync, steps", [("eager", 7), ("lagged", 8)])
def test_a_divergence_running_away_again_at_the_end_is_restored(tmp_path, sync, steps):
    """The demo's too-high LR with an LR cut that can do nothing (recovery.min_lr_scale: 0.99): the divergence
    at step 3 rolls back to step 0, and the loss runs away again at once. The fit ends before the watch fires
    again (lagged: SGD cannot skip on the device, the rollback comes a step later): unresolved, restored."""
    model = models.Regression(lr=1.5)
    initial = copy.deepcopy(model.state_dict())
    trace = LossTrace()
    pl.seed_everything(0, verbose=False)
    guard = NaNGuard(check={"sync": sync}, recovery={"min_lr_scale": 0.99}, logging={"verbose": False})
    models.trainer(tmp_path, [trace, guard], max_steps=steps).fit(model, models.loader(models.regression_data()))
    assert all(b >= 2 * a for a, b in zip(trace.losses[-3:], trace.losses[-2:]))  # running away at the end
    first, end = guard.events
    assert (first.kind, first.step, first.details["restored_step"]) == ("divergence", 3, 0)
    assert (end.kind, end.actions, end.details["detected_at"]) == ("divergence", ["rollback"], "train_end")
    assert end.details["restored_step"] == 0 and end.details["source_step"] == 3
    assert "grew again after the rollback of step 3" in end.details["reason"]
    assert _equal(initial, model)


def test_a_divergence_left_to_run_with_warn_is_not_restored(tmp_path):
    """check.divergence: warn never rolls back, at the end of fit neither: the same run as above, bitwise the run
    without the guard."""
    weights = []
    for guard in (None, NaNGuard(check={"divergence": "warn"}, recovery={"min_lr_scale": 0.99},
                                 logging={"verbose": False})):
        pl.seed_everything(0, verbose=False)
        model = models.Regression(lr=1.5)
        models.trainer(tmp_path / str(guard is None), [guard] if guard else [], max_steps=7).fit(
            model, models.loader(models.regression_data()))
        weights.append(model.state_dict())
    assert [(e.kind, e.actions) for e in guard.events] == [("divergence", ["warn"])]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])

