"""Eager islands in a native capture (cuda, hip, xpu): one torch graph per *piece*, all in the
graph's one pool, with the islands run eagerly between them (issue 26; vLLM's piecewise and
SGLang's breakable CUDA graphs). UNVERIFIED on hardware: tested against the FAKE modules only
(tests/backends/test_fake_native_islands.py); ``tools/device_check.py`` has the GPU row.

A capture begins as one torch graph. At an island (``accel_graph.eager_island``) on the
capturing thread, :class:`Pieces` (the runner :class:`~.backend.NativeGraphImpl` installs):

1. ends the current piece's torch graph (``capture_end``; instantiated as usual);
2. replays that piece once: stream capture runs no kernels, so this is what gives the island
   real values. It is a warm-up in torch's sense too: its in-place writes to captured tensors
   (a KV cache) and its random draws happen now, once more than in eager;
3. runs the island eagerly on the capture's stream, under the capture's grad and inference
   modes (``running_island``: islands nested in it are plain calls; the control-flow mode is
   lifted, so ``torch.cond`` in it runs eagerly too);
4. checks its outputs (``capture_common.island_outputs``: tensors or pytrees of them, None
   allowed, on the graph's device, not an argument's memory nor the graph pool's as torch's
   snapshot reports its segments, no grad), allocates static buffers
   for them *in the graph's pool* and copies the outputs in;
5. begins the next piece's torch graph in the same pool, with the same capture mode, and
   returns the buffers, in the island's structure, to the caller.

Buffers go into the pool through torch's allocate-to-pool routing
(:meth:`~.pools.NativePoolTable.allocating_to`: ``torch._C._cuda_beginAllocateCurrentThreadToPool``
or the ``_xpu_`` one, what ``torch.cuda.use_mem_pool`` calls). Where a torch has no such routing,
the buffers are allocated as the first thing of the next piece's capture (allocations during a
capture go to its pool; no kernel runs) and the outputs are copied in once that piece's capture
ended, before its warm-up replay (:attr:`Pieces.allocation` says which was used).

Replay runs piece 0, island 0, piece 1, ...: each island is called with the argument objects
of its capture (tensors at static addresses: pool tensors and tensors captured by reference,
holding the live values at that point), its outputs are checked (:class:`ReplayError` naming
the island and its source line, before anything is copied: nothing after it runs and the next
valid replay works) and copied into the buffers. Pieces sharing one pool replay in capture
order, which is torch's rule for graphs sharing a pool.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

from ...errors import CaptureError
from ..base import DeviceSpec
from ..capture_common.dispatch_stack import lifted
from ..capture_common.frames import user_frame
from ..capture_common.island_outputs import (
    IslandCall,
    autocast_state,
    awaited,
    check_argument_devices,
    check_outputs,
    held_storages,
)
from ..capture_common.islands import IslandInfo, check_not_refused, running_island

__all__ = ["IslandStep", "PieceHost", "Pieces", "debug_dump", "make_replay"]


class PieceHost(Protocol):
    """What :class:`Pieces` needs of the graph capturing (:class:`~.backend.NativeGraphImpl`,
    typed by its surface so the two modules do not import each other)."""

    device: DeviceSpec
    keep_graph: bool

    def island_device(self) -> torch.device: ...

    def control_flow_mode(self) -> Any: ...

    def end_piece(self) -> Any: ...

    def begin_piece(self) -> None: ...

    def allocating_to_pool(self) -> contextlib.AbstractContextManager[bool]: ...

    def pool_ranges(self) -> list[tuple[int, int]] | None: ...


class IslandStep:
    """One island between two pieces: its replay call, the argument objects it was captured
    with, and the static buffers (in the graph's pool) its outputs are copied into."""

    __slots__ = ("call", "args", "kwargs", "buffers")

    def __init__(self, call: IslandCall, args: tuple, kwargs: dict, buffers: tuple) -> None:
        self.call = call
        self.args = args
        self.kwargs = kwargs
        self.buffers = buffers

    def __call__(self) -> None:
        self.call(self.args, self.kwargs, self.buffers)


class Pieces:
    """The pieces and islands of one native capture. Empty (falsy) until an island is called.

    ``graphs``: the torch graphs of the pieces ended so far, in order (the last piece is the
    host's current graph until :meth:`finish` appends it); ``steps[i]`` runs between
    ``graphs[i]`` and ``graphs[i + 1]``. ``broken``: why the capture cannot be used (an island or
    a piece boundary raised), else None."""

    def __init__(self, host: PieceHost) -> None:
        self._host = weakref.ref(host)
        self.graphs: list[Any] = []
        self.steps: list[IslandStep] = []
        self.broken: str | None = None
        self.over = False
        #: How island buffers were put in the pool: "routed" (torch's allocate-to-pool
        #: routing), "in capture" (first thing of the next piece's capture), None (no island).
        self.allocation: str | None = None
        # "in capture" only: outputs waiting to be copied into their buffers once the piece
        # that allocated them ended (buffers, outputs).
        self._pending: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def __bool__(self) -> bool:
        return bool(self.steps)

    # -- capture ---------------------------------------------------------------------------
    def run(self, info: IslandInfo, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The island runner (``capture_common.islands.Runner``) of this capture."""
        host = self._host()
        if host is None or self.over or self.broken is not None:
            # The capture is gone, over, or already invalid (capture_end will say so): as every
            # op then runs eagerly, so does the island.
            return fn(*args, **kwargs)
        try:
            return self._island(host, info, fn, args, kwargs)
        except BaseException as exc:
            # Whatever state the boundary was left in, the capture must not be used: the island
            # neither ran at its place nor was captured (capture_end raises, abort cleans up).
            self.broken = f"eager island {info}: {type(exc).__name__}: {str(exc)[:300]}"
            raise

    def _island(self, host: PieceHost, info: IslandInfo, fn: Callable[..., Any], args: tuple,
                kwargs: dict) -> Any:
        where = user_frame()
        check_not_refused(info, where, f"a capture on {host.device}")
        flow = host.control_flow_mode()
        if flow is not None and flow.depth:
            raise CaptureError(
                f"eager island {info} called inside a torch.cond branch or a torch.while_loop "
                f"body during a native capture on {host.device} (at {where}): the branch is a "
                f"conditional node evaluated on the device at replay, and a graph cannot stop "
                f"there to run Python. Call the island outside the cond/while_loop (an island "
                f"may branch on values in Python itself), or capture on the recorder")
        device = host.island_device()
        check_argument_devices(info, (args, kwargs), where, device)
        self._end_piece(host)
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        autocast = autocast_state(device.type)
        with (lifted(flow) if flow is not None else contextlib.nullcontext()), running_island():
            out = fn(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        leaves = [awaited(x) for x in leaves]
        check_outputs(info, leaves, (args, kwargs), where, device, grad and not inference,
                      _in_ranges(host.pool_ranges()), held_storages(fn))
        outputs = [x for x in leaves if x is not None]
        slots: list[int | None] = []
        for x in leaves:
            slots.append(None if x is None else sum(s is not None for s in slots))
        # Buffers are made outside inference mode (so users and later pieces may write them)
        # and outside autograd (they are static copies).
        with torch.inference_mode(False), torch.no_grad():
            with host.allocating_to_pool() as routed:
                if routed:
                    buffers = _buffers_like(outputs)
            if routed:
                for b, x in zip(buffers, outputs):
                    b.copy_(x)
                self.allocation = "routed"
            host.begin_piece()
            if not routed:
                buffers = _buffers_like(outputs)  # inside the new piece's capture: its pool
                self._pending = (buffers, outputs)
                self.allocation = "in capture"
        call = IslandCall(info, fn, spec, tuple(slots), grad, inference, where, autocast,
                          replay_inference=False)
        self.steps.append(IslandStep(call, args, kwargs, tuple(buffers)))
        return pytree.tree_unflatten([None if s is None else buffers[s] for s in slots], spec)

    def _end_piece(self, host: PieceHost) -> None:
        """End the current piece and replay it once (the island's real values)."""
        graph = host.end_piece()
        self.graphs.append(graph)
        self._copy_pending()
        graph.replay()

    def _copy_pending(self) -> None:
        if self._pending is not None:
            buffers, outputs = self._pending
            self._pending = None
            with torch.inference_mode(False), torch.no_grad():
                for b, x in zip(buffers, outputs):
                    b.copy_(x)

    def end_capture(self) -> None:
        """The last piece's capture ended: islands are plain calls from now on, and the last
        island's buffers get its capture values (as when routed; "in capture" only)."""
        self.over = True
        self._copy_pending()

    def finish(self, last_graph: Any) -> Callable[[], None]:
        """The capture ended with ``last_graph`` as its last piece (instantiated): the replay of
        the whole sequence (a closure over the pieces, the per-replay path)."""
        self.over = True
        self.graphs.append(last_graph)
        return make_replay(self.graphs, self.steps)

    def drop(self) -> list[Any]:
        """Forget everything (abort, reset); returns the pieces' torch graphs to reset."""
        graphs, self.graphs, self.steps, self._pending = self.graphs, [], [], None
        self.over = True
        return graphs

    # -- debug_dump ----------------------------------------------------------------------------
    def listing(self, piece_files: list[str], title: str) -> str:
        """A DOT digraph naming the pieces (with their dump files) and islands in order."""
        lines = [f"digraph accel_graph {{\n  label={_dot(title)};\n  rankdir=TB;"]
        for i, path in enumerate(piece_files):
            lines.append(f"  piece{i} [shape=box, label={_dot(f'piece {i}: {path}')}];")
            if i < len(self.steps):
                call = self.steps[i].call
                label = (f"eager island {i}: {call.info.name}\\ndefined at {call.info.source}"
                         f"\\ncalled at {call.where}\\noutputs {len(self.steps[i].buffers)}")
                lines.append(f"  island{i} [shape=ellipse, label={_dot(label)}];")
                lines.append(f"  piece{i} -> island{i};\n  island{i} -> piece{i + 1};")
        lines.append("}")
        return "\n".join(lines) + "\n"


def make_replay(graphs: list[Any], steps: list[IslandStep]) -> Callable[[], None]:
    """Replay ``graphs[0]``, ``steps[0]``, ``graphs[1]``, ... in order (bound methods taken once,
    so a replay pays only the calls themselves)."""
    first = graphs[0].replay
    rest = [(step, g.replay) for step, g in zip(steps, graphs[1:])]

    def replay() -> None:
        first()
        for island, piece in rest:
            island()
            piece()

    return replay


def debug_dump(chain: Pieces, last: Any, path: str, dump: Callable[[Any, str], None] | None,
               device: str, nbytes: int | None) -> None:
    """``Graph.debug_dump`` of a native graph whose last (or only) torch graph is ``last``:
    without islands torch's DOT dump at ``path``; with them each piece's at
    ``path.piece<i>.dot`` and at ``path`` a DOT listing of the pieces and islands in order.
    ``dump(graph, file)`` writes torch's dump; None (debug mode was off at capture: torch kept
    nothing) writes a placeholder DOT file and warns, rather than leave a missing file."""
    graphs = list(chain.graphs)
    if not any(g is last for g in graphs):  # no island, or keep_graph not instantiated yet
        graphs.append(last)
    if len(graphs) == 1:
        files = [path]
    else:
        files = [f"{path}.piece{i}.dot" for i in range(len(graphs))]
    if dump is None:
        warnings.warn(
            f"debug_dump on {device}: call enable_debug_mode() before capture to get the kernel "
            f"graph; wrote a placeholder to {', '.join(files)}",
            stacklevel=4,
        )
    for g, f in zip(graphs, files):
        if dump is not None:
            dump(g, f)
            continue
        with open(f, "w", encoding="utf-8") as out:
            out.write(f'digraph accel_graph {{\n  label="{device}: captured, debug mode was '
                      f'off; memory_bytes={nbytes}";\n}}\n')
    if len(graphs) > 1:
        title = (f"{device}: {len(graphs)} pieces, {len(graphs) - 1} eager islands; "
                 f"memory_bytes={nbytes}")
        with open(path, "w", encoding="utf-8") as out:
            out.write(chain.listing(files, title))


def _in_ranges(ranges: list[tuple[int, int]] | None) -> Callable[[torch.Tensor], bool] | None:
    """Whether a tensor's memory lies in one of ``ranges`` (the graph pool's segments: an
    island output there is a static tensor of the graph, refused like an argument's memory)."""
    if not ranges:
        return None

    def owns(x: torch.Tensor) -> bool:
        p = x.untyped_storage().data_ptr()
        return any(a <= p < b for a, b in ranges)

    return owns


def _buffers_like(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Uninitialised tensors of the outputs' shapes, dtypes and devices (dense layouts kept,
    as ``empty_like``)."""
    out = []
    for x in outputs:
        stride = torch.empty_like(x, device="meta").stride()
        out.append(torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device))
    return out


def _dot(text: str) -> str:
    return '"' + text.replace('"', "'") + '"'
