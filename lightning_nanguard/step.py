"""One optimizer step, from its evidence to what the guard does about it.

:class:`StepFlow` follows the flow told in :class:`~lightning_nanguard.NaNGuard`'s docstring: at
``on_before_optimizer_step`` the step's flags are read and judged at once (``check.sync: eager``) or staged
on the device and judged one step later (``lagged``); at ``on_train_batch_end`` the outcome is carried out
(plans, buffer and metric undo, the weight flag for the next read, snapshots). The callback's hooks
delegate here; the incident path itself is :class:`~lightning_nanguard.incidents.Responder`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from .config import NaNGuardConfig
from .detect.amp import OverflowWatch, clear_device_skip, ensure_unscaled, grad_scaler, skip_on_device
from .detect.divergence import DivergenceWatch
from .detect.evidence import StepEvidence
from .detect.flags import LOSS, NORM, Outcome, StepFlags, classify, skip_flag
from .detect.spikes import LossWatch
from .detect.sync import StepSync, choose_sync
from .diagnose.diagnoser import Diagnoser
from .incidents import LateStep, Responder
from .recover.checkpoint import optimizer_state_nonfinite
from .recover.clipping import Clipper
from .recover.recovery import Recovery
from .report.progress import say
from .report.recorder import Recorder

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["StepFlow"]


class StepFlow:
    """The step's outcome (eager or lagged) and what follows it, over the parts of the guard.

    Attributes:
        outcome: the current step's :class:`~.detect.flags.Outcome`, from its optimizer step to its batch end.
        lagged: ``check.sync`` as chosen at fit start: flags read one step late.
        sync: how the flags agree across ranks (:class:`~.detect.sync.StepSync`).
    """

    def __init__(self, config: NaNGuardConfig, evidence: StepEvidence, clipper: Clipper, losses: LossWatch,
                 overflow: OverflowWatch, divergence: DivergenceWatch, recovery: Recovery, diagnoser: Diagnoser,
                 recorder: Recorder, responder: Responder) -> None:
        self.config = config
        self.evidence, self.clipper, self.losses, self.overflow = evidence, clipper, losses, overflow
        self.divergence, self.recovery, self.diagnoser = divergence, recovery, diagnoser
        self.recorder, self.responder = recorder, responder
        self.sync = StepSync()
        self.outcome: Optional[Outcome] = None
        self.lagged = False
        self._late: Optional[LateStep] = None  # the lagged step whose flags are not read yet
        self._staged: Optional[LateStep] = None  # the lagged step now running (until its batch ends)

    def start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Fit start: how flags agree across ranks, and eager or lagged reads (said once)."""
        self.sync = self.responder.sync = StepSync.for_trainer(trainer, self.config.clip.norm_type)
        self.lagged, why = choose_sync(self.config.check.sync, trainer, pl_module)
        if self.lagged and "cannot skip" in why and self.config.recovery.snapshot == "off":
            why += " (recovery.snapshot is off: nothing to roll back to)"
        say(trainer, f"[nanguard] sync: {'lagged' if self.lagged else 'eager'} ({why})")

    def abort(self) -> None:
        """An exception ends the fit: forget the lagged steps (and the device skip flag set on an optimizer)."""
        if self._staged is not None:
            clear_device_skip(self._staged.optimizer, self._staged.skip)
        self._late = self._staged = None

    def before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                              optimizer: torch.optim.Optimizer) -> None:
        """``on_before_optimizer_step``: judge the step now (eager), or stage it to be judged one step later
        (lagged) after reading the previous one's flags."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        scaler = grad_scaler(trainer)
        if scaler is not None:
            ensure_unscaled(scaler, optimizer)
        # lagged: the previous step's flags, read now that this step's work is queued; a rollback they call for
        # skips this step too, unless its gradients were taken on the very weights restored
        skip_now = self._late is not None and self._judge_late(trainer, pl_module)
        if self.recovery.stopped or self.recovery.skip_batches_left > 0 or skip_now:
            self.recovery.skip(params)
            self.outcome = Outcome.SKIPPED
            return
        cfg = self.config
        ladder = self.recovery.ladder
        grads = [p.grad for p in params if p.grad is not None]
        # clipping needs the norm even where check.gradients is off (then it only clips, never detects)
        clipping = cfg.clip.max_norm is not None or ladder.adaptive_clip or cfg.check.spike_action == "clip"
        norm = self.sync.grad_norm(grads) if grads and (cfg.check.gradients or clipping) else None  # sharded: local
        device = params[0].device if params else torch.device("cpu")
        if self.lagged:
            self._stage(trainer, optimizer, params, norm, device, scaler)
            return
        flags = self.evidence.read(norm, device, scaler, self.sync)  # the one host-device sync of the step
        # several processes: the flags were reduced over ranks, so everything below is identical on every rank
        norm = self.sync.global_norm(norm, flags.grad_norm)
        self.outcome = self._judge(trainer, pl_module, optimizer, params, flags, norm, scaler is not None)

    def _judge(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any, params: list[Tensor],
               flags: StepFlags, norm: Optional[Tensor], scaled: bool, late: Optional[LateStep] = None) -> Outcome:
        """The step's outcome from its flags, and what follows on the host (``late``: read one step later)."""
        cfg = self.config
        self.clipper.last_norm = flags.grad_norm
        checked = self.evidence.loss_checked if late is None else late.loss_checked
        loss = flags.loss if checked else None
        spike_z = None if flags.local_bad else self.losses.observe(loss)
        grads_bad = cfg.check.gradients and flags.grads_bad
        outcome = classify(flags, grads_bad, scaled, self.overflow.observe(flags, grads_bad, scaled))
        if outcome is Outcome.INCIDENT:
            self.responder.incident(trainer, pl_module, optimizer, params, flags, scaled, late)
        elif outcome is Outcome.HEALTHY:
            outcome = self._healthy(trainer, pl_module, params, norm, flags, spike_z, late)
        return outcome

    def _healthy(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", params: list[Tensor],
                 norm: Optional[Tensor], flags: StepFlags, spike_z: Optional[float],
                 late: Optional[LateStep] = None) -> Outcome:
        clip_to = None
        checked = self.evidence.loss_checked if late is None else late.loss_checked
        if getattr(pl_module, "automatic_optimization", True):  # manual: one loss stream per optimizer, mixed
            evidence = self.divergence.observe(trainer.global_step if late is None else late.step,
                                                flags.loss if checked else None, flags.grad_norm)
            if evidence is not None and self.responder.divergence(trainer, pl_module, params, flags, evidence,
                                                                   late):
                return Outcome.INCIDENT  # skipped; the rollback and LR cut follow at the end of the step
        if spike_z is not None:
            spike = self.responder.spike(trainer, pl_module, params, flags, spike_z, late)
            if spike.skip:
                return Outcome.SKIPPED
            clip_to = spike.clip_to
        self.evidence.grads_were_finite = True if self.config.check.gradients else None  # unchecked: unknown
        ladder = self.recovery.ladder
        ladder.healthy()
        outcome = Outcome.HEALTHY
        if late is None:
            self.clipper.clip(params, norm, flags.grad_norm, ladder.adaptive_clip, clip_to, trainer.global_step)
        elif late.has_norm:  # clipped on the device already
            self.clipper.observe(flags.grad_norm, late.spike_limit if clip_to is not None else late.limit, late.step)
        if (norm is not None or late is not None and late.has_norm) and self.clipper.clipping_persists(
                ladder.adaptive_clip):
            self.responder.clipping_persists(trainer, params, flags, late)
            outcome = Outcome.INCIDENT
        self.losses.healthy(flags.loss if checked else None)
        return outcome

    # ------------------------------------------------------------------------------ lagged reads

    def _stage(self, trainer: "pl.Trainer", optimizer: Any, params: list[Tensor], norm: Optional[Tensor],
               device: torch.device, scaler: Optional[Any]) -> None:
        """``check.sync: lagged``: skip on the device if the flags say so, clip on the device, and start the
        copy of the flags to the host; the step is judged when they are read (:meth:`_judge_late`)."""
        vec = self.evidence.vector(norm, device, scaler, self.sync)  # reduced over ranks: the same everywhere
        if norm is not None and self.sync.sharded:
            norm = vec[NORM].to(norm.dtype)  # the completed norm
        # under a GradScaler, non-finite gradients are its own (routine) overflows: its found_inf skips them
        skip = skip_flag(vec, self.config.check.gradients and scaler is None)
        # a loss spike acts on its own step: the spike test of the statistics read so far, on the device
        action = self.config.check.spike_action
        spike = self.losses.spike_flag(vec[LOSS]) if self.evidence.loss_checked and action in (
            "skip_step", "clip") else None
        if spike is not None and action == "skip_step":  # (a step with bad evidence is skipped anyway)
            skip = torch.maximum(skip, spike.float())
        device_skip = skip_on_device(optimizer, skip, scaler)
        limit, spike_limit = self.clipper.clip_on_device(params, norm, self.recovery.ladder.adaptive_clip,
                                                          spike if action == "clip" else None,
                                                          self.clipper.zclip.mean)
        self.evidence.stage(vec)
        self._staged = LateStep(
            step=trainer.global_step, epoch=trainer.current_epoch, batch_idx=self.evidence.batch_idx,
            window=list(self.evidence.window), rng=list(self.diagnoser._rng),
            lrs=[g["lr"] for g in optimizer.param_groups], skip=skip, device_skip=device_skip, limit=limit,
            spike_limit=spike_limit,
            has_norm=norm is not None, loss_checked=self.evidence.loss_checked, scaled=scaler is not None,
            optimizer=optimizer, local=self.sync.last_local)
        self.outcome = Outcome.PENDING

    def _judge_late(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", current: bool = True) -> bool:
        """Read and judge the lagged step. ``current``: a step is under way whose gradients were taken on the
        weights that step left; returns True when that step must be skipped (its weights were rolled back)."""
        late, self._late = self._late, None
        assert late is not None
        flags = self.evidence.take()
        pristine = self.recovery.pristine
        outcome = self._judge(trainer, pl_module, late.optimizer, [], flags, None, late.scaled, late)
        # what the device did with it: skipped where its skip flag was set and the optimizer honours it (under a
        # GradScaler, also on an overflow)
        # its skip flag, as the device set it (a loss spike too, with check.spike_action: skip_step)
        flagged = (flags.local_bad or self.config.check.gradients and not late.scaled and flags.grads_bad
                   or outcome is Outcome.SKIPPED)
        applied = not (late.device_skip and flagged or late.scaled and flags.grads_bad)
        self.recovery.settle_metrics(skipped=flagged)  # its metric states were undone on the device where flagged
        if outcome is Outcome.HEALTHY:
            self.recovery.healthy_step()
        if outcome in (Outcome.HEALTHY, Outcome.ROUTINE_OVERFLOW):
            self.recorder.scalars(trainer, lambda: self.responder.scalars(trainer))
        if not self.responder.pending:
            return False
        # the current step's gradients hold for the restored weights only if nothing was applied since them
        keep = current and pristine and not applied
        rollbacks = self.recovery.rollbacks
        self.responder.finish(trainer, pl_module, keep_step=keep)
        rolled_back = self.recovery.rollbacks > rollbacks
        return current and (self.recovery.stopped or rolled_back and not self.recovery.kept_step)

    def flush(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> bool:
        """Judge the lagged step now (train end, validation, a checkpoint, a due snapshot); True if there was one."""
        if self._late is None:
            return False
        self._judge_late(trainer, pl_module, current=False)
        return True

    def end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> bool:
        """``on_train_batch_end``: carry out what the step's outcome calls for; False after a non-final
        micro-batch of gradient accumulation (no optimizer step yet)."""
        outcome, self.outcome = self.outcome, None
        if outcome is None:
            return False
        self.evidence.step_end()
        self.diagnoser.step_end()
        if outcome is Outcome.PENDING:
            self._after_staged(trainer, pl_module)
        elif self.responder.pending:
            self.responder.finish(trainer, pl_module)
            if not self.recovery.stopped:  # weights can go bad during a skipped step too
                self.evidence.after_step(pl_module)
        elif outcome is Outcome.HEALTHY:
            self._after_healthy(trainer, pl_module)
        elif outcome is Outcome.SKIPPED and self.recovery.skip_batches_left > 0:
            self.recovery.skip_batches_left -= 1
            self.recovery.undo_buffers()
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
        self._late = staged
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
        if self.config.check.parameters:
            bad = bool(self.evidence.state_bad(consume=False))
            if self.sync.distributed:  # a weight poisoned on one rank alone: every rank skips this snapshot, or none
                bad = self.sync.any_rank(bad, trainer.strategy.root_device)
            if bad:  # never snapshot poisoned state: the next step rolls back
                return
            if optimizer_state_nonfinite(trainer.optimizers, self.sync, trainer.strategy.root_device):
                # an inf Adam moment leaves the weights finite (and freezes them): roll back instead of keeping it
                self.responder.parameter_incident(trainer, pl_module, where="snapshot")
                return
        self.recovery.take_snapshot(trainer, pl_module)
        self.evidence.state.refresh()  # re-collect parameters and buffers (a module added mid-fit) now and then
