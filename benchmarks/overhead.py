"""What does NaNGuard cost on a healthy run? Per-step CPU time, side by side, in one process.

For a small transformer LM and an MLP, each of these runs the same seeded fit, interleaved over repeats:

  plain           pl.Trainer()
  clip=1.0        pl.Trainer(gradient_clip_val=1.0)
  NaNGuard()      the defaults
  NaNGuard(flow_window=0)  the defaults without the gradient-flow window
  +activations    NaNGuard(check={"activations": "always"})  (n/a when the installed guard hooks nothing)
  detect_anomaly  pl.Trainer(detect_anomaly=True)
  naive hooks     a forward hook on every module calling torch.isfinite(out).all().item()

A timing callback placed first records ``time.process_time()`` at every ``on_train_batch_start``; the
interval between two of them is one whole training step (data, forward, backward, every callback, the
optimizer). The first ``--warmup`` steps of each fit are dropped; each configuration's median step time is
divided by plain's median *of the same repeat*, and the reported ratio is the median over repeats.
Single-threaded (``torch.set_num_threads(1)``) because CPU time is steadier than wall time on a shared
machine.

    python benchmarks/overhead.py            # full run (~2-4 min on 2 cores)
    python benchmarks/overhead.py --quick    # smoke run (~20 s)
    python benchmarks/overhead.py --only "clip=1.0" "NaNGuard()" --baseline /tmp/base/lightning_nanguard

``--baseline DIR`` loads another copy of the package (e.g. ``git archive main lightning_nanguard | tar -x -C
/tmp/base``) under its own name and runs its ``NaNGuard()`` side by side, as ``NaNGuard() before`` (and, with
``+activations``, its ``+activations before``): a change is measured in the same process, interleaved, instead of
against numbers from another day.

Besides the step times, every ``NaNGuard()`` fit (and the baseline's) times each of the guard's hooks on every
step (CPU time, median over the steps after the warm-up and over repeats): what the guard itself costs per hook.

Writes ``benchmarks/results/overhead.md`` (table), ``overhead.json`` and ``overhead.png`` (chart).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import common  # noqa: F401  (sets up sys.path, threads and warnings first)
import pytorch_lightning as pl
import torch

from common import MLP, RESULTS, TinyLM, classification_data, loader, machine, make_trainer, markov_tokens

from lightning_nanguard import NaNGuard


class StepTimer(pl.Callback):
    """CPU time between consecutive ``on_train_batch_start`` calls; also notes forward hooks installed."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.hooked_modules = 0
        self._last: Optional[float] = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        now = time.process_time()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        # forward hooks that callbacks keep for the fit or install per step are in place here
        self.hooked_modules = max(self.hooked_modules, sum(1 for m in pl_module.modules() if m._forward_hooks))


HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


def timed_hooks(guard: Any) -> dict[str, list[float]]:
    """Wrap the guard's step hooks (on the instance) to record the CPU time of every call, in ms."""
    return {name: timed_call(guard, name) for name in HOOKS}


CLIP = "Lightning's _clip_gradients"


def timed_call(obj: Any, name: str) -> list[float]:
    """Wrap ``obj.name`` (on the instance) to record the CPU time of every call, in ms."""
    times: list[float] = []
    method = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return method(*args, **kwargs)
        finally:
            times.append(1e3 * (time.process_time() - start))

    setattr(obj, name, wrapper)
    return times


def load_baseline(path: Path) -> Any:
    """The ``NaNGuard`` class of the package folder ``path``, imported as ``nanguard_baseline``."""
    spec = importlib.util.spec_from_file_location("nanguard_baseline", path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules["nanguard_baseline"] = module
    spec.loader.exec_module(module)
    return module.NaNGuard


class NaiveFiniteHooks(pl.Callback):
    """The obvious way to catch the first non-finite activation: a host sync in every module."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        def hook(module: Any, inputs: Any, out: Any) -> None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    if not torch.isfinite(t).all().item():
                        raise FloatingPointError(f"non-finite output in {type(module).__name__}")

        self.handles = [m.register_forward_hook(hook) for m in pl_module.modules()]

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        for h in self.handles:
            h.remove()


def _activations_guard() -> Optional[NaNGuard]:
    try:
        return NaNGuard(check={"activations": "always"})
    except Exception:  # an older guard without the key: reported as n/a
        return None


# name -> (trainer kwargs, callbacks factory); a factory returning None marks the configuration n/a
CONFIGS: dict[str, tuple[dict[str, Any], Callable[[], Optional[list]]]] = {
    "plain": ({}, lambda: []),
    "clip=1.0": ({"gradient_clip_val": 1.0}, lambda: []),
    "NaNGuard()": ({}, lambda: [NaNGuard()]),
    # the gradient-flow window off (logging.flow_window: 0): what the window costs, side by side
    "NaNGuard(flow_window=0)": ({}, lambda: [NaNGuard(logging={"flow_window": 0})]),
    "+activations": ({}, lambda: (lambda g: None if g is None else [g])(_activations_guard())),
    "detect_anomaly": ({"detect_anomaly": True}, lambda: []),
    "naive hooks": ({}, lambda: [NaiveFiniteHooks()]),
}


def workloads(quick: bool) -> dict[str, tuple[Callable[[], pl.LightningModule], Any]]:
    lm_data = markov_tokens(512, 64, 256)
    mlp_data = classification_data(4096, 64, 10)
    return {  # a small LM (0.47M parameters, 2 pre-LN layers, d=128, 16 x 64 tokens) and a tiny MLP (0.22M)
        "transformer LM": (lambda: TinyLM(vocab=256, d=128, layers=2, heads=4, seq_len=64), loader(lm_data, 16)),
        "MLP": (lambda: MLP(features=64, hidden=256, depth=4, classes=10), loader(mlp_data, 64)),
    }


def run_once(make_model: Callable[[], Any], data: Any, config: str, steps: int, root: Path,
             hooks: Optional[dict[str, list[list[float]]]] = None) -> Optional[StepTimer]:
    kwargs, callbacks = CONFIGS[config]
    extra = callbacks()
    if extra is None:
        return None
    if hooks is not None and config in ("NaNGuard()", "NaNGuard() before", "NaNGuard(flow_window=0)"):
        for name, times in timed_hooks(extra[0]).items():
            hooks.setdefault(name, []).append(times)
    timer = StepTimer()
    pl.seed_everything(0, verbose=False)
    model = make_model()
    trainer = make_trainer(root, callbacks=[timer] + extra, max_steps=steps, max_epochs=10_000, **kwargs)
    if hooks is not None and config == "clip=1.0":  # Lightning's own clipping, timed like the guard's hooks
        hooks.setdefault(CLIP, []).append(timed_call(trainer.precision_plugin, "_clip_gradients"))
    trainer.fit(model, data)
    return timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one short repeat (smoke test)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per fit")
    parser.add_argument("--warmup", type=int, default=10, help="steps dropped at the start of each fit")
    parser.add_argument("--only", nargs="*", default=None, help="subset of configurations (plus plain)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a lightning_nanguard package folder run side by side as 'NaNGuard() before'")
    parser.add_argument("--name", default="overhead", help="results file name (default: overhead)")
    args = parser.parse_args()
    if args.baseline is not None:
        before = load_baseline(args.baseline.resolve())
        at = list(CONFIGS).index("NaNGuard()") + 1
        items = list(CONFIGS.items())
        items.insert(at, ("NaNGuard() before", ({}, lambda: [before()])))
        items.insert([name for name, _ in items].index("+activations") + 1,
                     ("+activations before", ({}, lambda: [before(check={"activations": "always"})])))
        CONFIGS.clear()
        CONFIGS.update(items)
    common.single_thread()
    repeats = args.repeats or (1 if args.quick else 4)
    steps = args.steps or (25 if args.quick else 50)
    configs = list(CONFIGS) if not args.only else ["plain"] + [c for c in args.only if c != "plain"]
    if args.baseline is not None and "+activations" in configs and "+activations before" not in configs:
        configs.insert(configs.index("+activations") + 1, "+activations before")
    if args.baseline is not None and "NaNGuard() before" not in configs:
        configs.insert(configs.index("NaNGuard()") + 1 if "NaNGuard()" in configs else len(configs),
                       "NaNGuard() before")
    root = Path(tempfile.mkdtemp(prefix="nanguard-overhead-"))

    start = time.perf_counter()
    medians: dict[str, dict[str, list[float]]] = {}  # workload -> config -> per-repeat median step time
    hook_times: dict[str, dict[str, dict[str, list[list[float]]]]] = {}  # workload -> config -> hook -> per fit
    notes: dict[str, str] = {}
    for name, (make_model, data) in workloads(args.quick).items():
        per = medians.setdefault(name, {c: [] for c in configs})
        for r in range(repeats):
            order = configs[r % len(configs):] + configs[: r % len(configs)]  # rotate: no fixed position
            for config in order:
                timer = run_once(make_model, data, config, steps, root,
                                 hook_times.setdefault(name, {}).setdefault(config, {}))
                if timer is None:
                    notes[config] = "n/a: this NaNGuard does not accept check.activations: always"
                    continue
                if config == "+activations" and timer.hooked_modules == 0:
                    notes[config] = "n/a: check.activations: always installed no hooks"
                    continue
                per[config].append(statistics.median(timer.times[args.warmup:]))
        print(f"  {name}: done ({time.perf_counter() - start:.0f} s)", flush=True)

    rows = []
    for name, per in medians.items():
        plain = per["plain"]
        for config in configs:
            times = per[config]
            if len(times) != len(plain) or not times:
                rows.append({"workload": name, "config": config, "ms": None, "ratio": None})
                continue
            ratio = statistics.median(t / p for t, p in zip(times, plain))
            rows.append({"workload": name, "config": config, "ms": 1e3 * statistics.median(times), "ratio": ratio})

    hook_rows = []
    for name, per_config in hook_times.items():
        for config, per_hook in per_config.items():
            if per_hook:
                ms = {h: statistics.median(t for fit_times in per_hook.get(h, []) for t in fit_times[args.warmup:])
                      for h in HOOKS + (CLIP,) if any(per_hook.get(h, []))}
                hook_rows.append({"workload": name, "config": config, "ms": ms, "total": sum(ms.values())})

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    table = render_table(rows, configs, list(medians), notes, stamp, repeats, steps, args.warmup)
    table += "\n\n" + render_hooks(hook_rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name + ("-quick" if args.quick else "")
    (args.out / f"{stem}.md").write_text(table + "\n", encoding="utf-8")
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"date": stamp, "machine": machine(), "repeats": repeats, "steps": steps, "warmup": args.warmup,
         "rows": rows, "hooks": hook_rows, "notes": notes}, indent=2) + "\n", encoding="utf-8")
    chart(rows, configs, list(medians), args.out / f"{stem}.png")
    print(f"wrote {args.out / f'{stem}.md'} and {stem}.png in {time.perf_counter() - start:.0f} s")


def render_hooks(hook_rows: list[dict]) -> str:
    """The guard's own CPU time per hook on a healthy step (median), per workload and guard."""
    lines = ["Per-hook CPU time of the guard on a healthy step, and of Lightning's own clipping (`clip=1.0`: "
             "`_clip_gradients`), ms (median over steps and repeats):", "",
             "| workload | configuration | " + " | ".join(HOOKS) + " | sum |", "|---|---|" + "---:|" * (len(HOOKS) + 1)]
    for r in hook_rows:
        cells = [f"{r['ms'][h]:.3f}" if h in r["ms"] else "-" for h in HOOKS]
        if CLIP in r["ms"]:
            cells = ["-", "-", f"{r['ms'][CLIP]:.3f} (clipping)", "-"]
        lines.append(f"| {r['workload']} | {r['config']} | " + " | ".join(cells) + f" | {r['total']:.3f} |")
    return "\n".join(lines)


def render_table(rows: list[dict], configs: list[str], names: list[str], notes: dict[str, str], stamp: str,
                 repeats: int, steps: int, warmup: int) -> str:
    by = {(r["workload"], r["config"]): r for r in rows}
    head = "| configuration | " + " | ".join(f"{n}: ms/step | {n}: x plain" for n in names) + " |"
    lines = [f"Per-step CPU time, median of {repeats} interleaved repeat(s) x {steps - warmup - 1} steps "
             f"({stamp}; {machine()}).", "", head, "|---|" + "---:|---:|" * len(names)]
    for config in configs:
        cells = []
        for n in names:
            r = by[(n, config)]
            cells += ["n/a", "n/a"] if r["ms"] is None else [f"{r['ms']:.2f}", f"{r['ratio']:.3f}"]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    for config, note in notes.items():
        lines.append(f"\n{config}: {note}")
    return "\n".join(lines)


def chart(rows: list[dict], configs: list[str], names: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no chart")
        return
    by = {(r["workload"], r["config"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(configs))]
        ys = [by[(name, c)]["ratio"] or 0.0 for c in configs]
        bars = ax.bar(xs, ys, width, label=name)
        for x, y in zip(xs, ys):
            ax.text(x, y + 0.02, f"{y:.2f}" if y else "n/a", ha="center", va="bottom", fontsize=7)
        del bars
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(configs))], configs, fontsize=8)
    ax.set_ylabel("step time / plain Trainer")
    ax.set_title("NaNGuard overhead on a healthy run (CPU, 1 thread, median of repeats)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
