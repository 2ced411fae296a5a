/* accel-graph allocator core: the locked public entry points. Each ag_<name> of _core.h is
 * im_<name> under the engine's mutex: cffi drops the GIL around calls, so threads may share
 * an engine.
 */
#include "_core_internal.h"

/* ag_<name>(params) = im_<name>(args) under the engine's lock */
#define LOCKED(ret, name, params, args)                                                        \
    ret ag_##name params {                                                                     \
        LOCK(e);                                                                               \
        ret r = im_##name args;                                                                \
        UNLOCK(e);                                                                             \
        return r;                                                                              \
    }
#define LOCKED_VOID(name, params, args)                                                        \
    void ag_##name params {                                                                    \
        LOCK(e);                                                                               \
        im_##name args;                                                                        \
        UNLOCK(e);                                                                             \
    }

LOCKED(int64_t, malloc, (ag_engine *e, int64_t size, int32_t stream, int64_t pool_id), (e, size, stream, pool_id))
LOCKED(int, free, (ag_engine *e, uint64_t ptr), (e, ptr))
LOCKED(int, record_stream, (ag_engine *e, uint64_t ptr, int32_t stream), (e, ptr, stream))
LOCKED(int64_t, block_size, (ag_engine *e, uint64_t ptr), (e, ptr))
LOCKED(int, process_events, (ag_engine *e), (e))
LOCKED(int, synchronize, (ag_engine *e), (e))
LOCKED(int, empty_cache, (ag_engine *e), (e))
LOCKED(int32_t, create_stream, (ag_engine *e), (e))
LOCKED(int64_t, create_pool, (ag_engine *e, int32_t flags), (e, flags))
LOCKED(int, begin_allocate_to_pool, (ag_engine *e, int64_t pool_id, int32_t stream), (e, pool_id, stream))
LOCKED(int, end_allocate_to_pool, (ag_engine *e, int64_t pool_id), (e, pool_id))
LOCKED(int, release_pool, (ag_engine *e, int64_t pool_id), (e, pool_id))
LOCKED(int, pool_use_count, (const ag_engine *e, int64_t pool_id), (e, pool_id))
LOCKED(int, set_memory_fraction, (ag_engine *e, double fraction), (e, fraction))
LOCKED_VOID(get_stats, (const ag_engine *e, ag_stats *out), (e, out))
LOCKED_VOID(reset_peak_stats, (ag_engine *e), (e))
LOCKED_VOID(reset_accumulated_stats, (ag_engine *e), (e))
LOCKED(int, layout_counts, (const ag_engine *e, int64_t *n_segments, int64_t *n_blocks), (e, n_segments, n_blocks))
LOCKED(int, events_enable, (ag_engine *e, int32_t on, int64_t max_entries), (e, on, max_entries))
LOCKED(int64_t, events_count, (const ag_engine *e), (e))
LOCKED(int64_t, events_drain, (ag_engine *e, ag_event *out, int64_t max), (e, out, max))
LOCKED(int32_t, num_streams, (const ag_engine *e), (e))
LOCKED(int, pool_info_get, (const ag_engine *e, int64_t pool_id, ag_pool_info *out), (e, pool_id, out))
LOCKED(int, layout, (const ag_engine *e, ag_segment_info *segs, int64_t max_segs, ag_block_info *blocks, int64_t max_blocks), (e, segs, max_segs, blocks, max_blocks))
/* one lock for the whole trace: replay pays nothing per event for thread safety */
LOCKED(int, replay, (ag_engine *e, const ag_op *ops, int64_t n, uint64_t *slots, int64_t nslots, int64_t *results, int64_t *n_done), (e, ops, n, slots, nslots, results, n_done))
