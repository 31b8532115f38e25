"""The NaNGuard callback: wires checks, the recovery ladder, snapshots, diagnosis and sinks into Lightning."""

from __future__ import annotations

import logging
import math
import sys
from collections import deque
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from . import checks, diagnosis
from .config import (AnomalyConfig, CheckConfig, ClipConfig, LoggingConfig, NaNGuardConfig, RecoveryConfig,
                     SECTIONS)
from .events import JsonlSink, LoggerSink, NaNEvent
from .policy import Plan, RecoveryLadder
from .recovery import BufferUndo, SnapshotStore, current_lrs, reset_grads, scale_lr

try:  # the callback works in both packages' Trainers; it subclasses the classic one
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover
    import lightning.pytorch as pl  # type: ignore[no-redef]

__all__ = ["NaNGuard", "NaNGuardError"]

log = logging.getLogger("lightning_nanguard")


class NaNGuardError(RuntimeError):
    """Raised when NaNGuard gives up and ``recovery.on_give_up`` is ``"raise"``."""


def _rank_zero_print(trainer: Any, msg: str) -> None:
    if getattr(trainer, "global_rank", 0) == 0:
        if not log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False
        log.info(msg)


class NaNGuard(pl.Callback):
    """Keep a training run alive through NaN/Inf, and explain where they came from.

    Every optimizer step, NaNGuard checks the loss (per micro-batch, before backward), one fused total
    gradient norm, and the parameters and buffers written by the previous step, all folded into a single
    host read. While training is healthy it changes nothing: the trained weights are bitwise identical to
    a run without it. On an incident it climbs a recovery ladder:

    1. skip the step without touching optimizer state (grads set to ``None``) and undo the forward pass's
       writes into buffers (BatchNorm statistics);
    2. clip (a fixed ``clip.max_norm``, and adaptive clipping from healthy norms after an incident);
    3. cut the learning rate by ``recovery.lr_factor`` in a way LR schedulers keep;
    4. roll back to a known-good snapshot (module, optimizers, schedulers, grad scaler), further back if a
       rollback does not help;
    5. give up after ``recovery.max_rollbacks``: restore the last good weights, then stop or raise.

    Each incident is diagnosed (cause, culprit module, autograd op, suggestion), recorded in
    ``guard.events``, appended to ``<log_dir>/nanguard/events.jsonl`` and logged under ``nanguard/``.

    Example::

        trainer = pl.Trainer(callbacks=[NaNGuard()])
        trainer = pl.Trainer(callbacks=[NaNGuard(recovery={"lr_factor": 0.5}, clip={"max_norm": 1.0})])
        trainer = pl.Trainer(callbacks=[NaNGuard.from_yaml("configs/default.yaml")])

    Args:
        config: a whole :class:`NaNGuardConfig` (or mapping of sections); sections given as keywords
            override it.
        check: what is checked and when (:class:`CheckConfig` or mapping).
        clip: gradient clipping (:class:`ClipConfig` or mapping).
        anomaly: incident replay and anomaly detection (:class:`AnomalyConfig` or mapping).
        recovery: the recovery ladder (:class:`RecoveryConfig` or mapping).
        logging: event sinks (:class:`LoggingConfig` or mapping).

    Raises:
        ConfigError: on an unknown key, a wrong type or an out-of-range value, naming the key.
    """

    def __init__(
        self,
        *,
        config: Optional[NaNGuardConfig] = None,
        check: Optional[CheckConfig] = None,
        clip: Optional[ClipConfig] = None,
        anomaly: Optional[AnomalyConfig] = None,
        recovery: Optional[RecoveryConfig] = None,
        logging: Optional[LoggingConfig] = None,
    ) -> None:
        super().__init__()
        base = config if isinstance(config, NaNGuardConfig) else NaNGuardConfig.from_mapping(config or {})
        given = {"check": check, "clip": clip, "anomaly": anomaly, "recovery": recovery, "logging": logging}
        sections = {name: given[name] if given[name] is not None else getattr(base, name) for name in SECTIONS}
        self.config = NaNGuardConfig(**sections)
        self.events: list[NaNEvent] = []
        self._reset_run_state()

    @classmethod
    def from_yaml(cls, path: Union[str, Path]) -> "NaNGuard":
        """Build from a YAML file of sections (optionally nested under ``nanguard:``)."""
        return cls(config=NaNGuardConfig.from_yaml(path))

    # ------------------------------------------------------------------------------------------- state

    def _reset_run_state(self) -> None:
        cfg = self.config
        self.ladder = RecoveryLadder(cfg.recovery, cfg.clip)
        self.lr_scale = 1.0
        self.counters = {"incidents": 0, "skipped_steps": 0, "rollbacks": 0, "lr_cuts": 0, "clipped_steps": 0,
                         "replays": 0, "snapshots": 0}
        self.norm_history: deque[float] = deque(maxlen=200)
        self.loss_history: deque[float] = deque(maxlen=200)
        self.last_grad_norm = float("nan")
        self._norm_ema: Optional[tuple[float, float, int]] = None  # (mean, var, count) of healthy norms
        self._skip_batches_left = 0
        self._stopped = False
        self._event_index = 0
        # per-run objects, built in on_fit_start
        self._store: Optional[SnapshotStore] = None
        self._buffers: Optional[BufferUndo] = None
        self._jsonl: Optional[JsonlSink] = None
        self._logger_sink: Optional[LoggerSink] = None
        self._out_dir: Optional[Path] = None
        # per-step scratch
        self._window: list[tuple[Any, int]] = []
        self._rng: list[Any] = []
        self._loss_bad: Optional[Tensor] = None
        self._loss_sum: Optional[Tensor] = None
        self._input_bad: Optional[Tensor] = None
        self._param_bad: Optional[Tensor] = None
        self._last_step_grads_finite = True
        self._stepped = False
        self._healthy_step = False
        self._pending: list[tuple[NaNEvent, Plan, diagnosis.IncidentContext, str]] = []
        self._healthy_since_snapshot = 0
        self._scaler_overflows = 0

    @property
    def state_key(self) -> str:
        return "NaNGuard"

    def state_dict(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters),
            "lr_scale": self.lr_scale,
            "event_index": self._event_index,
            "ladder": self.ladder.state_dict(),
            "norm_ema": self._norm_ema,
            "norm_history": list(self.norm_history),
            "loss_history": list(self.loss_history),
            "healthy_since_snapshot": self._healthy_since_snapshot,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counters.update(state_dict.get("counters", {}))
        self.lr_scale = float(state_dict.get("lr_scale", 1.0))
        self._event_index = int(state_dict.get("event_index", 0))
        self.ladder.load_state_dict(state_dict.get("ladder", {}))
        ema = state_dict.get("norm_ema")
        self._norm_ema = tuple(ema) if ema is not None else None  # type: ignore[assignment]
        self.norm_history.extend(state_dict.get("norm_history", []))
        self.loss_history.extend(state_dict.get("loss_history", []))
        self._healthy_since_snapshot = int(state_dict.get("healthy_since_snapshot", 0))
        self._resumed = True

    # ------------------------------------------------------------------------------------ fit lifecycle

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        resumed = getattr(self, "_resumed", False)
        if not resumed:
            self._reset_run_state()
        self._resumed = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        cfg = self.config
        self._out_dir = Path(trainer.log_dir or trainer.default_root_dir) / "nanguard"
        is_zero = trainer.global_rank == 0
        self._jsonl = JsonlSink(self._out_dir / "events.jsonl") if cfg.logging.events_file and is_zero else None
        self._logger_sink = LoggerSink(trainer.logger) if cfg.logging.tensorboard and is_zero else None
        self._buffers = BufferUndo(pl_module)
        if cfg.recovery.snapshot != "off":
            directory = Path(cfg.recovery.snapshot_dir) if cfg.recovery.snapshot_dir else self._out_dir / "snapshots"
            if cfg.recovery.snapshot == "disk" and trainer.world_size > 1:
                directory = directory / f"rank{trainer.global_rank}"
            self._store = SnapshotStore(cfg.recovery.keep_snapshots, cfg.recovery.snapshot, directory)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.config.check.parameters:
            findings = self._find_nonfinite_state(pl_module)
            if findings:
                self._initialization_incident(trainer, pl_module, findings)
                return
        self._take_snapshot(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # the last steps' parameters have not been read yet: never leave a non-finite weight behind
        if self.config.check.parameters and not self._stopped and self._find_nonfinite_state(pl_module):
            self._parameter_incident(trainer, pl_module, where="train_end")
        self._flush()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._flush()

    # ------------------------------------------------------------------------------------- batch hooks

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._window:  # first micro-batch of an optimizer step
            if self._buffers is not None:
                self._buffers.arm()
            self._loss_bad = self._loss_sum = self._input_bad = None
        self._window.append((batch, batch_idx))
        if self.config.anomaly.mode != "off":
            self._rng.append(_rng_state())
        if self.config.check.inputs == "always":
            flag = checks.any_nonfinite_flag([t for _, t in checks.iter_batch_tensors(batch)])
            if flag is not None:
                self._input_bad = flag if self._input_bad is None else self._input_bad | flag

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Tensor) -> None:
        if not self.config.check.loss:
            return
        loss = loss.detach()
        flag = checks.nonfinite_flag(loss)
        value = loss.float().sum()
        self._loss_bad = flag if self._loss_bad is None else self._loss_bad | flag
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer) -> None:
        self._stepped = True
        params = [p for group in optimizer.param_groups for p in group["params"]]
        scaler = _grad_scaler(trainer)
        if scaler is not None:
            _ensure_unscaled(scaler, optimizer)
        if self._stopped or self._skip_batches_left > 0:
            self._skip_quietly(params)
            return

        grads = [p.grad for p in params if p.grad is not None]
        cfg = self.config
        norm = checks.total_norm(grads, cfg.clip.norm_type) if (grads and cfg.check.gradients) else None
        values = self._read_flags(norm, params)  # the one host-device sync of this step
        norm_value, loss_value, loss_bad, input_bad, param_bad = values
        local_bad = loss_bad or input_bad or param_bad
        if trainer.world_size > 1:  # rank-local evidence must agree before anyone acts
            any_bad = trainer.strategy.reduce_boolean_decision(local_bad, all=False)
        else:
            any_bad = local_bad
        grads_bad = not math.isfinite(norm_value)
        self.last_grad_norm = norm_value

        if not any_bad and grads_bad and scaler is not None:
            # a GradScaler overflow is routine: the scaler skips the step and lowers its scale
            self._scaler_overflows += 1
            scale = float(scaler.get_scale())
            if self._scaler_overflows < cfg.check.amp_overflow_patience and scale >= cfg.check.amp_min_scale:
                return
        if not any_bad and not grads_bad:
            self._scaler_overflows = 0
            self._healthy(trainer, grads, norm, norm_value, loss_value)
            return

        kind = "parameter" if param_bad else "input" if input_bad else "loss" if loss_bad else "gradient"
        self._incident(trainer, pl_module, optimizer, params, kind, norm_value, local_bad)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._stepped:
            return  # a non-final micro-batch of gradient accumulation
        self._stepped = False
        self._window.clear()
        self._rng.clear()
        if self._pending:
            self._finish_incidents(trainer, pl_module)
        elif self._healthy_step:
            self._after_healthy_step(trainer, pl_module)
        elif self._skip_batches_left > 0:
            self._skip_batches_left -= 1
            if self._buffers is not None:
                self._buffers.undo()
        self._healthy_step = False

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if not self.config.check.parameters:
            return
        state = checkpoint.get("state_dict") or {}
        flag = checks.any_nonfinite_flag([t for t in state.values() if isinstance(t, Tensor)])
        if flag is None or not bool(flag):
            return
        # the checkpoint would carry non-finite weights: restore known-good state and save that instead
        self._parameter_incident(trainer, pl_module, where="checkpoint")
        checkpoint["state_dict"] = trainer.strategy.lightning_module_state_dict()
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [trainer.strategy.optimizer_state(o) for o in trainer.optimizers]
        if "lr_schedulers" in checkpoint:
            checkpoint["lr_schedulers"] = [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]
        if "callbacks" in checkpoint and self.state_key in checkpoint["callbacks"]:
            checkpoint["callbacks"][self.state_key] = self.state_dict()

    # --------------------------------------------------------------------------------- step decisions

    def _read_flags(self, norm: Optional[Tensor], params: list[Tensor]) -> list[float]:
        """Fold every device flag of this step into one tensor and read it once."""
        device = params[0].device if params else torch.device("cpu")
        zero = torch.zeros((), device=device)
        parts = [
            norm.float().to(device) if norm is not None else zero,
            self._loss_sum.to(device) if self._loss_sum is not None else zero,
            self._loss_bad.float().to(device) if self._loss_bad is not None else zero,
            self._input_bad.float().to(device) if self._input_bad is not None else zero,
            self._param_bad.float().to(device) if self._param_bad is not None else zero,
        ]
        self._param_bad = None
        norm_value, loss_value, loss_bad, input_bad, param_bad = torch.stack(parts).tolist()
        return [norm_value, loss_value, bool(loss_bad), bool(input_bad), bool(param_bad)]

    def _healthy(self, trainer: Any, grads: list[Tensor], norm: Optional[Tensor], norm_value: float,
                 loss_value: float) -> None:
        self._healthy_step = True
        self._last_step_grads_finite = True
        self.ladder.healthy()
        threshold = self._clip_threshold()
        if norm is not None and threshold is not None and norm_value > threshold:
            torch.nn.utils.clip_grads_with_norm_(grads, threshold, norm)
            self.counters["clipped_steps"] += 1
        self._update_norm_stats(norm_value)
        self.norm_history.append(norm_value)
        if self._loss_sum is not None:
            self.loss_history.append(loss_value)

    def _clip_threshold(self) -> Optional[float]:
        cfg = self.config.clip
        limits = []
        if cfg.max_norm is not None:
            limits.append(cfg.max_norm)
        if self.ladder.adaptive_clip and self._norm_ema is not None and self._norm_ema[2] >= cfg.warmup_steps:
            mean, var, _ = self._norm_ema
            limits.append(mean + cfg.z_threshold * math.sqrt(max(var, 0.0)))
        return min(limits) if limits else None

    def _update_norm_stats(self, value: float) -> None:
        if not math.isfinite(value):
            return
        alpha = self.config.clip.ema_alpha
        if self._norm_ema is None:
            self._norm_ema = (value, 0.0, 1)
            return
        mean, var, count = self._norm_ema
        delta = value - mean
        mean = alpha * mean + (1 - alpha) * value
        var = alpha * (var + (1 - alpha) * delta * delta)
        self._norm_ema = (mean, var, count + 1)

    def _skip_quietly(self, params: list[Tensor]) -> None:
        reset_grads(params)
        self.counters["skipped_steps"] += 1

    def _incident(self, trainer: Any, pl_module: Any, optimizer: Any, params: list[Tensor], kind: str,
                  norm_value: float, local_bad: bool) -> None:
        cfg = self.config
        event = self._new_event(trainer, kind)
        event.details["grad_norm"] = norm_value
        event.details["lr"] = current_lrs([optimizer])
        if trainer.world_size > 1:
            event.rank = _first_bad_rank(trainer, local_bad)
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
        if ctx.replay:
            self.counters["replays"] += 1
        extra = diagnosis.diagnose(ctx)

        self._last_step_grads_finite = math.isfinite(norm_value)
        plan = self.ladder.incident(trainer.global_step, event.kind, can_roll_back=bool(self._store))
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
        _rank_zero_print(trainer, "[nanguard] " + message)

    # ------------------------------------------------------------------------------ healthy bookkeeping

    def _after_healthy_step(self, trainer: Any, pl_module: Any) -> None:
        if self._buffers is not None:
            self._buffers.disarm()
        if self.config.check.parameters:
            state = list(pl_module.parameters()) + [b for b in pl_module.buffers()]
            self._param_bad = checks.any_nonfinite_flag(state)  # read with the next step's flags
        self._healthy_since_snapshot += 1
        if self._store is not None and self._healthy_since_snapshot >= self.config.recovery.snapshot_every:
            self._take_snapshot(trainer, pl_module)
        if self._logger_sink is not None and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            self._log_scalars(trainer, trainer.global_step)

    def _take_snapshot(self, trainer: Any, pl_module: Any) -> None:
        if self._store is None:
            return
        if self.config.check.parameters and self._param_bad is not None:
            if bool(self._param_bad):  # never snapshot poisoned state; the next step handles the incident
                return
        state = {
            "module": pl_module.state_dict(),
            "optimizers": [o.state_dict() for o in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "scaler": _grad_scaler(trainer).state_dict() if _grad_scaler(trainer) is not None else None,
        }
        self._store.take(trainer.global_step, state, {"lr_scale": self.lr_scale})
        self._healthy_since_snapshot = 0
        self.counters["snapshots"] += 1
        self.ladder.snapshot_taken()

    def _rollback(self, trainer: Any, pl_module: Any, further: bool) -> None:
        assert self._store is not None and self._store.newest is not None
        snap = self._store.newest
        state = self._store.load(snap)
        pl_module.load_state_dict(state["module"])
        for opt, opt_state in zip(trainer.optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)
        for sched_cfg, sched_state in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            sched_cfg.scheduler.load_state_dict(sched_state)
        scaler = _grad_scaler(trainer)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        # the snapshot carries the LR scale of its time; keep the cuts made since
        snap_scale = float(snap.meta.get("lr_scale", 1.0))
        if snap_scale != self.lr_scale:
            scale_lr(trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs], self.lr_scale / snap_scale)
        reset_grads(pl_module.parameters())
        self._param_bad = None
        self._healthy_since_snapshot = 0
        self.counters["rollbacks"] += 1

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
        _rank_zero_print(trainer, "[nanguard] " + message)

    # ---------------------------------------------------------------------------------------- recording

    def _new_event(self, trainer: Any, kind: str) -> NaNEvent:
        self._event_index += 1
        self.counters["incidents"] += 1
        return NaNEvent(step=trainer.global_step, epoch=trainer.current_epoch,
                        batch_idx=self._window[-1][1] if self._window else -1, kind=kind,
                        rank=trainer.global_rank, index=self._event_index)

    def _record(self, trainer: Any, event: NaNEvent, ctx: diagnosis.IncidentContext, extra: str) -> None:
        self.events.append(event)
        cfg = self.config.logging
        if self._jsonl is not None:
            self._jsonl.write(event)
        if cfg.reports and trainer.global_rank == 0 and self._out_dir is not None:
            path = self._report_path(event)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(diagnosis.render_report(ctx, extra), encoding="utf-8")
        if self._logger_sink is not None:
            self._log_scalars(trainer, event.step)
            self._logger_sink.text(event)
            self._logger_sink.flush()
        if cfg.verbose:
            _rank_zero_print(trainer, event.summary())

    def _report_path(self, event: NaNEvent) -> Path:
        base = self._out_dir if self._out_dir is not None else Path(".") / "nanguard"
        return base / f"incident-{event.index:04d}-step{event.step}.txt"

    def _log_scalars(self, trainer: Any, step: int) -> None:
        assert self._logger_sink is not None
        values = {
            "nanguard/incidents": float(self.counters["incidents"]),
            "nanguard/skipped_steps": float(self.counters["skipped_steps"]),
            "nanguard/rollbacks": float(self.counters["rollbacks"]),
            "nanguard/lr_scale": float(self.lr_scale),
            "nanguard/grad_norm": float(self.last_grad_norm),
        }
        scaler = _grad_scaler(trainer)
        if scaler is not None:
            values["nanguard/grad_scale"] = float(scaler.get_scale())
        self._logger_sink.scalars(values, step)

    def _flush(self) -> None:
        if self._logger_sink is not None:
            self._logger_sink.flush()

    # ------------------------------------------------------------------------------------------- helpers

    @staticmethod
    def _buffer_names(pl_module: Any) -> set[str]:
        return {n for n, _ in pl_module.named_buffers()}

    @staticmethod
    def _find_nonfinite_state(pl_module: Any) -> list[dict]:
        named = list(pl_module.named_parameters()) + list(pl_module.named_buffers())
        flag = checks.any_nonfinite_flag([t for _, t in named])
        if flag is None or not bool(flag):
            return []
        return checks.find_nonfinite_tensors(named)


# ----------------------------------------------------------------------------------------- module helpers


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _grad_scaler(trainer: Any) -> Optional[Any]:
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return scaler if scaler is not None and hasattr(scaler, "unscale_") and scaler.is_enabled() else None


def _ensure_unscaled(scaler: Any, optimizer: Any) -> None:
    """Lightning leaves a fused optimizer's grads scaled; unscale them so norms and checks are real."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


def _first_bad_rank(trainer: Any, local_bad: bool) -> int:
    flags = trainer.strategy.all_gather(torch.tensor([1 if local_bad else 0], device=trainer.strategy.root_device))
    flags = flags.flatten().tolist()
    return next((i for i, f in enumerate(flags) if f), trainer.global_rank)
