"""benchmarks/rescue.py (issue 41), the rescue-quality benchmark: its corrupt batches are where it says and
nowhere else, its schedule restarts where it says, and one tiny case runs end to end."""

from __future__ import annotations

import importlib
import json
import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch


def _import_rescue():
    """benchmarks/ is not a package (its modules import each other by bare name), and its ``common`` quiets
    Lightning's loggers and some warnings for the benchmarks' output: imported here so that none of that reaches
    the rest of the suite (the guard's lines on screen are Lightning's rank-zero logger at INFO, which other tests
    read)."""
    names = ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric")
    levels = {name: logging.getLogger(name).level for name in names}
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        with warnings.catch_warnings():
            return importlib.import_module("rescue")
    finally:
        sys.path.remove(folder)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


rescue = _import_rescue()


@pytest.mark.parametrize("kind", rescue.CORRUPTIONS)
def test_rescue_corrupt_batches_touch_only_their_batches(kind):
    clean = rescue.text_train(12, batch=4)
    bad = rescue.corrupt(clean, kind, at=5, batch=4, n=3)
    rows = torch.zeros(len(clean.tensors[0]), dtype=torch.bool)
    rows[5 * 4: 8 * 4] = True
    for c, b in zip(clean.tensors, bad.tensors):
        assert torch.equal(c[~rows], b[~rows])
        assert int(b.min()) >= 0 and int(b.max()) < rescue.VOCAB
    # every corrupt row differs from the text it replaced (in its targets at least)
    assert bool((clean.tensors[1][rows] != bad.tensors[1][rows]).any(dim=1).all())
    if kind == "shuffled targets":  # the inputs stay the text; the targets are the same characters, reordered
        assert torch.equal(clean.tensors[0], bad.tensors[0])
        assert torch.equal(clean.tensors[1][rows].sort(dim=1).values, bad.tensors[1][rows].sort(dim=1).values)


def test_rescue_schedule_restarts_at_its_factor():
    s = rescue.Schedule(cycle=10, warmup=2, restart=20.0, floor=0.1)
    assert s(0) == pytest.approx(0.5) and s(1) == pytest.approx(1.0)
    assert s(2) == pytest.approx(1.0) and s(11) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + torch.cos(
        torch.tensor(torch.pi * 9 / 10)).item()))
    assert s(12) == pytest.approx(20.0)  # the warm restart, 20x the base LR
    assert s(21) < 20.0 * 0.2


def test_rescue_tiny_healthy_case_runs_end_to_end_bitwise(tmp_path):
    payload = rescue.main(["--quick", "--cases", "healthy: MLP", "--out", str(tmp_path)])
    (name, res), = payload["results"].items()
    rows = {r["setup"]: r for r in res["rows"]}
    assert rows["NaNGuard()"]["bitwise"] is True and rows["NaNGuard()"]["events"] == 0
    assert rows["no guard"]["val_loss"] == rows["NaNGuard()"]["val_loss"] < 2.3  # it learned (ln 10 = 2.30)
    written = json.loads((tmp_path / "rescue-partial.json").read_text())
    assert written["results"][name]["rows"][1]["bitwise"] is True
    assert "| healthy: MLP classifier" in (tmp_path / "rescue-partial.md").read_text()
