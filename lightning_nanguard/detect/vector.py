"""The step's evidence vector: named fields, how each agrees across ranks, one builder and one reader.

The guard reads one small float32 vector per optimizer step (:mod:`.evidence` builds it on the device, one
all-reduce under DDP agrees on it, :mod:`.ranks`). Its fields are declared once, in :data:`SCHEMA`, each
with the reduction that makes it identical on every rank (as torchmetrics' ``add_state(...,
dist_reduce_fx=...)``):

- ``norm``: the total gradient norm. Identical on every rank already (the gradients were all-reduced), so
  not reduced; under a sharding strategy each rank holds ``sum |g|^p`` of its shards, which are summed and
  the root taken (the maximum, for the inf-norm);
- ``sum``: summed over ranks (a 0/1 flag becomes the number of ranks that raised it);
- ``mean``: summed, then divided by the number of ranks;
- ``none``: identical on every rank by construction; not reduced.

A field with a ``kind`` is rank-local evidence of an event of that kind (a flag: non-zero means bad); the
kinds are listed in order of precedence. The vector's layout is derived from the declarations (the norm,
then the summed fields, flags first, then the unreduced ones), so that one all-reduce covers every summed
field: adding a field is one line here.
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["Field", "VectorSchema", "StepFlags", "SCHEMA"]

_REDUCTIONS = ("norm", "sum", "mean", "none")


@dataclass(frozen=True)
class Field:
    """One number of the step's evidence vector."""

    name: str
    reduce: str  # one of _REDUCTIONS (see the module docstring)
    missing: float = 0.0  # its value when the step has no such evidence
    kind: Optional[str] = None  # a flag: non-zero is rank-local evidence of an event of this kind
    help: str = ""

    def __post_init__(self) -> None:
        if self.reduce not in _REDUCTIONS:
            raise ValueError(f"field {self.name}: reduce must be one of {_REDUCTIONS}, got {self.reduce!r}")
        if self.kind is not None and self.reduce != "sum":
            raise ValueError(f"field {self.name}: a flag (kind={self.kind!r}) is summed over ranks")


class VectorSchema:
    """The layout of the evidence vector, derived from its :class:`Field` declarations.

    Attributes:
        fields: the fields in vector order.
        index: field name -> position.
        norm: the position of the ``norm`` field.
        summed: the slice of every ``sum`` and ``mean`` field (one all-reduce).
        flags: the slice of the flag fields (those with a ``kind``), in order of precedence.
        means: the positions of the ``mean`` fields.
    """

    def __init__(self, fields: Sequence[Field], fallback_kind: str) -> None:
        norms = [f for f in fields if f.reduce == "norm"]
        if len(norms) != 1:
            raise ValueError("the evidence vector has exactly one 'norm' field")
        flags = [f for f in fields if f.kind is not None]
        summed = [f for f in fields if f.reduce in ("sum", "mean") and f.kind is None]
        self.fields: tuple[Field, ...] = (*norms, *flags, *summed, *(f for f in fields if f.reduce == "none"))
        self.index = {f.name: i for i, f in enumerate(self.fields)}
        if len(self.index) != len(self.fields):
            raise ValueError("evidence vector fields must have unique names")
        self.norm = 0
        self.flags = slice(1, 1 + len(flags))
        self.summed = slice(1, 1 + len(flags) + len(summed))
        self.means = [self.index[f.name] for f in summed if f.reduce == "mean"]
        self.fallback_kind = fallback_kind  # the kind of an incident no flag explains (the gradients)
        self._names = [f.name for f in self.fields]
        self._flags = StepFlags.for_schema(self)

    def __len__(self) -> int:
        return len(self.fields)

    def constants(self, device: torch.device) -> dict[str, Tensor]:
        """Field name -> its ``missing`` value as a 0-dim tensor on ``device`` (made once, shared by every step)."""
        made: dict[str, Tensor] = {}
        by_value: dict[str, Tensor] = {}
        for f in self.fields:
            key = repr(f.missing)
            if key not in by_value:
                by_value[key] = torch.full((), f.missing, device=device)
            made[f.name] = by_value[key]
        return made

    def build(self, parts: Mapping[str, Optional[Tensor]], constants: Mapping[str, Tensor]) -> Tensor:
        """Stack ``parts`` (name -> 0-dim float32 tensor on the device, or None for missing evidence) into the
        vector, with ``constants`` (:meth:`constants`) for the missing ones. A name that is not a field is an
        error (one set operation: this runs every step)."""
        if not parts.keys() <= self.index.keys():
            raise KeyError(f"not fields of the evidence vector: {sorted(set(parts) - set(self.index))}")
        get = parts.get
        # (a call's result is not narrowed by its `is not None` test: get(name) is a Tensor where it is taken)
        return torch.stack([get(name) if get(name) is not None else constants[name]  # type: ignore[misc]
                            for name in self._names])

    def get(self, vec: Tensor, name: str) -> Tensor:
        """The field ``name`` of a vector on the device (a 0-dim view; nothing is read)."""
        return vec[self.index[name]]

    def read(self, values: Sequence[float]) -> "StepFlags":
        """The host values of a vector, by name (:class:`StepFlags`)."""
        return self._flags(*values)

    def local_flags(self, vec: Tensor) -> list[bool]:
        """The flag fields of a vector (reads it: incident path only)."""
        return [bool(v) for v in vec[self.flags].tolist()]


class StepFlags(tuple):
    """One optimizer step's evidence, as read on the host: every field of the vector is an attribute
    (``flags.grad_norm``, ``flags.loss``, ``flags.loss_bad``, ...). :meth:`for_schema` makes the class of a
    schema: a named tuple of its fields (attribute reads at C speed: the guard reads them every step)."""

    __slots__ = ()
    _schema: VectorSchema

    if TYPE_CHECKING:  # what for_schema's class adds, for a type checker: every field (a float) and the properties
        def __getattr__(self, name: str) -> float: ...

        @property
        def local_bad(self) -> bool: ...

        @property
        def grads_bad(self) -> bool: ...

        def incident_kind(self) -> str: ...

    @classmethod
    def for_schema(cls, schema: VectorSchema) -> type:
        # the fields are the schema's, known at run time only: a type checker sees the class through StepFlags' stubs
        base = namedtuple("StepFlagsFields", [f.name for f in schema.fields])  # type: ignore[misc]
        flag_kinds = tuple((schema.index[f.name], f.kind) for f in schema.fields[schema.flags] if f.kind is not None)
        lo, hi = schema.flags.start, schema.flags.stop
        norm = schema.norm
        own_bad = schema.index.get("own_grad_bad")
        fallback = schema.fallback_kind

        class Flags(base, cls):  # type: ignore[valid-type, misc]  # a base made at run time (above)
            __slots__ = ()
            _schema = schema

            @property
            def local_bad(self) -> bool:
                """Rank-local evidence (not the gradients): any flag field raised."""
                return any(self[lo:hi])

            @property
            def grads_bad(self) -> bool:
                """A non-finite gradient norm; under DDP (the replica check), on any rank's copy: the same on every
                rank, even where one rank's copy alone went bad."""
                return not math.isfinite(self[norm]) or own_bad is not None and self[own_bad] > 0

            def incident_kind(self) -> str:
                """The event kind, by precedence of the evidence."""
                return next((kind for i, kind in flag_kinds if self[i]), fallback)

        Flags.__name__ = Flags.__qualname__ = "StepFlags"
        return Flags

    @property
    def values(self) -> dict[str, float]:
        """Field name -> value."""
        return dict(zip(self._schema.index, self))


SCHEMA = VectorSchema([
    Field("grad_norm", "norm", help="total gradient norm (clip.norm_type); nan/inf when a gradient is non-finite, "
                                    "0 when not computed"),
    Field("loss", "mean", help="sum of the step's micro-batch losses, unscaled (16-mixed); the mean over ranks"),
    # flags, in order of precedence of the event kind they imply
    Field("param_bad", "sum", kind="parameter", help="a parameter or buffer was non-finite after the previous step"),
    Field("input_bad", "sum", kind="input",
          help="a floating tensor of the batch was non-finite (check.inputs: always)"),
    Field("activation_bad", "sum", kind="activation", help="a module output was non-finite (check.activations)"),
    Field("loss_bad", "sum", kind="loss", help="a micro-batch loss was non-finite (check.loss)"),
    # the replica check (DDP, check.replicas): each rank's own copy of the reduced gradient, which is identical on
    # every rank by construction. check.replica_compare: tolerance compares their norms (with their sum, the sum of
    # squares gives the spread of the ranks' norms); exact, a checksum of their bits (the grad_checksum_* fields)
    Field("own_grad_norm", "sum", help="DDP: this rank's norm of its copy of the reduced gradient where finite (else "
                                       "0), summed over ranks; 0 on one process"),
    Field("own_grad_norm_signed", "sum", help="DDP: own_grad_norm with the sign of the rank (+ even, - odd), summed: "
                                              "identical norms cancel to within rounding; one rank off by d leaves d"),
    Field("own_grad_norm_sq", "sum", help="DDP: the square of own_grad_norm, summed over ranks"),
    Field("own_grad_bad", "sum", help="DDP: 1 where this rank's copy of the reduced gradient is non-finite; summed, "
                                      "the number of such ranks"),
    *(Field(f"grad_checksum_{k}", "sum", help=f"DDP, replica_compare exact: this rank's checksum of its copy of the "
                                              f"reduced gradient's bits modulo the prime p{k}, times the rank's weight "
                                              "(weights sum to 0 over ranks); summed: 0 for all three when every copy "
                                              "is the same (detect/replicas.py: checksum_parts)")
      for k in range(3)),
    Field("grad_scale", "none", math.nan, help="the GradScaler's scale (16-mixed), nan without one"),
], fallback_kind="gradient")
