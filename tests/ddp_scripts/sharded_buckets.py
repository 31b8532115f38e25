"""A sharded rollback of a state with a tensor larger than a bucket, without Lightning: 2 gloo processes; run by
tests/test_sharded_snapshots.py.

    python sharded_buckets.py OUT_DIR

Each rank keeps its share of :func:`state` (rank 0 a 20 MB tensor, larger than a 16 MiB bucket; rank 1 two of 12 MB,
the second larger than the room the first leaves) in a :class:`~lightning_nanguard.store.sharded.ShardedStore` with
the default bucket, then loads it into zeroed live tensors (:meth:`load_into`, what a rollback does). Every
collective the store issues is recorded (``common.install_counters``: wrapped, the original runs). Each rank writes
``OUT_DIR/buckets-rank{r}.pt``: the broadcasts (name, numel of the uint8 bucket), whether every tensor arrived in
place and bitwise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import common
from lightning_nanguard.store.sharded import ShardedStore
from lightning_nanguard.store.snapshots import MemoryStore

common.install_counters()


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(5_000_000, generator=g), "a": torch.randn(3_000_000, generator=g),
            "b": torch.randn(3_000_000, generator=g)}


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    saved = state()
    store = ShardedStore(MemoryStore(2), 2, rank)
    store.take(0, saved, {})
    live = {k: torch.zeros_like(v) for k, v in saved.items()}
    common.COUNTING[0] = True
    into = store.load_into(store.newest, live)
    common.COUNTING[0] = False
    payload = {"calls": list(common.CALLS), "owners": store.newest.plan.plan.owners,
               "in_place": all(into[k] is live[k] for k in saved),
               "bitwise": all(torch.equal(live[k], saved[k]) for k in saved)}
    common.save_and_exit(payload, out / f"buckets-rank{rank}.pt")


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    if "RANK" in os.environ:
        main(directory)
    else:  # the launcher: one process per rank
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, __file__, str(directory)],
                                  env=dict(os.environ, RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                 for r in range(2)]
        sys.exit(max(p.wait() for p in procs))
