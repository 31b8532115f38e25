"""The incident pipeline's skeleton (lightning_nanguard/respond/responder.py) and the endings it calls
(respond/endings.py), on real fits: the bound fit, each stage's actions written into the event in order, a forced
rollback of a step applied before it was judged, and a give-up's end (stop, or raise with the give-up message)."""

from __future__ import annotations

import copy

import pytest

from lightning_nanguard import NaNGuard, NaNGuardError
from lightning_nanguard.config import RecoveryConfig
from lightning_nanguard.core.events import NaNEvent
from lightning_nanguard.respond.endings import give_up_message, suspect_hardware
from lightning_nanguard.respond.responder import Fit, Responder
from . import models

QUIET = {"verbose": False}


def test_the_responder_is_bound_to_its_fit_and_a_copy_is_not(fit_steps):
    guard = NaNGuard(logging=QUIET)
    with pytest.raises(RuntimeError, match="before setup bound the guard"):
        _ = guard._responder.fit
    trainer = fit_steps(models.Regression(lr=0.01), [guard], steps=3)
    responder: Responder = guard._responder
    assert isinstance(responder.fit, Fit) and responder.fit.trainer is trainer and responder.fit.automatic
    copied = copy.deepcopy(guard)
    with pytest.raises(RuntimeError):
        _ = copied._responder.fit


class NaNLossAt(models.Regression):
    """Healthy nn.Linear + SGD whose loss is NaN at the given optimizer steps (its replay reproduces it)."""

    def __init__(self, nan_steps: range) -> None:
        super().__init__(lr=0.01)
        self.nan_steps = nan_steps

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step in self.nan_steps else loss


def test_a_streak_skips_then_rolls_back_in_the_order_the_event_records(fit_steps):
    recovery = {"max_skips": 2, "snapshot_every": 4, "skip_batches": 1, "reduce_lr_on_rollback": True}
    guard = NaNGuard(recovery=recovery, logging=QUIET)
    fit_steps(NaNLossAt(range(9, 12)), [guard], steps=16)
    assert [e.actions for e in guard.events][:2] == [["skip_step", "clip"], ["skip_step"]]  # (clip: armed at once)
    rolled = guard.events[2]
    assert rolled.actions == ["skip_step", "rollback", "skip_batches", "reduce_lr"], rolled.cause
    assert rolled.details["restored_step"] == 8 and rolled.details["skip_batches"] == 1
    assert rolled.details["reasons"][0] == "2 skipped step(s) did not help"
    factor = RecoveryConfig().lr_factor
    assert rolled.details["lr_after"] == [pytest.approx(factor * lr) for lr in rolled.details["lr_before"]]
    assert guard.counters["rollbacks"] == 1 and guard.counters["lr_cuts"] == 1


@pytest.mark.parametrize("on_give_up", ["stop", "raise"])
def test_a_give_up_ends_the_run_as_on_give_up_says(make_trainer, on_give_up):
    guard = NaNGuard(recovery={"max_skips": 1, "max_rollbacks": 1, "snapshot_every": 2, "on_give_up": on_give_up},
                     logging=QUIET)
    trainer = make_trainer([guard], max_steps=40, max_epochs=-1)
    data = models.loader(models.regression_data(n=512), 16)
    if on_give_up == "raise":
        with pytest.raises(NaNGuardError, match=r"NaNGuard gave up at step \d+ after \d+ incident\(s\) and 1 "
                                                r"rollback\(s\); the module, optimizers and LR schedulers were "
                                                r"restored to the last known-good state, the snapshot of step 4"):
            trainer.fit(NaNLossAt(range(4, 40)), data)
    else:
        trainer.fit(NaNLossAt(range(4, 40)), data)
        assert trainer.should_stop and trainer.global_step < 40
    last = guard.events[-1]
    assert last.actions[-1] == on_give_up and last.details["restored_step"] == 4
    assert guard._recovery.stopped


def test_the_endings_say_what_was_restored_and_which_hardware_is_suspect():
    event = NaNEvent(step=12, epoch=0, batch_idx=12, kind="gradient", rank=3, host="node7", device="cuda:1",
                     local_rank=1, cause="transient", suggestion="Replayed clean.")
    nothing = give_up_message(event, None, "recovery.snapshot is 'off'", 5, 2, [{"name": "w"}], "r.md")
    assert "nothing could be restored (recovery.snapshot is 'off'): the weights are left NON-FINITE (w)" in nothing
    finite = give_up_message(event, None, None, 5, 2, [], "r.md")
    assert "are left as they were before step 12 (finite; that step was not applied)" in finite
    cfg = RecoveryConfig(transient_limit=2, transient_window=100, on_suspect_hardware="stop")
    message = suspect_hardware(event, [3, 7, 12], cfg)
    assert "3 faults that did not come back within 100 steps (steps 3, 7, 12" in message and "node7" in message
    assert event.actions == ["stop"] and event.details["suspect_hardware"]["rank"] == 3
    assert event.suggestion.startswith("Replayed clean. The hardware of")
