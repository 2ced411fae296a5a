/* accel-graph allocator core: the event ring (docs/allocator.md "Events"), the trace torch's
 * _record_memory_history keeps: one ag_event per alloc, free, segment change and OOM, in a
 * buffer that grows, or drops its oldest entries once max_entries is reached. */
#include "_core_internal.h"

#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

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

void ev_push(ag_engine *e, int action, uint64_t addr, uint64_t size, int32_t stream, const ag_bpool *p) {
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

int im_events_enable(ag_engine *e, int32_t on, int64_t max_entries) {
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

int64_t im_events_count(const ag_engine *e) { return e->ev_count; }

int64_t im_events_drain(ag_engine *e, ag_event *out, int64_t max) {
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
