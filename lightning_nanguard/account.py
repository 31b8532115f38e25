"""One account of an incident for every rank.

Under DDP every rank meets the same incident at the same step (the step's flags are reduced across ranks:
:mod:`.detect.ranks`), but each rank holds its own evidence and its own diagnosis. On an incident only,
:func:`share_incident` gathers every rank's evidence and diagnosis, so that all ranks adopt the account of the
rank that produced the problem (the one rank 0 writes to the sinks): one ``all_gather_object``, never called in
steady state.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from torch import Tensor

from .detect.ranks import Ranks
from .detect.replicas import CHECKSUM_FIELDS, odd_checksums, odd_ranks, own_residues
from .detect.vector import SCHEMA

__all__ = ["share_incident"]

_EVENT_FIELDS = ("kind", "cause", "culprit", "op", "details", "suggestion", "host", "device", "local_rank")


def share_incident(sync: Ranks, event: Any, extra: str, local: Optional[Tensor] = None,
                   own_norm: Optional[float] = None, recomputed: Optional[tuple[float, Any]] = None,
                   found: Optional[bool] = None) -> str:
    """On an incident: gather every rank's evidence and make every rank adopt the same account.

    The chosen rank is the one that produced the fault:

    - a replica disagreement (``event.kind == "replica"``; ``own_norm``: this rank's norm of its copy of the
      reduced gradient, ``recomputed``: the norm and checksum residues of the reduced gradient recomputed from the
      replays, :meth:`.Ranks.reduced_norm`): the first rank whose copy disagrees, by its checksum
      (:func:`odd_checksums`, ``replica_compare: exact``), else by its norm (:func:`odd_ranks`);
    - the first whose own weights hold the non-finite values (under sharding a rank checks its own shards, and a
      bad shard spoils every rank's loss through the forward's all-gather);
    - else the first whose own replay of its own micro-batches reproduced the fault (``details.replay``);
    - else the first with local evidence (a non-finite loss, input, parameter or module output);
    - else the first whose diagnosis found something of its own (bad inputs, an op);
    - else (sharded) the first whose own share of the gradient is non-finite (a fault after the backward, in one
      rank's shard: the others' are finite);
    - else nobody knows: rank 0's account, and ``details.ranks`` is empty (e.g. a fault that no rank's replay
      reproduces, in a gradient the all-reduce spread to every rank).

    ``event.rank`` (and ``host``, ``device``, ``local_rank``) become the chosen rank's and
    ``event.details["ranks"]`` lists the ranks with evidence (the disagreeing ones, for a replica). Returns the
    chosen rank's report text. Costs one ``all_gather_object``; never called in steady state. ``local``: the
    rank's vector of the incident's step when it is not the last one reduced (a lagged read). ``found``: an
    incident outside a step (before a snapshot or a checkpoint, at validation or the end of fit): this rank's own
    evidence (its weights or optimizer state non-finite), instead of a step's flags.
    """
    if not sync.distributed:
        return extra
    residues = None
    if event.kind == "replica" and own_norm is not None and sync.primes:  # this rank's checksum, from its fields
        vec = sync.last_local if local is None else local
        if vec is not None:
            first = SCHEMA.index[CHECKSUM_FIELDS[0]]
            residues = own_residues(vec[first:first + len(CHECKSUM_FIELDS)].tolist(), sync.weight)
    shard = found is None and sync.shard_bad(local)
    own_flags = [bool(found)] if found is not None else sync.local_flags(local)
    own = bool(event.op) or bool(event.details.get("inputs")) or event.kind == "input"
    reproduced = bool((event.details.get("replay") or {}).get("reproduced"))
    weights = event.kind in ("parameter", "buffer") and bool(event.details.get("nonfinite_parameters"))
    evidence = 5 if weights else 4 if reproduced else 3 if any(own_flags) else 2 if own else 1 if shard else 0
    payload = {"rank": sync.rank, "evidence": evidence, "local": own_flags, "extra": extra, "own_norm": own_norm,
               "residues": None if residues is None else list(residues),
               "event": {k: getattr(event, k) for k in _EVENT_FIELDS}}
    gathered = sync.gather(payload)
    ranks = [p["rank"] for p in gathered if p["evidence"] > 0]
    best = max(gathered, key=lambda p: (p["evidence"], -p["rank"]))
    odd: Optional[tuple[list[int], str]] = None
    norm, checksum = recomputed if recomputed is not None else (None, None)
    if event.kind == "replica" and own_norm is not None:
        norms = [math.nan if p["own_norm"] is None else float(p["own_norm"]) for p in gathered]
        odd = ([], "untold")
        if sync.primes:  # exact: by the copies' checksums
            odd = odd_checksums([p["residues"] for p in gathered], checksum)
        if not odd[0]:
            odd = odd_ranks(norms, sync.tolerance, norm)
        ranks = odd[0]
        if odd[0]:
            best = gathered[odd[0][0]]
    for key, value in best["event"].items():
        setattr(event, key, value)
    event.rank = best["rank"]
    event.details = dict(event.details)
    event.details["ranks"] = ranks
    if odd is not None:
        event.details["replica"] = dict(event.details.get("replica") or {}, grad_norms=norms, odd_ranks=odd[0],
                                        found_by=odd[1], recomputed_grad_norm=norm)
        if sync.primes:
            event.details["replica"]["checksum_residues"] = [p["residues"] for p in gathered]
    return best["extra"]
