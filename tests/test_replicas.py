"""Issues 19 and 27 under real DDP (gloo, CPU), with 2 and 3 ranks: faults that do not come back, replicas that
disagree (exactly, by a checksum of their copies' bits), and the rank and host that produced them.

One spawn per world size (tests/ddp_scripts/ddp_faults.py, several fits in the same processes, ~10-20 s): every
fault is on the last rank, whose host is ``node<rank>``. Plus the replica check's arithmetic in isolation: the
same decision on the device and on the host, the odd rank by majority or recomputed, the checksums of weights and
gradients, the exact check's float32 sums.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from lightning_nanguard.detect.replicas import (EPS32, FLOAT32_EXACT, _f32, bits_checksum, checksum_parts,
                                                checksum_primes, checksum_weight, checksums_disagree, odd_checksums,
                                                odd_ranks, own_residues, replicas_disagree, weights_checksum)

from .ranks import launch, per_step

SCRIPT = Path(__file__).parent / "ddp_scripts" / "ddp_faults.py"


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def world(request, tmp_path_factory):
    """``(world size, [each rank's fits])``: one spawn of ``world`` processes, launched as torchrun would."""
    size, out = request.param, tmp_path_factory.mktemp(f"ddp{request.param}")
    return size, [saved["fits"] for saved in launch(SCRIPT, out, size)]


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


EVIDENCE = 12  # numbers in the step's all-reduce: the loss, 4 flags, 4 replica fields, 3 checksum fields


# ----------------------------------------------------------------------------------------- real DDP runs


@pytest.mark.slow  # one spawn per world size, ~10-20 s each
@pytest.mark.ddp
def test_a_healthy_ddp_run_is_untouched_for_one_all_reduce_and_one_host_read_per_step(world):
    """Zero events, bitwise the run without the guard, replicas identical. Per step the guard issues one all-reduce
    (12 numbers: the loss, 4 flags, the 4 replica fields and the 3 of the gradients' checksum) and one host read,
    the same with check.replicas on (``healthy``: the exact check, the default) as off (``unchecked``, before its
    fault at step 12); a snapshot adds the weights' checksum and the agreement that they and the optimizer states
    are finite: one all-reduce of 4 numbers and its read."""
    size, fits = world
    for r in range(size):
        healthy = fits[r]["healthy"]
        assert healthy["events"] == [] and healthy["counters"]["incidents"] == 0
        assert same_state(healthy["state"], fits[r]["plain"]["state"])  # transparent
        rows = per_step(healthy)
        assert len(rows) == 15 and 0 < sum(s for *_, s in rows) < len(rows)
        for step, calls, reads, snapshot in rows:
            assert calls == [("all_reduce", EVIDENCE)] + [("all_reduce", 4)] * snapshot, (step, calls)
            assert reads.count("tolist") == 1 + snapshot, (step, reads)
        off = {step: (calls, reads) for step, calls, reads, snapshot in per_step(fits[r]["unchecked"])
               if step < 12 and not snapshot}
        on = {step: (calls, reads) for step, calls, reads, snapshot in rows if step < 12 and not snapshot}
        assert on == off and len(on) >= 8 and all(v == ([("all_reduce", EVIDENCE)], ["tolist"]) for v in on.values())
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
    assert shifted["compared"] == "exact" and any(shifted["checksum_fields"])
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
def test_one_changed_element_of_one_rank_gradient_copy_is_caught_at_its_step_in_both_sync_modes(world):
    """The exact check (check.replica_compare: exact, the default): on the last rank, one element of its copy of the
    reduced gradient x1.5 + 1e-3 (steps 4 and 12) and its lowest mantissa bit flipped (step 8), which leave the
    ranks' gradient norms equal or within float32 rounding of each other. Each is a replica incident at its own
    step (read one step late with check.sync lagged, skipped on the device), naming the last rank (by majority with
    3 ranks, by the recomputed gradient's checksum with 2), skipped on every rank and nothing else: no rollback,
    the replicas bitwise identical, eager bitwise the run with those steps dropped by hand. Lagged, every other step
    still costs one all-reduce and at most one host read."""
    size, fits = world
    odd = size - 1
    found_by = "majority" if size >= 3 else "recomputed"
    for name in ("corrupt", "corrupt_lagged"):
        events = fits[0][name]["events"]
        assert [(e["step"], e["kind"], e["cause"], e["actions"], e["rank"], e["host"], e["details"]["ranks"])
                for e in events] == [(s, "replica", "transient", ["skip_step"], odd, f"node{odd}", [odd])
                                     for s in (4, 8, 12)], name
        for e in events:
            replica = e["details"]["replica"]
            assert (replica["compared"], replica["odd_ranks"], replica["found_by"]) == ("exact", [odd], found_by)
            residues = replica["checksum_residues"]
            assert len(set(map(tuple, residues[:odd]))) == 1 and residues[odd] != residues[0]
            norms = replica["grad_norms"]  # what the toleranced comparison had to go on
            assert abs(norms[odd] - norms[0]) <= 1e-6 * norms[0], (name, e["step"], norms)
        flipped = events[1]["details"]["replica"]
        assert all(abs(v) == abs(checksum_weight(odd, size)) for v in flipped["checksum_fields"])  # one bit: +-1
        for r in range(size):
            fit = fits[r][name]
            assert [account(e) for e in fit["events"]] == [account(e) for e in events]
            assert {k: fit["counters"][k] for k in ("skipped_steps", "rollbacks", "lr_cuts")} == {
                "skipped_steps": 3, "rollbacks": 0, "lr_cuts": 0}
            assert fit["global_step"] == 16 and fit["lr_scale"] == 1.0
        assert replicas_identical(fits, name)
    for r in range(size):
        assert same_state(fits[r]["corrupt"]["state"], fits[r]["dropped"]["state"])
        quiet = [(calls, reads) for step, calls, reads, snapshot in per_step(fits[r]["corrupt_lagged"])
                 if not snapshot and step not in (4, 5, 8, 9, 12, 13)]
        assert len(quiet) >= 6 and all(calls == [("all_reduce", EVIDENCE)] and reads in ([], ["tolist"])
                                       for calls, reads in quiet), quiet


@pytest.mark.slow  # one spawn per world size, ~10-20 s each
@pytest.mark.ddp
def test_replicas_that_drift_apart_are_rolled_back_at_the_next_snapshot(world):
    """What the exact check is for: with check.replicas false (``unchecked``) a finite shift of the last rank's copy
    is not seen and the replicas end apart; with check.replica_compare tolerance (``tolerant``), the x1.5 + 1e-3
    corruption of one element moves the norm by less than check.replica_tolerance, the step is taken, and the next
    snapshot's weights checksum finds them apart: every rank rolls back to the newest snapshot (where they agreed),
    and the replicas end identical. The odd rank is named by majority with 3 ranks; with 2 nobody can tell."""
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
    """check.sync lagged with a fused AdamW, check.replica_compare tolerance (the norms' test on the device; the
    exact test's is in the corrupt_lagged fit): the replica flag joins the device skip flag of every rank, so the
    shifted step is skipped everywhere before any host read; the event comes one step later, as every lagged
    decision, and names the last rank."""
    size, fits = world
    odd = size - 1
    for r in range(size):
        fit = fits[r]["lagged"]
        assert [(e["step"], e["kind"], e["cause"], e["actions"], e["rank"], e["host"]) for e in fit["events"]] == [
            (9, "replica", "transient", ["skip_step"], odd, f"node{odd}")]
        assert fit["counters"]["skipped_steps"] == 1 and fit["counters"]["rollbacks"] == 0
        assert fit["events"][0]["details"]["replica"]["compared"] == "tolerance"
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


@pytest.mark.slow  # one spawn per world size, ~10-20 s each
@pytest.mark.ddp
def test_a_transient_no_rank_can_claim_counts_against_no_rank_hardware(world):
    """The same gradient element poisoned on every rank's copy at steps 3 and 6: the copies agree (no replica
    event), no rank's replay reproduces it, so the cause is transient with no rank known (``details.ranks`` empty,
    rank 0's account). With recovery.transient_limit 2 and on_suspect_hardware stop, neither counts against rank
    0's hardware (nor any rank's): no suspect, no stop."""
    size, fits = world
    for r in range(size):
        fit = fits[r]["unknown"]
        assert [(e["step"], e["kind"], e["cause"], e["actions"], e["rank"], e["details"]["ranks"])
                for e in fit["events"]] == [(3, "gradient", "transient", ["skip_step"], 0, []),
                                            (6, "gradient", "transient", ["skip_step"], 0, [])]
        assert all("suspect_hardware" not in e["details"] for e in fit["events"])
        assert not fit["stopped"] and fit["global_step"] == 16
    assert replicas_identical(fits, "unknown")


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


def test_the_gradients_checksum_sees_one_flipped_bit_in_any_dtype():
    """bits_checksum (which weights_checksum is): any one flipped bit of any element changes it, in float32, float64
    (two int32 words: the int64 sum never wraps) and bfloat16; identical copies give identical sums."""
    torch.manual_seed(0)
    for dtype, words in ((torch.float32, torch.int32), (torch.float64, torch.int32), (torch.bfloat16, torch.int16)):
        grads = [torch.randn(5, 3).to(dtype), torch.randn(7).to(dtype), torch.randn(()).to(dtype)]
        base = int(bits_checksum(grads))
        assert base == int(bits_checksum([g.clone() for g in grads]))
        for t in range(len(grads)):
            width = 8 * torch.empty((), dtype=words).element_size()
            for bit in range(width):
                copy = [g.clone() for g in grads]
                view = copy[t].reshape(-1).view(words)
                view[0] ^= torch.tensor(1, dtype=words) << bit if bit < width - 1 else torch.iinfo(words).min
                assert int(bits_checksum(copy)) != base, (dtype, t, bit)
    assert bits_checksum([]) is None


def test_the_exact_replica_check_is_exact_in_float32_sums_and_names_the_odd_rank():
    """The checksum fields: each rank's weight (non-zero, summing to 0 over ranks) times its checksum modulo three
    primes, summed in float32 in any order. Every partial sum is an integer below 2^24 (exact); identical checksums
    sum to 0; one rank's copy with any one element changed (x1.5 + 1e-3, or one flipped bit) never does, decided
    alike on the device and on the host; each rank's residues come back from its own fields, and name the odd rank
    by majority (3+ ranks) or against the recomputed gradient's (2 ranks)."""
    rng = random.Random(0)
    torch.manual_seed(0)
    for world in (2, 3, 4, 5, 7, 64, 1023):
        weights = [checksum_weight(r, world) for r in range(world)]
        primes = checksum_primes(world)
        assert sum(weights) == 0 and all(weights) and len(set(primes)) == 3
        assert all(p % d for p in primes for d in range(2, math.isqrt(p) + 1))
        assert sum(map(abs, weights)) * (max(primes) - 1) < FLOAT32_EXACT
        assert math.prod(primes) > 2 ** 40  # every checksum difference (0 < |d| < 2^32) is caught
        p = torch.tensor(primes)
        for trial in range(20 if world < 100 else 2):
            grads = [torch.randn(6, 4) * 10 ** rng.uniform(-6, 2), torch.randn(3)]
            copies = [[g.clone() for g in grads] for _ in range(world)]
            odd = rng.randrange(world)
            if trial % 2:
                flat = copies[odd][0].view(-1)
                i = rng.randrange(flat.numel())
                if trial % 4 == 1:
                    flat[i] = flat[i] * 1.5 + 1e-3
                else:
                    flat.view(torch.int32)[i] ^= 1 << rng.randrange(31)
            parts = [checksum_parts(bits_checksum(c), weights[r], p) for r, c in enumerate(copies)]
            order = list(range(world))
            rng.shuffle(order)
            total = torch.zeros(3)
            for r in order:
                total = total + parts[r]
            exact = [sum(int(parts[r][k]) for r in range(world)) for k in range(3)]
            assert [int(v) for v in total] == exact  # no rounding anywhere
            changed = bool(trial % 2) and not torch.equal(copies[odd][0], grads[0])
            assert bool(checksums_disagree(total)) == checksums_disagree(total.tolist()) == changed, (world, trial)
            residues = [own_residues(parts[r].tolist(), weights[r]) for r in range(world)]
            assert all(x == tuple(int(v) for v in torch.remainder(bits_checksum(c), p)) for x, c in
                       zip(residues, copies))
            if changed:
                expected = ([odd], "majority") if world >= 3 else ([odd], "recomputed")
                assert odd_checksums(residues, residues[1 - odd] if world == 2 else None) == expected
    assert odd_checksums([(1, 2, 3), (1, 2, 4)]) == ([], "untold")  # two ranks, nothing recomputed
    assert odd_checksums([(1, 2, 3), (1, 2, 4)], (9, 9, 9)) == ([], "untold")  # the recompute matches neither
    assert odd_checksums([(1, 2, 3), None, (1, 2, 3)]) == ([1], "majority")
