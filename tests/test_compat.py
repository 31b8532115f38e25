"""A standing compatibility suite (issue 12, items 5 and 8): real third-party architectures and the batch
structures users train with, under the guard. Each case asserts the two promises of the contract:

- a healthy run is bitwise identical to the unguarded run, with zero events;
- an injected fault is recovered: the event names the right culprit and kind, and the run ends exactly where
  the same run ends when that one step is skipped (the bad step leaves no trace).

Optional dependencies (``transformers``) come with the ``test`` extra; without them those cases skip.
torch.compile has its own file (``test_compile.py``), sparse graphs theirs (``test_sparse.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.testing import Fault, FaultInjector
from .models import SparseGraphAutoencoder, SquareNet, graph, graph_loader, overflow_data, trainer


class SkipStep(pl.Callback):
    """The reference for a recovered fault: the same run with optimizer step ``step`` skipped by hand."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == self.step:
            for p in pl_module.parameters():
                p.grad = None


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    """Bitwise equal parameters and buffers (sparse ones compared densely)."""
    sa, sb = a.state_dict(), b.state_dict()
    dense = [(p.to_dense(), q.to_dense()) if p.layout != torch.strided else (p, q)
             for p, q in zip(sa.values(), sb.values())]
    return list(sa) == list(sb) and all(torch.equal(p, q) for p, q in dense)


def check_compat(tmp_path: Any, make_model: Callable[[], nn.Module], make_loader: Callable[[], Any],
                 fault: Fault, make_trainer: Callable[..., Any] = trainer, culprit: Any = "target",
                 **guard_kwargs: Any) -> Any:
    """Healthy: bitwise identical, no event. Fault: one event naming ``culprit`` (default: the fault's
    target), the step skipped, and the final weights those of the run that skips that step. Returns the
    event."""
    runs = {}
    for name, callbacks in (("plain", []), ("guarded", [NaNGuard(**guard_kwargs)]),
                            ("reference", [SkipStep(min(fault.steps))]),
                            ("fault", [FaultInjector(fault), NaNGuard(**guard_kwargs)])):
        pl.seed_everything(0)
        model = make_model()
        make_trainer(tmp_path / name, callbacks).fit(model, make_loader())
        runs[name] = (model, callbacks[-1] if callbacks else None)
    guard = runs["guarded"][1]
    assert guard.events == [] and same_weights(runs["plain"][0], runs["guarded"][0])
    (event,) = runs["fault"][1].events
    expected = fault.target if culprit == "target" else culprit
    assert event.culprit == expected and event.step == min(fault.steps) and event.actions[0] == "skip_step"
    assert same_weights(runs["reference"][0], runs["fault"][0])
    return event


# ----------------------------------------------------------------------------------- batch structures


@dataclass
class XY:
    x: torch.Tensor
    y: torch.Tensor


class PairXY(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


STRUCTURES: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], Any], str]] = {
    "tuple": (lambda x, y: (x, y), "batch[0]"),
    "dict": (lambda x, y: {"x": x, "y": y}, "batch['x']"),
    "dataclass": (XY, "batch.x"),
    "namedtuple": (PairXY, "batch.x"),
}


def structured_loader(kind: str, bad_batch: Any = None) -> DataLoader:
    make, _ = STRUCTURES[kind]
    x, y = overflow_data(bad_batch).tensors
    return DataLoader([make(x[i:i + 8], y[i:i + 8]) for i in range(0, len(x), 8)], batch_size=None)


@pytest.mark.parametrize("kind", list(STRUCTURES))
def test_batch_structure_healthy_and_input_fault(tmp_path: Any, kind: str) -> None:
    """Checks, input finders and the FaultInjector walk dict, dataclass and NamedTuple batches:
    ``details.inputs[*].field`` names the field."""
    field = STRUCTURES[kind][1]
    event = check_compat(tmp_path, SquareNet, lambda: structured_loader(kind),
                         Fault("input", steps=[3], target=field), culprit=None, check={"inputs": "always"})
    assert (event.kind, event.cause) == ("input", "input")
    (found,) = event.details["inputs"]
    assert found["field"] == field and found["samples"] and found["features"]


@pytest.mark.parametrize("kind", list(STRUCTURES))
def test_batch_structure_float64_rerun(tmp_path: Any, kind: str) -> None:
    """The float64 rerun casts every structure (a dataclass batch used to keep float32: dtype mismatch,
    cause unknown): an overflow is named as in a tuple batch."""
    guard = NaNGuard()
    trainer(tmp_path, [guard]).fit(SquareNet(), structured_loader(kind, bad_batch=2))
    (event,) = guard.events
    assert "errors" not in event.details["replay"]
    assert (event.culprit, event.op, event.cause) == ("net.1", "MulBackward0", "overflow")
    assert event.details["float64"]["finite"] is True


# ---------------------------------------------------------------------------- activation checkpointing


class RowNorm(nn.Module):
    """Appends the row norm; ``sqrt`` at an all-zero row has an infinite derivative (a NaN in backward)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, torch.sqrt((h * h).sum(-1, keepdim=True))], dim=-1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16, bias=False)
        self.rownorm = RowNorm()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.rownorm(self.lin(h))


class Checkpointed(pl.LightningModule):
    def __init__(self, reentrant: Any) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.proj = nn.Linear(8, 16, bias=False)
        self.block = Block()
        self.head = nn.Linear(17, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.proj(x)
        h = self.block(h) if self.reentrant is None else checkpoint(self.block, h, use_reentrant=self.reentrant)
        return nn.functional.mse_loss(self.head(h), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("reentrant", [None, True, False], ids=["plain", "reentrant", "non_reentrant"])
def test_activation_checkpointing_replay_names_the_backward_op(tmp_path: Any, reentrant: Any) -> None:
    """``checkpoint(..., use_reentrant=True)`` refuses ``torch.autograd.grad``: the replay falls back to
    ``backward()`` (grads put back) and hooks the graph the checkpoint rebuilds inside backward."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    x[19] = 0.0  # a zero row in batch 2
    guard = NaNGuard()
    model = Checkpointed(reentrant)
    trainer(tmp_path, [guard]).fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    (event,) = guard.events
    assert "errors" not in event.details["replay"]
    assert (event.kind, event.culprit, event.op, event.cause) == ("gradient", "block.rownorm", "SqrtBackward0",
                                                                   "backward_op")
    assert event.details["replay"]["nonfinite_grads"] == ["proj.weight", "block.lin.weight"]


# -------------------------------------------------------------------------------- third-party models


def token_loader(vocab: int, batches: int = 6, length: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batches * 4, length), generator=g)
    return DataLoader([{"input_ids": ids[i:i + 4]} for i in range(0, len(ids), 4)], batch_size=None)


class CausalLM(pl.LightningModule):
    """A Hugging Face causal LM, randomly initialised from a config (no download)."""

    def __init__(self, arch: str) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        common = dict(vocab_size=256, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        if arch == "gpt2":
            config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=16, **common)
            self.model = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=16, **common)
            self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("arch,target", [("gpt2", "model.transformer.h.1.mlp.c_fc"),
                                         ("llama", "model.model.layers.1.mlp.up_proj")])
def test_huggingface_causal_lm(tmp_path: Any, arch: str, target: str) -> None:
    pytest.importorskip("transformers")
    event = check_compat(tmp_path, lambda: CausalLM(arch), lambda: token_loader(256),
                         Fault("activation", steps=[3], target=target))
    assert event.kind == "loss" and event.details["replay"]["reproduced"]


@pytest.mark.parametrize("layout,in_batch", [(torch.sparse_coo, False), (torch.sparse_csr, True)],
                         ids=["coo_buffer", "csr_batch"])
def test_graph_autoencoder_with_sparse_adjacency(tmp_path: Any, layout: torch.layout, in_batch: bool) -> None:
    adj, target, x = graph(layout=layout)
    event = check_compat(tmp_path, lambda: SparseGraphAutoencoder(adj.clone(), target, x.shape[1]),
                         lambda: graph_loader(x, adj=adj if in_batch else None),
                         Fault("activation", steps=[4], target="gcn"), check={"inputs": "always"})
    assert event.kind == "loss" and event.details["replay"]["reproduced"]


def test_lightning_package_demo_transformer(tmp_path: Any) -> None:
    """The unified ``lightning`` package: its Trainer and its demo Transformer (encoder-decoder with -inf
    masks and dropout)."""
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.demos.transformer import LightningTransformer

    class DemoTransformer(LightningTransformer):
        def prepare_data(self) -> None:  # the demo downloads WikiText-2: feed it tokens instead
            pass

    def make_trainer(root: Any, callbacks: list) -> Any:
        return L.Trainer(max_epochs=1, accelerator="cpu", devices=1, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, logger=False,
                         default_root_dir=str(root), deterministic=True, callbacks=callbacks)

    def make_loader() -> DataLoader:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 32, (6, 2, 2, 8), generator=g)  # 6 batches of (inputs, target), 2 x 8 tokens
        return DataLoader([(i[0], i[1]) for i in ids], batch_size=None)

    event = check_compat(tmp_path, lambda: DemoTransformer(vocab_size=32), make_loader,
                         Fault("activation", steps=[2], target="model.decoder"), make_trainer=make_trainer)
    assert event.kind == "loss"
