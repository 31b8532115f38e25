"""Prevention: z-score clipping statistics, loss-spike detection and unit-wise AGC, alone and in a real Trainer."""

from __future__ import annotations

import json
import pytorch_lightning as pl
import math
import random
import statistics
from typing import Any

import pytest
import torch
from torch import nn

from lightning_nanguard import NaNGuard
from lightning_nanguard.detect.spikes import RunningStats, SpikeDetector
from lightning_nanguard.incidents import SPIKES_BEFORE_LR_CUT
from lightning_nanguard.recover.clipping import CLIPS_BEFORE_LR_CUT, ZClip, adaptive_grad_clip_, unitwise_norms
from .models import Classifier, Regression, classification_data, loader, regression_data, trainer


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
    assert d.observe(mean - 50 * std) is None  # a falling loss is never a spike
    d.load_state_dict(state)
    z = d.observe(mean + 10 * std)
    assert z is not None and z == pytest.approx(10.0, rel=0.05)
    # the spike is folded in capped at the threshold: the baseline hardly moves, the next spike is still seen
    assert d.stats.mean < mean + 0.02 * 6 * std + 0.05
    assert d.observe(mean + 10 * std) is not None


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


def _fit(tmp_path: Any, model: Any, guard: Any = None, epochs: int = 3, data: Any = None, **kw: Any) -> Any:
    tr = trainer(tmp_path, callbacks=[guard] if guard is not None else [], max_epochs=epochs, **kw)
    tr.fit(model, loader(data if data is not None else regression_data(), shuffle=True))
    return tr


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_healthy_adamw_onecycle_dropout_run_has_no_events_and_identical_weights(tmp_path: Any) -> None:
    import pytorch_lightning as pl

    data = classification_data()
    pl.seed_everything(0, verbose=False)
    plain = Classifier(scheduler="onecycle", dropout=0.2)
    _fit(tmp_path / "plain", plain, epochs=8, data=data)
    pl.seed_everything(0, verbose=False)
    guarded = Classifier(scheduler="onecycle", dropout=0.2)
    guard = NaNGuard()
    _fit(tmp_path / "guarded", guarded, guard, epochs=8, data=data)

    assert guard._losses.detector.stats.count == 128 and guard._losses.detector.stats.ready  # detection was live for 78 steps
    assert guard._clipper.zclip.threshold() is not None
    assert guard.events == [] and guard.counters["spikes"] == 0 and guard.counters["clipped_steps"] == 0
    assert _same_weights(plain, guarded)


def test_bad_batch_spike_is_one_event_and_skipped(tmp_path: Any) -> None:
    guard = NaNGuard(check={"spike_action": "skip_step", "spike_warmup": 20})
    model = SpikyRegression(at=30, mode="input")
    _fit(tmp_path, model, guard)
    assert [e.kind for e in guard.events] == ["spike"]
    event = guard.events[0]
    assert event.step == 30 and event.actions == ["skip_step"]
    assert event.details["loss_zscore"] > 6 and event.details["loss"] > 1e3
    assert event.cause == "exploding_gradient"  # the bad batch's gradient norm is an outlier too
    assert guard.counters["spikes"] == 1 and guard.counters["incidents"] == 0
    assert guard.counters["skipped_steps"] == 1
    lines = (tmp_path / "nanguard" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["spike"]
    x, y = regression_data().tensors
    assert float(nn.functional.mse_loss(model(x).detach(), y)) < 0.05  # the x1000 step never reached the weights


def test_unguarded_bad_batch_wrecks_the_same_run(tmp_path: Any) -> None:
    """The control for the test above: without the skip the x1000 batch ruins the weights."""
    model = SpikyRegression(at=30, mode="input")
    _fit(tmp_path, model)
    x, y = regression_data().tensors
    loss = float(nn.functional.mse_loss(model(x).detach(), y))
    assert not math.isfinite(loss) or loss > 1.0


def test_warn_spike_records_but_changes_nothing(tmp_path: Any) -> None:
    import pytorch_lightning as pl

    pl.seed_everything(0, verbose=False)
    plain = SpikyRegression(at=30, mode="offset")
    _fit(tmp_path / "plain", plain)
    pl.seed_everything(0, verbose=False)
    guarded = SpikyRegression(at=30, mode="offset")
    guard = NaNGuard(check={"spike_warmup": 20})  # spike_action: warn (the default)
    _fit(tmp_path / "guarded", guarded, guard)
    assert [(e.kind, e.step, e.actions) for e in guard.events] == [("spike", 30, ["warn"])]
    assert guard.events[0].cause == "unknown"  # the gradient was normal: only the loss value jumped
    assert _same_weights(plain, guarded)


def test_reduce_lr_spike_cuts_the_lr_without_climbing_the_ladder(tmp_path: Any) -> None:
    guard = NaNGuard(check={"spike_action": "reduce_lr", "spike_warmup": 20}, recovery={"lr_factor": 0.25})
    model = SpikyRegression(at=30, mode="offset")
    tr = _fit(tmp_path, model, guard)
    assert [(e.kind, e.actions) for e in guard.events] == [("spike", ["reduce_lr"])]
    event = guard.events[0]
    assert event.details["lr_before"] == [0.05] and event.details["lr_after"] == [pytest.approx(0.0125)]
    assert tr.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0125)
    assert guard.lr_scale == 0.25 and guard.counters["lr_cuts"] == 1
    assert guard.counters["incidents"] == 0 and guard._recovery.ladder.consecutive == 0 and not guard._recovery.ladder.adaptive_clip


def test_clip_spike_clips_the_step_to_the_typical_norm_and_arms_adaptive_clipping(tmp_path: Any) -> None:
    import pytorch_lightning as pl

    seen: list[float] = []

    class Probe(pl.Callback):  # runs after the guard in on_before_optimizer_step: sees the clipped grads
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == 30:
                grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
                seen.append(float(torch.nn.utils.get_total_norm(grads)))

    guard = NaNGuard(check={"spike_action": "clip", "spike_warmup": 20})
    model = SpikyRegression(at=30, mode="input")
    tr = trainer(tmp_path, callbacks=[guard, Probe()], max_epochs=3)
    tr.fit(model, loader(regression_data(), shuffle=True))
    spikes = [e for e in guard.events if e.kind == "spike"]
    assert spikes and spikes[0].step == 30 and spikes[0].actions == ["clip"]
    assert seen == [pytest.approx(spikes[0].details["clip_to"], rel=1e-4)]
    assert spikes[0].details["clip_to"] < spikes[0].details["grad_norm"] / 100
    assert guard._recovery.ladder.adaptive_clip and guard.counters["clipped_steps"] >= 1
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_agc_in_a_trainer_bounds_every_unit(tmp_path: Any) -> None:
    import pytorch_lightning as pl

    worst: list[float] = []

    class Probe(pl.Callback):  # after the guard: every unit's gradient within 0.01 * its weight norm
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            for p in pl_module.parameters():
                bound = unitwise_norms([p.detach()])[0].clamp(min=1e-3) * 0.01
                worst.append(float((unitwise_norms([p.grad])[0] / bound).max()))

    guard = NaNGuard(clip={"agc_clip_factor": 0.01})
    model = Classifier()
    tr = trainer(tmp_path, callbacks=[guard, Probe()], max_epochs=1)
    tr.fit(model, loader(classification_data(), shuffle=True))
    assert len(worst) == 16 * 6 and max(worst) <= 1 + 1e-5 and max(worst) > 0.99  # clipping was active
    assert guard.events == []
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_adaptive_always_clips_after_warmup_at_the_threshold_and_cuts_lr_when_it_never_stops(tmp_path: Any) -> None:
    import pytorch_lightning as pl

    steps: list[tuple[int, float, float, Any]] = []  # (step, norm before, norm after, threshold used)

    class Probe(pl.Callback):  # after the guard: the gradient the optimizer will apply
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            used = guard._clipper.zclip.stats.state_dict()
            steps.append((trainer.global_step, guard._clipper.last_norm, float(torch.nn.utils.get_total_norm(grads)),
                          used))

    # the divergence watch (issue 13) would act at step 3, long before clipping warms up: this pins clipping alone
    guard = NaNGuard(clip={"adaptive": "always", "warmup_steps": 10}, check={"spike_action": "off", "divergence": "off"})
    model = Regression(lr=1.5)  # past the SGD stability edge: the norms grow until clipping holds them
    tr = trainer(tmp_path, callbacks=[guard, Probe()], max_epochs=2)
    tr.fit(model, loader(regression_data(), shuffle=True))
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


def test_guard_state_dict_carries_the_statistics() -> None:
    a = NaNGuard()
    for v in range(1, 40):
        a._clipper.zclip.update(float(v))
        a._losses.detector.observe(float(v % 5))
    b = NaNGuard()
    b.load_state_dict(a.state_dict())
    assert b._clipper.zclip.state_dict() == a._clipper.zclip.state_dict() and b._losses.detector.state_dict() == a._losses.detector.state_dict()
    c = NaNGuard()  # a version-1 state dict: one flat dict of counters and statistics
    c.load_state_dict({"counters": {"incidents": 3, "rollbacks": 1}, "lr_scale": 0.25, "event_index": 4,
                       "norm_ema": {"count": 30, "mean": 2.0, "var": 0.25}})
    assert c._clipper.zclip.threshold() == pytest.approx(2.0 + 2.5 * 0.5)
    assert c.lr_scale == 0.25 and c.counters["incidents"] == 3 and c.counters["rollbacks"] == 1
    assert c._recorder.state_dict()["index"] == 4


# ------------------------------------------------------------------------- hot-path helpers (checks.py)


def test_total_norm_is_bitwise_get_total_norm() -> None:
    from lightning_nanguard.detect import flags as checks
    from lightning_nanguard.detect.state import StateCheck

    torch.manual_seed(0)
    grads = [torch.randn(s) * 3 for s in [(16, 8), (16,), (4, 3, 3), ()]]
    for norm_type in (2.0, 1.0, math.inf):
        assert torch.equal(checks.total_norm(grads, norm_type), torch.nn.utils.get_total_norm(grads, norm_type))
    mixed = grads + [torch.randn(5, dtype=torch.float64)]  # several dtypes: torch's own path
    assert torch.equal(checks.total_norm(mixed), torch.nn.utils.get_total_norm(mixed))


def test_state_check_sees_in_place_writes_new_storage_and_huge_finite_values() -> None:
    from lightning_nanguard.detect import flags as checks
    from lightning_nanguard.detect.state import StateCheck

    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1), nn.Linear(1100, 1000))
    check = StateCheck()
    assert not bool(check.flag(model))
    weight = model[0].weight
    with torch.no_grad():
        weight[3, 2] = float("nan")  # in place: the cached views see it
    assert bool(check.flag(model))
    with torch.no_grad():
        weight[3, 2] = 0.0
        model[1].running_var[0] = float("inf")  # a buffer
    assert bool(check.flag(model))
    with torch.no_grad():
        model[1].running_var[0] = 1.0
        model[3].weight[0, 0] = float("-inf")  # a large tensor (aminmax path)
    assert bool(check.flag(model))
    with torch.no_grad():
        model[3].weight[0, 0] = 3e38  # huge but finite: no overflow to a false alarm
    assert not bool(check.flag(model))
    model[2].bias.data = torch.full((1,), float("nan"))  # storage replaced: re-collected
    assert bool(check.flag(model))


class NaNLossRegression(Regression):
    """Healthy nn.Linear + SGD whose loss is NaN at the given optimizer steps."""

    def __init__(self, nan_steps: tuple[int, ...]) -> None:
        super().__init__(lr=0.05)
        self.nan_steps = nan_steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step in self.nan_steps else loss


def test_rollback_restores_the_running_statistics_of_the_snapshot(tmp_path: Any) -> None:
    """Statistics gathered while a run diverged would blind adaptive clipping and spike detection after the
    rollback: they are part of the known-good state."""
    import pytorch_lightning as pl

    seen: list[tuple[dict, dict, dict, dict]] = []

    class Probe(pl.Callback):  # after the guard's on_train_batch_end, i.e. after the rollback
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if guard.counters["rollbacks"] and not seen:
                meta = guard._recovery.store.newest.meta
                seen.append((meta["zclip"], guard._clipper.zclip.state_dict(), meta["loss_stats"], guard._losses.detector.state_dict()))

    guard = NaNGuard()  # snapshot every 50 steps; 4 NaN losses in a row: skip x3, then roll back
    tr = trainer(tmp_path, callbacks=[guard, Probe()], max_epochs=5)
    tr.fit(NaNLossRegression(nan_steps=(60, 61, 62, 63)), loader(regression_data(), shuffle=True))
    assert guard.counters["rollbacks"] == 1 and guard._recovery.store.newest.step >= 50
    (zclip_snap, zclip_now, loss_snap, loss_now), = seen
    assert zclip_now == zclip_snap and loss_now == loss_snap and zclip_now["count"] >= 50


def test_repeated_spikes_cut_the_lr_even_when_the_action_is_warn(tmp_path: Any) -> None:
    class ThreeSpikes(SpikyRegression):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss + 1000.0 if self.global_step in (30, 34, 38) else loss

    guard = NaNGuard(check={"spike_warmup": 20})  # spike_action: warn
    tr = _fit(tmp_path, ThreeSpikes(at=-1, mode="offset"), guard)
    assert SPIKES_BEFORE_LR_CUT == 3
    assert [(e.kind, e.step, e.actions) for e in guard.events] == [
        ("spike", 30, ["warn"]), ("spike", 34, ["warn"]), ("spike", 38, ["reduce_lr"])]
    assert tr.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025) and guard.counters["incidents"] == 0
    d = SpikeDetector()
    assert [d.repeated(s, 3, 100) for s in (0, 50, 150, 160, 170, 180)] == [False, False, False, False, True, False]


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


def _fit_scripted(tmp_path: Any, model: Any, check: dict, extra: Any = None) -> Any:
    guard = NaNGuard(check=check, logging={"verbose": False})
    steps = len(model.values)
    tr = trainer(tmp_path, callbacks=[guard] + ([extra] if extra else []), max_steps=steps)
    tr.fit(model, loader(regression_data(16 * steps), batch_size=16))
    return guard


def test_spike_z_is_the_detection_threshold(tmp_path: Any) -> None:
    values = _scripted(WARMUP, spike_z=8.0)
    f32 = [float(torch.tensor(v)) for v in values]  # the guard reads float32 losses
    expected = (f32[-1] - statistics.fmean(f32[:-1])) / statistics.pstdev(f32[:-1])
    assert expected == pytest.approx(8.0, rel=1e-5)
    low = _fit_scripted(tmp_path / "low", ScriptedLoss(values), {"spike_z": 7.5, "spike_warmup": WARMUP})
    assert [(e.kind, e.step, e.actions) for e in low.events] == [("spike", WARMUP, ["warn"])]
    assert low.events[0].details["loss_zscore"] == pytest.approx(expected, rel=1e-6)
    high = _fit_scripted(tmp_path / "high", ScriptedLoss(values), {"spike_z": 8.5, "spike_warmup": WARMUP})
    assert high.events == [] and high.counters["spikes"] == 0 and high._losses.detector.stats.count == WARMUP + 1


def test_spike_warmup_is_the_number_of_losses_before_detection(tmp_path: Any) -> None:
    values = _scripted(WARMUP, spike_z=50.0)
    ready = _fit_scripted(tmp_path / "ready", ScriptedLoss(values), {"spike_warmup": WARMUP})
    assert [(e.kind, e.step) for e in ready.events] == [("spike", WARMUP)]
    warming = _fit_scripted(tmp_path / "warming", ScriptedLoss(values), {"spike_warmup": WARMUP + 1})
    assert warming.events == [] and warming._losses.detector.stats.count == WARMUP + 1  # the spike fed the warm-up


def test_spike_action_off_turns_detection_off(tmp_path: Any) -> None:
    values = _scripted(WARMUP, spike_z=50.0)
    guard = _fit_scripted(tmp_path, ScriptedLoss(values), {"spike_action": "off", "spike_warmup": WARMUP})
    assert guard.events == [] and guard._losses.detector.stats.count == 0
    assert guard._losses.history[-1] == pytest.approx(values[-1])  # the loss was read, just not judged


class _StateProbe(pl.Callback):
    """After the guard: the module state at the end of every batch."""

    def __init__(self) -> None:
        self.states: list[dict] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.states.append({k: v.clone() for k, v in pl_module.state_dict().items()})


@pytest.mark.parametrize("case", ["spike_skip_step", "nan_incident", "spike_warn"])
def test_skipped_spike_undoes_batchnorm_statistics_like_an_incident(tmp_path: Any, case: str) -> None:
    values = _scripted(WARMUP, spike_z=50.0 if case != "nan_incident" else 0.0)
    model = ScriptedLoss(values, mse_weight=1e-3, nan_at=WARMUP if case == "nan_incident" else -1)
    probe = _StateProbe()
    action = "warn" if case == "spike_warn" else "skip_step"
    guard = _fit_scripted(tmp_path, model, {"spike_action": action, "spike_warmup": WARMUP}, probe)
    assert [(e.kind, e.step) for e in guard.events] == [("loss" if case == "nan_incident" else "spike", WARMUP)]
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
