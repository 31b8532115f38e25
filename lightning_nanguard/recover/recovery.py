"""The state of recovery during a fit: the ladder, known-good snapshots, the learning-rate scale, the buffer
and metric undo, and the operations that change them (skip, LR cut, snapshot, rollback)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol

from ..config import ClipConfig, RecoveryConfig
from ..detect.amp import grad_scaler
from ..layouts import load_module_state
from ..report.events import NaNEvent
from .actions import BufferUndo, current_lrs, scale_lr, skip_step
from .ladder import Plan, RecoveryLadder
from .metrics import MetricUndo
from .snapshots import SnapshotStore

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Recovery", "restorable_scaler_state"]


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def restorable_scaler_state(snapshot: dict[str, Any], current_scale: float, overflows: int) -> dict[str, Any]:
    """The scaler state a rollback restores: the snapshot's, except while the scaler is overflowing.

    A rollback during a streak of overflows must not raise the scale back to the snapshot's value (that
    scale is what overflows): the scale is capped at the current one. After any other incident (a NaN
    loss, bad inputs) the snapshot's scale is restored as it was.
    """
    state = dict(snapshot)
    if overflows > 0 and "scale" in state:
        state["scale"] = min(float(state["scale"]), float(current_scale))
    return state


class Recovery:
    """Everything the guard can undo or change about training, and the ladder that decides when.

    Attributes:
        ladder: the recovery policy (:class:`~.ladder.RecoveryLadder`).
        lr_scale: the cumulative learning-rate scale applied so far (1.0: untouched).
        stopped: the guard gave up (or found non-finite weights at fit start); steps are skipped from now on.
        skip_batches_left: steps still to skip after a rollback (``recovery.skip_batches``).
        skipped_steps, rollbacks, lr_cuts, snapshots: counters for this fit.
        lr_cut_step: the step of the latest LR cut (None: none yet).
    """

    def __init__(self, cfg: RecoveryConfig, clip: ClipConfig, statistics: dict[str, _Stateful]) -> None:
        self.cfg = cfg
        self.ladder = RecoveryLadder(cfg, clip)
        # running statistics that belong to the known-good state: kept with each snapshot and restored with
        # it, so a rollback is not followed by statistics polluted by the divergence that caused it
        self.statistics = statistics
        self.lr_scale = 1.0
        self.stopped = False
        self.skip_batches_left = 0
        self.healthy_since_snapshot = 0
        self.skipped_steps = 0
        self.rollbacks = 0
        self.lr_cuts = 0
        self.lr_cut_step: Optional[int] = None
        self.snapshots = 0
        self.store: Optional[SnapshotStore] = None
        self.buffers: Optional[BufferUndo] = None
        self.metrics: Optional[MetricUndo] = None
        # no optimizer step was applied since the newest snapshot was taken or restored: the parameters are
        # the snapshot's (a lagged rollback then keeps the current step, whose gradients were taken on them)
        self.pristine = True
        self.kept_step = False  # the last rollback kept the current step (see rollback's keep_step)

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", out_dir: Path) -> None:
        """Fit start: the buffer and metric undo for this module, and the snapshot store (unless ``snapshot:
        off``)."""
        cfg = self.cfg
        self.buffers = BufferUndo(pl_module)
        self.metrics = MetricUndo(pl_module)
        self.store = None
        if cfg.snapshot != "off":
            directory = Path(cfg.snapshot_dir) if cfg.snapshot_dir else out_dir / "snapshots"
            if cfg.snapshot == "disk" and trainer.world_size > 1:
                directory = directory / f"rank{trainer.global_rank}"
            self.store = SnapshotStore(cfg.keep_snapshots, cfg.snapshot, directory)

    @property
    def can_roll_back(self) -> bool:
        return bool(self.store)

    # -------------------------------------------------------------------------------------------- actions

    def skip(self, params: list[Any]) -> None:
        """Skip this optimizer step (parameters and optimizer state untouched)."""
        skip_step(params)
        self.skipped_steps += 1

    def undo_buffers(self) -> None:
        """Undo what this step's forward passes wrote into buffers (BatchNorm running statistics)."""
        if self.buffers is not None:
            self.buffers.undo()

    def undo_buffers_where(self, skip: Any) -> None:
        """:meth:`undo_buffers` where the device flag ``skip`` is set, without a host read."""
        if self.buffers is not None:
            self.buffers.undo_where(skip)

    def healthy_step(self) -> None:
        """After a healthy optimizer step."""
        if self.buffers is not None:
            self.buffers.disarm()
        self.healthy_since_snapshot += 1
        self.pristine = False

    def undo_metrics_where(self, skip: Any) -> None:
        """:meth:`undo_metrics` where the device flag ``skip`` is set, without a host read (``check.sync: lagged``);
        :meth:`settle_metrics` finishes it once the flag is read."""
        if self.metrics is not None:
            self.metrics.undo_where(skip)

    def settle_metrics(self, skipped: bool) -> None:
        if self.metrics is not None:
            self.metrics.settle(skipped)

    def undo_metrics(self) -> None:
        """Undo what this step wrote into the user's metrics and Lightning's logged aggregates (a skipped step)."""
        if self.metrics is not None:
            self.metrics.undo()

    def step_start(self, trainer: "pl.Trainer") -> None:
        """The first micro-batch of an optimizer step: back up the buffers its forward passes will write, and the
        metrics and logged aggregates its training steps will update."""
        if self.buffers is not None:
            self.buffers.arm()
        if self.metrics is not None:
            self.metrics.arm(getattr(trainer, "_results", None))  # Lightning's results of the running loop

    def snapshot_due(self, ahead: int = 0) -> bool:
        """Every ``snapshot_every`` healthy steps (``confirm_after`` while a rollback awaits confirmation);
        ``ahead``: counting that many steps not judged yet as healthy."""
        every = self.cfg.snapshot_every
        if self.ladder.failed_rollbacks:  # confirm a rollback with a fresh known-good state soon after it
            every = min(every, self.cfg.confirm_after)
        return self.store is not None and self.healthy_since_snapshot + ahead >= every

    def take_snapshot(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Keep the current state as known-good: module, optimizers, schedulers, grad scaler, statistics."""
        if self.store is None:
            return
        scaler = grad_scaler(trainer)
        state = {
            "module": pl_module.state_dict(),
            "optimizers": [o.state_dict() for o in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
        meta: dict[str, Any] = {"lr_scale": self.lr_scale}
        meta.update({name: obj.state_dict() for name, obj in self.statistics.items()})
        self.store.take(trainer.global_step, state, meta)
        self.healthy_since_snapshot = 0
        self.pristine = True
        self.snapshots += 1
        self.ladder.snapshot_taken()

    def newest_before(self, step: int) -> Optional[Any]:
        """The newest snapshot taken at or before ``step`` (a state from before a divergence began), or None."""
        if self.store is None:
            return None
        return next((snap for snap in reversed(self.store.ring) if snap.step <= step), None)

    def weights_at(self, step: int) -> Optional[tuple[int, dict[str, Any]]]:
        """``(snapshot step, module state dict)`` of :meth:`newest_before` (incident time only: it loads a copy)."""
        snap = self.newest_before(step)
        if snap is None or self.store is None:
            return None
        return snap.step, self.store.load(snap)["module"]

    def rollback(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", scaler_overflows: int,
                 keep_step: bool = False) -> None:
        """Restore the newest snapshot, then re-apply the LR cuts made since it was taken. ``keep_step``: a
        lagged rollback before the current step's update, whose gradients were taken on the snapshot's
        parameters (:attr:`pristine`): keep them and the buffers its forward wrote, so the step goes ahead."""
        assert self.store is not None and self.store.newest is not None
        snap = self.store.newest
        state = self.store.load(snap)
        written = self.buffers.written() if keep_step and self.buffers is not None else {}
        load_module_state(pl_module, state["module"])
        if written:
            self.buffers.put_back(written)  # type: ignore[union-attr]
        for opt, opt_state in zip(trainer.optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)
        for sched_cfg, sched_state in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            sched_cfg.scheduler.load_state_dict(sched_state)
        scaler = grad_scaler(trainer)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(restorable_scaler_state(state["scaler"], scaler.get_scale(), scaler_overflows))
        for name, obj in self.statistics.items():
            if name in snap.meta:
                obj.load_state_dict(snap.meta[name])
        snap_scale = float(snap.meta.get("lr_scale", 1.0))
        if snap_scale != self.lr_scale:  # the snapshot carries the LR scale of its time; keep the cuts since
            scale_lr(trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs],
                     self.lr_scale / snap_scale)
        self.kept_step = keep_step
        if not keep_step:
            skip_step(pl_module.parameters())
        self.healthy_since_snapshot = 0
        self.pristine = True
        self.rollbacks += 1

    @property
    def unfinished(self) -> bool:
        """Recovery is under way: the last steps were skipped incidents, or a rollback is not yet confirmed by a
        snapshot after healthy training (and the guard has not given up). Only then can the weights at the end
        of fit be suspect (:meth:`~lightning_nanguard.incidents.Responder.unfinished_recovery` decides)."""
        return not self.stopped and (self.ladder.consecutive > 0 or self.ladder.failed_rollbacks > 0)

    @contextmanager
    def newest_weights(self, pl_module: "pl.LightningModule") -> Iterator[Optional[int]]:
        """Inside the block the module holds the newest snapshot's weights and buffers (the block gets its step;
        None, and nothing changed, without one); its own are put back after it. Optimizers are not touched."""
        if not self.store or self.store.newest is None:
            yield None
            return
        own = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        load_module_state(pl_module, self.store.load(self.store.newest)["module"])
        try:
            yield self.store.newest.step
        finally:
            load_module_state(pl_module, own)

    def restore_newest(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                       scaler_overflows: int = 0) -> Optional[int]:
        """Roll back to the newest snapshot (fit ends while recovery is unfinished); returns its step, or None
        without one."""
        if not self.store or self.store.newest is None:
            return None
        self.rollback(trainer, pl_module, scaler_overflows)
        self.ladder.consecutive = 0
        return self.store.newest.step

    def cut_lr(self, trainer: "pl.Trainer", event: NaNEvent, factor: Optional[float] = None) -> None:
        """Multiply every learning rate by ``factor`` (default ``lr_factor``), down to ``min_lr_scale`` of the
        original."""
        factor = self.cfg.lr_factor if factor is None else factor
        new_scale = max(self.lr_scale * factor, self.cfg.min_lr_scale)
        before = current_lrs(trainer.optimizers)
        if new_scale < self.lr_scale:
            scale_lr(trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs], new_scale / self.lr_scale)
            self.lr_scale = new_scale
            self.lr_cuts += 1
            self.lr_cut_step = event.step
            event.add_action("reduce_lr")
            event.details["lr_before"] = before
            event.details["lr_after"] = current_lrs(trainer.optimizers)
        event.details["lr_scale"] = self.lr_scale

    def apply(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", event: NaNEvent, plan: Plan,
              scaler_overflows: int = 0, keep_step: bool = False) -> None:
        """Carry out a plan's rollback, batch skipping and LR cut (a give-up restores the newest snapshot).
        ``keep_step``: see :meth:`rollback` (not for a give-up, nor when going further back)."""
        if plan.give_up:
            self.stopped = True
            if self.store:
                self.rollback(trainer, pl_module, scaler_overflows)
                event.details["restored_step"] = self.store.newest.step if self.store.newest else None
            return
        if plan.rollback and self.store:
            if plan.go_further_back:
                self.store.drop_newest()
            dropped = len(self.store)
            while plan.rollback_before is not None and len(self.store) > 1 and self.store.newest is not None \
                    and self.store.newest.step > plan.rollback_before:
                self.store.drop_newest()  # taken after the divergence began: not known-good
            further = plan.go_further_back or len(self.store) < dropped
            self.rollback(trainer, pl_module, scaler_overflows, keep_step=keep_step and not further)
            event.add_action("rollback")
            event.details["restored_step"] = self.store.newest.step if self.store.newest else None
            if plan.skip_batches:
                self.skip_batches_left = plan.skip_batches
                event.add_action("skip_batches")
                event.details["skip_batches"] = plan.skip_batches
        if plan.reduce_lr:
            self.cut_lr(trainer, event, plan.lr_factor)
        event.details["reasons"] = plan.reasons

    # ---------------------------------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        return {"lr_scale": self.lr_scale, "ladder": self.ladder.state_dict(),
                "healthy_since_snapshot": self.healthy_since_snapshot, "skipped_steps": self.skipped_steps,
                "rollbacks": self.rollbacks, "lr_cuts": self.lr_cuts, "snapshots": self.snapshots,
                "lr_cut_step": self.lr_cut_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.ladder.load_state_dict(state.get("ladder", {}))
        self.healthy_since_snapshot = int(state.get("healthy_since_snapshot", 0))
        self.pristine = self.healthy_since_snapshot == 0
        for key in ("skipped_steps", "rollbacks", "lr_cuts", "snapshots"):
            setattr(self, key, int(state.get(key, 0)))
        self.lr_cut_step = state.get("lr_cut_step")
