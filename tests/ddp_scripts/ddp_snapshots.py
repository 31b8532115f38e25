"""Sharded snapshots on real DDP (gloo, CPU), N processes; run by tests/test_sharded_snapshots.py.

    python ddp_snapshots.py OUT_DIR N

Two tiny fits in the same N processes, one per ``recovery.snapshot`` mode (``memory``, then ``disk``). Rank 1
alone sees a NaN loss on three batches in a row (``BAD``): the third forces a rollback on every rank. A probe
callback listed after the guard keeps its own unsharded copy of every snapshot the guard takes
(:class:`~lightning_nanguard.store.snapshots.MemoryStore`, the store a single process uses) and, right after the
rollback, compares the restored state with that copy. In the disk fit, rank 1's share of one snapshot cannot be
written (a folder stands where its file goes): rank 1 keeps that share in host memory, and every rank still rolls
back to that snapshot.
After each fit every rank reads the newest snapshot's module (a collective) and the module norms of every
snapshot. Every ``torch.distributed`` collective the guard calls is counted (``ddp_guard.py``'s wrapper).

Each rank writes ``OUT_DIR/snapshots-rank{r}.pt``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
import ddp_guard  # noqa: E402  (wraps every collective, recording whether the guard called it)
from common import save_and_exit  # noqa: E402

from lightning_nanguard import NaNGuard  # noqa: E402
from lightning_nanguard.diagnose.dynamics import norms  # noqa: E402
from lightning_nanguard.errors import SnapshotWriteWarning  # noqa: E402
from lightning_nanguard.store.snapshots import MemoryStore, training_state  # noqa: E402
from lightning_nanguard.core.tree import flatten  # noqa: E402

STEPS = 14
BAD = (7, 8, 9)  # optimizer steps where rank 1's loss is NaN: three incidents in a row, the third rolls back
FAILED_STEP = 6  # disk fit: rank 1 cannot write its share of this snapshot


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 48), nn.Tanh(), nn.Linear(48, 24), nn.Tanh(), nn.Linear(24, 1))
        self.register_buffer("scale", torch.tensor(1.0))  # a buffer: rank 0 keeps it

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x) * self.scale, y)
        if self.global_rank == 1 and self.global_step in BAD:
            loss = loss + torch.tensor(float("nan"))  # finite gradients: only rank 1 can tell
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.9),
                                                   "interval": "step"}}


def tensors(state) -> list[torch.Tensor]:
    return flatten(state)[1]


def same(a, b) -> bool:
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb))


def places(state) -> list[int]:
    """The storage of every tensor of the module and the optimizers (a tensor replaced by a copy moves)."""
    return [t.untyped_storage().data_ptr() for t in tensors([state["module"], state["optimizers"]])]


def module_norms(module_state) -> dict[str, float]:
    named = [(n, t) for n, t in module_state.items() if t.is_floating_point()]
    return dict(zip([n for n, _ in named], norms(t for _, t in named)))


class Probe(pl.Callback):
    """After the guard: an unsharded copy of every snapshot it takes, and the state right after its rollback."""

    def __init__(self, guard: NaNGuard) -> None:
        self.guard = guard
        self.mirror = MemoryStore(keep=100)
        self.seen = self.rollbacks = 0
        self.after_rollback: list[dict] = []
        self.places: list[int] = []  # where the live weights and optimizer state are, at the start of each batch

    def _look(self, trainer, pl_module) -> None:
        guard = self.guard
        if guard.counters["snapshots"] != self.seen:
            self.seen = guard.counters["snapshots"]
            self.mirror.take(guard.snapshots.newest.step, training_state(trainer, pl_module), {})
        if guard.counters["rollbacks"] != self.rollbacks:
            self.rollbacks = guard.counters["rollbacks"]
            restored = guard.events[-1].details["restored_step"]
            live = training_state(trainer, pl_module)
            ref = self.mirror.load(next(s for s in self.mirror.ring if s.step == restored))
            self.after_rollback.append({
                "step": trainer.global_step, "restored_step": restored, "same_as_unsharded": same(ref, live),
                # restored in place: the same tensors as before the rollback hold the snapshot's values
                "in_place": self.places == places(live), "places": len(self.places),
                "weights": [t.clone() for t in tensors(live["module"])],
                "optimizer": [t.clone() for t in tensors(live["optimizers"])]})

    def on_train_start(self, trainer, pl_module):
        self._look(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.places = places(training_state(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._look(trainer, pl_module)


def fit(out: Path, mode: str) -> dict:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * STEPS * 4, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).tanh()), batch_size=4)
    root = out / mode
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if mode == "disk" and rank == 1:  # a folder where rank 1's share of one snapshot goes: its write fails
        (root / "nanguard" / "snapshots" / "rank1" / f"snapshot-step{FAILED_STEP}.pt").mkdir(parents=True)
    guard = NaNGuard(recovery={"snapshot": mode, "snapshot_every": 3, "max_skips": 2, "keep_snapshots": 3},
                     logging={"loggers": False})
    probe = Probe(guard)
    # checkpoints: the guard checks each one, every rank agreeing (one all_reduce of one flag) before it may roll back
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=int(sys.argv[2]), strategy="ddp", max_steps=STEPS,
                         logger=False, enable_checkpointing=True, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(root), callbacks=[guard, probe, ckpt])
    start = len(ddp_guard.CALLS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Net(), loader)
    fit_calls = [(name, numel) for name, from_guard, numel in ddp_guard.CALLS[start:] if from_guard]
    store = guard.snapshots
    newest = store.newest
    mirror_newest = probe.mirror.load(next(s for s in probe.mirror.ring if s.step == newest.step))
    module = store.load_module(newest)  # a collective: every rank rebuilds the module from every rank's share
    store.prepare_norms(norms)  # the snapshots taken since the last incident: one all_reduce
    mirror = {s.step: probe.mirror.load(s) for s in probe.mirror.ring}
    return {
        "world_size": trainer.world_size, "rank": trainer.global_rank, "sharded": store.collective,
        "events": [(e.step, e.kind, e.actions, e.details.get("restored_step")) for e in guard.events],
        "counters": dict(guard.counters), "after_rollback": probe.after_rollback,
        "ring": [s.step for s in store.ring],
        "held": [(s.step, s.nbytes, s.total_nbytes) for s in store.ring],
        "largest": max(t.numel() * t.element_size() for t in tensors(mirror_newest)),
        "load_module_same": same(module, mirror_newest["module"]),
        "norms_same": {s.step: s.norms == module_norms(mirror[s.step]["module"]) for s in store.ring},
        "norms_set": all(s.norms for s in store.ring),
        "calls": fit_calls,
        "failures": list(store.failures),
        "warned": [str(w.message) for w in caught if issubclass(w.category, SnapshotWriteWarning)],
        "files": sorted(p.name for p in (root / "nanguard" / "snapshots" / f"rank{trainer.global_rank}").iterdir())
        if mode == "disk" else [],
        "final": [t.clone() for t in tensors(training_state(trainer, trainer.lightning_module))],
        "checkpoints": sorted(p.name for p in (root / "ckpt").glob("*.ckpt")) if trainer.global_rank == 0 else [],
    }


def main(out: Path) -> None:
    results = {mode: fit(out, mode) for mode in ("memory", "disk")}
    rank = results["memory"]["rank"]
    save_and_exit(results, out / f"snapshots-rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
