"""How well is the LR cut of issue 41's worst rescue sized? The ``exploding gradients, 20-layer MLP (SGD
lr=0.035)`` case of rescue.py / stability.py (tests.models.DeepMLP, 96 steps of 32 samples, reference lr=0.0035),
taken apart (issue 41, item 4).

Three questions, each answered by runs of the case at several seeds and LRs (the case itself is lr=0.035, seed 7;
the others test whether an answer carries over):

1. **Is the cut too deep or too shallow?** ``NaNGuard()`` with ``recovery.divergence_lr_factor`` at 0.1 (the
   default: the cut lands exactly on the reference LR), 0.2 and 0.316, against the reference and ``clip=1.0``.
2. **Or is it the steps the rescue loses?** The guarded run against the reference LR (lr / 10) trained for the
   same number of applied steps as the guarded run kept (96 minus its steps lost), and ``clip=1.0`` likewise.
3. **Or the rollback target?** ``recovery.snapshot_every`` at 20 (the default), 10 and 5: where the rollback
   lands, and the steps lost.

    python benchmarks/lr_cut_sizing.py      # ~2 min single-threaded

Writes ``benchmarks/results/lr-cut-sizing.md`` and ``lr-cut-sizing.json``.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from datetime import datetime, timezone
from typing import Any, Optional

import common  # noqa: F401  (sets up sys.path, threads and warnings first)
import pytorch_lightning as pl
import torch

from common import RESULTS, loader, machine, make_trainer
from rescue import mse_loss, regression_split
from stability import steps_lost
from tests.models import DeepMLP

from lightning_nanguard import NaNGuard

STEPS = 96  # 3 epochs of 1024 samples in batches of 32
RUNS = [(0.035, 7), (0.035, 5), (0.035, 4), (0.03, 7), (0.03, 5)]  # (lr, seed); the first is the benchmark's case
FACTORS = [0.1, 0.2, 0.316]
SNAPSHOT_EVERY = [20, 10, 5]


def fit(lr: float, seed: int, guard: Optional[dict[str, Any]] = None, **trainer_kw: Any) -> tuple[float, Any]:
    data, held_out = regression_split(1024, 16, 7, 256)
    pl.seed_everything(seed, verbose=False)
    model = DeepMLP(lr=lr)
    g = NaNGuard(logging={"verbose": False}, **guard) if guard is not None else None
    with tempfile.TemporaryDirectory() as root:
        trainer = make_trainer(root, callbacks=[g] if g else [], max_epochs=3, **trainer_kw)
        trainer.fit(model, loader(data, 32, shuffle=True))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return (mse_loss(held_out)(model) if finite else math.nan), g


def guarded(lr: float, seed: int, **recovery: Any) -> dict[str, Any]:
    val, g = fit(lr, seed, {"recovery": recovery} if recovery else {})
    return {"val_loss": val, "events": [f"{e.kind}/{e.cause}@{e.step}" for e in g.events[:4]],
            "lr_scale": g.lr_scale, "steps_lost": steps_lost(g, STEPS),
            "restored": [e.details["restored_step"] for e in g.events if e.details.get("restored_step") is not None]}


def measure() -> list[dict[str, Any]]:
    rows = []
    for lr, seed in RUNS:
        default = guarded(lr, seed)
        kept = STEPS - default["steps_lost"]
        row: dict[str, Any] = {
            "lr": lr, "seed": seed, "reference": fit(lr / 10, seed)[0],
            "clip=1.0": fit(lr, seed, gradient_clip_val=1.0)[0], "guard": default,
            "reference_same_steps": fit(lr / 10, seed, max_steps=kept)[0],
            "clip_same_steps": fit(lr, seed, gradient_clip_val=1.0, max_steps=kept)[0],
            "factors": {str(f): guarded(lr, seed, divergence_lr_factor=f)["val_loss"] for f in FACTORS},
            "snapshot_every": {str(n): guarded(lr, seed, snapshot_every=n) for n in SNAPSHOT_EVERY},
        }
        rows.append(row)
        print(f"lr={lr} seed={seed}: guard {default['val_loss']:.3f}, reference {row['reference']:.3f}", flush=True)
    return rows


def report(rows: list[dict[str, Any]], stamp: str, wall: float) -> str:
    def f(v: float) -> str:
        return f"{v:.3f}"
    lines = [f"LR-cut sizing on the exploding-gradient MLP ({stamp}; {machine()}; single-threaded; "
             f"the losses are deterministic; {wall / 60:.1f} min). Validation MSE on held-out data after {STEPS} "
             "steps; the first row is the benchmark's case.", "",
             "**1-2. The cut's depth, and the steps lost** (`NaNGuard()` with `recovery.divergence_lr_factor` F; "
             "same steps: trained for the steps the guarded run kept)", "",
             "| lr, seed | events | steps lost | NaNGuard() (F=0.1) | F=0.2 | F=0.316 | reference (lr/10) "
             "| reference, same steps | clip=1.0 | clip=1.0, same steps |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g = r["guard"]
        lines.append(f"| {r['lr']}, {r['seed']} | {', '.join(g['events']) or '-'} | {g['steps_lost']} | "
                     f"{f(g['val_loss'])} | {f(r['factors']['0.2'])} | {f(r['factors']['0.316'])} | "
                     f"{f(r['reference'])} | {f(r['reference_same_steps'])} | {f(r['clip=1.0'])} | "
                     f"{f(r['clip_same_steps'])} |")
    lines += ["", "**3. The rollback target** (`recovery.snapshot_every` N: val loss, steps lost, restored step)", "",
              "| lr, seed | " + " | ".join(f"N={n}" for n in SNAPSHOT_EVERY) + " |",
              "|---|" + "---|" * len(SNAPSHOT_EVERY)]
    for r in rows:
        cells = [f"{f(s['val_loss'])}, lost {s['steps_lost']}, from {s['restored'] or '-'}"
                 for s in (r["snapshot_every"][str(n)] for n in SNAPSHOT_EVERY)]
        lines.append(f"| {r['lr']}, {r['seed']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    start = time.perf_counter()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = measure()
    wall = time.perf_counter() - start
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lr-cut-sizing.json").write_text(json.dumps({"stamp": stamp, "rows": rows}, indent=1, default=str))
    text = report(rows, stamp, wall)
    (RESULTS / "lr-cut-sizing.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
