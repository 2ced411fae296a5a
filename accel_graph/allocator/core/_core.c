/* accel-graph allocator core: a caching allocator that models PyTorch's CUDA caching allocator
 * (policy `native`), XPU's simpler one (policy `xpu`) and TensorFlow's BFC allocator (policy
 * `bfc`, section "bfc policy" below) over a pluggable upstream.
 *
 * The algorithm follows shared/reference/torch-internals.md section 4 step by step; comments
 * name the step they implement. The data model is the reference's: blocks live in segments
 * (doubly linked neighbours), free blocks in per-BlockPool ordered sets keyed by
 * (stream, size, address), unmapped expandable blocks in a second set keyed by
 * (stream, address). The ordered sets are treaps threaded through the blocks themselves (the
 * free set split into per-size-bucket treaps, see ag_bpool), block structs come from a
 * freelist, and live blocks are found by address in an open-addressing map, so a malloc/free
 * pair touches no host allocator in the steady state.
 *
 * C never prints or aborts: every entry point returns a status (see _core.h).
 */
#define _GNU_SOURCE
#include "_core.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif
#include <unistd.h>

#define KMIN_BLOCK 512ULL
#define KSMALL_SIZE (1ULL << 20)
#define KSMALL_BUFFER (2ULL << 20)
#define KMIN_LARGE_ALLOC (10ULL << 20)
#define KROUND_LARGE (2ULL << 20)
#define ONE_EB (1ULL << 60)
#define MAX_STREAMS 64
#define MAX_CAPTURES 32
#define COUNTING_BASE 0x100000000000ULL /* fake addresses start at 16 TiB */
#define DEFAULT_VA (1ULL << 40)          /* ES range when the capacity is unbounded */

/* ------------------------------------------------------------------------------------------ */
/* data model                                                                                  */

struct ag_bpool;
struct ag_segment;

/* Ordered-set keys are packed into one 128-bit integer so that a comparison is one compare:
 * free set   (stream, size, ptr): stream << 116 | size << 55 | ptr >> 9  (size < 2^61)
 * unmapped   (stream, ptr):       stream << 64 | ptr
 * Pointers are 512-aligned, streams < 64, and sizes stay below 2^61 (requests below 2^60). */
typedef unsigned __int128 u128;

static inline u128 size_key(int32_t stream, uint64_t size, uint64_t ptr) {
    return ((u128)(uint32_t)stream << 116) | ((u128)size << 55) | (u128)(ptr >> 9);
}

static inline u128 addr_key(int32_t stream, uint64_t ptr) {
    return ((u128)(uint32_t)stream << 64) | (u128)ptr;
}

typedef struct ag_block {
    /* first cache line: everything an ordered-set search touches */
    u128 key;                     /* set-order key, fixed while the block is in a set */
    struct ag_block *l, *r;       /* treap children (free set or unmapped set) */
    uint64_t size, ptr;
    int32_t stream;
    uint32_t prio;
    struct ag_block *prev, *next; /* neighbours inside the same segment only */
    uint8_t allocated, mapped;
    int32_t event_count;
    /* the rest */
    uint64_t requested;
    struct ag_block *pend_next;   /* pending-free FIFO */
    struct ag_bpool *pool;
    struct ag_segment *seg;
    uint64_t gc_base;             /* pool's get_free_blocks call count at insertion */
    uint64_t stream_uses;         /* record_stream bitmask */
    int32_t ustream;              /* allocated blocks: the stream of the request (events,
                                   * record_stream); equal to `stream` except under bfc, whose
                                   * blocks all sit in stream 0 of the free set */
} ag_block;

/* Free blocks are split by size bucket (floor(log2 size)): each bucket is a treap keyed by
 * (stream, size, ptr), and per-stream bitmaps say which buckets hold a block of that stream.
 * Together they are one set in (stream, size, ptr) order, searched in at most two small
 * trees, which keeps best fit exact and the trees shallow. */
#define NBUCKET 64
typedef struct ag_bpool {
    ag_block *root[NBUCKET];
    uint64_t mask[MAX_STREAMS];
    uint32_t cnt[MAX_STREAMS][NBUCKET];
    size_t n_free;
    ag_block *unmapped_root;  /* (stream, ptr) */
    uint64_t gc_calls;
    int is_small;
    struct ag_ppool *owner;   /* NULL: the default pools */
    uint64_t bfc_region;      /* bfc: size of the next region (TF's curr_region_allocation_bytes_);
                               * 0 until the first region */
    int bfc_backpedal;        /* bfc: the one 0.9x backpedal has been used */
} ag_bpool;

typedef struct ag_ppool {
    int64_t id;
    int use_count;
    int freeable;
    int no_split;
    int use_on_oom;           /* default-pool requests may take its free blocks before OOM */
    int64_t n_segments;       /* live segments (ES ranges included) */
    ag_bpool small, large;
    struct ag_ppool *next;
} ag_ppool;

typedef struct ag_segment {
    uint64_t base, size;
    uint64_t page;            /* ES page; 0 for ordinary segments */
    ag_bpool *pool;
    ag_block *head;           /* lowest-address block */
    struct ag_segment *lprev, *lnext;
    int32_t stream;
    uint8_t expandable;
} ag_segment;

typedef struct {
    uint64_t k; /* 0: empty */
    ag_block *v;
} hentry;

typedef struct {
    struct ag_ppool *pool;
    int32_t stream;           /* -1: every stream */
} ag_capture;

typedef struct {
    int kind;
    uint64_t total, peak;     /* bytes held (segments + mapped pages) */
    uint64_t next_addr;       /* counting upstream */
    void *dl;
    int (*dmalloc)(void **, size_t);
    int (*dfree)(void *);
    int (*dmeminfo)(size_t *, size_t *);
    /* optional, resolved from the same runtime (NULL where absent); used by the plug-in */
    int (*dget_device)(int *);
    int (*dset_device)(int);
    int (*dxchg_mode)(int *);                 /* cuda/hipThreadExchangeStreamCaptureMode */
    int (*dis_capturing)(void *, int *);      /* cuda/hipStreamIsCapturing */
    int (*dget_last_error)(void);             /* cuda/hipGetLastError: clears the sticky error */
} ag_upstream;

struct ag_engine {
    ag_settings s;
    int set_fraction;
    uint64_t allowed_max;
    uint64_t capacity;        /* UINT64_MAX: unbounded */
    ag_upstream up;
    ag_stats st;

    ag_bpool small, large;
    ag_ppool *ppools;
    int64_t next_pool_id;
    ag_capture captures[MAX_CAPTURES];
    int n_captures;
    int32_t n_streams;

    ag_segment *segs;
    int64_t n_segs, n_blocks_live;

    ag_block *pend_head, *pend_tail;

    /* block slab: freelist of block structs, grown in chunks */
    ag_block *free_structs;
    void **chunks;
    size_t n_chunks, cap_chunks;
    size_t n_spare;

    /* pointer -> allocated (or pending) block */
    hentry *htab;
    size_t hcap, hcount;
    unsigned hbits;

    /* events */
    int ev_on;
    ag_event *ev;
    int64_t ev_cap, ev_head, ev_count, ev_max;
    int64_t ev_seq;
    int64_t anchor_raw, anchor_ns; /* clock pair taken when events were first enabled */

    uint32_t rng;
    int last_upstream_err;
    int no_release;     /* the plug-in's stream is capturing: never give memory back (no cudaFree) */
    int plug_device;    /* device this engine is installed on as the pluggable allocator, or -1 */
    pthread_mutex_t mu; /* cffi drops the GIL around calls: every entry point takes this */

    /* Tensor blocks (ag_tensor_*): blocks owned by tensors outside Python's reach (DLPack).
     * refs: 1 for the owner (dropped by ag_engine_destroy) + 1 per live tensor block; the
     * engine is torn down when it reaches 0, so a tensor's memory outlives a closed engine.
     * Keys of blocks that died are queued for the owner to read (ag_tensor_drain); the queue
     * always has room for one key per live tensor block, so a death never allocates. */
    int64_t refs;              /* atomic */
    int closed;                /* ag_engine_destroy ran: deaths no longer queue keys */
    int t_release_idle;        /* a death also returns whole free segments (empty_cache) */
    int64_t t_live;            /* live tensor blocks */
    int64_t *t_keys;           /* dead keys, not yet drained */
    int64_t t_nkeys, t_capkeys;
    int64_t t_pending;         /* = t_nkeys, atomic, read lock-free by the owner */
    int64_t t_errors;          /* deaths whose free the engine refused (never expected) */
};

/* The reason for the last failure and the numbers of the last OOM are per thread, so a caller
 * reads its own failure even while other threads use the engine. */
static __thread char tls_err[512];
static __thread ag_oom_info tls_oom;

/* ------------------------------------------------------------------------------------------ */
/* errors                                                                                      */

static int fail(ag_engine *e, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    (void)e;
    vsnprintf(tls_err, sizeof tls_err, fmt, ap);
    va_end(ap);
    return code;
}

const char *ag_last_error(const ag_engine *e) { return tls_err; }

/* ------------------------------------------------------------------------------------------ */
/* statistics: torch's Stat.increase/decrease                                                  */

static inline void stat_add(ag_stat *s, int64_t amount) {
    s->current += amount;
    if (s->current > s->peak) s->peak = s->current;
    if (amount > 0) s->allocated += amount;
    else s->freed -= amount;
}

/* all + the pool's own kind, as get_stat_types_for_pool */
static inline void stat2(ag_stat *arr, const ag_bpool *p, int64_t amount) {
    stat_add(&arr[0], amount);
    stat_add(&arr[p->is_small ? 1 : 2], amount);
}

/* ------------------------------------------------------------------------------------------ */
/* events                                                                                      */

/* Events are stamped with a raw clock (the TSC where there is one: a few ns, where reading
 * the wall clock costs tens) and converted to Unix-epoch microseconds when drained, by linear
 * interpolation between the wall time at enable and at drain, as torch converts its TSC
 * stamps. Elsewhere the raw clock is the wall clock in nanoseconds. */
static inline int64_t wall_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

#if defined(__x86_64__) || defined(__i386__)
static inline int64_t raw_clock(void) { return (int64_t)__rdtsc(); }
#define RAW_IS_WALL 0
#else
static inline int64_t raw_clock(void) { return wall_ns(); }
#define RAW_IS_WALL 1
#endif

static void ev_push(ag_engine *e, int action, uint64_t addr, uint64_t size, int32_t stream,
                    const ag_bpool *p) {
    if (e->ev_count == e->ev_cap) {
        if (e->ev_max > 0 && e->ev_cap >= e->ev_max) {
            /* ring: drop the oldest, like torch's max_entries */
            if (++e->ev_head == e->ev_cap) e->ev_head = 0;
            e->ev_count--;
        } else {
            int64_t ncap = e->ev_cap ? e->ev_cap * 2 : 4096;
            if (e->ev_max > 0 && ncap > e->ev_max) ncap = e->ev_max;
            ag_event *n = malloc((size_t)ncap * sizeof *n);
            if (!n) { /* drop the event rather than fail the allocation it describes */
                e->ev_seq++;
                return;
            }
            for (int64_t i = 0; i < e->ev_count; i++) n[i] = e->ev[(e->ev_head + i) % e->ev_cap];
            free(e->ev);
            e->ev = n;
            e->ev_cap = ncap;
            e->ev_head = 0;
        }
    }
    int64_t pos = e->ev_head + e->ev_count; /* wrap by compare: a division costs more */
    if (pos >= e->ev_cap) pos -= e->ev_cap;
    ag_event *x = &e->ev[pos];
    x->time_us = raw_clock(); /* converted in im_events_drain */
    x->seq = e->ev_seq++;
    x->addr = addr;
    x->size = size;
    x->pool_id = (p && p->owner) ? p->owner->id : 0;
    x->stream = stream;
    x->action = action;
    e->ev_count++;
}

#define EVENT(e, a, addr, size, stream, pool)                                       \
    do {                                                                           \
        if ((e)->ev_on) ev_push((e), (a), (addr), (size), (stream), (pool));       \
    } while (0)

static int im_events_enable(ag_engine *e, int32_t on, int64_t max_entries) {
    if (max_entries < 0) return fail(e, AG_ERR_INVALID, "max_entries must be >= 0, got %lld",
                                     (long long)max_entries);
    e->ev_on = on ? 1 : 0;
    if (on && !e->anchor_ns) {
        e->anchor_ns = wall_ns();
        e->anchor_raw = raw_clock();
    }
    if (max_entries != e->ev_max) {
        /* keep the newest events that fit the new bound */
        if (max_entries > 0 && e->ev_count > max_entries) {
            int64_t drop = e->ev_count - max_entries;
            e->ev_head = (e->ev_head + drop) % (e->ev_cap ? e->ev_cap : 1);
            e->ev_count = max_entries;
        }
        if (max_entries > 0 && e->ev_cap > max_entries) {
            ag_event *n = malloc((size_t)max_entries * sizeof *n);
            if (!n) return fail(e, AG_ERR_NOMEM, "out of host memory for the event buffer");
            for (int64_t i = 0; i < e->ev_count; i++) n[i] = e->ev[(e->ev_head + i) % e->ev_cap];
            free(e->ev);
            e->ev = n;
            e->ev_cap = max_entries;
            e->ev_head = 0;
        }
        e->ev_max = max_entries;
    }
    return AG_OK;
}

static int64_t im_events_count(const ag_engine *e) { return e->ev_count; }

static int64_t im_events_drain(ag_engine *e, ag_event *out, int64_t max) {
    int64_t n = e->ev_count < max ? e->ev_count : max;
    int64_t now_raw = raw_clock(), now_ns = wall_ns();
    double ns_per_tick = 1.0;
    if (!RAW_IS_WALL)
        ns_per_tick = now_raw > e->anchor_raw ? (double)(now_ns - e->anchor_ns) / (double)(now_raw - e->anchor_raw) : 0.0;
    for (int64_t i = 0; i < n; i++) {
        out[i] = e->ev[(e->ev_head + i) % e->ev_cap];
        int64_t ns = RAW_IS_WALL ? out[i].time_us
                                 : e->anchor_ns + (int64_t)((double)(out[i].time_us - e->anchor_raw) * ns_per_tick);
        out[i].time_us = ns / 1000;
    }
    if (n) {
        e->ev_head = (e->ev_head + n) % e->ev_cap;
        e->ev_count -= n;
    }
    return n;
}

/* ------------------------------------------------------------------------------------------ */
/* block structs: a freelist over chunks, with a spare reserve taken before any mutation so  */
/* that an operation never fails half way for want of metadata                                */

#define CHUNK_BLOCKS 4096

static int grow_blocks(ag_engine *e) {
    if (e->n_chunks == e->cap_chunks) {
        size_t nc = e->cap_chunks ? e->cap_chunks * 2 : 16;
        void **n = realloc(e->chunks, nc * sizeof *n);
        if (!n) return 0;
        e->chunks = n;
        e->cap_chunks = nc;
    }
    ag_block *c = malloc(CHUNK_BLOCKS * sizeof *c);
    if (!c) return 0;
    e->chunks[e->n_chunks++] = c;
    for (size_t i = 0; i < CHUNK_BLOCKS; i++) {
        c[i].l = e->free_structs;
        e->free_structs = &c[i];
    }
    e->n_spare += CHUNK_BLOCKS;
    return 1;
}

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

static int hgrow(ag_engine *e) {
    unsigned nbits = e->hbits ? e->hbits + 1 : 10;
    size_t ncap = (size_t)1 << nbits;
    hentry *n = calloc(ncap, sizeof *n);
    if (!n) return 0;
    for (size_t i = 0; i < e->hcap; i++) {
        if (!e->htab[i].k) continue;
        size_t j = hslot(e->htab[i].k, nbits);
        while (n[j].k) j = (j + 1) & (ncap - 1);
        n[j] = e->htab[i];
    }
    free(e->htab);
    e->htab = n;
    e->hcap = ncap;
    e->hbits = nbits;
    return 1;
}

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

static void hdel(ag_engine *e, uint64_t k) {
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
static ag_block *t_insert(ag_block *root, ag_block *b) {
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

static ag_block *t_join(ag_block *a, ag_block *b) {
    if (!a) return b;
    if (!b) return a;
    if (a->prio > b->prio) {
        a->r = t_join(a->r, b);
        return a;
    }
    b->l = t_join(a, b->l);
    return b;
}

static ag_block *t_erase(ag_block *t, ag_block *b) {
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
static ag_block *t_lower(ag_block *t, u128 k) {
    ag_block *best = NULL;
    while (t) {
        int ge = t->key >= k;
        best = ge ? t : best;
        t = ge ? t->l : t->r;
    }
    return best;
}

/* last block with key < k */
static ag_block *t_before(ag_block *t, u128 k) {
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

static size_t t_collect(ag_block *t, ag_block **out, size_t n) {
    while (t) {
        n = t_collect(t->l, out, n);
        out[n++] = t;
        t = t->r;
    }
    return n;
}

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
static ag_block *pool_lower(const ag_bpool *p, int32_t s, uint64_t z) {
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
static ag_block *pool_next(const ag_bpool *p, const ag_block *b) {
    int k = bucket_of(b->size);
    ag_block *n = t_lower(p->root[k], b->key + 1);
    if (n && n->stream == b->stream) return n;
    uint64_t m = p->mask[b->stream] & above(k);
    return m ? t_lower(p->root[__builtin_ctzll(m)], size_key(b->stream, 0, 0)) : NULL;
}

/* the last free block of stream s ordered before (s, z, ptr) */
static ag_block *pool_before(const ag_bpool *p, int32_t s, uint64_t z, uint64_t ptr) {
    int k = bucket_of(z);
    uint64_t m = p->mask[s];
    if (m >> k & 1) {
        ag_block *b = t_before(p->root[k], size_key(s, z, ptr));
        if (b && b->stream == s) return b;
    }
    m &= (1ULL << k) - 1;
    return m ? t_before(p->root[63 - __builtin_clzll(m)], size_key(s + 1, 0, 0)) : NULL;
}

static int key_cmp(const void *a, const void *b) {
    u128 x = (*(ag_block *const *)a)->key, y = (*(ag_block *const *)b)->key;
    return x < y ? -1 : x > y;
}

/* every free block, in (stream, size, ptr) order; out holds p->n_free entries */
static size_t pool_collect(const ag_bpool *p, ag_block **out) {
    size_t n = 0;
    for (int k = 0; k < NBUCKET; k++) n = t_collect(p->root[k], out, n);
    qsort(out, n, sizeof *out, key_cmp);
    return n;
}

static inline void unmapped_insert(ag_bpool *p, ag_block *b) {
    b->key = addr_key(b->stream, b->ptr);
    p->unmapped_root = t_insert(p->unmapped_root, b);
}

static inline void unmapped_erase(ag_bpool *p, ag_block *b) {
    p->unmapped_root = t_erase(p->unmapped_root, b);
}

/* ------------------------------------------------------------------------------------------ */
/* upstreams                                                                                   */

/* The upstream error code that means "out of memory" for cudaMalloc and hipMalloc alike. */
#define DEVICE_ERR_OOM 2

/* 0 on success, AG_ERR_OOM when refused for memory, AG_ERR_UPSTREAM otherwise. */
static int up_alloc(ag_engine *e, uint64_t size, uint64_t *out) {
    ag_upstream *u = &e->up;
    if (e->s.cap && u->total + size > e->s.cap) return AG_ERR_OOM;
    if (u->kind == AG_UPSTREAM_COUNTING) {
        *out = u->next_addr;
        u->next_addr += (size + KMIN_BLOCK - 1) & ~(KMIN_BLOCK - 1);
    } else if (u->kind == AG_UPSTREAM_HOST) {
        void *p = NULL;
        if (posix_memalign(&p, KMIN_BLOCK, (size_t)size) != 0 || !p) return AG_ERR_OOM;
        *out = (uint64_t)(uintptr_t)p;
    } else {
        void *p = NULL;
        /* as torch's cudaMallocMaybeCapturing: cudaMalloc in relaxed capture mode, so it is legal
         * while this thread (or, in global mode, any thread) captures; the old mode comes back */
        int mode = 2; /* cudaStreamCaptureModeRelaxed == hipStreamCaptureModeRelaxed */
        int swapped = u->dxchg_mode && u->dxchg_mode(&mode) == 0;
        int rc = u->dmalloc(&p, (size_t)size);
        if (swapped) u->dxchg_mode(&mode);
        if (rc != 0 || !p) {
            if (u->dget_last_error) u->dget_last_error(); /* torch clears it too: not sticky */
            e->last_upstream_err = rc;
            return rc == DEVICE_ERR_OOM ? AG_ERR_OOM : AG_ERR_UPSTREAM;
        }
        *out = (uint64_t)(uintptr_t)p;
    }
    u->total += size;
    if (u->total > u->peak) u->peak = u->total;
    return AG_OK;
}

static void up_free(ag_engine *e, uint64_t ptr, uint64_t size) {
    ag_upstream *u = &e->up;
    if (u->kind == AG_UPSTREAM_HOST) free((void *)(uintptr_t)ptr);
    else if (u->kind == AG_UPSTREAM_DEVICE) u->dfree((void *)(uintptr_t)ptr);
    u->total -= size;
}

/* Expandable segments: reserve address space only (nothing counted). */
static int up_reserve(ag_engine *e, uint64_t size, uint64_t *out) {
    ag_upstream *u = &e->up;
    if (u->kind == AG_UPSTREAM_COUNTING) {
        *out = u->next_addr;
        u->next_addr += size;
        return AG_OK;
    }
    if (u->kind == AG_UPSTREAM_HOST) {
        void *p = mmap(NULL, (size_t)size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return AG_ERR_OOM;
        *out = (uint64_t)(uintptr_t)p;
        return AG_OK;
    }
    return AG_ERR_UNSUPPORTED;
}

static void up_unreserve(ag_engine *e, uint64_t base, uint64_t size) {
    if (e->up.kind == AG_UPSTREAM_HOST) munmap((void *)(uintptr_t)base, (size_t)size);
}

static int up_map(ag_engine *e, uint64_t addr, uint64_t size) {
    ag_upstream *u = &e->up;
    if (e->s.cap && u->total + size > e->s.cap) return AG_ERR_OOM;
    if (u->kind == AG_UPSTREAM_HOST &&
        mprotect((void *)(uintptr_t)addr, (size_t)size, PROT_READ | PROT_WRITE) != 0)
        return AG_ERR_OOM;
    u->total += size;
    if (u->total > u->peak) u->peak = u->total;
    return AG_OK;
}

static void up_unmap(ag_engine *e, uint64_t addr, uint64_t size) {
    ag_upstream *u = &e->up;
    if (u->kind == AG_UPSTREAM_HOST) {
        /* give the pages back, then make the range inaccessible again */
        madvise((void *)(uintptr_t)addr, (size_t)size, MADV_DONTNEED);
        mprotect((void *)(uintptr_t)addr, (size_t)size, PROT_NONE);
    }
    u->total -= size;
}

static int open_device(ag_engine *e, const char *libs, char *err, size_t errlen) {
    static const char *cuda_default = "libcudart.so;libcudart.so.13;libcudart.so.12;libcudart.so.11.0";
    static const char *hip_default = "libamdhip64.so;libamdhip64.so.7;libamdhip64.so.6";
    int hip = e->s.device_kind == 1;
    const char *list = (libs && *libs) ? libs : (hip ? hip_default : cuda_default);
    char tried[400] = "";
    size_t tl = 0;
    const char *p = list;
    while (*p) {
        const char *q = strchr(p, ';');
        size_t n = q ? (size_t)(q - p) : strlen(p);
        char path[256];
        if (n && n < sizeof path) {
            memcpy(path, p, n);
            path[n] = 0;
            void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
            if (h) {
                e->up.dl = h;
                e->up.dmalloc = (int (*)(void **, size_t))dlsym(h, hip ? "hipMalloc" : "cudaMalloc");
                e->up.dfree = (int (*)(void *))dlsym(h, hip ? "hipFree" : "cudaFree");
                e->up.dmeminfo = (int (*)(size_t *, size_t *))dlsym(h, hip ? "hipMemGetInfo" : "cudaMemGetInfo");
                e->up.dget_device = (int (*)(int *))dlsym(h, hip ? "hipGetDevice" : "cudaGetDevice");
                e->up.dset_device = (int (*)(int))dlsym(h, hip ? "hipSetDevice" : "cudaSetDevice");
                e->up.dxchg_mode = (int (*)(int *))dlsym(
                    h, hip ? "hipThreadExchangeStreamCaptureMode" : "cudaThreadExchangeStreamCaptureMode");
                e->up.dis_capturing =
                    (int (*)(void *, int *))dlsym(h, hip ? "hipStreamIsCapturing" : "cudaStreamIsCapturing");
                e->up.dget_last_error = (int (*)(void))dlsym(h, hip ? "hipGetLastError" : "cudaGetLastError");
                if (e->up.dmalloc && e->up.dfree) return AG_OK;
                snprintf(err, errlen, "%s loaded but lacks %s/%s", path,
                         hip ? "hipMalloc" : "cudaMalloc", hip ? "hipFree" : "cudaFree");
                dlclose(h);
                e->up.dl = NULL;
                return AG_ERR_LOAD;
            }
            if (tl + n + 3 < sizeof tried) {
                tl += (size_t)snprintf(tried + tl, sizeof tried - tl, "%s%s", tl ? ", " : "", path);
            }
        }
        p += n;
        if (*p == ';') p++;
    }
    snprintf(err, errlen, "could not load the %s runtime library; tried: %s", hip ? "HIP" : "CUDA",
             tried);
    return AG_ERR_LOAD;
}

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

static inline uint64_t round_base(const ag_settings *s, uint64_t size) {
    if (size < KMIN_BLOCK) return KMIN_BLOCK;
    if (s->policy == AG_POLICY_NATIVE) {
        uint32_t d = divisions_for(s, size);
        if (d > 1 && size > KMIN_BLOCK * d) return ag_rp2_next_division(size, d);
    }
    return (size + KMIN_BLOCK - 1) / KMIN_BLOCK * KMIN_BLOCK;
}

/* bfc: TF's RoundedBytes, multiples of 256 bytes (at least 256) */
#define BFC_MIN 256ULL
static inline uint64_t bfc_round(uint64_t size) {
    return size < BFC_MIN ? BFC_MIN : (size + BFC_MIN - 1) / BFC_MIN * BFC_MIN;
}

/* torch's round_size; round_extra is added first (torch_npu adds 32 bytes before rounding) */
uint64_t ag_round_size(const ag_settings *s, uint64_t size) {
    if (s->policy == AG_POLICY_BFC) return bfc_round(size); /* no torch rounding knob applies */
    return round_base(s, size + s->round_extra);
}

uint64_t ag_allocation_size(const ag_settings *s, uint64_t size) {
    if (size <= KSMALL_SIZE) return KSMALL_BUFFER;
    if (size < KMIN_LARGE_ALLOC) return s->large_segment_size;
    return (size + KROUND_LARGE - 1) / KROUND_LARGE * KROUND_LARGE;
}

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

static inline int is_split(const ag_block *b) { return b->prev || b->next; }
static inline int max_split_on(const ag_engine *e) { return e->s.policy == AG_POLICY_NATIVE; }

/* ------------------------------------------------------------------------------------------ */
/* merging and freeing (section 4 "free(block)")                                               */

static uint64_t try_merge(ag_engine *e, ag_block *dst, ag_block *src) {
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

static void synchronize_and_free_events(ag_engine *e) {
    e->st.num_sync_all_streams++;
    complete_pending(e);
}

/* ------------------------------------------------------------------------------------------ */
/* releasing memory (section 4 "Releasing memory")                                             */

static void release_block(ag_engine *e, ag_block *b) {
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

static void bfc_regrow(ag_engine *e, ag_bpool *p);

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
    if (released && e->s.policy == AG_POLICY_BFC) bfc_regrow(e, p);
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

static int release_cached_blocks(ag_engine *e) {
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
/* malloc (section 4 "malloc(orig_size, stream)")                                              */

typedef struct {
    uint64_t size, alloc_size;
    int32_t stream;           /* free-set stream searched (bfc: always 0) */
    int32_t ustream;          /* the request's stream */
    ag_bpool *pool;
    ag_block *block;
    int err; /* AG_ERR_UPSTREAM aborts the chain */
} params;

/* step 3 */
static int bfc_find(ag_engine *e, params *p);

static int get_free_block(ag_engine *e, params *p) {
    if (e->s.policy == AG_POLICY_BFC) return bfc_find(e, p);
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

static ag_block *find_expandable_block(ag_engine *e, params *p) {
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

static int map_block(ag_engine *e, ag_block *b, uint64_t size, params *p) {
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

static ag_block *try_allocate_expandable_block(ag_engine *e, params *p) {
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

static int alloc_block(ag_engine *e, params *p, int is_retry) {
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
    ag_segment *g = seg_new(e, ptr, p->alloc_size, p->pool, p->stream);
    if (!g) {
        up_free(e, ptr, p->alloc_size);
        p->err = AG_ERR_NOMEM;
        return 0;
    }
    ag_block *b = blk_new(e);
    b->ptr = ptr;
    b->size = p->alloc_size;
    b->stream = p->stream;
    b->pool = p->pool;
    b->seg = g;
    g->head = b;
    stat2(e->st.segment, p->pool, 1);
    stat2(e->st.reserved_bytes, p->pool, (int64_t)p->alloc_size);
    if (max_split_on(e) && p->alloc_size >= e->s.max_split_size) stat_add(&e->st.oversize_segments, 1);
    e->st.num_device_alloc++;
    e->st.device_mallocs++;
    EVENT(e, AG_EV_SEGMENT_ALLOC, ptr, p->alloc_size, p->stream, p->pool);
    p->block = b;
    return 1;
}

/* ------------------------------------------------------------------------------------------ */
/* bfc policy: a model of TensorFlow's BFC allocator (best-fit with coalescing), after the     */
/* public tensorflow/core/common_runtime/bfc_allocator.{h,cc}; docs/allocator.md "bfc policy"  */
/*
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
#define BFC_FIRST_REGION (2ULL << 20)
#define BFC_MAX_REGION (1ULL << 58) /* the next-region size stops doubling here (set keys) */
#define BFC_BACKPEDAL 0.9

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
static int bfc_find(ag_engine *e, params *p) {
    ag_block *b = pool_lower(p->pool, 0, p->size);
    if (!b) return 0;
    pool_erase(p->pool, b);
    p->block = b;
    return 1;
}

/* Extend: add one region to the BlockPool as one free chunk */
static int bfc_extend(ag_engine *e, params *p) {
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
    ag_segment *g = seg_new(e, ptr, bytes, bp, 0);
    if (!g) {
        up_free(e, ptr, bytes);
        p->err = AG_ERR_NOMEM;
        return 0;
    }
    ag_block *b = blk_new(e);
    b->ptr = ptr;
    b->size = bytes;
    b->stream = 0;
    b->pool = bp;
    b->seg = g;
    g->head = b;
    pool_insert(bp, b);
    p->alloc_size = bytes;
    stat2(e->st.segment, bp, 1);
    stat2(e->st.reserved_bytes, bp, (int64_t)bytes);
    e->st.num_device_alloc++;
    e->st.device_mallocs++;
    EVENT(e, AG_EV_SEGMENT_ALLOC, ptr, bytes, 0, bp);
    return 1;
}

/* DeallocateFreeRegions: give back every wholly free region of the BlockPool if that can
 * make room for the request */
static int bfc_deallocate_free_regions(ag_engine *e, params *p) {
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

/* MemPools made with use_on_oom lend their free blocks to default-pool requests as a last
 * resort, lowest pool id first (torch keeps them in an ordered set of ids). */
static ag_ppool *find_ppool(const ag_engine *e, int64_t id);

static int try_mempool_fallback(ag_engine *e, params *p) {
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
        if (get_free_block(e, p)) return 1;
        p->pool = saved;
    }
}

/* release oversize cached blocks: only when max_split_size is set */
static int release_available_cached_blocks(ag_engine *e, params *p) {
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

static int should_split(const ag_engine *e, const ag_block *b, uint64_t size) {
    const ag_bpool *bp = b->pool;
    if (bp->owner && bp->owner->no_split) return 0;
    uint64_t rem = b->size - size;
    /* bfc (TF FindChunkPtr): split when the chunk is at least twice the request, or when
     * keeping it whole would waste 128 MiB or more */
    if (e->s.policy == AG_POLICY_BFC) return rem >= size || rem >= (128ULL << 20);
    if (bp->is_small || e->s.expandable_segments) return rem >= KMIN_BLOCK;
    if (max_split_on(e) && size >= e->s.max_split_size) return 0;
    return rem > KSMALL_SIZE;
}

/* step 8 */
static ag_block *alloc_found_block(ag_engine *e, params *p, uint64_t orig) {
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

static ag_ppool *find_ppool(const ag_engine *e, int64_t id) {
    for (ag_ppool *q = e->ppools; q; q = q->next)
        if (q->id == id) return q;
    return NULL;
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

static uint64_t device_free_bytes(const ag_engine *e) {
    uint64_t fr = UINT64_MAX;
    if (e->capacity != UINT64_MAX) fr = e->capacity > e->up.total ? e->capacity - e->up.total : 0;
    if (e->up.kind == AG_UPSTREAM_DEVICE && e->up.dmeminfo) {
        size_t dfr = 0, tot = 0;
        if (e->up.dmeminfo(&dfr, &tot) == 0 && (uint64_t)dfr < fr) fr = (uint64_t)dfr;
    }
    return fr;
}

static int check_stream(ag_engine *e, int32_t stream) {
    if (stream < 0 || stream >= e->n_streams)
        return fail(e, AG_ERR_INVALID, "unknown stream %d: this engine has streams 0..%d (create more with create_stream())",
                    stream, e->n_streams - 1);
    return AG_OK;
}

static int64_t im_malloc(ag_engine *e, int64_t size, int32_t stream, int64_t pool_id) {
    if (size <= 0)
        return fail(e, AG_ERR_INVALID, "allocation size must be positive, got %lld", (long long)size);
    if ((uint64_t)size >= ONE_EB) {
        memset(&tls_oom, 0, sizeof tls_oom);
        tls_oom.kind = 2;
        tls_oom.requested = (uint64_t)size;
        tls_oom.stream = stream;
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
    params p = {0};
    int bfc = e->s.policy == AG_POLICY_BFC;
    p.size = ag_round_size(&e->s, (uint64_t)size);
    p.stream = bfc ? 0 : stream; /* bfc is stream-unaware */
    p.ustream = stream;
    int small = !bfc && p.size <= KSMALL_SIZE;
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
    p.alloc_size = bfc ? p.size : ag_allocation_size(&e->s, p.size);

    int found = get_free_block(e, &p);
    if (!found && bfc) {
        /* TF's AllocateRawInternal: find, extend, (use_on_oom pools), free regions + extend */
        found = (bfc_extend(e, &p) && bfc_find(e, &p)) || try_mempool_fallback(e, &p) ||
                (bfc_deallocate_free_regions(e, &p) && bfc_extend(e, &p) && bfc_find(e, &p));
    } else if (!found) {
        /* no_release (the plug-in's stream is capturing): skip every step that frees memory */
        if (e->set_fraction && e->s.garbage_collection_threshold > 0.0 && max_split_on(e) && !e->no_release)
            garbage_collect_cached_blocks(e);
        found = alloc_block(e, &p, 0) || try_mempool_fallback(e, &p) ||
                (!e->no_release && release_available_cached_blocks(e, &p) && alloc_block(e, &p, 0)) ||
                (!p.err && e->n_captures == 0 && !e->no_release && release_cached_blocks(e) == AG_OK &&
                 alloc_block(e, &p, 1));
    }
    if (!found) {
        if (p.err) {
            if (p.err == AG_ERR_UPSTREAM)
                return fail(e, AG_ERR_UPSTREAM, "the device runtime failed with error %d while allocating %llu bytes",
                            e->last_upstream_err, (unsigned long long)p.alloc_size);
            if (p.err == AG_ERR_UNSUPPORTED)
                return fail(e, AG_ERR_UNSUPPORTED, "this upstream cannot reserve address space for expandable segments");
            return fail(e, p.err, "out of host memory for allocator metadata");
        }
        /* step 6 */
        e->st.num_ooms++;
        ag_oom_info *o = &tls_oom;
        o->kind = 1;
        o->stream = stream;
        o->fraction_set = e->set_fraction;
        o->expandable_segments = e->s.expandable_segments;
        o->requested = (uint64_t)size;
        o->rounded = p.size;
        o->alloc_size = bfc ? p.size : p.alloc_size;
        o->capacity = e->capacity;
        o->device_free = device_free_bytes(e);
        o->allowed = e->allowed_max;
        o->reserved = (uint64_t)e->st.reserved_bytes[0].current;
        o->allocated = (uint64_t)e->st.allocated_bytes[0].current;
        o->cached_in_private_pools = cached_in_private_pools(e);
        EVENT(e, AG_EV_OOM, o->device_free, p.size, stream, p.pool);
        return fail(e, AG_ERR_OOM, "out of memory: tried to allocate %llu bytes",
                    (unsigned long long)(bfc ? p.size : p.alloc_size));
    }
    ag_block *b = alloc_found_block(e, &p, (uint64_t)size);
    return (int64_t)b->ptr;
}

static int im_free(ag_engine *e, uint64_t ptr) {
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

static int im_record_stream(ag_engine *e, uint64_t ptr, int32_t stream) {
    if (check_stream(e, stream)) return AG_ERR_INVALID;
    ag_block *b = hget(e, ptr);
    if (!b || !b->allocated)
        return fail(e, AG_ERR_BAD_PTR, "record_stream(0x%llx): not an allocated block of this engine",
                    (unsigned long long)ptr);
    if (stream != b->ustream) b->stream_uses |= 1ULL << stream; /* uses on the own stream need no sync */
    return AG_OK;
}

static int64_t im_block_size(ag_engine *e, uint64_t ptr) {
    ag_block *b = hget(e, ptr);
    if (!b || !b->allocated)
        return fail(e, AG_ERR_BAD_PTR, "0x%llx is not an allocated block of this engine", (unsigned long long)ptr);
    return (int64_t)b->size;
}

static int im_process_events(ag_engine *e) {
    if (e->n_captures == 0) complete_pending(e);
    return AG_OK;
}

static int im_synchronize(ag_engine *e) {
    synchronize_and_free_events(e);
    return AG_OK;
}

static int im_empty_cache(ag_engine *e) {
    if (!reserve_blocks(e, 8)) return fail(e, AG_ERR_NOMEM, "out of host memory for allocator metadata");
    int rc = release_cached_blocks(e);
    return rc ? fail(e, rc, "out of host memory while releasing cached blocks") : AG_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* streams and private pools                                                                   */

static int32_t im_create_stream(ag_engine *e) {
    if (e->n_streams >= MAX_STREAMS)
        return fail(e, AG_ERR_UNSUPPORTED, "at most %d streams per engine", MAX_STREAMS);
    return e->n_streams++;
}

static int32_t im_num_streams(const ag_engine *e) { return e->n_streams; }

static int64_t im_create_pool(ag_engine *e, int32_t flags) {
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

static int im_begin_allocate_to_pool(ag_engine *e, int64_t pool_id, int32_t stream) {
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

static int im_end_allocate_to_pool(ag_engine *e, int64_t pool_id) {
    for (int i = 0; i < e->n_captures; i++) {
        if (e->captures[i].pool->id == pool_id) {
            memmove(&e->captures[i], &e->captures[i + 1], (size_t)(e->n_captures - i - 1) * sizeof e->captures[0]);
            e->n_captures--;
            return AG_OK;
        }
    }
    return fail(e, AG_ERR_STATE, "end_allocate_to_pool: not currently allocating to pool %lld", (long long)pool_id);
}

static int im_release_pool(ag_engine *e, int64_t pool_id) {
    ag_ppool *q = live_pool(e, pool_id, "release_pool");
    if (!q) return AG_ERR_POOL;
    if (--q->use_count == 0) q->freeable = 1;
    return AG_OK;
}

static int im_pool_use_count(const ag_engine *e, int64_t pool_id) {
    ag_ppool *q = find_ppool(e, pool_id);
    return q ? q->use_count
             : fail((ag_engine *)e, AG_ERR_POOL, "pool %lld is not a pool of this engine", (long long)pool_id);
}

/* What one pool holds, walked from the segment list (pool id 0: the default pools). */
static int im_pool_info_get(const ag_engine *e, int64_t pool_id, ag_pool_info *out) {
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

static int apply_fraction(ag_engine *e, double f) {
    if (f < 0) {
        e->set_fraction = 0;
        e->allowed_max = UINT64_MAX;
        return AG_OK;
    }
    if (f > 1.0) return fail(e, AG_ERR_INVALID, "memory_fraction must be in [0, 1], got %g", f);
    if (e->capacity == UINT64_MAX)
        return fail(e, AG_ERR_INVALID, "memory_fraction needs a known capacity: set cap or capacity on this upstream");
    /* a fraction of 1 is what torch has before anyone calls set_per_process_memory_fraction */
    e->set_fraction = f < 1.0;
    e->allowed_max = e->set_fraction ? (uint64_t)(f * (double)e->capacity) : UINT64_MAX;
    return AG_OK;
}

static int im_set_memory_fraction(ag_engine *e, double fraction) {
    int rc = apply_fraction(e, fraction);
    if (rc == AG_OK) e->s.memory_fraction = fraction;
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* statistics and layout                                                                       */

static void im_get_stats(const ag_engine *e, ag_stats *out) {
    *out = e->st;
    out->upstream_bytes = (int64_t)e->up.total;
    out->upstream_peak_bytes = (int64_t)e->up.peak;
}

static void im_reset_peak_stats(ag_engine *e) {
    ag_stat *arrs[] = {e->st.allocation, e->st.segment, e->st.active, e->st.inactive_split,
                       e->st.allocated_bytes, e->st.reserved_bytes, e->st.active_bytes,
                       e->st.inactive_split_bytes, e->st.requested_bytes};
    for (size_t i = 0; i < sizeof arrs / sizeof arrs[0]; i++)
        for (int j = 0; j < 3; j++) arrs[i][j].peak = arrs[i][j].current;
    e->st.oversize_allocations.peak = e->st.oversize_allocations.current;
    e->st.oversize_segments.peak = e->st.oversize_segments.current;
    e->up.peak = e->up.total;
}

static void im_reset_accumulated_stats(ag_engine *e) {
    ag_stat *arrs[] = {e->st.allocation, e->st.segment, e->st.active, e->st.inactive_split,
                       e->st.allocated_bytes, e->st.reserved_bytes, e->st.active_bytes,
                       e->st.inactive_split_bytes, e->st.requested_bytes};
    for (size_t i = 0; i < sizeof arrs / sizeof arrs[0]; i++)
        for (int j = 0; j < 3; j++) arrs[i][j].allocated = arrs[i][j].freed = 0;
    e->st.oversize_allocations.allocated = e->st.oversize_allocations.freed = 0;
    e->st.oversize_segments.allocated = e->st.oversize_segments.freed = 0;
    e->st.num_alloc_retries = e->st.num_ooms = e->st.num_sync_all_streams = 0;
    e->st.num_device_alloc = e->st.num_device_free = 0;
    e->st.device_mallocs = e->st.device_frees = e->st.device_maps = e->st.device_unmaps = 0;
}

void ag_last_oom(const ag_engine *e, ag_oom_info *out) { *out = tls_oom; }

uint64_t ag_capacity(const ag_engine *e) { return e->capacity; }

static int im_layout_counts(const ag_engine *e, int64_t *n_segments, int64_t *n_blocks) {
    *n_segments = e->n_segs;
    *n_blocks = e->n_blocks_live;
    return AG_OK;
}

static int im_layout(const ag_engine *e, ag_segment_info *segs, int64_t max_segs, ag_block_info *blocks,
                     int64_t max_blocks) {
    int64_t ns = 0, nb = 0;
    for (ag_segment *g = e->segs; g; g = g->lnext) {
        if (ns >= max_segs) return AG_ERR_INVALID;
        ag_segment_info *si = &segs[ns++];
        si->address = g->base;
        si->size = g->size;
        si->pool_id = g->pool->owner ? g->pool->owner->id : 0;
        si->stream = g->stream;
        si->is_small = g->pool->is_small;
        si->is_expandable = g->expandable;
        si->first_block = nb;
        si->n_blocks = 0;
        for (ag_block *b = g->head; b; b = b->next) {
            if (nb >= max_blocks) return AG_ERR_INVALID;
            ag_block_info *bi = &blocks[nb++];
            bi->address = b->ptr;
            bi->size = b->size;
            bi->stream = b->stream;
            if (b->allocated) bi->state = AG_BLOCK_ALLOCATED;
            else if (b->event_count > 0) bi->state = AG_BLOCK_PENDING_FREE;
            else if (!b->mapped) bi->state = AG_BLOCK_UNMAPPED;
            else bi->state = AG_BLOCK_INACTIVE;
            bi->requested_size = (b->allocated || b->event_count > 0) ? b->requested : 0;
            si->n_blocks++;
        }
    }
    return AG_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* replay: a whole trace in one call                                                           */

static int im_replay(ag_engine *e, const ag_op *ops, int64_t n, uint64_t *slots, int64_t nslots,
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

/* ------------------------------------------------------------------------------------------ */
/* create / destroy                                                                            */

static int validate(const ag_settings *s, char *err, size_t errlen) {
    if (s->policy != AG_POLICY_NATIVE && s->policy != AG_POLICY_XPU && s->policy != AG_POLICY_BFC) {
        snprintf(err, errlen, "unknown policy %d", s->policy);
        return AG_ERR_INVALID;
    }
    if (s->upstream < AG_UPSTREAM_HOST || s->upstream > AG_UPSTREAM_DEVICE) {
        snprintf(err, errlen, "unknown upstream %d", s->upstream);
        return AG_ERR_INVALID;
    }
    if (s->large_segment_size < KROUND_LARGE || s->large_segment_size % KROUND_LARGE) {
        snprintf(err, errlen, "large_segment_size must be a positive multiple of 2 MiB, got %llu",
                 (unsigned long long)s->large_segment_size);
        return AG_ERR_INVALID;
    }
    if (s->max_split_size < s->large_segment_size) {
        snprintf(err, errlen, "max_split_size must be >= large_segment_size (%llu), got %llu",
                 (unsigned long long)s->large_segment_size, (unsigned long long)s->max_split_size);
        return AG_ERR_INVALID;
    }
    if (s->expandable_head_align && (s->expandable_head_align < KMIN_BLOCK || s->expandable_head_align > KROUND_LARGE ||
                                     (s->expandable_head_align & (s->expandable_head_align - 1)))) {
        snprintf(err, errlen, "expandable_head_align must be 0 or a power of 2 in [512, 2 MiB], got %llu",
                 (unsigned long long)s->expandable_head_align);
        return AG_ERR_INVALID;
    }
    if (s->round_extra > (1ULL << 30)) {
        snprintf(err, errlen, "round_extra must be at most 1 GiB, got %llu", (unsigned long long)s->round_extra);
        return AG_ERR_INVALID;
    }
    for (int i = 0; i < 16; i++) {
        uint32_t d = s->roundup_power2_divisions[i];
        if (d & (d - 1)) {
            snprintf(err, errlen, "roundup_power2_divisions[%d] must be 0 or a power of 2, got %u", i, d);
            return AG_ERR_INVALID;
        }
    }
    if (!(s->garbage_collection_threshold >= 0.0 && s->garbage_collection_threshold < 1.0)) {
        snprintf(err, errlen, "garbage_collection_threshold must be in [0, 1), got %g", s->garbage_collection_threshold);
        return AG_ERR_INVALID;
    }
    if (s->expandable_segments && s->upstream == AG_UPSTREAM_DEVICE && s->policy != AG_POLICY_BFC) {
        snprintf(err, errlen, "expandable segments need the driver's virtual-memory API, which the device "
                              "upstream does not use; use the counting or host upstream, or turn them off");
        return AG_ERR_UNSUPPORTED;
    }
    return AG_OK;
}

int ag_engine_create(const ag_settings *settings, const char *device_libs, ag_engine **out,
                     char *err, size_t errlen) {
    *out = NULL;
    int rc = validate(settings, err, errlen);
    if (rc) return rc;
    ag_engine *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(err, errlen, "out of host memory");
        return AG_ERR_NOMEM;
    }
    e->s = *settings;
    if (settings->policy == AG_POLICY_BFC) {
        /* bfc ignores torch's knobs (validated above all the same): no expandable segments,
         * no max_split_size rules, no GC threshold, no NPU padding; see "bfc policy" */
        e->s.expandable_segments = 0;
        e->s.expandable_head_align = 0;
        e->s.round_extra = 0;
        e->s.max_split_size = UINT64_MAX;
        e->s.garbage_collection_threshold = 0.0;
    }
    e->up.kind = settings->upstream;
    e->up.next_addr = COUNTING_BASE;
    e->small.is_small = 1;
    e->n_streams = 1;
    e->next_pool_id = 1;
    e->rng = 0x9E3779B9u;
    e->plug_device = -1;
    e->refs = 1;
    pthread_mutex_init(&e->mu, NULL);
    if (e->up.kind == AG_UPSTREAM_DEVICE) {
        rc = open_device(e, device_libs, err, errlen);
        if (rc) {
            free(e);
            return rc;
        }
    }
    /* capacity: explicit, else the cap, else what the machine has */
    if (settings->capacity) e->capacity = settings->capacity;
    else if (settings->cap) e->capacity = settings->cap;
    else if (e->up.kind == AG_UPSTREAM_HOST) {
        long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        e->capacity = (pages > 0 && psz > 0) ? (uint64_t)pages * (uint64_t)psz : UINT64_MAX;
    } else if (e->up.kind == AG_UPSTREAM_DEVICE && e->up.dmeminfo) {
        size_t fr = 0, tot = 0;
        e->capacity = (e->up.dmeminfo(&fr, &tot) == 0 && tot) ? (uint64_t)tot : UINT64_MAX;
    } else {
        e->capacity = UINT64_MAX;
    }
    rc = apply_fraction(e, settings->memory_fraction);
    if (rc == AG_OK && (!grow_blocks(e) || !hgrow(e))) rc = fail(e, AG_ERR_NOMEM, "out of host memory");
    if (rc) {
        snprintf(err, errlen, "%s", tls_err);
        ag_engine_destroy(e);
        return rc;
    }
    *out = e;
    return AG_OK;
}

static void plug_forget_engine(ag_engine *e);
static void engine_teardown(ag_engine *e);

static void engine_unref(ag_engine *e) {
    if (__atomic_sub_fetch(&e->refs, 1, __ATOMIC_ACQ_REL) == 0) engine_teardown(e);
}

/* an extra reference for a holder of the raw engine address (TensorBlocks): the struct stays
 * valid until ag_engine_drop, even after the owner's ag_engine_destroy (calls then see
 * `closed` and refuse) */
void ag_engine_retain(ag_engine *e) {
    if (e) __atomic_add_fetch(&e->refs, 1, __ATOMIC_RELAXED);
}

void ag_engine_drop(ag_engine *e) {
    if (e) engine_unref(e);
}

void ag_engine_destroy(ag_engine *e) {
    if (!e) return;
    /* an engine still installed as the pluggable allocator is unbound first, so a later
     * alloc/free from torch finds no engine (an error it counts) instead of freed memory */
    if (e->plug_device >= 0) plug_forget_engine(e);
    pthread_mutex_lock(&e->mu);
    e->closed = 1;
    /* tensors still hold blocks: keep only what they need until the last one dies */
    if (e->t_live) (void)im_empty_cache(e);
    pthread_mutex_unlock(&e->mu);
    /* the owner's reference; live tensor blocks keep the engine (and their memory) alive */
    engine_unref(e);
}

static void engine_teardown(ag_engine *e) {
    /* give every segment back to the upstream; pointers into them die with the engine */
    ag_segment *g = e->segs;
    while (g) {
        ag_segment *n = g->lnext;
        if (g->expandable) {
            for (ag_block *b = g->head; b; b = b->next)
                if (b->mapped) up_unmap(e, b->ptr, b->size);
            up_unreserve(e, g->base, g->size);
        } else {
            up_free(e, g->base, g->size);
        }
        free(g);
        g = n;
    }
    while (e->ppools) {
        ag_ppool *n = e->ppools->next;
        free(e->ppools);
        e->ppools = n;
    }
    for (size_t i = 0; i < e->n_chunks; i++) free(e->chunks[i]);
    free(e->chunks);
    free(e->htab);
    free(e->ev);
    free(e->t_keys);
    if (e->up.dl) dlclose(e->up.dl);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

/* ------------------------------------------------------------------------------------------ */
/* locked entry points                                                                         */

#define LOCK(e) pthread_mutex_lock((pthread_mutex_t *)&(e)->mu)
#define UNLOCK(e) pthread_mutex_unlock((pthread_mutex_t *)&(e)->mu)
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

/* ------------------------------------------------------------------------------------------ */
/* tensor blocks: memory owned by a tensor whose death frees it from any thread, without the   */
/* GIL (the DLPack deleter of accel_graph/allocator/core/_dlpack.c calls ag_tensor_release)          */

int64_t ag_tensor_alloc(ag_engine *e, int64_t size) {
    LOCK(e);
    int64_t r;
    if (e->up.kind != AG_UPSTREAM_HOST) {
        r = fail(e, AG_ERR_UNSUPPORTED, "tensor blocks need the host upstream (real memory)");
    } else if (e->closed) {
        r = fail(e, AG_ERR_STATE, "the engine is closed");
    } else {
        r = AG_OK;
        /* room for this block's key: a death must never need memory */
        int64_t need = e->t_nkeys + e->t_live + 1;
        if (need > e->t_capkeys) {
            int64_t cap = e->t_capkeys ? e->t_capkeys * 2 : 256;
            while (cap < need) cap *= 2;
            int64_t *k = realloc(e->t_keys, (size_t)cap * sizeof *k);
            if (!k) r = fail(e, AG_ERR_NOMEM, "out of host memory for allocator metadata");
            else e->t_keys = k, e->t_capkeys = cap;
        }
        if (r == AG_OK) r = im_malloc(e, size, 0, 0);
        if (r >= 0) {
            e->t_live++;
            __atomic_add_fetch(&e->refs, 1, __ATOMIC_RELAXED);
        }
    }
    UNLOCK(e);
    return r;
}

void ag_tensor_release(ag_engine *e, uint64_t ptr, int64_t key) {
    LOCK(e);
    if (im_free(e, ptr) != AG_OK) e->t_errors++;
    e->t_live--;
    if (!e->closed) {
        e->t_keys[e->t_nkeys++] = key;
        __atomic_store_n(&e->t_pending, e->t_nkeys, __ATOMIC_RELEASE);
        if (e->t_release_idle) (void)im_empty_cache(e);
    }
    UNLOCK(e);
    engine_unref(e); /* the last reference tears the engine down (after the owner closed it) */
}

int64_t ag_tensor_drain(ag_engine *e, int64_t *out, int64_t max) {
    LOCK(e);
    int64_t n = e->t_nkeys < max ? e->t_nkeys : max;
    if (n > 0) {
        memcpy(out, e->t_keys, (size_t)n * sizeof *out);
        memmove(e->t_keys, e->t_keys + n, (size_t)(e->t_nkeys - n) * sizeof *out);
        e->t_nkeys -= n;
        __atomic_store_n(&e->t_pending, e->t_nkeys, __ATOMIC_RELEASE);
    }
    UNLOCK(e);
    return n;
}

const int64_t *ag_tensor_pending(const ag_engine *e) { return &e->t_pending; }

int ag_tensor_set_release_idle(ag_engine *e, int32_t on) {
    LOCK(e);
    e->t_release_idle = on != 0;
    int rc = on ? im_empty_cache(e) : AG_OK;
    UNLOCK(e);
    return rc;
}

void ag_tensor_counts(const ag_engine *e, int64_t *live, int64_t *errors) {
    LOCK(e);
    *live = e->t_live;
    *errors = e->t_errors;
    UNLOCK(e);
}

/* ------------------------------------------------------------------------------------------ */
/* the CUDAPluggableAllocator plug-in (docs/allocator.md "Pluggable-allocator entry points")    */
/*
 * torch calls ag_pluggable_alloc/ag_pluggable_free (the exact C ABI of CUDAPluggableAllocator)
 * from any thread, without the GIL. A table maps each device index to one installed engine
 * (device upstream only). Lock order: plug_rw (read for alloc/free, write for install/uninstall/
 * destroy), then the engine's mutex; the error texts have their own leaf mutex. Failures never
 * reach torch as anything but NULL: each refused alloc/free bumps the device's error count and
 * replaces its last error text.
 */

#define PLUG_MAX_DEVICES 64

typedef struct {
    ag_engine *e;
    int n_map;                        /* cudaStream_t value -> engine stream id (not NULL) */
    void *stream_key[MAX_STREAMS];
    int32_t stream_id[MAX_STREAMS];
    int64_t errors;                   /* atomic */
    char last_err[256];               /* under plug_err_mu */
} plug_slot;

static plug_slot plug_slots[PLUG_MAX_DEVICES];
static pthread_rwlock_t plug_rw = PTHREAD_RWLOCK_INITIALIZER;
static pthread_mutex_t plug_err_mu = PTHREAD_MUTEX_INITIALIZER;
static __thread char tls_plug_err[256];

static inline int plug_index_ok(int device) { return device >= 0 && device < PLUG_MAX_DEVICES; }

static void plug_error(int device, const char *fmt, ...) {
    plug_slot *s = &plug_slots[device];
    __atomic_fetch_add(&s->errors, 1, __ATOMIC_RELAXED);
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&plug_err_mu);
    vsnprintf(s->last_err, sizeof s->last_err, fmt, ap);
    pthread_mutex_unlock(&plug_err_mu);
    va_end(ap);
}

static void plug_clear_runtime_error(const ag_upstream *u) {
    if (u->dget_last_error) u->dget_last_error();
}

static void plug_forget_engine(ag_engine *e) {
    pthread_rwlock_wrlock(&plug_rw);
    int d = e->plug_device;
    if (plug_index_ok(d) && plug_slots[d].e == e) {
        plug_slots[d].e = NULL;
        plug_slots[d].n_map = 0;
    }
    e->plug_device = -1;
    pthread_rwlock_unlock(&plug_rw);
}

int ag_engine_set_threadsafe(ag_engine *e, int32_t on) {
    /* Every public ag_* call on an engine already takes its mutex (cffi drops the GIL), so this
     * only acknowledges the request; on = 0 is accepted and keeps the locking. */
    if (!e) return fail(NULL, AG_ERR_INVALID, "ag_engine_set_threadsafe: no engine");
    (void)on;
    return AG_OK;
}

int ag_pluggable_install(int device, ag_engine *e) {
    if (!plug_index_ok(device))
        return fail(NULL, AG_ERR_INVALID, "device index %d is out of range 0..%d", device, PLUG_MAX_DEVICES - 1);
    if (!e) return fail(NULL, AG_ERR_INVALID, "ag_pluggable_install: no engine");
    if (e->up.kind != AG_UPSTREAM_DEVICE)
        return fail(NULL, AG_ERR_INVALID,
                    "only an engine on the device upstream (cudaMalloc/hipMalloc) can be the pluggable "
                    "allocator; this one uses the %s upstream",
                    e->up.kind == AG_UPSTREAM_HOST ? "host" : "counting");
    int rc = AG_OK;
    pthread_rwlock_wrlock(&plug_rw);
    plug_slot *s = &plug_slots[device];
    if (s->e == e) {
        rc = AG_OK; /* already installed here */
    } else if (s->e) {
        rc = fail(NULL, AG_ERR_STATE, "device %d is already served by another engine; uninstall it first", device);
    } else if (e->plug_device >= 0) {
        rc = fail(NULL, AG_ERR_STATE, "this engine already serves device %d; one engine per device", e->plug_device);
    } else {
        s->e = e;
        s->n_map = 0;
        __atomic_store_n(&s->errors, 0, __ATOMIC_RELAXED);
        pthread_mutex_lock(&plug_err_mu);
        s->last_err[0] = 0;
        pthread_mutex_unlock(&plug_err_mu);
        e->plug_device = device;
    }
    pthread_rwlock_unlock(&plug_rw);
    return rc;
}

int ag_pluggable_uninstall(int device) {
    if (!plug_index_ok(device))
        return fail(NULL, AG_ERR_INVALID, "device index %d is out of range 0..%d", device, PLUG_MAX_DEVICES - 1);
    int rc = AG_OK;
    pthread_rwlock_wrlock(&plug_rw);
    plug_slot *s = &plug_slots[device];
    ag_engine *e = s->e;
    if (e) {
        LOCK(e);
        int64_t live = e->st.active[0].current; /* allocated + frees pending on other streams */
        UNLOCK(e);
        if (live > 0) {
            rc = fail(NULL, AG_ERR_STATE,
                      "device %d: %lld blocks of its engine are still allocated (memory torch may still "
                      "use); free them (delete the tensors / the MemPool) before uninstalling",
                      device, (long long)live);
        } else {
            s->e = NULL;
            s->n_map = 0;
            e->plug_device = -1;
        }
    }
    pthread_rwlock_unlock(&plug_rw);
    return rc;
}

int64_t ag_pluggable_errors(int device) {
    if (!plug_index_ok(device)) return AG_ERR_INVALID;
    return __atomic_load_n(&plug_slots[device].errors, __ATOMIC_RELAXED);
}

const char *ag_pluggable_last_error(int device) {
    if (!plug_index_ok(device)) return NULL;
    pthread_mutex_lock(&plug_err_mu);
    memcpy(tls_plug_err, plug_slots[device].last_err, sizeof tls_plug_err);
    pthread_mutex_unlock(&plug_err_mu);
    tls_plug_err[sizeof tls_plug_err - 1] = 0;
    return tls_plug_err;
}

/* The engine stream id of a cudaStream_t (NULL: stream 0), made on first sight. Under e->mu. */
static int32_t plug_stream(plug_slot *s, ag_engine *e, void *stream) {
    if (!stream) return 0;
    for (int i = 0; i < s->n_map; i++)
        if (s->stream_key[i] == stream) return s->stream_id[i];
    if (s->n_map >= MAX_STREAMS || e->n_streams >= MAX_STREAMS)
        return fail(e, AG_ERR_UNSUPPORTED, "stream %p is one stream too many: an engine serves at most %d streams",
                    stream, MAX_STREAMS);
    int32_t id = im_create_stream(e);
    if (id < 0) return id;
    s->stream_key[s->n_map] = stream;
    s->stream_id[s->n_map] = id;
    s->n_map++;
    return id;
}

void *ag_pluggable_alloc(size_t size, int device, void *stream) {
    if (size == 0 || !plug_index_ok(device)) return NULL; /* torch allocates 0-byte tensors */
    void *out = NULL;
    pthread_rwlock_rdlock(&plug_rw);
    plug_slot *s = &plug_slots[device];
    ag_engine *e = s->e;
    if (!e) {
        plug_error(device, "alloc(%zu bytes): no engine is installed for device %d", size, device);
        pthread_rwlock_unlock(&plug_rw);
        return NULL;
    }
    const ag_upstream *u = &e->up;
    /* the current device is `device` for the call (cudaMalloc allocates on the current one) */
    int prev = -1, switched = 0;
    if (u->dget_device && u->dset_device) {
        if (u->dget_device(&prev) != 0) {
            plug_clear_runtime_error(u);
        } else if (prev != device) {
            if (u->dset_device(device) != 0) {
                plug_clear_runtime_error(u);
                plug_error(device, "alloc(%zu bytes): could not make device %d current", size, device);
                pthread_rwlock_unlock(&plug_rw);
                return NULL;
            }
            switched = 1;
        }
    }
    /* a capturing stream must not see cudaFree: no release step on OOM, no GC */
    int capturing = 0;
    if (u->dis_capturing) {
        int status = 0;
        if (u->dis_capturing(stream, &status) != 0) {
            plug_clear_runtime_error(u);
            capturing = 1; /* unknown: the safe answer */
        } else {
            capturing = status != 0; /* active or invalidated */
        }
    }
    LOCK(e);
    int64_t r = plug_stream(s, e, stream);
    if (r >= 0) {
        e->no_release = capturing;
        r = im_malloc(e, size > (size_t)INT64_MAX ? INT64_MAX : (int64_t)size, (int32_t)r, 0);
        e->no_release = 0;
    }
    UNLOCK(e);
    if (switched && u->dset_device(prev) != 0) plug_clear_runtime_error(u);
    if (r < 0) plug_error(device, "alloc(%zu bytes, stream %p): %s", size, stream, tls_err);
    else out = (void *)(uintptr_t)r;
    pthread_rwlock_unlock(&plug_rw);
    return out;
}

void ag_pluggable_free(void *ptr, size_t size, int device, void *stream) {
    (void)size;
    (void)stream;
    if (!ptr || !plug_index_ok(device)) return;
    pthread_rwlock_rdlock(&plug_rw);
    ag_engine *e = plug_slots[device].e;
    if (!e) {
        plug_error(device, "free(%p): no engine is installed for device %d", ptr, device);
    } else {
        LOCK(e);
        int rc = im_free(e, (uint64_t)(uintptr_t)ptr);
        UNLOCK(e);
        if (rc) plug_error(device, "free(%p) on device %d: %s", ptr, device, tls_err);
    }
    pthread_rwlock_unlock(&plug_rw);
}
