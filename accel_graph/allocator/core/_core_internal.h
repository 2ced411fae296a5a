/* accel-graph allocator core: what the core's C files share (internal; the API is _core.h).
 *
 * The core is a caching allocator that models PyTorch's CUDA caching allocator (policy
 * `native`), XPU's simpler one (policy `xpu`, a variant of native) and TensorFlow's BFC
 * allocator (policy `bfc`) over an upstream raw allocator (host memory, a counting simulator,
 * or cudaMalloc/hipMalloc). The algorithm follows shared/reference/torch-internals.md section 4
 * step by step; comments name the step they implement. Which file holds what:
 *
 *   _core.h            the public API (the cffi cdef), the only header Python sees
 *   _core_internal.h   this file: data model, the policy and upstream ops tables, shared helpers
 *   _core_sets.h/.c    block structs, the pointer map and the ordered sets (inline hot paths)
 *   _core_upstream.c   the upstreams (host, counting, device) behind ag_upstream_ops
 *   _core_alloc.c      malloc, free, record_stream: the policy-independent steps
 *   _core_segments.c   segments: creating, releasing, expandable segments (map/unmap)
 *   _core_native.c     the native and xpu policies (ag_policy_ops)
 *   _core_bfc.c        the bfc policy (ag_policy_ops)
 *   _core_pools.c      streams and private pools
 *   _core_stats.c      statistics, layout, per-pool info
 *   _core_events.c     the event ring (the trace torch's _record_memory_history keeps)
 *   _core_replay.c     a whole trace in one call
 *   _core_engine.c     errors, settings validation, create / destroy, the policy table
 *   _core_api.c        the locked public entry points (ag_* = im_* under the engine mutex)
 *   _core_tensor.c     tensor blocks (memory owned by DLPack tensors)
 *   _core_plugin.c     the CUDAPluggableAllocator plug-in
 *
 * Conventions: functions named im_* are the unlocked bodies of the ag_* entry points (callers
 * hold e->mu). Nothing here prints, aborts or longjmps: failures return AG_ERR_* and put a
 * one-line reason in the per-thread error text (fail()).
 */
#ifndef ACCEL_GRAPH_ALLOCATOR_CORE_INTERNAL_H
#define ACCEL_GRAPH_ALLOCATOR_CORE_INTERNAL_H

#include "_core.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* Every name declared below is internal to the extension module: hidden symbols are called
 * directly (no PLT, nothing another library can interpose) and only _core.h's ag_* API is
 * exported. */
#pragma GCC visibility push(hidden)

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
/*
 * The reference's: blocks live in segments (doubly linked neighbours), free blocks in
 * per-BlockPool ordered sets keyed by (stream, size, address), unmapped expandable blocks in a
 * second set keyed by (stream, address). The ordered sets are treaps threaded through the
 * blocks themselves (the free set split into per-size-bucket treaps, see ag_bpool), block
 * structs come from a freelist, and live blocks are found by address in an open-addressing
 * map, so a malloc/free pair touches no host allocator in the steady state (_core_sets.h).
 */

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

/* ------------------------------------------------------------------------------------------ */
/* upstreams: where segments come from (_core_upstream.c)                                      */

typedef struct ag_upstream ag_upstream;

/* One upstream kind. Byte accounting (total, peak) and the settings' cap are the caller's
 * (up_* in _core_upstream.c): an op only does the raw work. Statuses: AG_OK, AG_ERR_OOM when
 * refused for memory, AG_ERR_UPSTREAM for any other failure (the runtime's code in
 * u->last_err), AG_ERR_UNSUPPORTED for what the kind cannot do. To add an upstream: write one
 * of these tables, give it an AG_UPSTREAM_* number in _core.h and a slot in ag_upstream_of. */
typedef struct ag_upstream_ops {
    const char *name;                                       /* "host", "counting", "device" */
    int expandable;           /* reserve/map work: expandable segments are possible */
    /* bring it up (device: load the runtime); NULL: nothing to do; failure text in err */
    int (*open)(ag_upstream *u, const ag_settings *s, const char *libs, char *err, size_t errlen);
    void (*close)(ag_upstream *u);                          /* NULL: nothing to do */
    int (*alloc)(ag_upstream *u, uint64_t size, uint64_t *out);
    void (*free)(ag_upstream *u, uint64_t ptr, uint64_t size);
    /* expandable segments: reserve address space, then map/unmap pages inside it */
    int (*reserve)(ag_upstream *u, uint64_t size, uint64_t *out);
    void (*unreserve)(ag_upstream *u, uint64_t base, uint64_t size);
    int (*map)(ag_upstream *u, uint64_t addr, uint64_t size);
    void (*unmap)(ag_upstream *u, uint64_t addr, uint64_t size);
    uint64_t (*total_memory)(const ag_upstream *u);        /* UINT64_MAX: unknown */
    uint64_t (*free_memory)(const ag_upstream *u);         /* UINT64_MAX: unknown */
} ag_upstream_ops;

struct ag_upstream {
    const ag_upstream_ops *ops;
    int kind;                 /* AG_UPSTREAM_* */
    uint64_t total, peak;     /* bytes held (segments + mapped pages) */
    uint64_t next_addr;       /* counting upstream */
    int last_err;             /* device: the runtime's code of the last failed malloc */
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
};

extern const ag_upstream_ops ag_upstream_host, ag_upstream_counting, ag_upstream_device;
/* The table of an AG_UPSTREAM_* number; NULL: unknown. */
const ag_upstream_ops *ag_upstream_of(int32_t kind);

/* ------------------------------------------------------------------------------------------ */
/* policies: how a request is rounded, served from the cache, and grown (_core_native.c,      */
/* _core_bfc.c)                                                                                */

/* One malloc in flight (section 4 "malloc(orig_size, stream)"). */
typedef struct {
    uint64_t size, alloc_size;    /* the rounded request; the segment size asked for */
    int32_t stream;               /* free-set stream searched (bfc: always 0) */
    int32_t ustream;              /* the request's stream */
    ag_bpool *pool;
    ag_block *block;              /* find/acquire: the block taken out of the free set */
    int err;                      /* AG_ERR_UPSTREAM, _UNSUPPORTED, _NOMEM: ends the chain */
} ag_request;

/* One policy. ag_malloc runs: round_size, pick the BlockPool, segment_size, then find (a cached
 * block) or else acquire (new memory, releasing cached memory as the policy does), then splits
 * the block (should_split) and hands it out. On failure p->err says why, or nothing: an OOM,
 * reported with p->alloc_size as the size tried. To add a policy: write one of these tables,
 * give it an AG_POLICY_* number in _core.h, a slot in ag_policy_of, a name in POLICIES and the
 * config keys it honours in POLICY_KEYS (accel_graph/allocator/core/settings.py). */
typedef struct ag_policy_ops {
    const char *name;
    int max_split;            /* torch's max_split_size rules apply (oversize stats, GC) */
    int stream_aware;         /* 0: every block sits in stream 0 of the free set */
    int small_pool;           /* requests up to 1 MiB go to the small BlockPool */
    /* the settings the engine keeps (knobs the policy ignores are reset); NULL: as given */
    void (*adjust_settings)(ag_settings *s);
    uint64_t (*round_size)(const ag_settings *s, uint64_t size);
    uint64_t (*segment_size)(const ag_settings *s, uint64_t rounded);
    int (*find)(ag_engine *e, ag_request *p);               /* 1: p->block taken */
    int (*acquire)(ag_engine *e, ag_request *p);            /* 1: p->block taken */
    /* split a free block of pool bp whose `rem` bytes would be left after `size`? */
    int (*should_split)(const ag_engine *e, const ag_bpool *bp, uint64_t rem, uint64_t size);
    /* whole free segments of p went back to the upstream (empty_cache); NULL: nothing */
    void (*segments_released)(ag_engine *e, ag_bpool *p);
} ag_policy_ops;

extern const ag_policy_ops ag_policy_native, ag_policy_xpu, ag_policy_bfc;
/* The table of an AG_POLICY_* number; NULL: unknown. */
const ag_policy_ops *ag_policy_of(int32_t policy);

/* ------------------------------------------------------------------------------------------ */
/* the engine                                                                                  */

struct ag_engine {
    ag_settings s;
    const ag_policy_ops *pol;
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

#define LOCK(e) pthread_mutex_lock((pthread_mutex_t *)&(e)->mu)
#define UNLOCK(e) pthread_mutex_unlock((pthread_mutex_t *)&(e)->mu)

/* ------------------------------------------------------------------------------------------ */
/* errors (_core_engine.c)                                                                     */

/* The reason for the last failure and the numbers of the last OOM are per thread, so a caller
 * reads its own failure even while other threads use the engine. */
extern __thread char ag_tls_err[512];
extern __thread ag_oom_info ag_tls_oom;

/* Put the reason in ag_tls_err and return `code` (e may be NULL). */
int fail(ag_engine *e, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

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

static inline int is_split(const ag_block *b) { return b->prev || b->next; }
static inline int max_split_on(const ag_engine *e) { return e->pol->max_split; }

/* ------------------------------------------------------------------------------------------ */
/* events (_core_events.c)                                                                     */

void ev_push(ag_engine *e, int action, uint64_t addr, uint64_t size, int32_t stream, const ag_bpool *p);

#define EVENT(e, a, addr, size, stream, pool)                                       \
    do {                                                                           \
        if ((e)->ev_on) ev_push((e), (a), (addr), (size), (stream), (pool));       \
    } while (0)

int im_events_enable(ag_engine *e, int32_t on, int64_t max_entries);
int64_t im_events_count(const ag_engine *e);
int64_t im_events_drain(ag_engine *e, ag_event *out, int64_t max);

/* ------------------------------------------------------------------------------------------ */
/* upstream calls with byte accounting and the cap (_core_upstream.c)                          */

int up_open(ag_engine *e, const char *libs, char *err, size_t errlen);
void up_close(ag_engine *e);
int up_alloc(ag_engine *e, uint64_t size, uint64_t *out);
void up_free(ag_engine *e, uint64_t ptr, uint64_t size);
int up_reserve(ag_engine *e, uint64_t size, uint64_t *out);
void up_unreserve(ag_engine *e, uint64_t base, uint64_t size);
int up_map(ag_engine *e, uint64_t addr, uint64_t size);
void up_unmap(ag_engine *e, uint64_t addr, uint64_t size);
/* free device bytes as torch reports them in an OOM (capacity - held, or the driver's) */
uint64_t up_device_free(const ag_engine *e);

/* ------------------------------------------------------------------------------------------ */
/* malloc and free (_core_alloc.c)                                                             */

int64_t im_malloc(ag_engine *e, int64_t size, int32_t stream, int64_t pool_id);
int im_free(ag_engine *e, uint64_t ptr);
int im_record_stream(ag_engine *e, uint64_t ptr, int32_t stream);
int im_set_requested(ag_engine *e, uint64_t ptr, int64_t requested);
int64_t im_block_size(ag_engine *e, uint64_t ptr);
int im_process_events(ag_engine *e);
int im_synchronize(ag_engine *e);
int im_empty_cache(ag_engine *e);
/* merge the free neighbour src into dst; the bytes it added (0: not mergeable) */
uint64_t try_merge(ag_engine *e, ag_block *dst, ag_block *src);
/* every pending cross-stream free completes (counted as a synchronize) */
void synchronize_and_free_events(ag_engine *e);
/* use_on_oom private pools lend a free block to a default-pool request (policy->find) */
int try_mempool_fallback(ag_engine *e, ag_request *p);

/* ------------------------------------------------------------------------------------------ */
/* segments (_core_segments.c)                                                                 */

/* A fresh segment of `size` bytes at ptr (from up_alloc) as one block, counted and reported;
 * the block is in no set. NULL (AG_ERR_NOMEM in p->err, the memory given back): no metadata. */
ag_block *seg_add(ag_engine *e, ag_request *p, uint64_t ptr, uint64_t size, ag_bpool *bp, int32_t stream);
/* give a whole free segment (its one block) back to the upstream */
void release_block(ag_engine *e, ag_block *b);
/* every whole free segment of every releasable pool back to the upstream (AG_ERR_NOMEM) */
int release_cached_blocks(ag_engine *e);
/* expandable segments: a free run of at least p->size bytes, mapped, out of the free set */
ag_block *try_allocate_expandable_block(ag_engine *e, ag_request *p);

/* ------------------------------------------------------------------------------------------ */
/* streams and pools (_core_pools.c), memory fraction (_core_engine.c)                         */

int check_stream(ag_engine *e, int32_t stream);
ag_ppool *find_ppool(const ag_engine *e, int64_t id);
int32_t im_create_stream(ag_engine *e);
int32_t im_num_streams(const ag_engine *e);
int64_t im_create_pool(ag_engine *e, int32_t flags);
int im_begin_allocate_to_pool(ag_engine *e, int64_t pool_id, int32_t stream);
int im_end_allocate_to_pool(ag_engine *e, int64_t pool_id);
int im_release_pool(ag_engine *e, int64_t pool_id);
int im_pool_use_count(const ag_engine *e, int64_t pool_id);
int im_pool_info_get(const ag_engine *e, int64_t pool_id, ag_pool_info *out);
int im_set_memory_fraction(ag_engine *e, double fraction);

/* ------------------------------------------------------------------------------------------ */
/* statistics and layout (_core_stats.c), replay (_core_replay.c)                              */

void im_get_stats(const ag_engine *e, ag_stats *out);
void im_reset_peak_stats(ag_engine *e);
void im_reset_accumulated_stats(ag_engine *e);
int im_layout_counts(const ag_engine *e, int64_t *n_segments, int64_t *n_blocks);
int im_layout(const ag_engine *e, ag_segment_info *segs, int64_t max_segs, ag_block_info *blocks,
              int64_t max_blocks);
int im_replay(ag_engine *e, const ag_op *ops, int64_t n, uint64_t *slots, int64_t nslots,
              int64_t *results, int64_t *n_done);

/* ------------------------------------------------------------------------------------------ */
/* engine lifetime (_core_engine.c), plug-in (_core_plugin.c)                                  */

/* drop one reference; the last one tears the engine down */
void engine_unref(ag_engine *e);
/* unbind an engine from its plug-in device */
void plug_forget_engine(ag_engine *e);

#pragma GCC visibility pop

#endif
