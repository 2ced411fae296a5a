/* accel-graph allocator core: segments, what the upstream hands out (one allocation, or for
 * expandable segments one reserved address range whose pages are mapped on demand): creating
 * them, giving them back (section 4 "Releasing memory"), and mapping/unmapping pages.
 */
#include "_core_sets.h"

#include <stdlib.h>

/* ------------------------------------------------------------------------------------------ */
/* segments                                                                                    */

static ag_segment *seg_new(ag_engine *e, uint64_t base, uint64_t size, ag_bpool *p, int32_t stream) {
    ag_segment *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->base = base;
    g->size = size;
    g->pool = p;
    g->stream = stream;
    g->lnext = e->segs;
    if (e->segs) e->segs->lprev = g;
    e->segs = g;
    e->n_segs++;
    if (p->owner) p->owner->n_segments++;
    return g;
}

static void seg_del(ag_engine *e, ag_segment *g) {
    if (g->lprev) g->lprev->lnext = g->lnext;
    else e->segs = g->lnext;
    if (g->lnext) g->lnext->lprev = g->lprev;
    if (g->pool->owner) g->pool->owner->n_segments--;
    e->n_segs--;
    free(g);
}

ag_block *seg_add(ag_engine *e, ag_request *p, uint64_t ptr, uint64_t size, ag_bpool *bp, int32_t stream) {
    ag_segment *g = seg_new(e, ptr, size, bp, stream);
    if (!g) {
        up_free(e, ptr, size);
        p->err = AG_ERR_NOMEM;
        return NULL;
    }
    ag_block *b = blk_new(e);
    b->ptr = ptr;
    b->size = size;
    b->stream = stream;
    b->pool = bp;
    b->seg = g;
    g->head = b;
    stat2(e->st.segment, bp, 1);
    stat2(e->st.reserved_bytes, bp, (int64_t)size);
    if (max_split_on(e) && size >= e->s.max_split_size) stat_add(&e->st.oversize_segments, 1);
    e->st.num_device_alloc++;
    e->st.device_mallocs++;
    EVENT(e, AG_EV_SEGMENT_ALLOC, ptr, size, stream, bp);
    return b;
}

/* ------------------------------------------------------------------------------------------ */
/* releasing memory (section 4 "Releasing memory")                                             */

void release_block(ag_engine *e, ag_block *b) {
    ag_bpool *p = b->pool;
    ag_segment *g = b->seg;
    EVENT(e, AG_EV_SEGMENT_FREE, b->ptr, b->size, b->stream, p);
    up_free(e, b->ptr, b->size);
    stat2(e->st.segment, p, -1);
    stat2(e->st.reserved_bytes, p, -(int64_t)b->size);
    if (max_split_on(e) && b->size >= e->s.max_split_size) stat_add(&e->st.oversize_segments, -1);
    pool_erase(p, b);
    e->st.num_device_free++;
    e->st.device_frees++;
    seg_del(e, g);
    blk_del(e, b);
}

static void unmap_block(ag_engine *e, ag_block *b) {
    ag_segment *g = b->seg;
    ag_bpool *p = b->pool;
    uint64_t pg = g->page;
    uint64_t begin = (b->ptr - g->base + pg - 1) / pg * pg + g->base;
    uint64_t end = (b->ptr + b->size - g->base) / pg * pg + g->base;
    if (begin >= end) return;
    pool_erase(p, b);
    uint64_t before = begin - b->ptr;
    uint64_t after = b->ptr + b->size - end;
    if (before) pool_insert(p, blk_neighbour(e, b, b->ptr, before, 1));
    if (after) pool_insert(p, blk_neighbour(e, b, end, after, 0));
    b->ptr = begin;
    b->size = end - begin;
    b->mapped = 0;
    try_merge(e, b, b->prev);
    try_merge(e, b, b->next);
    unmapped_insert(p, b);
    up_unmap(e, begin, end - begin);
    stat2(e->st.reserved_bytes, p, -(int64_t)(end - begin));
    e->st.num_device_free++;
    e->st.device_unmaps++;
    EVENT(e, AG_EV_SEGMENT_UNMAP, begin, end - begin, b->stream, p);
}

static void release_expandable_segment(ag_engine *e, ag_block *b) {
    ag_segment *g = b->seg;
    unmapped_erase(b->pool, b);
    up_unreserve(e, g->base, g->size);
    seg_del(e, g);
    blk_del(e, b);
}

/* Free every whole free segment of a BlockPool; unmap the whole free pages of ES blocks. */
static int release_blocks(ag_engine *e, ag_bpool *p) {
    size_t n = p->n_free;
    if (!n) return AG_OK;
    ag_block **all = malloc(n * sizeof *all);
    if (!all || !reserve_blocks(e, 2 * n)) {
        free(all);
        return AG_ERR_NOMEM;
    }
    n = pool_collect(p, all);
    size_t nu = 0, released = 0;
    for (size_t i = 0; i < n; i++) {
        ag_block *b = all[i];
        if (b->seg->expandable) all[nu++] = b; /* unmapping mutates the set: gather first */
        else if (!b->prev && !b->next) {
            release_block(e, b);
            released++;
        }
    }
    if (released && e->pol->segments_released) e->pol->segments_released(e, p);
    for (size_t i = 0; i < nu; i++) {
        ag_block *b = all[i];
        unmap_block(e, b);
        if (!b->prev && !b->next && !b->mapped) release_expandable_segment(e, b);
    }
    free(all);
    return AG_OK;
}

static void maybe_delete_pools(ag_engine *e) {
    ag_ppool **pp = &e->ppools;
    while (*pp) {
        ag_ppool *q = *pp;
        int capturing = 0;
        for (int i = 0; i < e->n_captures; i++) capturing |= e->captures[i].pool == q;
        if (q->freeable && q->n_segments == 0 && !capturing) {
            *pp = q->next;
            free(q);
        } else {
            pp = &q->next;
        }
    }
}

int release_cached_blocks(ag_engine *e) {
    int rc = AG_OK;
    if (e->n_captures == 0) {
        synchronize_and_free_events(e);
        rc |= release_blocks(e, &e->large);
        rc |= release_blocks(e, &e->small);
    }
    for (ag_ppool *q = e->ppools; q; q = q->next) {
        if (!q->freeable) continue;
        rc |= release_blocks(e, &q->small);
        rc |= release_blocks(e, &q->large);
    }
    maybe_delete_pools(e);
    return rc ? AG_ERR_NOMEM : AG_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* expandable segments: finding and mapping a run of pages                                     */

static ag_block *find_expandable_block(ag_engine *e, ag_request *p) {
    ag_bpool *bp = p->pool;
    for (ag_block *c = t_lower(bp->unmapped_root, addr_key(p->stream, 0)); c && c->stream == p->stream;
         c = t_succ(bp->unmapped_root, c)) {
        ag_block *x = c;
        /* a free mapped block right before the unmapped one extends the run */
        if (x->prev && !x->prev->allocated && !x->prev->event_count && !x->prev->stream_uses) x = x->prev;
        uint64_t bytes = 0;
        for (ag_block *y = x; y && bytes < p->size && !y->allocated && !y->event_count && !y->stream_uses;
             y = y->next)
            bytes += y->size;
        if (bytes >= p->size) return x;
    }
    uint64_t page = bp->is_small ? KSMALL_BUFFER : e->s.large_segment_size;
    uint64_t cap = e->capacity == UINT64_MAX ? DEFAULT_VA : e->capacity;
    if (cap > (1ULL << 59)) cap = 1ULL << 59; /* keys need sizes below 2^61 */
    uint64_t va = cap + cap / 8;
    va = (va + page - 1) / page * page;
    if (va < p->size) va = (p->size + page - 1) / page * page;
    uint64_t base;
    int rc = up_reserve(e, va, &base);
    if (rc) {
        p->err = rc == AG_ERR_OOM ? 0 : rc;
        return NULL;
    }
    ag_segment *g = seg_new(e, base, va, bp, p->stream);
    if (!g) {
        up_unreserve(e, base, va);
        p->err = AG_ERR_NOMEM;
        return NULL;
    }
    g->expandable = 1;
    g->page = page;
    ag_block *b = blk_new(e);
    b->ptr = base;
    b->size = va;
    b->stream = p->stream;
    b->pool = bp;
    b->seg = g;
    b->mapped = 0;
    g->head = b;
    unmapped_insert(bp, b);
    return b;
}

static int map_block(ag_engine *e, ag_block *b, uint64_t size, ag_request *p) {
    ag_segment *g = b->seg;
    ag_bpool *bp = b->pool;
    uint64_t msize = (size + g->page - 1) / g->page * g->page; /* unmapped blocks are page aligned */
    if (msize > b->size) msize = b->size;
    int rc = up_map(e, b->ptr, msize);
    if (rc) {
        if (rc != AG_ERR_OOM) p->err = rc;
        return 0;
    }
    unmapped_erase(bp, b);
    b->mapped = 1;
    if (msize < b->size) {
        ag_block *x = blk_neighbour(e, b, b->ptr + msize, b->size - msize, 0);
        x->mapped = 0;
        unmapped_insert(bp, x);
        b->size = msize;
    }
    uint64_t base = b->ptr;
    try_merge(e, b, b->prev);
    try_merge(e, b, b->next);
    pool_insert(bp, b);
    stat2(e->st.reserved_bytes, bp, (int64_t)msize);
    e->st.num_device_alloc++;
    e->st.device_maps++;
    EVENT(e, AG_EV_SEGMENT_MAP, base, msize, b->stream, bp);
    return 1;
}

ag_block *try_allocate_expandable_block(ag_engine *e, ag_request *p) {
    ag_block *c = find_expandable_block(e, p);
    if (!c) return NULL;
    if (!c->mapped && !map_block(e, c, c->size < p->size ? c->size : p->size, p)) return NULL;
    while (c->size < p->size) {
        uint64_t rem = p->size - c->size;
        ag_block *n = c->next;
        if (!map_block(e, n, rem < n->size ? rem : n->size, p)) return NULL;
        c = n;
    }
    pool_erase(p->pool, c);
    return c;
}
