"""The fits behind the incident-picture tests (tests/test_pictures.py), importable by a subprocess too (the fit
without matplotlib): a gradient explosion built up over ~45 steps in one module, and a one-step NaN input."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NaNGuard

EXPLOSION_FROM = 20  # the step from which the gradient of net.2 is multiplied by GROWTH per step
GROWTH = 1.3
NAN_STEP = 12  # the step whose batch holds one NaN


class ExplodingMLP(pl.LightningModule):
    """A 4-layer MLP whose middle Linear (``net.2``) gets its weight gradient multiplied by ``GROWTH ** (step -
    EXPLOSION_FROM)`` from EXPLOSION_FROM on (a per-layer gradient multiplier gone wrong): its gradients, then its
    weights, run away while the other modules' stay where they were, until the loss diverges."""

    def __init__(self, growth: float = GROWTH) -> None:  # growth 1.0: no multiplier (a healthy MLP)
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16),
                                 nn.ReLU(), nn.Linear(16, 1))
        if growth != 1.0:
            self.net[2].weight.register_hook(lambda g: g * growth ** max(0, self.global_step - EXPLOSION_FROM))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class NaNInputMLP(ExplodingMLP):
    """The same MLP without the multiplier; the batch of NAN_STEP holds one NaN."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


class GrowingLastLayer(pl.LightningModule):
    """The issue's measured case: a 4-layer MLP whose last Linear's weights grow 1.6x per step from step 20 (before the
    gradient-flow window, four divergence events with culprit None)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32),
                                 nn.ReLU(), nn.Linear(32, 1))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step >= 20:
            with torch.no_grad():
                self.net[6].weight.mul_(1.6)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def growing_last_layer(root: Path) -> tuple[Any, pl.LightningModule]:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True) * 0.1), batch_size=32, shuffle=True)
    return fit(root, "growing", GrowingLastLayer(), data, 40, NaNGuard())


def _data(nan_step: Optional[int] = None) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    y = x[:, :1] * 0.5
    if nan_step is not None:
        x[nan_step * 32 + 3, 1] = math.nan
    return DataLoader(TensorDataset(x, y), batch_size=32)


def fit(root: Path, name: str, model: pl.LightningModule, data: DataLoader, steps: int,
        guard: Optional[NaNGuard] = None, **trainer: Any) -> tuple[Optional[NaNGuard], pl.LightningModule]:
    trainer = pl.Trainer(max_steps=steps, logger=TensorBoardLogger(str(root), name=name, version=0),
                         callbacks=[guard] if guard is not None else [], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                         log_every_n_steps=5, **trainer)
    trainer.fit(model, data)
    return guard, model


def explosion(root: Path, **guard: Any) -> tuple[Any, pl.LightningModule]:
    pl.seed_everything(0, verbose=False)
    # the pictures of a divergence: the rising losses are let through (spike_action: warn), as they were before
    # spikes were skipped by default; with skip_step each is a skipped spike and the window never runs away
    guard["check"] = {"spike_action": "warn", **dict(guard.get("check") or {})}
    return fit(root, "explosion", ExplodingMLP(), _data(), 67, NaNGuard(**guard))


def nan_input(root: Path, **guard: Any) -> tuple[Any, pl.LightningModule]:
    pl.seed_everything(0, verbose=False)
    return fit(root, "nan_input", NaNInputMLP(), _data(NAN_STEP), 20, NaNGuard(**guard))


if __name__ == "__main__":  # the subprocess of a test: the NaN-input fit, its events as JSON on the last line
    import sys

    g, _ = nan_input(Path(sys.argv[1]))
    assert g is not None
    print(json.dumps([e.to_dict() for e in g.events]))
