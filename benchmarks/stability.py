"""Does the guard help a run that is going wrong? Final loss and incidents at a learning rate that is too high.

Two cases, each trained with the same seed and data under four setups:

- ``transformer LM``: a small causal transformer (benchmarks/common.py ``TinyLM``) with SGD + momentum at
  lr=2.0 (it goes to NaN within ~30 steps; lr=0.5 trains well);
- ``linear``: examples/demo.py's ``nn.Linear`` + SGD at lr=1.5 (NaN within a few steps; lr=0.05 is sane).

Setups: no guard; ``Trainer(gradient_clip_val=1.0)``; ``NaNGuard()`` defaults; ``NaNGuard(clip={"adaptive":
"always"})`` (z-score clipping from the first warmed-up step). Reported: the final loss over the whole
training set (``nan`` when the weights are non-finite), the first step whose training loss was non-finite,
the number of non-finite training losses, and the guard's counters (incidents, loss spikes, skipped steps,
rollbacks, LR cuts, clipped steps; "gave up" when it stopped the run). A row at the sane learning rate is
the reference.

    python benchmarks/stability.py            # ~1-2 min on 2 cores
    python benchmarks/stability.py --quick    # one epoch

Writes ``benchmarks/results/stability.md`` and ``stability.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import common  # noqa: F401  (sets up sys.path, threads and warnings first)
import pytorch_lightning as pl
import torch
from torch import nn

from common import RESULTS, LinearRegression, TinyLM, loader, machine, make_trainer, markov_tokens, regression_data

from lightning_nanguard import NaNGuard


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss) if loss is not None else float("nan"))


SETUPS: dict[str, tuple[dict[str, Any], Callable[[], Optional[NaNGuard]]]] = {
    "no guard": ({}, lambda: None),
    "clip=1.0": ({"gradient_clip_val": 1.0}, lambda: None),
    "NaNGuard()": ({}, lambda: NaNGuard(logging={"verbose": False})),
    "NaNGuard(adaptive clip always)": ({}, lambda: NaNGuard(clip={"adaptive": "always"}, logging={"verbose": False})),
}


def lm_case(epochs: int) -> dict[str, Any]:
    data = markov_tokens(1024, 32, 128)

    def final_loss(model: Any) -> float:
        x, y = data.tensors
        model.eval()
        with torch.no_grad():
            logits = model(x)
            return float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))

    return {"make": lambda lr: TinyLM(lr=lr, optimizer="sgd"), "lr": 2.0, "sane_lr": 0.5, "epochs": epochs,
            "loader": lambda: loader(data, 16), "final_loss": final_loss}


def linear_case(epochs: int) -> dict[str, Any]:
    data = regression_data()

    def final_loss(model: Any) -> float:
        x, y = data.tensors
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(x), y))

    return {"make": lambda lr: LinearRegression(lr=lr), "lr": 1.5, "sane_lr": 0.05, "epochs": epochs,
            "loader": lambda: loader(data, 32), "final_loss": final_loss}


def run(case: dict[str, Any], setup: str, lr: float, root: Path) -> dict[str, Any]:
    kwargs, make_guard = SETUPS[setup]
    guard = make_guard()
    rec = LossRecorder()
    pl.seed_everything(0, verbose=False)
    model = case["make"](lr)
    callbacks: list[Any] = [rec] + ([guard] if guard is not None else [])
    trainer = make_trainer(root, callbacks=callbacks, max_epochs=case["epochs"], **kwargs)
    trainer.fit(model, case["loader"]())
    finite_weights = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    bad = [i for i, v in enumerate(rec.losses) if not math.isfinite(v)]
    row: dict[str, Any] = {
        "setup": setup, "lr": lr, "steps": trainer.global_step,
        "final_loss": case["final_loss"](model) if finite_weights else float("nan"),
        "first_nonfinite_step": bad[0] if bad else None, "nonfinite_losses": len(bad),
    }
    if guard is not None:
        row.update({k: guard.counters.get(k, 0) for k in
                    ("incidents", "spikes", "skipped_steps", "rollbacks", "lr_cuts", "clipped_steps")})
        row["gave_up"] = bool(guard.stopped)
        row["lr_scale"] = guard.lr_scale
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one epoch per run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    common.single_thread()
    epochs = 1 if args.quick else 3
    root = Path(tempfile.mkdtemp(prefix="nanguard-stability-"))
    cases = {"transformer LM (SGD, lr=2.0)": lm_case(epochs), "linear (SGD, lr=1.5)": linear_case(epochs)}

    start = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    for name, case in cases.items():
        rows = [run(case, setup, case["lr"], root) for setup in SETUPS]
        reference = run(case, "no guard", case["sane_lr"], root)
        reference["setup"] = f"reference: no guard at lr={case['sane_lr']}"
        results[name] = rows + [reference]
        print(f"  {name}: done ({time.perf_counter() - start:.0f} s)", flush=True)

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Too-high learning rate, {epochs} epoch(s), same seed and data per case ({stamp}; {machine()}).", ""]
    for name, rows in results.items():
        lines += [f"**{name}**", "",
                  "| setup | final loss | first non-finite step | non-finite losses | incidents | spikes | skipped "
                  "| rollbacks | LR cuts | clipped | gave up |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            guard_cells = ([str(r[k]) for k in ("incidents", "spikes", "skipped_steps", "rollbacks", "lr_cuts",
                                                 "clipped_steps")] + ["yes" if r["gave_up"] else "no"]
                           if "incidents" in r else ["-"] * 7)
            first = "-" if r["first_nonfinite_step"] is None else str(r["first_nonfinite_step"])
            lines.append(f"| {r['setup']} | {r['final_loss']:.4g} | {first} | {r['nonfinite_losses']} | "
                         + " | ".join(guard_cells) + " |")
        lines.append("")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    (args.out / f"stability{suffix}.md").write_text(table, encoding="utf-8")
    (args.out / f"stability{suffix}.json").write_text(json.dumps(
        {"date": stamp, "machine": machine(), "epochs": epochs, "results": results}, indent=2,
        default=lambda o: None) + "\n", encoding="utf-8")
    print(f"wrote {args.out / f'stability{suffix}.md'} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
