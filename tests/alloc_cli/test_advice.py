"""accel_graph.allocator.tune.advice: the line to paste and the warnings (explicit environ, no I/O)."""

from __future__ import annotations

import shlex

import pytest

from accel_graph.allocator.alloc_conf import CONFIG_VARIABLES, parse_config
from accel_graph.allocator.sim.profiles import PROFILES
from accel_graph.allocator.tune.advice import (
    USES,
    advise,
    env_assignment,
    env_override_warnings,
    es_conflict_warnings,
    parse_uses,
)

P213, P29, NPU, XPU, ROCM = (PROFILES[n] for n in ("cuda-2.13", "cuda-2.9", "npu", "xpu",
                                                   "rocm-2.13"))


def codes(advice):
    return [a.code for a in advice]


def by_code(advice, code):
    return next(a for a in advice if a.code == code)


# ---------------------------------------------------------------------------------------------
# the line to paste


def test_env_assignment_per_profile():
    cfg = "expandable_segments:True,roundup_power2_divisions:[256:2,>:8]"
    a = env_assignment(cfg, P213)
    assert a.env_var == "PYTORCH_ALLOC_CONF"
    assert a.env_line == f"export PYTORCH_ALLOC_CONF={shlex.quote(cfg)}"
    assert shlex.split(a.env_line)[1] == f"PYTORCH_ALLOC_CONF={cfg}"  # brackets quoted
    assert a.also == (f"export PYTORCH_CUDA_ALLOC_CONF={shlex.quote(cfg)}",)
    assert "_accelerator_setAllocatorSettings" in a.snippet and cfg in a.snippet
    assert "axolotl" in a.note
    old = env_assignment(cfg, P29)
    assert old.env_var == "PYTORCH_CUDA_ALLOC_CONF"
    assert "torch.cuda.memory._set_allocator_settings" in old.snippet
    assert env_assignment(cfg, NPU).env_var == "PYTORCH_NPU_ALLOC_CONF"
    assert env_assignment(cfg, XPU).env_var == "PYTORCH_ALLOC_CONF"
    assert "PYTORCH_HIP_ALLOC_CONF" in env_assignment(cfg, ROCM).also[0]


def test_parse_uses():
    assert parse_uses("ipc, mempool,custom_allreduce") == ("ipc", "mempool", "custom-allreduce")
    assert parse_uses(None) == ()
    assert set(USES) == {"ipc", "mempool", "custom-allreduce", "nccl-register"}
    with pytest.raises(ValueError, match="accepted"):
        parse_uses("ipc,telepathy")


# ---------------------------------------------------------------------------------------------
# warnings


def test_env_override_by_an_older_variable():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    w = env_override_warnings(env, "PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert codes(w) == ["env-override"]
    assert w[0].severity == "high" and "PYTORCH_CUDA_ALLOC_CONF" in w[0].message
    assert w[0].reference
    hip = env_override_warnings({"PYTORCH_HIP_ALLOC_CONF": ""}, "PYTORCH_ALLOC_CONF")
    assert codes(hip) == ["env-override"]  # set even to "" wins (CONFIG_VARIABLES precedence)
    assert CONFIG_VARIABLES.index("PYTORCH_HIP_ALLOC_CONF") < CONFIG_VARIABLES.index(
        "PYTORCH_ALLOC_CONF")
    assert env_override_warnings({}, "PYTORCH_ALLOC_CONF") == []
    # the same string in the older variable overrides nothing
    assert env_override_warnings({"PYTORCH_CUDA_ALLOC_CONF": "a:1"}, "PYTORCH_ALLOC_CONF",
                                 "a:1") == []
    # nothing is read before the first variable
    assert env_override_warnings({"PYTORCH_ALLOC_CONF": "x"}, "PYTORCH_CUDA_ALLOC_CONF") == []
    # through advise(): the environment is only checked when one is passed
    s = parse_config("expandable_segments:True")
    assert "env-override" in codes(advise(s, P213, environ=env))
    assert "env-override" not in codes(advise(s, P213))


def test_es_conflicts():
    s = parse_config("expandable_segments:True")
    plain = advise(s, P213)
    assert "es-compat" in codes(plain)
    ref = by_code(plain, "es-compat").reference
    for r in ("pytorch/pytorch#130330", "pytorch/pytorch#147851", "vllm-project/vllm#40812",
              "vllm-project/vllm#43923", "vllm-project/vllm#54351", "kvcache-ai/Mooncake#2511"):
        assert r in ref
    strong = advise(s, P213, uses=("ipc", "mempool", "custom-allreduce", "nccl-register"))
    for u, refs in (("ipc", ["#130330"]), ("mempool", ["#147851", "vllm#40812"]),
                    ("custom-allreduce", ["vllm#43923"]),
                    ("nccl-register", ["vllm#54351", "Mooncake#2511"])):
        a = by_code(strong, f"es-{u}")
        assert a.severity == "high"
        assert all(r in a.reference for r in refs)
    assert "es-compat" not in codes(strong)
    pools = advise(s, P213, private_pools=True)
    assert by_code(pools, "es-private-pools").severity == "high"
    assert es_conflict_warnings(("ipc",))[0].code == "es-ipc"
    # no expandable segments, no ES warnings
    off = advise(parse_config("max_split_size_mb:128"), P213, uses=("ipc",), private_pools=True)
    assert not any(c.startswith("es-") for c in codes(off))


def test_max_split_with_es_depends_on_the_version():
    s = parse_config("max_split_size_mb:128,expandable_segments:True")
    new = by_code(advise(s, P213), "max-split-with-es")
    assert new.severity == "high" and "pytorch/pytorch#193400" in new.reference
    old = advise(s, P29)
    assert "max-split-with-es" not in codes(old)
    assert by_code(old, "max-split-with-es-upgrade").severity == "warning"
    assert "max-split-with-es" not in codes(advise(parse_config("max_split_size_mb:128"), P213))


def test_gc_roundup_and_init_warnings():
    gc = advise(parse_config("garbage_collection_threshold:0.6"), P213)
    assert "pytorch/pytorch#106660" in by_code(gc, "gc-inert").reference
    with_fraction = parse_config("garbage_collection_threshold:0.6,per_process_memory_fraction:0.9")
    assert "gc-inert" not in codes(advise(with_fraction, P213))
    one = advise(parse_config("roundup_power2_divisions:[256:1,512:2,>:8]"), P213)
    assert "pytorch/pytorch#161139" in by_code(one, "roundup-one-ignored").reference
    assert "roundup-one-ignored" not in codes(advise(parse_config("roundup_power2_divisions:4"),
                                                     P213))
    init = by_code(advise(parse_config(""), P213), "set-before-init")
    assert "axolotl-ai-cloud/axolotl#2183" in init.reference


def test_every_warning_names_its_reference():
    s = parse_config("max_split_size_mb:128,garbage_collection_threshold:0.6,"
                     "roundup_power2_divisions:[256:1,>:8],expandable_segments:True")
    env = {"PYTORCH_CUDA_ALLOC_CONF": "x", "PYTORCH_HIP_ALLOC_CONF": "y"}
    out = advise(s, P213, environ=env, uses=tuple(USES), private_pools=True)
    assert len(out) >= 8
    for a in out:
        assert a.reference and a.message and a.severity in ("info", "warning", "high")
        assert set(a.to_json()) == {"code", "severity", "message", "reference"}


def test_es_warning_is_worded_for_the_device():
    cuda = es_conflict_warnings((), False, "cuda")[0].message
    npu = es_conflict_warnings((), False, "npu")[0].message
    assert "documented for CUDA/ROCm" not in cuda
    assert "documented for CUDA/ROCm builds; on npu" in npu
