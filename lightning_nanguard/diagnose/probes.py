"""Probes used by the incident replay (:mod:`.replay`); nothing here runs
while training is healthy.

- :class:`FrameRecorder`: forward pre/post and full backward hooks on every module. Per module call it keeps
  abs-max, abs-min (of finite values) and the count of non-finite values of inputs and outputs as a small
  device tensor, like transformers' ``DebugUnderflowOverflow`` but without a host sync per module:
  :meth:`FrameRecorder.read` reads all frames at once.
- :class:`FirstBadOp`: a ``TorchFunctionMode`` naming the first torch op, inside a given module call, that made a
  non-finite value: its output holds a NaN its tensor inputs did not, or an infinity that neither its tensor inputs nor
  its scalar arguments carried (``masked_fill(mask, -inf)`` is never it; the softmax of the row it fills is), with
  the op's evidence (:func:`~.domain.op_evidence`: its float64 recompute, working dtype, out-of-domain input).
- :class:`GraphWatch`: hooks on every node of an autograd graph, naming the first backward function that
  produced NaN *or* Inf from finite gradients (anomaly mode only checks NaN).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import sysconfig
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ..core.dtensors import is_dtensor, local
from ..core.jsonvalue import JSONDict
from ..core.layouts import is_strided, stored_values
from ..core.tree import iter_tensors
from . import domain
from .comms import is_communication, is_communication_node

__all__ = ["Frame", "FrameRecorder", "FirstBadOp", "GraphWatch", "all_finite", "format_frames", "forward_trace",
           "floats_of", "user_frame", "is_compiled", "public_name"]


def _library_dirs() -> tuple[str, ...]:
    """Folders whose frames are never "user code": torch, Lightning, NaNGuard and the standard library."""
    dirs = [str(Path(torch.__file__).parent), str(Path(__file__).parent)]
    for name in ("pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(spec.submodule_search_locations)
    return tuple(os.path.join(d, "") for d in dirs)


_LIBRARY_DIRS = _library_dirs()
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")


def _is_library(filename: str) -> bool:
    return filename.startswith(_LIBRARY_DIRS) or (filename.startswith(_STDLIB) and "-packages" not in filename)


def is_compiled(module: nn.Module) -> bool:
    """Is ``module`` the wrapper ``torch.compile(module)`` returns (an ``OptimizedModule``)?"""
    return type(module).__name__ == "OptimizedModule" and isinstance(module._modules.get("_orig_mod"), nn.Module)


def public_name(name: str) -> str:
    """A module or parameter name as the user wrote the model: without ``torch.compile``'s ``_orig_mod``."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod") if "_orig_mod" in name else name


def floats_of(obj: object) -> list[Tensor]:
    """The non-empty floating tensors of a nested input/output structure (sparse ones: their stored values)."""
    values = (local(t) if is_strided(t) else stored_values(t, path)  # a DTensor: its local shard
              for path, t in iter_tensors(obj, "") if t.is_floating_point())
    return [t for t in values if t is not None and t.numel()]


def _stats(tensors: list[Tensor]) -> Tensor:
    """Device tensor [abs-max, abs-min, non-finite count] over finite values of ``tensors`` (not empty; no sync)."""
    rows = []
    for t in tensors:
        a = t.detach().abs().double()
        fin = torch.isfinite(a)
        rows.append(torch.stack([torch.where(fin, a, 0.0).amax(), torch.where(fin, a, math.inf).amin(),
                                 (~fin).sum().double()]))
    s = torch.stack([r.to(rows[0].device) for r in rows])
    return torch.stack([s[:, 0].amax(), s[:, 1].amin(), s[:, 2].sum()])


def all_finite(tensors: list[Tensor]) -> bool:
    return all(bool(torch.isfinite(t.detach()).all()) for t in tensors)


def user_frame() -> Optional[str]:
    """``file:line in func: code`` of the innermost stack frame outside torch, Lightning and NaNGuard."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        if not _is_library(fr.filename):
            return f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
    return None


@dataclass
class Frame:
    index: int
    module: str
    call: int
    dtype: str
    pending: Optional[Tensor]  # on the device until read(): [in_max, in_min, in_bad, out_max, out_min, out_bad]
    stats: list[float] = field(default_factory=list)  # the same six, read (FrameRecorder.read)

    def row(self) -> JSONDict:
        s = self.stats
        return {"module": self.module, "call": self.call, "dtype": self.dtype, "in_abs_max": s[0],
                "in_abs_min": s[1], "in_nonfinite": int(s[2]), "out_abs_max": s[3], "out_abs_min": s[4],
                "out_nonfinite": int(s[5])}


class FrameRecorder:
    """Forward (and optionally full backward) hooks on every submodule, statistics kept on the device."""

    def __init__(self, root: nn.Module, backward: bool = True, root_name: str = "<root>") -> None:
        # named as in the uncompiled model: a compiled submodule's wrapper is not hooked, its inner module is
        self.names = {m: (public_name(n) or root_name) for n, m in root.named_modules() if not is_compiled(m)}
        self.backward = backward
        self.forward_frames: list[Frame] = []
        self.backward_frames: list[Frame] = []
        self.calls: dict[str, int] = {}
        self.stack: list[tuple[str, int]] = []
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> "FrameRecorder":
        for m in self.names:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
            if self.backward:
                self._handles.append(m.register_full_backward_hook(self._bwd))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        name = self.names[module]
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        self.stack.append((name, call))

    def _post(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        name, call = self.stack.pop() if self.stack else (self.names[module], 0)
        self._add(self.forward_frames, name, call, floats_of(args), floats_of(output))

    def _bwd(self, module: nn.Module, grad_input: object, grad_output: object) -> None:
        # for gradients, "in" is what flows into the module's backward (grad_output), "out" what it produces
        self._add(self.backward_frames, self.names[module], 0, floats_of(grad_output), floats_of(grad_input))

    def _add(self, frames: list[Frame], name: str, call: int, ins: list[Tensor], outs: list[Tensor]) -> None:
        if not outs:
            return
        so = _stats(outs)
        si = _stats(ins) if ins else torch.tensor([0.0, math.inf, 0.0], dtype=torch.float64, device=so.device)
        frames.append(Frame(len(frames), name, call, str(outs[0].dtype).replace("torch.", ""),
                            torch.cat([si.to(so.device), so])))  # (stats: read at once, by read())

    def read(self) -> None:
        """The one host read of a replay pass."""
        for frames in (self.forward_frames, self.backward_frames):
            pending = [(f, t) for f in frames if (t := f.pending) is not None]
            if pending:
                values = torch.stack([t for _, t in pending]).tolist()
                for (f, _), v in zip(pending, values):
                    f.stats, f.pending = v, None

    @staticmethod
    def first_bad(frames: list[Frame]) -> Optional[Frame]:
        return next((f for f in frames if f.stats[5] > 0 and f.stats[2] == 0), None)


def format_frames(frames: list[Frame], title: str) -> str:
    head = f"{'#':>4}  {'module (call)':<40} {'dtype':<9} {'in abs-min':>10} {'in abs-max':>10} {'in bad':>7} " \
           f"{'out abs-min':>11} {'out abs-max':>11} {'out bad':>8}"
    lines = [title, head, "-" * len(head)]
    for f in frames:
        s = f.stats
        label = f"{f.module} ({f.call})"
        lines.append(f"{f.index:>4}  {label[-40:]:<40} {f.dtype:<9} {s[1]:>10.3g} {s[0]:>10.3g} {int(s[2]):>7} "
                     f"{s[4]:>11.3g} {s[3]:>11.3g} {int(s[5]):>8}")
    return "\n".join(lines)


_UNINITIALISED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})


class FirstBadOp(TorchFunctionMode):
    """Names the first torch op, inside ``module`` (innermost), that made a non-finite value
    (:func:`~.domain.made_nonfinite`), with its evidence (:func:`~.domain.op_evidence`). A Python composite whose
    output's autograd name is not its own (``multi_head_attention_forward``, whose output comes from a transpose)
    is named by the aten op inside it that made the value (``SoftmaxBackward0``).

    Collectives (:func:`~.comms.is_communication`: sharded modules) are never the op: their results are other
    ranks' values, read only after the collective's wait (a later op's input); they are listed in
    :attr:`collectives`, the way by which a value no op of this rank made came in. Ops whose output is uninitialised
    memory (``torch.empty``) are never the op either.

    ``written``: the batch tensors (path, tensor: copies of those the step itself wrote into in place, whose values
    are the ones it wrote) whose non-finite values no op of the rerun can be judged on: the first in-place op
    whose output, written into one of them (or a view of it), is non-finite is the op, named with the path it
    wrote (``wrote_batch``) and none of the float64 or domain evidence, which would read the values it wrote
    instead of those it was fed."""

    def __init__(self, recorder: FrameRecorder, module: Optional[tuple[str, int]], float64: bool = True,
                 written: Sequence[tuple[str, Tensor]] = ()) -> None:
        super().__init__()
        self.recorder, self.module, self.float64 = recorder, module, float64
        self.found: Optional[JSONDict] = None
        self.collectives: list[str] = []
        self.written = {t.untyped_storage().data_ptr(): path for path, t in written}

    def __torch_function__(self, func: domain.Op, types: Sequence[type], args: Sequence[object] = (),
                           kwargs: Optional[Mapping[str, object]] = None) -> object:
        kwargs = kwargs or {}
        if self.found is None and self.written and domain.in_place(func) and args and isinstance(args[0], Tensor):
            path = self.written.get(args[0].untyped_storage().data_ptr())
            if path is not None:  # a write into a batch tensor the step wrote: what it wrote there is all we hold
                out = func(*args, **kwargs)
                outs = floats_of(out)
                if outs and not all_finite(outs):
                    self.found = self._wrote_batch(func, path, out, outs)
                return out
        watched = self.found is None and (self.module is None or (self.recorder.stack[-1] if self.recorder.stack
                                                                    else None) == self.module)
        before: Sequence[object] = args
        if watched and domain.in_place(func) and args and isinstance(args[0], Tensor):
            before = (args[0].detach().clone(), *args[1:])  # an in-place op: its input as it was
        out = func(*args, **kwargs)
        if watched and is_communication(func):
            self.collectives.append(getattr(func, "__name__", str(func)))
        elif watched and domain.op_name(func) not in _UNINITIALISED:
            outs = floats_of(out)
            if outs and domain.made_nonfinite(floats_of([before, kwargs]), outs, domain.scalars_of([before, kwargs])):
                self.found = self._evidence(func, before, kwargs, out, outs)
        return out

    def _wrote_batch(self, func: domain.Op, path: str, out: object, outs: list[Tensor]) -> JSONDict:
        where = self.recorder.stack[-1] if self.recorder.stack else None
        grad_fn = next((t.grad_fn for _, t in iter_tensors(out, "") if t.grad_fn is not None), None)
        # (no count of positions: a rerun writes again over what the step wrote, details.batch_written counts those)
        return {"op": grad_fn.name() if grad_fn is not None else None, "function": getattr(func, "__name__", str(func)),
                "module": where[0] if where else None, "source": user_frame(), "wrote_batch": path,
                "dtype": str(outs[0].dtype)}

    def _evidence(self, func: domain.Op, args: Sequence[object], kwargs: Mapping[str, object], out: object,
                  outs: list[Tensor]) -> JSONDict:
        where = self.recorder.stack[-1] if self.recorder.stack else None
        # (of the op's own outputs: a DTensor's local shard, in ``outs``, is a view made by to_local)
        grad_fn = next((t.grad_fn for _, t in iter_tensors(out, "") if t.grad_fn is not None), None)
        name = getattr(func, "__name__", str(func))
        op = grad_fn.name() if grad_fn is not None else None
        found: JSONDict = {"op": op, "function": name, "module": where[0] if where else None, "source": user_frame()}
        if inspect.isfunction(func) and op is not None and not domain.names_itself(op) \
                and not any(is_dtensor(t) for _, t in iter_tensors([args, kwargs], "")):  # (a rerun: collectives)
            inner = domain.inner_op(func, args, kwargs)
            if inner is not None:
                aten, inner_args, inner_kwargs, inner_out = inner
                found.update(op=domain.autograd_name(domain.op_name(aten)), inner_function=domain.op_name(aten))
                found.update(domain.op_evidence(aten, inner_args, inner_kwargs, inner_out, self.float64))
                return found
        found.update(domain.op_evidence(func, args, kwargs, out, self.float64))
        return found


class GraphWatch:
    """Hooks on every node of an autograd graph: the first one producing NaN/Inf from finite gradients.

    With ``nan_too`` also the first one whose output holds a NaN (:attr:`first_nan`: the node
    ``detect_anomaly(check_nan=True)`` raises at, found without raising: a lockstep replay's backward must complete
    on every rank), and whether any node's output was non-finite at all (:attr:`nonfinite_seen`: a NaN that a
    tensor hook wrote is made by no node, and is still this rank's own). A node that brings in other ranks'
    gradients (:func:`~.comms.is_communication_node`) is marked ``received``.

    :meth:`growing` also hooks the nodes of graphs built *during* backward (``checkpoint(...,
    use_reentrant=True)`` recomputes its forward, and builds its part of the graph, inside backward)."""

    def __init__(self, root: Tensor, nan_too: bool = False) -> None:
        self.found: Optional[JSONDict] = None
        self.nan_too = nan_too
        self.first_nan: Optional[JSONDict] = None
        self.nonfinite_seen = False  # (nan_too) some node's output was non-finite, made there or not
        self._handles: list[RemovableHandle] = []
        self._seen: set[Node] = set()
        self.add(root.grad_fn)

    def add(self, root: Optional[Node]) -> None:
        """Hook ``root`` and every node below it not hooked yet."""
        todo: list[Optional[Node]] = [root]
        while todo:
            node = todo.pop()
            if node is None or node in self._seen:
                continue
            self._seen.add(node)
            self._handles.append(node.register_hook(self._hook(node)))
            todo.extend(n for n, _ in node.next_functions)

    @contextmanager
    def growing(self, root: nn.Module) -> Iterator[None]:
        """Inside: the graph below every output of ``root``'s modules is hooked as the forward builds it (a
        reentrant checkpoint's forward runs again inside backward, where no mode of this thread reaches)."""
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            for _, t in iter_tensors(output, ""):
                if t.grad_fn is not None:
                    self.add(t.grad_fn)

        handles = [m.register_forward_hook(hook) for m in root.modules()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, node: Node) -> Callable[[Sequence[Optional[Tensor]], Sequence[Optional[Tensor]]], None]:
        def hook(grad_inputs: Sequence[Optional[Tensor]], grad_outputs: Sequence[Optional[Tensor]]) -> None:
            if self.found is None and not all_finite(floats_of(list(grad_inputs))) \
                    and all_finite(floats_of(list(grad_outputs))):
                bad = floats_of(list(grad_inputs))
                self.found = {"op": node.name(), "nan": any(bool(torch.isnan(t).any()) for t in bad),
                              "traceback": _forward_trace_of(node)}
                if is_communication_node(node):
                    self.found["received"] = node.name()
            if self.nan_too and not self.nonfinite_seen:
                self.nonfinite_seen = not all_finite(floats_of(list(grad_inputs)))
            if self.nan_too and self.first_nan is None:  # (anomaly mode checks each node's outputs alone)
                output = next((i for i, g in enumerate(grad_inputs) if _any_nan([g])), None)
                if output is not None:
                    self.first_nan = {"op": node.name(), "output": output,
                                      "traceback": _forward_trace_of(node)}
                    if is_communication_node(node):
                        self.first_nan["received"] = node.name()
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _forward_trace_of(node: Node) -> Optional[str]:
    """The user's line in the forward traceback that anomaly mode recorded on ``node``."""
    meta = node.metadata  # a dict (torch's Node declares it a method)
    return forward_trace(meta.get("traceback_") if isinstance(meta, dict) else None)


def _any_nan(grads: Iterable[object]) -> bool:
    return any(bool(torch.isnan(t.detach()).any()) for t in floats_of(list(grads)))


def forward_trace(tb: Union[None, str, Sequence[str]]) -> Optional[str]:
    if not tb:
        return None
    lines = [ln for ln in str(tb if isinstance(tb, str) else "".join(tb)).splitlines() if ln.strip()]
    user = [i for i, ln in enumerate(lines) if ln.strip().startswith('File "')
            and not _is_library(ln.strip()[6:].split('"', 1)[0])]
    if not user:
        return lines[-1].strip() if lines else None
    i = user[-1]
    return " ".join(ln.strip() for ln in lines[i:i + 2])
