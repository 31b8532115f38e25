"""What do known-good snapshots cost? Snapshot and rollback vs one training step at 1M / 10M / 50M parameters.

For each size, an MLP of Linear layers with AdamW (module + optimizer state, as NaNGuard stores it) is trained
for a few steps, then timed, single-threaded, in CPU time:

- one training step (forward, backward, AdamW), median;
- taking a snapshot exactly as the callback does (``state_dict()`` of module and optimizer, then
  ``MemoryStore.take``): the first one (allocates the preallocated CPU buffers) and the steady state
  (``copy_`` into them), median;
- rolling back (``MemoryStore.load`` + ``load_state_dict`` of module and optimizer), median;
- the memory of one snapshot and of the ring (``recovery.keep_snapshots``);
- the amortised cost: steady snapshot time / (``recovery.snapshot_every`` x step time).

    python benchmarks/snapshot.py            # 1M, 10M, 50M (~1-2 min on 2 cores)
    python benchmarks/snapshot.py --quick    # 1M and 10M, fewer repeats

Writes ``benchmarks/results/snapshot.md`` and ``snapshot.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import common  # noqa: F401  (sets up sys.path, threads and warnings first)
import torch
from torch import nn

from common import RESULTS, machine

from lightning_nanguard.config import RecoveryConfig
from lightning_nanguard.recover.snapshots import MemoryStore

SIZES = {"1M": (512, 4), "10M": (1024, 10), "50M": (2048, 12)}  # width, Linear layers (width x width)


def build(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def cpu_time(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return out


def measure(label: str, width: int, layers: int, batch: int, repeats: int, every: int, keep: int) -> dict:
    model, opt = build(width, layers)
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(2):  # optimizer state exists from here on
        step()
    step_times = cpu_time(step, repeats)

    store = MemoryStore(keep=keep)

    def snapshot() -> None:  # what NaNGuard._take_snapshot does
        state = {"module": model.state_dict(), "optimizers": [opt.state_dict()], "schedulers": [], "scaler": None}
        store.take(0, state, {"lr_scale": 1.0})

    first = cpu_time(snapshot, 1)[0]
    for _ in range(keep):  # fill the ring: from here on every take reuses an evicted snapshot's buffers
        snapshot()
    steady = cpu_time(snapshot, repeats)

    def rollback() -> None:  # what NaNGuard._rollback does
        state = store.load(store.newest)
        model.load_state_dict(state["module"])
        opt.load_state_dict(state["optimizers"][0])

    rollbacks = cpu_time(rollback, max(2, repeats // 2))
    step()  # still trains after a rollback
    one = store.newest.nbytes
    step_s, snap_s = statistics.median(step_times), statistics.median(steady)
    return {
        "size": label, "params": params, "batch": batch, "step_ms": 1e3 * step_s, "first_snapshot_ms": 1e3 * first,
        "snapshot_ms": 1e3 * snap_s, "rollback_ms": 1e3 * statistics.median(rollbacks),
        "snapshot_mb": one / 2**20, "ring_mb": keep * one / 2**20, "snapshot_per_step": snap_s / step_s,
        "amortised_pct": 100 * snap_s / (every * step_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1M and 10M only, fewer repeats")
    parser.add_argument("--batch", type=int, default=64, help="samples per training step")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    common.single_thread()
    defaults = RecoveryConfig()
    every, keep = defaults.snapshot_every, defaults.keep_snapshots
    repeats = 3 if args.quick else 7
    sizes = ["1M", "10M"] if args.quick else list(SIZES)

    start = time.perf_counter()
    rows = []
    for label in sizes:
        width, layers = SIZES[label]
        rows.append(measure(label, width, layers, args.batch, repeats, every, keep))
        print(f"  {label}: done ({time.perf_counter() - start:.0f} s)", flush=True)

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Snapshot cost vs one training step (MLP + AdamW, batch {args.batch}, CPU time, 1 thread; "
             f"snapshot_every={every}, keep_snapshots={keep}; {stamp}; {machine()}).", "",
             "| params | step ms | snapshot ms (first) | snapshot ms | rollback ms | snapshot MiB | ring MiB "
             "| snapshot / step | amortised % of step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['params'] / 1e6:.1f}M | {r['step_ms']:.1f} | {r['first_snapshot_ms']:.1f} | "
                     f"{r['snapshot_ms']:.1f} | {r['rollback_ms']:.1f} | {r['snapshot_mb']:.0f} | {r['ring_mb']:.0f} | "
                     f"{r['snapshot_per_step']:.2f}x | {r['amortised_pct']:.2f}% |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    (args.out / f"snapshot{suffix}.md").write_text(table + "\n", encoding="utf-8")
    (args.out / f"snapshot{suffix}.json").write_text(json.dumps(
        {"date": stamp, "machine": machine(), "snapshot_every": every, "keep_snapshots": keep, "rows": rows},
        indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out / f'snapshot{suffix}.md'} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
