"""What do known-good snapshots cost? Memory per rank, the stall of a snapshot step, and a rollback.

Three parts (``--only`` picks some):

``stores``: the stores alone, single-threaded, at 1M / 10M / 50M parameters (an MLP of Linear layers with AdamW,
module + optimizer state as NaNGuard stores it), against one training step (forward, backward, AdamW):

- a memory snapshot (``MemoryStore.take``: ``copy_`` into preallocated buffers), first (allocates) and steady,
  CPU time, median; a rollback (``load`` + ``load_state_dict`` of module and optimizer), CPU time, median;
- a disk snapshot written on the step (``DiskStore(background=False)``: ``torch.save``, ``fsync``, rename, as
  before issue 20) and the part of a background one that stays on the step (the host copy), wall time, median;
- from these, the bandwidths the projections use (host copy, disk write).

``ddp``: real fits with 1, 2 and 4 gloo ranks (Lightning's ``ddp`` launcher; the ``--worker`` mode of this
script), a 5.3M-parameter MLP with Adam (61 MiB of state), ``snapshot_every: 8``, ``keep_snapshots: 2``: for no
guard, memory and disk snapshots (and, with ``--before DIR``, the same with another copy of the package, e.g. the
code before issue 20):

- the extra peak host memory per rank: ``VmHWM`` of each rank against the same run without the guard (separate
  processes: a process's peak cannot be reset);
- the step that takes a snapshot against a normal step (wall time between consecutive ``on_train_batch_start``,
  rank 0, medians), and the three steps after it (a disk write in flight);
- a rollback (``guard.snapshots.restore`` of the newest snapshot after the fit, on every rank: under DDP a
  collective), wall time, median of 3, and ``VmHWM`` after it (since issue 27 a sharded rollback restores in place,
  bucket by bucket: ``--bucket-mib`` sets the bucket; ``--ranks 2 4`` picks the world sizes).

``projection``: host RAM per rank and the stall per snapshot for 125M / 1.3B / 7B-parameter models with Adam
(12 bytes per parameter: fp32 weights and two moments) under DDP x 8 and FSDP x 8, before and after issue 20,
from the bandwidths measured here (and an assumed device-to-host bandwidth, printed as such).

    python benchmarks/snapshot.py                      # everything (~5 min on 2 cores)
    python benchmarks/snapshot.py --quick              # fewer sizes, steps and repeats
    python benchmarks/snapshot.py --before /tmp/base   # /tmp/base/lightning_nanguard: 'before' rows too

Writes ``benchmarks/results/snapshot.md`` and ``snapshot.json`` (``-quick`` for a quick run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

SIZES = {"1M": (512, 4), "10M": (1024, 10), "50M": (2048, 12)}  # width, Linear layers (width x width)
DDP_WIDTH, DDP_LAYERS, DDP_BATCH = 1024, 5, 64  # 5.25M parameters: 61 MiB of state with Adam
MODELS = {"125M": 125e6, "1.3B": 1.3e9, "7B": 7e9}
BYTES_PER_PARAM = 12  # fp32 weights + Adam's exp_avg and exp_avg_sq
D2H_GBPS = 25.0  # ASSUMED pinned device-to-host bandwidth per GPU (not measured: no GPU was lent)


def _status() -> dict[str, float]:
    """VmHWM and VmRSS of this process, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) / 1024
    return out


# ------------------------------------------------------------------------------------------------- worker


def worker(config: dict) -> None:
    """One fit under Lightning's launcher (re-run for every rank with the same arguments); each rank writes
    ``<out>/rank<r>.json``."""
    # the package measured (another copy with --before), first on the path before anything imports it
    sys.path.insert(0, config.get("package") or str(Path(__file__).resolve().parents[1]))
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    import lightning_nanguard
    from lightning_nanguard import NaNGuard

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(DDP_WIDTH, DDP_WIDTH) for _ in range(DDP_LAYERS)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-5)

    class Steps(pl.Callback):
        def __init__(self, guard: Optional[NaNGuard]) -> None:
            self.guard, self.starts, self.cpu, self.snapshot_steps, self.seen = guard, [], [], set(), 0

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.starts.append(time.perf_counter())
            self.cpu.append(time.thread_time())  # the training thread's own CPU time (not the writer thread's)

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if self.guard is not None and self.guard.counters["snapshots"] != self.seen:
                self.seen = self.guard.counters["snapshots"]
                self.snapshot_steps.add(len(self.starts) - 1)

    pl.seed_everything(0, verbose=False)
    ranks, steps, mode = config["ranks"], config["steps"], config["mode"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(DDP_BATCH * 8, DDP_WIDTH, generator=g)
    data = TensorDataset(x.repeat(steps * ranks // 8 + 1, 1), x.flip(1).repeat(steps * ranks // 8 + 1, 1))
    out = Path(config["out"])
    guard = None
    if mode != "none":
        guard = NaNGuard(recovery={"snapshot": mode, "snapshot_every": config["every"], "keep_snapshots": 2,
                                   "snapshot_dir": str(out / "snapshots")},
                         logging={"events_file": False, "reports": False, "verbose": False, "loggers": False})
    timer = Steps(guard)
    trainer = pl.Trainer(accelerator="cpu", devices=ranks, strategy="ddp" if ranks > 1 else "auto",
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(out), num_sanity_val_steps=0,
                         callbacks=[guard, timer] if guard is not None else [timer])
    model = MLP()
    trainer.fit(model, DataLoader(data, batch_size=DDP_BATCH))
    result: dict[str, Any] = {"rank": trainer.global_rank, "package": lightning_nanguard.__file__,
                              "status_after_fit": _status()}
    for key, clock in (("", timer.starts), ("cpu_", timer.cpu)):
        durations = [b - a for a, b in zip(clock, clock[1:])]
        snaps = {i for i in timer.snapshot_steps if 5 <= i < len(durations)}
        after = {i + k for i in snaps for k in (1, 2, 3)}
        normal = [d for i, d in enumerate(durations) if i >= 5 and i not in snaps and i not in after]
        result[f"{key}step_ms"] = 1e3 * statistics.median(normal)
        if snaps:
            result[f"{key}snapshot_step_ms"] = 1e3 * statistics.median(durations[i] for i in snaps)
            result[f"{key}next_steps_ms"] = 1e3 * statistics.median(durations[i] for i in after if i < len(durations))
    if guard is not None:
        store = guard.snapshots
        newest = store.newest
        result["held_mib"] = newest.nbytes / 2**20
        result["state_mib"] = getattr(newest, "total_nbytes", newest.nbytes) / 2**20
        result["store"] = type(store).__name__
        if config.get("bucket_mib") and hasattr(store, "bucket_bytes"):
            store.bucket_bytes = int(config["bucket_mib"] * 2**20)
        result["status_before_rollback"] = _status()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            store.restore(newest, trainer, model)
            times.append(time.perf_counter() - start)
        result["rollback_ms"] = 1e3 * statistics.median(times)
        result["status_after_rollback"] = _status()
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, indent=1))
    if ranks > 1:
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # see tests/ddp_scripts/ddp_guard.py: gloo's threads can abort the interpreter's teardown


def ddp_run(ranks: int, mode: str, steps: int, every: int, package: Optional[Path], root: Path,
            bucket_mib: Optional[float] = None) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix=f"snap-{ranks}-{mode}-", dir=root))
    config = {"ranks": ranks, "mode": mode, "steps": steps, "every": every, "out": str(out),
              "package": str(package) if package else None, "bucket_mib": bucket_mib}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(config)], env=env,
                          cwd=str(out), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {config} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def ddp_rows(quick: bool, before: Optional[Path], repeats: int,
             world_sizes: tuple[int, ...] = (1, 2, 4), bucket_mib: Optional[float] = None) -> list[dict]:
    """Every configuration ``repeats`` times (interleaved), each against its own run without the guard; the
    median over the repeats of each number (per rank for memory)."""
    steps, every = (40, 8) if quick else (88, 8)
    codes = [("after", None)] + ([("before", before)] if before else [])
    configs = [(code, package, mode) for code, package in codes for mode in ("memory", "disk")]
    med = statistics.median
    rows = []
    with tempfile.TemporaryDirectory(prefix="nanguard-snapshot-bench-") as tmp:
        root = Path(tmp)
        for ranks in world_sizes:
            seen: dict[tuple, list[tuple[list[dict], list[float]]]] = {c[::2]: [] for c in configs}
            for _ in range(repeats):
                hwm0 = [r["status_after_fit"]["VmHWM"] for r in ddp_run(ranks, "none", steps, every, None, root)]
                for code, package, mode in configs:
                    seen[(code, mode)].append((ddp_run(ranks, mode, steps, every, package, root, bucket_mib), hwm0))
            for (code, mode), reps in seen.items():
                r0s = [runs[0] for runs, _ in reps]
                row = {"ranks": ranks, "mode": mode, "code": code, "store": r0s[0]["store"], "repeats": repeats,
                       "state_mib": r0s[0]["state_mib"], "held_mib": [r["held_mib"] for r in reps[0][0]],
                       "extra_peak_mib": [med(runs[k]["status_after_fit"]["VmHWM"] - h[k] for runs, h in reps)
                                          for k in range(ranks)],
                       "extra_peak_with_rollback_mib": [
                           med(runs[k]["status_after_rollback"]["VmHWM"] - h[k] for runs, h in reps)
                           for k in range(ranks)],
                       "rollback_ms": med(r["rollback_ms"] for r in r0s)}
                for key in ("", "cpu_"):
                    row[f"{key}step_ms"] = med(r[f"{key}step_ms"] for r in r0s)
                    row[f"{key}snapshot_step_ratio"] = med(r[f"{key}snapshot_step_ms"] / r[f"{key}step_ms"]
                                                           for r in r0s)
                    row[f"{key}next_steps_ratio"] = med(r[f"{key}next_steps_ms"] / r[f"{key}step_ms"] for r in r0s)
                rows.append(row)
                print(f"  ddp {ranks} rank(s) {code} {mode}: extra {['%.0f' % e for e in row['extra_peak_mib']]} MiB, "
                      f"snapshot step {row['snapshot_step_ratio']:.2f}x (CPU {row['cpu_snapshot_step_ratio']:.2f}x), "
                      f"rollback {row['rollback_ms']:.0f} ms", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------- stores


def build(width: int, layers: int) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def timed(fn: Callable[[], Any], repeats: int, clock: Callable[[], float] = time.process_time) -> list[float]:
    out = []
    for _ in range(repeats):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def measure(label: str, width: int, layers: int, batch: int, repeats: int, every: int, keep: int) -> dict:
    import torch
    from torch import nn

    from lightning_nanguard.store.snapshots import DiskStore, MemoryStore

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
    step_times = timed(step, repeats)
    step_wall = timed(step, repeats, time.perf_counter)

    def state() -> dict:
        return {"module": model.state_dict(), "optimizers": [opt.state_dict()], "schedulers": [], "scaler": None}

    store = MemoryStore(keep=keep)
    first = timed(lambda: store.take(0, state(), {"lr_scale": 1.0}), 1)[0]
    for _ in range(keep):  # fill the ring: from here on every take reuses an evicted snapshot's buffers
        store.take(0, state(), {"lr_scale": 1.0})
    steady = timed(lambda: store.take(0, state(), {"lr_scale": 1.0}), repeats)
    steady_wall = timed(lambda: store.take(0, state(), {"lr_scale": 1.0}), repeats, time.perf_counter)

    def rollback() -> None:  # what a rollback does
        loaded = store.load(store.newest)
        model.load_state_dict(loaded["module"])
        opt.load_state_dict(loaded["optimizers"][0])

    rollbacks = timed(rollback, max(2, repeats // 2))
    step()  # still trains after a rollback
    with tempfile.TemporaryDirectory(prefix="nanguard-disk-bench-") as tmp:
        inline = DiskStore(keep=keep, directory=Path(tmp) / "inline", background=False)
        disk_inline = timed(lambda: inline.take(0, state(), {}), max(2, repeats // 2), time.perf_counter)
        background = DiskStore(keep=keep, directory=Path(tmp) / "background")
        background.take(0, state(), {})  # allocates its staging buffers
        background.flush()
        on_step, write = [], []
        for _ in range(max(2, repeats // 2)):
            start = time.perf_counter()
            background.take(0, state(), {})
            on_step.append(time.perf_counter() - start)
            background.flush()  # the write, off the step
            write.append(time.perf_counter() - start)
        background.close()
    one = store.newest.nbytes
    step_s, snap_s = statistics.median(step_times), statistics.median(steady)
    return {
        "size": label, "params": params, "batch": batch, "step_ms": 1e3 * step_s,
        "step_wall_ms": 1e3 * statistics.median(step_wall), "first_snapshot_ms": 1e3 * first,
        "snapshot_ms": 1e3 * snap_s, "snapshot_wall_ms": 1e3 * statistics.median(steady_wall),
        "rollback_ms": 1e3 * statistics.median(rollbacks),
        "snapshot_mb": one / 2**20, "ring_mb": keep * one / 2**20, "snapshot_per_step": snap_s / step_s,
        "amortised_pct": 100 * snap_s / (every * step_s),
        "disk_inline_ms": 1e3 * statistics.median(disk_inline),
        "disk_on_step_ms": 1e3 * statistics.median(on_step), "disk_write_ms": 1e3 * statistics.median(write),
        "copy_gbps": one / statistics.median(steady_wall) / 1e9,
        "disk_gbps": one / statistics.median(disk_inline) / 1e9,
    }


# --------------------------------------------------------------------------------------------- projection


def projection(stores: list[dict], ddp: list[dict]) -> dict:
    """Host RAM per rank and the stall of a snapshot step on a node of 8 GPUs, from the bandwidths measured here
    (host copy, torch.save + fsync on this machine's disk, shared by the node's ranks) and an assumed
    device-to-host bandwidth (:data:`D2H_GBPS`)."""
    big = max(stores, key=lambda r: r["params"])
    copy_gbps, disk_gbps = big["copy_gbps"], big["disk_gbps"]
    d2h = D2H_GBPS * 1e9
    rows = []
    for name, params in MODELS.items():
        state = params * BYTES_PER_PARAM
        for strategy in ("DDP x 8", "FSDP x 8"):
            today = state if strategy == "DDP x 8" else state / 8  # what one rank copies before issue 20
            share = state / 8  # ... and after it (DDP: its share; FSDP: its shard, as before)
            rows.append({
                "model": name, "strategy": strategy, "state_gb": state / 1e9,
                "ram_memory_today_gb": 2 * today / 1e9, "ram_memory_after_gb": 2 * share / 1e9,
                "ram_disk_today_gb": 0.0,  # torch.save streamed the live tensors
                "ram_disk_after_gb": share / 1e9,  # one staging copy of the rank's share
                # memory: the copy to the host, then torch.cuda.synchronize(): the host waits for all of it
                "stall_memory_today_s": today / d2h,
                "stall_memory_after_s": 0.0,  # side stream: no host wait
                "device_copy_after_s": share / d2h,  # overlaps the next forward and backward
                # disk, inline: the copy to the host, then every rank's file through the node's one disk
                "stall_disk_today_s": today / d2h + 8 * today / (disk_gbps * 1e9),
                "stall_disk_after_s": 0.0,  # the copy as for memory; the write on the writer thread
                "write_after_s": 8 * share / (disk_gbps * 1e9),  # the node's writes, off the step
            })
    rebuild = [r for r in ddp if r["code"] == "after" and r["ranks"] > 1 and r["mode"] == "memory"]
    return {"copy_gbps": copy_gbps, "disk_gbps": disk_gbps, "d2h_gbps_assumed": D2H_GBPS,
            "bytes_per_param": BYTES_PER_PARAM, "keep_snapshots": 2, "rows": rows,
            "gloo_rebuild_gbps": [(r["ranks"], r["state_mib"] * 2**20 / (r["rollback_ms"] / 1e3) / 1e9)
                                  for r in rebuild]}


# ------------------------------------------------------------------------------------------------ report


def _fmt_list(values: list[float]) -> str:
    return " / ".join(f"{v:.0f}" for v in values)


def report(out: dict, every: int, keep: int, batch: int) -> str:
    lines: list[str] = []
    if out.get("stores"):
        lines += [f"Stores alone: MLP + AdamW, batch {batch}, 1 thread; snapshot_every={every}, keep_snapshots={keep}; "
                  f"{out['date']}; {out['machine']}. CPU time except where marked wall.", "",
                  "| params | step ms | snapshot ms (first) | snapshot ms | rollback ms | snapshot MiB | ring MiB "
                  "| snapshot / step | amortised % of step | disk inline ms (wall) | disk on the step ms (wall) "
                  "| disk write ms (wall, off the step) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in out["stores"]:
            lines.append(
                f"| {r['params'] / 1e6:.1f}M | {r['step_ms']:.1f} | {r['first_snapshot_ms']:.1f} | "
                f"{r['snapshot_ms']:.1f} | {r['rollback_ms']:.1f} | {r['snapshot_mb']:.0f} | {r['ring_mb']:.0f} | "
                f"{r['snapshot_per_step']:.2f}x | {r['amortised_pct']:.2f}% | {r['disk_inline_ms']:.0f} | "
                f"{r['disk_on_step_ms']:.1f} | {r['disk_write_ms']:.0f} |")
        big = max(out["stores"], key=lambda r: r["params"])
        lines += ["", f"Bandwidths ({big['params'] / 1e6:.0f}M row): host copy into preallocated buffers "
                      f"{big['copy_gbps']:.2f} GB/s, torch.save + fsync {big['disk_gbps']:.2f} GB/s.", ""]
    if out.get("ddp"):
        reps = out["ddp"][0].get("repeats", 1)
        lines += [f"DDP on gloo, {DDP_WIDTH}x{DDP_WIDTH} x {DDP_LAYERS} MLP with Adam (5.25M parameters), batch "
                  f"{DDP_BATCH} per rank, snapshot_every=8, keep_snapshots=2; ranks share 2 CPUs; median of {reps} "
                  "run(s). Step ratios of rank 0: wall time, and the training thread's CPU time (a disk writer "
                  "thread not counted).", "",
                  "| ranks | snapshots | code | state MiB | held per rank MiB | extra peak per rank MiB (VmHWM) "
                  "| with a rollback MiB | step ms | snapshot step / step (wall) | (CPU) | next 3 steps / step "
                  "(wall) | rollback ms |",
                  "|---:|---|---|---:|---|---|---|---:|---:|---:|---:|---:|"]
        for r in out["ddp"]:
            lines.append(
                f"| {r['ranks']} | {r['mode']} | {r['code']} | {r['state_mib']:.0f} | {_fmt_list(r['held_mib'])} | "
                f"{_fmt_list(r['extra_peak_mib'])} | {_fmt_list(r['extra_peak_with_rollback_mib'])} | "
                f"{r['step_ms']:.0f} | {r['snapshot_step_ratio']:.2f}x | {r.get('cpu_snapshot_step_ratio', 0):.2f}x | "
                f"{r['next_steps_ratio']:.2f}x | {r['rollback_ms']:.0f} |")
        lines.append("")
    if out.get("projection"):
        p = out["projection"]
        lines += [f"Projection for a node of 8 GPUs, 2 snapshots kept, {p['bytes_per_param']} bytes per parameter "
                  f"(fp32 weights and Adam's two moments). Measured here: torch.save + fsync {p['disk_gbps']:.2f} GB/s "
                  f"(one disk per node, shared by its ranks). ASSUMED (no GPU was lent): "
                  f"{p['d2h_gbps_assumed']:.0f} GB/s device to host per GPU. Host RAM is per rank; stalls are per "
                  "snapshot, on the host.", "",
                  "| model | strategy | state GB | RAM memory today GB | RAM memory after GB | RAM disk today GB "
                  "| RAM disk after GB | stall memory today s | stall memory after s (device copy, overlapped) "
                  "| stall disk today s | stall disk after s (node's write, off the step) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in p["rows"]:
            lines.append(
                f"| {r['model']} | {r['strategy']} | {r['state_gb']:.1f} | {r['ram_memory_today_gb']:.1f} | "
                f"{r['ram_memory_after_gb']:.1f} | {r['ram_disk_today_gb']:.0f} | {r['ram_disk_after_gb']:.1f} | "
                f"{r['stall_memory_today_s']:.2f} | 0 ({r['device_copy_after_s']:.2f}) | "
                f"{r['stall_disk_today_s']:.0f} | 0 ({r['write_after_s']:.0f}) |")
        rebuild = ", ".join(f"{n} ranks {g:.2f} GB/s" for n, g in p["gloo_rebuild_gbps"])
        if rebuild:
            lines += ["", f"A rollback's rebuild over gloo (TCP on one host, measured above): {rebuild}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1M and 10M, fewer steps and repeats")
    parser.add_argument("--only", nargs="+", choices=["stores", "ddp", "projection"], default=None)
    parser.add_argument("--before", type=Path, default=None,
                        help="a folder holding another lightning_nanguard/ (e.g. git archive of main): 'before' rows")
    parser.add_argument("--batch", type=int, default=64, help="samples per training step (stores)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each DDP configuration (default 2)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes of the DDP part")
    parser.add_argument("--bucket-mib", type=float, default=None,
                        help="the sharded store's bucket for the rollbacks after the fit (default: BUCKET_BYTES)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker))
        return
    import common

    common.single_thread()
    from lightning_nanguard.config import RecoveryConfig

    defaults = RecoveryConfig()
    every, keep = defaults.snapshot_every, defaults.keep_snapshots
    parts = args.only or ["stores", "ddp", "projection"]
    out_dir = args.out or common.RESULTS
    suffix = "-quick" if args.quick else ""
    path = out_dir / f"snapshot{suffix}.json"
    previous = json.loads(path.read_text()) if path.exists() and args.only else {}
    out: dict[str, Any] = {**previous, "machine": common.machine(), "snapshot_every": every, "keep_snapshots": keep}
    if "stores" in parts or "ddp" in parts or "date" not in out:  # the date of the measurements
        out["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    start = time.perf_counter()
    if "stores" in parts:
        repeats = 3 if args.quick else 7
        out["stores"] = []
        for label in (["1M", "10M"] if args.quick else list(SIZES)):
            width, layers = SIZES[label]
            out["stores"].append(measure(label, width, layers, args.batch, repeats, every, keep))
            print(f"  stores {label}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    if "ddp" in parts:
        out["ddp"] = ddp_rows(args.quick, args.before.resolve() if args.before else None,
                              args.repeats or (1 if args.quick else 2), tuple(args.ranks), args.bucket_mib)
    if "projection" in parts and out.get("stores"):
        out["projection"] = projection(out["stores"], out.get("ddp", []))
    table = report(out, every, keep, args.batch)
    print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"snapshot{suffix}.md").write_text(table + "\n", encoding="utf-8")
    path.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out_dir / f'snapshot{suffix}.md'} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
