"""Real ModelParallelStrategy runs (gloo, CPU, 2 ranks): FSDP2 (``fully_shard``) and tensor parallel
(``parallelize_module``), with and without the guard; run by tests/test_fsdp.py, one process per rank, launched
the way torchrun launches them:

    RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python fsdp_guard.py OUT_DIR LAYOUT...

``LAYOUT`` is ``fsdp`` (data_parallel_size=2: parameters, gradients and optimizer states sharded in dim 0, the
last layer's 1-row weight and 1-element bias empty on rank 1), ``tp`` (tensor_parallel_size=2: column-wise then
row-wise, the last bias replicated) or ``2d`` (WORLD_SIZE=4, data_parallel_size=2 x tensor_parallel_size=2: tensor
parallel, then FSDP2 over the data-parallel dim; only ``plain``, ``healthy``, ``faults`` and ``clip``). Several short
fits run one after the other in the same processes, per layout:

- ``plain`` and ``healthy``: no fault, without and with the guard (the guard's collectives and host reads are
  counted per step);
- ``faults``: one fault of each kind of ``FaultInjector`` at its own step: an input (step 3), a module output
  (step 6), a gradient on rank 1 only (step 9), a parameter (step 12, after the update: the next step's loss is
  NaN, a rollback) and an Adam ``exp_avg_sq`` element (step 16, before the update);
- ``one_rank``: on rank 1 only, an input (step 3), a module output (step 7) and a parameter (step 11): the ranks'
  diagnoses differ, and every rank still replays together or not at all;
- ``lagged_fused``, ``lagged_sgd`` and ``eager_fused`` (fsdp): ``check.sync: lagged`` with a fused AdamW (skipped
  on the device) against eager, and with an SGD (applied, then rolled back); an input on rank 1 (step 5) and a
  gradient element on every rank (step 10);
- ``backward``: rank 1's backward makes the gradient NaN at steps 4 and 5, the last (its replay does too): the fit
  ends inside a streak of incidents;
- ``clip``: ``clip.max_norm`` against ``torch.nn.utils.clip_grad_norm_`` on the same DTensor gradients;
- ``ckpt`` and ``resume`` (fsdp): a parameter made NaN on rank 1 only just before a checkpoint is saved (the
  guard rolls back and saves the restored state), and a fit resumed from that checkpoint.

Each rank writes ``OUT_DIR/rank{r}.pt``: per layout and fit, events, counters, the full weights and optimizer
state (``full_tensor()``), and the guard's collectives and host reads per step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from common import CALLS, COUNTING, READS, install_counters, save_and_exit  # noqa: E402
from lightning_nanguard import NaNGuard  # noqa: E402
from lightning_nanguard.testing import Fault, FaultInjector  # noqa: E402

STEPS = 20
FAULTS = [Fault("input", steps=[3]), Fault("activation", steps=[6], target="net.0"),
          Fault("gradient", steps=[9], ranks=[1]), Fault("parameter", steps=[12], target="net.0.weight"),
          Fault("optimizer_state", steps=[16], target="net.0.weight")]
LAGGED = [Fault("input", steps=[5], ranks=[1]), Fault("gradient", steps=[10])]
ONE_RANK = [Fault("input", steps=[3], ranks=[1]), Fault("activation", steps=[7], ranks=[1], target="net.0"),
            Fault("parameter", steps=[11], ranks=[1], target="net.0.weight")]
install_counters()


class Net(pl.LightningModule):
    def __init__(self, layout: str, optimizer: str = "adamw") -> None:
        super().__init__()
        self.layout, self.optimizer = layout, optimizer
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def configure_model(self):
        if self.layout in ("tp", "2d"):
            parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if self.layout == "2d":  # FSDP2 over the data-parallel dim of the 2-D mesh, on top of tensor parallel
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net[2], mesh=mesh)
            fully_shard(self, mesh=mesh)
        elif self.layout == "fsdp":
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net[2], mesh=mesh)
            fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=0.02, fused=self.optimizer == "fused")


class BackwardNaN(pl.Callback):
    """Rank 1, step ``step``: the gradient flowing back out of ``net.0``'s output is NaN (its forward is finite), in
    the step and in a replay of it: a fault of the backward that a replay reproduces."""

    def __init__(self, step: int) -> None:
        self.step, self.handle = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            def hook(module, args, out):
                if out.requires_grad:
                    out.register_hook(lambda g: g * float("nan"))
            self.handle = pl_module.net[0].register_forward_hook(hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class Probe(pl.Callback):
    """The guard's cumulative collectives, host reads and snapshots at the end of every batch."""

    def __init__(self, guard, states: bool = False) -> None:
        self.guard, self.steps, self.states = guard, [], states

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        row = {"step": trainer.global_step - 1, "calls": len(CALLS), "reads": len(READS),
               "snapshots": self.guard.counters["snapshots"] if self.guard is not None else 0}
        if self.states:  # the full weights and Adam state as the step left them (full_tensor: every rank calls it)
            row["state"] = full_state(pl_module, trainer.optimizers[0])
        self.steps.append(row)


class TorchClip(pl.Callback):
    """Before the guard: the gradients as ``torch.nn.utils.clip_grad_norm_`` clips them (on clones), and its norm."""

    def __init__(self, max_norm: float) -> None:
        self.max_norm, self.clipped, self.norms = max_norm, [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = [p for p in pl_module.parameters() if p.grad is not None]
        saved = [p.grad.detach().clone() for p in params]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        self.norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        self.clipped.append([p.grad.full_tensor().clone() for p in params])
        with torch.no_grad():
            for p, g in zip(params, saved):
                p.grad.copy_(g)


class AfterGuard(pl.Callback):
    """After the guard: the gradients it left (clipped) at each step."""

    def __init__(self) -> None:
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([p.grad.full_tensor().clone() for p in pl_module.parameters() if p.grad is not None])


def guard(**sections) -> NaNGuard:
    recovery = {"snapshot_every": 4, "confirm_after": 4, **sections.pop("recovery", {})}
    return NaNGuard(logging={"loggers": False, "verbose": False}, recovery=recovery, **sections)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state(model, opt) -> dict:
    return {"weights": {k: full(v).detach().clone() for k, v in model.state_dict().items()},
            "optimizer": {i: {k: full(v).detach().clone() for k, v in opt.state[p].items()}
                          for i, p in enumerate(model.parameters()) if p in opt.state}}


def run(out: Path, layout: str, name: str, callbacks, g=None, count=False, steps=STEPS, ckpt_path=None,
        checkpoint=None, after=(), states=False, optimizer="adamw") -> dict:
    pl.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD * STEPS * 4, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    probe = Probe(g, states)
    cbs = (list(callbacks) + ([g] if g is not None else []) + list(after) + [probe]
           + ([checkpoint] if checkpoint else []))
    dp = {"tp": 1, "fsdp": WORLD, "2d": 2}[layout]
    strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=WORLD // dp)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=checkpoint is not None, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(out / layout / name), callbacks=cbs)
    model = Net(layout, optimizer)
    CALLS.clear()
    READS.clear()
    COUNTING[0] = count
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4), ckpt_path=ckpt_path)
    COUNTING[0] = False
    final = full_state(model, trainer.optimizers[0])
    return {
        "state": final["weights"], "optimizer": final["optimizer"], "global_step": trainer.global_step,
        "events": [e.to_dict() for e in g.events] if g is not None else [],
        "counters": dict(g.counters) if g is not None else {},
        "stopped": g.stopped if g is not None else False,
        "injected": [(i.step, i.kind, i.where, i.applied) for c in callbacks if isinstance(c, FaultInjector)
                     for i in c.log],
        "steps": probe.steps, "calls": list(CALLS), "reads": list(READS),
    }


def main(out: Path, layouts: list[str]) -> None:
    results = {}
    for layout in layouts:
        if layout == "2d":  # 4 ranks: the healthy pair, the faults, the clip
            torch_clip, after = TorchClip(0.05), AfterGuard()
            results[layout] = {"plain": run(out, layout, "plain", []),
                               "healthy": run(out, layout, "healthy", [], guard(), count=True),
                               "faults": run(out, layout, "faults", [FaultInjector(FAULTS)], guard(), states=True),
                               "clip": run(out, layout, "clip", [torch_clip], guard(clip={"max_norm": 0.05}), steps=3,
                                           after=[after])}
            results[layout]["clip"].update(torch_norms=torch_clip.norms, torch_grads=torch_clip.clipped,
                                           guard_grads=after.grads)
            continue
        fits = {"plain": run(out, layout, "plain", []),
                "healthy": run(out, layout, "healthy", [], guard(), count=True),
                "faults": run(out, layout, "faults", [FaultInjector(FAULTS)], guard(), states=True),
                "one_rank": run(out, layout, "one_rank", [FaultInjector(ONE_RANK)], guard(), states=True)}
        fits["backward"] = run(out, layout, "backward", [BackwardNaN(4), BackwardNaN(5)], guard(), steps=6)
        torch_clip, after = TorchClip(0.05), AfterGuard()
        fits["clip"] = run(out, layout, "clip", [torch_clip], guard(clip={"max_norm": 0.05}), steps=3, after=[after])
        fits["clip"].update(torch_norms=torch_clip.norms, torch_grads=torch_clip.clipped, guard_grads=after.grads)
        if layout == "fsdp":
            for optimizer in ("fused", "sgd"):  # check.sync: lagged: skipped on the device (fused), or rolled back
                fits[f"lagged_{optimizer}"] = run(out, layout, f"lagged_{optimizer}", [FaultInjector(LAGGED)],
                                                  guard(check={"sync": "lagged"}), optimizer=optimizer, states=True)
            fits["eager_fused"] = run(out, layout, "eager_fused", [FaultInjector(LAGGED)], guard(), optimizer="fused")
            checkpoint = ModelCheckpoint(dirpath=str(out / layout / "ckpts"), every_n_train_steps=5,
                                         save_top_k=-1, save_last=False)
            fits["ckpt"] = run(out, layout, "ckpt", [FaultInjector(Fault("parameter", steps=[9], ranks=[1]))], guard(),
                               steps=10, checkpoint=checkpoint, states=True)
            saved = torch.load(out / layout / "ckpts" / "epoch=0-step=10.ckpt" / "meta.pt", weights_only=False)
            fits["ckpt"]["saved_callbacks"] = list(saved.get("callbacks", {}))
            fits["resume"] = run(out, layout, "resume", [], guard(), steps=STEPS,
                                 ckpt_path=str(out / layout / "ckpts" / "epoch=0-step=10.ckpt"))
        results[layout] = fits
    save_and_exit({"rank": RANK, "world": WORLD, "fits": results}, out / f"rank{RANK}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
