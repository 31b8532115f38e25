"""A sharded snapshot put back in place, without Lightning: N gloo processes; run by tests/test_sharded_snapshots.py.

    python sharded_restore.py OUT_DIR N

Each rank keeps its share of a snapshot of a small state (float32, int64, float64, bool, a 0-dim and an empty tensor)
in a :class:`~lightning_nanguard.store.sharded.ShardedStore`, for bucket sizes from 64 bytes (every tensor split
across buckets) to larger than the state, then loads it into zeroed live tensors (:meth:`load_into`), into a live
state missing some tensors (an optimizer's lazy state: those come fresh), and whole (:meth:`load`). Each rank writes
``OUT_DIR/restore-rank{r}.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_nanguard.store.sharded import ShardedStore
from lightning_nanguard.store.snapshots import MemoryStore

BUCKETS = (64, 1000, 10**6)  # 64: every tensor split across buckets, at bytes inside its elements


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(1000, generator=g), "b": torch.randint(0, 9, (77,), generator=g), "c": torch.tensor(3.0),
            "d": torch.rand(5, generator=g) > 0.5, "e": torch.randn(3, 333, generator=g).double(), "z": torch.empty(0)}


def main(out: Path, world: int) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    saved = state()
    found = {}
    for bucket in BUCKETS:
        store = ShardedStore(MemoryStore(2), world, rank, bucket_bytes=bucket)
        store.take(0, saved, {})
        live = {k: torch.zeros_like(v) for k, v in saved.items()}
        into = store.load_into(store.newest, live)
        partial = store.load_into(store.newest, {"a": live["a"]})  # the others do not exist yet
        whole = store.load(store.newest)
        found[bucket] = {
            "in_place": all(into[k] is live[k] for k in saved),
            "into": {k: v.clone() for k, v in into.items()},
            "partial_kept": partial["a"] is live["a"],
            "partial": partial,
            "whole": whole,
        }
    torch.save({"saved": saved, "found": found}, out / f"restore-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    directory, n = Path(sys.argv[1]), int(sys.argv[2])
    if "RANK" in os.environ:
        main(directory, n)
    else:  # the launcher: one process per rank
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, __file__, str(directory), str(n)],
                                  env=dict(os.environ, RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                 for r in range(n)]
        sys.exit(max(p.wait() for p in procs))
