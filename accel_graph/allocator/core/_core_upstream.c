/* accel-graph allocator core: the upstreams, raw allocators that segments come from.
 *
 *   host      real memory: posix_memalign; expandable segments reserve address space with
 *             mmap(PROT_NONE) and map pages with mprotect (given back with madvise)
 *   counting  no memory at all: fake, 512-aligned addresses from 16 TiB up (simulation)
 *   device    cudaMalloc/hipMalloc from the runtime library, resolved with dlopen at run time
 *
 * Each is an ag_upstream_ops table (_core_internal.h). The up_* functions below are what the
 * rest of the core calls: they add the settings' cap and the byte accounting (total, peak)
 * around the table's raw operation.
 */
#define _GNU_SOURCE
#include "_core_internal.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------ */
/* with accounting: what the core calls                                                        */

int up_open(ag_engine *e, const char *libs, char *err, size_t errlen) {
    ag_upstream *u = &e->up;
    u->ops = ag_upstream_of(e->s.upstream);
    u->kind = e->s.upstream;
    u->next_addr = COUNTING_BASE;
    return u->ops->open ? u->ops->open(u, &e->s, libs, err, errlen) : AG_OK;
}

void up_close(ag_engine *e) {
    if (e->up.ops && e->up.ops->close) e->up.ops->close(&e->up);
}

/* 0 on success, AG_ERR_OOM when refused for memory, AG_ERR_UPSTREAM otherwise. */
int up_alloc(ag_engine *e, uint64_t size, uint64_t *out) {
    ag_upstream *u = &e->up;
    if (e->s.cap && u->total + size > e->s.cap) return AG_ERR_OOM;
    int rc = u->ops->alloc(u, size, out);
    if (rc) return rc;
    u->total += size;
    if (u->total > u->peak) u->peak = u->total;
    return AG_OK;
}

void up_free(ag_engine *e, uint64_t ptr, uint64_t size) {
    e->up.ops->free(&e->up, ptr, size);
    e->up.total -= size;
}

/* Expandable segments: reserve address space only (nothing counted). */
int up_reserve(ag_engine *e, uint64_t size, uint64_t *out) { return e->up.ops->reserve(&e->up, size, out); }

void up_unreserve(ag_engine *e, uint64_t base, uint64_t size) { e->up.ops->unreserve(&e->up, base, size); }

int up_map(ag_engine *e, uint64_t addr, uint64_t size) {
    ag_upstream *u = &e->up;
    if (e->s.cap && u->total + size > e->s.cap) return AG_ERR_OOM;
    int rc = u->ops->map(u, addr, size);
    if (rc) return rc;
    u->total += size;
    if (u->total > u->peak) u->peak = u->total;
    return AG_OK;
}

void up_unmap(ag_engine *e, uint64_t addr, uint64_t size) {
    e->up.ops->unmap(&e->up, addr, size);
    e->up.total -= size;
}

uint64_t up_device_free(const ag_engine *e) {
    uint64_t fr = UINT64_MAX;
    if (e->capacity != UINT64_MAX) fr = e->capacity > e->up.total ? e->capacity - e->up.total : 0;
    uint64_t dfr = e->up.ops->free_memory(&e->up);
    return dfr < fr ? dfr : fr;
}

const ag_upstream_ops *ag_upstream_of(int32_t kind) {
    static const ag_upstream_ops *const table[] = {
        [AG_UPSTREAM_HOST] = &ag_upstream_host,
        [AG_UPSTREAM_COUNTING] = &ag_upstream_counting,
        [AG_UPSTREAM_DEVICE] = &ag_upstream_device,
    };
    return kind >= 0 && kind < (int32_t)(sizeof table / sizeof table[0]) ? table[kind] : NULL;
}

/* shared by the kinds that have no such operation or nothing to do in it */
static int none_reserve(ag_upstream *u, uint64_t size, uint64_t *out) { return AG_ERR_UNSUPPORTED; }
static void none_release(ag_upstream *u, uint64_t addr, uint64_t size) {}
static int none_map(ag_upstream *u, uint64_t addr, uint64_t size) { return AG_OK; }
static uint64_t unknown_memory(const ag_upstream *u) { return UINT64_MAX; }

/* ------------------------------------------------------------------------------------------ */
/* host                                                                                        */

static int host_alloc(ag_upstream *u, uint64_t size, uint64_t *out) {
    void *p = NULL;
    if (posix_memalign(&p, KMIN_BLOCK, (size_t)size) != 0 || !p) return AG_ERR_OOM;
    *out = (uint64_t)(uintptr_t)p;
    return AG_OK;
}

static void host_free(ag_upstream *u, uint64_t ptr, uint64_t size) { free((void *)(uintptr_t)ptr); }

static int host_reserve(ag_upstream *u, uint64_t size, uint64_t *out) {
    void *p = mmap(NULL, (size_t)size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return AG_ERR_OOM;
    *out = (uint64_t)(uintptr_t)p;
    return AG_OK;
}

static void host_unreserve(ag_upstream *u, uint64_t base, uint64_t size) {
    munmap((void *)(uintptr_t)base, (size_t)size);
}

static int host_map(ag_upstream *u, uint64_t addr, uint64_t size) {
    return mprotect((void *)(uintptr_t)addr, (size_t)size, PROT_READ | PROT_WRITE) != 0 ? AG_ERR_OOM : AG_OK;
}

static void host_unmap(ag_upstream *u, uint64_t addr, uint64_t size) {
    /* give the pages back, then make the range inaccessible again */
    madvise((void *)(uintptr_t)addr, (size_t)size, MADV_DONTNEED);
    mprotect((void *)(uintptr_t)addr, (size_t)size, PROT_NONE);
}

/* the machine's RAM */
static uint64_t host_total_memory(const ag_upstream *u) {
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    return (pages > 0 && psz > 0) ? (uint64_t)pages * (uint64_t)psz : UINT64_MAX;
}

const ag_upstream_ops ag_upstream_host = {
    .name = "host",
    .expandable = 1,
    .alloc = host_alloc,
    .free = host_free,
    .reserve = host_reserve,
    .unreserve = host_unreserve,
    .map = host_map,
    .unmap = host_unmap,
    .total_memory = host_total_memory,
    .free_memory = unknown_memory,
};

/* ------------------------------------------------------------------------------------------ */
/* counting                                                                                    */

static int counting_alloc(ag_upstream *u, uint64_t size, uint64_t *out) {
    *out = u->next_addr;
    u->next_addr += (size + KMIN_BLOCK - 1) & ~(KMIN_BLOCK - 1);
    return AG_OK;
}

static int counting_reserve(ag_upstream *u, uint64_t size, uint64_t *out) {
    *out = u->next_addr;
    u->next_addr += size;
    return AG_OK;
}

const ag_upstream_ops ag_upstream_counting = {
    .name = "counting",
    .expandable = 1,
    .alloc = counting_alloc,
    .free = none_release,
    .reserve = counting_reserve,
    .unreserve = none_release,
    .map = none_map,
    .unmap = none_release,
    .total_memory = unknown_memory,
    .free_memory = unknown_memory,
};

/* ------------------------------------------------------------------------------------------ */
/* device: the CUDA or HIP runtime                                                             */

/* The upstream error code that means "out of memory" for cudaMalloc and hipMalloc alike. */
#define DEVICE_ERR_OOM 2

static int device_open(ag_upstream *u, const ag_settings *s, const char *libs, char *err, size_t errlen) {
    static const char *cuda_default = "libcudart.so;libcudart.so.13;libcudart.so.12;libcudart.so.11.0";
    static const char *hip_default = "libamdhip64.so;libamdhip64.so.7;libamdhip64.so.6";
    int hip = s->device_kind == 1;
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
                u->dl = h;
                u->dmalloc = (int (*)(void **, size_t))dlsym(h, hip ? "hipMalloc" : "cudaMalloc");
                u->dfree = (int (*)(void *))dlsym(h, hip ? "hipFree" : "cudaFree");
                u->dmeminfo = (int (*)(size_t *, size_t *))dlsym(h, hip ? "hipMemGetInfo" : "cudaMemGetInfo");
                u->dget_device = (int (*)(int *))dlsym(h, hip ? "hipGetDevice" : "cudaGetDevice");
                u->dset_device = (int (*)(int))dlsym(h, hip ? "hipSetDevice" : "cudaSetDevice");
                u->dxchg_mode = (int (*)(int *))dlsym(
                    h, hip ? "hipThreadExchangeStreamCaptureMode" : "cudaThreadExchangeStreamCaptureMode");
                u->dis_capturing =
                    (int (*)(void *, int *))dlsym(h, hip ? "hipStreamIsCapturing" : "cudaStreamIsCapturing");
                u->dget_last_error = (int (*)(void))dlsym(h, hip ? "hipGetLastError" : "cudaGetLastError");
                if (u->dmalloc && u->dfree) return AG_OK;
                snprintf(err, errlen, "%s loaded but lacks %s/%s", path,
                         hip ? "hipMalloc" : "cudaMalloc", hip ? "hipFree" : "cudaFree");
                dlclose(h);
                u->dl = NULL;
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

static void device_close(ag_upstream *u) {
    if (u->dl) dlclose(u->dl);
}

static int device_alloc(ag_upstream *u, uint64_t size, uint64_t *out) {
    void *p = NULL;
    /* as torch's cudaMallocMaybeCapturing: cudaMalloc in relaxed capture mode, so it is legal
     * while this thread (or, in global mode, any thread) captures; the old mode comes back */
    int mode = 2; /* cudaStreamCaptureModeRelaxed == hipStreamCaptureModeRelaxed */
    int swapped = u->dxchg_mode && u->dxchg_mode(&mode) == 0;
    int rc = u->dmalloc(&p, (size_t)size);
    if (swapped) u->dxchg_mode(&mode);
    if (rc != 0 || !p) {
        if (u->dget_last_error) u->dget_last_error(); /* torch clears it too: not sticky */
        u->last_err = rc;
        return rc == DEVICE_ERR_OOM ? AG_ERR_OOM : AG_ERR_UPSTREAM;
    }
    *out = (uint64_t)(uintptr_t)p;
    return AG_OK;
}

static void device_free(ag_upstream *u, uint64_t ptr, uint64_t size) { u->dfree((void *)(uintptr_t)ptr); }

/* the device's memory, as the driver reports it */
static uint64_t device_total_memory(const ag_upstream *u) {
    size_t fr = 0, tot = 0;
    return (u->dmeminfo && u->dmeminfo(&fr, &tot) == 0 && tot) ? (uint64_t)tot : UINT64_MAX;
}

static uint64_t device_free_memory(const ag_upstream *u) {
    size_t fr = 0, tot = 0;
    return (u->dmeminfo && u->dmeminfo(&fr, &tot) == 0) ? (uint64_t)fr : UINT64_MAX;
}

/* No expandable segments (they would need the driver's virtual-memory API): validation refuses
 * them for this upstream, so reserve is never reached. */
const ag_upstream_ops ag_upstream_device = {
    .name = "device",
    .expandable = 0,
    .open = device_open,
    .close = device_close,
    .alloc = device_alloc,
    .free = device_free,
    .reserve = none_reserve,
    .unreserve = none_release,
    .map = none_map,
    .unmap = none_release,
    .total_memory = device_total_memory,
    .free_memory = device_free_memory,
};
