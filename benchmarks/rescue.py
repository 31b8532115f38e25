"""Is the model better at the end with ``NaNGuard()``? The rescue-quality benchmark of issue 41: cases x setups,
each judged by its final loss on HELD-OUT data against a sane reference run.

Setups: ``no guard``; Lightning's ``gradient_clip_val=1.0`` (``clip=1.0``); ``NaNGuard()`` defaults; on the
corrupt-batch cases also ``NaNGuard(check={"spike_action": "skip_step"})``; and the sane reference (no guard at
the sane LR, or on the clean data).

Cases (the language models read real English text that ships offline: CPython's ``pydoc_data.topics.topics``,
its topics joined in key order, one token per ASCII character, the first 90% for training and the last 10% held
out):

- ``AdamW lr=0.1, pre-LN LM``: common.py's ``TinyLM`` (2 pre-LN blocks, d=64), no warm-up; reference lr=3e-3.
- ``AdamW lr=0.03, post-LN LM``: the same model in nn.TransformerEncoderLayer's default (post-LN) order;
  reference: post-LN at lr=3e-3.
- ``SGD+momentum lr=2.0, LM``: stability.py's transformer case (Markov tokens); reference lr=0.5.
- ``exploding gradients, 20-layer MLP``: stability.py's case (SGD lr=0.035); reference lr=0.0035.
- ``corrupt batches: KIND``: the healthy AdamW lr=3e-3 pre-LN LM, with 5 consecutive corrupt batches fed at
  the middle of the fit, for 4 kinds (uniform random tokens; one repeated token; the bytes of a float32 tensor
  file read as text; the text with its targets shuffled against its inputs); reference: the clean run.
- ``warm restart x20``: AdamW pre-LN LM on a cosine schedule (3e-3 -> 3e-4) whose warm restart at mid-fit
  jumps to 20x the base LR; reference: the same schedule restarting at 1x.
- ``data mix gets harder``: benchmarks/mixture.py's GRU LM (RMSprop), one token source per batch, the share of
  batches from a harder source rising from 0 at 60% of the fit to 50% at its end; nothing is wrong, its reference
  is its own no-guard run; also ``NaNGuard(check={"spike_action": "warn"})``.
- ``healthy: ...``: the sane LM, the LM with warm-up + cosine, the LM whose cosine restarts at 1x (an LR that
  jumps 10x), and an MLP classifier. With ``NaNGuard()`` the
  final weights must be bitwise identical to no guard (column ``bitwise``).

Per run: the final validation loss (``nan``: non-finite weights), its ratio to the reference, the steps lost
(stability.py's ``steps_lost``), the guard's events (kind/cause counts), LR cuts, rollbacks, skipped and clipped
steps, and the wall time of ``fit`` against the no-guard run of the same case (the machine is shared: the
ratios are noisy).

    python benchmarks/rescue.py                     # every case (~15 min single-threaded)
    python benchmarks/rescue.py --quick             # 1/4 of the steps
    python benchmarks/rescue.py --cases pre-ln corrupt   # cases whose name contains any of the words

Writes ``benchmarks/results/rescue.md`` and ``rescue.json`` (``rescue-quick.*`` with ``--quick``; with
``--cases``, ``rescue-partial.*``).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

import common  # noqa: F401  (sets up sys.path, threads and warnings first)
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from common import MLP, RESULTS, TinyLM, classification_data, loader, machine, make_trainer
from mixture import HARD_FROM, GRULM, mixture
from stability import Recorder, steps_lost
from tests.models import DeepMLP

from lightning_nanguard import NaNGuard

VOCAB = 128
SEQ = 32
BATCH = 16
STEPS = 600
CORRUPT_BATCHES = 5
MIX_STEPS = 3000  # the harder-mix case: its easy source's loss must settle first (benchmarks/mixture.py)

# ----------------------------------------------------------------------------------------------------- text


@lru_cache(maxsize=1)
def text_ids() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token ids of CPython's own documentation text (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    ids = torch.tensor([ord(c) if ord(c) < VOCAB else 0 for c in text], dtype=torch.long)
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:]


def windows(ids: torch.Tensor, starts: torch.Tensor, length: int = SEQ) -> TensorDataset:
    w = torch.stack([ids[s: s + length + 1] for s in starts.tolist()])
    return TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous())


def text_train(steps: int, batch: int = BATCH, seed: int = 0) -> TensorDataset:
    """``steps * batch`` random windows of the training text, in the order they are fed (one epoch)."""
    ids = text_ids()[0]
    g = torch.Generator().manual_seed(seed)
    return windows(ids, torch.randint(0, len(ids) - SEQ - 1, (steps * batch,), generator=g))


@lru_cache(maxsize=1)
def text_val(n: int = 512) -> TensorDataset:
    """``n`` evenly spaced windows of the held-out text."""
    ids = text_ids()[1]
    return windows(ids, torch.linspace(0, len(ids) - SEQ - 2, n).long())


def unigram_entropy() -> float:
    """The entropy (nats) of the training text's character distribution: the loss of a model that ignores context."""
    counts = torch.bincount(text_ids()[0], minlength=VOCAB).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


CORRUPTIONS = ("uniform random tokens", "one repeated token", "float32 file bytes", "shuffled targets")


def corrupt(data: TensorDataset, kind: str, at: int, batch: int = BATCH, n: int = CORRUPT_BATCHES,
            seed: int = 1) -> TensorDataset:
    """A copy of ``data`` whose batches ``at .. at+n-1`` (in feeding order) are corrupt: well-formed, finite, in
    the vocabulary, nothing like the text."""
    x, y = (t.clone() for t in data.tensors)
    rows = slice(at * batch, (at + n) * batch)
    shape = (n * batch, SEQ + 1)
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform random tokens":
        w = torch.randint(0, VOCAB, shape, generator=g)
    elif kind == "one repeated token":
        w = torch.full(shape, ord("e"))
    elif kind == "float32 file bytes":  # a checkpoint shard read as text
        raw = torch.randn(shape[0] * shape[1] // 4 + 1, generator=g).numpy().tobytes()
        w = (torch.frombuffer(bytearray(raw), dtype=torch.uint8)[: shape[0] * shape[1]].long() % VOCAB).view(shape)
    elif kind == "shuffled targets":  # real text in, the same characters in a random order as targets
        perm = torch.argsort(torch.rand(n * batch, SEQ, generator=g), dim=1)
        y[rows] = torch.gather(y[rows], 1, perm)
        return TensorDataset(x, y)
    else:
        raise ValueError(kind)
    x[rows], y[rows] = w[:, :-1], w[:, 1:]
    return TensorDataset(x, y)


# --------------------------------------------------------------------------------------- held-out synthetics


def regression_split(n: int, features: int, seed: int, held_out: int) -> tuple[TensorDataset, TensorDataset]:
    """common.regression_data(n, features, seed) exactly, and ``held_out`` more rows of the same target."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    xv = torch.randn(held_out, features, generator=g)
    return TensorDataset(x, y), TensorDataset(xv, xv @ w + 0.1 * torch.randn(held_out, 1, generator=g))


def markov_split(n: int, length: int, vocab: int, held_out: int, seed: int = 0,
                 successors: int = 4) -> tuple[TensorDataset, TensorDataset]:
    """tests.models.markov_tokens(n, length, vocab, seed) exactly, and ``held_out`` more sequences of its chain."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, vocab, (vocab, successors), generator=g)
    out = []
    for rows in (n, held_out):
        seq = torch.empty(rows, length + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
        for t in range(length):
            seq[:, t + 1] = nxt[seq[:, t], torch.randint(0, successors, (rows,), generator=g)]
        out.append(TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out[0], out[1]


# --------------------------------------------------------------------------------------------------- models


class Schedule:
    """A per-step LR factor: linear warm-up, then cosine from 1 to ``floor`` over ``cycle`` steps; each later
    cycle restarts at ``restart`` (x the base LR). A callable object: LambdaLR keeps its state in its own."""

    def __init__(self, cycle: int, warmup: int = 0, restart: float = 1.0, floor: float = 0.1) -> None:
        self.cycle, self.warmup, self.restart, self.floor = cycle, warmup, restart, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        k, t = divmod(step - self.warmup, self.cycle)
        top = 1.0 if k == 0 else self.restart
        return self.floor * top + (top - self.floor * top) * 0.5 * (1 + math.cos(math.pi * t / self.cycle))


class TextLM(TinyLM):
    """common.py's TinyLM over the text (pre- or post-LN), AdamW, with an optional step-interval schedule."""

    def __init__(self, lr: float, norm_first: bool = True, schedule: Optional[Schedule] = None,
                 optimizer: str = "adamw") -> None:
        super().__init__(vocab=VOCAB, seq_len=SEQ, lr=lr, norm_first=norm_first, optimizer=optimizer)
        self.schedule = schedule

    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()
        if self.schedule is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, self.schedule),
                                                   "interval": "step"}}


# ---------------------------------------------------------------------------------------------------- cases


def lm_loss(val: TensorDataset) -> Callable[[Any], float]:
    """Mean cross-entropy per token over ``val``, in eval mode (no dropout), in chunks."""
    def final(model: Any) -> float:
        x, y = val.tensors
        model.eval()
        with torch.no_grad():
            total = sum(float(nn.functional.cross_entropy(model(xb).reshape(-1, VOCAB), yb.reshape(-1),
                                                          reduction="sum"))
                        for xb, yb in zip(x.split(256), y.split(256)))
        return total / y.numel()
    return final


def ce_loss(val: TensorDataset) -> Callable[[Any], float]:
    def final(model: Any) -> float:
        x, y = val.tensors
        model.eval()
        with torch.no_grad():
            logits = model(x)
            return float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    return final


def mixture_loss(val: TensorDataset) -> Callable[[Any], float]:
    def final(model: Any) -> float:
        x, y = val.tensors
        model.eval()
        with torch.no_grad():
            return float(nn.functional.cross_entropy(model(x).reshape(-1, model.head.out_features), y.reshape(-1)))
    return final


def mse_loss(val: TensorDataset) -> Callable[[Any], float]:
    def final(model: Any) -> float:
        x, y = val.tensors
        model.eval()
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(x), y))
    return final


@dataclass
class Run:
    """How to train one model: its constructor, training data and schedule (``key`` names it for the cache)."""

    key: str
    make: Callable[[], pl.LightningModule]
    data: TensorDataset
    batch: int
    epochs: int = 1
    shuffle: bool = False
    seed: int = 0  # pl.seed_everything's; a shuffled loader draws from seed 0 (as stability.py's runs do)


@dataclass
class Case:
    name: str
    run: Run
    reference: Run
    val: Callable[[Any], float]
    setups: list[str] = field(default_factory=lambda: ["no guard", "clip=1.0", "NaNGuard()"])
    healthy: bool = False  # NaNGuard() must leave the weights bitwise identical to no guard
    note: str = ""


def _guard(**sections: Any) -> Callable[[], NaNGuard]:
    return lambda: NaNGuard(logging={"verbose": False}, **sections)


SETUPS: dict[str, tuple[dict[str, Any], Callable[[], Optional[NaNGuard]]]] = {
    "no guard": ({}, lambda: None),
    "clip=1.0": ({"gradient_clip_val": 1.0}, lambda: None),
    "NaNGuard()": ({}, _guard()),
    "NaNGuard(spike_action=skip_step)": ({}, _guard(check={"spike_action": "skip_step"})),
    "NaNGuard(spike_action=warn)": ({}, _guard(check={"spike_action": "warn"})),
}


def cases(quick: bool) -> list[Case]:
    steps = STEPS // 4 if quick else STEPS
    epochs = 1 if quick else 3
    text, val = text_train(steps), lm_loss(text_val())
    sane = Run("AdamW lr=3e-3, pre-LN, clean text", lambda: TextLM(3e-3), text, BATCH)
    out = [
        Case("AdamW lr=0.1, pre-LN LM (no warm-up)", Run("AdamW lr=0.1, pre-LN", lambda: TextLM(0.1), text, BATCH),
             sane, val),
        Case("AdamW lr=0.03, post-LN LM (no warm-up)",
             Run("AdamW lr=0.03, post-LN", lambda: TextLM(0.03, norm_first=False), text, BATCH),
             Run("AdamW lr=3e-3, post-LN", lambda: TextLM(3e-3, norm_first=False), text, BATCH), val),
    ]
    lm, lm_val = markov_split(1024, 32, 128, 256)
    out.append(Case("SGD+momentum lr=2.0, LM (Markov tokens)",
                    Run("SGD lr=2.0", lambda: TinyLM(lr=2.0, optimizer="sgd"), lm, 16, epochs, True),
                    Run("SGD lr=0.5", lambda: TinyLM(lr=0.5, optimizer="sgd"), lm, 16, epochs, True), ce_loss(lm_val)))
    mlp, mlp_val = regression_split(1024, 16, 7, 256)
    out.append(Case("exploding gradients, 20-layer MLP (SGD lr=0.035)",
                    Run("DeepMLP lr=0.035", lambda: DeepMLP(lr=0.035), mlp, 32, epochs, True, 7),
                    Run("DeepMLP lr=0.0035", lambda: DeepMLP(lr=0.0035), mlp, 32, epochs, True, 7), mse_loss(mlp_val)))
    # the same run, longer: what the 96-step case measures is the steps its rollback loses (to step 0, 19 of them)
    long = 3 if quick else 10
    out.append(Case(f"exploding gradients, 20-layer MLP (SGD lr=0.035), {long} epochs",
                    Run("DeepMLP lr=0.035", lambda: DeepMLP(lr=0.035), mlp, 32, long, True, 7),
                    Run("DeepMLP lr=0.0035", lambda: DeepMLP(lr=0.0035), mlp, 32, long, True, 7), mse_loss(mlp_val),
                    note=f"{long * 32} steps: the exploding case run on past its 96"))
    at = steps // 2
    for kind in CORRUPTIONS:
        out.append(Case(f"corrupt batches: {kind} (AdamW lr=3e-3, pre-LN LM)",
                        Run(f"corrupt {kind}", lambda: TextLM(3e-3), corrupt(text, kind, at), BATCH), sane, val,
                        setups=list(SETUPS), note=f"batches {at}..{at + CORRUPT_BATCHES - 1} corrupt"))
    half = steps // 2
    out.append(Case("warm restart x20 (AdamW 3e-3, cosine, pre-LN LM)",
                    Run("restart x20", lambda: TextLM(3e-3, schedule=Schedule(half, restart=20.0)), text, BATCH),
                    Run("restart x1", lambda: TextLM(3e-3, schedule=Schedule(half, restart=1.0)), text, BATCH), val,
                    note=f"cosine 1 -> 0.1 over {half} steps, then restart at 20x"))
    restart1 = Run("restart x1", lambda: TextLM(3e-3, schedule=Schedule(half, restart=1.0)), text, BATCH)
    out.append(Case("healthy: AdamW lr=3e-3, cosine with a warm restart to 1x, pre-LN LM", restart1, restart1, val,
                    ["no guard", "NaNGuard()"], True, note=f"the LR jumps 10x at step {half}"))
    mix_steps = MIX_STEPS // 4 if quick else MIX_STEPS
    mix_train, mix_val = mixture(mix_steps, BATCH)
    mix = Run("GRU, harder mix", lambda: GRULM(), mix_train, BATCH)
    out.append(Case("data mix gets harder: GRU (RMSprop lr=3e-3)", mix, mix, mixture_loss(mix_val),
                    ["no guard", "clip=1.0", "NaNGuard()", "NaNGuard(spike_action=warn)"],
                    note=f"one source per batch; hard batches from step {int(HARD_FROM * mix_steps)} of {mix_steps}"))
    out.append(Case("healthy: AdamW lr=3e-3, pre-LN LM", sane, sane, val, ["no guard", "NaNGuard()"], True))
    warm = Run("AdamW lr=3e-3, warm-up + cosine", lambda: TextLM(3e-3, schedule=Schedule(steps - steps // 10,
                                                                                          warmup=steps // 10)),
               text, BATCH)
    out.append(Case("healthy: AdamW lr=3e-3, warm-up + cosine, pre-LN LM", warm, warm, val, ["no guard", "NaNGuard()"],
                    True))
    cls = classification_data(2560, 8, 10)
    cls_train, cls_val = (TensorDataset(*(t[s] for t in cls.tensors)) for s in (slice(0, 2048), slice(2048, None)))
    mlp_run = Run("MLP AdamW lr=1e-3", lambda: MLP(features=8), cls_train, 64, 2 if quick else 6, True)
    out.append(Case("healthy: MLP classifier (AdamW lr=1e-3)", mlp_run, mlp_run, ce_loss(cls_val),
                    ["no guard", "NaNGuard()"], True))
    return out


# ------------------------------------------------------------------------------------------------------ runs


def fit(spec: Run, setup: str, root: Path) -> tuple[dict[str, Any], pl.LightningModule, Optional[NaNGuard],
                                                     Recorder]:
    kwargs, make_guard = SETUPS[setup]
    guard = make_guard()
    rec = Recorder()
    pl.seed_everything(spec.seed, verbose=False)
    model = spec.make()
    trainer = make_trainer(root, callbacks=[rec] + ([guard] if guard is not None else []), max_epochs=spec.epochs,
                           **kwargs)
    start = time.perf_counter()
    trainer.fit(model, loader(spec.data, spec.batch, shuffle=spec.shuffle))
    wall = time.perf_counter() - start
    bad = sorted({i for i, v in enumerate(rec.losses) if not math.isfinite(v)}
                 | {s for s, v in rec.norms.items() if not math.isfinite(v)})
    return {"steps": trainer.global_step, "wall_s": wall, "first_nonfinite_step": bad[0] if bad else None,
            "nonfinite_steps": len(bad)}, model, guard, rec


def guard_row(guard: NaNGuard, total: int) -> dict[str, Any]:
    kinds = Counter(f"{e.kind}/{e.cause}" for e in guard.events)
    row: dict[str, Any] = {
        "events": len(guard.events), "kinds": dict(kinds),
        "first_events": [{"step": e.step, "kind": e.kind, "cause": e.cause, "actions": e.actions,
                          "culprit": e.culprit} for e in guard.events[:8]],
        "steps_lost": steps_lost(guard, total), "gave_up": bool(guard.stopped), "lr_scale": guard.lr_scale,
        "suggestion": guard.events[0].suggestion if guard.events else None,
    }
    row.update({k: guard.counters.get(k, 0) for k in
                ("incidents", "spikes", "skipped_steps", "rollbacks", "lr_cuts", "clipped_steps")})
    return row


def finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def run_case(case: Case, root: Path, cache: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    plain_state: Optional[dict[str, torch.Tensor]] = None
    for setup in case.setups:
        row, model, guard, rec = fit(case.run, setup, root)
        row = {"setup": setup, **row, "val_loss": case.val(model) if finite(model) else float("nan")}
        if guard is not None:
            row.update(guard_row(guard, len(rec.losses)))
        if setup == "no guard":
            plain_state = {k: v.clone() for k, v in model.state_dict().items()}
        elif case.healthy and setup == "NaNGuard()" and plain_state is not None:
            state = model.state_dict()
            row["bitwise"] = all(torch.equal(plain_state[k], state[k]) for k in plain_state)
        rows.append(row)
    if case.reference.key == case.run.key:  # a healthy case is its own reference: its no-guard run
        cache[case.reference.key] = {k: v for k, v in rows[0].items() if k != "setup"}
    if case.reference.key not in cache:
        row, model, _, _ = fit(case.reference, "no guard", root)
        cache[case.reference.key] = {**row, "val_loss": case.val(model) if finite(model) else float("nan")}
    ref = {"setup": f"reference: {case.reference.key}", **cache[case.reference.key]}
    plain_wall = rows[0]["wall_s"]
    for r in rows:
        r["ratio_to_reference"] = (r["val_loss"] / ref["val_loss"]
                                   if math.isfinite(r["val_loss"]) and ref["val_loss"] > 0 else None)
        r["wall_ratio"] = r["wall_s"] / plain_wall
    return rows + [ref]


# ---------------------------------------------------------------------------------------------------- report


def _kinds(r: dict[str, Any]) -> str:
    return ", ".join(f"{k} x{n}" for k, n in r["kinds"].items()) or "-"


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}x"


def report(results: dict[str, dict[str, Any]], quick: bool, stamp: str, wall: float) -> str:
    lines = [f"Rescue quality ({'--quick, ' if quick else ''}{stamp}; {machine()}; single-threaded, on a "
             "machine shared with other jobs: the losses are deterministic, the wall ratios are noisy). Losses are "
             f"on held-out data; the LMs read CPython's `pydoc_data.topics` text (unigram entropy of the training "
             f"text {unigram_entropy():.3f} nats); {STEPS // 4 if quick else STEPS} steps of {BATCH} x {SEQ} "
             f"tokens. The whole run took {wall / 60:.1f} min.", "",
             "**Summary** (validation loss; ratio: `NaNGuard()` against the reference; best other: the better of "
             "no guard and clip=1.0)", "",
             "| case | no guard | clip=1.0 | NaNGuard() | skip_step | reference | ratio | events (kind/cause) "
             "| LR cuts | rollbacks | steps lost | <= best other | bitwise |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|"]
    for name, res in results.items():
        rows = {r["setup"]: r for r in res["rows"]}
        ref = res["rows"][-1]
        g = rows["NaNGuard()"]

        def cell(setup: str, rows: dict[str, dict[str, Any]] = rows) -> str:
            return f"{rows[setup]['val_loss']:.4g}" if setup in rows else "-"
        others = [rows[s]["val_loss"] for s in ("no guard", "clip=1.0") if s in rows
                  and math.isfinite(rows[s]["val_loss"])]
        best = min(others) if others else float("nan")
        ok = "-" if not others or not math.isfinite(g["val_loss"]) else ("yes" if g["val_loss"] <= best else "no")
        bitwise = "-" if "bitwise" not in g else ("yes" if g["bitwise"] else "NO")
        lines.append(f"| {name} | {cell('no guard')} | {cell('clip=1.0')} | {cell('NaNGuard()')} | "
                     f"{cell('NaNGuard(spike_action=skip_step)')} | {ref['val_loss']:.4g} | "
                     f"{_ratio(g['ratio_to_reference'])} | {_kinds(g)} | {g['lr_cuts']} | {g['rollbacks']} | "
                     f"{g['steps_lost']} | {ok} | {bitwise} |")
    lines.append("")
    for name, res in results.items():
        lines += [f"**{name}**" + (f" ({res['note']})" if res["note"] else ""), "",
                  "| setup | val loss | x reference | first non-finite step | events (kind/cause) | first actions "
                  "| LR cuts | rollbacks | skipped | clipped | steps lost | gave up | wall x no guard |",
                  "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---|---:|"]
        for r in res["rows"]:
            ratio = "-" if r.get("ratio_to_reference") is None else f"{r['ratio_to_reference']:.3f}"
            first = "-" if r.get("first_nonfinite_step") is None else str(r["first_nonfinite_step"])
            if "events" in r:
                acts = "; ".join(f"{e['step']}: {'+'.join(e['actions'])}" for e in r["first_events"][:3]) or "-"
                cells = [_kinds(r), acts, str(r["lr_cuts"]), str(r["rollbacks"]), str(r["skipped_steps"]),
                         str(r["clipped_steps"]), str(r["steps_lost"]), "yes" if r["gave_up"] else "no"]
            else:
                cells = ["-"] * 8
            wall_ratio = f"{r['wall_ratio']:.2f}" if "wall_ratio" in r else "-"
            lines.append(f"| {r['setup']} | {r['val_loss']:.4g} | {ratio} | {first} | " + " | ".join(cells)
                         + f" | {wall_ratio} |")
        g = next(r for r in res["rows"] if r["setup"] == "NaNGuard()")
        if g.get("suggestion"):
            lines.append(f"\nFirst suggestion: {g['suggestion']}")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1/4 of the steps, 1 epoch of the synthetic cases")
    parser.add_argument("--cases", nargs="+", metavar="WORD", help="only the cases whose name contains a WORD")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    common.single_thread()
    root = Path(tempfile.mkdtemp(prefix="nanguard-rescue-"))
    chosen = [c for c in cases(args.quick)
              if not args.cases or any(w.lower() in c.name.lower() for w in args.cases)]
    warm_up = Run("warm-up", lambda: TextLM(3e-3), text_train(4), BATCH)
    fit(warm_up, "NaNGuard()", root)  # untimed: the first fit of a process pays for lazy initialisation
    start = time.perf_counter()
    cache: dict[str, dict[str, Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    for case in chosen:
        results[case.name] = {"note": case.note, "rows": run_case(case, root, cache)}
        print(f"  {case.name}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    wall = time.perf_counter() - start
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    table = report(results, args.quick, stamp, wall)
    print(table)
    suffix = "-partial" if args.cases else "-quick" if args.quick else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rescue{suffix}.md").write_text(table + "\n", encoding="utf-8")
    payload = {"date": stamp, "machine": machine(), "quick": args.quick, "steps": STEPS // 4 if args.quick else STEPS,
               "batch": BATCH, "seq_len": SEQ, "single_threaded": True, "wall_s": wall,
               "unigram_entropy": unigram_entropy(), "note": "machine shared with other jobs", "results": results}
    (args.out / f"rescue{suffix}.json").write_text(json.dumps(payload, indent=2, default=lambda o: None) + "\n",
                                                   encoding="utf-8")
    print(f"wrote {args.out / f'rescue{suffix}.md'} in {wall:.0f} s")
    return payload


if __name__ == "__main__":
    main()
