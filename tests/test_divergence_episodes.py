"""The divergence watch after its first episode (``lightning_nanguard/detect/divergence.py``, docs/recovery.md),
through real fits: a second episode later in the same fit is caught again (the growth latch re-arms after a step
without growth, the far-above latch once the loss is back below ``divergence_factor`` times the first loss); one
event per episode, however long; the far-above and the growth rules never report the same episode twice; and
after a rollback the watch is the snapshot's, so an episode like the one rolled back is caught again.

The loss the guard reads is scripted per batch (a level times a factor) while the gradients are those of the real
MSE, so training is real and the episodes are exact; one test raises the learning rate itself, twice.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch

from lightning_nanguard import NaNGuard
from . import models

MODES = ["eager", "lagged"]
QUIET = {"verbose": False, "events_file": False, "reports": False}


class Scripted(models.Regression):
    """nn.Linear + SGD (fused: it can skip on the device under lagged reads) whose loss *value* at batch ``i`` is
    ``values(i)``; its gradient is the real MSE's (a detached offset), so the weights train as usual."""

    def __init__(self, values: Callable[[int], float]) -> None:
        super().__init__(lr=0.05)
        self.values = values

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss - loss.detach() + self.values(batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)


def episodes(*spans: tuple[int, Callable[[int], float]]) -> Callable[[int], float]:
    """A loss of 1.0 (the first loss too), except on each ``(start, f)`` span, where the loss at ``start + i`` is
    ``f(i)`` while ``f(i)`` is not None."""

    def value(step: int) -> float:
        for start, f in spans:
            if step >= start and f(step - start) is not None:
                return float(f(step - start))
        return 1.0

    return value


def fit_scripted(fit, sync: str, values: Callable[[int], float], steps: int, divergence: str = "warn", subdir=None,
                 **sections: Any) -> NaNGuard:
    """A fit of ``steps`` steps (one epoch, batches of 16) on the scripted loss; spikes off, the divergence watch
    in ``divergence`` mode; returns the guard."""
    pl.seed_everything(0, verbose=False)
    check = dict(sections.pop("check", {}), sync=sync, divergence=divergence, spike_action="off")
    g = NaNGuard(check=check, logging=QUIET, **sections)
    fit(Scripted(values), models.regression_data(n=16 * steps), [g], subdir=subdir or sync, batch_size=16, steps=steps)
    assert g.lagged is (sync == "lagged")
    return g


def divergences(g: NaNGuard) -> list[tuple[int, str, int]]:
    """``(step, rule, onset step)`` of each divergence event."""
    return [(e.step, e.details["divergence"]["rule"], e.details["divergence"]["onset_step"])
            for e in g.events if e.kind == "divergence"]


# ---------------------------------------------------------------------- one event per episode, re-armed


@pytest.mark.parametrize("sync", MODES)
def test_a_long_growth_episode_is_one_event_and_a_later_one_is_caught_again(fit, sync):
    """Episode 1: the loss grows 4x per step for 8 steps (10-17): one loss_growth event, at the third growth step
    (12, onset 9), not one per step. Back at 1.0 (a step without growth re-arms the latch), episode 2 (28-30)
    grows 100x per step, to 10x above everything before it including episode 1: caught again, at 30."""
    values = episodes((10, lambda i: 4.0 ** (i + 1) if i < 8 else None),
                      (28, lambda i: 100.0 ** (i + 1) if i < 3 else None))
    g = fit_scripted(fit, sync, values, steps=40)
    assert divergences(g) == [(12, "loss_growth", 9), (30, "loss_growth", 27)]
    assert [e.actions for e in g.events] == [["warn"], ["warn"]] and g.counters["incidents"] == 2


@pytest.mark.parametrize("sync", MODES)
def test_a_long_far_above_episode_is_one_event_and_a_later_one_is_caught_again(fit, sync):
    """Episode 1: the loss jumps to 1000x the first loss and stays there for 10 steps (10-19): one
    loss_above_first event after divergence_steps + 2 = 5 steps above (14), none for the 5 steps after. Back below
    100x the first loss (re-armed), episode 2 (30-39) at 20000x, 10x every loss before it: caught again, at 34."""
    values = episodes((10, lambda i: 1000.0 if i < 10 else None), (30, lambda i: 20000.0 if i < 10 else None))
    g = fit_scripted(fit, sync, values, steps=44)
    assert divergences(g) == [(14, "loss_above_first", 9), (34, "loss_above_first", 29)]
    assert g.counters["incidents"] == 2


GROWTHS = {  # the loss from step 10, and the one event it makes
    # 3x per step (a loss_growth event at its third step, 12, still below 100x the first loss), then 20x per step:
    # far above the first loss, each loss 10x above every one before, for 6 more steps
    "then_far_above": (lambda i: 3.0 ** (i + 1) if i < 3 else 27.0 * 20.0 ** (i - 2) if i < 9 else None,
                       (12, "loss_growth", 9)),
    # 10x per step for 8 steps: already far above the first loss (100x at step 11) when the blow-up rule fires there
    "already_far_above": (lambda i: 10.0 ** (i + 1) if i < 8 else None, (11, "loss_blowup", 9)),
}


@pytest.mark.parametrize("sync", MODES)
@pytest.mark.parametrize("shape", sorted(GROWTHS))
def test_a_growth_episode_that_goes_on_far_above_is_reported_once(fit, sync, shape):
    """A loss growing from step 10 is caught by a growth rule (onset 9); it keeps growing, far above the first loss
    for more than divergence_steps + 2 steps: the same episode, which the far-above rule must not report again,
    whether it was already far above when the growth rule fired or got there after."""
    values, event = GROWTHS[shape]
    g = fit_scripted(fit, sync, episodes((10, values)), steps=24)
    assert divergences(g) == [event]


@pytest.mark.parametrize("sync", MODES)
def test_a_far_above_episode_that_goes_on_growing_is_reported_once(fit, sync):
    """The loss jumps to 1000x and stays (a loss_above_first event at 14), then grows 10x per step from 15 to 18,
    still the same episode: the growth rules must not report it again. Back at 1.0, a fresh blow-up far above
    everything before (1e7, then 100x per step from 22) is a new episode: loss_blowup at its second step."""
    values = episodes((10, lambda i: 1000.0 if i < 5 else 1000.0 * 10.0 ** (i - 4) if i < 9 else None),
                      (22, lambda i: 1e7 * 100.0 ** i if i < 3 else None))
    g = fit_scripted(fit, sync, values, steps=28)
    assert divergences(g) == [(14, "loss_above_first", 9), (23, "loss_blowup", 21)]


def test_the_demo_warned_reports_its_one_blow_up_once(fit):
    """The demo's too-high LR (SGD at lr=1.5) with check.divergence: warn, left to run: the loss grows 4-11x at every
    step for 30 steps, one episode. It is reported once (loss_growth at step 3), not again by the far-above rule
    when a step grows more than 10x (the eager run, bitwise the run without a guard)."""
    guard = NaNGuard(check={"divergence": "warn"}, logging=QUIET)
    losses: list[float] = []

    class Trace(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    fit(models.Regression(lr=1.5), models.regression_data(n=1024), [Trace(), guard], steps=30)
    assert all(math.isfinite(v) for v in losses) and all(b > 2 * a for a, b in zip(losses, losses[1:]))
    assert [(e.step, e.kind, e.actions, e.details["divergence"]["rule"]) for e in guard.events] == [
        (3, "divergence", ["warn"], "loss_growth")]


# ------------------------------------------------------------------------------ after a rollback


@pytest.mark.parametrize("sync", MODES)
@pytest.mark.parametrize("rule", ["loss_growth", "loss_above_first"])
def test_after_a_rollback_the_watch_is_the_snapshots_and_catches_the_same_episode_again(fit, sync, rule):
    """check.divergence: act. Episode 1 (from step 10) is caught, skipped and rolled back to the snapshot from
    before its onset, and with it the watch: the losses of the episode are forgotten. Episode 2, the same
    shape later (from step 30), is caught again; a watch still holding episode 1 would take its level as the record
    to beat (10x the growth's last loss, 10x the level above the first loss) and miss it."""
    shape = {"loss_growth": lambda i: 4.0 ** (i + 1) if i < 3 else None,
             "loss_above_first": lambda i: 1000.0 if i < 5 else None}[rule]
    g = fit_scripted(fit, sync, episodes((10, shape), (30, shape)), steps=40, divergence="act",
                     recovery={"snapshot_every": 5})
    fired = {"loss_growth": 12, "loss_above_first": 14}[rule]
    assert divergences(g) == [(fired, rule, 9), (fired + 20, rule, 29)]
    first, second = g.events
    assert first.details["restored_step"] == 5  # the newest snapshot from before the onset (10 was taken after it)
    assert first.step < second.details["restored_step"] <= 29  # a snapshot taken after the first rollback
    assert all("rollback" in e.actions and "reduce_lr" in e.actions for e in g.events)
    assert g.counters["rollbacks"] == 2 and g.counters["incidents"] == 2


def test_a_second_lr_raise_is_a_second_divergence_after_the_first_rollback(fit):
    """A real divergence, twice: the test's own callback sets the LR to 1.5 (the demo's) at step 5 and again at step
    40 (overriding the guard's cut). Each blow-up is one divergence event with a rollback to a snapshot from before
    it and an LR cut, the second caught though its losses stay below the first's (the watch came back with the
    snapshot); no loss is ever non-finite. (Adaptive clipping off: armed by the first event, it would slow the
    second blow-up into persistent clipping instead.)"""
    guard = NaNGuard(logging=QUIET, clip={"adaptive": "off"})
    losses: list[float] = []

    class RaiseLR(pl.Callback):  # listed before the guard
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step in (5, 40):
                for group in trainer.optimizers[0].param_groups:
                    group["lr"] = 1.5

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    fit(models.Regression(lr=0.05), models.regression_data(n=1024), [RaiseLR(), guard], batch_size=16, steps=64)
    assert [(e.kind, e.details["divergence"]["rule"]) for e in guard.events] == [("divergence", "loss_growth")] * 2
    first, second = (e.details["divergence"] for e in guard.events)
    assert 5 <= first["onset_step"] < guard.events[0].step < 40 <= second["onset_step"] < guard.events[1].step
    assert max(second["losses"]) < max(first["losses"])  # below the first episode's record: caught all the same
    assert guard.events[0].details["restored_step"] == 0
    assert guard.events[0].step < guard.events[1].details["restored_step"] <= second["onset_step"]
    assert all(e.actions == ["skip_step", "rollback", "reduce_lr"] for e in guard.events)
    assert guard.counters["lr_cuts"] == 2 and guard.lr_scale < 0.01
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
