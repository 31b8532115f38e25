"""The fault injector's machinery: what a :class:`Fault` is, when and where it fires, and :class:`FaultInjectorBase`,
the callback without a Lightning base class (:mod:`lightning_nanguard.testing` is the public face, with the user's
manual; :mod:`lightning_nanguard.classic` and :mod:`lightning_nanguard.lightning` add each package's Callback)."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Protocol, Sequence, TypeVar, Union

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .core.dtensors import local
from .core.jsonvalue import JSONDict
from .core.layouts import raw_values
from .core.tree import iter_tensors, map_tensors

__all__ = ["Fault", "FaultInjectorBase", "Injection", "FAULT_KINDS", "FAULT_VALUES"]

FAULT_KINDS = ("input", "loss", "activation", "gradient", "parameter", "optimizer_state")
FAULT_VALUES = ("nan", "inf", "-inf")
_NUMBERS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_PER_MICRO_BATCH = ("input", "loss", "activation", "gradient")


class _Trainer(Protocol):
    """What the injector reads of a Trainer (either Lightning package's)."""

    @property
    def global_step(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def current_epoch(self) -> int: ...


def _as_tuple(value: Union[str, Sequence[str]], allowed: Sequence[str], name: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value)
    bad = [v for v in items if v not in allowed]
    if not items or bad:
        raise ValueError(f"Fault.{name}: got {value!r}; allowed: one of {allowed} or a non-empty tuple of them")
    return items


@dataclass(frozen=True)
class Fault:
    """One kind of fault (or a set to draw from) and when to inject it.

    Args:
        kind: one of ``FAULT_KINDS`` or a tuple of them (one is drawn each time the fault fires).
        steps: optimizer steps (``trainer.global_step``) at which it fires.
        rate: probability in [0, 1] that it fires at any other step (seeded, see the module docs).
        value: ``"nan"``, ``"inf"``, ``"-inf"`` or a tuple of them (one is drawn each time).
        target: module name (``activation``) or parameter name (``gradient``, ``parameter``,
            ``optimizer_state``); default: a seeded choice (activation: the first leaf module with parameters).
        micro_batch: which micro-batch of an accumulation window gets ``input``/``loss``/``activation``/
            ``gradient`` faults (0 = the first).
        state_key: the optimizer-state entry poisoned by ``optimizer_state``.
        ranks: global ranks that inject (default: all).

    Raises:
        ValueError: a kind or value outside ``FAULT_KINDS``/``FAULT_VALUES``, a negative step or micro-batch, or a
            rate outside [0, 1].
    """

    kind: Union[str, tuple[str, ...]]
    steps: Sequence[int] = ()
    rate: float = 0.0
    value: Union[str, tuple[str, ...]] = "nan"
    target: Optional[str] = None
    micro_batch: int = 0
    state_key: str = "exp_avg_sq"
    ranks: Optional[Sequence[int]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _as_tuple(self.kind, FAULT_KINDS, "kind"))
        object.__setattr__(self, "value", _as_tuple(self.value, FAULT_VALUES, "value"))
        if not all(isinstance(s, int) and s >= 0 for s in self.steps):
            raise ValueError(f"Fault.steps: got {self.steps!r}; allowed: optimizer steps (ints >= 0)")
        object.__setattr__(self, "steps", frozenset(self.steps))
        if not (isinstance(self.rate, (int, float)) and 0.0 <= self.rate <= 1.0):
            raise ValueError(f"Fault.rate: got {self.rate!r}; allowed: a probability in [0, 1]")
        if not isinstance(self.micro_batch, int) or self.micro_batch < 0:
            raise ValueError(f"Fault.micro_batch: got {self.micro_batch!r}; allowed: an int >= 0")
        if self.ranks is not None:
            object.__setattr__(self, "ranks", frozenset(self.ranks))


@dataclass
class Injection:
    """One record of ``FaultInjector.log``."""

    step: int
    epoch: int
    batch_idx: int
    micro_batch: int
    kind: str
    value: str
    where: Optional[str] = None  # module / parameter / batch field that was poisoned
    index: Optional[list[int]] = None  # the element
    applied: bool = True
    note: str = ""

    def to_dict(self) -> JSONDict:
        """The record as JSON (what a test or a report writes out).

        Returns:
            Its fields by name.
        """
        return asdict(self)


@dataclass
class _Planned:
    fault: Fault
    kind: str
    value: str
    rng: random.Random
    record: Injection
    done: bool = False


def _element(t: Tensor, rng: random.Random) -> tuple[int, ...]:
    flat, index = rng.randrange(max(t.numel(), 1)), []
    for size in reversed(t.shape):
        flat, rem = divmod(flat, size)
        index.append(rem)
    return tuple(reversed(index))


def _first_float(out: object) -> Optional[Tensor]:
    return next((t for _, t in iter_tensors(out) if t.is_floating_point() and t.numel()), None)


_Injector = TypeVar("_Injector", bound="FaultInjectorBase")


class FaultInjectorBase:
    """Poison inputs, the loss, activations, gradients, parameters or optimizer state, reproducibly.

    See :mod:`lightning_nanguard.testing` for where each kind is injected and why the injector goes before
    ``NaNGuard`` in the callback list. ``injector.log`` lists an :class:`Injection` per planned fault of
    the current fit (``applied=False`` with a ``note`` where it could not be applied).

    Args:
        faults: a :class:`Fault` or a list of them.
        seed: seed of the injector's own random draws (never the global RNG).

    Raises:
        ValueError: ``faults`` holds something that is no :class:`Fault`.
    """

    def __init__(self, faults: Union[Fault, Iterable[Fault]], *, seed: int = 0) -> None:
        super().__init__()
        self.faults: list[Fault] = [faults] if isinstance(faults, Fault) else list(faults)
        if not all(isinstance(f, Fault) for f in self.faults):
            raise ValueError("FaultInjector.faults: expected Fault objects")
        self.seed = int(seed)
        self.log: list[Injection] = []
        self._plan: list[_Planned] = []
        self._micro = -1
        self._stepped = False
        self._restore: list[tuple[Tensor, tuple[int, ...], Tensor]] = []  # this step's poisoned inputs
        self._pending: list[tuple[Tensor, tuple[int, ...], Tensor]] = []  # the previous step's, written back later
        self._handles: list[RemovableHandle] = []

    @classmethod
    def at_rate(cls: type[_Injector], rate: float, kinds: Sequence[str] = FAULT_KINDS,
                values: Sequence[str] = FAULT_VALUES, *, seed: int = 0, steps: Sequence[int] = (),
                target: Optional[str] = None, micro_batch: int = 0, state_key: str = "exp_avg_sq",
                ranks: Optional[Sequence[int]] = None) -> _Injector:
        """At each optimizer step, with probability ``rate``, one fault of a kind and value drawn at random.

        Args:
            rate: the probability in [0, 1] that a fault fires at a step.
            kinds: the kinds to draw from (``FAULT_KINDS``).
            values: the values to draw from (``FAULT_VALUES``).
            seed: seed of the injector's own draws.
            steps, target, micro_batch, state_key, ranks: as :class:`Fault` has them.

        Returns:
            An injector with that one :class:`Fault`.

        Raises:
            ValueError: a kind, value, rate or step outside what :class:`Fault` allows.
        """
        return cls(Fault(tuple(kinds), steps=steps, rate=rate, value=tuple(values), target=target,
                         micro_batch=micro_batch, state_key=state_key, ranks=ranks), seed=seed)

    # ----------------------------------------------------------------------------------------- planning

    def fires_at(self, step: int) -> list[tuple[str, str]]:
        """The faults planned for an optimizer step (a pure function of the seed and the step).

        Args:
            step: the optimizer step (``trainer.global_step``).

        Returns:
            ``(kind, value)`` of each fault that fires at ``step``, on any rank.
        """
        return [(p.kind, p.value) for p in self._draw(step, rank=None)]

    def _draw(self, step: int, rank: Optional[int]) -> list[_Planned]:
        planned = []
        for i, fault in enumerate(self.faults):
            if rank is not None and fault.ranks is not None and rank not in fault.ranks:
                continue
            rng = random.Random(f"nanguard-fault/{self.seed}/{i}/{step}")
            fires = rng.random() < fault.rate
            if step in fault.steps or fires:
                kind, value = rng.choice(fault.kind), rng.choice(fault.value)
                planned.append(_Planned(fault, kind, value, rng, Injection(step, 0, 0, 0, kind, value)))
        return planned

    def _due(self, kinds: Sequence[str]) -> list[_Planned]:
        return [p for p in self._plan if not p.done and p.kind in kinds
                and (p.kind not in _PER_MICRO_BATCH or p.fault.micro_batch == self._micro)]

    def _mark(self, p: _Planned, where: Optional[str], index: Optional[tuple[int, ...]], note: str = "") -> None:
        p.done = True
        p.record.where, p.record.index = where, list(index) if index is not None else None
        p.record.applied, p.record.note = index is not None, note
        p.record.micro_batch = self._micro

    # ------------------------------------------------------------------------------------------- hooks

    def on_fit_start(self, trainer: _Trainer, pl_module: nn.Module) -> None:
        self.log = []
        self._plan, self._micro, self._stepped = [], -1, False

    def on_train_batch_start(self, trainer: _Trainer, pl_module: nn.Module, batch: object, batch_idx: int) -> None:
        if self._micro < 0:  # first micro-batch of an optimizer step
            self._plan = self._draw(trainer.global_step, rank=trainer.global_rank)
            for p in self._plan:
                p.record.epoch, p.record.batch_idx = trainer.current_epoch, batch_idx
                self.log.append(p.record)
        self._micro += 1
        if self._pending:
            self._release_shared(batch)
        for p in self._due(("input",)):
            self._poison_input(p, batch)
        for p in self._due(("activation",)):
            self._hook_activation(p, pl_module)

    def on_before_backward(self, trainer: _Trainer, pl_module: nn.Module, loss: Tensor) -> None:
        for p in self._due(("loss",)):
            number = _NUMBERS[p.value]
            loss.data.fill_(number)  # the value, without bumping the version autograd checks
            if loss.requires_grad:
                loss.register_hook(lambda g, n=number: torch.full_like(g, n))
            self._mark(p, "loss", ())

    def on_after_backward(self, trainer: _Trainer, pl_module: nn.Module) -> None:
        for p in self._due(("gradient",)):
            named = [(n, q) for n, q in pl_module.named_parameters() if q.grad is not None]
            name, param = self._pick(p, named)
            if param is None or param.grad is None:  # (named holds only parameters with a gradient)
                self._mark(p, None, None, "no parameter with a gradient" + _named(p))
                continue
            self._mark(p, name, self._poison(param.grad, p))

    def on_before_optimizer_step(self, trainer: _Trainer, pl_module: nn.Module,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._stepped = True
        for p in self._due(("optimizer_state",)):
            names = {id(q): n for n, q in pl_module.named_parameters()}
            key = p.fault.state_key
            named = [(names.get(id(q), f"param{i}"), q) for i, q in
                     enumerate(q for g in optimizer.param_groups for q in g["params"])
                     if isinstance(optimizer.state.get(q, {}).get(key), Tensor)]
            name, param = self._pick(p, named)
            if param is None:
                self._mark(p, None, None, f"optimizer has no {key!r} state" + _named(p) + " yet")
                continue
            self._mark(p, f"{name}.{key}", self._poison(optimizer.state[param][key], p))

    def on_train_batch_end(self, trainer: _Trainer, pl_module: nn.Module, outputs: object, batch: object,
                           batch_idx: int) -> None:
        if not self._stepped:
            return  # a non-final micro-batch of gradient accumulation
        for p in self._due(("parameter",)):
            name, param = self._pick(p, list(pl_module.named_parameters()))
            if param is None:
                self._mark(p, None, None, "no floating parameter" + _named(p))
                continue
            self._mark(p, name, self._poison(param, p))
        self._end_window()

    def on_train_end(self, trainer: _Trainer, pl_module: nn.Module) -> None:
        self._end_window()  # (a lagged guard judges the last step after this hook: its inputs stay until teardown)

    def on_exception(self, trainer: _Trainer, pl_module: nn.Module, exception: BaseException) -> None:
        self._end_window(restore_all=True)

    def teardown(self, trainer: _Trainer, pl_module: nn.Module, stage: str) -> None:
        self._end_window(restore_all=True)

    # ------------------------------------------------------------------------------------------ poison

    @staticmethod
    def _write_back(entries: list[tuple[Tensor, tuple[int, ...], Tensor]]) -> None:
        with torch.no_grad():
            for tensor, index, original in reversed(entries):
                tensor.data[index] = original  # (no version bump either: the batch was never the step's to write)

    def _release_shared(self, batch: object) -> None:
        """Write back now the previous step's poisoned inputs whose storage this batch shares (a dataset handing
        out views of one tensor): the new batch must not see an old fault."""
        storages = {t.untyped_storage().data_ptr() for t in
                    (raw_values(t) for _, t in iter_tensors(batch)) if t is not None}
        shared = [e for e in self._pending if e[0].untyped_storage().data_ptr() in storages]
        if shared:
            self._write_back(shared)
            self._pending = [e for e in self._pending if all(e is not x for x in shared)]

    def _end_window(self, restore_all: bool = False) -> None:
        """The step is over: write back the previous step's poisoned inputs and keep this step's for one more step
        (a lagged guard replays the batch one step later); ``restore_all``: write back both (the fit is over)."""
        if restore_all:
            self._write_back(self._restore)  # (the newest first: an element poisoned twice gets its first value)
            self._write_back(self._pending)
            self._pending = []
        else:
            self._write_back(self._pending)
            self._pending = self._restore
        self._restore = []
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for p in self._plan:
            if not p.done:
                self._mark(p, None, None, "the hook was not reached in this step")
        self._plan, self._micro, self._stepped = [], -1, False

    @staticmethod
    def _pick(p: _Planned, named: Sequence[tuple[str, Tensor]]) -> tuple[Optional[str], Optional[Tensor]]:
        named = [(n, t) for n, t in named if t.is_floating_point() and local(t).numel()]  # a DTensor: its own shard
        if p.fault.target is not None:
            named = [(n, t) for n, t in named if n == p.fault.target]
        return p.rng.choice(named) if named else (None, None)

    @staticmethod
    def _poison(t: Tensor, p: _Planned) -> tuple[int, ...]:
        # a sparse gradient or parameter: one of its stored values; a DTensor: an element of this rank's shard (an
        # item assignment on the DTensor itself is a collective that the other ranks never enter)
        values = raw_values(t.detach())
        if values is None:
            values = local(t).detach()
        index = _element(values, p.rng)
        with torch.no_grad():
            values[index] = _NUMBERS[p.value]
        return index

    def _poison_input(self, p: _Planned, batch: object) -> None:
        # a sparse tensor: one of its stored values (a view of its storage, so the restore reaches it)
        named = [(path, v) for path, v in ((p, raw_values(t)) for p, t in iter_tensors(batch)) if v is not None]
        where, tensor = self._pick(p, named)
        if tensor is None:
            self._mark(p, None, None, "the batch has no floating tensor")
            return
        index = _element(tensor, p.rng)
        self._restore.append((tensor.detach(), index, tensor.detach()[index].clone()))
        with torch.no_grad():  # through ``.data``: the value, without bumping the tensor's version counter, so that
            tensor.data[index] = _NUMBERS[p.value]  # the guard sees bad data, not a write by the step (detect/writes)
        self._mark(p, where, index)

    def _hook_activation(self, p: _Planned, pl_module: nn.Module) -> None:
        modules = dict(pl_module.named_modules())
        name = p.fault.target
        if name is None:
            name = next((n for n, m in modules.items() if n and not list(m.children())
                         and any(True for _ in m.parameters(recurse=False))), None)
        if name not in modules:
            self._mark(p, name, None, f"no module named {name!r}")
            return
        record = p.record

        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> object:
            out = _first_float(output)
            if out is None:
                return None
            if not record.index:  # drawn at the first forward, reused by a replay of the same step
                record.index = list(_element(out, p.rng))
            poisoned = out.clone()
            poisoned[tuple(record.index)] = _NUMBERS[p.value]
            if isinstance(output, Tensor):
                return poisoned
            return map_tensors(output, lambda t: poisoned if t is out else t)

        self._handles.append(modules[name].register_forward_hook(hook))
        self._mark(p, name, ())  # the element is filled in by the hook at the first forward


def _named(p: _Planned) -> str:
    return f" for {p.fault.target!r}" if p.fault.target is not None else ""
