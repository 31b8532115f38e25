"""What does an incident's replay cost under FSDP2, against the same replay on one process? Time and peak memory per
rank (gloo, CPU).

An MLP (``--width`` x ``--depth`` ``Linear`` layers with ReLU, about 6.3M parameters by default, 25 MiB in float32)
trains with a norm penalty ``sqrt(sum((h * m)^2))`` on its output; at steps 3, 5 and 7 one sample of the last rank's
batch gets the mask 0: the backward of ``sqrt`` at 0 makes NaN (the ``backward`` scenario of
tests/ddp_scripts/parity.py), an incident that is replayed in full: the recorded pass, the backward's pass (anomaly
mode's tracebacks, a watch on every autograd node) and the float64 pass. Under FSDP2
(``ModelParallelStrategy(data_parallel_size=N)``, every ``Linear`` and the root ``fully_shard``-ed) every rank runs
them together (lockstep) and the float64 pass gathers the whole model in float64 on every rank.

Per rank and incident: the wall time of the diagnosis (the replay and the rules) and of its float64 pass alone, and
the peak resident memory during the diagnosis above the resident memory just before it (``VmHWM`` of
``/proc/self/status``, reset through ``/proc/self/clear_refs``). Medians over the 3 incidents. ``--ranks 1 2 4``: one
process (no strategy), then FSDP2 on 2 and 4 ranks (the ranks share the CPUs: times are for gloo on a small machine).

    python benchmarks/sharded_replay.py                 # --ranks 1 2 4
    python benchmarks/sharded_replay.py --quick         # a 4x smaller model

Writes ``benchmarks/results/sharded-replay.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

STEPS, FAULT_STEPS = 8, (3, 5, 7)


def _launch(world: int, argv: list[str], out: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", SHARDED_REPLAY_OUT=str(out))
    procs = [subprocess.Popen([sys.executable, __file__, *argv], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    if max(p.wait() for p in procs):
        raise SystemExit(f"a rank of the {world}-rank run failed")


def _rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _rank_main(args: argparse.Namespace) -> None:
    import common  # noqa: F401  (sys.path, threads, warnings)
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_nanguard import NaNGuard
    from lightning_nanguard.diagnose import lockstep, replay
    from lightning_nanguard.diagnose.diagnoser import Diagnoser

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sharded = args.layout == "fsdp"
    rows: list[dict[str, float]] = []
    f64: list[float] = []

    original = Diagnoser.diagnose

    def diagnose(self: Any, ctx: Any, events: Any) -> str:
        before = _rss_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        start = time.perf_counter()
        try:
            return original(self, ctx, events)
        finally:
            rows.append({"diagnosis_ms": 1e3 * (time.perf_counter() - start),
                         "peak_mib": (_rss_kib("VmHWM") - before) / 1024})

    Diagnoser.diagnose = diagnose  # type: ignore[method-assign]
    whole = lockstep.whole_float64

    def timed_whole(*a: Any, **k: Any) -> None:
        start = time.perf_counter()
        try:
            whole(*a, **k)
        finally:
            f64.append(1e3 * (time.perf_counter() - start))

    lockstep.whole_float64 = timed_whole  # type: ignore[assignment]
    one = replay.float64_pass

    def timed_one(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return one(*a, **k)
        finally:
            f64.append(1e3 * (time.perf_counter() - start))

    replay.float64_pass = timed_one  # type: ignore[assignment]

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = [nn.Linear(64, args.width), nn.ReLU()]
            for _ in range(args.depth - 2):
                layers += [nn.Linear(args.width, args.width), nn.ReLU()]
            layers.append(nn.Linear(args.width, 8))
            self.net = nn.Sequential(*layers)

        def configure_model(self) -> None:
            if sharded:
                from torch.distributed.fsdp import fully_shard

                for m in self.net:
                    if isinstance(m, nn.Linear):
                        fully_shard(m, mesh=self.device_mesh["data_parallel"])
                fully_shard(self, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y, m = batch
            if self.trainer.global_step in FAULT_STEPS and self.global_rank == world - 1:
                m = m.clone()
                m[1] = 0.0
            h = self.net(x)
            return F.mse_loss(h, y) + 1e-3 * torch.sqrt(((h * m) ** 2).sum(-1)).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._last: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            now = time.perf_counter()
            if self._last is not None and trainer.global_step - 1 not in FAULT_STEPS and trainer.global_step > 1:
                self.times.append(1e3 * (now - self._last))
            self._last = now

    timer = StepTimer()
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    n = world * STEPS * args.batch
    x, y = torch.randn(n, 64, generator=g), torch.randn(n, 8, generator=g)
    guard = NaNGuard(logging={"loggers": False, "verbose": False}, recovery={"max_skips": 10})
    kwargs: dict[str, Any] = {}
    if sharded:
        from pytorch_lightning.strategies import ModelParallelStrategy

        kwargs["strategy"] = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=world, max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer, guard],
                         default_root_dir=tempfile.mkdtemp(), **kwargs)
    model = Net()
    trainer.fit(model, DataLoader(TensorDataset(x, y, torch.ones(n, 1)), batch_size=args.batch))
    events = [e.to_dict() for e in guard.events]
    params = sum(p.numel() for p in model.parameters())
    out = {"rank": rank, "world": world, "layout": args.layout, "params": params, "rows": rows, "float64_ms": f64,
           "step_ms": timer.times,
           "events": [(e["step"], e["cause"], e["culprit"], e["op"], e["rank"]) for e in events]}
    Path(os.environ["SHARDED_REPLAY_OUT"], f"{args.layout}-{world}-rank{rank}.json").write_text(json.dumps(out))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a model of width 512 (about 1.6M parameters)")
    parser.add_argument("--layout", default=None, help=argparse.SUPPRESS)  # set by the launcher for its ranks
    args = parser.parse_args()
    if args.quick:
        args.width = 512
    if "RANK" in os.environ:
        _rank_main(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import RESULTS, machine

    out = Path(tempfile.mkdtemp())
    table, raw = [], []
    for world in args.ranks:
        layout = "single" if world == 1 else "fsdp"
        argv = [a for a in sys.argv[1:]] + ["--layout", layout]
        _launch(world, argv, out)
        for rank in range(world):
            r = json.loads((out / f"{layout}-{world}-rank{rank}.json").read_text())
            raw.append(r)
            table.append((layout, world, rank, _median([x["diagnosis_ms"] for x in r["rows"]]),
                          _median(r["float64_ms"]) if r["float64_ms"] else None,
                          _median([x["peak_mib"] for x in r["rows"]]), _median(r["step_ms"]), r["events"][0],
                          r["params"]))
    params = table[0][-1]
    lines = ["# Incident replay under FSDP2 against one process (`benchmarks/sharded_replay.py`)", "",
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}; gloo.", "",
             f"MLP {args.depth} x `Linear` (width {args.width}), {params / 1e6:.2f}M parameters "
             f"({params * 4 / 2**20:.0f} MiB float32), batch {args.batch} per rank; a NaN made by the last rank's "
             f"backward at steps {', '.join(map(str, FAULT_STEPS))}; medians over the 3 incidents. The float64 pass "
             f"holds the whole model in float64 on each rank that runs it: {params * 8 / 2**20:.0f} MiB, under FSDP2 "
             f"as on one process (the recorded and backward passes hold the rank's shards and the all-gathered "
             f"layer being computed). Peak memory: the growth of the resident set during the diagnosis (memory "
             f"the process had freed before is reused first, so it can stay below the tensors allocated).", "",
             "| run | rank | diagnosis (ms) | of it: float64 pass (ms) | peak memory above before (MiB) "
             "| healthy step (ms) | first event (step, cause, culprit, op, rank) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for layout, world, rank, ms, f64, peak, step, first, _ in table:
        run = "one process" if layout == "single" else f"FSDP2, {world} ranks"
        lines.append(f"| {run} | {rank} | {ms:.0f} | {'-' if f64 is None else f'{f64:.0f}'} | {peak:.1f} | {step:.0f} "
                     f"| {tuple(first)} |")
    lines += ["", "One process: the float64 pass runs on a float64 deep copy. FSDP2: every rank gathers the whole "
              "model in float64 (`full_tensor()`), and the rank that made the fault reruns its micro-batch on it; the "
              "peak is that of the rank's whole diagnosis. A healthy training step, for scale: the median time "
              "between two `on_train_batch_start` calls of steps without an incident."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sharded-replay.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "sharded-replay.json").write_text(json.dumps({"args": vars(args), "runs": raw}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
