"""The snapshot stores on one process: the background disk writer, the side-stream ordering of device copies, and
the plan that shards a replicated state across ranks (the sharded store itself runs on real DDP in
tests/test_sharded_snapshots.py)."""

from __future__ import annotations

import contextlib
import os
import random
import time
from typing import Any

import pytest
import torch
from torch import nn

from lightning_nanguard import NaNGuard
from lightning_nanguard.errors import SnapshotWriteWarning
from lightning_nanguard.store.device_copy import DeviceCopy
from lightning_nanguard.store.sharded import EVERY_RANK, ShardPlan
from lightning_nanguard.store.snapshots import MemoryStore
from lightning_nanguard.store.writer import write_atomic
from lightning_nanguard.testing import Fault, FaultInjector

from . import models

QUIET = {"events_file": False, "reports": False, "verbose": False, "loggers": False}


def _tensors(state: Any) -> list[torch.Tensor]:
    from lightning_nanguard.core.tree import flatten

    return flatten(state)[1]


def _same(a: Any, b: Any) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


class AfterRollback(models.SnapshotSpy):
    """After the guard: the training state each time it took a snapshot (``states``), and right after each
    rollback (``restored``: (restored step, state))."""

    def __init__(self, guard: Any) -> None:
        super().__init__(guard)
        self.rollbacks, self.restored = 0, []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        if self.guard.counters["rollbacks"] != self.rollbacks:
            self.rollbacks = self.guard.counters["rollbacks"]
            self.restored.append((self.guard.events[-1].details["restored_step"],
                                  models.training_state(trainer, pl_module)))


class UserObject:
    """A user object in the module's state (``get_extra_state``): kept in the run's memory, never pickled into a
    snapshot file (the file names it instead, so that torch's restricted loader reads the file)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __deepcopy__(self, memo: dict) -> "UserObject":  # (a snapshot keeps a copy of it in memory)
        return UserObject(self.step)

    def __reduce__(self) -> tuple:
        raise AssertionError("a snapshot file never pickles a user's object")


def slow_disk(monkeypatch: Any, delays: dict[int, float]) -> None:
    """The snapshot of step ``s`` takes ``delays[s]`` seconds to reach the disk (its temporary file's fsync, on the
    snapshot thread: a slow or busy disk)."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        for step, delay in delays.items():
            if name.endswith(f"snapshot-step{step}.pt.tmp"):
                time.sleep(delay)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)  # (the OS, not torch: the writer thread calls os.fsync)


class ExtraState(models.Regression):
    """An AdamW regression whose module state carries ``extra(step)`` (``get_extra_state``)."""

    def __init__(self, extra: Any) -> None:
        super().__init__(optimizer="adamw", lr=0.01)
        self.extra = extra

    def get_extra_state(self) -> Any:
        return self.extra(self.trainer.global_step)

    def set_extra_state(self, state: Any) -> None:
        pass


def _disk_guard(tmp_path: Any, **recovery: Any) -> NaNGuard:
    # the ring alone (no stall anchors): these tests count its snapshots and files
    return NaNGuard(recovery={"snapshot": "disk", "snapshot_dir": str(tmp_path / "snaps"), "stall_anchors": False,
                              **recovery}, logging=QUIET)


# ------------------------------------------------------------------------------------------ the disk writer


def test_a_rollback_waits_for_the_disk_write_in_flight_and_restores_bitwise(tmp_path, fit_steps, monkeypatch):
    """The snapshot of step 4 takes 0.5 s to write; the step after it poisons a weight and the guard rolls back
    at once: the rollback waits for that write, then restores its state bitwise."""
    guard = _disk_guard(tmp_path, snapshot_every=2)
    spy = AfterRollback(guard)
    slow_disk(monkeypatch, {4: 0.5})
    model = ExtraState(UserObject)
    fit_steps(model, [FaultInjector(Fault("parameter", steps=[4])), guard, spy], steps=8)
    assert guard.counters["rollbacks"] == 1
    (restored, state), = spy.restored
    assert restored == 4 and _same(state["module"], spy.states[4]["module"])  # weights, bitwise
    assert _same(state["optimizers"], spy.states[4]["optimizers"])  # AdamW moments and step counts
    assert guard.snapshots.waits >= 1  # the write was still in flight when the rollback came: the step went on
    assert not list((tmp_path / "snaps").glob("*.tmp"))


def test_a_failed_disk_write_is_reported_leaves_no_file_and_is_never_a_target(tmp_path, fit_steps):
    """The file of step 4 cannot be written (a folder in the way of its temporary name): that write fails, is
    reported (a SnapshotWriteWarning, ``snapshots.failures``), leaves no file, and the rollback goes to step 2, the
    newest snapshot on disk that verifies (step 4's host copy is a target of last resort only)."""
    guard = _disk_guard(tmp_path, snapshot_every=2, max_skips=3)
    spy = AfterRollback(guard)
    (tmp_path / "snaps" / "snapshot-step4.pt.tmp").mkdir(parents=True)
    model = ExtraState(lambda step: {"step": step})
    with pytest.warns(SnapshotWriteWarning, match="snapshot at step 4 not written"):
        fit_steps(model, [FaultInjector(Fault("loss", steps=[5, 6, 7, 8])), guard, spy], steps=10)
    assert [(f["step"], f["error"]) for f in guard.snapshots.failures] == [(4, "Is a directory")]
    (restored, state), = spy.restored
    assert restored == 2 and _same(state["module"], spy.states[2]["module"])  # not the failed snapshot of step 4
    files = sorted(p.name for p in (tmp_path / "snaps").iterdir())
    assert "snapshot-step4.pt" not in files and [f for f in files if f.endswith(".tmp")] == ["snapshot-step4.pt.tmp"]
    assert (tmp_path / "snaps" / "snapshot-step4.pt.tmp").is_dir()  # the obstacle, left alone


def test_the_end_of_fit_waits_for_the_last_disk_write(tmp_path, fit_steps, monkeypatch):
    """A fit that ends while its last snapshot is being written leaves it whole on disk (the end of fit waits for
    the writer, whose thread then ends); a single process keeps whole snapshots (no sharding)."""
    guard = _disk_guard(tmp_path, snapshot_every=3, keep_snapshots=2)
    spy = models.SnapshotSpy(guard)
    slow_disk(monkeypatch, {6: 0.3})
    fit_steps(ExtraState(UserObject), [guard, spy], steps=6)
    store = guard.snapshots
    assert [s.step for s in store.ring] == [3, 6] and not store.collective and store.failures == []
    assert not store.writer.running  # its thread ended with the fit
    for snap in store.ring:
        assert snap.write is None and snap.nbytes == snap.total_nbytes > 0
        on_disk = torch.load(tmp_path / "snaps" / f"snapshot-step{snap.step}.pt", weights_only=True)
        assert _same(on_disk["module"], spy.states[snap.step]["module"])
        assert _same(on_disk["optimizers"], spy.states[snap.step]["optimizers"])
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == ["snapshot-step3.pt", "snapshot-step6.pt"]


def test_every_disk_snapshot_is_fsynced_under_its_temporary_name(tmp_path, fit_steps, monkeypatch):
    """docs/recovery.md: recovery.snapshot: disk 'writes each snapshot with torch.save to a temporary file, fsyncs it
    and renames it' (the rename keeps the file: its inode). Every snapshot file on disk was fsynced, and at that
    moment no file had its final name yet (a power loss never leaves a named snapshot whose data is not on disk)."""
    snaps = tmp_path / "snaps"
    synced: list[tuple[int, list[str]]] = []  # (inode fsynced, snapshot files with a final name at that moment)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        ino = os.fstat(fd).st_ino
        synced.append((ino, [p.name for p in snaps.glob("*.pt") if p.stat().st_ino == ino]))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)  # (the writer thread calls os.fsync too)
    guard = _disk_guard(tmp_path, snapshot_every=3, keep_snapshots=2)
    fit_steps(models.Regression(), [guard], steps=6)
    assert guard.counters["snapshots"] == 3 and [s.step for s in guard.snapshots.ring] == [3, 6]
    files = sorted(snaps.glob("*.pt"))
    assert [p.name for p in files] == ["snapshot-step3.pt", "snapshot-step6.pt"]
    assert {p.stat().st_ino for p in files} <= {ino for ino, _ in synced}
    assert len(synced) >= 3 and all(named == [] for _, named in synced)


class FailsAt(ExtraState):
    """Raises in ``training_step`` at step ``fail``."""

    def __init__(self, extra: Any, fail: int) -> None:
        super().__init__(extra)
        self.fail = fail

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.fail:
            raise RuntimeError("the user's own error")
        return super().training_step(batch, batch_idx)


def test_an_exception_waits_for_the_disk_write_in_flight_and_propagates(tmp_path, fit_steps, monkeypatch):
    """The fit raises one step after a snapshot that takes 0.3 s to write: the user's error propagates unchanged,
    and the snapshot is on disk, whole, with the writer thread ended."""
    guard = _disk_guard(tmp_path, snapshot_every=2)
    spy = models.SnapshotSpy(guard)
    with pytest.raises(RuntimeError, match="the user's own error"):
        slow_disk(monkeypatch, {4: 0.3})
        fit_steps(FailsAt(UserObject, fail=5), [guard, spy], steps=8)
    assert not guard.snapshots.writer.running and guard.snapshots.newest.step == 4
    on_disk = torch.load(tmp_path / "snaps" / "snapshot-step4.pt", weights_only=True)
    assert _same(on_disk["module"], spy.states[4]["module"])
    assert _same(on_disk["optimizers"], spy.states[4]["optimizers"])
    assert not list((tmp_path / "snaps").glob("*.tmp"))


def test_write_atomic_never_leaves_half_a_file(tmp_path):
    path = tmp_path / "snapshot.pt"
    write_atomic({"w": torch.ones(3)}, path)
    with pytest.raises(Exception, match="(?i)pickle"):
        write_atomic({"w": torch.zeros(3), "f": lambda: 0}, path)  # fails while pickling
    assert torch.equal(torch.load(path, weights_only=False)["w"], torch.ones(3))  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot.pt"]  # no temporary file


# -------------------------------------------------------------------------- device copies on a side stream


class RecordingBackend:
    """Streams and events as names; copies run at once; every call is logged (the CPU stand-in for CUDA)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.events = 0

    def current(self) -> str:
        return "main"

    def side(self) -> str:
        return "side"

    def record(self, stream: str) -> str:
        self.events += 1
        event = f"e{self.events}"
        self.log.append(("record", stream, event))
        return event

    def wait(self, stream: str, event: str) -> None:
        self.log.append(("wait", stream, event))

    @contextlib.contextmanager
    def use(self, stream: str):
        self.log.append(("use", stream))
        yield
        self.log.append(("end", stream))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: str) -> None:
        dst.copy_(src)
        self.log.append(("copy", stream, tuple(src.shape)))

    def synchronize(self, event: str) -> None:
        self.log.append(("synchronize", event))


def test_device_copies_follow_the_step_and_the_next_update_waits_on_the_device():
    """The copies start after the work queued so far (the optimizer step), buffers first; the training stream
    waits for the buffers at once and, at the next optimizer step, for everything, both on the device, once; the
    host synchronizes only when it reads the copies."""
    backend = RecordingBackend()
    copier = DeviceCopy(backend)
    buf, weight = torch.randn(2), torch.randn(3, 4)
    host_buf, host_weight = torch.empty(2), torch.empty(3, 4)
    done = copier.start([(host_buf, buf)], [(host_weight, weight)])
    assert backend.log == [("record", "main", "e1"), ("wait", "side", "e1"), ("use", "side"),
                           ("copy", "side", (2,)), ("record", "side", "e2"), ("copy", "side", (3, 4)),
                           ("record", "side", "e3"), ("end", "side"), ("wait", "main", "e2")]
    assert done == "e3" and copier.in_flight
    backend.log.clear()
    for _ in range(2):  # a second call waits for nothing new
        copier.before_optimizer_step()
    assert backend.log == [("wait", "main", "e3")]  # a device-side wait only
    assert copier.in_flight  # the host has not waited
    copier.wait()
    assert backend.log[-1] == ("synchronize", "e3") and not copier.in_flight
    copier.wait()
    assert sum(entry[0] == "synchronize" for entry in backend.log) == 1
    assert torch.equal(host_buf, buf) and torch.equal(host_weight, weight)


def test_a_new_device_copy_supersedes_the_unwaited_one():
    """Two snapshots before any wait (copies on one stream run in order): the next optimizer step waits for the
    newest copy only, and a host read synchronizes once, on it; a copy without buffers makes nothing wait at once."""
    backend = RecordingBackend()
    copier = DeviceCopy(backend)
    copier.start([], [(torch.empty(4), torch.randn(4))])
    copier.start([], [(torch.empty(4), torch.randn(4))])
    assert not [e for e in backend.log if e[0] == "wait" and e[1] == "main"]
    backend.log.clear()
    copier.before_optimizer_step()
    assert backend.log == [("wait", "main", "e4")]
    copier.wait()
    assert backend.log[-1] == ("synchronize", "e4") and not copier.in_flight
    copier.before_optimizer_step()  # after the host waited there is nothing left to wait for
    assert backend.log[-1] == ("synchronize", "e4")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_memory_snapshot_never_synchronizes_the_host():
    """Under torch.cuda.set_sync_debug_mode("error"), steps that take memory snapshots (fused AdamW, a BatchNorm
    buffer) never synchronize: the copies go to pinned memory on a side stream; the training stream waits for the
    buffers' copies at once and the next optimizer step for the rest, on the device. Read back afterwards, each
    snapshot is bitwise the state it was taken of."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    store = MemoryStore(keep=2)
    buffers = [n for n, _ in model.named_buffers()]

    def state() -> dict:
        return {"module": model.state_dict(), "optimizers": [opt.state_dict()]}

    def step() -> None:
        loss = model(torch.randn(32, 64, device="cuda")).square().mean()
        loss.backward()
        store.before_optimizer_step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    for k in (-1, 0):  # the first ones allocate the pinned buffers; from here on, steady state (reused)
        store.take(k, state(), {}, buffers=buffers)
    store.flush()
    expected = {}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(1, 4):
            step()
            store.take(k, state(), {}, buffers=buffers)
            expected[k] = [t.clone() for t in _tensors(state())]  # device clones: no sync
        step()  # mutates everything the last snapshot copied: it must wait on the device
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [snap.step for snap in store.ring] == [2, 3]
    for snap in store.ring:
        assert all(torch.equal(a.cpu(), b) for a, b in zip(expected[snap.step], _tensors(store.load(snap))))


# --------------------------------------------------------------------------------- the plan of a sharded store


def test_the_shard_plan_gives_every_tensor_one_owner_balanced_by_bytes():
    rng = random.Random(0)
    for world in (2, 3, 4, 8):
        sizes = [rng.choice([4, 96, 1536, 4608, 65536, 0]) for _ in range(57)]
        buffers = {1, 5}
        plan = ShardPlan.balance(sizes, world, to_first=buffers, everywhere={7})
        assert plan == ShardPlan.balance(sizes, world, to_first=buffers, everywhere={7})  # the same on every rank
        assert plan.owners[7] == EVERY_RANK and all(plan.owners[i] == 0 for i in buffers)
        assert all(0 <= o < world for i, o in enumerate(plan.owners) if i != 7)
        owned = [plan.owned(r) for r in range(world)]
        assert all(7 in o for o in owned) and sorted(i for o in owned for i in o if i != 7) == [
            i for i in range(len(sizes)) if i != 7]  # every other tensor exactly once
        total = sum(s for i, s in enumerate(sizes) if i != 7)
        assert sum(plan.loads) == total
        assert max(plan.loads) - total / world <= max(sizes) and total / world - min(plan.loads) <= max(sizes)


def test_only_a_replicated_strategy_shards_its_snapshots():
    """DDP (every start method) holds the same state on every rank: sharded. FSDP, model parallelism and DeepSpeed
    (whose ZeRO stages subclass DDP but partition the optimizer state) keep what each rank holds."""
    from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    from lightning_nanguard.detect.placement import replicates as replicates_state

    class DeepSpeedStrategy(DDPStrategy):  # the name is what counts (no deepspeed install needed)
        pass

    assert replicates_state(DDPStrategy()) and replicates_state(DDPStrategy(start_method="spawn"))
    assert not replicates_state(FSDPStrategy()) and not replicates_state(DeepSpeedStrategy())
    assert not replicates_state(SingleDeviceStrategy(torch.device("cpu")))


# ------------------------------------------------------------------ anchors: snapshots kept beside the newest few


def _state(v: float) -> dict[str, Any]:
    return {"module": {"w": torch.full((3,), v)}, "optimizers": [], "schedulers": [], "scaler": None}


def test_a_pinned_snapshot_outlives_the_ring_until_it_is_unpinned_or_dropped():
    store = MemoryStore(keep=2)
    first = store.take(0, _state(0.0), {})
    store.pin("start", first)
    for step in (20, 40, 60):
        store.take(step, _state(float(step)), {})
    assert [s.step for s in store.ring] == [0, 40, 60]  # the newest 2, and the anchor beside them
    assert float(store.load(first)["module"]["w"][0]) == 0.0  # its buffers were not reused by a newer one
    store.pin("before_lr_rise", store.ring[1])
    store.take(80, _state(80.0), {})
    assert [s.step for s in store.ring] == [0, 40, 60, 80]
    store.pin("start", None)  # unpinned: the oldest ordinary snapshot goes at once
    assert [s.step for s in store.ring] == [40, 60, 80] and set(store.anchors) == {"before_lr_rise"}
    store.pin("newest", store.ring[-1])
    store.drop_newest()  # a dropped anchor leaves its role too
    assert [s.step for s in store.ring] == [40, 60] and set(store.anchors) == {"before_lr_rise"}
    assert store.newest_before(100) is store.ring[-1]


def test_a_stall_rolls_back_before_the_lr_rose_or_to_the_fit_start():
    from lightning_nanguard.config import NaNGuardConfig
    from lightning_nanguard.core.counters import Counters
    from lightning_nanguard.recover.recovery import Recovery

    cfg = NaNGuardConfig()
    recovery = Recovery(cfg.recovery, cfg.clip, Counters(), {})
    recovery.store = MemoryStore(keep=2)
    for step, lr in ((0, 0.1), (20, 0.1), (40, 0.1), (60, 0.1)):
        recovery.store.take(step, _state(float(step)), {"lr": lr})
        if step == 0:
            recovery.store.pin("start", recovery.store.ring[0])
    assert [s.step for s in recovery.store.ring] == [0, 40, 60]
    # always too high: the oldest at or before the onset (the fit's first snapshot), none after the onset
    assert recovery.stall_target(onset=30, lr=0.01) == 0
    assert MemoryStore(keep=2).newest is None
    store = recovery.store
    store.pin("start", None)
    assert recovery.stall_target(onset=30, lr=0.01) is None  # nothing kept from before the stall
    for step, lr in ((80, 3e-4), (100, 0.06), (120, 0.06)):
        store.take(step, _state(float(step)), {"lr": lr})
        if step == 100:
            store.pin("before_lr_rise", store.ring[-2])
    # a warm restart: the newest snapshot taken at an LR the probe found learns, before the rise
    assert [s.step for s in store.ring] == [80, 100, 120]
    assert recovery.stall_target(onset=90, lr=0.006) == 80
