/* accel-graph allocator core: the C API.
 *
 * One engine is one device's caching allocator: a policy (PyTorch's `native` CUDA caching
 * allocator, XPU's simpler one, or a model of TensorFlow's BFC allocator) over an upstream raw allocator (host memory, a counting
 * simulator, or cudaMalloc/hipMalloc resolved with dlopen at run time).
 *
 * Contract for every function: nothing here prints, aborts or longjmps. Failures return a
 * negative status (AG_ERR_*), leave the engine consistent and usable, and put a one-line
 * reason in ag_last_error(). Functions returning a pointer or an id return it as a positive
 * int64 and a negative status on failure. Every public call on an engine takes that engine's
 * mutex (cffi releases the GIL), so threads may share an engine.
 *
 * This header is the whole API. The implementation is the _core_*.c files, built together into
 * one extension by _build.py; _core_internal.h says which file holds what.
 *
 * Only the text between the CDEF markers is given to cffi's cdef (it cannot read #include or
 * include guards), so keep that part free of preprocessor lines.
 */
#ifndef ACCEL_GRAPH_ALLOCATOR_CORE_H
#define ACCEL_GRAPH_ALLOCATOR_CORE_H

#include <stddef.h>
#include <stdint.h>

/* CDEF BEGIN */
enum {
    AG_OK = 0,
    AG_ERR_OOM = -1,         /* the request cannot be served: cap, fraction or upstream full */
    AG_ERR_INVALID = -2,     /* bad argument: size <= 0, unknown stream, bad setting */
    AG_ERR_BAD_PTR = -3,     /* pointer unknown to this engine or already freed */
    AG_ERR_POOL = -4,        /* unknown or released private pool id */
    AG_ERR_UNSUPPORTED = -5, /* valid request this upstream/policy cannot do */
    AG_ERR_UPSTREAM = -6,    /* the upstream failed for a reason other than memory */
    AG_ERR_NOMEM = -7,       /* host malloc failed for allocator metadata */
    AG_ERR_LOAD = -8,        /* the device runtime library could not be loaded */
    AG_ERR_STATE = -9        /* call not legal in the current state (end without begin, ...) */
};

/* bfc: TensorFlow's BFC allocator (best-fit with coalescing), docs/allocator.md "bfc policy" */
enum { AG_POLICY_NATIVE = 0, AG_POLICY_XPU = 1, AG_POLICY_BFC = 2 };
/* Private pool flags (torch's MemPool arguments). */
enum { AG_POOL_NO_SPLIT = 1, AG_POOL_USE_ON_OOM = 2 };
enum { AG_UPSTREAM_HOST = 0, AG_UPSTREAM_COUNTING = 1, AG_UPSTREAM_DEVICE = 2 };

/* Action codes: identical to accel_graph/allocator/traces/actions.py ACTIONS (never renumber). */
enum {
    AG_EV_ALLOC = 0,
    AG_EV_FREE_REQUESTED = 1,
    AG_EV_FREE_COMPLETED = 2,
    AG_EV_SEGMENT_ALLOC = 3,
    AG_EV_SEGMENT_FREE = 4,
    AG_EV_SEGMENT_MAP = 5,
    AG_EV_SEGMENT_UNMAP = 6,
    AG_EV_OOM = 7
    /* 8 snapshot, 9 annotate (torch 2.14): trace-only actions, which the engine never emits */
};

/* Block states reported by ag_layout. */
enum { AG_BLOCK_INACTIVE = 0, AG_BLOCK_ALLOCATED = 1, AG_BLOCK_PENDING_FREE = 2, AG_BLOCK_UNMAPPED = 3 };

/* Replay opcodes for ag_replay (one C call runs a whole trace). */
enum {
    AG_OP_MALLOC = 0,         /* size, stream; id = slot that receives the pointer */
    AG_OP_FREE = 1,           /* id = slot; an empty slot (failed malloc) is skipped */
    AG_OP_RECORD_STREAM = 2,  /* id = slot, stream = the using stream */
    AG_OP_PROCESS_EVENTS = 3,
    AG_OP_SYNCHRONIZE = 4,
    AG_OP_EMPTY_CACHE = 5,
    AG_OP_BEGIN_POOL = 6,     /* id = pool id, stream = filter (-1: every stream) */
    AG_OP_END_POOL = 7,       /* id = pool id */
    AG_OP_RELEASE_POOL = 8,   /* id = pool id */
    AG_OP_MALLOC_POOL = 9,    /* like MALLOC, into the private pool given as size2 */
    AG_OP_RESET_PEAK_STATS = 10, /* like ag_reset_peak_stats (e.g. after a replay prologue) */
    AG_OP_SET_REQUESTED = 11  /* id = slot, size = the bytes its caller asked for (1..block size):
                               * a replay prologue allocates a pre-existing block at its block size
                               * and records the size it was requested at */
};

typedef struct {
    int32_t policy;                   /* AG_POLICY_* */
    int32_t upstream;                 /* AG_UPSTREAM_* */
    uint64_t max_split_size;          /* UINT64_MAX: unlimited (torch's SIZE_MAX) */
    uint64_t max_non_split_rounding_size;
    uint64_t large_segment_size;      /* 20 MiB by default; also the large ES page */
    uint32_t roundup_power2_divisions[16];
    double garbage_collection_threshold; /* 0: off */
    double memory_fraction;           /* < 0: never set (torch's default) */
    int32_t expandable_segments;
    int32_t device_kind;              /* device upstream: 0 = CUDA runtime, 1 = HIP */
    uint64_t cap;                     /* 0: no cap; else the upstream refuses to hold more */
    uint64_t capacity;                /* total device memory; 0: derive (cap, host RAM, driver) */
    uint64_t round_extra;             /* bytes added to a request before rounding (torch_npu: 32) */
    uint64_t expandable_head_align;   /* 0: off; else, with expandable segments, a request of
                                       * >= 2 MiB whose block starts off this alignment starts
                                       * at the next multiple, the skipped head staying a free
                                       * block (torch_npu base_addr_aligned_kb, 16 KiB) */
    int32_t expandable_oversize_rule; /* 1: get_free_block applies the max_split oversize rules
                                       * to blocks of expandable segments (torch >= 2.12,
                                       * pytorch#193400); 0: it skips them (torch 2.9-2.11) */
} ag_settings;

typedef struct {
    int64_t current;
    int64_t peak;
    int64_t allocated;
    int64_t freed;
} ag_stat;

/* Index 0 = all, 1 = small_pool, 2 = large_pool (torch's StatType order). */
typedef struct {
    ag_stat allocation[3];
    ag_stat segment[3];
    ag_stat active[3];
    ag_stat inactive_split[3];
    ag_stat allocated_bytes[3];
    ag_stat reserved_bytes[3];
    ag_stat active_bytes[3];
    ag_stat inactive_split_bytes[3];
    ag_stat requested_bytes[3];
    ag_stat oversize_allocations;
    ag_stat oversize_segments;
    int64_t num_alloc_retries;
    int64_t num_ooms;
    int64_t num_sync_all_streams;
    int64_t num_device_alloc;         /* torch: device mallocs + ES maps */
    int64_t num_device_free;          /* torch: device frees + ES unmaps */
    int64_t device_mallocs;
    int64_t device_frees;
    int64_t device_maps;
    int64_t device_unmaps;
    int64_t upstream_bytes;           /* bytes the upstream holds right now */
    int64_t upstream_peak_bytes;
} ag_stats;

typedef struct {
    int32_t kind;                     /* 0 = none yet, 1 = cache exhausted, 2 = more than 1 EB */
    int32_t stream;
    int32_t fraction_set;
    int32_t expandable_segments;
    uint64_t requested;
    uint64_t rounded;
    uint64_t alloc_size;
    uint64_t capacity;                /* UINT64_MAX: unbounded */
    uint64_t device_free;
    uint64_t allowed;
    uint64_t reserved;
    uint64_t allocated;
    uint64_t cached_in_private_pools;
} ag_oom_info;

typedef struct {
    uint64_t address;                 /* base of the allocation or of the ES address range */
    uint64_t size;
    int64_t pool_id;                  /* 0: default pools */
    int32_t stream;
    int32_t is_small;
    int32_t is_expandable;
    int32_t n_blocks;
    int64_t first_block;              /* index into the block array */
} ag_segment_info;

typedef struct {
    uint64_t address;
    uint64_t size;
    uint64_t requested_size;
    int32_t state;                    /* AG_BLOCK_* */
    int32_t stream;
} ag_block_info;

typedef struct {
    int64_t seq;                      /* per-engine sequence number, from 0 */
    int64_t time_us;                  /* Unix-epoch microseconds, as torch's trace */
    uint64_t addr;                    /* oom: the free device bytes, as torch does */
    uint64_t size;
    int64_t pool_id;
    int32_t stream;
    int32_t action;                   /* AG_EV_* */
} ag_event;

typedef struct {
    int32_t op;
    int32_t stream;
    int64_t size;
    int64_t id;
    int64_t size2;
} ag_op;

typedef struct {
    int64_t segments;                 /* ordinary segments and expandable ranges */
    int64_t reserved_bytes;           /* segment bytes, mapped pages for expandable ranges */
    int64_t allocated_bytes;
    int64_t active_bytes;             /* allocated + pending cross-stream frees */
    int64_t blocks_allocated;
    int32_t use_count;
    int32_t freeable;
} ag_pool_info;

typedef struct ag_engine ag_engine;

int ag_engine_create(const ag_settings *settings, const char *device_libs, ag_engine **out,
                     char *err, size_t errlen);
void ag_engine_destroy(ag_engine *e);
const char *ag_last_error(const ag_engine *e);

int64_t ag_malloc(ag_engine *e, int64_t size, int32_t stream, int64_t pool_id);
int ag_free(ag_engine *e, uint64_t ptr);
int ag_record_stream(ag_engine *e, uint64_t ptr, int32_t stream);
int ag_process_events(ag_engine *e);
int ag_synchronize(ag_engine *e);
int ag_empty_cache(ag_engine *e);
int64_t ag_block_size(ag_engine *e, uint64_t ptr);

int32_t ag_create_stream(ag_engine *e);
int32_t ag_num_streams(const ag_engine *e);
int64_t ag_create_pool(ag_engine *e, int32_t flags); /* AG_POOL_* bits */
int ag_begin_allocate_to_pool(ag_engine *e, int64_t pool_id, int32_t stream);
int ag_end_allocate_to_pool(ag_engine *e, int64_t pool_id);
int ag_release_pool(ag_engine *e, int64_t pool_id);
int ag_pool_use_count(const ag_engine *e, int64_t pool_id);
int ag_pool_info_get(const ag_engine *e, int64_t pool_id, ag_pool_info *out);
int ag_set_memory_fraction(ag_engine *e, double fraction);

void ag_get_stats(const ag_engine *e, ag_stats *out);
void ag_reset_peak_stats(ag_engine *e);
void ag_reset_accumulated_stats(ag_engine *e);
void ag_last_oom(const ag_engine *e, ag_oom_info *out);
uint64_t ag_capacity(const ag_engine *e);

int ag_layout_counts(const ag_engine *e, int64_t *n_segments, int64_t *n_blocks);
int ag_layout(const ag_engine *e, ag_segment_info *segs, int64_t max_segs, ag_block_info *blocks,
              int64_t max_blocks);

int ag_events_enable(ag_engine *e, int32_t on, int64_t max_entries);
int64_t ag_events_count(const ag_engine *e);
int64_t ag_events_drain(ag_engine *e, ag_event *out, int64_t max);

int ag_replay(ag_engine *e, const ag_op *ops, int64_t n, uint64_t *slots, int64_t nslots,
              int64_t *results, int64_t *n_done);

uint64_t ag_round_size(const ag_settings *s, uint64_t size);
uint64_t ag_rp2_next_division(uint64_t size, uint32_t divisions);
uint64_t ag_allocation_size(const ag_settings *s, uint64_t size);

/* The CUDAPluggableAllocator plug-in (docs/allocator.md "Pluggable-allocator entry points").
 * The exact ABI torch looks up with ctypes (stream is a cudaStream_t/hipStream_t; NULL: the
 * default stream). alloc of 0 bytes, or any failure, returns NULL; free(NULL) does nothing.
 * Neither prints, aborts or reports to the caller: failures are counted per device. */
void *ag_pluggable_alloc(size_t size, int device, void *stream);
void ag_pluggable_free(void *ptr, size_t size, int device, void *stream);
/* Bind a device-upstream engine to a device index (0..63). AG_ERR_STATE: another engine holds
 * the device, or this engine serves another one; AG_ERR_INVALID: bad index or not the device
 * upstream. Installing the same engine twice is AG_OK. Resets the device's error count. */
int ag_pluggable_install(int device, ag_engine *e);
/* Unbind; AG_ERR_STATE while any of its blocks is allocated. Nothing bound: AG_OK. */
int ag_pluggable_uninstall(int device);
/* The engine mutex is always taken; kept for the plug-in's contract (any value: AG_OK). */
int ag_engine_set_threadsafe(ag_engine *e, int32_t on);
/* Refused allocs/frees on the device since its last install (AG_ERR_INVALID: bad index). */
int64_t ag_pluggable_errors(int device);
/* The last refusal's text ("" if none; NULL for a bad index), a copy private to the thread. */
const char *ag_pluggable_last_error(int device);
/* Tensor blocks (docs/allocator.md "Tensor blocks"): host-upstream blocks owned by a tensor
 * (a DLPack deleter) instead of the caller. ag_tensor_alloc is ag_malloc(size, stream 0) that
 * also takes a reference on the engine; ag_tensor_release(ptr, key) frees the block from any
 * thread (no GIL needed), queues `key` for ag_tensor_drain unless the engine is closed, and
 * drops the reference. ag_engine_destroy only drops the owner's reference: the engine and its
 * memory go when the last tensor block is released. ag_tensor_pending points at the number of
 * queued keys (read without the lock). ag_engine_retain/ag_engine_drop take and drop an extra
 * reference for whoever keeps the raw engine address. With release_idle on, each release also returns whole
 * free segments (as ag_empty_cache); turning it on releases them at once. */
void ag_engine_retain(ag_engine *e);
void ag_engine_drop(ag_engine *e);
int64_t ag_tensor_alloc(ag_engine *e, int64_t size);
void ag_tensor_release(ag_engine *e, uint64_t ptr, int64_t key);
int64_t ag_tensor_drain(ag_engine *e, int64_t *out, int64_t max);
const int64_t *ag_tensor_pending(const ag_engine *e);
int ag_tensor_set_release_idle(ag_engine *e, int32_t on);
void ag_tensor_counts(const ag_engine *e, int64_t *live, int64_t *errors);
/* CDEF END */

#endif
