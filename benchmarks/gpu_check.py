"""Checks only a CUDA machine can make, as one short script (run it where a GPU is lent).

1. Synchronising calls per healthy optimizer step (``torch.cuda.set_sync_debug_mode("warn")`` warns once per
   call), between the start and the end of each batch: a plain Trainer, ``NaNGuard(check={"sync": "eager"})``
   and ``NaNGuard(check={"sync": "lagged"})``, with a fused AdamW, in 32-true and 16-mixed. Target: 0 lagged.
2. Step time of transformer LMs (d=256/512/1024, fused AdamW), plain vs ``NaNGuard()`` (``auto``: lagged on
   CUDA with a fused optimizer) and vs the eager guard, in 32-true and 16-mixed: wall time of the steps after
   the warm-up with one ``synchronize`` at each end (a sync per step would hide what lagged reads remove),
   interleaved repeats, median ratio. Target: <= 1.02x.
3. ``16-mixed`` with a real CUDA GradScaler: routine overflows are no incident; a NaN loss is, for a fused
   and a non-fused AdamW, eager and lagged, with the same events.
4. ``bf16-mixed``: a NaN is a real incident.
5. Snapshots (issue 20): the synchronising calls on the steps that take a memory snapshot against the other steps
   (lagged guard, ``snapshot_every: 4``; the known-good checks before a snapshot still read a flag), and the
   stall of one memory snapshot of a ~1 GB fp32 state (weights + Adam moments of 85M parameters): the host time of
   ``MemoryStore.take`` with the side stream, the same followed by ``torch.cuda.synchronize()`` (what a snapshot
   cost before), and the device-to-host bandwidth the copy reached.

    python benchmarks/gpu_check.py [OUT.json]          # about 5 min on one GPU
    python benchmarks/gpu_check.py --quick [OUT.json]  # d=256 only, one repeat

Without CUDA the same code paths run as a tiny dry run on the CPU (under a minute; lagged is then forced, as
``auto`` reads eagerly on the CPU): the figures mean nothing there, the script only proves it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_nanguard import NaNGuard  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")
CUDA = torch.cuda.is_available()  # without one, a tiny dry run of the same code paths on the CPU
QUIET = {"events_file": False, "reports": False, "verbose": False}


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


class TinyLM(pl.LightningModule):
    def __init__(self, vocab: int = 512, d: int = 256, layers: int = 6, poison_steps: tuple = (), fused: bool = True,
                 lr: float = 3e-4, poison: str = "mul") -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, max(d // 64, 1), 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.poison_steps, self.fused, self.lr, self.poison = set(poison_steps), fused, lr, poison

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.head(self.enc(self.emb(tokens[:, :-1]), is_causal=False))
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        if self.global_step in self.poison_steps:
            loss = loss * float("nan") if self.poison == "mul" else loss + float("nan")
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.fused)


class Throughput(pl.Callback):
    """Wall time from the start of step ``warmup`` to the end of fit, one device sync at each end."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.per_step = warmup, None, None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warmup and self.start is None:
            _sync()
            self.start = time.perf_counter()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        _sync()
        if self.start is not None:
            self.per_step = (time.perf_counter() - self.start) / max(trainer.global_step - self.warmup, 1)


class SyncCounter(pl.Callback):
    """Counts CUDA sync warnings raised from the start of each batch to its end, every callback's hooks included:
    put ``counter`` first in the callback list and ``counter.end`` last."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._ctx: Any = None
        self._log: list = []
        self.end = _EndOfBatch(self)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._ctx = warnings.catch_warnings(record=True)
        self._log = self._ctx.__enter__()
        warnings.simplefilter("always")
        if CUDA:
            torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if CUDA:
            torch.cuda.set_sync_debug_mode("default")
        self._ctx.__exit__(None, None, None)
        self.per_step.append(sum("synchroniz" in str(w.message) for w in self._log))


class _EndOfBatch(pl.Callback):
    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.counter.stop()


def data(n: int = 64 * 40, seq: int = 129 if CUDA else 17, vocab: int = 512, batch: int = 64 if CUDA else 8) -> Any:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randint(0, vocab, (n, seq), generator=g)), batch_size=batch)


def fit(model: pl.LightningModule, callbacks: list, precision: str = "32-true", steps: int = 40,
        plugins: Optional[list] = None) -> pl.Trainer:
    steps = steps if CUDA else min(steps, 8)
    trainer = pl.Trainer(accelerator="cuda" if CUDA else "cpu", devices=1, max_steps=steps, max_epochs=-1,
                         precision=None if plugins else precision, plugins=plugins, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tempfile.mkdtemp(prefix="nanguard-gpu-"))
    trainer.fit(model, data())
    return trainer


def fp16_plugins(precision: str) -> Optional[list]:
    """16-mixed on the CPU dry run needs an explicit GradScaler plugin (else Lightning turns it into bf16)."""
    if precision != "16-mixed" or CUDA:
        return None
    from pytorch_lightning.plugins import MixedPrecision

    return [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]


def guard(sync: Optional[str]) -> Optional[NaNGuard]:
    """None: no guard; "auto": NaNGuard() (lagged on CUDA with a fused optimizer); "eager"/"lagged": forced."""
    if sync is None:
        return None
    if sync == "auto" and not CUDA:
        sync = "lagged"  # the dry run exercises the path auto takes on a GPU
    return NaNGuard(logging=QUIET) if sync == "auto" else NaNGuard(check={"sync": sync}, logging=QUIET)


def sync_counts(d: int) -> dict:
    out = {}
    for precision in ("32-true", "16-mixed"):
        for name in ("plain", "eager", "lagged"):
            counter = SyncCounter()
            g = guard(None if name == "plain" else name)
            pl.seed_everything(0, verbose=False)
            fit(TinyLM(d=d, layers=2), [counter] + ([g] if g else []) + [counter.end], precision, steps=12,
                plugins=fp16_plugins(precision))
            steady = counter.per_step[3:] or counter.per_step
            out[f"{precision} {name}"] = {"median": statistics.median(steady), "max": max(steady),
                                          "lagged": None if g is None else g.lagged}
    return out


def step_times(dims: list[int], repeats: int) -> dict:
    out: dict = {}
    configs = ("plain", "auto", "eager")
    for precision in ("32-true", "16-mixed"):
        for d in dims:
            times: dict[str, list[float]] = {c: [] for c in configs}
            for rep in range(repeats):
                for c in configs[rep % len(configs):] + configs[: rep % len(configs)]:  # rotate the order
                    timer, g = Throughput(warmup=10 if CUDA else 2), guard(None if c == "plain" else c)
                    pl.seed_everything(0, verbose=False)
                    fit(TinyLM(d=d), [timer] + ([g] if g else []), precision, steps=50, plugins=fp16_plugins(precision))
                    times[c].append(timer.per_step or float("nan"))
            ms = {c: 1000 * statistics.median(v) for c, v in times.items()}
            out[f"{precision} d={d}"] = {
                "step_ms": ms,
                "ratio_auto": statistics.median(a / p for a, p in zip(times["auto"], times["plain"])),
                "ratio_eager": statistics.median(e / p for e, p in zip(times["eager"], times["plain"])),
            }
    return out


def mixed_checks() -> dict:
    out = {}
    for fused in (False, True):
        events = {}
        for sync in ("eager", "lagged"):
            g = NaNGuard(check={"sync": sync}, logging=QUIET)
            pl.seed_everything(0, verbose=False)
            model = TinyLM(layers=2, poison_steps=(20 if CUDA else 4,), fused=fused)
            trainer = fit(model, [g], precision="16-mixed", steps=40, plugins=fp16_plugins("16-mixed"))
            scaler = trainer.precision_plugin.scaler
            events[sync] = [(e.step, e.kind, e.actions) for e in g.events]
            out[f"16-mixed fused={fused} {sync}"] = {
                "events": events[sync], "lagged": g.lagged,
                "final_scale": float(scaler.get_scale()) if scaler is not None else None,
                "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                "skipped_steps": g.counters["skipped_steps"]}
        out[f"16-mixed fused={fused} same events"] = events["eager"] == events["lagged"]
    g = NaNGuard(logging=QUIET)
    model = TinyLM(layers=2, poison_steps=(5 if CUDA else 3,))
    fit(model, [g], precision="bf16-mixed", steps=12)
    out["bf16-mixed"] = {"events": [(e.step, e.kind, e.actions) for e in g.events],
                         "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}
    return out


class SnapshotSteps(pl.Callback):
    """After the guard: the indices of the steps at whose end it took a snapshot."""

    def __init__(self, guard: NaNGuard) -> None:
        self.guard, self.seen, self.steps, self.n = guard, 0, set(), 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.guard.counters["snapshots"] != self.seen:
            self.seen = self.guard.counters["snapshots"]
            self.steps.add(self.n)
        self.n += 1


def snapshot_checks() -> dict:
    """Syncs per snapshot step, and the host stall of one memory snapshot with and without waiting for the copy."""
    from lightning_nanguard.store.snapshots import MemoryStore

    counter = SyncCounter()
    g = NaNGuard(check={"sync": "lagged"}, recovery={"snapshot_every": 4}, logging=QUIET)
    steps = SnapshotSteps(g)
    pl.seed_everything(0, verbose=False)
    fit(TinyLM(d=256 if CUDA else 32, layers=2), [counter, g, steps, counter.end], steps=16)
    per = counter.per_step
    snap = [n for i, n in enumerate(per) if i in steps.steps and i > 0]
    other = [n for i, n in enumerate(per) if i not in steps.steps and i > 2]
    out: dict = {"syncs_snapshot_steps": snap, "syncs_other_steps_median": statistics.median(other) if other else None}
    device = "cuda" if CUDA else "cpu"
    n = 85_000_000 // 3 if CUDA else 300_000  # parameters: weights + 2 moments = 12 bytes each
    chunks = [torch.randn(n // 8, device=device) for _ in range(24)]  # 8 "layers" x (weight, exp_avg, exp_avg_sq)
    state = {"module": {f"w{i}": chunks[i] for i in range(8)},
             "optimizers": [{"state": chunks[8:], "param_groups": []}]}
    store = MemoryStore(keep=2)
    for _ in range(3):  # allocate both snapshots' pinned buffers
        store.take(0, state, {})
    store.flush()
    side, blocking = [], []
    for _ in range(5):
        _sync()
        t = time.perf_counter()
        store.take(0, state, {})
        side.append(time.perf_counter() - t)
        store.flush()  # the host waits for the copy here (outside the step): the copy's own time
        copy = time.perf_counter() - t
        _sync()
        t = time.perf_counter()
        store.take(0, state, {})
        _sync()  # before issue 20 a snapshot ended in torch.cuda.synchronize()
        blocking.append(time.perf_counter() - t)
    nbytes = sum(c.numel() * c.element_size() for c in chunks)
    out.update({"state_gb": nbytes / 1e9, "side_stream_host_ms": 1e3 * statistics.median(side),
                "with_synchronize_ms": 1e3 * statistics.median(blocking),
                "d2h_gbps": nbytes / statistics.median(blocking) / 1e9, "last_copy_ms": 1e3 * copy})
    return out


def table(out: dict) -> str:
    lines = ["| precision, model | plain ms | NaNGuard() ms | x plain | eager ms | x plain |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, r in out["step_time"].items():
        ms = r["step_ms"]
        lines.append(f"| {key} | {ms['plain']:.2f} | {ms['auto']:.2f} | {r['ratio_auto']:.3f} | {ms['eager']:.2f} "
                     f"| {r['ratio_eager']:.3f} |")
    lines += ["", "| syncs per healthy step | median | max |", "|---|---:|---:|"]
    lines += [f"| {k} | {v['median']} | {v['max']} |" for k, v in out["syncs_per_step"].items()]
    if "snapshots" in out:
        sn = out["snapshots"]
        lines += ["", f"Snapshots: syncs on snapshot steps {sn['syncs_snapshot_steps']} (other steps, median: "
                      f"{sn['syncs_other_steps_median']}); one memory snapshot of {sn['state_gb']:.2f} GB: host "
                      f"{sn['side_stream_host_ms']:.1f} ms with the side stream, {sn['with_synchronize_ms']:.1f} ms "
                      f"waiting for the copy as before ({sn['d2h_gbps']:.1f} GB/s device to host)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, help="write the JSON summary here too")
    parser.add_argument("--quick", action="store_true", help="d=256 only, one repeat")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    dims = ([256] if args.quick else [256, 512, 1024]) if CUDA else [32]
    repeats = args.repeats or (1 if args.quick or not CUDA else 3)
    out: dict = {"device": torch.cuda.get_device_name() if CUDA else "cpu (dry run)", "torch": torch.__version__,
                 "lightning": pl.__version__}
    out["syncs_per_step"] = sync_counts(256 if CUDA else 32)
    out["step_time"] = step_times(dims, repeats)
    out.update(mixed_checks())
    out["snapshots"] = snapshot_checks()
    out["seconds"] = round(time.perf_counter() - start, 1)
    text = json.dumps(out, indent=1, default=str)
    print(text)
    print(table(out))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
