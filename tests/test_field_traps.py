"""A field corpus: NaN traps that PyTorch and Lightning users reported in public issue threads and forums, each
rebuilt as a small LightningModule and trained under a default ``NaNGuard()`` (in both ``check.sync`` modes: eager,
and lagged, forced with fused optimizers as in ``tests/test_lagged_paths.py``).

Each case cites its thread and carries the diagnosis an expert gives it, written down before the guard ran: the
cause, the culprit (the module that made the value, ``training_step`` for code in the step itself, None for bad
data) and the op (the autograd name of the op that made it, the function's name where nothing required grad).
``docs/diagnosis.md`` (the field corpus) tabulates them beside what ``detect_anomaly`` alone says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from . import models

MODES = ["eager", "lagged"]


class Trap(pl.LightningModule):
    """A module whose ``loss(batch)`` is the user's code; fused Adam (it skips a bad step on the device)."""

    lr = 1e-3

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(*batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ------------------------------------------------------------------------------------------------- the traps


class PaddedMHA(Trap):
    """A sequence of which every position is padding: key_padding_mask masks every key of its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def loss(self, x: torch.Tensor, pad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = self.attn(x, x, x, key_padding_mask=pad)
        return F.mse_loss(self.head(h).squeeze(-1), y)


def padded_mha() -> tuple:
    x, y = torch.randn(16, 5, 8, generator=_g()), torch.randn(16, 5, generator=_g())
    pad = torch.zeros(16, 5, dtype=torch.bool)
    pad[3] = True  # an empty sequence in the batch
    return PaddedMHA(), TensorDataset(x, pad, y)


class SelfAttention(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        scores = self.q(x) @ self.k(x).transpose(1, 2) / x.shape[-1] ** 0.5
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        scores = scores.masked_fill(causal[None] | pad[:, None, :], float("-inf"))
        return torch.softmax(scores, -1) @ self.v(x)


class CausalPadded(Trap):
    """Causal mask and (left) padding mask together: the first query of a left-padded row sees no key."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = SelfAttention(), nn.Linear(8, 1)

    def loss(self, x: torch.Tensor, pad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.attn(x, pad)).squeeze(-1), y)


def causal_padded() -> tuple:
    x, y = torch.randn(16, 6, 8, generator=_g()), torch.randn(16, 6, generator=_g())
    pad = torch.zeros(16, 6, dtype=torch.bool)
    pad[3, :2] = True  # left padding
    return CausalPadded(), TensorDataset(x, pad, y)


class Standardize(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h - h.mean(0)) / (h.std(0) + 1e-5)


class BatchStd(Trap):
    """Per-batch standardisation of the features: the last batch holds one sample."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(4, 4), Standardize(), nn.Linear(4, 1)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.norm(self.lin(x))), y)


def batch_std() -> tuple:
    return BatchStd(), TensorDataset(torch.randn(9, 4, generator=_g()), torch.randn(9, 1, generator=_g()))


class L2Norm(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h / h.norm(dim=1, keepdim=True)


class ZeroNorm(Trap):
    """Embeddings normalised without an eps; an all-zero input row (a padded sample) embeds to 0: 0/0."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.l2norm, self.head = nn.Linear(4, 8, bias=False), L2Norm(), nn.Linear(8, 1)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.l2norm(self.emb(x))), y)


def zero_norm() -> tuple:
    x = torch.randn(32, 4, generator=_g())
    x[10] = 0.0
    return ZeroNorm(), TensorDataset(x, torch.randn(32, 1, generator=_g()))


class MaskedLogProb(Trap):
    """log of a softmax over the allowed classes only: the masked classes have probability exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def loss(self, x: torch.Tensor, allowed: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.lin(x).masked_fill(~allowed, float("-inf")), -1)
        return -(F.one_hot(y, 5) * torch.log(p)).sum(-1).mean()


def masked_log_prob() -> tuple:
    x, y = torch.randn(32, 4, generator=_g()), torch.zeros(32, dtype=torch.long)
    allowed = torch.ones(32, 5, dtype=torch.bool)
    allowed[:, 3:] = False
    return MaskedLogProb(), TensorDataset(x, allowed, y)


class HandBCE(Trap):
    """A hand-written binary cross-entropy on sigmoid outputs, trained with bf16-mixed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.lin(x) * 20)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def hand_bce() -> tuple:
    return HandBCE(), TensorDataset(torch.randn(64, 4, generator=_g()),
                                    (torch.rand(64, 1, generator=_g()) > 0.5).float())


class Gram(nn.Module):
    def forward(self, f: torch.Tensor) -> torch.Tensor:
        b, c, h, w = f.shape
        f = f.reshape(b, c, h * w).half()
        return (torch.bmm(f, f.transpose(1, 2)) / (c * h * w)).float()


class StyleLoss(Trap):
    """A style loss whose Gram matrix is computed in float16 and then normalised by c*h*w."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.gram, self.head = nn.Conv2d(3, 8, 3, padding=1), Gram(), nn.Linear(64, 1)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        g = self.gram(self.conv(x) * 30)
        return F.mse_loss(self.head(g.reshape(len(x), -1)), y)


def style_loss() -> tuple:
    return StyleLoss(), TensorDataset(torch.randn(8, 3, 32, 32, generator=_g()), torch.randn(8, 1, generator=_g()))


class TokenCE(Trap):
    """Token classification whose labels are -100 (ignored) at padding; a batch of padding only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lin(x).reshape(-1, 3), y.reshape(-1))


def token_ce() -> tuple:
    x, y = torch.randn(16, 5, 4, generator=_g()), torch.randint(0, 3, (16, 5), generator=_g())
    y[8:] = -100  # the second batch is all padding
    return TokenCE(), TensorDataset(x, y)


class EmptyMask(Trap):
    """An auxiliary loss averaged over the positives of the batch; a batch without positives."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def loss(self, x: torch.Tensor, y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        err = (self.lin(x) - y).squeeze(-1) ** 2
        return err.mean() + err[pos].mean()


def empty_mask() -> tuple:
    pos = torch.rand(16, generator=_g()) > 0.5
    pos[8:] = False
    return EmptyMask(), TensorDataset(torch.randn(16, 4, generator=_g()), torch.randn(16, 1, generator=_g()), pos)


class AdditiveMask(nn.Module):
    def forward(self, scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores * keep + (1 - keep) * float("-inf"), -1)


class MultiplyInf(Trap):
    """A mask applied as ``scores * mask + (1 - mask) * -inf``: 0 x -inf at every kept position."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.mask, self.head = nn.Linear(4, 6), AdditiveMask(), nn.Linear(6, 1)

    def loss(self, x: torch.Tensor, keep: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.mask(self.lin(x), keep)), y)


def multiply_inf() -> tuple:
    keep = torch.ones(16, 6)
    keep[:, 4:] = 0.0
    return MultiplyInf(), TensorDataset(torch.randn(16, 4, generator=_g()), keep, torch.randn(16, 1, generator=_g()))


class Angle(Trap):
    """An angular loss acos(cos(z, t)) with the cosine computed by hand: 1.0000001 in float32 for equal vectors."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def loss(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        z = x * self.scale
        cos = (z * t).sum(-1) / (z.norm(dim=-1) * t.norm(dim=-1))
        return torch.acos(cos).mean()


def angle() -> tuple:
    x = torch.randn(8, 84, generator=_g())
    x[2] = torch.arange(84.0)  # the vector of pytorch#18057
    t = x.clone()
    t[:2] += 0.5
    t[3:] += 0.5
    return Angle(), TensorDataset(x, t)


class NaiveSoftmax(Trap):
    """softmax written as exp(z) / exp(z).sum() on logits scaled by a temperature of 1/100."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        e = torch.exp(self.lin(x) * 100)
        p = e / e.sum(-1, keepdim=True)
        return -(F.one_hot(y, 5) * p).sum(-1).mean()


def naive_softmax() -> tuple:
    x = torch.randn(16, 4, generator=_g())
    x[5] *= 10
    return NaiveSoftmax(), TensorDataset(x, torch.randint(0, 5, (16,), generator=_g()))


class HighLR(models.Regression):
    """Linear regression with SGD at a learning rate 100 times too high."""

    def __init__(self) -> None:
        super().__init__(lr=5.0)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)


def high_lr() -> tuple:
    return HighLR(), models.regression_data(n=256)


class MaskedTargets(Trap):
    """Missing targets stored as NaN, masked out of the loss after it is computed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per = F.mse_loss(self.lin(x), y, reduction="none")
        return per[~torch.isnan(y)].mean()


def masked_targets() -> tuple:
    y = torch.randn(32, 2, generator=_g())
    y[20, 1] = float("nan")
    return MaskedTargets(), TensorDataset(torch.randn(32, 4, generator=_g()), y)


class VectorNorm(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((h * h).sum(-1, keepdim=True))


class NormPenalty(Trap):
    """A norm penalty written as sqrt(sum(h*h)) on embeddings; a zero input row embeds to 0 (sqrt' is inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.vnorm, self.head = nn.Linear(4, 8, bias=False), VectorNorm(), nn.Linear(8, 1)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return F.mse_loss(self.head(h), y) + 1e-3 * self.vnorm(h).mean()


def norm_penalty() -> tuple:
    x = torch.randn(32, 4, generator=_g())
    x[7] = 0.0
    return NormPenalty(), TensorDataset(x, torch.randn(32, 1, generator=_g()))


class WideInit(Trap):
    """A hidden layer initialised with std 1e3 (a unit mix-up) instead of about 1/sqrt(fan_in)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(8, 8), nn.Linear(8, 1)
        nn.init.normal_(self.hidden.weight, std=1e3)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(12):
            h = self.hidden(h)
        return F.mse_loss(self.out(h), y)


def wide_init() -> tuple:
    return WideInit(), TensorDataset(torch.randn(32, 8, generator=_g()), torch.randn(32, 1, generator=_g()))


# ------------------------------------------------------------------------------------------------ the corpus


@dataclass(frozen=True)
class Case:
    name: str
    thread: str  # the public report the trap comes from
    build: Callable[[], tuple]
    cause: str
    culprit: Optional[str]
    op: Optional[str]
    anomaly_says: str  # what Trainer(detect_anomaly=True) alone reports (docs/diagnosis.md's table)
    batch_size: int = 8
    steps: int = 3
    trainer: dict = field(default_factory=dict)
    suggestion: str = ""  # a phrase the suggestion must hold


NOTHING = "nothing: a NaN loss, no error"
CORPUS = [
    Case("padded_mha", "https://github.com/pytorch/pytorch/issues/41508", padded_mha, "domain", "attn",
         "SoftmaxBackward0", "MseLossBackward0 returned nan", suggestion="at least one position"),
    Case("causal_and_padding_mask", "https://github.com/pytorch/pytorch/issues/63271", causal_padded, "domain",
         "attn", "SoftmaxBackward0", "MseLossBackward0 returned nan", suggestion="-inf everywhere"),
    Case("std_of_one_sample", "https://github.com/pytorch/pytorch/issues/29372", batch_std, "domain", "norm",
         "StdBackward0", "MseLossBackward0 returned nan", steps=2, suggestion="correction=0"),
    Case("zero_vector_normalised", "https://github.com/pytorch/pytorch/issues/3264", zero_norm, "domain", "l2norm",
         "DivBackward0", "MseLossBackward0 returned nan", suggestion="F.normalize"),
    Case("log_of_masked_softmax", "https://huggingface.co/datasets/nvidia/Nemotron-CC-Math-v1 (forum thread: "
         "'How to Solve the Loss Becoming NaN Due to Using torch.log()')", masked_log_prob, "domain",
         "training_step", "LogBackward0", "LogBackward0 returned nan", suggestion="log_softmax"),
    Case("hand_written_bce_bf16", "https://runebook.dev/en/docs/pytorch/generated/torch.nn.functional."
         "binary_cross_entropy", hand_bce, "precision", "training_step", "LogBackward0", "LogBackward0 returned nan",
         trainer={"precision": "bf16-mixed"}, steps=2, suggestion="BCEWithLogitsLoss"),
    Case("gram_matrix_fp16", "https://github.com/NVIDIA/apex/issues/973", style_loss, "overflow", "gram",
         "BmmBackward0", "MseLossBackward0 returned nan", steps=2, suggestion="the sum exceeds float16's range"),
    Case("cross_entropy_all_ignored", "https://github.com/pytorch/pytorch/issues/70348", token_ce, "domain",
         "training_step", "NllLossBackward0", NOTHING, suggestion="ignore_index"),
    Case("mean_of_empty_selection", "https://github.com/pytorch/pytorch/issues/50224", empty_mask, "domain",
         "training_step", "MeanBackward0", NOTHING, suggestion="empty selection"),
    Case("mask_times_minus_inf", "https://github.com/cerebroai/reformers/issues/3", multiply_inf, "domain", "mask",
         "mul", "MseLossBackward0 returned nan", suggestion="0 x inf"),
    Case("acos_of_rounded_cosine", "https://github.com/pytorch/pytorch/issues/18057", angle, "precision",
         "training_step", "AcosBackward0", "AcosBackward0 returned nan", suggestion="clamp"),
    Case("naive_softmax_exp", "https://saipien.org/why-naive-softmax-produces-nans-on-gpus-use-logsumexp-for-"
         "numerically-stable-cross-entropy/", naive_softmax, "overflow", "training_step", "ExpBackward0",
         "DivBackward0 returned nan", suggestion="float32's max"),
    # expected before the run: (learning_rate, training_step, MseLossBackward0); the guard's divergence watch stops
    # it at step 3, before anything is non-finite: a divergence event names no op, and as its culprit the module whose
    # weights ran away since the snapshot before the onset (diagnose/culprit.py; its only module)
    Case("learning_rate_too_high", "https://github.com/neuralhydrology/neuralhydrology/issues/101", high_lr,
         "learning_rate", "linear", None, "nothing in 8 steps (the loss runs away)", batch_size=32, steps=8,
         suggestion="learning rate"),
    Case("nan_targets_masked_after_the_loss", "https://github.com/pytorch/pytorch/issues/121416", masked_targets,
         "input", None, None, "MseLossBackward0 returned nan", suggestion="samples"),
    Case("zero_vector_norm_penalty", "https://github.com/pytorch/pytorch/issues/2421", norm_penalty, "backward_op",
         "vnorm", "SqrtBackward0", "MulBackward0 returned nan", suggestion="epsilon"),
    Case("init_std_far_too_large", "https://github.com/facebookresearch/detectron2/issues/755", wide_init,
         "initialization", "hidden.weight", None, "MseLossBackward0 returned nan", suggestion="initialised"),
]


def _fit(fit: Any, case: Case, sync: str) -> Any:
    pl.seed_everything(0, verbose=False)
    model, data = case.build()
    guard = models.sync_guard(sync)  # NaNGuard() as it comes, in this check.sync mode, quiet
    fit(model, data, [guard], subdir=f"{case.name}-{sync}", batch_size=case.batch_size, steps=case.steps,
        **case.trainer)
    return guard


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_field_trap_names_the_cause_culprit_and_op_in_both_sync_modes(fit: Any, case: Case) -> None:
    for sync in MODES:
        guard = _fit(fit, case, sync)
        assert guard.lagged is (sync == "lagged")
        assert guard.events, f"{case.name} ({sync}): no incident"
        ev = guard.events[0]
        found = (ev.cause, ev.culprit, ev.op)
        assert found == (case.cause, case.culprit, case.op), f"{case.name} ({sync}): {found}; {ev.suggestion}"
        assert case.suggestion in ev.suggestion, f"{case.name} ({sync}): {ev.suggestion}"
        assert len({e.cause for e in guard.events}) == 1, [(e.step, e.cause) for e in guard.events]
