"""One optimizer step, from its evidence to what the guard does about it, eager or lagged, top to bottom.

:class:`StepFlow` follows the flow told in :class:`~lightning_nanguard.NaNGuard`'s docstring:

1. ``on_before_optimizer_step`` (:meth:`StepFlow.before_optimizer_step`): the gradient norm, then a
   :class:`~.record.StepRecord` of the step. With ``check.sync: eager`` its evidence vector is read at once and
   the step judged (:meth:`StepFlow._judge`) while its update can still be skipped or clipped on the host.
   With ``lagged`` the step is staged instead (:meth:`StepFlow._stage`): skipped on the device where its flags
   say so, clipped on the device, its vector copied to the host without a wait; it is read and judged by the
   same :meth:`StepFlow._judge` at the next step's ``on_before_optimizer_step`` (:meth:`StepFlow._judge_late`),
   or sooner where something must not wait (:meth:`StepFlow.flush`: train end, validation, a checkpoint, a due
   snapshot).
2. ``on_train_batch_end`` (:meth:`StepFlow.end`): the outcome is carried out (the plans of its incidents,
   buffer and metric undo, the weight flag for the next read, snapshots).

The incident path itself is :class:`~lightning_nanguard.respond.responder.Responder`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import Tensor

from ..core.console import say, warn
from ..core.record import StepRecord, UpdateStage
from ..detect.amp import clear_device_skip, ensure_unscaled, grad_scaler, skip_on_device
from ..detect.ranks import Ranks
from ..detect.read_mode import choose_read_mode
from ..detect.spikes import SPIKE_PATIENCE
from ..detect.stall import ANCHOR_WINDOWS, PROBE_FACTORS, best_factor, gain_ratio
from ..detect.vector import SCHEMA
from ..detect.verdict import Outcome, classify, device_skipped, skip_flag
from ..diagnose.lr_probe import lr_probe
from ..diagnose.samples import sample_losses
from ..diagnose.rules import drifted_replicas_cause, persistent_clipping_cause, spike_cause
from ..recover.actions import Clip, SkipStep
from ..recover.checkpoint import optimizer_state_nonfinite
from ..recover.lr import current_lrs
from ..report.recorder import logger_step
from . import incident as incidents
from .account import drifted_replicas
from .incident import NOTHING_DONE, SPIKES_BEFORE_LR_CUT, Incident, Response
from .parts import Parts
from .responder import Responder

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["StepFlow"]

_FLOW_MARKS = {Outcome.HEALTHY: "h", Outcome.INCIDENT: "i", Outcome.ROUTINE_OVERFLOW: "o"}


class StepFlow:
    """The step's outcome (eager or lagged) and what follows it, over the parts of the guard.

    Attributes:
        outcome: the current step's :class:`~.detect.verdict.Outcome`, from its optimizer step to its batch end.
        lagged: ``check.sync`` as chosen at fit start: flags read one step late.
    """

    def __init__(self, parts: Parts, responder: Responder) -> None:
        self.parts, self.responder = parts, responder
        self.outcome: Optional[Outcome] = None
        self.response = NOTHING_DONE  # what the incidents of the current step did (its queued plans: end())
        self.lagged = False
        self._unread: Optional[StepRecord] = None  # the lagged step whose flags are not read yet
        self._staged: Optional[StepRecord] = None  # the lagged step now running (until its batch ends)

    def start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Fit start: how flags agree across ranks, and eager or lagged reads (said once where ``check.sync`` was
        set: a healthy fit under ``auto`` prints nothing)."""
        p, check = self.parts, self.parts.config.check
        p.ranks = Ranks.for_trainer(trainer, p.config.clip.norm_type, check.replicas, check.replica_tolerance,
                                    exact=check.replica_compare == "exact")
        self.lagged, why = choose_read_mode(check.sync, trainer, pl_module)
        p.flow.start(pl_module)
        # the snapshots a stall rolls back to are kept (for ANCHOR_WINDOWS stall windows) only where the probe runs
        world = int(getattr(trainer, "world_size", 1) or 1)
        probes = check.stall == "act" and p.config.recovery.stall_anchors and len(trainer.optimizers) == 1 \
            and world == 1
        p.recovery.anchoring = ANCHOR_WINDOWS * check.stall_window if probes else None
        if self.lagged and "cannot skip" in why and p.config.recovery.snapshot == "off":
            why += " (recovery.snapshot is off: nothing to roll back to)"
        if check.sync != "auto":  # the user chose a mode: say what they got, and why
            say(trainer, f"[nanguard] sync: {'lagged' if self.lagged else 'eager'} ({why})")

    def abort(self) -> None:
        """An exception ends the fit: forget the lagged steps (and the device skip flag set on an optimizer)."""
        if self._staged is not None:
            clear_device_skip(self._staged.optimizer, self._staged.skip)
        self._unread = self._staged = None

    # -------------------------------------------------------------------------- on_before_optimizer_step

    def before_optimizer_step(self, trainer: "pl.Trainer", optimizer: torch.optim.Optimizer) -> None:
        """``on_before_optimizer_step``: judge the step now (eager), or stage it to be judged one step later
        (lagged) after reading the previous one's flags. The step's verdict is kept in :attr:`outcome` until
        :meth:`end`.

        Args:
            trainer: read once here, for the step, epoch, logger step and GradScaler of the step.
            optimizer: the optimizer about to step (its parameters are skipped or clipped here, eager).

        Raises:
            NaNGuardError: an incident of the step (or, lagged, of the previous one) gave up under
                ``recovery.on_give_up: raise`` (:meth:`.Responder.respond`).
        """
        p = self.parts
        p.recovery.before_update()  # a snapshot's device copies finish before the update writes (no host wait)
        params = [q for group in optimizer.param_groups for q in group["params"]]
        scaler = grad_scaler(trainer)
        if scaler is not None:
            ensure_unscaled(scaler, optimizer)
        # lagged: the previous step's flags, read now that this step's work is queued; a rollback they call for
        # skips this step too, unless its gradients were taken on the very weights restored
        skip_now = self._unread is not None and self._judge_late()[1]
        if p.recovery.stopped or p.recovery.skipping_batches or skip_now:
            p.recovery.skip(params)
            self.outcome = Outcome.SKIPPED
            return
        cfg = p.config
        grads = [q.grad for q in params if q.grad is not None]
        # clipping needs the norm even where check.gradients is off (then it only clips, never detects)
        clipping = p.clipper.active or cfg.check.spike_action == Clip.name
        norm = None
        if grads and (cfg.check.gradients or clipping):  # sharded: local
            if p.flow.enabled:  # the per-tensor norms the total is reduced from go into the window (no read)
                norm, parts = p.ranks.grad_norms(grads)
                p.flow.record(optimizer, trainer.global_step, params, len(grads), parts, p.ranks.sharded)
            else:
                norm = p.ranks.grad_norm(grads)
        device = params[0].device if params else torch.device("cpu")
        record = StepRecord(step=trainer.global_step, epoch=trainer.current_epoch, window=p.evidence.window,
                            lrs=[g["lr"] for g in optimizer.param_groups], loss_checked=p.evidence.loss_checked,
                            optimizer=optimizer, update=UpdateStage.ON_HOST, scaled=scaler is not None,
                            has_norm=norm is not None, params=params, log_step=logger_step(trainer))
        if self.lagged:
            self._stage(record, norm, device, scaler, grads)
            return
        record.flags = p.evidence.read(norm, device, scaler, p.ranks, grads)  # the step's one host-device sync
        record.local = p.ranks.last_local
        # several processes: the flags were reduced over ranks, so everything below is identical on every rank
        record.norm = p.ranks.global_norm(norm, record.flags.grad_norm)
        self.outcome, self.response = self._judge(record)
        self._marked(record, self.outcome, self.response)

    def _stage(self, record: StepRecord, norm: Optional[Tensor], device: torch.device, scaler: Optional[Any],
               grads: list[Tensor]) -> None:
        """``check.sync: lagged``: skip on the device if the flags say so, clip on the device, and start the
        copy of the flags to the host; the step is judged when they are read (:meth:`_judge_late`)."""
        p = self.parts
        record.window = record.window.copy()  # the evidence's window is the next step's by the time it is judged
        vec = p.evidence.vector(norm, device, scaler, p.ranks, grads)  # reduced over ranks: the same everywhere
        if norm is not None and p.ranks.sharded:
            norm = SCHEMA.get(vec, "grad_norm").to(norm.dtype)  # the completed norm
        # under a GradScaler, non-finite gradients are its own (routine) overflows: its found_inf skips them
        # DDP: replicas that disagree skip the step on every rank (any gradient copy gone bad, under a scaler too)
        skip = skip_flag(vec, p.config.check.gradients and scaler is None, p.ranks.replica_flag(vec))
        # a loss spike acts on its own step: the spike test of the statistics read so far, on the device
        action = p.config.check.spike_action
        spike = p.losses.spike_flag(SCHEMA.get(vec, "loss")) if record.loss_checked and action in (
            SkipStep.name, Clip.name) else None
        if spike is not None and action == SkipStep.name:  # (a step with bad evidence is skipped anyway)
            skip = torch.maximum(skip, spike.float())
        on_device = skip_on_device(record.optimizer, skip, scaler)
        record.limit, record.spike_limit = p.clipper.clip_on_device(
            record.params, norm, spike if action == Clip.name else None, p.clipper.zclip.mean)
        p.evidence.stage(vec)
        record.update = UpdateStage.ON_DEVICE if on_device else UpdateStage.APPLIED
        record.skip, record.local, record.params = skip, p.ranks.last_local, []
        self._staged = record
        self.outcome = Outcome.STAGED

    # ------------------------------------------------------------------------------------------- the verdict

    def _judge(self, record: StepRecord) -> tuple[Outcome, Response]:
        """The step's outcome from its flags, and what its incidents did on the host."""
        p = self.parts
        cfg, flags, loss = p.config, record.read_flags, record.loss
        window = p.flow.window(record.optimizer)
        if window is not None:  # what the host read of the step, beside its row of the gradient-flow window
            window.judged(record.step, loss, flags.grad_norm, p.clipper.threshold(), "?")
        p.clipper.saw(flags.grad_norm)
        spike_z = None if flags.local_bad else p.losses.observe(loss)
        grads_bad = cfg.check.gradients and flags.grads_bad
        record.replica = p.ranks.disagreement(flags)  # DDP: the ranks' copies of the reduced gradient differ
        outcome = classify(flags, grads_bad, record.scaled, p.overflow.observe(flags, grads_bad, record.scaled),
                           record.replica is not None)
        if outcome is Outcome.HEALTHY:
            return self._healthy(record, loss, spike_z)
        if outcome is not Outcome.INCIDENT:
            return outcome, NOTHING_DONE
        if record.update is UpdateStage.ON_HOST:  # its bad forward's buffer writes, before anything reads the weights
            p.recovery.undo_buffers()  # (judged late, the device undid them where it skipped the step)
        found = incidents.nonfinite_step(
            self.responder.at(record), record, grads_were_finite=p.evidence.grads_were_finite,
            check_parameters=cfg.check.parameters, check_inputs=cfg.check.inputs != "off",
            scaler=(p.overflow.overflows, p.overflow.scale) if record.scaled else None)
        response = self.responder.respond(found)
        p.evidence.judged(flags.grad_norm)
        return outcome, response

    def _marked(self, record: StepRecord, outcome: Outcome, response: Response) -> None:
        """What became of a judged step, in its gradient-flow window (:data:`~.detect.flow.MARKS`)."""
        window = self.parts.flow.window(record.optimizer)
        if window is not None:
            skipped = response.skipped or outcome is Outcome.SKIPPED
            window.mark(record.step, _FLOW_MARKS.get(outcome, "s" if skipped else "?") if not skipped or
                        outcome is Outcome.INCIDENT else "s")

    def _healthy(self, record: StepRecord, loss: Optional[float],
                 spike_z: Optional[float]) -> tuple[Outcome, Response]:
        """A step with finite evidence: its divergence and loss spike (:meth:`_finite_incidents`), then clipping
        (and clipping that persists)."""
        p, response = self.parts, NOTHING_DONE
        for found in self._finite_incidents(record, loss, spike_z):
            response = response.merge(self.responder.respond(found))
            if response.queued:  # skipped; the rollback and LR cut follow at the end of the step
                return Outcome.INCIDENT, response
            if response.skipped:
                return Outcome.SKIPPED, response
        p.evidence.judged(record.read_flags.grad_norm)  # (finite: checked, a healthy step's gradients are)
        p.recovery.streak_over()
        outcome = Outcome.HEALTHY
        self._clip(record, response.clip_to)
        if record.has_norm and p.clipper.clipping_persists():
            zclip = p.clipper.zclip
            found = incidents.persistent_clipping(self.responder.at(record), record, streak=zclip.streak,
                                                  threshold=zclip.threshold(), cause=persistent_clipping_cause(),
                                                  can_roll_back=p.recovery.can_roll_back)
            p.clipper.reset_streak()
            response = response.merge(self.responder.respond(found))
            outcome = Outcome.INCIDENT
        p.losses.healthy(loss)
        if self.responder.fit.automatic:
            p.stall.observe(record.step, loss)  # host floats only: it may arm the lower-LR probe
        return outcome, response

    def _finite_incidents(self, record: StepRecord, loss: Optional[float],
                          spike_z: Optional[float]) -> Iterator[Incident]:
        """The incidents of a finite step, in order, each built only once the one before it let the step go on: a
        divergence (:mod:`.detect.divergence`; automatic optimization only: manual mixes one loss stream per
        optimizer), then a loss spike."""
        p, flags = self.parts, record.read_flags
        check = p.config.check
        if self.responder.fit.automatic:
            found = p.divergence.observe(record.step, loss, flags.grad_norm)
            if found is not None:
                yield incidents.divergence(self.responder.at(record), record, found,
                                           act=check.divergence != "warn")
        if spike_z is not None and p.losses.detector.held >= SPIKE_PATIENCE:
            # the loss did not come back on SPIKE_PATIENCE skipped batches: the weights are wrong, not the batches
            held = p.losses.detector.held
            found = {"rule": "loss_spike_not_back", "spikes": held, "loss": loss, "loss_zscore": spike_z,
                     **{f"loss_{k}": v for k, v in p.losses.detector.last.items()},
                     "onset_step": record.step - held}
            yield incidents.divergence(self.responder.at(record), record, found, act=True)
        elif spike_z is not None:
            detector = p.losses.detector
            cause, growth = spike_cause(flags.grad_norm, list(p.clipper.history), check.divergence_growth,
                                        check.divergence_steps, after_healthy=detector.after_healthy)
            window = p.config.recovery.incident_window
            fit = self.responder.fit
            # the batch's fault: which of its samples (a forward each, now only)
            samples = sample_losses(fit.module, record.window.batches, getattr(fit.trainer, "precision_plugin", None),
                                    trainer=fit.trainer, step=record.step) if cause == "input" else None
            if samples is not None:
                # judged late, an update the device did not skip is in the weights the samples were rerun on
                skipped = record.skip is not None and bool(record.skip.item())
                samples["after_update"] = record.update is UpdateStage.APPLIED or (
                    record.update is UpdateStage.ON_DEVICE and not skipped)
            yield incidents.spike(self.responder.at(record), record, z=spike_z, samples=samples,
                                  test=p.losses.detector.last, grad_norm_zscore=p.clipper.zscore(flags.grad_norm),
                                  cause=cause, growth=growth, action=check.spike_action, moved=detector.shifted,
                                  clip_to=p.clipper.zclip.mean,
                                  # a bad batch's spike never counts towards the LR cut of repeated spikes
                                  repeated=cause != "input" and detector.repeated(record.step, SPIKES_BEFORE_LR_CUT,
                                                                                  window),
                                  window=window)

    def _clip(self, record: StepRecord, clip_to: Optional[float]) -> None:
        """Clip a healthy step and learn its norm: on the host while its update is pending, else learn what the
        device applied (:meth:`_stage`)."""
        flags, clipper = record.read_flags, self.parts.clipper
        if record.update is UpdateStage.ON_HOST:
            clipper.clip(record.params, record.norm, flags.grad_norm, clip_to, record.step)
        elif record.has_norm:
            clipper.observe(flags.grad_norm, record.spike_limit if clip_to is not None else record.limit, record.step)

    # ------------------------------------------------------------------------------------- lagged reads

    def _judge_late(self, current: bool = True) -> tuple[Outcome, bool]:
        """Read and judge the lagged step: its outcome, and (``current``: a step is under way whose gradients were
        taken on the weights that step left) whether that step must be skipped (its weights were rolled back)."""
        p = self.parts
        record, self._unread = self._unread, None
        assert record is not None
        record.flags = flags = p.evidence.take()
        outcome, response = self._judge(record)
        self._marked(record, outcome, response)
        # what the device did with its skip flag: skipped where the optimizer honours it (under a GradScaler, also on
        # an overflow)
        flagged = device_skipped(flags, p.config.check.gradients, record.scaled, record.replica is not None,
                                 outcome is Outcome.SKIPPED)
        applied = not (record.update is UpdateStage.ON_DEVICE and flagged or record.scaled and flags.grads_bad)
        p.recovery.settle_metrics(skipped=flagged)  # its metric states were undone on the device where flagged
        if outcome is Outcome.HEALTHY:
            p.recovery.healthy_step()
        if outcome in (Outcome.HEALTHY, Outcome.ROUTINE_OVERFLOW):  # at its own batch's logger step
            self._scalars(record.log_step)
        if not response.queued:
            return outcome, False
        # the current step's gradients hold for the restored weights only if nothing was applied since them
        done = self.responder.finish(keep_step=current and not applied)
        return outcome, current and (done.stopped or done.rolled_back and not done.kept_step)

    def flush(self) -> bool:
        """Judge the lagged step now (train end, epoch end, validation, a checkpoint, a due snapshot).

        Returns:
            True if a lagged step was waiting to be judged (its verdict may have rolled the weights back).

        Raises:
            NaNGuardError: as :meth:`before_optimizer_step`.
        """
        if self._unread is None:
            return False
        self._judge_late(current=False)
        return True

    # ----------------------------------------------------------------------------------- on_train_batch_end

    def end(self) -> bool:
        """``on_train_batch_end``: carry out what the step's outcome calls for (its queued plans, the buffer and
        metric undo, the weight flag for the next read, a due snapshot).

        Returns:
            False after a non-final micro-batch of gradient accumulation (no optimizer step yet), else True.

        Raises:
            NaNGuardError: a queued plan gave up under ``recovery.on_give_up: raise``.
        """
        p = self.parts
        outcome, self.outcome = self.outcome, None
        response, self.response = self.response, NOTHING_DONE
        if outcome is None:
            return False
        probe = None
        if p.stall.armed:  # (only while armed: a copy of the step's batches for the probe)
            if outcome in (Outcome.HEALTHY, Outcome.STAGED) and not response.queued:
                probe = p.stall.collect(p.evidence.window.batches)
            else:
                p.stall.disarm()  # an incident: the batches kept were seen on other weights
        p.evidence.step_end()
        if outcome is Outcome.STAGED:
            self._after_staged()
        elif response.queued:
            if not self.responder.finish().stopped:  # weights can go bad during a skipped step too
                p.evidence.after_step(self.responder.fit.module)
        elif outcome is Outcome.HEALTHY:
            self._after_healthy()
        elif outcome is Outcome.SKIPPED and p.recovery.skipping_batches:
            p.recovery.batch_skipped()
        if outcome in (Outcome.INCIDENT, Outcome.SKIPPED) and not p.recovery.stopped:
            # a rescued step leaves no trace in what the user logged; a failed run (given up) is not hidden
            p.recovery.undo_metrics()
        if outcome is Outcome.ROUTINE_OVERFLOW:  # log the lowered scale like a healthy step
            self._scalars()
        if probe:
            self._probe_stall()
        return True

    def _probe_stall(self) -> None:
        """The stall watch kept its probe's batches: run the lower-LR probe (:mod:`..diagnose.lr_probe`) and, where a
        lower LR learns ``check.stall_gain_ratio`` times more from them, respond with a ``stall`` event (its LR cut:
        the factor the probe measured best). Only one optimizer on one process; the guard's own failure here is
        warned once and the watch turned off, never the end of the run."""
        p, fit = self.parts, self.responder.fit
        trainer, module, watch = fit.trainer, fit.module, p.stall
        trigger = dict(watch.trigger)
        if self._unread is not None:
            self.flush()  # a lagged step not judged yet: judged first (the probe reads the weights anyway)
        kept = watch.take(stalled=False)
        if p.recovery.stopped or len(trainer.optimizers) != 1 or trainer.world_size > 1:
            return
        try:
            first = lr_probe(trainer, module, trainer.optimizers[0], kept, (1.0, 0.1))
            before, after = first["before"], dict(first["after"])
            ratio = gain_ratio(before, after[1.0], after[0.1])
            if ratio is None or ratio < watch.ratio or not watch.far_from_start(before):
                return
            more = lr_probe(trainer, module, trainer.optimizers[0], kept,
                            [f for f in PROBE_FACTORS if f not in after], before=before)
        except Exception as exc:  # noqa: BLE001  (the guard's own failure never ends the run)
            watch.enabled = False
            warn(f"[nanguard] the stall probe failed and is off for the rest of the fit: {exc!r}")
            return
        watch.cooldown, watch.wait = 2 * watch.window, 0  # a stall: the next probe as soon as a new window is full
        after.update(more["after"])
        factor = best_factor(before, after)
        moved = first["moved"]
        culprit = max(moved, key=lambda n: moved[n]) if moved else None
        onset = int(trigger.get("onset_step", 0))
        lrs = current_lrs(trainer.optimizers)
        target = p.recovery.stall_target(onset, max(lrs) * (factor or 1.0)) if lrs else None
        found = {"trigger": trigger, "probe_steps": len(kept), "loss_before": before,
                 "loss_after": {f"x{f:g}": v for f, v in sorted(after.items(), reverse=True)},
                 "gain_ratio": ratio, "threshold": watch.ratio, "lr_factor": factor,
                 "loss_at_start": watch.start, "remaining": watch.remaining,
                 "relative_update": moved.get(culprit) if culprit else None,
                 "rollback_target": target}
        self.responder.respond(incidents.stall(
            self.responder.at(), found, culprit=culprit, lr_factor=factor,
            rollback_before=target,
            act=p.config.check.stall == "act"))

    def _scalars(self, step: Optional[int] = None) -> None:
        """The guard's scalars of a step without an event, at the logger ``step`` of its batch (default: the
        current batch's)."""
        p, trainer = self.parts, self.responder.fit.trainer
        p.recorder.scalars(trainer, lambda: p.scalars(trainer), step)

    def _after_healthy(self) -> None:
        p = self.parts
        p.recovery.healthy_step()
        p.evidence.after_step(self.responder.fit.module)  # read with the next step's flags
        self._maybe_snapshot()
        self._scalars()

    def _after_staged(self) -> None:
        """End of a lagged step: undo its buffer writes where it was skipped (on the device), flag the weights
        it left, and leave its flags to the next step; read them now only if a snapshot may be due."""
        p = self.parts
        staged, self._staged = self._staged, None
        assert staged is not None
        clear_device_skip(staged.optimizer, staged.skip)
        p.recovery.undo_buffers_where(staged.skip)
        p.recovery.undo_metrics_where(staged.skip)  # settled once its flags are read
        p.evidence.after_step(self.responder.fit.module)  # read with the next step's flags
        self._unread = staged
        # a snapshot copies the weights to the host and waits anyway: judge the step first, never keep unread state
        if p.recovery.snapshot_due(ahead=1) and not p.recovery.stopped:
            outcome, _ = self._judge_late(current=False)
            if outcome is Outcome.HEALTHY:
                self._maybe_snapshot()

    def _maybe_snapshot(self) -> None:
        # never snapshot a run whose gradient norm is running away: finite is not known-good
        p = self.parts
        if p.recovery.snapshot_due() and not p.clipper.diverging() and not p.divergence.growing():
            self.snapshot()

    def snapshot(self) -> None:
        """Take a known-good snapshot where one is due and the weights (and, several ranks, the replicas) agree."""
        p, fit = self.parts, self.responder.fit
        trainer, pl_module = fit.trainer, fit.module
        if p.recovery.store is None:
            return
        # several processes: every rank takes the same decision (one all-reduce of 4 numbers, before any rank-local
        # decision): a weight or an optimizer state poisoned on one rank alone acts on every rank, and a snapshot is
        # taken only where the replicas agree, bit for bit (else every rank rolls back to where they did)
        checked = p.config.check.parameters
        weights_bad = bool(p.evidence.state_bad(consume=False)) if checked else False
        own_state_bad = optimizer_state_nonfinite(trainer.optimizers) if checked else False
        agree, (weights_bad, state_bad) = p.ranks.snapshot_agreement(pl_module, (weights_bad, own_state_bad))
        if weights_bad:  # never snapshot poisoned state: the next step rolls back
            return
        if not agree:  # every rank rolls back to the newest snapshot, on which they agreed
            gathered, odd = drifted_replicas(p.ranks, trainer, pl_module)
            newest = p.recovery.store.newest
            self.responder.respond(incidents.replicas_drifted(
                self.responder.at(), gathered, odd, newest.step if newest else None, drifted_replicas_cause()))
            return
        # an inf Adam moment leaves the weights finite (and freezes them): roll back instead of keeping it
        if state_bad:
            self.responder.bad_weights("snapshot", own_evidence=own_state_bad)
            return
        p.recovery.take_snapshot(trainer, pl_module)
        p.evidence.weights.refresh()  # re-collect parameters and buffers (a module added mid-fit) now and then
