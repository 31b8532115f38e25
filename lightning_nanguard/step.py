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

The incident path itself is :class:`~lightning_nanguard.responder.Responder`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from .config import NaNGuardConfig
from .console import say
from .counters import Counters
from .detect.amp import OverflowWatch, clear_device_skip, ensure_unscaled, grad_scaler, skip_on_device
from .detect.divergence import DivergenceWatch
from .detect.evidence import StepEvidence
from .detect.ranks import Ranks
from .detect.read_mode import choose_read_mode
from .detect.spikes import LossWatch
from .detect.vector import SCHEMA
from .detect.verdict import Outcome, classify, skip_flag
from .record import StepRecord, UpdateStage
from .recover.checkpoint import optimizer_state_nonfinite
from .recover.clipping import Clipper
from .recover.recovery import Recovery
from .report.recorder import Recorder, logger_step
from .responder import Responder

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["StepFlow"]


class StepFlow:
    """The step's outcome (eager or lagged) and what follows it, over the parts of the guard.

    Attributes:
        outcome: the current step's :class:`~.detect.verdict.Outcome`, from its optimizer step to its batch end.
        lagged: ``check.sync`` as chosen at fit start: flags read one step late.
        sync: how the flags agree across ranks (:class:`~.detect.ranks.Ranks`).
    """

    def __init__(self, config: NaNGuardConfig, counters: Counters, evidence: StepEvidence, clipper: Clipper,
                 losses: LossWatch, overflow: OverflowWatch, divergence: DivergenceWatch, recovery: Recovery,
                 recorder: Recorder, responder: Responder) -> None:
        self.config = config
        self.counters = counters
        self.evidence, self.clipper, self.losses, self.overflow = evidence, clipper, losses, overflow
        self.divergence, self.recovery = divergence, recovery
        self.recorder, self.responder = recorder, responder
        self.sync = Ranks()
        self.outcome: Optional[Outcome] = None
        self.lagged = False
        self._unread: Optional[StepRecord] = None  # the lagged step whose flags are not read yet
        self._staged: Optional[StepRecord] = None  # the lagged step now running (until its batch ends)

    def start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Fit start: how flags agree across ranks, and eager or lagged reads (said once where ``check.sync`` was
        set: a healthy fit under ``auto`` prints nothing)."""
        check = self.config.check
        self.sync = self.responder.sync = Ranks.for_trainer(trainer, self.config.clip.norm_type, check.replicas,
                                                               check.replica_tolerance,
                                                               exact=check.replica_compare == "exact")
        self.lagged, why = choose_read_mode(self.config.check.sync, trainer, pl_module)
        if self.lagged and "cannot skip" in why and self.config.recovery.snapshot == "off":
            why += " (recovery.snapshot is off: nothing to roll back to)"
        if check.sync != "auto":  # the user chose a mode: say what they got, and why
            say(trainer, f"[nanguard] sync: {'lagged' if self.lagged else 'eager'} ({why})")

    def abort(self) -> None:
        """An exception ends the fit: forget the lagged steps (and the device skip flag set on an optimizer)."""
        if self._staged is not None:
            clear_device_skip(self._staged.optimizer, self._staged.skip)
        self._unread = self._staged = None

    # -------------------------------------------------------------------------- on_before_optimizer_step

    def before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                              optimizer: torch.optim.Optimizer) -> None:
        """``on_before_optimizer_step``: judge the step now (eager), or stage it to be judged one step later
        (lagged) after reading the previous one's flags."""
        self.recovery.before_update()  # a snapshot's device copies finish before the update writes (no host wait)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        scaler = grad_scaler(trainer)
        if scaler is not None:
            ensure_unscaled(scaler, optimizer)
        # lagged: the previous step's flags, read now that this step's work is queued; a rollback they call for
        # skips this step too, unless its gradients were taken on the very weights restored
        skip_now = self._unread is not None and self._judge_late(trainer, pl_module)
        if self.recovery.stopped or self.recovery.skipping_batches or skip_now:
            self.recovery.skip(params)
            self.outcome = Outcome.SKIPPED
            return
        cfg = self.config
        grads = [p.grad for p in params if p.grad is not None]
        # clipping needs the norm even where check.gradients is off (then it only clips, never detects)
        clipping = self.clipper.active or cfg.check.spike_action == "clip"
        norm = self.sync.grad_norm(grads) if grads and (cfg.check.gradients or clipping) else None  # sharded: local
        device = params[0].device if params else torch.device("cpu")
        record = StepRecord(step=trainer.global_step, epoch=trainer.current_epoch, window=self.evidence.window,
                            lrs=[g["lr"] for g in optimizer.param_groups], loss_checked=self.evidence.loss_checked,
                            optimizer=optimizer, update=UpdateStage.PENDING, scaled=scaler is not None,
                            has_norm=norm is not None, params=params, log_step=logger_step(trainer))
        if self.lagged:
            self._stage(record, norm, device, scaler, grads)
            return
        record.flags = self.evidence.read(norm, device, scaler, self.sync, grads)  # the step's one host-device sync
        record.local = self.sync.last_local
        # several processes: the flags were reduced over ranks, so everything below is identical on every rank
        record.norm = self.sync.global_norm(norm, record.flags.grad_norm)
        self.outcome = self._judge(trainer, pl_module, record)

    def _stage(self, record: StepRecord, norm: Optional[Tensor], device: torch.device, scaler: Optional[Any],
               grads: list[Tensor]) -> None:
        """``check.sync: lagged``: skip on the device if the flags say so, clip on the device, and start the
        copy of the flags to the host; the step is judged when they are read (:meth:`_judge_late`)."""
        record.window = record.window.copy()  # the evidence's window is the next step's by the time it is judged
        vec = self.evidence.vector(norm, device, scaler, self.sync, grads)  # reduced over ranks: the same everywhere
        if norm is not None and self.sync.sharded:
            norm = SCHEMA.get(vec, "grad_norm").to(norm.dtype)  # the completed norm
        # under a GradScaler, non-finite gradients are its own (routine) overflows: its found_inf skips them
        # DDP: replicas that disagree skip the step on every rank (any gradient copy gone bad, under a scaler too)
        skip = skip_flag(vec, self.config.check.gradients and scaler is None, self.sync.replica_flag(vec))
        # a loss spike acts on its own step: the spike test of the statistics read so far, on the device
        action = self.config.check.spike_action
        spike = self.losses.spike_flag(SCHEMA.get(vec, "loss")) if record.loss_checked and action in (
            "skip_step", "clip") else None
        if spike is not None and action == "skip_step":  # (a step with bad evidence is skipped anyway)
            skip = torch.maximum(skip, spike.float())
        on_device = skip_on_device(record.optimizer, skip, scaler)
        record.limit, record.spike_limit = self.clipper.clip_on_device(
            record.params, norm, spike if action == "clip" else None, self.clipper.zclip.mean)
        self.evidence.stage(vec)
        record.update = UpdateStage.ON_DEVICE if on_device else UpdateStage.APPLIED
        record.skip, record.local, record.params = skip, self.sync.last_local, []
        self._staged = record
        self.outcome = Outcome.PENDING

    # ------------------------------------------------------------------------------------------- the verdict

    def _judge(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", record: StepRecord) -> Outcome:
        """The step's outcome from its flags, and what follows on the host."""
        cfg, flags, loss = self.config, record.evidence, record.loss
        self.clipper.saw(flags.grad_norm)
        spike_z = None if flags.local_bad else self.losses.observe(loss)
        grads_bad = cfg.check.gradients and flags.grads_bad
        record.replica = self.sync.disagreement(flags)  # DDP: the ranks' copies of the reduced gradient differ
        outcome = classify(flags, grads_bad, record.scaled, self.overflow.observe(flags, grads_bad, record.scaled),
                           record.replica is not None)
        if outcome is Outcome.INCIDENT:
            self.responder.incident(trainer, pl_module, record)
        elif outcome is Outcome.HEALTHY:
            outcome = self._healthy(trainer, pl_module, record, loss, spike_z)
        return outcome

    def _healthy(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", record: StepRecord,
                 loss: Optional[float], spike_z: Optional[float]) -> Outcome:
        flags, clip_to = record.evidence, None
        if getattr(pl_module, "automatic_optimization", True):  # manual: one loss stream per optimizer, mixed
            evidence = self.divergence.observe(record.step, loss, flags.grad_norm)
            if evidence is not None and self.responder.divergence(trainer, pl_module, record, evidence):
                return Outcome.INCIDENT  # skipped; the rollback and LR cut follow at the end of the step
        if spike_z is not None:
            spike = self.responder.spike(trainer, pl_module, record, spike_z)
            if spike.skip:
                return Outcome.SKIPPED
            clip_to = spike.clip_to
        self.evidence.grads_were_finite = True if self.config.check.gradients else None  # unchecked: unknown
        self.recovery.judged_healthy()
        outcome = Outcome.HEALTHY
        self._clip(record, clip_to)
        if record.has_norm and self.clipper.clipping_persists():
            self.responder.clipping_persists(trainer, record)
            outcome = Outcome.INCIDENT
        self.losses.healthy(loss)
        return outcome

    def _clip(self, record: StepRecord, clip_to: Optional[float]) -> None:
        """Clip a healthy step and learn its norm: on the host while its update is pending, else learn what the
        device applied (:meth:`_stage`)."""
        flags = record.evidence
        if record.update is UpdateStage.PENDING:
            self.clipper.clip(record.params, record.norm, flags.grad_norm, clip_to, record.step)
        elif record.has_norm:
            self.clipper.observe(flags.grad_norm, record.spike_limit if clip_to is not None else record.limit,
                                 record.step)

    # ------------------------------------------------------------------------------------- lagged reads

    def _judge_late(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", current: bool = True) -> bool:
        """Read and judge the lagged step. ``current``: a step is under way whose gradients were taken on the
        weights that step left; returns True when that step must be skipped (its weights were rolled back)."""
        record, self._unread = self._unread, None
        assert record is not None
        record.flags = flags = self.evidence.take()
        pristine = self.recovery.pristine
        outcome = self._judge(trainer, pl_module, record)
        # its skip flag, as the device set it (a loss spike too, with check.spike_action: skip_step), and what the
        # device did with it: skipped where the optimizer honours it (under a GradScaler, also on an overflow)
        flagged = (flags.local_bad or self.config.check.gradients and not record.scaled and flags.grads_bad
                   or record.replica is not None or outcome is Outcome.SKIPPED)
        applied = not (record.update is UpdateStage.ON_DEVICE and flagged or record.scaled and flags.grads_bad)
        self.recovery.settle_metrics(skipped=flagged)  # its metric states were undone on the device where flagged
        if outcome is Outcome.HEALTHY:
            self.recovery.healthy_step()
        if outcome in (Outcome.HEALTHY, Outcome.ROUTINE_OVERFLOW):  # at its own batch's logger step
            self.recorder.scalars(trainer, lambda: self.responder.scalars(trainer), record.log_step)
        if not self.responder.pending:
            return False
        # the current step's gradients hold for the restored weights only if nothing was applied since them
        keep = current and pristine and not applied
        rollbacks = self.counters["rollbacks"]
        self.responder.finish(trainer, pl_module, keep_step=keep)
        rolled_back = self.counters["rollbacks"] > rollbacks
        return current and (self.recovery.stopped or rolled_back and not self.recovery.kept_step)

    def flush(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> bool:
        """Judge the lagged step now (train end, epoch end, validation, a checkpoint, a due snapshot); True if
        there was one."""
        if self._unread is None:
            return False
        self._judge_late(trainer, pl_module, current=False)
        return True

    # ----------------------------------------------------------------------------------- on_train_batch_end

    def end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> bool:
        """``on_train_batch_end``: carry out what the step's outcome calls for; False after a non-final
        micro-batch of gradient accumulation (no optimizer step yet)."""
        outcome, self.outcome = self.outcome, None
        if outcome is None:
            return False
        self.evidence.step_end()
        if outcome is Outcome.PENDING:
            self._after_staged(trainer, pl_module)
        elif self.responder.pending:
            self.responder.finish(trainer, pl_module)
            if not self.recovery.stopped:  # weights can go bad during a skipped step too
                self.evidence.after_step(pl_module)
        elif outcome is Outcome.HEALTHY:
            self._after_healthy(trainer, pl_module)
        elif outcome is Outcome.SKIPPED and self.recovery.skipping_batches:
            self.recovery.batch_skipped()
        if outcome in (Outcome.INCIDENT, Outcome.SKIPPED) and not self.recovery.stopped:
            # a rescued step leaves no trace in what the user logged; a failed run (given up) is not hidden
            self.recovery.undo_metrics()
        if outcome is Outcome.ROUTINE_OVERFLOW:  # log the lowered scale like a healthy step
            self.recorder.scalars(trainer, lambda: self.responder.scalars(trainer))
        return True

    def _after_healthy(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.recovery.healthy_step()
        self.evidence.after_step(pl_module)  # read with the next step's flags
        self._maybe_snapshot(trainer, pl_module)
        self.recorder.scalars(trainer, lambda: self.responder.scalars(trainer))

    def _after_staged(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """End of a lagged step: undo its buffer writes where it was skipped (on the device), flag the weights
        it left, and leave its flags to the next step; read them now only if a snapshot may be due."""
        staged, self._staged = self._staged, None
        assert staged is not None
        clear_device_skip(staged.optimizer, staged.skip)
        self.recovery.undo_buffers_where(staged.skip)
        self.recovery.undo_metrics_where(staged.skip)  # settled once its flags are read
        self.evidence.after_step(pl_module)  # read with the next step's flags
        self._unread = staged
        # a snapshot copies the weights to the host and waits anyway: judge the step first, never keep unread state
        if self.recovery.snapshot_due(ahead=1) and not self.recovery.stopped:
            healthy = self.recovery.healthy_since_snapshot
            self.flush(trainer, pl_module)
            if self.recovery.healthy_since_snapshot > healthy:  # judged healthy
                self._maybe_snapshot(trainer, pl_module)

    def _maybe_snapshot(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # never snapshot a run whose gradient norm is running away: finite is not known-good
        if self.recovery.snapshot_due() and not self.clipper.diverging() and not self.divergence.growing():
            self.snapshot(trainer, pl_module)

    def snapshot(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.recovery.store is None:
            return
        # several processes: every rank takes the same decision (one all-reduce of 4 numbers, before any rank-local
        # decision): a weight or an optimizer state poisoned on one rank alone acts on every rank, and a snapshot is
        # taken only where the replicas agree, bit for bit (else every rank rolls back to where they did)
        checked = self.config.check.parameters
        weights_bad = bool(self.evidence.state_bad(consume=False)) if checked else False
        own_state_bad = optimizer_state_nonfinite(trainer.optimizers) if checked else False
        agree, (weights_bad, state_bad) = self.sync.snapshot_agreement(pl_module, (weights_bad, own_state_bad))
        if weights_bad:  # never snapshot poisoned state: the next step rolls back
            return
        if not agree:
            self.responder.replicas_drifted(trainer, pl_module)
            return
        # an inf Adam moment leaves the weights finite (and freezes them): roll back instead of keeping it
        if state_bad:
            self.responder.parameter_incident(trainer, pl_module, where="snapshot", own_evidence=own_state_bad)
            return
        self.recovery.take_snapshot(trainer, pl_module)
        self.evidence.weights.refresh()  # re-collect parameters and buffers (a module added mid-fit) now and then
