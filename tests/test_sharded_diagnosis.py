"""Sharded diagnosis as good as one process (issue 35): for the same model, data and fault, FSDP2, tensor parallel and
both on a 2 x 2 mesh name the culprit module, the op and the cause that the one-process fit names, and the rank whose
own micro-batch made the fault; every rank records the same events.

One spawn of 2 processes (``fsdp``, ``tp``) and one of 4 (``2d``: FSDP2 over the data-parallel dim of a 2 x 2 mesh on
top of tensor parallel) of tests/ddp_scripts/sharded_diagnosis.py; the one-process fits of the same scenarios
(tests/ddp_scripts/parity.py) run in this process. Every rank must finish: a hang fails at the subprocess timeout.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from .ranks import launch, per_step

SCRIPTS = Path(__file__).parent / "ddp_scripts"
LAST = {"fsdp": 1, "tp": 1, "2d": 3}  # the rank each scenario poisons


def _parity():
    """tests/ddp_scripts/parity.py, imported as the spawned script imports it."""
    spec = importlib.util.spec_from_file_location("parity", SCRIPTS / "parity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("parity", module)
    spec.loader.exec_module(module)
    return module


parity = _parity()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Scenario -> the one-process fit's events (``to_dict()``)."""
    root = tmp_path_factory.mktemp("single")
    return {name: [e.to_dict() for e in parity.fit_single(name, root).events] for name in parity.SCENARIOS}


@pytest.fixture(scope="module")
def one_process_faults(tmp_path_factory):
    """``check.sync`` mode -> (step, kind, cause, culprit, op) of each event of ``parity.FAULTS`` on one process."""
    root = tmp_path_factory.mktemp("single-faults")
    return {sync: [(e.step, e.kind, e.cause, e.culprit, e.op) for e in parity.fit_single_faults(sync, root).events]
            for sync in ("eager", "lagged")}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """``{layout: [rank 0's fits, rank 1's fits]}``: one spawn of 2 processes."""
    out = tmp_path_factory.mktemp("parity2")
    ranks = [saved["fits"] for saved in launch(SCRIPTS / "sharded_diagnosis.py", out, 2, "fsdp", "tp", timeout=480)]
    return {layout: [r[layout] for r in ranks] for layout in ("fsdp", "tp")}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """Rank 0..3's fits on the 2 x 2 mesh: one spawn of 4 processes."""
    out = tmp_path_factory.mktemp("parity4")
    return [saved["fits"]["2d"] for saved in launch(SCRIPTS / "sharded_diagnosis.py", out, 4, "2d", timeout=600)]


def named(event: dict) -> tuple:
    return event["culprit"], event["op"], event["cause"]


def identical(fits: list[dict]) -> bool:
    return all(f["events"] == fits[0]["events"] for f in fits)


def healthy_steps_unchanged(fit: dict) -> None:
    """Before the first incident every step costs the guard what it costs today: one all-reduce of its evidence
    vector and one host read (a snapshot step: one all-reduce of 4 numbers and one host read more)."""
    first = fit["events"][0]["step"]
    rows = [r for r in per_step(fit) if r[0] < first]
    assert rows, "no healthy step before the incident"
    size = rows[0][1][0][1]
    for step, calls, reads, snapshot in rows:
        assert calls == [("all_reduce", size)] + [("all_reduce", 4)] * snapshot, (step, calls)
        assert reads == ["tolist"] * (1 + snapshot), (step, reads)


# --------------------------------------------------------------------------------------------------- parity


@pytest.mark.slow
@pytest.mark.parametrize("name", parity.SCENARIOS)
def test_the_one_process_fit_names_the_module_op_and_cause_of_each_scenario(one_process, name):
    """The reference: what the guard names for each scenario on one process."""
    first = one_process[name][0]
    assert (first["step"], *named(first)) == (parity.AT, *parity.EXPECTED[name])


@pytest.mark.slow  # one spawn of 2 processes, ~30 s on 2 cores
@pytest.mark.ddp
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
@pytest.mark.parametrize("name", parity.SCENARIOS)
def test_fsdp2_and_tensor_parallel_name_what_one_process_names_and_the_faulty_rank(one_process, two_ranks, layout,
                                                                                   name):
    """The same culprit module (the user's path), op and cause as the one-process fit, every rank alike; the rank
    whose own micro-batch made the fault is named (a divergence is no rank's own: rank 0, ``details.ranks`` empty);
    the steps before it cost what a healthy step costs."""
    fits = [rank[name] for rank in two_ranks[layout]]
    assert identical(fits) and all(f["finite"] for f in fits)
    first = fits[0]["events"][0]
    assert (first["step"], first["kind"]) == (parity.AT, one_process[name][0]["kind"])
    assert named(first) == named(one_process[name][0])
    if name == "lr":
        assert (first["rank"], first["details"]["ranks"]) == (0, [])
    else:
        assert first["rank"] == LAST[layout]
        # (tensor parallel: rank 0's loss went NaN through the row-wise all-reduce, a flag of its own, but its replay
        # or its bad-batch-free flags rank below rank 1's own batch)
        expected = [0, 1] if (layout, name) == ("tp", "input") else [1]
        assert first["details"]["ranks"] == expected
    if name in ("backward", "overflow"):
        replay = first["details"]["replay"]
        assert replay["reproduced"] and "sharded" in replay and "received" not in replay  # the account is rank 1's own
        assert first["details"]["float64"]["finite"] is (name == "overflow")  # the gathered whole model in float64
    if name == "backward":  # anomaly mode's finding, as one process reports it (found without raising)
        assert first["details"]["anomaly"]["op"] == one_process[name][0]["details"]["anomaly"]["op"]
        assert first["details"]["backward_op"]["traceback"]
    if name == "overflow":  # judged at the op, recomputed in float64 on the rank's own shards
        assert first["details"]["judged_at"] == "op" and first["details"]["forward_op"]["float64_finite"]
    healthy_steps_unchanged(fits[0])


@pytest.mark.slow
@pytest.mark.ddp
def test_a_rank_that_received_the_fault_through_a_collective_says_so_and_is_not_named(two_ranks):
    """Rank 0's own replay of the overflow: under FSDP2 its gradients came back non-finite through the reduce-scatter
    (its own backward finite); under tensor parallel its forward went non-finite at the row-wise layer's all-reduce.
    Both ranks' accounts are gathered on the incident path only; the event is rank 1's, with ``ranks == [1]``."""
    for layout in ("fsdp", "tp"):
        first = two_ranks[layout][0]["overflow"]["events"][0]
        assert first["rank"] == 1 and first["details"]["ranks"] == [1] and first["culprit"] == "net.0"


@pytest.mark.slow
@pytest.mark.ddp
def test_a_replay_past_its_timeout_ends_on_every_rank_together_and_says_so(two_ranks):
    """``anomaly.replay_timeout`` far below the replay's time: every rank stops after the first agreement, together
    (no hang), records the same event, and says where it stopped; not ``transient``, no op named."""
    fits = [rank["timeout"] for rank in two_ranks["fsdp"]]
    assert identical(fits) and all(f["global_step"] == parity.STEPS for f in fits)
    first = fits[0]["events"][0]
    assert "ended on every rank together after the recorded pass of micro-batch 0" in first["details"]["replay"][
        "timeout"]
    assert first["cause"] != "transient" and first["op"] is None


# ------------------------------------------------------------------------------------------------ 2 x 2 mesh


@pytest.mark.slow  # one spawn of 4 processes, ~60 s on 2 cores
@pytest.mark.ddp
def test_the_2x2_mesh_names_what_one_process_names_and_the_rank_of_its_own_batch(one_process, mesh):
    """FSDP2 on top of tensor parallel: each scenario poisoned on rank 3 (whose tensor-parallel partner, rank 2,
    computes on the same batch): the one-process module, op and cause, rank 3 named, on all 4 ranks alike."""
    for name in parity.SCENARIOS:
        fits = [rank[name] for rank in mesh]
        assert identical(fits), name
        first = fits[0]["events"][0]
        assert named(first) == named(one_process[name][0]), name
        if name == "lr":
            assert (first["rank"], first["details"]["ranks"]) == (0, []), name
        else:
            assert first["rank"] == 3, name
            assert first["details"]["ranks"] == ([2, 3] if name == "input" else [3]), name
        healthy_steps_unchanged(fits[0])


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("fit", ["faults", "lagged"])
def test_one_rank_faults_of_every_kind_on_the_2x2_mesh_name_that_rank_in_both_sync_modes(mesh, one_process_faults,
                                                                                         fit):
    """On rank 3 only: an input (step 3), a module output (6), a gradient element (9), a weight (12), an Adam state
    (16), eager and with ``check.sync: lagged`` (a fused AdamW, skipping on the device): every rank finishes with
    finite weights and the same events, with the one-process fit's kind, cause, culprit and op, each naming rank 3,
    but for one case that no rank can tell: read one step late, the module output's fault does not come back on
    replay (the injector's hook lives to the end of its own step; one process says ``transient`` too), and both
    ranks of the tensor-parallel group have a NaN loss of their own (the row-wise layer's all-reduce):
    ``details.ranks == [2, 3]``, the lowest named."""
    fits = [rank[fit] for rank in mesh]
    assert identical(fits) and all(f["finite"] and f["global_step"] == 20 for f in fits)
    events = fits[0]["events"]
    one = one_process_faults["eager" if fit == "faults" else "lagged"]
    assert [(e["step"], e["kind"], e["cause"], e["culprit"], e["op"]) for e in events] == one  # as one process
    assert [e["step"] for e in events] == [3, 6, 9, 13, 17]
    assert [e["kind"] for e in events] == ["input", "loss", "gradient", "parameter", "parameter"]
    assert [e["cause"] for e in events][2:] == ["transient", "optimizer", "optimizer"]
    told = [e for e in events if e["step"] != 6 or fit == "faults"]
    assert all(e["rank"] == 3 for e in told), [(e["step"], e["rank"]) for e in events]
    if fit == "faults":  # rank 3's own replay made it; rank 2 received it through the all-reduce
        assert (events[1]["culprit"], events[1]["details"]["ranks"]) == ("net.0", [3])
    else:
        assert (events[1]["cause"], events[1]["rank"], events[1]["details"]["ranks"]) == ("transient", 2, [2, 3])


@pytest.mark.slow
@pytest.mark.ddp
def test_a_checkpoint_on_the_2x2_mesh_never_holds_the_nan_and_resumes(mesh):
    """A weight made NaN on rank 3 just before a distributed checkpoint (step 10): every rank rolls back, names rank
    3, and the fit resumed from that checkpoint runs to its end without an incident on every rank."""
    ckpts = [rank["ckpt"] for rank in mesh]
    assert identical(ckpts)
    assert [(e["step"], e["kind"], e["actions"], e["rank"]) for e in ckpts[0]["events"]] == [
        (10, "parameter", ["rollback"], 3)]
    for rank in mesh:
        resume = rank["resume"]
        assert resume["events"] == [] and resume["global_step"] == 20 and resume["finite"]
        assert resume["counters"]["rollbacks"] == 1  # the guard's own state came back with the checkpoint
