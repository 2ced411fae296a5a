"""Static inputs of a GraphRunner: one buffer per input leaf, sized for the largest bucket.

Everything a call needs per live batch size ``n`` is built once at capture (views for the live
rows and the padded rows), so the hot path only compares shapes, copies and fills.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError

__all__ = ["ExampleInputs", "InputSpec", "broadcast", "leaf_names"]


def leaf_names(args: tuple, kwargs: dict) -> list[str]:
    """Readable names of the leaves of ``(args, kwargs)``, in pytree order: ``args[0]``,
    ``args[1][2]``, ``kwargs['mask']``."""
    paths, _ = pytree.tree_flatten_with_path((args, kwargs))
    names = []
    for path, _leaf in paths:
        head, rest = path[0], path[1:]
        base = "args" if getattr(head, "idx", 0) == 0 else "kwargs"
        names.append(base + "".join(str(k) for k in rest))
    return names


def broadcast(value: Any, spec: pytree.TreeSpec, what: str, default: Any) -> list[Any]:
    """``value`` broadcast to one entry per leaf of ``spec`` (the spec of ``(args, kwargs)``).

    A scalar (or None) applies to every leaf; a tuple/list gives one entry per positional
    argument (each a scalar or a tree matching that argument, as vmap's ``in_dims``) and leaves
    keyword inputs at ``default``; a dict gives entries per keyword argument and leaves
    positional inputs at ``default``.
    """
    if not isinstance(value, (tuple, list, dict)):
        return [value] * spec.num_leaves
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    args_spec, kwargs_spec = children
    out: list[Any] | None
    if isinstance(value, dict):
        rest = pytree._broadcast_to_and_flatten(value, kwargs_spec)
        out = None if rest is None else [default] * args_spec.num_leaves + rest
    else:
        head = pytree._broadcast_to_and_flatten(tuple(value), args_spec)
        out = None if head is None else head + [default] * kwargs_spec.num_leaves
    if out is None:
        raise ConfigError(
            f"{what}={value!r} does not match the structure of the example inputs; give one "
            f"value for all inputs, a tuple with one entry per positional argument, or a dict "
            f"per keyword argument"
        )
    return out


@dataclass
class InputSpec:
    """One input leaf: what a call must pass, where it is copied, and how it is padded."""

    name: str
    dtype: torch.dtype
    device: torch.device
    batch_dim: int | None
    pad: float | int | bool
    is_index: bool
    #: Shape of the example with the batch dimension shown as ``B``, for messages.
    shape_text: str
    static: torch.Tensor = field(repr=False)
    #: ``live[n]``: the first n rows of the static buffer (the whole buffer if unbatched).
    live: list[torch.Tensor] = field(default_factory=list, repr=False)

    @classmethod
    def build(cls, name: str, example: Any, batch_dim: Any, pad: Any, pad_index: Any,
              rows: int, device: torch.device) -> InputSpec:
        if not isinstance(example, torch.Tensor):
            raise ConfigError(
                f"example input {name} is a {type(example).__name__}; GraphRunner inputs must be "
                f"tensors (bake constants into the function instead)"
            )
        if example.device != device:
            raise ConfigError(f"example input {name} is on {example.device}, the runner on {device}")
        if batch_dim is not None:
            if isinstance(batch_dim, bool) or not isinstance(batch_dim, int):
                raise ConfigError(f"batch_dim for {name} must be an int or None, got {batch_dim!r}")
            if example.dim() == 0:
                raise ConfigError(f"example input {name} is 0-dim; it has no batch dimension (use batch_dim=None)")
            if not -example.dim() <= batch_dim < example.dim():
                raise ConfigError(
                    f"batch_dim={batch_dim} is out of range for {name} of shape {tuple(example.shape)}"
                )
            batch_dim %= example.dim()
            if example.shape[batch_dim] < 1:
                raise ConfigError(f"example input {name} has an empty batch dimension")
        is_index = pad_index is not None
        value = pad_index if is_index else (0 if pad is None else pad)
        if is_index and (example.dtype.is_floating_point or example.dtype.is_complex):
            raise ConfigError(f"pad_index given for {name}, but it is {example.dtype}, not an index tensor")
        if not isinstance(value, (int, float, bool)):
            raise ConfigError(f"pad value for {name} must be a number, got {value!r}")
        dims = [str(s) for s in example.shape]
        if batch_dim is None:
            static = example.detach().clone()
        else:
            dims[batch_dim] = "B"
            shape = list(example.shape)
            shape[batch_dim] = rows
            static = torch.empty(shape, dtype=example.dtype, device=device)
            static.fill_(value)
        return cls(name, example.dtype, device, batch_dim, value, is_index,
                   f"{example.dtype}[{', '.join(dims)}] on {device}", static)

    def view(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the static buffer (the whole buffer if unbatched)."""
        if self.batch_dim is None:
            return self.static
        return self.static.narrow(self.batch_dim, 0, n)

    def fill_bucket(self, example: torch.Tensor, bucket: int) -> None:
        """Warm-up data for ``bucket``: the example's rows, the rest padding."""
        if self.batch_dim is None:
            self.static.copy_(example)
            return
        k = min(example.shape[self.batch_dim], bucket)
        self.static.narrow(self.batch_dim, 0, k).copy_(example.narrow(self.batch_dim, 0, k))
        if bucket > k:
            self.static.narrow(self.batch_dim, k, bucket - k).fill_(self.pad)

    def mismatch(self, x: Any, n: int) -> str:
        """Why ``x`` cannot be this input at batch ``n`` (slow path, for the error message)."""
        expected = self.shape_text.replace("B", str(n)) if self.batch_dim is not None else self.shape_text
        if not isinstance(x, torch.Tensor):
            got = type(x).__name__
        else:
            got = f"{x.dtype}[{', '.join(map(str, x.shape))}] on {x.device}"
        return f"input {self.name}: expected {expected} (batch dim {self.batch_dim}), got {got}"


@dataclass(frozen=True)
class ExampleInputs:
    """The example inputs of ``GraphRunner(...)``, flattened, with the runner's device and one
    :class:`InputSpec` (static buffer) per leaf: what the runtime's input fields are built from."""

    #: One static input per input leaf, in pytree order of ``(args, kwargs)``.
    inputs: list[InputSpec]
    #: The example leaves (detached), whose rows seed each bucket's warm-up.
    examples: list[torch.Tensor]
    #: The pytree structure of ``(args, kwargs)`` every call must match.
    in_spec: pytree.TreeSpec
    #: The example's keyword names, in the order they were flattened.
    kw_order: dict[str, None]
    #: True when the inputs are positional tensors only: a call's args are the leaves.
    flat_args: bool
    #: The runner's device: ``device=``, else the first input's (with its index).
    device: torch.device

    @classmethod
    def build(cls, example_inputs: Any, example_kwargs: Any, device: Any, batch_dim: Any,
              pad_value: Any, pad_index: Any, max_bucket: int) -> ExampleInputs:
        """Flatten the examples and size a static buffer per leaf for ``max_bucket`` rows;
        ``ConfigError`` when they hold no tensor or do not fit the per-input settings."""
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        kwargs = dict(example_kwargs or {})
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        if not leaves:
            raise ConfigError("example_inputs has no tensors; GraphRunner needs at least one input")
        first = next((x for x in leaves if isinstance(x, torch.Tensor)), None)
        if first is None:
            raise ConfigError("example_inputs holds no tensor")
        dev = torch.device(device) if device is not None else first.device
        if dev.type != "cpu" and dev.index is None and first.device.type == dev.type:
            dev = first.device
        names = leaf_names(args, kwargs)
        dims = broadcast(batch_dim, in_spec, "batch_dim", 0)
        pads = broadcast(pad_value, in_spec, "pad_value", 0)
        idx = broadcast(pad_index, in_spec, "pad_index", None)
        inputs = [
            InputSpec.build(nm, x, d, p, i, max_bucket, dev)
            for nm, x, d, p, i in zip(names, leaves, dims, pads, idx)
        ]
        return cls(
            inputs=inputs,
            examples=[x.detach() for x in leaves],
            in_spec=in_spec,
            kw_order=dict.fromkeys(kwargs),
            # Fast path: positional tensors only, no kwargs: the call's args are the leaves.
            flat_args=not kwargs and all(isinstance(a, torch.Tensor) for a in args),
            device=dev,
        )
