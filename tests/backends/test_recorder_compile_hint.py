"""The compiled-replay fallback names the C++ compiler only when the failure is about it."""

from __future__ import annotations

from accel_graph.backends.recorder.compiled.failures import compiler_hint as _compiler_hint
from accel_graph.backends.recorder.compiled.inductor import CompileUnsupported


def test_compiler_hint_only_for_compiler_failures() -> None:
    assert "C++ compiler" in _compiler_hint(RuntimeError("CppCompileError: C++ compile error: g++ exited 1"))
    assert "C++ compiler" in _compiler_hint(RuntimeError("InvalidCxxCompiler: no working C++ compiler found"))
    # torch's functionalization refusal of fused optimizers, our own refusals: not the compiler.
    assert _compiler_hint(RuntimeError("mutating a non-functional tensor with a functional tensor "
                                       "is not allowed")) == ""
    assert _compiler_hint(CompileUnsupported("control flow is replayed by the interpreter")) == ""
