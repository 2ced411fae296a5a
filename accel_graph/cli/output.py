"""Command output shared by both command-line tools (``accel-graph`` and ``accel-alloc``):
plain-text tables and JSON documents, written the same way by every command.

- :func:`emit` prints a command's JSON document (``--json``: keys sorted, so output is
  deterministic) or its text;
- :func:`write_json` writes a JSON report to a file;
- :func:`format_table` lays out a plain-text table (text left, numbers right);
- :func:`json_text` is the one JSON encoder behind both (numpy scalars and arrays become JSON
  numbers and lists).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["emit", "format_table", "json_text", "write_json"]


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
                 align: str | None = None) -> str:
    """A plain-text table; ``align`` is one char per column (``l``/``r``, default: text left,
    numbers right)."""
    body = [[str(c) for c in r] for r in rows]
    cols = list(zip(*([list(headers)] + body), strict=False)) if body else [[h] for h in headers]
    width = [max(len(c) for c in col) for col in cols]
    if align is None:
        align = "".join("r" if body and all(_numeric(r[i]) for r in body) else "l"
                        for i in range(len(headers)))

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if a == "r" else c.ljust(w)
               for c, w, a in zip(cells, width, align, strict=False)]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in width)
    return "\n".join([line(list(headers)), sep] + [line(r) for r in body])


def _numeric(cell: str) -> bool:
    head = cell.split(" ")[0].replace(",", "").replace("%", "").lstrip("+-x")
    try:
        float(head)
    except ValueError:
        return cell == "-"
    return True


def json_text(payload: Any, *, sort_keys: bool = True, allow_nan: bool = True) -> str:
    """``payload`` as indented JSON text (no trailing newline); numpy values become plain
    numbers and lists. ``allow_nan=False`` refuses NaN and infinities (``ValueError``)."""
    return json.dumps(payload, indent=2, sort_keys=sort_keys, allow_nan=allow_nan,
                      default=_json_default)


def emit(args: argparse.Namespace, payload: dict[str, Any], text: str | None) -> None:
    """Print ``payload`` as JSON with ``--json`` (keys sorted, so output is deterministic),
    else ``text``."""
    if getattr(args, "json", False):
        sys.stdout.write(json_text(payload) + "\n")
    elif text is not None:
        sys.stdout.write(text.rstrip("\n") + "\n")
    sys.stdout.flush()


def _json_default(obj: Any) -> Any:
    try:
        import numpy as np

        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")



def write_json(path: Path, payload: Any, *, sort_keys: bool = False,
               allow_nan: bool = False) -> None:
    """Write ``payload`` to ``path`` as :func:`json_text` plus a newline, creating the parent
    directory; by default keys keep their order and NaN is refused (strict JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_text(payload, sort_keys=sort_keys, allow_nan=allow_nan) + "\n",
                    encoding="utf-8")
