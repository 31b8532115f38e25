"""The state of recovery during a fit, and the only object that changes it: the ladder's plans, known-good
snapshots, the learning-rate scale, the buffer and metric undo, and the operations (skip, LR cut, snapshot,
rollback, give up).

Callers ask :meth:`Recovery.plan` what to do about an event (the ladder answers; nobody reaches through to it)
and :meth:`Recovery.apply` carries the plan out and returns what it did (:class:`Applied`), which the caller
writes into the event.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol

import torch.distributed as dist

from ..config import ClipConfig, RecoveryConfig
from ..core.console import say
from ..core.counters import Counters
from ..core.layouts import load_module_state
from ..core.record import StepRecord, UpdateStage
from ..detect.placement import replicates
from ..store.sharded import ShardedStore
from ..store.snapshots import Norms, Restored, SnapshotStore, as_live, make_store
from ..store.verify import REASONS, Refused
from .actions import Applied, Hands, Rollback
from .hardware import HardwareWatch
from .ladder import Plan, RecoveryLadder
from .lr import common_ratio, current_lrs, reference_lrs, scale_lr
from .metrics import MetricUndo
from .undo import BufferUndo, skip_step

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Recovery", "Applied", "Rollback"]  # (Applied and Rollback: from .actions, where they are made)


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# the LR rose between two snapshots when it grew by more than this factor (a warm restart, a warm-up)
LR_RISE = 2.0


def _rose(before: Optional[float], after: Optional[float]) -> bool:
    return before is not None and after is not None and after > LR_RISE * before


class Recovery:
    """Everything the guard can undo or change about training, and the ladder that decides when.

    Skipped steps, rollbacks, LR cuts and snapshots are counted (``counters``).

    Attributes:
        lr_scale: the cumulative learning-rate scale applied so far (1.0: untouched).
        stopped: the guard gave up (or found non-finite weights at fit start); steps are skipped from now on.
        skip_batches_left: steps still to skip after a rollback (``recovery.skip_batches``).
        healthy_since_snapshot: healthy optimizer steps since the newest snapshot was taken or restored.
        lr_cut_step: the step of the latest LR cut (None: none yet).
        pristine: no optimizer step was applied since the newest snapshot was taken or restored: the parameters
            are the snapshot's (a lagged rollback then keeps the current step, whose gradients were taken on them).
        kept_step: the last rollback kept the current step (see :meth:`rollback`'s ``keep_step``).
        store: the snapshot store (None with ``recovery.snapshot: off``, or before fit start).
    """

    def __init__(self, cfg: RecoveryConfig, clip: ClipConfig, counters: Counters,
                 statistics: dict[str, _Stateful]) -> None:
        self.cfg = cfg
        self.counters = counters
        self._ladder = RecoveryLadder(cfg, clip)
        self.hardware = HardwareWatch(cfg.transient_limit, cfg.transient_window)  # transient faults per rank
        # running statistics that belong to the known-good state: kept with each snapshot and restored with
        # it, so a rollback is not followed by statistics polluted by the divergence that caused it
        self.statistics = statistics
        self.lr_scale = 1.0
        self.lr_scale_known = True  # False: resumed from a guard state without recovery.lr_scale (reconcile_lr_scale)
        # the optimizers' reference LRs at fit start, before a resume loads theirs
        self._configured_lrs: list[float] = []
        self.stopped = False
        self.skip_batches_left = 0
        self.healthy_since_snapshot = 0
        self.lr_cut_step: Optional[int] = None
        self.store: Optional[SnapshotStore] = None
        self.buffers: Optional[BufferUndo] = None
        self.metrics: Optional[MetricUndo] = None
        self.pristine = True
        self.kept_step = False
        self._refusals_told = 0  # how many of the store's refused snapshots an event has named
        # keep the fit's first snapshot and the last one before the LR rose, for this many steps (:meth:
        # take_snapshot): the targets of a stall's rollback (set by the step flow where the stall probe can run;
        # None: none kept)
        self.anchoring: Optional[int] = None
        self._started = False  # the fit's first snapshot was taken (and pinned, anchoring)

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", out_dir: Path) -> None:
        """Fit start: the buffer and metric undo for this module, and the snapshot store (unless ``snapshot:
        off``): under a replicated strategy with several processes (DDP), each rank keeps its share of every
        snapshot (:class:`~.sharded.ShardedStore`); any other (FSDP, DeepSpeed) keeps what each rank holds."""
        cfg = self.cfg
        self._configured_lrs = reference_lrs(trainer.optimizers)  # a resume restores the optimizers after this hook
        self.buffers = BufferUndo(pl_module)
        self.metrics = MetricUndo(pl_module)
        self.store = None
        self._refusals_told = 0
        self._started = False
        if cfg.snapshot != "off":
            directory = Path(cfg.snapshot_dir) if cfg.snapshot_dir else out_dir / "snapshots"
            world = int(getattr(trainer, "world_size", 1) or 1)
            if cfg.snapshot == "disk" and world > 1:
                directory = directory / f"rank{trainer.global_rank}"
            replicated = (world > 1 and replicates(trainer.strategy, pl_module) and dist.is_available()
                          and dist.is_initialized() and dist.get_world_size() == world)
            store = make_store(cfg.snapshot, cfg.keep_snapshots, directory)
            stale = getattr(store, "stale", [])
            if stale:  # an earlier run's files (killed, or ended): removed, so they never pile up
                say(trainer, f"[nanguard] removed {len(stale)} snapshot file(s) an earlier run left in {directory}")
            self.store = ShardedStore(store, world, trainer.global_rank) if replicated else store

    def reconcile_lr_scale(self, trainer: "pl.Trainer") -> Optional[str]:
        """Train start of a fit resumed from a guard state without ``recovery.lr_scale``: the restored optimizers may
        run at an LR the guard cut. Where their reference LRs (:func:`~.lr.reference_lrs`) are one common fraction
        of those configured at fit start, that fraction becomes :attr:`lr_scale`; returns what to tell the user
        (None: nothing to reconcile)."""
        if self.lr_scale_known:
            return None
        self.lr_scale_known = True
        restored = reference_lrs(trainer.optimizers)
        if not restored or restored == self._configured_lrs:
            return None
        ratio = common_ratio(self._configured_lrs, restored)
        if ratio is None:
            return (f"the checkpoint's optimizers run at learning rates {restored}, configured {self._configured_lrs}: "
                    "not one common fraction, so the guard cannot tell which part is its own cut; lr_scale starts at "
                    "1.0 and later cuts count from the restored learning rates")
        if ratio >= 1.0:
            return None  # above the configured LRs: no cut of the guard's (it only ever lowers them)
        self.lr_scale = ratio
        return (f"the checkpoint's optimizers run at {ratio:.6g} x the configured learning rate: taken as the LR "
                f"scale of the guard's earlier cuts (lr_scale = {ratio:.6g}; recovery.min_lr_scale and later cuts "
                "count from it)")

    def finish(self) -> None:
        """End of fit, or an exception: wait for the snapshot writes in flight (a failed one is reported) and end
        the writer thread."""
        if self.store is not None:
            self.store.close()

    def why_nothing_to_restore(self) -> str:
        """Why there is no snapshot to restore, in words (for a give-up that restored nothing)."""
        if self.cfg.snapshot == "off" or self.store is None:
            return "recovery.snapshot is 'off'"
        refused = self.store.refused
        if refused:
            return ("every snapshot left was refused when read back (" + "; ".join(
                f"step {r.step}: {REASONS[r.reason]}" for r in refused[-3:]) + ")")
        failures = self.store.failures
        if failures:
            return f"no snapshot could be kept: {len(failures)} snapshot write(s) failed ({failures[-1]['error']})"
        return "no snapshot was taken yet"

    @property
    def can_roll_back(self) -> bool:
        return bool(self.store)

    @property
    def unfinished(self) -> bool:
        """Recovery is under way: the last steps were skipped incidents, or a rollback is not yet confirmed by a
        snapshot after healthy training (and the guard has not given up). Only then can the weights at the end
        of fit be suspect (:meth:`~lightning_nanguard.respond.fit_end.FitEnd.unfinished` decides)."""
        return not self.stopped and (self._ladder.incidents_in_a_row > 0 or self._ladder.unconfirmed_rollbacks > 0)

    @property
    def incidents_in_a_row(self) -> int:
        """Incidents since the last healthy step or rollback."""
        return self._ladder.incidents_in_a_row

    @property
    def unconfirmed_rollbacks(self) -> int:
        """Rollbacks not yet confirmed by a snapshot after healthy training."""
        return self._ladder.unconfirmed_rollbacks

    # ------------------------------------------------------------------------------------------- the plan

    def plan(self, step: int, kind: str, cause: Optional[str], *, safe_factor: Optional[float] = None,
             clip_armed: bool = False, rollback_before: Optional[int] = None) -> Plan:
        """The ladder's plan for an incident (:meth:`.RecoveryLadder.incident`).

        Args:
            step: the incident's optimizer step.
            kind: its event kind.
            cause: its own diagnosis (None: undiagnosed): the policy the ladder plans by.
            safe_factor: the LR factor of the diagnosis' safe LR (a ``sized`` cut goes that far).
            clip_armed: adaptive clipping is on already.
            rollback_before: roll back to a snapshot taken at or before that step (a divergence's onset).

        Returns:
            What to do about it. Where ``plan.suggestion`` is not None, ``plan.cause`` is the incident's episode's
            (its own diagnosis explains nothing): the caller writes both into the event, which reports them.
        """
        return self._ladder.incident(step, kind, can_roll_back=self.can_roll_back, cause=cause,
                                     safe_factor=safe_factor, clip_armed=clip_armed, rollback_before=rollback_before)

    def step_was_applied(self, plan: Plan) -> Plan:
        """The plan's step was applied (judged late, by an optimizer that cannot skip on the device): only a
        rollback undoes it (:meth:`.RecoveryLadder.must_roll_back`); the plan with it."""
        return self._ladder.must_roll_back(plan, self.can_roll_back,
                                           "the bad step was applied (its optimizer cannot skip on the device)")

    def must_roll_back(self, plan: Plan, reason: str) -> Plan:
        """The weights must go back to the newest snapshot (e.g. the DDP replicas drifted apart): a rollback counted
        like any other, so that one that keeps failing gives up (:meth:`.RecoveryLadder.must_roll_back`); the plan
        with it."""
        return self._ladder.must_roll_back(plan, self.can_roll_back, reason)

    def streak_over(self) -> None:
        """A step was judged healthy: a streak of incidents is over."""
        self._ladder.healthy()

    # -------------------------------------------------------------------------------------------- actions

    def skip(self, params: list[Any]) -> None:
        """Skip this optimizer step (parameters and optimizer state untouched)."""
        skip_step(params)
        self.counters.add("skipped_steps")

    def keep_from_landing(self, record: StepRecord, *, mirrored: bool, undo_buffers: bool) -> bool:
        """Keep a judged step's update from landing, where that is still possible; True when it does not land.

        ``ON_HOST``: the host skips it (and undoes its buffer writes with ``undo_buffers``). ``ON_DEVICE``: a
        decision the device ``mirrored`` (its skip flag is the host's test: an incident, a loss spike to skip)
        skipped it there already, and it is counted; any other decision came too late. ``APPLIED``: too late.
        """
        if record.update is UpdateStage.ON_HOST:
            self.skip(record.params)
            if undo_buffers:
                self.undo_buffers()
            return True
        if record.update is UpdateStage.ON_DEVICE and mirrored:
            self.count_skip()
            return True
        return False

    def count_skip(self) -> None:
        """A step skipped by the optimizer itself, on the device (its device flag)."""
        self.counters.add("skipped_steps")

    def stop(self) -> None:
        """Give up: every remaining step is skipped."""
        self.stopped = True

    @property
    def skipping_batches(self) -> bool:
        """Steps are skipped after a rollback (``recovery.skip_batches``)."""
        return self.skip_batches_left > 0

    def batch_skipped(self) -> None:
        """One of :attr:`skipping_batches`' steps ended: its buffer writes are undone."""
        self.skip_batches_left -= 1
        self.undo_buffers()

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

    def before_update(self) -> None:
        """``on_before_optimizer_step``: the update writes weights and optimizer state that a snapshot may still be
        copying; the device waits for the copies (CUDA), the host does not."""
        if self.store is not None:
            self.store.before_optimizer_step()

    # ------------------------------------------------------------------------------------------ snapshots

    def snapshot_due(self, ahead: int = 0) -> bool:
        """Every ``snapshot_every`` healthy steps (``confirm_after`` while a rollback awaits confirmation);
        ``ahead``: counting that many steps not judged yet as healthy."""
        every = self.cfg.snapshot_every
        if self._ladder.unconfirmed_rollbacks:  # confirm a rollback with a fresh known-good state soon after it
            every = min(every, self.cfg.confirm_after)
        return self.store is not None and self.healthy_since_snapshot + ahead >= every

    def take_snapshot(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Keep the current state as known-good: the fit's (module, optimizers, schedulers, grad scaler) and
        the guard's (the LR scale and the running statistics)."""
        if self.store is None:
            return
        lrs = current_lrs(trainer.optimizers)
        meta: dict[str, Any] = {"lr_scale": self.lr_scale, "lr": max(lrs) if lrs else None}
        meta.update({name: obj.state_dict() for name, obj in self.statistics.items()})
        before = self.store.newest
        snap = self.store.capture(trainer, pl_module, trainer.global_step, meta)
        if self.anchoring is not None:
            if not self._started:
                self.store.pin("start", snap)
            elif before is not None and _rose(before.meta.get("lr"), meta["lr"]):
                self.store.pin("before_lr_rise", before)
            for role, old in list(self.store.anchors.items()):
                if snap.step - old.step > self.anchoring:  # a stall this late is not the start's or that rise's
                    self.store.pin(role, None)
        self._started = True
        self.healthy_since_snapshot = 0
        self.pristine = True
        self.counters.add("snapshots")
        self._ladder.snapshot_taken()

    def stall_target(self, onset: int, lr: float) -> Optional[int]:
        """The step of the snapshot a stall rolls back to: the newest taken while the LR was at most ``lr`` (the
        LR the probe found learns; before the LR rose to the one that stalls), else the oldest taken at or before
        ``onset`` (the run stalled at its LR from the start: the fit's first snapshot, kept while
        :attr:`anchoring`); None: none."""
        kept = [s for s in self.store.ring if not s.failed] if self.store is not None else []
        low = [s for s in kept if s.meta.get("lr") is not None and s.meta["lr"] <= lr]
        if low:
            return max(s.step for s in low)
        early = [s.step for s in kept if s.step <= onset]
        return min(early) if early else None

    def prepare_reference(self, norms: Norms) -> None:
        """Before an incident's diagnosis, on every rank at the same point: drop the snapshots that could not be
        kept, and make the module norms of every snapshot readable (:meth:`reference_norms`; under a sharded store
        one collective, which :meth:`reference_norms`, asked by only some ranks' diagnoses, must not issue)."""
        if self.store is not None:
            self.store.prepare_norms(norms)

    def reference_norms(self, step: int, norms: Norms) -> Optional[tuple[int, dict[str, float]]]:
        """``(snapshot step, {name: 2-norm})`` of the module tensors of the newest snapshot taken at or before
        ``step`` (the weights from before a divergence began), or None (incident time only: it reads a copy)."""
        store = self.store
        while store is not None and (snap := store.newest_before(step)) is not None:
            try:
                found = store.module_norms(snap, norms)
            except Refused as exc:  # refused for good: the next older one
                store.refuse(snap, exc)
                continue
            return None if found is None else (snap.step, found)
        return None

    def rollback(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", scaler_overflows: int,
                 keep_step: bool = False) -> Restored:
        """Restore the newest snapshot that verifies (:meth:`.SnapshotStore.restore_newest`: those that do not are
        refused, and nothing of them reaches the fit), then re-apply the LR cuts made since it was taken. Nothing
        changes when none verifies.

        Args:
            trainer: the fit's Trainer (its optimizers and LR schedulers are restored and re-cut).
            pl_module: the module whose weights and buffers are restored.
            scaler_overflows: the GradScaler overflow streak, for the restore.
            keep_step: a lagged rollback before the current step's update, whose gradients were taken on the newest
                snapshot's parameters (:attr:`pristine`): keep them and the buffers its forward wrote, so the step
                goes ahead (not when an older one is restored).

        Returns:
            What was restored (``restored.snapshot`` is None when no snapshot verified). Only with a snapshot store
            (:attr:`store`).
        """
        assert self.store is not None
        newest = self.store.newest
        keep_step = keep_step and self.pristine  # else a step was applied since: other weights
        written = self.buffers.written() if keep_step and self.buffers is not None else {}
        restored = self.store.restore_newest(trainer, pl_module, scaler_overflows)
        snap = restored.snapshot
        if snap is None:
            return restored
        keep_step = keep_step and snap is newest
        if keep_step and written and self.buffers is not None:
            self.buffers.put_back(written)
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
        self.counters.add("rollbacks")
        return restored

    @contextmanager
    def newest_weights(self, pl_module: "pl.LightningModule") -> Iterator[Optional[int]]:
        """Inside the block the module holds the newest snapshot's weights and buffers (the block gets its step;
        None, and nothing changed, without one); its own are put back after it. Optimizers are not touched."""
        if self.store is not None:
            self.store.settle()
        snap, module, _ = self.store.newest_module() if self.store else (None, None, [])
        if snap is None or module is None:
            yield None
            return
        own = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        # (sharded: the snapshot's local shards, put back into the live DTensors)
        load_module_state(pl_module, as_live(module, pl_module.state_dict()))
        try:
            yield snap.step
        finally:
            load_module_state(pl_module, own)

    def restore_newest(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                       scaler_overflows: int = 0) -> Restored:
        """Roll back to the newest snapshot that verifies (fit ends while recovery is unfinished); what was restored
        (nothing without a snapshot)."""
        if self.store is not None:
            self.store.settle()
        if not self.store or self.store.newest is None:
            return Restored()
        restored = self.rollback(trainer, pl_module, scaler_overflows)
        if restored.snapshot is not None:
            self._ladder.restored()
        return restored

    # ---------------------------------------------------------------------------------------- carry it out

    def cut_lr(self, trainer: "pl.Trainer", step: int, factor: Optional[float]) -> tuple[bool, dict[str, Any]]:
        """Multiply every learning rate by ``factor`` (default ``lr_factor``), down to ``min_lr_scale`` of the
        original; ``step``: the event's.

        Returns:
            Whether anything was cut, and the evidence for the event's details: the LRs before and after (a cut
            only) and the scale.
        """
        factor = self.cfg.lr_factor if factor is None else factor
        new_scale = max(self.lr_scale * factor, self.cfg.min_lr_scale)
        details: dict[str, Any] = {}
        cut = new_scale < self.lr_scale
        if cut:
            before = current_lrs(trainer.optimizers)
            scale_lr(trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs], new_scale / self.lr_scale)
            self.lr_scale = new_scale
            self.counters.add("lr_cuts")
            self.lr_cut_step = step
            details.update(lr_before=before, lr_after=current_lrs(trainer.optimizers))
        details["lr_scale"] = self.lr_scale
        return cut, details

    def apply(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", plan: Plan, step: int,
              scaler_overflows: int = 0, keep_step: bool = False) -> Applied:
        """Carry out a plan's actions in order (:meth:`.actions.Action.carry_out`), but those that act on the step
        itself (a skip, a clip: the incident pipeline's skip stage carries them out when the incident is found).

        Args:
            trainer: the fit's Trainer.
            pl_module: the fit's module.
            plan: the ladder's plan (:meth:`plan`, or one an incident made).
            step: the event's step (the step of an LR cut).
            scaler_overflows: the GradScaler overflow streak, for a restore.
            keep_step: see :meth:`rollback` (not for a give-up, nor when going further back).

        Returns:
            What was done: the actions, in order, and their evidence for the event's details (the plan's reasons
            among them).
        """
        hands = Hands(self, trainer, pl_module, step, scaler_overflows, keep_step)
        done = Applied()
        for action in plan.actions:
            if not action.on_the_step:
                done = action.carry_out(hands, done)
        return done.then(details={"reasons": list(plan.reasons)})

    def refusals_untold(self) -> list[dict[str, Any]]:
        """The snapshots refused since an event last named them (by this rollback, or before it: by the diagnosis'
        reads), for an event's ``details.refused``; each is named once."""
        if self.store is None:
            return []
        untold, self._refusals_told = self.store.refused[self._refusals_told:], len(self.store.refused)
        return [r.to_dict() for r in untold]

    def restore_details(self, restored: Restored) -> tuple[dict[str, Any], Optional[str]]:
        """What a rollback (or a give-up's restore) restored, for the event's details (``restored_step``; the
        ``refused`` snapshots, and why nothing was restored: ``not_restored``), and why nothing was (None: a snapshot
        was restored)."""
        details: dict[str, Any] = {"restored_step": restored.step}
        refused = self.refusals_untold()
        if refused:
            details["refused"] = refused
        if restored.snapshot is None:
            details["not_restored"] = why = self.why_nothing_to_restore()
            return details, why
        return details, None

    # ---------------------------------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        return {"lr_scale": self.lr_scale, "ladder": self._ladder.state_dict(),
                "healthy_since_snapshot": self.healthy_since_snapshot, "lr_cut_step": self.lr_cut_step,
                "hardware": self.hardware.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.lr_scale_known = "lr_scale" in state
        self._ladder.load_state_dict(state.get("ladder", {}))
        self.healthy_since_snapshot = int(state.get("healthy_since_snapshot", 0))
        self.pristine = self.healthy_since_snapshot == 0
        self.lr_cut_step = state.get("lr_cut_step")
        self.hardware.load_state_dict(state.get("hardware", {}))
