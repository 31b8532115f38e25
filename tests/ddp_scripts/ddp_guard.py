"""A real 2-process DDP run (gloo, CPU) with NaNGuard; run by tests/test_distributed.py.

    python ddp_guard.py OUT_DIR [SYNC]

``SYNC`` is ``check.sync`` (default ``auto``, eager on the CPU); with ``lagged`` the optimizer is a fused AdamW,
which skips a bad step on the device.

Lightning's ``ddp`` launcher re-runs this script for rank 1. Rank 1 alone sees a non-finite loss on some
batches (``BAD``): a NaN *constant* added to the loss (gradients stay finite, so only rank 1 knows), a loss
multiplied by NaN (the NaN reaches every rank through the gradient all-reduce), and a burst longer than
``recovery.max_skips`` (a rollback), and a NaN input (only rank 1's evidence says ``input``, which the
ladder treats differently from a loss). Every ``torch.distributed`` collective called from Python is counted
(wrapped, not mocked: the original runs), with whether it came from lightning_nanguard. Each rank writes
``OUT_DIR/rank{r}.pt``: final weights, optimizer state, LRs, events, counters, per-step collective counts,
and a check of the sharded (FSDP-style) norm reduction on real gloo collectives.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from common import from_guard, save_and_exit
from lightning_nanguard import NaNGuard
from lightning_nanguard.detect.ranks import Ranks
from lightning_nanguard.detect.vector import SCHEMA

STEPS = 24
SYNC = sys.argv[2] if len(sys.argv) > 2 else "auto"
BAD = {3: "const", 8: "mul", 13: "const", 14: "const", 15: "const", 16: "const", 20: "input"}  # rank 1 only
NAMES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier", "reduce",
         "all_gather_into_tensor", "reduce_scatter_tensor", "gather", "scatter", "all_to_all")
CALLS: list[tuple[str, bool, int]] = []  # (collective, called from lightning_nanguard, numel of the tensor)


def _count(name: str) -> None:
    original = getattr(dist.distributed_c10d, name)

    def counted(*args, **kwargs):
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        CALLS.append((name, from_guard(), tensor.numel() if tensor is not None else -1))
        return original(*args, **kwargs)

    setattr(dist.distributed_c10d, name, counted)
    setattr(dist, name, counted)


for _name in NAMES:
    if hasattr(dist.distributed_c10d, _name):
        _count(_name)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        mode = BAD.get(batch_idx) if self.global_rank == 1 else None
        if mode == "input":
            # bad data as it would arrive from the loader (through .data: no version bump, so the guard does not
            # take it for a write of the step into its own batch); the batch NaNGuard holds is the bad one
            x.data[1, 2] = float("nan")  # (found on rank 1 only)
        loss = nn.functional.mse_loss(self.layer(x), y)
        if mode == "const":
            loss = loss + torch.tensor(float("nan"))  # the gradient stays finite: only rank 1 can tell
        elif mode == "mul":
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.02, fused=SYNC == "lagged")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Probe(pl.Callback):
    """After NaNGuard in the list: the cumulative collective and snapshot counts at the end of every batch."""

    def __init__(self, guard: NaNGuard) -> None:
        self.guard = guard
        self.steps: list[dict] = []
        self.sharded: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({"batch_idx": batch_idx, "global_step": trainer.global_step, "calls": len(CALLS),
                           "snapshots": self.guard.counters["snapshots"]})

    def on_train_end(self, trainer, pl_module):
        # the FSDP path of Ranks on real collectives: each rank holds half of the gradient tensors
        rank = dist.get_rank()
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(3 + i, generator=g) for i in range(5)]
        mine = full[rank::2]
        for p in (2.0, float("inf")):
            ranks = Ranks(world_size=2, sharded=True, norm_type=p)
            parts = {"grad_norm": ranks.grad_norm(mine), "loss": torch.tensor(float(rank + 1)),
                     "loss_bad": torch.tensor(float(rank == 1))}
            out = ranks.reduce(SCHEMA.build(parts, SCHEMA.constants(torch.device("cpu")))).tolist()
            reduced = [out[SCHEMA.index[name]] for name in ("grad_norm", "loss", "loss_bad")]
            self.sharded[str(p)] = {"reduced": reduced, "expected_norm": float(torch.nn.utils.get_total_norm(full, p))}


def main(out: Path) -> None:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * STEPS * 4, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    guard = NaNGuard(recovery={"max_skips": 3, "snapshot_every": 4, "confirm_after": 4},
                     logging={"loggers": False}, check={"sync": SYNC})
    probe = Probe(guard)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(out), callbacks=[guard, probe])
    model = Net()
    trainer.fit(model, loader)
    opt = trainer.optimizers[0]
    save_and_exit({
        "rank": trainer.global_rank,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "lrs": [grp["lr"] for grp in opt.param_groups],
        "events": [e.to_dict() for e in guard.events],
        "counters": dict(guard.counters),
        "lr_scale": guard.lr_scale,
        "calls": list(CALLS),
        "steps": probe.steps,
        "sharded": probe.sharded,
        "lagged": guard.lagged,
    }, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
