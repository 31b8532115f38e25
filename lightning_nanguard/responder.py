"""What the guard does about an abnormal step: build the event, diagnose it, ask recovery for a plan, act,
record, and give up when the plan says so.

:class:`Responder` composes the parts of the guard for the incident path; nothing here runs while training
is healthy. A judged step comes as its :class:`~.record.StepRecord`: where the step was, its window of
batches, and what can still be done about its update (:class:`~.record.UpdateStage`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional


from .account import share_incident
from .causes import cause as cause_entry, suggest, where_it_ran
from .config import NaNGuardConfig
from .console import say
from .counters import Counters
from .detect.amp import OverflowWatch, grad_scaler
from .detect.evidence import StepEvidence
from .detect.find import find_batch_nonfinite
from .detect.placement import whereabouts
from .detect.ranks import Ranks
from .detect.replicas import weights_checksum
from .detect.spikes import LossWatch
from .diagnose import dynamics
from .diagnose.diagnoser import Diagnoser
from .diagnose.replay import local_gradients, reproduces
from .diagnose.rules import IncidentContext, drifted_replicas_cause, persistent_clipping_cause, spike_cause
from .errors import NaNGuardError
from .events import KINDS, NaNEvent
from .record import StepRecord, UpdateStage, Window
from .recover.clipping import Clipper
from .recover.ladder import Plan
from .recover.recovery import Recovery
from .report.recorder import Recorder, logger_step
from .report.render import ReportText

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Responder", "Pending", "SPIKES_BEFORE_LR_CUT"]

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
class SpikeResponse:
    """What a loss spike does to its step: skip it, or clip it to ``clip_to``."""

    skip: bool = False
    clip_to: Optional[float] = None


class Responder:
    """The incident path of the guard, over the parts it composes (see :class:`~.callback.NaNGuard`).

    Attributes:
        pending: the events of this step whose plans are carried out at its end (:meth:`finish`).
        sync: how evidence agrees across ranks (set at fit start).
    """

    def __init__(self, config: NaNGuardConfig, counters: Counters, evidence: StepEvidence, clipper: Clipper,
                 losses: LossWatch, overflow: OverflowWatch, recovery: Recovery, diagnoser: Diagnoser,
                 recorder: Recorder) -> None:
        self.config = config
        self.counters = counters
        self.evidence = evidence
        self.clipper = clipper
        self.losses = losses
        self.overflow = overflow
        self.recovery = recovery
        self.diagnoser = diagnoser
        self.recorder = recorder
        self.sync = Ranks()
        self.pending: list[Pending] = []
        # the newest incident and its window: a fit that ends inside its streak reruns it at the end
        self.last_incident: Optional[tuple[NaNEvent, Window]] = None
        # the guard stopped on non-finite weights it could not replace, and said so (fit start, a give-up)
        self.left_nonfinite = False

    # ------------------------------------------------------------------------------------------- helpers

    def _event(self, trainer: "pl.Trainer", kind: str, record: Optional[StepRecord] = None) -> NaNEvent:
        """A new event of ``kind`` (numbered when recorded): at the judged step of ``record``, or (outside a step)
        where the trainer is; on this rank, its host and device (:func:`.detect.sync.whereabouts`)."""
        where = whereabouts(trainer)
        if record is None:
            return NaNEvent(step=trainer.global_step, epoch=trainer.current_epoch, batch_idx=self.evidence.batch_idx,
                            kind=kind, log_step=logger_step(trainer), **where)
        return NaNEvent(step=record.step, epoch=record.epoch, batch_idx=record.batch_idx, kind=kind,
                        log_step=record.log_step, **where)

    def _context(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", event: NaNEvent,
                 record: Optional[StepRecord] = None, **evidence: Any) -> IncidentContext:
        """The diagnosis' context of ``event``. Called on every rank at the same point of an incident (each caller's
        trigger is agreed across ranks), so it may issue a collective: the snapshots' module norms, which the
        diagnosis reads from a sharded store (:meth:`.Recovery.prepare_reference`)."""
        if record is not None:  # the LRs the step ran at (judged late, its scheduler stepped since)
            evidence["step_lrs"] = {id(g): lr for g, lr in zip(record.optimizer.param_groups, record.lrs)}
        recovery = self.recovery
        recovery.prepare_reference(dynamics.norms)
        return self.diagnoser.context(trainer, pl_module, event, norm_history=list(self.clipper.history),
                                      norm_history_end=self.clipper.history_end,
                                      lr_cut_step=recovery.lr_cut_step, loss_history=list(self.losses.history),
                                      reference=lambda step: recovery.reference_norms(step, dynamics.norms),
                                      norm_type=self.config.clip.norm_type, **evidence)

    def scalars(self, trainer: "pl.Trainer") -> dict[str, float]:
        """The guard's scalars (tags below ``nanguard/``): counts, LR scale, the last gradient norm (and the
        GradScaler's scale)."""
        counts = self.counters
        values = {"incidents": float(counts["incidents"]), "skipped_steps": float(counts["skipped_steps"]),
                  "rollbacks": float(counts["rollbacks"]), "lr_scale": float(self.recovery.lr_scale),
                  "grad_norm": float(self.clipper.last_norm)}
        scaler = grad_scaler(trainer)
        if scaler is not None:
            scale = self.overflow.scale  # read with the step's flags: no extra sync
            values["grad_scale"] = scale if scale is not None else float(scaler.get_scale())
        return values

    def _record(self, trainer: "pl.Trainer", event: NaNEvent, ctx: IncidentContext, extra: str) -> None:
        text = ReportText(ctx.norm_history, ctx.loss_history, extra)
        self.recorder.record(event, text, lambda: self.scalars(trainer))

    def _skip(self, record: StepRecord, *, mirrored: bool, undo_buffers: bool) -> bool:
        """Keep the step's update from landing, where that is still possible; True when it does not land.

        ``PENDING``: the host skips it (and undoes its buffer writes with ``undo_buffers``). ``ON_DEVICE``: a
        decision the device ``mirrored`` (its skip flag is the host's test: an incident, a loss spike to skip)
        skipped it there already, and it is counted; any other decision came too late. ``APPLIED``: too late.
        """
        if record.update is UpdateStage.PENDING:
            self.recovery.skip(record.params)
            if undo_buffers:
                self.recovery.undo_buffers()
            return True
        if record.update is UpdateStage.ON_DEVICE and mirrored:
            self.recovery.count_skip()
            return True
        return False

    def _arm_clip(self, plan: Plan, event: NaNEvent) -> None:
        if plan.arm_clip and self.clipper.arm():
            event.add_action("clip")

    # --------------------------------------------------------------------------------- step incidents

    def incident(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", record: StepRecord) -> None:
        """A step with non-finite evidence: diagnose it (before any state changes: the replay needs the
        weights and buffers of the bad forward), skip it, and plan the rest for the end of the step.

        A step judged one step after it ran (not ``PENDING``) was skipped on the device and its buffer writes
        undone there (else, applied, it is rolled back); its window is replayed on the weights it left, which
        are the ones it ran on when it was skipped.
        """
        cfg, flags = self.config, record.evidence
        # DDP: the ranks' copies of the reduced gradient disagree (and no rank has evidence of its own): the same
        # on every rank, as is every decision below that issues a collective
        replica = record.replica is not None and not flags.local_bad
        event = self._event(trainer, "replica" if replica else flags.incident_kind(), record)
        event.details["grad_norm"] = flags.grad_norm
        event.details["lr"] = [float(lr) for lr in record.lrs]
        if record.replica is not None:
            event.details["replica"] = dict(record.replica)
        window = record.window
        ctx = self._context(trainer, pl_module, event, record, window=window, grad_norm=flags.grad_norm,
                            grads_were_finite=self.evidence.grads_were_finite, only_gradients=not flags.local_bad,
                            same_weights=record.update is not UpdateStage.APPLIED)
        self.last_incident = (event, window.copy())  # (the evidence's live window is cleared at the step's end)
        if record.scaled:
            ctx.scaler_overflows, ctx.grad_scale = self.overflow.overflows, self.overflow.scale
        if record.update is UpdateStage.PENDING:
            self.recovery.undo_buffers()
        # a bad weight read by the forward spoils the loss before any pass over the weights sees it: look now
        ctx.param_findings = self._weight_findings(pl_module, event.kind == "parameter", record)
        if ctx.param_findings:
            event.kind = "parameter"
            if all(f["name"] in _buffer_names(pl_module) for f in ctx.param_findings):
                event.kind = "buffer"
        elif cfg.check.inputs != "off":
            ctx.input_findings = [dict(f, micro_batch=i) for i, (b, _) in enumerate(window.batches)
                                  for f in find_batch_nonfinite(b)]
            if ctx.input_findings:
                event.kind = "input"
        with self.evidence.activations.paused():
            extra = self.diagnoser.diagnose(ctx, self.recorder.events)
            recomputed = self._recompute(trainer, pl_module, record) if replica else None
        extra = share_incident(self.sync, event, extra, record.local, own_norm=flags.grad_norm if replica else None,
                               recomputed=recomputed)  # one account for all: the rank that produced the fault
        if self.sync.distributed:  # the suggestion names where the chosen rank ran
            event.suggestion = suggest(event, event.cause)

        self.evidence.grads_were_finite = math.isfinite(flags.grad_norm) if cfg.check.gradients else None
        plan = self.recovery.plan(record.step, event, clip_armed=self.clipper.armed)
        if self._skip(record, mirrored=True, undo_buffers=False):
            event.add_action("skip_step")
        else:  # the optimizer could not skip it on the device: undo it
            self.recovery.step_was_applied(plan)
        self._arm_clip(plan, event)
        self.pending.append(Pending(event, plan, ctx, extra))

    def _recompute(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                   record: StepRecord) -> Optional[tuple[float, Optional[tuple[int, ...]]]]:
        """Two replicas disagree and no majority can tell which copy is wrong: recompute the reduced gradient's
        norm (and checksum) from every rank's replayed local gradient (one incident-only all-reduce of the whole
        gradient, on every rank: :meth:`.Ranks.reduced_norm`). None where it cannot be: with ``anomaly.mode:
        off`` (no replays), manual optimization, more than two ranks (a majority tells), or a step whose update was
        already applied (other weights)."""
        if (self.sync.world_size != 2 or self.config.anomaly.mode == "off" or record.update is UpdateStage.APPLIED
                or not getattr(pl_module, "automatic_optimization", True)):
            return None
        params = [p for group in record.optimizer.param_groups for p in group["params"]]
        window = record.window
        grads = local_gradients(trainer, pl_module, window.batches, window.rng, params, window.step)
        return self.sync.reduced_norm(grads, params)

    def _weight_findings(self, pl_module: "pl.LightningModule", flagged: bool, record: StepRecord) -> list[dict]:
        """The non-finite parameters and buffers behind an incident (``check.parameters``; syncs: incident only).

        ``flagged``: the step's flags already say so. A step judged late is judged while the next one runs: its
        own weights are the current ones only if it was skipped on the device, and the buffers now hold the
        next step's writes, so only its parameters are looked at (nothing when its update was applied)."""
        if not self.config.check.parameters and not flagged:
            return []
        if record.update is UpdateStage.APPLIED and not flagged:
            return []
        findings = self.evidence.weights.find(pl_module)
        if record.update is not UpdateStage.PENDING and not flagged:
            params = {n for n, _ in pl_module.named_parameters()}
            findings = [f for f in findings if f["name"] in params]
        return findings

    def divergence(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", record: StepRecord,
                   evidence: dict) -> bool:
        """A finite loss (or gradient norm) running away (:mod:`.detect.divergence`): diagnose and record it.
        With ``check.divergence: act`` the step is skipped, and at its end the run rolls back to the newest
        snapshot from before the onset and the LR is cut as the cause allows (the ladder). Returns True when
        the step is skipped (or, judged late, when its update, already applied, is to be rolled back)."""
        flags = record.evidence
        event = self._event(trainer, "divergence", record)
        event.details.update(divergence=evidence, loss=flags.loss, grad_norm=flags.grad_norm,
                             lr=[float(lr) for lr in record.lrs])
        ctx = self._context(trainer, pl_module, event, record, grad_norm=flags.grad_norm, divergence=evidence)
        extra = self.diagnoser.diagnose(ctx, self.recorder.events)
        if self.config.check.divergence == "warn":
            event.add_action("warn")
            self._record(trainer, event, ctx, extra)
            return False
        plan = self.recovery.plan(record.step, event, clip_armed=self.clipper.armed,
                                  rollback_before=evidence.get("onset_step"))
        if self._skip(record, mirrored=False, undo_buffers=True):
            event.add_action("skip_step")
        self._arm_clip(plan, event)
        self.pending.append(Pending(event, plan, ctx, extra))
        return True

    def spike(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", record: StepRecord,
              z: float) -> SpikeResponse:
        """A finite loss far above its running statistics: record it and apply ``check.spike_action``. A
        spike does not climb the ladder (no rollback, no give-up); three within ``recovery.incident_window``
        steps cut the LR whatever the action. Judged late, the spike was skipped or clipped on the device
        already, by the same test; an LR cut applies from the step after it."""
        action, flags = self.config.check.spike_action, record.evidence
        event = self._event(trainer, "spike", record)
        test, check = self.losses.detector.last, self.config.check
        event.details.update(loss=flags.loss, loss_zscore=z, **{f"loss_{k}": v for k, v in test.items()},
                             grad_norm=flags.grad_norm, grad_norm_zscore=self.clipper.zscore(flags.grad_norm))
        event.cause, growth = spike_cause(flags.grad_norm, list(self.clipper.history), check.divergence_growth,
                                          check.divergence_steps)
        event.details.update(growth)
        event.suggestion = KINDS["spike"].advice
        response = SpikeResponse()
        if action == "skip_step":
            if self._skip(record, mirrored=True, undo_buffers=True):  # (else applied: a warning)
                event.add_action("skip_step")
                response.skip = True
        elif action == "clip":
            response.clip_to = self.clipper.zclip.mean
            self.clipper.arm()  # and z-score clipping from now on
            event.add_action("clip")
            event.details["clip_to"] = response.clip_to
        window = self.config.recovery.incident_window
        repeated = self.losses.detector.repeated(record.step, SPIKES_BEFORE_LR_CUT, window)
        if action == "reduce_lr" or repeated:  # repeated spikes are a divergence on its way: cut the LR
            reason = (f"{SPIKES_BEFORE_LR_CUT} loss spikes within {window} steps"
                      if repeated and action != "reduce_lr" else "loss spike")
            self._apply(trainer, pl_module, event, Plan(reduce_lr=True, reasons=[reason]))
        if not event.actions:  # warn, or an LR already at recovery.min_lr_scale
            event.add_action("warn")
        self._record(trainer, event, self._context(trainer, pl_module, event), "")
        return response

    def clipping_persists(self, trainer: "pl.Trainer", record: StepRecord) -> None:
        """The adaptive clip acted on ``CLIPS_BEFORE_LR_CUT`` steps in a row: a divergence that clipping slows
        but does not stop, with the weights already drifting. Skip this step, roll back to the newest
        snapshot and cut the LR at the end of the step, like an incident (recorded as a ``spike`` event:
        abnormal, still finite; it does not count towards the ladder's give-up). Judged late, the step was
        applied; the rollback undoes it."""
        flags, zclip = record.evidence, self.clipper.zclip
        event = self._event(trainer, "spike", record)
        event.details.update(reason=f"gradient norm clipped by the adaptive clip on {zclip.streak} consecutive "
                                    "steps", grad_norm=flags.grad_norm, clip_threshold=zclip.threshold(),
                             loss=flags.loss)
        event.cause, event.suggestion = persistent_clipping_cause(), KINDS["spike"].advice
        event.add_action("clip")
        self.clipper.reset_streak()
        if self._skip(record, mirrored=False, undo_buffers=False):
            event.add_action("skip_step")
        ctx = self._context(trainer, trainer.lightning_module, event)
        plan = Plan(rollback=self.recovery.can_roll_back, reduce_lr=True, reasons=["persistent adaptive clipping"])
        self.pending.append(Pending(event, plan, ctx, ""))

    def finish(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", keep_step: bool = False) -> None:
        """End of the step: carry out the pending plans. ``keep_step``: see :meth:`.Recovery.rollback`."""
        pending, self.pending = self.pending, []
        for p in pending:
            self._conclude(trainer, pl_module, p, keep_step)

    def _apply(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", event: NaNEvent, plan: Plan,
               keep_step: bool = False) -> None:
        done = self.recovery.apply(trainer, pl_module, plan, event.step, self.overflow.overflows, keep_step)
        for action in done.actions:
            event.add_action(action)
        event.details.update(done.details)

    def _conclude(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", p: Pending,
                  keep_step: bool = False) -> None:
        """Carry out the plan, record the event, and stop or raise if the plan gives up."""
        self._apply(trainer, pl_module, p.event, p.plan, keep_step)
        self.evidence.weights.refresh()  # a rollback replaced the tensors, and the flag computed on them
        self.evidence.forget_state()
        if p.plan.give_up:
            p.event.add_action(self.config.recovery.on_give_up)
        suspect = None if p.plan.give_up else self._hardware(trainer, p.event)
        self._record(trainer, p.event, p.ctx, p.report)
        if p.plan.give_up:
            self._give_up(trainer, pl_module, p.event)
        elif suspect is not None:
            self._suspect_hardware(trainer, p.event, suspect)

    def _hardware(self, trainer: "pl.Trainer", event: NaNEvent) -> Optional[str]:
        """Count a fault that does not come back against the rank that produced it (not where no rank is known);
        past ``recovery.transient_limit`` within ``transient_window`` steps, the rank's hardware is suspect: say so
        in the event and return the message for ``recovery.on_suspect_hardware``. The same on every rank: every rank
        records the same event."""
        if not cause_entry(event.cause).hardware_fault or event.details.get("ranks") == []:
            return None
        cfg = self.config.recovery
        steps = self.recovery.hardware.fault(event.rank, event.step)
        if steps is None:
            return None
        where = where_it_ran(event)
        event.details["suspect_hardware"] = {"rank": event.rank, "host": event.host, "device": event.device,
                                             "local_rank": event.local_rank, "faults": len(steps), "steps": steps,
                                             "window": cfg.transient_window, "policy": cfg.on_suspect_hardware}
        message = (f"the hardware of {where} is suspect: {len(steps)} faults that did not come back within "
                   f"{cfg.transient_window} steps (steps {', '.join(map(str, steps))}; recovery.transient_limit="
                   f"{cfg.transient_limit}). Test that device or have the job scheduler exclude host "
                   f"{event.host or '(unknown)'}.")
        event.suggestion = f"{event.suggestion} {message[0].upper()}{message[1:]}"
        event.add_action(cfg.on_suspect_hardware)
        return message

    def _suspect_hardware(self, trainer: "pl.Trainer", event: NaNEvent, message: str) -> None:
        """``recovery.on_suspect_hardware``: warn (on screen, the run goes on), stop the Trainer (the weights are
        good: the faulty steps were skipped), or raise :class:`NaNGuardError` naming the rank and host."""
        policy = self.config.recovery.on_suspect_hardware
        text = f"NaNGuard at step {event.step}: {message} Report: {self.recorder.report_path(event)}"
        if policy == "raise":
            raise NaNGuardError(text)
        if policy == "stop":
            self.recovery.stop()
            trainer.should_stop = True
        say(trainer, "[nanguard] " + text)

    def _give_up(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", event: NaNEvent) -> None:
        """Say exactly what the give-up restored (and from which step), or that nothing could be, and whether the
        weights left are finite; then stop or raise."""
        restored = event.details.get("restored_step")
        rollbacks = self.counters["rollbacks"] - (restored is not None)  # the give-up's own restore is not one
        if restored is not None:
            state = (f"the module, optimizers and LR schedulers were restored to the last known-good state, the "
                     f"snapshot of step {restored}")
        else:
            bad = self.evidence.weights.find(pl_module)
            self.left_nonfinite = bool(bad)
            state = (f"nothing could be restored ({event.details.get('not_restored', 'no snapshot')}): the weights "
                     + (f"are left NON-FINITE ({', '.join(f['name'] for f in bad[:5])})" if bad else
                        f"are left as they were before step {event.step} (finite; that step was not applied)"))
        message = (f"NaNGuard gave up at step {event.step} after {self.counters['incidents']} incident(s) and "
                   f"{rollbacks} rollback(s); {state}. Last incident: {event.kind}, "
                   f"cause={event.cause}, culprit={event.culprit}. {event.suggestion} "
                   f"Report: {self.recorder.report_path(event)}")
        self._stop_or_raise(trainer, message)

    def _stop_or_raise(self, trainer: "pl.Trainer", message: str) -> None:
        if self.config.recovery.on_give_up == "raise":
            raise NaNGuardError(message)
        trainer.should_stop = True
        say(trainer, "[nanguard] " + message)

    # ----------------------------------------------------------------- incidents outside the step

    def parameter_incident(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", where: str,
                           own_evidence: bool = False) -> None:
        """Non-finite weights (or optimizer state) found outside the step decision (before a snapshot or a
        checkpoint, at validation or at the end of fit): roll back (or give up) right away. Under DDP every rank
        calls it together (each caller agrees its trigger across ranks) and every rank adopts the account of the
        rank that found it (its own weights, or ``own_evidence``: e.g. its optimizer state)."""
        findings = self.evidence.weights.find(pl_module)
        buffers = _buffer_names(pl_module)
        kind = "buffer" if findings and all(f["name"] in buffers for f in findings) else "parameter"
        event = self._event(trainer, kind)
        ctx = self._context(trainer, pl_module, event, grads_were_finite=self.evidence.grads_were_finite,
                            param_findings=findings)
        extra = self.diagnoser.diagnose(ctx, self.recorder.events)
        extra = share_incident(self.sync, event, extra, found=bool(findings) or own_evidence)
        event.details["detected_at"] = where
        plan = self.recovery.plan(trainer.global_step, event, clip_armed=self.clipper.armed)
        self._conclude(trainer, pl_module, Pending(event, plan, ctx, extra))

    def nonfinite_after_stop(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Fit ends on non-finite weights after the guard stopped (gave up, or stopped on suspect hardware): restore
        the newest known-good snapshot; with none, say so and stop or raise (``recovery.on_give_up``). Nothing new
        where the guard already said it left them non-finite. Every rank calls it together."""
        if self.left_nonfinite:
            return
        findings = self.evidence.weights.find(pl_module)
        buffers = _buffer_names(pl_module)
        event = self._event(trainer, "buffer" if findings and all(f["name"] in buffers for f in findings)
                            else "parameter")
        event.cause = "unknown"
        names = ", ".join(f["name"] for f in findings[:5]) or "(a weight on another rank)"
        event.details.update(detected_at="train_end", after_stop=True, param_findings=findings[:20])
        restored = self.recovery.restore_newest(trainer, pl_module, self.overflow.overflows)
        self.evidence.weights.refresh()
        if restored is not None:
            event.add_action("rollback")
            event.details["restored_step"] = restored
            event.suggestion = (f"Training ended on non-finite weights ({names}) after the guard had stopped: they "
                                f"were replaced by the last known-good state, the snapshot of step {restored}.")
            self._record(trainer, event, self._context(trainer, pl_module, event), "")
            return
        self.left_nonfinite = True
        event.details["restored_step"] = None
        event.details["not_restored"] = self.recovery.why_nothing_to_restore()
        event.add_action(self.config.recovery.on_give_up)
        event.suggestion = (f"Training ended on NON-FINITE weights ({names}) after the guard had stopped, and "
                            f"nothing could be restored ({event.details['not_restored']}).")
        self._record(trainer, event, self._context(trainer, pl_module, event), "")
        self._stop_or_raise(trainer, f"NaNGuard: {event.suggestion} Report: {self.recorder.report_path(event)}")

    def unfinished_recovery(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                            diverging: bool = False) -> None:
        """Fit ends while recovery is unfinished (``recovery.restore_at_end``; the weights are finite): restore the
        newest known-good snapshot only if the final weights are suspect (:meth:`_suspect`), and record what was
        restored, from which step, and why.

        ``diverging``: the divergence watch sees the loss running away at the end (:meth:`.DivergenceWatch.growing`).
        A skipped step leaves the weights as they were, and the healthy steps after a rollback are good steps:
        neither makes the weights suspect; and weights that are the newest snapshot's already (no step applied
        since it was taken or restored) leave nothing to restore."""
        recovery = self.recovery
        last, self.last_incident = self.last_incident, None
        if not recovery.unfinished or recovery.pristine:
            return
        found = self._suspect(trainer, pl_module, last, diverging)
        if found is None:
            return
        kind, source, reason, evidence = found
        event = self._event(trainer, kind)
        event.cause, event.culprit, event.op = source.cause, source.culprit, source.op
        event.details.update(detected_at="train_end", reason=reason, source_step=source.step,
                             skipped_steps_in_a_row=recovery.incidents_in_a_row,
                             unconfirmed_rollbacks=recovery.unconfirmed_rollbacks, **evidence)
        restored = recovery.restore_newest(trainer, pl_module, self.overflow.overflows)
        what = ("Training ended inside a streak of incidents, on finite weights that are suspect"
                if not KINDS[kind].runaway else "Training ended while the loss was running away")
        if restored is None:
            event.add_action("warn")
            event.suggestion = (f"{what} ({reason}). There is no snapshot to compare them with or to restore "
                                "(recovery.snapshot: off): the final weights are kept and may be broken. See the "
                                f"event of step {source.step} for the cause.")
        else:
            event.add_action("rollback")
            event.details["restored_step"] = restored
            event.suggestion = (f"{what} ({reason}): the weights were restored to the last known-good state, the "
                                f"snapshot of step {restored}. See the event of step {source.step} for the cause "
                                "(recovery.restore_at_end: false keeps the final weights).")
        self.evidence.weights.refresh()
        self._record(trainer, event, self._context(trainer, pl_module, event), "")

    def _suspect(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                 last: Optional[tuple[NaNEvent, Window]],
                 diverging: bool) -> Optional[tuple[str, NaNEvent, str, dict[str, Any]]]:
        """Are the final (finite) weights suspect? ``(kind, the event behind it, reason, details)``, or None.

        - ``parameter``, finite but broken: the fit ended inside a streak of incidents that the weights themselves
          reproduce. The last incident's micro-batches, rerun on the final weights (:func:`.replay.reproduces`),
          are non-finite again, and on the newest snapshot's weights they are not (non-finite there too: the
          batch or the code is at fault, and the snapshot would not help). Inputs never make the weights
          suspect, nor does a fault that the rerun does not reproduce (a one-off). Where the batch cannot be
          rerun (``anomaly.mode: off``, manual optimization) the streak counts as suspect: the safe side.
        - ``divergence``, unresolved: a rollback (``check.divergence: act``, or any forced rollback) is not yet
          confirmed by a snapshot and the loss is running away at the end. With ``check.divergence: warn`` the
          guard never rolls back, at the end of fit neither.
        """
        recovery, events = self.recovery, self.recorder.events
        incidents = [e for e in events if KINDS[e.kind].incident]
        if recovery.incidents_in_a_row > 0 and incidents:
            found = self._streak_suspect(trainer, pl_module, incidents[-1], last)
            if found is not None:
                return found
        if recovery.unconfirmed_rollbacks > 0 and diverging:
            rolled_back = next((e for e in reversed(events) if "rollback" in e.actions), None)
            if rolled_back is not None:
                return ("divergence", rolled_back, f"the loss grew again after the rollback of step "
                                                   f"{rolled_back.step}, before a snapshot confirmed it", {})
            source = next((e for e in reversed(events) if KINDS[e.kind].runaway), None)
            if source is not None:  # no snapshot: the rollback it called for never happened
                return "divergence", source, f"the divergence of step {source.step} was never rolled back", {}
        return None

    def _streak_suspect(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", newest: NaNEvent,
                        last: Optional[tuple[NaNEvent, Window]]) -> Optional[tuple[str, NaNEvent, str, dict]]:
        """:meth:`_suspect` for a fit that ended inside a streak of incidents, the newest ``newest``."""
        if not cause_entry(newest.cause).weights_suspect:
            return None  # e.g. a bad batch: the weights never saw it
        automatic = getattr(pl_module, "automatic_optimization", True)
        if last is None or last[0] is not newest or self.config.anomaly.mode == "off" or not automatic:
            why = ("anomaly.mode: off" if self.config.anomaly.mode == "off" else
                   "manual optimization" if not automatic else "its batch is not kept")
            return "parameter", newest, f"the batch of step {newest.step} cannot be rerun ({why}): taken as suspect", {}
        window = last[1]
        norm_type = self.config.clip.norm_type
        final = reproduces(trainer, pl_module, window.batches, window.rng, norm_type, window.step)
        snapshot: Optional[bool] = None
        step: Optional[int] = None
        rerun = final is not False
        store = self.recovery.store
        if trainer.world_size > 1 and store is not None and store.collective:
            # reading a sharded snapshot is a collective: every rank loads it if any rank reruns on it
            load = trainer.strategy.reduce_boolean_decision(rerun, all=False)
        else:
            load = rerun
        if load:
            with self.recovery.newest_weights(pl_module) as snapshot_step:
                if rerun and snapshot_step is not None:
                    step = snapshot_step
                    snapshot = reproduces(trainer, pl_module, window.batches, window.rng, norm_type, window.step)
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

    def replicas_drifted(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """DDP, at a snapshot: the replicas' weights are no longer bitwise the same
        (:meth:`.Ranks.snapshot_agreement`). Every rank rolls back to the newest snapshot, on which they agreed
        (each is taken only where they do), counted like any rollback (one that keeps failing gives up). The event
        names the odd rank where a majority tells (3 or more ranks); every rank gathers the checksums
        (one ``all_gather_object``, only here)."""
        event = self._event(trainer, "replica")
        total = weights_checksum(pl_module)
        gathered = self.sync.gather({"checksum": None if total is None else int(total), **whereabouts(trainer)})
        sums = [p["checksum"] for p in gathered]
        common, agreeing = Counter(sums).most_common(1)[0]
        odd = [r for r, c in enumerate(sums) if c != common] if agreeing * 2 > len(sums) else []
        how = "majority" if odd else "untold"
        for key in ("rank", "host", "device", "local_rank"):  # the same account on every rank (rank 0's: unknown)
            setattr(event, key, gathered[odd[0] if odd else 0][key])
        newest = self.recovery.store.newest.step if self.recovery.store and self.recovery.store.newest else None
        event.cause = drifted_replicas_cause()
        event.details.update(detected_at="snapshot", ranks=odd, replica={
            "weights_checksums": sums, "odd_ranks": odd, "found_by": how, "agreed_at_step": newest})
        who = where_it_ran(event) if odd else "some rank (two ranks: no majority tells which)"
        event.suggestion = (f"The replicas' weights drifted apart since the snapshot of step {newest}: {who} holds "
                            "different weights, from a fault the per-step check of the gradients let through "
                            "(check.replica_compare: tolerance, or a corruption after the check) or an update that "
                            "one rank made alone. Every rank was rolled "
                            "back to that snapshot. If it comes back, test that GPU or exclude the host.")
        plan = Plan()
        self.recovery.must_roll_back(plan, "the DDP replicas' weights differ")
        if not (plan.rollback or plan.give_up):  # no snapshot yet: nothing to roll back to
            event.add_action("warn")
        self._conclude(trainer, pl_module, Pending(event, plan, self._context(trainer, pl_module, event), ""))

    def initialization_incident(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                findings: list[dict]) -> None:
        """Non-finite parameters before the first step: nothing known-good to roll back to; stop or raise."""
        event = self._event(trainer, "parameter")
        ctx = self._context(trainer, pl_module, event, at_fit_start=True, param_findings=findings)
        extra = self.diagnoser.diagnose(ctx, self.recorder.events)
        event.details["detected_at"] = "fit_start"
        self.recovery.stop()
        self.left_nonfinite = True
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
        window = self.evidence.window
        ctx = self.diagnoser.context(trainer, pl_module, event, window=window)
        if self.config.check.inputs != "off":
            ctx.input_findings = [dict(f, micro_batch=i) for i, (b, _) in enumerate(window.batches)
                                  for f in find_batch_nonfinite(b)]
            if ctx.input_findings:
                event.kind = "input"
        event.details["detected_at"] = "anomaly_mode"
        extra = self.diagnoser.diagnose_error(ctx, found)
        event.add_action("raise")
        self._record(trainer, event, ctx, extra)


def _buffer_names(pl_module: "pl.LightningModule") -> set[str]:
    return {n for n, _ in pl_module.named_buffers()}
