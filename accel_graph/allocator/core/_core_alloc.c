/* accel-graph allocator core: malloc, free and record_stream, the policy-independent steps
 * of section 4 (the policy's steps are behind e->pol, _core_native.c and _core_bfc.c).
 */
#include "_core_sets.h"

#include <stdlib.h>
#include <string.h>

/* torch's round_size under the settings' policy (an unknown one rounds as xpu) */
uint64_t ag_round_size(const ag_settings *s, uint64_t size) {
    const ag_policy_ops *pol = ag_policy_of(s->policy);
    return (pol ? pol : &ag_policy_xpu)->round_size(s, size);
}

/* ------------------------------------------------------------------------------------------ */
/* merging and freeing (section 4 "free(block)")                                               */

uint64_t try_merge(ag_engine *e, ag_block *dst, ag_block *src) {
    if (!src || src->allocated || src->event_count > 0 || src->stream_uses || dst->mapped != src->mapped)
        return 0;
    ag_bpool *p = dst->pool;
    if (src->mapped) pool_erase(p, src);
    else unmapped_erase(p, src);
    if (dst->prev == src) {
        dst->ptr = src->ptr;
        dst->prev = src->prev;
        if (dst->prev) dst->prev->next = dst;
        if (dst->seg->head == src) dst->seg->head = dst;
    } else {
        dst->next = src->next;
        if (dst->next) dst->next->prev = dst;
    }
    uint64_t sub = src->size;
    dst->size += sub;
    blk_del(e, src);
    return sub;
}

static void free_block(ag_engine *e, ag_block *b) {
    ag_bpool *p = b->pool;
    EVENT(e, AG_EV_FREE_COMPLETED, b->ptr, b->requested, b->ustream, p);
    uint64_t orig = b->size, req = b->requested;
    hdel(e, b->ptr);
    int64_t nblocks = 0, nbytes = 0;
    ag_block *cands[2] = {b->prev, b->next};
    for (int i = 0; i < 2; i++) {
        uint64_t sub = try_merge(e, b, cands[i]);
        if (sub) {
            nblocks -= 1;
            nbytes -= (int64_t)sub;
        }
    }
    pool_insert(p, b);
    if (is_split(b)) {
        nblocks += 1;
        nbytes += (int64_t)b->size;
    }
    /* inactive_split ignores expandable segments, as torch does */
    if (!b->seg->expandable) {
        if (nblocks) stat2(e->st.inactive_split, p, nblocks);
        if (nbytes) stat2(e->st.inactive_split_bytes, p, nbytes);
    }
    stat2(e->st.active, p, -1);
    stat2(e->st.active_bytes, p, -(int64_t)orig);
    stat2(e->st.requested_bytes, p, -(int64_t)req);
}

/* Complete every pending free: in this model the events recorded at free time have all
 * completed by the next process_events/synchronize. */
static void complete_pending(ag_engine *e) {
    ag_block *b = e->pend_head;
    e->pend_head = e->pend_tail = NULL;
    while (b) {
        ag_block *n = b->pend_next;
        b->pend_next = NULL;
        b->event_count = 0;
        free_block(e, b);
        b = n;
    }
}

void synchronize_and_free_events(ag_engine *e) {
    e->st.num_sync_all_streams++;
    complete_pending(e);
}

/* ------------------------------------------------------------------------------------------ */
/* malloc (section 4 "malloc(orig_size, stream)")                                              */

/* MemPools made with use_on_oom lend their free blocks to default-pool requests as a last
 * resort, lowest pool id first (torch keeps them in an ordered set of ids). */
int try_mempool_fallback(ag_engine *e, ag_request *p) {
    if (p->err || p->pool->owner) return 0;
    int small = p->pool->is_small;
    ag_ppool *best = NULL;
    for (;;) {
        /* next use_on_oom pool by id after `best` (pools are few) */
        ag_ppool *next = NULL;
        for (ag_ppool *q = e->ppools; q; q = q->next)
            if (q->use_on_oom && q->use_count > 0 && (!best || q->id > best->id) && (!next || q->id < next->id))
                next = q;
        if (!next) return 0;
        best = next;
        ag_bpool *saved = p->pool;
        p->pool = small ? &next->small : &next->large;
        if (e->pol->find(e, p)) return 1;
        p->pool = saved;
    }
}

static int should_split(const ag_engine *e, const ag_block *b, uint64_t size) {
    const ag_bpool *bp = b->pool;
    if (bp->owner && bp->owner->no_split) return 0;
    return e->pol->should_split(e, bp, b->size - size, size);
}

/* step 8 */
static ag_block *alloc_found_block(ag_engine *e, ag_request *p, uint64_t orig) {
    ag_block *b = p->block;
    ag_bpool *bp = p->pool;
    int expandable = b->seg->expandable;
    uint64_t al = e->s.expandable_head_align;
    if (al && e->s.expandable_segments && p->size >= KROUND_LARGE && b->ptr % al) {
        /* torch_npu: start the block on the next aligned address if it still fits; the
         * skipped head stays a free block of its own */
        uint64_t off = al - b->ptr % al;
        if (off + p->size <= b->size) {
            ag_block *h = b;
            b = blk_neighbour(e, h, h->ptr + off, h->size - off, 0);
            h->size = off;
            pool_insert(bp, h);
        }
    }
    int already_split = is_split(b);
    if (should_split(e, b, p->size)) {
        ag_block *rem = b;
        b = blk_neighbour(e, rem, rem->ptr, p->size, 1);
        b->stream = p->stream;
        rem->ptr += p->size;
        rem->size -= p->size;
        pool_insert(bp, rem);
        if (!expandable) {
            if (already_split) {
                stat2(e->st.inactive_split_bytes, bp, -(int64_t)b->size);
            } else {
                stat2(e->st.inactive_split, bp, 1);
                stat2(e->st.inactive_split_bytes, bp, (int64_t)rem->size);
            }
        }
    } else if (already_split && !expandable) {
        stat2(e->st.inactive_split, bp, -1);
        stat2(e->st.inactive_split_bytes, bp, -(int64_t)b->size);
    }
    b->allocated = 1;
    b->requested = orig;
    b->stream_uses = 0;
    b->ustream = p->ustream;
    hput(e, b->ptr, b);
    EVENT(e, AG_EV_ALLOC, b->ptr, orig, b->ustream, bp);
    stat2(e->st.allocation, bp, 1);
    stat2(e->st.allocated_bytes, bp, (int64_t)b->size);
    stat2(e->st.active, bp, 1);
    stat2(e->st.active_bytes, bp, (int64_t)b->size);
    stat2(e->st.requested_bytes, bp, (int64_t)orig);
    if (max_split_on(e) && b->size >= e->s.max_split_size) stat_add(&e->st.oversize_allocations, 1);
    return b;
}

static uint64_t cached_in_private_pools(const ag_engine *e) {
    /* torch's OOM message counts the free cached blocks of private pools */
    uint64_t total = 0;
    for (ag_ppool *q = e->ppools; q; q = q->next) {
        ag_bpool *ps[2] = {&q->small, &q->large};
        for (int i = 0; i < 2; i++) {
            size_t n = ps[i]->n_free;
            ag_block **all = n ? malloc(n * sizeof *all) : NULL;
            if (!all) continue;
            n = pool_collect(ps[i], all);
            for (size_t j = 0; j < n; j++) total += all[j]->size;
            free(all);
        }
    }
    return total;
}

int64_t im_malloc(ag_engine *e, int64_t size, int32_t stream, int64_t pool_id) {
    if (size <= 0)
        return fail(e, AG_ERR_INVALID, "allocation size must be positive, got %lld", (long long)size);
    if ((uint64_t)size >= ONE_EB) {
        memset(&ag_tls_oom, 0, sizeof ag_tls_oom);
        ag_tls_oom.kind = 2;
        ag_tls_oom.requested = (uint64_t)size;
        ag_tls_oom.stream = stream;
        return fail(e, AG_ERR_OOM, "Tried to allocate more than 1EB memory.");
    }
    if (check_stream(e, stream)) return AG_ERR_INVALID;
    ag_ppool *explicit_pool = NULL;
    if (pool_id) {
        explicit_pool = find_ppool(e, pool_id);
        if (!explicit_pool || explicit_pool->use_count <= 0)
            return fail(e, AG_ERR_POOL, "pool %lld is %s", (long long)pool_id,
                        explicit_pool ? "released (use count 0)" : "not a pool of this engine");
    }
    /* enough metadata for the worst case of this call, taken before anything changes */
    if (!reserve_blocks(e, 8) || !hreserve(e))
        return fail(e, AG_ERR_NOMEM, "out of host memory for allocator metadata");

    /* step 1: cross-stream frees complete, unless a capture (or pool routing) is underway */
    if (e->n_captures == 0) complete_pending(e);

    /* step 2 */
    const ag_policy_ops *pol = e->pol;
    ag_request p = {0};
    p.size = pol->round_size(&e->s, (uint64_t)size);
    p.stream = pol->stream_aware ? stream : 0;
    p.ustream = stream;
    int small = pol->small_pool && p.size <= KSMALL_SIZE;
    if (explicit_pool) {
        p.pool = small ? &explicit_pool->small : &explicit_pool->large;
    } else {
        p.pool = small ? &e->small : &e->large;
        for (int i = 0; i < e->n_captures; i++) {
            if (e->captures[i].stream < 0 || e->captures[i].stream == stream) {
                p.pool = small ? &e->captures[i].pool->small : &e->captures[i].pool->large;
                break;
            }
        }
    }
    p.alloc_size = pol->segment_size(&e->s, p.size);

    /* step 3, else steps 4-5 */
    int found = pol->find(e, &p) || pol->acquire(e, &p);
    if (!found) {
        if (p.err) {
            if (p.err == AG_ERR_UPSTREAM)
                return fail(e, AG_ERR_UPSTREAM, "the device runtime failed with error %d while allocating %llu bytes",
                            e->up.last_err, (unsigned long long)p.alloc_size);
            if (p.err == AG_ERR_UNSUPPORTED)
                return fail(e, AG_ERR_UNSUPPORTED, "this upstream cannot reserve address space for expandable segments");
            return fail(e, p.err, "out of host memory for allocator metadata");
        }
        /* step 6 */
        e->st.num_ooms++;
        ag_oom_info *o = &ag_tls_oom;
        o->kind = 1;
        o->stream = stream;
        o->fraction_set = e->set_fraction;
        o->expandable_segments = e->s.expandable_segments;
        o->requested = (uint64_t)size;
        o->rounded = p.size;
        o->alloc_size = p.alloc_size;
        o->capacity = e->capacity;
        o->device_free = up_device_free(e);
        o->allowed = e->allowed_max;
        o->reserved = (uint64_t)e->st.reserved_bytes[0].current;
        o->allocated = (uint64_t)e->st.allocated_bytes[0].current;
        o->cached_in_private_pools = cached_in_private_pools(e);
        EVENT(e, AG_EV_OOM, o->device_free, p.size, stream, p.pool);
        return fail(e, AG_ERR_OOM, "out of memory: tried to allocate %llu bytes",
                    (unsigned long long)p.alloc_size);
    }
    ag_block *b = alloc_found_block(e, &p, (uint64_t)size);
    return (int64_t)b->ptr;
}

int im_free(ag_engine *e, uint64_t ptr) {
    ag_block *b = hget(e, ptr);
    if (!b || !b->allocated)
        return fail(e, AG_ERR_BAD_PTR, "free(0x%llx): %s", (unsigned long long)ptr,
                    b ? "already freed (its free is pending on other streams)"
                      : "not an allocated block of this engine (unknown pointer or double free)");
    ag_bpool *p = b->pool;
    b->allocated = 0;
    stat2(e->st.allocation, p, -1);
    stat2(e->st.allocated_bytes, p, -(int64_t)b->size);
    EVENT(e, AG_EV_FREE_REQUESTED, b->ptr, b->requested, b->ustream, p);
    if (max_split_on(e) && b->size >= e->s.max_split_size) stat_add(&e->st.oversize_allocations, -1);
    if (b->stream_uses) {
        /* one event per use stream; the block is active_pending_free until they complete */
        b->event_count = __builtin_popcountll(b->stream_uses);
        b->stream_uses = 0;
        b->pend_next = NULL;
        if (e->pend_tail) e->pend_tail->pend_next = b;
        else e->pend_head = b;
        e->pend_tail = b;
    } else {
        free_block(e, b);
    }
    return AG_OK;
}

int im_record_stream(ag_engine *e, uint64_t ptr, int32_t stream) {
    if (check_stream(e, stream)) return AG_ERR_INVALID;
    ag_block *b = hget(e, ptr);
    if (!b || !b->allocated)
        return fail(e, AG_ERR_BAD_PTR, "record_stream(0x%llx): not an allocated block of this engine",
                    (unsigned long long)ptr);
    if (stream != b->ustream) b->stream_uses |= 1ULL << stream; /* uses on the own stream need no sync */
    return AG_OK;
}

int64_t im_block_size(ag_engine *e, uint64_t ptr) {
    ag_block *b = hget(e, ptr);
    if (!b || !b->allocated)
        return fail(e, AG_ERR_BAD_PTR, "0x%llx is not an allocated block of this engine", (unsigned long long)ptr);
    return (int64_t)b->size;
}

int im_process_events(ag_engine *e) {
    if (e->n_captures == 0) complete_pending(e);
    return AG_OK;
}

int im_synchronize(ag_engine *e) {
    synchronize_and_free_events(e);
    return AG_OK;
}

int im_empty_cache(ag_engine *e) {
    if (!reserve_blocks(e, 8)) return fail(e, AG_ERR_NOMEM, "out of host memory for allocator metadata");
    int rc = release_cached_blocks(e);
    return rc ? fail(e, rc, "out of host memory while releasing cached blocks") : AG_OK;
}


int im_set_requested(ag_engine *e, uint64_t ptr, int64_t requested) {
    /* the requested size of a live block (requested_bytes counts it); a block's size is fixed */
    ag_block *b = hget(e, ptr);
    if (!b || !b->allocated)
        return fail(e, AG_ERR_BAD_PTR, "set_requested(0x%llx): not an allocated block of this engine",
                    (unsigned long long)ptr);
    if (requested < 1 || (uint64_t)requested > b->size)
        return fail(e, AG_ERR_INVALID, "set_requested(0x%llx): %lld bytes is not in 1..%llu (the block size)",
                    (unsigned long long)ptr, (long long)requested, (unsigned long long)b->size);
    stat2(e->st.requested_bytes, b->pool, (int64_t)requested - (int64_t)b->requested);
    b->requested = (uint64_t)requested;
    return AG_OK;
}
