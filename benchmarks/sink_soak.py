"""Soak: what the guard writes and how its memory grows over a long faulty fit (issue 24, items 1 and 5).

    python benchmarks/sink_soak.py [--steps 5000] [--every 20] [--max-reports 100] [--full-disk]

A tiny MLP trains ``--steps`` steps with a NaN loss on every ``--every``-th batch (5% of the steps by default:
each an incident, replayed and recorded). Disk snapshots every 50 steps. Reports: the files and bytes under
``<log_dir>/nanguard`` (events.jsonl, incident reports, snapshots), the events recorded, and the process RSS
(``/proc/self/status`` VmRSS) after the first 10% of the steps and at the end. ``--full-disk``: events.jsonl and
every snapshot file go to ``/dev/full`` (one warning each; the lines stay in memory, bounded). ``--every 0``: a
healthy fit (``python benchmarks/sink_soak.py --steps 20000 --every 0``). Results go to
``benchmarks/results/sink-soak*.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from common import RESULTS, single_thread  # noqa: F401  (sets up the path and quiet logs)

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NaNGuard


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class MLP(pl.LightningModule):
    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = every
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        faulty = self.every > 0 and self.global_step % self.every == self.every - 1
        return loss * float("nan") if faulty else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Probe(pl.Callback):
    def __init__(self, at: int) -> None:
        self.at, self.rss_early = at, None

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.at:
            self.rss_early = rss_mib()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--every", type=int, default=20, help="a NaN loss every N steps; 0: a healthy fit")
    ap.add_argument("--max-reports", type=int, default=100)
    ap.add_argument("--full-disk", action="store_true")
    args = ap.parse_args()
    single_thread()
    root = Path(tempfile.mkdtemp(prefix="nanguard-soak-"))
    out = root / "nanguard"
    if args.full_disk:
        out.mkdir(parents=True)
        os.symlink("/dev/full", out / "events.jsonl")

    class FullSnapshots(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            (out / "snapshots").mkdir(parents=True, exist_ok=True)
            for step in range(args.steps + 1):  # wherever a snapshot falls
                os.symlink("/dev/full", out / "snapshots" / f"snapshot-step{step}.pt.tmp")

    guard = NaNGuard(logging={"verbose": False, "max_reports": args.max_reports},
                     recovery={"snapshot": "disk", "snapshot_every": 50})
    probe = Probe(args.steps // 10)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=8, shuffle=True)
    pl.seed_everything(0, verbose=False)
    callbacks = ([FullSnapshots()] if args.full_disk else []) + [guard, probe]
    trainer = pl.Trainer(max_steps=args.steps, max_epochs=-1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(root), callbacks=callbacks)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(MLP(args.every), data)
    wall = time.perf_counter() - start
    files = [p for p in out.rglob("*") if p.is_file() and not p.is_symlink()]
    reports = [p for p in files if p.name.startswith("incident-")]
    jsonl = out / "events.jsonl"
    result = {
        "steps": args.steps, "fault_every": args.every, "max_reports": args.max_reports, "full_disk": args.full_disk,
        "events": len(guard.events), "counters": guard.counters,
        "files_written": len(files), "report_files": len(reports),
        "report_bytes": sum(p.stat().st_size for p in reports),
        "events_jsonl_lines": 0 if jsonl.is_symlink() or not jsonl.exists() else len(jsonl.read_text().splitlines()),
        "events_jsonl_bytes": 0 if jsonl.is_symlink() or not jsonl.exists() else jsonl.stat().st_size,
        "snapshot_files": len([p for p in files if p.name.startswith("snapshot-")]),
        "rss_mib_at_10pct": probe.rss_early, "rss_mib_end": rss_mib(),
        "warnings": sorted({type(w.message).__name__ for w in caught if "nanguard" in str(w.message)}),
        "warning_count": len([w for w in caught if "[nanguard]" in str(w.message)]),
        "snapshot_failures": len(guard.snapshots.failures) if guard.snapshots is not None else 0,
        "wall_s": round(wall, 1),
    }
    result["rss_growth_mib"] = round(result["rss_mib_end"] - result["rss_mib_at_10pct"], 1)
    print(json.dumps(result, indent=2))
    name = ("sink-soak-full-disk.json" if args.full_disk else "sink-soak.json" if args.every
            else f"sink-soak-healthy-{args.steps}.json")
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
