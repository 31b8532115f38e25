"""What does trusting nothing it reads back cost (issue 34)? The seal at write, the check at read, and the choice of
digest, on the 60 MiB state of ``snapshot.py``'s DDP model (a 1024x1024 x 5 MLP with Adam: 5.25M parameters, the
weights and both moments after one step), single-threaded, median of ``--repeats``:

- the digests the seal could use, over that state on the host: SHA-256, BLAKE2b, CRC32 (``zlib``), and the
  replica check's device checksum kernel (``bits_checksum``: a sum of the bits, here on the CPU);
- a disk snapshot's read, before and after: ``torch.load(weights_only=False)`` of the file as the store wrote it
  before issue 34, against ``DiskStore.load`` now (``weights_only=True``, header, SHA-256 of every tensor), and the
  mapped read (``view``: ``mmap=True``) now;
- a memory snapshot's read: the clone of every tensor (before) against the clone and its check (now);
- a rollback end to end (``restore`` of the newest snapshot into a live module and AdamW), memory and disk, now.

    python benchmarks/verify.py [--repeats 7]

Writes ``benchmarks/results/verify.md`` and ``verify.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import common
import torch
from torch import nn

from lightning_nanguard.detect.replicas import bits_checksum
from lightning_nanguard.store.snapshots import DiskStore, MemoryStore, load_training_state
from lightning_nanguard.store.verify import _bytes, seal
from lightning_nanguard.core.tree import flatten

WIDTH, LAYERS = 1024, 5


class _Trainer:
    """What ``training_state`` and ``load_training_state`` read of a Trainer: its optimizers (no scheduler)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizers, self.lr_scheduler_configs, self.precision_plugin = [optimizer], [], None
        self.strategy = None


def _state() -> tuple[nn.Module, _Trainer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(64, WIDTH)).square().mean().backward()
    opt.step()
    return model, _Trainer(opt)


def _median(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(repeats: int) -> dict[str, Any]:
    model, trainer = _state()
    state = {"module": model.state_dict(), "optimizers": [o.state_dict() for o in trainer.optimizers],
             "schedulers": [], "scaler": None}
    _, tensors = flatten(state)
    mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    out: dict[str, Any] = {"state_mib": round(mib, 1), "tensors": len(tensors)}

    def digest(name: str) -> Callable[[], Any]:
        def go() -> Any:
            h = hashlib.new(name)
            for t in tensors:
                h.update(_bytes(t))
            return h.hexdigest()
        return go

    out["digest_ms"] = {
        "sha256 (the seal)": _median(lambda: seal(tensors), repeats),
        "blake2b": _median(digest("blake2b"), repeats),
        "crc32": _median(lambda: [zlib.crc32(_bytes(t)) for t in tensors], repeats),
        "bits_checksum (device kernel, on the CPU)": _median(lambda: int(bits_checksum(tensors)), repeats),
    }
    with tempfile.TemporaryDirectory() as tmp:
        disk = DiskStore(keep=2, directory=Path(tmp))
        memory = MemoryStore(keep=2)
        for store in (disk, memory):
            store.capture(trainer, model, 1, {})
            store.flush()
        snap = disk.newest
        assert snap is not None and snap.path is not None
        path = snap.path
        out["read_ms"] = {
            "disk, before: torch.load(weights_only=False)": _median(
                lambda: torch.load(path, map_location="cpu", weights_only=False), repeats),
            "disk, now: load (weights_only=True + check)": _median(lambda: disk.load(snap), repeats),
            "disk, now: view (mmap + check)": _median(lambda: disk.view(snap), repeats),
            "memory, before: clone": _median(lambda: [t.clone() for t in memory.newest.tensors], repeats),
            "memory, now: clone + check": _median(lambda: memory.load(memory.newest), repeats),
        }
        out["rollback_ms"] = {
            "memory, before: without the check": _median(
                lambda: load_training_state(trainer, model, _unchecked(memory)), repeats),
            "memory, now": _median(lambda: memory.restore(memory.newest, trainer, model), repeats),
            "disk, before: torch.load(weights_only=False), no check": _median(lambda: load_training_state(
                trainer, model, torch.load(path, map_location="cpu", weights_only=False)), repeats),
            "disk, now": _median(lambda: disk.restore(snap, trainer, model), repeats),
        }
        disk.close()
        memory.close()
    return out


def _unchecked(store: MemoryStore) -> Any:
    from lightning_nanguard.core.tree import unflatten

    snap = store.newest
    assert snap is not None
    return unflatten(snap.skeleton, snap.tensors, clone=True)


def render(r: dict[str, Any]) -> str:
    lines = [f"Issue 34's seal and checks on {r['state_mib']} MiB of state ({r['tensors']} tensors: a 1024x1024 x 5 "
             f"MLP with Adam), 1 torch thread, median of {r['repeats']}; {r['machine']}.", "",
             "| digest over the state (host) | ms | GB/s |", "|---|---:|---:|"]
    gb = r["state_mib"] * 2**20 / 1e9
    lines += [f"| {k} | {v:.1f} | {gb / (v / 1e3):.2f} |" for k, v in r["digest_ms"].items()]
    lines += ["", "| read of one snapshot | ms |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in r["read_ms"].items()]
    lines += ["", "| rollback (restore into the live module and Adam) | ms |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in r["rollback_ms"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    common.single_thread()
    result = run(args.repeats)
    result.update(repeats=args.repeats, machine=common.machine())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verify.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "verify.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
