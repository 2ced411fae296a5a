/* accel-graph allocator core: tensor blocks (docs/allocator.md "Tensor blocks"), memory owned
 * by a tensor whose death frees it from any thread, without the GIL (the DLPack deleter of
 * accel_graph/allocator/core/_dlpack.c calls ag_tensor_release).
 */
#include "_core_internal.h"

#include <stdlib.h>
#include <string.h>

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
