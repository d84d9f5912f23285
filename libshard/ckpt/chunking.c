/* The chunking of a piece in its shard file: whole rows, shared by the writer (which
 * picks it) and the reader (which finds it in the file and checks it). */
#include "ckpt.h"

#include <emmintrin.h>
#include <stdlib.h>

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
    if (r >= g.rows) return g.rows;
    /* the rows spread evenly over those chunks: HDF5 stores a last, partial chunk
     * whole (uncompressed: its padding on disk, read back with it), so a piece of
     * 2048 rows in chunks of 1365 took 2730 rows' bytes; in 2 of 1024 it takes 2048 */
    const int64_t n = (g.rows + r - 1) / r;
    return (g.rows + n - 1) / n;
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

/* ----------------------------------------------- cuts for readers together */
static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* v[(*n)++] = r, growing v; 0 when out of memory */
static int push(int64_t **v, size_t *n, size_t *cap, int64_t r)
{
    if (*n == *cap) {
        int64_t *w = realloc(*v, (*cap *= 2) * sizeof *w);
        if (!w) return 0;
        *v = w;
    }
    (*v)[(*n)++] = r;
    return 1;
}

/* The chunk starts of the pieces along dim 0, inside (lo, hi), sorted, unique; a
 * piece of 3 or more dims starts a chunk at every index of dim 0 (a plane each).
 * NULL when out of memory; *n their count. */
static int64_t *chunk_starts(const tensor *t, int64_t lo, int64_t hi, size_t *n)
{
    const size_t es = shard_dtype_size(t->t.dtype);
    size_t cap = 64, k = 0;
    int64_t *v = malloc(cap * sizeof *v);
    int ok = v != NULL;
    for (size_t j = 0; ok && j < t->t.npieces; j++) {
        const shard_box *b = &t->p[j].box;
        int64_t step = b->ndim >= 3 ? 1 : shard_chunking_rows_for(b->ndim, b->len, es), e = b->off[0] + b->len[0];
        if (step < 1) step = 1;
        int64_t r = b->off[0];
        if (lo > r) r += (lo - r) / step * step; /* the last start at or before lo: O(the band), not O(the piece) */
        for (; ok && r <= e && r < hi; r = r < e && r + step > e ? e : r + step)
            if (r > lo) ok = push(&v, &k, &cap, r);
    }
    if (!ok) { free(v); return NULL; }
    qsort(v, k, sizeof *v, cmp_i64);
    size_t u = 0;
    for (size_t j = 0; j < k; j++)
        if (!u || v[u - 1] != v[j]) v[u++] = v[j];
    *n = u;
    return v;
}

shard_status shard_ckpt_row_cuts(const shard_ckpt *c, size_t i, int64_t lo, int64_t hi, int parts, int64_t *cuts)
{
    if (i >= c->n || parts < 1 || hi < lo) return shard_fail(SHARD_E_USAGE, "row cuts: bad arguments");
    size_t n = 0;
    int64_t *v = chunk_starts(&c->t[i], lo, hi, &n);
    if (!v) return shard_fail(SHARD_E_NOMEM, "out of memory");
    cuts[0] = lo;
    cuts[parts] = hi;
    size_t at = 0; /* v[at]: the first start past the ideal cut */
    for (int q = 1; q < parts; q++) {
        const double ideal = (double)lo + (double)(hi - lo) * q / parts;
        int64_t best = cuts[q - 1]; /* the nearest of: the last cut, the starts either side */
        while (at < n && (double)v[at] <= ideal) at++;
        if (at > 0 && v[at - 1] > best) best = v[at - 1];
        if (at < n && (double)v[at] - ideal < ideal - (double)best) best = v[at];
        cuts[q] = best;
    }
    free(v);
    return SHARD_OK;
}

/* ---------------------------------------------------- the byte shuffle */
/* 16 f32 elements (64 bytes) into their 4 byte planes, `n` bytes apart: three rounds of
 * byte interleaves sort the bytes by plane, 8 elements to a half; 64-bit unpacks join
 * the halves (SSE2: every x86-64 has it) */
static void shuffle16_f32(uint8_t *dst, const uint8_t *src, size_t n)
{
    const __m128i x0 = _mm_loadu_si128((const __m128i *)src), x1 = _mm_loadu_si128((const __m128i *)(src + 16));
    const __m128i x2 = _mm_loadu_si128((const __m128i *)(src + 32)), x3 = _mm_loadu_si128((const __m128i *)(src + 48));
    const __m128i t0 = _mm_unpacklo_epi8(x0, x1), t1 = _mm_unpackhi_epi8(x0, x1); /* elements 0-7 */
    const __m128i t2 = _mm_unpacklo_epi8(x2, x3), t3 = _mm_unpackhi_epi8(x2, x3); /* 8-15 */
    const __m128i u0 = _mm_unpacklo_epi8(t0, t1), u1 = _mm_unpackhi_epi8(t0, t1);
    const __m128i u2 = _mm_unpacklo_epi8(t2, t3), u3 = _mm_unpackhi_epi8(t2, t3);
    const __m128i v0 = _mm_unpacklo_epi8(u0, u1), v1 = _mm_unpackhi_epi8(u0, u1); /* bytes 0, 1 | 2, 3 of 0-7 */
    const __m128i v2 = _mm_unpacklo_epi8(u2, u3), v3 = _mm_unpackhi_epi8(u2, u3); /* of 8-15 */
    _mm_storeu_si128((__m128i *)dst, _mm_unpacklo_epi64(v0, v2));
    _mm_storeu_si128((__m128i *)(dst + n), _mm_unpackhi_epi64(v0, v2));
    _mm_storeu_si128((__m128i *)(dst + 2 * n), _mm_unpacklo_epi64(v1, v3));
    _mm_storeu_si128((__m128i *)(dst + 3 * n), _mm_unpackhi_epi64(v1, v3));
}

/* HDF5's shuffle filter: n elements of es bytes <-> es planes of n bytes (byte b of
 * every element, then byte b+1, ...). bf16 (es 2) and f32 (es 4) are what checkpoints
 * hold; SSE2 does 16 elements at a time, the rest is the plain loop (a byte at a time:
 * a training checkpoint's f32 state took it at ~15% of a reshard's samples). */
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
    } else if (es == 4) {
        for (; i + 16 <= n; i += 16) shuffle16_f32(dst + i, src + 4 * i, n);
    }
    for (size_t b = 0; b < es; b++)
        for (size_t j = i; j < n; j++) dst[b * n + j] = src[j * es + b];
}

/* n elements out of es planes that start `plane` bytes apart */
static void unshuffle_planes(uint8_t *dst, const uint8_t *src, size_t n, size_t es, size_t plane)
{
    size_t i = 0;
    if (es == 2) {
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + plane + i));
            _mm_storeu_si128((__m128i *)(dst + 2 * i), _mm_unpacklo_epi8(a, b));
            _mm_storeu_si128((__m128i *)(dst + 2 * i + 16), _mm_unpackhi_epi8(a, b));
        }
    } else if (es == 4) {
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + plane + i));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 2 * plane + i));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 3 * plane + i));
            __m128i ab0 = _mm_unpacklo_epi8(a, b), ab1 = _mm_unpackhi_epi8(a, b);
            __m128i cd0 = _mm_unpacklo_epi8(c, d), cd1 = _mm_unpackhi_epi8(c, d);
            _mm_storeu_si128((__m128i *)(dst + 4 * i), _mm_unpacklo_epi16(ab0, cd0));
            _mm_storeu_si128((__m128i *)(dst + 4 * i + 16), _mm_unpackhi_epi16(ab0, cd0));
            _mm_storeu_si128((__m128i *)(dst + 4 * i + 32), _mm_unpacklo_epi16(ab1, cd1));
            _mm_storeu_si128((__m128i *)(dst + 4 * i + 48), _mm_unpackhi_epi16(ab1, cd1));
        }
    }
    for (size_t j = i; j < n; j++)
        for (size_t b = 0; b < es; b++) dst[j * es + b] = src[b * plane + j];
}

void shard_unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t es) { unshuffle_planes(dst, src, n, es, n); }

void shard_unshuffle_part(uint8_t *dst, const uint8_t *src, size_t n, size_t es, size_t from, size_t to)
{
    unshuffle_planes(dst, src + from, to - from, es, n);
}
