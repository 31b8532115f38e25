"""One walker for nested structures: batches, module outputs, state dicts and checkpoints.

Containers understood everywhere in the package: mappings, namedtuples, dataclass instances, lists and
tuples. Everything else is a leaf. :func:`iter_leaves` yields ``(path, leaf)`` pairs (paths read like
Python: ``batch['x']``, ``batch.features``, ``batch[0]``) and :func:`map_leaves` rebuilds the structure with
a function applied to every leaf, keeping container types (a dataclass is copied, never mutated).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol, Sequence, TypeGuard

from torch import Tensor

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["children", "keyed", "iter_leaves", "iter_tensors", "map_leaves", "map_tensors", "flatten", "unflatten",
           "slot"]


class _NamedTuple(Protocol):
    _fields: tuple[str, ...]


def _is_namedtuple(obj: object) -> TypeGuard[_NamedTuple]:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _is_dataclass(obj: object) -> TypeGuard["DataclassInstance"]:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _children(obj: object, path: str) -> Optional[list[tuple[object, str, object]]]:
    """``[(key, child path, child)]`` of a container, or None for a leaf."""
    if isinstance(obj, Mapping):
        return [(k, f"{path}[{k!r}]", v) for k, v in obj.items()]
    if _is_namedtuple(obj):
        return [(k, f"{path}.{k}", getattr(obj, k)) for k in obj._fields]
    if _is_dataclass(obj):
        return [(f.name, f"{path}.{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, (list, tuple)):
        return [(i, f"{path}[{i}]", v) for i, v in enumerate(obj)]
    return None


def children(obj: object) -> Optional[list[tuple[object, object]]]:
    """``[(key, child)]`` of a container (keys: mapping keys, field names or indices), or None for a leaf."""
    found = _children(obj, "")
    return None if found is None else [(key, child) for key, _, child in found]


def keyed(obj: object) -> bool:
    """Is ``obj`` a container whose children have names (a mapping or a dataclass)?"""
    return isinstance(obj, Mapping) or _is_dataclass(obj)


def iter_leaves(obj: object, path: str = "") -> Iterator[tuple[str, object]]:
    """Every leaf of ``obj`` with its path, depth first, in container order."""
    children = _children(obj, path)
    if children is None:
        yield path, obj
        return
    for _, child_path, child in children:
        yield from iter_leaves(child, child_path)


def iter_tensors(obj: object, path: str = "batch") -> Iterator[tuple[str, Tensor]]:
    """``(path, tensor)`` for every tensor in ``obj``."""
    return ((p, t) for p, t in iter_leaves(obj, path) if isinstance(t, Tensor))


def map_leaves(obj: Any, fn: Callable[[object], object]) -> Any:  # (any container, rebuilt by its own constructor)
    """``obj`` rebuilt with ``fn`` applied to every leaf (container types kept)."""
    children = _children(obj, "")
    if children is None:
        return fn(obj)
    values: dict[Any, object] = {key: map_leaves(child, fn) for key, _, child in children}
    if isinstance(obj, Mapping):
        try:
            return type(obj)(values)  # type: ignore[call-arg]  # dict, OrderedDict and their kin
        except TypeError:
            return dict(values)
    if _is_namedtuple(obj):
        return type(obj)(**values)
    if _is_dataclass(obj):
        out = copy.copy(obj)
        for name, value in values.items():
            object.__setattr__(out, name, value)  # frozen dataclasses too
        return out
    return type(obj)(values[i] for i in range(len(obj)))


def map_tensors(obj: object, fn: Callable[[Tensor], object]) -> Any:
    """``obj`` rebuilt with ``fn`` applied to every tensor; other leaves kept as they are."""
    return map_leaves(obj, lambda leaf: fn(leaf) if isinstance(leaf, Tensor) else leaf)


class _Slot:
    """Where the i-th tensor of a flattened structure goes back."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def flatten(obj: object) -> tuple[object, list[Tensor]]:
    """``(skeleton, tensors)``: the tensors of ``obj`` (detached, in order) and a skeleton holding deep copies
    of every other leaf, for :func:`unflatten`."""
    tensors: list[Tensor] = []

    def take(leaf: object) -> object:
        if isinstance(leaf, Tensor):
            tensors.append(leaf.detach())
            return _Slot(len(tensors) - 1)
        return copy.deepcopy(leaf)

    return map_leaves(obj, take), tensors


def slot(leaf: object) -> Optional[int]:
    """The index into :func:`flatten`'s tensors that a skeleton leaf stands for (None: not a tensor's place)."""
    return leaf.i if isinstance(leaf, _Slot) else None


def unflatten(skeleton: object, tensors: Sequence[Optional[Tensor]], clone: bool = False) -> Any:
    """The structure of :func:`flatten` with ``tensors`` (cloned if ``clone``) back in their places (``tensors``
    may hold None where ``skeleton`` has no slot: a part of a flattened state that was not loaded)."""

    def put(leaf: object) -> object:
        if isinstance(leaf, _Slot):
            t = tensors[leaf.i]
            return t.clone() if clone and t is not None else t
        return copy.deepcopy(leaf)

    return map_leaves(skeleton, put)
