"""Real DDP runs (gloo, CPU) of faults that do not come back and of replicas that disagree; run by
tests/test_replicas.py, one process per rank, launched the way torchrun launches them:

    RANK=r LOCAL_RANK=r WORLD_SIZE=W MASTER_ADDR=... MASTER_PORT=... python ddp_faults.py OUT_DIR

Several short fits run one after the other in the same processes (one spawn per world size). Every fault is on
the last rank only (``ODD``); each rank's host is named ``node<rank>`` (``socket.gethostname`` is patched), so an
event that names the right host names it from the right rank. The fits:

- ``plain`` and ``healthy``: no fault, without and with the guard (bitwise the same); the guard's collectives and
  host reads are counted per step;
- ``faults``: on rank ODD, a module output non-finite once at step 4 (not on the replay), its copy of the reduced
  gradient poisoned with NaN at step 8 (``FaultInjector``'s gradient fault, after the all-reduce) and shifted by a
  finite amount at step 12; ``dropped``: the same data with the gradients of steps 4, 8 and 12 dropped by hand;
- ``unchecked``: the finite shift at step 12 with ``check.replicas: false``: nothing is seen, the replicas differ
  (the guard's collectives and host reads are counted too);
- ``corrupt``: on rank ODD, one element of its copy of the reduced gradient x1.5 + 1e-3 at steps 4 and 12, its
  lowest mantissa bit flipped at step 8 (the exact replica check, eager); ``corrupt_lagged``: the same with
  ``check.sync: lagged`` and a fused AdamW (the guard's collectives and host reads are counted);
- ``tolerant``: the x1.5 + 1e-3 corruption at step 9 with ``check.replica_compare: tolerance``: its norm moves by
  less than ``replica_tolerance``, the step is taken, and the next snapshot finds the replicas' weights apart and
  rolls every rank back;
- ``lagged``: the finite shift at step 9 with ``check.sync: lagged``, ``check.replica_compare: tolerance`` (the
  norms, compared on the device) and a fused AdamW (skipped on the device);
- ``suspect``: module outputs non-finite once at steps 3, 6 and 9 on rank ODD, ``recovery.transient_limit: 3``,
  ``on_suspect_hardware: stop``;
- ``unknown``: ``FaultInjector``'s gradient fault on every rank at steps 3 and 6 (the same element of every copy:
  the copies agree, no rank's replay reproduces it, no rank is known), ``transient_limit: 2``,
  ``on_suspect_hardware: stop``.

Each rank writes ``OUT_DIR/rank{r}.pt``: per fit, events, counters, LR scale, whether the guard stopped, the final
step, weights and optimizer state, and (``healthy``) the guard's collectives and host reads per step.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # (Lightning drops WORLD_SIZE after a fit)
ODD = WORLD - 1
socket.gethostname = lambda: f"node{RANK}"  # noqa: E731  (one host per rank, as on a cluster)

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from common import CALLS, COUNTING, READS, install_counters, save_and_exit  # noqa: E402
from lightning_nanguard import NaNGuard  # noqa: E402
from lightning_nanguard.testing import Fault, FaultInjector  # noqa: E402

STEPS = 16
RARE = {"transient_limit": 10}  # one-off faults that do not make the hardware suspect
install_counters()


class Net(pl.LightningModule):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 1)
        self.fused = fused

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.l2(torch.tanh(self.l1(x))), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02, fused=self.fused)


class OutputOnce(pl.Callback):
    """Rank ODD: the first output element of ``l1`` is NaN once at each of ``steps`` (the replay is clean)."""

    def __init__(self, steps) -> None:
        self.steps, self.fired = set(steps), set()

    def on_train_start(self, trainer, pl_module):
        def hook(module, args, out):
            step = trainer.global_step
            if trainer.global_rank == ODD and step in self.steps and step not in self.fired:
                self.fired.add(step)
                out = out.clone()
                out[0, 0] = float("nan")
                return out
            return None

        pl_module.l1.register_forward_hook(hook)


class ShiftGrad(pl.Callback):
    """Rank ODD: its copy of the reduced gradient (after the all-reduce) shifted by a finite amount at ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_rank == ODD and trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.l1.weight.grad[0, 0] += 0.5


class CorruptGrad(pl.Callback):
    """Rank ODD: one element of its copy of the reduced gradient (after the all-reduce), the smallest in magnitude of
    ``l1.weight``'s, changed at each of ``steps`` ({step: how}): x1.5 + 1e-3 (``scale``) or its lowest mantissa bit
    flipped (``bit``)."""

    def __init__(self, steps: dict) -> None:
        self.steps = dict(steps)

    def on_after_backward(self, trainer, pl_module):
        how = self.steps.get(trainer.global_step)
        if trainer.global_rank == ODD and how is not None:
            with torch.no_grad():
                flat = pl_module.l1.weight.grad.view(-1)
                i = int(flat.abs().argmin())
                if how == "scale":
                    flat[i] = flat[i] * 1.5 + 1e-3
                else:
                    flat.view(torch.int32)[i] ^= 1


class DropSteps(pl.Callback):
    """Every rank: the gradients of ``steps`` dropped by hand (the optimizer skips them)."""

    def __init__(self, steps) -> None:
        self.steps = set(steps)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step in self.steps:
            for p in pl_module.parameters():
                p.grad = None


class Probe(pl.Callback):
    """The guard's cumulative collectives, host reads and snapshots at the end of every batch."""

    def __init__(self, guard) -> None:
        self.guard, self.steps = guard, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({"step": trainer.global_step - 1, "calls": len(CALLS), "reads": len(READS),
                           "snapshots": self.guard.counters["snapshots"] if self.guard is not None else 0})


def guard(check=None, recovery=None) -> NaNGuard:
    return NaNGuard(check=check or {}, logging={"loggers": False, "verbose": False},
                    recovery={"snapshot_every": 4, "confirm_after": 4, **(recovery or {})})


def run(out: Path, name: str, callbacks, g=None, fused=False, count=False) -> dict:
    pl.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD * STEPS * 4, 4, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    probe = Probe(g)
    cbs = list(callbacks) + ([g] if g is not None else []) + [probe]
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(out / name), callbacks=cbs)
    model = Net(fused=fused)
    CALLS.clear()
    READS.clear()
    COUNTING[0] = count
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    COUNTING[0] = False
    opt = trainer.optimizers[0]
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "global_step": trainer.global_step,
        "events": [e.to_dict() for e in g.events] if g is not None else [],
        "counters": dict(g.counters) if g is not None else {},
        "lr_scale": g.lr_scale if g is not None else 1.0,
        "stopped": g.stopped if g is not None else False,
        "steps": probe.steps, "calls": list(CALLS), "reads": list(READS),
    }


def main(out: Path) -> None:
    fits = {
        "plain": run(out, "plain", []),
        "healthy": (lambda g: run(out, "healthy", [], g, count=True))(guard()),
        "faults": run(out, "faults", [OutputOnce([4]), FaultInjector(Fault("gradient", steps=[8], ranks=[ODD])),
                                      ShiftGrad(12)], guard(recovery={"transient_limit": 10})),
        "dropped": run(out, "dropped", [DropSteps([4, 8, 12])]),
        "unchecked": run(out, "unchecked", [ShiftGrad(12)], guard(check={"replicas": False}), count=True),
        "corrupt": run(out, "corrupt", [CorruptGrad({4: "scale", 8: "bit", 12: "scale"})], guard(recovery=RARE)),
        "corrupt_lagged": (lambda g: run(out, "corrupt_lagged", [CorruptGrad({4: "scale", 8: "bit", 12: "scale"})], g,
                                         fused=True, count=True))(guard(check={"sync": "lagged"}, recovery=RARE)),
        "tolerant": run(out, "tolerant", [CorruptGrad({9: "scale"})], guard(check={"replica_compare": "tolerance"})),
        "lagged": run(out, "lagged", [ShiftGrad(9)], guard(check={"sync": "lagged", "replica_compare": "tolerance"}),
                      fused=True),
        "suspect": run(out, "suspect", [OutputOnce([3, 6, 9])],
                       guard(recovery={"transient_limit": 3, "transient_window": 100,
                                       "on_suspect_hardware": "stop"})),
        "unknown": run(out, "unknown", [FaultInjector(Fault("gradient", steps=[3, 6]))],
                       guard(recovery={"transient_limit": 2, "on_suspect_hardware": "stop"})),
    }
    save_and_exit({"rank": RANK, "world": WORLD, "fits": fits}, out / f"rank{RANK}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
