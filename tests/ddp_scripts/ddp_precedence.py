"""A real 2-process DDP run (gloo, CPU) without replays (``anomaly.mode: off``), in which both ranks have evidence
of the same incident; run by tests/test_ddp_ranks.py.

    python ddp_precedence.py OUT_DIR

Without a replay, the rank an event names is the one with the strongest evidence of its own (docs/distributed.md):
its own flags, then its own diagnosis (bad inputs), then none; among equals, the lowest rank. By optimizer step
(= batch index):

- 3: a NaN constant added to rank 0's loss (its own flag; the gradients stay finite), while rank 1's batch holds a
  NaN in a field the model never reads (its own diagnosis finds it, no flag of its own is raised);
- 6: a NaN constant added to the loss on both ranks (the same flag on each).

Each rank writes ``OUT_DIR/rank{r}.pt``: its events (``to_dict()``) and counters, through the public surface.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from common import save_and_exit
from lightning_nanguard import NaNGuard

STEPS = 8
LOSS = {3: {0}, 6: {0, 1}}  # step -> the ranks whose loss gets a NaN constant
UNREAD = {3: {1}}  # step -> the ranks whose batch holds a NaN in the field the model never reads


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y, unread = batch
        if self.global_rank in UNREAD.get(batch_idx, ()):
            # bad data as it would arrive from the loader (through .data: no version bump, so the guard does not
            # take it for a write of the step into its own batch): the batch the guard holds is the bad one
            unread.data[0, 1] = float("nan")
        loss = nn.functional.mse_loss(self.head(x), y)
        if self.global_rank in LOSS.get(batch_idx, ()):
            loss = loss + torch.tensor(float("nan"))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out: Path) -> None:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * STEPS * 4, 4, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True), torch.zeros(len(x), 3)), batch_size=4)
    guard = NaNGuard(anomaly={"mode": "off"}, logging={"loggers": False, "verbose": False},
                     check={"divergence": "off"})
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(out), callbacks=[guard])
    trainer.fit(Net(), loader)
    save_and_exit({"rank": trainer.global_rank, "events": [e.to_dict() for e in guard.events],
                   "counters": dict(guard.counters)}, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
