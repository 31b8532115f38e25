"""The evidence of one optimizer step, gathered on the device by the hooks and read once.

The hooks add to it as the step runs: the batch of each micro-batch (``check.inputs: always`` also turns it
into a device flag), the loss of each micro-batch before backward, the module outputs
(``check.activations``), and one flag over every parameter and buffer after the previous optimizer step
(``check.parameters``: every step while ``check.loss`` or ``check.gradients`` is off, else the one taken
before a due snapshot). :meth:`StepEvidence.read` stacks them with the total gradient norm into the
evidence vector (:mod:`.vector`), agrees on it across ranks, and reads it: the one host-device sync of
the step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import Tensor, nn

from ..config import CheckConfig
from ..core.layouts import checkable
from ..core.record import Window, rng_state
from ..core.tree import iter_tensors
from .activations import ActivationCheck
from .amp import scale_flag, unscale_value
from .find import find_batch_nonfinite
from .kernels import dense_nonfinite_flag
from .ranks import Ranks
from .vector import SCHEMA, StepFlags
from .weights import WeightCheck
from .writes import batch_versions

if TYPE_CHECKING:
    from torch.amp import GradScaler

__all__ = ["StepEvidence", "HostCopy"]


class StepEvidence:
    """Device flags of the current optimizer step and the batches they came from.

    Attributes:
        window: the micro-batches of the step and the RNG state before each (:class:`~..record.Window`: what an
            incident replays); the RNG states only with ``keep_rng`` (replays on).
        activations: the module-output check (``check.activations``).
        weights: the parameter/buffer check (``check.parameters``).
        grads_were_finite: the gradients of the last judged step were finite (a non-finite parameter after
            finite gradients points at the optimizer); None when ``check.gradients`` is off (not known); set by
            :meth:`judged` once the guard has judged a step.
    """

    def __init__(self, check: CheckConfig, keep_rng: bool = True) -> None:
        self.check = check
        self.keep_rng = keep_rng
        self.window = Window()
        self.activations = ActivationCheck(check.activations)
        self.weights = WeightCheck()
        self.grads_were_finite: Optional[bool] = True
        self._loss_sum: Optional[Tensor] = None
        self._input_bad: Optional[Tensor] = None
        self._state_bad: Optional[Tensor] = None  # parameters/buffers after the previous optimizer step
        self._state_module: Optional[nn.Module] = None  # its weights changed since they were last checked
        self._read = False  # manual optimization: the losses since the last read belong to the next step
        self._consts: dict[torch.device, dict[str, Tensor]] = {}
        self.host = HostCopy()

    @property
    def batch_idx(self) -> int:
        return self.window.batch_idx

    @property
    def loss_checked(self) -> bool:
        return self._loss_sum is not None

    def micro_batch(self, batch: object, batch_idx: int, step: int) -> bool:
        """A micro-batch starts; returns True when it is the first of an optimizer step."""
        first = not len(self.window)
        if first:
            self._loss_sum = self._input_bad = None
            self.activations.step_start(step)
            self.window.step = step
        # the batch tensors' version counters (host integers, no device work): an incident tells the batch tensors
        # the step itself wrote into in place (detect.writes)
        self.window.add(batch, batch_idx, rng_state() if self.keep_rng else None, batch_versions(batch))
        if self.check.inputs == "always":
            flag = dense_nonfinite_flag(checkable(iter_tensors(batch)))  # sparse tensors: their stored values
            if flag is not None:
                self._input_bad = flag if self._input_bad is None else self._input_bad | flag
        return first

    def loss(self, loss: Tensor, scaler: Optional["GradScaler"]) -> None:
        """A micro-batch's loss before backward (scaled under 16-mixed)."""
        self.activations.fold()
        if not self.check.loss:
            return
        if self._read:
            self._loss_sum = None
            self._read = False
        loss = loss.detach()
        # a sum is non-finite when any term is (NaN and +-Inf propagate): the step's flag is taken from it
        value = loss if loss.dtype is torch.float32 and loss.dim() == 0 else loss.float().sum()
        value = unscale_value(value, scaler)
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    def loss_bad(self) -> bool:
        """Read the loss flag of the step so far (one sync: outside the step decision, incidents only)."""
        return self._loss_sum is not None and not self._read and not bool(torch.isfinite(self._loss_sum))

    @property
    def state_every_step(self) -> bool:
        """Is every step's update checked by a pass over the parameters and buffers? Only while ``check.loss`` or
        ``check.gradients`` is off: otherwise a bad weight that the next forward reads spoils that step's loss
        (or gradients), and the incident path names it; one that no forward reads is found before the next
        snapshot, checkpoint or validation, and at the end of fit (``check.parameters``)."""
        return self.check.parameters and not (self.check.loss and self.check.gradients)

    def nonfinite_behind(self, module: nn.Module, batches: Sequence[tuple[object, int]], *, weights: bool,
                         parameters_only: bool, inputs: bool) -> tuple[list[dict], list[dict]]:
        """What holds the non-finite values behind an incident (syncs: incident only): the ``weights`` (only the
        parameters with ``parameters_only``), and where none is, with ``inputs``, the floating tensors of the
        micro-``batches`` (each finding with its ``micro_batch``)."""
        found = self.weights.find(module) if weights else []
        if parameters_only:
            names = {n for n, _ in module.named_parameters()}
            found = [f for f in found if f["name"] in names]
        batch = [dict(f, micro_batch=i) for i, (b, _) in enumerate(batches) for f in find_batch_nonfinite(b)] \
            if inputs and not found else []
        return found, batch

    def judged(self, grad_norm: float) -> None:
        """A step was judged (an incident, or healthy) with this gradient norm: :attr:`grads_were_finite`."""
        self.grads_were_finite = math.isfinite(grad_norm) if self.check.gradients else None

    def after_step(self, module: nn.Module) -> None:
        """After an optimizer step: the weights changed since they were last checked. With
        :attr:`state_every_step`, their flag (read with the next step's)."""
        if self.check.parameters:
            self._state_module = module
            if self.state_every_step:
                self._state_bad = self.weights.flag(module)

    def state_bad(self, consume: bool) -> Optional[bool]:
        """Read the flag of the weights changed since the last check now (one sync; snapshot and validation time
        only); None when they did not change. ``consume``: not checked again until the next step changes them."""
        if self._state_bad is None and self._state_module is not None:
            self._state_bad = self.weights.flag(self._state_module)
        if self._state_bad is None:
            return None
        bad = bool(self._state_bad)
        if consume:
            self._state_bad = self._state_module = None
        return bad

    def forget_state(self) -> None:
        """Drop the pending parameter/buffer flag (a rollback replaced the weights it was computed on)."""
        self._state_bad = self._state_module = None

    def vector(self, norm: Optional[Tensor], device: torch.device, scaler: Optional["GradScaler"], ranks: Ranks,
               grads: Sequence[Tensor] = ()) -> Tensor:
        """The step's evidence vector (:data:`~.vector.SCHEMA`) on the device, stacked with ``norm`` (of ``grads``)
        and agreed across ranks (one all-reduce under DDP); nothing is read."""
        consts = self._consts.get(device)
        if consts is None:  # stacked, never written: shared by every step
            consts = self._consts[device] = SCHEMA.constants(device)

        def part(t: Optional[Tensor]) -> Optional[Tensor]:
            if t is None:
                return None
            if t.dtype is not torch.float32:
                t = t.float()
            return t if t.device == device else t.to(device)

        loss_bad = None if self._loss_sum is None else ~torch.isfinite(self._loss_sum)
        parts = {"grad_norm": part(norm), "loss": part(self._loss_sum), "loss_bad": part(loss_bad),
                 "input_bad": part(self._input_bad), "param_bad": part(self._state_bad),
                 "activation_bad": part(self.activations.take()),
                 "grad_scale": scale_flag(scaler, device) if scaler is not None else None}
        if norm is not None and ranks.replicas:  # DDP: this rank's own copy of the reduced gradient, for the check
            parts.update((name, part(t)) for name, t in ranks.own_parts(norm, grads).items())
        if self._state_bad is not None:  # checked with this step's flags
            self._state_bad = self._state_module = None
        self._read = True
        return ranks.reduce(SCHEMA.build(parts, consts))

    def read(self, norm: Optional[Tensor], device: torch.device, scaler: Optional["GradScaler"], ranks: Ranks,
             grads: Sequence[Tensor] = ()) -> StepFlags:
        """Stack the step's flags with ``norm``, agree on them across ranks, read them: the step's one sync."""
        return SCHEMA.read(self.vector(norm, device, scaler, ranks, grads).tolist())

    def stage(self, vec: Tensor) -> None:
        """Start copying ``vec`` to the host without waiting (``check.sync: lagged``); :meth:`take` reads it."""
        self.host.put(vec)

    def take(self) -> StepFlags:
        """The staged vector's values (by now copied: its step's work finished while the next one was queued)."""
        return SCHEMA.read(self.host.take())

    def step_end(self) -> None:
        self.activations.step_end()
        self.window.clear()


class HostCopy:
    """A flag vector on its way to the host: copied without a wait, read one optimizer step later.

    CUDA: a non-blocking copy into pinned host memory and an event recorded behind it; by the time the next
    step reads it, the event has long completed, so the read waits for nothing (it only synchronises on the
    event if it has not). CPU: every op has finished when it returns; the vector is kept as it is. Other
    devices: the vector stays on the device and the read copies it (a wait, one step late).
    """

    def __init__(self) -> None:
        self.buffer: Optional[Tensor] = None
        self._event: Optional[torch.cuda.Event] = None

    def put(self, vec: Tensor) -> None:
        vec = vec.detach()
        if vec.is_cuda:
            if self.buffer is None or self.buffer.shape != vec.shape or self.buffer.dtype != vec.dtype:
                self.buffer = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
            self.buffer.copy_(vec, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self.buffer, self._event = vec, None

    def take(self) -> list[float]:
        assert self.buffer is not None, "nothing was staged"
        if self._event is not None:
            if not self._event.query():
                self._event.synchronize()
            self._event = None
        return self.buffer.tolist()
