"""An incident is a frozen value: what the guard found, and how the incident pipeline is to treat it.

One pure builder per trigger returns an :class:`Incident`: its event (kind, step, where it ran, the evidence
for its details), its :class:`~.record.StepRecord` (a step's incidents), the typed :class:`Evidence` the
diagnosis reads, what the pipeline looks at (the weights, the inputs), whether it is diagnosed and its account
agreed across ranks, where its plan comes from (a :data:`Planning` case), how its step is skipped (:class:`Skip`)
and when it acts (an :data:`Act` case; each case carries its own data). :meth:`~.responder.Responder.respond`
runs every incident through the same skeleton and returns a :class:`Response`, what it did to its step.
:func:`kind_of` is the one place that decides the kind. docs/architecture.md: which type answers which question.

Nothing here changes state or reads a device: the builders take what the caller read (:class:`At`, the step's
flags, the watches' statistics) and the pipeline does the looking (:meth:`.Responder.respond`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Optional, Sequence, Union

from ..core.causes import where_it_ran
from ..core.events import KINDS, NaNEvent
from ..core.record import StepRecord, UpdateStage, Window
from ..detect.spikes import SHIFT_SPIKES, SHIFT_WINDOW
from ..diagnose.context import Evidence
from ..recover.actions import Action, Clip, CutLr, Raise, RollBack, Rollback, SkipStep, Warn, give_up
from ..recover.ladder import Plan

__all__ = ["Act", "NoteNow", "ActNow", "ActAtStepEnd", "RestoreAtEnd", "StopAtStart", "Told", "Planning", "Ladder",
           "Given", "MustRollBack", "At", "Evidence", "Incident", "Look", "Response", "NOTHING_DONE", "kind_of",
           "nonfinite_step", "divergence", "stall", "spike", "persistent_clipping", "bad_weights", "replicas_drifted",
           "fit_start", "after_stop", "unfinished", "anomaly_error", "SPIKES_BEFORE_LR_CUT"]

# loss spikes within recovery.incident_window steps that cut the LR whatever check.spike_action says (one
# spike is noise the detector may have missed; repeated ones are a divergence under way, often one that
# clipping slows down but cannot stop)
SPIKES_BEFORE_LR_CUT = 3


# ---------------------------------------------------------------------- when an incident acts (its Act)

@dataclass(frozen=True)
class NoteNow:
    """Carry out its plan now (an LR cut at most), warn if nothing was done, record it; never a give-up."""


@dataclass(frozen=True)
class ActNow:
    """Outside a step: carry out its plan now, record it, give up if the plan says so."""


@dataclass(frozen=True)
class ActAtStepEnd:
    """Its plan waits for the step's end, after the optimizer skipped the step (:meth:`.Responder.finish`)."""


@dataclass(frozen=True)
class Told:
    """What a fit-end restore tells in its event once the restore is known (:class:`RestoreAtEnd`)."""

    action: Action
    suggestion: str
    details: dict[str, Any]
    stop: bool = False  # nothing could be restored: the fit stops or raises


@dataclass(frozen=True)
class RestoreAtEnd:
    """Fit end: restore the newest snapshot and record what was restored (stop where nothing was and the incident
    says so). ``conclude(restored step or None, why nothing was)`` is the event's account once the restore is
    known."""

    conclude: Callable[[Optional[int], str], Told]


@dataclass(frozen=True)
class StopAtStart:
    """Fit start: nothing known-good exists; stop or raise with ``message``."""

    message: str


Act = Union[NoteNow, ActNow, ActAtStepEnd, RestoreAtEnd, StopAtStart]


# ----------------------------------------------------------------- where its plan comes from (its Planning)

@dataclass(frozen=True)
class Ladder:
    """The recovery ladder's plan (:meth:`.Recovery.plan`); ``rollback_before``: to a snapshot at or before it."""

    rollback_before: Optional[int] = None


@dataclass(frozen=True)
class Given:
    """The builder's own plan."""

    plan: Plan


@dataclass(frozen=True)
class MustRollBack:
    """A rollback counted like any (:meth:`.Recovery.must_roll_back`), or a warning without a snapshot."""

    reason: str


Planning = Union[Ladder, Given, MustRollBack]


class Look(enum.Enum):
    """Which weights the pipeline looks at for the non-finite values behind an incident (syncs: incident only)."""

    NOTHING = "nothing"
    WEIGHTS = "weights"  # parameters and buffers
    PARAMETERS = "parameters"  # a step judged late: the buffers hold the next step's writes already


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


@dataclass(frozen=True)
class Incident:
    """One incident, as its builder describes it (module docstring). Frozen: the pipeline's stages return what
    they found and did; its ``event`` is the user's record, which the pipeline fills in."""

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
    planning: Optional[Planning] = None  # None: no plan
    skip: Optional[SkipStep] = None  # how it keeps its step's update from landing (the skip stage)
    clip_to: Optional[float] = None  # clip the step to this norm, and arm adaptive clipping
    keeps_window: bool = False  # the newest step incident: a fit that ends inside its streak reruns it


@dataclass(frozen=True)
class Response:
    """What an incident did to its step (:meth:`.Responder.respond`, :meth:`.Responder.finish`);
    :data:`NOTHING_DONE` for a step without one (frozen: shared by every healthy step, no allocation on the hot
    path)."""

    skipped: bool = False  # the step's update does not land
    queued: bool = False  # its plan is carried out at the step's end (finish)
    rollback: Optional[Rollback] = None  # the weights went back to a snapshot (:attr:`.Applied.rollback`)
    stopped: bool = False  # the guard gave up or stopped the run
    clip_to: Optional[float] = None  # clip the step to this norm (a loss spike with check.spike_action: clip)

    @property
    def rolled_back(self) -> bool:
        return self.rollback is not None

    @property
    def kept_step(self) -> bool:
        """The rollback kept the current step's gradients (:meth:`.Recovery.rollback`)."""
        return self.rollback is not None and self.rollback.kept_step

    def merge(self, other: "Response") -> "Response":
        """Both responses' doings: skipped, queued or stopped if either is; the later rollback and clip win.

        Args:
            other: what a later incident (or stage) of the same step did.

        Returns:
            A new :class:`Response` (neither operand changes).
        """
        return Response(self.skipped or other.skipped, self.queued or other.queued,
                        other.rollback if other.rollback is not None else self.rollback,
                        self.stopped or other.stopped, other.clip_to if other.clip_to is not None else self.clip_to)


NOTHING_DONE = Response()


def kind_of(base: str, param_findings: Sequence[dict] = (), buffers: Collection[str] = (),
            input_findings: Sequence[dict] = ()) -> str:
    """An event's kind, the one place that decides it: the weights first, then the inputs, then ``base``.

    Args:
        base: the kind the trigger found (the step's flags: :meth:`.StepFlags.incident_kind`, ``replica``, ...).
        param_findings: the non-finite weights found behind it (each with its ``name``).
        buffers: the module's buffer names.
        input_findings: the non-finite tensors found in its batch.

    Returns:
        ``buffer`` where only buffers were non-finite, ``parameter`` where any other weight was, else ``input``
        where the batch holds them, else ``base``.
    """
    if param_findings:
        return "buffer" if all(f["name"] in buffers for f in param_findings) else "parameter"
    return "input" if input_findings else base


def _lrs(record: StepRecord) -> dict[int, float]:
    return {id(g): lr for g, lr in zip(record.optimizer.param_groups, record.lrs)}


# ------------------------------------------------------------------------------------------- a step's

def nonfinite_step(at: At, record: StepRecord, *, grads_were_finite: Optional[bool], check_parameters: bool,
                   check_inputs: bool, scaler: Optional[tuple[int, Optional[float]]] = None) -> Incident:
    """A step with non-finite evidence (or, DDP, ranks whose copies of the reduced gradient disagree and no rank
    has evidence of its own): diagnosed before any state changes (the replay needs the bad forward's weights and
    buffers), skipped, its plan carried out at the step's end. A step judged late was skipped on the device (else,
    applied, it is rolled back); it looks only at the weights it ran on.

    Args:
        at: where it happened (:meth:`At.of` the record).
        record: the judged step, its flags read.
        grads_were_finite: the previous judged step's gradients were finite (None: unchecked).
        check_parameters: ``check.parameters``: look at the weights behind it.
        check_inputs: ``check.inputs`` is not ``off``: look at the batch where no weight explains it.
        scaler: 16-mixed: the GradScaler's overflow streak and scale.

    Returns:
        An :class:`Incident` that acts at the step's end (:class:`ActAtStepEnd`) on the ladder's plan.
    """
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
    overflows, scale = scaler if scaler is not None else (None, None)
    evidence = Evidence(window=record.window, grad_norm=flags.grad_norm, grads_were_finite=grads_were_finite,
                        only_gradients=not flags.local_bad, same_weights=record.update is not UpdateStage.APPLIED,
                        step_lrs=_lrs(record), scaler_overflows=overflows, grad_scale=scale)
    return Incident(event, ActAtStepEnd(), record, evidence, look=look, look_at_inputs=check_inputs, diagnose=True,
                    share=True, replica=replica, planning=Ladder(),
                    skip=SkipStep(mirrored=True, undo_buffers=False, applied_rolls_back=True), keeps_window=True)


def divergence(at: At, record: StepRecord, found: dict, *, act: bool) -> Incident:
    """A finite loss (or gradient norm) running away (:mod:`.detect.divergence`), diagnosed and shared.

    Args:
        at: where it happened.
        record: the judged step.
        found: the divergence watch's evidence (its ``onset_step``, growth, ...), for ``details.divergence``.
        act: ``check.divergence: act``: skip the step, and at its end roll back to a snapshot from before the onset
            and cut the LR as the cause allows (the ladder); else only a warning.

    Returns:
        An :class:`Incident` acting at the step's end on :class:`Ladder` (``act``), else :class:`NoteNow`.
    """
    flags = record.read_flags
    event = at.event("divergence")
    event.details.update(divergence=found, loss=flags.loss, grad_norm=flags.grad_norm,
                         lr=[float(lr) for lr in record.lrs])
    evidence = Evidence(grad_norm=flags.grad_norm, divergence=found, step_lrs=_lrs(record))
    # (shared: every rank sees the same running loss, and adopts one account: one rank's diagnosis, its LR cut)
    if not act:
        event.add_action(Warn())
        return Incident(event, NoteNow(), record, evidence, diagnose=True, share=True)
    return Incident(event, ActAtStepEnd(), record, evidence, diagnose=True, share=True,
                    planning=Ladder(rollback_before=found.get("onset_step")),
                    skip=SkipStep(mirrored=False, undo_buffers=True))


def stall(at: At, found: dict, *, culprit: Optional[str], lr_factor: Optional[float],
          rollback_before: Optional[int], act: bool) -> Incident:
    """A run that stopped learning because its steps are too large (:mod:`.detect.stall`, confirmed by the
    lower-LR probe): cause ``learning_rate``, the probe's and the trigger's numbers in ``details.stall``, the
    parameter the probe's steps moved most (relative to its norm) as the culprit. Outside a step (at its end).

    Args:
        at: where (the step whose batch completed the probe).
        found: the evidence: the trigger's numbers, the probe's losses, its gain ratio, the factor it chose.
        culprit: the parameter that moves most.
        lr_factor: the LR factor the probe measured best (None: none learned: no cut).
        rollback_before: roll back to a snapshot at or before this step (None: no snapshot from before the
            stall exists; the probe measured the cut from the current weights).
        act: ``check.stall: act`` (else only recorded).

    Returns:
        An :class:`Incident` acting now on its own plan (:class:`Given`), or noting it (:class:`NoteNow`).
    """
    event = at.event("stall")
    event.cause, event.culprit = "learning_rate", culprit
    event.details["stall"] = found
    factor = f" by {lr_factor:g}x" if lr_factor is not None else ""
    event.suggestion = (f"The loss stopped falling and the same batches learn more at a lower learning rate: lower "
                        f"it{factor} (or add warm-up). " + (f"The parameter that moves most: {culprit}." if culprit
                                                            else ""))
    if not act or lr_factor is None:
        return Incident(event, NoteNow(), history=False)
    reasons = [f"a lower-LR probe learned {found.get('gain_ratio', 0.0):.3g}x as much from the same batches"]
    back: tuple[Action, ...] = (RollBack(before=rollback_before),) if rollback_before is not None else ()
    plan = Plan(back + (CutLr(lr_factor),), tuple(reasons))
    return Incident(event, ActNow(), history=False, planning=Given(plan))


def spike(at: At, record: StepRecord, *, z: float, test: dict[str, Any], grad_norm_zscore: Optional[float],
          cause: str, growth: dict[str, Any], action: str, clip_to: Optional[float], repeated: bool,
          window: int, samples: Optional[dict[str, Any]] = None, moved: bool = False) -> Incident:
    """A finite loss far above its running statistics. It does not climb the ladder (no rollback, no give-up);
    judged late, it was skipped or clipped on the device already, by the same test.

    Args:
        at: where it happened.
        record: the judged step.
        z: the loss' z-score; ``test``: the detector's statistics (``details.loss_*``).
        grad_norm_zscore: the gradient norm's z-score (None: not known yet).
        cause: the spike's cause (:func:`.diagnose.rules.spike_cause`); ``growth``: its evidence, for the details.
        action: ``check.spike_action``: ``skip_step``, ``clip`` (to ``clip_to``, adaptive clipping armed),
            ``reduce_lr`` or a warning.
        clip_to: the norm a ``clip`` clips the step to.
        repeated: :data:`SPIKES_BEFORE_LR_CUT` spikes within ``window`` steps: the LR is cut whatever the action.
        window: ``recovery.incident_window``.
        samples: a bad batch's per-sample losses (:func:`.diagnose.samples.sample_losses`), for ``details.samples``
            and the suggestion; None: not known.
        moved: the spike test learned this skipped spike's loss (:attr:`.detect.spikes.SpikeDetector.shifted`:
            spikes that keep coming apart are the loss moving, not a bad stretch), ``details.loss_moved``.

    Returns:
        An :class:`Incident` that acts at once (:class:`NoteNow`), with its own LR cut (:class:`Given`) if any.
    """
    flags = record.read_flags
    event = at.event("spike")
    event.details.update(loss=flags.loss, loss_zscore=z, **{f"loss_{k}": v for k, v in test.items()},
                         grad_norm=flags.grad_norm, grad_norm_zscore=grad_norm_zscore)
    event.cause = cause
    event.details.update(growth)
    if samples is not None:
        event.details["samples"] = samples
    event.suggestion = KINDS["spike"].advice if cause != "input" else _bad_batch(at, record, z, action, samples)
    if moved:
        event.details["loss_moved"] = True
        event.suggestion += (f" It made {SHIFT_SPIKES} skipped spikes within {SHIFT_WINDOW} steps, each after "
                             "healthy batches: the loss itself has moved (a harder data mix, a new shard), and the "
                             "spike test has learned it.")
    if clip_to is not None and action == Clip.name:
        event.details["clip_to"] = clip_to
    planning = None
    if action == CutLr.name or repeated:  # repeated spikes are a divergence on its way: cut the LR
        reason = (f"{SPIKES_BEFORE_LR_CUT} loss spikes within {window} steps" if repeated and action != CutLr.name
                  else "loss spike")
        planning = Given(Plan((CutLr(),), (reason,)))
    return Incident(event, NoteNow(), record, planning=planning,
                    skip=SkipStep(mirrored=True, undo_buffers=True) if action == SkipStep.name else None,
                    clip_to=clip_to if action == Clip.name else None)


def _bad_batch(at: At, record: StepRecord, z: float, action: str, samples: Optional[dict[str, Any]] = None) -> str:
    """What a spike on weights that gave a healthy loss a step before tells the user: this batch is bad data (and,
    where its per-sample losses are known, which of its samples)."""
    done = "its update was skipped" if action == SkipStep.name else "its update was applied (check.spike_action: " \
        "skip_step keeps it out of the weights and the optimizer's moments)"
    which = "that batch's samples"
    if samples and samples.get("worst"):
        several = any(w["micro_batch"] for w in samples["worst"])
        named = ", ".join((f"{w['micro_batch']}:{w['index']}" if several else str(w["index"]))
                          + (f" ({w['x_median']:.3g}x)" if w.get("x_median") else "") for w in samples["worst"][:3])
        on = ", on the weights after its update" if samples.get("after_update") else ""
        which = (f"samples {named} of that batch first ({'micro-batch:index; ' if several else ''}loss alone against "
                 f"the median sample's {samples['median']:.3g}{on})")
    return (f"Bad input data: the loss of batch {at.batch_idx} of epoch {at.epoch} (step {record.step}) is {z:.3g} "
            f"spreads above what the same weights gave on the batches before it, and {done}. Check {which} and "
            "their shard (corrupt or mislabelled data, a file read as the wrong type); a smaller LR does not fix "
            "bad data.")


def persistent_clipping(at: At, record: StepRecord, *, streak: int, threshold: Optional[float], cause: str,
                        can_roll_back: bool) -> Incident:
    """The adaptive clip acted on ``streak`` steps in a row: a divergence that clipping slows but does not stop.
    The step is skipped and at its end the run rolls back and cuts the LR (a ``spike`` event: it does not count
    towards the ladder's give-up); judged late, the step was applied and the rollback undoes it.

    Args:
        at: where it happened.
        record: the judged step.
        streak: the clipped steps in a row; ``threshold``: the clip's threshold now.
        cause: its cause (:func:`.diagnose.rules.persistent_clipping_cause`).
        can_roll_back: a snapshot exists to roll back to.

    Returns:
        An :class:`Incident` acting at the step's end on its own plan (:class:`Given`).
    """
    flags = record.read_flags
    event = at.event("spike")
    event.details.update(reason=f"gradient norm clipped by the adaptive clip on {streak} consecutive steps",
                         grad_norm=flags.grad_norm, clip_threshold=threshold, loss=flags.loss)
    event.cause, event.suggestion = cause, KINDS["spike"].advice
    event.add_action(Clip())
    back: tuple[Action, ...] = (RollBack(),) if can_roll_back else ()
    plan = Plan(back + (CutLr(),), ("persistent adaptive clipping",))
    return Incident(event, ActAtStepEnd(), record, planning=Given(plan),
                    skip=SkipStep(mirrored=False, undo_buffers=False))


# ------------------------------------------------------------------------------------ outside a step

def bad_weights(at: At, where: str, *, grads_were_finite: Optional[bool], own_evidence: bool = False) -> Incident:
    """Non-finite weights (or optimizer state) found outside the step decision (before a snapshot or a
    checkpoint, at validation or at the end of fit). Every rank handles it together (each caller agrees its trigger
    across ranks) and adopts the account of the rank that found it.

    Args:
        at: where it happened.
        where: ``details.detected_at`` (``snapshot``, ``checkpoint``, ``validation_start``, ``train_end``).
        grads_were_finite: the last judged step's gradients were finite (None: unchecked).
        own_evidence: this rank's own evidence besides its weights (e.g. its optimizer state).

    Returns:
        An :class:`Incident` that acts now (:class:`ActNow`) on the ladder's plan: roll back, or give up.
    """
    return Incident(at.event("parameter"), ActNow(), evidence=Evidence(grads_were_finite=grads_were_finite),
                    look=Look.WEIGHTS, diagnose=True, share=True, own_evidence=own_evidence, detected_at=where,
                    planning=Ladder())


def replicas_drifted(at: At, gathered: Sequence[dict[str, Any]], odd: list[int], agreed_at: Optional[int],
                     cause: str) -> Incident:
    """DDP, at a snapshot: the replicas' weights are no longer bitwise the same; every rank rolls back to the
    newest snapshot, on which they agreed, counted like any rollback.

    Args:
        at: where it happened.
        gathered: every rank's weights checksum and whereabouts.
        odd: the ranks a majority tells are wrong (none with two ranks).
        agreed_at: the step of the newest snapshot.
        cause: its cause (:func:`.diagnose.rules.drifted_replicas_cause`).

    Returns:
        An :class:`Incident` that acts now (:class:`ActNow`) on a rollback it must make (:class:`MustRollBack`).
    """
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
    return Incident(event, ActNow(), planning=MustRollBack("the DDP replicas' weights differ"))


def fit_start(at: At, findings: list[dict], on_give_up: str) -> Incident:
    """Non-finite parameters before the first step: nothing known-good to roll back to.

    Args:
        at: where it happened.
        findings: the non-finite parameters (:meth:`.WeightCheck.find`).
        on_give_up: ``recovery.on_give_up``: the event's action.

    Returns:
        An :class:`Incident` that stops or raises (:class:`StopAtStart`), naming up to five of them.
    """
    event = at.event("parameter")
    event.add_action(give_up(on_give_up))
    names = ", ".join(f["name"] for f in findings[:5])
    return Incident(event, StopAtStart(f"non-finite parameters before training ({names})"),
                    evidence=Evidence(at_fit_start=True, param_findings=findings), diagnose=True,
                    detected_at="fit_start")


def after_stop(at: At, findings: list[dict], buffers: Collection[str], on_give_up: str) -> Incident:
    """Fit ends on non-finite weights after the guard stopped (gave up, or stopped on suspect hardware): restore
    the newest known-good snapshot; with none, say so and stop or raise.

    Args:
        at: where it happened.
        findings: the non-finite weights; ``buffers``: the module's buffer names (the event's kind).
        on_give_up: ``recovery.on_give_up``, where nothing could be restored.

    Returns:
        An :class:`Incident` that restores (:class:`RestoreAtEnd`); its ``conclude`` tells the event's account.
    """
    event = at.event(kind_of("parameter", findings, buffers))
    event.cause = "unknown"
    names = ", ".join(f["name"] for f in findings[:5]) or "(a weight on another rank)"
    event.details.update(detected_at="train_end", after_stop=True, param_findings=findings[:20])

    def conclude(restored: Optional[int], why: str) -> Told:
        if restored is not None:
            return Told(RollBack(), f"Training ended on non-finite weights ({names}) after the guard had stopped: "
                        f"they were replaced by the last known-good state, the snapshot of step {restored}.",
                        {"restored_step": restored})
        return Told(give_up(on_give_up), f"Training ended on NON-FINITE weights ({names}) after the guard had "
                    f"stopped, and nothing could be restored ({why}).", {"restored_step": None, "not_restored": why},
                    stop=True)
    return Incident(event, RestoreAtEnd(conclude))


def unfinished(at: At, kind: str, source: NaNEvent, reason: str, found: dict[str, Any], *, in_a_row: int,
               unconfirmed: int) -> Incident:
    """Fit ends while recovery is unfinished, on finite weights that are suspect: restore the newest known-good
    snapshot and say from which step.

    Args:
        at: where it happened.
        kind: the event's kind; ``source``: the event behind it (its cause, culprit and op are the new one's).
        reason: why the weights are suspect (:func:`.diagnose.final_weights.suspect`); ``found``: its evidence.
        in_a_row: incidents in a row; ``unconfirmed``: rollbacks not yet confirmed by a snapshot.

    Returns:
        An :class:`Incident` that restores (:class:`RestoreAtEnd`); with no snapshot it warns, never stops.
    """
    event = at.event(kind)
    event.cause, event.culprit, event.op = source.cause, source.culprit, source.op
    event.details.update(detected_at="train_end", reason=reason, source_step=source.step,
                         skipped_steps_in_a_row=in_a_row, unconfirmed_rollbacks=unconfirmed, **found)
    what = ("Training ended inside a streak of incidents, on finite weights that are suspect"
            if not KINDS[kind].runaway else "Training ended while the loss was running away")

    def conclude(restored: Optional[int], why: str) -> Told:
        if restored is None:
            return Told(Warn(), f"{what} ({reason}). There is no snapshot to compare them with or to restore ({why}): "
                        f"the final weights are kept and may be broken. See the event of step {source.step} for the "
                        "cause.", {"not_restored": why})
        return Told(RollBack(), f"{what} ({reason}): the weights were restored to the last known-good state, the "
                    f"snapshot of step {restored}. See the event of step {source.step} for the cause "
                    "(recovery.restore_at_end: false keeps the final weights).", {"restored_step": restored})
    return Incident(event, RestoreAtEnd(conclude))


def anomaly_error(at: At, base: str, window: Window, found: dict, check_inputs: bool) -> Incident:
    """torch's anomaly mode raised at the op in backward (``anomaly.mode: always``, or the user's own
    ``Trainer(detect_anomaly=True)``): diagnosed from the error and recorded; the error then propagates.

    Args:
        at: where it happened.
        base: ``loss`` or ``gradient``, as the step's evidence says.
        window: the step's micro-batches; ``found``: the error, parsed.
        check_inputs: look at the batch (``check.inputs`` is not ``off``).

    Returns:
        An :class:`Incident` recorded at once (:class:`NoteNow`), action ``raise``.
    """
    event = at.event(base)
    event.add_action(Raise())
    return Incident(event, NoteNow(), evidence=Evidence(window=window), look_at_inputs=check_inputs,
                    anomaly=found, history=False, detected_at="anomaly_mode")
