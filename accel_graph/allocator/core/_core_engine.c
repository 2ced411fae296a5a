/* accel-graph allocator core: an engine's life (settings validation, create, references,
 * destroy), the per-thread error text, and the tables that name the policies.
 */
#include "_core_sets.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

__thread char ag_tls_err[512];
__thread ag_oom_info ag_tls_oom;

int fail(ag_engine *e, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    (void)e;
    vsnprintf(ag_tls_err, sizeof ag_tls_err, fmt, ap);
    va_end(ap);
    return code;
}

const char *ag_last_error(const ag_engine *e) { return ag_tls_err; }

void ag_last_oom(const ag_engine *e, ag_oom_info *out) { *out = ag_tls_oom; }

uint64_t ag_capacity(const ag_engine *e) { return e->capacity; }

const ag_policy_ops *ag_policy_of(int32_t policy) {
    static const ag_policy_ops *const table[] = {
        [AG_POLICY_NATIVE] = &ag_policy_native,
        [AG_POLICY_XPU] = &ag_policy_xpu,
        [AG_POLICY_BFC] = &ag_policy_bfc,
    };
    return policy >= 0 && policy < (int32_t)(sizeof table / sizeof table[0]) ? table[policy] : NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* memory fraction                                                                             */

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

int im_set_memory_fraction(ag_engine *e, double fraction) {
    int rc = apply_fraction(e, fraction);
    if (rc == AG_OK) e->s.memory_fraction = fraction;
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* create / destroy                                                                            */

static int validate(const ag_settings *s, char *err, size_t errlen) {
    const ag_policy_ops *pol = ag_policy_of(s->policy);
    if (!pol) {
        snprintf(err, errlen, "unknown policy %d", s->policy);
        return AG_ERR_INVALID;
    }
    if (!ag_upstream_of(s->upstream)) {
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
    /* checked on the settings the policy keeps (bfc drops expandable segments) */
    ag_settings kept = *s;
    if (pol->adjust_settings) pol->adjust_settings(&kept);
    if (kept.expandable_segments && !ag_upstream_of(s->upstream)->expandable) {
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
    e->pol = ag_policy_of(settings->policy);
    if (e->pol->adjust_settings) e->pol->adjust_settings(&e->s); /* see "bfc policy" */
    e->small.is_small = 1;
    e->n_streams = 1;
    e->next_pool_id = 1;
    e->rng = 0x9E3779B9u;
    e->plug_device = -1;
    e->refs = 1;
    pthread_mutex_init(&e->mu, NULL);
    rc = up_open(e, device_libs, err, errlen);
    if (rc) {
        free(e);
        return rc;
    }
    /* capacity: explicit, else the cap, else what the machine has */
    if (settings->capacity) e->capacity = settings->capacity;
    else if (settings->cap) e->capacity = settings->cap;
    else e->capacity = e->up.ops->total_memory(&e->up);
    rc = apply_fraction(e, settings->memory_fraction);
    if (rc == AG_OK && (!grow_blocks(e) || !hgrow(e))) rc = fail(e, AG_ERR_NOMEM, "out of host memory");
    if (rc) {
        snprintf(err, errlen, "%s", ag_tls_err);
        ag_engine_destroy(e);
        return rc;
    }
    *out = e;
    return AG_OK;
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
    up_close(e);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

void engine_unref(ag_engine *e) {
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
