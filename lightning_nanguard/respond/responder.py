"""The incident pipeline: every incident (:mod:`.incident`, a value) runs through the same skeleton, once.

:meth:`Responder.respond` looks at the weights and inputs behind it, diagnoses it, agrees one account across
ranks, plans (the ladder, or the incident's own plan), skips its step by ``record.update``, arms clipping, and
acts now or at the step's end (:meth:`Responder.finish`); both return a :class:`~.incident.Response`, what was
done. Nothing here runs while training is healthy.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional

from ..core.causes import cause as cause_entry
from ..core.causes import suggest
from ..core.events import NaNEvent
from ..core.record import StepRecord, Window
from ..detect.placement import whereabouts
from ..diagnose.context import IncidentContext
from ..recover.ladder import Plan
from ..recover.recovery import Applied
from ..report.recorder import logger_step
from ..report.render import ReportText
from . import incident as incidents
from .account import Account, recompute_reduced_norm, share_incident
from .endings import act_on_suspect_hardware, give_up_message, stop_or_raise, suspect_hardware
from .incident import NOTHING_DONE, Act, At, Incident, Look, Planning, Response, kind_of
from .parts import Parts

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Responder"]

Queued = tuple[Incident, Plan, IncidentContext, Account]  # an incident to conclude: its plan, context and account


class Responder:
    """The incident pipeline over the guard's :class:`~.parts.Parts`.

    Attributes:
        last_incident: the newest step incident and its window: a fit that ends inside its streak reruns it.
        left_nonfinite: the guard stopped on non-finite weights it could not replace, and said so.
    """

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self._queued: list[Queued] = []
        self.last_incident: Optional[tuple[NaNEvent, Window]] = None
        self.left_nonfinite = False
        self._pictured = 0  # events of this fit that keep their gradient-flow window (logging.max_reports)

    def take_last_incident(self) -> Optional[tuple[NaNEvent, Window]]:
        """The newest step incident and its window, forgotten here (the end of fit reruns it once)."""
        last, self.last_incident = self.last_incident, None
        return last

    def at(self, trainer: "pl.Trainer", record: Optional[StepRecord] = None) -> At:
        """Where an incident happens: at the judged step of ``record``, or (outside a step) where the trainer is."""
        if record is not None:
            return At.of(record, whereabouts(trainer))
        return At(trainer.global_step, trainer.current_epoch, self.parts.evidence.batch_idx, logger_step(trainer),
                  whereabouts(trainer))

    # ----------------------------------------------------------------------------------------- the pipeline

    def respond(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", incident: Incident) -> Response:
        """Run ``incident`` through the skeleton (module docstring); returns what was done."""
        event = incident.event
        if incident.act is Act.RESTORE:
            return self._restore(trainer, pl_module, incident)
        ctx = self._context(trainer, pl_module, incident)
        if incident.keeps_window and incident.evidence.window is not None:
            self.last_incident = (event, incident.evidence.window.copy())  # (the live window is cleared at step end)
        account = self._diagnose(trainer, pl_module, incident, ctx)
        if incident.detected_at is not None:
            event.details["detected_at"] = incident.detected_at
        plan = self._plan(incident, account)
        response = self._skip_and_clip(incident, plan)
        return self._act(trainer, pl_module, (incident, plan or Plan(), ctx, account), response)

    def finish(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", keep_step: bool = False) -> Response:
        """End of the step: carry out the queued plans. ``keep_step``: the current step's gradients were taken on the
        weights the judged step left (see :meth:`.Recovery.rollback`)."""
        queued, self._queued = self._queued, []
        response = NOTHING_DONE
        for item in queued:
            response = response.merge(self._conclude(trainer, pl_module, item, keep_step))
        return response

    def _context(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", incident: Incident) -> IncidentContext:
        """The diagnosis' context of ``incident``: its evidence, and the guard's history where it reads one
        (:meth:`.Parts.history`, which may issue a collective: every rank calls this at the same point)."""
        history = self.parts.history() if incident.history else None
        return self.parts.diagnoser.context(trainer, pl_module, incident.event, incident.evidence, history)

    def _diagnose(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", incident: Incident,
                  ctx: IncidentContext) -> Account:
        """Look at the weights and inputs behind ``incident``, diagnose it and agree one account across ranks (the
        rank that produced the fault: :func:`.account.share_incident`)."""
        p, event = self.parts, incident.event
        self._look(pl_module, incident, ctx)
        extra, recomputed = "", None
        with p.evidence.activations.paused():
            if incident.anomaly is not None:
                extra = p.diagnoser.diagnose_error(ctx, incident.anomaly)
            elif incident.diagnose:
                extra = p.diagnoser.diagnose(ctx)
                recomputed = recompute_reduced_norm(p.ranks, trainer, pl_module, incident.record,
                                                    p.config.anomaly.mode != "off") if incident.replica else None
        if not incident.share:
            return Account(extra, None, ctx.safe_factor)
        record = incident.record
        found = None if incident.own_evidence is None else bool(ctx.evidence.param_findings) or incident.own_evidence
        account = share_incident(p.ranks, event, extra, record.local if record else None,
                                 own_norm=record.read_flags.grad_norm if record and incident.replica else None,
                                 recomputed=recomputed, found=found, safe_factor=ctx.safe_factor,
                                 diagnosis=ctx.diagnosis, own_replica=record.replica if record else None)
        if p.ranks.distributed:  # the suggestion names where the chosen rank ran
            event.suggestion = suggest(event, event.cause, ctx.diagnosis)
        return account

    def _look(self, pl_module: "pl.LightningModule", incident: Incident, ctx: IncidentContext) -> None:
        """The non-finite weights (``incident.look``) or else inputs behind ``incident``, and the kind they make it
        (:func:`.incident.kind_of`)."""
        looked = incident.look is not Look.NOTHING
        weights, inputs = self.parts.evidence.nonfinite_behind(
            pl_module, ctx.batches, weights=looked, parameters_only=incident.look is Look.PARAMETERS,
            inputs=incident.look_at_inputs)
        if looked:
            ctx.evidence.param_findings = weights
        ctx.input_findings = inputs
        incident.event.kind = kind_of(incident.event.kind, weights, {n for n, _ in pl_module.named_buffers()}, inputs)

    def _plan(self, incident: Incident, account: Account) -> Optional[Plan]:
        recovery, event = self.parts.recovery, incident.event
        if incident.planning is Planning.LADDER:
            return recovery.plan(event.step, event.kind, event.cause, safe_factor=account.safe_factor,
                                 clip_armed=self.parts.clipper.armed, rollback_before=incident.rollback_before)
        if incident.planning is Planning.ROLL_BACK:
            plan = Plan()
            recovery.must_roll_back(plan, incident.reason)
            if not (plan.rollback or plan.give_up):  # no snapshot yet: nothing to roll back to
                event.add_action("warn")
            return plan
        return incident.plan

    def _skip_and_clip(self, incident: Incident, plan: Optional[Plan]) -> Response:
        """Keep the step's update from landing where the incident says so (:meth:`.Recovery.keep_from_landing`; too
        late: the plan rolls it back), and clip: this step (a loss spike's ``clip_to``), or the steps after a step
        incident (the plan's ``arm_clip``)."""
        p, event, record = self.parts, incident.event, incident.record
        skipped = False
        if incident.skip is not None and record is not None:
            skipped = p.recovery.keep_from_landing(record, mirrored=incident.skip.mirrored,
                                                   undo_buffers=incident.skip.undo_buffers)
            if skipped:
                event.add_action("skip_step")
            elif incident.skip.applied_rolls_back and plan is not None:  # too late to skip: undo it
                p.recovery.step_was_applied(plan)
        if incident.clip_to is not None:
            p.clipper.arm()  # and z-score clipping from now on
            event.add_action("clip")
        if plan is not None and plan.arm_clip and record is not None and p.clipper.arm():
            event.add_action("clip")
        return Response(skipped=skipped, queued=incident.act is Act.STEP_END, clip_to=incident.clip_to)

    # ----------------------------------------------------------------------------------------------- acting

    def _act(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", item: Queued,
             response: Response) -> Response:
        """Carry out the incident's plan now (:meth:`_conclude`) or at the step's end (:meth:`finish`); record it."""
        p, (incident, plan, ctx, account) = self.parts, item
        event = incident.event
        if incident.act is Act.STEP_END:
            self._queued.append(item)
        elif incident.act is Act.NOW:
            response = response.merge(self._conclude(trainer, pl_module, item))
        elif incident.act is Act.RECORD:
            if incident.plan is not None:  # an LR cut at most
                self._apply(trainer, pl_module, event, plan)
            if not event.actions:  # warn, or an LR already at recovery.min_lr_scale
                event.add_action("warn")
            self._record(trainer, event, ctx, account.extra)
        else:  # Act.STOP: nothing known-good exists
            p.recovery.stop()
            self.left_nonfinite = True
            response = replace(response, stopped=True)
            self._record(trainer, event, ctx, account.extra)
            stop_or_raise(trainer, p.config.recovery.on_give_up, f"NaNGuard: {incident.stop_message}. "
                          f"{event.suggestion} Report: {p.recorder.report_path(event)}")
        return response

    def _apply(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", event: NaNEvent, plan: Plan,
               keep_step: bool = False) -> tuple[Response, Applied]:
        done = self.parts.recovery.apply(trainer, pl_module, plan, event.step, self.parts.overflow.overflows,
                                         keep_step)
        for action in done.actions:
            event.add_action(action)
        event.details.update(done.details)
        if "rollback" in done.actions and done.restored is not None and done.restored.step is not None:
            self.parts.rollbacks.append((done.restored.step, event.step))  # (the gradient-flow window's marks)
        return Response(rolled_back=done.rolled_back, kept_step=done.kept_step), done

    def _conclude(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", item: Queued,
                  keep_step: bool = False) -> Response:
        """Carry out the plan, record the event, and stop or raise if the plan gives up (or the rank's hardware is
        suspect, :func:`.endings.suspect_hardware`)."""
        p, (incident, plan, ctx, account) = self.parts, item
        event, cfg = incident.event, p.config.recovery
        rollbacks = p.counters["rollbacks"]
        response, done = self._apply(trainer, pl_module, event, plan, keep_step)
        p.evidence.weights.refresh()  # a rollback replaced the tensors, and the flag computed on them
        p.evidence.forget_state()
        if plan.give_up:
            event.add_action(cfg.on_give_up)
        # a fault that does not come back counts against the rank that produced it (not where no rank is known)
        steps = (p.recovery.hardware.fault(event.rank, event.step) if not plan.give_up and account.ranks != []
                 and cause_entry(event.cause).hardware_fault else None)
        message = None if steps is None else suspect_hardware(event, steps, cfg)
        self._record(trainer, event, ctx, account.extra)
        report = p.recorder.report_path(event)
        if plan.give_up:
            bad = [] if response.rolled_back else p.evidence.weights.find(pl_module)  # (restored: finite)
            self.left_nonfinite = bool(bad)
            stop_or_raise(trainer, cfg.on_give_up,
                          give_up_message(event, done.restored.step if done.restored else None, done.not_restored,
                                          p.counters["incidents"], rollbacks, bad, str(report)))
        elif message is not None:
            act_on_suspect_hardware(trainer, p.recovery, cfg.on_suspect_hardware,
                                    f"NaNGuard at step {event.step}: {message} Report: {report}")
        return replace(response, stopped=p.recovery.stopped)

    def _restore(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", incident: Incident) -> Response:
        """Fit end: restore the newest known-good snapshot, record what was restored (the incident's
        ``conclude``), and stop or raise where nothing could be and the incident says so."""
        p, event = self.parts, incident.event
        restored = p.recovery.restore_newest(trainer, pl_module, p.overflow.overflows)
        p.evidence.weights.refresh()
        assert incident.conclude is not None
        refused = p.recovery.refusals_untold()
        if refused:
            event.details["refused"] = refused
        stop = incident.conclude(event, restored.step,
                                 p.recovery.why_nothing_to_restore() if restored.snapshot is None else "")
        self._record(trainer, event, self._context(trainer, pl_module, incident), "")
        if stop:
            self.left_nonfinite = True
            stop_or_raise(trainer, p.config.recovery.on_give_up,
                          f"NaNGuard: {event.suggestion} Report: {p.recorder.report_path(event)}")
        return Response(rolled_back=restored.snapshot is not None, stopped=stop)

    def _record(self, trainer: "pl.Trainer", event: NaNEvent, ctx: IncidentContext, extra: str) -> None:
        past = ctx.history
        text = ReportText(past.norm_history, past.loss_history, extra)
        outputs = ctx.diagnosis.replay_outputs  # the replay's, of the account every rank adopted
        if past.flow is not None and self._pictured < self.parts.config.logging.max_reports:
            event.flow = past.flow.for_event(event.step, event.culprit, outputs).to_dict()
            self._pictured += 1
        self.parts.recorder.record(event, text, lambda: self.parts.scalars(trainer))

    # ------------------------------------------------------------------------------------- outside a step

    def bad_weights(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", where: str,
                    own_evidence: bool = False) -> Response:
        """Non-finite weights (or optimizer state: ``own_evidence``) found outside a step, ``where``; every rank calls
        it together: :func:`.incident.bad_weights`."""
        found = incidents.bad_weights(self.at(trainer), where, grads_were_finite=self.parts.evidence.grads_were_finite,
                                      own_evidence=own_evidence)
        return self.respond(trainer, pl_module, found)
