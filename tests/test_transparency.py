"""Transparency: a healthy run with NaNGuard is the run without it.

Bitwise identical weights, no events, no replays, no hooks left behind, across models, optimizers and
schedulers (real Trainers, CPU); an intentional -inf buffer is not an incident.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard
from . import models
from .models import Classifier, Regression, classification_data, regression_data, same_weights


def test_healthy_run_is_bitwise_transparent(fit):
    data = models.classification_data(n=384)
    weights, guards = [], []
    for guarded in (False, True):
        pl.seed_everything(7, verbose=False)
        model = models.Classifier(scheduler="onecycle", dropout=0.2)
        guard = NaNGuard() if guarded else None
        fit(model, data, [guard] if guard else [], subdir=str(guarded), shuffle=True, max_epochs=2)
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
        guards.append(guard)
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k
    assert guards[1].events == []
    assert guards[1].counters["snapshots"] >= 1  # it did work while staying transparent
    assert guards[1].counters["replays"] == 0


def test_healthy_adamw_onecycle_dropout_run_has_no_events_and_identical_weights(fit: Any) -> None:
    import pytorch_lightning as pl

    data = classification_data()
    pl.seed_everything(0, verbose=False)
    plain = Classifier(scheduler="onecycle", dropout=0.2)
    fit(plain, data, subdir="plain", shuffle=True, max_epochs=8)
    pl.seed_everything(0, verbose=False)
    guarded = Classifier(scheduler="onecycle", dropout=0.2)
    guard = NaNGuard()
    fit(guarded, data, [guard], subdir="guarded", shuffle=True, max_epochs=8)

    state = guard.state_dict()
    assert state["losses"]["spikes"]["count"] == 128 >= guard.config.check.spike_warmup  # live for 78 steps
    assert state["clipper"]["zclip"]["count"] >= guard.config.clip.warmup_steps  # the adaptive clip could act
    assert guard.events == [] and guard.counters["spikes"] == 0 and guard.counters["clipped_steps"] == 0
    assert same_weights(plain, guarded)


def test_healthy_run_performs_no_replay_and_leaves_no_hooks(fit: Any) -> None:
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            seen.append((torch.is_anomaly_enabled(), len(pl_module.linear._forward_hooks)))

    for anomaly, activations in (("on_incident", "on_incident"), ("always", "always")):
        seen.clear()
        guard = NaNGuard(anomaly={"mode": anomaly}, check={"activations": activations})
        model = Regression()
        t = fit(model, regression_data(128), [guard, Probe()], subdir=anomaly, batch_size=32, max_epochs=1)
        assert guard.events == [] and guard.counters["replays"] == 0 and t.global_step == 4
        assert all(s == ((True, 1) if anomaly == "always" else (False, 0)) for s in seen), seen
        assert not torch.is_anomaly_enabled()
        assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())


class MaskedAttention(pl.LightningModule):
    """A float causal mask of -inf, registered as a buffer, as nn.Transformer code commonly does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(6))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        h = self.proj(x)
        scores = h @ h.transpose(-1, -2) / 8 + self.mask
        return (scores.softmax(-1) @ h).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_intentional_inf_buffer_is_not_an_incident(tmp_path, fit):
    """The mask is exempt from every weight check: at checkpoints, at the end of fit, and before each snapshot
    (taken every 2 steps here: each one checks the weights the steps since changed)."""
    data = TensorDataset(torch.randn(64, 6, 8))
    guard = NaNGuard(recovery={"snapshot_every": 2})
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = fit(MaskedAttention(), data, [guard, ckpt], batch_size=8, enable_checkpointing=True, max_epochs=1)
    assert guard.events == [] and trainer.global_step == 8 and guard.counters["snapshots"] >= 4
    assert guard.exempt_buffers == {"mask"}
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 4  # checkpoints with the mask are written
