"""What NaNGuard does with one optimizer step: the healthy path (clipping, prevention), incidents (evidence,
diagnosis, the ladder's plan, carrying it out) and giving up. A mixin of :class:`~lightning_nanguard.NaNGuard`."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from . import checks, diagnosis, distributed, stats
from .events import NaNEvent
from .messages import NaNGuardError, rank_zero_print
from .policy import Plan
from .recovery import current_lrs, reset_grads, scale_lr


class StepResponses:
    """The step decisions of NaNGuard; state lives on the callback (see ``NaNGuard._reset_run_state``)."""

    def _healthy(self, trainer: Any, params: list[Tensor], grads: list[Tensor], norm: Optional[Tensor],
                 norm_value: float, loss_value: float, spike_limit: Optional[float] = None) -> None:
        self._healthy_step = True
        self._last_step_grads_finite = True
        self.ladder.healthy()
        threshold = self._clip_threshold(spike_limit)
        if norm is not None and threshold is not None and norm_value > threshold:
            # takes the parameters (it scales p.grad); given bare grad tensors it silently does nothing
            torch.nn.utils.clip_grads_with_norm_(params, threshold, norm)
            self.counters["clipped_steps"] += 1
        if self.config.clip.agc_clip_factor is not None:  # unit-wise AGC, on device, no sync
            stats.adaptive_grad_clip_(params, self.config.clip.agc_clip_factor)
        if norm is not None:
            self.zclip.update(norm_value)
            self.norm_history.append(norm_value)
            if self.ladder.adaptive_clip and self.zclip.streak >= stats.CLIPS_BEFORE_LR_CUT:
                self._clipping_streak(trainer, params, norm_value, loss_value)
        if self._loss_sum is not None:
            self.loss_history.append(loss_value)

    def _clip_threshold(self, extra: Optional[float] = None) -> Optional[float]:
        limits = [x for x in (self.config.clip.max_norm, extra) if x is not None]
        adaptive = self.zclip.threshold() if self.ladder.adaptive_clip else None
        if adaptive is not None:
            limits.append(adaptive)
        return min(limits) if limits else None

    def _observe_loss(self, local_bad: bool, loss_value: float) -> Optional[float]:
        """Feed the loss to the spike statistics; its z-score if it is a spike (no sync: a host float)."""
        if local_bad or self._loss_sum is None or self.config.check.spike_action == "off":
            return None
        return self.spikes.observe(loss_value)

    def _loss_spike(self, trainer: Any, pl_module: Any, params: list[Tensor], loss_value: float, z: float,
                    norm_value: float) -> Optional[float]:
        """Record a loss spike and apply ``check.spike_action``.

        Returns -1 when the step is skipped, a clip limit for this step (action ``clip``: the EMA mean of
        healthy norms), else None. A spike is not a non-finite incident: it does not climb the recovery
        ladder (no rollback, no LR cut by count) and is counted in ``counters["spikes"]``.
        """
        action = self.config.check.spike_action
        event = self._new_event(trainer, "spike", counter="spikes")
        norm_z = self.zclip.zscore(norm_value)
        event.details.update(loss=loss_value, loss_zscore=z, loss_mean=self.spikes.stats.mean,
                             loss_std=self.spikes.stats.std, grad_norm=norm_value, grad_norm_zscore=norm_z)
        event.cause = "exploding_gradient" if norm_z is not None and norm_z > self.zclip.z_threshold else "unknown"
        event.suggestion = stats.SPIKE_SUGGESTION
        limit: Optional[float] = None
        if action == "skip_step":
            reset_grads(params)
            self.counters["skipped_steps"] += 1
            if self._buffers is not None:
                self._buffers.undo()
            event.add_action("skip_step")
            limit = -1.0
        elif action == "clip":
            limit = self.zclip.mean
            self.ladder.adaptive_clip = True  # and z-score clipping from now on
            event.add_action("clip")
            event.details["clip_to"] = limit
        window = self.config.recovery.incident_window
        repeated = self.spikes.repeated(trainer.global_step, stats.SPIKES_BEFORE_LR_CUT, window)
        if action == "reduce_lr" or repeated:  # repeated spikes are a divergence on its way: cut the LR
            self._apply_plan(trainer, pl_module, event, Plan(
                skip_step=False, reduce_lr=True,
                reasons=[f"{stats.SPIKES_BEFORE_LR_CUT} loss spikes within {window} steps"
                         if repeated and action != "reduce_lr" else "loss spike"]))
        if not event.actions:  # warn, or an LR already at recovery.min_lr_scale
            event.add_action("warn")
        ctx = diagnosis.IncidentContext(trainer=trainer, pl_module=pl_module, event=event,
                                        norm_history=list(self.norm_history), loss_history=list(self.loss_history))
        self._record(trainer, event, ctx, "")
        return limit

    def _clipping_streak(self, trainer: Any, params: list[Tensor], norm_value: float, loss_value: float) -> None:
        """Adaptive clipping had to act on ``CLIPS_BEFORE_LR_CUT`` steps in a row: the gradient norm grows
        faster than its statistics can follow, a divergence that clipping slows but does not stop, and the
        weights are already drifting. Skip this step, roll back to the newest snapshot and cut the LR, at the
        end of the step like an incident (recorded as a ``spike`` event: abnormal, still finite; it does not
        count towards the ladder's give-up)."""
        event = self._new_event(trainer, "spike", counter="spikes")
        event.details.update(reason=f"gradient norm clipped by the adaptive clip on {self.zclip.streak} "
                                    "consecutive steps", grad_norm=norm_value, clip_threshold=self.zclip.threshold(),
                             loss=loss_value)
        event.cause, event.suggestion = "exploding_gradient", stats.SPIKE_SUGGESTION
        event.add_action("clip")
        event.add_action("skip_step")
        self.zclip.streak = 0
        reset_grads(params)
        self.counters["skipped_steps"] += 1
        self._healthy_step = False
        ctx = diagnosis.IncidentContext(trainer=trainer, pl_module=trainer.lightning_module, event=event,
                                        norm_history=list(self.norm_history), loss_history=list(self.loss_history))
        plan = Plan(rollback=bool(self._store), reduce_lr=True, reasons=["persistent adaptive clipping"])
        self._pending.append((event, plan, ctx, ""))

    def _skip_quietly(self, params: list[Tensor]) -> None:
        reset_grads(params)
        self.counters["skipped_steps"] += 1

    def _incident(self, trainer: Any, pl_module: Any, optimizer: Any, params: list[Tensor], kind: str,
                  norm_value: float, local_bad: bool) -> None:
        cfg = self.config
        event = self._new_event(trainer, kind)
        event.details["grad_norm"] = norm_value
        event.details["lr"] = current_lrs([optimizer])
        ctx = diagnosis.IncidentContext(
            trainer=trainer, pl_module=pl_module, event=event, batches=list(self._window), rng_states=list(self._rng),
            grad_norm=norm_value, norm_history=list(self.norm_history), loss_history=list(self.loss_history),
            grads_were_finite=self._last_step_grads_finite, frames=cfg.anomaly.frames,
            float64_check=cfg.anomaly.float64_check,
        )
        if kind in ("parameter", "buffer"):
            ctx.param_findings = self._find_nonfinite_state(pl_module)
            if ctx.param_findings and all(f["name"] in self._buffer_names(pl_module) for f in ctx.param_findings):
                event.kind = "buffer"
        elif cfg.check.inputs != "off":
            ctx.input_findings = [dict(f, micro_batch=i) for i, (b, _) in enumerate(self._window)
                                  for f in checks.find_batch_nonfinite(b)]
            if ctx.input_findings:
                event.kind = "input"
        # diagnose before any state changes: the replay needs the weights and buffers of the bad forward
        if self._buffers is not None:
            self._buffers.undo()
        ctx.replay = cfg.anomaly.mode != "off" and self.counters["replays"] < cfg.anomaly.max_replays
        # a manual-optimization training_step steps the optimizers itself: replaying it would train
        ctx.replay = ctx.replay and getattr(pl_module, "automatic_optimization", True)
        ctx.previous = next((e for e in reversed(self.events) if "replay" in e.details), None)
        with self._diag_hooks.paused():
            extra = diagnosis.diagnose(ctx)
        self.counters["replays"] += int(ctx.replayed)
        extra = distributed.share_incident(self._sync, event, extra)  # several processes: one account for all

        self._last_step_grads_finite = math.isfinite(norm_value)
        plan = self.ladder.incident(trainer.global_step, event.kind, can_roll_back=bool(self._store),
                                    diverging=event.cause == "exploding_gradient")
        reset_grads(params)
        event.add_action("skip_step")
        self.counters["skipped_steps"] += 1
        if plan.enable_adaptive_clip:
            event.add_action("clip")
        self._pending.append((event, plan, ctx, extra))

    def _finish_incidents(self, trainer: Any, pl_module: Any) -> None:
        pending, self._pending = self._pending, []
        for event, plan, ctx, extra in pending:
            self._conclude(trainer, pl_module, event, plan, ctx, extra)

    def _conclude(self, trainer: Any, pl_module: Any, event: NaNEvent, plan: Plan,
                  ctx: diagnosis.IncidentContext, extra: str) -> None:
        """Carry out the plan, record the event, and stop or raise if the plan gives up."""
        self._apply_plan(trainer, pl_module, event, plan)
        if plan.give_up:
            self._stopped = True
            event.add_action(self.config.recovery.on_give_up)
        self._record(trainer, event, ctx, extra)
        if plan.give_up:
            self._give_up(trainer, event)

    def _apply_plan(self, trainer: Any, pl_module: Any, event: NaNEvent, plan: Plan) -> None:
        cfg = self.config.recovery
        if plan.give_up:
            if self._store:
                self._rollback(trainer, pl_module, further=False)
                event.details["restored_step"] = self._store.newest.step if self._store.newest else None
            return
        if plan.rollback and self._store:
            if plan.go_further_back:
                self._store.drop_newest()
            self._rollback(trainer, pl_module, further=plan.go_further_back)
            event.add_action("rollback")
            event.details["restored_step"] = self._store.newest.step if self._store.newest else None
            if plan.skip_batches:
                self._skip_batches_left = plan.skip_batches
                event.add_action("skip_batches")
                event.details["skip_batches"] = plan.skip_batches
        if plan.reduce_lr:
            new_scale = max(self.lr_scale * cfg.lr_factor, cfg.min_lr_scale)
            before = current_lrs(trainer.optimizers)
            if new_scale < self.lr_scale:
                scale_lr(trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs],
                         new_scale / self.lr_scale)
                self.lr_scale = new_scale
                self.counters["lr_cuts"] += 1
                event.add_action("reduce_lr")
                event.details["lr_before"] = before
                event.details["lr_after"] = current_lrs(trainer.optimizers)
            event.details["lr_scale"] = self.lr_scale
        event.details["reasons"] = plan.reasons

    def _give_up(self, trainer: Any, event: NaNEvent) -> None:
        restored = event.details.get("restored_step")
        message = (f"NaNGuard gave up at step {event.step} after {self.counters['incidents']} incident(s) and "
                   f"{self.counters['rollbacks']} rollback(s); weights restored to the last known-good state"
                   f"{'' if restored is None else f' (step {restored})'}. Last incident: {event.kind}, "
                   f"cause={event.cause}, culprit={event.culprit}. {event.suggestion} "
                   f"Report: {self._report_path(event)}")
        if self.config.recovery.on_give_up == "raise":
            raise NaNGuardError(message)
        trainer.should_stop = True
        rank_zero_print(trainer, "[nanguard] " + message)

    # ------------------------------------------------------------------- incidents outside the step

    def _parameter_incident(self, trainer: Any, pl_module: Any, where: str) -> None:
        """Non-finite weights found outside the step decision (before a checkpoint, at the end of fit)."""
        findings = self._find_nonfinite_state(pl_module)
        buffers = self._buffer_names(pl_module)
        kind = "buffer" if findings and all(f["name"] in buffers for f in findings) else "parameter"
        event = self._new_event(trainer, kind)
        ctx = diagnosis.IncidentContext(trainer=trainer, pl_module=pl_module, event=event,
                                        norm_history=list(self.norm_history), loss_history=list(self.loss_history),
                                        grads_were_finite=self._last_step_grads_finite, param_findings=findings)
        extra = diagnosis.diagnose(ctx)
        event.details["detected_at"] = where
        plan = self.ladder.incident(trainer.global_step, kind, can_roll_back=bool(self._store))
        plan.skip_step = False
        self._conclude(trainer, pl_module, event, plan, ctx, extra)

    def _initialization_incident(self, trainer: Any, pl_module: Any, findings: list[dict]) -> None:
        event = self._new_event(trainer, "parameter")
        ctx = diagnosis.IncidentContext(trainer=trainer, pl_module=pl_module, event=event, at_fit_start=True,
                                        param_findings=findings)
        extra = diagnosis.diagnose(ctx)
        event.details["detected_at"] = "fit_start"
        self._stopped = True
        event.add_action("raise" if self.config.recovery.on_give_up == "raise" else "stop")
        self._record(trainer, event, ctx, extra)
        message = (f"NaNGuard: non-finite parameters before training ({', '.join(f['name'] for f in findings[:5])}). "
                   f"{event.suggestion} Report: {self._report_path(event)}")
        if self.config.recovery.on_give_up == "raise":
            raise NaNGuardError(message)
        trainer.should_stop = True
        rank_zero_print(trainer, "[nanguard] " + message)
