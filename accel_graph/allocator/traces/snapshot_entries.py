"""One device's events written back as torch's snapshot trace-entry dicts (the ``device_traces``
lists of a ``torch.cuda.memory._snapshot()`` dict): the output half of the snapshot format,
whose checked input half is :mod:`.torch_snapshot`.

Key order, the ``oom`` entry's ``device_free``, optional ``time_us`` and ``pool_id``, and the
per-event extra keys (``event_extras``) follow what torch writes (see :mod:`.torch_snapshot`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .actions import ACTION_CODE, ACTIONS
from .record import NO_FRAMES, NO_TIME
from .snapshot_values import Stack

__all__ = ["events_to_entries"]

_OOM = ACTION_CODE["oom"]


def events_to_entries(
    a: np.ndarray,
    stacks: list[Stack],
    event_extras: dict[tuple[int, int], dict[str, Any]],
    device: int,
) -> list[dict[str, Any]]:
    """One device's events as torch's trace-entry dicts, in torch's key order.

    ``oom`` carries ``device_free`` instead of ``addr``; ``time_us`` appears only when recorded;
    ``pool_id`` only when nonzero. Pass no ``stacks`` to write empty frames.
    """
    copies: dict[int, dict[str, Any]] = {}  # one copy per frame, shared like torch shares them
    frame_lists = [[copies.setdefault(id(f), dict(f)) for f in s] for s in stacks]
    names = list(ACTIONS)
    act, addr, size = a["action"].tolist(), a["addr"].tolist(), a["size"].tolist()
    stream, time_us = a["stream"].tolist(), a["time_us"].tolist()
    fr = a["frames"].tolist() if stacks else [NO_FRAMES] * len(a)
    timed = bool(len(a)) and bool((a["time_us"] != NO_TIME).all())
    # One dict display per event in a comprehension: several times faster than a loop.
    if timed:
        entries = [
            {"action": names[c], "addr": ad, "size": sz, "stream": st, "time_us": t,
             "frames": list(frame_lists[f]) if f >= 0 else []}
            for c, ad, sz, st, t, f in zip(act, addr, size, stream, time_us, fr, strict=True)
        ]  # fmt: skip
    else:
        entries = [
            {"action": names[c], "addr": ad, "size": sz, "stream": st,
             "frames": list(frame_lists[f]) if f >= 0 else []}
            for c, ad, sz, st, f in zip(act, addr, size, stream, fr, strict=True)
        ]  # fmt: skip
        if len(a):  # some (not all) events carry a time: insert it in torch's key order
            for i in np.flatnonzero(a["time_us"] != NO_TIME).tolist():
                e = entries[i]
                entries[i] = {**{k: e[k] for k in ("action", "addr", "size", "stream")},
                              "time_us": time_us[i], "frames": e["frames"]}  # fmt: skip
    for i in np.flatnonzero(a["action"] == _OOM).tolist():
        e = entries[i]
        entries[i] = {"action": "oom", "device_free": e["addr"],
                      **{k: v for k, v in e.items() if k not in ("action", "addr")}}  # fmt: skip
    for i in np.flatnonzero(a["pool"] != 0).tolist():
        entries[i]["pool_id"] = int(a["pool"][i])
    for (d, i), extra in event_extras.items():
        if d == device:
            entries[i].update(extra)
    return entries
