"""What does the guard cost per step under DDP (gloo, CPU, 2 processes), with and without the replica check?

The same workloads as ``overhead.py`` (a small transformer LM and an MLP), trained by ranks launched the way
torchrun launches them (this script starts them), every configuration in the same processes, interleaved:

  plain                    pl.Trainer(strategy="ddp")
  NaNGuard()               the defaults (check.replicas on, replica_compare exact: a checksum of the gradients'
                           bits, 3 numbers in the step's all-reduce, besides the norm fields)
  tolerance                NaNGuard(check={"replica_compare": "tolerance"}): the ranks' norms compared instead
  replicas off             NaNGuard(check={"replicas": False})
  NaNGuard() before        ``--baseline DIR``: another copy of the package (e.g. ``git archive main
                           lightning_nanguard | tar -x -C /tmp/base``)

Rank 0 also times the two passes over the gradients in isolation (one process, after a backward of each
workload): the fused total norm (``total_norm``) and the checksum of their bits (``bits_checksum``, what
``replica_compare: exact`` adds), median of 200 calls each.

``--strategy fsdp2``: the same under Lightning's ``ModelParallelStrategy(data_parallel_size=2)``, every module
holding parameters and the root wrapped with ``fully_shard`` (FSDP2: parameters, gradients and optimizer states are
DTensors sharded over the 2 ranks); plain against ``NaNGuard()`` (no replica check under sharding). Written to
``fsdp2-overhead.md`` and ``.json``.

Per step, each guard's hooks are timed (CPU time and wall time: gloo's all-reduce waits for the other rank, so the
wall time of ``on_before_optimizer_step`` holds the collective), and the guard's collectives and host reads are
counted. Rank 0 writes ``benchmarks/results/ddp-overhead.md`` and ``.json``.

    python benchmarks/ddp_overhead.py --baseline /tmp/base/lightning_nanguard
    python benchmarks/ddp_overhead.py --quick
    python benchmarks/ddp_overhead.py --strategy fsdp2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

WORLD = 2

if "RANK" not in os.environ:  # the launcher: start WORLD ranks of this very script and wait for them
    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), NODE_RANK="0",
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs = [subprocess.Popen([sys.executable, *sys.argv], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                 for r in range(WORLD)]
        sys.exit(max(p.wait() for p in procs))

RANK = int(os.environ["RANK"])

import common  # noqa: E402,F401  (sets up sys.path, threads and warnings first)
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import RESULTS, machine  # noqa: E402
from overhead import HOOKS, StepTimer, load_baseline, workloads  # noqa: E402

import lightning_nanguard  # noqa: E402
from lightning_nanguard import NaNGuard  # noqa: E402

PACKAGES: list[str] = [os.path.dirname(lightning_nanguard.__file__)]
CALLS: list[tuple[str, int]] = []
READS: list[str] = []


def _from_guard(depth: int) -> bool:
    frame = sys._getframe(depth)
    while frame is not None:
        if any(frame.f_code.co_filename.startswith(p) for p in PACKAGES):
            return True
        frame = frame.f_back
    return False


def _count() -> None:
    """Count the collectives the guard issues and the tensors it reads on the host (the originals run)."""
    for name in ("all_reduce", "all_gather_object", "broadcast", "barrier", "all_gather"):
        original = getattr(dist.distributed_c10d, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            if _from_guard(2):
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                CALLS.append((_name, t.numel() if t is not None else -1))
            return _original(*args, **kwargs)

        setattr(dist.distributed_c10d, name, counted)
        setattr(dist, name, counted)
    for name in ("tolist", "item", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def read(t: Any, *args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename  # (outside the generator, whose frame is its own)
            if any(caller.startswith(p) for p in PACKAGES):
                READS.append(_name)
            return _original(t, *args, **kwargs)

        setattr(torch.Tensor, name, read)


def timed(obj: Any, name: str, cpu: list[float], wall: list[float]) -> None:
    method = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        c, w = time.process_time(), time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            cpu.append(1e3 * (time.process_time() - c))
            wall.append(1e3 * (time.perf_counter() - w))

    setattr(obj, name, wrapper)


class Counts(pl.Callback):
    """The guard's collectives and host reads of every step (after the guard in the list)."""

    def __init__(self) -> None:
        self.per_step: list[tuple[list, list]] = []
        self._calls = self._reads = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.per_step.append((CALLS[self._calls:], READS[self._reads:]))
        self._calls, self._reads = len(CALLS), len(READS)


def fully_sharded(model: Any) -> Any:
    """``model`` with a ``configure_model`` that applies FSDP2's ``fully_shard`` to every module holding parameters
    of its own, then to the root, over the data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard

    def configure_model(self: Any) -> None:
        mesh = self.device_mesh["data_parallel"]
        for module in list(self.modules())[1:]:
            own = list(module.parameters(recurse=False))
            if own and not any(hasattr(p, "placements") for p in own):  # (a tied weight is sharded once)
                fully_shard(module, mesh=mesh)
        fully_shard(self, mesh=mesh)

    model.__class__ = type(f"FSDP2{type(model).__name__}", (type(model),), {"configure_model": configure_model})
    return model


def run(make_model: Callable[[], Any], data: Any, guard: Optional[Any], steps: int, root: Path,
        strategy: str = "ddp") -> dict:
    timer, counts = StepTimer(), Counts()
    hooks: dict[str, tuple[list[float], list[float]]] = {}
    if guard is not None:
        for name in HOOKS:
            hooks[name] = ([], [])
            timed(guard, name, *hooks[name])
    pl.seed_everything(0, verbose=False)
    model = make_model()
    if strategy == "fsdp2":
        from pytorch_lightning.strategies import ModelParallelStrategy

        model, chosen = fully_sharded(model), ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    else:
        chosen = strategy
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=chosen, max_steps=steps, max_epochs=10_000,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(root),
                         callbacks=[timer] + ([guard] if guard is not None else []) + [counts])
    trainer.fit(model, data)
    return {"steps": timer.times, "hooks": hooks, "counts": counts.per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp")
    args = parser.parse_args()
    common.single_thread()
    configs: dict[str, Callable[[], Optional[Any]]] = {
        "plain": lambda: None, "NaNGuard()": lambda: NaNGuard(logging={"loggers": False})}
    if args.strategy == "ddp":
        configs["tolerance"] = lambda: NaNGuard(check={"replica_compare": "tolerance"}, logging={"loggers": False})
        configs["replicas off"] = lambda: NaNGuard(check={"replicas": False}, logging={"loggers": False})
    if args.baseline is not None:
        before = load_baseline(args.baseline.resolve())
        PACKAGES.append(str(args.baseline.resolve()))
        configs["NaNGuard() before"] = lambda: before(logging={"loggers": False})
    _count()
    repeats, steps = args.repeats or (1 if args.quick else 3), args.steps or (25 if args.quick else 60)
    root = Path(tempfile.mkdtemp(prefix="nanguard-ddp-overhead-"))
    names = list(configs)
    results: dict[str, dict[str, list[dict]]] = {}
    start = time.perf_counter()
    for workload, (make_model, data) in workloads(args.quick).items():
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                results.setdefault(workload, {}).setdefault(name, []).append(
                    run(make_model, data, configs[name](), steps, root, args.strategy))
        if RANK == 0:
            print(f"  {workload}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    if RANK == 0:
        report(results, names, args, repeats, steps, passes(args.quick))
    dist.barrier()
    os._exit(0)


def passes(quick: bool, calls: int = 200) -> list[dict]:
    """The norm pass and the checksum pass over each workload's gradients, timed alone (ms, median of ``calls``)."""
    from lightning_nanguard.detect.kernels import total_norm
    from lightning_nanguard.detect.replicas import bits_checksum

    rows = []
    for workload, (make_model, data) in workloads(quick).items():
        pl.seed_everything(0, verbose=False)
        model = make_model()
        loss = model.training_step(next(iter(data)), 0)
        loss = loss["loss"] if isinstance(loss, dict) else loss
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        row: dict[str, Any] = {"workload": workload, "tensors": len(grads), "elements": sum(g.numel() for g in grads)}
        for name, fn in (("norm", lambda g=grads: total_norm(g)), ("checksum", lambda g=grads: bits_checksum(g))):
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t))
            row[name] = statistics.median(times)
        row["ratio"] = row["checksum"] / row["norm"]
        rows.append(row)
    return rows


def report(results: dict, names: list[str], args: Any, repeats: int, steps: int, alone: list[dict]) -> None:
    w = args.warmup
    rows = []
    for workload, per in results.items():
        plain = [statistics.median(f["steps"][w:]) for f in per["plain"]]
        for name in names:
            fits = per[name]
            step = [statistics.median(f["steps"][w:]) for f in fits]
            row = {"workload": workload, "config": name, "ms": 1e3 * statistics.median(step),
                   "ratio": statistics.median(s / p for s, p in zip(step, plain))}
            if name != "plain":
                row["hooks_cpu"] = {h: statistics.median(t for f in fits for t in f["hooks"][h][0][w:]) for h in HOOKS}
                row["hooks_wall"] = {h: statistics.median(t for f in fits for t in f["hooks"][h][1][w:]) for h in HOOKS}
                steady = [c for f in fits for c in f["counts"][w:]]
                row["collectives_per_step"] = sorted({repr(c) for c, _ in steady})
                row["host_reads_per_step"] = sorted({repr(r) for _, r in steady})
            rows.append(row)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = "FSDP2 (ModelParallelStrategy, fully_shard)" if args.strategy == "fsdp2" else "DDP"
    lines = [f"{title}, gloo on the CPU, {WORLD} processes x 1 thread: per-step CPU time of rank 0, "
             f"median of {repeats} "
             f"interleaved repeat(s) x {steps - w - 1} steps ({stamp}; {machine()}).", "",
             "| workload | configuration | ms/step | x plain | " + " | ".join(f"{h} (cpu / wall ms)" for h in HOOKS)
             + " | guard's collectives per step | host reads per step |",
             "|---|---|---:|---:|" + "---:|" * len(HOOKS) + "---|---|"]
    for r in rows:
        hooks = [f"{r['hooks_cpu'][h]:.3f} / {r['hooks_wall'][h]:.3f}" if "hooks_cpu" in r else "-" for h in HOOKS]
        lines.append(f"| {r['workload']} | {r['config']} | {r['ms']:.2f} | {r['ratio']:.3f} | " + " | ".join(hooks)
                     + f" | {'; '.join(r.get('collectives_per_step', ['-']))} | "
                       f"{'; '.join(r.get('host_reads_per_step', ['-']))} |")
    lines += ["", "The two passes over the gradients alone (rank 0, one process, ms, median of 200 calls):", "",
              "| workload | gradient tensors | elements | total norm | bits checksum | checksum / norm |",
              "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['workload']} | {r['tensors']} | {r['elements']} | {r['norm']:.3f} | {r['checksum']:.3f} | "
              f"{r['ratio']:.2f} |" for r in alone]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = ("fsdp2-overhead" if args.strategy == "fsdp2" else "ddp-overhead") + ("-quick" if args.quick else "")
    (args.out / f"{stem}.md").write_text(text + "\n", encoding="utf-8")
    summary = {"date": stamp, "machine": machine(), "world": WORLD, "repeats": repeats, "steps": steps, "warmup": w,
               "rows": rows, "passes": alone}
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
