"""What every capture shares, whichever backend records it: the recorder, the native backends'
control-flow mode, and ``check_capturable`` / ``check_capturable(steps=2)`` (which capture
nothing but apply the same rules).

Neutral ground: nothing here imports the recorder (``backends/recorder/``) or the native family
(``backends/native/``); both import from here, as do ``graphs/`` and ``runner/``. So the rules a
capture enforces are stated once and a check of them never loads a backend.

- :mod:`.illegal_ops`: the aten ops a device graph cannot capture, with the fix to suggest;
  :mod:`.collective_rules`: which ops are collectives and which of those (and which
  ``torch.distributed`` functions) a capture refuses.
- :mod:`.hostreads`: the host reads the dispatcher never sees (``tolist()``, ``repr``, ...),
  refused in a capture, reported by ``check_capturable``; :mod:`.scoped_patch` counts the
  interceptions that exist only while some capture is underway.
- :mod:`.control_flow`: the higher-order operators a capture takes (``torch.cond``,
  ``torch.while_loop``, ``switch``), the branch/carry checks, the TorchDynamo skip repair.
- :mod:`.dispatch_stack`: the calling thread's torch dispatch-mode stack (read it, take one mode
  off it wherever it sits).
- :mod:`.frames`: the user's source line an error about an op names.
- :mod:`.pytree`: a fast subset of torch's pytree over aten arguments.
- :mod:`.poison`: the fill that shows reads of memory nothing wrote (debug captures).
- :mod:`.islands`: eager islands' meeting point (``accel_graph.eager_island`` marks callables,
  a capturing backend installs the runner that runs them inside its capture).
"""
