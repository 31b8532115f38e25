"""The seed case: an nn.Linear trained with a learning rate that is far too high goes to NaN.

Runs the same training twice, first without the guard (the loss grows about 10x per step and dies with
loss=nan) and then with ``NaNGuard()`` defaults: the guard sees the loss running away within a few steps, names
the learning rate as the cause, rolls back and cuts the LR before any value is non-finite (it is rescued). A
third run turns that early warning off (``check.divergence: off``), so the loss does go NaN under the guard:
the guard skips the NaN steps, rolls back and cuts the LR, and the run is rescued from the NaN itself. It
prints what the guard did and where its logs are, ending with the incident pictures (PNG files, and the
TensorBoard tabs that show them).

    python examples/demo.py [--out demo_logs]
"""

from __future__ import annotations

import argparse
import math
import shutil
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NaNGuard

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")


class LinearRegression(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.linear = nn.Linear(20, 1)
        self.first_nan_step: int | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.linear(x), y)
        if not torch.isfinite(loss) and self.first_nan_step is None:
            self.first_nan_step = self.global_step
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def make_data(n: int = 4096, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    w = torch.randn(20, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def final_loss(model: LinearRegression, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(model.linear(x), y))


def train(lr: float, out: Path, name: str, guard: NaNGuard | None) -> LinearRegression:
    pl.seed_everything(0, verbose=False)
    data = make_data()
    model = LinearRegression(lr)
    trainer = pl.Trainer(
        max_epochs=3, logger=TensorBoardLogger(str(out), name=name), callbacks=[guard] if guard else [],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=10, accelerator="cpu", devices=1,
    )
    trainer.fit(model, DataLoader(data, batch_size=32, shuffle=True))
    return model


def print_events(guard: NaNGuard) -> None:
    print(f"\n   events: {len(guard.events)}")
    for ev in guard.events:
        print(f"   - step {ev.step:4d}  kind={ev.kind:10s} cause={str(ev.cause):18s} actions={', '.join(ev.actions)}")
    for ev in guard.events[:1]:
        print(f"     {ev.suggestion}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="demo_logs", help="folder for TensorBoard logs and events.jsonl")
    parser.add_argument("--lr", type=float, default=1.5, help="the far-too-high learning rate (sane: 0.05)")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    torch.set_num_threads(1)
    data = make_data()

    print(f"== 1. nn.Linear + SGD(lr={args.lr}) without NaNGuard ==")
    plain = train(args.lr, out, "unguarded", None)
    loss = final_loss(plain, data)
    print(f"   first non-finite loss at step {plain.first_nan_step}; final loss = {loss}")
    print(f"   weights finite: {all(torch.isfinite(p).all() for p in plain.parameters())}")

    print("\n== 2. the same run with NaNGuard() ==")
    guard = NaNGuard()
    guarded = train(args.lr, out, "guarded", guard)
    loss = final_loss(guarded, data)
    sane = final_loss(train(0.05, out, "sane_lr", None), data)
    print_events(guard)
    first_nan = guarded.first_nan_step
    acted = next((ev.step for ev in guard.events if ev.kind == "divergence"), None)
    print(f"   first non-finite loss: {'none' if first_nan is None else f'step {first_nan}'}"
          + (f" (the guard acted at step {acted}, before any NaN)" if acted is not None and first_nan is None else ""))
    print(f"   learning-rate scale now: {guard.lr_scale:g}  (lr {args.lr} -> {args.lr * guard.lr_scale:g})")
    print(f"   final loss = {loss:.5f}   (a run at a sane lr=0.05 reaches {sane:.5f})")
    print(f"   weights finite: {all(torch.isfinite(p).all() for p in guarded.parameters())}")

    print("\n== 3. the same run with NaNGuard(check={'divergence': 'off'}): the loss goes NaN under the guard ==")
    nan_guard = NaNGuard(check={"divergence": "off"})
    nan_run = train(args.lr, out, "guarded_nan", nan_guard)
    nan_loss = final_loss(nan_run, data)
    print_events(nan_guard)
    print(f"   first non-finite loss: step {nan_run.first_nan_step} (skipped: it never reached the weights)")
    print(f"   learning-rate scale now: {nan_guard.lr_scale:g}  (lr {args.lr} -> {args.lr * nan_guard.lr_scale:g})")
    print(f"   final loss = {nan_loss:.5f}   weights finite: "
          f"{all(torch.isfinite(p).all() for p in nan_run.parameters())}")

    events = sorted(out.glob("guarded*/*/nanguard/events.jsonl"))
    print(f"\n   TensorBoard logs: {out}/   (tensorboard --logdir {out})")
    print("   events files:     " + ("\n                     ".join(str(e) for e in events) if events else "none"))
    print(f"   summary:          nanguard report {out}")
    pictures = sorted(out.glob("guarded*/*/nanguard/*.png"))
    if pictures:
        print("   incident pictures: " + "\n                      ".join(str(p) for p in pictures))
        print("   in TensorBoard:    the IMAGES tab (nanguard/incident/<kind>/gradient_flow and .../where_it_broke, "
              "at each incident's step)\n                      and the CUSTOM SCALARS tab (NaNGuard: loss, gradient "
              "norm and clip threshold, LR scale, incidents)")
    else:
        print("   incident pictures: off (matplotlib is not installed: pip install 'lightning-nanguard[plots]')")

    rescued = all(math.isfinite(v) and v < 10 * sane for v in (loss, nan_loss)) and nan_run.first_nan_step is not None
    print("\nRESCUED" if rescued else "\nNOT RESCUED")
    raise SystemExit(0 if rescued else 1)


if __name__ == "__main__":
    main()
