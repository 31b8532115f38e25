"""What does one incident diagnosis cost, in training steps? Side by side, in one process, single-threaded.

On the small transformer LM of ``common.py`` (2 pre-LN layers, d=64, batch 16 x 32 tokens, AdamW) two
incidents are replayed with :func:`lightning_nanguard.diagnose.replay.replay_window`, the machinery
``diagnose(ctx)`` runs on an incident:

  backward  a zero padding row under ``sqrt(sum(h*h))``: forward finite, backward NaN. The most expensive
            path: hooked forward+backward, an anomaly-mode forward+backward with hooks on every autograd
            node, and a float64 forward+backward on a deep copy.
  forward   an Inf planted in the output head: hooked forward, an op-search forward (TorchFunctionMode),
            a float64 forward+backward on a deep copy.

Each replay is timed against a plain training step (zero_grad, training_step, backward, AdamW step) of the
same model on the same batch; timings are interleaved, ``time.process_time()``, median of repeats.

    python benchmarks/diagnosis.py            # ~1 min
    python benchmarks/diagnosis.py --quick    # a few seconds

Writes ``benchmarks/results/diagnosis.json`` and prints a table. The overhead of
``check.activations: always`` on a healthy run is measured by ``benchmarks/overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import common  # noqa: F401  (sets up sys.path, threads and warnings first)
import torch

from common import RESULTS, TinyLM, machine, markov_tokens
from lightning_nanguard.diagnose.replay import replay_window


class PaddedLM(TinyLM):
    """TinyLM plus a norm penalty on the (masked) embeddings; a fully masked row has a NaN backward."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, keep = batch
        h = self.emb(x) * keep[..., None]
        penalty = torch.sqrt((h * h).sum(-1)).mean()
        logits = self.head(self.norm(self.enc(h + self.pos[: x.shape[1]], mask=self.mask, is_causal=True)))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) \
            + 1e-3 * penalty


def _time(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    common.single_thread()
    torch.manual_seed(0)

    x, y = markov_tokens(16, 32, 128).tensors
    keep = torch.ones(16, 32)
    keep[3, 5] = 0.0  # one padding position: sqrt(0) in the penalty
    batch = (x, y, keep)
    model = PaddedLM(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step() -> None:
        opt.zero_grad()
        model.training_step(batch, 0).backward()
        opt.step()

    broken = PaddedLM(dropout=0.0)
    with torch.no_grad():
        broken.head.weight[0, 0] = float("inf")
    rng = {"cpu": torch.get_rng_state()}
    cases: dict[str, Callable[[], Any]] = {
        "train step": train_step,
        "backward replay": lambda: replay_window(None, model, [(batch, 0)], [rng]),
        "backward replay, no float64": lambda: replay_window(None, model, [(batch, 0)], [rng], float64_check=False),
        "forward replay": lambda: replay_window(None, broken, [(batch, 0)], [rng]),
    }
    check = replay_window(None, model, [(batch, 0)], [rng])
    assert check.backward_op and check.backward_op["op"] == "SqrtBackward0", check  # real and localised
    fwd = replay_window(None, broken, [(batch, 0)], [rng])
    assert fwd.forward and fwd.forward["module"] == "head", fwd.forward

    for fn in cases.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(_time(fn))
    step = statistics.median(times["train step"])
    rows = {name: {"median_s": statistics.median(t), "train_steps": statistics.median(t) / step}
            for name, t in times.items()}
    result = {"machine": machine(), "repeats": repeats, "model": "TinyLM d=64 2 layers, batch 16x32",
              "culprits": {"backward": [check.nonfinite_grads[:1], check.backward_op["op"]],
                           "forward": [fwd.forward["module"], (fwd.forward_op or {}).get("op")]},
              "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "diagnosis.json").write_text(json.dumps(result, indent=2))
    print(result["machine"])
    print(f"{'case':<30} {'median ms':>10} {'train steps':>12}")
    for name, row in rows.items():
        print(f"{name:<30} {1e3 * row['median_s']:>10.2f} {row['train_steps']:>12.2f}")
    print("culprits:", result["culprits"])


if __name__ == "__main__":
    main()
