/* The chunking of a piece in its shard file: whole rows, shared by the writer (which
 * picks it) and the reader (which finds it in the file and checks it). */
#include "ckpt.h"

#include <emmintrin.h>

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

/* ---------------------------------------------------- the byte shuffle */
/* HDF5's shuffle filter: n elements of es bytes <-> es planes of n bytes (byte b of
 * every element, then byte b+1, ...). bf16 (es 2) and f32 (es 4) are what checkpoints
 * hold; SSE2 does 16 elements at a time, the rest is the plain loop. */
void shard_shuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t es)
{
    size_t i = 0;
    if (es == 2) {
        const __m128i lo = _mm_set1_epi16(0x00ff);
        for (; i + 16 <= n; i += 16) {
            __m128i x = _mm_loadu_si128((const __m128i *)(src + 2 * i)), y = _mm_loadu_si128((const __m128i *)(src + 2 * i + 16));
            _mm_storeu_si128((__m128i *)(dst + i), _mm_packus_epi16(_mm_and_si128(x, lo), _mm_and_si128(y, lo)));
            _mm_storeu_si128((__m128i *)(dst + n + i), _mm_packus_epi16(_mm_srli_epi16(x, 8), _mm_srli_epi16(y, 8)));
        }
    }
    for (size_t b = 0; b < es; b++)
        for (size_t j = i; j < n; j++) dst[b * n + j] = src[j * es + b];
}

void shard_unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t es)
{
    size_t i = 0;
    if (es == 2) {
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + n + i));
            _mm_storeu_si128((__m128i *)(dst + 2 * i), _mm_unpacklo_epi8(a, b));
            _mm_storeu_si128((__m128i *)(dst + 2 * i + 16), _mm_unpackhi_epi8(a, b));
        }
    } else if (es == 4) {
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + n + i));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 2 * n + i)), d = _mm_loadu_si128((const __m128i *)(src + 3 * n + i));
            __m128i ab0 = _mm_unpacklo_epi8(a, b), ab1 = _mm_unpackhi_epi8(a, b);
            __m128i cd0 = _mm_unpacklo_epi8(c, d), cd1 = _mm_unpackhi_epi8(c, d);
            _mm_storeu_si128((__m128i *)(dst + 4 * i), _mm_unpacklo_epi16(ab0, cd0));
            _mm_storeu_si128((__m128i *)(dst + 4 * i + 16), _mm_unpackhi_epi16(ab0, cd0));
            _mm_storeu_si128((__m128i *)(dst + 4 * i + 32), _mm_unpacklo_epi16(ab1, cd1));
            _mm_storeu_si128((__m128i *)(dst + 4 * i + 48), _mm_unpackhi_epi16(ab1, cd1));
        }
    }
    for (size_t j = i; j < n; j++)
        for (size_t b = 0; b < es; b++) dst[j * es + b] = src[b * n + j];
}
