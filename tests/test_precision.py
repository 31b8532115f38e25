"""Mixed precision on CPU: the 16-mixed GradScaler path (plain and fused AdamW) and bf16-mixed.

The GradScaler path runs on CPU through ``MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))``
(``precision="16-mixed"`` alone would become bf16 on CPU). A too-high initial scale makes the first steps
overflow in fp16, as a real run calibrating its scale does.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.plugins import MixedPrecision
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard
from . import models


class ScaleProbe(pl.Callback):
    """After NaNGuard in the list: the scaler's scale at the end of every batch."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))


class Poisoned(models.Regression):
    """Regression whose loss is multiplied by NaN on ``bad`` batches (NaN gradients everywhere)."""

    def __init__(self, bad: tuple[int, ...] = (), optimizer: str = "sgd", lr: float = 0.01, fused: bool = False):
        super().__init__(lr=lr, optimizer=optimizer)
        self.bad, self.fused = set(bad), fused

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx in self.bad else loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.fused)
        return super().configure_optimizers()


def fp16(init_scale: float) -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=init_scale))


@pytest.fixture
def fit_mixed(fit):
    """``fit_mixed(model, guard, steps=16, data=None, extra=None, subdir=None, **trainer_kwargs)``: seed 0, then
    ``steps`` steps of batch 16 (default data: 256 regression samples) with the guard, then ``extra``."""

    def run(model: pl.LightningModule, guard: Optional[NaNGuard], steps: int = 16, data=None,
            extra: Optional[list] = None, subdir: Optional[str] = None, **kwargs: Any) -> pl.Trainer:
        pl.seed_everything(0, verbose=False)
        callbacks = ([guard] if guard is not None else []) + (extra or [])
        return fit(model, data or models.regression_data(n=256), callbacks, subdir=subdir, batch_size=16,
                   max_steps=steps, **kwargs)

    return run


def test_routine_overflow_is_not_an_incident_and_scale_is_logged(tmp_path, fit_mixed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    guard, probe = NaNGuard(), ScaleProbe()
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    guarded = models.Regression(lr=0.01)
    plain = copy.deepcopy(guarded)
    trainer = fit_mixed(guarded, guard, plugins=[fp16(2.0 ** 24)], extra=[probe], logger=logger,
                  log_every_n_steps=1)
    assert probe.scales[0] < 2.0 ** 24 and probe.scales[-1] <= 2.0 ** 14  # ~10 overflows calibrated the scale
    assert guard.events == [] and guard.counters["incidents"] == 0
    # transparent: the same weights as without the guard
    fit_mixed(plain, None, plugins=[fp16(2.0 ** 24)], subdir="plain")
    assert models.same_weights(guarded, plain)
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    logged = [e.value for e in acc.Scalars("nanguard/grad_scale")]
    assert logged[0] == 2.0 ** 24 and logged == sorted(logged, reverse=True)  # the scale each step used
    assert len(logged) == trainer.global_step  # overflow steps too
    assert logged[-1] == trainer.precision_plugin.scaler.get_scale()


INIT_SCALE = 2.0 ** 24  # overflows for the first ~10 steps of this run
BACKOFF = torch.amp.GradScaler("cpu").get_backoff_factor()  # each overflow multiplies the scale by this


@pytest.mark.parametrize("key, first", [("amp_overflow_patience", 2), ("amp_min_scale", 3)])
def test_persistent_overflow_is_an_incident(fit_mixed, key, first):
    """Overflow at every step from the start: step ``first`` (0-based) is the ``first + 1``-th overflow in a
    row, run at scale INIT_SCALE * BACKOFF**first; either key is set to make exactly that step the incident."""
    scale_at = [INIT_SCALE * BACKOFF ** i for i in range(first + 1)]
    # patience: the (first+1)-th overflow; floor: between the scale of step first and that of the step before
    check = {key: first + 1 if key == "amp_overflow_patience" else (scale_at[-1] + scale_at[-2]) / 2}
    guard, probe = NaNGuard(check=check), ScaleProbe()
    model = models.Regression(lr=0.01)
    trainer = fit_mixed(model, guard, steps=20, plugins=[fp16(INIT_SCALE)], extra=[probe])
    assert guard.events and guard.events[0].step == first
    event = guard.events[0]
    assert (event.kind, event.cause) == ("gradient", "overflow")
    assert event.details["scaler_overflows"] == first + 1 and event.details["grad_scale"] == scale_at[-1]
    # rollbacks during overflows keep the lowered scale, so the run calibrates and recovers
    assert probe.scales == sorted(probe.scales, reverse=True)
    assert guard.events[-1].step < 19 and not trainer.should_stop
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_rollback_restores_the_scaler(fit_mixed):
    recovery = {"max_skips": 3, "snapshot_every": 2, "reduce_lr_on_rollback": False, "reduce_lr_after": 0}
    guard = NaNGuard(recovery=recovery)
    probe = ScaleProbe()
    init = 2.0 ** 10  # no overflow at this scale: it stays constant until the burst
    bad = list(range(6, 6 + recovery["max_skips"] + 1))  # the last one forces the rollback
    model = Poisoned(bad=tuple(bad))
    fit_mixed(model, guard, steps=12, plugins=[fp16(init)], extra=[probe])
    assert [e.step for e in guard.events] == bad and guard.events[-1].actions[-1] == "rollback"
    # each NaN step backed the scale off; the rollback restored the snapshot's scale (taken before the burst)
    assert probe.scales[:bad[0]] == [init] * bad[0]
    assert probe.scales[bad[0]:bad[-1]] == [init * BACKOFF ** (i + 1) for i in range(len(bad) - 1)]
    assert probe.scales[bad[-1]] == init
    snapshot = guard.snapshots.load(guard.snapshots.newest)
    assert snapshot["scaler"]["scale"] == init  # the snapshot holds the scaler's state


def test_fused_adamw_is_unscaled_before_the_checks(fit_mixed):
    # healthy: the guard unscales the fused optimizer's gradients itself; the result is bitwise the same
    guarded = Poisoned(optimizer="adamw", fused=True)
    plain = copy.deepcopy(guarded)
    guard = NaNGuard()
    fit_mixed(guarded, guard, steps=8, plugins=[fp16(2.0 ** 10)])
    fit_mixed(plain, None, steps=8, plugins=[fp16(2.0 ** 10)], subdir="plain")
    assert guard.events == [] and models.same_weights(guarded, plain)
    # a NaN step is skipped (grads None after unscale_: no "No inf checks were recorded" error)
    model, guard = Poisoned(bad=(3,), optimizer="adamw", fused=True), NaNGuard()
    trainer = fit_mixed(model, guard, steps=8, plugins=[fp16(2.0 ** 10)], subdir="nan")
    assert [e.step for e in guard.events] == [3]
    opt = trainer.optimizers[0]
    assert all(int(opt.state[p]["step"]) == 7 for p in model.parameters())  # one update skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_nan_is_a_real_incident(fit_mixed):
    data = models.regression_data(n=256)
    x, y = data.tensors[0].clone(), data.tensors[1]
    x[5 * 16 + 2, 1] = float("nan")  # one bad sample in batch 5
    guarded = models.Regression(lr=0.01)
    plain = copy.deepcopy(guarded)
    guard = NaNGuard()
    fit_mixed(guarded, guard, data=TensorDataset(x, y), precision="bf16-mixed")
    assert [(e.step, e.kind, e.cause) for e in guard.events] == [(5, "input", "input")]
    assert guard.events[0].details["inputs"][0]["samples"] == [2]
    assert all(torch.isfinite(p).all() for p in guarded.parameters())
    # healthy bf16 run: transparent
    healthy, guard = copy.deepcopy(plain), NaNGuard()
    fit_mixed(healthy, guard, precision="bf16-mixed", subdir="a")
    fit_mixed(plain, None, precision="bf16-mixed", subdir="b")
    assert guard.events == [] and models.same_weights(healthy, plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fp16_grad_scaler_plain_and_fused(fit_mixed):
    def cuda_fp16(init_scale: float = 2.0 ** 16) -> dict:
        scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)
        return dict(accelerator="cuda", plugins=[MixedPrecision("16-mixed", "cuda", scaler)], deterministic=False)

    # routine overflows from a too-high initial scale are not incidents; the guard is transparent
    guarded = Poisoned(optimizer="adamw", fused=True)
    plain = copy.deepcopy(guarded)
    guard = NaNGuard()
    trainer = fit_mixed(guarded, guard, **cuda_fp16(2.0 ** 24))
    assert trainer.precision_plugin.scaler.get_scale() < 2.0 ** 24  # it did overflow
    fit_mixed(plain, None, **cuda_fp16(2.0 ** 24), subdir="plain")
    assert guard.events == [] and models.same_weights(guarded, plain)
    # a NaN loss under a fused optimizer and under a plain one: skipped, recorded, weights finite
    for fused in (True, False):
        model, guard = Poisoned(bad=(3,), optimizer="adamw", fused=fused), NaNGuard()
        trainer = fit_mixed(model, guard, steps=8, **cuda_fp16(2.0 ** 10), subdir=f"nan{fused}")  # no overflow
        assert [(e.step, e.kind) for e in guard.events] == [(3, "loss")]
        assert guard.events[0].details["grad_scale"] > 0  # read with the step's flags, no extra sync
        opt = trainer.optimizers[0]
        assert all(int(opt.state[p]["step"]) == 7 for p in model.parameters())
        assert all(torch.isfinite(p).all() for p in model.parameters())


# --------------------------------------------------------- check.amp_overflow_patience, check.amp_min_scale


@pytest.fixture
def fit_fp16(fit):
    """``fit_fp16(check, subdir)``: 12 fp16 steps from INIT_SCALE with the given check section; returns the guard
    and the scale after every step."""

    def run(check: dict, subdir: str) -> tuple[NaNGuard, list[float]]:
        guard, probe = NaNGuard(check=check, logging={"verbose": False}), ScaleProbe()
        fit(models.Regression(lr=0.01), models.regression_data(12 * 16), [guard, probe], subdir=subdir, batch_size=16,
            max_steps=12, plugins=[fp16(INIT_SCALE)])
        return guard, probe.scales

    return run


def _routine_overflows(fit_fp16: Any) -> int:
    guard, scales = fit_fp16({"amp_overflow_patience": 1000, "amp_min_scale": 1e-30}, "control")
    assert guard.events == []
    overflows = sum(1 for a, b in zip([INIT_SCALE] + scales, scales) if b < a)
    assert scales[:overflows] == [INIT_SCALE / 2 ** (i + 1) for i in range(overflows)]  # a streak from step 0
    return overflows


def test_amp_overflow_patience_is_the_streak_that_becomes_an_incident(fit_fp16: Any) -> None:
    streak = _routine_overflows(fit_fp16)
    assert streak >= 4
    for patience in (2, streak - 1):
        guard, _ = fit_fp16({"amp_overflow_patience": patience}, str(patience))
        ev = guard.events[0]
        assert (ev.step, ev.kind, ev.cause) == (patience - 1, "gradient", "overflow")
        assert ev.details["scaler_overflows"] == patience
    guard, _ = fit_fp16({"amp_overflow_patience": streak + 1}, "longer")
    assert guard.events == []


class OverflowAt(models.Regression):
    """Regression whose loss is multiplied by 1000 on batch ``at``: finite, but its scaled fp16 gradients overflow."""

    def __init__(self, at: int) -> None:
        super().__init__(lr=0.01)
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 1000.0 if batch_idx == self.at else loss


def test_amp_overflow_patience_counts_only_consecutive_overflows(fit: Any, fit_fp16: Any) -> None:
    """docs/distributed.md: overflows become an incident after check.amp_overflow_patience *consecutive* ones. The
    streak that calibrates the scale at the start, then a lone overflow later: as many as the patience in all,
    but never in a row, so both stay routine."""
    streak = _routine_overflows(fit_fp16)
    late = 14
    guard, probe = NaNGuard(check={"amp_overflow_patience": streak + 1}, logging={"verbose": False}), ScaleProbe()
    fit(OverflowAt(late), models.regression_data(16 * 16), [guard, probe], batch_size=16, max_steps=16,
        plugins=[fp16(INIT_SCALE)])
    scales = [INIT_SCALE] + probe.scales
    overflowed = [step for step in range(16) if scales[step + 1] < scales[step]]
    assert overflowed == list(range(streak)) + [late]  # streak + 1 overflows: the patience, but not in a row
    assert guard.events == [] and guard.counters["incidents"] == 0


def test_amp_min_scale_turns_an_overflow_below_it_into_an_incident(fit_fp16: Any) -> None:
    streak = _routine_overflows(fit_fp16)
    for at in (1, streak - 1):  # the overflow of step `at` runs at scale INIT_SCALE / 2**at
        floor = 1.5 * INIT_SCALE / 2 ** at
        guard, _ = fit_fp16({"amp_min_scale": floor, "amp_overflow_patience": 1000}, str(at))
        ev = guard.events[0]
        assert (ev.step, ev.kind, ev.cause) == (at, "gradient", "overflow")
        assert ev.details["grad_scale"] == INIT_SCALE / 2 ** at < floor
    # a floor under every scale of the streak: routine overflows only
    guard, _ = fit_fp16({"amp_min_scale": 0.5 * INIT_SCALE / 2 ** streak, "amp_overflow_patience": 1000}, "low")
    assert guard.events == []
