/* train/docs.c: packed documents (model.h): each token's document and RoPE position,
 * and which blocks of the context-parallel ring some query may see.
 *
 * A sequence of S tokens holds documents each ended by the separator (which belongs
 * to the document it ends); a document also starts at the sequence's first token.
 * A token's document id is the sequence position of its document's first token, so
 * ids grow along the sequence and two tokens share a document exactly when their
 * ids are equal, on whichever cp rank each of them lives. */
#include <string.h>

#include "model.h"

#define DV (m->dev)
#define OPS (m->dev->ops)

void model_set_documents(model *m, int32_t sep)
{
    m->docs = 1;
    m->sep = sep;
}

/* Positions [lo, hi] of the sequence held by cp rank i: chunks i and 2C-1-i of T/2
 * tokens (the whole sequence when C = 1). */
static int rank_holds(const model *m, int i, int64_t lo, int64_t hi)
{
    const int C = m->cp_size > 1 ? m->cp_size : 1;
    if (C == 1) return lo <= hi && lo < m->T && hi >= 0;
    const int64_t h = m->T / 2, a0 = (int64_t)i * h, b0 = (int64_t)(2 * C - 1 - i) * h;
    return (lo < a0 + h && hi >= a0) || (lo < b0 + h && hi >= b0);
}

/* ring_need[i] for every cp rank i: does some query of this rank see a key that rank
 * i holds? Query position p of document d sees keys [max(d, p - window + 1), p]. */
static void set_ring_need(model *m)
{
    const int C = m->cp_size > 1 ? m->cp_size : 1, T = m->T, r = C > 1 ? m->cp_rank : 0;
    const size_t N = (size_t)m->B * T;
    memset(m->ring_need, 0, (size_t)C);
    m->ring_need[r] = 1; /* every query sees itself */
    for (int b = 0; b < (m->docs ? m->B : 1); b++)
        for (int t = 0; t < T; t++) {
            const int64_t p = m->pos[t];
            int64_t lo = m->window > 0 ? p - m->window + 1 : 0;
            if (m->docs && m->doc[(size_t)r * N + (size_t)b * T + t] > lo) lo = m->doc[(size_t)r * N + (size_t)b * T + t];
            for (int i = 0; i < C; i++)
                if (!m->ring_need[i] && rank_holds(m, i, lo, p)) m->ring_need[i] = 1;
        }
}

/* the RoPE positions and tables of this rank's N tokens, and the ring's blocks */
static void set_rope(model *m)
{
    const size_t N = (size_t)m->B * m->T;
    OPS->upload(DV, m->rpos_d, m->rpos, N * sizeof(int32_t));
    OPS->rope_table(DV, m->cos_t, m->sin_t, m->rpos_d, (int)N, m->inv_freq_d, m->rd, m->rope_scale);
    set_ring_need(m);
}

void model_positions(model *m)
{
    const int T = m->T;
    for (int b = 0; b < m->B; b++) memcpy(m->rpos + (size_t)b * T, m->pos, (size_t)T * sizeof(int32_t));
    set_rope(m);
}

void model_documents(model *m, int rows, const int32_t *in)
{
    if (!m->docs) return;
    const int C = m->cp_size > 1 ? m->cp_size : 1, T = m->T, S = T * C;
    const size_t N = (size_t)m->B * T;
    int32_t *pos = m->seq_scratch, *doc = m->seq_scratch + S;
    for (int b = 0; b < m->B; b++) {
        /* rows past the microbatch's (a short last batch): one document each */
        const int32_t *tok = b < rows ? in + (size_t)b * S : NULL;
        for (int t = 0; t < S; t++) {
            pos[t] = t == 0 || (tok && tok[t - 1] == m->sep) ? 0 : pos[t - 1] + 1;
            doc[t] = t - pos[t];
        }
        for (int i = 0; i < C; i++)
            for (int t = 0; t < T; t++) m->doc[(size_t)i * N + (size_t)b * T + t] = doc[m->cp_pos[(size_t)i * T + t]];
        for (int t = 0; t < T; t++) m->rpos[(size_t)b * T + t] = pos[m->pos[t]];
    }
    OPS->upload(DV, m->doc_d, m->doc, (size_t)C * N * sizeof(int32_t));
    set_rope(m);
}
