"""Issue 19 under real DDP (gloo, CPU), with 2 and 3 ranks: faults that do not come back, replicas that disagree,
and the rank and host that produced them.

One spawn per world size (tests/ddp_scripts/ddp_faults.py, several fits in the same processes, ~10-20 s): every
fault is on the last rank, whose host is ``node<rank>``. Plus the replica check's arithmetic in isolation: the
same decision on the device and on the host, the odd rank by majority or recomputed, the weights' checksum.
"""

from __future__ import annotations

import math
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_nanguard.detect.sync import EPS32, _f32, odd_ranks, replicas_disagree, weights_checksum

SCRIPT = Path(__file__).parent / "ddp_scripts" / "ddp_faults.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def world(request, tmp_path_factory):
    """``(world size, [each rank's fits])``: one spawn of ``world`` processes, launched as torchrun would."""
    size, out = request.param, tmp_path_factory.mktemp(f"ddp{request.param}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), WORLD_SIZE=str(size), NODE_RANK="0")
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(out)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              cwd=str(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(size)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]  # a hang (ranks waiting on each other) fails here
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return size, [torch.load(out / f"rank{r}.pt", weights_only=False)["fits"] for r in range(size)]


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def replicas_identical(fits: list[dict], name: str) -> bool:
    """Every rank's weights and optimizer state (moments, step counts) of fit ``name`` are bitwise rank 0's."""
    first = fits[0][name]
    for other in fits[1:]:
        if not same_state(first["state"], other[name]["state"]):
            return False
        for pid, state in first["optimizer"]["state"].items():
            if not same_state(state, other[name]["optimizer"]["state"][pid]):
                return False
    return True


def account(event: dict) -> tuple:
    return (event["step"], event["kind"], event["cause"], event["actions"], event["rank"], event["host"],
            event["device"], event["local_rank"], event["details"].get("ranks"))


def per_step(fit: dict) -> list[tuple[int, list, list, bool]]:
    """``(step, the guard's collectives, its host reads, took a snapshot)`` of every step but the first (which also
    holds fit setup)."""
    rows, calls, reads, snaps = [], 0, 0, 0
    for rec in fit["steps"]:
        rows.append((rec["step"], fit["calls"][calls:rec["calls"]], fit["reads"][reads:rec["reads"]],
                     rec["snapshots"] > snaps))
        calls, reads, snaps = rec["calls"], rec["reads"], rec["snapshots"]
    return rows[1:]


# ----------------------------------------------------------------------------------------- real DDP runs


@pytest.mark.slow  # one spawn per world size, ~10-20 s each
@pytest.mark.ddp
def test_a_healthy_ddp_run_is_untouched_for_one_all_reduce_and_one_host_read_per_step(world):
    """Zero events, bitwise the run without the guard, replicas identical. Per step the guard issues one all-reduce
    (9 numbers: the loss, 4 flags and the 4 replica fields) and one host read, the same with check.replicas on
    (``healthy``) as off (``unchecked``, before its fault at step 12); a snapshot adds the weights' checksum and
    the agreement that they and the optimizer states are finite: one all-reduce of 4 numbers and its read."""
    size, fits = world
    for r in range(size):
        healthy = fits[r]["healthy"]
        assert healthy["events"] == [] and healthy["counters"]["incidents"] == 0
        assert same_state(healthy["state"], fits[r]["plain"]["state"])  # transparent
        rows = per_step(healthy)
        assert len(rows) == 15 and 0 < sum(s for *_, s in rows) < len(rows)
        for step, calls, reads, snapshot in rows:
            assert calls == [("all_reduce", 9)] + [("all_reduce", 4)] * snapshot, (step, calls)
            assert reads.count("tolist") == 1 + snapshot, (step, reads)
        off = {step: (calls, reads) for step, calls, reads, snapshot in per_step(fits[r]["unchecked"])
               if step < 12 and not snapshot}
        on = {step: (calls, reads) for step, calls, reads, snapshot in rows if step < 12 and not snapshot}
        assert on == off and len(on) >= 8 and all(v == ([("all_reduce", 9)], ["tolist"]) for v in on.values())
    assert replicas_identical(fits, "healthy")


@pytest.mark.slow  # one spawn per world size, ~10-20 s each
@pytest.mark.ddp
def test_one_off_faults_on_one_rank_are_transient_and_name_that_rank_and_host(world):
    """On the last rank: a module output non-finite once (step 4), its copy of the reduced gradient NaN (step 8)
    and off by a finite amount (step 12). Each is cause transient, named by the rank and host that produced it
    (by its own evidence; by majority with 3 ranks, recomputed from the replayed local gradients with 2), skipped
    on every rank and nothing else; the replicas stay identical, bitwise the run with those steps dropped by
    hand. Every rank records the same account."""
    size, fits = world
    odd = size - 1
    events = fits[0]["faults"]["events"]
    assert [(e["step"], e["kind"], e["cause"], e["actions"]) for e in events] == [
        (4, "loss", "transient", ["skip_step"]), (8, "replica", "transient", ["skip_step"]),
        (12, "replica", "transient", ["skip_step"])]
    assert all((e["rank"], e["host"], e["device"], e["local_rank"], e["details"]["ranks"]) ==
               (odd, f"node{odd}", "cpu", odd, [odd]) for e in events)
    assert all(f"rank {odd} on host node{odd} (cpu)" in e["suggestion"] for e in events)
    assert not events[0]["details"]["replay"]["reproduced"]
    found_by = "majority" if size >= 3 else "recomputed"
    nan_copy, shifted = events[1]["details"]["replica"], events[2]["details"]["replica"]
    assert (nan_copy["odd_ranks"], nan_copy["found_by"], nan_copy["nonfinite_copies"]) == ([odd], found_by, 1)
    assert (shifted["odd_ranks"], shifted["found_by"], shifted["nonfinite_copies"]) == ([odd], found_by, 0)
    norms = shifted["grad_norms"]
    assert len(set(norms[:odd])) == 1 and norms[odd] != norms[0]  # the healthy copies' norms are bitwise equal
    assert shifted["signed_deviation"] > shifted["signed_limit"]
    for r in range(size):
        fit = fits[r]["faults"]
        assert [account(e) for e in fit["events"]] == [account(e) for e in events]
        assert {k: fit["counters"][k] for k in ("skipped_steps", "rollbacks", "lr_cuts", "clipped_steps")} == {
            "skipped_steps": 3, "rollbacks": 0, "lr_cuts": 0, "clipped_steps": 0}
        assert fit["lr_scale"] == 1.0 and fit["global_step"] == 16
        assert same_state(fit["state"], fits[r]["dropped"]["state"])
    assert replicas_identical(fits, "faults")


@pytest.mark.slow  # one spawn per world size, ~10-20 s each
@pytest.mark.ddp
def test_replicas_that_drift_apart_are_rolled_back_at_the_next_snapshot(world):
    """The finite shift of the last rank's gradient copy: with check.replicas false (``unchecked``) nothing is seen
    and the replicas end apart; with a check.replica_tolerance above the shift (``tolerant``), the step is taken
    and the next snapshot's weights checksum finds them apart: every rank rolls back to the newest snapshot (where
    they agreed), and the replicas end identical. The odd rank is named by majority with 3 ranks; with 2 nobody
    can tell."""
    size, fits = world
    odd = size - 1
    assert all(fits[r]["unchecked"]["events"] == [] for r in range(size))
    assert not replicas_identical(fits, "unchecked")
    events = fits[0]["tolerant"]["events"]
    assert [(e["step"], e["kind"], e["actions"], e["details"]["detected_at"]) for e in events] == [
        (12, "replica", ["rollback"], "snapshot")]
    replica = events[0]["details"]["replica"]
    assert events[0]["details"]["restored_step"] == replica["agreed_at_step"] == 8
    sums = replica["weights_checksums"]
    assert len(set(sums)) == 2 and sums[odd] != sums[0]
    if size >= 3:
        assert (events[0]["rank"], events[0]["host"], replica["odd_ranks"]) == (odd, f"node{odd}", [odd])
    else:
        assert replica["odd_ranks"] == [] and events[0]["details"]["ranks"] == []
        assert "some rank (two ranks: no majority tells which)" in events[0]["suggestion"]
    for r in range(size):
        assert [account(e) for e in fits[r]["tolerant"]["events"]] == [account(e) for e in events]
        assert fits[r]["tolerant"]["counters"]["rollbacks"] == 1
    assert replicas_identical(fits, "tolerant")


@pytest.mark.slow  # one spawn per world size, ~10-20 s each
@pytest.mark.ddp
def test_a_replica_disagreement_read_one_step_late_was_skipped_on_the_device(world):
    """check.sync lagged with a fused AdamW: the replica flag joins the device skip flag of every rank, so the
    shifted step is skipped everywhere before any host read; the event comes one step later, as every lagged
    decision, and names the last rank."""
    size, fits = world
    odd = size - 1
    for r in range(size):
        fit = fits[r]["lagged"]
        assert [(e["step"], e["kind"], e["cause"], e["actions"], e["rank"], e["host"]) for e in fit["events"]] == [
            (9, "replica", "transient", ["skip_step"], odd, f"node{odd}")]
        assert fit["counters"]["skipped_steps"] == 1 and fit["counters"]["rollbacks"] == 0
    assert replicas_identical(fits, "lagged")


@pytest.mark.slow  # one spawn per world size, ~10-20 s each
@pytest.mark.ddp
def test_repeated_transients_on_one_rank_stop_every_rank_naming_it(world):
    """recovery.transient_limit 3 within transient_window 100 steps, on_suspect_hardware stop: the third one-off
    fault of the last rank says its hardware is suspect, names its rank and host, and every rank stops there."""
    size, fits = world
    odd = size - 1
    for r in range(size):
        fit = fits[r]["suspect"]
        assert [(e["step"], e["cause"], e["actions"], e["rank"]) for e in fit["events"]] == [
            (3, "transient", ["skip_step"], odd), (6, "transient", ["skip_step"], odd),
            (9, "transient", ["skip_step", "stop"], odd)]
        suspect = fit["events"][-1]["details"]["suspect_hardware"]
        assert suspect == {"rank": odd, "host": f"node{odd}", "device": "cpu", "local_rank": odd, "faults": 3,
                           "steps": [3, 6, 9], "window": 100, "policy": "stop"}
        assert f"The hardware of rank {odd} on host node{odd} (cpu) is suspect" in fit["events"][-1]["suggestion"]
        assert fit["stopped"] and fit["global_step"] == 10
    assert replicas_identical(fits, "suspect")


# -------------------------------------------------------------------------------------- the arithmetic


def test_the_replica_decision_is_the_same_on_the_device_and_on_the_host():
    """replicas_disagree in float32 tensor ops (the device, lagged) and in floats rounded to float32 after every
    operation (the host) agrees on every input, right at the limits too; identical norms never disagree, one rank
    off by twice the limit always does."""
    rng = random.Random(0)
    for world in (2, 3, 4, 7, 64, 1024):
        signed_limit, sq_limit = max(1e-3, 8 * world * EPS32), max(1e-3, 4 * world * math.sqrt(EPS32))
        signs = torch.tensor([1.0 if r % 2 == 0 else -1.0 for r in range(world)])
        for trial in range(200):
            x = _f32(10 ** rng.uniform(-4, 4))
            norms = [x] * world
            if trial % 2:  # one rank off, around the limit
                odd = rng.randrange(world)
                norms[odd] = _f32(x * (1 + rng.choice([-1, 1]) * rng.uniform(0.3, 3) * signed_limit))
            t = torch.tensor(norms, dtype=torch.float32)
            own, signed, sq = t.sum(), (t * signs).sum(), (t * t).sum()
            bad = torch.tensor(0.0)
            device = bool(replicas_disagree(own, signed, sq, bad, world, signed_limit, sq_limit))
            host = replicas_disagree(float(own), float(signed), float(sq), 0.0, world, signed_limit, sq_limit, _f32)
            assert device == host, (world, norms)
            if trial % 2 == 0:
                assert not host, (world, x)
            elif abs(norms[odd] - x) > 2 * signed_limit * x:
                assert host, (world, norms[odd] / x)
        # some copies non-finite, others not: disagree; every copy non-finite: the gradients, not the replicas
        assert replicas_disagree(1.0, 1.0, 1.0, 1.0, world, signed_limit, sq_limit, _f32)
        assert not replicas_disagree(0.0, 0.0, 0.0, float(world), world, signed_limit, sq_limit, _f32)


def test_the_odd_rank_is_found_by_majority_or_by_the_recomputed_norm():
    nan = float("nan")
    assert odd_ranks([2.0, 2.0, 2.5], 1e-3) == ([2], "majority")
    assert odd_ranks([2.0, nan, 2.0, 2.0], 1e-3) == ([1], "majority")
    assert odd_ranks([1.0, 2.0, 3.0], 1e-3) == ([], "untold")  # no majority, nothing recomputed
    assert odd_ranks([2.0, 2.5], 1e-3, recomputed=2.0000001) == ([1], "recomputed")
    assert odd_ranks([2.0, nan], 1e-3, recomputed=2.0) == ([1], "recomputed")
    assert odd_ranks([2.0, 2.5], 1e-3, recomputed=2.25) == ([], "untold")  # halfway: neither copy is clearly wrong
    assert odd_ranks([2.0, 2.5], 1e-3) == ([], "untold")


def test_the_weights_checksum_is_exact_and_sees_a_flipped_bit():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    b.load_state_dict(a.state_dict())
    assert int(weights_checksum(a)) == int(weights_checksum(b))
    with torch.no_grad():  # the lowest mantissa bit of one weight
        bits = b.weight.view(torch.int32)
        bits[3, 7] ^= 1
    assert not torch.equal(a.weight, b.weight) and torch.allclose(a.weight, b.weight)
    assert int(weights_checksum(a)) != int(weights_checksum(b))
    half = torch.nn.Linear(8, 8).to(torch.bfloat16)
    assert weights_checksum(half).dtype == torch.int64
