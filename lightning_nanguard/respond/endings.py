"""How an incident can end a run: a give-up (what was restored, from which step, or why nothing was) and a rank
whose hardware is suspect (``recovery.on_suspect_hardware``), in words, and the stop or the error that follows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from ..config import RecoveryConfig
from ..core.causes import where_it_ran
from ..core.console import say
from ..core.events import NaNEvent
from ..errors import NaNGuardError
from ..recover.actions import Raise, Stop, action_named
from ..recover.recovery import Recovery

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["give_up_message", "suspect_hardware", "act_on_suspect_hardware"]


def act_on_suspect_hardware(trainer: "pl.Trainer", recovery: Recovery, policy: str, text: str) -> None:
    """``recovery.on_suspect_hardware``: warn (on screen, the run goes on), stop the Trainer (the weights are good:
    the faulty steps were skipped), or raise :class:`NaNGuardError` naming the rank and host (``text``)."""
    if policy == Raise.name:
        raise NaNGuardError(text)
    if policy == Stop.name:
        recovery.stop()
        trainer.should_stop = True
    say(trainer, "[nanguard] " + text)


def give_up_message(event: NaNEvent, restored: Optional[int], not_restored: Optional[str], incidents: int,
                    rollbacks: int, bad: Sequence[dict], report: str) -> str:
    """The give-up at ``event``, in words.

    Args:
        event: the incident it gave up at (its step, kind, cause, culprit and suggestion).
        restored: the step of the snapshot its restore restored (None: nothing; :attr:`.Applied.restored`).
        not_restored: why nothing could be restored (:attr:`.Applied.not_restored`).
        incidents: the incidents of the fit so far.
        rollbacks: the rollbacks before the give-up's own restore.
        bad: the non-finite weights left, when nothing was restored.
        report: the path of the incident's report.

    Returns:
        Exactly what it restored (and from which step), or that nothing could be, and whether the weights left are
        finite.
    """
    if restored is not None:
        state = (f"the module, optimizers and LR schedulers were restored to the last known-good state, the "
                 f"snapshot of step {restored}")
    else:
        state = (f"nothing could be restored ({not_restored or 'no snapshot'}): the weights "
                 + (f"are left NON-FINITE ({', '.join(f['name'] for f in bad[:5])})" if bad else
                    f"are left as they were before step {event.step} (finite; that step was not applied)"))
    return (f"NaNGuard gave up at step {event.step} after {incidents} incident(s) and {rollbacks} rollback(s); "
            f"{state}. Last incident: {event.kind}, cause={event.cause}, culprit={event.culprit}. {event.suggestion} "
            f"Report: {report}")


def suspect_hardware(event: NaNEvent, steps: list[int], cfg: RecoveryConfig) -> str:
    """The rank of ``event`` had more faults that did not come back (at ``steps``) than ``recovery.transient_limit``
    within ``transient_window`` steps: say so in the event (its details, suggestion and action) and return the
    message for ``recovery.on_suspect_hardware``."""
    event.details["suspect_hardware"] = {"rank": event.rank, "host": event.host, "device": event.device,
                                         "local_rank": event.local_rank, "faults": len(steps), "steps": steps,
                                         "window": cfg.transient_window, "policy": cfg.on_suspect_hardware}
    message = (f"the hardware of {where_it_ran(event)} is suspect: {len(steps)} faults that did not come back "
               f"within {cfg.transient_window} steps (steps {', '.join(map(str, steps))}; recovery.transient_limit="
               f"{cfg.transient_limit}). Test that device or have the job scheduler exclude host "
               f"{event.host or '(unknown)'}.")
    event.suggestion = f"{event.suggestion} {message[0].upper()}{message[1:]}"
    event.add_action(action_named(cfg.on_suspect_hardware)())
    return message
