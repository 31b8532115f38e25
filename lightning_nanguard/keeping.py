"""NaNGuard's bookkeeping: known-good snapshots and rollbacks, and recording events (guard.events,
events.jsonl, incident reports, logger scalars). A mixin of :class:`~lightning_nanguard.NaNGuard`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


from . import amp, checks, ckpt, diagnosis, stats
from .events import NaNEvent
from .messages import rank_zero_print
from .recovery import reset_grads, scale_lr


class StateKeeping:
    """Snapshots, rollbacks and recording for NaNGuard; state lives on the callback."""

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
            "scaler": amp.grad_scaler(trainer).state_dict() if amp.grad_scaler(trainer) is not None else None,
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
        scaler = amp.grad_scaler(trainer)
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

    # ---------------------------------------------------------------------------------------- recording

    def _new_event(self, trainer: Any, kind: str, counter: str = "incidents") -> NaNEvent:
        """The next numbered event at the current step; ``counter``: which of ``counters`` it counts in."""
        self._event_index += 1
        self.counters[counter] += 1
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
            rank_zero_print(trainer, event.summary())

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
        scaler = amp.grad_scaler(trainer)
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
            rank_zero_print(trainer, "[nanguard] buffers non-finite before training, taken as intentional and "
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
