"""Sharded snapshots on real DDP (gloo, CPU), 2 and 4 processes: each rank keeps 1/N of every snapshot.

One spawned run per world size (tests/ddp_scripts/ddp_snapshots.py, ~10-30 s) holds two tiny fits, memory and disk
snapshots. Rank 1 alone sees three NaN losses in a row; the third rolls back on every rank. The run's probe keeps
an unsharded copy of every snapshot (the single-process MemoryStore) to compare the rollback with.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "ddp_scripts" / "ddp_snapshots.py"
MODES = ("memory", "disk")


def _spawn(out: Path, world: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MASTER_PORT", None)  # Lightning picks a free port
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), str(world)], env=env, cwd=str(out),
                          capture_output=True, text=True, timeout=300)  # a hang (a collective mismatch) fails here
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"snapshots-rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def sharded_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"sharded{request.param}")
    return request.param, out, _spawn(out, request.param)


@pytest.mark.slow  # one spawned run per world size: ~10 s with 2 ranks, ~20 s with 4 on two cores
@pytest.mark.ddp
def test_a_sharded_rollback_restores_every_rank_bitwise_like_the_unsharded_store(sharded_run):
    world, _, ranks = sharded_run
    # disk: rank 1's disk refused its share of step 6 alone; it keeps that share in host memory, so every rank
    # rolls back to step 6 as with a working disk (before issue 24 every rank dropped it and went back to step 3)
    for mode, restored in (("memory", 6), ("disk", 6)):
        runs = [r[mode] for r in ranks]
        assert all(r["sharded"] and r["world_size"] == world for r in runs)
        assert all(r["events"] == runs[0]["events"] for r in runs)  # same decisions everywhere
        assert [e[0] for e in runs[0]["events"]] == [7, 8, 9] and "rollback" in runs[0]["events"][-1][2]
        for r in runs:
            (after,) = r["after_rollback"]
            # the restored weights, Adam moments and step counts are the unsharded snapshot's, bitwise
            assert after["restored_step"] == restored and after["same_as_unsharded"], (mode, r["rank"])
            # in place: the live weights and Adam's moments and step counts are the same tensors as before it
            assert after["in_place"] and after["places"] >= 18, (mode, r["rank"], after["places"])
        for key in ("weights", "optimizer"):  # and the same on every rank
            first = runs[0]["after_rollback"][0][key]
            assert all(len(r["after_rollback"][0][key]) == len(first) and all(
                torch.equal(a, b) for a, b in zip(r["after_rollback"][0][key], first)) for r in runs), (mode, key)
        assert all(all(torch.equal(a, b) for a, b in zip(r["final"], runs[0]["final"])) for r in runs)
        assert len(runs[0]["checkpoints"]) == 2  # steps 5 and 10: checked on every rank alike, then written
        # reading a snapshot after the fit rebuilds it on every rank, and the norms the diagnosis reads are the
        # unsharded snapshot's, exactly
        assert all(r["load_module_same"] and r["norms_set"] and all(r["norms_same"].values()) for r in runs), mode


@pytest.mark.slow
@pytest.mark.ddp
def test_each_rank_holds_a_1_over_n_share_of_every_snapshot(sharded_run):
    world, _, ranks = sharded_run
    for mode in MODES:
        runs = [r[mode] for r in ranks]
        largest = runs[0]["largest"]
        steps = [s for s, _, _ in runs[0]["held"]]
        assert all([s for s, _, _ in r["held"]] == steps for r in runs) and len(steps) == 3
        for k, step in enumerate(steps):
            held = [r["held"][k][1] for r in runs]
            total = runs[0]["held"][k][2]
            assert sum(held) == total  # every tensor has one owner
            if step > 0:  # the full state (the optimizer has state from step 1 on)
                assert all(abs(h - total / world) <= largest for h in held), (mode, step, held, total)
                assert max(held) < total / world + largest and max(held) <= 0.55 * total


@pytest.mark.slow
@pytest.mark.ddp
def test_sharded_collectives_are_the_same_on_every_rank_and_only_on_incidents(sharded_run):
    world, _, ranks = sharded_run
    for mode in MODES:
        runs = [r[mode] for r in ranks]
        assert all(r["calls"] == runs[0]["calls"] for r in runs), mode  # same collectives, same order: no deadlock
        rebuild = [c for c in runs[0]["calls"] if c[0] == "broadcast" and c[1] > 1000]
        assert len(rebuild) == world  # the one rollback: one broadcast from each owner (one bucket each)
        # the norms of the snapshots an incident has not seen (7 module tensors each), with every rank's verdict on
        # its shares of them (one number per snapshot and rank), are summed once
        norms = [n for name, n in runs[0]["calls"] if name == "all_reduce" and n not in (1, 4, 12)
                 and n % (7 + world) == 0]
        snapshots = runs[0]["counters"]["snapshots"]
        assert norms and sum(norms) // (7 + world) <= snapshots, (mode, runs[0]["calls"])
        # every other all_reduce: the step's evidence (12 numbers), the checkpoint and train-end weight checks (1),
        # before each snapshot the replicas' agreement (4 numbers: their weights' checksum, finite weights and states),
        # for disk snapshots, which snapshots every rank wrote (one flag per snapshot of the ring) on the incident path
        others = [n for name, n in runs[0]["calls"] if name == "all_reduce" and n not in norms and n not in (1, 12)]
        # the rollback: one agreement on which snapshot every rank's shares verified (3 candidates x the ranks)
        if 3 * world not in (1, 4, 12):
            assert others.count(3 * world) == 1, (mode, others)
            others.remove(3 * world)
        incidents = runs[0]["counters"]["incidents"]
        if mode == "memory":
            assert others == [4] * snapshots, (mode, others)
        else:
            assert all(n <= 4 for n in others) and others.count(4) >= snapshots, (mode, others)
            assert len(others) - snapshots <= 2 * incidents, (mode, others)


@pytest.mark.slow
@pytest.mark.ddp
def test_sharded_disk_snapshots_write_each_share_and_agree_on_a_failed_one(sharded_run):
    """Each rank writes only its share. Rank 1's disk refuses its share of step 6 (a folder in the way): rank 1
    alone warns once and keeps that share in host memory, so every rank keeps step 6 as a rollback target (the
    ranks' rings agree); no half file anywhere, the obstacle left alone."""
    world, out, ranks = sharded_run
    runs = [r["disk"] for r in ranks]
    assert all([s for s, _, _ in r["held"]] == [s for s, _, _ in runs[0]["held"]] for r in runs)  # same decisions
    for r in runs:
        folder = out / "disk" / "nanguard" / "snapshots" / f"rank{r['rank']}"
        steps = [s for s, _, _ in r["held"]]
        assert 6 in steps  # kept on every rank: rank 1 holds its share in memory
        on_disk = [s for s in steps if not (r["rank"] == 1 and s == 6)]
        assert all(f"snapshot-step{s}.pt" in r["files"] for s in on_disk)
        assert not [f for f in r["files"] if f.endswith(".tmp")]  # no half file anywhere
        for step, held, _ in r["held"]:  # each rank wrote only its share
            if step in on_disk:
                share = torch.load(folder / f"snapshot-step{step}.pt", weights_only=True)["nanguard"]["tensors"]
                assert sum(t.numel() * t.element_size() for t in share) == held
        if r["rank"] == 1:
            assert [(f["step"], f["error"], f["in_memory"]) for f in r["failures"]] == [(6, "Is a directory", True)]
            assert len(r["warned"]) == 1 and "snapshot at step 6 not written: Is a directory" in r["warned"][0]
            assert (folder / "snapshot-step6.pt").is_dir()  # the obstacle, left alone
        else:
            assert r["failures"] == [] and r["warned"] == [], r["rank"]


@pytest.mark.slow  # three gloo processes, ~5-15 s on two cores
@pytest.mark.ddp
def test_a_sharded_snapshot_loads_into_the_live_tensors_bucket_by_bucket(tmp_path):
    """``ShardedStore.load_into``: each tensor arrives in the live tensor at its place (the same object, bitwise the
    snapshot's value and dtype) for every bucket size, down to 64 bytes (each tensor split across buckets); a tensor
    with no live place (an optimizer's lazy state) comes fresh; the whole load is the same."""
    script = Path(__file__).parent / "ddp_scripts" / "sharded_restore.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), "3"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(3):
        got = torch.load(tmp_path / f"restore-rank{rank}.pt", weights_only=False)
        saved = got["saved"]
        assert len(got["found"]) == 3
        for bucket, found in got["found"].items():
            assert found["in_place"] and found["partial_kept"], (rank, bucket)
            for what in ("into", "partial", "whole"):
                assert set(found[what]) == set(saved), (rank, bucket, what)
                for key, value in saved.items():
                    loaded = found[what][key]
                    assert loaded.dtype == value.dtype and torch.equal(loaded, value), (rank, bucket, what, key)


# ------------------------------------------------------------------- buckets no larger than 16 MiB (issue 46)


def big_state() -> dict[str, torch.Tensor]:
    """Over 2 ranks: ``big`` (20 MB, larger than a bucket) to rank 0; ``a`` and ``b`` (12 MB each) to rank 1, so that
    ``b`` is larger than the room ``a`` leaves in rank 1's first bucket."""
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(5_000_000, generator=g), "a": torch.randn(3_000_000, generator=g),
            "b": torch.randn(3_000_000, generator=g)}


def test_a_tensor_larger_than_the_room_left_in_a_bucket_is_split_across_buckets():
    """docs/distributed.md: a rollback broadcasts one 16 MiB bucket at a time, a larger tensor split across buckets,
    so no broadcast grows to the largest tensor plus a bucket: every bucket but the last of an owner is exactly
    16 MiB, the last one no larger, and the pieces cover each tensor's bytes once, in order."""
    from lightning_nanguard.store.sharded import BUCKET_BYTES, ShardedStore
    from lightning_nanguard.store.snapshots import MemoryStore

    state = big_state()
    store = ShardedStore(MemoryStore(2), world_size=2, rank=0)  # taking a snapshot issues no collective
    snap = store.take(0, state, {})
    layout = snap.plan
    assert layout.plan.owners == (0, 1, 1)
    for owner, indices in ((0, [0]), (1, [1, 2])):
        buckets = store._buckets(layout, indices)
        sizes = [total for _, total in buckets]
        want = sum(state[k].numel() * 4 for k in ("big",) if owner == 0) + \
            sum(state[k].numel() * 4 for k in ("a", "b") if owner == 1)
        assert sizes == [BUCKET_BYTES] * (want // BUCKET_BYTES) + [want % BUCKET_BYTES], (owner, sizes)
        covered: dict[int, int] = {}
        for pieces, total in buckets:
            assert sum(end - start for _, start, end, _ in pieces) == total
            for i, start, end, off in pieces:
                assert start == covered.get(i, 0) and end > start and off + end - start <= total
                covered[i] = end
        assert covered == {i: layout.nbytes(i) for i in indices}


@pytest.mark.slow  # two gloo processes, a 44 MB state: ~5 s on two cores
@pytest.mark.ddp
def test_a_sharded_rollback_broadcasts_no_bucket_larger_than_16_mib(tmp_path):
    """docs/distributed.md, on real gloo ranks: a rollback of a state with a 20 MB tensor (rank 0's) and two of 12 MB
    (rank 1's) broadcasts one bucket of at most 16 MiB at a time (the split tensors' buckets full, the rest last),
    the same broadcasts on both ranks, and every tensor arrives in the live one, bitwise."""
    from lightning_nanguard.store.sharded import BUCKET_BYTES

    script = Path(__file__).parent / "ddp_scripts" / "sharded_buckets.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"buckets-rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["owners"] == (0, 1, 1) and ranks[0]["calls"] == ranks[1]["calls"]
    broadcasts = [n for name, n in ranks[0]["calls"] if name == "broadcast"]
    assert broadcasts == [BUCKET_BYTES, 20_000_000 - BUCKET_BYTES, BUCKET_BYTES, 24_000_000 - BUCKET_BYTES], broadcasts
    assert all(r["in_place"] and r["bitwise"] for r in ranks)
