"""Fit-long diagnosis modes: ``anomaly.mode: always`` and ``check.activations: always | N``.

:class:`DiagnosisHooks` owns everything NaNGuard installs into torch for a whole fit, so the callback can
remove all of it in one call at fit end or on an exception:

- ``anomaly.mode: always`` turns ``torch.autograd.set_detect_anomaly(True)`` on for the fit and restores the
  previous mode afterwards;
- ``check.activations: always`` (or every N steps) registers forward hooks on every module. A hook only keeps
  a reference to the module's output; :meth:`DiagnosisHooks.take` reduces them with one fused inf-norm kernel
  into ONE device flag, which the callback folds into its single host read per step (no per-module sync).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from . import checks
from .frames import tensors_of

__all__ = ["DiagnosisHooks", "outputs_nonfinite_flag"]


def outputs_nonfinite_flag(outputs: dict[int, Tensor]) -> Optional[Tensor]:
    """0-dim bool device tensor: does any output hold NaN/Inf? No host sync.

    On CUDA one fused inf-norm kernel (:func:`checks.any_nonfinite_flag`). On CPU, where that kernel is slow,
    one sum per tensor accumulated in float64: a sum is non-finite iff a value is, and cannot overflow for
    float32/float16/bfloat16 values.
    """
    tensors = list(outputs.values())
    if not tensors:
        return None
    with torch.no_grad():
        if tensors[0].device.type != "cpu":
            return checks.any_nonfinite_flag(tensors)
        sums = torch.stack([t.sum(dtype=torch.float64) for t in tensors])
        return ~torch.isfinite(sums).all()


class DiagnosisHooks:
    """Anomaly mode and activation hooks for a fit; call :meth:`stop` at fit end and on exceptions."""

    def __init__(self, anomaly_mode: str, activations: Union[str, int]) -> None:
        self.anomaly_mode = anomaly_mode
        self.activations = activations
        self.root: Optional[nn.Module] = None
        self._anomaly_prev: Optional[tuple[bool, bool]] = None
        self._handles: list[Any] = []
        self._outs: dict[int, Tensor] = {}
        self._flag: Optional[Tensor] = None
        self._recording = False  # hooks stay registered (cheap); they record only inside a checked step

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def start(self, root: nn.Module) -> None:
        self.root = root
        if self.anomaly_mode == "always" and self._anomaly_prev is None:
            self._anomaly_prev = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.autograd.set_detect_anomaly(True, check_nan=True)

    def stop(self) -> None:
        """Remove every hook and restore the anomaly mode found at :meth:`start`."""
        self._detach()
        self._flag = None
        if self._anomaly_prev is not None:
            torch.autograd.set_detect_anomaly(*self._anomaly_prev)
            self._anomaly_prev = None

    def step_start(self, step: int) -> None:
        """First micro-batch of an optimizer step: hook the modules if this step is checked."""
        due = self.activations == "always" or (isinstance(self.activations, int) and step % self.activations == 0)
        if due and self.root is not None:
            self._attach()
        elif self.attached and self.activations != "always":
            self._detach()
        self._recording = due

    def step_end(self) -> None:
        """After the optimizer step: stop recording, so validation and other loops are never recorded."""
        self._recording = False
        self._outs = {}
        self._flag = None

    def fold(self) -> None:
        """Reduce the outputs recorded since the last call into the step's device flag (no sync)."""
        if self._outs:
            flag = outputs_nonfinite_flag(self._outs)
            self._outs = {}
            if flag is not None:
                self._flag = flag if self._flag is None else self._flag | flag

    def take(self) -> Optional[Tensor]:
        """The step's activation flag (None when nothing was checked); resets it."""
        self.fold()
        flag, self._flag = self._flag, None
        return flag

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No activation hooks and no fit-long anomaly mode while the incident replay runs."""
        was = self.attached
        anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        self._detach()
        torch.autograd.set_detect_anomaly(False)
        try:
            yield
        finally:
            torch.autograd.set_detect_anomaly(*anomaly)
            if was:
                self._attach()

    def _attach(self) -> None:
        if not self._handles and self.root is not None:
            self._handles = [m.register_forward_hook(self._hook) for m in self.root.modules()]

    def _detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._outs = {}

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._recording:
            return
        if type(output) is Tensor:
            if output.is_floating_point() and output.numel():
                self._outs[id(output)] = output  # a container returns its last child's tensor: keep one
        else:
            self._outs.update((id(t), t) for t in tensors_of(output))
