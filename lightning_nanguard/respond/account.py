"""One account of an incident for every rank.

Under DDP every rank meets the same incident at the same step (the step's flags are reduced across ranks:
:mod:`.detect.ranks`), but each rank holds its own evidence and its own diagnosis. On an incident only,
:func:`share_incident` gathers every rank's evidence and diagnosis, so that all ranks adopt the account of the
rank that produced the problem (the one rank 0 writes to the sinks): one ``all_gather_object``, never called in
steady state.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import fields
from typing import Any, NamedTuple, Optional

from torch import Tensor

from ..core.diagnosis import Diagnosis
from ..core.events import NaNEvent
from ..core.record import StepRecord, UpdateStage
from ..detect.placement import whereabouts
from ..detect.ranks import Ranks
from ..detect.replicas import CHECKSUM_FIELDS, odd_checksums, odd_ranks, own_residues, weights_checksum
from ..detect.vector import SCHEMA
from ..diagnose.replay import local_gradients

__all__ = ["Account", "share_incident", "recompute_reduced_norm", "drifted_replicas"]


class Account(NamedTuple):
    """The account every rank adopts (:func:`share_incident`): the chosen rank's report text, the ranks with
    evidence of their own (None: one process; empty: several, and no rank knows), and the LR factor its diagnosis
    found safe (a ``sized`` cut, :meth:`.Recovery.plan`)."""

    extra: str
    ranks: Optional[list[int]] = None
    safe_factor: Optional[float] = None

# the reduced gradient recomputed from the replays: its norm and checksum residues (:meth:`.Ranks.reduced_norm`)
Recomputed = tuple[float, Optional[tuple[int, ...]]]

_EVENT_FIELDS = ("kind", "cause", "culprit", "op", "details", "suggestion", "host", "device", "local_rank")


def share_incident(ranks: Ranks, event: NaNEvent, extra: str, local: Optional[Tensor] = None,
                   own_norm: Optional[float] = None, recomputed: Optional[Recomputed] = None,
                   found: Optional[bool] = None, safe_factor: Optional[float] = None,
                   diagnosis: Optional[Diagnosis] = None, own_replica: Optional[dict] = None) -> Account:
    """On an incident: gather every rank's evidence and make every rank adopt the same account.

    The chosen rank is the one that produced the fault: for a replica disagreement (``event.kind == "replica"``;
    ``own_norm``: this rank's norm of its copy of the reduced gradient, ``recomputed``: the norm and checksum
    residues of the reduced gradient recomputed from the replays, :meth:`.Ranks.reduced_norm`) the first rank
    whose copy disagrees (:func:`_odd_replica`), else the first with the strongest evidence of its own
    (:func:`_evidence`; rank 0 when nobody knows, and ``details.ranks`` is empty then).

    ``event.rank`` (and ``host``, ``device``, ``local_rank``) become the chosen rank's and
    ``event.details["ranks"]`` lists the ranks with evidence (the disagreeing ones, for a replica). ``diagnosis``
    (this rank's: what the ranks' evidence is ranked by) becomes the chosen rank's, in place, with its ``ranks``.
    Returns the chosen rank's :class:`Account` (``safe_factor``: this rank's, from its diagnosis). Costs one
    ``all_gather_object``; never called in steady state. ``local``: the rank's vector of the incident's step when it
    is not the last one reduced (a lagged read). ``found``: an incident outside a step (before a snapshot or a
    checkpoint, at validation or the end of fit): this rank's own evidence (its weights or optimizer state
    non-finite), instead of a step's flags. ``own_replica``: this rank's evidence of a replica disagreement
    (:attr:`.StepRecord.replica`, the event's ``details.replica``).
    """
    if not ranks.distributed:
        return Account(extra, None, safe_factor)
    mine = diagnosis if diagnosis is not None else Diagnosis()
    gathered = ranks.gather(dict(_payload(ranks, event, extra, local, own_norm, found, mine), safe_factor=safe_factor,
                                 replica=own_replica))
    best = max(gathered, key=lambda p: (p["evidence"], -p["rank"]))
    # (a rank whose only evidence is its own share of the gradient, while another rank made the fault: its share is
    # what the gradients' reduction brought it)
    floor = 1 if best["evidence"] <= _SHARD else _SHARD + 1
    named = [p["rank"] for p in gathered if p["evidence"] >= floor]
    replica: Optional[dict[str, Any]] = None
    if event.kind == "replica" and own_norm is not None:
        replica = _odd_replica(ranks, gathered, recomputed)
        named = replica["odd_ranks"]
        if named:
            best = gathered[named[0]]
    _adopt(event, mine, best, named, replica)
    return Account(best["extra"], named, best["safe_factor"])


def _payload(ranks: Ranks, event: NaNEvent, extra: str, local: Optional[Tensor], own_norm: Optional[float],
             found: Optional[bool], diagnosis: Diagnosis) -> dict[str, Any]:
    """What this rank tells the others of the incident: its rank, the strength of its evidence (:func:`_evidence`),
    its own flags, its report text, its norm and checksum residues of its copy (a replica incident), its event's
    account (:data:`_EVENT_FIELDS`) and its diagnosis. Reads the device (incident only)."""
    residues = _own_checksum(ranks, event, local, own_norm)
    shard = found is None and ranks.shard_bad(local)
    own_flags = [bool(found)] if found is not None else ranks.local_flags(local)
    return {"rank": ranks.rank, "evidence": _evidence(event, diagnosis, own_flags, shard), "local": own_flags,
            "extra": extra, "own_norm": own_norm, "residues": None if residues is None else list(residues),
            "event": {k: getattr(event, k) for k in _EVENT_FIELDS}, "diagnosis": diagnosis}


def _own_checksum(ranks: Ranks, event: NaNEvent, local: Optional[Tensor],
                  own_norm: Optional[float]) -> Optional[tuple[int, ...]]:
    """A replica incident under ``replica_compare: exact``: this rank's checksum residues, back from its checksum
    fields in its vector of the incident's step (``local``, else the last one reduced); None otherwise."""
    if event.kind != "replica" or own_norm is None or not ranks.primes:
        return None
    vec = ranks.last_local if local is None else local
    if vec is None:
        return None
    first = SCHEMA.index[CHECKSUM_FIELDS[0]]
    return own_residues(vec[first:first + len(CHECKSUM_FIELDS)].tolist(), ranks.weight)


_SHARD = 1  # the evidence of a rank whose own share of the gradient is non-finite, and nothing more


def _evidence(event: NaNEvent, found: Diagnosis, own_flags: list[bool], shard: bool) -> int:
    """How strongly this rank's own evidence says it produced the fault (0: none); the highest wins, the lowest
    rank among equals:

    6. its own weights hold the non-finite values (under sharding a rank checks its own shards, and a bad shard
       spoils every rank's loss through the forward's all-gather);
    5. its own replay of its own micro-batches reproduced the fault of its own (``found.replay``; under sharding
       not a replay whose non-finite values came through a collective, ``replay.received``);
    4. its own batch holds non-finite values (``found.inputs``, kind ``input``) and its own flags are set: under
       tensor parallel every rank of a group computes on the same batch, and one rank's bad copy spoils the others'
       losses through the row-wise layer's all-reduce (their flags, below, are what it brought them);
    3. local evidence (a non-finite loss, input, parameter or module output: ``own_flags``);
    2. its diagnosis found something of its own (bad inputs that raised no flag of its own, an op);
    1. (sharded) its own share of the gradient is non-finite (``shard``: a fault after the backward, in one rank's
       shard: the others' are finite);
    0. nothing (e.g. a fault that no rank's replay reproduces, in a gradient the all-reduce spread to every rank).

    A rank whose replay showed its non-finite values coming from another rank (``replay.received``) has none of 1-3
    and 5: they are what the collective brought it."""
    replay = found.replay
    received = replay is not None and bool(replay.received)
    inputs = bool(found.inputs) or event.kind == "input"
    reproduced = replay is not None and replay.reproduced and not received and not replay.timeout
    weights = event.kind in ("parameter", "buffer") and bool(found.nonfinite_parameters)
    if received:  # its replay showed its non-finite values coming from another rank: its flags and share too
        return 6 if weights else 2 if inputs else 0
    return (6 if weights else 5 if reproduced else 4 if inputs and any(own_flags) else 3 if any(own_flags)
            else 2 if inputs or event.op else _SHARD if shard else 0)


def _odd_replica(ranks: Ranks, gathered: list[dict[str, Any]],
                 recomputed: Optional[Recomputed]) -> dict[str, Any]:
    """A replica disagreement: which ranks' copies of the reduced gradient disagree, by their checksums
    (:func:`~.detect.replicas.odd_checksums`, ``replica_compare: exact``), else by their norms
    (:func:`~.detect.replicas.odd_ranks`), from every rank's payload and the gradient recomputed from the replays.
    Returns the fields for ``details.replica``: ``grad_norms``, ``odd_ranks`` (empty: untold), ``found_by``,
    ``recomputed_grad_norm`` (and ``checksum_residues`` when exact)."""
    norm, checksum = recomputed if recomputed is not None else (None, None)
    norms = [math.nan if p["own_norm"] is None else float(p["own_norm"]) for p in gathered]
    odd: tuple[list[int], str] = ([], "untold")
    if ranks.primes:  # exact: by the copies' checksums
        odd = odd_checksums([p["residues"] for p in gathered], checksum)
    if not odd[0]:
        odd = odd_ranks(norms, ranks.tolerance, norm)
    replica: dict[str, Any] = {"grad_norms": norms, "odd_ranks": odd[0], "found_by": odd[1],
                               "recomputed_grad_norm": norm}
    if ranks.primes:
        replica["checksum_residues"] = [p["residues"] for p in gathered]
    return replica


def _adopt(event: NaNEvent, diagnosis: Diagnosis, best: dict[str, Any], named: list[int],
           replica: Optional[dict[str, Any]]) -> None:
    """Make ``event`` and ``diagnosis`` the chosen rank's account (``best``, its payload), with ``details.ranks`` =
    ``named`` and the replica disagreement's fields (``replica``) over the account's own evidence of it."""
    for key, value in best["event"].items():
        setattr(event, key, dict(value) if key == "details" else value)
    event.rank = best["rank"]
    theirs: Diagnosis = best["diagnosis"]
    for f in fields(Diagnosis):
        setattr(diagnosis, f.name, getattr(theirs, f.name))
    diagnosis.ranks = named
    event.details["ranks"] = named
    if replica is not None:
        event.details["replica"] = dict(best["replica"] or {}, **replica)


def recompute_reduced_norm(ranks: Ranks, trainer: Any, pl_module: Any, record: Optional[StepRecord],
                           replays: bool) -> Optional[Recomputed]:
    """Two replicas disagree and no majority can tell which copy is wrong: recompute the reduced gradient's norm
    (and checksum) from every rank's replayed local gradient (one incident-only all-reduce of the whole gradient, on
    every rank: :meth:`.Ranks.reduced_norm`). None where it cannot be: no ``replays`` (``anomaly.mode: off``),
    manual optimization, more than two ranks (a majority tells), or a step whose update was already applied (other
    weights)."""
    if (record is None or ranks.world_size != 2 or not replays or record.update is UpdateStage.APPLIED
            or not getattr(pl_module, "automatic_optimization", True)):
        return None
    params = [p for group in record.optimizer.param_groups for p in group["params"]]
    window = record.window
    grads = local_gradients(trainer, pl_module, window.batches, window.rng, params, window.step)
    return ranks.reduced_norm(grads, params)


def drifted_replicas(ranks: Ranks, trainer: Any, pl_module: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """DDP replicas whose weights differ (:meth:`.Ranks.snapshot_agreement`): every rank's weights checksum and
    whereabouts (one ``all_gather_object``, only here), and the odd ranks where a majority tells (3 or more ranks;
    none with two)."""
    total = weights_checksum(pl_module)
    gathered = ranks.gather({"checksum": None if total is None else int(total), **whereabouts(trainer)})
    sums = [g["checksum"] for g in gathered]
    common, agreeing = Counter(sums).most_common(1)[0]
    return gathered, [r for r, c in enumerate(sums) if c != common] if agreeing * 2 > len(sums) else []
