/* accel-graph allocator core: replay, a whole trace in one call (docs/allocator.md "Replay"):
 * ag_op records run in order under one lock, so a replay pays nothing per event for thread
 * safety or for crossing into C.
 */
#include "_core_internal.h"

int im_replay(ag_engine *e, const ag_op *ops, int64_t n, uint64_t *slots, int64_t nslots,
              int64_t *results, int64_t *n_done) {
    int64_t i;
    int64_t r = 0;
    for (i = 0; i < n; i++) {
        const ag_op *o = &ops[i];
        r = 0;
        switch (o->op) {
        case AG_OP_MALLOC:
        case AG_OP_MALLOC_POOL:
        case AG_OP_FREE:
        case AG_OP_RECORD_STREAM:
        case AG_OP_SET_REQUESTED:
            if (o->id < 0 || o->id >= nslots) {
                r = fail(e, AG_ERR_INVALID, "op %lld: slot %lld out of range 0..%lld", (long long)i,
                         (long long)o->id, (long long)nslots - 1);
                goto out;
            }
            if (o->op == AG_OP_MALLOC || o->op == AG_OP_MALLOC_POOL) {
                r = im_malloc(e, o->size, o->stream, o->op == AG_OP_MALLOC_POOL ? o->size2 : 0);
                /* an OOM is a result, not the end of the trace: the slot stays empty and a
                 * later free of it is skipped */
                slots[o->id] = r > 0 ? (uint64_t)r : 0;
                if (r < 0 && r != AG_ERR_OOM) goto out;
            } else if (slots[o->id]) {
                if (o->op == AG_OP_FREE) {
                    r = im_free(e, slots[o->id]);
                    slots[o->id] = 0;
                } else if (o->op == AG_OP_SET_REQUESTED) {
                    r = im_set_requested(e, slots[o->id], o->size);
                } else {
                    r = im_record_stream(e, slots[o->id], o->stream);
                }
                if (r < 0) goto out;
            }
            break;
        case AG_OP_PROCESS_EVENTS: r = im_process_events(e); break;
        case AG_OP_SYNCHRONIZE: r = im_synchronize(e); break;
        case AG_OP_EMPTY_CACHE: r = im_empty_cache(e); break;
        case AG_OP_BEGIN_POOL: r = im_begin_allocate_to_pool(e, o->id, o->stream); break;
        case AG_OP_END_POOL: r = im_end_allocate_to_pool(e, o->id); break;
        case AG_OP_RELEASE_POOL: r = im_release_pool(e, o->id); break;
        case AG_OP_RESET_PEAK_STATS: im_reset_peak_stats(e); break;
        default:
            r = fail(e, AG_ERR_INVALID, "op %lld: unknown opcode %d", (long long)i, o->op);
            goto out;
        }
        if (r < 0 && r != AG_ERR_OOM) goto out;
        if (results) results[i] = r;
    }
    *n_done = i;
    return AG_OK;
out:
    if (results) results[i] = r;
    *n_done = i;
    return (int)r;
}
