"""Every sparse layout docs/compatibility.md promises, through the public surface only.

"A sparse adjacency buffer (COO, CSR, CSC, BSR, BSC), a sparse tensor in the batch and the sparse gradients of
``nn.Embedding(sparse=True)`` are checked through their stored values, snapshotted and restored in their own
layout (a CSR buffer rebuilt with another sparsity is put back whole), and a bad entry is named by its row and
column (``details.inputs[*].samples`` / ``features``). Sparse gradients count in the gradient norm and are
clipped; AGC (``clip.agc_clip_factor``) leaves them alone."

Each layout: a healthy fit is bitwise the unguarded one with no event; a NaN written into a buffer's stored
values is named and rolled back to the buffer, bitwise, in its layout (also a compressed buffer the forward
rebuilds with another number of stored elements); a NaN in a sparse batch tensor is named by row and column.
Nested tensors (``torch.nested``) are not promised by the docs and are not tested here.
"""

from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_nanguard import NaNGuard
from lightning_nanguard.testing import Fault, FaultInjector
from .models import SparseGraphAutoencoder, graph, graph_loader, trainer

LAYOUTS = {"coo": torch.sparse_coo, "csr": torch.sparse_csr, "csc": torch.sparse_csc,
           "bsr": torch.sparse_bsr, "bsc": torch.sparse_bsc}
COMPRESSED = ("csr", "csc", "bsr", "bsc")
BLOCK = (2, 2)  # the graphs have 12 nodes: 6 x 6 blocks
QUIET = {"verbose": False}


def to_layout(dense: torch.Tensor, layout: str) -> torch.Tensor:
    """``dense`` in ``layout`` (COO coalesced; BSR/BSC with 2x2 blocks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*support is in beta.*")
        if layout == "coo":
            return dense.to_sparse_coo().coalesce()
        if layout in ("bsr", "bsc"):
            return dense.to_sparse(layout=LAYOUTS[layout], blocksize=BLOCK)
        return dense.to_sparse(layout=LAYOUTS[layout])


def parts(t: torch.Tensor) -> list[torch.Tensor]:
    """What a sparse tensor stores, in its own layout: the index tensors and the values."""
    if t.layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    return [t.ccol_indices(), t.row_indices(), t.values()]


def stored(t: torch.Tensor) -> torch.Tensor:
    """The stored values of ``t``, as a view one can write into."""
    return t._values() if t.layout is torch.sparse_coo else t.values()


def assert_same_sparse(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same layout, shape, index tensors and values, bitwise (no conversion)."""
    assert (a.layout, a.shape) == (b.layout, b.shape)
    pa, pb = parts(a), parts(b)
    assert [p.shape for p in pa] == [p.shape for p in pb]
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))


def spmm(adj: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``adj @ h``; torch has no CPU backward for block layouts: those go through COO, as user code would."""
    return adj @ h if adj.layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc) else adj.to_sparse_coo() @ h


class LayoutGAE(SparseGraphAutoencoder):
    """The graph autoencoder of tests/models.py with a buffer (and an optional batch adjacency) of any layout."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        adj, x = batch if isinstance(batch, (tuple, list)) else (self.adj, batch)
        h = torch.relu(spmm(adj, self.encoder(x)))
        z = spmm(adj, self.gcn(h))
        return nn.functional.binary_cross_entropy_with_logits(z @ z.t(), self.target)


def layout_graph(layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    adj, target, x = graph()
    return to_layout(adj.to_dense(), layout), target, x


def fit_layout(tmp_path: Any, layout: str, callbacks: list, in_batch: bool = False, batches: Any = None,
               **kwargs: Any) -> tuple[LayoutGAE, torch.Tensor]:
    adj, target, x = layout_graph(layout)
    pl.seed_everything(0, verbose=False)
    model = LayoutGAE(adj.clone(), target, x.shape[1])
    data = batches if batches is not None else graph_loader(x, adj=adj if in_batch else None)
    trainer(tmp_path, callbacks, **kwargs).fit(model, data)
    return model, adj


# ------------------------------------------------------------------------------------------ healthy runs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_healthy_fit_with_sparse_buffer_and_batch_in_every_layout_is_bitwise_unguarded(tmp_path, layout):
    """The adjacency is a buffer AND travels in the batch (the model reads the batch's): every check reads
    both through their stored values every step (``check.inputs: always``), snapshots copy the buffer, and the
    trained weights are bitwise those of the run without the guard."""
    plain, _ = fit_layout(tmp_path / "plain", layout, [], in_batch=True, max_epochs=2)
    guard = NaNGuard(check={"inputs": "always"}, recovery={"snapshot_every": 2}, logging=QUIET)
    guarded, adj = fit_layout(tmp_path / "guarded", layout, [guard], in_batch=True, max_epochs=2)
    assert guard.events == [] and guard.counters["incidents"] == 0 and guard.counters["skipped_steps"] == 0
    assert guard.counters["snapshots"] == 1 + 16 // 2  # fit start, then every 2 of the 16 steps: all taken
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in guarded.named_parameters()]
    for (name, p), q in zip(plain.named_parameters(), guarded.parameters()):
        assert torch.equal(p, q), name
    assert_same_sparse(guarded.adj, adj)


# ----------------------------------------------------------------------------- a NaN in a sparse buffer


class PoisonStored(pl.Callback):
    """After optimizer step ``step``: one stored value of the sparse buffer ``adj`` becomes NaN, in place."""

    def __init__(self, step: int, index: int = 3) -> None:
        self.step, self.index = step, index

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                stored(pl_module.adj).view(-1)[self.index] = float("nan")


@pytest.mark.parametrize("mode", ["memory", "disk"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nan_in_stored_values_of_a_sparse_buffer_is_named_and_rolled_back_bitwise(tmp_path, layout, mode):
    guard = NaNGuard(recovery={"snapshot": mode, "snapshot_every": 2}, logging=QUIET)
    model, adj = fit_layout(tmp_path, layout, [PoisonStored(step=5), guard])
    (event,) = guard.events
    # poisoned after the update of step 4 (global_step 5): read with the flags of the next step
    assert (event.kind, event.culprit, event.step) == ("buffer", "adj", 5)
    (finding,) = event.details["nonfinite_parameters"]
    assert (finding["name"], finding["nan"], finding["inf"]) == ("adj", 1, 0)
    assert finding["layout"] == str(LAYOUTS[layout]).replace("torch.", "")
    assert finding["nnz"] == stored(adj).shape[0]  # stored elements (blocks for BSR/BSC)
    assert "rollback" in event.actions and event.details["restored_step"] == 4
    assert guard.counters["rollbacks"] == 1 and not guard.stopped
    # the adjacency never changes in training: the rollback put the original back, in its own layout
    assert_same_sparse(model.adj, adj)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


class RebuiltAdjacency(LayoutGAE):
    """Rebuilds its adjacency from each batch in its layout (a k-NN style graph): the number of stored elements
    changes from step to step, and a compressed tensor cannot be copied in place across them."""

    def __init__(self, layout: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout_name = layout

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        sim = torch.sigmoid(batch @ batch.t()).detach()
        k = 1 + 2 * (batch_idx % 3)  # each node keeps its k nearest: 1, 3 or 5 neighbours
        near = sim >= sim.topk(k, dim=1).values[:, -1:]
        self.adj = to_layout(torch.where(near, sim, 0.0) + torch.eye(len(sim)), self.layout_name)
        return super().training_step(batch, batch_idx)


class AdjacencySpy(pl.Callback):
    """After the guard: a copy of the adjacency at every batch end (by global step), and at the rollback, the
    adjacency just before and just after it."""

    def __init__(self, guard: NaNGuard) -> None:
        self.guard = guard
        self.at: dict[int, torch.Tensor] = {}
        self.before: Any = None
        self.rollback: Any = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.before = pl_module.adj.clone()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if self.guard.counters["rollbacks"] and self.rollback is None:
            self.rollback = (self.before, pl_module.adj.clone())
        self.at.setdefault(trainer.global_step, pl_module.adj.clone())


@pytest.mark.parametrize("layout", COMPRESSED)
def test_rollback_puts_back_a_compressed_buffer_rebuilt_with_another_sparsity(tmp_path, layout):
    """load_state_dict alone raises on a compressed buffer whose number of stored elements changed; the rollback
    puts the snapshot's buffer back whole, in its layout."""
    adj, target, x = layout_graph(layout)
    guard = NaNGuard(recovery={"snapshot_every": 2}, logging=QUIET)
    spy = AdjacencySpy(guard)
    pl.seed_everything(0, verbose=False)
    model = RebuiltAdjacency(layout, adj, target, x.shape[1])
    injector = FaultInjector(Fault("parameter", steps=[4], target="gcn.weight"))
    trainer(tmp_path, [injector, guard, spy]).fit(model, graph_loader(x))
    (event,) = guard.events
    assert event.kind == "parameter" and event.culprit == "gcn.weight" and "rollback" in event.actions
    restored = event.details["restored_step"]
    before, after = spy.rollback
    snapshot = spy.at[restored]  # the adjacency the module held when the snapshot of that step was taken
    assert stored(before).shape[0] != stored(snapshot).shape[0]  # another number of stored elements
    assert_same_sparse(after, snapshot)
    assert after.layout is LAYOUTS[layout]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ------------------------------------------------------------------------------ a NaN in a sparse batch


def poisoned_batches(layout: str, bad: int, row: int, col: int) -> tuple[DataLoader, torch.Tensor]:
    """Full-graph batches ``(adj, x)`` in ``layout``; in batch ``bad`` the stored entry (row, col) is NaN."""
    adj, _, x = graph()
    dense = adj.to_dense()
    assert dense[row, col] != 0  # an edge: stored in every layout
    g = torch.Generator().manual_seed(1)
    items = []
    for i in range(8):
        a = dense.clone()
        if i == bad:
            a[row, col] = float("nan")
        items.append((to_layout(a, layout), x + 0.1 * torch.randn(x.shape, generator=g)))
    return DataLoader(items, batch_size=None), dense


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nan_in_sparse_batch_of_every_layout_is_named_by_row_and_column(tmp_path, layout):
    adj, _, _ = graph()
    row, col = (int(i) for i in adj.indices()[:, 7])  # an off-diagonal edge of the graph
    assert row != col
    batches, _ = poisoned_batches(layout, bad=3, row=row, col=col)
    guard = NaNGuard(logging=QUIET)
    model, _ = fit_layout(tmp_path, layout, [guard], batches=batches)
    (event,) = guard.events
    assert (event.kind, event.cause, event.step, event.batch_idx) == ("input", "input", 3, 3)
    assert event.actions[0] == "skip_step"
    (found,) = event.details["inputs"]
    assert (found["field"], found["nan"], found["inf"]) == ("batch[0]", 1, 0)
    assert found["layout"] == str(LAYOUTS[layout]).replace("torch.", "")
    assert found["samples"] == [row] and found["features"] == [col]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# -------------------------------------------------------------------------------- sparse gradients


class TwoPartEmbedding(pl.LightningModule):
    """A sparse embedding and a dense regression head with separate losses: the embedding's trajectory does
    not depend on the head's (unless a clip couples them through the total norm)."""

    def __init__(self, rows: int = 32, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim, sparse=True)
        self.head = nn.Linear(6, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, y, x, t = batch
        return (nn.functional.mse_loss(self.emb(idx).sum(-1), y)
                + nn.functional.mse_loss(self.head(x), t))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def embedding_batches() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (64, 3), generator=g)  # repeated rows: uncoalesced sparse gradients
    y, x = torch.randn(64, 3, generator=g), torch.randn(64, 6, generator=g)
    t = x.sum(-1, keepdim=True)
    return DataLoader(list(zip(idx, y, x, t)), batch_size=8)


def hand_norm(module: nn.Module) -> torch.Tensor:
    """The 2-norm of every gradient, the sparse one through its coalesced values."""
    grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in module.parameters()]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


class HandClip(pl.Callback):
    """The reference for ``clip.max_norm``: the hand-computed norm of every step, and, with ``max_norm``, every
    gradient (the sparse one too) scaled by ``max_norm / (norm + 1e-6)`` where the norm is above it."""

    def __init__(self, max_norm: Any = None) -> None:
        self.max_norm, self.norms = max_norm, []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        norm = hand_norm(pl_module)
        self.norms.append(float(norm))
        if self.max_norm is not None and float(norm) > self.max_norm:
            for p in pl_module.parameters():
                p.grad.mul_(self.max_norm / (norm + 1e-6))


def fit_embedding(tmp_path: Any, callbacks: list, **kwargs: Any) -> TwoPartEmbedding:
    pl.seed_everything(0, verbose=False)
    model = TwoPartEmbedding()
    trainer(tmp_path, callbacks, **kwargs).fit(model, embedding_batches())
    return model


def logged(root: Path, tag: str) -> list[float]:
    """The values of column ``tag`` of the CSVLogger's metrics.csv under ``root``, in order."""
    (path,) = root.rglob("metrics.csv")
    with open(path) as f:
        return [float(r[tag]) for r in csv.DictReader(f) if r.get(tag) not in (None, "")]


def test_sparse_gradients_count_in_the_logged_gradient_norm(tmp_path):
    """A healthy run with a sparse embedding: bitwise the unguarded run, and ``nanguard/grad_norm`` of every
    step is the norm of all gradients, the sparse one included (without it, it would be the head's alone)."""
    plain = fit_embedding(tmp_path / "plain", [])
    spy, guard = HandClip(), NaNGuard(logging=QUIET)
    guarded = fit_embedding(tmp_path / "guarded", [spy, guard], logger=CSVLogger(tmp_path / "guarded"),
                            log_every_n_steps=1)
    assert guard.events == []
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), guarded.parameters()))
    norms = logged(tmp_path / "guarded", "nanguard/grad_norm")
    assert len(norms) == len(spy.norms) == 8
    assert norms == pytest.approx(spy.norms, rel=1e-6)


def test_clip_max_norm_scales_sparse_gradients_like_dense_ones(tmp_path):
    """``clip.max_norm``: every step is above the limit; the embedding (sparse) and the head (dense) move as
    under a hand clip of every gradient by the total norm, and not as without clipping."""
    max_norm = 0.05
    reference = fit_embedding(tmp_path / "hand", [HandClip(max_norm)])
    unclipped = fit_embedding(tmp_path / "plain", [])
    guard = NaNGuard(clip={"max_norm": max_norm}, logging=QUIET)
    clipped = fit_embedding(tmp_path / "guarded", [guard])
    assert guard.events == [] and guard.counters["clipped_steps"] == 8
    for (name, p), q, u in zip(clipped.named_parameters(), reference.parameters(), unclipped.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name
        assert not torch.allclose(p, u, rtol=1e-3), name  # clipping made a difference to this parameter


def test_agc_clips_dense_gradients_and_leaves_sparse_ones_alone(tmp_path):
    """``clip.agc_clip_factor``: the dense head's gradient is clipped unit-wise (it moves far less than without),
    the sparse embedding's is left alone (its trajectory is bitwise the unguarded one's), and nothing crashes."""
    plain = fit_embedding(tmp_path / "plain", [])
    guard = NaNGuard(clip={"agc_clip_factor": 1e-3}, logging=QUIET)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*sparse gradients are not clipped unit-wise.*")
        agc = fit_embedding(tmp_path / "agc", [guard])
    assert guard.events == []
    assert torch.equal(agc.emb.weight, plain.emb.weight)
    pl.seed_everything(0, verbose=False)
    init = TwoPartEmbedding().head.weight.detach()
    moved_agc = float((agc.head.weight.detach() - init).norm())
    moved_plain = float((plain.head.weight.detach() - init).norm())
    assert math.isfinite(moved_agc) and 0 < moved_agc < 0.1 * moved_plain
