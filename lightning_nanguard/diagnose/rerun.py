"""What every incident replay is made of: the result it fills, rerunning ``training_step`` without changing training,
its gradients without touching ``.grad``, at the step's own number, eagerly.

- :func:`preserved_state` restores RNG, buffers (BatchNorm statistics), torchmetrics states, train/eval modes and
  ``log``/``log_dict`` after a rerun (and reshards FSDP2 modules: a forward all-gathered their weights);
- :func:`run_step` reruns one micro-batch inside the precision plugin's forward context, with its RNG state;
- :func:`gradients` computes the gradients with :func:`torch.autograd.grad` (a real ``backward()``, with every
  ``.grad`` put back, where autograd cannot: FSDP2, a reentrant checkpoint);
- :func:`eager` and :func:`at_step`: a compiled model runs eagerly, and ``trainer.global_step`` reads the step's
  own number;
- :class:`Rewritten`: a micro-batch that its own step wrote into in place (:mod:`~..detect.writes`): every rerun
  gets a fresh copy of it (:func:`fresh`), so that no pass writes into the user's batch again nor sees another
  pass's writes.

Used by the one-process replay (:mod:`.replay`), the lockstep one of a sharded module (:mod:`.lockstep`), their
passes (:mod:`.passes`) and the float64 pass (:mod:`.float64`).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ContextManager, Iterator, Optional, Protocol, Sequence

import torch
from torch import Tensor, nn

from ..core.dtensors import is_dtensor
from ..core.record import RngState, rng_state, set_rng_state
from ..core.tree import iter_tensors, map_tensors
from ..recover.metrics import MetricUndo
from .probes import public_name

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.plugins import Precision

__all__ = ["ReplayResult", "preserved_state", "run_step", "gradients", "eager", "at_step", "forward_context",
           "quiet_hooks", "trainable", "reentrant_checkpoint", "noop", "RngState", "Batches", "Rewritten", "fresh",
           "rewritten"]

# one micro-batch's RNG state before it ran (:func:`~..core.record.rng_state`: the CPU and CUDA generators' states)
# the micro-batches of a window, each with its batch_idx (:class:`~..core.record.Window`)
Batches = Sequence[tuple[object, int]]


@dataclass
class ReplayResult:
    micro_batch: Optional[int] = None
    reproduced: bool = False
    loss_finite: Optional[bool] = None
    forward: Optional[dict] = None  # first bad module call (frame row)
    forward_op: Optional[dict] = None
    backward: Optional[dict] = None  # first bad module in backward order
    backward_op: Optional[dict] = None  # first autograd node producing NaN/Inf
    anomaly: Optional[dict] = None  # what detect_anomaly(check_nan=True) reported
    nonfinite_grads: list[str] = field(default_factory=list)
    norm_overflow: bool = False  # every gradient finite, their total norm not (an incident too)
    float64: Optional[dict] = None
    errors: list[str] = field(default_factory=list)
    frames_text: str = ""
    forward_rows: list[dict] = field(default_factory=list)  # module calls up to the first non-finite output
    lockstep: bool = False  # sharded: the same passes on every rank (:mod:`.lockstep`)
    # sharded: the non-finite values reached this rank through this collective; its own computation was finite
    received: Optional[str] = None
    timeout: Optional[str] = None  # anomaly.replay_timeout ended the replay: where
    float64_note: Optional[str] = None  # why the float64 pass did not run (sharded: the memory of the whole model)


def noop(*args: object, **kwargs: object) -> None:
    return None


@contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Restore RNG, buffers, torchmetrics states, train modes and ``log``/``log_dict`` of ``module`` on exit."""
    rng = rng_state()
    metrics = MetricUndo(module)  # a replayed training_step must not count its batch in the user's metrics again
    metrics.arm()
    modes = {m: m.training for m in module.modules()}
    buffers = {n: (b, b.detach().clone()) for n, b in module.named_buffers()}
    shadowed: dict[str, object] = {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}
    object.__setattr__(module, "log", noop)
    object.__setattr__(module, "log_dict", noop)
    try:
        yield
    finally:
        for k in ("log", "log_dict"):
            module.__dict__.pop(k, None)
        module.__dict__.update(shadowed)
        with torch.no_grad():
            for name, (buf, saved) in buffers.items():
                owner_name, _, attr = name.rpartition(".")
                owner = module.get_submodule(owner_name) if owner_name else module
                if owner._buffers.get(attr) is not buf:
                    owner._buffers[attr] = buf  # the forward replaced the buffer object: put the original back
                buf.copy_(saved)
        for m, mode in modes.items():
            m.training = mode
        metrics.undo()
        set_rng_state(rng)
        _reshard(module)


def _reshard(module: nn.Module) -> None:
    """FSDP2: a replay's forward all-gathered the weights, and only a completed ``backward()`` reshards them (not a
    forward whose loss was None, nor one cut short by an error): put every FSDP module back on its sharded
    parameters (local, no collective), so that what follows (a rollback, the optimizer step) sees the DTensors."""
    for m in module.modules():
        reshard = getattr(m, "reshard", None)
        if callable(reshard) and hasattr(m, "unshard"):
            reshard()


def _loss_of(output: object) -> Optional[Tensor]:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


class Rewritten:
    """A micro-batch its own ``training_step`` wrote into in place (``fields``: the paths of the tensors it wrote,
    :func:`~..core.tree.iter_tensors`'): what the guard holds are the values it wrote. A rerun is given a copy
    (:meth:`copy`), never the batch itself."""

    __slots__ = ("batch", "fields")

    def __init__(self, batch: object, fields: Sequence[str]) -> None:
        self.batch, self.fields = batch, tuple(fields)

    def copy(self) -> tuple[object, list[tuple[str, Tensor]]]:
        """A copy of the batch (every tensor cloned), and the copies of the written tensors with their paths."""
        twin = map_tensors(self.batch, lambda t: t.detach().clone())
        return twin, [(p, t) for p, t in iter_tensors(twin) if p in self.fields]


def fresh(batch: object) -> object:
    """The batch a rerun is given: a copy of a :class:`Rewritten` one, else the batch itself."""
    return batch.copy()[0] if isinstance(batch, Rewritten) else batch


def rewritten(batches: Batches, written: Sequence[dict]) -> list[tuple[object, int]]:
    """``batches`` with each micro-batch that its step wrote into in place (``written``: the entries of
    :func:`~..detect.writes.written_in_place`) wrapped in :class:`Rewritten`."""
    fields: dict[int, list[str]] = {}
    for w in written:
        fields.setdefault(int(w["micro_batch"]), []).append(str(w["field"]))
    return [(Rewritten(b, fields[i]) if i in fields else b, idx) for i, (b, idx) in enumerate(batches)]


def run_step(module: "pl.LightningModule", batch: object, batch_idx: int, rng: Optional[RngState],
             ctx: ContextManager[object]) -> Optional[Tensor]:
    batch = fresh(batch)
    set_rng_state(rng)
    with ctx, torch.enable_grad():
        return _loss_of(module.training_step(batch, batch_idx))


def gradients(loss: Tensor, named: Sequence[tuple[str, Tensor]]) -> list[Optional[Tensor]]:
    if not loss.requires_grad or not named:
        return [None] * len(named)
    params = [p for _, p in named]
    # torch.autograd.grad refuses checkpoint(..., use_reentrant=True); under FSDP2 it finds no gradient at all (the
    # sharded parameters are not in the graph of the all-gathered ones that the forward used): a real backward,
    # whose reduce-scatter every rank of a lockstep replay makes alike
    if reentrant_checkpoint(loss) or any(is_dtensor(p) for p in params):
        return _backward_grads(loss, params)
    return list(torch.autograd.grad(loss.sum(), params, allow_unused=True))


def reentrant_checkpoint(loss: Tensor) -> bool:
    """Does the graph of ``loss`` run through ``torch.utils.checkpoint`` with ``use_reentrant=True``?"""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        if node.name() == "CheckpointFunctionBackward":
            return True
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return False


def _backward_grads(loss: Tensor, params: Sequence[Tensor]) -> list[Optional[Tensor]]:
    """The gradients of ``params`` through ``loss.backward()``, every ``.grad`` put back as it was."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        loss.sum().backward()
        return [p.grad for p in params]
    finally:
        for p, g in zip(params, saved):
            p.grad = g


@contextmanager
def eager() -> Iterator[None]:
    """Run ``torch.compile``'d modules and functions eagerly: the replay's hooks and modes would otherwise
    make dynamo trace them again (recompiling the user's graphs, or failing on the hooks)."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:  # pragma: no cover  (torch < 2.6)
        yield
        return
    with set_stance("force_eager"):
        yield


def _step_counter(trainer: Optional["pl.Trainer"]) -> Optional[_Counter]:
    """The progress counter behind ``trainer.global_step`` under automatic optimization (the only kind a replay
    runs for), or None where the Trainer has none."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    optim = getattr(getattr(loop, "automatic_optimization", None), "optim_progress", None)
    total = getattr(getattr(getattr(optim, "optimizer", None), "step", None), "total", None)
    return total if isinstance(getattr(total, "completed", None), int) else None


class _Counter(Protocol):
    completed: int  # (Lightning's progress tracker)


@contextmanager
def at_step(trainer: Optional["pl.Trainer"], step: Optional[int]) -> Iterator[None]:
    """Inside the block ``trainer.global_step`` (and the module's) is ``step``: a step judged one step late (or at
    the end of fit) is replayed at its own number, so a ``training_step`` that reads it (a schedule, a
    curriculum, a fault injected at that step) runs as it did."""
    counter = _step_counter(trainer)
    if counter is None or step is None or counter.completed == step:
        yield
        return
    now, counter.completed = counter.completed, int(step)
    try:
        yield
    finally:
        counter.completed = now


@contextmanager
def quiet_hooks() -> Iterator[None]:
    """Inside: the warnings of the replay's full backward hooks on modules whose outputs they cannot see, silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        warnings.filterwarnings("ignore", message="For backward hooks to be called")  # a ModelOutput
        yield


def forward_context(plugin: Optional["Precision"]) -> ContextManager[object]:
    return plugin.forward_context() if plugin is not None else nullcontext()


def trainable(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The parameters that get a gradient, named as the user wrote the model (:func:`~.probes.public_name`)."""
    return [(public_name(n), p) for n, p in module.named_parameters() if p.requires_grad]
