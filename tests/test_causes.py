"""Issue 13: seed 001's four causes named from the incident's own evidence, from the first steps, and actions
that follow the cause (LR cuts for learning_rate and exploding_gradient only; initialization stops at once).

Real Trainer runs of the issue's cases, plus the evidence helpers (diagnose/dynamics.py) and the ladder's
policy in isolation.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.config import ClipConfig, RecoveryConfig
from lightning_nanguard.diagnose import dynamics
from lightning_nanguard.core.causes import CAUSES
from lightning_nanguard.recover.ladder import LARGEST_CUT, RecoveryLadder
from .models import GPT, DeepMLP, FeatureSquare, Regression, loader, markov_tokens, regression_data, trainer
from .test_divergence import LossTrace

QUIET = {"verbose": False}

# ------------------------------------------------------------------------------------------------ models


class TooLarge(Regression):
    """An nn.Linear whose weights start 1e20 times too large (finite)."""

    def __init__(self) -> None:
        super().__init__(features=8, lr=0.01)
        with torch.no_grad():
            self.linear.weight.mul_(1e20)


def _mlp_run(tmp_path: Any, divergence: str) -> tuple[NaNGuard, LossTrace]:
    """Unguarded, its gradient norm goes 10, 10, 7, 8, 14, 96, 1.8e3, 1.2e14, then NaN at step 8."""
    pl.seed_everything(7, verbose=False)
    guard, trace = NaNGuard(check={"divergence": divergence}, logging=QUIET), LossTrace()
    trainer(tmp_path, [trace, guard], max_steps=14).fit(DeepMLP(lr=0.035), loader(
        regression_data(n=384, features=16, seed=7)))
    return guard, trace


# ------------------------------------------------------------------------------------- the cases


def test_deep_mlp_whose_gradient_norm_explodes_is_exploding_gradient_not_overflow(tmp_path: Any) -> None:
    """Defaults: caught as a divergence before the NaN; the relative update at the onset was small (the LR was
    sane for the initial weights) and the norm grew geometrically: exploding_gradient; a divergence cuts the
    LR by divergence_lr_factor."""
    guard, trace = _mlp_run(tmp_path, "act")
    first = guard.events[0]
    assert (first.kind, first.cause) == ("divergence", "exploding_gradient")
    assert first.details["divergence"]["rule"] in ("loss_blowup", "grad_norm_growth")
    norms = first.details["divergence"]["grad_norms"]
    assert all(b >= 2 * a for a, b in zip(norms, norms[1:])) and norms[-1] > 1000 * norms[0]
    assert first.details["relative_update"]["relative_update"] < dynamics.RELATIVE_UPDATE_LR
    assert first.details["grad_norm_growth"] == norms[-3:]
    assert first.actions == ["skip_step", "clip", "rollback", "reduce_lr"]
    assert first.details["lr_after"] == [pytest.approx(0.035 * guard.config.recovery.divergence_lr_factor)]
    assert all(math.isfinite(v) for v in trace.losses)  # acted before anything was non-finite


def test_deep_mlp_at_the_first_nan_is_exploding_gradient_with_overflow_as_symptom(tmp_path: Any) -> None:
    """Without the watch the first NaN comes after < 5 healthy steps of history: the activations of the
    replayed forward pass grow layer by layer until they overflow."""
    guard, _ = _mlp_run(tmp_path, "off")
    first = guard.events[0]
    assert first.kind == "loss" and first.cause == "exploding_gradient"
    assert first.details["symptom"] == "overflow"  # the replay found where: beyond float32's max
    acts = first.details["activation_growth"]
    assert len(acts["layers"]) >= dynamics.ACTIVATION_CHAIN and acts["abs_max"][-1] > 1e3 * acts["abs_max"][0]
    assert all(layer.startswith("net.") for layer in acts["layers"])
    assert "reduce_lr" in first.actions and "normalisation" in first.suggestion


def test_weights_1e20_too_large_are_initialization_and_stop_at_once(tmp_path: Any) -> None:
    """Named with its scale against 1/sqrt(fan_in); no LR cut, no rollback cycle: one event, then stop."""
    guard = NaNGuard(logging=QUIET)
    t = trainer(tmp_path, [guard], max_epochs=2)
    model = TooLarge()
    t.fit(model, loader(regression_data(n=256, features=8)))
    (event,) = guard.events
    assert (event.cause, event.culprit, event.actions) == ("initialization", "linear.weight", ["skip_step", "stop"])
    init = event.details["initialization"]
    assert init["fan_in"] == 8 and init["expected_scale"] == pytest.approx(8 ** -0.5)
    rms = float(model.linear.weight.detach().double().pow(2).mean().sqrt())  # restored: the weights at fit start
    assert init["ratio"] > 1e18 and init["scale"] == pytest.approx(rms, rel=1e-5)
    # at fit start the 2-norm overflowed float32: the abs-max stands in for it (a lower bound, no float64 copy)
    assert dynamics.INIT_RATIO * init["expected_scale"] < init["scale_at_fit_start"] <= init["scale"]
    assert "linear.weight" in event.suggestion and "fan_in=8" in event.suggestion
    assert guard.stopped and t.global_step <= 1 and guard.lr_scale == 1.0 and guard.counters["lr_cuts"] == 0


@pytest.mark.parametrize("divergence", ["act", "off"])
def test_tiny_gpt2_with_sgd_at_lr_100_is_learning_rate_not_precision(tmp_path: Any, divergence: str) -> None:
    """The first step already moves the weights by several times their size: learning_rate (the history is the
    same as an exploding gradient's: 0.5, 16, 1300, ... ; the relative update at the onset tells them apart).
    Defaults act on the growing loss before any value is non-finite."""
    guard = NaNGuard(check={"divergence": divergence}, logging=QUIET)
    trainer(tmp_path, [guard], max_steps=8).fit(GPT(lr=100.0, optimizer="sgd"),
                                                DataLoader(markov_tokens(n=128), batch_size=16))
    first = guard.events[0]
    assert first.cause == "learning_rate"
    rel = first.details["relative_update"]
    assert rel["optimizer"] == "sgd" and rel["reference_step"] == 0 and rel["relative_update"] > 1
    # the gradient norm grows ~50-100x per step: the edge of stability is near 100 x 2 / (r + 1), and the cut
    # goes EDGE_MARGIN below it, further than divergence_lr_factor and the relative update's safe LR
    assert rel["edge_lr"] == pytest.approx(dynamics.edge_lr(100.0, rel["grad_norm_growth"]))
    assert rel["safe_lr"] == pytest.approx(rel["edge_lr"] / dynamics.EDGE_MARGIN)
    assert rel["safe_lr"] < 100.0 / rel["relative_update"]
    assert first.details["lr_after"] == [pytest.approx(rel["safe_lr"])]
    assert rel["safe_lr"] < 100.0 * guard.config.recovery.divergence_lr_factor
    assert f"edge of stability near {rel['edge_lr']:.3g}" in first.suggestion
    assert f"about {rel['safe_lr']:.3g} or below" in first.suggestion
    if divergence == "act":
        norms = first.details["divergence"]["grad_norms"]
        ratios = sorted(b / a for a, b in zip(norms, norms[1:]))
        assert rel["grad_norm_growth"] == pytest.approx(ratios[(len(ratios) - 1) // 2])
        assert first.kind == "divergence" and first.details["divergence"]["rule"] == "loss_growth"
    else:  # the first non-finite value: the gradient norm overflows float32 at step 4 (the loss is ~1e9)
        assert (first.kind, first.step) == ("gradient", 4) and math.isinf(first.details["grad_norm"])


def test_data_overflow_names_the_feature_and_never_cuts_the_lr(tmp_path: Any) -> None:
    """Seed 000's case: an un-normalised feature overflows float32; the data is the cause, so the guard skips,
    rolls back and gives up without touching the LR."""
    x, y = (t.clone() for t in regression_data(n=64, features=8).tensors)
    x[:, 5] = 1e20 * (1 + torch.rand(64))
    guard = NaNGuard(recovery={"max_skips": 1, "max_rollbacks": 1}, anomaly={"max_replays": 2}, logging=QUIET)
    t = trainer(tmp_path, [guard], max_epochs=4)
    t.fit(FeatureSquare(identity=True), DataLoader(TensorDataset(x, y), batch_size=16))
    assert guard.events and all(e.cause == "overflow" for e in guard.events)
    assert guard.events[0].details["extreme_features"][0]["features"] == [5]
    assert "feature(s) [5]" in guard.events[0].suggestion
    assert not any("reduce_lr" in e.actions for e in guard.events) and guard.lr_scale == 1.0
    assert "rollback" in guard.events[1].actions and guard.events[-1].actions[-1] == "stop"
    cfg = guard.config.recovery
    assert len(guard.events) == (cfg.max_skips + 1) * (cfg.max_rollbacks + 1)  # every step is an incident


def test_nan_in_the_data_is_input_and_leaves_the_lr_alone(tmp_path: Any) -> None:
    x, y = (t.clone() for t in regression_data(n=256, features=8).tensors)
    x[[40, 41, 130], 3] = float("nan")
    guard = NaNGuard(logging=QUIET)
    trainer(tmp_path, [guard], max_epochs=2).fit(Regression(), loader(TensorDataset(x, y)))
    assert [(e.step % 8, e.kind, e.cause, e.actions) for e in guard.events] == [
        (1, "input", "input", ["skip_step"]), (4, "input", "input", ["skip_step"])] * 2
    assert guard.lr_scale == 1.0 and guard.counters["rollbacks"] == 0


# ----------------------------------------------------------------------------------- evidence helpers


def test_expected_scale_is_one_over_sqrt_fan_in_and_brackets_the_usual_inits() -> None:
    assert dynamics.expected_scale((64, 16)) == 0.25 and dynamics.expected_scale((8, 4, 3, 3)) == 1 / 6
    assert dynamics.expected_scale((16,)) is None
    w = torch.empty(256, 64)
    for init, low, high in ((nn.init.xavier_uniform_, 0.5, 1.5), (nn.init.kaiming_normal_, 1.2, 1.6),
                            (lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)), 0.5, 0.65)):
        init(w)
        ratio = float(w.pow(2).mean().sqrt()) / dynamics.expected_scale(w.shape)
        assert low < ratio < high  # the usual schemes sit within a small factor of it, far from INIT_RATIO


def test_oversized_needs_the_scale_at_fit_start_and_now() -> None:
    net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    scales = dynamics.InitialScales()
    scales.record(net)
    assert dynamics.oversized(net, scales.read()) is None
    with torch.no_grad():
        net[1].weight.mul_(1e6)  # grew during training (not at fit start): not initialization
    assert dynamics.oversized(net, scales.read()) is None
    scales.record(net)
    found = dynamics.oversized(net, scales.read())
    assert found is not None and found["parameter"] == "1.weight" and found["fan_in"] == 16
    assert found["ratio"] == pytest.approx(float(net[1].weight.detach().pow(2).mean().sqrt()) * 4)


def test_relative_update_for_sgd_and_adaptive_optimizers() -> None:
    net = nn.Linear(100, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(0.1)  # norm 1.0
    sgd = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    found = dynamics.relative_update([sgd], net, grad_norm=2.0)
    assert found["optimizer"] == "sgd" and found["relative_update"] == pytest.approx(0.5 * 2.0 / 0.1)
    assert found["safe_lr"] == pytest.approx(0.5 / found["relative_update"])
    adam = torch.optim.Adam(net.parameters(), lr=0.5)
    found = dynamics.relative_update([adam], net, grad_norm=math.nan)
    assert found["optimizer"] == "adaptive" and found["relative_update"] == pytest.approx(0.5 * 10 / 1.0)
    assert found["safe_lr"] == pytest.approx(0.5 * dynamics.SAFE_RELATIVE_UPDATE["adaptive"] / 5.0)
    # a reference (the weights at the onset) replaces the current ones
    found = dynamics.relative_update([adam], net, math.nan, reference={"weight": 10.0}, reference_step=3)
    assert found["relative_update"] == pytest.approx(0.5) and found["reference_step"] == 3


def test_a_gradient_norm_growing_r_fold_per_step_places_the_edge_of_stability() -> None:
    """SGD diverging r-fold per step means lr x curvature = r + 1 + momentum; the edge is lr x curvature =
    2 (1 + momentum). A cut sized from it aims EDGE_MARGIN below the edge when that is below the relative
    update's safe LR; adaptive optimizers (no such relation) ignore the growth."""
    assert dynamics.edge_lr(100.0, 49.0) == pytest.approx(100.0 * 2 / 50)
    assert dynamics.edge_lr(1.0, 4.0, momentum=0.9) == pytest.approx(2 * 1.9 / 5.9)
    net = nn.Linear(100, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(0.1)  # norm 1.0
    sgd = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    found = dynamics.relative_update([sgd], net, grad_norm=2.0, growth=60.0)
    edge = 0.5 * 2 * 1.9 / (60.0 + 1.9)
    assert found["grad_norm_growth"] == 60.0 and found["edge_lr"] == pytest.approx(edge)
    assert found["safe_lr"] == pytest.approx(edge / dynamics.EDGE_MARGIN) and found["safe_lr"] < 0.5 / 10.0
    slow = dynamics.relative_update([sgd], net, grad_norm=2.0, growth=2.5)  # the relative update asks for more
    assert slow["safe_lr"] == pytest.approx(0.5 / 10.0) and slow["safe_lr"] < slow["edge_lr"] / dynamics.EDGE_MARGIN
    adam = dynamics.relative_update([torch.optim.Adam(net.parameters(), lr=0.5)], net, math.nan, growth=60.0)
    assert "edge_lr" not in adam
    assert adam["safe_lr"] == pytest.approx(0.5 * dynamics.SAFE_RELATIVE_UPDATE["adaptive"] / 5)


def test_growth_rate_is_the_median_ratio_of_the_final_growth_run() -> None:
    """The first ratio of a run is low (the gradient is not yet along the unstable direction), the last
    non-linear: the median stands for the run; a run shorter than two ratios, or one broken by a non-finite
    value, gives none."""
    assert dynamics.growth_rate([5.0, 4.0, 0.5, 20.0, 1600.0, 1.6e9]) == pytest.approx(80.0)  # 40, 80, 1e6
    assert dynamics.growth_rate([0.5, 20.0, 1600.0]) == pytest.approx(40.0)  # even count: the lower one
    assert dynamics.growth_rate([1.0, 3.0]) is None and dynamics.growth_rate([9.0, 1.0, 3.0]) is None
    assert dynamics.growth_rate([1.0, 3.0, 9.0, math.inf]) is None
    assert dynamics.growth_rate([1.0, 1.5, 2.2, 3.3]) is None  # growing, but never 2-fold in a step


def test_the_edge_estimate_matches_the_curvature_of_a_quadratic(tmp_path: Any) -> None:
    """Full-batch SGD on least squares is a quadratic with the largest curvature lam = top eigenvalue of
    2 X^T X / n: the edge of stability 2 (1 + momentum) / lam is known. Diverging at 6x to 30x it, the estimate
    from the gradient norm's growth lands within 25% of it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    data = TensorDataset(x, x @ torch.randn(8, 1, generator=g))
    design = torch.cat([x, torch.ones(256, 1)], 1)  # the bias is a weight on a constant feature
    lam = float(torch.linalg.eigvalsh(2 * design.T @ design / 256).max())

    class Momentum(Regression):
        def __init__(self, lr: float, momentum: float) -> None:
            super().__init__(lr=lr)
            self.momentum = momentum

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    for times, momentum in ((6.0, 0.0), (30.0, 0.0), (12.0, 0.9)):
        pl.seed_everything(0, verbose=False)
        guard = NaNGuard(check={"divergence": "warn"}, logging=QUIET)
        trainer(tmp_path / f"{times}-{momentum}", [guard], max_steps=6, max_epochs=6).fit(
            Momentum(times / lam, momentum), DataLoader(data, batch_size=256))
        (event,) = guard.events
        rel = event.details["relative_update"]
        assert event.kind == "divergence" and rel["grad_norm_growth"] + 1 + momentum == pytest.approx(times, rel=0.25)
        assert rel["edge_lr"] == pytest.approx(2 * (1 + momentum) / lam, rel=0.25)


def test_layer_growth_needs_gradients_growing_towards_the_input() -> None:
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    for i, layer in enumerate(net):
        layer.weight.grad = torch.full_like(layer.weight, 10.0 ** (5 - i))  # 1e5 at the input ... 1 at the output
    found = dynamics.layer_growth(net)
    assert found is not None and found["input_side_over_output_side"] == pytest.approx(1e5)
    for i, layer in enumerate(net):
        layer.weight.grad = torch.full_like(layer.weight, 10.0 ** i)  # growing towards the output: not this
    assert dynamics.layer_growth(net) is None


def test_short_growth_and_onset() -> None:
    assert dynamics.short_growth([3.0, 7.0, 14.0]) == [3.0, 7.0, 14.0]
    assert dynamics.short_growth([3.0, 7.0, 13.0]) is None and dynamics.short_growth([7.0]) is None
    assert dynamics.growth_onset([5.0, 4.0, 3.0, 7.0, 14.0, 109.0]) == 2
    assert dynamics.growth_onset([5.0, 4.0]) == 1


# ------------------------------------------------------------------------------------------- the ladder


def _ladder(**recovery: Any) -> RecoveryLadder:
    return RecoveryLadder(RecoveryConfig(**recovery), ClipConfig())


@pytest.mark.parametrize("cause", [c.name for c in CAUSES.values() if c.lr_cut == "never"])
def test_causes_a_smaller_lr_cannot_fix_never_cut_it(cause: str) -> None:
    ladder = _ladder(max_skips=1, max_rollbacks=5, reduce_lr_after=1)
    plans = [ladder.incident(s, "loss", can_roll_back=True, cause=cause) for s in range(6)]
    assert not any(p.reduce_lr for p in plans)
    if CAUSES[cause].gives_up:  # the weights were wrong before the first step: give up at once
        assert cause == "initialization"
        assert plans[0].give_up and not plans[0].rollback and not plans[0].arm_clip
    else:  # back to back, every incident counts (a fault that came back on the next step was no one-off)
        assert any(p.rollback for p in plans)
    if not CAUSES[cause].counts_toward_rollback:  # isolated, a fault that does not come back is skipped, nothing else
        assert cause == "transient"
        isolated = _ladder(max_skips=1, max_rollbacks=5, reduce_lr_after=1)
        plans = []
        for s in range(6):
            plans.append(isolated.incident(s, "loss", can_roll_back=True, cause=cause))
            isolated.healthy()
        assert not any(p.rollback or p.arm_clip or p.skip_batches or p.give_up or p.reduce_lr for p in plans)
        assert all(p.reasons == ("the cause (transient) calls for skipping the step and nothing else",) for p in plans)


@pytest.mark.parametrize("cause, safe_factor", [("exploding_gradient", 0.02), ("learning_rate", 0.5)])
def test_lr_causes_cut_at_the_first_incident_and_on_rollback(cause: str, safe_factor: float) -> None:
    ladder = _ladder(max_skips=2)
    plans = [ladder.incident(s, "loss", can_roll_back=True, cause=cause, safe_factor=safe_factor) for s in range(3)]
    assert [(p.reduce_lr, p.rollback) for p in plans] == [(True, False), (False, False), (True, True)]
    cfg = RecoveryConfig()  # a NaN after exploding gradients may be a one-off outlier: recovery.lr_factor
    expected = cfg.divergence_lr_factor if cause == "learning_rate" else None  # (0.5 would cut less)
    assert plans[0].lr_factor == expected


def test_a_cut_to_the_safe_lr_is_not_repeated_by_the_first_rollback_of_its_episode() -> None:
    """learning_rate with a safe LR below divergence_lr_factor's: the cut goes there; the rollback that follows
    undoes the weights that grew before it and does not cut again. An incident after the rollback is new
    evidence (the first of a new run: it cuts), and a confirming snapshot ends the episode: without a sized cut
    in it, a rollback cuts by divergence_lr_factor."""
    ladder = _ladder(max_skips=1, max_rollbacks=5)
    plans = [ladder.incident(s, "loss", can_roll_back=True, cause="learning_rate", safe_factor=0.02)
             for s in range(4)]
    assert [(p.reduce_lr, p.rollback) for p in plans] == [(True, False), (False, True), (True, False), (False, True)]
    assert plans[0].lr_factor == plans[2].lr_factor == 0.02
    assert all(any("safe LR" in r for r in p.reasons) for p in (plans[1], plans[3]))
    ladder.snapshot_taken()
    plans = [ladder.incident(s, "loss", can_roll_back=True, cause="learning_rate", safe_factor=1.0)
             for s in range(10, 12)]
    assert [(p.reduce_lr, p.rollback) for p in plans] == [(True, False), (True, True)]
    assert plans[1].lr_factor == RecoveryConfig().divergence_lr_factor


def test_a_divergence_rolls_back_and_cuts_at_once_and_the_cut_is_bounded() -> None:
    ladder = _ladder()
    plan = ladder.incident(3, "divergence", can_roll_back=True, cause="learning_rate", safe_factor=1e-9)
    assert plan.rollback and plan.reduce_lr and plan.lr_factor == LARGEST_CUT
    plan = _ladder().incident(3, "divergence", can_roll_back=True, cause="unknown", safe_factor=1e-9)
    assert plan.rollback and plan.reduce_lr and plan.lr_factor == RecoveryConfig().divergence_lr_factor
    plan = _ladder().incident(3, "divergence", can_roll_back=True, cause="overflow")
    assert plan.rollback and not plan.reduce_lr
