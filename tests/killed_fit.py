"""A fit that SIGKILLs itself after its last checkpoint; run by tests/test_sink_faults.py.

    python -m tests.killed_fit ROOT

Events at steps 3 and 9 (NaN losses), disk snapshots every 2 steps, a checkpoint at step 6; at the start of step
11 the process kills itself (SIGKILL: no hook, no flush, no cleanup), leaving event 2 in events.jsonl after the
checkpoint's count and its snapshot files on disk.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from lightning_nanguard import NaNGuard

from . import models
from .test_sink_faults import Net

BAD = (3, 9)
KILL_AT = 11
CKPT_EVERY = 6


def guard(root: Path) -> NaNGuard:
    return NaNGuard(logging={"verbose": False},
                    recovery={"snapshot": "disk", "snapshot_every": 2, "snapshot_dir": str(root / "snaps")})


def trainer(root: Path, callbacks: list, steps: int) -> pl.Trainer:
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=CKPT_EVERY, save_top_k=-1)
    return models.trainer(root, [*callbacks, ckpt], max_steps=steps, max_epochs=-1, enable_checkpointing=True)


class Kill(pl.Callback):
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    pl.seed_everything(0, verbose=False)
    trainer(root, [guard(root), Kill()], 40).fit(Net(BAD), models.loader(models.regression_data(), 16))
