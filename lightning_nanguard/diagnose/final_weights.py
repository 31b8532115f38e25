"""Are the final weights of a fit suspect? At the end of a fit whose recovery is unfinished (a streak of incidents,
or a rollback not yet confirmed by a snapshot), finite weights may still be broken: this tells, by rerunning the
last incident's batch on them and on the newest snapshot's (:func:`suspect`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..core.causes import cause_entry
from ..core.events import KINDS, NaNEvent
from ..core.record import Window
from ..recover.actions import RollBack
from .replay import reproduces

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from ..recover.recovery import Recovery

__all__ = ["Suspect", "suspect"]

# (kind of the event to record, the event behind it, the reason in words, details for the event)
Suspect = tuple[str, NaNEvent, str, dict[str, Any]]


def suspect(trainer: "pl.Trainer", pl_module: "pl.LightningModule", recovery: "Recovery", events: list[NaNEvent],
            last: Optional[tuple[NaNEvent, Window]], diverging: bool, rerun: bool,
            norm_type: float ) -> Optional[Suspect]:
    """Are the final (finite) weights suspect? A :data:`Suspect`, or None.

    - ``parameter``, finite but broken: the fit ended inside a streak of incidents that the weights themselves
      reproduce. The last incident's micro-batches (``last``: that event and its window), rerun on the final weights
      (:func:`.replay.reproduces`), are non-finite again, and on the newest snapshot's weights they are not
      (non-finite there too: the batch or the code is at fault, and the snapshot would not help). Inputs never make
      the weights suspect, nor does a fault that the rerun does not reproduce (a one-off). Where the batch cannot be
      rerun (``rerun`` False: ``anomaly.mode: off``; manual optimization) the streak counts as suspect: the safe
      side.
    - ``divergence``, unresolved: a rollback (``check.divergence: act``, or any forced rollback) is not yet
      confirmed by a snapshot and the loss is running away at the end (``diverging``). With ``check.divergence:
      warn`` the guard never rolls back, at the end of fit neither.

    Args:
        trainer, pl_module: the fit at its end.
        recovery: the guard's recovery (its streak, unconfirmed rollbacks and snapshots).
        events: the fit's events, oldest first.
        last: the last incident's event and its window, where kept.
        diverging: the loss is running away at the end.
        rerun: the last incident's batch may be rerun (``anomaly.mode`` not ``off``).
        norm_type: the norm whose overflow of finite gradients counts as non-finite.

    Returns:
        The :data:`Suspect` to record, or None when the final weights are not suspect.
    """
    incidents = [e for e in events if KINDS[e.kind].incident]
    if recovery.incidents_in_a_row > 0 and incidents:
        found = _streak(trainer, pl_module, recovery, incidents[-1], last, rerun, norm_type)
        if found is not None:
            return found
    if recovery.unconfirmed_rollbacks > 0 and diverging:
        rolled_back = next((e for e in reversed(events) if RollBack.name in e.actions), None)
        if rolled_back is not None:
            return ("divergence", rolled_back, f"the loss grew again after the rollback of step "
                                               f"{rolled_back.step}, before a snapshot confirmed it", {})
        source = next((e for e in reversed(events) if KINDS[e.kind].runaway), None)
        if source is not None:  # no snapshot: the rollback it called for never happened
            return "divergence", source, f"the divergence of step {source.step} was never rolled back", {}
    return None


def _streak(trainer: "pl.Trainer", pl_module: "pl.LightningModule", recovery: "Recovery", newest: NaNEvent,
            last: Optional[tuple[NaNEvent, Window]], rerun: bool, norm_type: float) -> Optional[Suspect]:
    """:func:`suspect` for a fit that ended inside a streak of incidents, the newest ``newest``."""
    if not cause_entry(newest.cause).weights_suspect:
        return None  # e.g. a bad batch: the weights never saw it
    automatic = getattr(pl_module, "automatic_optimization", True)
    if last is None or last[0] is not newest or not rerun or not automatic:
        why = ("anomaly.mode: off" if not rerun else "manual optimization" if not automatic else
               "its batch is not kept")
        return "parameter", newest, f"the batch of step {newest.step} cannot be rerun ({why}): taken as suspect", {}
    final, snapshot, step = _rerun(trainer, pl_module, recovery, last[1], norm_type)
    suspect = final is not False and snapshot is not True
    if trainer.world_size > 1:  # each rank reruns its own batch: restore on every rank if one says so
        suspect = trainer.strategy.reduce_boolean_decision(suspect, all=False)
    if not suspect:
        return None
    on = {True: "non-finite", False: "finite", None: "not rerun (an error)"}
    reason = f"the batch of step {newest.step} is {on[final]} on the final weights"
    if step is not None:
        reason += f" and {on[snapshot]} on the snapshot's of step {step}"
    return "parameter", newest, reason, {
        "rerun_at_end": {"final_weights": final, "snapshot_weights": snapshot, "snapshot_step": step}}


def _rerun(trainer: "pl.Trainer", pl_module: "pl.LightningModule", recovery: "Recovery", window: Window,
           norm_type: float ) -> tuple[Optional[bool], Optional[bool], Optional[int]]:
    """Rerun ``window`` on the final weights and, where that is non-finite (or failed), on the newest snapshot's:
    (non-finite on the final weights, on the snapshot's, the snapshot's step); None where not rerun."""
    final = reproduces(trainer, pl_module, window.batches, window.rng, norm_type, window.step)
    snapshot: Optional[bool] = None
    step: Optional[int] = None
    again = final is not False
    store = recovery.store
    if trainer.world_size > 1 and store is not None and store.collective:
        # reading a sharded snapshot is a collective: every rank loads it if any rank reruns on it
        load = trainer.strategy.reduce_boolean_decision(again, all=False)
    else:
        load = again
    if load:
        with recovery.newest_weights(pl_module) as snapshot_step:
            if again and snapshot_step is not None:
                step = snapshot_step
                snapshot = reproduces(trainer, pl_module, window.batches, window.rng, norm_type, window.step)
    return final, snapshot, step
