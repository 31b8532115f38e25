"""The evidence of one optimizer step, gathered on the device by the hooks and read once.

The hooks add to it as the step runs: the batch of each micro-batch (``check.inputs: always`` also turns it
into a device flag), the loss of each micro-batch before backward, the module outputs
(``check.activations``), and, after the previous optimizer step, one flag over every parameter and buffer
(``check.parameters``). :meth:`StepEvidence.read` stacks them with the total gradient norm into the
:class:`~.flags.StepFlags` vector, agrees on it across ranks, and reads it: the one host-device sync of
the step.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..config import CheckConfig
from ..layouts import checkable
from ..tree import iter_tensors
from .activations import ActivationCheck
from .amp import scale_flag, unscale_value
from .flags import StepFlags, dense_nonfinite_flag, nonfinite_flag
from .state import StateCheck
from .sync import StepSync

__all__ = ["StepEvidence"]


class StepEvidence:
    """Device flags of the current optimizer step and the batches they came from.

    Attributes:
        window: ``(batch, batch_idx)`` of each micro-batch of the step (what an incident replays).
        activations: the module-output check (``check.activations``).
        state: the parameter/buffer check (``check.parameters``).
        grads_were_finite: the gradients of the last judged step were finite (a non-finite parameter after
            finite gradients points at the optimizer); set by the guard once it has judged a step.
    """

    def __init__(self, check: CheckConfig) -> None:
        self.check = check
        self.window: list[tuple[Any, int]] = []
        self.activations = ActivationCheck(check.activations)
        self.state = StateCheck()
        self.grads_were_finite = True
        self._loss_bad: Optional[Tensor] = None
        self._loss_sum: Optional[Tensor] = None
        self._input_bad: Optional[Tensor] = None
        self._state_bad: Optional[Tensor] = None  # parameters/buffers after the previous optimizer step
        self._read = False  # manual optimization: the losses since the last read belong to the next step
        self._nan: dict[torch.device, Tensor] = {}

    @property
    def batch_idx(self) -> int:
        return self.window[-1][1] if self.window else -1

    @property
    def loss_checked(self) -> bool:
        return self._loss_sum is not None

    def micro_batch(self, batch: Any, batch_idx: int, step: int) -> bool:
        """A micro-batch starts; returns True when it is the first of an optimizer step."""
        first = not self.window
        if first:
            self._loss_bad = self._loss_sum = self._input_bad = None
            self.activations.step_start(step)
        self.window.append((batch, batch_idx))
        if self.check.inputs == "always":
            flag = dense_nonfinite_flag(checkable(iter_tensors(batch)))  # sparse tensors: their stored values
            if flag is not None:
                self._input_bad = flag if self._input_bad is None else self._input_bad | flag
        return first

    def loss(self, loss: Tensor, scaler: Optional[Any]) -> None:
        """A micro-batch's loss before backward (scaled under 16-mixed)."""
        self.activations.fold()
        if not self.check.loss:
            return
        if self._read:
            self._loss_bad = self._loss_sum = None
            self._read = False
        loss = loss.detach()
        flag = nonfinite_flag(loss)
        value = unscale_value(loss.float().sum(), scaler)
        self._loss_bad = flag if self._loss_bad is None else self._loss_bad | flag
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    def loss_bad(self) -> bool:
        """Read the loss flag of the step so far (one sync: outside the step decision, incidents only)."""
        return self._loss_bad is not None and not self._read and bool(self._loss_bad)

    def after_step(self, module: nn.Module) -> None:
        """After an optimizer step: the flag over every parameter and buffer, read with the next step's."""
        if self.check.parameters:
            self._state_bad = self.state.flag(module)

    def state_bad(self, consume: bool) -> Optional[bool]:
        """Read the pending parameter/buffer flag now (one sync; snapshot and validation time only); None
        when there is none. ``consume``: it is not read again with the next step's flags."""
        if self._state_bad is None:
            return None
        bad = bool(self._state_bad)
        if consume:
            self._state_bad = None
        return bad

    def forget_state(self) -> None:
        """Drop the pending parameter/buffer flag (a rollback replaced the weights it was computed on)."""
        self._state_bad = None

    def read(self, norm: Optional[Tensor], device: torch.device, scaler: Optional[Any], sync: StepSync) -> StepFlags:
        """Stack the step's flags with ``norm``, agree on them across ranks, read them: the step's one sync."""
        zero = torch.zeros((), device=device)
        nan = self._nan.get(device)
        if nan is None:
            nan = self._nan[device] = torch.full((), math.nan, device=device)

        def part(t: Optional[Tensor]) -> Tensor:
            return zero if t is None else t.float().to(device)

        parts = {"grad_norm": part(norm), "loss": part(self._loss_sum), "loss_bad": part(self._loss_bad),
                 "input_bad": part(self._input_bad), "param_bad": part(self._state_bad),
                 "activation_bad": part(self.activations.take()),
                 "grad_scale": scale_flag(scaler, device) if scaler is not None else nan}
        self._state_bad = None
        self._read = True
        vec = torch.stack([parts[name] for name in StepFlags._fields])
        return StepFlags.from_values(sync.reduce(vec).tolist())

    def step_end(self) -> None:
        self.activations.step_end()
        self.window.clear()
