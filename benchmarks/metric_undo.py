"""What does backing up the user's metrics cost per optimizer step? (``MetricUndo.arm``, item 1 of issue 12)

A real fit of ``tests.models.MetricsClassifier`` (a ``MeanMetric`` of the loss, a ``MulticlassAccuracy``
logged as a metric object, a ``SumMetric`` of samples seen, and ``self.log("train_loss", on_step=True,
on_epoch=True)``) runs under NaNGuard, with a callback that times every ``MetricUndo.arm`` the guard makes
(``time.perf_counter``, synchronised on CUDA only around the timing, never inside the guard) next to the
whole step. Reports the median per step, on CPU and, where available, CUDA.

    python benchmarks/metric_undo.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import common  # noqa: F401  (sets up sys.path, threads and warnings first)
import pytorch_lightning as pl
import torch

from lightning_nanguard import NaNGuard
from tests.models import MetricsClassifier, classification_data, loader


class ArmTimer(pl.Callback):
    """Listed before the guard: wraps its ``MetricUndo.arm`` with a timer; also times whole steps."""

    def __init__(self, guard: NaNGuard, cuda: bool) -> None:
        self.guard, self.cuda = guard, cuda
        self.arm_s: list[float] = []
        self.step_s: list[float] = []
        self._last = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        undo = self.guard._recovery.metrics
        arm = undo.arm

        def timed(results: Any = None) -> None:
            self._sync()
            t0 = time.perf_counter()
            arm(results)
            self._sync()
            self.arm_s.append(time.perf_counter() - t0)

        undo.arm = timed

    def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self._sync()
        now = time.perf_counter()
        if self._last is not None:
            self.step_s.append(now - self._last)
        self._last = now


def measure(device: str, steps: int = 400) -> tuple[float, float, int]:
    pl.seed_everything(0, verbose=False)
    guard = NaNGuard(logging={"verbose": False})
    timer = ArmTimer(guard, device == "cuda")
    model = MetricsClassifier()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=steps,
                             callbacks=[timer, guard], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp)
        trainer.fit(model, loader(classification_data(n=4096), batch_size=32))
    warm = 20
    tensors = sum(1 for m in [*guard._recovery.metrics.metrics, *trainer.fit_loop.epoch_loop._results.values()]
                  for v in m.metric_state.values() if isinstance(v, torch.Tensor))
    return statistics.median(timer.arm_s[warm:]), statistics.median(timer.step_s[warm:]), tensors


def main() -> None:
    torch.set_num_threads(1)
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        arm, step, tensors = measure(device)
        print(f"{device}: MetricUndo.arm {arm * 1e6:.1f} us per step ({tensors} state tensors: 3 torchmetrics + "
              f"Lightning's logged values), whole step {step * 1e3:.2f} ms ({100 * arm / step:.2f}%)")


if __name__ == "__main__":
    main()
