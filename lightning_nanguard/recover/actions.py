"""What the guard does about an incident, as values: one small frozen class per action of an event's ``actions``.

Each class carries its ``name`` (what the event records: the contract's vocabulary, :data:`ACTIONS`, derives from
the classes), its ``meaning``, and a :meth:`Action.carry_out` that does it on the fit (:class:`Hands`) and returns
what was done so far with its own doing added (an :class:`Applied`). A :class:`~.ladder.Plan` is a tuple of them
and :meth:`.Recovery.apply` one loop over it; the incident pipeline carries out the actions that act on the step
itself (:attr:`Action.on_the_step`: a skip, a clip) when the incident is found, the rest with the plan.

A new action is one class here (its name, meaning and :meth:`~Action.carry_out`) plus the rung of the ladder, or
the incident builder, that puts it into a plan (docs/architecture.md, "Where a new thing goes").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from ..core.console import say
from ..core.record import StepRecord
from ..errors import NaNGuardError
from ..store.snapshots import Restored

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from .clipping import Clipper
    from .recovery import Recovery

__all__ = ["Action", "SkipStep", "Clip", "CutLr", "RollBack", "SkipBatches", "GiveUp", "Stop", "Raise", "Warn",
           "ACTIONS", "action_named", "give_up", "Hands", "Applied", "Rollback"]


@dataclass(frozen=True)
class Rollback:
    """The weights went back to a snapshot (a give-up's restore too)."""

    kept_step: bool = False  # the rollback kept the current step's gradients (:meth:`.Recovery.rollback`)


@dataclass(frozen=True)
class Applied:
    """What was done about an incident so far (each :meth:`Action.carry_out` returns it with its own doing added):
    the actions, in order, their evidence for the event's details, and the rollback if one restored a snapshot."""

    actions: tuple["Action", ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
    rollback: Optional[Rollback] = None
    restored: Optional[Restored] = None  # what a rollback (or a give-up's restore) restored; None: none tried
    not_restored: Optional[str] = None  # why nothing could be restored

    def then(self, *actions: "Action", details: Optional[dict[str, Any]] = None, **changes: Any) -> "Applied":
        """This, followed by ``actions`` (with their ``details``; ``changes``: fields that replace this one's)."""
        after = Applied(self.actions + actions, {}, changes.get("rollback", self.rollback),
                        changes.get("restored", self.restored), changes.get("not_restored", self.not_restored))
        after.details.update(self.details)  # (one record of the user's values written into the next)
        after.details.update(details or {})
        return after


@dataclass(frozen=True)
class Hands:
    """What an action is carried out on: the fit's recovery state and Trainer and module, the event's step, and
    what the step's own actions need (its :class:`~.record.StepRecord`, the guard's clipper).

    Attributes:
        scaler_overflows: the GradScaler overflow streak, for a restore.
        keep_step: a rollback may keep the current step's gradients (:meth:`.Recovery.rollback`).
    """

    recovery: "Recovery"
    trainer: "pl.Trainer"
    module: "pl.LightningModule"
    step: int
    scaler_overflows: int = 0
    keep_step: bool = False
    record: Optional[StepRecord] = None
    clipper: Optional["Clipper"] = None


@dataclass(frozen=True)
class Action:
    """One thing the guard does about an incident (module docstring)."""

    name: ClassVar[str]
    meaning: ClassVar[str]
    on_the_step: ClassVar[bool] = False  # it acts on the judged step itself: carried out when the incident is found

    def carry_out(self, hands: Hands, done: Applied) -> Applied:
        """Do it on ``hands``; ``done``: what the incident's earlier actions did. Returns ``done`` with this action's
        doing added (unchanged: it did nothing)."""
        raise NotImplementedError


@dataclass(frozen=True)
class SkipStep(Action):
    """Keep the judged step's update from landing, where that is still possible (:meth:`.Recovery.keep_from_landing`).

    Attributes:
        mirrored: the device's skip flag is this same test: judged late, the device skipped it already.
        undo_buffers: undo its buffer writes when the host skips it.
        applied_rolls_back: an update that landed anyway (judged late) must be rolled back (the caller's plan).
    """

    name: ClassVar[str] = "skip_step"
    meaning: ClassVar[str] = "the optimizer step was skipped (weights, moments and step counts untouched)"
    on_the_step: ClassVar[bool] = True

    mirrored: bool = False
    undo_buffers: bool = True
    applied_rolls_back: bool = False

    def carry_out(self, hands: Hands, done: Applied) -> Applied:
        if hands.record is None or not hands.recovery.keep_from_landing(hands.record, mirrored=self.mirrored,
                                                                        undo_buffers=self.undo_buffers):
            return done
        return done.then(self)


@dataclass(frozen=True)
class Clip(Action):
    """Clip: this step to ``to`` (a loss spike under ``check.spike_action: clip``, always recorded), or, with ``to``
    None, arm adaptive clipping for the steps after it (recorded where it was not armed already)."""

    name: ClassVar[str] = "clip"
    meaning: ClassVar[str] = "gradient clipping was armed or applied"
    on_the_step: ClassVar[bool] = True

    to: Optional[float] = None

    def carry_out(self, hands: Hands, done: Applied) -> Applied:
        if hands.clipper is None:
            return done
        armed = hands.clipper.arm()  # (a clip of this step arms z-score clipping from now on too)
        return done.then(self) if armed or self.to is not None else done


@dataclass(frozen=True)
class CutLr(Action):
    """Multiply every learning rate by ``factor`` (None: ``recovery.lr_factor``), in a way LR schedulers keep
    (:meth:`.Recovery.cut_lr`); at ``recovery.min_lr_scale`` already, nothing is cut and nothing recorded."""

    name: ClassVar[str] = "reduce_lr"
    meaning: ClassVar[str] = "every learning rate was cut, in a way LR schedulers keep"

    factor: Optional[float] = None

    def carry_out(self, hands: Hands, done: Applied) -> Applied:
        cut, details = hands.recovery.cut_lr(hands.trainer, hands.step, self.factor)
        return done.then(self, details=details) if cut else done.then(details=details)


@dataclass(frozen=True)
class RollBack(Action):
    """Restore the newest snapshot that verifies: taken at or ``before`` that step (those taken after it, once the
    divergence had begun, are dropped), one ``further`` back after a rollback that did not help. Where none
    verifies, nothing changes and the event says so (recorded as a warning)."""

    name: ClassVar[str] = "rollback"
    meaning: ClassVar[str] = "the training state was restored from a known-good snapshot"

    before: Optional[int] = None
    further: bool = False

    def carry_out(self, hands: Hands, done: Applied) -> Applied:
        store, recovery = hands.recovery.store, hands.recovery
        if store is not None:
            store.settle()  # a snapshot whose write failed is no target (every rank agrees)
        if not store:
            return done
        if self.further:
            store.drop_newest()
        dropped = len(store)
        while self.before is not None and len(store) > 1 and store.newest is not None \
                and store.newest.step > self.before:
            store.drop_newest()  # taken after the divergence began: not known-good
        further = self.further or len(store) < dropped
        restored = recovery.rollback(hands.trainer, hands.module, hands.scaler_overflows,
                                     keep_step=hands.keep_step and not further)
        details, why = recovery.restore_details(restored)
        if why is not None:  # nothing verified: the ladder goes on with the weights it has
            return done.then(Warn(), details=details, restored=restored, not_restored=why)
        return done.then(self, details=details, rollback=Rollback(kept_step=recovery.kept_step), restored=restored)


@dataclass(frozen=True)
class SkipBatches(Action):
    """After a rollback that restored a snapshot, skip the steps of the next ``n`` batches (``recovery.skip_batches``:
    the batches that led into the divergence may lead into it again)."""

    name: ClassVar[str] = "skip_batches"
    meaning: ClassVar[str] = "the steps of the next batches are skipped (recovery.skip_batches)"

    n: int = 0

    def carry_out(self, hands: Hands, done: Applied) -> Applied:
        if done.rollback is None or self.n <= 0:
            return done
        hands.recovery.skip_batches_left = self.n
        return done.then(self, details={"skip_batches": self.n})


@dataclass(frozen=True)
class GiveUp(Action):
    """Give up: every remaining step is skipped and the newest snapshot that verifies is restored (where there is
    one); :meth:`end` then stops the Trainer or raises, as ``recovery.on_give_up`` (the subclass) says. Why: the
    plan's reasons."""

    name: ClassVar[str] = ""  # (abstract: Stop or Raise)
    meaning: ClassVar[str] = ""

    def carry_out(self, hands: Hands, done: Applied) -> Applied:
        recovery = hands.recovery
        recovery.stop()
        if recovery.store is not None:
            recovery.store.settle()  # a snapshot whose write failed is no target (every rank agrees)
        restored = recovery.rollback(hands.trainer, hands.module, hands.scaler_overflows) if recovery.store \
            else Restored()
        details, why = recovery.restore_details(restored)
        rollback = Rollback(kept_step=recovery.kept_step) if why is None else None
        return done.then(self, details=details, rollback=rollback, restored=restored, not_restored=why)

    def end(self, trainer: "pl.Trainer", message: str) -> None:
        """End the run, saying ``message`` (the incident's record is written first)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Stop(GiveUp):
    """Give up and stop the Trainer (``recovery.on_give_up: stop``)."""

    name: ClassVar[str] = "stop"
    meaning: ClassVar[str] = "the guard gave up and stopped the Trainer"

    def end(self, trainer: "pl.Trainer", message: str) -> None:
        trainer.should_stop = True
        say(trainer, "[nanguard] " + message)


@dataclass(frozen=True)
class Raise(GiveUp):
    """Give up and raise :class:`~lightning_nanguard.errors.NaNGuardError` (``recovery.on_give_up: raise``; torch's
    anomaly error propagates under ``anomaly.mode: always``)."""

    name: ClassVar[str] = "raise"
    meaning: ClassVar[str] = "the guard gave up and raised NaNGuardError (or torch's anomaly error propagates)"

    def end(self, trainer: "pl.Trainer", message: str) -> None:
        raise NaNGuardError(message)


@dataclass(frozen=True)
class Warn(Action):
    """Record the incident, and do nothing else."""

    name: ClassVar[str] = "warn"
    meaning: ClassVar[str] = "recorded only"

    def carry_out(self, hands: Hands, done: Applied) -> Applied:
        return done.then(self)


# the contract's order (docs/events.md's ``actions`` row is generated from it)
_ALL: tuple[type[Action], ...] = (SkipStep, Clip, CutLr, RollBack, SkipBatches, Stop, Raise, Warn)

ACTIONS: dict[str, str] = {cls.name: cls.meaning for cls in _ALL}


def action_named(name: str) -> type[Action]:
    """The action class a config value names (``recovery.on_give_up``, ``recovery.on_suspect_hardware``).

    Raises:
        ValueError: a name outside :data:`ACTIONS`.
    """
    for cls in _ALL:
        if cls.name == name:
            return cls
    raise ValueError(f"unknown action {name!r}; allowed: {tuple(ACTIONS)}")


def give_up(on_give_up: str) -> GiveUp:
    """The give-up ``recovery.on_give_up`` names: :class:`Stop` or :class:`Raise`.

    Raises:
        ValueError: any other name.
    """
    cls = action_named(on_give_up)
    if not issubclass(cls, GiveUp):
        raise ValueError(f"recovery.on_give_up={on_give_up!r}; allowed: {Stop.name!r}, {Raise.name!r}")
    return cls()
