"""Tampered shares of sharded snapshots on real DDP (gloo, CPU, 2 processes); run by tests/test_snapshot_trust.py.

    python ddp_tampered.py OUT_DIR

Several tiny fits in the same 2 processes, each with snapshots every 5 steps (``keep_snapshots: 3``: steps 5, 10 and
15 at the rollback) and three NaN losses in a row on rank 1 alone (steps 16-18), which roll every rank back at step
18. Once rank 1's share of the step-15 snapshot is written, rank 1 alone tampers with it (``FAULTS``: a flipped byte,
a deleted, truncated, code-carrying or swapped file; in the memory fit, one flipped bit of the share in host memory);
the ``healthy`` fit has no fault and no tampering (its collectives are counted), the ``reference`` fit no tampering.
A probe listed after the guard keeps a deep copy of the training state at each snapshot and right after the rollback.

Each rank writes ``OUT_DIR/tampered-rank{r}.pt``.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2]))
from common import CALLS, COUNTING, install_counters, save_and_exit  # noqa: E402
from tests.tampering import FAULTS  # noqa: E402

from lightning_nanguard import NaNGuard  # noqa: E402
from lightning_nanguard.errors import SnapshotReadWarning  # noqa: E402

install_counters()

STEPS = 24
BAD = (16, 17, 18)  # rank 1's NaN losses: the third rolls back every rank
OUT = Path(sys.argv[1])


class Net(pl.LightningModule):
    def __init__(self, healthy: bool = False) -> None:
        super().__init__()
        self.healthy = healthy
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if not self.healthy and self.global_rank == 1 and self.global_step in BAD:
            loss = loss + torch.tensor(float("nan"))  # finite gradients: only rank 1 can tell
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Probe(pl.Callback):
    """After the guard: rank 1 tampers with its share of step 15 once it is written; the state at every snapshot
    and right after the rollback."""

    def __init__(self, guard: NaNGuard, fault: str) -> None:
        self.guard, self.fault, self.done = guard, fault, False
        self.states: dict[int, dict] = {}
        self.after: list[tuple[int, dict]] = []
        self.snapshots = self.rollbacks = 0

    def _state(self, trainer, pl_module) -> dict:
        return copy.deepcopy({"module": pl_module.state_dict(),
                              "optimizers": [o.state_dict() for o in trainer.optimizers]})

    def on_train_start(self, trainer, pl_module):
        self.on_train_batch_end(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, *args):
        g = self.guard
        if g.counters["snapshots"] != self.snapshots:
            self.snapshots = g.counters["snapshots"]
            self.states[g.snapshots.newest.step] = self._state(trainer, pl_module)
        if g.counters["rollbacks"] != self.rollbacks:
            self.rollbacks = g.counters["rollbacks"]
            self.after.append((g.events[-1].details["restored_step"], self._state(trainer, pl_module)))
        newest = g.snapshots.newest
        if self.fault and not self.done and trainer.global_rank == 1 and newest is not None and newest.step == 15:
            g.snapshots.flush()  # rank 1's share is written (local: no collective)
            share = newest.share
            if self.fault == "memory_bit":
                share.tensors[0].view(-1).view(torch.int32)[0] ^= 1 << 5
            else:
                FAULTS[self.fault][0](share.path, OUT / "code-ran")
            self.done = True


def fit(name: str, fault: str = "", healthy: bool = False) -> dict:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * STEPS * 4, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).tanh()), batch_size=4)
    mode = "memory" if fault == "memory_bit" else "disk"
    guard = NaNGuard(recovery={"snapshot": mode, "snapshot_every": 5, "max_skips": 2, "keep_snapshots": 3},
                     logging={"loggers": False, "verbose": False})
    probe = Probe(guard, fault)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(OUT / name), callbacks=[guard, probe])
    start = len(CALLS)
    COUNTING[0] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Net(healthy), loader)
    COUNTING[0] = False
    return {
        "rank": trainer.global_rank, "global_step": trainer.global_step, "sharded": guard.snapshots.collective,
        "events": [(e.step, e.kind, e.actions, e.details.get("restored_step"), e.details.get("refused"))
                   for e in guard.events],
        "after": probe.after, "states": probe.states,
        "refused": [(r.step, r.reason, r.ranks) for r in guard.snapshots.refused],
        "ring": [s.step for s in guard.snapshots.ring],
        "warned": [str(w.message) for w in caught if issubclass(w.category, SnapshotReadWarning)],
        "calls": CALLS[start:], "snapshots": guard.counters["snapshots"],
        "final": [t.detach().clone() for t in trainer.lightning_module.parameters()],
    }


def main() -> None:
    results = {"healthy": fit("healthy", healthy=True), "reference": fit("reference")}
    for fault in [*FAULTS, "memory_bit"]:
        results[fault] = fit(fault, fault)
    results["code_ran"] = (OUT / "code-ran").exists()
    rank = results["reference"]["rank"]
    save_and_exit(results, OUT / f"tampered-rank{rank}.pt")


if __name__ == "__main__":
    main()
