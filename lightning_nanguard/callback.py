"""The NaNGuard callback: wires checks, the recovery ladder, snapshots, diagnosis and sinks into Lightning."""

from __future__ import annotations

import math
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
from .recovery import BufferUndo, SnapshotStore
from .status import ProgressStatus
from .messages import NaNGuardError
from .responses import StepResponses
from .keeping import StateKeeping

try:  # the callback works in both packages' Trainers; it subclasses the classic one
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover
    import lightning.pytorch as pl  # type: ignore[no-redef]

__all__ = ["NaNGuard", "NaNGuardError"]

class NaNGuard(StepResponses, StateKeeping, pl.Callback):
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
        # clipping needs the norm even where check.gradients is off (then it only clips, never detects)
        clipping = (cfg.clip.max_norm is not None or self.ladder.adaptive_clip or cfg.check.spike_action == "clip")
        norm = self._sync.grad_norm(grads) if grads and (cfg.check.gradients or clipping) else None  # sharded: local
        values = self._read_flags(norm, params)  # the one host-device sync of this step (and, DDP, all-reduce)
        norm_value, loss_value, loss_bad, input_bad, param_bad = values
        norm = self._sync.global_norm(norm, norm_value)
        # several processes: the flags were summed over ranks and the loss is the mean over ranks, so this
        # decision, the spike statistics and everything below are identical on every rank
        any_bad = loss_bad or input_bad or param_bad or self._activation_bad
        spike_z = self._observe_loss(any_bad, loss_value)  # host-side statistics, no sync
        grads_bad = cfg.check.gradients and not math.isfinite(norm_value)
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

# ----------------------------------------------------------------------------------------- module helpers


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state
