/* accel-graph allocator core: the cold parts of the data structures (_core_sets.h). */
#include "_core_sets.h"

#include <stdlib.h>

int grow_blocks(ag_engine *e) {
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

int hgrow(ag_engine *e) {
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

/* every block of the tree, in key order, appended to out[n...]; the new count */
static size_t t_collect(ag_block *t, ag_block **out, size_t n) {
    while (t) {
        n = t_collect(t->l, out, n);
        out[n++] = t;
        t = t->r;
    }
    return n;
}

static int key_cmp(const void *a, const void *b) {
    u128 x = (*(ag_block *const *)a)->key, y = (*(ag_block *const *)b)->key;
    return x < y ? -1 : x > y;
}

size_t pool_collect(const ag_bpool *p, ag_block **out) {
    size_t n = 0;
    for (int k = 0; k < NBUCKET; k++) n = t_collect(p->root[k], out, n);
    qsort(out, n, sizeof *out, key_cmp);
    return n;
}
