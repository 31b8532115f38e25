"""Undoing a step: skip its update, and undo what its forward passes wrote into buffers.

Independent of Lightning: it takes parameters and modules. (The user's metrics: :mod:`.metrics`.)
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

__all__ = ["skip_step", "BufferUndo"]


def skip_step(params: Iterable[Tensor]) -> None:
    """Skip the coming optimizer step for ``params``: torch optimizers skip params whose grad is None,
    leaving the parameter and its optimizer state (moments, step count) untouched. Zeroing would not:
    weight decay and momentum would still move the weights."""
    for p in params:
        p.grad = None


class BufferUndo:
    """Undo what one forward pass wrote into module buffers (BatchNorm running statistics).

    ``arm()`` before the forward copies the buffers that forward passes write into preallocated device
    memory; ``undo()`` copies them back. Which buffers are written: those of normalisation layers that
    track running statistics (their kernels update in place without bumping the version counter), plus
    any buffer whose version counter was seen to move during a forward. Constant buffers (masks,
    positional tables) are never copied.
    """

    def __init__(self, module: nn.Module) -> None:
        self.named = [(n, b) for n, b in module.named_buffers() if b is not None]
        self._mutable: set[str] = set()
        for prefix, sub in module.named_modules():
            if getattr(sub, "track_running_stats", False):
                self._mutable.update(f"{prefix}.{n}" if prefix else n for n, _ in sub.named_buffers(recurse=False))
        self._backup: dict[str, Tensor] = {}
        self._versions: dict[str, int] = {}

    def arm(self) -> None:
        self._learn()
        src, dst = [], []
        for n, b in self.named:
            self._versions[n] = b._version
            if n in self._mutable:
                if n not in self._backup or self._backup[n].shape != b.shape:
                    self._backup[n] = torch.empty_like(b)
                src.append(b.detach())
                dst.append(self._backup[n])
        if src:
            torch._foreach_copy_(dst, src)

    def _learn(self) -> None:
        for n, b in self.named:
            if n in self._versions and b._version != self._versions[n]:
                self._mutable.add(n)

    def undo(self) -> list[str]:
        """Restore the buffers backed up by ``arm()``; returns their names."""
        restored = []
        with torch.no_grad():
            for n, b in self.named:
                if n in self._backup:
                    b.copy_(self._backup[n])
                    restored.append(n)
        self._learn()  # a buffer written for the first time is backed up from the next arm() on
        for n, b in self.named:
            self._versions[n] = b._version
        return restored

    def undo_where(self, skip: Tensor) -> None:
        """:meth:`undo` where the 0-dim device flag ``skip`` is set, else keep the buffers: no host read
        (``check.sync: lagged``, where the host learns one step later whether this step was skipped)."""
        self._learn()
        with torch.no_grad():
            for n, b in self.named:
                if n in self._backup and b.layout == torch.strided:
                    b.copy_(torch.where(skip.to(b.device).bool(), self._backup[n], b))
        for n, b in self.named:
            self._versions[n] = b._version

    def written(self) -> dict[str, Tensor]:
        """Copies of the buffers this step's forward passes write (those :meth:`arm` backs up)."""
        return {n: b.detach().clone() for n, b in self.named if n in self._backup}

    def put_back(self, values: dict[str, Tensor]) -> None:
        """Copy ``values`` (from :meth:`written`) into the buffers of the same names."""
        with torch.no_grad():
            for n, b in self.named:
                if n in values:
                    b.copy_(values[n])
        for n, b in self.named:
            self._versions[n] = b._version

    def disarm(self) -> None:
        """After a healthy step: learn which buffers the forward pass changed."""
        self._learn()
