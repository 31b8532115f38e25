"""The recovery ladder (lightning_nanguard/recover/ladder.py), a pure state machine, driven directly with its real
types: no Trainer, no tensors. The fits that check the same rungs end to end are in test_recovery.py."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from lightning_nanguard.config import ClipConfig, RecoveryConfig
from lightning_nanguard.core.causes import CAUSES
from lightning_nanguard.recover.ladder import LARGEST_CUT, Episode, Plan, RecoveryLadder

LR_ADVICE = CAUSES["learning_rate"].advice


def ladder(**recovery: Any) -> RecoveryLadder:
    return RecoveryLadder(RecoveryConfig(**recovery), ClipConfig())


def loss(lad: RecoveryLadder, step: int, cause: Optional[str] = "unknown", safe_factor: Optional[float] = None,
         kind: str = "loss") -> Plan:
    """An incident of ``kind`` at ``step`` with a snapshot to roll back to and clipping already armed."""
    return lad.incident(step, kind, can_roll_back=True, cause=cause, safe_factor=safe_factor, clip_armed=True)


def divergence(lad: RecoveryLadder, step: int = 3, safe_factor: Optional[float] = 0.01) -> Plan:
    """A too-high LR caught running away at ``step``: rollback and a cut sized to ``safe_factor``."""
    return loss(lad, step, "learning_rate", safe_factor, kind="divergence")


# ------------------------------------------------------------------------------------------- the episode


def test_a_cause_of_the_runs_dynamics_opens_an_episode() -> None:
    lad = ladder()
    plan = loss(lad, 5, "exploding_gradient")
    assert lad.episode == Episode("exploding_gradient", 5, 5)
    assert (plan.cause, plan.episode_since, plan.suggestion) == ("exploding_gradient", None, None)  # its own


@pytest.mark.parametrize("cause", [None, "unknown", "input", "transient", "overflow", "domain", "backward_op"])
def test_no_episode_from_an_unexplained_incident_nor_from_one_of_its_own_batch_or_op(cause) -> None:
    lad = ladder()
    loss(lad, 5, cause)
    assert lad.episode is None
    later = loss(lad, 6)
    assert (later.cause, later.episode_since) == ("unknown", None)  # nothing to inherit


def test_an_unexplained_incident_of_the_episode_reports_the_episodes_cause() -> None:
    lad = ladder(max_skips=10)
    divergence(lad, 3)
    for step in (8, 9):
        plan = loss(lad, step, "unknown")
        assert (plan.cause, plan.episode_since) == ("learning_rate", 3)
        assert plan.suggestion == "Part of the episode that began at step 3 (learning_rate). " + LR_ADVICE
        assert plan.reasons[-1].startswith("cause learning_rate: its episode's (since step 3)")
    undiagnosed = loss(lad, 10, None)  # diagnosis off: the contract's null cause stays null
    assert (undiagnosed.cause, undiagnosed.episode_since, undiagnosed.suggestion) == (None, None, None)
    assert lad.episode == Episode("learning_rate", 3, 10)


def test_an_incident_with_a_cause_of_its_own_reports_it_and_keeps_the_episode() -> None:
    lad = ladder(max_skips=10)
    divergence(lad, 3)
    plan = loss(lad, 8, "input", kind="input")
    assert (plan.cause, plan.episode_since, plan.suggestion) == ("input", None, None)
    assert not any(r.startswith("cause ") for r in plan.reasons)
    assert loss(lad, 9).cause == "learning_rate"  # the episode's cause is its first diagnosis, still


@pytest.mark.parametrize("gap, inherits", [(4, True), (5, False)])
def test_the_episode_ends_incident_window_steps_after_its_latest_incident(gap, inherits) -> None:
    window = 5
    lad = ladder(incident_window=window, max_skips=10)
    divergence(lad, 3)
    loss(lad, 3 + window - 1)  # within the window: it belongs, and the window counts from it
    lad.healthy()
    plan = loss(lad, 3 + window - 1 + gap)
    assert (plan.cause == "learning_rate") is inherits
    assert (lad.episode is not None) is inherits


def test_a_confirming_snapshot_ends_the_episode_and_a_healthy_step_does_not() -> None:
    lad = ladder(max_skips=10)
    divergence(lad, 3)
    lad.healthy()
    assert loss(lad, 8).cause == "learning_rate"
    lad.snapshot_taken()
    assert lad.episode is None
    assert loss(lad, 9).cause == "unknown"


def test_the_episode_survives_the_ladders_state_dict() -> None:
    lad = ladder(max_skips=10)
    divergence(lad, 3)
    loss(lad, 7)
    state = lad.state_dict()
    assert (state["episode_cause"], state["episode_since"], state["episode_last"]) == ("learning_rate", 3, 7)
    loaded = ladder(max_skips=10)
    loaded.load_state_dict(state)
    assert loaded.episode == lad.episode and loss(loaded, 8) == loss(lad, 8)
    fresh = ladder()
    fresh.load_state_dict({k: v for k, v in state.items() if not k.startswith("episode")})  # an older state
    assert fresh.episode is None and loss(fresh, 8).cause == "unknown"


# ------------------------------------------------------------------------------- the rungs, and the policy


def test_a_sized_cut_goes_to_the_safe_lr_and_no_further_than_the_largest_cut() -> None:
    lad = ladder()
    plan = divergence(lad, safe_factor=0.01)
    assert plan.rollback and plan.reduce_lr and plan.lr_factor == 0.01 and lad.sized_cut
    assert divergence(ladder(), safe_factor=1e-9).lr_factor == LARGEST_CUT
    calm = ladder()
    mild = divergence(calm, safe_factor=0.5)  # the divergence factor cuts further: no sized exemption
    assert mild.reduce_lr and mild.lr_factor == RecoveryConfig().divergence_lr_factor and not calm.sized_cut


def test_the_ladder_after_a_sized_cut_spares_only_the_first_forced_rollback() -> None:
    """The ladder's side of test_recovery's fit of the same name: NaN losses in pairs (max_skips: 1) force rollbacks
    inside the episode; every incident reports learning_rate, the first forced rollback does not cut, the second
    cuts by lr_factor (an undiagnosed incident's cut, not a second sized one)."""
    lad = ladder(max_skips=1)
    first = divergence(lad, 3)
    plans = [loss(lad, s) for s in (8, 9, 12, 13)]
    assert [p.cause for p in [first, *plans]] == ["learning_rate"] * 5
    assert [(p.rollback, p.reduce_lr) for p in plans] == [(False, False), (True, False), (False, False), (True, True)]
    assert plans[1].go_further_back and "no LR cut: the LR was cut to the diagnosis' safe LR" in plans[1].reasons[1]
    assert plans[3].lr_factor is None  # recovery.lr_factor
    assert plans[3].reasons[1] == "skipping did not help"


def test_the_inherited_cause_never_cuts_the_lr_at_once() -> None:
    """The split: the first incident of a streak (after a healthy step) inside a learning_rate episode is
    planned by its own diagnosis: unknown does not cut; a learning_rate it measures itself (a safe LR below the
    current one) does, sized again."""
    lad = ladder(max_skips=10)
    divergence(lad, 3)
    lad.healthy()
    inherited = loss(lad, 8)
    assert inherited.cause == "learning_rate" and not inherited.reduce_lr
    lad.healthy()
    measured = loss(lad, 9, "learning_rate", safe_factor=0.05)
    assert measured.reduce_lr and measured.lr_factor == 0.05 and measured.episode_since is None
    assert measured.reasons == ("the learning rate is too high",)


@pytest.mark.parametrize("safe_factor, echo", [(None, True), (1.7, True), (1.0, False)])
def test_an_echo_of_the_episodes_sized_cause_is_planned_as_undiagnosed(safe_factor, echo) -> None:
    """A learning_rate diagnosis reused from an earlier incident (anomaly.max_replays spent) whose own evidence has
    no safe LR below the current one: no second sized cut, reported as the episode's. A safe LR at the current one
    (a relative update of exactly 1) is a measured learning_rate: it cuts."""
    lad = ladder(max_skips=10)
    divergence(lad, 3)
    lad.healthy()
    plan = loss(lad, 8, "learning_rate", safe_factor=safe_factor)
    assert plan.reduce_lr is not echo and (plan.episode_since == 3) is echo and plan.cause == "learning_rate"
    outside = ladder(max_skips=10)  # outside an episode the same incident opens one and cuts
    first = loss(outside, 8, "learning_rate", safe_factor=safe_factor)
    assert first.reduce_lr and first.lr_factor == RecoveryConfig().divergence_lr_factor


def test_escalation_to_rollback_further_back_and_give_up_inside_the_episode() -> None:
    lad = ladder(max_skips=2, max_rollbacks=3)
    divergence(lad, 3)  # rollback 1 (unconfirmed)
    plans = [loss(lad, s) for s in range(10, 19)]
    assert [i for i, p in enumerate(plans) if p.rollback] == [2, 5]
    assert all(p.go_further_back for p in plans if p.rollback)  # the divergence's rollback was not confirmed
    assert [p.give_up for p in plans] == [False] * 8 + [True]
    assert plans[8].cause == "learning_rate"
    assert plans[8].reasons[0] == "3 rollback(s) did not help (recovery.max_rollbacks=3)"


def test_a_cause_that_gives_up_does_so_at_once() -> None:
    lad = ladder()
    plan = loss(lad, 0, "initialization", kind="parameter")
    assert plan.give_up and not plan.rollback and plan.cause == "initialization"
