"""Checking a functional op's plan against the real kernel, once per plan.

Meta kernels describe what a kernel returns, and some describe it differently from the kernel
that actually runs:

- ``mkldnn_rnn_layer`` (``nn.LSTM`` on the CPU) returns an undefined workspace when no gradient
  is needed, and a workspace whose size only the oneDNN primitive knows otherwise; its meta
  kernel says an empty uint8 tensor either way. A plan made from the metadata captures and
  then fails at every replay.
- ``reflection_pad2d`` and ``replication_pad2d`` keep a channels_last input's layout on the
  CPU; their meta kernels say contiguous. The next convolution then sees another layout at
  replay than in eager, takes another algorithm, and replay is no longer bitwise equal.

So before a functional plan is cached, :func:`real_run` runs its op once for real on
zero-filled stand-ins of its tensor arguments (never pool memory or user tensors), and the
plan takes its outputs (defined or not, shapes, strides, dtypes) from that run; then
:func:`out_call_fails` runs the replay call the plan chose (the ``.out`` overload) once into
stand-in outputs of those specs, and a call that raises makes the plan replay by computing the
op and copying its results instead. The result is cached with the plan, so this costs one or
two kernel runs on zeros per distinct (op, argument metadata) in the process, and transient
memory for one op's stand-ins.

A check that cannot run says so by returning None, and the plan keeps its metadata: an op that
raises on zero-valued arguments (its errors depend on values, which meta kernels do not see),
and a random op with no ``generator`` argument (running it would consume the caller's random
numbers; with one, a private generator is passed).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload

from ...errors import CaptureError
from ..capture_common.pytree import first_tensor, tree_flatten, tree_map


def standin(x: Any, how: str) -> Any:
    """A stand-in of ``x`` if it is a tensor (``how``: ``"meta"``, or ``"zeros"`` for zero-filled
    memory of the same shape, strides, dtype and device); anything else as it is."""
    if not isinstance(x, torch.Tensor):
        return x
    if how == "meta":
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if x.is_contiguous():
        return torch.zeros_like(x, memory_format=torch.preserve_format)
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).zero_()


def _storages(tree: Any) -> list[int]:
    return [t.untyped_storage()._cdata for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _private_generator(func: OpOverload, args: tuple, kwargs: dict) -> dict | None:
    """kwargs with a private generator for a random op (its draws must not come from the
    caller's generator); None when the op is random and takes no generator."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return kwargs
    names = [a.name for a in func._schema.arguments]
    if "generator" not in names or names.index("generator") < len(args):
        return None  # no generator argument, or one given positionally: cannot swap it safely
    t = first_tensor((args, kwargs))
    try:
        gen = torch.Generator(device=t.device if t is not None else "cpu")
    except RuntimeError:  # a device without Python generators
        return None
    return {**kwargs, "generator": gen}


def real_run(func: OpOverload, args: tuple, kwargs: dict) -> Any | None:
    """``func``'s outputs on zero-filled stand-ins of its tensor arguments, or None when the check
    cannot run (module docstring). Raises CaptureError when the kernel returns an alias of an
    argument where the meta kernel said the output is fresh: capture would then hand out fresh
    memory where eager shares it."""
    kw = _private_generator(func, args, kwargs)
    if kw is None:
        return None
    s_args = tree_map(lambda x: standin(x, "zeros"), args)
    s_kwargs = tree_map(lambda x: standin(x, "zeros"), kw)
    try:
        # Under the caller's grad mode, which some kernels read (stand-ins need no gradient,
        # so no autograd graph is built).
        out = func(*s_args, **s_kwargs)
    except Exception:  # value-dependent errors (zeros are not valid input to every op)
        return None
    inputs = set(_storages((s_args, s_kwargs)))
    if any(s in inputs for s in _storages(out)):
        raise CaptureError(
            f"{func} returns memory of one of its arguments on {first_tensor(out).device}, while "
            f"its meta kernel says a fresh tensor; the recorder cannot capture that faithfully. "
            f"Move this op out of the captured region or file an issue."
        )
    return out


def out_call_fails(func: OpOverload, out_op: OpOverload, names: tuple[str, ...], args: tuple,
                   kwargs: dict, outputs: list[tuple[Any, ...]], device: torch.device) -> str | None:
    """Why replaying ``func`` through ``out_op`` (out arguments ``names``) into outputs of the
    given (shape, stride, dtype) fails, or None when a run on zero-filled stand-ins succeeds
    without resizing or re-pointing any output (or cannot run)."""
    kw = _private_generator(func, args, kwargs)
    if kw is None:
        return None
    outs = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype in outputs]
    s_args = tree_map(lambda x: standin(x, "zeros"), args)
    s_kwargs = tree_map(lambda x: standin(x, "zeros"), kw)
    if len(names) == 1:
        s_kwargs[names[0]] = outs[0] if len(outs) == 1 else outs
    else:
        s_kwargs.update(zip(names, outs))
    before = [(o.shape, o.stride(), o.data_ptr()) for o in outs]
    try:
        out_op(*s_args, **s_kwargs)  # under the caller's grad mode, as replay runs it
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        return f"{out_op} failed on zero stand-ins ({first})"
    if before != [(o.shape, o.stride(), o.data_ptr()) for o in outs]:
        return f"{out_op} resized or re-pointed its outputs on zero stand-ins"
    return None


def spec_of(out: Any) -> tuple[Any, ...]:
    """Per flat output: (shape, stride, dtype) of a tensor, or the value of anything else."""
    return tuple([(o.shape, o.stride(), o.dtype) if isinstance(o, torch.Tensor) else o
                  for o in tree_flatten(out)[0]])


def depends_on_grad_mode(func: OpOverload, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether ``func``'s outputs (``out``, from :func:`real_run` with grad mode on) differ with
    grad mode off. ``mkldnn_rnn_layer`` makes its workspace only with grad mode on; replay,
    which runs under inference mode, must then run it with grad mode on too."""
    with torch.no_grad():
        other = real_run(func, args, kwargs)
    return other is not None and spec_of(other) != spec_of(out)
