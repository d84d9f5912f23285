/* The chunking of a piece in its shard file: whole rows, shared by the writer (which
 * picks it) and the reader (which finds it in the file and checks it). */
#include "ckpt.h"

void shard_chunking_init(shard_chunking *g, int ndim, const int64_t *len, size_t es, int64_t chunk_rows)
{
    g->ndim = ndim;
    g->es = es;
    g->planes = 1;
    for (int k = 0; k < ndim; k++) g->len[k] = len[k];
    for (int k = 0; k < ndim - 2; k++) g->planes *= len[k];
    g->rows = ndim == 1 ? len[0] : len[ndim - 2];
    g->cols = ndim == 1 ? 1 : len[ndim - 1];
    g->chunk_rows = chunk_rows;
    g->per_plane = (uint64_t)((g->rows + chunk_rows - 1) / chunk_rows);
    g->nchunks = (uint64_t)g->planes * g->per_plane;
    g->full = (size_t)(chunk_rows * g->cols) * es;
}

int64_t shard_chunking_rows_for(int ndim, const int64_t *len, size_t es)
{
    shard_chunking g;
    shard_chunking_init(&g, ndim, len, es, 1);
    int64_t r = (int64_t)(SHARD_CHUNK_TARGET / ((uint64_t)g.cols * es));
    if (r < 1) r = 1;
    /* pieces over ~4 GiB: bigger chunks rather than more of them */
    if (g.planes <= SHARD_CHUNKS_MAX) {
        int64_t blocks = SHARD_CHUNKS_MAX / g.planes, least = (g.rows + blocks - 1) / blocks;
        if (r < least) r = least;
    }
    return r < g.rows ? r : g.rows;
}

void shard_chunking_dims(const shard_chunking *g, hsize_t *dims)
{
    for (int k = 0; k < g->ndim; k++) dims[k] = 1;
    if (g->ndim == 1) { dims[0] = (hsize_t)g->chunk_rows; return; }
    dims[g->ndim - 2] = (hsize_t)g->chunk_rows;
    dims[g->ndim - 1] = (hsize_t)g->cols;
}

void shard_chunking_at(const shard_chunking *g, uint64_t k, uint64_t *plane, int64_t *r0, int64_t *nr, hsize_t *hoff)
{
    const int nd = g->ndim;
    uint64_t pl = k / g->per_plane;
    *plane = pl;
    *r0 = (int64_t)(k % g->per_plane) * g->chunk_rows;
    *nr = g->rows - *r0 < g->chunk_rows ? g->rows - *r0 : g->chunk_rows;
    for (int d = 0; d < nd; d++) hoff[d] = 0;
    if (nd == 1) { hoff[0] = (hsize_t)*r0; return; }
    for (int d = nd - 3; d >= 0; d--) { hoff[d] = (hsize_t)(pl % (uint64_t)g->len[d]); pl /= (uint64_t)g->len[d]; }
    hoff[nd - 2] = (hsize_t)*r0;
}
