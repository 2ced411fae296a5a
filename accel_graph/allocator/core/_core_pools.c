/* accel-graph allocator core: streams and private pools (torch's MemPool: a pool receives
 * the allocations of the streams routed to it between begin and end_allocate_to_pool).
 */
#include "_core_internal.h"

#include <stdlib.h>
#include <string.h>

int check_stream(ag_engine *e, int32_t stream) {
    if (stream < 0 || stream >= e->n_streams)
        return fail(e, AG_ERR_INVALID, "unknown stream %d: this engine has streams 0..%d (create more with create_stream())",
                    stream, e->n_streams - 1);
    return AG_OK;
}

ag_ppool *find_ppool(const ag_engine *e, int64_t id) {
    for (ag_ppool *q = e->ppools; q; q = q->next)
        if (q->id == id) return q;
    return NULL;
}

int32_t im_create_stream(ag_engine *e) {
    if (e->n_streams >= MAX_STREAMS)
        return fail(e, AG_ERR_UNSUPPORTED, "at most %d streams per engine", MAX_STREAMS);
    return e->n_streams++;
}

int32_t im_num_streams(const ag_engine *e) { return e->n_streams; }

int64_t im_create_pool(ag_engine *e, int32_t flags) {
    ag_ppool *q = calloc(1, sizeof *q);
    if (!q) return fail(e, AG_ERR_NOMEM, "out of host memory for a pool");
    q->id = e->next_pool_id++;
    q->use_count = 1;
    if (flags & ~(AG_POOL_NO_SPLIT | AG_POOL_USE_ON_OOM)) {
        free(q);
        return fail(e, AG_ERR_INVALID, "unknown pool flags 0x%x", (unsigned)flags);
    }
    q->no_split = (flags & AG_POOL_NO_SPLIT) != 0;
    q->use_on_oom = (flags & AG_POOL_USE_ON_OOM) != 0;
    q->small.is_small = 1;
    q->small.owner = q;
    q->large.owner = q;
    q->next = e->ppools;
    e->ppools = q;
    return q->id;
}

static ag_ppool *live_pool(ag_engine *e, int64_t id, const char *what) {
    ag_ppool *q = find_ppool(e, id);
    if (!q || q->use_count <= 0) {
        fail(e, AG_ERR_POOL, "%s: pool %lld is %s", what, (long long)id,
             q ? "released (use count 0)" : "not a pool of this engine");
        return NULL;
    }
    return q;
}

int im_begin_allocate_to_pool(ag_engine *e, int64_t pool_id, int32_t stream) {
    ag_ppool *q = live_pool(e, pool_id, "begin_allocate_to_pool");
    if (!q) return AG_ERR_POOL;
    if (stream != -1 && check_stream(e, stream)) return AG_ERR_INVALID;
    for (int i = 0; i < e->n_captures; i++)
        if (e->captures[i].pool == q)
            return fail(e, AG_ERR_STATE, "begin_allocate_to_pool: already allocating to pool %lld", (long long)pool_id);
    if (e->n_captures == MAX_CAPTURES)
        return fail(e, AG_ERR_UNSUPPORTED, "at most %d pools can receive allocations at once", MAX_CAPTURES);
    q->use_count++;
    e->captures[e->n_captures].pool = q;
    e->captures[e->n_captures].stream = stream;
    e->n_captures++;
    return AG_OK;
}

int im_end_allocate_to_pool(ag_engine *e, int64_t pool_id) {
    for (int i = 0; i < e->n_captures; i++) {
        if (e->captures[i].pool->id == pool_id) {
            memmove(&e->captures[i], &e->captures[i + 1], (size_t)(e->n_captures - i - 1) * sizeof e->captures[0]);
            e->n_captures--;
            return AG_OK;
        }
    }
    return fail(e, AG_ERR_STATE, "end_allocate_to_pool: not currently allocating to pool %lld", (long long)pool_id);
}

int im_release_pool(ag_engine *e, int64_t pool_id) {
    ag_ppool *q = live_pool(e, pool_id, "release_pool");
    if (!q) return AG_ERR_POOL;
    if (--q->use_count == 0) q->freeable = 1;
    return AG_OK;
}

int im_pool_use_count(const ag_engine *e, int64_t pool_id) {
    ag_ppool *q = find_ppool(e, pool_id);
    return q ? q->use_count
             : fail((ag_engine *)e, AG_ERR_POOL, "pool %lld is not a pool of this engine", (long long)pool_id);
}

/* What one pool holds, walked from the segment list (pool id 0: the default pools). */
int im_pool_info_get(const ag_engine *e, int64_t pool_id, ag_pool_info *out) {
    memset(out, 0, sizeof *out);
    if (pool_id) {
        ag_ppool *q = find_ppool(e, pool_id);
        if (!q) return fail((ag_engine *)e, AG_ERR_POOL, "pool %lld is not a pool of this engine", (long long)pool_id);
        out->use_count = q->use_count;
        out->freeable = q->freeable;
    }
    for (ag_segment *g = e->segs; g; g = g->lnext) {
        if ((g->pool->owner ? g->pool->owner->id : 0) != pool_id) continue;
        out->segments++;
        for (ag_block *b = g->head; b; b = b->next) {
            if (b->mapped) out->reserved_bytes += (int64_t)b->size;
            if (b->allocated) {
                out->allocated_bytes += (int64_t)b->size;
                out->blocks_allocated++;
            }
            if (b->allocated || b->event_count > 0) out->active_bytes += (int64_t)b->size;
        }
    }
    return AG_OK;
}
