"""The incident pipeline: every incident (:mod:`.incident`, a value) runs through the same skeleton, once.

:meth:`Responder.respond` looks at the weights and inputs behind it, diagnoses it, agrees one account across
ranks, plans (the ladder, or the incident's own plan), skips its step by ``record.update``, arms clipping, and
acts now or at the step's end (:meth:`Responder.finish`); both return a :class:`~.incident.Response`, what was
done to the step. Each stage returns what it did (a :class:`~.recover.recovery.Applied`) and only the skeleton
writes it into the event. The Trainer and the module are bound once per fit (:meth:`Responder.bind`, a
:class:`Fit`). Nothing here runs while training is healthy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from ..core.causes import cause_entry, suggest
from ..core.events import NaNEvent
from ..core.record import StepRecord, Window
from ..detect.placement import whereabouts
from ..detect.writes import split_written, written_in_place
from ..diagnose.context import IncidentContext
from ..recover.actions import Applied, Clip, GiveUp, Hands, Rollback, Warn, give_up
from ..recover.ladder import Plan
from ..report.recorder import logger_step
from ..report.render import ReportText
from . import incident as incidents
from .account import Account, recompute_reduced_norm, share_incident
from .endings import act_on_suspect_hardware, give_up_message, suspect_hardware
from .incident import (NOTHING_DONE, ActAtStepEnd, ActNow, At, Given, Incident, Ladder, Look, MustRollBack, NoteNow,
                       Response, RestoreAtEnd, StopAtStart, kind_of)
from .parts import Parts

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Fit", "Responder"]


@dataclass(frozen=True)
class Fit:
    """The fit a guard runs in, bound once (:meth:`Responder.bind`, at ``setup``): the incident pipeline reads the
    Trainer and the module from here instead of receiving them at every call."""

    trainer: "pl.Trainer"
    module: "pl.LightningModule"

    @property
    def automatic(self) -> bool:
        """Lightning's automatic optimization (manual mixes one loss stream per optimizer)."""
        return bool(getattr(self.module, "automatic_optimization", True))


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
        self._fit: Optional[Fit] = None

    def bind(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """The fit this guard runs in, from now on (``setup``: before any other hook)."""
        self._fit = Fit(trainer, pl_module)

    def __getstate__(self) -> dict[str, object]:
        """A copy (``copy.deepcopy``, ``pickle``) of the guard is not bound to a fit: the Trainer and the module are
        the user's, not the guard's (and hold what does not pickle); the copy's ``setup`` binds it to its own."""
        state = self.__dict__.copy()
        state["_fit"] = None
        return state

    @property
    def fit(self) -> Fit:
        """The bound fit (:meth:`bind`)."""
        if self._fit is None:
            raise RuntimeError("NaNGuard: a hook ran before setup bound the guard to its Trainer")
        return self._fit

    def take_last_incident(self) -> Optional[tuple[NaNEvent, Window]]:
        """The newest step incident and its window, forgotten here (the end of fit reruns it once)."""
        last, self.last_incident = self.last_incident, None
        return last

    def at(self, record: Optional[StepRecord] = None) -> At:
        """Where an incident happens: at the judged step of ``record``, or (outside a step) where the trainer is."""
        trainer = self.fit.trainer
        if record is not None:
            return At.of(record, whereabouts(trainer))
        return At(trainer.global_step, trainer.current_epoch, self.parts.evidence.batch_idx, logger_step(trainer),
                  whereabouts(trainer))

    # ----------------------------------------------------------------------------------------- the pipeline

    def respond(self, incident: Incident) -> Response:
        """Run ``incident`` through the skeleton (module docstring): look, diagnose, agree, plan, skip and clip,
        then act now or queue its plan for :meth:`finish`. Each stage returns what it found or did; only this
        skeleton writes it into the event.

        Args:
            incident: what a trigger found (one of the builders of :mod:`.incident`).

        Returns:
            What the incident did to its step; ``queued``: its plan waits for :meth:`finish`.

        Raises:
            NaNGuardError: the incident gives up, stops at fit start or restores nothing at fit end under
                ``recovery.on_give_up: raise``, or a rank's hardware is suspect under ``on_suspect_hardware: raise``.
        """
        event = incident.event
        if isinstance(incident.act, RestoreAtEnd):
            return self._restore(incident, incident.act)
        ctx = self._context(incident)
        if incident.keeps_window and incident.evidence.window is not None:
            self.last_incident = (event, incident.evidence.window.copy())  # (the live window is cleared at step end)
        event.kind = self._look(incident, ctx)  # (the diagnosis reads it)
        account = self._diagnose(incident, ctx)
        if incident.detected_at is not None:
            event.details["detected_at"] = incident.detected_at
        plan, planned = self._plan(incident, account)
        _tell(event, planned)
        response, skipped, plan = self._skip_and_clip(incident, plan)
        _tell(event, skipped)
        return self._act((incident, plan or Plan(), ctx, account), response)

    def finish(self, keep_step: bool = False) -> Response:
        """End of the step: carry out the queued plans (:class:`~.incident.ActAtStepEnd`).

        Args:
            keep_step: the current step's gradients were taken on the weights the judged step left (a lagged read;
                see :meth:`.Recovery.rollback`).

        Returns:
            What the queued incidents did, merged (:data:`~.incident.NOTHING_DONE` with none queued).

        Raises:
            NaNGuardError: as :meth:`respond`, for a plan that gives up.
        """
        queued, self._queued = self._queued, []
        response = NOTHING_DONE
        for item in queued:
            response = response.merge(self._conclude(item, keep_step))
        return response

    def _context(self, incident: Incident) -> IncidentContext:
        """The diagnosis' context of ``incident``: its evidence, and the guard's history where it reads one
        (:meth:`.Parts.history`, which may issue a collective: every rank calls this at the same point)."""
        history = self.parts.history() if incident.history else None
        fit = self.fit
        return self.parts.diagnoser.context(fit.trainer, fit.module, incident.event, incident.evidence, history)

    def _diagnose(self, incident: Incident, ctx: IncidentContext) -> Account:
        """Diagnose ``incident`` from what :meth:`_look` put into ``ctx`` (once per incident: the weights and inputs
        are scanned once) and agree one account across ranks (the rank that produced the fault:
        :func:`.account.share_incident`)."""
        p, event, fit = self.parts, incident.event, self.fit
        extra, recomputed = "", None
        with p.evidence.activations.paused():
            if incident.anomaly is not None:
                extra = p.diagnoser.diagnose_error(ctx, incident.anomaly)
            elif incident.diagnose:
                extra = p.diagnoser.diagnose(ctx)
                recomputed = recompute_reduced_norm(p.ranks, fit.trainer, fit.module, incident.record,
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

    def _look(self, incident: Incident, ctx: IncidentContext) -> str:
        """The non-finite weights (``incident.look``) or else inputs behind ``incident``, into ``ctx``; returns the
        kind they make it (:func:`.incident.kind_of`)."""
        looked, pl_module = incident.look is not Look.NOTHING, self.fit.module
        weights, inputs = self.parts.evidence.nonfinite_behind(
            pl_module, ctx.batches, weights=looked, parameters_only=incident.look is Look.PARAMETERS,
            inputs=incident.look_at_inputs)
        if looked:
            ctx.evidence.param_findings = weights
        window = ctx.evidence.window
        written = written_in_place(ctx.batches, window.versions) if window is not None else []
        if written:  # the batch tensors the step itself wrote into in place: what they hold is what it wrote,
            data, ctx.written = split_written(inputs, written)
            if incident.event.kind != "input":  # (unless check.inputs: always saw the batch bad before the step)
                inputs = data
        ctx.input_findings = inputs
        return kind_of(incident.event.kind, weights, {n for n, _ in pl_module.named_buffers()}, inputs)

    def _plan(self, incident: Incident, account: Account) -> tuple[Optional[Plan], Applied]:
        """The incident's plan (None: it has none) from where its :data:`~.incident.Planning` says, and a warning
        where a rollback it must make has no snapshot to go to."""
        recovery, event, planning = self.parts.recovery, incident.event, incident.planning
        if isinstance(planning, Ladder):
            plan = recovery.plan(event.step, event.kind, event.cause, safe_factor=account.safe_factor,
                                 clip_armed=self.parts.clipper.armed, rollback_before=planning.rollback_before)
            if plan.suggestion is not None:  # the episode's cause (recover/ladder.py): the event reports it
                event.cause, event.suggestion = plan.cause, plan.suggestion
            return plan, _NONE
        if isinstance(planning, MustRollBack):
            plan = recovery.must_roll_back(Plan(), planning.reason)
            return plan, _NONE if plan.rollback or plan.give_up else Applied((Warn(),))  # no snapshot yet
        return (planning.plan if isinstance(planning, Given) else None), _NONE

    def _skip_and_clip(self, incident: Incident, plan: Optional[Plan]) -> tuple[Response, Applied, Optional[Plan]]:
        """Carry out the actions on the step itself (:attr:`.actions.Action.on_the_step`): keep its update from
        landing where the incident says so (its :class:`~.actions.SkipStep`; too late: the plan rolls it back), and
        clip: this step (a loss spike's ``clip_to``), or the steps after a step incident (the plan's
        :class:`~.actions.Clip`). Returns what it did to the step, its actions, and the plan (with that rollback)."""
        p, record, fit = self.parts, incident.record, self.fit
        hands = Hands(p.recovery, fit.trainer, fit.module, incident.event.step, record=record, clipper=p.clipper)
        done = _NONE
        if incident.skip is not None and record is not None:
            done = incident.skip.carry_out(hands, done)
            if not done.actions and incident.skip.applied_rolls_back and plan is not None:  # too late: undo it
                plan = p.recovery.step_was_applied(plan)
        skipped = bool(done.actions)
        if incident.clip_to is not None:
            done = Clip(to=incident.clip_to).carry_out(hands, done)  # and z-score clipping from now on
        if plan is not None and record is not None:
            for action in plan.actions:
                if action.on_the_step:
                    done = action.carry_out(hands, done)
        queued = isinstance(incident.act, ActAtStepEnd)
        return Response(skipped=skipped, queued=queued, clip_to=incident.clip_to), done, plan

    # ----------------------------------------------------------------------------------------------- acting

    def _act(self, item: Queued, response: Response) -> Response:
        """Carry out the incident's plan now (:meth:`_conclude`) or at the step's end (:meth:`finish`); record it."""
        p, (incident, plan, ctx, account) = self.parts, item
        event, act = incident.event, incident.act
        if isinstance(act, ActAtStepEnd):
            self._queued.append(item)
        elif isinstance(act, ActNow):
            response = response.merge(self._conclude(item))
        elif isinstance(act, NoteNow):
            if isinstance(incident.planning, Given):  # an LR cut at most
                self._apply(event, plan)
            if not event.actions:  # warn, or an LR already at recovery.min_lr_scale
                event.add_action(Warn())
            self._record(event, ctx, account.extra)
        elif isinstance(act, StopAtStart):  # nothing known-good exists
            p.recovery.stop()
            self.left_nonfinite = True
            response = replace(response, stopped=True)
            self._record(event, ctx, account.extra)
            report = p.recorder.report_path(event)
            give_up(p.config.recovery.on_give_up).end(
                self.fit.trainer, f"NaNGuard: {act.message}. {event.suggestion} Report: {report}")
        return response

    def _apply(self, event: NaNEvent, plan: Plan, keep_step: bool = False) -> tuple[Response, Applied]:
        """Carry out ``plan`` (:meth:`.Recovery.apply`) and write what was done into ``event``."""
        fit = self.fit
        done = self.parts.recovery.apply(fit.trainer, fit.module, plan, event.step, self.parts.overflow.overflows,
                                         keep_step)
        _tell(event, done)
        if done.rollback is not None and done.restored is not None and done.restored.step is not None:
            self.parts.rollbacks.append((done.restored.step, event.step))  # (the gradient-flow window's marks)
        return Response(rollback=done.rollback), done

    def _conclude(self, item: Queued, keep_step: bool = False) -> Response:
        """Carry out the plan, record the event, and stop or raise if the plan gives up (or the rank's hardware is
        suspect, :func:`.endings.suspect_hardware`)."""
        p, (incident, plan, ctx, account) = self.parts, item
        event, cfg, trainer = incident.event, p.config.recovery, self.fit.trainer
        rollbacks = p.counters["rollbacks"]
        response, done = self._apply(event, plan, keep_step)
        p.evidence.weights.refresh()  # a rollback replaced the tensors, and the flag computed on them
        p.evidence.forget_state()
        ending = plan.find(GiveUp)
        # a fault that does not come back counts against the rank that produced it (not where no rank is known)
        steps = (p.recovery.hardware.fault(event.rank, event.step) if ending is None and account.ranks != []
                 and cause_entry(event.cause).hardware_fault else None)
        message = None if steps is None else suspect_hardware(event, steps, cfg)
        self._record(event, ctx, account.extra)
        report = p.recorder.report_path(event)
        if ending is not None:
            bad = [] if response.rolled_back else p.evidence.weights.find(self.fit.module)  # (restored: finite)
            self.left_nonfinite = bool(bad)
            ending.end(trainer, give_up_message(event, done.restored.step if done.restored else None,
                                                done.not_restored, p.counters["incidents"], rollbacks, bad,
                                                str(report)))
        elif message is not None:
            act_on_suspect_hardware(trainer, p.recovery, cfg.on_suspect_hardware,
                                    f"NaNGuard at step {event.step}: {message} Report: {report}")
        return replace(response, stopped=p.recovery.stopped)

    def _restore(self, incident: Incident, act: RestoreAtEnd) -> Response:
        """Fit end: restore the newest known-good snapshot, record what was restored (``act.conclude``), and stop
        or raise where nothing could be and the incident says so."""
        p, event, trainer = self.parts, incident.event, self.fit.trainer
        restored = p.recovery.restore_newest(trainer, self.fit.module, p.overflow.overflows)
        p.evidence.weights.refresh()
        refused = p.recovery.refusals_untold()
        if refused:
            event.details["refused"] = refused
        told = act.conclude(restored.step, p.recovery.why_nothing_to_restore() if restored.snapshot is None else "")
        event.add_action(told.action)
        event.details.update(told.details)
        event.suggestion = told.suggestion
        self._record(event, self._context(incident), "")
        if told.stop:
            self.left_nonfinite = True
            give_up(p.config.recovery.on_give_up).end(
                trainer, f"NaNGuard: {event.suggestion} Report: {p.recorder.report_path(event)}")
        return Response(rollback=Rollback() if restored.snapshot is not None else None, stopped=told.stop)

    def _record(self, event: NaNEvent, ctx: IncidentContext, extra: str) -> None:
        past = ctx.history
        text = ReportText(past.norm_history, past.loss_history, extra)
        outputs = ctx.diagnosis.replay_outputs  # the replay's, of the account every rank adopted
        if past.flow is not None and self._pictured < self.parts.config.logging.max_reports:
            event.flow = past.flow.for_event(event.step, event.culprit, outputs).to_dict()
            self._pictured += 1
        self.parts.recorder.record(event, text, lambda: self.parts.scalars(self.fit.trainer))

    # ------------------------------------------------------------------------------------- outside a step

    def bad_weights(self, where: str, own_evidence: bool = False) -> Response:
        """Non-finite weights found outside a step: every rank calls it together (:func:`.incident.bad_weights`).

        Args:
            where: ``details.detected_at`` (``snapshot``, ``checkpoint``, ``validation_start``, ``train_end``).
            own_evidence: this rank's own evidence besides its weights (its optimizer state).

        Returns:
            What the incident did (a rollback, or a give-up: ``stopped``).

        Raises:
            NaNGuardError: it gave up under ``recovery.on_give_up: raise``.
        """
        found = incidents.bad_weights(self.at(), where, grads_were_finite=self.parts.evidence.grads_were_finite,
                                      own_evidence=own_evidence)
        return self.respond(found)


_NONE = Applied()  # nothing done


def _tell(event: NaNEvent, done: Applied) -> None:
    """Write what a stage did into ``event``, the user's record: its actions, in order, and their details."""
    for action in done.actions:
        event.add_action(action)
    event.details.update(done.details)
