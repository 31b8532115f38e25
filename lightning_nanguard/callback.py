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

from . import amp, checks, ckpt, diagnosis, distributed, stats
from .monitor import DiagnosisHooks
from .config import (AnomalyConfig, CheckConfig, ClipConfig, LoggingConfig, NaNGuardConfig, RecoveryConfig,
                     SECTIONS)
from .events import JsonlSink, LoggerSink, NaNEvent
from .policy import Plan, RecoveryLadder
from .recovery import BufferUndo, SnapshotStore, current_lrs, reset_grads, scale_lr
from .status import ProgressStatus

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
                         "replays": 0, "snapshots": 0, "spikes": 0}
        self.norm_history: deque[float] = deque(maxlen=200)
        self.loss_history: deque[float] = deque(maxlen=200)
        self.last_grad_norm = float("nan")
        # prevention (stats.py): z-score clipping statistics of healthy norms, loss-spike statistics
        self.zclip = stats.ZClip(cfg.clip.z_threshold, cfg.clip.ema_alpha, cfg.clip.warmup_steps)
        self._state_check = checks.StateCheck()  # the per-step parameter/buffer flag, tensors collected once
        self.spikes = stats.SpikeDetector(cfg.check.spike_z, cfg.check.spike_warmup)
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
        self._scaler: Optional[Any] = None  # the GradScaler of this step (16-mixed), read by _read_flags
        self.grad_scale: Optional[float] = None  # its scale, read with the step's flags (no extra sync)
        self._flags_read = False
        self._routine_overflow = False
        # several processes: flags agree in one all-reduce (distributed.py); replaced in on_fit_start
        self._sync = distributed.StepSync(norm_type=cfg.clip.norm_type)
        self._status = ProgressStatus()  # progress-bar status, logged only when it changes
        # anomaly.mode always / check.activations hooks (monitor.py); removed at fit end and on exception
        self._diag_hooks = DiagnosisHooks(cfg.anomaly.mode, cfg.check.activations)
        self._activation_bad = False

    @property
    def state_key(self) -> str:
        return "NaNGuard"

    def state_dict(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters),
            "lr_scale": self.lr_scale,
            "event_index": self._event_index,
            "ladder": self.ladder.state_dict(),
            "norm_ema": self.zclip.state_dict(),
            "loss_stats": self.spikes.state_dict(),
            "norm_history": list(self.norm_history),
            "loss_history": list(self.loss_history),
            "healthy_since_snapshot": self._healthy_since_snapshot,
            "scaler_overflows": self._scaler_overflows,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counters.update(state_dict.get("counters", {}))
        self.lr_scale = float(state_dict.get("lr_scale", 1.0))
        self._event_index = int(state_dict.get("event_index", 0))
        self.ladder.load_state_dict(state_dict.get("ladder", {}))
        if state_dict.get("norm_ema") is not None:
            self.zclip.load_state_dict(state_dict["norm_ema"])
        if state_dict.get("loss_stats") is not None:
            self.spikes.load_state_dict(state_dict["loss_stats"])
        self.norm_history.extend(state_dict.get("norm_history", []))
        self.loss_history.extend(state_dict.get("loss_history", []))
        self._healthy_since_snapshot = int(state_dict.get("healthy_since_snapshot", 0))
        self._scaler_overflows = int(state_dict.get("scaler_overflows", 0))
        self._resumed = True

    # ------------------------------------------------------------------------------------ fit lifecycle

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        resumed = getattr(self, "_resumed", False)
        if not resumed:
            self._reset_run_state()
            self.events = []  # the events of this fit, numbered from 1 (a resumed fit continues the numbering)
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
        self._sync = distributed.StepSync.for_trainer(trainer, cfg.clip.norm_type)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._resumed = False  # callback state is restored before this hook on every strategy
        self._diag_hooks.start(pl_module)  # here, inside the Trainer's own set_detect_anomaly context
        self._status.reset()
        if self.config.check.parameters:
            self._exempt_constant_buffers(trainer, pl_module)
            findings = self._find_nonfinite_state(pl_module)
            if findings:
                self._initialization_incident(trainer, pl_module, findings)
                return
        self._take_snapshot(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # the last steps' parameters have not been read yet: never leave a non-finite weight behind
        if self.config.check.parameters and not self._stopped and self._find_nonfinite_state(pl_module):
            self._parameter_incident(trainer, pl_module, where="train_end")
        self._diag_hooks.stop()
        self._flush()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # the last training step's weights are read only with the next step's flags: read them now, so that
        # validation (and checkpoints picked by its metrics) never runs on weights poisoned by that step
        if self._param_bad is None or trainer.sanity_checking or self._stopped:
            return
        bad, self._param_bad = bool(self._param_bad), None
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad:
            self._parameter_incident(trainer, pl_module, where="validation_start")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._diag_hooks.stop()
        found = diagnosis.parse_anomaly_error(exception) if self.config.anomaly.mode == "always" else None
        if found is not None:  # anomaly mode raised at the op: diagnose and record it; the error propagates
            event = self._new_event(trainer, "gradient")
            ctx = diagnosis.IncidentContext(trainer=trainer, pl_module=pl_module, event=event,
                                            batches=list(self._window), rng_states=list(self._rng),
                                            replay=getattr(pl_module, "automatic_optimization", True),
                                            frames=self.config.anomaly.frames,
                                            float64_check=self.config.anomaly.float64_check)
            extra = diagnosis.diagnose_anomaly_error(ctx, found)
            self.counters["replays"] += int(ctx.replayed)
            event.add_action("raise")
            self._record(trainer, event, ctx, extra)
        self._flush()

    # ------------------------------------------------------------------------------------- batch hooks

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._window:  # first micro-batch of an optimizer step
            if self._buffers is not None:
                self._buffers.arm()
            self._loss_bad = self._loss_sum = self._input_bad = None
            self._diag_hooks.step_start(trainer.global_step)
        self._window.append((batch, batch_idx))
        if self.config.anomaly.mode != "off":
            self._rng.append(_rng_state())
        if self.config.check.inputs == "always":
            flag = checks.any_nonfinite_flag([t for _, t in checks.iter_batch_tensors(batch)])
            if flag is not None:
                self._input_bad = flag if self._input_bad is None else self._input_bad | flag

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Tensor) -> None:
        self._diag_hooks.fold()  # check.activations: outputs of this micro-batch -> one device flag
        if not self.config.check.loss:
            return
        if self._flags_read:  # manual optimization: each optimizer step judges the losses since the last one
            self._loss_bad = self._loss_sum = None
            self._flags_read = False
        loss = loss.detach()
        flag = checks.nonfinite_flag(loss)
        value = amp.unscale_value(loss.float().sum(), amp.grad_scaler(trainer))  # 16-mixed: loss is scaled here
        self._loss_bad = flag if self._loss_bad is None else self._loss_bad | flag
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer) -> None:
        self._stepped = True
        params = [p for group in optimizer.param_groups for p in group["params"]]
        scaler = self._scaler = amp.grad_scaler(trainer)
        if scaler is not None:
            amp.ensure_unscaled(scaler, optimizer)
        if self._stopped or self._skip_batches_left > 0:
            self._skip_quietly(params)
            return

        grads = [p.grad for p in params if p.grad is not None]
        cfg = self.config
        norm = self._sync.grad_norm(grads) if (grads and cfg.check.gradients) else None  # sharded: local part
        values = self._read_flags(norm, params)  # the one host-device sync of this step (and, DDP, all-reduce)
        norm_value, loss_value, loss_bad, input_bad, param_bad = values
        norm = self._sync.global_norm(norm, norm_value)
        # several processes: the flags were summed over ranks and the loss is the mean over ranks, so this
        # decision, the spike statistics and everything below are identical on every rank
        any_bad = loss_bad or input_bad or param_bad or self._activation_bad
        spike_z = self._observe_loss(any_bad, loss_value)  # host-side statistics, no sync
        grads_bad = not math.isfinite(norm_value)
        self.last_grad_norm = norm_value

        if not any_bad and grads_bad and scaler is not None:
            # a GradScaler overflow is routine: the scaler skips the step and lowers its scale
            self._scaler_overflows += 1
            if not amp.overflow_is_incident(self._scaler_overflows, self.grad_scale, cfg.check.amp_overflow_patience,
                                            cfg.check.amp_min_scale):
                self._routine_overflow = True  # logged (the scale) in on_train_batch_end
                return
        if not any_bad and not grads_bad:
            self._scaler_overflows = 0
            limit = None
            if spike_z is not None:
                limit = self._loss_spike(trainer, pl_module, params, loss_value, spike_z, norm_value)
                if limit is not None and limit < 0:
                    return  # check.spike_action: skip_step
            self._healthy(trainer, params, grads, norm, norm_value, loss_value, limit)
            return

        kind = ("parameter" if param_bad else "input" if input_bad else "activation" if self._activation_bad
                else "loss" if loss_bad else "gradient")
        self._incident(trainer, pl_module, optimizer, params, kind, norm_value, any_bad)
        if scaler is not None and self._pending:
            event = self._pending[-1][0]
            event.details.update(grad_scale=self.grad_scale, scaler_overflows=self._scaler_overflows)
            if not any_bad and event.kind == "gradient" and event.cause in (None, "unknown"):
                event.cause = "overflow"  # overflows persisted beyond check.amp_overflow_patience / amp_min_scale
                event.suggestion = diagnosis.SUGGESTIONS["overflow"]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._stepped:
            return  # a non-final micro-batch of gradient accumulation
        self._stepped = False
        self._diag_hooks.step_end()
        self._window.clear()
        self._rng.clear()
        if self._pending:
            self._finish_incidents(trainer, pl_module)
            if self.config.check.parameters and not self._stopped:  # weights can go bad during a skipped step too
                self._param_bad = self._state_check.flag(pl_module)
        elif self._healthy_step:
            self._after_healthy_step(trainer, pl_module)
        elif self._skip_batches_left > 0:
            self._skip_batches_left -= 1
            if self._buffers is not None:
                self._buffers.undo()
        self._healthy_step = False
        if self._routine_overflow:  # a GradScaler overflow: log the lowered scale like a healthy step
            self._routine_overflow = False
            if self._logger_sink is not None and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
                self._log_scalars(trainer, trainer.global_step)
        if self.config.logging.progress_bar:
            self._status.update(trainer, pl_module, self.counters["incidents"], self.lr_scale)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if not self.config.check.parameters:
            return
        bad = ckpt.nonfinite_entries(checkpoint, exempt=self._state_check.exempt)  # weights, optimizer states
        # sharded state (FSDP): every rank holds a different part, so every rank must take the same decision
        if self._sync.sharded and self._sync.any_rank(bool(bad), trainer.strategy.root_device) and not bad:
            bad = [{"name": "(a shard on another rank)"}]
        if not bad:
            return
        # the checkpoint would carry non-finite state: restore known-good state and save that instead
        self._parameter_incident(trainer, pl_module, where="checkpoint")
        ckpt.rebuild(checkpoint, trainer, self.state_key, self.state_dict())
        still_bad = ckpt.nonfinite_entries(checkpoint, exempt=self._state_check.exempt)
        if still_bad:  # nothing known-good to substitute (recovery.snapshot: off): refuse to write it
            raise NaNGuardError(
                "NaNGuard refused to write a checkpoint holding non-finite tensors "
                f"({', '.join(f['name'] for f in still_bad[:5])}) and has no known-good snapshot to save instead "
                "(recovery.snapshot is 'off'?).")

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
        activations = self._diag_hooks.take()  # check.activations: one flag for all modules of the step
        parts.append(activations.float().to(device) if activations is not None else zero)
        self._param_bad = None
        self._flags_read = True
        stacked = self._sync.reduce(torch.stack(parts))  # several processes: one small all-reduce, no barrier
        read = torch.cat([stacked] + amp.scale_parts(self._scaler, device)).tolist()
        self.grad_scale = read.pop() if self._scaler is not None and len(read) > len(parts) else None
        *values, activation_bad = read
        self._activation_bad = bool(activation_bad)
        norm_value, loss_value, loss_bad, input_bad, param_bad = values
        return [norm_value, loss_value, bool(loss_bad), bool(input_bad), bool(param_bad)]

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
        event = self._spike_event(trainer)
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

    def _spike_event(self, trainer: Any) -> NaNEvent:
        self._event_index += 1
        self.counters["spikes"] += 1
        return NaNEvent(step=trainer.global_step, epoch=trainer.current_epoch,
                        batch_idx=self._window[-1][1] if self._window else -1, kind="spike",
                        rank=trainer.global_rank, index=self._event_index)

    def _clipping_streak(self, trainer: Any, params: list[Tensor], norm_value: float, loss_value: float) -> None:
        """Adaptive clipping had to act on ``CLIPS_BEFORE_LR_CUT`` steps in a row: the gradient norm grows
        faster than its statistics can follow, a divergence that clipping slows but does not stop, and the
        weights are already drifting. Skip this step, roll back to the newest snapshot and cut the LR, at the
        end of the step like an incident (recorded as a ``spike`` event: abnormal, still finite; it does not
        count towards the ladder's give-up)."""
        event = self._spike_event(trainer)
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
        _rank_zero_print(trainer, "[nanguard] " + message)

    # ------------------------------------------------------------------------------ healthy bookkeeping

    def _after_healthy_step(self, trainer: Any, pl_module: Any) -> None:
        if self._buffers is not None:
            self._buffers.disarm()
        if self.config.check.parameters:  # read with the next step's flags; tensor list cached (checks.py)
            self._param_bad = self._state_check.flag(pl_module)
        self._healthy_since_snapshot += 1
        every = self.config.recovery.snapshot_every
        if self.ladder.failed_rollbacks:  # confirm a rollback with a fresh known-good state soon after it
            every = min(every, self.config.recovery.confirm_after)
        if self._store is not None and self._healthy_since_snapshot >= every and not self._diverging():
            self._take_snapshot(trainer, pl_module)
        if self._logger_sink is not None and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            self._log_scalars(trainer, trainer.global_step)

    def _diverging(self) -> bool:
        """Defer a due snapshot while the gradient norm grows geometrically or sits far above its statistics:
        finite is not known-good, and a snapshot of a run on its way to NaN is a rollback target that cannot
        help. Deferred until the growth stops (geometric growth cannot go on for long without overflowing)."""
        z = self.zclip.zscore(self.last_grad_norm)
        far_above = z is not None and z > 2 * self.zclip.z_threshold
        return far_above or stats.norm_growth(list(self.norm_history)[-25:]) is not None

    def _take_snapshot(self, trainer: Any, pl_module: Any) -> None:
        if self._store is None:
            return
        if self.config.check.parameters and self._param_bad is not None:
            if bool(self._param_bad):  # never snapshot poisoned state; the next step handles the incident
                return
        if self.config.check.parameters and self._store and ckpt.optimizer_state_nonfinite(
                trainer.optimizers, self._sync, trainer.strategy.root_device):
            # an inf Adam moment leaves the weights finite (and freezes them): roll back instead of keeping it
            self._parameter_incident(trainer, pl_module, where="snapshot")
            return
        state = {
            "module": pl_module.state_dict(),
            "optimizers": [o.state_dict() for o in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "scaler": _grad_scaler(trainer).state_dict() if _grad_scaler(trainer) is not None else None,
        }
        # the running statistics belong to the known-good state: restored with it, they are not polluted by
        # the divergence that led to the rollback (else adaptive clipping and spike detection go blind)
        self._store.take(trainer.global_step, state, {"lr_scale": self.lr_scale, "zclip": self.zclip.state_dict(),
                                                      "loss_stats": self.spikes.state_dict()})
        self._state_check.refresh()  # re-collect parameters and buffers (a module added mid-fit) now and then
        self._healthy_since_snapshot = 0
        self.counters["snapshots"] += 1
        self.ladder.snapshot_taken()

    def _rollback(self, trainer: Any, pl_module: Any, further: bool) -> None:
        assert self._store is not None and self._store.newest is not None
        self._state_check.refresh()
        snap = self._store.newest
        state = self._store.load(snap)
        pl_module.load_state_dict(state["module"])
        for opt, opt_state in zip(trainer.optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)
        for sched_cfg, sched_state in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            sched_cfg.scheduler.load_state_dict(sched_state)
        scaler = _grad_scaler(trainer)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(amp.restorable_scaler_state(state["scaler"], scaler, self._scaler_overflows))
        # the snapshot carries the LR scale of its time; keep the cuts made since
        snap_scale = float(snap.meta.get("lr_scale", 1.0))
        if "zclip" in snap.meta:
            self.zclip.load_state_dict(snap.meta["zclip"])
            self.spikes.load_state_dict(snap.meta["loss_stats"])
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
            scale = self.grad_scale  # read with the step's flags: no extra sync
            values["nanguard/grad_scale"] = scale if scale is not None else float(scaler.get_scale())
        self._logger_sink.scalars(values, step)

    def _flush(self) -> None:
        if self._logger_sink is not None:
            self._logger_sink.flush()

    # ------------------------------------------------------------------------------------------- helpers

    def _exempt_constant_buffers(self, trainer: Any, pl_module: Any) -> None:
        """Buffers that hold NaN/Inf before training are by design (a float causal mask of -inf, a padding
        table): leave them out of every check instead of calling the model broken. Parameters never are."""
        named = list(pl_module.named_buffers())
        flag = checks.any_nonfinite_flag([t for _, t in named])
        found = checks.find_nonfinite_tensors(named, limit=len(named)) if flag is not None and bool(flag) else []
        self._state_check.exempt = frozenset(f["name"] for f in found)
        self._state_check.refresh()
        if found:
            _rank_zero_print(trainer, "[nanguard] buffers non-finite before training, taken as intentional and "
                                      f"not checked: {', '.join(sorted(self._state_check.exempt))}")

    @staticmethod
    def _buffer_names(pl_module: Any) -> set[str]:
        return {n for n, _ in pl_module.named_buffers()}

    def _find_nonfinite_state(self, pl_module: Any) -> list[dict]:
        named = [(n, t) for n, t in list(pl_module.named_parameters()) + list(pl_module.named_buffers())
                 if n not in self._state_check.exempt]
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
    return amp.grad_scaler(trainer)
