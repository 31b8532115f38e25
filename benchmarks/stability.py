"""Does the guard help a run that is going wrong? Seed 001's four causes of NaN and the early blow-ups of
issue 13, each trained with the same seed and data with and without ``NaNGuard()``, against a sane reference.

Cases (``--quick``: fewer epochs):

- ``linear, LR too high``: examples/demo.py's ``nn.Linear`` + SGD at lr=1.5 (the loss grows ~10x per step from
  step 0; NaN at step 37); reference lr=0.05. Also with ``gradient_clip_val=1.0`` and adaptive clipping.
- ``transformer LM, LR too high``: a small causal transformer (common.py ``TinyLM``), SGD + momentum at
  lr=2.0 (NaN within ~30 steps); reference lr=0.5. Also with ``gradient_clip_val=1.0`` and adaptive clipping.
- ``NaN/Inf in the data``: the linear model at a sane lr=0.05, 1% of the rows holding NaN or Inf; reference:
  the clean data.
- ``exploding gradients, 20-layer MLP``: un-normalised, Kaiming init, SGD at lr=0.035: the gradient norm goes
  10, 7, 14, 96, 1.8e3, 1.2e14 over the first steps, then NaN; reference lr=0.0035.
- ``bad initialisation``: the linear model with weights 1e20 times too large (finite); reference: default
  init. The guard cannot fix it: it should say so, naming the parameter, and stop.
- ``tiny GPT-2, SGD lr=100``: 2 pre-LN blocks, d=32; reference SGD lr=1.
- ``tiny GPT-2, AdamW lr=10``: the loss jumps from ~4 to ~2,000 and stays there, never NaN; reference AdamW
  lr=3e-3.
- ``seed 000, un-normalised feature``: a feature column of ~1e20 squared overflows float32; Adam lr=1e-3;
  reference: the column standardised. The data is the cause: no LR cut can help.

Per run: the first event (kind, cause, step), the first step whose loss or gradient norm was non-finite, the
steps lost (optimizer steps whose update was skipped or undone by a rollback), the guard's counters, and the
final loss over the whole (clean) training set against the reference run (``nan``: non-finite weights).

    python benchmarks/stability.py            # ~2-3 min single-threaded
    python benchmarks/stability.py --quick    # one epoch

Writes ``benchmarks/results/stability.md`` and ``stability.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import common  # noqa: F401  (sets up sys.path, threads and warnings first)
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from common import RESULTS, LinearRegression, TinyLM, loader, machine, make_trainer, markov_tokens, regression_data
from tests.models import GPT, DeepMLP, FeatureSquare  # noqa: E402  (shared with the tests that pin these cases)

from lightning_nanguard import NaNGuard

# --------------------------------------------------------------------------------------------------- models


class TooLarge(LinearRegression):
    def __init__(self, lr: float) -> None:
        super().__init__(lr=lr)
        with torch.no_grad():
            self.linear.weight.mul_(1e20)


# ----------------------------------------------------------------------------------------------------- data


def poisoned(data: TensorDataset, fraction: float = 0.01, seed: int = 0) -> TensorDataset:
    x = data.tensors[0].clone()
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(len(x), generator=g)[: int(fraction * len(x))]
    for i, r in enumerate(rows.tolist()):
        x[r, i % x.shape[1]] = float("nan") if i % 2 == 0 else float("inf")
    return TensorDataset(x, data.tensors[1])


def extreme_feature(n: int = 512, features: int = 8, column: int = 5, scale: Optional[float] = 1e20) -> TensorDataset:
    data = regression_data(n, features)
    x = data.tensors[0].clone()
    if scale is not None:
        g = torch.Generator().manual_seed(1)
        x[:, column] = scale * (1 + torch.rand(n, generator=g))
    return TensorDataset(x, data.tensors[1])


def mse(data: TensorDataset) -> Callable[[Any], float]:
    def final(model: Any) -> float:
        x, y = data.tensors
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(x), y))
    return final


def cross_entropy(data: TensorDataset) -> Callable[[Any], float]:
    def final(model: Any) -> float:
        x, y = data.tensors
        model.eval()
        with torch.no_grad():
            logits = model(x)
            return float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    return final


# ---------------------------------------------------------------------------------------------------- cases


@dataclass
class Case:
    name: str
    make: Callable[[], pl.LightningModule]
    data: TensorDataset
    batch: int
    epochs: int
    final_loss: Callable[[Any], float]
    reference: tuple[str, Callable[[], pl.LightningModule], TensorDataset]  # (label, model, data)
    seed: int = 0
    setups: list[str] = field(default_factory=lambda: ["no guard", "NaNGuard()"])


SETUPS: dict[str, tuple[dict[str, Any], Callable[[], Optional[NaNGuard]]]] = {
    "no guard": ({}, lambda: None),
    "clip=1.0": ({"gradient_clip_val": 1.0}, lambda: None),
    "NaNGuard()": ({}, lambda: NaNGuard(logging={"verbose": False})),
    "NaNGuard(adaptive clip always)": ({}, lambda: NaNGuard(clip={"adaptive": "always"}, logging={"verbose": False})),
}
ALL_SETUPS = list(SETUPS)


def cases(quick: bool) -> list[Case]:
    e = (lambda n: 1) if quick else (lambda n: n)
    lin = regression_data()
    mlp = regression_data(1024, 16, seed=7)
    lm = markov_tokens(1024, 32, 128)
    gpt = markov_tokens(512, 16, 64)
    clean = extreme_feature(scale=None)
    return [
        Case("linear, LR too high (SGD lr=1.5)", lambda: LinearRegression(lr=1.5), lin, 32, e(3), mse(lin),
             ("no guard at lr=0.05", lambda: LinearRegression(lr=0.05), lin), setups=ALL_SETUPS),
        Case("transformer LM, LR too high (SGD+momentum lr=2.0)", lambda: TinyLM(lr=2.0, optimizer="sgd"), lm, 16,
             e(3), cross_entropy(lm), ("no guard at lr=0.5", lambda: TinyLM(lr=0.5, optimizer="sgd"), lm),
             setups=ALL_SETUPS),
        Case("NaN/Inf in 1% of the rows (linear, SGD lr=0.05)", lambda: LinearRegression(lr=0.05), poisoned(lin),
             32, e(3), mse(lin), ("no guard on the clean data", lambda: LinearRegression(lr=0.05), lin)),
        Case("exploding gradients (20-layer MLP, SGD lr=0.035)", lambda: DeepMLP(lr=0.035), mlp, 32, e(3),
             mse(mlp), ("no guard at lr=0.0035", lambda: DeepMLP(lr=0.0035), mlp), seed=7),
        Case("bad initialisation (nn.Linear weights x1e20)", lambda: TooLarge(lr=0.05), lin, 32, e(3), mse(lin),
             ("no guard, default init", lambda: LinearRegression(lr=0.05), lin)),
        Case("tiny GPT-2, SGD lr=100", lambda: GPT(100.0, "sgd"), gpt, 16, e(3), cross_entropy(gpt),
             ("no guard at lr=1", lambda: GPT(1.0, "sgd"), gpt)),
        Case("tiny GPT-2, AdamW lr=10", lambda: GPT(10.0, "adamw"), gpt, 16, e(3), cross_entropy(gpt),
             ("no guard at lr=3e-3", lambda: GPT(3e-3, "adamw"), gpt)),
        Case("seed 000: un-normalised feature (Adam lr=1e-3)", lambda: FeatureSquare(1e-3), extreme_feature(), 32,
             e(3), mse(clean), ("no guard, feature standardised", lambda: FeatureSquare(1e-3), clean)),
    ]


# ------------------------------------------------------------------------------------------------------ runs


class Recorder(pl.Callback):
    """Listed before the guard: the loss and total gradient norm of every optimizer step."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms[trainer.global_step] = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss) if loss is not None else float("nan"))


def steps_lost(guard: NaNGuard, total: int) -> int:
    """Optimizer steps whose update was skipped, or applied and later undone by a rollback."""
    applied = set(range(total))
    for e in guard.events:
        if "skip_step" in e.actions:
            applied.discard(e.step)
        if e.details.get("restored_step") is not None and ("rollback" in e.actions or e.actions[-1] in ("stop",
                                                                                                        "raise")):
            applied -= {s for s in applied if e.details["restored_step"] <= s < e.step}
    skipped_batches = sum(e.details.get("skip_batches", 0) for e in guard.events)
    return total - len(applied) + skipped_batches


def run(case: Case, setup: str, root: Path, reference: bool = False) -> dict[str, Any]:
    kwargs, make_guard = SETUPS["no guard" if reference else setup]
    guard = make_guard()
    rec = Recorder()
    pl.seed_everything(case.seed, verbose=False)
    model = (case.reference[1] if reference else case.make)()
    data = case.reference[2] if reference else case.data
    callbacks: list[Any] = [rec] + ([guard] if guard is not None else [])
    trainer = make_trainer(root, callbacks=callbacks, max_epochs=case.epochs, **kwargs)
    trainer.fit(model, loader(data, case.batch))
    finite_weights = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    bad = sorted({i for i, v in enumerate(rec.losses) if not math.isfinite(v)}
                 | {s for s, v in rec.norms.items() if not math.isfinite(v)})
    total = len(rec.losses)
    row: dict[str, Any] = {
        "setup": f"reference: {case.reference[0]}" if reference else setup, "steps": trainer.global_step,
        "final_loss": case.final_loss(model) if finite_weights else float("nan"),
        "first_nonfinite_step": bad[0] if bad else None, "nonfinite_steps": len(bad),
    }
    if guard is not None:
        first = guard.events[0] if guard.events else None
        row["first_event"] = None if first is None else {"kind": first.kind, "cause": first.cause, "step": first.step,
                                                          "culprit": first.culprit, "actions": first.actions}
        row["events"] = len(guard.events)
        row["first_events"] = [{"step": e.step, "kind": e.kind, "cause": e.cause, "actions": e.actions}
                               for e in guard.events[:8]]
        row.update({k: guard.counters.get(k, 0) for k in
                    ("incidents", "spikes", "skipped_steps", "rollbacks", "lr_cuts", "clipped_steps")})
        row["divergences"] = sum(e.kind == "divergence" for e in guard.events)
        row["steps_lost"] = steps_lost(guard, total)
        row["gave_up"] = bool(guard.stopped)
        row["lr_scale"] = guard.lr_scale
        row["suggestion"] = first.suggestion if first is not None else None
    return row


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.4g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one epoch per run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    common.single_thread()
    root = Path(tempfile.mkdtemp(prefix="nanguard-stability-"))

    start = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    for case in cases(args.quick):
        rows = [run(case, setup, root) for setup in case.setups]
        ref = run(case, "no guard", root, reference=True)
        for r in rows:
            r["ratio_to_reference"] = (r["final_loss"] / ref["final_loss"]
                                       if math.isfinite(r["final_loss"]) and ref["final_loss"] > 0 else None)
        results[case.name] = rows + [ref]
        print(f"  {case.name}: done ({time.perf_counter() - start:.0f} s)", flush=True)

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    epochs = 1 if args.quick else 3
    lines = [f"Runs going wrong, {epochs} epoch(s), same seed and data per case ({stamp}; {machine()}; "
             "single-threaded, on a machine shared with other jobs: the numbers are deterministic, the times are not "
             "reported).", "",
             "**Summary, `NaNGuard()` defaults** (first event: kind / cause at step; first non-finite step: without "
             "the guard -> with it; final loss against the reference run)", "",
             "| case | first event | first non-finite step | steps lost | LR cuts | rollbacks | gave up | final loss "
             "| reference | ratio |", "|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for name, rows in results.items():
        plain = next(r for r in rows if r["setup"] == "no guard")
        g = next(r for r in rows if r["setup"] == "NaNGuard()")
        ref = rows[-1]
        ev = g["first_event"]
        first = "-" if ev is None else f"{ev['kind']} / {ev['cause']} at {ev['step']}"
        nonfinite = f"{_fmt(plain['first_nonfinite_step'])} -> {_fmt(g['first_nonfinite_step'])}"
        ratio = "-" if g["ratio_to_reference"] is None else f"{g['ratio_to_reference']:.2f}x"
        lines.append(f"| {name} | {first} | {nonfinite} | {g['steps_lost']} | {g['lr_cuts']} | {g['rollbacks']} | "
                     f"{'yes' if g['gave_up'] else 'no'} | {g['final_loss']:.4g} | {ref['final_loss']:.4g} | {ratio} |")
    lines.append("")
    for name, rows in results.items():
        lines += [f"**{name}**", "",
                  "| setup | final loss | x reference | first non-finite step | non-finite steps | first event "
                  "| events | LR cuts | rollbacks | skipped | clipped | steps lost | gave up |",
                  "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            ratio = "-" if r.get("ratio_to_reference") is None else f"{r['ratio_to_reference']:.2f}"
            if "incidents" in r:
                ev = r["first_event"]
                first = "-" if ev is None else f"{ev['kind']}/{ev['cause']}@{ev['step']}"
                cells = [first, str(r["events"]), str(r["lr_cuts"]), str(r["rollbacks"]), str(r["skipped_steps"]),
                         str(r["clipped_steps"]), str(r["steps_lost"]), "yes" if r["gave_up"] else "no"]
            else:
                cells = ["-"] * 8
            lines.append(f"| {r['setup']} | {r['final_loss']:.4g} | {ratio} | {_fmt(r['first_nonfinite_step'])} | "
                         f"{r['nonfinite_steps']} | " + " | ".join(cells) + " |")
        g = next(r for r in rows if r["setup"] == "NaNGuard()")
        if g.get("suggestion"):
            lines.append(f"\nFirst suggestion: {g['suggestion']}")
        lines.append("")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    (args.out / f"stability{suffix}.md").write_text(table, encoding="utf-8")
    (args.out / f"stability{suffix}.json").write_text(json.dumps(
        {"date": stamp, "machine": machine(), "epochs": epochs, "single_threaded": True,
         "note": "machine shared with other jobs", "results": results}, indent=2,
        default=lambda o: None) + "\n", encoding="utf-8")
    print(f"wrote {args.out / f'stability{suffix}.md'} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
