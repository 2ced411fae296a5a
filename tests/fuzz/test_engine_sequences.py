"""Random sequences of engine operations, with invariants checked after every step.

A hypothesis state machine drives one :class:`Engine` (counting upstream, a 256 MiB device)
through malloc/free/record_stream/process_events/synchronize/empty_cache, private pools (create,
route, end, release, malloc into), memory fractions, event recording, and garbage arguments, for
each policy with and without expandable segments. After every step:

- statistics: every ``.current`` count is non-negative and at most its peak; allocated and
  active bytes are at most reserved bytes; the counting upstream holds exactly the reserved bytes;
- live blocks: every pointer is distinct, its block is at least the request, and no two blocks
  overlap; their sizes add up to ``allocated_bytes`` and to the pools' ``allocated_bytes``;
- pools: each pool's use count equals the model's;
- only documented exceptions: OutOfMemoryError from malloc, PoolError for a released pool,
  AccelGraphError for begin/end in the wrong state, ConfigError for garbage arguments, and a
  refused call changes no statistic.

At the end every block is freed, every pool ended and released, and ``empty_cache`` must bring
reserved memory (and the upstream) to 0.

Bounded (about 10 s on a CI runner) and derandomized; ``ACCEL_GRAPH_SOAK=20`` runs twenty
times the examples (a bug hunt, not for CI).
"""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from accel_graph.allocator.core.engine import Engine
from accel_graph.allocator.core.settings import EngineSettings
from accel_graph.allocator.traces.actions import ACTIONS
from accel_graph.errors import AccelGraphError, ConfigError, OutOfMemoryError, PoolError

MIB = 1 << 20
CAP = 256 * MIB
STREAMS = 3
_SOAK = max(1, int(os.environ.get("ACCEL_GRAPH_SOAK", "1")))

sizes = st.one_of(
    st.sampled_from([1, 512, 513, MIB, MIB + 1, 2 * MIB, 10 * MIB, 20 * MIB + 1]),
    st.integers(1, MIB),
    st.integers(MIB, 48 * MIB),
)
streams = st.integers(0, STREAMS - 1)
# Arguments no entry point takes: each must be a ConfigError that changes nothing.
HUGE = "10**5000"  # drawn as this name (hypothesis reprs what it draws), called with the int
GARBAGE = [-1, 1 << 64, -(1 << 63) - 1, HUGE, 1.5, math.nan, "7", None, True, b"", [1]]
GARBAGE_CALLS = [
    ("malloc", lambda e, g: e.malloc(g)),
    ("malloc stream", lambda e, g: e.malloc(512, stream=g)),
    ("free", lambda e, g: e.free(g)),
    ("record_stream", lambda e, g: e.record_stream(g, 0)),
    ("block_size", lambda e, g: e.block_size(g)),
    ("begin_allocate_to_pool", lambda e, g: e.begin_allocate_to_pool(g)),
    ("end_allocate_to_pool", lambda e, g: e.end_allocate_to_pool(g)),
    ("release_pool", lambda e, g: e.release_pool(g)),
    ("pool_use_count", lambda e, g: e.pool_use_count(g)),
    ("pool_memory", lambda e, g: e.pool_memory(g)),
    ("enable_events", lambda e, g: e.enable_events(g)),
    ("set_memory_fraction", lambda e, g: e.set_memory_fraction(g)),
    ("create_pool", lambda e, g: e.create_pool(no_split=g)),
]
# None stands for "no pool" / "unset" where these take it
_NONE_OK = {"pool_memory", "set_memory_fraction"}
# an int64 pool id is well-formed: the C core refuses an unknown one with PoolError
_POOL_CALLS = {
    "begin_allocate_to_pool", "end_allocate_to_pool", "release_pool", "pool_use_count",
    "pool_memory",
}  # fmt: skip


class EngineSequences(RuleBasedStateMachine):
    """The model: live blocks (pointer -> requested size), pools (id -> uses), routing."""

    policy = "native"
    expandable = False

    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.e = Engine(
            self.policy,
            "counting",
            EngineSettings(cap=CAP, expandable_segments=self.expandable),
            streams=STREAMS,
        )
        self.blocks: dict[int, int] = {}  # live pointer -> requested size
        self.uses: dict[int, int] = {}  # every pool ever created -> the model's use count
        self.routing: set[int] = set()  # pools receiving allocations
        self.events_max: int | None = None  # None: not recording

    # -- allocation ------------------------------------------------------------------------

    def _malloc(self, size: int, stream: int, pool: int | None) -> int | None:
        try:
            p = self.e.malloc(size, stream, pool)
        except OutOfMemoryError:
            return None
        assert p not in self.blocks, f"pointer {p:#x} handed out twice"
        assert self.e.block_size(p) >= size
        self.blocks[p] = size
        return p

    @rule(target=live, size=sizes, stream=streams)
    def malloc(self, size: int, stream: int) -> int:
        p = self._malloc(size, stream, None)
        return p if p is not None else 0  # 0 is never a live pointer: a refused free

    @precondition(lambda self: self.uses)
    @rule(target=live, size=sizes, stream=streams, data=st.data())
    def malloc_pool(self, size: int, stream: int, data: st.DataObject) -> int:
        pool = data.draw(st.sampled_from(sorted(self.uses)))
        if self.uses[pool] == 0:  # released: refused, nothing changes
            with pytest.raises(PoolError):
                self.e.malloc(size, stream, pool)
            return 0
        p = self._malloc(size, stream, pool)
        return p if p is not None else 0

    @rule(p=consumes(live))
    def free(self, p: int) -> None:
        if p not in self.blocks:
            with pytest.raises(ConfigError):
                self.e.free(p)
            return
        self.e.free(p)
        del self.blocks[p]
        with pytest.raises(ConfigError):  # a double free is refused
            self.e.free(p)

    @rule(p=live, stream=streams)
    def record_stream(self, p: int, stream: int) -> None:
        if p in self.blocks:
            self.e.record_stream(p, stream)
        else:
            with pytest.raises(ConfigError):
                self.e.record_stream(p, stream)

    @rule()
    def process_events(self) -> None:
        self.e.process_events()

    @rule()
    def synchronize(self) -> None:
        self.e.synchronize()

    @rule()
    def empty_cache(self) -> None:
        self.e.empty_cache()

    # -- pools -----------------------------------------------------------------------------

    @rule(no_split=st.booleans(), use_on_oom=st.booleans())
    def create_pool(self, no_split: bool, use_on_oom: bool) -> None:
        pool = self.e.create_pool(no_split=no_split, use_on_oom=use_on_oom)
        assert pool not in self.uses
        self.uses[pool] = 1

    @precondition(lambda self: self.uses)
    @rule(data=st.data(), stream=st.integers(-1, STREAMS - 1))
    def begin_pool(self, data: st.DataObject, stream: int) -> None:
        pool = data.draw(st.sampled_from(sorted(self.uses)))
        if self.uses[pool] == 0:
            with pytest.raises(PoolError):
                self.e.begin_allocate_to_pool(pool, stream)
        elif pool in self.routing:
            with pytest.raises(AccelGraphError, match="already allocating"):
                self.e.begin_allocate_to_pool(pool, stream)
        else:
            self.e.begin_allocate_to_pool(pool, stream)
            self.uses[pool] += 1
            self.routing.add(pool)

    @precondition(lambda self: self.uses)
    @rule(data=st.data())
    def end_pool(self, data: st.DataObject) -> None:
        pool = data.draw(st.sampled_from(sorted(self.uses)))
        if pool in self.routing:
            self.e.end_allocate_to_pool(pool)
            self.routing.discard(pool)
        else:
            with pytest.raises(AccelGraphError, match="not currently allocating"):
                self.e.end_allocate_to_pool(pool)

    @precondition(lambda self: self.uses)
    @rule(data=st.data())
    def release_pool(self, data: st.DataObject) -> None:
        pool = data.draw(st.sampled_from(sorted(self.uses)))
        if self.uses[pool] == 0:
            with pytest.raises(PoolError):
                self.e.release_pool(pool)
        else:
            self.e.release_pool(pool)
            self.uses[pool] -= 1

    # -- settings, events, garbage ---------------------------------------------------------

    @rule(fraction=st.sampled_from([None, 0.0, 0.25, 0.5, 0.9, 1.0]))
    def memory_fraction(self, fraction: float | None) -> None:
        self.e.set_memory_fraction(fraction)

    @rule(max_entries=st.sampled_from([0, 1, 7, 1000]))
    def enable_events(self, max_entries: int) -> None:
        self.e.enable_events(max_entries)
        self.events_max = max_entries

    @rule()
    def drain_events(self) -> None:
        ev = self.e.drain_events()
        if self.events_max:
            assert len(ev) <= self.events_max
        if self.events_max is None:
            assert len(ev) == 0
        assert all(0 <= a < len(ACTIONS) for a in ev["action"].tolist())
        seqs = ev["seq"].tolist()
        assert seqs == sorted(set(seqs)), "event sequence numbers must increase"

    @rule(call=st.sampled_from(GARBAGE_CALLS), garbage=st.sampled_from(GARBAGE))
    def garbage_argument(self, call: tuple, garbage: object) -> None:
        name, fn = call
        if garbage is None and name in _NONE_OK:
            return
        if garbage is HUGE:
            garbage = 10**5000
        if name == "create_pool" and type(garbage) is bool:
            return  # a flag: well-formed
        if name == "malloc" and type(garbage) is int and garbage > 0:
            # past int64: torch's "more than 1EB" OOM (counted in num_ooms)
            with pytest.raises(OutOfMemoryError, match="1EB"):
                fn(self.e, garbage)
            return
        well_formed_pool = (
            name in _POOL_CALLS
            and type(garbage) is int
            and -(1 << 63) <= garbage < 1 << 63
        )
        before = self.e.memory_stats()
        if well_formed_pool:
            # end_allocate_to_pool of a pool that is not routing: a state error
            with pytest.raises(PoolError if name != "end_allocate_to_pool" else AccelGraphError):
                fn(self.e, garbage)
        else:
            with pytest.raises(ConfigError):
                fn(self.e, garbage)
        assert self.e.memory_stats() == before

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def statistics_hold(self) -> None:
        s = self.e.memory_stats()
        for key, value in s.items():
            assert value >= 0 or key == "max_split_size" and value == -1, (key, value)
            if key.endswith(".current"):
                assert value <= s[key[: -len("current")] + "peak"], key
        reserved = s["reserved_bytes.all.current"]
        assert s["allocated_bytes.all.current"] <= reserved
        assert s["active_bytes.all.current"] <= reserved
        assert s["accel.upstream_bytes"] == reserved
        assert reserved <= CAP
        # the live blocks are exactly what is allocated
        spans = sorted((p, p + self.e.block_size(p)) for p in self.blocks)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, f"blocks overlap: {spans}"
        total = sum(end - start for start, end in spans)
        assert s["allocated_bytes.all.current"] == total
        assert s["allocation.all.current"] == len(self.blocks)
        in_pools = self.e.pool_memory()["allocated_bytes"]
        for pool, uses in self.uses.items():
            try:
                info = self.e.pool_memory(pool)
            except PoolError:  # a released pool disappears with its last segment
                assert uses == 0
                continue
            assert info["use_count"] == uses == self.e.pool_use_count(pool)
            in_pools += info["allocated_bytes"]
        assert in_pools == total

    def teardown(self) -> None:
        e = self.e
        try:
            for p in list(self.blocks):
                e.free(p)
            for pool in self.routing:
                e.end_allocate_to_pool(pool)
            for pool, uses in self.uses.items():
                for _ in range(uses):
                    e.release_pool(pool)
            e.synchronize()
            e.empty_cache()
            s = e.memory_stats()
            assert s["reserved_bytes.all.current"] == 0, "empty_cache left memory reserved"
            assert s["accel.upstream_bytes"] == 0
            assert s["active_bytes.all.current"] == 0
            assert e.layout() == []
        finally:
            e.close()


CONFIGS = [(p, x) for p in ("native", "xpu", "bfc") for x in (False, True)]


@pytest.mark.parametrize(("policy", "expandable"), CONFIGS)
def test_random_engine_sequences(policy: str, expandable: bool) -> None:
    machine = type(
        f"EngineSequences_{policy}_{int(expandable)}",
        (EngineSequences,),
        {"policy": policy, "expandable": expandable},
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=30 * _SOAK,
            stateful_step_count=50,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
