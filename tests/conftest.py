import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    import pytorch_lightning as pl

    pl.seed_everything(0, verbose=False)
    yield
