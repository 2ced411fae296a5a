"""Replay fidelity on the Ascend NPU twin traces: prints the table, optionally writes JSON.

    python tools/fidelity.py [--traces DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accel_graph.allocator.sim.fidelity import (  # noqa: E402
    fidelity_markdown,
    fidelity_table,
    find_npu_traces,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=None, help="directory of the NPU traces")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    d = Path(a.traces) if a.traces else find_npu_traces()
    if d is None:
        print("shared/traces/npu not found; pass --traces", file=sys.stderr)
        return 2
    rows = fidelity_table(d)
    print(fidelity_markdown(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
