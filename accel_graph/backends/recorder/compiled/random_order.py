"""Random ops in compiled replay draw in program order, also on torches whose Inductor reorders them.

Compiled replay compiles with ``fallback_random`` (:mod:`.settings`): each random op
calls aten's kernel on the global generator, so a replay after ``torch.manual_seed(s)`` draws
what eager draws, provided the kernels run in program order. Since torch 2.13 Inductor's
post-grad passes chain the random ops (``_chain_random_ops_for_ordering``: each one depends on
the one before, through torch's ``control_deps`` operator). torch 2.11 has no such pass and its
scheduler moves the random kernels freely (seen: the 7 draws of tests/conformance/test_random.py
ran in the order 4, 5, 3, 7, 2, 1, 6), so every draw came out different from eager, silently.

On such a torch, :func:`ordering_settings` gives the Inductor setting that runs the same
chaining as a post-grad custom pass (2.11's custom post pass runs exactly where later torches
chain). Feature-detected by API, never by version: a torch with the built-in pass gets nothing;
a torch with neither the pass nor ``preserve_node_ordering`` gets :func:`refusal` for programs
with two random ops or more (interpreted replay, with the reason).

A second 2.11 gap, same file: its Inductor decomposes ``rrelu_with_noise`` even under
``fallback_random``, into draws of its own; such programs are refused too (:data:`DRAWS_DIFFER`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..steps import Step
from .precision_casts import program_steps

__all__ = ["DRAWS_DIFFER", "decomposed_with_other_draws", "ordering_settings", "refusal", "torch_chains_random_ops"]

# torch._inductor is imported inside the functions below, on first use: importing it takes
# seconds, and most processes never compile. Each import is feature-detected there (torch
# 2.11 to 2.14 differ).


@functools.cache
def torch_chains_random_ops() -> bool:
    """True when Inductor itself keeps random ops in program order under ``fallback_random``."""
    try:
        from torch._inductor.fx_passes import post_grad
    except Exception:
        return False
    return hasattr(post_grad, "_chain_random_ops_for_ordering")


def _preserve_node_ordering() -> Any | None:
    try:
        from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    except Exception:
        return None
    return preserve_node_ordering


def _is_random(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in node.target.tags)


def chain_random_ops(graph: torch.fx.Graph) -> None:
    """Make each random op of ``graph`` depend on the one before it (torch 2.13's pass)."""
    from torch.utils._ordered_set import OrderedSet

    nodes = [n for n in graph.nodes if _is_random(n)]
    if len(nodes) < 2:
        return
    deps = {nodes[i]: OrderedSet([nodes[i - 1]]) for i in range(1, len(nodes))}
    _preserve_node_ordering()(graph, deps)


@functools.cache
def _pass_class() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ChainRandomOps(CustomGraphPass):  # type: ignore[misc]
        """The chaining as Inductor's post-grad custom pass; ``then``: a pass set before."""

        def __init__(self, then: Any = None) -> None:
            self.then = then

        def __call__(self, graph: torch.fx.Graph) -> None:
            if self.then is not None:
                self.then(graph)
            chain_random_ops(graph)

        def uuid(self) -> Any:  # part of Inductor's FX-graph cache key
            inner = self.then.uuid() if hasattr(self.then, "uuid") else None
            return ("accel_graph.chain_random_ops", 1, inner)

    return ChainRandomOps


def _we_can_chain() -> bool:
    """This torch has what :func:`chain_random_ops` needs as a custom post-grad pass."""
    from torch._inductor import config as inductor_config

    return (_preserve_node_ordering() is not None
            and hasattr(inductor_config, "post_grad_custom_post_pass"))


def ordering_settings() -> dict[str, Any]:
    """Inductor settings keeping random ops in order: ``{}`` where Inductor does it itself (or
    nothing can: :func:`refusal` then refuses), else the custom post-grad pass, composed with
    one the user set. Computed for each compilation, before the caller's config patch."""
    if torch_chains_random_ops() or not _we_can_chain():
        return {}
    from torch._inductor import config as inductor_config

    user = inductor_config.post_grad_custom_post_pass
    if isinstance(user, _pass_class()):
        return {}
    return {"post_grad_custom_post_pass": _pass_class()(user)}


#: Random ops whose Inductor decomposition draws other numbers than eager's kernel (the
#: decomposition of ``rrelu_with_noise_functional`` draws a uniform for every element; eager's
#: CPU kernel draws one per non-positive element only), by the op Inductor decomposes.
DRAWS_DIFFER = {"rrelu_with_noise": "rrelu_with_noise_functional",
                "rrelu_with_noise_": "rrelu_with_noise_functional",
                "rrelu_with_noise_functional": "rrelu_with_noise_functional"}


@functools.cache
def decomposed_with_other_draws() -> frozenset[str]:
    """The :data:`DRAWS_DIFFER` ops Inductor still decomposes with ``fallback_random`` on
    (torch 2.11 does for rrelu; 2.13+ keeps it as a fallback kernel)."""
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.decomposition import select_decomp_table

        with inductor_config.patch(fallback_random=True):
            table = select_decomp_table()
        names = {getattr(k, "_opname", None) for k in table if isinstance(k, torch._ops.OpOverload)}
    except Exception:  # cannot tell: refuse them all (the safe side)
        names = set(DRAWS_DIFFER.values())
    return frozenset(n for n in DRAWS_DIFFER.values() if n in names)


def refusal(steps: list[Step]) -> str | None:
    """Why the program ``steps`` cannot be compiled with eager's draws, or None: a random op
    this torch's Inductor decomposes into other draws (:data:`DRAWS_DIFFER`), or two random
    ops or more on a torch that cannot chain them (control-flow sub-programs included)."""
    random = [s for s in program_steps(steps)
              if torch.Tag.nondeterministic_seeded in getattr(s.func, "tags", ())]
    for step in random:
        target = DRAWS_DIFFER.get(getattr(step.func, "_opname", ""))
        # rrelu draws only in training (its 5th argument); in eval it is a leaky ReLU
        training = step.args[4] if len(step.args) > 4 else step.kwargs.get("training", False)
        if target is not None and training and target in decomposed_with_other_draws():
            return (f"torch {torch.__version__}'s Inductor decomposes aten.{target} even with "
                    f"fallback_random, drawing other numbers than eager's {step.func} kernel")
    random_ops = len(random)
    if random_ops < 2 or torch_chains_random_ops() or _we_can_chain():
        return None
    return (f"torch {torch.__version__}'s Inductor may reorder the program's {random_ops} random "
            f"ops and has no way to chain them (no _chain_random_ops_for_ordering, no "
            f"preserve_node_ordering), so replay would draw other numbers than eager")
