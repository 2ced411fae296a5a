"""Allocation sites: the first user Python frame of each allocation (:data:`FRAME_RULE`) and its
user call stack, and the bytes each holds at a moment of a :class:`~.walk.Layout` and over the
whole run (the ``sites``/``stacks`` sections of ``accel-alloc inspect``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from .walk import Layout, Pairs

__all__ = ["ALLOCATOR_ONLY_SITE", "CHAIN_DEPTH", "FRAME_RULE", "NO_FRAMES_SITE", "PRE_EXISTING_SITE", "held_by_site", "site_ids",
           "stack_chains", "stack_sites", "top_user_frame", "user_chain"]

PRE_EXISTING_SITE = "(allocated before the recording began)"
NO_FRAMES_SITE = "(no stack frames)"


# ------------------------------------------------------------------------------------------
# stack frames

#: The frame rule, as reports state it (``sites_rule`` in ``accel-alloc inspect --json``).
FRAME_RULE = (
    "an allocation is attributed to its first (innermost) user Python frame: C++ frames (a "
    "file that is not a .py file, such as '??' from torch::unwind, or a .so/.cpp) are "
    "skipped, and so are Python frames of torch itself (a torch/ or torch_npu/ directory), of "
    "the standard library (lib/pythonX.Y/ outside site-packages) and <...> pseudo-files; "
    "when a stack has no such frame, its first Python frame, else its first frame with a "
    "known file, else its first frame")

#: Directories whose Python frames belong to torch itself (matched as whole path components).
_TORCH_DIRS = ("torch", "torch_npu")
#: User call stacks are labelled with at most this many frames (innermost first).
CHAIN_DEPTH = 6


_PYTHON_DIR = re.compile(r"python\d(\.\d+)?t?")  # python3.11, python3.13t, python3


def _parts(filename: str) -> list[str]:
    return filename.replace("\\", "/").split("/")


def _is_python(filename: str) -> bool:
    """A Python frame: a ``.py`` file or a ``<...>`` pseudo-file (``<frozen runpy>``,
    ``<string>``, FX's ``<eval_with_key>``); everything else (``??``, ``.so``, ``.cpp``,
    ``.h``) is a C++ frame of the unwinder."""
    return filename.endswith(".py") or filename.startswith("<")


def _is_stdlib(parts: list[str]) -> bool:
    """A file under ``lib/pythonX.Y/`` (or ``Lib/`` on Windows) but not in a site-packages /
    dist-packages directory below it."""
    for i, p in enumerate(parts[:-1]):
        if i > 0 and (p == "Lib" or (_PYTHON_DIR.fullmatch(p) is not None
                                     and parts[i - 1].lower() in ("lib", "lib64"))):
            rest = parts[i + 1:-1]
            return not any(r in ("site-packages", "dist-packages") for r in rest)
    return False


def _is_internal(filename: str) -> bool:
    """True for frames that are not user code: C++ frames, torch's and torch_npu's own Python
    frames, the standard library, ``<...>`` pseudo-files."""
    if not filename or filename.startswith("<") or not _is_python(filename):
        return True
    parts = _parts(filename)
    return any(d in parts[:-1] for d in _TORCH_DIRS) or _is_stdlib(parts)


#: Frames of the allocator and of the snapshot machinery itself (torch records them at the top
#: of C++ stacks): never an allocation site, even when a stack has nothing else. A training
#: step's top site was ``memory_snapshot.cpp:0 (gather_with_cpp)``, credited with 28.3 GiB.
_MACHINERY_FILES = re.compile(
    r"(memory_snapshot|CapturedTraceback|\w*CachingAllocator\w*|\w*Allocator(Config)?|"
    r"unwind|combined_traceback)\.(cpp|h|hpp|cc)$", re.I)
_MACHINERY_NAMES = re.compile(
    r"gather_with_cpp|CapturedTraceback|torch::unwind|c10::cuda::CUDACachingAllocator|"
    r"c10_npu::NPUCachingAllocator|DeviceCachingAllocator|NativeCachingAllocator|"
    r"\bmalloc\b.*Allocator|Allocator::\w*alloc", re.I)
ALLOCATOR_ONLY_SITE = "(only allocator/snapshot frames recorded: no user frame)"


def is_machinery(frame: dict[str, Any]) -> bool:
    """A frame of the allocator or of the snapshot machinery (:data:`_MACHINERY_FILES`)."""
    name = _parts(str(frame.get("filename", "")))[-1]
    return bool(_MACHINERY_FILES.search(name) or _MACHINERY_NAMES.search(str(frame.get("name", ""))))


def top_user_frame(stack: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The frame an allocation is attributed to (:data:`FRAME_RULE`): the first (innermost)
    Python frame of a ``.py`` file that is neither torch's own (a ``torch/`` or ``torch_npu/``
    directory, which covers ``site-packages/torch``) nor the standard library's; when there is
    none, the first Python frame (``<...>`` pseudo-files included), else the first frame whose
    file is known (not ``??``), else the first frame; None for an empty stack. Directories are
    matched as whole path components, so ``torchvision/`` or ``mytorch/`` frames count as user
    frames."""
    frames = [f for f in stack if isinstance(f, dict) and not is_machinery(f)]
    if not frames:  # empty, or only allocator/snapshot frames: no site to name
        return None
    names = [str(f.get("filename", "")) for f in frames]
    for f, name in zip(frames, names, strict=True):
        if not _is_internal(name):
            return f
    for f, name in zip(frames, names, strict=True):
        if _is_python(name):
            return f
    for f, name in zip(frames, names, strict=True):
        if name and name != "??":
            return f
    return frames[0]


def user_chain(stack: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The user call stack of an allocation: every user Python frame (as in
    :func:`top_user_frame`), innermost first; ``[top_user_frame(stack)]`` when there are none."""
    frames = [f for f in stack if isinstance(f, dict)]
    out = [f for f in frames if not _is_internal(str(f.get("filename", "")))]
    if out:
        return out
    top = top_user_frame(frames)
    return [] if top is None else [top]


def _site_label(frame: dict[str, Any]) -> str:
    return f"{frame.get('filename', '?')}:{frame.get('line', '?')} ({frame.get('name', '?')})"


def _chain_label(chain: list[dict[str, Any]]) -> str:
    shown = " <- ".join(_site_label(f) for f in chain[:CHAIN_DEPTH])
    return shown + (f" <- ... ({len(chain) - CHAIN_DEPTH} more)" if len(chain) > CHAIN_DEPTH
                    else "")


def _intern(trace: Any, key_of: Any) -> tuple[np.ndarray, list[str]]:
    labels = [NO_FRAMES_SITE, PRE_EXISTING_SITE]
    index: dict[str, int] = {}
    ids = np.zeros(len(trace.stacks), np.int64)
    for i, st in enumerate(trace.stacks):
        label = key_of(st)
        if label is None:
            continue
        if label not in index:
            index[label] = len(labels)
            labels.append(label)
        ids[i] = index[label]
    return ids, labels


def stack_sites(trace: Any) -> tuple[np.ndarray, list[str]]:
    """(site id per stack, labels): id 0 is "no stack frames", 1 "allocated before the recording
    began", then one id per distinct top user frame."""
    def key(st: Any) -> str | None:
        f = top_user_frame(st)
        if f is None:
            return ALLOCATOR_ONLY_SITE if any(isinstance(x, dict) for x in st) else None
        return _site_label(f)
    return _intern(trace, key)


def stack_chains(trace: Any) -> tuple[np.ndarray, list[str]]:
    """Like :func:`stack_sites`, by user call stack (:func:`user_chain`, labelled with at most
    :data:`CHAIN_DEPTH` frames, ``a <- b <- c`` innermost first)."""
    def key(st: Any) -> str | None:
        chain = user_chain(st)
        if not chain:
            return ALLOCATOR_ONLY_SITE if any(isinstance(x, dict) for x in st) else None
        return _chain_label(chain)
    return _intern(trace, key)


def site_ids(stack_ids: np.ndarray, frames: np.ndarray) -> np.ndarray:
    f = frames.astype(np.int64)
    ok = (f >= 0) & (f < len(stack_ids))
    return np.where(ok, stack_ids[np.where(ok, f, 0)] if len(stack_ids) else 0, 0)


def _rows(ids: np.ndarray, labels: list[str], req: np.ndarray, live_ids: np.ndarray,
          live_req: np.ndarray, key: str, top: int, name: str) -> list[dict[str, Any]]:
    m = len(labels)
    total_b = np.zeros(m, np.int64)
    np.add.at(total_b, ids, req)
    total_n = np.bincount(ids, minlength=m)
    live_b = np.zeros(m, np.int64)
    np.add.at(live_b, live_ids, live_req)
    live_n = np.bincount(live_ids, minlength=m)
    rows = [{name: labels[i], "live_at_peak_bytes": int(live_b[i]),
             "live_at_peak_count": int(live_n[i]), "allocated_bytes": int(total_b[i]),
             "allocations": int(total_n[i])}
            for i in range(m) if live_n[i] or total_n[i]]
    other = "allocated_bytes" if key == "live_at_peak_bytes" else "live_at_peak_bytes"
    rows.sort(key=lambda r: (-r[key], -r[other], r[name]))
    return rows[:top]


def held_by_site(trace: Any, ev: np.ndarray, pairs: Pairs, req: np.ndarray, lay: Layout,
                 top: int) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
    """The top ``top`` allocation sites (:data:`FRAME_RULE`) and user call stacks, each ranked
    two ways: by requested bytes live at the moment of ``lay`` (``sites``, ``stacks``), and by
    requested bytes allocated over the whole trace (``sites_over_run``, ``stacks_over_run``).
    Blocks that existed before the recording count at the moment of ``lay`` under
    :data:`PRE_EXISTING_SITE`; they were not allocated in the trace."""
    empty: dict[str, list[dict[str, Any]]] = {
        "sites": [], "sites_over_run": [], "stacks": [], "stacks_over_run": []}
    if not (len(ev) and (ev["frames"] >= 0).any()):
        return empty, "no stack frames recorded"
    frames = ev["frames"][pairs.alloc_idx]
    live = lay.live
    out = {}
    site_of_stack, site_labels = stack_sites(trace)
    chain_of_stack, chain_labels = stack_chains(trace)
    # lay.site holds site ids; the chain of a live block comes from its stack, kept alongside
    for kind, of_stack, labels, live_ids in (
            ("sites", site_of_stack, site_labels, lay.site[live]),
            ("stacks", chain_of_stack, chain_labels, lay.chain[live])):
        ids = site_ids(of_stack, frames)
        name = "site" if kind == "sites" else "stack"
        out[kind] = _rows(ids, labels, req, live_ids, lay.req[live], "live_at_peak_bytes", top,
                          name)
        out[f"{kind}_over_run"] = _rows(ids, labels, req, live_ids, lay.req[live],
                                        "allocated_bytes", top, name)
    return out, None
