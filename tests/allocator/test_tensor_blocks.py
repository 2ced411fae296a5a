"""Tensor blocks: CPU tensors that own engine blocks, made in one native call (DLPack).

The block must go back to the engine exactly when the last tensor over it dies (from any
thread), never earlier, and its memory must stay valid even after the engine is closed.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import pytest
import torch

from accel_graph.allocator.core.engine import Engine
from accel_graph.allocator.core.settings import EngineSettings
from accel_graph.errors import OutOfMemoryError

F32 = (2, 32)  # DLPack kDLFloat, 32 bits


@pytest.fixture
def engine():
    e = Engine("native", "host")
    yield e
    e.close()


@pytest.fixture
def blocks(engine):
    b = engine.tensor_blocks()
    if b is None:
        pytest.skip("the _dlpack extension is not built")
    return b


def allocated(engine: Engine) -> int:
    return engine.memory_stats()["allocated_bytes.all.current"]


@pytest.mark.parametrize(
    ("shape", "stride"),
    [
        ((4, 3), (3, 1)),
        ((3, 4), (1, 3)),
        ((2, 1, 5), (5, 7, 1)),
        ((6,), (0,)),
        ((0, 3), (3, 1)),
        ((), ()),
    ],
)
def test_shape_stride_dtype_are_exact_and_memory_is_usable(engine, blocks, shape, stride):
    t = blocks.make(0, *F32, shape, stride)
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert tuple(t.shape) == shape and t.stride() == stride
    t.fill_(3.0)
    assert torch.all(t == 3.0)
    assert allocated(engine) > 0  # even an empty tensor holds its (1-byte) block


@pytest.mark.parametrize(
    ("code", "dtype"),
    [
        ((0, 64), torch.int64),
        ((1, 8), torch.uint8),
        ((2, 16), torch.float16),
        ((4, 16), torch.bfloat16),
        ((5, 128), torch.complex128),
        ((6, 8), torch.bool),
    ],
)
def test_dtypes(blocks, code, dtype):
    assert blocks.make(0, *code, (2, 2), (2, 1)).dtype == dtype


def test_block_returns_when_the_last_view_dies(engine, blocks):
    t = blocks.make(7, *F32, (1024,), (1,))
    v = t[10:20]
    addr = t.data_ptr()
    del t
    gc.collect()
    assert allocated(engine) > 0 and blocks.drain() == []  # the view keeps the block
    v.fill_(1.0)
    assert v.data_ptr() == addr + 40
    del v
    assert allocated(engine) == 0
    assert blocks.drain() == [7]
    assert blocks.pending[0] == 0
    assert blocks.counts() == (0, 0)


def test_keys_drain_in_order_of_death(blocks):
    ts = [blocks.make(k, *F32, (16,), (1,)) for k in range(5)]
    for k in (3, 0, 4):
        ts[k] = None
    assert blocks.pending[0] == 3
    assert blocks.drain() == [3, 0, 4]
    ts.clear()  # a list drops its items last to first
    assert sorted(blocks.drain()) == [1, 2]


def test_many_deaths_drain_completely(blocks):
    ts = [blocks.make(k, *F32, (4,), (1,)) for k in range(3000)]
    del ts
    assert sorted(blocks.drain()) == list(range(3000))  # more than one C batch


def test_death_on_another_thread(engine, blocks):
    t = blocks.make(1, *F32, (256,), (1,))
    box = [t]
    del t

    def drop():
        box.clear()

    th = threading.Thread(target=drop)
    th.start()
    th.join()
    assert allocated(engine) == 0 and blocks.drain() == [1]


def test_memory_outlives_a_closed_engine():
    e = Engine("native", "host")
    b = e.tensor_blocks()
    if b is None:
        pytest.skip("the _dlpack extension is not built")
    t = b.make(0, *F32, (1 << 20,), (1,))  # 4 MiB
    spare = b.make(1, *F32, (16,), (1,))
    del spare
    e.close()  # the C engine stays until the tensor dies
    t.fill_(5.0)
    assert float(t.sum()) == 5.0 * (1 << 20)
    del t  # tears the engine down; nothing to observe but the absence of a crash
    gc.collect()


def test_blocks_handle_stays_valid_after_close_and_last_death():
    """TensorBlocks holds its own engine reference: after close() and the last tensor's death,
    make/drain/pending refuse or read zero instead of touching freed memory (was a
    use-after-free, seen with MALLOC_PERTURB_ and ASan)."""
    if Engine("native", "host").tensor_blocks() is None:
        pytest.skip("the _dlpack extension is not built")
    # in a child with glibc's MALLOC_PERTURB_, freed memory is overwritten: a read through a
    # dangling engine pointer shows up as a garbage count instead of passing by luck
    code = """
import gc
from accel_graph.allocator.core.engine import Engine
e = Engine("native", "host")
b = e.tensor_blocks()
t = b.make(1, 2, 32, (4,), (1,))
e.close()
del t
gc.collect()
rc = b.make(2, 2, 32, (4,), (1,))
print(b.pending[0], isinstance(rc, int) and rc < 0, b.drain())
del b
gc.collect()
"""
    env = dict(os.environ, MALLOC_PERTURB_="165")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "True", "[]"]


def test_owner_is_kept_alive_until_the_tensor_dies(blocks):
    class Owner:
        pass

    o = Owner()
    import weakref

    w = weakref.ref(o)
    t = blocks.make(0, *F32, (8,), (1,), o)
    del o
    gc.collect()
    assert w() is not None
    del t
    gc.collect()
    assert w() is None


def test_oom_is_reported_and_changes_nothing():
    e = Engine("native", "host", EngineSettings(cap=4 << 20))
    b = e.tensor_blocks()
    if b is None:
        pytest.skip("the _dlpack extension is not built")
    rc = b.make(0, *F32, (8 << 20,), (1,))
    assert isinstance(rc, int) and rc < 0
    with pytest.raises(OutOfMemoryError):
        b.check(rc)
    assert b.counts() == (0, 0) and b.drain() == []
    e.close()


def test_failed_import_frees_the_block(engine, blocks):
    # kDLOpaqueHandle (3) is no dtype torch imports: the capsule is not consumed and its
    # destructor gives the block back
    with pytest.raises((RuntimeError, TypeError, ValueError, BufferError)):
        blocks.make(9, 3, 8, (4,), (1,))
    assert allocated(engine) == 0
    assert blocks.drain() == [9]


def test_bad_arguments(blocks, engine):
    with pytest.raises(ValueError):
        blocks.make(0, *F32, (4,), (-1,))
    with pytest.raises(ValueError):
        blocks.make(0, *F32, (4, 2), (1,))
    with pytest.raises(ValueError):
        blocks.make(0, 2, 12, (4,), (1,))
    with pytest.raises(OverflowError):
        blocks.make(0, *F32, (1 << 62,), (4,))
    assert allocated(engine) == 0 and blocks.counts() == (0, 0)


def test_only_host_engines_make_tensors():
    with Engine("native", "counting") as e:
        assert e.tensor_blocks() is None
