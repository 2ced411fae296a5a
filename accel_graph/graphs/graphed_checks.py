"""Argument checks of :func:`accel_graph.make_graphed_callables`: what a callable, its sample
arguments and its outputs must be (torch's rules, refused in our words, naming the argument)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ..errors import CaptureError, ConfigError

__all__ = ["check_autocast", "check_module", "describe", "flatten_args", "output_leaves"]


def check_autocast(device: torch.device | None) -> None:
    # Autocast's cast cache would hand the capture tensors cast before it (or keep pool tensors
    # alive after it); torch refuses it for the same reason. torch checks CUDA's autocast (the
    # no-argument form); the graphs' own device type is checked too.
    kinds = [None] if device is None or device.type == "cuda" else [None, device.type]
    enabled = any(torch.is_autocast_enabled(*([k] if k else [])) for k in kinds)
    if enabled and torch.is_autocast_cache_enabled():
        raise CaptureError(
            "make_graphed_callables cannot run under autocast with its cast cache enabled: cached "
            "casts would leak into (or out of) the captured graphs. Use "
            "torch.autocast(..., cache_enabled=False)"
        )


def describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_module(i: int, c: torch.nn.Module) -> None:
    hooks = {
        "forward hooks": c._forward_hooks,
        "forward pre-hooks": c._forward_pre_hooks,
        "backward hooks": c._backward_hooks,
    }
    found = [name for name, table in hooks.items() if len(table)]
    if found:
        raise ConfigError(
            f"callables[{i}] ({type(c).__name__}) has {', '.join(found)} registered: a captured "
            f"graph would run them once, at capture, never at replay. Register hooks after "
            f"make_graphed_callables, or remove them first"
        )
    for name, b in c.named_buffers():
        if b.requires_grad:
            raise ConfigError(
                f"buffer {name!r} of callables[{i}] ({type(c).__name__}) requires grad: only "
                f"parameters may be trainable in a graphed module (their gradients are the "
                f"backward graph's outputs). Set requires_grad=False on the buffer, or make it a "
                f"Parameter"
            )


def flatten_args(i: int, args: object) -> tuple[tuple[torch.Tensor, ...], pytree.TreeSpec]:
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"sample_args[{i}] is a {type(args).__name__}; pass a tuple of the arguments of "
            f"callables[{i}] (with one callable, sample_args itself is that tuple)"
        )
    leaves, spec = pytree.tree_flatten(tuple(args))
    for j, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"sample_args[{i}] holds a {type(leaf).__name__} as flattened argument {j}: only "
                f"tensors may be arguments of a graphed callable (a graph cannot take a new Python "
                f"value at replay). Bind other values with functools.partial or a Module attribute"
            )
    return tuple(leaves), spec


def output_leaves(i: int, outputs: object) -> tuple[list[torch.Tensor], pytree.TreeSpec]:
    leaves, spec = pytree.tree_flatten(outputs)
    for j, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"callables[{i}] returned a {type(leaf).__name__} as flattened output {j}: a "
                f"graphed callable may return only tensors (nested in tuples, lists or dicts), "
                f"because replay cannot produce a new Python value. Return it as a tensor, or "
                f"compute it outside the graphed callable"
            )
    return leaves, spec
