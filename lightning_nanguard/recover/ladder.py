"""The recovery ladder as a small, pure state machine.

The callback reports what happened at each optimizer step (``healthy()``, ``incident(...)``,
``snapshot_taken()``); the ladder answers with a :class:`Plan` of what to do. No tensors, no Lightning:
every rung is unit-testable in isolation, and the callback reads like the policy written in English.

Rungs, in order of escalation:

1. every incident skips the step (and undoes buffer writes);
2. adaptive clipping is switched on after the first incident (``clip.adaptive: on_incident``);
3. the LR is cut on evidence that the dynamics diverge, and only then: actions follow the cause.

   - ``learning_rate`` and ``exploding_gradient``: cut at the first incident of a run of incidents, and again
     after each rollback forced because skipping did not help; ``exploding_gradient`` by ``lr_factor`` (a
     NaN after a gradient outlier may be a one-off), ``learning_rate`` and any ``divergence`` (a run caught
     running away is past the edge of stability) by ``recovery.divergence_lr_factor`` and, for
     ``learning_rate``, further if that is not enough: down to the LR at which
     the diagnosis' relative update would be safe (``safe_lr`` in its evidence: SGD moving the weights by at
     most their own size per step, or a quarter of the edge of stability its gradient norm's growth rate
     implies if lower; an adaptive optimizer's largest step at 5% of their RMS; at most 10,000-fold in one
     cut). After such a sized cut, the first rollback of the same episode does not cut again: the LR is
     already where the diagnosis calls it safe, and the incidents that forced the rollback come from the
     weights that grew before the cut (which the rollback undoes); a further failed rollback cuts;
   - ``input``, ``initialization``, ``overflow``, ``precision`` and ``backward_op`` name a problem a smaller
     LR cannot fix (bad data, bad weights, a dtype's range, an op's domain): never cut;
   - no cause, ``unknown`` or ``optimizer``: cut after a rollback forced because skipping did not help
     (``reduce_lr_on_rollback``) and, if ``reduce_lr_after > 0``, after that many non-input incidents within
     ``incident_window`` steps;
4. more than ``max_skips`` consecutive incidents, non-finite parameters, or a ``divergence`` (finite, but
   running away: skipping its step does not stop it) roll back to the newest snapshot; a rollback that is
   not followed by a new snapshot counts as failed, and the next one goes one snapshot further back (the
   callback takes that confirming snapshot ``confirm_after`` healthy steps after a rollback, so isolated
   incidents far apart each start a fresh ladder);
5. more than ``max_rollbacks`` failed rollbacks in a row: give up. ``initialization`` gives up at once: the
   weights were wrong before the first step, so no rollback and no LR can help, and the event says which
   parameter and how far off its scale is.

A run where every step is an incident therefore ends after at most
``(max_skips + 1) * (max_rollbacks + 1)`` steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import ClipConfig, RecoveryConfig

__all__ = ["Plan", "RecoveryLadder", "LR_CAUSES", "NO_LR_CUT"]

LR_CAUSES = ("learning_rate", "exploding_gradient")  # the dynamics diverge: a smaller LR is the remedy
NO_LR_CUT = ("input", "initialization", "overflow", "precision", "backward_op")  # a smaller LR cannot help
# the smallest factor of one cut (a relative update measured on weights that are already broken can be absurd)
LARGEST_CUT = 1e-4


@dataclass
class Plan:
    """What the callback must do about one incident, in this order (the step itself is always skipped)."""

    enable_adaptive_clip: bool = False
    rollback: bool = False
    go_further_back: bool = False
    rollback_before: Optional[int] = None  # roll back to a snapshot taken at or before this step
    reduce_lr: bool = False
    lr_factor: Optional[float] = None  # the cut's factor (None: recovery.lr_factor)
    skip_batches: int = 0
    give_up: bool = False
    reasons: list[str] = field(default_factory=list)


class RecoveryLadder:
    def __init__(self, recovery: RecoveryConfig, clip: ClipConfig) -> None:
        self.cfg = recovery
        self.clip_cfg = clip
        self.consecutive = 0  # incidents since the last healthy step or rollback
        self.failed_rollbacks = 0  # rollbacks not yet confirmed by a new snapshot
        self.adaptive_clip = clip.adaptive == "always"
        self._recent: deque[int] = deque()  # steps of recent non-input incidents
        self.sized_cut = False  # the LR was cut to the diagnosis' safe LR since the last confirming snapshot

    # ------------------------------------------------------------------------------------ transitions

    def healthy(self) -> None:
        self.consecutive = 0

    def arm_adaptive_clip(self) -> None:
        """Adaptive clipping from now on (a loss spike with ``check.spike_action: clip``)."""
        self.adaptive_clip = True

    def snapshot_taken(self) -> None:
        """A snapshot after healthy training confirms the last rollback worked."""
        self.failed_rollbacks = 0
        self.sized_cut = False

    def incident(self, step: int, kind: str, *, can_roll_back: bool, cause: Optional[str] = None,
                 safe_factor: Optional[float] = None, diverging: bool = False) -> Plan:
        """Plan the response to an incident (or a ``divergence`` event) at ``step`` with the diagnosed ``cause``
        (``diverging=True``: the same as ``cause="exploding_gradient"``). ``safe_factor``: the LR factor at
        which the diagnosis' relative update would be safe; a ``learning_rate`` cut goes that far if
        ``divergence_lr_factor`` does not."""
        if diverging and cause is None:
            cause = "exploding_gradient"
        plan = Plan()
        self.consecutive += 1
        if cause == "initialization":
            plan.give_up = True
            plan.reasons.append("the weights were wrong before the first step: no rollback or learning rate helps")
            return plan
        if self.clip_cfg.adaptive == "on_incident" and not self.adaptive_clip and kind != "input":
            self.adaptive_clip = True
            plan.enable_adaptive_clip = True
            plan.reasons.append("adaptive clipping enabled after the first incident")

        params = kind in ("parameter", "buffer")
        wants_rollback = params or kind == "divergence" or self.consecutive > self.cfg.max_skips
        if wants_rollback:
            if self.failed_rollbacks >= self.cfg.max_rollbacks or not can_roll_back and params:
                plan.give_up = True
                plan.reasons.append(
                    f"{self.failed_rollbacks} rollback(s) did not help (recovery.max_rollbacks="
                    f"{self.cfg.max_rollbacks})" if can_roll_back else "no known-good snapshot to roll back to")
                return plan
            plan.rollback = can_roll_back
            # a rollback that did not help points at the snapshot: go one further back. Not for a one-off bad
            # parameter (a bit flip, an optimizer hiccup): the snapshot was fine, and an older one costs progress
            plan.go_further_back = self.failed_rollbacks > 0 and not params
            self.failed_rollbacks += 1
            self.consecutive = 0
            plan.skip_batches = self.cfg.skip_batches
            plan.reasons.append("parameters are non-finite" if params else
                                "the loss is running away" if kind == "divergence" else
                                f"{self.cfg.max_skips} skipped step(s) did not help")

        if kind != "input":
            self._recent.append(step)
            while self._recent and self._recent[0] <= step - self.cfg.incident_window:
                self._recent.popleft()
        if cause in NO_LR_CUT or kind == "input":
            if cause in NO_LR_CUT and (wants_rollback or self.consecutive == 1):
                plan.reasons.append(f"no LR cut: the cause ({cause}) is not the learning rate")
            return plan
        by_rollback = wants_rollback and not params and self.cfg.reduce_lr_on_rollback
        by_cause = cause in LR_CAUSES and (self.consecutive == 1 or kind == "divergence")
        by_divergence = kind == "divergence"
        by_count = self.cfg.reduce_lr_after > 0 and len(self._recent) >= self.cfg.reduce_lr_after
        if by_rollback and self.sized_cut and not (by_cause or by_divergence or by_count):
            self.sized_cut = False  # once: if this rollback does not help either, the next one cuts
            plan.reasons.append("no LR cut: the LR was cut to the diagnosis' safe LR since the last good snapshot")
        elif by_cause or by_divergence or by_rollback or by_count:
            plan.reduce_lr = True
            self._recent.clear()
            if cause == "learning_rate" or kind == "divergence":
                plan.lr_factor = self.cfg.divergence_lr_factor
            if cause == "learning_rate" and safe_factor is not None and safe_factor < plan.lr_factor:
                plan.lr_factor = max(safe_factor, LARGEST_CUT)
                self.sized_cut = True
            plan.reasons.append("the learning rate is too high" if cause == "learning_rate" else
                                "exploding gradients" if cause == "exploding_gradient" else
                                "a divergence, whatever its cause, runs at too high an LR" if by_divergence else
                                "skipping did not help" if by_rollback else "repeated incidents")
        return plan

    def step_was_applied(self, plan: Plan, can_roll_back: bool) -> None:
        """The incident's step was applied (read one step late, by an optimizer that cannot skip on the device):
        only a rollback undoes it. Counted like any other rollback, so a run that keeps failing still gives up."""
        if plan.rollback or plan.give_up or not can_roll_back:
            return
        if self.failed_rollbacks >= self.cfg.max_rollbacks:
            plan.give_up = True
            plan.reasons.append(f"{self.failed_rollbacks} rollback(s) did not help (recovery.max_rollbacks="
                                f"{self.cfg.max_rollbacks})")
            return
        plan.rollback = True
        self.failed_rollbacks += 1
        self.consecutive = 0
        plan.skip_batches = self.cfg.skip_batches
        plan.reasons.append("the bad step was applied (its optimizer cannot skip on the device)")

    # ------------------------------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive, "failed_rollbacks": self.failed_rollbacks,
                "adaptive_clip": self.adaptive_clip, "recent": list(self._recent), "sized_cut": self.sized_cut}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.failed_rollbacks = int(state.get("failed_rollbacks", 0))
        self.adaptive_clip = bool(state.get("adaptive_clip", self.adaptive_clip))
        self._recent = deque(int(s) for s in state.get("recent", []))
        self.sized_cut = bool(state.get("sized_cut", False))
