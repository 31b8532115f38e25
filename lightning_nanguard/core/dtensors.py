"""Sharded tensors (``DTensor``: FSDP2's ``fully_shard``, tensor parallel's ``parallelize_module``) as the guard reads
them: through each rank's local shard.

A DTensor's global operations are collectives (and an inf-norm of an empty shard, a reshape of a sharded dimension,
a copy from a plain tensor are errors), while every read of the guard is rank-local by design: its flags are summed
over ranks in the step's one all-reduce anyway. So every read takes :func:`local` (``t.to_local()``, a view of the
shard, possibly empty; a plain tensor as it is). The pieces that need the layout:

- the total gradient norm: :func:`norm_share` says how much of a shard's ``sum |g|^p`` this rank adds to the
  all-reduce over the world, so that an element held by several ranks (a ``Replicate`` placement, a mesh smaller
  than the world) counts once; :func:`reduced` first completes a ``Partial`` placement (its local values are
  addends, not values);
- snapshots keep the local shards and :func:`like` puts them back as DTensors with the live placements (no
  communication), so that a rollback restores each rank's shard in place.

Duck-typed (``placements`` and ``to_local``), so a run without DTensors never imports ``torch.distributed.tensor``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard

from torch import Tensor, nn

if TYPE_CHECKING:  # for the type checker only: at run time the check is duck-typed
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "local", "reduced", "norm_share", "like", "sharded"]


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """Is ``t`` a ``DTensor``?"""
    return hasattr(t, "placements") and hasattr(t, "to_local") and hasattr(t, "device_mesh")


def local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view: writing it writes the DTensor; may be empty); a plain tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def reduced(t: Tensor) -> Tensor:
    """``t`` with every ``Partial`` placement completed (``Replicate``): a collective every rank holding ``t`` makes
    (the ranks hold the same parameters, so they call it alike); ``t`` itself otherwise."""
    if not is_dtensor(t) or not any(p.is_partial() for p in t.placements):
        return t
    from torch.distributed.tensor import Replicate

    return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])


def norm_share(t: Tensor, world: int) -> float:
    """The weight of this rank's ``sum |g|^p`` of ``t``'s shard in a sum over all ``world`` ranks that gives the
    global ``sum |g|^p`` once: 1 for a plain tensor (a rank's own shard, as under the old FSDP's flat parameters);
    for a DTensor, 0 on every rank but the first along each ``Replicate`` dimension of its mesh (those copies are
    counted there), divided by the number of meshes like its own that the world holds (a mesh smaller than the
    world: its copies on the other meshes)."""
    if not is_dtensor(t):
        return 1.0
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh: it holds nothing of ``t``
        return 0.0
    for dim, placement in enumerate(t.placements):
        if placement.is_replicate() and coordinate[dim] != 0:
            return 0.0
    size = mesh.size()
    return 1.0 if size >= world else size / world


def like(saved: Tensor, live: object) -> Tensor:
    """``saved`` (a local shard kept by a snapshot) as a DTensor laid out as ``live`` (no communication), for a
    load into the live DTensor; ``saved`` as it is where ``live`` is not a DTensor or its shard's shape differs."""
    if not is_dtensor(live) or is_dtensor(saved) or tuple(saved.shape) != tuple(live.to_local().shape):
        return saved
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(saved, live.device_mesh, live.placements, run_check=False, shape=live.shape,
                              stride=live.stride())


def sharded(module: nn.Module) -> bool:
    """Does ``module`` hold DTensor parameters? (Its forward and backward are then collectives: FSDP2 all-gathers
    and reduce-scatters, tensor parallel all-reduces, so every rank must run the same passes.)"""
    return any(is_dtensor(p) for p in module.parameters())
