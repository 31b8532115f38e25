"""Regenerate the example incident pictures of docs/events.md from real fits (CPU, seeded, ~10 s):

- ``docs/images/gradient_flow.png``: a 4-layer MLP whose middle Linear (``net.2``) gets its weight gradient multiplied
  by 1.3 per step from step 20 (a per-layer gradient multiplier gone wrong); NaNGuard() stops the divergence it
  becomes at step 66 and names ``net.2``;
- ``docs/images/where_it_broke.png``: the same MLP without the multiplier; at step 30 one output element of ``net.2``
  is NaN (``FaultInjector``), the replay finds it there.

    python scripts/gen_example_images.py [--out docs/images]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_nanguard import NaNGuard  # noqa: E402
from lightning_nanguard.testing import Fault, FaultInjector  # noqa: E402
from tests.picture_runs import ExplodingMLP  # noqa: E402  (the test suite's model: the same pictures)

warnings.filterwarnings("ignore")


def fit(root: Path, name: str, make: Any, steps: int, callbacks: list) -> NaNGuard:
    pl.seed_everything(0, verbose=False)
    model = make()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    guard = NaNGuard()
    trainer = pl.Trainer(max_steps=steps, logger=TensorBoardLogger(str(root), name=name, version=0),
                         callbacks=callbacks + [guard], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1, log_every_n_steps=5)
    trainer.fit(model, DataLoader(TensorDataset(x, x[:, :1] * 0.5), batch_size=32))
    return guard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "images")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="nanguard-images-"))
    args.out.mkdir(parents=True, exist_ok=True)
    explosion = fit(root, "explosion", ExplodingMLP, 67, [])
    event = next(e for e in explosion.events if e.kind == "divergence")
    shutil.copy(explosion.report_path(event).with_name(f"{explosion.report_path(event).stem}-gradient_flow.png"),
                args.out / "gradient_flow.png")
    print(f"gradient_flow.png: step {event.step}, {event.kind}, cause {event.cause}, culprit {event.culprit}")
    fault = FaultInjector(Fault("activation", steps=[30], target="net.2"))
    broken = fit(root, "nan_activation", lambda: ExplodingMLP(growth=1.0), 40, [fault])
    event = broken.events[0]
    shutil.copy(broken.report_path(event).with_name(f"{broken.report_path(event).stem}-where_it_broke.png"),
                args.out / "where_it_broke.png")
    print(f"where_it_broke.png: step {event.step}, {event.kind}, cause {event.cause}, culprit {event.culprit}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
