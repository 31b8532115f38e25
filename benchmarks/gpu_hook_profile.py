"""Where does NaNGuard's step time go on a GPU? Per-hook CPU time, and the wait inside the flag reads.

    python benchmarks/gpu_hook_profile.py [d_model] [layers] [sync]     # sync: auto (default), eager, lagged
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402

import gpu_check as g  # noqa: E402
from lightning_nanguard import NaNGuard  # noqa: E402
from lightning_nanguard.detect.evidence import StepEvidence  # noqa: E402

HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


def timed(guard: NaNGuard) -> dict[str, list[float]]:
    spent: dict[str, list[float]] = {h: [] for h in HOOKS + ("read_wait",)}
    for name in HOOKS:
        fn = getattr(guard, name)

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            t = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_name].append(time.perf_counter() - t)
        setattr(guard, name, wrapper)

    for method in ("read", "take"):  # eager reads at once; lagged takes the previous step's copy
        original = getattr(StepEvidence, method)

        def reading(self, *args, _original=original, **kwargs):
            if g.CUDA and _original.__name__ == "read":
                t = time.perf_counter()
                torch.cuda.synchronize()  # the wait the .tolist() would do, measured apart
                spent["read_wait"].append(time.perf_counter() - t)
            return _original(self, *args, **kwargs)
        setattr(StepEvidence, method, reading)
    return spent


def main() -> None:
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    sync = sys.argv[3] if len(sys.argv) > 3 else "auto"
    guard = NaNGuard(logging={"events_file": False}, check={"sync": sync})
    spent = timed(guard)
    timer = g.Throughput(warmup=10 if g.CUDA else 2)
    pl.seed_everything(0, verbose=False)
    g.fit(g.TinyLM(d=d, layers=layers), [timer, guard], steps=40)
    print(f"RESULT d={d} layers={layers} sync={'lagged' if guard.lagged else 'eager'} "
          f"step {1000 * (timer.per_step or float('nan')):.2f} ms")
    for name, values in spent.items():
        if values:
            print(f"RESULT {name:26s} median {1000 * statistics.median(values[10:] or values):.3f} ms  "
                  f"max {1000 * max(values):.1f} ms  calls {len(values)}")


if __name__ == "__main__":
    main()
