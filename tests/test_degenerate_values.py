"""Issue 20, item 1b: the guard never crashes a run, whatever the values it divides by, takes the log of, squares
or normalises by (an LR, a norm, a weight scale, a loss, a count): a zero, a negative, an infinite or a NaN value
gives a finite estimate or none.

Each case is a real fit that crashed (or misbehaved) before: an LR of 0 (SGD probed at lr=0, a warm-up from 0, a
cosine schedule ending at 0) with a divergence or a NaN loss; all-zero gradients; zero-initialised weights; a
zero or a constant loss; a non-finite or negative LR; float64 weights too large to square in Python; a parameter
and a batch field with no elements. Every behaviour test runs with ``check.sync`` eager and lagged (fused
optimizers, which skip bad steps on the device, so lagged is the real lagged path on the CPU).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Optional, Union

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.report.cli import main as nanguard_cli
from . import models

NAN = float("nan")
SYNCS = ["eager", "lagged"]


def long_data():
    """64 batches of 16: one epoch holds every step of the longer fits (batch_idx == step)."""
    return models.regression_data(n=1024)


def guard(sync: str, **sections: Any) -> NaNGuard:
    return models.sync_guard(sync, {"verbose": False}, **sections)


def assert_clean(guard: NaNGuard, sync: str) -> None:
    """The fit ran in ``sync`` mode; every event serialises to strict JSON and its suggestion is a sentence with
    no 'nan', 'inf' or 'None' standing in for a number the guard does not know."""
    assert guard.lagged == (sync == "lagged")
    for e in guard.events:
        json.dumps(e.to_dict(), allow_nan=False)
        assert isinstance(e.suggestion, str) and e.suggestion, e
        assert not re.search(r"\b(nan|inf|None)\b", e.suggestion), e.suggestion


def initial_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


class Probe(models.Regression):
    """Regression with a fused SGD (or AdamW) and an optional step-interval schedule, whose loss can be made
    degenerate:

    - ``loss``: ``"mse"``; ``"zero_grad"``: the MSE's value with all-zero gradients (a detached term plus
      ``0 * sum(params)``); ``"zero"``: the value 0 with the MSE's gradients; ``"const"``: the value 1.5 with the
      MSE's gradients; ``"nan_term"``: the MSE plus a detached NaN term (a NaN loss with finite gradients);
    - ``switch_at``: from this batch on the loss is the plain MSE;
    - ``grow_from``: from this batch on the loss is multiplied by 10 per step (a divergence that owes nothing to
      the optimizer); ``nan_at``: batches whose loss is multiplied by NaN;
    - ``schedule``: a ``LambdaLR`` factor, or ``"cosine0"``: cosine annealing to exactly 0 at step ``t_max``;
    - ``zero_init``: every parameter starts at 0.
    """

    def __init__(self, lr: float = 0.0, optimizer: str = "sgd", loss: str = "mse", switch_at: Optional[int] = None,
                 grow_from: Optional[int] = None, nan_at: tuple[int, ...] = (), nan_term_at: tuple[int, ...] = (),
                 schedule: Union[None, str, Callable[[int], float]] = None, t_max: int = 10,
                 zero_init: bool = False) -> None:
        super().__init__(lr=lr, optimizer=optimizer)
        self.loss_kind, self.switch_at, self.grow_from = loss, switch_at, grow_from
        self.nan_at, self.nan_term_at, self.schedule, self.t_max = set(nan_at), set(nan_term_at), schedule, t_max
        if zero_init:
            with torch.no_grad():
                for p in self.parameters():
                    p.zero_()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        mse = super().training_step(batch, batch_idx)
        kind = "mse" if self.switch_at is not None and batch_idx >= self.switch_at else self.loss_kind
        if kind == "zero_grad":
            loss = mse.detach() + 0.0 * sum(p.sum() for p in self.parameters())
        elif kind == "zero":
            loss = mse - mse.detach()
        elif kind == "const":
            loss = 1.5 + (mse - mse.detach())
        else:
            loss = mse
        if self.grow_from is not None and batch_idx >= self.grow_from:
            loss = loss * 10.0 ** (batch_idx - self.grow_from + 1)
        if batch_idx in self.nan_term_at:
            loss = loss + mse.detach() * NAN
        return loss * NAN if batch_idx in self.nan_at else loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)
        if self.schedule is None:
            return opt
        if self.schedule == "cosine0":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.t_max, eta_min=0.0)
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, self.schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ---------------------------------------------------------------------------------------- an LR of zero


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("mode", ["warn", "act"])
def test_a_divergence_at_lr_zero_is_diagnosed_without_a_safe_lr(fit_steps, tmp_path, sync, mode):
    """SGD at lr=0 with a loss that grows 10x per step (crashed with ZeroDivisionError in the safe-LR estimate):
    the divergence is recorded, its relative update is 0 and no safe LR is given; nothing can move the weights."""
    model, g = Probe(lr=0.0, grow_from=4), guard(sync, check={"divergence": mode})
    before = initial_weights(model)
    fit_steps(model, [g], 10)
    assert_clean(g, sync)
    first = g.events[0]
    assert first.kind == "divergence" and first.cause != "learning_rate"
    rel = first.details["relative_update"]
    assert rel["lr"] == 0.0 and rel["relative_update"] == 0.0 and rel["safe_lr"] is None and "edge_lr" not in rel
    assert "Lower it to about" not in first.suggestion
    assert unchanged(model, before)
    if mode == "warn":
        assert all(e.actions == ["warn"] for e in g.events) and g.lr_scale == 1.0
    else:
        assert "rollback" in first.actions and g.counters["rollbacks"] >= 1 and g.lr_scale < 1.0
        # and the report command reads the events file of such a run
        assert nanguard_cli(["report", str(tmp_path)]) == 0


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_nan_loss_in_a_run_at_lr_zero_is_skipped(fit_steps, sync, optimizer):
    model = Probe(lr=0.0, optimizer=optimizer, nan_at=(6,))
    before = initial_weights(model)
    g = guard(sync)
    fit_steps(model, [g], 10)
    assert_clean(g, sync)
    (e,) = g.events
    assert (e.step, e.kind) == (6, "loss") and e.cause != "learning_rate" and "reduce_lr" not in e.actions
    assert g.counters["skipped_steps"] == 1
    rel = e.details["relative_update"]
    assert rel["relative_update"] == 0.0 and rel["safe_lr"] is None
    assert unchanged(model, before)


@pytest.mark.parametrize("sync", SYNCS)
def test_a_nan_loss_at_the_first_step_of_a_warm_up_from_zero(fit_steps, sync):
    """AdamW with a LambdaLR warm-up from 0: the NaN comes at step 0, where the LR is 0; the run goes on and trains."""
    model = Probe(lr=0.01, optimizer="adamw", schedule=lambda k: min(k / 4, 1.0), nan_at=(0,))
    before = initial_weights(model)
    g = guard(sync)
    trainer = fit_steps(model, [g], 8)
    assert_clean(g, sync)
    (e,) = g.events
    assert (e.step, e.kind, e.details["lr"]) == (0, "loss", [0.0]) and e.cause != "learning_rate"
    assert trainer.global_step == 8 and models.all_finite(model) and not unchanged(model, before)


@pytest.mark.parametrize("sync", SYNCS)
def test_a_nan_loss_where_a_cosine_schedule_reaches_zero(fit_steps, sync):
    """CosineAnnealingLR(eta_min=0) is at exactly 0 at step T_max=10, where the loss is NaN."""
    model = Probe(lr=0.05, schedule="cosine0", t_max=10, nan_at=(10,))
    g = guard(sync)
    trainer = fit_steps(model, [g], 13)
    assert_clean(g, sync)
    (e,) = g.events
    assert (e.step, e.kind, e.details["lr"]) == (10, "loss", [0.0]) and e.cause != "learning_rate"
    assert trainer.global_step == 13 and models.all_finite(model)


@pytest.mark.parametrize("sync", SYNCS)
def test_zero_initialised_weights_at_lr_zero(fit_steps, sync):
    """Zero weights and a zero LR: the relative update is 0 against the floor of the weight scale; no safe LR."""
    model = Probe(lr=0.0, zero_init=True, nan_at=(6,))
    g = guard(sync)
    fit_steps(model, [g], 10)
    assert_clean(g, sync)
    (e,) = g.events
    assert (e.step, e.kind) == (6, "loss") and e.details["relative_update"]["safe_lr"] is None
    assert all(bool((p == 0).all()) for p in model.parameters())


# -------------------------------------------------------------------------- non-finite and negative LRs


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("lr", [math.inf, NAN, -1.0], ids=["inf", "nan", "negative"])
def test_a_non_finite_or_negative_lr_gives_no_safe_lr_and_a_clean_suggestion(fit_steps, sync, lr):
    """From step 6 a LambdaLR sets the LR to inf, NaN or a negative value, and step 6's loss is NaN: the guard
    gives no safe-LR estimate (no 'nan' in the suggestion) and still ends the run with finite weights."""
    model = Probe(lr=0.01, schedule=lambda k: lr if k >= 6 else 1.0, nan_at=(6,))
    g = guard(sync)
    fit_steps(model, [g], 10)
    assert_clean(g, sync)
    first = g.events[0]
    assert (first.step, first.kind) == (6, "loss")
    rel = first.details.get("relative_update")
    assert rel is None or rel["safe_lr"] is None
    assert models.all_finite(model)


# ------------------------------------------------------------------------------ all-zero gradients


@pytest.mark.parametrize("sync", SYNCS)
def test_all_zero_gradients_then_a_nan_loss(fit_steps, sync):
    """Nothing to estimate from a zero gradient norm: no relative update, no crash, the weights never move."""
    model = Probe(lr=0.1, loss="zero_grad", nan_at=(8,))
    before = initial_weights(model)
    g = guard(sync)
    fit_steps(model, [g], 12)
    assert_clean(g, sync)
    (e,) = g.events
    assert (e.step, e.kind) == (8, "loss") and "relative_update" not in e.details
    assert unchanged(model, before)


@pytest.mark.parametrize("sync", SYNCS)
def test_a_divergence_with_all_zero_gradients(fit_steps, sync):
    model = Probe(lr=0.1, loss="zero_grad", grow_from=4)
    g = guard(sync)
    fit_steps(model, [g], 10)
    assert_clean(g, sync)
    first = g.events[0]
    assert first.kind == "divergence" and first.cause not in ("learning_rate", "exploding_gradient")
    assert models.all_finite(model)


@pytest.mark.parametrize("sync", SYNCS)
def test_a_gradient_norm_against_a_history_of_zero_norms_is_no_z_score(fit_steps, sync):
    """Six steps of all-zero gradients, then a NaN loss (a detached NaN term) with finite gradients: against a
    history without spread the norm has no z-score (it was 1e12 standard deviations, "exploding_gradient", and
    the LR was cut)."""
    model = Probe(lr=0.01, loss="zero_grad", switch_at=6, nan_term_at=(6,))
    g = guard(sync)
    fit_steps(model, [g], 10)
    assert_clean(g, sync)
    (e,) = g.events
    assert (e.step, e.kind) == (6, "loss") and math.isfinite(e.details["grad_norm"]) and e.details["grad_norm"] > 0
    assert "grad_norm_zscore" not in e.details and e.cause != "exploding_gradient"
    assert "reduce_lr" not in e.actions and g.lr_scale == 1.0


@pytest.mark.parametrize("sync", SYNCS)
def test_the_adaptive_clip_learns_no_zero_threshold_from_zero_gradients(fit_steps, sync):
    """``clip.adaptive: always`` over 30 steps of all-zero gradients: a threshold of 0 clipped every later
    gradient to nothing, and ten such steps rolled the healthy run back and cut its LR. Zero norms say nothing
    about the scale of the gradients: the clip warms up on the real ones, and the run equals the unguarded one."""
    make = lambda: Probe(lr=0.05, loss="zero_grad", switch_at=30)  # noqa: E731
    pl.seed_everything(0, verbose=False)
    plain = make()
    fit_steps(plain, [], 45, subdir="plain", data=long_data())
    pl.seed_everything(0, verbose=False)
    model, g = make(), guard(sync, clip={"adaptive": "always"})
    fit_steps(model, [g], 45, subdir=sync, data=long_data())
    assert_clean(g, sync)
    assert g.events == [] and g.counters["rollbacks"] == 0 and g.lr_scale == 1.0
    assert models.same_weights(model, plain)


@pytest.mark.parametrize("sync", SYNCS)
def test_gradients_starting_after_a_phase_of_zero_gradients_are_no_divergence(fit_steps, sync):
    """The first real gradient norms after 30 zero ones grew "infinitely" over a zero mean, so the guard held back
    its snapshots as if the run were diverging (7 instead of 10): it takes them as in a run that always had
    gradients."""
    counts = {}
    for loss in ("zero_grad", "mse"):
        pl.seed_everything(0, verbose=False)
        model, g = Probe(lr=0.05, loss=loss, switch_at=30), guard(sync, recovery={"snapshot_every": 5})
        fit_steps(model, [g], 45, data=long_data(), subdir=loss)
        assert_clean(g, sync)
        assert g.events == []
        counts[loss] = g.counters["snapshots"]
    assert counts["zero_grad"] == counts["mse"] == 10


# ----------------------------------------------------------------------------------- zero and constant losses


@pytest.mark.parametrize("sync", SYNCS)
def test_a_loss_of_exactly_zero_gives_the_spike_test_no_scale(fit_steps, sync):
    """55 steps at a loss of exactly 0 (real gradients), then the plain MSE, with ``check.spike_action: skip_step``:
    every later step was a "spike" of 1e12 standard deviations, skipped, and the LR was cut. A history without
    scale restarts the spike test's warm-up instead: no spike, and the run equals the unguarded one."""
    make = lambda: Probe(lr=0.01, loss="zero", switch_at=55)  # noqa: E731
    pl.seed_everything(0, verbose=False)
    plain = make()
    fit_steps(plain, [], 62, subdir="plain", data=long_data())
    pl.seed_everything(0, verbose=False)
    model, g = make(), guard(sync, check={"spike_action": "skip_step"})
    fit_steps(model, [g], 62, subdir=sync, data=long_data())
    assert_clean(g, sync)
    assert g.events == [] and g.counters["skipped_steps"] == 0 and g.lr_scale == 1.0
    assert models.same_weights(model, plain)


@pytest.mark.parametrize("sync", SYNCS)
def test_a_constant_loss_then_a_nan_loss(fit_steps, sync):
    """A loss of exactly 1.5 at every step (real gradients): no spike, no divergence; the NaN at step 56 is the
    one event."""
    model = Probe(lr=0.01, loss="const", nan_at=(56,))
    g = guard(sync, check={"spike_action": "skip_step"})
    fit_steps(model, [g], 60, data=long_data())
    assert_clean(g, sync)
    (e,) = g.events
    assert (e.step, e.kind) == (56, "loss") and g.counters["skipped_steps"] == 1 and g.lr_scale == 1.0
    assert models.all_finite(model)


# ------------------------------------------------------------------------------- huge weights, empty tensors


class HugeGain(models.Regression):
    """float64 regression whose output is scaled by a gain parameter kept at 1e200 (divided back out): its norm
    squared overflows a Python float. NaN loss at batch 6."""

    def __init__(self) -> None:
        super().__init__(lr=0.01)
        self.gain = nn.Parameter(torch.tensor([1e200], dtype=torch.float64))
        self.double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.linear(x) * (self.gain / 1e200), y)
        return loss * NAN if batch_idx == 6 else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)


@pytest.mark.parametrize("sync", SYNCS)
def test_float64_weights_whose_norm_squared_overflows(fit_steps, sync):
    """The diagnosis compared weight norms through ``norm ** 2`` (OverflowError past 1e154 in Python)."""
    data = TensorDataset(*(t.double() for t in models.regression_data(n=256).tensors))
    model, g = HugeGain(), guard(sync, recovery={"snapshot_every": 2})
    fit_steps(model, [g], 10, data=data)
    assert_clean(g, sync)
    (e,) = g.events
    assert (e.step, e.kind, g.counters["skipped_steps"]) == (6, "loss", 1) and models.all_finite(model)


class EmptyParameter(Probe):
    """Probe plus a parameter with no elements (a configurable table sized 0, e.g. no extra tokens)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = nn.Parameter(torch.zeros(0, 8))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + self.extra.sum()


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_a_parameter_with_no_elements(fit_steps, sync, norm_type):
    """The fit-start weight scales took the inf-norm of every parameter (an error on an empty one, in every run);
    so did the inf-norm gradient norm (``clip.norm_type: inf``). A healthy run equals the unguarded one; a NaN
    loss is one event."""
    make = lambda nan_at=(): EmptyParameter(lr=0.05, nan_at=nan_at)  # noqa: E731
    pl.seed_everything(0, verbose=False)
    plain = make()
    fit_steps(plain, [], 8, subdir="plain")
    for nan_at in ((), (5,)):
        pl.seed_everything(0, verbose=False)
        model, g = make(nan_at), guard(sync, clip={"norm_type": norm_type})
        fit_steps(model, [g], 8, subdir=f"{sync}{nan_at}")
        assert_clean(g, sync)
        if nan_at:
            (e,) = g.events
            assert (e.step, e.kind) == (5, "loss") and models.all_finite(model)
        else:
            assert g.events == [] and models.same_weights(model, plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused non-finite check over CUDA tensors")
def test_a_parameter_with_no_elements_on_cuda(fit_steps):
    model, g = EmptyParameter(lr=0.05, nan_at=(5,)), NaNGuard(logging={"verbose": False})
    fit_steps(model, [g], 8, accelerator="cuda")
    (e,) = g.events
    assert (e.step, e.kind) == (5, "loss") and models.all_finite(model)


class SquareWithBoxes(models.SquareNet):
    """SquareNet whose batches carry an empty float field (e.g. detection boxes of shape [batch, 0, 4])."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, boxes = batch
        return super().training_step((x, y), batch_idx) + 0.0 * boxes.sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3, fused=True)


@pytest.mark.parametrize("sync", SYNCS)
def test_an_overflow_in_a_batch_with_an_empty_field(fit, sync):
    """The overflow's extreme-feature search took the column abs-max of every batch tensor (an error on one with
    no elements): the overflow is named, with its feature."""
    x, y = models.overflow_data(bad_batch=2).tensors
    model, g = SquareWithBoxes(), guard(sync)
    fit(model, TensorDataset(x, y, torch.zeros(len(x), 0, 4)), [g], batch_size=8, steps=6)
    assert_clean(g, sync)
    (e,) = g.events
    assert (e.step, e.cause) == (2, "overflow")
    assert [(f["field"], f["features"]) for f in e.details["extreme_features"]] == [("batch[0]", [2])]
