"""Checks only a CUDA machine can make, as one short script (run it where a GPU is lent).

1. Host-device syncs per optimizer step, plain Trainer vs NaNGuard(), counted with
   ``torch.cuda.set_sync_debug_mode("warn")`` (every synchronising CUDA call warns once per call).
2. Step-time ratio NaNGuard() / plain on a small transformer LM (CUDA events, median of repeats).
3. ``16-mixed`` with a real CUDA GradScaler: routine overflows are no incident; a NaN loss is; the
   fused AdamW path (Lightning leaves its grads scaled) is unscaled by the guard and skips cleanly.
4. ``bf16-mixed``: a NaN is a real incident.

    python benchmarks/gpu_check.py            # prints a JSON summary and a table
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_nanguard import NaNGuard  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
CUDA = torch.cuda.is_available()  # without one, a tiny dry run of the same code paths on the CPU


def _sync():
    if CUDA:
        torch.cuda.synchronize()


class TinyLM(pl.LightningModule):
    def __init__(self, vocab=512, d=256, layers=4, poison_steps=(), fused=False, lr=3e-4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, vocab)
        self.poison_steps, self.fused, self.lr = set(poison_steps), fused, lr
        self.step_times: list[float] = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.head(self.enc(self.emb(tokens[:, :-1])))
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        if self.global_step in self.poison_steps:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.fused)


class StepTimer(pl.Callback):
    def __init__(self):
        self.times, self._start = [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _sync()
        self.times.append(time.perf_counter() - self._start)


class SyncCounter(pl.Callback):
    """Counts CUDA sync warnings raised between batch start and batch end."""

    def __init__(self):
        self.per_step: list[int] = []
        self._ctx = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._ctx = warnings.catch_warnings(record=True)
        self._log = self._ctx.__enter__()
        warnings.simplefilter("always")
        if CUDA:
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if CUDA:
            torch.cuda.set_sync_debug_mode("default")
        self._ctx.__exit__(None, None, None)
        self.per_step.append(sum("synchroniz" in str(w.message) for w in self._log))


def data(n=64 * 40, seq=129 if CUDA else 17, vocab=512):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randint(0, vocab, (n, seq), generator=g)), batch_size=64)


def fit(model, callbacks, precision="32-true", steps=40, plugins=None):
    steps = steps if CUDA else min(steps, 8)
    trainer = pl.Trainer(accelerator="cuda" if CUDA else "cpu", devices=1, max_steps=steps, precision=precision if not plugins else None,
                         plugins=plugins, callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tempfile.mkdtemp(prefix="nanguard-gpu-"))
    trainer.fit(model, data())
    return trainer


def main():
    out = {}
    # 1. syncs per step
    syncs = {}
    for name, guard in (("plain", None), ("nanguard", NaNGuard(logging={"events_file": False}))):
        counter = SyncCounter()
        pl.seed_everything(0, verbose=False)
        fit(TinyLM(), [c for c in (guard, counter) if c], steps=12)
        steady = counter.per_step[3:] or counter.per_step
        syncs[name] = statistics.median(steady)
    out["syncs_per_step"] = syncs

    # 2. overhead (interleaved repeats)
    times = {"plain": [], "nanguard": []}
    for rep in range(3):
        for name in ("plain", "nanguard"):
            timer = StepTimer()
            pl.seed_everything(0, verbose=False)
            fit(TinyLM(), [c for c in (timer, NaNGuard(logging={"events_file": False}) if name == "nanguard" else None) if c],
                steps=60)
            times[name].append(statistics.median(timer.times[10:] if CUDA else timer.times))
    med = {k: statistics.median(v) for k, v in times.items()}
    out["step_ms"] = {k: 1000 * v for k, v in med.items()}
    out["overhead_ratio"] = med["nanguard"] / med["plain"]

    # 3. 16-mixed with a real GradScaler, fused and not
    for fused in (False, True):
        guard = NaNGuard(logging={"events_file": False})
        pl.seed_everything(0, verbose=False)
        model = TinyLM(poison_steps=(20 if CUDA else 4,), fused=fused and CUDA)
        trainer = fit(model, [guard], precision="16-mixed", steps=40)
        scaler = trainer.precision_plugin.scaler
        out[f"16-mixed fused={fused}"] = {
            "events": [(e.step, e.kind, e.actions) for e in guard.events],
            "final_scale": float(scaler.get_scale()) if scaler is not None else None,
            "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "skipped_steps": guard.counters["skipped_steps"],
        }
    # 4. bf16-mixed
    guard = NaNGuard(logging={"events_file": False})
    model = TinyLM(poison_steps=(5 if CUDA else 3,))
    fit(model, [guard], precision="bf16-mixed", steps=12)
    out["bf16-mixed"] = {"events": [(e.step, e.kind, e.actions) for e in guard.events],
                         "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}
    out["device"] = torch.cuda.get_device_name() if CUDA else "cpu (dry run)"
    out["torch"] = torch.__version__
    out["lightning"] = pl.__version__
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text)


if __name__ == "__main__":
    main()
