"""Sparse tensors under the guard (issue 12, item 2): a graph autoencoder keeps its adjacency as a torch.sparse
buffer or receives it in the batch, and an embedding with ``sparse=True`` has sparse gradients. Every path
reads the stored values (COO and CSR), copies in the sparse layout and names bad entries by their indices."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_nanguard import NaNGuard
from lightning_nanguard.core import layouts
from lightning_nanguard.testing import Fault, FaultInjector
from .models import SparseGraphAutoencoder, graph, graph_loader, trainer

LAYOUTS = {"coo": torch.sparse_coo, "csr": torch.sparse_csr, "csc": torch.sparse_csc}


def same_sparse(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same layout, same stored entries (indices and values), bitwise."""
    if a.layout != b.layout or a.shape != b.shape:
        return False
    a, b = a.to_sparse_coo().coalesce(), b.to_sparse_coo().coalesce()
    return torch.equal(a.indices(), b.indices()) and torch.equal(a.values(), b.values())


def uncoalesced(adj: torch.Tensor) -> torch.Tensor:
    """The same COO tensor, every entry stored twice as two halves (as an unsorted sum of edge lists is)."""
    i, v = adj._indices(), adj._values()
    return torch.sparse_coo_tensor(torch.cat([i, i], 1), torch.cat([v / 2, v / 2]), adj.shape, check_invariants=True)


def fit_gae(tmp_path: Any, layout: str, callbacks: list, epochs: int = 1, in_batch: bool = False,
            **kwargs: Any) -> tuple[SparseGraphAutoencoder, torch.Tensor]:
    adj, target, x = graph(layout=LAYOUTS[layout.replace("_dup", "")])
    if layout == "coo_dup":
        adj = uncoalesced(adj)
    pl.seed_everything(0)
    model = SparseGraphAutoencoder(adj.clone(), target, x.shape[1])
    trainer(tmp_path, callbacks, max_epochs=epochs, **kwargs).fit(model, graph_loader(x, adj=adj if in_batch else None))
    return model, adj


class PoisonBuffer(pl.Callback):
    """After optimizer step ``step``, one stored value of the sparse buffer ``adj`` becomes NaN (in place)."""

    def __init__(self, step: int, index: int = 3) -> None:
        self.step, self.index = step, index

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                layouts.raw_values(pl_module.adj)[self.index] = float("nan")


# ------------------------------------------------------------------------------------ buffers, snapshots


@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_healthy_run_with_sparse_buffer_is_transparent_and_snapshotted(tmp_path: Any, layout: str) -> None:
    """A sparse adjacency buffer: no crash at fit start, bitwise identical weights, no event, and the
    snapshots hold the adjacency in its own layout, exactly."""
    plain, _ = fit_gae(tmp_path / "plain", layout, [], epochs=2)
    guard = NaNGuard(check={"inputs": "always"}, recovery={"snapshot_every": 2})
    guarded, adj = fit_gae(tmp_path / "guarded", layout, [guard], epochs=2)
    assert guard.events == []
    for (name, p), q in zip(plain.named_parameters(), guarded.parameters()):
        assert torch.equal(p, q), name
    store = guard.snapshots
    assert guard.counters["snapshots"] == 1 + 16 // 2  # fit start, then every 2 of the 16 healthy steps
    snap = store.load(store.newest)["module"]["adj"]
    assert same_sparse(snap, adj) and snap.layout == LAYOUTS[layout]


@pytest.mark.parametrize("mode", ["memory", "disk"])
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_nan_in_sparse_buffer_is_named_and_rolled_back_exactly(tmp_path: Any, layout: str, mode: str) -> None:
    """The state check reads the stored values of a sparse buffer; the rollback restores it exactly, in its
    layout, from memory or disk snapshots."""
    guard = NaNGuard(recovery={"snapshot": mode, "snapshot_every": 2})
    model, adj = fit_gae(tmp_path, layout, [PoisonBuffer(step=5), guard])
    (event,) = guard.events
    # poisoned after the optimizer step of batch 4 (global_step 5), read with the flags of batch 5
    assert (event.kind, event.culprit, event.step, event.batch_idx) == ("buffer", "adj", 5, 5)
    assert "rollback" in event.actions and event.details["restored_step"] == 4
    (finding,) = event.details["nonfinite_parameters"]
    assert (finding["name"], finding["nan"], finding["nnz"]) == ("adj", 1, adj._nnz())
    assert finding["layout"] == str(adj.layout).replace("torch.", "")
    assert same_sparse(model.adj, adj)  # the adjacency never changes in training: restored to the original


class RebuiltGraph(SparseGraphAutoencoder):
    """Rebuilds its CSR adjacency from each batch (a k-NN style graph): the number of stored elements changes
    from step to step, and a CSR tensor cannot be copied in place across sparsity patterns."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        sim = torch.sigmoid(batch @ batch.t()).detach()
        self.adj = (torch.where(sim > 0.9, sim, 0.0) + torch.eye(len(sim))).to_sparse_csr()
        return super().training_step(batch, batch_idx)


class AdjacencyAfterRollback(pl.Callback):
    """After the guard: the adjacency before and after the rollback, and the snapshot's."""

    def __init__(self, guard: NaNGuard) -> None:
        self.guard, self.before, self.seen = guard, None, None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.before = pl_module.adj.clone()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if self.guard.counters["rollbacks"] and self.seen is None:
            store = self.guard.snapshots
            self.seen = (self.before, pl_module.adj.clone(), store.load(store.newest)["module"]["adj"])


def test_rollback_restores_a_csr_buffer_whose_sparsity_changed(tmp_path: Any) -> None:
    """A CSR buffer rebuilt with another number of stored elements since the snapshot: the rollback puts
    the snapshot's back (load_state_dict alone would raise)."""
    adj, target, x = graph(layout=torch.sparse_csr)
    guard = NaNGuard(recovery={"snapshot_every": 2})
    spy = AdjacencyAfterRollback(guard)
    model = RebuiltGraph(adj, target, x.shape[1])
    trainer(tmp_path, [FaultInjector(Fault("parameter", steps=[4], target="gcn.weight")), guard, spy]).fit(
        model, graph_loader(x))
    assert guard.counters["rollbacks"] == 1 and [e.kind for e in guard.events] == ["parameter"]
    before, now, snapshot = spy.seen
    assert before._nnz() != snapshot._nnz()  # a CSR tensor cannot copy_ across numbers of stored elements
    assert same_sparse(now, snapshot)


class DecayingEdges(SparseGraphAutoencoder):
    """Writes a sparse buffer in place in every forward (running edge weights, like BatchNorm statistics)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("edges", self.adj.clone())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.edges.mul_(0.5)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_buffer_written_by_a_skipped_step_is_undone(tmp_path: Any, layout: str) -> None:
    """A sparse buffer written in place by every forward: the buffer undo and the replay's restore leave it
    as if the skipped batch never ran."""
    adj, target, x = graph(layout=LAYOUTS[layout])
    guard = NaNGuard()
    model = DecayingEdges(adj, target, x.shape[1])
    trainer(tmp_path, [FaultInjector(Fault("activation", steps=[3], target="encoder")), guard]).fit(
        model, graph_loader(x))
    (event,) = guard.events
    assert event.kind == "loss" and event.culprit == "encoder" and guard.counters["replays"] == 1
    expected = adj.clone()
    for _ in range(8 - 1):  # 8 forwards kept, less the skipped one (its replays are undone too)
        expected.mul_(0.5)
    assert same_sparse(model.edges, expected)


def test_checkpoint_with_poisoned_sparse_buffer_is_rebuilt(tmp_path: Any) -> None:
    """A checkpoint is checked through the sparse buffer's stored values and rebuilt from known-good state."""
    guard = NaNGuard(recovery={"snapshot_every": 2})
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    _, adj = fit_gae(tmp_path, "csr", [PoisonBuffer(step=4), guard, ckpt], enable_checkpointing=True)
    (event,) = guard.events
    assert event.details["detected_at"] == "checkpoint" and event.culprit == "adj"
    saved = torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", weights_only=False)["state_dict"]["adj"]
    assert same_sparse(saved, adj)


class MkldnnTable(SparseGraphAutoencoder):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("table", torch.ones(4, 4).to_mkldnn())


def test_a_layout_it_cannot_read_is_skipped_with_one_warning(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(layouts, "_warned", set())
    adj, target, x = graph()
    guard = NaNGuard(check={"inputs": "always"}, recovery={"snapshot_every": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [guard], max_epochs=2).fit(MkldnnTable(adj, target, x.shape[1]), graph_loader(x))
    about = [str(w.message) for w in caught if "NaNGuard cannot read" in str(w.message)]
    assert len(about) == 1 and "table has layout _mkldnn" in about[0]
    assert guard.events == [] and guard.counters["snapshots"] == 9


# ---------------------------------------------------------------------------------------- sparse batches


def _entry(adj: torch.Tensor, k: int) -> tuple[int, int]:
    """(row, column) of the k-th stored value of ``adj`` (CSR stores row-major, as a COO conversion does)."""
    indices = adj._indices() if adj.layout == torch.sparse_coo else adj.to_sparse_coo().indices()
    row, col = indices[:, k].tolist()
    return row, col


@pytest.mark.parametrize("inputs", ["on_incident", "always"])
@pytest.mark.parametrize("layout", ["coo", "coo_dup", "csr"])
def test_nan_in_sparse_batch_is_found_by_row_and_column(tmp_path: Any, layout: str, inputs: str) -> None:
    """An uncoalesced COO batch too: the device flag reads the stored values as they are, the finder
    coalesces (the NaN half of a duplicated entry makes the entry NaN)."""
    injector = FaultInjector(Fault("input", steps=[3], target="batch[0]"))
    guard = NaNGuard(check={"inputs": inputs})
    _, adj = fit_gae(tmp_path, layout, [injector, guard], in_batch=True)
    if layout.startswith("coo"):
        assert adj.is_coalesced() == (layout == "coo")
    (event,) = guard.events
    assert (event.kind, event.cause, event.step) == ("input", "input", 3)
    (found,) = event.details["inputs"]
    row, col = _entry(adj, injector.log[0].index[0])
    assert found["field"] == "batch[0]" and found["nan"] == 1
    assert found["samples"] == [row] and found["features"] == [col]


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_replay_casts_a_sparse_batch_to_float64(tmp_path: Any, layout: str) -> None:
    guard = NaNGuard()
    fit_gae(tmp_path, layout, [FaultInjector(Fault("activation", steps=[2], target="gcn")), guard], in_batch=True)
    (event,) = guard.events
    assert event.culprit == "gcn" and event.details["replay"]["reproduced"]
    assert "errors" not in event.details["replay"]
    assert event.details["float64"]["module_finite"] is False  # the injected NaN survives float64: not overflow


# ------------------------------------------------------------------------------------- sparse gradients


class SparseEmbedding(pl.LightningModule):
    def __init__(self, rows: int = 32, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim, sparse=True)
        self.head = nn.Linear(dim, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, y = batch
        return nn.functional.mse_loss(self.head(self.emb(idx)).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def embedding_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (64, 3), generator=g)  # repeated rows: uncoalesced sparse gradients
    return DataLoader(list(zip(idx, torch.randn(64, 3, generator=g))), batch_size=8)


class NormSpy(pl.Callback):
    """Before the guard: the total gradient norm computed by hand from the coalesced sparse gradient."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        parts = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in pl_module.parameters()]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in parts]))))


def test_sparse_gradients_are_normed_and_clipped(tmp_path: Any, monkeypatch: Any) -> None:
    """nn.Embedding(sparse=True): the fused norm counts the coalesced sparse gradient, clipping scales it,
    and unit-wise clipping (AGC) leaves it alone with one warning instead of crashing."""
    monkeypatch.setattr(layouts, "_warned", set())
    pl.seed_everything(0)
    plain = SparseEmbedding()
    trainer(tmp_path / "plain", []).fit(plain, embedding_loader())
    pl.seed_everything(0)
    spy, guard = NormSpy(), NaNGuard()
    guarded = SparseEmbedding()
    trainer(tmp_path / "guarded", [spy, guard]).fit(guarded, embedding_loader())
    assert guard.events == [] and all(torch.equal(p, q) for p, q in zip(plain.parameters(), guarded.parameters()))
    assert list(guard.state_dict()["clipper"]["history"]) == pytest.approx(spy.norms, rel=1e-6)

    pl.seed_everything(0)
    guard = NaNGuard(clip={"max_norm": 1e-3, "agc_clip_factor": 0.01})
    with pytest.warns(UserWarning, match="sparse gradients are not clipped unit-wise"):
        trainer(tmp_path / "clipped", [guard]).fit(SparseEmbedding(), embedding_loader())
    assert guard.events == [] and guard.counters["clipped_steps"] == 8


def test_nan_in_sparse_gradient_is_skipped(tmp_path: Any) -> None:
    pl.seed_everything(0)
    guard = NaNGuard()
    model = SparseEmbedding()
    injector = FaultInjector(Fault("gradient", steps=[2], target="emb.weight"))
    trainer(tmp_path, [injector, guard]).fit(model, embedding_loader())
    (event,) = guard.events
    assert (event.kind, event.step, event.actions[0]) == ("gradient", 2, "skip_step")
    assert injector.log[0].applied and torch.isfinite(model.emb.weight).all()
