"""A healthy run whose data gets harder: a GRU language model over two token sources, fed one source per batch.

The easy source is a Markov chain with one successor per token (learned to a loss near 0 within a few hundred
steps); the hard one has 8 successors per token (entropy ln 8 = 2.08 nats). The share of hard batches rises
linearly from 0 at :data:`HARD_FROM` of the fit to :data:`HARD_SHARE` at its end, as a data loader that mixes in a
new shard does: the first hard batches come after hundreds of easy ones whose loss barely moves, hundreds of
spreads above it. Nothing is wrong with the run: a guard should let it learn the hard source. Validation: the
mean loss over held-out sequences of both sources in the end's proportion.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

__all__ = ["GRULM", "mixture", "VOCAB", "SEQ", "HARD_FROM", "HARD_SHARE"]

VOCAB = 64
SEQ = 32
HARD_FROM = 0.6  # the first hard batch may come after this share of the fit ...
HARD_SHARE = 0.5  # ... and this share of the last batches is hard


def _chain(successors: int, rows: int, g: torch.Generator, nxt: torch.Tensor) -> torch.Tensor:
    seq = torch.empty(rows, SEQ + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (rows,), generator=g)
    for t in range(SEQ):
        seq[:, t + 1] = nxt[seq[:, t], torch.randint(0, successors, (rows,), generator=g)]
    return seq


def mixture(steps: int, batch: int, held_out: int = 512, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """``steps`` batches of ``batch`` sequences in feeding order (no shuffle), each all easy or all hard, and the
    held-out set (``HARD_SHARE`` hard)."""
    g = torch.Generator().manual_seed(seed)
    easy_next = torch.randint(0, VOCAB, (VOCAB, 1), generator=g)
    hard_next = torch.randint(0, VOCAB, (VOCAB, 8), generator=g)
    share = torch.clamp((torch.arange(steps) / steps - HARD_FROM) / (1 - HARD_FROM), min=0) * HARD_SHARE
    hard = torch.rand(steps, generator=g) < share
    easy_rows, hard_rows = _chain(1, steps * batch, g, easy_next), _chain(8, steps * batch, g, hard_next)
    rows = torch.where(hard.repeat_interleave(batch)[:, None], hard_rows, easy_rows)
    n_hard = int(held_out * HARD_SHARE)
    val = torch.cat([_chain(8, n_hard, g, hard_next), _chain(1, held_out - n_hard, g, easy_next)])
    return (TensorDataset(rows[:, :-1].contiguous(), rows[:, 1:].contiguous()),
            TensorDataset(val[:, :-1].contiguous(), val[:, 1:].contiguous()))


class GRULM(pl.LightningModule):
    """Embedding, a 1-layer GRU, a linear head; RMSprop."""

    def __init__(self, lr: float = 3e-3, d: int = 64) -> None:
        super().__init__()
        self.lr = lr
        self.emb = nn.Embedding(VOCAB, d)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.emb(x))[0])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.RMSprop(self.parameters(), lr=self.lr)
