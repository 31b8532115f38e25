"""NaNGuard configured through LightningCLI: the callback and its sections live in YAML.

A small regression model and datamodule; ``nan_batches`` poisons the inputs of a few batches so the
guard has something to do. Run::

    python examples/cli_example.py fit --config configs/lightning_cli.yaml
    python examples/cli_example.py fit --config configs/lightning_cli.yaml \\
        --trainer.callbacks.init_args.recovery.max_rollbacks=7
    python examples/cli_example.py fit --print_config --config configs/lightning_cli.yaml

The guard's sections (``check``, ``clip``, ``anomaly``, ``recovery``, ``logging``) are ``init_args`` of
``lightning_nanguard.NaNGuard`` under ``trainer.callbacks``; jsonargparse validates them from the
dataclasses' type hints, and NaNGuard validates ranges (``ConfigError`` naming the key).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")


class RegressionData(pl.LightningDataModule):
    """Random linear-regression data; the batches listed in ``nan_batches`` get a NaN input."""

    def __init__(self, samples: int = 512, features: int = 8, batch_size: int = 32,
                 nan_batches: tuple[int, ...] = (), seed: int = 0) -> None:
        super().__init__()
        self.samples, self.features, self.batch_size = samples, features, batch_size
        self.nan_batches, self.seed = tuple(nan_batches), seed

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.samples, self.features, generator=g)
        w = torch.randn(self.features, 1, generator=g)
        y = x @ w + 0.1 * torch.randn(self.samples, 1, generator=g)
        for b in self.nan_batches:  # one poisoned sample per listed batch (no shuffling: batch b is fixed)
            if 0 <= b * self.batch_size < self.samples:
                x[b * self.batch_size, 0] = float("nan")
        self.data = TensorDataset(x, y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False)


class RegressionModel(pl.LightningModule):
    """A two-layer MLP trained with SGD."""

    def __init__(self, features: int = 8, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    LightningCLI(RegressionModel, RegressionData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
