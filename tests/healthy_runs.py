"""The long healthy corpus (issue 24): real fits of tens of thousands of tiny steps, their per-step numbers, and
the guard's host-side detectors fed those numbers.

Each case is a real ``pl.Trainer`` fit without a guard; :class:`Trace` records, per optimizer step, the loss
the guard would read (the step's loss, float32) and the total gradient norm (``get_total_norm``, the same
arithmetic as the guard's). A healthy step under ``NaNGuard()`` (no spike: nothing skipped) changes nothing, so
these are the numbers the guard sees in the same fit. They are stored in ``tests/data/healthy_traces.json.gz``
(base64 float32) so that :func:`judge` can replay 60,000 steps through the detectors in about two seconds;
``python -m tests.healthy_runs`` re-records them (about two minutes on one CPU core).

What makes each case hard for a spike test: batches of 4 (or 8) samples, whose per-batch loss is right-skewed
and heavy-tailed (a batch holding one hard sample costs 5-50x the typical one), unshuffled data (the same hard
batch comes back every epoch), schedules that raise and lower the LR (cosine, one-cycle), one hard
batch per epoch, and a fine-tune (a pretrained body, a fresh head, a lower LR).
"""

from __future__ import annotations

import base64
import gzip
import json
import math
import sys
from array import array
from pathlib import Path
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard.config import NaNGuardConfig
from lightning_nanguard.detect.divergence import DivergenceWatch
from lightning_nanguard.detect.spikes import LossWatch
from lightning_nanguard.diagnose.rules import spike_cause
from lightning_nanguard.recover.clipping import ZClip

TRACES = Path(__file__).parent / "data" / "healthy_traces.json.gz"


def classes(n: int, features: int = 8, k: int = 4, sep: float = 2.0, seed: int = 0) -> TensorDataset:
    """Gaussian clusters around ``k`` random centres ``sep`` apart (overlapping for a small ``sep``)."""
    g = torch.Generator().manual_seed(seed)
    centres = sep * torch.randn(k, features, generator=g)
    y = torch.randint(0, k, (n,), generator=g)
    return TensorDataset(centres[y] + torch.randn(n, features, generator=g), y)


def regression(n: int, features: int = 8, seed: int = 0, dof: int = 3) -> TensorDataset:
    """A linear target with Student-t noise (``dof`` degrees of freedom: rare large residuals)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    chi2 = torch.randn(n, dof, generator=g).square().sum(1, keepdim=True)
    noise = torch.randn(n, 1, generator=g) / (chi2 / dof).sqrt()
    return TensorDataset(x, x @ w + 0.3 * noise)


def one_hard_batch(n: int = 2048, batch: int = 4) -> TensorDataset:
    """:func:`classes` whose batch 100 (of ``n / batch``, unshuffled) holds ambiguous samples: midway between two
    class centres, labelled one or the other. No model is sure of them: once per epoch, a batch whose loss stays
    near ``ln 2`` while the others fall towards 0."""
    g = torch.Generator().manual_seed(3)
    centres = 2.0 * torch.randn(4, 8, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    x = centres[y] + torch.randn(n, 8, generator=g)
    hard = slice(100 * batch, 101 * batch)
    x[hard] = (centres[0] + centres[1]) / 2 + 0.3 * torch.randn(batch, 8, generator=g)
    y[hard] = torch.arange(batch) % 2
    return TensorDataset(x, y)


class Fit(pl.LightningModule):
    """An MLP ``features -> hidden -> out`` (ReLU), a loss, an optimizer and an optional per-step scheduler."""

    def __init__(self, out: int, loss: str, optimizer: Callable, scheduler: Optional[Callable] = None,
                 hidden: int = 16, features: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, out)
        self.loss_name, self.make_opt, self.make_sched = loss, optimizer, scheduler

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.head(self.body(x))
        if self.loss_name == "ce":
            return nn.functional.cross_entropy(out, y)
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> Any:
        opt = self.make_opt(self.parameters())
        if self.make_sched is None:
            return opt
        sched = self.make_sched(opt, int(self.trainer.max_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _adam(lr: float) -> Callable:
    return lambda p: torch.optim.Adam(p, lr=lr)


def _cosine(opt: Any, total: int) -> Any:
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)


def _one_cycle(opt: Any, total: int) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.03, total_steps=total)


# name -> (module factory, data factory, batch size, shuffle, steps)
CASES: dict[str, tuple[Callable[[], pl.LightningModule], Callable[[], TensorDataset], int, bool, int]] = {
    # the case: the same hard batches come back every epoch (64 batches of 4)
    "classifier_batch4_unshuffled": (lambda: Fit(4, "ce", _adam(1e-3)), lambda: classes(256), 4, False, 20000),
    "classifier_batch4_overlapping_sgd": (lambda: Fit(4, "ce", lambda p: torch.optim.SGD(p, lr=0.1)),
                                          lambda: classes(256, sep=1.0), 4, False, 10000),
    "regression_batch4_heavy_noise_cosine": (lambda: Fit(1, "mse", lambda p: torch.optim.AdamW(p, lr=3e-3), _cosine,
                                                         hidden=32),
                                             lambda: regression(512), 4, True, 10000),
    "classifier_batch8_one_cycle": (lambda: Fit(4, "ce", lambda p: torch.optim.AdamW(p, lr=0.03), _one_cycle),
                                    lambda: classes(512, sep=1.0, seed=1), 8, True, 8000),
    "one_hard_batch_per_epoch": (lambda: Fit(4, "ce", _adam(3e-3), hidden=32), one_hard_batch, 4, False,
                                        6000),
    "pretrain": (lambda: Fit(4, "ce", _adam(1e-3), hidden=32), lambda: classes(1024, seed=2), 4, True, 3000),
}
# the fine-tune: the body of "pretrain" with a fresh head, on other labels of the same inputs, at a lower LR
FINE_TUNE = "fine_tune_fresh_head"
FINE_TUNE_STEPS = 3000


class Trace(pl.Callback):
    """The loss and the total gradient norm of every optimizer step, as the guard reads them."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"].detach().float()))


def fit(make: Callable[[], pl.LightningModule], data: TensorDataset, batch: int, shuffle: bool, steps: int,
        root: Any, callbacks: list) -> pl.LightningModule:
    """A quiet CPU fit of exactly ``steps`` optimizer steps (seed 0); returns the module."""
    pl.seed_everything(0, verbose=False)
    model = make()
    trainer = pl.Trainer(max_steps=steps, max_epochs=-1, accelerator="cpu", devices=1, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, logger=False,
                         default_root_dir=str(root), deterministic=True, callbacks=callbacks)
    trainer.fit(model, DataLoader(data, batch_size=batch, shuffle=shuffle,
                                  generator=torch.Generator().manual_seed(0) if shuffle else None))
    return model


def fine_tune_model(pretrained: pl.LightningModule) -> pl.LightningModule:
    """The fine-tune's module: the pretrained body, a fresh head, Adam at a tenth of the pretraining LR."""
    torch.manual_seed(1)
    model = Fit(4, "ce", _adam(1e-4), hidden=32)
    model.body.load_state_dict(pretrained.body.state_dict())
    return model


def fine_tune_data() -> TensorDataset:
    x, y = classes(1024, seed=2).tensors
    return TensorDataset(x, (y * 3 + 1) % 4)  # other labels of the same inputs


def record(root: Any, names: Optional[list[str]] = None) -> dict[str, dict[str, list[float]]]:
    """Fit the cases ``names`` (default: all; the fine-tune after "pretrain") with a :class:`Trace`; name -> losses
    and norms."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, (make, data, batch, shuffle, steps) in CASES.items():
        if names is not None and name not in names and not (name == "pretrain" and FINE_TUNE in names):
            continue
        trace = Trace()
        model = fit(make, data(), batch, shuffle, steps, Path(root) / name, [trace])
        out[name] = {"losses": trace.losses, "norms": trace.norms}
        print(f"{name}: {len(trace.losses)} steps", file=sys.stderr)
        if name == "pretrain" and (names is None or FINE_TUNE in names):
            trace = Trace()
            fit(lambda m=model: fine_tune_model(m), fine_tune_data(), 4, True, FINE_TUNE_STEPS, Path(root) / FINE_TUNE,
                [trace])
            out[FINE_TUNE] = {"losses": trace.losses, "norms": trace.norms}
    return out


def _pack(values: list[float]) -> str:
    return base64.b64encode(array("f", values).tobytes()).decode()


def _unpack(text: str) -> list[float]:
    return array("f", base64.b64decode(text)).tolist()


def save(traces: dict[str, dict[str, list[float]]], path: Path = TRACES) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"about": "per-step loss and total gradient norm of healthy fits (tests/healthy_runs.py), float32, "
                    f"torch {torch.__version__}, pytorch-lightning {pl.__version__}",
           "cases": {name: {k: _pack(v) for k, v in t.items()} for name, t in traces.items()}}
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(doc, f)


def load(path: Path = TRACES) -> dict[str, dict[str, list[float]]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    return {name: {k: _unpack(v) for k, v in t.items()} for name, t in doc["cases"].items()}


def judge(losses: list[float], norms: list[float], config: Optional[NaNGuardConfig] = None
          ) -> list[tuple[int, str, str]]:
    """The events the guard's host-side detectors raise on these numbers: ``(step, kind, cause)``.

    Every step is healthy (finite), so it goes where :meth:`~lightning_nanguard.respond.step.StepFlow._healthy` sends
    it: the divergence watch, the spike test (``LossWatch``), the spike's cause from the gradient-norm history,
    then the adaptive clip's statistics and the histories learn the norm."""
    cfg = config or NaNGuardConfig()
    check, clip = cfg.check, cfg.clip
    watch = LossWatch(check.spike_action, check.spike_z, check.spike_warmup)
    divergence = DivergenceWatch(check.divergence, check.divergence_growth, check.divergence_steps,
                                 check.divergence_factor)
    zclip = ZClip(clip.z_threshold, clip.ema_alpha, clip.warmup_steps)
    history: list[float] = []
    events: list[tuple[int, str, str]] = []
    for step, (loss, norm) in enumerate(zip(losses, norms)):
        found = divergence.observe(step, loss, norm)
        if found is not None:
            events.append((step, "divergence", found["rule"]))
            continue
        z = watch.observe(loss)
        if z is not None:
            events.append((step, "spike", spike_cause(norm, history, check.divergence_growth,
                                                      check.divergence_steps)[0]))
        zclip.update(norm)
        history = (history + [norm])[-200:]
        watch.healthy(loss)
    return events


def per_100k(events: int, steps: int) -> float:
    return 1e5 * events / max(steps, 1)


if __name__ == "__main__":  # python -m tests.healthy_runs [NAME ...]: re-record all cases, or those named
    import tempfile

    wanted = sys.argv[1:] or None
    with tempfile.TemporaryDirectory() as tmp:
        recorded = record(tmp, wanted)
    assert all(math.isfinite(v) for t in recorded.values() for vs in t.values() for v in vs)
    kept = load() if wanted and TRACES.exists() else {}
    merged = {name: recorded.get(name) or kept[name] for name in [*CASES, FINE_TUNE]
              if name in recorded or name in kept}
    save(merged)
    total = sum(len(t["losses"]) for t in merged.values())
    print(f"{len(merged)} cases, {total} steps -> {TRACES} ({TRACES.stat().st_size} bytes)", file=sys.stderr)
