"""Issue 13: divergence without NaN, from step 1 (kind ``divergence``), acted on before any value is non-finite.

The watch itself (lightning_nanguard/detect/divergence.py) is tested on value streams; the guard on real
Trainer runs: the demo's too-high LR, AdamW at lr=10 on a small pre-LN transformer (finite, never NaN), and
``check.divergence: warn`` leaving training untouched.
"""

from __future__ import annotations

import math
import random
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.detect.divergence import RECORD_FACTOR, DivergenceWatch
from .models import Regression, loader, regression_data, trainer

# ------------------------------------------------------------------------------------------- shared parts


class Block(nn.Module):
    """A GPT-2 block: pre-LN causal self-attention and MLP, residual."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(pl.LightningModule):
    """A tiny GPT-2 (token and position embeddings, 2 pre-LN blocks, final LayerNorm, GPT-2's N(0, 0.02) init)."""

    def __init__(self, lr: float, optimizer: str = "adamw", vocab: int = 64, d: int = 32, length: int = 16) -> None:
        super().__init__()
        self.lr, self.optimizer_name = lr, optimizer
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.ModuleList([Block(d, 2) for _ in range(2)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
        self.register_buffer("mask", torch.ones(length, length, dtype=torch.bool).triu(1), persistent=False)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h, self.mask)
        logits = self.head(self.ln_f(h))
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def tokens(n: int = 256, length: int = 16, vocab: int = 64, seed: int = 0) -> TensorDataset:
    """Sequences of a sparse Markov chain (4 successors per token): learnable, entropy floor log(4)."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, vocab, (vocab, 4), generator=g)
    seq = torch.empty(n, length + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(length):
        seq[:, t + 1] = nxt[seq[:, t], torch.randint(0, 4, (n,), generator=g)]
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


class LossTrace(pl.Callback):
    """Every training-step loss as the Trainer saw it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def feed(watch: DivergenceWatch, losses: list[Optional[float]], norms: Optional[list[float]] = None) -> list[dict]:
    """Observe a stream; the evidence of every event, with the step it fired at."""
    out = []
    for step, loss in enumerate(losses):
        found = watch.observe(step, loss, norms[step] if norms is not None else 1.0)
        if found is not None:
            out.append(dict(found, fired_at=step))
    return out


# ---------------------------------------------------------------------------------------------- the watch


def test_loss_growing_geometrically_fires_after_divergence_steps_ratios() -> None:
    """The demo's trajectory (about 10x per step from step 0) is a divergence at step k, onset step 0."""
    watch = DivergenceWatch(growth=2.0, steps=3)
    events = feed(watch, [34.3 * 9.0 ** i for i in range(6)])
    assert [(e["fired_at"], e["rule"], e["onset_step"]) for e in events] == [(3, "loss_growth", 0)]
    assert events[0]["losses"] == pytest.approx([34.3 * 9.0 ** i for i in range(4)])


def test_a_blow_up_within_two_steps_after_a_healthy_history() -> None:
    """Healthy, then 25x and 1e5x in two steps (a deep net going to NaN at the next step): caught, but only
    once k + 3 losses were seen (at the start of a run the k-step streak decides)."""
    events = feed(DivergenceWatch(), [7.0, 14.0, 7.7, 10.1, 16.4, 10.5, 258.0, 3.4e7])
    assert [(e["fired_at"], e["rule"], e["onset_step"]) for e in events] == [(7, "loss_blowup", 5)]
    assert feed(DivergenceWatch(), [7.0, 258.0, 3.4e7]) == []
    assert feed(DivergenceWatch(), [7.0, 14.0, 7.7, 10.1, 16.4, 10.5, 258.0, 1.6e3]) == []  # not 100x of 16.4


def test_growth_below_the_factor_or_shorter_than_the_streak_is_not_divergence() -> None:
    watch = DivergenceWatch(growth=2.0, steps=3)
    assert feed(watch, [1.0 * 1.9 ** i for i in range(8)]) == []  # 1.9x per step: below divergence_growth
    watch = DivergenceWatch(growth=2.0, steps=3)
    assert feed(watch, [1.0, 2.0, 4.0, 3.0, 6.0, 12.0, 11.0]) == []  # two doublings, then a dip, twice


def test_a_streak_must_end_far_above_everything_before_it() -> None:
    """After a long history, the last value of the streak must be RECORD_FACTOR x every loss before it."""
    history = [5.0, 0.1, 0.1, 0.1]
    streak = [0.1 * 2 ** i for i in range(1, 4)]  # 0.2, 0.4, 0.8: doubling, but below the old 5.0
    watch = DivergenceWatch(growth=2.0, steps=3)
    assert feed(watch, history + streak) == []
    watch = DivergenceWatch(growth=2.0, steps=3)
    high = [0.1 * 8 ** i for i in range(1, 4)]  # 0.8, 6.4, 51.2 >= 10 x 5.0
    events = feed(watch, history + high)
    assert [(e["fired_at"], e["rule"]) for e in events] == [(6, "loss_growth")]
    assert high[-1] >= RECORD_FACTOR * 5.0 and events[0]["loss_max_before"] == 5.0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tail", ["exponential", "lognormal", "pareto"])
def test_noisy_healthy_losses_never_fire(seed: int, tail: str) -> None:
    """Stationary noise with heavy tails (tiny batches near convergence): no event in 5000 steps."""
    rng = random.Random(seed)
    draw = {"exponential": lambda: rng.expovariate(1.0), "lognormal": lambda: rng.lognormvariate(0.0, 2.0),
            "pareto": lambda: rng.paretovariate(1.0)}[tail]
    losses = [draw() for _ in range(5000)]
    norms = [math.sqrt(v) * rng.uniform(0.5, 2.0) for v in losses]
    assert feed(DivergenceWatch(), losses, norms) == []


def test_gradient_norm_growth_counts_only_while_the_loss_grows() -> None:
    """A norm growing 3x per step while the loss falls (escaping a plateau) is healthy; with the loss
    growing over the same steps it is a divergence."""
    norms = [1e-3 * 3 ** i for i in range(6)]
    falling = [10.0, 9.5, 9.0, 8.0, 5.0, 1.0]
    assert feed(DivergenceWatch(), falling, norms) == []
    rising = [10.0, 12.0, 15.0, 20.5, 30.0, 45.0]  # never 2x per step, but 2x+ over the streak
    events = feed(DivergenceWatch(), rising, norms)
    assert [(e["fired_at"], e["rule"], e["onset_step"]) for e in events] == [(3, "grad_norm_growth", 0)]


def test_loss_far_above_its_first_value_fires_once_after_k_plus_2_steps() -> None:
    """AdamW at lr=10: 5.5, then ~2000 for good (never 2x per step for long): an event at the (k+2)-th step
    above divergence_factor x the first loss; one event while it stays there, re-armed once it falls back."""
    watch = DivergenceWatch(growth=2.0, steps=3, factor=100.0)
    high = [1584.0, 3277.0, 2141.0, 1345.0, 4003.0, 1989.0, 1893.0]
    events = feed(watch, [4.14] + high)
    assert [(e["fired_at"], e["rule"], e["onset_step"]) for e in events] == [(5, "loss_above_first", 0)]
    assert events[0]["first_loss"] == 4.14 and events[0]["losses"] == high[:5]
    assert [watch.observe(8 + i, 2000.0, 1.0) for i in range(5)] == [None] * 5  # the same episode: reported once
    assert watch.observe(13, 5.0, 1.0) is None and not watch.above  # back below: re-armed
    assert [watch.observe(14 + i, 2000.0, 1.0) for i in range(5)] == [None] * 5  # not 10x the earlier 4003
    later = [watch.observe(19 + i, 50000.0, 1.0) for i in range(5)]
    assert [e is not None for e in later] == [False] * 4 + [True]


def test_zero_and_negative_losses_disable_the_loss_rules() -> None:
    assert feed(DivergenceWatch(), [-1.0, -0.5, 0.0, -4.0, -40.0, -400.0, 0.0, 1e-9, 1.0, 100.0]) == []
    assert feed(DivergenceWatch(), [0.5, 0.0, 0.1, 0.3, 0.9, 2.7, 8.1, 50.0, 1e4, 1e8]) == []  # a hinge loss
    assert feed(DivergenceWatch(), [None, None, None, None, None]) == []  # check.loss off: no loss, no rules


def test_state_dict_round_trip_resumes_the_streak() -> None:
    watch = DivergenceWatch()
    feed(watch, [1.0, 9.0, 81.0])
    resumed = DivergenceWatch()
    resumed.load_state_dict(watch.state_dict())
    assert resumed.growing() and resumed.observe(3, 729.0, 1.0) is not None
    assert DivergenceWatch(mode="off").observe(0, 1.0, 1.0) is None


# ------------------------------------------------------------------------------------------ on a Trainer


def test_too_high_lr_is_acted_on_before_the_first_nan(tmp_path: Any) -> None:
    """The demo's failure: with defaults no loss is ever non-finite; without the guard one is."""
    data = regression_data(n=1024, features=8)
    traces = {}
    for name, guard in (("plain", None), ("guarded", NaNGuard())):
        pl.seed_everything(0, verbose=False)
        trace = LossTrace()
        trainer(tmp_path / name, [trace] + ([guard] if guard else []), max_epochs=3).fit(
            Regression(lr=1.5), loader(data))
        traces[name] = (trace.losses, guard)
    plain, (losses, guard) = traces["plain"][0], traces["guarded"]
    first_nan = next(i for i, v in enumerate(plain) if not math.isfinite(v))
    (event,) = guard.events
    assert event.kind == "divergence" and event.step < first_nan
    assert all(math.isfinite(v) for v in losses) and losses[-1] < plain[0] / 100
    assert event.actions[-2:] == ["rollback", "reduce_lr"] and event.details["restored_step"] == 0


def test_adamw_at_lr_10_on_a_small_transformer_is_caught_though_never_nan(tmp_path: Any) -> None:
    """The loss jumps from ~log(64) to thousands and stays there, finite: caught by the far-above rule."""
    data = tokens(n=128)
    plain = GPT(lr=10.0)
    trainer(tmp_path / "plain", [], max_steps=12).fit(plain, DataLoader(data, batch_size=16))
    assert all(math.isfinite(v) for v in plain.losses) and min(plain.losses[1:]) > 100 * plain.losses[0]
    pl.seed_everything(0, verbose=False)
    guard = NaNGuard()
    model = GPT(lr=10.0)
    trainer(tmp_path / "guarded", [guard], max_steps=30, max_epochs=10).fit(model, DataLoader(data, batch_size=16))
    first = guard.events[0]
    steps = guard.config.check.divergence_steps
    assert (first.kind, first.cause, first.step) == ("divergence", "learning_rate", steps + 2)
    assert first.details["divergence"]["rule"] == "loss_above_first"
    assert first.details["restored_step"] == 0 and "reduce_lr" in first.actions
    # Adam moves every weight by about lr per step: 10 is hundreds of times the weights' RMS; the cut goes to
    # where that step is SAFE_RELATIVE_UPDATE["adaptive"] of it (at most 10,000-fold in one cut)
    rel = first.details["relative_update"]
    assert rel["optimizer"] == "adaptive" and rel["relative_update"] > 100
    assert guard.lr_scale == pytest.approx(max(rel["safe_lr"] / 10.0, 1e-4))
    assert guard.counters["incidents"] == len(guard.events) and all(e.kind == "divergence" for e in guard.events)
    assert model.losses[-1] < model.losses[0]  # trained below the untrained model's loss after the rescue
    assert all(math.isfinite(v) for v in model.losses)


def test_one_lr_cut_sized_from_the_growth_rate_stops_sgd_at_lr_100(tmp_path: Any) -> None:
    """A tiny GPT-2 with SGD at lr=100: the gradient norm grows ~50-100x per step, which puts the edge of
    stability near lr=2-4. One cut a margin below that edge holds (divergence_lr_factor alone, to lr=10, diverges
    again a few steps later), and training goes on finite, below the untrained loss."""
    model = GPT(lr=100.0, optimizer="sgd")
    guard = NaNGuard(logging={"verbose": False})
    trainer(tmp_path, [guard], max_steps=24, max_epochs=10).fit(model, DataLoader(tokens(n=128), batch_size=16))
    (event,) = guard.events
    rel = event.details["relative_update"]
    assert (event.kind, event.cause) == ("divergence", "learning_rate") and event.details["restored_step"] == 0
    assert 1.0 < rel["edge_lr"] < 10.0 and event.details["lr_after"] == [pytest.approx(rel["safe_lr"])]
    assert guard.lr_scale == pytest.approx(rel["safe_lr"] / 100.0) and guard.counters["lr_cuts"] == 1
    assert all(math.isfinite(v) for v in model.losses) and max(model.losses[-8:]) < model.losses[0]


def test_warn_records_the_divergence_and_changes_nothing(tmp_path: Any) -> None:
    data = regression_data(n=512, features=8)
    weights = []
    guard = NaNGuard(check={"divergence": "warn"})
    for name, g in (("plain", None), ("warn", guard)):
        pl.seed_everything(0, verbose=False)
        model = Regression(lr=1.5)
        trainer(tmp_path / name, [g] if g else [], max_steps=8).fit(model, loader(data))  # before any NaN
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
    assert [(e.kind, e.step, e.actions, e.cause) for e in guard.events] == [
        ("divergence", guard.config.check.divergence_steps, ["warn"], "learning_rate")]
    assert guard.lr_scale == 1.0 and guard.counters["rollbacks"] == 0


def test_rollback_goes_to_a_snapshot_from_before_the_onset(tmp_path: Any) -> None:
    """Snapshots every step: the ones taken during the growth are not known-good; the rollback restores the
    newest snapshot at or before the step where the growth began."""
    guard = NaNGuard(recovery={"snapshot_every": 1, "keep_snapshots": 4})
    trainer(tmp_path, [guard], max_steps=10).fit(Regression(lr=1.5), loader(regression_data(n=512)))
    event = guard.events[0]
    onset = event.details["divergence"]["onset_step"]
    assert event.kind == "divergence" and event.step > onset + 1  # snapshots were due in between
    assert event.details["restored_step"] == onset


# --------------------------------------------------------------------------------------------- the keys


def _demo_run(tmp_path: Any, steps: int = 16, **sections: Any) -> tuple[NaNGuard, Regression, LossTrace]:
    """The demo's failure (the loss grows 5-20x per step from step 0), ``steps`` steps, with ``sections``."""
    pl.seed_everything(0, verbose=False)
    guard, model, trace = NaNGuard(logging={"verbose": False}, **sections), Regression(lr=1.5), LossTrace()
    trainer(tmp_path, [trace, guard], max_steps=steps).fit(model, loader(regression_data(n=512)))
    return guard, model, trace


@pytest.mark.parametrize("mode", ["off", "warn", "act"])
def test_check_divergence_off_warn_act(tmp_path: Any, mode: str) -> None:
    """check.divergence: off sees nothing, warn records the event and leaves training bitwise alone, act rolls
    back and cuts the LR."""
    pl.seed_everything(0, verbose=False)
    plain = Regression(lr=1.5)
    trainer(tmp_path / "plain", [], max_steps=16).fit(plain, loader(regression_data(n=512)))
    guard, model, trace = _demo_run(tmp_path / mode, check={"divergence": mode})
    same = all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))
    events = [(e.kind, e.actions[-1]) for e in guard.events]
    assert events == {"off": [], "warn": [("divergence", "warn")], "act": [("divergence", "reduce_lr")]}[mode]
    assert same == (mode != "act") and (guard.lr_scale < 1) == (mode == "act")
    assert all(math.isfinite(v) for v in trace.losses)


@pytest.mark.parametrize("steps", [2, 3, 5])
def test_check_divergence_steps_is_the_length_of_the_growth_streak(tmp_path: Any, steps: int) -> None:
    guard, _, _ = _demo_run(tmp_path, check={"divergence_steps": steps})
    first = guard.events[0]
    assert (first.kind, first.step, first.details["divergence"]["rule"]) == ("divergence", steps, "loss_growth")
    assert len(first.details["divergence"]["losses"]) == steps + 1


def test_check_divergence_growth_is_the_per_step_factor(tmp_path: Any) -> None:
    """The demo's loss grows 5-20x per step: a streak at growth 2, none at growth 30 (the far-above rule, which
    does not look at the factor, then fires a few steps later)."""
    default, _, _ = _demo_run(tmp_path / "2")
    high, _, trace = _demo_run(tmp_path / "30", check={"divergence_growth": 30.0})
    assert [(e.step, e.details["divergence"]["rule"]) for e in default.events] == [(3, "loss_growth")]
    ratios = [b / a for a, b in zip(trace.losses, trace.losses[1:])]
    rules = [(e.step, e.details["divergence"]["rule"]) for e in high.events if "divergence" in e.details]
    assert max(ratios[:8]) < 30 and [rule for _, rule in rules] == ["loss_above_first"] and rules[0][0] > 3


@pytest.mark.parametrize("factor, caught", [(100.0, True), (1e4, False)])
def test_check_divergence_factor_is_how_far_above_the_first_loss(tmp_path: Any, factor: float, caught: bool) -> None:
    """AdamW at lr=10 holds the loss at ~300-800x its first value: above a factor of 100, below one of 1e4."""
    guard = NaNGuard(check={"divergence_factor": factor}, logging={"verbose": False})
    model = GPT(lr=10.0)
    trainer(tmp_path, [guard], max_steps=10, max_epochs=10).fit(model, DataLoader(tokens(n=128), batch_size=16))
    assert max(model.losses[1:6]) < 1e4 * model.losses[0] < 1e4 * min(model.losses[1:6]) * 100
    assert [(e.step, e.details["divergence"]["rule"]) for e in guard.events if "divergence" in e.details] == (
        [(guard.config.check.divergence_steps + 2, "loss_above_first")] if caught else [])
    assert bool(guard.events) == caught


@pytest.mark.parametrize("factor", [0.1, 0.01])
def test_recovery_divergence_lr_factor_is_the_cut_unless_the_diagnosis_asks_for_more(tmp_path: Any,
                                                                                     factor: float) -> None:
    """At least divergence_lr_factor; further when the relative update says the LR is still unsafe."""
    guard, _, _ = _demo_run(tmp_path, recovery={"divergence_lr_factor": factor})
    rel = guard.events[0].details["relative_update"]
    safe = rel["safe_lr"] / rel["lr"]
    assert 0.01 < safe < 0.1  # measured: ~0.05 for this run
    assert guard.lr_scale == pytest.approx(min(factor, safe))
