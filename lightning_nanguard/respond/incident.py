"""An incident is a value: what the guard found, and how the incident pipeline is to treat it.

One pure builder per trigger returns an :class:`Incident`: its event (kind, step, where it ran, the evidence
for its details), its :class:`~.record.StepRecord` (a step's incidents), the typed :class:`Evidence` the
diagnosis reads, what the pipeline looks at (the weights, the inputs), whether it is diagnosed and its account
agreed across ranks, where its plan comes from (:class:`Planning`), how its step is skipped (:class:`Skip`) and
when it acts (:class:`Act`). :meth:`~.responder.Responder.respond` runs every incident through the same
skeleton and returns a :class:`Response`, what it did. :func:`kind_of` is the one place that decides the kind.

Nothing here changes state or reads a device: the builders take what the caller read (:class:`At`, the step's
flags, the watches' statistics) and the pipeline does the looking (:meth:`.Responder.respond`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Optional, Sequence

from ..core.causes import where_it_ran
from ..core.events import KINDS, NaNEvent
from ..core.record import StepRecord, UpdateStage, Window
from ..diagnose.context import Evidence
from ..recover.ladder import Plan

__all__ = ["Act", "At", "Evidence", "Incident", "Look", "Planning", "Response", "NOTHING_DONE", "Skip", "kind_of",
           "nonfinite_step", "divergence", "spike", "persistent_clipping", "bad_weights", "replicas_drifted",
           "fit_start", "after_stop", "unfinished", "anomaly_error", "SPIKES_BEFORE_LR_CUT"]

# loss spikes within recovery.incident_window steps that cut the LR whatever check.spike_action says (one
# spike is noise the detector may have missed; repeated ones are a divergence under way, often one that
# clipping slows down but cannot stop)
SPIKES_BEFORE_LR_CUT = 3


class Act(enum.Enum):
    """When an incident acts, and how it ends."""

    RECORD = "record"  # carry out its plan (an LR cut at most) now, warn if nothing was done, record it
    NOW = "now"  # outside a step: carry out its plan now, record it, give up if the plan says so
    STEP_END = "step_end"  # its plan waits for the step's end (the optimizer skipped the step): finish()
    RESTORE = "restore"  # fit end: restore the newest snapshot, record what was restored (stop if nothing was)
    STOP = "stop"  # fit start: nothing known-good exists; stop or raise


class Planning(enum.Enum):
    """Where an incident's plan comes from."""

    NONE = "none"
    LADDER = "ladder"  # the recovery ladder's (:meth:`.Recovery.plan`)
    GIVEN = "given"  # the builder's own :attr:`Incident.plan`
    ROLL_BACK = "roll_back"  # a rollback counted like any (:meth:`.Recovery.must_roll_back`), or a warning


class Look(enum.Enum):
    """Which weights the pipeline looks at for the non-finite values behind an incident (syncs: incident only)."""

    NOTHING = "nothing"
    WEIGHTS = "weights"  # parameters and buffers
    PARAMETERS = "parameters"  # a step judged late: the buffers hold the next step's writes already


@dataclass
class Skip:
    """How an incident keeps its step's update from landing (:meth:`.Responder.respond`'s skip stage)."""

    mirrored: bool  # the device's skip flag is this same test: judged late, the device skipped it already
    undo_buffers: bool  # undo its buffer writes when the host skips it
    applied_rolls_back: bool = False  # an update that landed anyway (judged late) must be rolled back


@dataclass(frozen=True)
class At:
    """Where an event happened: the step, epoch, batch and logger step, and where the rank ran
    (:func:`.detect.placement.whereabouts`)."""

    step: int
    epoch: int
    batch_idx: int
    log_step: Optional[int]
    where: dict[str, Any]

    @classmethod
    def of(cls, record: StepRecord, where: dict[str, Any]) -> "At":
        return cls(record.step, record.epoch, record.batch_idx, record.log_step, where)

    def event(self, kind: str) -> NaNEvent:
        return NaNEvent(step=self.step, epoch=self.epoch, batch_idx=self.batch_idx, kind=kind,
                        log_step=self.log_step, **self.where)


@dataclass
class Incident:
    """One incident, as its builder describes it (module docstring)."""

    event: NaNEvent
    act: Act
    record: Optional[StepRecord] = None
    evidence: Evidence = field(default_factory=Evidence)
    look: Look = Look.NOTHING
    look_at_inputs: bool = False  # where no weight it looked at explains it: the window's inputs
    diagnose: bool = False
    anomaly: Optional[dict] = None  # the user's anomaly error, parsed: diagnosed from it instead
    history: bool = True  # the diagnosis and the report see the guard's norm and loss histories
    share: bool = False  # several ranks: every rank adopts the account of the rank that produced it
    own_evidence: Optional[bool] = None  # outside a step: this rank's own evidence, for the account
    replica: bool = False  # the ranks' copies of the reduced gradient disagree (the account compares them)
    detected_at: Optional[str] = None
    planning: Planning = Planning.NONE
    plan: Optional[Plan] = None  # Planning.GIVEN
    rollback_before: Optional[int] = None  # Planning.LADDER: to a snapshot at or before this step
    reason: str = ""  # Planning.ROLL_BACK: why
    skip: Optional[Skip] = None
    clip_to: Optional[float] = None  # clip the step to this norm, and arm adaptive clipping
    keeps_window: bool = False  # the newest step incident: a fit that ends inside its streak reruns it
    # Act.RESTORE: the event's account once the restore is known (restored step or None, why nothing was);
    # returns True when nothing could be restored and the fit stops or raises
    conclude: Optional[Callable[[NaNEvent, Optional[int], str], bool]] = None
    stop_message: str = ""  # Act.STOP: what the error or the screen says


@dataclass(frozen=True)
class Response:
    """What :meth:`.Responder.respond` (or :meth:`.Responder.finish`) did about an incident; :data:`NOTHING_DONE`
    for a step without one (frozen: shared by every healthy step, no allocation on the hot path)."""

    skipped: bool = False  # the step's update does not land
    queued: bool = False  # its plan is carried out at the step's end (finish)
    rolled_back: bool = False
    kept_step: bool = False  # the rollback kept the current step's gradients (:meth:`.Recovery.rollback`)
    stopped: bool = False  # the guard gave up or stopped the run
    clip_to: Optional[float] = None  # clip the step to this norm (a loss spike with check.spike_action: clip)

    def merge(self, other: "Response") -> "Response":
        return Response(self.skipped or other.skipped, self.queued or other.queued,
                        self.rolled_back or other.rolled_back, other.kept_step if other.rolled_back else self.kept_step,
                        self.stopped or other.stopped, other.clip_to if other.clip_to is not None else self.clip_to)


NOTHING_DONE = Response()


def kind_of(base: str, param_findings: Sequence[dict] = (), buffers: Collection[str] = (),
            input_findings: Sequence[dict] = ()) -> str:
    """An event's kind: ``buffer`` or ``parameter`` where non-finite weights were found (buffers only: ``buffer``),
    else ``input`` where the batch holds them, else ``base`` (the step's flags: :meth:`.StepFlags.incident_kind`,
    ``replica``, or what the trigger found)."""
    if param_findings:
        return "buffer" if all(f["name"] in buffers for f in param_findings) else "parameter"
    return "input" if input_findings else base


def _lrs(record: StepRecord) -> dict[int, float]:
    return {id(g): lr for g, lr in zip(record.optimizer.param_groups, record.lrs)}


# ------------------------------------------------------------------------------------------- a step's

def nonfinite_step(at: At, record: StepRecord, *, grads_were_finite: Optional[bool], check_parameters: bool,
                   check_inputs: bool, scaler: Optional[tuple[int, Optional[float]]] = None) -> Incident:
    """A step with non-finite evidence (or, DDP, ranks whose copies of the reduced gradient disagree and no rank
    has evidence of its own). Diagnosed before any state changes (the replay needs the weights and buffers of the
    bad forward), skipped, its plan carried out at the step's end. A step judged late (not ``ON_HOST``) was skipped
    on the device (else, applied, it is rolled back); its window replays on the weights it left, which are the ones
    it ran on when it was skipped. ``scaler``: 16-mixed, the GradScaler's overflow streak and scale."""
    flags = record.read_flags
    replica = record.replica is not None and not flags.local_bad
    base = "replica" if replica else flags.incident_kind()
    event = at.event(base)
    event.details["grad_norm"] = flags.grad_norm
    event.details["lr"] = [float(lr) for lr in record.lrs]
    if record.replica is not None:
        event.details["replica"] = dict(record.replica)
    # a bad weight read by the forward spoils the loss before any pass over the weights sees it: look now. A step
    # judged late is judged while the next one runs: its own weights are the current ones only if it was skipped on
    # the device, and the buffers hold the next step's writes already (nothing to look at after an applied update)
    flagged = base == "parameter"
    look = (Look.NOTHING if not (check_parameters or flagged) or record.update is UpdateStage.APPLIED and not flagged
            else Look.PARAMETERS if record.update is not UpdateStage.ON_HOST and not flagged else Look.WEIGHTS)
    evidence = Evidence(window=record.window, grad_norm=flags.grad_norm, grads_were_finite=grads_were_finite,
                        only_gradients=not flags.local_bad, same_weights=record.update is not UpdateStage.APPLIED,
                        step_lrs=_lrs(record))
    if scaler is not None:
        evidence.scaler_overflows, evidence.grad_scale = scaler
    return Incident(event, Act.STEP_END, record, evidence, look=look, look_at_inputs=check_inputs, diagnose=True,
                    share=True, replica=replica, planning=Planning.LADDER,
                    skip=Skip(mirrored=True, undo_buffers=False, applied_rolls_back=True), keeps_window=True)


def divergence(at: At, record: StepRecord, found: dict, *, act: bool) -> Incident:
    """A finite loss (or gradient norm) running away (:mod:`.detect.divergence`), diagnosed. With ``act``
    (``check.divergence: act``) the step is skipped, and at its end the run rolls back to the newest snapshot from
    before the onset and the LR is cut as the cause allows (the ladder); else a warning."""
    flags = record.read_flags
    event = at.event("divergence")
    event.details.update(divergence=found, loss=flags.loss, grad_norm=flags.grad_norm,
                         lr=[float(lr) for lr in record.lrs])
    evidence = Evidence(grad_norm=flags.grad_norm, divergence=found, step_lrs=_lrs(record))
    # (shared: every rank sees the same running loss, and adopts one account: one rank's diagnosis, its LR cut)
    if not act:
        event.add_action("warn")
        return Incident(event, Act.RECORD, record, evidence, diagnose=True, share=True)
    return Incident(event, Act.STEP_END, record, evidence, diagnose=True, share=True, planning=Planning.LADDER,
                    rollback_before=found.get("onset_step"), skip=Skip(mirrored=False, undo_buffers=True))


def spike(at: At, record: StepRecord, *, z: float, test: dict[str, Any], grad_norm_zscore: Optional[float],
          cause: str, growth: dict[str, Any], action: str, clip_to: Optional[float], repeated: bool,
          window: int) -> Incident:
    """A finite loss far above its running statistics, with ``check.spike_action``: skipped (``skip_step``),
    clipped to ``clip_to`` with adaptive clipping armed (``clip``), or an LR cut (``reduce_lr``). A spike does not
    climb the ladder (no rollback, no give-up); ``repeated`` (:data:`SPIKES_BEFORE_LR_CUT` within ``window`` steps)
    cuts the LR whatever the action. Judged late, the spike was skipped or clipped on the device already, by the
    same test; an LR cut applies from the step after it."""
    flags = record.read_flags
    event = at.event("spike")
    event.details.update(loss=flags.loss, loss_zscore=z, **{f"loss_{k}": v for k, v in test.items()},
                         grad_norm=flags.grad_norm, grad_norm_zscore=grad_norm_zscore)
    event.cause = cause
    event.details.update(growth)
    event.suggestion = KINDS["spike"].advice
    if clip_to is not None and action == "clip":
        event.details["clip_to"] = clip_to
    plan = None
    if action == "reduce_lr" or repeated:  # repeated spikes are a divergence on its way: cut the LR
        reason = (f"{SPIKES_BEFORE_LR_CUT} loss spikes within {window} steps" if repeated and action != "reduce_lr"
                  else "loss spike")
        plan = Plan(reduce_lr=True, reasons=[reason])
    return Incident(event, Act.RECORD, record, planning=Planning.GIVEN if plan else Planning.NONE, plan=plan,
                    skip=Skip(mirrored=True, undo_buffers=True) if action == "skip_step" else None,
                    clip_to=clip_to if action == "clip" else None)


def persistent_clipping(at: At, record: StepRecord, *, streak: int, threshold: Optional[float], cause: str,
                        can_roll_back: bool) -> Incident:
    """The adaptive clip acted on ``streak`` steps in a row: a divergence that clipping slows but does not stop,
    with the weights already drifting. The step is skipped, and at its end the run rolls back to the newest snapshot
    and cuts the LR, like an incident (a ``spike`` event: abnormal, still finite; it does not count towards the
    ladder's give-up). Judged late, the step was applied; the rollback undoes it."""
    flags = record.read_flags
    event = at.event("spike")
    event.details.update(reason=f"gradient norm clipped by the adaptive clip on {streak} consecutive steps",
                         grad_norm=flags.grad_norm, clip_threshold=threshold, loss=flags.loss)
    event.cause, event.suggestion = cause, KINDS["spike"].advice
    event.add_action("clip")
    plan = Plan(rollback=can_roll_back, reduce_lr=True, reasons=["persistent adaptive clipping"])
    return Incident(event, Act.STEP_END, record, planning=Planning.GIVEN, plan=plan,
                    skip=Skip(mirrored=False, undo_buffers=False))


# ------------------------------------------------------------------------------------ outside a step

def bad_weights(at: At, where: str, *, grads_were_finite: Optional[bool], own_evidence: bool = False) -> Incident:
    """Non-finite weights (or optimizer state) found outside the step decision (before a snapshot or a checkpoint,
    at validation or at the end of fit): roll back (or give up) right away. Under DDP every rank handles it together
    (each caller agrees its trigger across ranks) and every rank adopts the account of the rank that found it (its
    own weights, or ``own_evidence``: e.g. its optimizer state)."""
    return Incident(at.event("parameter"), Act.NOW, evidence=Evidence(grads_were_finite=grads_were_finite),
                    look=Look.WEIGHTS, diagnose=True, share=True, own_evidence=own_evidence, detected_at=where,
                    planning=Planning.LADDER)


def replicas_drifted(at: At, gathered: Sequence[dict[str, Any]], odd: list[int], agreed_at: Optional[int],
                     cause: str) -> Incident:
    """DDP, at a snapshot: the replicas' weights are no longer bitwise the same. ``gathered``: every rank's weights
    checksum and whereabouts; ``odd``: the ranks a majority tells are wrong (none with two ranks). Every rank rolls
    back to the newest snapshot (``agreed_at``), on which they agreed, counted like any rollback."""
    event = at.event("replica")
    sums = [p["checksum"] for p in gathered]
    for key in ("rank", "host", "device", "local_rank"):  # the same account on every rank (rank 0's: unknown)
        setattr(event, key, gathered[odd[0] if odd else 0][key])
    event.cause = cause
    event.details.update(detected_at="snapshot", ranks=odd, replica={
        "weights_checksums": sums, "odd_ranks": odd, "found_by": "majority" if odd else "untold",
        "agreed_at_step": agreed_at})
    who = where_it_ran(event) if odd else "some rank (two ranks: no majority tells which)"
    event.suggestion = (f"The replicas' weights drifted apart since the snapshot of step {agreed_at}: {who} holds "
                        "different weights, from a fault the per-step check of the gradients let through "
                        "(check.replica_compare: tolerance, or a corruption after the check) or an update that "
                        "one rank made alone. Every rank was rolled "
                        "back to that snapshot. If it comes back, test that GPU or exclude the host.")
    return Incident(event, Act.NOW, planning=Planning.ROLL_BACK, reason="the DDP replicas' weights differ")


def fit_start(at: At, findings: list[dict], on_give_up: str) -> Incident:
    """Non-finite parameters before the first step: nothing known-good to roll back to; stop or raise."""
    event = at.event("parameter")
    event.add_action(on_give_up)
    names = ", ".join(f["name"] for f in findings[:5])
    return Incident(event, Act.STOP, evidence=Evidence(at_fit_start=True, param_findings=findings), diagnose=True,
                    detected_at="fit_start", stop_message=f"non-finite parameters before training ({names})")


def after_stop(at: At, findings: list[dict], buffers: Collection[str], on_give_up: str) -> Incident:
    """Fit ends on non-finite weights after the guard stopped (gave up, or stopped on suspect hardware): restore the
    newest known-good snapshot; with none, say so and stop or raise (``on_give_up``)."""
    event = at.event(kind_of("parameter", findings, buffers))
    event.cause = "unknown"
    names = ", ".join(f["name"] for f in findings[:5]) or "(a weight on another rank)"
    event.details.update(detected_at="train_end", after_stop=True, param_findings=findings[:20])

    def conclude(event: NaNEvent, restored: Optional[int], why: str) -> bool:
        event.details["restored_step"] = restored
        if restored is not None:
            event.add_action("rollback")
            event.suggestion = (f"Training ended on non-finite weights ({names}) after the guard had stopped: they "
                                f"were replaced by the last known-good state, the snapshot of step {restored}.")
            return False
        event.details["not_restored"] = why
        event.add_action(on_give_up)
        event.suggestion = (f"Training ended on NON-FINITE weights ({names}) after the guard had stopped, and "
                            f"nothing could be restored ({why}).")
        return True
    return Incident(event, Act.RESTORE, conclude=conclude)


def unfinished(at: At, kind: str, source: NaNEvent, reason: str, found: dict[str, Any], *, in_a_row: int,
               unconfirmed: int) -> Incident:
    """Fit ends while recovery is unfinished, on finite weights that are suspect (``reason``; :mod:`.final_weights`
    tells, from the event ``source`` behind it): restore the newest known-good snapshot and say from which step."""
    event = at.event(kind)
    event.cause, event.culprit, event.op = source.cause, source.culprit, source.op
    event.details.update(detected_at="train_end", reason=reason, source_step=source.step,
                         skipped_steps_in_a_row=in_a_row, unconfirmed_rollbacks=unconfirmed, **found)
    what = ("Training ended inside a streak of incidents, on finite weights that are suspect"
            if not KINDS[kind].runaway else "Training ended while the loss was running away")

    def conclude(event: NaNEvent, restored: Optional[int], why: str) -> bool:
        if restored is None:
            event.add_action("warn")
            event.details["not_restored"] = why
            event.suggestion = (f"{what} ({reason}). There is no snapshot to compare them with or to restore "
                                f"({why}): the final weights are kept and may be broken. See the event of step "
                                f"{source.step} for the cause.")
        else:
            event.add_action("rollback")
            event.details["restored_step"] = restored
            event.suggestion = (f"{what} ({reason}): the weights were restored to the last known-good state, the "
                                f"snapshot of step {restored}. See the event of step {source.step} for the cause "
                                "(recovery.restore_at_end: false keeps the final weights).")
        return False
    return Incident(event, Act.RESTORE, conclude=conclude)


def anomaly_error(at: At, base: str, window: Window, found: dict, check_inputs: bool) -> Incident:
    """torch's anomaly mode raised at the op in backward (``anomaly.mode: always``, or the user's own, e.g.
    ``Trainer(detect_anomaly=True)``; ``found``: the error, parsed): diagnosed from it and recorded (the error
    then propagates). ``base``: ``loss`` or ``gradient``, as the step's evidence says."""
    event = at.event(base)
    event.add_action("raise")
    return Incident(event, Act.RECORD, evidence=Evidence(window=window), look_at_inputs=check_inputs,
                    anomaly=found, history=False, detected_at="anomaly_mode")
