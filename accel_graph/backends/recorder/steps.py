"""What a recorder capture records: one :class:`Step` per operation, one :class:`InputRecord`
per tensor that existed before the capture.

The recording itself (:mod:`.capture`, :mod:`.control_flow`) makes these; replay
(:mod:`.program`, :mod:`.compiled`) and dumps (:mod:`.dump`) read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload

from . import ops as opinfo
from . import rng

__all__ = ["InputRecord", "Step"]


@dataclass
class Step:
    """One recorded operation.

    Arguments keep inputs (tensors that existed before capture) by reference and pool tensors
    as :class:`~.pool_protocol.PoolRef` locations, so capture holds no pool memory alive. ``kind`` is
    ``"mutate"`` (in-place / out= as called), ``"host"`` (a Python call at replay, ``func`` a
    :class:`~.rng.HostCall` and ``extra`` its function: generator state) or a functional
    :class:`~accel_graph.backends.recorder.ops.Strategy` kind; ``outputs`` are the locations a
    functional op writes.
    """

    func: OpOverload | rng.HostCall
    kind: str
    args: tuple
    kwargs: dict
    outputs: tuple = ()
    strategy: opinfo.Strategy | None = None
    extra: Any = None
    #: Index of each output among the op's flattened results (for rebuilding it as FX).
    positions: tuple[int, ...] = ()
    #: Replay runs this step with grad mode on (its kernel's outputs depend on it).
    grad: bool = False


@dataclass
class InputRecord:
    """A tensor that existed before capture, with what replay checks to detect staleness."""

    tensor: torch.Tensor
    data_ptr: int
    shape: torch.Size
    stride: tuple[int, ...]
    name: str = ""
