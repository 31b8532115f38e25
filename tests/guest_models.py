"""A tiny model and data for tests/test_good_guest.py, for either Lightning package: this module imports neither
(a fresh interpreter of the unified package's user imports it without ``pytorch_lightning``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def data(n: int = 96, bad: tuple[int, ...] = (), batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    for b in bad:
        x[b * batch_size, 0] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def module(pkg: Any, manual: bool = False, every: int = 1) -> Any:
    """A tiny regression LightningModule of ``pkg`` that logs ``train_loss`` (progress bar) and ``val_loss``;
    ``manual``: two optimizers stepped by hand every ``every`` batches."""

    class Model(pkg.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)
            self.automatic_optimization = not manual

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss, prog_bar=True)
            if not manual:
                return loss
            opt_a, opt_b = self.optimizers()
            self.manual_backward(loss / every)
            if (batch_idx + 1) % every == 0:
                for opt in (opt_a, opt_b):
                    opt.step()
                    opt.zero_grad()
            return None

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self(x), y), prog_bar=True)

        def configure_optimizers(self):
            if manual:
                return [torch.optim.SGD(self.a.parameters(), lr=0.05), torch.optim.SGD(self.b.parameters(), lr=0.05)]
            return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)  # fused: lagged can skip on the device

    return Model()
