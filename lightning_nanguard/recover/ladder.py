"""The recovery ladder as a small, pure state machine.

The guard reports what happened at each optimizer step (``healthy()``, ``incident(...)``,
``snapshot_taken()``); the ladder answers with a :class:`Plan` of what to do. No tensors, no Lightning:
every rung is unit-testable in isolation. What a cause or an event kind calls for is read from their tables
(:mod:`lightning_nanguard.core.causes`, :data:`lightning_nanguard.core.events.KINDS`); no name is spelled here.

Rungs, in order of escalation:

1. every incident skips the step (and undoes buffer writes);
2. adaptive clipping is armed after the first incident whose cause ``arms_clip`` (``clip.adaptive:
   on_incident``);
3. the LR is cut on evidence that the dynamics diverge, and only then: the cause's ``lr_cut`` policy decides.

   - ``at_once`` and ``sized``: cut at the first incident of a run of incidents, and again after each rollback
     forced because skipping did not help; ``at_once`` by ``lr_factor`` (a NaN after a gradient outlier may
     be a one-off), ``sized`` and any runaway kind (a ``divergence``: a run caught running away is past the
     edge of stability) by ``recovery.divergence_lr_factor`` and, for ``sized``, further if that is not
     enough: down to the LR at which the diagnosis' relative update would be safe (``safe_lr`` in its
     evidence: SGD moving the weights by at most their own size per step, or a quarter of the edge of
     stability its gradient norm's growth rate implies if lower; an adaptive optimizer's largest step at 5%
     of their RMS; at most 10,000-fold in one cut). After such a sized cut, the first rollback of the same
     episode does not cut again: the LR is already where the diagnosis calls it safe, and the incidents that
     forced the rollback come from the weights that grew before the cut (which the rollback undoes); a
     further failed rollback cuts;
   - ``never``: a problem a smaller LR cannot fix (bad data, bad weights, a dtype's range, an op's domain);
   - ``escalation`` (and an incident without a diagnosis): cut after a rollback forced because skipping did
     not help (``reduce_lr_on_rollback``) and, if ``reduce_lr_after > 0``, after that many incidents that
     count ``in_incident_window`` within ``incident_window`` steps;
4. more than ``max_skips`` consecutive incidents (a cause that does not ``count_toward_rollback``, a fault that
   does not come back, counts only when the step after it fails too: isolated, it is skipped and nothing else),
   bad weights (a kind whose evidence is the ``weights``), or
   a ``runaway`` kind (finite, but running away: skipping its step does not stop it) roll back to the newest
   snapshot; a rollback that is not followed by a new snapshot counts as failed, and the next one goes one
   snapshot further back (the guard takes that confirming snapshot ``confirm_after`` healthy steps after a
   rollback, so isolated incidents far apart each start a fresh ladder);
5. more than ``max_rollbacks`` failed rollbacks in a row: give up. A cause that ``gives_up`` (the weights were
   wrong before the first step) gives up at once: no rollback and no LR can help.

A run where every step is an incident therefore ends after at most
``(max_skips + 1) * (max_rollbacks + 1)`` steps.

The cause an incident reports and the policy it is planned by are two answers (:class:`Plan`'s ``cause``):

- the **episode**: an incident diagnosed with a cause of the run's dynamics (one a smaller LR can fix: its
  ``lr_cut`` is not ``never``; not a bad batch, a dtype's range, an op's domain, a fault that does not come back,
  which belong to their own batch or op) opens one: the dynamics stay in the weights. Every later incident until a
  snapshot after healthy training confirms recovery (:meth:`RecoveryLadder.snapshot_taken`), or until
  ``recovery.incident_window`` steps pass without an incident, belongs to it. An incident of the episode that its
  own rule cannot explain (``unknown``: after an LR cut it measures the new, already-cut rate) reports the
  episode's cause; one with a cause of its own reports that one, and one without a diagnosis (None: diagnosis
  off) none;
- the **policy** is always the incident's own diagnosis: an inherited cause never cuts the LR (the episode's
  ``sized`` cut is not made a second time because a later incident inherits ``learning_rate``). An incident that
  names its episode's ``sized`` cause while its own evidence has no safe LR below the current one (a diagnosis
  reused from an earlier incident's replay, ``anomaly.max_replays`` spent, on a rate already cut) only echoes it:
  it is reported and planned as an undiagnosed incident of the episode.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, TypedDict, TypeVar

from ..config import ClipConfig, RecoveryConfig
from ..core.causes import Cause, cause_entry
from ..core.events import KINDS, Kind
from .actions import Action, Clip, CutLr, GiveUp, RollBack, SkipBatches, give_up

__all__ = ["Plan", "Episode", "LadderState", "RecoveryLadder", "LARGEST_CUT"]

# the smallest factor of one cut (a relative update measured on weights that are already broken can be absurd)
LARGEST_CUT = 1e-4


A = TypeVar("A", bound=Action)


@dataclass(frozen=True)
class Plan:
    """What the guard must do about one incident: its actions, in order (:mod:`.actions`; the step itself is always
    skipped), why, and the cause the event reports. A value: the ladder's rungs fill a private draft, and a change
    to a plan (:meth:`RecoveryLadder.must_roll_back`) returns a new one.

    Attributes:
        actions: in order: arming the adaptive clip (:class:`~.actions.Clip`, carried out at once), then a give-up,
            or a rollback, the batches to skip after it and an LR cut.
        reasons: why, for the event's ``details.reasons``.
        cause: the cause the event reports: the incident's own diagnosis, or its episode's where that one explains
            nothing.
        episode_since: the step of the episode's first incident, when ``cause`` is the episode's.
        suggestion: then the event's suggestion too: the episode cause's advice (the incident's own evidence measured
            the new, already-cut rate: a suggestion drawn from it would contradict the cause); None: the diagnosis'
            own suggestion.
    """

    actions: tuple[Action, ...] = ()
    reasons: tuple[str, ...] = ()
    cause: Optional[str] = None
    episode_since: Optional[int] = None
    suggestion: Optional[str] = None

    def find(self, kind: type[A]) -> Optional[A]:
        """The plan's action of ``kind`` (None: it has none)."""
        return next((a for a in self.actions if isinstance(a, kind)), None)

    # (views of the actions, for the callers that ask one question)
    @property
    def give_up(self) -> bool:
        return self.find(GiveUp) is not None

    @property
    def rollback(self) -> bool:
        return self.find(RollBack) is not None

    @property
    def reduce_lr(self) -> bool:
        return self.find(CutLr) is not None

    @property
    def arm_clip(self) -> bool:
        return self.find(Clip) is not None

    @property
    def lr_factor(self) -> Optional[float]:
        """The LR cut's factor (None: ``recovery.lr_factor``, or no cut)."""
        cut = self.find(CutLr)
        return cut.factor if cut is not None else None

    @property
    def go_further_back(self) -> bool:
        back = self.find(RollBack)
        return back is not None and back.further

    @property
    def rollback_before(self) -> Optional[int]:
        back = self.find(RollBack)
        return back.before if back is not None else None

    @property
    def skip_batches(self) -> int:
        skip = self.find(SkipBatches)
        return skip.n if skip is not None else 0


@dataclass
class _Draft:
    """A plan while the rungs fill it in (:meth:`RecoveryLadder.incident`); :meth:`plan` makes it the value."""

    arm_clip: bool = False  # arm adaptive clipping (the guard's clipper knows whether it already is)
    rollback: bool = False
    go_further_back: bool = False
    rollback_before: Optional[int] = None  # roll back to a snapshot taken at or before this step
    reduce_lr: bool = False
    lr_factor: Optional[float] = None  # the cut's factor (None: recovery.lr_factor)
    skip_batches: int = 0
    give_up: bool = False
    reasons: list[str] = field(default_factory=list)
    cause: Optional[str] = None
    episode_since: Optional[int] = None
    suggestion: Optional[str] = None

    @classmethod
    def of(cls, plan: Plan) -> "_Draft":
        return cls(plan.arm_clip, plan.rollback, plan.go_further_back, plan.rollback_before, plan.reduce_lr,
                   plan.lr_factor, plan.skip_batches, plan.give_up, list(plan.reasons), plan.cause, plan.episode_since,
                   plan.suggestion)

    def plan(self, on_give_up: str) -> Plan:
        """The plan's actions, in order (a give-up replaces the rest: :class:`Plan`); ``on_give_up``:
        ``recovery.on_give_up``, the give-up's end."""
        actions: list[Action] = [Clip()] if self.arm_clip else []
        if self.give_up:
            actions.append(give_up(on_give_up))
        else:
            if self.rollback:
                actions.append(RollBack(self.rollback_before, self.go_further_back))
                if self.skip_batches:
                    actions.append(SkipBatches(self.skip_batches))
            if self.reduce_lr:
                actions.append(CutLr(self.lr_factor))
        return Plan(tuple(actions), tuple(self.reasons), self.cause, self.episode_since, self.suggestion)


@dataclass
class Episode:
    """The incidents since one diagnosed with a cause of the run's dynamics (module docstring).

    Attributes:
        cause: the diagnosis of its first incident: what every incident of it that its own rule cannot explain
            reports.
        since: the step of that first incident.
        last: the step of its latest incident (``recovery.incident_window`` steps later without one, it is over).
    """

    cause: str
    since: int
    last: int


class LadderState(TypedDict, total=False):
    """:meth:`RecoveryLadder.state_dict` (a guard state saved by an older version may lack any key)."""

    consecutive: int  # (the layout's names: RecoveryLadder.incidents_in_a_row ...)
    uncounted: int
    failed_rollbacks: int  # (... and RecoveryLadder.unconfirmed_rollbacks)
    recent: list[int]
    sized_cut: bool
    episode_cause: Optional[str]  # the open episode (None: none is open)
    episode_since: Optional[int]
    episode_last: Optional[int]


def _diagnosed(cause: Optional[str]) -> bool:
    """The incident's own rule explains it: a cause other than an undiagnosed incident's (``unknown``)."""
    return cause is not None and cause_entry(cause) is not cause_entry(None)


class RecoveryLadder:
    """The rungs above, over the incidents of a fit (see the module docstring).

    Attributes:
        incidents_in_a_row: incidents since the last healthy step or rollback (a fault that does not come back counts
            only when the step after it fails too: then it was no isolated fault).
        unconfirmed_rollbacks: rollbacks not yet confirmed by a new snapshot.
        sized_cut: the LR was cut to the diagnosis' safe LR since the last confirming snapshot.
        episode: the open episode (None: none is open), whose cause its undiagnosed incidents report.
    """

    def __init__(self, recovery: RecoveryConfig, clip: ClipConfig) -> None:
        self.cfg = recovery
        self.clip_cfg = clip
        self.incidents_in_a_row = 0
        self.uncounted = 0  # an isolated incident whose cause does not count_toward_rollback, since the healthy step
        self.unconfirmed_rollbacks = 0
        self._recent: deque[int] = deque()  # steps of recent incidents that count in the incident window
        self.sized_cut = False
        self.episode: Optional[Episode] = None

    # ------------------------------------------------------------------------------------ transitions

    def healthy(self) -> None:
        """A step was judged healthy: a streak of incidents is over (an episode goes on: its weights may still be the
        ones that grew)."""
        self.incidents_in_a_row = 0
        self.uncounted = 0

    def snapshot_taken(self) -> None:
        """A snapshot after healthy training confirms the last rollback worked: the episode is over."""
        self.unconfirmed_rollbacks = 0
        self.sized_cut = False
        self.episode = None

    def restored(self) -> None:
        """The newest snapshot was restored outside the ladder (the end of fit): the streak is over."""
        self.incidents_in_a_row = 0
        self.uncounted = 0

    def incident(self, step: int, kind: str, *, can_roll_back: bool, cause: Optional[str] = None,
                 safe_factor: Optional[float] = None, clip_armed: bool = False,
                 rollback_before: Optional[int] = None) -> Plan:
        """Plan the response to an incident (or a runaway event).

        Args:
            step: the incident's optimizer step.
            kind: its event kind (a key of :data:`~lightning_nanguard.core.events.KINDS`).
            can_roll_back: a snapshot exists to roll back to.
            cause: the incident's own diagnosis (None: not diagnosed). It decides the policy; what the event
                reports is the plan's ``cause`` (the episode's, where this one is ``unknown``: module docstring).
            safe_factor: the LR factor at which the diagnosis' relative update would be safe; a ``sized`` cut goes
                that far if ``recovery.divergence_lr_factor`` does not.
            clip_armed: adaptive clipping is on already.
            rollback_before: a rollback goes to a snapshot taken at or before that step (a divergence's onset).

        Returns:
            What to do, in order (the step itself is always skipped), the reasons, and the cause to report.
        """
        episode = self._episode_of(step, cause)
        echo = self._echoes(episode, cause, safe_factor)
        policy = cause_entry(None) if echo else cause_entry(cause)
        plan = _Draft(cause=cause, rollback_before=rollback_before)
        if episode is not None and (echo or cause is not None and not _diagnosed(cause)):
            plan.cause, plan.episode_since = episode.cause, episode.since
            plan.suggestion = (f"Part of the episode that began at step {episode.since} ({episode.cause}). "
                               + cause_entry(episode.cause).advice)
        self._plan(plan, step, KINDS[kind], policy, cause, can_roll_back, safe_factor, clip_armed)
        if plan.episode_since is not None:
            plan.reasons.append(f"cause {plan.cause}: its episode's (since step {plan.episode_since}); this incident's "
                                "own evidence explains nothing, and the ladder plans by that")
        return plan.plan(self.cfg.on_give_up)

    def _plan(self, plan: _Draft, step: int, what: Kind, policy: Cause, cause: Optional[str], can_roll_back: bool,
              safe_factor: Optional[float], clip_armed: bool) -> None:
        """The rungs, by ``policy`` (:meth:`incident`'s arguments; ``cause``: its diagnosis, for the reasons)."""
        self._count(policy)
        if policy.gives_up:
            plan.give_up = True
            plan.reasons.append("the weights were wrong before the first step: no rollback or learning rate helps")
            return
        if self.clip_cfg.adaptive == "on_incident" and not clip_armed and policy.arms_clip:
            plan.arm_clip = True
            plan.reasons.append("adaptive clipping enabled after the first incident")
        wants_rollback = what.weights or what.runaway or self.incidents_in_a_row > self.cfg.max_skips
        if wants_rollback and not self._roll_back(plan, what, can_roll_back):
            return  # given up
        self._in_window(step, policy)
        self._cut_lr(plan, policy, what, cause, wants_rollback, safe_factor)

    def _episode_of(self, step: int, cause: Optional[str]) -> Optional[Episode]:
        """The open episode the incident at ``step`` is a later incident of, or None: it opens one (its ``cause`` is
        one of the run's dynamics), or belongs to none. An episode ``incident_window`` steps past its latest incident is
        over."""
        episode = self.episode
        if episode is not None and step - episode.last >= self.cfg.incident_window:
            episode = self.episode = None
        if episode is None:
            if cause is not None and _diagnosed(cause) and cause_entry(cause).lr_cut != "never":
                self.episode = Episode(cause, step, step)
            return None
        episode.last = step
        return episode

    @staticmethod
    def _echoes(episode: Optional[Episode], cause: Optional[str], safe_factor: Optional[float]) -> bool:
        """The incident only echoes its episode's ``sized`` cause: its own evidence has no safe LR below the current
        one (a diagnosis reused from an earlier incident, ``anomaly.max_replays`` spent, on a rate already cut). It
        is planned as an undiagnosed incident."""
        return (episode is not None and cause == episode.cause and cause_entry(cause).lr_cut == "sized"
                and (safe_factor is None or safe_factor > 1.0))

    def _count(self, policy: Cause) -> None:
        """Count the incident in the streak (a fault that does not come back, after a healthy step, only if the next
        step fails too)."""
        if policy.counts_toward_rollback or self.incidents_in_a_row or self.uncounted:
            self.incidents_in_a_row += 1 + self.uncounted  # (a fault that came back on the next step counts after all)
            self.uncounted = 0
        else:
            self.uncounted = 1

    def _roll_back(self, plan: _Draft, what: Kind, can_roll_back: bool) -> bool:
        """The rollback rung: roll back (one snapshot further back after a failed rollback), or give up when too
        many rollbacks failed or bad weights have no snapshot to go back to. False when it gave up."""
        weights = what.weights
        if self.unconfirmed_rollbacks >= self.cfg.max_rollbacks or not can_roll_back and weights:
            plan.give_up = True
            plan.reasons.append(
                f"{self.unconfirmed_rollbacks} rollback(s) did not help (recovery.max_rollbacks="
                f"{self.cfg.max_rollbacks})" if can_roll_back else "no known-good snapshot to roll back to")
            return False
        plan.rollback = can_roll_back
        # a rollback that did not help points at the snapshot: go one further back. Not for a one-off bad
        # weight (a bit flip, an optimizer hiccup): the snapshot was fine, and an older one costs progress
        plan.go_further_back = self.unconfirmed_rollbacks > 0 and not weights
        self.unconfirmed_rollbacks += 1
        self.incidents_in_a_row = self.uncounted = 0
        plan.skip_batches = self.cfg.skip_batches
        plan.reasons.append("parameters are non-finite" if weights else
                            "the loss is running away" if what.runaway else
                            f"{self.cfg.max_skips} skipped step(s) did not help")
        return True

    def _in_window(self, step: int, policy: Cause) -> None:
        """Remember the incident's step in the incident window (if its cause counts there); forget the older ones."""
        if policy.in_incident_window:
            self._recent.append(step)
            while self._recent and self._recent[0] <= step - self.cfg.incident_window:
                self._recent.popleft()

    def _cut_lr(self, plan: _Draft, policy: Cause, what: Kind, cause: Optional[str], wants_rollback: bool,
                safe_factor: Optional[float]) -> None:
        """The LR rung: cut (by how much) or say why not, as the cause's ``lr_cut`` policy and the kind decide."""
        if policy.lr_cut == "never":
            if not policy.counts_toward_rollback and not self.incidents_in_a_row:
                plan.reasons.append(f"the cause ({cause}) calls for skipping the step and nothing else")
            elif cause is not None and (wants_rollback or self.incidents_in_a_row == 1):
                plan.reasons.append(f"no LR cut: the cause ({cause}) is not the learning rate")
            return
        by_rollback = wants_rollback and not what.weights and self.cfg.reduce_lr_on_rollback
        by_cause = policy.lr_cut in ("at_once", "sized") and (self.incidents_in_a_row == 1 or what.runaway)
        by_runaway = what.runaway
        by_count = self.cfg.reduce_lr_after > 0 and len(self._recent) >= self.cfg.reduce_lr_after
        if by_rollback and self.sized_cut and not (by_cause or by_runaway or by_count):
            self.sized_cut = False  # once: if this rollback does not help either, the next one cuts
            plan.reasons.append("no LR cut: the LR was cut to the diagnosis' safe LR since the last good snapshot")
        elif by_cause or by_runaway or by_rollback or by_count:
            plan.reduce_lr = True
            self._recent.clear()
            if policy.lr_cut == "sized" or by_runaway:
                plan.lr_factor = self.cfg.divergence_lr_factor
                if policy.lr_cut == "sized" and safe_factor is not None and safe_factor < plan.lr_factor:
                    plan.lr_factor = max(safe_factor, LARGEST_CUT)
                    self.sized_cut = True
            plan.reasons.append(policy.lr_reason if by_cause else
                                "a divergence, whatever its cause, runs at too high an LR" if by_runaway else
                                "skipping did not help" if by_rollback else "repeated incidents")

    def must_roll_back(self, plan: Plan, can_roll_back: bool, reason: str) -> Plan:
        """The weights must go back to the newest snapshot: the incident's step was applied (read one step late, by
        an optimizer that cannot skip on the device), or the DDP replicas drifted apart. Counted like any other
        rollback, so a run that keeps failing still gives up.

        Args:
            plan: the incident's plan.
            can_roll_back: a snapshot exists to roll back to.
            reason: why, for the plan's reasons.

        Returns:
            ``plan`` with a rollback, or a give-up when too many failed; ``plan`` itself when it rolls back or gives
            up already, or there is no snapshot.
        """
        if plan.rollback or plan.give_up or not can_roll_back:
            return plan
        draft = _Draft.of(plan)
        if self.unconfirmed_rollbacks >= self.cfg.max_rollbacks:
            draft.give_up = True
            draft.reasons.append(f"{self.unconfirmed_rollbacks} rollback(s) did not help (recovery.max_rollbacks="
                                 f"{self.cfg.max_rollbacks})")
            return draft.plan(self.cfg.on_give_up)
        draft.rollback = True
        self.unconfirmed_rollbacks += 1
        self.incidents_in_a_row = self.uncounted = 0
        draft.skip_batches = self.cfg.skip_batches
        draft.reasons.append(reason)
        return draft.plan(self.cfg.on_give_up)

    # ------------------------------------------------------------------------------------ persistence

    def state_dict(self) -> LadderState:
        """The ladder's state, for the guard's checkpoint state (``recovery.ladder``).

        Returns:
            Plain data: the streak, the unconfirmed rollbacks, the incident window, the sized cut and the open episode.
        """
        episode = self.episode
        # (the saved keys keep the layout's earlier names: "consecutive" is incidents_in_a_row, "failed_rollbacks"
        # unconfirmed_rollbacks)
        return {"consecutive": self.incidents_in_a_row, "failed_rollbacks": self.unconfirmed_rollbacks,
                "recent": list(self._recent), "sized_cut": self.sized_cut, "uncounted": self.uncounted,
                "episode_cause": episode.cause if episode else None,
                "episode_since": episode.since if episode else None,
                "episode_last": episode.last if episode else None}

    def load_state_dict(self, state: LadderState) -> None:
        """Take up the state :meth:`state_dict` returned (checked by :mod:`~lightning_nanguard.state_schema`).

        Args:
            state: a ladder state; a key it lacks (a state saved by an older version) starts fresh.
        """
        self.incidents_in_a_row = int(state.get("consecutive", 0))
        self.uncounted = int(state.get("uncounted", 0))
        self.unconfirmed_rollbacks = int(state.get("failed_rollbacks", 0))
        self._recent = deque(int(s) for s in state.get("recent", []))
        self.sized_cut = bool(state.get("sized_cut", False))
        cause, since, last = state.get("episode_cause"), state.get("episode_since"), state.get("episode_last")
        self.episode = (Episode(cause, int(since), int(last)) if cause is not None and since is not None
                        and last is not None else None)
