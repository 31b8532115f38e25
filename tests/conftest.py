"""Fixtures shared by the test files: quiet CPU Trainers and fits writing under ``tmp_path``.

Models, data and pure helpers live in ``tests/models.py``; import them with ``from .models import ...``.
"""

import os
from typing import Any, Iterable, Optional

import pytest
import torch
from torch.utils.data import Dataset

from . import models

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    import pytorch_lightning as pl

    pl.seed_everything(0, verbose=False)
    yield


@pytest.fixture
def make_trainer(tmp_path):
    """``make_trainer(callbacks=(), subdir=None, **trainer_kwargs)``: a quiet CPU Trainer (``models.trainer``)
    writing under ``tmp_path``, or under ``tmp_path / subdir``."""

    def make(callbacks: Iterable[Any] = (), subdir: Optional[str] = None, **kwargs: Any):
        return models.trainer(tmp_path if subdir is None else tmp_path / str(subdir), list(callbacks), **kwargs)

    return make


@pytest.fixture
def fit(make_trainer):
    """``fit(model, data, callbacks=(), subdir=None, batch_size=32, shuffle=False, steps=None, val=None,
    ckpt_path=None, **trainer_kwargs)``: fit ``model`` in a ``make_trainer`` Trainer and return the Trainer.

    ``data`` is a Dataset (batched by ``models.loader``) or anything ``Trainer.fit`` takes; ``steps`` runs
    exactly that many optimizer steps (``max_steps=steps, max_epochs=-1``); ``val`` is the validation data."""

    def run(model, data, callbacks: Iterable[Any] = (), subdir: Optional[str] = None, batch_size: int = 32,
            shuffle: bool = False, steps: Optional[int] = None, val: Any = None, ckpt_path: Optional[str] = None,
            **kwargs: Any):
        if steps is not None:
            kwargs = {"max_steps": steps, "max_epochs": -1, **kwargs}
        trainer = make_trainer(callbacks, subdir, **kwargs)
        batches = models.loader(data, batch_size, shuffle) if isinstance(data, Dataset) else data
        if isinstance(val, Dataset):
            val = models.loader(val, batch_size)
        trainer.fit(model, batches, val, ckpt_path=ckpt_path)
        return trainer

    return run


@pytest.fixture
def fit_steps(fit):
    """``fit_steps(model, callbacks, steps, data=None, batch_size=16, **fit_kwargs)``: exactly ``steps`` optimizer
    steps on ``data`` (default: ``models.regression_data(n=512)``); returns the Trainer."""

    def run(model, callbacks: Iterable[Any], steps: int, data: Any = None, batch_size: int = 16, **kwargs: Any):
        data = data if data is not None else models.regression_data(n=512)
        return fit(model, data, callbacks, batch_size=batch_size, steps=steps, **kwargs)

    return run
