/* accel-graph allocator core: statistics (torch's memory_stats counters) and the layout of
 * segments and blocks (torch's memory_snapshot).
 */
#include "_core_internal.h"

void im_get_stats(const ag_engine *e, ag_stats *out) {
    *out = e->st;
    out->upstream_bytes = (int64_t)e->up.total;
    out->upstream_peak_bytes = (int64_t)e->up.peak;
}

void im_reset_peak_stats(ag_engine *e) {
    ag_stat *arrs[] = {e->st.allocation, e->st.segment, e->st.active, e->st.inactive_split,
                       e->st.allocated_bytes, e->st.reserved_bytes, e->st.active_bytes,
                       e->st.inactive_split_bytes, e->st.requested_bytes};
    for (size_t i = 0; i < sizeof arrs / sizeof arrs[0]; i++)
        for (int j = 0; j < 3; j++) arrs[i][j].peak = arrs[i][j].current;
    e->st.oversize_allocations.peak = e->st.oversize_allocations.current;
    e->st.oversize_segments.peak = e->st.oversize_segments.current;
    e->up.peak = e->up.total;
}

void im_reset_accumulated_stats(ag_engine *e) {
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

int im_layout_counts(const ag_engine *e, int64_t *n_segments, int64_t *n_blocks) {
    *n_segments = e->n_segs;
    *n_blocks = e->n_blocks_live;
    return AG_OK;
}

int im_layout(const ag_engine *e, ag_segment_info *segs, int64_t max_segs, ag_block_info *blocks,
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
