"""``accel_graph.errors.OutOfMemoryError`` is created on first access, exactly once, even when
several threads reach it together (a second class would make ``except`` clauses miss)."""

from __future__ import annotations

import subprocess
import sys


def test_concurrent_first_access_gives_one_class():
    code = """
import threading
import accel_graph.errors as E
seen, gate = [], threading.Barrier(8)
def get():
    gate.wait()
    seen.append(E.OutOfMemoryError)
ts = [threading.Thread(target=get) for _ in range(8)]
[t.start() for t in ts]
[t.join() for t in ts]
import torch
cls = seen[0]
print(len({id(c) for c in seen}), issubclass(cls, torch.OutOfMemoryError), cls is E.OutOfMemoryError)
"""
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, timeout=120)
        assert out.stdout.split() == ["1", "True", "True"]
