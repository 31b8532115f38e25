"""Which signal tells a run that has stopped learning because its steps are too large (issue 41, item 2) from a
healthy one? Measured per step on rescue.py's stalled LMs and on healthy LMs, before any detector is built.

Runs (no guard, rescue.py's text, model and data): stalled: AdamW lr=0.1 pre-LN, AdamW lr=0.03 post-LN;
borderline: AdamW lr=0.01 and 0.03 pre-LN (labelled by their own outcome: stalled when their final validation
loss is over 1.10x the lr=3e-3 reference); healthy: AdamW lr=3e-3 pre-LN and post-LN, lr=3e-3 with warm-up +
cosine, and lr=3e-3 on a cosine schedule with warm restarts at 1x.

Signals, each per optimizer step t (W = the window):

- ``progress``: (mean loss over [t-2W, t-W) - mean loss over [t-W, t)) / std of the loss over [t-W, t): the
  loss's progress over a window against its noise (small: not learning).
- ``progress (2W)``: the same over windows of 2W (defined from step 4W).
- ``loss/H``: the mean loss over [t-W, t) against the unigram entropy H of the training text (the loss of a
  model that ignores the context; ~1: stuck at the unigram level).
- ``max rel update``: the median over [t-W, t) of max over parameters of |p_after - p_before| / |p_before|
  (the parameter that moves most).

    python benchmarks/stall_signals.py            # ~4 min single-threaded
    python benchmarks/stall_signals.py --quick    # fewer steps

Writes ``benchmarks/results/rescue-stall-signals.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import common  # noqa: F401  (sets up sys.path, threads and warnings first)
import pytorch_lightning as pl
import torch

from common import RESULTS, loader, machine, make_trainer
from rescue import BATCH, STEPS, Schedule, TextLM, lm_loss, text_train, text_val, unigram_entropy

WINDOW = 50


class Signals(pl.Callback):
    """The loss and the largest relative parameter update of every optimizer step (host reads: a benchmark)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.rel_update: list[float] = []
        self._before: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        rel = [float((p.detach() - b).norm() / b.norm().clamp_min(1e-12))
               for p, b in zip(pl_module.parameters(), self._before)]
        self.rel_update.append(max(rel))


class Probe(pl.Callback):
    """At a few steps, from a copy of the weights and optimizer state: ``K`` steps on the ``K`` batches just seen, at
    the run's LR and at 1/10 of it; the loss on those batches (eval mode) before and after each. The run itself is
    untouched (its RNG state is restored)."""

    def __init__(self, make: Callable[[], pl.LightningModule], at: list[int], k: int = 20) -> None:
        self.make, self.at, self.k = make, set(at), k
        self.seen: list[Any] = []
        self.found: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen = (self.seen + [batch])[-self.k:]
        step = trainer.global_step
        if step in self.at:
            rng = torch.get_rng_state()
            self.found[step] = {"before": self._loss(pl_module)}
            for factor in (1.0, 0.1):
                self.found[step][f"after x{factor:g}"] = self._probe(pl_module, trainer.optimizers[0], factor)
            torch.set_rng_state(rng)
            pl_module.train()

    def _loss(self, m: Any) -> float:
        m.eval()
        with torch.no_grad():
            return statistics.fmean(float(torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()))
                                    for x, y in self.seen)

    def _probe(self, module: Any, optimizer: Any, factor: float) -> float:
        m = self.make()
        m.load_state_dict(module.state_dict())
        opt = type(optimizer)(m.parameters(), lr=optimizer.param_groups[0]["lr"])
        opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        for g in opt.param_groups:
            g["lr"] *= factor
        m.train()
        for x, y in self.seen:
            loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        return self._loss(m)


def probe_ratios(found: dict[int, dict[str, float]]) -> dict[int, float]:
    """Per probe step: what 1/10 of the LR gains on the batches just seen against what the run's LR gains."""
    out = {}
    for t, pr in sorted(found.items()):
        g1, g01 = pr["before"] - pr["after x1"], pr["before"] - pr["after x0.1"]
        out[t] = g01 / g1 if g1 > 0 else float("inf")
    return out


def rounded(o: Any) -> Any:
    """``o`` with its floats at 5 significant digits (the per-step series stay small on disk)."""
    if isinstance(o, float):
        return float(f"{o:.5g}") if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: rounded(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [rounded(v) for v in o]
    return o


def progress(losses: list[float], t: int, w: int) -> float:
    old, new = losses[t - 2 * w: t - w], losses[t - w: t]
    return (statistics.fmean(old) - statistics.fmean(new)) / max(statistics.pstdev(new), 1e-12)


def series(rec: Signals, entropy: float, w: int) -> dict[str, list[Optional[float]]]:
    n = len(rec.losses)
    out: dict[str, list[Optional[float]]] = {"progress": [], "progress (2W)": [], "loss/H": [], "max rel update": []}
    for t in range(1, n + 1):
        out["progress"].append(progress(rec.losses, t, w) if t >= 2 * w else None)
        out["progress (2W)"].append(progress(rec.losses, t, 2 * w) if t >= 4 * w else None)
        out["loss/H"].append(statistics.fmean(rec.losses[t - w: t]) / entropy if t >= w else None)
        out["max rel update"].append(statistics.median(rec.rel_update[t - w: t]) if t >= w else None)
    return out


# a signal fires when it is on this side of its threshold: progress and loss/H say "stalled" when LOW progress /
# HIGH loss; the relative update when HIGH
STALLED_WHEN = {"progress": "below", "progress (2W)": "below", "loss/H": "above", "max rel update": "above"}


def runs(steps: int) -> list[tuple[str, Callable[[], pl.LightningModule]]]:
    return [
        ("AdamW lr=0.1, pre-LN", lambda: TextLM(0.1)),
        ("AdamW lr=0.03, post-LN", lambda: TextLM(0.03, norm_first=False)),
        ("AdamW lr=0.03, pre-LN", lambda: TextLM(0.03)),
        ("AdamW lr=0.01, pre-LN", lambda: TextLM(0.01)),
        ("AdamW lr=3e-3, pre-LN", lambda: TextLM(3e-3)),
        ("AdamW lr=3e-3, post-LN", lambda: TextLM(3e-3, norm_first=False)),
        ("AdamW lr=3e-3, warm-up + cosine", lambda: TextLM(3e-3, schedule=Schedule(steps - steps // 10,
                                                                                  warmup=steps // 10))),
        ("AdamW lr=3e-3, cosine warm restarts x1", lambda: TextLM(3e-3, schedule=Schedule(steps // 4))),
    ]


def first_fire(values: list[Optional[float]], threshold: float, side: str, start: int) -> Optional[int]:
    for t, v in enumerate(values):
        if t >= start and v is not None and (v < threshold if side == "below" else v > threshold):
            return t
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1/3 of the steps")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    common.single_thread()
    steps = STEPS // 3 if args.quick else STEPS
    root = Path(tempfile.mkdtemp(prefix="nanguard-stall-"))
    data, val = text_train(steps), lm_loss(text_val())
    entropy = unigram_entropy()
    probe_at = [steps // 6, steps // 3, steps // 2, 3 * steps // 4]
    start = time.perf_counter()
    found: dict[str, dict[str, Any]] = {}
    for name, make in runs(steps):
        rec, probe = Signals(), Probe(make, probe_at)
        pl.seed_everything(0, verbose=False)
        model = make()
        make_trainer(root, callbacks=[rec, probe], max_epochs=1).fit(model, loader(data, BATCH, shuffle=False))
        found[name] = {"val_loss": val(model), "signals": series(rec, entropy, WINDOW), "losses": rec.losses,
                       "probe": probe.found}
        print(f"  {name}: val {found[name]['val_loss']:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    ref = found["AdamW lr=3e-3, pre-LN"]["val_loss"]
    for r in found.values():
        r["ratio"] = r["val_loss"] / ref
        r["stalled"] = r["ratio"] > 1.10
    stalled = [n for n, r in found.items() if r["stalled"]]
    healthy = [n for n, r in found.items() if not r["stalled"]]

    # the separation, judged from step 2W on (every signal defined): the healthy runs' extreme against the
    # stalled runs' typical value after their stall set in
    checkpoints = sorted({c for c in (2 * WINDOW, 150, 200, 300, 400, steps) if c <= steps})
    study: dict[str, Any] = {}
    lines_sep = ["| signal | stalled when | healthy extreme (every step where defined) "
                 "| stalled: median over steps >= 2W "
                 "| stalled: weakest run's median | margin | threshold | fires at (stalled runs) |",
                 "|---|---|---:|---:|---:|---:|---:|---|"]
    for sig, side in STALLED_WHEN.items():
        pick = max if side == "above" else min

        def tail(n: str, sig: str = sig) -> list[float]:
            return [v for v in found[n]["signals"][sig][2 * WINDOW - 1:] if v is not None]
        healthy_extreme = pick(pick(tail(n)) for n in healthy)
        per_stalled = {n: statistics.median(tail(n)) for n in stalled}
        weakest = (min if side == "above" else max)(per_stalled.values()) if per_stalled else float("nan")
        margin = (weakest - healthy_extreme) if side == "above" else (healthy_extreme - weakest)
        threshold = (weakest + healthy_extreme) / 2
        fires = {n: first_fire(found[n]["signals"][sig], threshold, side, 2 * WINDOW - 1) for n in found}
        false = [n for n in healthy if fires[n] is not None]
        study[sig] = {"side": side, "healthy_extreme": healthy_extreme, "stalled_medians": per_stalled,
                      "margin": margin, "threshold": threshold, "fires_at": fires, "false_alarms": false}
        at = ", ".join(f"{n.split(', ', 1)[1]}: {fires[n]}" for n in stalled)
        lines_sep.append(f"| {sig} | {side} | {healthy_extreme:.4g} | "
                         f"{statistics.median(v for n in stalled for v in tail(n)):.4g} | {weakest:.4g} | "
                         f"{margin:+.4g} | {threshold:.4g} | {at}"
                         + (f"; FALSE ALARM on {', '.join(false)}" if false else "") + " |")

    ratios = {n: probe_ratios(r["probe"]) for n, r in found.items()}
    healthy_extreme = max(max(ratios[n].values()) for n in healthy)
    per_stalled = {n: statistics.median(ratios[n].values()) for n in stalled}
    weakest = min(per_stalled.values()) if per_stalled else float("nan")
    threshold = (weakest + healthy_extreme) / 2 if math.isfinite(weakest) else healthy_extreme * 1.5
    fires = {n: next((t for t, v in ratios[n].items() if v > threshold), None) for n in found}
    false = [n for n in healthy if fires[n] is not None]
    study["probe gain ratio"] = {"side": "above", "healthy_extreme": healthy_extreme, "stalled_medians": per_stalled,
                                 "margin": weakest - healthy_extreme, "threshold": threshold, "fires_at": fires,
                                 "false_alarms": false, "ratios": ratios}
    at = ", ".join(f"{n.split(', ', 1)[1]}: {fires[n]}" for n in stalled)
    lines_sep.append(f"| probe gain ratio (at steps {', '.join(map(str, probe_at))}) | above | {healthy_extreme:.4g} | "
                     f"{statistics.median(v for n in stalled for v in ratios[n].values()):.4g} | {weakest:.4g} | "
                     f"{weakest - healthy_extreme:+.4g} | {threshold:.4g} | {at}"
                     + (f"; FALSE ALARM on {', '.join(false)}" if false else "") + " |")

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    wall = time.perf_counter() - start
    lines = [f"Stall signals, issue 41 item 2 ({stamp}; {machine()}; single-threaded; {steps} steps of {BATCH} "
             f"sequences; window W={WINDOW}; unigram entropy of the training text H={entropy:.3f} nats; "
             f"{wall / 60:.1f} min). No guard on any run; labels from the run's own held-out loss (stalled: "
             "> 1.10x the AdamW lr=3e-3 pre-LN reference).", "",
             "**Runs**", "", "| run | val loss | x reference | label |", "|---|---:|---:|---|"]
    for n, r in found.items():
        lines.append(f"| {n} | {r['val_loss']:.4g} | {r['ratio']:.3f} | {'stalled' if r['stalled'] else 'healthy'} |")
    lines += ["", "**Separation** (margin > 0: one threshold separates every step of every healthy run from the "
              "typical step of every stalled run; threshold: half-way; fires at: the first step >= 2W past it)", ""]
    lines += lines_sep
    lines += ["", "**Probe** (from a copy at step t: 20 steps on the 20 batches just seen, at the run's LR and at 1/10 "
              "of it; their loss before -> after each; gain ratio: (before - after at LR/10) / (before - after at "
              "LR); large: a lower LR would learn more from the same batches)", "",
              "| run | " + " | ".join(f"step {t}" for t in probe_at) + " | gain ratio, min..max |",
              "|---|" + "---|" * len(probe_at) + "---:|"]
    for n, r in found.items():
        cells = []
        for t in probe_at:
            pr = r["probe"].get(t)
            if pr is None:
                cells.append("-")
                continue
            cells.append(f"{pr['before']:.3f} -> {pr['after x1']:.3f} / {pr['after x0.1']:.3f}")
        vals = list(ratios[n].values())
        rng = f"{min(vals):.3g}..{max(vals):.3g}" if vals else "-"
        lines.append(f"| {n} ({'stalled' if r['stalled'] else 'healthy'}) | " + " | ".join(cells) + f" | {rng} |")
    lines += ["", "**Per step** (each signal at a few steps)", ""]
    for sig in STALLED_WHEN:
        lines += [f"*{sig}*", "", "| run | " + " | ".join(str(c) for c in checkpoints) + " |",
                  "|---|" + "---:|" * len(checkpoints)]
        for n, r in found.items():
            vals = [r["signals"][sig][c - 1] for c in checkpoints]
            lines.append(f"| {n} ({'stalled' if r['stalled'] else 'healthy'}) | "
                         + " | ".join("-" if v is None else f"{v:.3g}" for v in vals) + " |")
        lines.append("")
    table = "\n".join(lines)
    print(table)
    suffix = "-quick" if args.quick else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rescue-stall-signals{suffix}.md").write_text(table + "\n", encoding="utf-8")
    (args.out / f"rescue-stall-signals{suffix}.json").write_text(json.dumps(rounded(
        {"date": stamp, "machine": machine(), "steps": steps, "window": WINDOW, "unigram_entropy": entropy,
         "study": study, "runs": found}), default=lambda o: None) + "\n", encoding="utf-8")
    print(f"wrote {args.out / f'rescue-stall-signals{suffix}.md'} in {wall:.0f} s")


if __name__ == "__main__":
    main()
