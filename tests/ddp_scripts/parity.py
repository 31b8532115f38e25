"""The model, data and faults of the sharded-diagnosis parity tests (tests/test_sharded_diagnosis.py): the same fit on
one process (in the test's own process), under FSDP2, tensor parallel and both (tests/ddp_scripts/sharded_diagnosis.py).

``Parity``: ``net = Linear(8, 32) -> ReLU -> Linear(32, 4)`` (tensor parallel: column-wise then row-wise; FSDP2: each
``Linear`` and the root sharded), and a norm penalty ``sqrt(sum((h * m)^2))`` on its output, ``m`` a per-sample mask of
the batch. The scenarios (``SCENARIOS``), each poisoning one rank's micro-batch (``rank``: global rank 1 on 2 ranks, 3
on the 2 x 2 mesh, 0 on one process) at step ``AT``:

- ``backward``: that sample's mask is 0: the penalty's ``sqrt`` of 0 has an infinite derivative (the forward is
  finite), the backward makes NaN (``SqrtBackward0`` in ``vnorm``, cause ``backward_op``);
- ``overflow``: that sample is ``3e38`` times the signs of the largest row of the rank's own shard of
  ``net.0.weight``: that row's output overflows float32 in ``net.0``'s matmul (finite in float64: cause ``overflow``);
- ``lr``: SGD at an LR far too high, no poison: the loss runs away (a ``divergence``, cause ``learning_rate``);
- ``input``: a NaN in that rank's batch (``FaultInjector``), cause ``input``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.testing import Fault, FaultInjector

AT = 3  # the step of every scenario's fault
STEPS = 8
SCENARIOS = ("backward", "overflow", "lr", "input")
# what the one-process fit names (culprit, op, cause): the tests check it first, then every sharded fit against it
EXPECTED = {"backward": ("vnorm", "SqrtBackward0", "backward_op"), "overflow": ("net.0", "AddmmBackward0", "overflow"),
            "lr": ("net.2", None, "learning_rate"), "input": (None, None, "input")}  # lr: the module that ran away


class VectorNorm(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((h * h).sum(-1, keepdim=True))


class Parity(pl.LightningModule):
    def __init__(self, layout: str = "single", optimizer: str = "adamw", lr: float = 0.02) -> None:
        super().__init__()
        self.layout, self.optimizer, self.lr = layout, optimizer, lr
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        self.vnorm = VectorNorm()

    def configure_model(self) -> None:
        if self.layout in ("tp", "2d"):
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if self.layout in ("fsdp", "2d"):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net[2], mesh=mesh)
            fully_shard(self, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, m = batch
        h = self.net(x)
        return F.mse_loss(h, y) + 1e-3 * self.vnorm(h * m).mean()

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.optimizer == "fused")


class Poison(pl.Callback):
    """At ``step``, on global rank ``rank`` only, one sample of the batch, in place (the batch the guard replays)."""

    def __init__(self, what: str, step: int, rank: int) -> None:
        self.what, self.step, self.rank = what, step, rank

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        x, _, m = batch
        if self.what == "backward":
            m[1] = 0.0
        elif self.what == "overflow":
            w = pl_module.net[0].weight
            w = (w.to_local() if hasattr(w, "to_local") else w).detach()  # this rank's own shard: no collective
            x[1] = 3e38 * torch.sign(w[w.abs().sum(1).argmax()])  # its largest row: |w| sums to > 1.13 (3.4e38 / 3e38)


def data() -> DataLoader:
    """The same 320 samples for every fit (tensor parallel: one data-parallel rank, the one-process batches)."""
    gen = torch.Generator().manual_seed(1)
    n = 320
    x, y = torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)
    return DataLoader(TensorDataset(x, y, torch.ones(n, 1)), batch_size=4)


def guard(**sections: Any) -> NaNGuard:
    recovery = {"snapshot_every": 4, "confirm_after": 4, **sections.pop("recovery", {})}
    return NaNGuard(logging={"loggers": False, "verbose": False}, recovery=recovery, **sections)


def scenario(name: str, rank: int) -> tuple[list[pl.Callback], dict[str, Any], int]:
    """The callbacks (before the guard), the model's arguments and the steps of scenario ``name``, poisoned on
    ``rank``."""
    if name in ("backward", "overflow"):
        return [Poison(name, AT, rank)], {}, STEPS
    if name == "input":
        return [FaultInjector(Fault("input", steps=[AT], ranks=[rank]))], {}, STEPS
    return [], {"optimizer": "sgd", "lr": 5.0}, 12


# a fault of each FaultInjector kind (tests/ddp_scripts/sharded_diagnosis.py puts them on one rank)
FAULTS = [Fault("input", steps=[3]), Fault("activation", steps=[6], target="net.0"), Fault("gradient", steps=[9]),
          Fault("parameter", steps=[12], target="net.0.weight"),
          Fault("optimizer_state", steps=[16], target="net.0.weight")]


def fit_single_faults(sync: str, root: Path) -> NaNGuard:
    """``FAULTS`` on one process, eager (AdamW) or ``check.sync: lagged`` (a fused AdamW), 20 steps; the guard."""
    pl.seed_everything(0, verbose=False)
    g = guard(check={"sync": sync})
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=20, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root / sync),
                         callbacks=[FaultInjector(FAULTS), g])
    trainer.fit(Parity(optimizer="fused" if sync == "lagged" else "adamw"), data())
    return g


def fit_single(name: str, root: Path, g: Optional[NaNGuard] = None) -> NaNGuard:
    """Scenario ``name`` on one process; the guard."""
    pl.seed_everything(0, verbose=False)
    callbacks, kwargs, steps = scenario(name, 0)
    g = g or guard()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root / name),
                         callbacks=[*callbacks, g])
    trainer.fit(Parity(**kwargs), data())
    return g
