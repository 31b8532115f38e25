"""Device-to-host snapshot copies that do not stall the step: a side stream, ordered by events.

On CUDA, :class:`DeviceCopy` queues a snapshot's copies into pinned host memory on a side stream:

1. the copies start after the work already queued on the current stream (the optimizer step that made the
   state): an event recorded there, waited for by the side stream, on the device;
2. the tensors that code other than the optimizer writes (the module's buffers: a forward's BatchNorm statistics,
   an EMA a hook updates after the step) are copied first, and the current stream waits for those copies at once,
   on the device (small: buffers). The parameters and the optimizer state, which only an optimizer step writes,
   are copied while the next forward and backward run: the next optimizer step waits for them, on the device
   (:meth:`DeviceCopy.before_optimizer_step`);
3. the host asks whether the copies are done only where it reads them (:meth:`DeviceCopy.wait`: a rollback, a
   load, the disk writer's thread), never on a healthy step.

The ordering is a small state machine over a :class:`Backend` (streams and events). :class:`CudaBackend` is the
real one; a test drives the same machine on the CPU with a backend that records what it is asked to do.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Generic, Iterable, Optional, Protocol, TypeVar

import torch
from torch import Tensor

__all__ = ["Backend", "CudaBackend", "DeviceCopy"]

_S = TypeVar("_S")  # a backend's stream
_E = TypeVar("_E")  # a backend's event


class Backend(Protocol[_S, _E]):
    """Streams and events: what :class:`DeviceCopy` orders its copies with."""

    def current(self) -> _S: ...  # the stream training runs on

    def side(self) -> _S: ...  # the copy stream (one per store)

    def record(self, stream: _S) -> _E: ...  # an event after the work queued on ``stream`` so far

    def wait(self, stream: _S, event: _E) -> None: ...  # ``stream`` waits for ``event``, on the device

    def use(self, stream: _S) -> AbstractContextManager[object]: ...  # queue the work inside on ``stream``

    def copy(self, dst: Tensor, src: Tensor, stream: _S) -> None: ...  # queue ``dst <- src`` (no host wait)

    def synchronize(self, event: _E) -> None: ...  # the host waits for ``event``


class CudaBackend:
    """CUDA streams and events (the side stream is made on first use, on the current device)."""

    def __init__(self) -> None:
        self._side: Optional[torch.cuda.Stream] = None

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def side(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream()
        return self._side

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        return stream.record_event()

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def use(self, stream: torch.cuda.Stream) -> AbstractContextManager[object]:
        return torch.cuda.stream(stream)

    def copy(self, dst: Tensor, src: Tensor, stream: torch.cuda.Stream) -> None:
        dst.copy_(src, non_blocking=True)
        src.record_stream(stream)  # the allocator keeps ``src``'s memory until the side stream has read it

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()


class DeviceCopy(Generic[_S, _E]):
    """The order of one store's device-to-host copies (module docstring).

    ``start`` queues a snapshot's copies and returns the event after them (a thread that reads the host copies
    waits for that one). Only the newest copy's events are kept: copies on the side stream run in the order they
    were queued, so waiting for the newest waits for all of them.
    """

    def __init__(self, backend: Backend[_S, _E]) -> None:
        self.backend = backend
        self._update: Optional[_E] = None  # the next optimizer step waits for this (everything is copied)
        self._done: Optional[_E] = None  # the host waits for this before it reads a copy

    @property
    def in_flight(self) -> bool:
        """Copies were queued that the host has not waited for."""
        return self._done is not None

    def start(self, first: Iterable[tuple[Tensor, Tensor]], rest: Iterable[tuple[Tensor, Tensor]]) -> _E:
        """Queue ``dst <- src`` for every pair after the work queued on the current stream, ``first`` (what code
        other than an optimizer step writes) before ``rest``; the current stream waits for ``first`` on the device,
        the host for nothing. Returns the event after the last copy."""
        b = self.backend
        side, current = b.side(), b.current()
        b.wait(side, b.record(current))
        first, rest = list(first), list(rest)
        with b.use(side):
            for dst, src in first:
                b.copy(dst, src, side)
            early = b.record(side) if first else None
            for dst, src in rest:
                b.copy(dst, src, side)
            done = b.record(side)
        if early is not None:
            b.wait(current, early)  # whatever runs next on the current stream may write the buffers
        self._update, self._done = done, done
        return done

    def before_optimizer_step(self) -> None:
        """The next optimizer step writes the parameters and optimizer state: the current stream waits for every
        copy (on the device)."""
        if self._update is not None:
            self.backend.wait(self.backend.current(), self._update)
            self._update = None

    def wait(self) -> None:
        """The host waits until every queued copy is in host memory (a read of a snapshot: incident path)."""
        if self._done is not None:
            self.backend.synchronize(self._done)
            self._done = self._update = None
