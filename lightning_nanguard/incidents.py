"""What the guard does about an abnormal step: build the event, diagnose it, ask the ladder for a plan, act,
record, and give up when the plan says so.

:class:`Responder` composes the parts of the guard for the incident path; nothing here runs while
training is healthy, except the choice of clipping limit for a loss spike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor

from .config import NaNGuardConfig
from .detect.amp import OverflowWatch, grad_scaler
from .detect.evidence import StepEvidence
from .detect.find import find_batch_nonfinite
from .detect.flags import StepFlags
from .detect.spikes import LossWatch
from .detect.sync import StepSync, share_incident
from .diagnose.causes import IncidentContext
from .diagnose.diagnoser import Diagnoser
from .diagnose.report import render_report
from .diagnose.suggestions import SPIKE_SUGGESTION
from .errors import NaNGuardError
from .recover.actions import current_lrs
from .recover.clipping import Clipper
from .recover.ladder import Plan
from .recover.recovery import Recovery
from .report.events import NaNEvent
from .report.progress import say
from .report.recorder import Recorder

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Responder", "Pending", "LateStep", "SPIKES_BEFORE_LR_CUT"]

# loss spikes within recovery.incident_window steps that cut the LR whatever check.spike_action says (one
# spike is noise the detector may have missed; repeated ones are a divergence under way, often one that
# clipping slows down but cannot stop)
SPIKES_BEFORE_LR_CUT = 3


@dataclass
class Pending:
    """An event whose plan is carried out at the end of the step (after the optimizer skipped it)."""

    event: NaNEvent
    plan: Plan
    ctx: IncidentContext
    report: str  # extra report text (the module frames of a replay)


@dataclass
class LateStep:
    """A step whose flags are on their way to the host (``check.sync: lagged``): what its judgement, one step
    later, needs to know about it."""

    step: int
    epoch: int
    batch_idx: int
    window: list  # (batch, batch_idx) of its micro-batches, kept one step longer for the replay
    rng: list  # the RNG state at each micro-batch
    lrs: list  # the learning rates it ran with
    skip: Tensor  # the device flag that skipped it (0-dim float)
    device_skip: bool  # the optimizer honoured ``skip`` on the device (else a bad step was applied)
    limit: Optional[float]  # the clipping limit applied on the device
    spike_limit: Optional[float]  # the limit applied instead to a loss spike (check.spike_action: clip)
    has_norm: bool  # its gradient norm was computed
    loss_checked: bool
    scaled: bool  # a GradScaler was active
    optimizer: Any = None
    local: Optional[Tensor] = None  # this rank's vector before the all-reduce (DDP)


@dataclass
class SpikeResponse:
    """What a loss spike does to its step: skip it, or clip it to ``clip_to``."""

    skip: bool = False
    clip_to: Optional[float] = None


class Responder:
    """The incident path of the guard, over the parts it composes (see :class:`~.callback.NaNGuard`)."""

    def __init__(self, config: NaNGuardConfig, evidence: StepEvidence, clipper: Clipper, losses: LossWatch,
                 overflow: OverflowWatch, recovery: Recovery, diagnoser: Diagnoser, recorder: Recorder) -> None:
        self.config = config
        self.evidence = evidence
        self.clipper = clipper
        self.losses = losses
        self.overflow = overflow
        self.recovery = recovery
        self.diagnoser = diagnoser
        self.recorder = recorder
        self.sync = StepSync()
        self.pending: list[Pending] = []

    # ------------------------------------------------------------------------------------------- helpers

    def _event(self, trainer: "pl.Trainer", kind: str, late: Optional[LateStep] = None) -> NaNEvent:
        if late is None:
            return self.recorder.new_event(trainer, kind, self.evidence.batch_idx)
        event = self.recorder.new_event(trainer, kind, late.batch_idx)
        event.step, event.epoch = late.step, late.epoch  # recorded for the step it happened at
        return event

    def _context(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", event: NaNEvent,
                 **evidence: Any) -> IncidentContext:
        return self.diagnoser.context(trainer, pl_module, event, norm_history=list(self.clipper.history),
                                      norm_history_end=self.clipper.history_end,
                                      lr_cut_step=self.recovery.lr_cut_step,
                                      loss_history=list(self.losses.history), reference=self.recovery.weights_at,
                                      **evidence)

    def scalars(self, trainer: "pl.Trainer") -> dict[str, float]:
        """The guard's scalars (tags below ``nanguard/``): counts, LR scale, the last gradient norm (and the
        GradScaler's scale)."""
        values = {"incidents": float(self.recorder.incidents), "skipped_steps": float(self.recovery.skipped_steps),
                  "rollbacks": float(self.recovery.rollbacks), "lr_scale": float(self.recovery.lr_scale),
                  "grad_norm": float(self.clipper.last_norm)}
        scaler = grad_scaler(trainer)
        if scaler is not None:
            scale = self.overflow.scale  # read with the step's flags: no extra sync
            values["grad_scale"] = scale if scale is not None else float(scaler.get_scale())
        return values

    def _record(self, trainer: "pl.Trainer", event: NaNEvent, ctx: IncidentContext, extra: str) -> None:
        report = render_report(event, ctx.norm_history, ctx.loss_history, extra)
        self.recorder.record(trainer, event, report, self.scalars(trainer))

    # --------------------------------------------------------------------------------- step incidents

    def incident(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any,
                 params: list[Tensor], flags: StepFlags, scaled: bool, late: Optional[LateStep] = None) -> None:
        """A step with non-finite evidence: diagnose it (before any state changes: the replay needs the
        weights and buffers of the bad forward), skip it, and plan the rest for the end of the step.

        ``late``: a step judged one step after it ran (``check.sync: lagged``): it was skipped on the device
        and its buffer writes undone there (else, applied, it is rolled back); its window is replayed on the
        weights it left, which are the ones it ran on when it was skipped.
        """
        cfg = self.config
        event = self._event(trainer, flags.incident_kind(), late)
        event.details["grad_norm"] = flags.grad_norm
        event.details["lr"] = current_lrs([optimizer]) if late is None else [float(lr) for lr in late.lrs]
        window = list(self.evidence.window) if late is None else late.window
        ctx = self._context(trainer, pl_module, event, batches=window, grad_norm=flags.grad_norm,
                            grads_were_finite=self.evidence.grads_were_finite, only_gradients=not flags.local_bad)
        if late is not None:
            ctx.rng_states = list(late.rng)
        if scaled:
            ctx.scaler_overflows, ctx.grad_scale = self.overflow.overflows, self.overflow.scale
        if late is None:
            self.recovery.undo_buffers()
        # a bad weight read by the forward spoils the loss before any pass over the weights sees it: look now
        ctx.param_findings = self._weight_findings(pl_module, event.kind == "parameter", late)
        if ctx.param_findings:
            event.kind = "parameter"
            if all(f["name"] in _buffer_names(pl_module) for f in ctx.param_findings):
                event.kind = "buffer"
        elif cfg.check.inputs != "off":
            ctx.input_findings = [dict(f, micro_batch=i) for i, (b, _) in enumerate(window)
                                  for f in find_batch_nonfinite(b)]
            if ctx.input_findings:
                event.kind = "input"
        with self.evidence.activations.paused():
            extra = self.diagnoser.diagnose(ctx, self.recorder.events)
        extra = share_incident(self.sync, event, extra, None if late is None else late.local)  # one account for all

        self.evidence.grads_were_finite = math.isfinite(flags.grad_norm) if self.config.check.gradients else None
        step = trainer.global_step if late is None else late.step
        plan = self.recovery.ladder.incident(step, event.kind, can_roll_back=self.recovery.can_roll_back,
                                             cause=event.cause, safe_factor=_safe_factor(event))
        if late is None:
            self.recovery.skip(params)
            event.add_action("skip_step")
        elif late.device_skip:
            self.recovery.skipped_steps += 1
            event.add_action("skip_step")
        else:  # the optimizer could not skip it on the device: undo it
            self.recovery.ladder.step_was_applied(plan, self.recovery.can_roll_back)
        if plan.enable_adaptive_clip:
            event.add_action("clip")
        self.pending.append(Pending(event, plan, ctx, extra))

    def _weight_findings(self, pl_module: "pl.LightningModule", flagged: bool, late: Optional[LateStep]) -> list[dict]:
        """The non-finite parameters and buffers behind an incident (``check.parameters``; syncs: incident only).

        ``flagged``: the step's flags already say so. A lagged step is judged while the next one runs: its own
        weights are the current ones only if it was skipped on the device, and the buffers now hold the next
        step's writes, so only its parameters are looked at (nothing when its update was applied)."""
        if not self.config.check.parameters and not flagged:
            return []
        if late is not None and not flagged and not late.device_skip:
            return []
        findings = self.evidence.state.find(pl_module)
        if late is not None and not flagged:
            params = {n for n, _ in pl_module.named_parameters()}
            findings = [f for f in findings if f["name"] in params]
        return findings

    def divergence(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", params: list[Tensor],
                   flags: StepFlags, evidence: dict, late: Optional[LateStep] = None) -> bool:
        """A finite loss (or gradient norm) running away (:mod:`.detect.divergence`): diagnose and record it.
        With ``check.divergence: act`` the step is skipped, and at its end the run rolls back to the newest
        snapshot from before the onset and the LR is cut as the cause allows (the ladder). Returns True when
        the step is skipped (or, ``late``: read one step later, when its update, already applied, is to be
        rolled back)."""
        event = self._event(trainer, "divergence", late)
        event.details.update(divergence=evidence, loss=flags.loss, grad_norm=flags.grad_norm,
                             lr=current_lrs(trainer.optimizers) if late is None else [float(lr) for lr in late.lrs])
        ctx = self._context(trainer, pl_module, event, grad_norm=flags.grad_norm, divergence=evidence)
        extra = self.diagnoser.diagnose(ctx, self.recorder.events)
        if self.config.check.divergence == "warn":
            event.add_action("warn")
            self._record(trainer, event, ctx, extra)
            return False
        plan = self.recovery.ladder.incident(trainer.global_step if late is None else late.step, "divergence",
                                             can_roll_back=self.recovery.can_roll_back, cause=event.cause,
                                             safe_factor=_safe_factor(event))
        plan.rollback_before = evidence.get("onset_step")
        if late is None:
            self.recovery.skip(params)
            self.recovery.undo_buffers()
            event.add_action("skip_step")
        if plan.enable_adaptive_clip:
            event.add_action("clip")
        self.pending.append(Pending(event, plan, ctx, extra))
        return True

    def spike(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", params: list[Tensor],
              flags: StepFlags, z: float, late: Optional[LateStep] = None) -> SpikeResponse:
        """A finite loss far above its running statistics: record it and apply ``check.spike_action``. A
        spike does not climb the ladder (no rollback, no give-up); three within ``recovery.incident_window``
        steps cut the LR whatever the action. ``late`` (lagged read): the spike was skipped or clipped on the
        device already, by the same test; an LR cut applies from the step after it."""
        action = self.config.check.spike_action
        event = self._event(trainer, "spike", late)
        zclip = self.clipper.zclip
        norm_z = zclip.zscore(flags.grad_norm)
        stats = self.losses.detector.stats
        event.details.update(loss=flags.loss, loss_zscore=z, loss_mean=stats.mean, loss_std=stats.std,
                             grad_norm=flags.grad_norm, grad_norm_zscore=norm_z)
        event.cause = "exploding_gradient" if norm_z is not None and norm_z > zclip.z_threshold else "unknown"
        event.suggestion = SPIKE_SUGGESTION
        response = SpikeResponse()
        if action == "skip_step" and late is not None and not late.device_skip:
            pass  # the optimizer cannot skip on the device: the spike was applied (a warning)
        elif action == "skip_step":
            if late is None:
                self.recovery.skip(params)
                self.recovery.undo_buffers()
            else:
                self.recovery.skipped_steps += 1
            event.add_action("skip_step")
            response.skip = True
        elif action == "clip":
            response.clip_to = zclip.mean
            self.recovery.ladder.arm_adaptive_clip()  # and z-score clipping from now on
            event.add_action("clip")
            event.details["clip_to"] = response.clip_to
        window = self.config.recovery.incident_window
        step = trainer.global_step if late is None else late.step
        repeated = self.losses.detector.repeated(step, SPIKES_BEFORE_LR_CUT, window)
        if action == "reduce_lr" or repeated:  # repeated spikes are a divergence on its way: cut the LR
            reason = (f"{SPIKES_BEFORE_LR_CUT} loss spikes within {window} steps"
                      if repeated and action != "reduce_lr" else "loss spike")
            self.recovery.apply(trainer, pl_module, event, Plan(reduce_lr=True, reasons=[reason]))
        if not event.actions:  # warn, or an LR already at recovery.min_lr_scale
            event.add_action("warn")
        self._record(trainer, event, self._context(trainer, pl_module, event), "")
        return response

    def clipping_persists(self, trainer: "pl.Trainer", params: Optional[list[Tensor]], flags: StepFlags,
                          late: Optional[LateStep] = None) -> None:
        """The adaptive clip acted on ``CLIPS_BEFORE_LR_CUT`` steps in a row: a divergence that clipping slows
        but does not stop, with the weights already drifting. Skip this step, roll back to the newest
        snapshot and cut the LR at the end of the step, like an incident (recorded as a ``spike`` event:
        abnormal, still finite; it does not count towards the ladder's give-up). ``late`` (lagged read): the
        step was applied; the rollback undoes it."""
        zclip = self.clipper.zclip
        event = self._event(trainer, "spike", late)
        event.details.update(reason=f"gradient norm clipped by the adaptive clip on {zclip.streak} consecutive "
                                    "steps", grad_norm=flags.grad_norm, clip_threshold=zclip.threshold(),
                             loss=flags.loss)
        event.cause, event.suggestion = "exploding_gradient", SPIKE_SUGGESTION
        event.add_action("clip")
        zclip.streak = 0
        if late is None:
            event.add_action("skip_step")
            self.recovery.skip(params or [])
        ctx = self._context(trainer, trainer.lightning_module, event)
        plan = Plan(rollback=self.recovery.can_roll_back, reduce_lr=True, reasons=["persistent adaptive clipping"])
        self.pending.append(Pending(event, plan, ctx, ""))

    def finish(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", keep_step: bool = False) -> None:
        """End of the step: carry out the pending plans. ``keep_step``: see :meth:`.Recovery.rollback`."""
        pending, self.pending = self.pending, []
        for p in pending:
            self._conclude(trainer, pl_module, p, keep_step)

    def _conclude(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", p: Pending,
                  keep_step: bool = False) -> None:
        """Carry out the plan, record the event, and stop or raise if the plan gives up."""
        self.recovery.apply(trainer, pl_module, p.event, p.plan, self.overflow.overflows, keep_step)
        self.evidence.state.refresh()  # a rollback replaced the tensors, and the flag computed on them
        self.evidence.forget_state()
        if p.plan.give_up:
            p.event.add_action(self.config.recovery.on_give_up)
        self._record(trainer, p.event, p.ctx, p.report)
        if p.plan.give_up:
            self._give_up(trainer, p.event)

    def _give_up(self, trainer: "pl.Trainer", event: NaNEvent) -> None:
        restored = event.details.get("restored_step")
        message = (f"NaNGuard gave up at step {event.step} after {self.recorder.incidents} incident(s) and "
                   f"{self.recovery.rollbacks} rollback(s); weights restored to the last known-good state"
                   f"{'' if restored is None else f' (step {restored})'}. Last incident: {event.kind}, "
                   f"cause={event.cause}, culprit={event.culprit}. {event.suggestion} "
                   f"Report: {self.recorder.report_path(event)}")
        self._stop_or_raise(trainer, message)

    def _stop_or_raise(self, trainer: "pl.Trainer", message: str) -> None:
        if self.config.recovery.on_give_up == "raise":
            raise NaNGuardError(message)
        trainer.should_stop = True
        say(trainer, "[nanguard] " + message)

    # ----------------------------------------------------------------- incidents outside the step

    def parameter_incident(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", where: str) -> None:
        """Non-finite weights found outside the step decision (before a snapshot or a checkpoint, at
        validation or at the end of fit): roll back (or give up) right away."""
        findings = self.evidence.state.find(pl_module)
        buffers = _buffer_names(pl_module)
        kind = "buffer" if findings and all(f["name"] in buffers for f in findings) else "parameter"
        event = self._event(trainer, kind)
        ctx = self._context(trainer, pl_module, event, grads_were_finite=self.evidence.grads_were_finite,
                            param_findings=findings)
        extra = self.diagnoser.diagnose(ctx, self.recorder.events)
        event.details["detected_at"] = where
        plan = self.recovery.ladder.incident(trainer.global_step, kind, can_roll_back=self.recovery.can_roll_back,
                                             cause=event.cause)
        self._conclude(trainer, pl_module, Pending(event, plan, ctx, extra))

    def unfinished_recovery(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Fit ends while recovery is unfinished (``recovery.restore_at_end``): the weights left can be finite
        and broken, so the newest known-good snapshot is restored and recorded. Unfinished: the last steps were
        skipped incidents (a divergence the skips had not stopped yet), or a rollback forced by them is not yet
        confirmed by a snapshot after healthy training. Not: skipped bad inputs alone (the weights never saw
        them), nor the healthy steps after rolling back a one-off bad parameter (the snapshot was fine)."""
        recovery, ladder = self.recovery, self.recovery.ladder
        if not recovery.unfinished:
            return
        incidents = [e for e in self.recorder.events if e.kind != "spike"]
        skipped = incidents[-ladder.consecutive:] if ladder.consecutive else []
        rolled_back = next((e for e in reversed(incidents) if "rollback" in e.actions), None)
        unconfirmed = ladder.failed_rollbacks > 0 and (rolled_back is None or rolled_back.kind not in (
            "parameter", "buffer"))
        if not unconfirmed and all(e.kind == "input" for e in skipped):
            return
        if not skipped and recovery.healthy_since_snapshot == 0:
            return  # the last step rolled back: the weights are the newest snapshot's already
        last = incidents[-1] if incidents else None
        event = self._event(trainer, last.kind if last is not None else "parameter")
        if last is not None:
            event.cause, event.culprit, event.op = last.cause, last.culprit, last.op
        event.details.update(detected_at="train_end", skipped_steps_in_a_row=ladder.consecutive,
                             unconfirmed_rollbacks=ladder.failed_rollbacks,
                             last_incident_step=last.step if last is not None else None)
        restored = recovery.restore_newest(trainer, pl_module, self.overflow.overflows)
        if restored is None:
            event.add_action("warn")
            event.suggestion = ("Training ended while the guard was still recovering and there is no snapshot to "
                                "restore (recovery.snapshot: off): the final weights may be diverged. Lower the "
                                "learning rate, or train longer.")
        else:
            event.add_action("rollback")
            event.details["restored_step"] = restored
            event.suggestion = (f"Training ended while the guard was still recovering: the weights were restored to "
                                f"the last known-good state (step {restored}). Lower the learning rate, or train "
                                "longer so that recovery can complete (recovery.restore_at_end: false keeps the "
                                "final weights).")
        self.evidence.state.refresh()
        self._record(trainer, event, self._context(trainer, pl_module, event), "")

    def initialization_incident(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                findings: list[dict]) -> None:
        """Non-finite parameters before the first step: nothing known-good to roll back to; stop or raise."""
        event = self._event(trainer, "parameter")
        ctx = self._context(trainer, pl_module, event, at_fit_start=True, param_findings=findings)
        extra = self.diagnoser.diagnose(ctx, self.recorder.events)
        event.details["detected_at"] = "fit_start"
        self.recovery.stopped = True
        event.add_action(self.config.recovery.on_give_up)
        self._record(trainer, event, ctx, extra)
        self._stop_or_raise(trainer, f"NaNGuard: non-finite parameters before training "
                                     f"({', '.join(f['name'] for f in findings[:5])}). {event.suggestion} "
                                     f"Report: {self.recorder.report_path(event)}")

    def anomaly_error(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", error: BaseException) -> None:
        """torch's anomaly mode raised at the op in backward (``anomaly.mode: always``, or the user's own,
        e.g. ``Trainer(detect_anomaly=True)``): diagnose and record it (the error then propagates)."""
        found = self.diagnoser.anomaly_error(error)
        if found is None:
            return
        event = self._event(trainer, "loss" if self.evidence.loss_bad() else "gradient")
        ctx = self.diagnoser.context(trainer, pl_module, event, batches=list(self.evidence.window))
        if self.config.check.inputs != "off":
            ctx.input_findings = [dict(f, micro_batch=i) for i, (b, _) in enumerate(self.evidence.window)
                                  for f in find_batch_nonfinite(b)]
            if ctx.input_findings:
                event.kind = "input"
        event.details["detected_at"] = "anomaly_mode"
        extra = self.diagnoser.diagnose_error(ctx, found)
        event.add_action("raise")
        self._record(trainer, event, ctx, extra)


def _safe_factor(event: NaNEvent) -> Optional[float]:
    """The LR factor at which the diagnosis' relative update would be safe (cause ``learning_rate``)."""
    found = event.details.get("relative_update")
    return found["safe_lr"] / found["lr"] if found and found.get("safe_lr") is not None and found["lr"] > 0 else None


def _buffer_names(pl_module: "pl.LightningModule") -> set[str]:
    return {n for n, _ in pl_module.named_buffers()}
