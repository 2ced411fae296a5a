"""A synthetic trace shaped like a real CUDA benchmark recording: it starts from a full cache,
calls ``empty_cache`` right after recording starts, and carries stack frames as torch records
them.

Real snapshots of a training benchmark (default settings) look like this: the recording begins
after earlier calls filled the cache (weights and optimiser state live, large freed segments
cached), the benchmark calls ``torch.cuda.empty_cache()`` right after
``_record_memory_history()``, and every event's frames are, innermost first, C++ frames with file
``??`` (``torch::unwind::unwind()``, the caching allocator), then torch's own Python frames
(``torch/nn/modules/...``, ``torch/_tensor.py``), the standard library (``contextlib.py``), then
the user's frames (``train.py``), then the interpreter's start-up (``runpy.py``). The 2.7B-model
recordings themselves are not distributable; :func:`warm_start_trace` builds a small one with the
same structure through the C engine (so segment events and addresses are the native allocator's
own, as in :mod:`.generate`), for tests and benchmarks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..alloc_conf import parse_config
from ..core.engine import Engine
from ..core.settings import EngineSettings
from ..traces.actions import A_ALLOC, A_SEG_FREE
from ..traces.model import Trace
from ..units import MIB

__all__ = ["USER_FILE", "torch_frames", "warm_start_trace"]

#: The user's training script in the frames :func:`torch_frames` builds.
USER_FILE = "/home/user/bench/train.py"
_SITE = "/opt/conda/lib/python3.11/site-packages/torch"
_STDLIB = "/opt/conda/lib/python3.11"


def torch_frames(user_line: int, user_name: str, torch_file: str = "nn/modules/linear.py"
                 ) -> tuple[dict[str, Any], ...]:
    """One allocation's frames as torch records them (``context='all'``, ``stacks='all'``),
    innermost first: C++ (file ``??``), torch's Python, the standard library, the user's
    ``USER_FILE:user_line (user_name)`` called from its ``main``, then ``runpy``."""
    return (
        {"filename": "??", "line": 0, "name": "torch::unwind::unwind()"},
        {"filename": "??", "line": 0, "name": "torch::CapturedTraceback::gather(bool, bool, bool)"},
        {"filename": "??", "line": 0,
         "name": "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(...)"},
        {"filename": f"{_SITE}/{torch_file}", "line": 125, "name": "forward"},
        {"filename": f"{_SITE}/nn/modules/module.py", "line": 1762, "name": "_call_impl"},
        {"filename": f"{_STDLIB}/contextlib.py", "line": 81, "name": "inner"},
        {"filename": USER_FILE, "line": user_line, "name": user_name},
        {"filename": USER_FILE, "line": 200, "name": "main"},
        {"filename": f"{_STDLIB}/runpy.py", "line": 88, "name": "_run_code"},
    )


#: (user line, user function, torch file) per allocation kind of the recorded steps.
_KINDS = ((42, "forward", "nn/modules/linear.py"), (57, "loss_fn", "_tensor.py"),
          (63, "backward", "autograd/graph.py"))


def warm_start_trace(steps: int = 4, *, seed: int = 0, settings: str = "") -> Trace:
    """A CUDA trace that starts from a full cache and empties it first thing.

    Before the recording (not in the events): 6 weight blocks of 20,000,000 requested bytes
    each (20 MiB blocks: each keeps 971,520 bytes of rounding slack, recorded as its
    ``requested_size``), and 4 cached free 64 MiB segments from earlier calls. The recording:
    ``empty_cache`` (4 ``segment_free`` events whose frames name it), then ``steps`` steps of
    forward / loss / backward allocations of 8-24 MiB with torch-shaped frames
    (:func:`torch_frames`; the user's frames name ``forward`` at line 42, ``loss_fn`` at 57,
    ``backward`` at 63). The peak reserved of the whole trace is therefore the start state, and
    the recording's own peak is lower. ``settings``: the allocator config the engine runs under
    (recorded in ``allocator_settings``). Deterministic in its arguments.
    """
    parsed = parse_config(settings)
    eng = Engine(policy="native", upstream="counting",
                 settings=EngineSettings.from_allocator_settings(parsed))
    eng.enable_events()
    rng = np.random.default_rng(seed)
    weights = [eng.malloc(20_000_000) for _ in range(6)]
    for p in [eng.malloc(64 * MIB) for _ in range(4)]:
        eng.free(p)
    eng.drain_events()  # the recording starts here
    eng.empty_cache()
    kinds: list[int] = []
    for _ in range(steps):
        live = []
        for kind in range(3):
            for _ in range(2):
                size = int(rng.integers(8, 24)) * MIB + int(rng.integers(0, 4096))
                live.append(eng.malloc(size))
                kinds.append(kind)
            if kind == 1:  # the forward activations are freed once the loss exists
                for p in live[:2]:
                    eng.free(p)
                live = live[2:]
        for p in live:
            eng.free(p)
    events = eng.drain_events()
    events = events[np.argsort(events["seq"], kind="stable")]
    events["time_us"] = np.arange(len(events), dtype=np.int64) * 5
    segments = eng.snapshot()
    eng.close()
    del weights
    trace = Trace.from_events(events, device_type="cuda", segments=segments,
                              allocator_settings=dict(parsed.to_snapshot_dict()))
    ev = trace.device_traces[0]
    empty_cache = ({"filename": "??", "line": 0, "name": "torch::unwind::unwind()"},
                   {"filename": f"{_SITE}/cuda/memory.py", "line": 222, "name": "empty_cache"},
                   {"filename": USER_FILE, "line": 190, "name": "main"})
    trace.stacks = [torch_frames(*k) for k in _KINDS] + [empty_cache]
    frames = np.full(len(ev), -1, np.int32)
    allocs = np.flatnonzero(ev["action"] == A_ALLOC)
    frames[allocs] = np.asarray(kinds, np.int32)
    seg_free = np.flatnonzero(ev["action"] == A_SEG_FREE)
    frames[seg_free[:4]] = len(_KINDS)
    ev["frames"] = frames
    return trace
