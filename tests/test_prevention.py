"""Prevention: gradient clipping (fixed, z-score adaptive, unit-wise AGC) and loss-spike detection, alone and in
a real Trainer."""

from __future__ import annotations

import json
import math
import random
import statistics
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_nanguard import NaNGuard
from lightning_nanguard.detect.spikes import SHIFT_SPIKES, SHIFT_WINDOW, SPIKE_PATIENCE, RunningStats, SpikeDetector
from lightning_nanguard.diagnose.rules import spike_cause
from lightning_nanguard.respond.incident import SPIKES_BEFORE_LR_CUT
from lightning_nanguard.recover.clipping import CLIPS_BEFORE_LR_CUT, ZClip, adaptive_grad_clip_, unitwise_norms
from lightning_nanguard.testing import Fault, FaultInjector
from . import models
from .models import Classifier, Regression, classification_data, regression_data, same_weights


# ------------------------------------------------------------------------------------------ statistics


def test_running_stats_exact_during_warmup_then_ema() -> None:
    values = [3.0, 1.0, 4.0, 1.0, 5.0]
    s = RunningStats(alpha=0.9, warmup=5)
    for i, v in enumerate(values, 1):
        s.update(v)
        assert s.mean == pytest.approx(statistics.fmean(values[:i]))
        assert s.var == pytest.approx(statistics.pvariance(values[:i]))
    assert s.ready
    mean, var = s.mean, s.var
    s.update(10.0)  # EMA from here: mean' = a*mean + (1-a)*x, var' = a*(var + (1-a)*delta^2)
    assert s.mean == pytest.approx(0.9 * mean + 0.1 * 10.0)
    assert s.var == pytest.approx(0.9 * (var + 0.1 * (10.0 - mean) ** 2))
    s.update(float("nan"))
    s.update(float("inf"))
    assert s.count == 6 and math.isfinite(s.mean)


def test_running_stats_state_dict_round_trip() -> None:
    s = RunningStats(0.97, 3)
    for v in (1.0, 2.0, 4.0, 8.0):
        s.update(v)
    t = RunningStats(0.97, 3)
    t.load_state_dict(s.state_dict())
    for x in (3.0, 5.0):
        s.update(x)
        t.update(x)
    assert t.state_dict() == s.state_dict()
    with pytest.raises(ValueError, match="alpha"):
        RunningStats(alpha=1.0)


def test_zclip_warmup_threshold_and_clipped_update() -> None:
    z = ZClip(z_threshold=2.5, alpha=0.97, warmup_steps=10)
    rng = random.Random(0)
    norms = [1.0 + 0.1 * rng.gauss(0, 1) for _ in range(10)]
    for n in norms[:-1]:
        z.update(n)
        assert z.threshold() is None and z.zscore(n) is None  # warm-up: never clips
    z.update(norms[-1])
    expected = statistics.fmean(norms) + 2.5 * statistics.pstdev(norms)
    assert z.threshold() == pytest.approx(expected)

    # an outlier is folded in at the threshold, not at its own value: the threshold barely moves
    before_mean, limit = z.stats.mean, z.threshold()
    assert z.update(1000.0) == pytest.approx(limit)
    assert z.stats.mean == pytest.approx(0.97 * before_mean + 0.03 * limit)
    assert z.threshold() < 2.0
    state = z.state_dict()
    other = ZClip(2.5, 0.97, 10)
    other.load_state_dict(state)
    assert other.threshold() == z.threshold()


def test_spike_detector_warmup_threshold_and_one_sidedness() -> None:
    rng = random.Random(1)
    d = SpikeDetector(z_threshold=6.0, warmup=50)
    assert d.observe(1e9) is None  # nothing is a spike during the warm-up
    for _ in range(49):
        assert d.observe(2.0 + 0.1 * rng.gauss(0, 1)) is None
    assert d.stats.ready
    # normal noise never fires: 20k draws at z=6
    fired = [d.observe(2.0 + 0.1 * rng.gauss(0, 1)) for _ in range(20000)]
    assert all(f is None for f in fired)
    mean, std, state = d.stats.mean, d.stats.std, d.state_dict()
    # the spread: the std, or half the highest recent excess over the mean (a Gaussian's is ~3.3 std)
    assert 2.8 * std < d.peak < 4.5 * std and d.spread() == 0.5 * d.peak
    assert d.observe(mean - 50 * std) is None  # a falling loss is never a spike
    d.load_state_dict(state)
    spread = d.spread()
    assert d.observe(mean + 5.9 * spread) is None
    d.load_state_dict(state)
    z = d.observe(mean + 60 * std)
    assert z is not None and z == pytest.approx(60 * std / spread)
    # the spike is folded in capped at the threshold: the baseline hardly moves, the next spike is still seen
    assert d.stats.mean < mean + 0.02 * 6 * spread + 1e-9 and d.peak == pytest.approx(6 * spread)
    assert d.observe(mean + 60 * std) is not None


def test_spike_detector_learns_a_heavy_tail() -> None:
    """Per-batch losses of 4 samples (a chi-square of 4 dof: right-skewed) plus a batch at 12x the mean once every
    64 steps (a hard batch every epoch): the Gaussian z-test on their EMA fired on it every epoch (314 times); the
    peak of the recent losses widens the spread instead: only its first sighting, with nothing like it before, is a
    spike. A loss 30x the recent peak is still one."""
    rng = random.Random(2)
    d = SpikeDetector(z_threshold=6.0, warmup=50)
    fired = []
    for step in range(20000):
        loss = 0.1 * (48.0 if step % 64 == 63 else sum(rng.gauss(0, 1) ** 2 for _ in range(4)))
        fired += [step] if d.observe(loss) is not None else []
    assert fired == [63]
    assert d.peak > 3.0 and d.spread() == 0.5 * d.peak > 2 * d.stats.std  # the tail, not the std, decides
    assert d.observe(30 * d.peak) is not None


def test_spike_detector_relative_floor_on_a_constant_loss() -> None:
    d = SpikeDetector(z_threshold=6.0, warmup=5)
    for _ in range(5):
        d.observe(1.0)
    assert d.observe(1.005) is None  # std is 0: the floor (1% of the mean) keeps a wobble quiet
    assert d.observe(2.0) is not None


# ------------------------------------------------------------------------------------------------ AGC


def _timm_agc(params: list[nn.Parameter], clip_factor: float, eps: float = 1e-3) -> None:
    """Reference: timm.utils.agc.adaptive_clip_grad, one tensor at a time."""
    def unitwise(x: torch.Tensor) -> torch.Tensor:
        return x.norm(2) if x.ndim <= 1 else x.norm(2, dim=tuple(range(1, x.ndim)), keepdim=True)

    for p in params:
        g = p.grad.detach()
        max_norm = unitwise(p.detach()).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise(g)
        g.copy_(torch.where(grad_norm < max_norm, g, g * (max_norm / grad_norm.clamp(min=1e-6))))


def test_agc_matches_reference_and_leaves_units_within_bound_unchanged() -> None:
    torch.manual_seed(0)
    shapes = [(16, 8), (16,), (4, 3, 3, 3), (), (32, 5)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    for i, p in enumerate(params):
        p.grad = torch.randn_like(p) * (0.001 if i % 2 else 1.0)  # some units within the bound, some above
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(reference, params):
        r.grad = p.grad.clone()
    original = [p.grad.clone() for p in params]
    no_grad = nn.Parameter(torch.randn(3))

    adaptive_grad_clip_(params + [no_grad], clip_factor=0.05)
    _timm_agc(reference, clip_factor=0.05)
    for p, r, g0 in zip(params, reference, original):
        assert torch.equal(p.grad, r.grad)
        bound = (unitwise_norms([p.detach()])[0].clamp(min=1e-3) * 0.05).reshape(-1)
        assert bool((unitwise_norms([p.grad])[0].reshape(-1) <= bound * (1 + 1e-5)).all())
        within = unitwise_norms([g0])[0].reshape(-1) < bound  # these units are left bitwise unchanged
        same = (p.grad == g0).reshape(within.numel(), -1).all(1)
        assert bool(same[within].all()) and not bool(same[~within].any())
    assert no_grad.grad is None
    assert any(not torch.equal(p.grad, g0) for p, g0 in zip(params, original))


# ------------------------------------------------------------------------------------- real Trainer runs


class SpikyRegression(Regression):
    """nn.Linear + SGD whose loss spikes once, at optimizer step ``at``.

    ``mode="input"``: the batch is scaled x1000 (a bad batch: loss and gradient explode, finite).
    ``mode="offset"``: 1000 is added to the loss value (the gradient is unchanged).
    """

    def __init__(self, at: int, mode: str, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.at, self.mode = at, mode

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hit = self.global_step == self.at
        if hit and self.mode == "input":
            x = x * 1000.0
        loss = nn.functional.mse_loss(self(x), y)
        return loss + 1000.0 if hit and self.mode == "offset" else loss


def test_bad_batch_spike_is_one_event_and_skipped(tmp_path: Any, fit: Any) -> None:
    guard = NaNGuard(check={"spike_action": "skip_step", "spike_warmup": 20})
    model = SpikyRegression(at=30, mode="input")
    fit(model, regression_data(), [guard], shuffle=True, max_epochs=3)
    assert [e.kind for e in guard.events] == ["spike"]
    event = guard.events[0]
    assert event.step == 30 and event.actions == ["skip_step"]
    assert event.details["loss_zscore"] > 6 and event.details["loss"] > 1e3
    # its gradient norm is an outlier too, but one hard or bad batch is not growth: no exploding_gradient; on
    # weights whose loss was healthy a step before, the batch is the data's fault (issue 41)
    assert event.cause == "input" and event.details["grad_norm_zscore"] > 100
    assert event.details["spike_after_healthy"] is True and "batch" in event.suggestion
    assert "grad_norm_growth" not in event.details and "grad_norm_trend" not in event.details
    assert guard.counters["spikes"] == 1 and guard.counters["incidents"] == 0
    assert guard.counters["skipped_steps"] == 1
    lines = (tmp_path / "nanguard" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["spike"]
    x, y = regression_data().tensors
    assert float(nn.functional.mse_loss(model(x).detach(), y)) < 0.05  # the x1000 step never reached the weights


class GrowingGradient(SpikyRegression):
    """A parameter ``extra`` whose gradient (not the loss value) grows 4-fold at each of optimizer steps 27-30; at
    step 30 the loss also jumps by 1000: a spike at the end of a growth across steps."""

    def __init__(self, at: int, mode: str) -> None:
        super().__init__(at, mode)
        self.extra = nn.Parameter(torch.zeros(()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        k = 4.0 ** (self.global_step - 26) if 27 <= self.global_step <= 30 else 0.0
        return loss + k * (self.extra - self.extra.detach())  # the same value; d(loss)/d(extra) = k


def test_spike_after_gradient_growth_is_exploding_gradient(fit: Any) -> None:
    """exploding_gradient means growth: the gradient norm rose check.divergence_growth-fold at each of the last
    check.divergence_steps steps up to the spike. (The divergence watch, off here, calls the same growth and the
    loss's jump a divergence.)"""
    guard = NaNGuard(check={"spike_warmup": 20, "divergence": "off"})
    fit(GrowingGradient(at=30, mode="offset"), regression_data(), [guard], shuffle=True, max_epochs=3)
    assert [(e.kind, e.step, e.cause) for e in guard.events] == [("spike", 30, "exploding_gradient")]
    tail = guard.events[0].details["grad_norm_growth"]
    assert len(tail) == 4 and all(b >= 2 * a for a, b in zip(tail, tail[1:]))


def test_spike_cause_needs_growth_across_steps() -> None:
    flat = [1.0, 1.2, 0.9, 1.1] * 10
    assert spike_cause(1000.0, flat, 2.0, 3) == ("unknown", {})  # one large norm: a hard batch
    assert spike_cause(4.0, flat + [1.0, 2.0], 2.0, 3) == ("unknown", {})  # two 2x rises: not three
    assert spike_cause(8.0, flat + [1.0, 2.0, 4.0], 2.0, 3) == ("exploding_gradient",
                                                               {"grad_norm_growth": [1.0, 2.0, 4.0, 8.0]})
    assert spike_cause(8.0, flat + [1.0, 2.0, 4.0], 2.0, 4)[0] == "unknown"  # check.divergence_steps: 4
    cause, evidence = spike_cause(1.0, flat + [30.0, 25.0, 40.0, 35.0, 30.0], 2.0, 3)  # a sustained rise before
    assert cause == "exploding_gradient" and evidence["grad_norm_trend"]["recent_mean"] == 32.0
    assert spike_cause(0.0, [], 2.0, 3) == ("unknown", {})  # no norm (check.gradients off), no history
    # on weights whose loss was healthy a step before: a bad batch, unless the gradients grew
    assert spike_cause(1000.0, flat, 2.0, 3, after_healthy=True) == ("input", {"spike_after_healthy": True})
    assert spike_cause(8.0, flat + [1.0, 2.0, 4.0], 2.0, 3, after_healthy=True)[0] == "exploding_gradient"


def test_unguarded_bad_batch_wrecks_the_same_run(fit: Any) -> None:
    """The control for the test above: without the skip the x1000 batch ruins the weights."""
    model = SpikyRegression(at=30, mode="input")
    fit(model, regression_data(), shuffle=True, max_epochs=3)
    x, y = regression_data().tensors
    loss = float(nn.functional.mse_loss(model(x).detach(), y))
    assert not math.isfinite(loss) or loss > 1.0


def test_warn_spike_records_but_changes_nothing(fit: Any) -> None:
    import pytorch_lightning as pl

    pl.seed_everything(0, verbose=False)
    plain = SpikyRegression(at=30, mode="offset")
    fit(plain, regression_data(), subdir="plain", shuffle=True, max_epochs=3)
    pl.seed_everything(0, verbose=False)
    guarded = SpikyRegression(at=30, mode="offset")
    guard = NaNGuard(check={"spike_action": "warn", "spike_warmup": 20})
    fit(guarded, regression_data(), [guard], subdir="guarded", shuffle=True, max_epochs=3)
    assert [(e.kind, e.step, e.actions) for e in guard.events] == [("spike", 30, ["warn"])]
    # the gradient was normal, only the loss value jumped, on weights whose loss was healthy a step before: the data
    assert guard.events[0].cause == "input"
    assert same_weights(plain, guarded)


def test_reduce_lr_spike_cuts_the_lr_without_climbing_the_ladder(fit: Any) -> None:
    guard = NaNGuard(check={"spike_action": "reduce_lr", "spike_warmup": 20}, recovery={"lr_factor": 0.25})
    model = SpikyRegression(at=30, mode="offset")
    tr = fit(model, regression_data(), [guard], shuffle=True, max_epochs=3)
    assert [(e.kind, e.actions) for e in guard.events] == [("spike", ["reduce_lr"])]
    event = guard.events[0]
    assert event.details["lr_before"] == [0.05] and event.details["lr_after"] == [pytest.approx(0.0125)]
    assert tr.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0125)
    assert guard.lr_scale == 0.25 and guard.counters["lr_cuts"] == 1
    assert guard.counters["incidents"] == 0 and guard.state_dict()["recovery"]["ladder"]["consecutive"] == 0
    assert not guard.state_dict()["clipper"]["armed"]


def test_clip_spike_clips_the_step_to_the_typical_norm_and_arms_adaptive_clipping(fit: Any) -> None:
    import pytorch_lightning as pl

    seen: list[float] = []

    class Probe(pl.Callback):  # runs after the guard in on_before_optimizer_step: sees the clipped grads
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == 30:
                grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
                seen.append(float(torch.nn.utils.get_total_norm(grads)))

    guard = NaNGuard(check={"spike_action": "clip", "spike_warmup": 20})
    model = SpikyRegression(at=30, mode="input")
    fit(model, regression_data(), [guard, Probe()], shuffle=True, max_epochs=3)
    spikes = [e for e in guard.events if e.kind == "spike"]
    assert spikes and spikes[0].step == 30 and spikes[0].actions == ["clip"]
    assert seen == [pytest.approx(spikes[0].details["clip_to"], rel=1e-4)]
    assert spikes[0].details["clip_to"] < spikes[0].details["grad_norm"] / 100
    assert guard.state_dict()["clipper"]["armed"] and guard.counters["clipped_steps"] >= 1
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_agc_in_a_trainer_bounds_every_unit(fit: Any) -> None:
    import pytorch_lightning as pl

    worst: list[float] = []

    class Probe(pl.Callback):  # after the guard: every unit's gradient within 0.01 * its weight norm
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            for p in pl_module.parameters():
                bound = unitwise_norms([p.detach()])[0].clamp(min=1e-3) * 0.01
                worst.append(float((unitwise_norms([p.grad])[0] / bound).max()))

    guard = NaNGuard(clip={"agc_clip_factor": 0.01})
    model = Classifier()
    fit(model, classification_data(), [guard, Probe()], shuffle=True, max_epochs=1)
    assert len(worst) == 16 * 6 and max(worst) <= 1 + 1e-5 and max(worst) > 0.99  # clipping was active
    assert guard.events == []
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_agc_clips_a_zero_initialised_layer_to_its_eps_floor_not_to_nothing(fit: Any) -> None:
    """docs/recovery.md (AGC): every unit keeps ||g_row|| <= factor * max(||w_row||, 1e-3). The output layer starts
    at zero weights: at the first step each of its units' gradients is clipped to exactly 0.01 * 1e-3, so it
    still learns."""
    seen: list[torch.Tensor] = []

    class Probe(pl.Callback):  # after the guard: the gradient the optimizer will apply
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == 0:
                head = pl_module.net[-1].weight
                seen.append(unitwise_norms([head.grad])[0].flatten().clone())
                seen.append(unitwise_norms([head.detach()])[0].flatten().clone())

    model = Classifier(dropout=0.0)
    with torch.no_grad():
        model.net[-1].weight.zero_()
    fit(model, classification_data(n=64), [NaNGuard(clip={"agc_clip_factor": 0.01}), Probe()], max_steps=1)
    grads, weights = seen
    assert torch.equal(weights, torch.zeros_like(weights))
    assert torch.allclose(grads, torch.full_like(grads, 0.01 * 1e-3), rtol=1e-4, atol=0.0)  # the floor, for every unit
    assert bool((model.net[-1].weight != 0).any())  # and the layer moved off zero


def test_adaptive_always_clips_after_warmup_at_the_threshold_and_cuts_lr_when_it_never_stops(fit: Any) -> None:
    import pytorch_lightning as pl

    steps: list[tuple[int, float, float, Any]] = []  # (step, norm before, norm after, threshold used)

    class Probe(pl.Callback):  # after the guard: the gradient the optimizer will apply
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            used = guard.state_dict()["clipper"]["zclip"]
            last_norm = guard.state_dict()["clipper"]["last_norm"]
            steps.append((trainer.global_step, last_norm, float(torch.nn.utils.get_total_norm(grads)), used))

    # the divergence watch (issue 13) would act at step 3, long before clipping warms up: this pins clipping alone
    guard = NaNGuard(clip={"adaptive": "always", "warmup_steps": 10},
                     check={"spike_action": "off", "divergence": "off"})
    model = Regression(lr=1.5)  # past the SGD stability edge: the norms grow until clipping holds them
    tr = fit(model, regression_data(), [guard, Probe()], shuffle=True, max_epochs=2)
    clipped = [(s, before, after) for s, before, after, _ in steps if after < before * (1 - 1e-6)]
    assert clipped, "adaptive clipping never acted"
    assert all(s >= 10 for s, _, _ in clipped)  # never during the warm-up
    assert guard.counters["clipped_steps"] == len(clipped)
    # every step from the warm-up on needed clipping: a divergence that clipping only slows, so after
    # CLIPS_BEFORE_LR_CUT consecutive clips the step is skipped, the weights go back to the last snapshot and
    # the LR is cut, before any NaN (a "spike" event: abnormal, still finite)
    assert [s for s, _, _ in clipped[:CLIPS_BEFORE_LR_CUT]] == list(range(10, 10 + CLIPS_BEFORE_LR_CUT))
    assert [(e.kind, e.step, e.actions) for e in guard.events] == [
        ("spike", 9 + CLIPS_BEFORE_LR_CUT, ["clip", "skip_step", "rollback", "reduce_lr"])]
    assert guard.events[0].details["restored_step"] == 0 and guard.counters["incidents"] == 0
    assert guard.lr_scale == 0.5 and tr.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.75)
    # the clipped norm is the z-threshold of the statistics before the step: mean + 2.5 std of clipped norms
    replay = ZClip(2.5, 0.97, 10)
    cut = guard.events[0].step
    assert [after for s, _, after, _ in steps if s == cut] == [0.0]  # skipped: no gradient reached the optimizer
    for s, before, after, _ in steps:
        if s >= cut:  # from here on the statistics are the snapshot's (restored with the weights)
            break
        limit = replay.threshold()
        assert after == pytest.approx(min(before, limit) if limit is not None else before, rel=1e-5)
        replay.update(before)


def test_repeated_spikes_cut_the_lr_even_when_the_action_is_warn(fit: Any) -> None:
    class ThreeSpikes(SpikyRegression):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            pair = {30: 0, 31: 0, 34: 1, 35: 1, 38: 2, 39: 2}.get(self.global_step)  # each pair 100x the last
            return loss + 1000.0 * 100.0 ** pair if pair is not None else loss

    # each pair's first spike is on weights healthy a step before (a bad batch: never counts towards the cut), its
    # second on the weights the first one's applied update moved
    guard = NaNGuard(check={"spike_action": "warn", "spike_warmup": 20})
    tr = fit(ThreeSpikes(at=-1, mode="offset"), regression_data(), [guard], shuffle=True, max_epochs=3)
    assert SPIKES_BEFORE_LR_CUT == 3
    assert [(e.kind, e.step, e.cause, e.actions) for e in guard.events] == [
        ("spike", 30, "input", ["warn"]), ("spike", 31, "unknown", ["warn"]), ("spike", 34, "input", ["warn"]),
        ("spike", 35, "unknown", ["warn"]), ("spike", 38, "input", ["warn"]), ("spike", 39, "unknown", ["reduce_lr"])]
    assert tr.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025) and guard.counters["incidents"] == 0
    d = SpikeDetector()
    assert [d.repeated(s, 3, 100) for s in (0, 50, 150, 160, 170, 180)] == [False, False, False, False, True, False]


@pytest.mark.parametrize("third, cut", [(37, True), (38, False)])
def test_three_spikes_cut_the_lr_only_within_incident_window_steps(fit: Any, third: int, cut: bool) -> None:
    """docs/recovery.md: 'Three spikes within recovery.incident_window steps cut the LR'. With a window of 8, a
    third counted spike 7 steps after the first cuts; one 8 steps after it does not (the first has left the window).
    A bad batch's spike (cause input) is not counted."""
    class Spikes(SpikyRegression):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            pair = {30: 0, 31: 0, 34: 1, 35: 1, third: 2, third + 1: 2}.get(self.global_step)  # each 100x the last
            return loss + 1000.0 * 100.0 ** pair if pair is not None else loss

    # the counted spikes are the second of each pair (31, 35, third + 1): the first is a bad batch's
    guard = NaNGuard(check={"spike_action": "warn", "spike_warmup": 20}, recovery={"incident_window": 8})
    tr = fit(Spikes(at=-1, mode="offset"), regression_data(), [guard], shuffle=True, max_epochs=3)
    assert [(e.kind, e.step) for e in guard.events] == [("spike", s) for s in (30, 31, 34, 35, third, third + 1)]
    assert [e.actions for e in guard.events] == [["warn"]] * 5 + [["reduce_lr"] if cut else ["warn"]]
    assert tr.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025 if cut else 0.05)


class CorruptStretch(SpikyRegression):
    """1000 added to the loss on the ``n`` optimizer steps from ``at`` on: a stretch of corrupt batches."""

    def __init__(self, at: int, n: int) -> None:
        super().__init__(at=-1, mode="offset")
        self.first, self.n = at, n

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss + 1000.0 if self.first <= self.global_step < self.first + self.n else loss


@pytest.mark.slow
def test_skip_step_catches_every_batch_of_a_corrupt_stretch_and_never_cuts_the_lr(fit: Any) -> None:
    """Issue 41: a skipped spike leaves the spike test's statistics as they were, so the five corrupt batches in a
    row are all caught and skipped (a spike that widened the spread let the later ones through); each is on the
    weights of the last healthy step (cause input), and bad data never counts towards the LR cut of repeated
    spikes."""
    guard = NaNGuard(check={"spike_action": "skip_step", "spike_warmup": 20})
    tr = fit(CorruptStretch(at=30, n=5), regression_data(), [guard], shuffle=True, max_epochs=3)
    assert [(e.kind, e.step, e.cause, e.actions) for e in guard.events] == [
        ("spike", s, "input", ["skip_step"]) for s in range(30, 35)]
    assert guard.counters["skipped_steps"] == 5 and guard.counters["lr_cuts"] == 0
    assert tr.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)
    assert guard.state_dict()["losses"]["spikes"]["held"] == 0  # the loss came back
    tests = [e.details["loss_threshold"] for e in guard.events]
    assert max(tests) == pytest.approx(min(tests))  # every corrupt batch was tested against the same statistics


def test_skip_step_spike_leaves_the_spike_statistics_as_they_were() -> None:
    held, capped = SpikeDetector(6.0, 10, hold=True), SpikeDetector(6.0, 10)
    for d in (held, capped):
        for i in range(40):
            d.observe(1.0 + 0.1 * (i % 2))
    before = held.state_dict()
    assert held.observe(100.0) is not None and capped.observe(100.0) is not None
    counting = ("held", "tests", "starts")
    assert {k: v for k, v in held.state_dict().items() if k not in counting} == \
        {k: v for k, v in before.items() if k not in counting}
    assert held.held == 1 and capped.spread() > 2 * held.spread()  # a capped spike widens the test threefold
    assert held.observe(1.05) is None and held.held == 0


def healthy_then(d: SpikeDetector, losses: dict[int, float], n: int) -> list[int]:
    """Feed ``n`` losses alternating 1.0/1.1 (40 of them first), ``losses[i]`` at test ``i`` instead; the tests
    that were spikes."""
    for i in range(40):
        d.observe(1.0 + 0.1 * (i % 2))
    return [i for i in range(n) if d.observe(losses.get(i, 1.0 + 0.1 * (i % 2))) is not None]


def test_held_spikes_that_keep_coming_apart_are_the_loss_moving() -> None:
    """A skipped spike leaves the statistics as they were, unless SHIFT_SPIKES of them, each after healthy
    batches, come within SHIFT_WINDOW tests: the loss itself moved (a harder data mix), and the last of them is
    learned whole, so that losses like it are no longer spikes. A bad stretch in a row is one such spike; spikes
    further apart stay spikes."""
    apart = {i: 50.0 for i in range(0, 200, 10)}
    d = SpikeDetector(6.0, 10, hold=True)
    assert healthy_then(d, apart, 200) == [0, 10, 20]  # the third is learned: 50 is no spike any more
    d = SpikeDetector(6.0, 10, hold=True)
    for i in range(40):
        d.observe(1.0 + 0.1 * (i % 2))
    shifted = []
    for _ in range(SHIFT_SPIKES):
        before = d.state_dict()
        assert d.observe(50.0) is not None
        shifted.append(d.shifted)
        if not d.shifted:  # left as they were
            assert {k: v for k, v in d.state_dict().items() if k in ("mean", "var", "peak")} == \
                {k: v for k, v in before.items() if k in ("mean", "var", "peak")}
        d.observe(1.0)
    assert shifted == [False] * (SHIFT_SPIKES - 1) + [True]
    assert d.peak == pytest.approx(49.0, rel=0.05) and d.observe(50.0) is None
    stretch = {i: 50.0 for i in range(30)}  # a stretch in a row: one spike start, every batch of it a spike
    d = SpikeDetector(6.0, 10, hold=True)
    assert healthy_then(d, stretch, 40) == list(range(30)) and d.held == 0 and len(d.state_dict()["starts"]) == 1
    far = {i: 50.0 for i in range(0, 10 * SHIFT_WINDOW, SHIFT_WINDOW // 2 + 1)}
    d = SpikeDetector(6.0, 10, hold=True)
    assert healthy_then(d, far, 10 * SHIFT_WINDOW) == sorted(far)  # never 3 within the window: all stay spikes
    restored = SpikeDetector(6.0, 10, hold=True)
    restored.load_state_dict(d.state_dict())
    assert restored.state_dict() == d.state_dict() and restored.state_dict()["starts"]


class HarderMix(Regression):
    """From optimizer step ``at`` on, every ``every``-th batch comes from a source whose loss is 50 higher (its
    gradient the clean one's, as for a source with more irreducible loss): the data mix got harder, nothing is
    bad."""

    def __init__(self, at: int = 60, every: int = 5) -> None:
        super().__init__()
        self.at, self.every = at, every

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        return loss + 50.0 if self.global_step >= self.at and self.global_step % self.every == 0 else loss


def test_skip_step_learns_a_data_mix_that_got_harder(fit: Any) -> None:
    """Skipped spikes leave the statistics as they were; where they keep coming after healthy batches, the loss
    has moved: the first SHIFT_SPIKES noisy batches are skipped spikes (cause input), the last of them learned
    (details.loss_moved, said in its suggestion), and every later noisy batch trains: no rollback, no LR cut
    (held for good, each of the 28 noisy batches was a skipped spike and never trained)."""
    guard = NaNGuard(check={"spike_action": "skip_step", "spike_warmup": 20})
    tr = fit(HarderMix(), regression_data(n=512), [guard], batch_size=16, steps=200)
    firsts = [60 + 5 * i for i in range(SHIFT_SPIKES)]
    assert [(e.kind, e.step, e.cause, e.actions) for e in guard.events] == [
        ("spike", s, "input", ["skip_step"]) for s in firsts]
    assert [e.details.get("loss_moved", False) for e in guard.events] == [False] * (SHIFT_SPIKES - 1) + [True]
    assert "the loss itself has moved" in guard.events[-1].suggestion
    assert guard.counters["skipped_steps"] == SHIFT_SPIKES and guard.counters["rollbacks"] == 0
    assert guard.counters["lr_cuts"] == 0 and tr.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.slow
def test_a_loss_that_does_not_come_back_after_skipped_spikes_rolls_back(fit: Any) -> None:
    """Issue 41 (PaLM): SPIKE_PATIENCE spikes in a row on unchanged weights are not the batches' fault: a
    divergence event rolls back to a snapshot from before the first and cuts the LR."""
    guard = NaNGuard(check={"spike_action": "skip_step", "spike_warmup": 20})
    tr = fit(CorruptStretch(at=30, n=SPIKE_PATIENCE + 3), regression_data(), [guard], shuffle=True, max_epochs=5)
    kinds = [(e.kind, e.step) for e in guard.events]
    last = 30 + SPIKE_PATIENCE - 1
    assert kinds[:SPIKE_PATIENCE] == [("spike", s) for s in range(30, last)] + [("divergence", last)]
    event = guard.events[SPIKE_PATIENCE - 1]
    assert event.details["divergence"]["rule"] == "loss_spike_not_back"
    assert event.details["divergence"]["onset_step"] == 30 - 1
    assert "rollback" in event.actions and "reduce_lr" in event.actions
    assert guard.counters["rollbacks"] >= 1 and tr.optimizers[0].param_groups[0]["lr"] < 0.05


# ------------------------------------------------------------------- spike_z, spike_warmup, skip_step + BN

WARMUP = 10


def _scripted(spike_at: int, spike_z: float = 8.0) -> list[float]:
    """Losses alternating 1.0 / 1.2 (mean 1.1, std 0.1), then one ``spike_z`` standard deviations above."""
    values = [1.0 if i % 2 == 0 else 1.2 for i in range(spike_at)]
    return values + [statistics.fmean(values) + spike_z * statistics.pstdev(values)]


class ScriptedLoss(Regression):
    """The loss of step ``i`` is ``values[i]`` (+ ``mse_weight`` x a real MSE through Linear-BatchNorm-Linear)."""

    def __init__(self, values: list[float], mse_weight: float = 0.0, nan_at: int = -1) -> None:
        super().__init__(lr=0.05)
        self.values, self.mse_weight, self.nan_at = values, mse_weight, nan_at
        self.linear = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.values[self.global_step] + self.mse_weight * nn.functional.mse_loss(self(x), y)
        return loss * float("nan") if self.global_step == self.nan_at else loss


@pytest.fixture
def fit_scripted(fit: Any) -> Any:
    """``fit_scripted(model, check, extra=None, subdir=None)``: one step per scripted loss; returns the guard."""

    def run(model: Any, check: dict, extra: Any = None, subdir: Any = None) -> NaNGuard:
        guard = NaNGuard(check=check, logging={"verbose": False})
        steps = len(model.values)
        fit(model, regression_data(16 * steps), [guard] + ([extra] if extra else []), subdir=subdir, batch_size=16,
            max_steps=steps)
        return guard

    return run


def test_spike_z_is_the_detection_threshold(fit_scripted: Any) -> None:
    values = _scripted(WARMUP, spike_z=8.0)
    f32 = [float(torch.tensor(v)) for v in values]  # the guard reads float32 losses
    expected = (f32[-1] - statistics.fmean(f32[:-1])) / statistics.pstdev(f32[:-1])
    assert expected == pytest.approx(8.0, rel=1e-5)
    low = fit_scripted(ScriptedLoss(values), {"spike_z": 7.5, "spike_warmup": WARMUP}, subdir="low")
    assert [(e.kind, e.step, e.actions) for e in low.events] == [("spike", WARMUP, ["skip_step"])]  # the default
    assert low.events[0].details["loss_zscore"] == pytest.approx(expected, rel=1e-6)
    high = fit_scripted(ScriptedLoss(values), {"spike_z": 8.5, "spike_warmup": WARMUP}, subdir="high")
    assert high.events == [] and high.counters["spikes"] == 0
    assert high.state_dict()["losses"]["spikes"]["count"] == WARMUP + 1


def test_spike_warmup_is_the_number_of_losses_before_detection(fit_scripted: Any) -> None:
    values = _scripted(WARMUP, spike_z=50.0)
    ready = fit_scripted(ScriptedLoss(values), {"spike_warmup": WARMUP}, subdir="ready")
    assert [(e.kind, e.step) for e in ready.events] == [("spike", WARMUP)]
    warming = fit_scripted(ScriptedLoss(values), {"spike_warmup": WARMUP + 1}, subdir="warming")
    # the spike fed the warm-up
    assert warming.events == [] and warming.state_dict()["losses"]["spikes"]["count"] == WARMUP + 1


def test_spike_action_off_turns_detection_off(fit_scripted: Any) -> None:
    values = _scripted(WARMUP, spike_z=50.0)
    guard = fit_scripted(ScriptedLoss(values), {"spike_action": "off", "spike_warmup": WARMUP})
    assert guard.events == [] and guard.state_dict()["losses"]["spikes"]["count"] == 0
    # the loss was read, just not judged
    assert guard.state_dict()["losses"]["history"][-1] == pytest.approx(values[-1])


class _StateProbe(pl.Callback):
    """After the guard: the module state at the end of every batch."""

    def __init__(self) -> None:
        self.states: list[dict] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.states.append({k: v.clone() for k, v in pl_module.state_dict().items()})


@pytest.mark.parametrize("case", ["spike_skip_step", "nan_incident", "spike_warn"])
def test_skipped_spike_undoes_batchnorm_statistics_like_an_incident(fit_scripted: Any, case: str) -> None:
    values = _scripted(WARMUP, spike_z=50.0 if case != "nan_incident" else 0.0)
    model = ScriptedLoss(values, mse_weight=1e-3, nan_at=WARMUP if case == "nan_incident" else -1)
    probe = _StateProbe()
    action = "warn" if case == "spike_warn" else "skip_step"
    guard = fit_scripted(model, {"spike_action": action, "spike_warmup": WARMUP}, probe)
    during = [e for e in guard.events if e.details.get("detected_at") != "train_end"]  # (it ends on the incident)
    assert [(e.kind, e.step) for e in during] == [("loss" if case == "nan_incident" else "spike", WARMUP)]
    def changed(a: dict, b: dict) -> set:
        return {k for k in a if not torch.equal(a[k], b[k])}

    stats = {"linear.1.running_mean", "linear.1.running_var", "linear.1.num_batches_tracked"}
    moved = stats | {"linear.0.weight", "linear.1.weight", "linear.2.weight"}
    assert moved <= changed(probe.states[WARMUP - 2], probe.states[WARMUP - 1])  # what a healthy step changes
    at_event = changed(probe.states[WARMUP - 1], probe.states[WARMUP])
    if case == "spike_warn":  # the control: the step ran, its forward moved the statistics
        assert moved <= at_event
    else:  # skipped: no update, and the forward's writes into the BatchNorm buffers are undone
        assert at_event == set()


# --------------------------------------------------- clipping: clip.max_norm, clip.adaptive, clip.norm_type


QUIET = {"verbose": False}


def grad_norm(module: torch.nn.Module, norm_type: float = 2.0) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for p in module.parameters() if p.grad is not None],
                                               norm_type))


class Spiky(models.Regression):
    """Healthy regression (SGD) whose loss is multiplied by ``factor`` at ``steps``: finite gradient spikes."""

    def __init__(self, steps: tuple[int, ...] = (), factor: float = 30.0) -> None:
        super().__init__(lr=0.05)
        self.spikes, self.factor = set(steps), factor

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * self.factor if self.global_step in self.spikes else loss


class Norms(pl.Callback):
    """Listed before or after the guard: the gradient norms the guard saw / the optimizer will apply."""

    def __init__(self, norm_types: tuple[float, ...] = (2.0,)) -> None:
        self.norm_types, self.rows = norm_types, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.rows.append(tuple(grad_norm(pl_module, p) for p in self.norm_types))


def test_fixed_max_norm_bounds_every_step_the_optimizer_applies(fit_steps):
    """clip.max_norm: the norm of the applied gradient is min(norm, max_norm) at every step."""
    max_norm = 3.0
    guard = NaNGuard(clip={"max_norm": max_norm, "adaptive": "off"}, logging=QUIET)
    before, after = Norms(), Norms()
    fit_steps(Spiky(), [before, guard, after], steps=30)
    pre, post = [r[0] for r in before.rows], [r[0] for r in after.rows]
    assert len(post) == 30 and guard.events == []
    assert max(pre) > max_norm and min(pre) < max_norm  # both cases happen in this run
    for a, b in zip(pre, post):
        assert b == pytest.approx(min(a, max_norm), rel=1e-5), (a, b)
    assert guard.counters["clipped_steps"] == sum(a > max_norm for a in pre) > 0


def test_smaller_of_fixed_and_adaptive_limit_wins(fit_steps):
    """With clip.adaptive: always, each step is clipped to min(max_norm, mean + z_threshold * std) of an EMA
    (ema_alpha) of the norms, from warmup_steps on: replayed here from the config, not read from the guard."""
    clip = {"max_norm": 9.0, "adaptive": "always", "warmup_steps": 4, "z_threshold": 1.0, "ema_alpha": 0.8}
    guard = NaNGuard(clip=clip, logging=QUIET)
    before, after = Norms(), Norms()
    fit_steps(Spiky(steps=(12, 17, 22)), [before, guard, after], steps=30)
    replay = ZClip(clip["z_threshold"], clip["ema_alpha"], clip["warmup_steps"])
    winners = []
    for (a,), (b,) in zip(before.rows, after.rows):
        adaptive = replay.threshold()
        limit = min(clip["max_norm"], adaptive) if adaptive is not None else clip["max_norm"]
        assert b == pytest.approx(min(a, limit), rel=1e-5), (a, b, adaptive)
        if a > limit:
            winners.append("adaptive" if adaptive is not None and adaptive < clip["max_norm"] else "fixed")
        replay.update(a)
    assert guard.events == [] and guard.counters["clipped_steps"] == len(winners)
    assert {"adaptive", "fixed"} <= set(winners), winners  # each limit was the smaller one at some clipped step


@pytest.mark.parametrize("adaptive", ["on_incident", "off"])
def test_adaptive_on_incident_arms_after_an_incident_and_off_never(fit_steps, adaptive):
    """clip.adaptive: on_incident clips a later finite spike once an incident has armed it; off never clips."""
    guard = NaNGuard(clip={"adaptive": adaptive, "warmup_steps": 4}, logging=QUIET)
    before, after = Norms(), Norms()
    spike = 12
    # a poisoned module output, which the replay reproduces (a one-off loss fault is a transient: it arms nothing)
    fit_steps(Spiky(steps=(spike,)), [FaultInjector(Fault("activation", steps=[2])), before, guard, after], steps=16)
    assert [e.step for e in guard.events] == [2]
    clipped = [s for s, ((a,), (b,)) in enumerate(zip(before.rows, after.rows))
               if b < a * (1 - 1e-6) and s != 2]  # (the incident's step is skipped: no gradient left to measure)
    if adaptive == "off":
        assert clipped == [] and not guard.state_dict()["clipper"]["armed"] and guard.counters["clipped_steps"] == 0
    else:
        assert "clip" in guard.events[0].actions and guard.state_dict()["clipper"]["armed"]
        assert spike in clipped and guard.counters["clipped_steps"] == len(clipped)


@pytest.mark.parametrize("norm_type", [math.inf, 1.0])
def test_norm_type_is_the_norm_that_is_clipped(fit_steps, norm_type):
    """clip.norm_type: the p-norm of the applied gradient is min(p-norm, max_norm); clipping the 2-norm
    instead would leave another size (the 2-norm of the clipped gradients is not max_norm)."""
    max_norm = 3.0
    guard = NaNGuard(clip={"max_norm": max_norm, "norm_type": norm_type, "adaptive": "off"}, logging=QUIET)
    before, after = Norms((norm_type,)), Norms((norm_type, 2.0))
    fit_steps(Spiky(), [before, guard, after], steps=30)
    clipped = 0
    for (p_pre,), (p_post, two_post) in zip(before.rows, after.rows):
        assert p_post == pytest.approx(min(p_pre, max_norm), rel=1e-5), (p_pre, p_post)
        if p_pre > max_norm:
            clipped += 1
            assert abs(two_post - max_norm) > 0.05 * max_norm, two_post
    assert guard.counters["clipped_steps"] == clipped > 0
    assert guard.state_dict()["clipper"]["last_norm"] == pytest.approx(before.rows[-1][0], rel=1e-6)


def test_a_bad_batch_spike_names_its_worst_samples(tmp_path: Any, fit: Any) -> None:
    """Two mislabelled samples (targets x1000) in batch 30 of a clean regression: the spike is the data's fault, and
    each sample's loss alone (diagnose/samples.py) names those two first, in the details and the suggestion."""
    data = regression_data()
    x, y = (t.clone() for t in data.tensors)
    bad = [30 * 16 + 3, 30 * 16 + 11]
    y[bad] *= 1000.0
    guard = NaNGuard(check={"spike_warmup": 20}, logging={"verbose": False})
    fit(Regression(lr=0.05), torch.utils.data.TensorDataset(x, y), [guard], batch_size=16, max_epochs=1)
    spikes = [e for e in guard.events if e.kind == "spike"]
    assert [e.step for e in spikes] == [30] and spikes[0].cause == "input", [(e.step, e.cause) for e in spikes]
    found = spikes[0].details["samples"]
    assert found["samples"] == 16
    worst = found["worst"]
    assert sorted(w["index"] for w in worst[:2]) == [3, 11] and worst[1]["x_median"] > 1e3, worst
    assert worst[2]["x_median"] < 100  # the clean ones are near the median
    assert "samples 3 (" in spikes[0].suggestion or "samples 11 (" in spikes[0].suggestion, spikes[0].suggestion
    assert torch.equal(y[bad[0]], data.tensors[1][bad[0]] * 1000.0)  # the rerun left the batch as it was


def test_a_batch_that_cannot_be_split_is_named_without_samples() -> None:
    from lightning_nanguard.diagnose.samples import split

    assert split((torch.zeros(4, 3), torch.zeros(4))) is not None
    assert len(split({"x": torch.zeros(4, 3), "scale": torch.tensor(2.0)})) == 4  # a scalar rides along
    assert split((torch.zeros(4, 3), torch.zeros(5))) is None  # no one first dimension
