"""Collective ops in a capture: which ops are collectives, and which of them (and which
``torch.distributed`` functions calling them) a capture refuses, with the reason.

The recorder applies these when it records (``backends/recorder/collectives.py`` decides what
is recorded and how it replays); ``check_capturable`` reports the same refusals without
capturing, through :func:`~.illegal_ops.illegal_reason`.
"""

from __future__ import annotations

import functools
import os
import sys

from torch._ops import OpOverload

__all__ = [
    "C10D", "FUNCTIONAL", "REFUSED_CALLERS", "REFUSED_OPS", "is_collective", "refusal",
    "refused_caller",
]

#: Namespaces of the collective ops.
C10D = "c10d"
FUNCTIONAL = "_c10d_functional"
_NAMESPACES = frozenset({C10D, FUNCTIONAL, "c10d_functional"})

_P2P = ("point-to-point transfers differ between ranks (one sends, the other receives), so the "
        "ranks' recorded programs could not be checked against each other; keep send/recv "
        "outside the capture, or use a collective (all_to_all_single, broadcast)")
_ROOTED = ("its tensor lists differ between the root and the other ranks; use "
           "all_gather_into_tensor / broadcast / reduce_scatter_tensor, which capture")

#: Collective ops refused at capture, by ``namespace::name``, with the reason.
REFUSED_OPS: dict[str, str] = {
    "c10d::barrier": "a barrier synchronises the host with other ranks, which a device graph "
    "cannot replay; call dist.barrier() before capture or after replay",
    "c10d::monitored_barrier_": "a barrier synchronises the host with other ranks, which a "
    "device graph cannot replay; call it outside the capture",
    "c10d::check_for_nan": "it reads tensor values on the host (a sync); check after replay",
    "c10d::send": _P2P,
    "c10d::recv_": _P2P,
    "c10d::recv_any_source_": _P2P,
    "c10d::gather_": _ROOTED,
    "c10d::scatter_": _ROOTED,
    "_c10d_functional::isend": _P2P,
    "_c10d_functional::irecv": _P2P,
    "_c10d_functional::batch_p2p_ops": _P2P,
}

#: ``torch.distributed`` functions refused when a collective is issued from inside them
#: (found on the Python stack), with the reason.
_OBJECT = ("it pickles Python objects and sizes tensors from their values on the host, which a "
           "device graph cannot replay; exchange objects before capture, or exchange tensors")
REFUSED_CALLERS: dict[str, str] = {
    "all_gather_object": _OBJECT,
    "gather_object": _OBJECT,
    "broadcast_object_list": _OBJECT,
    "scatter_object_list": _OBJECT,
    "send_object_list": _OBJECT,
    "recv_object_list": _OBJECT,
    "barrier": REFUSED_OPS["c10d::barrier"],
    "monitored_barrier": REFUSED_OPS["c10d::barrier"],
    "new_group": "process groups must exist before capture (group creation talks to the "
    "store and other ranks on the host); create groups first, then capture",
    "new_subgroups": "process groups must exist before capture; create groups first",
    "new_subgroups_by_enumeration": "process groups must exist before capture; create groups first",
    "batch_isend_irecv": _P2P,
    "isend": _P2P,
    "irecv": _P2P,
    "send": _P2P,
    "recv": _P2P,
    "gather": _ROOTED,
    "scatter": _ROOTED,
}

_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


@functools.lru_cache(maxsize=1024)
def is_collective(func: OpOverload) -> bool:
    """Whether ``func`` is a c10d or functional collective op (including ``wait_tensor``)."""
    return func.namespace in _NAMESPACES


def refusal(func: OpOverload) -> str | None:
    """Why capture refuses ``func`` (a collective op), or None."""
    return REFUSED_OPS.get(func._schema.name)


def refused_caller() -> tuple[str, str] | None:
    """``(function, reason)`` of a refused ``torch.distributed`` function on the Python stack
    (``all_gather_object``, ``barrier``, ``new_group``, ...), or None. Walked only when a
    collective op is captured, so its cost is paid per collective, never per op."""
    frame = sys._getframe(1)
    found = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_C10D_FILE) and code.co_name in REFUSED_CALLERS:
            found = code.co_name  # keep walking: the outermost one is what the user called
        frame = frame.f_back
    return None if found is None else (found, REFUSED_CALLERS[found])
