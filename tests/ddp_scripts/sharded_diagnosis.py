"""Sharded diagnosis as good as one process: real ModelParallelStrategy fits on gloo, run by
tests/test_sharded_diagnosis.py (one spawn of 2 processes for ``fsdp`` and ``tp``, one of 4 for ``2d``).

    python sharded_diagnosis.py OUT_DIR LAYOUT [LAYOUT ...]

Per layout, every scenario of ``parity.SCENARIOS`` (a NaN made by one rank's backward, an overflow in one module, an
LR far too high, a NaN input on one rank: ``parity.py``), poisoned on the last rank of the world (rank 1; on the 2 x 2
mesh rank 3, whose tensor-parallel partner rank 2 computes on the same batch), with the guard's collectives and host
reads counted per step. Then:

- ``fsdp``: ``timeout``: the backward scenario with ``anomaly.replay_timeout`` far too short for its replay;
- ``2d``: ``faults`` and ``lagged``: a fault of each ``FaultInjector`` kind on rank 3 only, eager and with
  ``check.sync: lagged`` (a fused AdamW); ``ckpt`` and ``resume``: a weight made NaN on rank 3 just before a
  distributed checkpoint, and a fit resumed from that checkpoint.

Each rank writes ``OUT_DIR/rank{r}.pt``: per layout and fit, its events (``to_dict()``), counters, final step, whether
its weights are finite, the guard's collectives and host reads per step, and the wall time of each incident's replay.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.strategies import ModelParallelStrategy  # noqa: E402

from common import CALLS, COUNTING, READS, install_counters, save_and_exit  # noqa: E402
from lightning_nanguard.diagnose.diagnoser import Diagnoser  # noqa: E402
from lightning_nanguard.testing import Fault, FaultInjector  # noqa: E402
from parity import FAULTS, SCENARIOS, Parity, data, guard, scenario  # noqa: E402

install_counters()


class Probe(pl.Callback):
    """The guard's cumulative collectives, host reads and snapshots at the end of every batch."""

    def __init__(self, g) -> None:
        self.guard, self.steps = g, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({"step": trainer.global_step - 1, "calls": len(CALLS), "reads": len(READS),
                           "snapshots": self.guard.counters["snapshots"]})


DIAGNOSES: list[float] = []  # the wall time of each diagnosis (the replay, mostly), in seconds


def _timed(original):
    def diagnose(self, ctx):
        start = time.perf_counter()
        try:
            return original(self, ctx)
        finally:
            DIAGNOSES.append(time.perf_counter() - start)
    return diagnose


Diagnoser.diagnose = _timed(Diagnoser.diagnose)


def run(out: Path, layout: str, name: str, callbacks, g, model: Parity, steps: int, checkpoint=None,
        ckpt_path=None) -> dict:
    pl.seed_everything(0, verbose=False)
    probe = Probe(g)
    dp = {"tp": 1, "fsdp": WORLD, "2d": 2}[layout]
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, max_steps=steps, logger=False,
                         strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=WORLD // dp),
                         enable_checkpointing=checkpoint is not None, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(out / layout / name),
                         callbacks=[*callbacks, g, probe] + ([checkpoint] if checkpoint else []))
    DIAGNOSES.clear()
    CALLS.clear()
    READS.clear()
    COUNTING[0] = True
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    COUNTING[0] = False
    finite = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                 for p in model.parameters())
    return {"events": [e.to_dict() for e in g.events], "counters": dict(g.counters), "global_step": trainer.global_step,
            "finite": finite, "steps": probe.steps, "calls": list(CALLS), "reads": list(READS),
            "diagnosis_s": list(DIAGNOSES)}


def main(out: Path, layouts: list[str]) -> None:
    last = WORLD - 1
    results = {}
    for layout in layouts:
        fits = {}
        for name in SCENARIOS:
            callbacks, kwargs, steps = scenario(name, last)
            fits[name] = run(out, layout, name, callbacks, guard(), Parity(layout, **kwargs), steps)
        if layout == "fsdp":
            callbacks, kwargs, steps = scenario("backward", last)
            fits["timeout"] = run(out, layout, "timeout", callbacks, guard(anomaly={"replay_timeout": 1e-6}),
                                  Parity(layout, **kwargs), steps)
        if layout == "2d":
            faults = [replace(f, ranks=[last]) for f in FAULTS]
            fits["faults"] = run(out, layout, "faults", [FaultInjector(faults)], guard(), Parity(layout), 20)
            fits["lagged"] = run(out, layout, "lagged", [FaultInjector(faults)], guard(check={"sync": "lagged"}),
                                 Parity(layout, optimizer="fused"), 20)
            ckpts = out / layout / "ckpts"
            checkpoint = ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=5, save_top_k=-1, save_last=False)
            fits["ckpt"] = run(out, layout, "ckpt", [FaultInjector(Fault("parameter", steps=[9], ranks=[last]))],
                               guard(), Parity(layout), 10, checkpoint=checkpoint)
            fits["resume"] = run(out, layout, "resume", [], guard(), Parity(layout), 20,
                                 ckpt_path=str(ckpts / "epoch=0-step=10.ckpt"))
        results[layout] = fits
    save_and_exit({"rank": RANK, "world": WORLD, "fits": results}, out / f"rank{RANK}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
