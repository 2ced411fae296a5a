"""How each functional aten op replays in a recorder program (its :class:`Strategy`), and the
op tables that decision reads (what capture must refuse is
:mod:`accel_graph.backends.capture_common.illegal_ops`).

Everything here is decided once per (op, argument kinds) and cached, so capture pays the schema
walk once per distinct op and replay pays nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload

# torch 2.11 has no ``Tag.out`` (2.12 added it); the schema's out arguments say the same there.
_OUT_TAG = getattr(torch.Tag, "out", None)

#: Factory ops whose output replays as a fill of the captured memory (value from the args).
_FILL_FACTORIES: dict[str, Any] = {
    "zeros": 0, "zeros_like": 0, "new_zeros": 0,
    "ones": 1, "ones_like": 1, "new_ones": 1,
}
_FULL_FACTORIES = {"full": 1, "full_like": 1, "new_full": 2, "scalar_tensor": 0}
#: Ops that allocate without writing: replay does nothing (contents undefined, as on CUDA).
EMPTY_FACTORIES: frozenset[str] = frozenset(
    {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
)
#: Random factories: the in-place form draws the same numbers as eager from the same state.
_RANDOM_FACTORIES: dict[str, str] = {
    "randn": "normal", "randn_like": "normal",
    "rand": "uniform", "rand_like": "uniform",
    "randint": "random", "randint_like": "random",
}
#: Ops whose output layout the CPU/cuDNN kernels take from a channels_last input while the meta
#: kernel reports a contiguous one; the recorder gives their outputs the input's layout.
LAYOUT_FOLLOWING_OPS: frozenset[str] = frozenset(
    {"convolution", "_convolution", "mkldnn_convolution", "max_pool2d_with_indices",
     "max_pool3d_with_indices", "avg_pool2d", "avg_pool3d", "_adaptive_avg_pool2d",
     "_adaptive_avg_pool3d", "adaptive_max_pool2d", "upsample_nearest2d", "upsample_bilinear2d",
     "upsample_bicubic2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
     "upsample_trilinear3d", "native_batch_norm", "_native_batch_norm_legit_no_training",
     "_native_batch_norm_legit", "native_group_norm"}
)

#: Casts and copies: replay is ``out.copy_(src)``, which matches eager bit for bit.
COPY_OPS: frozenset[str] = frozenset(
    {"_to_copy", "clone", "lift_fresh_copy", "_copy", "copy", "contiguous", "alias_copy",
     "detach_copy", "_to_dense"}
)

_FACTORY_KWARGS = ("dtype", "layout", "device", "pin_memory", "memory_format", "requires_grad")


@dataclass(frozen=True)
class Strategy:
    """How a functional op replays into its captured outputs.

    kind:
      ``out``       call ``op`` (an ``.out`` overload) with the captured outputs as out= kwargs
      ``fill``      ``out.fill_(value)`` (``zero_`` for 0)
      ``random``    ``out.normal_()/uniform_()/random_()`` from the default or given generator
      ``copy``      ``out.copy_(src)`` (casts, clones)
      ``none``      nothing to do at replay (``empty``)
      ``compute``   call the functional op and copy its results into the outputs (allocates)
      ``host``      a Python call at replay (generator state; see :mod:`.rng`), not an op
    """

    kind: str
    op: OpOverload | None = None
    out_names: tuple[str, ...] = ()
    why: str = ""


def _arg_signature(schema: torch.FunctionSchema) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]


@functools.lru_cache(maxsize=4096)
def tensor_params(func: OpOverload) -> tuple[tuple[int, str], ...]:
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments) if "Tensor" in str(a.type))


def _number_args(func: OpOverload, args: tuple, kwargs: dict) -> frozenset[str]:
    """Names of Tensor-typed arguments that were given a Python number."""
    names = set()
    for i, name in tensor_params(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, (int, float, bool, complex)):
            names.add(name)
    return frozenset(names)


@functools.lru_cache(maxsize=4096)
def find_out_overload(func: OpOverload, number_args: frozenset[str] = frozenset()):
    """The ``.out`` overload whose non-out arguments match ``func``'s by name and type.

    The exact match wins; a Tensor argument that was given a Python number may otherwise match
    a Scalar argument (``mul.Tensor(x, 2.0)`` -> ``mul.Scalar_out``). The exact overload is
    preferred because capture pre-wraps the number as a 0-dim tensor of the computation dtype,
    which allocates nothing per call, while the CPU ``Scalar_out`` kernels wrap and cast the
    number again on every call (measured: 3 allocations a call against 0). Never the first
    out-tagged overload: for ``sum.default`` that would be ``sum.IntList_out``.
    """
    want = _arg_signature(func._schema)
    packet = func.overloadpacket
    exact, scalar = None, None
    for name in packet.overloads():
        cand = getattr(packet, name)
        if (_OUT_TAG is None or _OUT_TAG not in cand.tags) and not any(
            a.is_out for a in cand._schema.arguments
        ):
            continue
        sig = _arg_signature(cand._schema)
        if len(sig) != len(want):
            continue
        if sig == want:
            exact = cand
        elif number_args and all(
            # A Scalar schema type prints as "number".
            w == s or (w[0] == s[0] and w[0] in number_args and s[1] in ("Scalar", "number"))
            for w, s in zip(want, sig)
        ):
            scalar = cand
    return exact or scalar


def out_names(op: OpOverload) -> tuple[str, ...]:
    return tuple(a.name for a in op._schema.arguments if a.is_out)


def choose_strategy(func: OpOverload, args: tuple, kwargs: dict) -> Strategy:
    """Pick the replay strategy of a functional op (not a view, not in-place)."""
    name = func.overloadpacket.__name__
    if name in EMPTY_FACTORIES:
        return Strategy("none", why="allocates without writing (contents undefined, as on CUDA)")
    if name in _FILL_FACTORIES:
        return Strategy("fill", why=f"factory replayed as fill_({_FILL_FACTORIES[name]})")
    if name in _FULL_FACTORIES:
        return Strategy("fill", why="factory replayed as fill_(value)")
    if name in _RANDOM_FACTORIES:
        return Strategy("random", why=f"random factory replayed as {_RANDOM_FACTORIES[name]}_()")
    if name in COPY_OPS:
        return Strategy("copy", why="cast/copy replayed as copy_()")
    out = find_out_overload(func, _number_args(func, args, kwargs))
    if out is not None:
        return Strategy("out", op=out, out_names=out_names(out), why=f"replays through {out}")
    return Strategy("compute", why=f"{func} has no .out, in-place, fill or copy form; "
                    "replay computes it and copies into the captured memory (allocates)")


def fill_value(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """The value a fill-replayed factory writes."""
    name = func.overloadpacket.__name__
    if name in _FILL_FACTORIES:
        return _FILL_FACTORIES[name]
    pos = _FULL_FACTORIES[name]
    if name == "scalar_tensor":
        return args[0] if args else kwargs["s"]
    return args[pos] if len(args) > pos else kwargs["fill_value"]


def random_call(func: OpOverload, args: tuple, kwargs: dict) -> tuple[str, tuple, dict]:
    """The in-place method and arguments that draw what a random factory draws."""
    name = func.overloadpacket.__name__
    kind = _RANDOM_FACTORIES[name]
    gen = kwargs.get("generator")
    extra: dict[str, Any] = {} if gen is None else {"generator": gen}
    if kind == "normal":
        return "normal_", (0.0, 1.0), extra
    if kind == "uniform":
        return "uniform_", (0.0, 1.0), extra
    # randint(high, size) / randint(low, high, size) / randint_like(self, high) / (self, low, high)
    ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    if name == "randint":
        bounds = (0, args[0]) if func._overloadname in ("default", "generator") else (args[0], args[1])
    else:
        bounds = (0, ints[0]) if len(ints) == 1 else (ints[0], ints[1])
    return "random_", bounds, extra


def is_factory_kwarg(name: str) -> bool:
    return name in _FACTORY_KWARGS
