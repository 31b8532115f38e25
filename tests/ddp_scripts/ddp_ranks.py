"""A real 2-process DDP run (gloo, CPU) in which every fault arises on rank 1 only; run by tests/test_ddp_ranks.py.

    python ddp_ranks.py OUT_DIR [SYNC] [state]

``SYNC`` is ``check.sync`` (default ``eager``); with ``lagged`` the optimizer is a fused AdamW. With ``state`` the
run's one fault is an Adam ``exp_avg_sq`` element made inf on rank 1 alone (``STATE_FAULT_AT``), with the replica
check off (so that only the optimizer-state check before the next snapshot can see it): every rank must take that
check's decision together (a rank that rolled back alone would wait for the others in a collective forever).

Lightning's ``ddp`` launcher re-runs this script for rank 1. On rank 1 only (``FAULTS``, by optimizer step):

- ``loss``: a NaN constant added to the loss (its gradients stay finite: only rank 1's own flag says so);
- ``input``: a NaN written into rank 1's batch, in place (the batch the guard holds is the bad one);
- ``weight``: after the update of the step before, one element of ``head.weight`` becomes NaN on rank 1 alone
  (``FaultInjector(Fault("parameter", ranks=[1]))``): the replicas disagree until the rollback;
- ``gradient``: an all-zero sample in rank 1's batch; ``sqrt`` of its zero norm has an undefined derivative: the
  forward is finite everywhere, the NaN arises in rank 1's backward and reaches every rank through the gradient
  all-reduce.

Each rank writes ``OUT_DIR/rank{r}.pt``: its events (``to_dict()``), counters, LR scale, final weights and
optimizer state, all through the public surface.
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
from lightning_nanguard.testing import Fault, FaultInjector

STEPS = 18
SYNC = sys.argv[2] if len(sys.argv) > 2 else "eager"
STATE = len(sys.argv) > 3 and sys.argv[3] == "state"
# the step (batch) where rank 1's fault shows
FAULTS = {} if STATE else {3: "loss", 6: "input", 10: "weight", 14: "gradient"}
STATE_FAULT_AT = 9  # state: rank 1's exp_avg_sq poisoned before this step's update; a snapshot falls due after it
WEIGHT_WRITTEN_AT = 9  # the injector writes the NaN weight after this step's update: step 10 reads it


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # by batch index (= the optimizer step here: one epoch, every step counted), so that the guard's replay of a
        # step, which may run one step later (lagged reads), reproduces the fault
        fault = FAULTS.get(batch_idx) if self.global_rank == 1 else None
        if fault == "input":
            x.data[1, 2] = float("nan")  # bad data, as from the loader (.data: no version bump, not the step's write)
        elif fault == "gradient":
            x[2] = 0.0
        h = self.proj(x)
        out = self.head(h) + 0.1 * torch.sqrt((h * h).sum(-1, keepdim=True))
        loss = nn.functional.mse_loss(out, y)
        if fault == "loss":
            loss = loss + torch.tensor(float("nan"))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=SYNC == "lagged")


def main(out: Path) -> None:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * STEPS * 4, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    if STATE:
        injector = FaultInjector([Fault("optimizer_state", steps=[STATE_FAULT_AT], target="head.weight", ranks=[1],
                                        value="inf")])
    else:
        injector = FaultInjector([Fault("parameter", steps=[WEIGHT_WRITTEN_AT], target="head.weight", ranks=[1])])
    guard = NaNGuard(recovery={"snapshot_every": 2}, logging={"loggers": False, "verbose": False},
                     check={"sync": SYNC, "divergence": "off", "replicas": not STATE})
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(out), callbacks=[injector, guard])
    model = Net()
    trainer.fit(model, loader)
    opt = trainer.optimizers[0]
    save_and_exit({
        "rank": trainer.global_rank,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "events": [e.to_dict() for e in guard.events],
        "counters": dict(guard.counters),
        "lr_scale": guard.lr_scale,
        "injected": [(i.step, i.kind, i.applied) for i in injector.log],
    }, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
