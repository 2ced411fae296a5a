/* accel-graph allocator core: the native policy, PyTorch's CUDA caching allocator
 * (shared/reference/torch-internals.md section 4), and its variant xpu, XPU's simpler one: the
 * same algorithm without roundup_power2_divisions and without the max_split_size rules.
 */
#include "_core_sets.h"

#include <stdlib.h>

/* ------------------------------------------------------------------------------------------ */
/* rounding (section 4 "Rounding")                                                             */

uint64_t ag_rp2_next_division(uint64_t size, uint32_t divisions) {
    if (size == 0 || (size & (size - 1)) == 0) return size;
    if (divisions < 2) return size;
    uint64_t p = 1ULL << (63 - __builtin_clzll(size));
    uint64_t step = p >> (31 - __builtin_clz(divisions));
    if (step == 0) return p << 1;
    uint64_t f = size & ~(step - 1);
    return f == size ? size : f + step;
}

static inline uint32_t divisions_for(const ag_settings *s, uint64_t size) {
    int i = (63 - __builtin_clzll(size)) - 20;
    if (i < 0) i = 0;
    if (i > 15) i = 15;
    return s->roundup_power2_divisions[i];
}

/* multiples of 512 bytes (at least 512) */
static inline uint64_t round_512(uint64_t size) {
    return size < KMIN_BLOCK ? KMIN_BLOCK : (size + KMIN_BLOCK - 1) / KMIN_BLOCK * KMIN_BLOCK;
}

/* torch's round_size; round_extra is added first (torch_npu adds 32 bytes before rounding) */
static uint64_t native_round_size(const ag_settings *s, uint64_t size) {
    size += s->round_extra;
    if (size < KMIN_BLOCK) return KMIN_BLOCK;
    uint32_t d = divisions_for(s, size);
    if (d > 1 && size > KMIN_BLOCK * d) return ag_rp2_next_division(size, d);
    return round_512(size);
}

static uint64_t xpu_round_size(const ag_settings *s, uint64_t size) { return round_512(size + s->round_extra); }

uint64_t ag_allocation_size(const ag_settings *s, uint64_t size) {
    if (size <= KSMALL_SIZE) return KSMALL_BUFFER;
    if (size < KMIN_LARGE_ALLOC) return s->large_segment_size;
    return (size + KROUND_LARGE - 1) / KROUND_LARGE * KROUND_LARGE;
}

/* ------------------------------------------------------------------------------------------ */
/* malloc steps (section 4 "malloc(orig_size, stream)")                                        */

/* step 3 */
static int get_free_block(ag_engine *e, ag_request *p) {
    ag_bpool *bp = p->pool;
    if (e->set_fraction && e->s.garbage_collection_threshold > 0.0 && max_split_on(e)) bp->gc_calls++;
    ag_block *b = pool_lower(bp, p->stream, p->size);
    if (!b) return 0;
    if (b->seg->expandable) {
        if (e->s.expandable_segments) {
            /* best fit by the size the block can grow to */
#define ESIZE(x) ((x)->size + (((x)->next && !(x)->next->mapped) ? (x)->next->size : 0))
            ag_block *n = pool_next(bp, b);
            while (b->seg->expandable && n && n->stream == p->stream && ESIZE(n) < ESIZE(b)) {
                b = n;
                n = pool_next(bp, n);
            }
#undef ESIZE
        } else {
            do {
                b = pool_next(bp, b);
            } while (b && b->seg->expandable && b->stream == p->stream);
            if (!b || b->stream != p->stream) return 0;
        }
    }
    /* torch 2.9-2.11 did not apply the oversize rules to expandable blocks (pytorch#193400) */
    if (max_split_on(e) && (e->s.expandable_oversize_rule || !b->seg->expandable)) {
        uint64_t ms = e->s.max_split_size;
        /* large cached blocks are kept for large requests */
        if (p->size < ms && b->size >= ms) return 0;
        uint64_t lim = p->size + e->s.max_non_split_rounding_size;
        if (lim < p->size) lim = UINT64_MAX;
        if (p->size >= ms && b->size >= lim) return 0;
    }
    pool_erase(bp, b);
    p->block = b;
    return 1;
}

/* step 5, GC: only with a memory fraction and a threshold */
static void garbage_collect_cached_blocks(ag_engine *e) {
    uint64_t thr = (uint64_t)(e->s.garbage_collection_threshold * (double)e->allowed_max);
    uint64_t total = (uint64_t)e->st.reserved_bytes[0].current;
    if (total <= thr) return;
    uint64_t target = total - thr;
    ag_bpool *lp = &e->large;
    size_t n = lp->n_free;
    if (!n) return;
    ag_block **all = malloc(n * sizeof *all);
    if (!all) return;
    n = pool_collect(lp, all);
    uint64_t total_age = 0;
    int64_t count = 0;
    for (size_t i = 0; i < n; i++) {
        if (!is_split(all[i])) {
            total_age += lp->gc_calls - all[i]->gc_base;
            count++;
        }
    }
    uint64_t reclaimed = 0;
    int freed = 1;
    while (count > 0 && reclaimed < target && freed) {
        double age_thr = (double)total_age / (double)count;
        freed = 0;
        for (size_t i = 0; i < n; i++) {
            ag_block *b = all[i];
            if (!b || is_split(b) || b->seg->expandable) continue;
            uint64_t age = lp->gc_calls - b->gc_base;
            if ((double)age >= age_thr) {
                freed = 1;
                reclaimed += b->size;
                total_age -= age;
                count--;
                all[i] = NULL;
                release_block(e, b);
            }
        }
    }
    free(all);
}

static int alloc_block(ag_engine *e, ag_request *p, int is_retry) {
    if (p->err) return 0;
    if (is_retry) e->st.num_alloc_retries++;
    if (e->set_fraction && (uint64_t)e->st.reserved_bytes[0].current + p->alloc_size > e->allowed_max)
        return 0;
    if (e->s.expandable_segments) {
        p->block = try_allocate_expandable_block(e, p);
        return p->block != NULL;
    }
    uint64_t ptr;
    int rc = up_alloc(e, p->alloc_size, &ptr);
    if (rc) {
        if (rc != AG_ERR_OOM) p->err = rc;
        return 0;
    }
    p->block = seg_add(e, p, ptr, p->alloc_size, p->pool, p->stream);
    return p->block != NULL;
}

/* release oversize cached blocks: only when max_split_size is set */
static int release_available_cached_blocks(ag_engine *e, ag_request *p) {
    if (p->err || !max_split_on(e) || e->s.max_split_size == UINT64_MAX) return 0;
    ag_bpool *bp = p->pool;
    uint64_t ms = e->s.max_split_size;
    uint64_t key = p->size < ms ? ms : p->size;
    ag_block *b = pool_lower(bp, p->stream, key);
    if (!b || b->stream != p->stream || b->seg->expandable) {
        /* no single block is large enough: free oversize blocks from the largest down */
        ag_block *cur = pool_before(bp, p->stream, key, 0);
        uint64_t released = 0;
        while (cur && released < key && cur->size >= ms && cur->stream == p->stream) {
            ag_block *prev = pool_before(bp, cur->stream, cur->size, cur->ptr);
            if (!cur->seg->expandable && !is_split(cur)) {
                released += cur->size;
                release_block(e, cur);
            }
            cur = prev;
        }
        return released >= key;
    }
    if (is_split(b)) return 0; /* oversize blocks are whole segments; be safe anyway */
    release_block(e, b);
    return 1;
}

static int native_should_split(const ag_engine *e, const ag_bpool *bp, uint64_t rem, uint64_t size) {
    if (bp->is_small || e->s.expandable_segments) return rem >= KMIN_BLOCK;
    if (max_split_on(e) && size >= e->s.max_split_size) return 0;
    return rem > KSMALL_SIZE;
}

/* steps 4-5: a new segment, else use_on_oom pools, else release cached memory and retry */
static int native_acquire(ag_engine *e, ag_request *p) {
    /* no_release (the plug-in's stream is capturing): skip every step that frees memory */
    if (e->set_fraction && e->s.garbage_collection_threshold > 0.0 && max_split_on(e) && !e->no_release)
        garbage_collect_cached_blocks(e);
    return alloc_block(e, p, 0) || try_mempool_fallback(e, p) ||
           (!e->no_release && release_available_cached_blocks(e, p) && alloc_block(e, p, 0)) ||
           (!p->err && e->n_captures == 0 && !e->no_release && release_cached_blocks(e) == AG_OK &&
            alloc_block(e, p, 1));
}

const ag_policy_ops ag_policy_native = {
    .name = "native",
    .max_split = 1,
    .stream_aware = 1,
    .small_pool = 1,
    .round_size = native_round_size,
    .segment_size = ag_allocation_size,
    .find = get_free_block,
    .acquire = native_acquire,
    .should_split = native_should_split,
};

/* xpu: plain 512-byte rounding, no max_split_size rules; the rest as native */
const ag_policy_ops ag_policy_xpu = {
    .name = "xpu",
    .max_split = 0,
    .stream_aware = 1,
    .small_pool = 1,
    .round_size = xpu_round_size,
    .segment_size = ag_allocation_size,
    .find = get_free_block,
    .acquire = native_acquire,
    .should_split = native_should_split,
};
