"""torch.compile under the guard (issue 12, item 4): healthy compiled runs are transparent, and an incident in
a compiled model is replayed eagerly and diagnosed like the same model uncompiled (same culprit, op and
cause), without recompiling the user's graphs. Compiled both ways users do it: a submodule compiled inside
the LightningModule, and the whole LightningModule passed to ``fit`` compiled."""

from __future__ import annotations

import shutil
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from lightning_nanguard import NaNGuard
from .models import SquareNet, loader, overflow_data, trainer


def overflow_loader(bad_batch: Optional[int] = 2) -> DataLoader:
    return loader(overflow_data(bad_batch), batch_size=8)


def compiled_model(how: Optional[str], backend: str) -> pl.LightningModule:
    pl.seed_everything(0)
    if how == "submodule":
        return SquareNet(compile_net=backend)
    model = SquareNet()
    return torch.compile(model, backend=backend) if how == "whole" else model


class CompileCount(pl.Callback):
    """Dynamo's count of compiled frames once the first step compiled the graphs, and at the end of fit."""

    def __init__(self) -> None:
        self.after_first: Optional[int] = None
        self.at_end: Optional[int] = None

    @staticmethod
    def frames() -> int:
        return sum(counters["frames"].values()) + counters["stats"]["unique_graphs"]

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.after_first is None:
            self.after_first = self.frames()

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.at_end = self.frames()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def diagnosis(how: Optional[str], backend: str, tmp_path: Any) -> tuple[Any, CompileCount]:
    guard, count = NaNGuard(), CompileCount()
    trainer(tmp_path, [guard, count]).fit(compiled_model(how, backend), overflow_loader())
    (event,) = guard.events
    return event, count


@pytest.mark.parametrize("how", ["submodule", "whole"])
def test_incident_in_compiled_model_is_diagnosed_like_eager(tmp_path: Any, how: str) -> None:
    """The replay runs eagerly (dynamo's ``eager`` backend: dynamo traces, no code generation, so the test
    is fast and fails exactly where the replay used to, on dynamo tracing the replay's hooks)."""
    eager, _ = diagnosis(None, "eager", tmp_path / "eager")
    assert (eager.culprit, eager.op, eager.cause) == ("net.1", "MulBackward0", "overflow")
    compiled, count = diagnosis(how, "eager", tmp_path / how)
    assert "errors" not in compiled.details["replay"]
    assert (compiled.kind, compiled.culprit, compiled.op, compiled.cause) == (
        eager.kind, eager.culprit, eager.op, eager.cause)
    assert compiled.details["float64"]["module_finite"] is True
    assert count.after_first and count.at_end == count.after_first  # the replay compiled nothing


@pytest.mark.parametrize("how", ["submodule", "whole"])
def test_healthy_compiled_run_is_transparent(tmp_path: Any, how: str) -> None:
    plain = compiled_model(how, "eager")
    trainer(tmp_path / "plain", []).fit(plain, overflow_loader(None))
    guard = NaNGuard(recovery={"snapshot_every": 2})
    guarded = compiled_model(how, "eager")
    trainer(tmp_path / "guarded", [guard]).fit(guarded, overflow_loader(None))
    assert guard.events == [] and guard.counters["snapshots"] == 5
    for p, q in zip(plain.parameters(), guarded.parameters()):
        assert torch.equal(p, q)


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="inductor needs a C++ compiler on CPU")
def test_inductor_compiled_model_healthy_and_incident(tmp_path: Any) -> None:
    """The default backend (inductor, C++ code generation on CPU): transparent when healthy; an incident
    diagnosed like eager, with no recompilation. Slow: compiling takes seconds (tens on a cold cache)."""
    plain = compiled_model("submodule", "inductor")
    trainer(tmp_path / "plain", []).fit(plain, overflow_loader(None))
    guard = NaNGuard()
    guarded = compiled_model("submodule", "inductor")
    trainer(tmp_path / "guarded", [guard]).fit(guarded, overflow_loader(None))
    assert guard.events == [] and all(torch.equal(p, q) for p, q in zip(plain.parameters(), guarded.parameters()))
    event, count = diagnosis("submodule", "inductor", tmp_path / "incident")
    assert (event.culprit, event.op, event.cause) == ("net.1", "MulBackward0", "overflow")
    assert count.at_end == count.after_first
