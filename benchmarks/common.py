"""Models, data and helpers shared by the CPU benchmarks (overhead, snapshot, stability)."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tests.models import markov_tokens  # noqa: E402,F401  (one generator for tests and benchmarks)

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")
warnings.filterwarnings("ignore", ".*anomaly detection.*", category=UserWarning)
for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
    logging.getLogger(name).setLevel(logging.ERROR)

RESULTS = Path(__file__).resolve().parent / "results"


def single_thread() -> None:
    torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------- data


def classification_data(n: int, features: int, classes: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(classes, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centers[y] + torch.randn(n, features, generator=g), y)


def regression_data(n: int = 4096, features: int = 20, seed: int = 0) -> TensorDataset:
    """The data of examples/demo.py."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


# ----------------------------------------------------------------------------------------------- models


class TinyLM(pl.LightningModule):
    """A small causal transformer language model (pre-LN encoder layers with a causal mask; ``norm_first=False``:
    post-LN, nn.TransformerEncoderLayer's default order)."""

    def __init__(self, vocab: int = 128, d: int = 64, layers: int = 2, heads: int = 4, seq_len: int = 32,
                 lr: float = 3e-3, optimizer: str = "adamw", dropout: float = 0.1, norm_first: bool = True) -> None:
        super().__init__()
        self.lr, self.optimizer_name = lr, optimizer
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=dropout, batch_first=True,
                                           norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        # a bool mask (True: may not attend); the float form holds -inf, which NaNGuard's parameter/buffer
        # check currently reports as a non-finite buffer at fit start
        self.register_buffer("mask", torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        h = self.enc(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class MLP(pl.LightningModule):
    """A plain MLP classifier (Linear/ReLU/Dropout) with AdamW."""

    def __init__(self, features: int = 64, hidden: int = 256, depth: int = 4, classes: int = 10,
                 lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        layers: list[nn.Module] = []
        width = features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(0.1)]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LinearRegression(pl.LightningModule):
    """examples/demo.py's nn.Linear + SGD, which diverges to NaN at lr=1.5."""

    def __init__(self, lr: float = 1.5, features: int = 20) -> None:
        super().__init__()
        self.lr = lr
        self.linear = nn.Linear(features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


# ---------------------------------------------------------------------------------------------- trainer


def make_trainer(root: Path, callbacks: Optional[list] = None, **kwargs: Any) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
                    num_sanity_val_steps=0)
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks or [], **defaults)


def loader(data: TensorDataset, batch_size: int, shuffle: bool = True, seed: int = 0) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))


def machine() -> str:
    """One line: CPU model, cores, torch and Lightning versions."""
    model = platform.processor() or "cpu"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        model = info.get("Model name", model).strip()
        cpus = info.get("CPU(s)", "?").strip()
    except OSError:  # pragma: no cover
        cpus = str(os.cpu_count())
    return (f"{model}, {cpus} CPU(s), 1 torch thread; torch {torch.__version__}, "
            f"pytorch-lightning {pl.__version__}, Python {platform.python_version()}")
