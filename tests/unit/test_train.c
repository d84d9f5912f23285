/* train/: the data order (files, sequences, shuffling by epoch, refusals), the
 * learning-rate schedule, the deterministic gradient norm and clipping, through
 * train/'s library (libsmptrain.a); the C backend's choice of OpenBLAS kernels; a
 * load's prefault of its destination; the lane count auto picks. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <omp.h>

#include "c/blas_pick.h"
#include "data.h"
#include "dev.h"
#include "lanes.h"
#include "optim.h"
#include "prefault.h"
#include "state.h"

static char tmpdir[256];

static int setup(void **st)
{
    (void)st;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/smp-test-train-XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **st)
{
    (void)st;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

/* a token file holding tokens base, base+1, ... (mod vocab); u32: the 20240801 format */
static const char *write_file(const char *name, int n, int base, int vocab, int u32, int magic_override, int count_delta)
{
    static char path[8][300];
    static int k;
    char *p = path[k++ % 8];
    snprintf(p, 300, "%s/%s", tmpdir, name);
    FILE *f = fopen(p, "wb");
    int32_t h[256] = {0};
    h[0] = magic_override ? magic_override : u32 ? DATA_MAGIC_U32 : DATA_MAGIC_U16;
    h[1] = u32 ? 7 : 1;
    h[2] = n + count_delta;
    fwrite(h, 4, 256, f);
    for (int i = 0; i < n; i++) {
        uint32_t t = (uint32_t)((base + i) % vocab);
        if (u32) fwrite(&t, 4, 1, f);
        else {
            uint16_t s = (uint16_t)t;
            fwrite(&s, 2, 1, f);
        }
    }
    fclose(f);
    return p;
}

static void test_sequences_and_files(void **st)
{
    (void)st;
    const int S = 4;
    /* 13 tokens -> 3 sequences; 10 -> 2 (u32); 3 -> 0 */
    char spec[1000];
    snprintf(spec, sizeof spec, "%s,%s,%s", write_file("a.bin", 13, 0, 1000, 0, 0, 0),
             write_file("b.bin", 10, 100, 1000, 1, 0, 0), write_file("c.bin", 3, 500, 1000, 0, 0, 0));
    data_set ds;
    assert_int_equal(data_open(&ds, spec, S, 1000), SHARD_OK);
    assert_int_equal(ds.nfiles, 3);
    assert_int_equal(ds.nseq, 5);
    int32_t in[5 * 4], tg[5 * 4];
    assert_int_equal(data_fill_sequential(&ds, 0, 5, in, tg), SHARD_OK);
    /* sequence j of a file: tokens [j*S, j*S+S]; the third file is too short */
    int first[5] = {0, 4, 8, 100, 104};
    for (int r = 0; r < 5; r++)
        for (int t = 0; t < S; t++) {
            assert_int_equal(in[r * S + t], first[r] + t);
            assert_int_equal(tg[r * S + t], first[r] + t + 1);
        }
    /* unshuffled, the global order repeats the files' order every epoch */
    data_set_order(&ds, 0, 0);
    int32_t in2[4], tg2[4];
    assert_int_equal(data_fill(&ds, 5 * 7 + 3, 1, in2, tg2), SHARD_OK);
    assert_int_equal(in2[0], 100);
    data_close(&ds);
    /* a glob is sorted and means the same files */
    snprintf(spec, sizeof spec, "%s/[ab].bin", tmpdir);
    assert_int_equal(data_open(&ds, spec, S, 1000), SHARD_OK);
    assert_int_equal(ds.nseq, 5);
    assert_string_equal(ds.files[1].path + strlen(ds.files[1].path) - 5, "b.bin");
    data_close(&ds);
}

/* a position of sequences of 4 tokens re-expressed at 2 and 6 (resumed at another --seq) */
static void test_position_at_another_length(void **st)
{
    (void)st;
    char spec[1000];
    snprintf(spec, sizeof spec, "%s,%s,%s", write_file("a.bin", 13, 0, 1000, 0, 0, 0),
             write_file("b.bin", 10, 100, 1000, 1, 0, 0), write_file("c.bin", 3, 500, 1000, 0, 0, 0));
    data_set ds;
    uint64_t p;
    /* at 4: a 3 sequences, b 2, c 0; at 2: a 6, b 4, c 1 (11) */
    assert_int_equal(data_open(&ds, spec, 2, 1000), SHARD_OK);
    assert_int_equal(data_position_at(&ds, 5 * 2 + 1, 4, 1, &p), SHARD_OK); /* epoch 2, a's token 4 */
    assert_int_equal(p, 11 * 2 + 2);
    assert_int_equal(data_position_at(&ds, 3, 4, 1, &p), SHARD_OK); /* b's token 0 */
    assert_int_equal(p, 6);
    assert_int_equal(data_position_at(&ds, 3, 4, 0, &p), SHARD_OK); /* shuffled: 3/5 of an epoch, rounded up */
    assert_int_equal(p, 7);
    assert_int_equal(data_position_at(&ds, 3, 2, 1, &p), SHARD_OK); /* the same length: unchanged */
    assert_int_equal(p, 3);
    assert_int_equal(data_position_at(&ds, 3, 20, 1, &p), SHARD_OK); /* no sequence at 20: unchanged */
    assert_int_equal(p, 3);
    assert_int_equal(data_position_at(&ds, (uint64_t)DATA_COUNTER_MAX - 1, 4, 1, &p), SHARD_E_INVALID);
    data_close(&ds);
    /* at 6: a 2, b 1 (3): past a file's last whole sequence, the next file's first */
    assert_int_equal(data_open(&ds, spec, 6, 1000), SHARD_OK);
    assert_int_equal(data_position_at(&ds, 2, 4, 1, &p), SHARD_OK); /* a's token 8: b */
    assert_int_equal(p, 2);
    assert_int_equal(data_position_at(&ds, 5 + 4, 4, 1, &p), SHARD_OK); /* b's token 4: the next epoch */
    assert_int_equal(p, 3 + 3);
    data_close(&ds);
}

static void test_shuffle(void **st)
{
    (void)st;
    const int S = 2, n = 50;
    data_set ds;
    assert_int_equal(data_open(&ds, write_file("s.bin", n * S + 1, 0, 1 << 16, 0, 0, 0), S, 1 << 16), SHARD_OK);
    assert_int_equal(ds.nseq, (uint64_t)n);
    data_set_order(&ds, 1, 1234);
    int seen_epoch[3][50];
    int32_t in[2], tg[2];
    for (int e = 0; e < 3; e++) {
        memset(seen_epoch[e], 0, sizeof seen_epoch[e]);
        for (int p = 0; p < n; p++) {
            assert_int_equal(data_fill(&ds, (uint64_t)(e * n + p), 1, in, tg), SHARD_OK);
            int seq = in[0] / S;
            assert_true(seq >= 0 && seq < n);
            seen_epoch[e][p] = seq;
        }
        int count[50] = {0};
        for (int p = 0; p < n; p++) count[seen_epoch[e][p]]++;
        for (int j = 0; j < n; j++) assert_int_equal(count[j], 1); /* a permutation */
    }
    assert_true(memcmp(seen_epoch[0], seen_epoch[1], sizeof seen_epoch[0]) != 0); /* reshuffled each epoch */
    /* positions alone determine the order: jump back to epoch 0 */
    assert_int_equal(data_fill(&ds, 7, 1, in, tg), SHARD_OK);
    assert_int_equal(in[0] / S, seen_epoch[0][7]);
    /* another seed, another order; the same seed, the same */
    data_set_order(&ds, 1, 1235);
    int differ = 0;
    for (int p = 0; p < n; p++) {
        data_fill(&ds, (uint64_t)p, 1, in, tg);
        differ += in[0] / S != seen_epoch[0][p];
    }
    assert_true(differ > 0);
    data_set_order(&ds, 1, 1234);
    for (int p = 0; p < n; p++) {
        data_fill(&ds, (uint64_t)p, 1, in, tg);
        assert_int_equal(in[0] / S, seen_epoch[0][p]);
    }
    data_close(&ds);
}

/* data.c's shuffle draws a block of swaps ahead and prefetches them: the same order as
 * Fisher-Yates one swap at a time (below: Lemire's bounded draw on the same generator),
 * for sizes round the block's and a large one */
static uint64_t ref_below(rng_state *r, uint64_t n)
{
    unsigned __int128 m = (unsigned __int128)rng_next(r) * n;
    if ((uint64_t)m < n) {
        const uint64_t thresh = -n % n;
        while ((uint64_t)m < thresh) m = (unsigned __int128)rng_next(r) * n;
    }
    return (uint64_t)(m >> 64);
}

static void test_shuffle_is_fisher_yates(void **st)
{
    (void)st;
    const int S = 2, sizes[] = {1, 2, 3, 31, 32, 33, 64, 65, 97, 1000, 100003};
    for (size_t c = 0; c < sizeof sizes / sizeof *sizes; c++) {
        const int n = sizes[c];
        data_set ds;
        assert_int_equal(data_open(&ds, write_file("fy.bin", n * S + 1, 0, 1 << 30, 1, 0, 0), S, 1 << 30), SHARD_OK);
        data_set_order(&ds, 1, 99);
        uint32_t *want = malloc((size_t)n * sizeof *want);
        for (uint64_t e = 0; e < 2; e++) {
            rng_state rs;
            rng_seed(&rs, 99, e);
            for (int i = 0; i < n; i++) want[i] = (uint32_t)i;
            for (int i = n - 1; i > 0; i--) {
                const uint64_t j = ref_below(&rs, (uint64_t)i + 1);
                const uint32_t t = want[i];
                want[i] = want[j];
                want[j] = t;
            }
            int32_t in[2], tg[2];
            for (int p = 0; p < n; p++) {
                assert_int_equal(data_fill(&ds, e * (uint64_t)n + (uint64_t)p, 1, in, tg), SHARD_OK);
                if ((uint32_t)in[0] != want[p] * S) fail_msg("n %d epoch %d position %d: sequence %d, not %u", n, (int)e, p, in[0] / S, want[p]);
            }
        }
        free(want);
        data_close(&ds);
    }
}

/* a record of a file as it is (data_seen) spares its reading: its hash is the record's,
 * no byte counted as checked; a record of a larger vocabulary than the model's, or of
 * another stamp, does not */
static void test_seen_files_are_not_read(void **st)
{
    (void)st;
    const char *path = write_file("seen.bin", 5000, 0, 900, 0, 0, 0);
    data_set ds;
    assert_int_equal(data_open(&ds, path, 4, 1000), SHARD_OK);
    const data_stamp was = ds.files[0].stamp;
    assert_true(was.ino != 0 && was.size == 1024 + 5000 * 2 && was.hash == ds.files[0].hash && !ds.files[0].seen);
    data_close(&ds);
    data_seen rec = {.tok = was, .vocab = 1000};
    rec.tok.hash = 0x1234; /* what the record says is taken, unread */
    uint64_t before = data_checked_bytes(NULL);
    assert_int_equal(data_open_on(&ds, path, 4, 1000, &(data_open_opts){.seen = &rec, .nseen = 1}), SHARD_OK);
    assert_true(ds.files[0].seen && ds.files[0].hash == 0x1234 && data_checked_bytes(NULL) == before);
    assert_int_equal(data_seen_bytes(&ds), 5000 * 2);
    data_close(&ds);
    rec.vocab = 1001; /* checked against more ids than the model has: read */
    assert_int_equal(data_open_on(&ds, path, 4, 1000, &(data_open_opts){.seen = &rec, .nseen = 1}), SHARD_OK);
    assert_true(!ds.files[0].seen && ds.files[0].hash == was.hash && data_checked_bytes(NULL) == before + 5000 * 2);
    data_close(&ds);
    rec.vocab = 1000;
    /* among records of other files (other inodes, one of them the same inode with
     * another size), in any order: the matching one found */
    data_seen many[7];
    for (int k = 0; k < 7; k++) {
        many[k] = rec;
        many[k].tok.ino = was.ino + (uint64_t)(k * 5 % 7) - 3; /* inodes ino-3 .. ino+3, shuffled */
        many[k].tok.hash = 100 + (uint64_t)k;
    }
    many[0].tok.ino = was.ino; /* k = 0 gave ino - 3: now a second record of this inode, */
    many[0].tok.size++;        /* but of another size */
    int match = -1;
    for (int k = 1; k < 7; k++) if (many[k].tok.ino == was.ino) match = k;
    assert_int_equal(data_open_on(&ds, path, 4, 1000, &(data_open_opts){.seen = many, .nseen = 7}), SHARD_OK);
    assert_true(match > 0 && ds.files[0].seen && ds.files[0].hash == 100 + (uint64_t)match);
    data_close(&ds);
    rec.tok.mtime_ns++; /* another stamp: read */
    assert_int_equal(data_open_on(&ds, path, 4, 1000, &(data_open_opts){.seen = &rec, .nseen = 1}), SHARD_OK);
    assert_true(!ds.files[0].seen && ds.files[0].hash == was.hash);
    data_close(&ds);
}

static void test_refusals(void **st)
{
    (void)st;
    data_set ds;
    /* tokens 240, 241, ...: the first one outside a vocabulary of 250 is at position 10 */
    assert_int_equal(data_open(&ds, write_file("v.bin", 20, 240, 300, 0, 0, 0), 4, 250), SHARD_E_INVALID);
    assert_non_null(strstr(shard_errmsg(), "v.bin: token 250 at position 10 is outside the model's vocabulary (vocab_size 250)"));
    assert_int_equal(data_open(&ds, write_file("v32.bin", 20, 240, 300, 1, 0, 0), 4, 250), SHARD_E_INVALID);
    assert_non_null(strstr(shard_errmsg(), "v32.bin: token 250 at position 10"));
    assert_int_equal(data_open(&ds, write_file("m.bin", 20, 0, 100, 0, 12345, 0), 4, 100), SHARD_E_INVALID);
    assert_non_null(strstr(shard_errmsg(), "not an llm.c token file"));
    assert_int_equal(data_open(&ds, write_file("n.bin", 20, 0, 100, 0, 0, 1), 4, 100), SHARD_E_INVALID);
    assert_non_null(strstr(shard_errmsg(), "header says 21 tokens"));
    assert_int_equal(data_open(&ds, write_file("t.bin", 4, 0, 100, 0, 0, 0), 4, 100), SHARD_E_INVALID);
    assert_non_null(strstr(shard_errmsg(), "fewer than 5 tokens"));
    char spec[300];
    snprintf(spec, sizeof spec, "%s/nothing-*.bin", tmpdir);
    assert_int_equal(data_open(&ds, spec, 4, 100), SHARD_E_USAGE);
    snprintf(spec, sizeof spec, "%s/absent.bin", tmpdir);
    assert_int_equal(data_open(&ds, spec, 4, 100), SHARD_E_INVALID); /* missing: exit 3 */
}

/* value v into element i (es bytes) of the file's data after its 1024-byte header */
static void poke(const char *path, uint64_t i, uint32_t v, int es)
{
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, (long)(1024 + i * (uint64_t)es), SEEK_SET), 0);
    assert_int_equal(fwrite(&v, (size_t)es, 1, f), 1); /* little-endian: the low bytes */
    fclose(f);
}

/* a loss mask file of n bytes, every one 1 */
static const char *write_mask(const char *name, int n)
{
    static char p[300];
    snprintf(p, sizeof p, "%s/%s", tmpdir, name);
    FILE *f = fopen(p, "wb");
    int32_t h[256] = {DATA_MAGIC_MASK, 1, n};
    fwrite(h, 4, 256, f);
    for (int i = 0; i < n; i++) fputc(1, f);
    fclose(f);
    return p;
}

/* data_open under mask (NULL: none) with t OpenMP threads: its status, message and
 * fingerprint */
static shard_status open_with(const char *spec, const char *mask, int t, char *msg, uint64_t *fp)
{
    omp_set_num_threads(t);
    data_set ds;
    shard_status s = data_open(&ds, spec, 4, 1000);
    const int opened = !s;
    if (!s && mask) s = data_open_masks(&ds, mask);
    snprintf(msg, 300, "%s", s ? shard_errmsg() : "");
    *fp = s ? 0 : data_fingerprint(&ds);
    if (opened) data_close(&ds);
    return s;
}

/* A file of many 1 MiB blocks is checked and hashed by 1..4 threads alike: the same
 * fingerprint (shard_hash64 of the blocks' shard_hash64s, the rule data.h gives), and a
 * bad token or mask byte in two blocks is refused naming the first in the file, as one
 * thread finds it. */
static void test_scan_threads(void **st)
{
    (void)st;
    const int was = omp_get_max_threads();
    enum { N = 3500000 }; /* uint16: 7 blocks of 524288 tokens, the last partial; mask: 4 blocks */
    const char *tok = write_file("scan.bin", N, 7, 1000, 0, 0, 0), *mask = write_mask("scan.mask.bin", N);
    /* the expected hash of the tokens, from the file's bytes */
    FILE *f = fopen(tok, "rb");
    uint8_t *all = malloc((size_t)N * 2);
    assert_non_null(all);
    assert_int_equal(fseek(f, 1024, SEEK_SET), 0);
    assert_int_equal(fread(all, 2, N, f), N);
    fclose(f);
    uint64_t bh[7];
    for (int b = 0; b < 7; b++) {
        const size_t n = b < 6 ? 524288 : N - 6 * 524288;
        bh[b] = shard_hash64(0, all + (size_t)b * (1u << 20), n * 2);
    }
    free(all);
    const uint64_t rec[4] = {2, N, shard_hash64(0, bh, sizeof bh), 0};
    const uint64_t want = shard_hash64(0, rec, sizeof rec);
    char msg[300], first[300];
    uint64_t fp, fp1 = 0;
    for (int t = 1; t <= 4; t++) {
        assert_int_equal(open_with(tok, NULL, t, msg, &fp), SHARD_OK);
        assert_true(fp == want);
        assert_int_equal(open_with(tok, mask, t, msg, &fp), SHARD_OK);
        if (t == 1) fp1 = fp;
        assert_true(fp == fp1 && fp != want); /* the mask counts */
    }
    poke(tok, 3000000, 1001, 2); /* block 5 */
    poke(tok, 1500000, 1000, 2); /* block 2: the first */
    poke(mask, 3400000, 7, 1);   /* block 3 */
    poke(mask, 1200000, 2, 1);   /* block 1: the first */
    for (int t = 1; t <= 4; t++) {
        assert_int_equal(open_with(tok, NULL, t, msg, &fp), SHARD_E_INVALID);
        assert_non_null(strstr(msg, "scan.bin: token 1000 at position 1500000 is outside the model's vocabulary"));
        if (t == 1) snprintf(first, sizeof first, "%s", msg);
        assert_string_equal(msg, first);
    }
    poke(tok, 3000000, 5, 2);
    poke(tok, 1500000, 5, 2);
    for (int t = 1; t <= 4; t++) {
        assert_int_equal(open_with(tok, mask, t, msg, &fp), SHARD_E_INVALID);
        assert_non_null(strstr(msg, "scan.mask.bin: mask byte 2 at position 1200000"));
    }
    omp_set_num_threads(was);
}

/* A resumed run's checks of its master weights and moments (state.c): blocks on the
 * threads, each vectorized, then the first failing block searched. Over 6 blocks (the
 * last partial) and 1-4 threads: finite values pass (-0 too, in exp_avg_sq), and each
 * failure names the first bad element, wherever it is, whatever the thread count. */
static void test_state_checks_threads(void **st)
{
    (void)st;
    const int was = omp_get_max_threads();
    enum { B = 1 << 16, N = 5 * B + 123 };
    float *w = malloc(N * sizeof *w), *m = malloc(N * sizeof *m), *v = malloc(N * sizeof *v);
    assert_true(w && m && v);
    for (size_t i = 0; i < N; i++) {
        w[i] = (float)((int)(i % 2001) - 1000) * 1e-3f;
        m[i] = -w[i] * 1e-30f; /* subnormals and zeros pass */
        v[i] = i % 7 ? w[i] * w[i] : -0.0f;
    }
    char want[200];
    for (int t = 1; t <= 4; t++) {
        omp_set_num_threads(t);
        assert_int_equal(state_check_weights("d", "optim/master", w, N), SHARD_OK);
        assert_int_equal(state_check_moments("d", m, v, N), SHARD_OK);
    }
    const struct { float *x; size_t at[2]; float bad[2]; const char *what; } cases[] = {
        {w, {4 * B + 5, 2 * B + 7}, {NAN, INFINITY}, "optim/master holds a value that is not finite"},
        {w, {5 * B + 100, 5 * B + 122}, {-INFINITY, NAN}, "optim/master holds a value that is not finite"},
        {m, {B + 1, 3 * B}, {INFINITY, NAN}, "optim/exp_avg holds a value that is not finite"},
        {v, {5 * B + 9, 3 * B + 65535}, {NAN, -1e-30f}, "optim/exp_avg_sq holds a negative or non-finite value"},
        {v, {0, 4 * B}, {-INFINITY, -2.0f}, "optim/exp_avg_sq holds a negative or non-finite value"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        float keep[2];
        for (int k = 0; k < 2; k++) {
            keep[k] = cases[c].x[cases[c].at[k]];
            cases[c].x[cases[c].at[k]] = cases[c].bad[k];
        }
        const size_t first = cases[c].at[0] < cases[c].at[1] ? cases[c].at[0] : cases[c].at[1];
        snprintf(want, sizeof want, "d: %s (element %zu of this rank's)", cases[c].what, first);
        for (int t = 1; t <= 4; t++) {
            omp_set_num_threads(t);
            const shard_status s = cases[c].x == w ? state_check_weights("d", "optim/master", w, N)
                                                   : state_check_moments("d", m, v, N);
            assert_int_equal(s, SHARD_E_INVALID);
            assert_string_equal(shard_errmsg(), want);
        }
        for (int k = 0; k < 2; k++) cases[c].x[cases[c].at[k]] = keep[k];
    }
    free(w);
    free(m);
    free(v);
    omp_set_num_threads(was);
}

static void test_schedule(void **st)
{
    (void)st;
    optim_hparams h = {.lr = 1.0f, .lr_min = 0.1f, .warmup = 4, .steps = 14, .cosine = 1};
    assert_float_equal(optim_lr(&h, 0), 0.25f, 0);
    assert_float_equal(optim_lr(&h, 3), 1.0f, 0);
    assert_float_equal(optim_lr(&h, 4), 1.0f, 1e-7); /* the cosine starts at lr ... */
    assert_float_equal(optim_lr(&h, 13), 0.1f, 1e-7); /* ... and reaches lr_min at the last step */
    assert_float_equal(optim_lr(&h, 8), 0.1f + 0.9f * 0.5f * (1.0f + cosf((float)M_PI * 4.0f / 9.0f)), 1e-6);
    for (int s = 4; s < 13; s++) assert_true(optim_lr(&h, s + 1) < optim_lr(&h, s));
    h.cosine = 0;
    assert_float_equal(optim_lr(&h, 10), 1.0f, 0);
    h.warmup = 0;
    assert_float_equal(optim_lr(&h, 0), 1.0f, 0);
}

static void test_norm_and_clip(void **st)
{
    (void)st;
    size_t n = 300000; /* several chunks */
    float *g = malloc(n * sizeof *g);
    double naive = 0.0;
    for (size_t i = 0; i < n; i++) {
        g[i] = (float)sin((double)i) * 0.01f;
        naive += (double)g[i] * g[i];
    }
    double a = optim_sumsq(g, n), b = optim_sumsq(g, n);
    assert_true(a == b);
    assert_true(fabs(a - naive) <= 1e-12 * naive);
    double norm = sqrt(a);
    assert_float_equal(optim_clip(g, n, norm, (float)(norm * 2)), 1.0f, 0); /* below the limit: untouched */
    float coef = optim_clip(g, n, norm, 1.0f);
    assert_float_equal(coef, (float)(1.0 / (norm + 1e-6)), 1e-6);
    assert_true(fabs(sqrt(optim_sumsq(g, n)) - 1.0) < 1e-5);
    assert_float_equal(optim_clip(g, n, 1e9, 0.0f), 1.0f, 0); /* clip 0: off */
    free(g);
}

/* OpenBLAS's pick is kept unless it is a known core of narrower vectors than the CPU's. */
static void test_blas_kernels(void **state)
{
    (void)state;
    assert_string_equal(blas_better_kernels("Prescott", 512), "SkylakeX");
    assert_string_equal(blas_better_kernels("prescott", 256), "Haswell");
    assert_string_equal(blas_better_kernels("Sandybridge", 256), "Haswell");
    assert_string_equal(blas_better_kernels("Haswell", 512), "SkylakeX");
    assert_null(blas_better_kernels("Haswell", 256));
    assert_null(blas_better_kernels("Zen", 256));
    assert_null(blas_better_kernels("SkylakeX", 512));
    assert_null(blas_better_kernels("Cooperlake", 512));
    assert_null(blas_better_kernels("Prescott", 128)); /* nothing wider to ask for */
    assert_null(blas_better_kernels("SomeNewCore", 512)); /* unknown: the library knows better */
    assert_null(blas_better_kernels(NULL, 512));
    int w = blas_cpu_width();
    assert_true(w == 128 || w == 256 || w == 512);
}

/* pages of [p, p + n) resident (mincore) */
static size_t resident(const unsigned char *p, size_t n, size_t page)
{
    unsigned char *v = calloc(n / page + 1, 1);
    assert_int_equal(mincore((void *)p, n, v), 0);
    size_t r = 0;
    for (size_t i = 0; i < (n + page - 1) / page; i++) r += v[i] & 1;
    free(v);
    return r;
}

/* prefault_spans faults in every page lying whole in its spans, over several threads and
 * spans at odd offsets, leaves the bytes zero and the pages outside alone, and does
 * nothing under its 16 MiB floor (a kernel before 5.14: nothing, said so) */
static void test_prefault(void **st)
{
    (void)st;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), n = (size_t)64 << 20;
    unsigned char *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(m != MAP_FAILED);
    madvise(m, n, MADV_NOHUGEPAGE); /* a huge page would make the count below moot */
    assert_int_equal(resident(m, n, page), 0);
    const prefault_span small = {m, (size_t)8 << 20};
    prefault_spans(&small, 1, 2);
    assert_int_equal(resident(m, n, page), 0); /* under the floor */
    /* two spans, neither on a page bound; a hole of 4 MiB between them */
    const prefault_span sp[2] = {{m + 100, ((size_t)20 << 20) - 100}, {m + ((size_t)24 << 20) + 7, (size_t)16 << 20}};
    prefault_spans(sp, 2, 3);
    const size_t got = resident(m, n, page);
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    unsigned char *probe = mmap(NULL, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    const int supported = madvise(probe, page, MADV_POPULATE_WRITE) == 0; /* Linux 5.14 and later */
    munmap(probe, page);
    if (!supported) {
        print_message("test_prefault: this kernel has no MADV_POPULATE_WRITE: only the floor is checked\n");
        assert_int_equal(got, 0);
        munmap(m, n);
        return;
    }
    const size_t whole = ((size_t)20 << 20) / page - 1 + ((size_t)16 << 20) / page - 1; /* each span's edge pages left */
    assert_true(got >= whole - 2 && got <= whole); /* a page split between two threads' shares is left too */
    assert_int_equal(resident(m + ((size_t)21 << 20), (size_t)3 << 20, page), 0); /* the hole */
    assert_int_equal(resident(m + ((size_t)41 << 20), (size_t)23 << 20, page), 0); /* past the spans */
    for (size_t i = 0; i < n; i += 4093) assert_int_equal(m[i], 0);
    munmap(m, n);
}

/* auto: a lane per thread where they divide the rows and can run, and only while the
 * extra gradient copies fit an eighth of the machine's memory */
static void test_lanes_auto(void **st)
{
    (void)st;
    dev d;
    memset(&d, 0, sizeof d);
    model m;
    memset(&m, 0, sizeof m);
    m.dev = &d;
    m.nparams = 5u << 20;
    const shard_layout one = {1, 1, 1, 1, 0}, tp2 = {1, 2, 1, 1, 0};
    omp_set_num_threads(2);
    assert_int_equal(lanes_auto(&m, &one, 8), 2);
    assert_int_equal(lanes_auto(&m, &one, 3), 1);  /* 2 does not divide 3 */
    assert_int_equal(lanes_auto(&m, &tp2, 8), 1);  /* tensor parallelism */
    m.E = 8;
    assert_int_equal(lanes_auto(&m, &one, 8), 1);  /* experts */
    m.E = 0;
    d.cuda = 1;
    assert_int_equal(lanes_auto(&m, &one, 8), 1);  /* a GPU */
    d.cuda = 0;
    const uint64_t eighth = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE) / 8;
    m.nparams = (size_t)(eighth / sizeof(float)); /* one gradient copy: an eighth exactly */
    assert_int_equal(lanes_auto(&m, &one, 8), 2);
    m.nparams += 1;
    assert_int_equal(lanes_auto(&m, &one, 8), 1);
    omp_set_num_threads(4);
    m.nparams = 5u << 20;
    assert_int_equal(lanes_auto(&m, &one, 8), 4);
    assert_int_equal(lanes_auto(&m, &one, 6), 1);  /* 4 does not divide 6: not fewer lanes than threads */
    assert_null(lanes_refusal(&m, &one, 8, 1));
    assert_non_null(strstr(lanes_refusal(&m, &one, 8, 3), "do not divide"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sequences_and_files), cmocka_unit_test(test_position_at_another_length),
        cmocka_unit_test(test_shuffle), cmocka_unit_test(test_shuffle_is_fisher_yates), cmocka_unit_test(test_seen_files_are_not_read), cmocka_unit_test(test_refusals), cmocka_unit_test(test_scan_threads), cmocka_unit_test(test_state_checks_threads),
        cmocka_unit_test(test_schedule), cmocka_unit_test(test_norm_and_clip),
        cmocka_unit_test(test_blas_kernels), cmocka_unit_test(test_prefault), cmocka_unit_test(test_lanes_auto),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
