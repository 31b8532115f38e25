"""Snapshot work off the training thread: one snapshot thread that seals snapshots and writes atomic files.

:func:`write_atomic` is how a snapshot file is written (``torch.save`` to a temporary name, ``fsync``, rename):
a reader finds the whole file or none, and a failed write removes its temporary file. :class:`SnapshotWriter`
runs, on one background thread and in the order they were submitted, each snapshot's seal (its digest,
:func:`~.verify.seal`: every store's, memory ones included), its file where it has one, and the deletion of
evicted snapshots' files; each is a :class:`Write` that the training thread can wait for (a read of that
snapshot, the end of fit) and that says why it failed.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from .verify import Seal

__all__ = ["Write", "SnapshotWriter", "write_atomic", "why_not_written"]


def write_atomic(obj: object, path: Path) -> int:
    """``torch.save(obj)`` to ``path``: a temporary file, fsynced, then renamed; on failure the temporary file is
    removed and the error raised (``path`` is never half written). Saved through a Python file object, so that a
    full disk raises the OS's own ``OSError`` (ENOSPC), not torch's ``basic_ios::clear: iostream error``. Returns
    the file's size."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
            size = fh.tell()
        os.replace(tmp, path)
        return size
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # not a file of ours (a folder in its way): leave it
            pass
        raise


def why_not_written(exc: BaseException) -> str:
    """Plain words for a failed write: the OS's own (``No space left on device``) for an ``OSError``, else the
    exception's type and text."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"


class Write:
    """One snapshot being sealed, and written to ``path`` where it has one, by a :class:`SnapshotWriter`."""

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path
        self.error: Optional[str] = None  # why it failed, once done: the OS's words, or "PicklingError: ..."
        self.disk_error = False  # it failed on the disk (an OSError: full, not writable, a file in the way)
        self.seal: Optional[Seal] = None  # its digest, once taken (before the file is written)
        self.size: Optional[int] = None  # the size of the file written
        self._done = threading.Event()

    def __getstate__(self) -> dict[str, object]:
        """A copy (``copy.deepcopy``, ``pickle``) is of the finished write: the snapshot thread finishes it first (its
        seal taken, its file written or its error known); the copy's event is new and set (no lock is pickled)."""
        self.wait()
        state = self.__dict__.copy()
        del state["_done"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._done = threading.Event()
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        """Wait until the file is written or the write failed; True if it had to wait."""
        if self._done.is_set():
            return False
        self._done.wait()
        return True


# a write: its record, what to save (built on the thread), what to run before and after, and what seals it
_Job = tuple["Write", Optional[Callable[[], object]], Optional[Callable[[], None]], Optional[Callable[[], None]],
             Optional[Callable[[], Seal]]]


class SnapshotWriter:
    """One background thread sealing snapshots and writing their files, in the order they were submitted.

    ``submit`` hands over ``before`` (e.g. wait for the device copies the rest reads), ``seal`` (the snapshot's
    digest, taken first), ``build`` (what to save to ``path``; none without a path) and ``after`` (called whatever
    happened), all called on the writer thread: they must read only memory the training thread leaves alone until
    the write is done. The thread and its queue start with the first write and end at :meth:`close` (a later write
    starts new ones); they are left out of a copy (``copy.deepcopy``, ``pickle``), which starts idle.
    """

    def __init__(self) -> None:
        self._queue: Optional["queue.Queue[Union[None, Path, _Job]]"] = None  # None in it: the end
        self._thread: Optional[threading.Thread] = None

    def __getstate__(self) -> dict[str, object]:
        """Nothing: the thread, its queue and its jobs are this fit's (each job's :class:`Write` finishes before it
        is copied itself)."""
        return {}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]  # (an idle writer, as new)

    @property
    def running(self) -> bool:
        """The writer thread is alive (between the first write and :meth:`close`)."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, path: Optional[Path], build: Optional[Callable[[], object]] = None,
               before: Optional[Callable[[], None]] = None, after: Optional[Callable[[], None]] = None,
               seal: Optional[Callable[[], Seal]] = None) -> Write:
        write = Write(path)
        self._put((write, build, before, after, seal))
        return write

    def remove(self, path: Path) -> None:
        """Delete ``path`` on the writer thread, after the writes submitted before (freeing a large file's blocks
        takes milliseconds that the step should not wait for)."""
        self._put(path)

    def _put(self, job: Union[Path, _Job]) -> None:
        if self._queue is None or self._thread is None or not self._thread.is_alive():
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._run, args=(self._queue,), name="nanguard-snapshot-writer",
                                            daemon=True)
            self._thread.start()
        self._queue.put(job)

    def _run(self, jobs: "queue.Queue[Union[None, Path, _Job]]") -> None:
        while True:
            job = jobs.get()
            if job is None:
                jobs.task_done()
                return
            if isinstance(job, Path):
                try:
                    job.unlink(missing_ok=True)
                except OSError:
                    pass
                jobs.task_done()
                continue
            write, build, before, after, seal = job
            try:
                if before is not None:
                    before()
                if seal is not None:
                    write.seal = seal()
                if write.path is not None and build is not None:
                    write.size = write_atomic(build(), write.path)
            except BaseException as exc:  # noqa: BLE001  (reported by the training thread; never half a file)
                write.error, write.disk_error = why_not_written(exc), isinstance(exc, OSError)
            finally:
                if after is not None:
                    after()
                write._done.set()
                jobs.task_done()

    def drain(self) -> None:
        """Wait until every write and deletion submitted so far is done."""
        if self.running and self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Finish the writes submitted so far, then end the thread."""
        if self._queue is not None and self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._thread = self._queue = None
