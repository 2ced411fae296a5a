/* accel-graph allocator core: block structs, the pointer map and the ordered sets (internal).
 *
 * Everything malloc/free runs through on every call is here as static inline, so each C file
 * that uses it compiles it in place (as when the core was one translation unit); the cold
 * parts (growth, full walks) are in _core_sets.c.
 */
#ifndef ACCEL_GRAPH_ALLOCATOR_CORE_SETS_H
#define ACCEL_GRAPH_ALLOCATOR_CORE_SETS_H

#include "_core_internal.h"

#pragma GCC visibility push(hidden)

/* ------------------------------------------------------------------------------------------ */
/* block structs: a freelist over chunks, with a spare reserve taken before any mutation so  */
/* that an operation never fails half way for want of metadata                                */

#define CHUNK_BLOCKS 4096

/* one more chunk of CHUNK_BLOCKS structs on the freelist; 0: out of host memory */
int grow_blocks(ag_engine *e);

static inline int reserve_blocks(ag_engine *e, size_t n) {
    while (e->n_spare < n)
        if (!grow_blocks(e)) return 0;
    return 1;
}

static inline ag_block *blk_new(ag_engine *e) {
    ag_block *b = e->free_structs; /* callers reserved first */
    e->free_structs = b->l;
    e->n_spare--;
    *b = (ag_block){0};
    e->rng ^= e->rng << 13;
    e->rng ^= e->rng >> 17;
    e->rng ^= e->rng << 5;
    b->prio = e->rng;
    b->mapped = 1;
    e->n_blocks_live++;
    return b;
}

/* A new block of `size` bytes at `ptr` in b's segment and pool, with b's stream and mapping,
 * linked just before (before != 0) or just after b. The caller sets what differs and puts it
 * in the set it belongs to (free pool, unmapped set). Callers reserved the struct first. */
static inline ag_block *blk_neighbour(ag_engine *e, ag_block *b, uint64_t ptr, uint64_t size,
                                      int before) {
    ag_block *x = blk_new(e);
    x->ptr = ptr;
    x->size = size;
    x->stream = b->stream;
    x->pool = b->pool;
    x->seg = b->seg;
    x->mapped = b->mapped;
    if (before) {
        x->prev = b->prev;
        x->next = b;
        if (b->prev) b->prev->next = x;
        b->prev = x;
        if (b->seg->head == b) b->seg->head = x;
    } else {
        x->prev = b;
        x->next = b->next;
        if (b->next) b->next->prev = x;
        b->next = x;
    }
    return x;
}

static inline void blk_del(ag_engine *e, ag_block *b) {
    b->l = e->free_structs;
    e->free_structs = b;
    e->n_spare++;
    e->n_blocks_live--;
}

/* ------------------------------------------------------------------------------------------ */
/* pointer map (open addressing, backward-shift deletion)                                      */

/* Fibonacci hashing of the 512-aligned address: the top bits of the product are well mixed. */
static inline size_t hslot(uint64_t k, unsigned bits) {
    return (size_t)(((k >> 9) * 0x9E3779B97F4A7C15ULL) >> (64 - bits));
}

/* double the table (first call: 1024 slots); 0: out of host memory */
int hgrow(ag_engine *e);

static inline int hreserve(ag_engine *e) {
    return (e->hcount + 1) * 2 <= e->hcap || hgrow(e);
}

static inline void hput(ag_engine *e, uint64_t k, ag_block *v) {
    size_t m = e->hcap - 1, j = hslot(k, e->hbits);
    while (e->htab[j].k) j = (j + 1) & m;
    e->htab[j].k = k;
    e->htab[j].v = v;
    e->hcount++;
}

static inline ag_block *hget(const ag_engine *e, uint64_t k) {
    if (!k || !e->hcap) return NULL;
    size_t m = e->hcap - 1, j = hslot(k, e->hbits);
    while (e->htab[j].k) {
        if (e->htab[j].k == k) return e->htab[j].v;
        j = (j + 1) & m;
    }
    return NULL;
}

static inline void hdel(ag_engine *e, uint64_t k) {
    size_t m = e->hcap - 1, j = hslot(k, e->hbits);
    while (e->htab[j].k != k) {
        if (!e->htab[j].k) return;
        j = (j + 1) & m;
    }
    e->htab[j].k = 0;
    e->hcount--;
    /* shift back later entries of the same cluster that would become unreachable */
    size_t i = j;
    for (;;) {
        i = (i + 1) & m;
        if (!e->htab[i].k) break;
        size_t h = hslot(e->htab[i].k, e->hbits);
        /* entry i may move to j iff its home h is not cyclically in (j, i] */
        if ((i > j && (h <= j || h > i)) || (i < j && (h <= j && h > i))) {
            e->htab[j] = e->htab[i];
            e->htab[i].k = 0;
            j = i;
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* ordered sets: treaps keyed by (stream, size, ptr) [mode 0] or (stream, ptr) [mode 1]        */

/* Insert without recursion: descend while the nodes outrank b, then split the rest of that
 * subtree around b's key into b's two children. */
static inline ag_block *t_insert(ag_block *root, ag_block *b) {
    ag_block **link = &root;
    while (*link && (*link)->prio > b->prio) link = (b->key < (*link)->key) ? &(*link)->l : &(*link)->r;
    ag_block *t = *link, **lo = &b->l, **hi = &b->r;
    while (t) {
        if (t->key < b->key) {
            *lo = t;
            lo = &t->r;
            t = t->r;
        } else {
            *hi = t;
            hi = &t->l;
            t = t->l;
        }
    }
    *lo = *hi = NULL;
    *link = b;
    return root;
}

static inline ag_block *t_join(ag_block *a, ag_block *b) {
    if (!a) return b;
    if (!b) return a;
    if (a->prio > b->prio) {
        a->r = t_join(a->r, b);
        return a;
    }
    b->l = t_join(a, b->l);
    return b;
}

static inline ag_block *t_erase(ag_block *t, ag_block *b) {
    /* iterative descent to the node, then join its children in place */
    ag_block **link = &t;
    u128 k = b->key;
    while (*link && *link != b) {
        ag_block *n = *link;
        link = (k < n->key) ? &n->l : &n->r;
    }
    if (*link) *link = t_join(b->l, b->r);
    return t;
}

/* first block with key >= k; written as selects because the branch is a coin toss */
static inline ag_block *t_lower(ag_block *t, u128 k) {
    ag_block *best = NULL;
    while (t) {
        int ge = t->key >= k;
        best = ge ? t : best;
        t = ge ? t->l : t->r;
    }
    return best;
}

/* last block with key < k */
static inline ag_block *t_before(ag_block *t, u128 k) {
    ag_block *best = NULL;
    while (t) {
        if (t->key < k) {
            best = t;
            t = t->r;
        } else {
            t = t->l;
        }
    }
    return best;
}

static inline ag_block *t_succ(ag_block *root, const ag_block *b) { return t_lower(root, b->key + 1); }

static inline int bucket_of(uint64_t size) { return 63 - __builtin_clzll(size | 1); }

static inline void pool_insert(ag_bpool *p, ag_block *b) {
    b->gc_base = p->gc_calls; /* insert_into_blocks */
    b->key = size_key(b->stream, b->size, b->ptr);
    int k = bucket_of(b->size);
    p->root[k] = t_insert(p->root[k], b);
    if (p->cnt[b->stream][k]++ == 0) p->mask[b->stream] |= 1ULL << k;
    p->n_free++;
}

static inline void pool_erase(ag_bpool *p, ag_block *b) {
    int k = bucket_of(b->size);
    p->root[k] = t_erase(p->root[k], b);
    if (--p->cnt[b->stream][k] == 0) p->mask[b->stream] &= ~(1ULL << k);
    p->n_free--;
}

/* buckets above k, as a mask (k = 63 gives none) */
static inline uint64_t above(int k) { return k >= 63 ? 0 : ~((2ULL << k) - 1); }

/* the smallest free block of stream s with size >= z, in (size, ptr) order */
static inline ag_block *pool_lower(const ag_bpool *p, int32_t s, uint64_t z) {
    int k = bucket_of(z);
    uint64_t m = p->mask[s];
    if (m >> k & 1) {
        ag_block *b = t_lower(p->root[k], size_key(s, z, 0));
        if (b && b->stream == s) return b;
    }
    m &= above(k);
    return m ? t_lower(p->root[__builtin_ctzll(m)], size_key(s, 0, 0)) : NULL;
}

/* the next free block of the same stream after b */
static inline ag_block *pool_next(const ag_bpool *p, const ag_block *b) {
    int k = bucket_of(b->size);
    ag_block *n = t_lower(p->root[k], b->key + 1);
    if (n && n->stream == b->stream) return n;
    uint64_t m = p->mask[b->stream] & above(k);
    return m ? t_lower(p->root[__builtin_ctzll(m)], size_key(b->stream, 0, 0)) : NULL;
}

/* the last free block of stream s ordered before (s, z, ptr) */
static inline ag_block *pool_before(const ag_bpool *p, int32_t s, uint64_t z, uint64_t ptr) {
    int k = bucket_of(z);
    uint64_t m = p->mask[s];
    if (m >> k & 1) {
        ag_block *b = t_before(p->root[k], size_key(s, z, ptr));
        if (b && b->stream == s) return b;
    }
    m &= (1ULL << k) - 1;
    return m ? t_before(p->root[63 - __builtin_clzll(m)], size_key(s + 1, 0, 0)) : NULL;
}

/* every free block, in (stream, size, ptr) order; out holds p->n_free entries */
size_t pool_collect(const ag_bpool *p, ag_block **out);

static inline void unmapped_insert(ag_bpool *p, ag_block *b) {
    b->key = addr_key(b->stream, b->ptr);
    p->unmapped_root = t_insert(p->unmapped_root, b);
}

static inline void unmapped_erase(ag_bpool *p, ag_block *b) {
    p->unmapped_root = t_erase(p->unmapped_root, b);
}

#pragma GCC visibility pop

#endif
