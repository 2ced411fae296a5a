"""``torch.cond`` / ``torch.while_loop`` / ``switch`` in a capture: what every backend that
captures them shares, and what ``check_capturable`` reports about them.

- :data:`SUPPORTED`: the higher-order operators a capture takes (the recorder everywhere; the
  native backends where their torch can build conditional nodes).
- :func:`same_meta`: the check that branch outputs (or a loop's carries and its body's results)
  match, with the error that names both sides.
- :func:`undo_dynamo_skip`: the repair of TorchDynamo's cached skip after an eager ``torch.cond``
  ran under a user dispatch mode (every capturing or flagging mode calls it).
"""

from __future__ import annotations

import sys
import types

import torch

from ...errors import CaptureError

__all__ = ["SUPPORTED", "same_meta", "undo_dynamo_skip"]

#: Higher-order operators the recorder captures, by ``HigherOrderOperator.name()`` (``switch``
#: only where this torch has it: the recorder's ``register_rules`` skips operators torch lacks).
SUPPORTED = ("cond", "while_loop", "switch")


def same_meta(a: list[torch.Tensor], b: list[torch.Tensor], what: str, why: str = "") -> None:
    """Raise :class:`CaptureError` naming both sides unless ``a`` and ``b`` (a branch's and the
    other branch's outputs, or a loop's carries and its body's results) match in number, shape,
    dtype and device. ``why`` adds what a mismatch would do on this backend."""
    if len(a) != len(b):
        raise CaptureError(f"{what}: {len(a)} outputs against {len(b)}; they must match")
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            raise CaptureError(
                f"{what}: output {i} is {x.dtype}{list(x.shape)} on {x.device} against "
                f"{y.dtype}{list(y.shape)} on {y.device}; torch.cond and torch.while_loop require "
                f"the same shape, dtype and device{why}"
            )


#: The wrappers eager torch.cond / torch.while_loop hand to torch.compile, by module and
#: enclosing function.
_EAGER_WRAPPERS = (("torch._higher_order_ops.cond", "cond", "_cond_op_wrapper"),
                   ("torch._higher_order_ops.while_loop", "while_loop", "_while_loop_op_wrapper"),
                   ("torch._higher_order_ops.switch", "switch", "run_switch"))


def undo_dynamo_skip() -> None:
    """Let eager ``torch.cond``/``torch.while_loop`` compile again after one ran under a mode.

    Eager torch.cond runs its operator inside ``torch.compile``; under a user dispatch mode
    TorchDynamo skips that frame (pytorch#163013) and caches the skip on the wrapper's code
    object, after which every eager torch.cond of the process fails with ``Unsupported``. This
    resets the wrappers' code to the default strategy. Feature-detected: does nothing where the
    torch build lacks these internals (or has not imported TorchDynamo: nothing to repair then,
    and importing it here would cost seconds).
    """
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    dtypes = sys.modules.get("torch._dynamo.types")
    if dynamo is None or dtypes is None:
        return
    try:
        default = dtypes.FrameExecStrategy(dtypes.FrameAction.DEFAULT, dtypes.FrameAction.DEFAULT)
        for module, func, wrapper in _EAGER_WRAPPERS:
            fn = getattr(sys.modules.get(module), func, None)
            for const in getattr(getattr(fn, "__code__", None), "co_consts", ()):
                if isinstance(const, types.CodeType) and const.co_name == wrapper:
                    dynamo.set_code_exec_strategy(const, default)
    except (AttributeError, TypeError):  # pragma: no cover - other torch internals
        return
