"""The replay of a sharded module (DTensor parameters: FSDP2, tensor parallel): every rank runs its passes, together.

A sharded module's forward and backward are collectives (FSDP2 all-gathers the weights and reduce-scatters the
gradients; tensor parallel all-reduces activations and the gradients of its inputs): a rank that ran a pass alone
would wait forever for the others. So :func:`lockstep_window` runs, on every rank, for every micro-batch of the window:

1. the recorded pass (:func:`~.passes.recorded_run`: forward and backward under the module hooks);
2. then the ranks agree (:meth:`Lockstep.any`: one all-reduce of a few flags) on which further passes any rank needs,
   and every rank runs each of them, a rank that needs none of its findings for its collectives' sake: the op search
   (:func:`~.passes.op_pass`), where some rank's forward went non-finite; the backward's (:func:`backward_pass`),
   where some rank's gradients went non-finite in backward: anomaly mode records the forward's tracebacks and a
   :class:`~.probes.GraphWatch` on every node of the graph names the first one that made NaN or Inf and the first one
   that returned NaN, the node ``detect_anomaly(check_nan=True)`` raises at. It cannot raise here: a rank that left its
   backward half way would leave the others waiting in its collectives;
3. after the window, the float64 pass on the whole model (:func:`whole_float64`): every rank gathers the whole of each
   sharded parameter and buffer (``full_tensor()``, in the same order everywhere) as float64, and a rank that
   reproduced the fault reruns its micro-batch with those in place of the shards and the sharding's own hooks off: a
   computation of this rank alone, no collective. It needs the whole model in float64 on every rank (twice the memory
   of a float32 copy, as the one-process pass): where any rank lacks it, no rank runs it, and the event says so.

Which findings are a rank's own (:func:`received`): a non-finite value that first appears at a collective (the op
search's op, the backward's node: :mod:`.comms`), or gradients that are non-finite although nothing in this rank's own
backward made them (FSDP2's reduce-scatter brought them), were received from another rank (``ReplayResult.received``
says through what); the account then names the rank that made them (:func:`~..account.share_incident`).

Never a hang: ``anomaly.replay_timeout`` bounds the replay. Every agreement carries whether some rank ran past it, and
then every rank ends the replay at that point, together (``ReplayResult.timeout`` says where).
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, TypeVar, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.dtensors import is_dtensor
from ..core.jsonvalue import JSONDict
from .float64 import float64_run
from .passes import first_bad_backward, first_bad_forward, nonfinite_gradients, op_pass, recorded_run
from .probes import GraphWatch
from .rerun import (
    Batches,
    ReplayResult,
    RngState,
    at_step,
    eager,
    forward_context,
    gradients,
    preserved_state,
    quiet_hooks,
    reentrant_checkpoint,
    run_step,
    trainable,
)

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.plugins import Precision

__all__ = ["Lockstep", "lockstep_window", "backward_pass", "whole_float64", "gather_whole", "whole_module", "received",
           "NOWHERE", "LOCKSTEP", "FLOAT64_ROOM"]

# the op search of a rank whose own forward is finite watches no module call (it runs for the collectives only)
NOWHERE = ("", -1)
# what ``details.replay.sharded`` says
LOCKSTEP = ("sharded (DTensor parameters): every rank ran the same passes together, each on its own micro-batches: "
            "the recorded pass, the op search and the backward's (anomaly mode's tracebacks; its NaN check without "
            "raising) where any rank needed them, the float64 pass on the gathered whole model")
# the float64 pass of a sharded module runs where this many times the whole model in float64 is free on every rank
# (the gathered weights, and room for the float64 activations and gradients of one micro-batch)
FLOAT64_ROOM = 2
_REDUCED = "the gradients' reduction across ranks (this rank's own backward was finite)"
_TORCH_DISTRIBUTED = os.path.join(os.path.dirname(torch.__file__), "distributed", "")
_R = TypeVar("_R")
# this rank's own reproduction: its result, the micro-batch, its batch_idx and RNG state
Own = tuple[ReplayResult, object, int, Optional[RngState]]


class Lockstep:
    """How the ranks of a sharded replay agree: one all-reduce (MAX) of a few flags per point (:meth:`any`), and the
    deadline (``timeout`` seconds after :meth:`start`) that ends the replay on every rank together. On one process
    (or outside ``torch.distributed``) every agreement is this rank's own."""

    def __init__(self, timeout: Optional[float] = None, device: Union[torch.device, str, None] = None,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        self.timeout, self.device, self.group = timeout, device, group
        self._deadline: Optional[float] = None
        self.stopped_at: Optional[str] = None

    def start(self) -> None:
        self._deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self.stopped_at = None

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def any(self, *flags: bool, where: str = "") -> list[bool]:
        """Is each of ``flags`` set on some rank? (one all-reduce; identical on every rank). Past the deadline on some
        rank, the replay stops here on every rank (:attr:`stopped_at` = ``where``) and every flag reads False."""
        late = self._deadline is not None and time.monotonic() > self._deadline
        values = [bool(f) for f in flags] + [late]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            t = torch.tensor([float(v) for v in values], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            values = [v > 0 for v in t.tolist()]
        if values[-1] and self.stopped_at is None:
            self.stopped_at = where
        return [v and not self.stopped for v in values[:-1]]

    def agree(self, want: bool) -> bool:
        """Does every rank ``want`` it? (one all-reduce)"""
        return not self.any(not want, where="before the replay")[0]


def lockstep_window(trainer: "pl.Trainer", module: "pl.LightningModule", batches: Batches,
                    rng_states: Sequence[Optional[RngState]], lock: Lockstep, frames: int = 21,
                    float64_check: bool = True, norm_type: float = 2.0, step: Optional[int] = None) -> ReplayResult:
    """Replay every micro-batch of the window on every rank together (module docstring); this rank's result: its first
    micro-batch that reproduced the fault of its own, else its first that received it, else the last one."""
    with eager(), at_step(trainer, step):
        return _window(trainer, module, batches, rng_states, lock, frames, float64_check, norm_type)


def _window(trainer: "pl.Trainer", module: "pl.LightningModule", batches: Batches,
            rng_states: Sequence[Optional[RngState]], lock: Lockstep, frames: int, float64_check: bool,
            norm_type: float) -> ReplayResult:
    plugin = getattr(trainer, "precision_plugin", None)
    lock.start()
    own: Optional[Own] = None
    got: Optional[ReplayResult] = None
    result = ReplayResult(lockstep=True)
    for i, (batch, batch_idx) in enumerate(batches):
        rng = rng_states[i] if i < len(rng_states) else None
        result = ReplayResult(micro_batch=i, lockstep=True)
        with preserved_state(module), quiet_hooks():
            _one(result, module, batch, batch_idx, rng, plugin, frames, norm_type, float64_check, lock)
        if result.reproduced and result.received is None and own is None:
            own = (result, batch, batch_idx, rng)
        elif result.reproduced and got is None:
            got = result
        if lock.stopped:
            break
    chosen = own[0] if own is not None else got or result
    if float64_check and not lock.stopped:
        whole_float64(module, own, lock, share=_ranks_sharing_memory(trainer))
    if lock.stopped:
        chosen.timeout = f"ended on every rank together {lock.stopped_at} (anomaly.replay_timeout: {lock.timeout} s)"
    return chosen


def _one(res: ReplayResult, module: "pl.LightningModule", batch: object, batch_idx: int, rng: Optional[RngState],
         plugin: Optional["Precision"], frames: int, norm_type: float, float64: bool, lock: Lockstep) -> None:
    """One micro-batch: the recorded pass, then the passes some rank needs (every rank runs them), then whether this
    rank's findings are its own (:func:`received`)."""
    named = trainable(module)
    rec, bad_grads, local_finite = None, [], False
    try:
        rec, grads = recorded_run(res, module, batch, batch_idx, rng, plugin, named)
        bad_grads = nonfinite_gradients(res, named, grads, norm_type)
    except Exception as err:  # the replay must never break training (the agreement below still runs)
        res.errors.append(f"replay: {type(err).__name__}: {err}")
    first_fwd = first_bad_forward(res, rec, frames, bad_grads) if rec is not None else None
    want_op, want_backward = res.forward is not None, bool(bad_grads) and res.forward is None
    need_op, need_backward = lock.any(want_op, want_backward, where=f"after the recorded pass of micro-batch "
                                                                    f"{res.micro_batch}")
    if need_op:
        where = (first_fwd.module, first_fwd.call) if first_fwd is not None else None if want_op else NOWHERE
        with preserved_state(module):  # every pass starts from the same buffers
            found = _guarded(res, "op search", op_pass, module, batch, batch_idx, rng, plugin, where, float64)
        if want_op:
            res.forward_op = found
    if need_backward:
        if want_backward and rec is not None:
            first_bad_backward(res, rec, frames)
        with preserved_state(module):
            back = _guarded(res, "backward", backward_pass, module, batch, batch_idx, rng, plugin, named)
        if want_backward and back is not None:
            res.backward_op, res.anomaly, seen = back
            local_finite = not seen
    if not lock.stopped:  # (a replay ended early tells nothing of where the values came from)
        res.received = received(res, bad_grads, local_finite)


def _guarded(res: ReplayResult, name: str, run: Callable[..., _R], *args: object) -> Optional[_R]:
    try:
        return run(*args)
    except Exception as err:  # a pass that fails is evidence missing, never an error of training
        res.errors.append(f"{name}: {type(err).__name__}: {err}")
        return None


def backward_pass(module: "pl.LightningModule", batch: object, batch_idx: int, rng: Optional[RngState],
                  plugin: Optional["Precision"], named: list[tuple[str, Tensor]]) -> tuple[Optional[JSONDict],
                  Optional[JSONDict], bool]:
    """Forward and backward with anomaly mode recording the forward's tracebacks (its NaN check off: it would raise
    on this rank alone, half way through a backward whose collectives the other ranks make) and a
    :class:`~.probes.GraphWatch` on every node: the first node that made NaN or Inf (``backward_op``), the first
    that returned NaN, as anomaly mode would have reported it (``anomaly``, with ``raised: False``), and whether any
    node of this rank's own backward returned a non-finite value."""
    watch: Optional[GraphWatch] = None
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        loss = run_step(module, batch, batch_idx, rng, forward_context(plugin))
        if loss is None or not loss.requires_grad:
            return None, None, False
        watch = GraphWatch(loss, nan_too=True)
        try:
            with watch.growing(module) if reentrant_checkpoint(loss) else nullcontext():
                gradients(loss, named)  # (under FSDP2 a real backward: its reduce-scatter, on every rank)
        finally:
            watch.remove()
    nan = watch.first_nan
    if nan is None:
        return watch.found, None, watch.nonfinite_seen
    anomaly: JSONDict = {"message": f"Function '{nan['op']}' returned nan values in its {nan['output']}th output.",
               "op": nan["op"], "value": "nan", "output": nan["output"], "traceback": nan["traceback"], "raised": False}
    if nan.get("received"):
        anomaly["received"] = nan["received"]
    return watch.found, anomaly, watch.nonfinite_seen


def received(res: ReplayResult, bad_grads: list[str], local_finite: bool = False) -> Optional[str]:
    """Through what collective the non-finite values of this rank's replay reached it, when its own computation made
    none of them (``local_finite``: every node of its own backward returned finite values); None when they are its
    own (or there are none)."""
    if not res.reproduced:
        return None
    if res.forward is not None:
        return (res.forward_op or {}).get("received")
    if bad_grads:
        node = res.backward_op
        if node is None:  # no node of this rank made them (nor carried them): the gradients' reduction brought them
            return _REDUCED if local_finite else None
        return node.get("received")
    return None


# ----------------------------------------------------------------------------------------- the float64 pass


def whole_float64(module: "pl.LightningModule", own: Optional[Own], lock: Lockstep, share: int = 1) -> None:
    """The float64 pass of a sharded module (module docstring, 3): every rank takes part in the gathers where some
    rank reproduced the fault of its own and every rank has the memory (``share``: ranks holding their copies in the
    same memory); ``own``: this rank's result, micro-batch, its index and RNG state, or None."""
    need = _float64_bytes(module) * share
    want, short = lock.any(own is not None, need > _free_bytes(module), where="before the float64 pass")
    if not want:
        return
    res = own[0] if own is not None else None
    if short:
        if res is not None:
            res.float64_note = (f"not run: the whole model in float64 ({need / 2**20:.0f} MiB on each rank) does not "
                                f"fit in the free memory of every rank")
        return
    whole = gather_whole(module)  # (a collective: every rank, in the same order)
    if own is None or res is None:
        return
    _, batch, batch_idx, rng = own
    with preserved_state(module), whole_module(module, whole):
        try:
            res.float64 = float64_run(module, type(module).__name__, batch, batch_idx, rng, res)
        except Exception as err:  # e.g. a training_step that relies on the shards' shapes
            res.errors.append(f"float64: {type(err).__name__}: {err}")
            res.float64_note = "not run: the whole model's training_step failed (see replay.errors)"


def gather_whole(module: nn.Module) -> dict[int, Tensor]:
    """The whole of every DTensor parameter and buffer of ``module`` in float64, by ``id`` (``full_tensor()``: a
    collective that every rank calls, in the same order)."""
    whole: dict[int, Tensor] = {}
    with torch.no_grad():
        for t in (*module.parameters(), *module.buffers()):
            if is_dtensor(t) and id(t) not in whole:
                full = t.full_tensor()
                whole[id(t)] = full.double() if full.is_floating_point() else full
    return whole


@contextmanager
def whole_module(module: nn.Module, whole: dict[int, Tensor]) -> Iterator[None]:
    """Inside: ``module`` as one process would hold it, in float64: each DTensor parameter and buffer replaced by its
    whole tensor (``whole``: :func:`gather_whole`), every other floating one by a float64 copy, and the sharding's own
    forward and backward hooks (FSDP2's, tensor parallel's: defined in ``torch.distributed``) taken off. The user's
    hooks stay (a fault a hook injects comes back in float64, as on the one-process copy). Put back on exit."""
    swapped: list[tuple[dict[str, Any], str, Tensor]] = []
    hooks: list[tuple[dict[int, Callable[..., object]], dict[int, Callable[..., object]]]] = []
    made: dict[int, Tensor] = {}

    def twin(t: Tensor, parameter: bool) -> Tensor:
        if id(t) not in made:
            value = whole.get(id(t))
            if value is None:
                value = t.detach().double() if t.is_floating_point() else t.detach()
                value = value.clone() if value.data_ptr() == t.data_ptr() else value
            made[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if parameter else value
        return made[id(t)]

    try:
        for m in module.modules():
            # (m._parameters holds Parameters, m._buffers Tensors: dicts of two value types)
            tensors: tuple[tuple[dict[str, Any], bool], ...] = ((m._parameters, True), (m._buffers, False))
            for table, parameter in tensors:
                for key, t in list(table.items()):
                    if t is not None:
                        swapped.append((table, key, t))
                        table[key] = twin(t, parameter)
            hook_tables: tuple[dict[int, Callable[..., object]], ...] = (
                m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks)
            for hook_table in hook_tables:
                off = [k for k, hook in hook_table.items() if _sharding_hook(hook)]
                if off:
                    hooks.append((hook_table, dict(hook_table)))
                    for k in off:
                        del hook_table[k]
        yield
    finally:
        for table, key, t in reversed(swapped):
            table[key] = t
        for hook_table, saved in hooks:
            hook_table.clear()
            hook_table.update(saved)


def _sharding_hook(hook: object) -> bool:
    """Is ``hook`` the sharding's own (its code in ``torch.distributed``: FSDP2's state, tensor parallel's input and
    output redistributions)?"""
    fn = getattr(hook, "func", hook)  # a functools.partial
    fn = getattr(fn, "__func__", fn)  # a bound method
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.startswith(_TORCH_DISTRIBUTED)


def _float64_bytes(module: nn.Module) -> int:
    """The memory the float64 pass is given room for: :data:`FLOAT64_ROOM` times the whole model in float64 (a
    DTensor's ``numel()`` is the whole tensor's)."""
    seen: set[int] = set()
    total = 0
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * (8 if t.is_floating_point() else t.element_size())
    return FLOAT64_ROOM * total


def _free_bytes(module: nn.Module) -> float:
    """The memory free where the module's tensors live: the device's (CUDA), else the host's available memory."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return math.inf  # (not Linux: not known, assumed enough)


def _ranks_sharing_memory(trainer: "pl.Trainer") -> int:
    """How many ranks keep their float64 copies in the same memory: the processes of this host on the CPU, one per
    accelerator otherwise."""
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    if getattr(device, "type", "cpu") != "cpu":
        return 1
    return max(int(getattr(trainer, "num_devices", 1) or 1), 1)
