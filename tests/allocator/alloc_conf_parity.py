"""The allocator-config strings every parity check runs, and how torch's own outcome on each is
recorded: the shared half of tests/allocator/test_config.py (live differential) and
test_config_tables.py (frozen per-version tables).

Run as a script with the torch to record (``python tests/allocator/alloc_conf_parity.py``) to
write ``data/alloc_conf_torch-<version>.json``: every string of :func:`parity_corpus` with the
outcome of the running torch's parser, the build kind (cpu/cuda/hip/xpu) and the rules that
must reproduce it. This file imports no accel_graph module, so it runs under any torch.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"

# Strings with only the common keys (or malformed structure): cpu and cuda rules agree.
CORE_CORPUS = [
    "",
    "   ",
    "max_split_size_mb:20",
    "max_split_size_mb:19",
    "max_split_size_mb:0",
    "max_split_size_mb:100",
    "max_split_size_mb:100abc",
    "max_split_size_mb:abc",
    "max_split_size_mb:-1",
    "max_split_size_mb:-0",
    "max_split_size_mb:+30",
    "max_split_size_mb:0x100",
    "max_split_size_mb:18446744073709551615",
    "max_split_size_mb:18446744073709551616",
    "max_split_size_mb:-18446744073709551615",
    "max_split_size_mb:99999999999999999999999",
    "max_split_size_mb:[20]",
    "max_split_size_mb: 2 0",
    "max_split_size_mb:3\u0660",
    "max_split_size_mb:\u0663\u0660",
    "max_split_size_mb:2\u00a00",
    "max_split_size_mb",
    "max_split_size_mb:",
    "max_split_size_mb:20:30",
    "large_segment_size_mb:10",
    "large_segment_size_mb:11",
    "large_segment_size_mb:30",
    "large_segment_size_mb:abc",
    "large_segment_size_mb:99999999999999999999",
    "large_segment_size_mb:17592186044416",
    "large_segment_size_mb:20:30",
    "large_segment_size_mb:11,max_split_size_mb:11",
    "large_segment_size_mb:30,max_split_size_mb:25",
    "max_split_size_mb:25,large_segment_size_mb:30",
    "max_split_size_mb:30,large_segment_size_mb:30",
    "large_segment_size_mb:30,max_non_split_rounding_mb:25",
    "large_segment_size_mb:30,max_non_split_rounding_mb:30",
    "max_non_split_rounding_mb:19",
    "max_non_split_rounding_mb:20",
    "max_non_split_rounding_mb:64,max_split_size_mb:512",
    "garbage_collection_threshold:0.5",
    "garbage_collection_threshold:0",
    "garbage_collection_threshold:1",
    "garbage_collection_threshold:1.0",
    "garbage_collection_threshold:0.999999",
    "garbage_collection_threshold:abc",
    "garbage_collection_threshold:nan",
    "garbage_collection_threshold:nan(12)",
    "garbage_collection_threshold:inf",
    "garbage_collection_threshold:infinity",
    "garbage_collection_threshold:-0.5",
    "garbage_collection_threshold:0.5x",
    "garbage_collection_threshold:.5",
    "garbage_collection_threshold:5e-1",
    "garbage_collection_threshold:1e",
    "garbage_collection_threshold:0x",
    "garbage_collection_threshold:0x1p-1",
    "garbage_collection_threshold:0x1p-1074",
    "garbage_collection_threshold:0x1p-1022",
    "garbage_collection_threshold:1e-300",
    "garbage_collection_threshold:1e-310",
    "garbage_collection_threshold:2.225073858507201e-308",
    "garbage_collection_threshold:1e999",
    "garbage_collection_threshold:1e-99999",
    "garbage_collection_threshold:0e-999",
    "garbage_collection_threshold:1_0",
    "garbage_collection_threshold:0,5",
    "garbage_collection_threshold:0.5,garbage_collection_threshold:2",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:4x",
    "roundup_power2_divisions:3",
    "roundup_power2_divisions:0",
    "roundup_power2_divisions:-1",
    "roundup_power2_divisions:]",
    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
    "roundup_power2_divisions:[0:4]",
    "roundup_power2_divisions:[3:4]",
    "roundup_power2_divisions:[256:3]",
    "roundup_power2_divisions:[256:0,>:8]",
    "roundup_power2_divisions:[65536:2]",
    "roundup_power2_divisions:[>:4]",
    "roundup_power2_divisions:[>:2,>:4]",
    "roundup_power2_divisions:[1:1,1:2]",
    "roundup_power2_divisions:[]",
    "roundup_power2_divisions:[256:1",
    "roundup_power2_divisions:[256:1,",
    "roundup_power2_divisions:[256:1,]",
    "roundup_power2_divisions:[,256:1]",
    "roundup_power2_divisions:[:1]",
    "roundup_power2_divisions:[abc:3]",
    "roundup_power2_divisions:[abc:4]",
    "roundup_power2_divisions:[256:1 512:2]",
    "roundup_power2_divisions:[256,1]",
    "roundup_power2_divisions:[",
    "expandable_segments:True",
    "expandable_segments:False",
    "expandable_segments:true",
    "expandable_segments:1",
    "expandable_segments:[True]",
    "expandable_segments:True,",
    "expandable_segments:\tTrue",
    "expandable_segments:True,expandable_segments:False",
    "expandable_segments:True garbage_collection_threshold:0.5",
    "pinned_use_background_threads:True",
    "pinned_use_background_threads:1",
    "pinned_max_round_threshold_mb:64",
    "pinned_max_round_threshold_mb:abc",
    "pinned_max_cached_size_mb:-1",
    "pinned_max_cached_size_mb:128,pinned_max_round_threshold_mb:64",
    "max_split_size_mb:200,garbage_collection_threshold:0.8,expandable_segments:True",
    "max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
    ",",
    ":",
    "::",
    "[",
    "]",
    # strings from torch's own c10/test/core/AllocatorConfig_test.cpp (seen in the test binary)
    "large_segment_size_mb:15,max_split_size_mb:20,max_non_split_rounding_mb:40,"
    "garbage_collection_threshold:0.8",
    "roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]",
    "max_split_size_mb:20,large_segment_size_mb:25",
    "pinned_use_background_threads:False",
    "expandable_segments:False,",
]

# Strings with keys the CPU build skips unchecked (device keys and unknown keys).
SKIPPED_ON_CPU_CORPUS = [
    "a",
    "a:b:c",
    "a:b:c:d",
    "a:b,,",
    "a:b,",
    ",a:b",
    "foo:bar",
    "foo:[a,b",
    "foo:[a,b]",
    "foo:[",
    "foo:]",
    "foo:large_segment_size_mb",
    "foo:[large_segment_size_mb:30],max_split_size_mb:25",
    "x:y,expandable_segments:yes",
    "backend:native",
    "backend:cudaMallocAsync",
    "backend:foo",
    "per_process_memory_fraction:2",
    "release_lock_on_cudamalloc:yes",
    "pinned_num_register_threads:0",
    "pinned_num_register_threads:3",
]


# Device-hook keys (CUDA/ROCm builds check them; the CPU build skips them).
DEVICE_CORPUS = [
    "backend:native",
    "backend:hipMallocAsync",
    "release_lock_on_cudamalloc:True",
    "release_lock_on_hipmalloc:True",
    "pinned_use_cuda_host_register:True",
    "pinned_use_hip_host_register:True",
    "pinned_num_register_threads:8",
    "pinned_num_register_threads:128",
    "pinned_num_register_threads:256",
    "pinned_num_register_threads:[8]",
    "pinned_reserve_segment_size_mb:0",
    "pinned_reserve_segment_size_mb:16",
    "graph_capture_record_stream_reuse:True",
    "graph_capture_record_stream_reuse:yes",
    "per_process_memory_fraction:0",
    "per_process_memory_fraction:1",
    "per_process_memory_fraction:0.5",
    "per_process_memory_fraction:1.5",
    "per_process_memory_fraction:-0.1",
    "per_process_memory_fraction:x",
    "per_process_memory_fraction:nan",
    "pinned_free_catch_all:True",
    "pinned_free_catch_all:yes",
    "throw_on_cudamalloc_oom:True",
    "throw_on_cudamalloc_oom:true",
    "backend:foo,max_split_size_mb:5",
    "max_split_size_mb:100,bogus:1",
    "expandable_segments_handle_type:1",
    "expandable_segments:True,backend:native",
]

_KEYS = [
    "large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
    "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
    "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
    "backend", "foo", "pinned_num_register_threads", "per_process_memory_fraction",
    "release_lock_on_cudamalloc", "pinned_reserve_segment_size_mb",
]  # fmt: skip
_VALUES = ["20", "25", "11", "10", "0.5", "True", "False", "4", "3", "0", ">", "-1", "abc",
           "1e-3", "native", "cudaMallocAsync", "128"]  # fmt: skip
_PIECES = _KEYS + _VALUES + [":", ",", "[", "]", " "]


def generated_corpus(seed: int = 1234, soups: int = 800, well_formed: int = 500) -> list[str]:
    """Seeded token soups and well-formed ``key:value`` lists over every key (fixed per seed)."""
    rng = random.Random(seed)
    out = ["".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 12))) for _ in range(soups)]
    out += [",".join(f"{rng.choice(_KEYS)}:{rng.choice(_VALUES + ['[256:1,>:2]'])}"
                     for _ in range(rng.randint(0, 4))) for _ in range(well_formed)]
    return out


def parity_corpus() -> list[str]:
    """Every string the frozen tables record: hand-written first, then generated; no repeats."""
    return list(dict.fromkeys(CORE_CORPUS + SKIPPED_ON_CPU_CORPUS + DEVICE_CORPUS
                              + generated_corpus()))


def build_device() -> str:
    """The parse_config ``device`` whose rules the installed torch build applies."""
    import torch

    if getattr(torch.version, "hip", None):
        return "hip"
    if getattr(torch.version, "cuda", None):
        return "cuda"
    if getattr(torch.version, "xpu", None):
        return "xpu"
    return "cpu"


def torch_minor() -> str:
    """``"2.14"`` for the installed torch."""
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"{major}.{minor}"


#: torch's message when a ``backend:`` value differs from the one the process started with.
LOAD_TIME = "allocator backend parsed at load time"


def torch_outcome(text: str) -> BaseException | None:
    """Run torch's parser on ``text`` as a process started with it would; its exception or None.

    ``large_segment_size_mb`` is sticky across calls (even failed ones) and sets the minimum
    of max_split_size_mb, so torch is reset to 20 before and after. On a CUDA build a
    ``backend:`` value other than the one the process started with trips an internal assert
    (runtime != load time) that a fresh process never sees; such strings are re-run in a
    subprocess started with ``PYTORCH_ALLOC_CONF`` set to them.
    """
    import torch

    set_ = torch._C._accelerator_setAllocatorSettings
    set_("large_segment_size_mb:20")
    try:
        set_(text)
    except Exception as e:  # noqa: BLE001 - we compare whatever torch raised
        if LOAD_TIME in str(e):
            return _fresh_process_outcome(text)
        return e
    finally:
        set_("large_segment_size_mb:20")
    return None


_CHILD = """
import sys, torch
try:
    torch._C._accelerator_setAllocatorSettings(sys.argv[1])
except Exception as e:
    print(type(e).__name__); print(str(e).strip()); sys.exit(0)
print("ok")
"""


def _fresh_process_outcome(text: str) -> BaseException | None:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_ALLOC_CONF")}
    env["PYTORCH_ALLOC_CONF"] = text
    out = subprocess.run([sys.executable, "-c", _CHILD, text], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    lines = out.stdout.strip().splitlines()
    if lines == ["ok"]:
        return None
    kind = {"ValueError": ValueError, "IndexError": IndexError}.get(lines[0], RuntimeError)
    return kind("\n".join(lines[1:]))


#: What a CUDA build says when it asks a driver that is not there. torch 2.11 checks the driver
#: while parsing ``backend:cudaMallocAsync`` (2.14 does not): on a GPU-less host that is the
#: outcome, but it is the host's, not the parser's verdict on the string.
DRIVER_ERRORS = ("cudaErrorInsufficientDriver", "Found no NVIDIA driver")


def outcome_record(e: BaseException | None) -> list[str] | None:
    """A JSON form of an outcome: None (accepted), [exception type, message], or
    ``["DriverError", first line]`` when torch stopped at a missing driver (:data:`DRIVER_ERRORS`)."""
    if e is None:
        return None
    text = str(e).strip()
    if any(marker in text for marker in DRIVER_ERRORS):
        return ["DriverError", text.splitlines()[0]]
    return [type(e).__name__, text]


def table_path(version: str) -> Path:
    return DATA / f"alloc_conf_torch-{version}.json"


def record(strings: list[str]) -> dict[str, Any]:
    """The frozen table of the installed torch for ``strings``."""
    import torch

    return {
        "torch": torch.__version__,
        "rules": torch_minor(),
        "device": build_device(),
        "recorded_with": "tests/allocator/alloc_conf_parity.py (torch_outcome)",
        "outcomes": {s: outcome_record(torch_outcome(s)) for s in strings},
    }


def load_tables() -> list[dict[str, Any]]:
    """Every checked-in frozen table, oldest torch first."""
    return [json.loads(p.read_text()) for p in sorted(DATA.glob("alloc_conf_torch-*.json"))]


if __name__ == "__main__":
    table = record(parity_corpus())
    DATA.mkdir(exist_ok=True)
    path = table_path(table["rules"])
    path.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path} ({len(table['outcomes'])} strings, torch {table['torch']}, "
          f"{table['device']} build)")
