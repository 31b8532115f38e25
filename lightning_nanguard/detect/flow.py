"""The gradient-flow window: the last ``logging.flow_window`` steps of every gradient tensor's norm, on the device.

The fused total norm (:func:`.kernels.total_norm_parts`) computes one norm per gradient tensor and stacks them before
it reduces them; :class:`FlowWindow` keeps that stack in a preallocated ring on the device (one row per optimizer
step, one small copy, no host read, no collective), and what the host already knows of the step beside it (its step
number, its loss and total gradient norm once its flags are read, the clip threshold, and whether it was skipped,
rolled back or was an incident). Under DDP the reduced gradients are the same on every rank, so is every rank's
ring; under sharding (FSDP2, tensor parallel) a row holds this rank's share of each tensor's ``sum |g|^p``
(:func:`.ranks.local_norm_powers`), and :meth:`FlowWindow.capture` completes them with one all-reduce, on an
incident only (every rank captures at the same point of it).

Nothing is read until an incident: :meth:`FlowWindow.capture` reads the ring once and returns a :class:`Flow`, the
window grouped by module (the tensors of each module, in model order), what the pictures and the culprit of a
divergence (:func:`fastest_growing`) are drawn from, stored compactly with the event (:meth:`Flow.to_dict`,
:meth:`Flow.from_dict`: plain JSON and base64, no torch needed to read it back).
"""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence, TypedDict

from ..core.jsonvalue import JSONDict

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

__all__ = ["FlowWindow", "FlowWindows", "Flow", "Growing", "fastest_growing", "module_of", "replay_outputs", "MARKS",
           "CULPRIT_GROWTH", "FLOW_VERSION"]

FLOW_VERSION = 1  # the stored window's format (Flow.to_dict)
# what became of a step in the window, one letter each (Flow.marks)
MARKS = {"h": "healthy", "s": "skipped", "r": "rolled back", "i": "incident", "o": "GradScaler overflow",
         "?": "not judged yet"}
# a module whose gradient norm grew this many times over the window (from its baseline to its newest level) can be
# the culprit of a divergence; below it no module stands out
CULPRIT_GROWTH = 4.0


def module_of(name: str) -> str:
    """The module a parameter belongs to (``net.3.weight`` -> ``net.3``; a parameter of the root module: ``(root)``),
    named as the user wrote the model (without ``torch.compile``'s ``_orig_mod``)."""
    parts = [p for p in name.split(".") if p != "_orig_mod"]
    return ".".join(parts[:-1]) or "(root)"


class FlowWindow:
    """The ring of per-tensor gradient norms of one optimizer's parameters (module docstring).

    Attributes:
        size: steps kept (``logging.flow_window``; 0: off, nothing is kept).
        names: the parameter name of each column (set with the first row, renewed when the set of gradients changes).
        powers: the rows hold ``sum |g|^p`` shares (sharded) instead of norms.
    """

    def __init__(self, size: int, norm_type: float = 2.0) -> None:
        self.size = int(size)
        self.norm_type = float(norm_type)
        self.names: list[str] = []
        self.powers = False
        self._ring: Optional[Tensor] = None  # (size, tensors) float32 on the device
        self._rows: list[Tensor] = []  # its rows (views)
        self._key: tuple = ()
        self._count = 0  # rows written since the layout was set
        self._steps: list[int] = [-1] * self.size
        self._loss = [math.nan] * self.size
        self._total = [math.nan] * self.size
        self._limit = [math.nan] * self.size
        self._marks = ["?"] * self.size
        self._slot: dict[int, int] = {}  # step -> its slot

    @property
    def enabled(self) -> bool:
        return self.size > 0

    @property
    def nbytes(self) -> int:
        """Device memory of the ring (``size x tensors x 4`` bytes)."""
        return 0 if self._ring is None else int(self._ring.numel() * self._ring.element_size())

    def __len__(self) -> int:
        return min(self._count, self.size)

    # ------------------------------------------------------------------------------------------ every step

    def record(self, step: int, params: Sequence[Tensor], with_grads: int, parts: Optional[Tensor],
               names: Callable[[Tensor], str], powers: bool = False) -> None:
        """A step's per-tensor norms ``parts`` (a 1-dim device tensor, one per parameter of ``params`` that has a
        gradient: ``with_grads`` of them) go into the ring: one copy, no read. ``names``: parameter -> name, called
        only when the layout changes. The step's host facts follow with :meth:`judged`."""
        if not self.size or parts is None:
            return
        key: tuple[int, ...] = (len(params), with_grads, id(params[0]) if params else 0,
                                id(params[-1]) if params else 0)
        if with_grads != len(params):  # some parameters got no gradient: which ones is part of the layout
            key = key + tuple(id(p) for p in params if p.grad is not None)
        if key != self._key or self._ring is None or self._ring.device != parts.device:
            self._new_layout(key, [p for p in params if p.grad is not None], parts, names, powers)
        slot = self._count % self.size
        self._rows[slot].copy_(parts)  # (the rows' views made once: one kernel, no indexing per step)
        old = self._steps[slot]
        if self._slot.get(old) == slot:
            del self._slot[old]
        self._steps[slot] = step
        self._loss[slot] = self._total[slot] = self._limit[slot] = math.nan
        self._marks[slot] = "?"
        self._slot[step] = slot
        self._count += 1

    def _new_layout(self, key: tuple, params: list[Tensor], parts: Tensor, names: Callable[[Tensor], str],
                    powers: bool) -> None:
        import torch

        self._key, self.powers, self._count = key, powers, 0
        self.names = [names(p) for p in params]
        self._ring = torch.full((self.size, int(parts.numel())), math.nan, dtype=torch.float32, device=parts.device)
        self._rows = list(self._ring.unbind(0))
        self._steps = [-1] * self.size
        self._marks = ["?"] * self.size
        self._slot = {}

    def judged(self, step: int, loss: Optional[float], total: float, limit: Optional[float], mark: str) -> None:
        """What the host read of ``step`` (its flags) and what the guard did with it (a :data:`MARKS` letter)."""
        slot = self._slot.get(step)
        if slot is None:
            return
        self._loss[slot] = math.nan if loss is None else float(loss)
        self._total[slot] = float(total)
        self._limit[slot] = math.nan if limit is None else float(limit)
        self._marks[slot] = mark

    def mark(self, step: int, mark: str) -> None:
        """Change what became of ``step`` (its incident skipped it)."""
        slot = self._slot.get(step)
        if slot is not None:
            self._marks[slot] = mark

    def rolled_back(self, after: int, upto: int) -> None:
        """A rollback undid the updates of the steps in ``(after, upto]``."""
        for step, slot in self._slot.items():
            if after < step <= upto and self._marks[slot] in "h?o":
                self._marks[slot] = "r"

    # ------------------------------------------------------------------------------------------ an incident

    def capture(self, reduce: Optional[Callable[[Tensor], Tensor]] = None) -> Optional["Flow"]:
        """The window as it is now, grouped by module (one host read; with ``reduce``, the sharded shares are first
        summed over ranks: a collective, every rank at the same point). None when nothing was kept."""
        n = len(self)
        if not n or self._ring is None:
            return None
        import torch

        start = (self._count - n) % self.size
        order = [(start + i) % self.size for i in range(n)]
        rows = self._ring[torch.tensor(order, device=self._ring.device)]
        if self.powers and reduce is not None:
            rows = reduce(rows)
        p = self.norm_type
        # the norms' p-th powers, summed per module (the inf-norm: the max), then back to norms
        modules: list[str] = []
        index: list[int] = []
        for name in self.names:
            m = module_of(name)
            if m not in modules:
                modules.append(m)
            index.append(modules.index(m))
        idx = torch.tensor(index, device=rows.device)
        values = rows.double().t()  # tensors x steps
        if math.isinf(p):
            grouped = torch.full((len(modules), n), -math.inf, dtype=torch.float64, device=rows.device)
            grouped = grouped.index_reduce(0, idx, values.abs(), "amax")
        else:
            powers = values if self.powers else values.abs().pow(p)
            grouped = torch.zeros((len(modules), n), dtype=torch.float64, device=rows.device).index_add(0, idx, powers)
            grouped = grouped.clamp_min(0).pow(1.0 / p)
        norms = [[float(v) for v in row] for row in grouped.cpu().tolist()]
        return Flow(modules=modules, steps=[self._steps[s] for s in order], norms=norms,
                    loss=[self._loss[s] for s in order], grad_norm=[self._total[s] for s in order],
                    threshold=[self._limit[s] for s in order], marks="".join(self._marks[s] for s in order),
                    norm_type=p)


class FlowWindows:
    """One :class:`FlowWindow` per optimizer (``logging.flow_window`` steps each; 0: none), and the names of the
    module's parameters they label their columns with."""

    def __init__(self, size: int, norm_type: float = 2.0) -> None:
        self.size = int(size)
        self.norm_type = float(norm_type)
        self._windows: dict[int, FlowWindow] = {}
        self._names: dict[int, str] = {}
        self.latest: Optional[FlowWindow] = None  # the window of the optimizer stepped last

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def start(self, module: nn.Module) -> None:
        """Fit start: the parameter names (a parameter outside the module is named by its position)."""
        self._names = {id(p): name for name, p in module.named_parameters()}
        self._windows, self.latest = {}, None

    def name(self, param: Tensor) -> str:
        return self._names.get(id(param), f"param{len(self._names)}")

    def window(self, optimizer: torch.optim.Optimizer) -> Optional[FlowWindow]:
        """The window of ``optimizer`` (None: off, or nothing recorded for it yet)."""
        return self._windows.get(id(optimizer)) if self.size else None

    def record(self, optimizer: torch.optim.Optimizer, step: int, params: Sequence[Tensor], with_grads: int,
               parts: Optional[Tensor], powers: bool = False) -> None:
        """A step's row (:meth:`FlowWindow.record`)."""
        if not self.size or parts is None:
            return
        window = self._windows.get(id(optimizer))
        if window is None:
            window = self._windows[id(optimizer)] = FlowWindow(self.size, self.norm_type)
        window.record(step, params, with_grads, parts, self.name, powers)
        self.latest = window

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._windows.values())


def replay_outputs(rows: Sequence[dict]) -> list[dict]:
    """A replay's module calls (frame rows) summed up per module, in call order: the largest finite |output|
    (``abs_max``) and the count of non-finite values (``nonfinite``); the LightningModule's own row is left out."""
    acts: dict[str, dict] = {}
    for row in rows:
        name = str(row.get("module", ""))
        if not name or name.startswith("<"):  # the LightningModule itself: the whole forward
            continue
        top = float(row.get("out_abs_max", math.nan))
        entry = acts.setdefault(name, {"module": name, "abs_max": top, "nonfinite": 0})
        entry["abs_max"] = max(entry["abs_max"], top) if math.isfinite(entry["abs_max"]) else top
        entry["nonfinite"] += int(row.get("out_nonfinite", 0))
    return list(acts.values())


def _pack(values: Sequence[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def _unpack(text: str, n: int) -> list[float]:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) != 4 * n:
        raise ValueError(f"expected {n} float32 values, got {len(raw)} bytes")
    return list(struct.unpack(f"<{n}f", raw))


@dataclass
class Flow:
    """A captured window: per module (model order) and step (oldest first) the gradient norm, with the steps' loss,
    total gradient norm, clip threshold (NaN: none) and :data:`MARKS`; ``incident_step`` and ``culprit`` once an event
    owns it; ``activations``: a replay's largest |output| per module call (``module``, ``abs_max``, ``nonfinite``)."""

    modules: list[str]
    steps: list[int]
    norms: list[list[float]]  # modules x steps
    loss: list[float]
    grad_norm: list[float]
    threshold: list[float]
    marks: str
    norm_type: float = 2.0
    incident_step: Optional[int] = None
    culprit: Optional[str] = None
    activations: list[dict] = field(default_factory=list)

    def to_dict(self) -> JSONDict:
        """Compact JSON: the float arrays as base64 float32 (NaN and Inf survive), one letter per step's mark."""
        flat = [v for row in self.norms for v in row]
        out: JSONDict = {
            "version": FLOW_VERSION, "modules": list(self.modules), "first_step": self.steps[0] if self.steps else 0,
            "n_steps": len(self.steps), "steps": _steps_text(self.steps), "norms": _pack(flat),
            "loss": _pack(self.loss),
            "grad_norm": _pack(self.grad_norm), "threshold": _pack(self.threshold), "marks": self.marks,
            "norm_type": "inf" if math.isinf(self.norm_type) else self.norm_type,
            "incident_step": self.incident_step, "culprit": self.culprit}
        if self.activations:
            out["activations"] = {"modules": [a["module"] for a in self.activations],
                                  "abs_max": _pack([float(a["abs_max"]) for a in self.activations]),
                                  "nonfinite": [int(a["nonfinite"]) for a in self.activations]}
        return out

    @classmethod
    def from_dict(cls, data: object) -> "Flow":
        """Read :meth:`to_dict` back; ``ValueError`` on anything else."""
        if not isinstance(data, dict) or data.get("version") != FLOW_VERSION:
            raise ValueError("not a stored gradient-flow window (or of another version)")
        try:
            modules = [str(m) for m in data["modules"]]
            steps = _steps_back(int(data["first_step"]), int(data["n_steps"]), str(data["steps"]))
            n = len(steps)
            flat = _unpack(data["norms"], n * len(modules))
            norms = [flat[i * n:(i + 1) * n] for i in range(len(modules))]
            acts: list[dict] = []
            stored = data.get("activations")
            if stored:
                names = [str(m) for m in stored["modules"]]
                for name, v, bad in zip(names, _unpack(stored["abs_max"], len(names)), stored["nonfinite"]):
                    acts.append({"module": name, "abs_max": v, "nonfinite": int(bad)})
            marks = str(data["marks"])
            if len(marks) != n:
                raise ValueError("one mark per step expected")
            return cls(modules=modules, steps=steps, norms=norms, loss=_unpack(data["loss"], n),
                       grad_norm=_unpack(data["grad_norm"], n), threshold=_unpack(data["threshold"], n), marks=marks,
                       norm_type=float(data.get("norm_type", 2.0)), incident_step=data.get("incident_step"),
                       culprit=data.get("culprit"), activations=acts)
        except (KeyError, TypeError, ValueError, struct.error) as err:
            raise ValueError(f"a malformed gradient-flow window: {err}") from None

    def for_event(self, step: int, culprit: Optional[str], outputs: Sequence[dict] = ()) -> "Flow":
        """This window as an event at ``step`` keeps it: the step marked as the incident, the event's culprit, and
        the replay's ``outputs`` per module (:func:`replay_outputs`)."""
        marks = list(self.marks)
        j = self.column(step)
        if j is not None:
            marks[j] = "i"
        acts = [dict(a) for a in outputs]
        return Flow(modules=list(self.modules), steps=list(self.steps), norms=[list(r) for r in self.norms],
                    loss=list(self.loss), grad_norm=list(self.grad_norm), threshold=list(self.threshold),
                    marks="".join(marks), norm_type=self.norm_type, incident_step=step, culprit=culprit,
                    activations=acts)

    def column(self, step: int) -> Optional[int]:
        """The column of ``step`` (None: not in the window)."""
        try:
            return self.steps.index(step)
        except ValueError:
            return None


def _steps_text(steps: Sequence[int]) -> str:
    """The steps as the gaps from one to the next ("" when every gap is 1, else comma-separated)."""
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    return "" if all(g == 1 for g in gaps) else ",".join(map(str, gaps))


def _steps_back(first: int, n: int, text: str) -> list[int]:
    gaps = [int(g) for g in text.split(",")] if text else [1] * max(n - 1, 0)
    if len(gaps) != max(n - 1, 0):
        raise ValueError("one gap between each two steps expected")
    steps = [first]
    for gap in gaps:
        steps.append(steps[-1] + gap)
    return steps[:n]


class Growing(TypedDict):
    """The module whose gradient norm grew the most over a window (:func:`fastest_growing`)."""

    module: str
    growth: float  # newest / baseline
    baseline: float
    newest: float
    runner_up: Optional[float]  # the next module's growth
    from_step: int
    to_step: int


def fastest_growing(flow: Flow, onset: Optional[int] = None) -> Optional[Growing]:
    """The module whose gradient norm grew the most over the window: its newest finite level (the largest of the last
    three finite steps) against its baseline (the median of its finite norms up to the ``onset`` step, or of the
    window's first half), when that is :data:`CULPRIT_GROWTH` times or more and the most of any module. Returns its
    ``module``, ``growth``, ``baseline``, ``newest`` and the ``runner_up``'s growth, or None."""
    cols = [j for j, s in enumerate(flow.steps) if all(math.isfinite(row[j]) for row in flow.norms)]
    if len(cols) < 4 or not flow.modules:
        return None
    base = [j for j in cols if onset is not None and flow.steps[j] <= onset]
    if len(base) < 2:
        base = cols[: len(cols) // 2]
    tail = cols[-3:]
    growth: list[Growth] = []
    for name, row in zip(flow.modules, flow.norms):
        baseline = _median([row[j] for j in base])
        newest = max(row[j] for j in tail)
        if baseline > 0 and newest > 0:
            growth.append((newest / baseline, name, baseline, newest))
    best = fastest(growth, CULPRIT_GROWTH)
    if best is None:
        return None
    return {"module": best[1], "growth": best[0], "baseline": best[2], "newest": best[3],
            "runner_up": growth[1][0] if len(growth) > 1 else None, "from_step": flow.steps[base[0]],
            "to_step": flow.steps[tail[-1]]}


Growth = tuple[float, str, float, float]  # (growth factor, module, before, after)


def fastest(growth: list[Growth], threshold: float) -> Optional[Growth]:
    """The module that grew most, if it grew ``threshold`` times or more (``growth`` is sorted, largest first)."""
    growth.sort(reverse=True)
    return growth[0] if growth and growth[0][0] >= threshold else None


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return 0.0 if not n else ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
