/* accel-graph allocator core: the CUDAPluggableAllocator plug-in (docs/allocator.md
 * "Pluggable-allocator entry points").
 *
 * torch calls ag_pluggable_alloc/ag_pluggable_free (the exact C ABI of CUDAPluggableAllocator)
 * from any thread, without the GIL. A table maps each device index to one installed engine
 * (device upstream only). Lock order: plug_rw (read for alloc/free, write for install/uninstall/
 * destroy), then the engine's mutex; the error texts have their own leaf mutex. Failures never
 * reach torch as anything but NULL: each refused alloc/free bumps the device's error count and
 * replaces its last error text.
 */
#include "_core_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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

void plug_forget_engine(ag_engine *e) {
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
                    e->up.ops->name);
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
    if (r < 0) plug_error(device, "alloc(%zu bytes, stream %p): %s", size, stream, ag_tls_err);
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
        if (rc) plug_error(device, "free(%p) on device %d: %s", ptr, device, ag_tls_err);
    }
    pthread_rwlock_unlock(&plug_rw);
}
