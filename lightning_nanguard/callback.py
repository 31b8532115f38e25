"""The NaNGuard callback: Lightning's hooks, each delegating to the parts of the guard.

:class:`NaNGuardBase` is the whole callback without a Lightning base class, so that this module imports neither
Lightning package (importing ``pytorch_lightning`` rebinds globals that ``lightning.pytorch`` shares, and the
other way round). ``lightning_nanguard.NaNGuard`` (:mod:`.classic`) adds ``pytorch_lightning.Callback``,
``lightning_nanguard.lightning.NaNGuard`` adds ``lightning.pytorch.Callback``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, TypeVar, Union

import torch
from torch import Tensor

from .config import SECTIONS, AnomalyConfig, CheckConfig, ClipConfig, LoggingConfig, NaNGuardConfig, RecoveryConfig
from .core.console import say, warn
from .core.events import NaNEvent
from .detect.amp import grad_scaler
from .errors import ConfigError, NaNGuardError
from .recover.checkpoint import nonfinite_entries, rebuild
from .report.progress import ProgressStatus
from .respond import incident as incidents
from .respond.fit_end import FitEnd
from .respond.parts import Parts
from .respond.responder import Responder
from .respond.step import StepFlow
from .state_schema import check_state, check_version
from .store.snapshots import SnapshotStore
from .usage_errors import usage_errors

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["NaNGuardBase", "NaNGuardError"]

_Section = Union[Mapping[str, object], None]
_Guard = TypeVar("_Guard", bound="NaNGuardBase")
_STATE_VERSION = 3


class NaNGuardBase:
    """Keep a training run alive through NaN/Inf, and explain where they came from.

    One optimizer step, as the guard sees it:

    1. ``on_train_batch_start``: the batch joins the step's window (for a replay), its buffers, the module's
       torchmetrics states and Lightning's logged aggregates are backed up (at the step's first micro-batch),
       and with ``check.inputs: always`` its floating tensors become a device flag;
    2. ``on_before_backward``: the loss of each micro-batch joins the step's device sum (non-finite if any is);
    3. ``on_before_optimizer_step``: one fused total gradient norm; the norm, the loss, its flag, the
       parameter/buffer flag (where one was taken) and the activation flag are stacked into one vector (one
       small all-reduce under DDP). With ``check.sync: eager`` (the default on the CPU) it is read at once,
       the step's one host-device sync, and the step's :class:`~.detect.verdict.Outcome` follows:

       - healthy: a loss or gradient norm running away while finite is a ``divergence`` event (from the
         host floats just read; ``check.divergence``: by default the step is skipped and, at its end, the
         run rolls back to a snapshot from before the growth and the LR is cut as the cause allows);
         otherwise clip (``clip.max_norm``, adaptive z-score, AGC), learn the norm and loss statistics; a
         loss spike is recorded and acted on (``check.spike_action``);
       - routine overflow (16-mixed): the GradScaler skips the step by itself;
       - incident: the step is skipped without touching optimizer state (grads set to ``None``), its
         buffer writes are undone, the bad micro-batch is replayed to name the module, op, weight and cause,
         and the recovery ladder plans what follows.

       With ``check.sync: lagged`` (``auto`` off the CPU when every optimizer can skip on the device) nothing
       is read: a device flag skips a bad step inside the optimizer (``found_inf`` of a fused optimizer, or
       the GradScaler's) and undoes its buffer and metric writes, clipping compares the norm with its limit
       on the device, and the vector is copied to the host without a wait. It is read at the next step's
       ``on_before_optimizer_step``, when that step's work is queued, and the step is judged then, as above,
       with its own step number and batches; a rollback it calls for also skips the step under way unless
       that step's gradients were taken on the restored weights. Train end, an epoch's end, validation, a
       checkpoint and a due snapshot read it at once;
    4. ``on_train_batch_end``: a skipped step's metric updates and logged values are undone; the plan is
       carried out (clip from now on, cut the LR in a way schedulers keep, roll back to a known-good
       snapshot, skip the next batches, give up: restore, then stop or raise), the event is recorded
       (``guard.events``, ``events.jsonl``, every logger, a report file), and a snapshot is taken every
       ``recovery.snapshot_every`` healthy steps.

    The weights are checked (``check.parameters``) on every incident, before a snapshot, a checkpoint or
    validation, and at the end of fit; a bad weight that the next forward reads already spoils its loss. While
    ``check.loss`` or ``check.gradients`` is off, every step's update is checked as well.

    While training is healthy nothing changes: the trained weights are bitwise identical to a run without
    the guard. If fit ends on suspect weights (inside a streak of incidents that they reproduce, or while the
    loss runs away after an unconfirmed rollback), the newest snapshot is restored (``recovery.restore_at_end``).

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
        name: only to run two guards in one Trainer: it tells their checkpoint state apart (``state_key``),
            and this guard then writes to ``<log_dir>/nanguard/<name>/``, under ``nanguard/<name>/`` tags and
            to ``ng_<name>_*`` progress-bar keys.

    Attributes:
        config: the resolved :class:`NaNGuardConfig`.
        events: one :class:`NaNEvent` per event of the current fit, in order.
        counters: counts of this fit (incidents, spikes, skipped steps, rollbacks, LR cuts, clipped steps,
            replays, snapshots).
        lr_scale: the cumulative learning-rate scale the guard applied (1.0: untouched).
        stopped: the guard gave up; it skips every remaining step.
        lagged: ``check.sync`` as chosen at fit start (flags read one step late).
        snapshots: the known-good snapshots (a :class:`~.store.snapshots.SnapshotStore`, or None).
        exempt_buffers: buffers non-finite before training (a -inf mask), never checked.
        report_dir: ``<log_dir>/nanguard``: ``events.jsonl`` and the incident reports (``report_path(event)``).

    Raises:
        ConfigError: on an unknown key, a wrong type or an out-of-range value, naming the key.
    """

    if TYPE_CHECKING:  # from the Lightning Callback that classic.py and lightning.py add as a base class
        def _generate_state_key(self, **kwargs: object) -> str: ...

    def __init__(
        self,
        *,
        config: Union[NaNGuardConfig, _Section] = None,
        check: Union[CheckConfig, _Section] = None,
        clip: Union[ClipConfig, _Section] = None,
        anomaly: Union[AnomalyConfig, _Section] = None,
        recovery: Union[RecoveryConfig, _Section] = None,
        logging: Union[LoggingConfig, _Section] = None,
        name: Optional[str] = None,
    ) -> None:
        super().__init__()
        with usage_errors():  # under LightningCLI: a one-line parser error naming the key, not a traceback
            if name is not None and (not isinstance(name, str) or not name.isidentifier()):
                raise ConfigError(f"name: got {name!r}; allowed: null or an identifier (letters, digits, underscores)")
            base = config if isinstance(config, NaNGuardConfig) else NaNGuardConfig.from_mapping(config or {})
            given = {"check": check, "clip": clip, "anomaly": anomaly, "recovery": recovery, "logging": logging}
            # a section given as a mapping becomes its dataclass in NaNGuardConfig.__post_init__
            sections: dict[str, Any] = {name: given[name] if given[name] is not None else getattr(base, name)
                                        for name in SECTIONS}
            self.config = NaNGuardConfig(**sections)
        self.name = name
        self._build()
        self._resumed = False

    @classmethod
    def from_yaml(cls: type[_Guard], path: Union[str, Path]) -> _Guard:
        """Build from a YAML file of sections (optionally nested under ``nanguard:``).

        Args:
            path: the YAML file.

        Returns:
            The guard with that configuration.

        Raises:
            ConfigError: the file cannot be read, is malformed, or holds an invalid configuration.
        """
        return cls(config=NaNGuardConfig.from_yaml(path))

    def _build(self) -> None:
        """The parts of the guard, fresh for a new fit."""
        self._parts = parts = Parts.build(self.config, self.name)
        self._counters, self._evidence, self._recovery = parts.counters, parts.evidence, parts.recovery
        self._clipper, self._recorder, self._diagnoser = parts.clipper, parts.recorder, parts.diagnoser
        self._status = ProgressStatus(self.name)
        self._responder = Responder(parts)
        self._flow = StepFlow(parts, self._responder)
        self._fit_end = FitEnd(parts, self._responder)

    # ------------------------------------------------------------------------------------------- views

    @property
    def events(self) -> list[NaNEvent]:
        return self._recorder.events

    @property
    def lr_scale(self) -> float:
        return self._recovery.lr_scale

    @property
    def stopped(self) -> bool:
        return self._recovery.stopped

    @property
    def lagged(self) -> bool:
        """``check.sync`` as chosen at fit start: flags read one step late."""
        return self._flow.lagged

    @property
    def counters(self) -> dict[str, int]:
        return self._counters.as_dict()

    @property
    def snapshots(self) -> Optional[SnapshotStore]:
        """The known-good snapshots of this fit (:class:`~.store.snapshots.SnapshotStore`: ``ring``, ``newest``,
        ``load(snapshot)``); None before fit start or with ``recovery.snapshot: off``."""
        return self._recovery.store

    @property
    def exempt_buffers(self) -> frozenset[str]:
        """Buffers that held NaN/Inf before training (a causal mask of -inf): taken as intentional, never
        checked."""
        return self._evidence.weights.exempt

    @property
    def report_dir(self) -> Optional[Path]:
        """``<log_dir>/nanguard`` (``events.jsonl`` and the incident reports); None before fit start."""
        return self._recorder.out_dir

    def report_path(self, event: NaNEvent) -> Path:
        """The incident report file of an event.

        Args:
            event: one of :attr:`events`.

        Returns:
            Its Markdown report under :attr:`report_dir`.
        """
        return self._recorder.report_path(event)

    # ------------------------------------------------------------------------------------ persistence

    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name) if self.name else "NaNGuard"

    def state_dict(self) -> dict[str, object]:
        """The guard's state for a checkpoint (Lightning calls it).

        Returns:
            Its versioned sections: counters, event numbering, the recovery ladder and LR scale, the learned
            statistics.
        """
        return {"version": _STATE_VERSION, "counters": self._counters.state_dict(),
                "recorder": self._recorder.state_dict(), "recovery": self._recovery.state_dict(),
                "clipper": self._clipper.state_dict(), "losses": self._parts.losses.state_dict(),
                "overflow": self._parts.overflow.state_dict(), "divergence": self._parts.divergence.state_dict(),
                "stall": self._parts.stall.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved state: checked first (:mod:`~lightning_nanguard.state_schema`), so that a state of
        another version than the current one (the older ones are layouts from before 0.1.0) or a malformed decision
        raises :class:`NaNGuardError` naming its key before anything is loaded, and malformed statistics are reset
        with one warning.

        Args:
            state_dict: what :meth:`state_dict` returned (Lightning passes it from the checkpoint).

        Raises:
            NaNGuardError: another version, or a malformed decision (naming its key).
        """
        source = f"checkpoint['callbacks'][{self.state_key!r}]"
        check_version(state_dict, _STATE_VERSION, source)
        checked = check_state(state_dict, source)
        if checked.reset:
            warn(f"[nanguard] the guard state saved in the checkpoint ({source}) holds unusable running statistics, "
                 f"reset to a fresh warm-up (they are re-learned from the next healthy steps): "
                 f"{'; '.join(checked.reset)}")
        state = checked.state
        self._counters.load_state_dict(state.get("counters", {}))
        self._recorder.load_state_dict(state.get("recorder", {}))
        self._recovery.load_state_dict(state.get("recovery", {}))
        self._clipper.load_state_dict(state.get("clipper", {}))
        self._parts.losses.load_state_dict(state.get("losses", {}))
        self._parts.overflow.load_state_dict(state.get("overflow", {}))
        self._parts.divergence.load_state_dict(state.get("divergence", {}))
        self._parts.stall.load_state_dict(state.get("stall", {}))
        self._resumed = True

    # ---------------------------------------------------------------------------------- fit lifecycle

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit" and not self._resumed:
            self._build()  # a new fit starts afresh (a resumed one continues counters and event numbering)
        self._resumed = False
        self._responder.bind(trainer, pl_module)  # the incident pipeline's Trainer and module, from now on

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._recorder.start(trainer)  # its sinks: events.jsonl, the loggers, incident reports, the screen
        assert self._recorder.out_dir is not None
        self._recovery.start(trainer, pl_module, self._recorder.out_dir)
        self._flow.start(trainer, pl_module)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._resumed = False  # callback state is restored before this hook on every strategy
        unsaved = self._recovery.reconcile_lr_scale(trainer)  # a resumed state without recovery.lr_scale
        if unsaved:
            warn(f"[nanguard] the guard state saved in the checkpoint has no recovery.lr_scale, and {unsaved}")
        self._evidence.activations.start(pl_module)
        self._diagnoser.start()  # here, inside the Trainer's own set_detect_anomaly context
        self._diagnoser.record_initial(pl_module)  # parameter scales at fit start, read only on an incident
        if self.config.check.parameters:
            # a causal mask of -inf is a healthy model: exempt silently (listed in guard.exempt_buffers)
            self._evidence.weights.exempt_nonfinite_buffers(pl_module)
            findings = self._evidence.weights.find(pl_module)
            if findings:
                self._responder.respond(incidents.fit_start(
                    self._responder.at(), findings, self.config.recovery.on_give_up))
                return
        self._flow.snapshot()

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._flow.flush()  # the last lagged step's flags
        self._fit_end.judge()  # never leave a non-finite weight behind; restore suspect ones
        self._recovery.finish()  # snapshot writes in flight are done (a failed one reported)
        summary = self._recovery.store.failure_summary() if self._recovery.store is not None else None
        if summary:
            say(trainer, summary)
        self._stop_hooks()
        self._recorder.flush()
        written = self._recorder.failure_summary()
        if written:
            say(trainer, written)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # a lagged step's list states and update counts are settled when its flags are read: read the epoch's last
        # step now, so that what the epoch's end computes (the module's hook, EarlyStopping) never counts its batch
        self._flow.flush()

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # the last training step's weights are read only with the next step's flags: read them now, so that
        # validation (and checkpoints picked by its metrics) never runs on weights poisoned by that step
        if trainer.sanity_checking:
            return
        self._flow.flush()
        if self._recovery.stopped:
            return
        bad = self._evidence.state_bad(consume=True)
        if bad is not None and trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad:
            self._responder.bad_weights("validation_start")

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._flow.abort()
        try:
            self._recovery.finish()  # the snapshot writes in flight end (a failed one reported)
        except Exception as exc:  # noqa: BLE001  (never hide the exception that ends the fit behind our own)
            warn(f"[nanguard] the snapshot writes could not be finished after the error: {exc!r}")
        self._stop_hooks()
        found = self._diagnoser.anomaly_error(exception)
        if found is not None:  # torch's anomaly mode raised at the op in backward: recorded; the error propagates
            base = "loss" if self._evidence.loss_bad() else "gradient"
            self._responder.respond(incidents.anomaly_error(
                self._responder.at(), base, self._evidence.window, found, self.config.check.inputs != "off"))
        self._recorder.flush()

    def _stop_hooks(self) -> None:
        self._evidence.activations.stop()
        self._diagnoser.stop()

    # ------------------------------------------------------------------------------------- the step

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: object,
                             batch_idx: int) -> None:
        if self._evidence.micro_batch(batch, batch_idx, trainer.global_step):
            self._recovery.step_start(trainer)

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        self._evidence.loss(loss, grad_scaler(trainer))  # 16-mixed: the loss is scaled here

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        self._flow.before_optimizer_step(trainer, optimizer)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: object, batch: object,
                           batch_idx: int) -> None:
        if self._flow.end() and self.config.logging.progress_bar:
            self._status.update(trainer, pl_module, self._counters["incidents"], self._recovery.lr_scale)

    # ----------------------------------------------------------------------------------- checkpoints

    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, object]) -> None:
        # the lagged step's verdict belongs in the checkpoint (and may roll back)
        if self._flow.flush():
            rebuild(checkpoint, trainer, self.state_key, self.state_dict())
        if not self.config.check.parameters:
            return
        exempt = self._evidence.weights.exempt
        bad = nonfinite_entries(checkpoint, exempt=exempt)  # weights and optimizer states
        # several processes: every rank takes the same decision (one all-reduce per checkpoint): under sharding each
        # holds a different part, and the incident that follows is a collective on every rank (its account is
        # shared; a rollback of a DDP rank's share of the snapshots reads every rank)
        ranks = self._parts.ranks
        if ranks.distributed and ranks.any_rank(bool(bad), trainer.strategy.root_device) and not bad:
            bad = [{"name": "(a shard on another rank)" if ranks.sharded else "(a weight on another rank)"}]
        if not bad:
            return
        # the checkpoint would carry non-finite state: restore known-good state and save that instead
        self._responder.bad_weights("checkpoint")
        rebuild(checkpoint, trainer, self.state_key, self.state_dict())
        still_bad = nonfinite_entries(checkpoint, exempt=exempt)
        if still_bad:  # nothing known-good to substitute (recovery.snapshot: off): refuse to write it
            raise NaNGuardError(
                "NaNGuard refused to write a checkpoint holding non-finite tensors "
                f"({', '.join(f['name'] for f in still_bad[:5])}) and has no known-good snapshot to save instead "
                "(recovery.snapshot is 'off'?).")

