"""Actions as values (lightning_nanguard/recover/actions.py): the vocabulary is the classes, a plan is a frozen tuple
of them that the ladder fills, and :meth:`Recovery.apply` is one loop that carries each out on a real fit. A new
action is one class: the test's own ``ResetMoments`` is carried out by the same loop, with no other edit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import pytorch_lightning as pl
import torch

from lightning_nanguard import NaNGuard
from lightning_nanguard.config import ClipConfig, RecoveryConfig
from lightning_nanguard.recover.actions import (ACTIONS, Action, Applied, Clip, CutLr, GiveUp, Hands, Raise, RollBack,
                                                SkipBatches, SkipStep, Stop, Warn, action_named, give_up)
from lightning_nanguard.recover.ladder import Plan, RecoveryLadder
from . import models

QUIET = {"verbose": False}
# the contract's vocabulary, in its order (shared/CONTRACT.md, the event's ``actions`` row)
CONTRACT = ["skip_step", "clip", "reduce_lr", "rollback", "skip_batches", "stop", "raise", "warn"]


def test_the_action_vocabulary_is_the_classes():
    assert list(ACTIONS) == CONTRACT
    for name, meaning in ACTIONS.items():
        cls = action_named(name)
        assert cls.name == name and cls.meaning == meaning and meaning
        with pytest.raises(dataclasses.FrozenInstanceError):
            cls().anything = 1  # type: ignore[attr-defined]
    assert give_up("stop") == Stop() and give_up("raise") == Raise()
    assert isinstance(Stop(), GiveUp) and not isinstance(Warn(), GiveUp)
    with pytest.raises(ValueError, match="unknown action 'pray'; allowed: .*'skip_step'"):
        action_named("pray")
    with pytest.raises(ValueError, match="recovery.on_give_up='warn'"):
        give_up("warn")
    assert {cls.name for cls in (SkipStep, Clip) if cls.on_the_step} == {"skip_step", "clip"}
    assert not any(action_named(n).on_the_step for n in CONTRACT if n not in ("skip_step", "clip"))


def test_a_plan_is_a_frozen_tuple_of_actions_that_its_views_read():
    plan = Plan((Clip(), RollBack(before=4, further=True), SkipBatches(3), CutLr(0.25)), ("why",))
    assert (plan.arm_clip, plan.rollback, plan.go_further_back, plan.rollback_before) == (True, True, True, 4)
    assert (plan.skip_batches, plan.reduce_lr, plan.lr_factor, plan.give_up) == (3, True, 0.25, False)
    assert plan.find(CutLr) == CutLr(0.25) and plan.find(GiveUp) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.actions = ()  # type: ignore[misc]
    empty = Plan()
    assert (empty.rollback, empty.reduce_lr, empty.lr_factor, empty.skip_batches) == (False, False, None, 0)


def test_the_ladder_plans_in_actions_and_a_forced_rollback_is_a_new_plan():
    ladder = RecoveryLadder(RecoveryConfig(max_skips=1, skip_batches=2, max_rollbacks=1), ClipConfig(adaptive="off"))
    assert ladder.incident(0, "loss", can_roll_back=True).actions == ()  # the step is skipped, nothing else
    rolled = ladder.incident(1, "loss", can_roll_back=True, rollback_before=0)
    assert rolled.actions == (RollBack(before=0), SkipBatches(2), CutLr(None))
    assert rolled.reasons[0] == "1 skipped step(s) did not help"
    ladder.incident(2, "loss", can_roll_back=True)
    gave_up = ladder.incident(3, "loss", can_roll_back=True)  # the rollback was not confirmed: 1 >= max_rollbacks
    assert gave_up.actions == (Stop(),) and gave_up.give_up
    # a step applied before it was judged: the rollback is added to a new plan, the old one is left as it was
    fresh = RecoveryLadder(RecoveryConfig(skip_batches=1), ClipConfig(adaptive="off"))
    cut = Plan((CutLr(0.5),), ("loss spike",))
    forced = fresh.must_roll_back(cut, can_roll_back=True, reason="applied")
    assert cut.actions == (CutLr(0.5),) and cut.reasons == ("loss spike",)
    assert forced.actions == (RollBack(), SkipBatches(1), CutLr(0.5)) and forced.reasons == ("loss spike", "applied")
    assert fresh.must_roll_back(forced, can_roll_back=True, reason="again") is forced  # it rolls back already


@dataclass(frozen=True)
class ResetMoments(Action):
    """A new action, written as a user extending the guard would: one class (outside the vocabulary: an event does
    not record it)."""

    name: ClassVar[str] = "reset_moments"
    meaning: ClassVar[str] = "the optimizers' moments were cleared"

    def carry_out(self, hands: Hands, done: Applied) -> Applied:
        cleared = sum(len(opt.state) for opt in hands.trainer.optimizers)
        for opt in hands.trainer.optimizers:
            opt.state.clear()
        return done.then(self, details={"moments_cleared": cleared})


class ApplyAt(pl.Callback):
    """At the start of step ``at``, carry out ``plan`` with the guard's own recovery, as its incident pipeline does
    at a step's end (after the guard's callbacks of the step before)."""

    def __init__(self, guard: NaNGuard, at: int, plan: Plan) -> None:
        self.guard, self.at, self.plan = guard, at, plan
        self.done: Applied = Applied()
        self.skip_left = -1
        self.lr_after: list[float] = []
        self.moments_after = -1

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at:
            recovery = self.guard._recovery
            self.done = recovery.apply(trainer, pl_module, self.plan, trainer.global_step)
            self.skip_left = recovery.skip_batches_left
            self.lr_after = [g["lr"] for g in trainer.optimizers[0].param_groups]
            self.moments_after = len(trainer.optimizers[0].state)


def _fit(fit_steps: Any, plan: Plan, **recovery: Any) -> tuple[NaNGuard, ApplyAt, pl.Trainer]:
    guard = NaNGuard(recovery={"snapshot_every": 4, **recovery}, logging=QUIET)
    spy = ApplyAt(guard, 6, plan)
    trainer = fit_steps(models.Regression(lr=0.01, optimizer="adamw"), [guard, spy], steps=10)
    return guard, spy, trainer


def test_recovery_apply_carries_out_each_action_in_order_on_a_real_fit(fit_steps):
    guard, spy, trainer = _fit(fit_steps, Plan((Clip(), RollBack(), SkipBatches(2), CutLr(0.5)), ("test",)))
    done = spy.done
    # the clip acts on the step itself (the pipeline's skip stage): the plan's loop leaves it
    assert done.actions == (RollBack(), SkipBatches(2), CutLr(0.5))
    assert done.rollback is not None and done.restored is not None and done.restored.step == 4
    assert done.details["restored_step"] == 4 and done.details["skip_batches"] == 2
    assert done.details["lr_after"] == [pytest.approx(0.5 * lr) for lr in done.details["lr_before"]]
    assert done.details["reasons"] == ["test"] and done.details["lr_scale"] == 0.5
    assert spy.skip_left == 2 and spy.lr_after == done.details["lr_after"]
    assert guard.counters["rollbacks"] == 1 and guard.counters["lr_cuts"] == 1
    assert guard.counters["skipped_steps"] >= 2  # the two batches after the rollback
    assert guard.events == []  # applied by hand: no incident recorded


def test_a_rollback_with_no_snapshot_store_does_nothing_and_the_batches_are_not_skipped(fit_steps):
    guard, spy, _ = _fit(fit_steps, Plan((RollBack(), SkipBatches(2), CutLr(0.5))), snapshot="off")
    assert spy.done.actions == (CutLr(0.5),) and spy.done.rollback is None and spy.skip_left == 0
    assert guard.counters["rollbacks"] == 0 and guard.counters["skipped_steps"] == 0


def test_a_new_action_is_one_class_that_the_same_loop_carries_out(fit_steps):
    guard, spy, trainer = _fit(fit_steps, Plan((ResetMoments(), CutLr(0.5))))
    assert spy.done.actions == (ResetMoments(), CutLr(0.5)) and spy.done.details["moments_cleared"] > 0
    assert spy.moments_after == 0  # cleared by the step's start; the step then made new ones
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
    assert "reset_moments" not in ACTIONS  # outside the vocabulary until it is listed in recover/actions.py
