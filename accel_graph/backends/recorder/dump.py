"""``debug_dump`` for recorder graphs: DOT at ``path`` and JSON at ``path + ".json"``.

Works without ``enable_debug_mode()``: the recorder always knows its program. The JSON lists
ops, inputs, outputs, which ops allocate at replay and why, the eager islands (``islands``:
step index, name, definition line, calling line, static outputs) and the pool's bytes.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..capture_common.pytree import tree_flatten
from .islands import is_island_step
from .pool_protocol import ADDRESS, PoolRef
from .program import allocates_at_replay
from .steps import InputRecord, Step

SCHEMA_VERSION = 1


def _ref_name(ref: PoolRef) -> str:
    if ref.segment == ADDRESS:  # CPU pool: the offset is the address
        return f"pool:{ref.byte_offset:#x}"
    return f"pool:{ref.segment:#x}+{ref.byte_offset}"  # device pool: segment and offset


def describe(steps: list[Step], inputs: list[InputRecord], outputs: list[PoolRef],
             extra: dict[str, Any]) -> dict[str, Any]:
    """JSON-ready description of a captured program (``steps`` as captured, with PoolRefs)."""
    by_storage = {rec.tensor.untyped_storage()._cdata: f"in{i}" for i, rec in enumerate(inputs)}

    def name(x: Any) -> str | None:
        if isinstance(x, PoolRef):
            return _ref_name(x)
        if isinstance(x, torch.Tensor):
            return by_storage.get(x.untyped_storage()._cdata, "const")
        return None

    ops = []
    for n, s in enumerate(steps):
        reads = [nm for nm in (name(a) for a in tree_flatten((s.args, s.kwargs))[0]) if nm]
        written = [nm for nm in (name(o) for o in s.outputs) if nm]
        ops.append({
            "index": n,
            "op": str(s.func),
            "kind": s.kind,
            "inputs": reads,
            "outputs": written,
            "replay_op": str(s.strategy.op) if s.strategy and s.strategy.op else str(s.func),
            "allocates_at_replay": allocates_at_replay(s),
            "why": s.strategy.why if s.strategy else "in-place or out= op replayed as called",
        })
    # Eager islands (islands.py): host steps that split the program into pieces.
    isl = [{"index": n, "name": s.extra.info.name, "source": s.extra.info.source,
            "called_at": s.extra.where, "outputs": [_ref_name(o) for o in s.outputs]}
           for n, s in enumerate(steps) if is_island_step(s)]
    return {
        "schema_version": SCHEMA_VERSION,
        "islands": isl,
        "backend": "recorder",
        "num_ops": len(steps),
        "inputs": [
            {"name": f"in{i}", "shape": list(r.shape), "stride": list(r.stride),
             "dtype": str(r.tensor.dtype), "device": str(r.tensor.device)}
            for i, r in enumerate(inputs)
        ],
        "outputs": [
            {"name": _ref_name(r), "shape": list(r.shape), "stride": list(r.stride), "dtype": str(r.dtype)}
            for r in outputs
        ],
        "ops": ops,
        "allocating_ops": sum(op["allocates_at_replay"] for op in ops),
        **extra,
    }


def write_dump(path: str, desc: dict[str, Any]) -> None:
    """Write ``desc`` as DOT at ``path`` and as JSON at ``path + ".json"``."""
    out_names = {o["name"] for o in desc["outputs"]}
    lines = ["digraph accel_graph {", "  rankdir=TB;", "  node [fontname=monospace];"]
    for inp in desc["inputs"]:
        lines.append(f'  "{inp["name"]}" [shape=box,label="{inp["name"]} {inp["shape"]} {inp["dtype"]}"];')
    for op in desc["ops"]:
        node = f"op{op['index']}"
        style = ",color=red" if op["allocates_at_replay"] else ""
        lines.append(f'  {node} [label="{op["op"]}\\n{op["kind"]}"{style}];')
        for a in op["inputs"]:
            lines.append(f'  "{a}" -> {node};')
        for o in op["outputs"]:
            shape = ",shape=doubleoctagon" if o in out_names else ",shape=ellipse"
            lines.append(f'  "{o}" [label="{o}"{shape}];')
            lines.append(f'  {node} -> "{o}";')
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(path + ".json", "w") as f:
        json.dump(desc, f, indent=1)
