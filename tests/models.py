"""Small real LightningModules, data and pure helpers shared by the tests (``from .models import ...``).

What a test builds under its ``tmp_path`` (Trainers, fits) comes from the fixtures of ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n: int = 512, features: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def classification_data(n: int = 512, features: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(classes, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, features, generator=g)
    return TensorDataset(x, y)


def poison_rows(data: TensorDataset, rows: list[int], value: float) -> TensorDataset:
    """A copy of ``data`` whose input row ``rows[i]`` holds ``value`` (alternating sign) in feature ``i``."""
    x = data.tensors[0].clone()
    for i, r in enumerate(rows):
        x[r, i % x.shape[1]] = value if i % 2 == 0 else -value
    return TensorDataset(x, data.tensors[1])


class Regression(pl.LightningModule):
    """nn.Linear + SGD; diverges to NaN with a too-high ``lr``."""

    def __init__(self, features: int = 8, lr: float = 0.05, optimizer: str = "sgd") -> None:
        super().__init__()
        self.lr, self.optimizer_name = lr, optimizer
        self.linear = nn.Linear(features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Classifier(pl.LightningModule):
    """MLP with BatchNorm and dropout; AdamW, optionally with a step-interval scheduler."""

    def __init__(self, features: int = 16, classes: int = 4, hidden: int = 32, lr: float = 1e-2,
                 scheduler: Optional[str] = None, batch_hook: Optional[Callable[[Any, int, "Classifier"], Any]] = None,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.lr, self.scheduler_name, self.batch_hook = lr, scheduler, batch_hook
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                 nn.Dropout(dropout), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.batch_hook is not None:
            batch = self.batch_hook(batch, batch_idx, self)
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if self.scheduler_name is None:
            return opt
        steps = self.trainer.estimated_stepping_batches
        if self.scheduler_name == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=int(steps))
        elif self.scheduler_name == "cosine":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=int(steps), eta_min=self.lr * 0.01)
        else:
            raise ValueError(self.scheduler_name)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class NaNLossOnBatches(Regression):
    """Regression (AdamW) whose loss is multiplied by NaN on the batches ``bad`` (NaN gradients everywhere)."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__(lr=0.02, optimizer="adamw")
        self.bad = bad

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx in self.bad else loss


class EpsZeroEmbedding(pl.LightningModule):
    """Adam with ``eps=0`` and embedding rows no batch uses: their update is 0/0, so they turn NaN after the
    first step while every gradient stays finite (a classic silent failure)."""

    def __init__(self, rows: int, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim)
        self.head = nn.Linear(dim, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, y = batch
        return nn.functional.mse_loss(self.head(self.emb(idx)).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2, eps=0.0)


def accuracy(model: pl.LightningModule, data: TensorDataset) -> float:
    model.eval()
    x, y = data.tensors
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def all_finite(module: nn.Module) -> bool:
    """Every floating parameter and buffer of ``module`` is finite."""
    return all(bool(torch.isfinite(t).all()) for t in list(module.parameters()) + list(module.buffers())
               if t.is_floating_point())


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    """Bitwise equal state dicts (same keys, same weights and buffers)."""
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def read_events(root: Any) -> list[dict]:
    """The records of ``<root>/nanguard/events.jsonl`` (or of the file ``root`` itself)."""
    path = Path(root)
    path = path if path.is_file() else path / "nanguard" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def detected_steps(faults: Iterable[Any]) -> list[int]:
    """Where the guard sees each fault: at its step, or one later for parameters (read with the next flags)."""
    return sorted(s + (f.kind == ("parameter",)) for f in faults for s in f.steps)


def loader(data: TensorDataset, batch_size: int = 32, shuffle: bool = False) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, shuffle=shuffle)


SYNCS = ("eager", "lagged")  # check.sync modes; lagged is forced on the CPU with an optimizer that skips on the device
QUIET = {"verbose": False, "events_file": False, "reports": False}


def sync_guard(sync: str, quiet: Optional[dict] = None, **sections: Any) -> Any:
    """``NaNGuard(**sections)`` with ``check.sync: sync`` and the quiet logging ``quiet`` (default :data:`QUIET`)
    under the given ``logging`` keys."""
    from lightning_nanguard import NaNGuard

    check = dict(sections.pop("check", {}), sync=sync)
    return NaNGuard(check=check, logging=dict(QUIET if quiet is None else quiet, **sections.pop("logging", {})),
                    **sections)


def event_record(e: Any) -> dict:
    """An event as JSON, without its number (two fits that record alike number alike anyway)."""
    d = e.to_dict()
    d.pop("index", None)
    return d


def without_samples(record: dict) -> dict:
    """An event record without what depends on the weights a bad batch's samples were rerun on (a step judged one
    step late reruns them after its update where it was applied: ``details.samples`` and the suggestion that
    quotes them), keeping only that it named samples."""
    if "samples" not in record["details"]:
        return record
    return {**{k: v for k, v in record.items() if k != "suggestion"}, "details": {**record["details"], "samples": True}}


def trainer(tmp_path: Any, callbacks: Optional[list] = None, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer writing under ``tmp_path``."""
    defaults = dict(max_epochs=1, accelerator="cpu", devices=1, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, logger=False,
                    default_root_dir=str(tmp_path), deterministic=True)
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks or [], **defaults)


def training_state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
    """A deep copy of what a rollback restores: module, optimizer and scheduler state."""
    import copy

    return copy.deepcopy({"module": pl_module.state_dict(), "optimizers": [o.state_dict() for o in trainer.optimizers],
                          "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]})


class SnapshotSpy(pl.Callback):
    """Listed after a NaNGuard: ``states[step]`` is the training state each time the guard took a snapshot."""

    def __init__(self, guard: Any) -> None:
        self.guard, self.seen, self.states = guard, 0, {}

    def _capture(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard.counters["snapshots"] != self.seen:
            self.seen = self.guard.counters["snapshots"]
            self.states[self.guard.snapshots.newest.step] = training_state(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._capture(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._capture(trainer, pl_module)


def graph(nodes: int = 12, features: int = 6, layout: torch.layout = torch.sparse_coo,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random undirected graph: its symmetric-normalised adjacency with self-loops as a sparse tensor in
    ``layout`` (COO coalesced, or CSR/CSC), the dense 0/1 adjacency (a reconstruction target) and node
    features."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.rand(nodes, nodes, generator=g) < 0.3).float().triu(1)
    a = a + a.t()
    target = a.clone()
    a = a + torch.eye(nodes)
    d = a.sum(1).rsqrt()
    norm = (d[:, None] * a * d[None, :]).to_sparse_coo().coalesce()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        adj = norm if layout is torch.sparse_coo else norm.to_sparse(layout=layout)
    return adj, target, torch.randn(nodes, features, generator=g)


def graph_loader(x: torch.Tensor, batches: int = 8, adj: Optional[torch.Tensor] = None, seed: int = 1) -> DataLoader:
    """``batches`` full-graph batches: noisy copies of the node features ``x`` (with ``adj`` in front when the
    adjacency travels in the batch: ``(adj, x)``)."""
    g = torch.Generator().manual_seed(seed)
    items = [x + 0.1 * torch.randn(x.shape, generator=g) for _ in range(batches)]
    data = [(adj.clone(), item) for item in items] if adj is not None else items
    return DataLoader(data, batch_size=None)


class SparseGraphAutoencoder(pl.LightningModule):
    """Two GCN layers over a sparse normalised adjacency and an inner-product decoder (seed 000's graph
    autoencoder). The adjacency is a sparse buffer, or travels in the batch as ``(adj, x)``."""

    def __init__(self, adj: torch.Tensor, target: torch.Tensor, features: int, hidden: int = 8,
                 lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.register_buffer("adj", adj)
        self.register_buffer("target", target)
        self.encoder = nn.Linear(features, hidden)
        self.gcn = nn.Linear(hidden, hidden)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        adj, x = batch if isinstance(batch, (tuple, list)) else (self.adj, batch)
        h = torch.relu(adj @ self.encoder(x))
        z = adj @ self.gcn(h)
        return nn.functional.binary_cross_entropy_with_logits(z @ z.t(), self.target)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


class SquareNet(pl.LightningModule):
    """Linear -> x*x -> Linear on ``(x, y)`` batches (a tuple, a dict, or anything with ``.x``/``.y``): a
    finite but huge input feature overflows float32 in ``net.1``. ``compile_net``: a torch.compile backend
    for the inner network (compiled as a submodule)."""

    def __init__(self, compile_net: Optional[str] = None) -> None:
        super().__init__()
        net = nn.Sequential(nn.Linear(4, 8), Square(), nn.Linear(8, 1))
        self.net = torch.compile(net, backend=compile_net) if compile_net else net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if isinstance(batch, dict):
            x, y = batch["x"], batch["y"]
        elif hasattr(batch, "x"):
            x, y = batch.x, batch.y
        else:
            x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class FeatureSquare(pl.LightningModule):
    """Linear -> x*x -> Linear, Adam: a feature of ~1e20 squares past float32's max (the seed-000 overflow case).
    ``identity``: the first Linear starts as the identity, so the feature reaches the square unchanged."""

    def __init__(self, lr: float = 1e-3, features: int = 8, identity: bool = False) -> None:
        super().__init__()
        self.lr = lr
        self.proj, self.square, self.head = nn.Linear(features, features), Square(), nn.Linear(features, 1)
        if identity:
            with torch.no_grad():
                self.proj.weight.copy_(torch.eye(features))
                self.proj.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.square(self.proj(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def overflow_data(bad_batch: Optional[int] = 2, batches: int = 8, batch_size: int = 8) -> TensorDataset:
    """Regression data for :class:`SquareNet`; with ``bad_batch``, one feature of one sample of that batch is
    1e25: finite, but its square overflows float32 (finite again in float64)."""
    g = torch.Generator().manual_seed(0)
    n = batches * batch_size
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    if bad_batch is not None:
        x[batch_size * bad_batch + 4, 2] = 1e25
    return TensorDataset(x, y)


class MetricsClassifier(pl.LightningModule):
    """A classifier that reports like real training code: ``self.log("train_loss", on_step=True, on_epoch=True)``
    and torchmetrics objects updated in ``training_step`` (a ``MeanMetric`` of the loss, a ``MulticlassAccuracy``
    also logged as a metric object, a ``SumMetric`` of the samples seen). SGD, no dropout: a run whose bad batches
    are skipped equals, bitwise, one that never saw them.

    Args:
        drop: batch indices whose ``training_step`` returns None before touching anything (the reference run
            for "as if the batch never happened").
        manual: manual optimization, logging and updating the metrics after the optimizer step.
    """

    def __init__(self, features: int = 16, classes: int = 4, hidden: int = 32, lr: float = 0.1,
                 drop: tuple[int, ...] = (), manual: bool = False) -> None:
        super().__init__()
        import torchmetrics
        from torchmetrics.classification import MulticlassAccuracy

        self.lr, self.drop = lr, set(drop)
        self.automatic_optimization = not manual
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
        self.loss_mean = torchmetrics.MeanMetric(nan_strategy="disable")  # a NaN loss would make it NaN
        self.accuracy = MulticlassAccuracy(num_classes=classes)
        self.seen = torchmetrics.SumMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        if batch_idx in self.drop:
            return None
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.loss_mean(loss.detach())
        self.accuracy.update(logits.detach(), y)
        self.log("train_acc", self.accuracy, on_step=False, on_epoch=True)
        self.seen.update(torch.tensor(float(len(y))))
        return loss if self.automatic_optimization else None

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def metric_states(self) -> dict[str, torch.Tensor]:
        """Every torchmetrics state of the module, cloned (``Metric.metric_state``)."""
        return {f"{name}.{attr}": value.detach().clone() for name, m in self.named_modules()
                if hasattr(m, "metric_state") for attr, value in m.metric_state.items()}


def markov_tokens(n: int = 256, length: int = 16, vocab: int = 64, seed: int = 0, successors: int = 4) -> TensorDataset:
    """Sequences of a sparse Markov chain (``successors`` per token): learnable, entropy floor log(successors)."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, vocab, (vocab, successors), generator=g)
    seq = torch.empty(n, length + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(length):
        seq[:, t + 1] = nxt[seq[:, t], torch.randint(0, successors, (n,), generator=g)]
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


class DeepMLP(pl.LightningModule):
    """20 Linear+ReLU layers, Kaiming init, no normalisation, SGD: the gradient norm grows over the first steps
    until it explodes (the loss stays finite until the last one)."""

    def __init__(self, depth: int = 20, width: int = 32, features: int = 16, lr: float = 0.02) -> None:
        super().__init__()
        self.lr = lr
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(features if i == 0 else width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Block(nn.Module):
    """A GPT-2 block: pre-LN causal self-attention and MLP, residual."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(pl.LightningModule):
    """A tiny GPT-2 (token and position embeddings, 2 pre-LN blocks, final LayerNorm, GPT-2's N(0, 0.02) init)."""

    def __init__(self, lr: float, optimizer: str = "adamw", vocab: int = 64, d: int = 32, length: int = 16) -> None:
        super().__init__()
        self.lr, self.optimizer_name = lr, optimizer
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.ModuleList([Block(d, 2) for _ in range(2)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
        self.register_buffer("mask", torch.ones(length, length, dtype=torch.bool).triu(1), persistent=False)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h, self.mask)
        return self.head(self.ln_f(h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.losses.append(float(loss.detach()))  # the losses the tests read (one host read per step)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
