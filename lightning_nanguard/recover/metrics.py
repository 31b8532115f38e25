"""Undo what a skipped step wrote into the user's metrics, as :class:`~.undo.BufferUndo` does for buffers.

Two kinds of accumulators see a batch before the guard can judge its step, and both are torchmetrics
``Metric`` objects:

- every ``torchmetrics.Metric`` of the LightningModule (``MeanMetric`` of the loss, ``MulticlassAccuracy``,
  ``SumMetric`` of samples seen; found by walking ``pl_module.modules()``) and every metric object the step
  logged with ``self.log``;
- Lightning's own logged values (``trainer._results``, a collection of ``_ResultMetric``): the on-epoch
  aggregates behind ``train_loss_epoch``, what EarlyStopping and ModelCheckpoint read at the epoch's end.

:meth:`MetricUndo.arm`, at the first micro-batch of each optimizer step, copies every tensor state (named by
the metric's ``_defaults``) into preallocated buffers on the same device in one ``_foreach_copy_`` and keeps
the rest by reference: no allocation in steady state, no host-device sync. :meth:`MetricUndo.undo`, after a
skipped step (every micro-batch of it, manual optimization included), puts the states back, with the update
count, and drops the step's cached values: as if the batches never happened. A value the step logged on
step level only is not logged for the skipped step; a key first logged in it is removed. (Once the guard has
given up, the failed steps are not hidden: the run stops with them in its logs.)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn
from torchmetrics import Metric

__all__ = ["MetricUndo", "module_metrics"]

_UNSET = object()


def module_metrics(module: nn.Module) -> list[Metric]:
    """Every torchmetrics ``Metric`` of ``module`` (inside ``MetricCollection``s too)."""
    return [m for m in module.modules() if isinstance(m, Metric)]


class _Saved:
    """One metric's state at ``arm()``: tensor states in buffers, list states as shallow copies."""

    __slots__ = ("metric", "tensors", "sources", "lists", "update_count", "forward_cache", "has_reset")

    def __init__(self, metric: Metric) -> None:
        self.metric = metric
        self.tensors: dict[str, Tensor] = {}  # attr -> backup buffer
        self.sources: dict[str, Tensor] = {}  # attr -> the state tensor last backed up (same object: same buffer)
        self.lists: dict[str, list] = {}
        self.update_count = 0
        self.forward_cache: Any = None  # (torchmetrics declares _forward_cache as None)
        self.has_reset: object = _UNSET

    def keep(self, src: list[Tensor], dst: list[Tensor]) -> None:
        """Back up the metric's state as it is now: its host fields at once, each tensor state as a (state, buffer)
        pair appended to ``src``/``dst`` for the one batched copy; a buffer is reused while its state is the same
        tensor, or one of the same shape, dtype and device."""
        metric, state = self.metric, self.metric.__dict__
        self.update_count = state.get("_update_count", 0)
        self.forward_cache = state.get("_forward_cache")
        self.has_reset = state.get("has_reset", _UNSET)
        if self.lists:
            self.lists.clear()
        tensors = self.tensors
        for attr in metric._defaults:
            value = state.get(attr)
            if value is None:
                value = getattr(metric, attr)
            buf, source = tensors.get(attr), self.sources.get(attr)
            if buf is not None and source is not None and source is value:  # the same tensor as at the last arm()
                src.append(source)
                dst.append(buf)
            elif isinstance(value, Tensor):
                if (buf is None or buf.shape != value.shape or buf.dtype != value.dtype
                        or buf.device != value.device):
                    buf = tensors[attr] = torch.empty_like(value, memory_format=torch.contiguous_format)
                self.sources[attr] = value
                src.append(value)
                dst.append(buf)
            elif isinstance(value, list):
                self.lists[attr] = list(value)


class MetricUndo:
    """Back up the user's metrics at the start of each optimizer step; restore them when it is skipped.

    Args:
        module: the LightningModule whose ``torchmetrics.Metric`` submodules are kept (walked once, here).
    """

    def __init__(self, module: nn.Module) -> None:
        self.metrics = module_metrics(module)
        self._saved: dict[int, _Saved] = {}
        self._results: Optional[dict] = None
        self._keys: Optional[set] = None
        self._added: Optional[list] = None  # what a step undone on the device added on the host (undo_where)

    def arm(self, results: Optional[dict] = None) -> None:
        """Back up every metric of the module and, given Lightning's result collection (``trainer._results``),
        every logged value in it. Tensors only, on their device: one batched copy, no sync."""
        self._results = results
        self._keys = None if results is None else set(results)
        src: list[Tensor] = []
        dst: list[Tensor] = []
        live: dict[int, _Saved] = {}
        for metric in self._watched(results):
            key = id(metric)
            if key in live or not isinstance(metric, Metric):
                continue
            saved = self._saved.get(key)
            if saved is None or saved.metric is not metric:
                saved = _Saved(metric)
            live[key] = saved
            saved.keep(src, dst)
        self._saved = live
        if src:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)

    def _watched(self, results: Optional[dict]) -> Sequence[object]:
        """The module's metrics and, given Lightning's result collection, the logged values and the metric objects
        they hold (of which :meth:`arm` keeps the ``Metric`` objects only)."""
        if not results:
            return self.metrics
        logged = list(results.values())
        objects = [getattr(r, "value", None) for r in logged if not getattr(r, "is_tensor", True)]
        return [*self.metrics, *logged, *objects]

    def undo(self) -> None:
        """Restore what :meth:`arm` backed up; forget the values of the skipped step."""
        with torch.no_grad():
            for saved in self._saved.values():
                metric = saved.metric
                for attr, buf in saved.tensors.items():
                    if attr not in metric._defaults:
                        continue
                    current = getattr(metric, attr)
                    if (isinstance(current, Tensor) and current.shape == buf.shape and current.dtype == buf.dtype
                            and current.device == buf.device and not current.requires_grad):
                        current.copy_(buf)  # in place: states shared by a MetricCollection's compute group stay shared
                    else:
                        setattr(metric, attr, buf.clone())
                for attr, items in saved.lists.items():
                    setattr(metric, attr, list(items))
                changed = metric._update_count != saved.update_count
                metric._update_count = saved.update_count
                metric._computed = None
                if saved.has_reset is not _UNSET:  # Lightning's logged value: not logged for the skipped step
                    metric.has_reset = saved.has_reset
                    metric._forward_cache = None if changed else saved.forward_cache
                else:
                    metric._forward_cache = saved.forward_cache
        results, keys = self._results, self._keys
        if results is not None and keys is not None:
            for key in [k for k in results if k not in keys]:  # first logged in the skipped step
                del results[key]

    def undo_where(self, skip: Tensor) -> None:
        """:meth:`undo` where the 0-dim device flag ``skip`` is set, without a host read (``check.sync: lagged``,
        where the host learns one step later whether the step was skipped): every tensor state is put back on
        the device. What lives on the host (list states, update counts) waits for :meth:`settle`, which gets
        what the step added to them."""
        added = []
        with torch.no_grad():
            for saved in self._saved.values():
                metric = saved.metric
                for attr, buf in saved.tensors.items():
                    current = getattr(metric, attr, None) if attr in metric._defaults else None
                    if (isinstance(current, Tensor) and current.shape == buf.shape and current.dtype == buf.dtype
                            and current.device == buf.device and not current.requires_grad):
                        current.copy_(torch.where(skip.to(current.device).bool(), buf, current))
                metric._computed = None
                lists = {attr: (len(items), len(getattr(metric, attr))) for attr, items in saved.lists.items()
                         if isinstance(getattr(metric, attr, None), list)}
                added.append((metric, metric._update_count - saved.update_count, lists))
        self._added = added

    def settle(self, skipped: bool) -> None:
        """The host has read the flag of the step :meth:`undo_where` undid on the device: if it was skipped, take
        out what it added to list states and update counts (later steps may have added more since)."""
        added, self._added = self._added, None
        if not skipped or not added:
            return
        for metric, updates, lists in added:
            metric._update_count = max(metric._update_count - updates, 0)
            metric._computed = None
            for attr, (start, end) in lists.items():
                items = getattr(metric, attr, None)
                if isinstance(items, list) and len(items) >= end:
                    del items[start:end]
