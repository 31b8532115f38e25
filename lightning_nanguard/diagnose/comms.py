"""Which ops and autograd functions carry other ranks' values.

Under sharding a rank's forward and backward run collectives (tensor parallel all-reduces activations and the
gradients of its inputs, FSDP2 all-gathers weights and reduce-scatters gradients), so a non-finite value made on
one rank reaches the others. A rank whose first non-finite value comes out of one of these *received* it: its own
computation was finite. The replay's probes (:class:`~.probes.FirstBadOp`, :class:`~.probes.GraphWatch`) ask
:func:`is_communication` and :func:`is_communication_node` so that such a rank is not named for it, and so that the
op is never recomputed alone (a collective that one rank calls while the others do not never returns).
"""

from __future__ import annotations

__all__ = ["is_communication", "is_communication_node"]

# torch.ops namespaces of collectives: functional collectives (and their autograd twins), c10d, FSDP2's copy-in
_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d", "c10d_functional", "fsdp",
                         "_dtensor"})
# the names of DTensor's conversions and of the collectives, as a TorchFunctionMode sees them
_NAMES = frozenset({"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_tensor", "reduce_scatter_tensor",
                    "all_to_all_single", "broadcast", "wait_tensor", "redistribute", "full_tensor", "from_local",
                    "to_local", "_wrap_tensor_autograd"})
# C++ autograd nodes of the functional collectives (``_c10d_functional_autograd``)
_NODE_WORDS = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll", "c10d")


def _namespace(func: object) -> str:
    namespace = getattr(func, "namespace", None)  # an OpOverload: torch.ops.<namespace>.<op>.<overload>
    if isinstance(namespace, str):
        return namespace
    module = getattr(func, "__module__", None) or ""  # an OpOverloadPacket: module torch._ops.<namespace>
    return module.rpartition("torch._ops.")[2] if module.startswith("torch._ops.") else ""


def is_communication(func: object) -> bool:
    """Does calling ``func`` bring in other ranks' values (a collective, a DTensor redistribution or conversion)?"""
    if _namespace(func) in _NAMESPACES:
        return True
    module = getattr(func, "__module__", None) or ""
    name = getattr(func, "__name__", None) or ""
    return module.startswith("torch.distributed") or name.split(".")[0] in _NAMES


def is_communication_node(node: object) -> bool:
    """Is the autograd node ``node`` the backward of a collective or of a DTensor conversion (DTensor's
    ``from_local`` / ``to_local`` / ``redistribute``, whose backward all-reduces a partial gradient)?"""
    forward = getattr(node, "_forward_cls", None)  # a Python autograd.Function's node: its Function class
    if forward is not None and (getattr(forward, "__module__", None) or "").startswith("torch.distributed"):
        return True
    name_of = getattr(node, "name", None)
    name = name_of() if callable(name_of) else ""
    return any(word in name for word in _NODE_WORDS)
