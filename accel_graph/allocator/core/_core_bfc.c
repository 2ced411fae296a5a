/* accel-graph allocator core: the bfc policy, a model of TensorFlow's BFC allocator (best-fit
 * with coalescing), after the public tensorflow/core/common_runtime/bfc_allocator.{h,cc};
 * docs/allocator.md "bfc policy".
 *
 * - Requests are rounded to multiples of 256 bytes (bfc_round). There is no small/large split:
 *   every block lives in the BlockPool `large` (of the default pools, or of a private pool).
 * - Stream-unaware: every chunk sits in stream 0 of the free set, so any request reuses any
 *   free chunk; regions (segments) belong to stream 0. The request's stream is kept in
 *   `ustream` for the events and for record_stream, whose deferred frees work as elsewhere.
 * - Best fit: TF searches 21 power-of-two bins, each ordered by (size, address), from the
 *   request's bin upwards, and takes the first chunk that is large enough. That is the smallest
 *   sufficient chunk, lowest address first, which is what pool_lower returns from our
 *   (stream 0, size, address) set; the bins themselves change nothing observable.
 * - Split (should_split): when the chunk is at least twice the request, or the remainder is
 *   128 MiB or more; the allocation keeps the low part. Otherwise the whole chunk is handed out.
 * - Free: coalesce with the free neighbours of the same region (the shared free_block).
 * - Extend (allow_growth): the next region size starts at min(limit, 2 MiB); a request larger
 *   than it doubles it until it fits (that region is then exactly the doubled size), otherwise
 *   it doubles after each region. A region is min(next size, limit - reserved) bytes; when the
 *   upstream refuses it, the first time ever, the size backs off by 0.9x (rounded) while it
 *   still holds the request. The limit is the cap, the capacity and the memory fraction, the
 *   smallest that applies.
 * - On the way to OOM (TF's garbage_collection, on by default for GPUs): when no chunk fits
 *   and no region can be added, every wholly free region of the BlockPool is returned to the
 *   upstream if that could make room (limit - reserved + their bytes >= request; counted in
 *   num_alloc_retries), and the extension is tried once more.
 * - empty_cache (no TF equivalent) returns every wholly free region; a BlockPool that lost a
 *   region restarts its growth at max(first size, 2 x its largest remaining region).
 */
#include "_core_sets.h"

/* TF's RoundedBytes, multiples of 256 bytes (at least 256) */
#define BFC_MIN 256ULL
#define BFC_FIRST_REGION (2ULL << 20)
#define BFC_MAX_REGION (1ULL << 58) /* the next-region size stops doubling here (set keys) */
#define BFC_BACKPEDAL 0.9

static uint64_t bfc_round(uint64_t size) {
    return size < BFC_MIN ? BFC_MIN : (size + BFC_MIN - 1) / BFC_MIN * BFC_MIN;
}

/* no torch rounding knob applies */
static uint64_t bfc_round_size(const ag_settings *s, uint64_t size) { return bfc_round(size); }

/* the request is the region's lower bound (bfc_extend picks the region size) */
static uint64_t bfc_segment_size(const ag_settings *s, uint64_t rounded) { return rounded; }

/* bfc ignores torch's knobs (validated all the same): no expandable segments, no
 * max_split_size rules, no GC threshold, no NPU padding */
static void bfc_adjust_settings(ag_settings *s) {
    s->expandable_segments = 0;
    s->expandable_head_align = 0;
    s->round_extra = 0;
    s->max_split_size = UINT64_MAX;
    s->garbage_collection_threshold = 0.0;
}

static uint64_t bfc_limit(const ag_engine *e) {
    uint64_t lim = e->capacity;
    if (e->s.cap && e->s.cap < lim) lim = e->s.cap;
    if (e->set_fraction && e->allowed_max < lim) lim = e->allowed_max;
    return lim;
}

static uint64_t bfc_first_region(const ag_engine *e) {
    uint64_t lim = bfc_limit(e);
    return bfc_round(lim < BFC_FIRST_REGION ? lim : BFC_FIRST_REGION);
}

static void bfc_regrow(ag_engine *e, ag_bpool *p) {
    uint64_t largest = 0;
    for (ag_segment *g = e->segs; g; g = g->lnext)
        if (g->pool == p && g->size > largest) largest = g->size;
    uint64_t next = largest > BFC_MAX_REGION / 2 ? BFC_MAX_REGION : 2 * largest;
    uint64_t first = bfc_first_region(e);
    p->bfc_region = next > first ? next : first;
}

/* FindChunkPtr: the smallest free chunk that holds the request, lowest address first */
static int bfc_find(ag_engine *e, ag_request *p) {
    ag_block *b = pool_lower(p->pool, 0, p->size);
    if (!b) return 0;
    pool_erase(p->pool, b);
    p->block = b;
    return 1;
}

/* Extend: add one region to the BlockPool as one free chunk */
static int bfc_extend(ag_engine *e, ag_request *p) {
    if (p->err) return 0;
    ag_bpool *bp = p->pool;
    uint64_t lim = bfc_limit(e), used = (uint64_t)e->st.reserved_bytes[0].current;
    uint64_t avail = lim > used ? (lim - used) / BFC_MIN * BFC_MIN : 0;
    if (p->size > avail) return 0;
    if (!bp->bfc_region) bp->bfc_region = bfc_first_region(e);
    int increased = 0;
    while (p->size > bp->bfc_region) {
        bp->bfc_region *= 2;
        increased = 1;
    }
    uint64_t bytes = bp->bfc_region < avail ? bp->bfc_region : avail;
    p->alloc_size = bytes;
    uint64_t ptr = 0;
    int rc = up_alloc(e, bytes, &ptr);
    if (rc == AG_ERR_OOM && !bp->bfc_backpedal) {
        bp->bfc_backpedal = 1; /* only once, as TF's started_backpedal_ */
        while (rc == AG_ERR_OOM) {
            uint64_t less = bfc_round((uint64_t)((double)bytes * BFC_BACKPEDAL));
            if (less < p->size || less >= bytes) break;
            bytes = less;
            rc = up_alloc(e, bytes, &ptr);
        }
    }
    if (rc) {
        if (rc != AG_ERR_OOM) p->err = rc;
        return 0;
    }
    if (!increased && bp->bfc_region < BFC_MAX_REGION) bp->bfc_region *= 2;
    ag_block *b = seg_add(e, p, ptr, bytes, bp, 0);
    if (!b) return 0;
    pool_insert(bp, b);
    p->alloc_size = bytes;
    return 1;
}

/* DeallocateFreeRegions: give back every wholly free region of the BlockPool if that can
 * make room for the request */
static int bfc_deallocate_free_regions(ag_engine *e, ag_request *p) {
    if (p->err || e->no_release) return 0;
    ag_bpool *bp = p->pool;
    uint64_t total = 0;
    for (ag_segment *g = e->segs; g; g = g->lnext)
        if (g->pool == bp && !g->head->next && !g->head->allocated && !g->head->event_count) total += g->size;
    if (!total) return 0;
    uint64_t lim = bfc_limit(e), used = (uint64_t)e->st.reserved_bytes[0].current;
    uint64_t avail = (lim > used ? lim - used : 0) + total;
    if (p->size > avail) return 0;
    e->st.num_alloc_retries++;
    /* in address order, as TF walks its regions */
    for (;;) {
        ag_segment *low = NULL;
        for (ag_segment *g = e->segs; g; g = g->lnext)
            if (g->pool == bp && !g->head->next && !g->head->allocated && !g->head->event_count &&
                (!low || g->base < low->base))
                low = g;
        if (!low) break;
        release_block(e, low->head);
    }
    return 1;
}

/* TF's AllocateRawInternal after FindChunkPtr failed: extend, (use_on_oom pools), free
 * regions + extend. An OOM reports the request itself as the size tried. */
static int bfc_acquire(ag_engine *e, ag_request *p) {
    int found = (bfc_extend(e, p) && bfc_find(e, p)) || try_mempool_fallback(e, p) ||
                (bfc_deallocate_free_regions(e, p) && bfc_extend(e, p) && bfc_find(e, p));
    if (!found && !p->err) p->alloc_size = p->size;
    return found;
}

/* TF FindChunkPtr: split when the chunk is at least twice the request, or when keeping it
 * whole would waste 128 MiB or more */
static int bfc_should_split(const ag_engine *e, const ag_bpool *bp, uint64_t rem, uint64_t size) {
    return rem >= size || rem >= (128ULL << 20);
}

const ag_policy_ops ag_policy_bfc = {
    .name = "bfc",
    .max_split = 0,
    .stream_aware = 0,
    .small_pool = 0,
    .adjust_settings = bfc_adjust_settings,
    .round_size = bfc_round_size,
    .segment_size = bfc_segment_size,
    .find = bfc_find,
    .acquire = bfc_acquire,
    .should_split = bfc_should_split,
    .segments_released = bfc_regrow,
};
