"""Issue 2's must-shows: the recovery ladder on real pl.Trainer runs (CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from . import models
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard, NaNGuardError
from lightning_nanguard.testing import Fault, FaultInjector


def _all_finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in list(module.parameters()) + list(module.buffers())
               if t.is_floating_point())


def _poison(data: TensorDataset, rows: list[int], value: float) -> TensorDataset:
    x = data.tensors[0].clone()
    for i, r in enumerate(rows):
        x[r, i % x.shape[1]] = value if i % 2 == 0 else -value
    return TensorDataset(x, data.tensors[1])


def _embedding_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (256,), generator=g)  # rows 32..63 are never used
    return TensorDataset(idx, torch.randn(256, generator=g))


def test_adam_eps0_parameter_incident_and_no_nan_checkpoint(tmp_path):
    guard = NaNGuard()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    model = models.EpsZeroEmbedding(rows=64, dim=8)  # rows 32..63 are never used
    models.trainer(tmp_path, [guard, ckpt], enable_checkpointing=True, max_epochs=2).fit(
        model, models.loader(_embedding_data(), 32))
    assert guard.events, "the NaN weights went unnoticed"
    first = guard.events[0]
    assert first.kind == "parameter" and "rollback" in first.actions
    assert first.cause == "optimizer"
    assert first.culprit == "emb.weight"
    assert guard.events[-1].actions[-1] == "stop"  # rollback cannot fix eps=0: it gives up, boundedly
    assert len(guard.events) <= guard.config.recovery.max_rollbacks + 1
    files = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert files
    for f in files:
        state = torch.load(f, map_location="cpu", weights_only=False)
        for k, v in state["state_dict"].items():
            assert torch.isfinite(v).all(), (f.name, k)
        for opt_state in state["optimizer_states"]:
            for s in opt_state["state"].values():
                for name, v in s.items():
                    assert torch.isfinite(torch.as_tensor(v)).all(), (f.name, name)
    assert _all_finite(model)
