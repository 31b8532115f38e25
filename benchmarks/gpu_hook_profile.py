"""Where does NaNGuard's step time go on a GPU? Per-hook CPU time, and the wait inside the one sync.

    python benchmarks/gpu_hook_profile.py [d_model] [layers]
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

HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


def timed(guard: NaNGuard) -> dict[str, list[float]]:
    spent: dict[str, list[float]] = {h: [] for h in HOOKS + ("sync_wait",)}
    for name in HOOKS:
        fn = getattr(guard, name)

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            t = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_name].append(time.perf_counter() - t)
        setattr(guard, name, wrapper)
    read = guard._read_flags

    def read_flags(*args, **kwargs):
        if g.CUDA:
            t = time.perf_counter()
            torch.cuda.synchronize()  # the wait the .tolist() would do, measured apart
            spent["sync_wait"].append(time.perf_counter() - t)
        return read(*args, **kwargs)
    guard._read_flags = read_flags
    return spent


def main() -> None:
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    guard = NaNGuard(logging={"events_file": False})
    spent = timed(guard)
    timer = g.StepTimer()
    pl.seed_everything(0, verbose=False)
    g.fit(g.TinyLM(d=d, layers=layers), [timer, guard], steps=40)
    print(f"RESULT d={d} layers={layers} step median {1000 * statistics.median(timer.times[10:] or timer.times):.2f} ms")
    for name, values in spent.items():
        if values:
            print(f"RESULT {name:26s} median {1000 * statistics.median(values[10:] or values):.3f} ms  "
                  f"max {1000 * max(values):.1f} ms  calls {len(values)}")


if __name__ == "__main__":
    main()
