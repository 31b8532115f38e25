"""What a snapshot must be when it is read back: its seal (a SHA-256 digest of its tensors, taken when it was kept),
the file format a disk snapshot is written in, and the checks every read makes before a byte reaches the model.

- :func:`seal` digests a snapshot's flat tensors (:func:`~..tree.flatten` order): each tensor's layout, dtype and
  shape, then its bytes (a sparse tensor's indices and values). It runs off the training thread (the snapshot
  thread, :mod:`.writer`), on the host copy the step took. The seal stays in the run's memory, never in a file a
  writer of the log folder could rewrite beside the data; SHA-256 because such a writer can read the file: a
  checksum it could recompute (a sum, a CRC) would let it put other weights in with a matching one.
- :func:`packed` is what a disk snapshot file holds: the state itself in plain containers, tensors, numbers and
  strings (:func:`plain`: a user's own object, an ``get_extra_state`` of any class, is left in memory and named in
  its place), plus ``"nanguard": {"format", "step", "tensors"}``, the flat tensors the reader uses. So torch's
  restricted loader (``torch.load(weights_only=True)``) reads every file the guard writes, and refuses any other.
- :func:`unpack` and :func:`check` are the read side: the file holds this snapshot (its format and step), the
  tensors are those of the seal (count, layouts, dtypes, shapes), and their digest is the seal's. Anything else is
  :class:`Refused`, with a reason from :data:`REASONS`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from ..core.layouts import COMPRESSED, is_strided
from ..core.tree import slot

__all__ = ["Seal", "Refused", "REASONS", "FORMAT", "seal", "check", "packed", "unpack", "plain"]

FORMAT = 1  # the layout of a snapshot file (``"nanguard": {"format": 1, ...}``)

# why a snapshot is refused: the reason's key (the same on every rank: an event's details) and its words
REASONS: dict[str, str] = {
    "not_written": "its write failed",
    "missing": "its file is missing",
    "truncated": "its file is shorter than it was written",
    "unreadable": "its file cannot be read as a snapshot",
    "restricted": "torch's restricted loader (weights_only=True) refused its file: it holds more than tensors and "
                  "plain data, which the guard never writes",
    "swapped": "its file holds another snapshot",
    "digest": "its tensors differ from those it was written with (SHA-256)",
    "unsealed": "its digest could not be taken when it was kept",
    "other_rank": "another rank's share of it was refused",
}


class Refused(Exception):
    """A snapshot that must not be restored: ``reason`` (a key of :data:`REASONS`) and ``detail`` (what was
    found, for the warning). ``recorded``: the store's record of it, once it is refused (refused once only)."""

    def __init__(self, reason: str, detail: str = "", recorded: object = None) -> None:
        super().__init__(f"{REASONS[reason]}{': ' + detail if detail else ''}")
        self.reason, self.detail, self.recorded = reason, detail, recorded


@dataclass(frozen=True)
class Seal:
    """A snapshot's digest (hex SHA-256) and the signature of its tensors: ``(layout, dtype, shape)`` each."""

    digest: str
    signature: tuple[tuple[str, str, tuple[int, ...]], ...]
    nbytes: int  # the bytes digested


def _signature(t: Tensor) -> tuple[str, str, tuple[int, ...]]:
    return str(t.layout), str(t.dtype), tuple(t.shape)


def _parts(t: Tensor) -> list[Tensor]:
    """The strided tensors that hold ``t``'s data: itself, or a sparse tensor's indices and values as stored."""
    if is_strided(t):
        return [t]
    if t.layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in COMPRESSED:
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


def _bytes(t: Tensor) -> Any:  # bytes, or a numpy array over them (a buffer hashlib reads)
    """A buffer over ``t``'s bytes (a host tensor; contiguous: a copy only where it is not)."""
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def seal(tensors: Sequence[Tensor]) -> Seal:
    """The :class:`Seal` of ``tensors`` (host tensors). ``hashlib`` releases the GIL while it digests a buffer: on
    the snapshot thread, this costs the training thread nothing but a share of the cores."""
    h = hashlib.sha256()
    total = 0
    for t in tensors:
        h.update(repr(_signature(t)).encode())
        for part in _parts(t):
            h.update(repr((str(part.dtype), tuple(part.shape))).encode())
            data = _bytes(part)
            h.update(data)
            total += len(data) if isinstance(data, bytes) else data.nbytes
    return Seal(h.hexdigest(), tuple(_signature(t) for t in tensors), total)


def check(expected: Optional[Seal], tensors: Sequence[Tensor]) -> None:
    """Raise :class:`Refused` unless ``tensors`` are those ``expected`` sealed (None: it was never sealed)."""
    if expected is None:
        raise Refused("unsealed")
    if len(tensors) != len(expected.signature):
        raise Refused("swapped", f"{len(tensors)} tensors, {len(expected.signature)} were written")
    for i, (t, want) in enumerate(zip(tensors, expected.signature)):
        if _signature(t) != want:
            raise Refused("swapped", f"tensor {i} is {_signature(t)}, {want} was written")
    if seal(tensors).digest != expected.digest:
        raise Refused("digest")


# ------------------------------------------------------------------------------------------- the file format


_PLAIN_LEAVES = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def plain(skeleton: object, tensors: Sequence[Tensor]) -> object:
    """The state of ``skeleton`` (:func:`~..tree.flatten`'s) with ``tensors`` in their places, in what torch's
    restricted loader reads: mappings as dicts (an ``OrderedDict`` kept), lists, tuples (a namedtuple as a tuple,
    a dataclass as a dict of its fields), tensors and plain scalars; any other object (a user's extra state, a
    scheduler's callable) becomes a string naming it: a reader takes the structure from the run's memory, never
    from the file (:func:`unpack`). Reads ``skeleton`` without copying it (the snapshot thread may run this)."""
    i = slot(skeleton)
    if i is not None:
        return tensors[i]
    if isinstance(skeleton, Tensor) or isinstance(skeleton, _PLAIN_LEAVES):
        return skeleton
    if isinstance(skeleton, Mapping):
        kind = OrderedDict if isinstance(skeleton, OrderedDict) else dict
        return kind((k if isinstance(k, _PLAIN_LEAVES) else repr(k), plain(v, tensors)) for k, v in skeleton.items())
    if dataclasses.is_dataclass(skeleton) and not isinstance(skeleton, type):
        return {f.name: plain(getattr(skeleton, f.name), tensors) for f in dataclasses.fields(skeleton)}
    if isinstance(skeleton, list):
        return [plain(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(plain(v, tensors) for v in skeleton)
    return f"<kept in the run's memory: a {type(skeleton).__module__}.{type(skeleton).__qualname__}>"


def packed(skeleton: object, tensors: Sequence[Tensor], step: int) -> dict[str, object]:
    """What a disk snapshot file holds: the state of ``skeleton`` and ``tensors`` in plain form (:func:`plain`; each
    tensor stored once: ``torch.save`` keeps one copy of a storage however often it appears), and under
    ``"nanguard"`` the format, the step and the flat tensors. A mapping's keys stay at the top (a file reads like the
    state it holds)."""
    meta = {"format": FORMAT, "step": int(step), "tensors": list(tensors)}
    body = plain(skeleton, tensors)
    if isinstance(body, dict) and "nanguard" not in body:
        return {**body, "nanguard": meta}
    return {"state": body, "nanguard": meta}


def unpack(obj: object, step: int) -> list[Tensor]:
    """The flat tensors of a loaded snapshot file, once it is shown to be the file of the snapshot of ``step``
    (:class:`Refused` ``swapped`` or ``unreadable`` otherwise)."""
    meta = obj.get("nanguard") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise Refused("unreadable", "no nanguard snapshot header of this format")
    if meta.get("step") != step:
        raise Refused("swapped", f"it is the snapshot of step {meta.get('step')!r}, not of step {step}")
    tensors = meta.get("tensors")
    if not isinstance(tensors, list) or not all(isinstance(t, Tensor) for t in tensors):
        raise Refused("unreadable", "its tensor list is malformed")
    return tensors
