"""Fidelity of whole-trace replay on the Ascend NPU twin recordings.

The three twins in ``shared/traces/npu`` record one alloc/free sequence (same pre-existing state,
320 live blocks) under three settings. :func:`fidelity_table` replays each twin under each
setting and compares with what the twin recorded under that setting: segment allocations and
frees (native), maps and unmaps (expandable), peak and final reserved bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..traces import load_trace
from .replayer import replay_trace
from .trace_ops import recorded_summary
from .trace_state import empty_cache_positions

__all__ = ["METRICS", "TWINS", "fidelity_markdown", "fidelity_table", "find_npu_traces"]

#: twin file -> (expandable_segments, empty_cache calls)
TWINS: dict[str, tuple[bool, bool]] = {
    "snapshot_with_empty_cache.pkl": (False, True),
    "snapshot_with_empty_cache_expandable.pkl": (True, True),
    "snapshot_expandable.pkl": (True, False),
}
FROM_START = "snapshot_1768383987920985470.pkl"
METRICS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap", "peak_reserved",
           "final_reserved")


def find_npu_traces(start: str | os.PathLike[str] | None = None) -> Path | None:
    """``shared/traces/npu`` beside the repository (CI) or at /work/shared; None if absent."""
    repo = Path(start) if start else Path(__file__).resolve().parents[2]
    for cand in (repo / ".." / "shared" / "traces" / "npu", Path("/work/shared/traces/npu")):
        if (cand / "snapshot_with_empty_cache.pkl").is_file():
            return cand.resolve()
    return None


def fidelity_table(directory: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """One row per (source twin, target setting) and one for the from-start native trace:
    ``source``, ``target``, and per metric ``<m>.predicted``, ``<m>.recorded``, ``<m>.error``
    (predicted - recorded)."""
    d = Path(directory) if directory else find_npu_traces()
    if d is None:
        raise FileNotFoundError("shared/traces/npu not found beside the repository or in /work")
    traces = {name: load_trace(d / name) for name in (*TWINS, FROM_START)}
    recorded = {name: recorded_summary(t) for name, t in traces.items()}
    # the empty_cache calls come from the program (a post_step hook), so a twin recorded
    # without them gets the calls inferred from a twin that recorded them, by position
    ec_pos = empty_cache_positions(traces["snapshot_with_empty_cache.pkl"])
    rows = []
    pairs = [(s, t) for s in TWINS for t in TWINS] + [(FROM_START, FROM_START)]
    for src, tgt in pairs:
        exp, ec = TWINS.get(tgt, (False, False))
        r = replay_trace(traces[src], expandable=exp, empty_cache=ec_pos if ec else False,
                         profile="npu")
        pred = r.summary()
        row: dict[str, Any] = {"source": src, "target": tgt,
                               "target_setting": ("expandable" if exp else "native")
                               + ("+empty_cache" if ec else ""),
                               "inferred_empty_cache": r.inferred_empty_cache}
        for m in METRICS:
            row[f"{m}.predicted"] = int(pred[m])
            row[f"{m}.recorded"] = int(recorded[tgt][m])
            row[f"{m}.error"] = int(pred[m]) - int(recorded[tgt][m])
        rows.append(row)
    return rows


def fidelity_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`fidelity_table` as a markdown table (for docs, unlike the CLI's
    plain-text :func:`accel_graph.cli.output.format_table`): predicted/recorded (error) per
    metric; byte metrics in MiB."""
    head = ["source", "replayed as"] + list(METRICS)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["source"].removesuffix(".pkl"), r["target_setting"]]
        for m in METRICS:
            p, rec, e = r[f"{m}.predicted"], r[f"{m}.recorded"], r[f"{m}.error"]
            if m.endswith("reserved"):
                cells.append(f"{p / 2**20:g} / {rec / 2**20:g} ({e / 2**20:+g} MiB)")
            else:
                cells.append(f"{p} / {rec} ({e:+d})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
