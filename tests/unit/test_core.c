/* libshard core: status mapping, dtypes, paths, the safetensors writer's contract. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>
#include <hdf5.h>

#include "../../libshard/core/internal.h"
#include "../../libshard/ckpt/ckpt.h"

static void test_exit_codes(void **st)
{
    (void)st;
    assert_int_equal(shard_status_exit_code(SHARD_OK), 0);
    assert_int_equal(shard_status_exit_code(SHARD_E_IO), 1);
    assert_int_equal(shard_status_exit_code(SHARD_E_NOMEM), 1);
    assert_int_equal(shard_status_exit_code(SHARD_E_USAGE), 2);
    assert_int_equal(shard_status_exit_code(SHARD_E_INVALID), 3);
    assert_int_equal(shard_status_exit_code(SHARD_E_UNSUPPORTED), 3);
    assert_int_equal(shard_status_exit_code(SHARD_E_CORRUPT), 3);
    assert_int_equal(shard_status_exit_code(SHARD_E_CANCELLED), 130);
    assert_int_equal(shard_fail(SHARD_E_CORRUPT, "%s: bad %d", "f.h5", 7), SHARD_E_CORRUPT);
    assert_string_equal(shard_errmsg(), "f.h5: bad 7");
}

static void test_dtype_names(void **st)
{
    (void)st;
    for (int i = 1; i < SHARD_DT_COUNT; i++) {
        const char *n = shard_dtype_name((shard_dtype)i);
        assert_non_null(n);
        assert_int_equal(shard_dtype_from_name(n), i);
        assert_true(shard_dtype_size((shard_dtype)i) >= 1);
    }
    assert_int_equal(shard_dtype_from_name("F128"), SHARD_DT_INVALID);
    assert_int_equal(shard_dtype_from_name("f32"), SHARD_DT_INVALID); /* case matters, as in the reference */
    assert_null(shard_dtype_name(SHARD_DT_INVALID));
    assert_int_equal(shard_dtype_size(SHARD_DT_BF16), 2);
}

static void test_fp8_edges(void **st)
{
    (void)st;
    assert_int_equal(shard_f32_to_e4m3(448.0f), 0x7e);
    assert_int_equal(shard_f32_to_e4m3(464.0f), 0x7e);   /* the tie goes to even: 448 */
    assert_int_equal(shard_f32_to_e4m3(470.0f), 0x7f);   /* rounds past max: NaN (no inf in e4m3fn) */
    assert_int_equal(shard_f32_to_e4m3(-INFINITY), 0xff);
    assert_int_equal(shard_f32_to_e5m2(57344.0f), 0x7b);
    assert_int_equal(shard_f32_to_e5m2(65536.0f), 0x7c);  /* inf */
    assert_int_equal(shard_f32_to_e4m3(0x1p-10f), 0x00);  /* tie to even: 0 */
    assert_int_equal(shard_f32_to_e4m3(0x1.8p-9f), 0x02); /* 1.5 subnormal steps: to even (2) */
    assert_true(shard_e4m3_to_f32(0x01) == 0x1p-9f);
    uint8_t q[3];
    float x[3] = {1000.0f, -1000.0f, 1.0f};
    float amax = shard_fp8_quantize(q, x, 3, 1.0f, SHARD_DT_F8_E4M3);
    assert_true(amax == 1000.0f);
    assert_int_equal(q[0], 0x7e); /* saturates to 448, not NaN */
    assert_int_equal(q[1], 0xfe);
    assert_int_equal(shard_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80); /* tie to even */
    assert_int_equal(shard_f32_to_bf16(1.0f + 0x1.8p-8f), 0x3f81);
}

static void test_paths(void **st)
{
    (void)st;
    assert_true(shard_path_is_contained("model.safetensors"));
    assert_true(shard_path_is_contained("sub/model.safetensors"));
    assert_false(shard_path_is_contained("../x"));
    assert_false(shard_path_is_contained("a/../../x"));
    assert_false(shard_path_is_contained("/etc/passwd"));
    assert_false(shard_path_is_contained(""));
    assert_false(shard_path_is_contained("a//b"));
    assert_false(shard_path_is_contained("./a"));
    assert_false(shard_path_is_contained("a\\..\\b"));
    char *p = shard_path_join("dir/", "f");
    assert_string_equal(p, "dir/f");
    free(p);
    /* staging folders: beside the output, hidden, named after it and this process */
    static const char *const outs[][2] = {{"ck", "./.tmp-ck-"}, {"a/b/", "a/.tmp-b-"}, {"/x", "/.tmp-x-"}, {"/a/b//", "/a/.tmp-b-"}};
    for (size_t i = 0; i < sizeof outs / sizeof *outs; i++) {
        char want[64];
        snprintf(want, sizeof want, "%s%ld-", outs[i][1], (long)getpid());
        p = shard_staging_path(outs[i][0]);
        assert_non_null(p);
        assert_memory_equal(p, want, strlen(want));
        /* and its name is recognised as one (a later write notes it, smp-train sweeps it) */
        const char *slash = strrchr(p, '/');
        assert_true(shard_is_staging_name(slash + 1, NULL));
        free(p);
    }
    assert_true(shard_is_staging_name(".tmp-ck-12-34", "ck"));
    assert_true(shard_is_staging_name(".tmp-ck-2-12-34", "ck-2"));
    assert_false(shard_is_staging_name(".tmp-ck-2-12-34", "ck")); /* ck-2's, not ck's */
    assert_true(shard_is_staging_name(".tmp-step-000003.old-12-34", NULL)); /* an overwritten one, aside */
    assert_false(shard_is_staging_name(".tmp-ck-12", NULL));
    assert_false(shard_is_staging_name(".tmp--12-34", NULL));
    assert_false(shard_is_staging_name(".tmp-ck-12-34x", "ck"));
    assert_false(shard_is_staging_name("tmp-ck-12-34", NULL));
    assert_false(shard_is_staging_name(".tmp-ck-1a-34", NULL));
}

/* The writer's contract, durable (o NULL) or not (no_fsync changes nothing but the
 * fsyncs: the file appears at finish, whole); and shard_copy_file's. */
static void writer_contract(const shard_write_opts *o)
{
    char dir[] = "/tmp/smp-unit-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[256];
    snprintf(path, sizeof path, "%s/t.safetensors", dir);
    shard_st_writer *w;
    assert_int_equal(shard_st_writer_create_opts(path, o, &w), SHARD_OK);
    int64_t shape[2] = {2, 3};
    assert_int_equal(shard_st_writer_declare(w, "a", SHARD_DT_F32, 2, shape), SHARD_OK);
    assert_int_equal(shard_st_writer_declare(w, "a", SHARD_DT_F32, 2, shape), SHARD_E_USAGE);
    assert_int_equal(shard_st_writer_declare(w, "__metadata__", SHARD_DT_F32, 2, shape), SHARD_E_USAGE);
    float v[6] = {1, 2, 3, 4, 5, 6}, extra = 7;
    assert_int_equal(shard_st_writer_write(w, v, sizeof v), SHARD_OK);
    assert_int_equal(shard_st_writer_write(w, &extra, 4), SHARD_E_USAGE); /* past the declared bytes */
    assert_int_equal(access(path, F_OK), -1);                           /* not visible before finish */
    assert_int_equal(shard_st_writer_finish(w), SHARD_OK);
    shard_st_file *f;
    assert_int_equal(shard_st_open(path, &f), SHARD_OK);
    assert_int_equal(shard_st_count(f), 1);
    const shard_st_tensor *t = shard_st_find(f, "a");
    assert_non_null(t);
    assert_memory_equal(t->data, v, sizeof v);
    assert_int_equal(t->file_offset % 8, 0);
    shard_st_close(f);
    char copy[300];
    snprintf(copy, sizeof copy, "%s/copy", dir);
    assert_int_equal(shard_copy_file(path, copy, o), SHARD_OK);
    assert_int_equal(shard_copy_file(path, copy, o), SHARD_E_IO); /* exists: refused */
    unlink(copy);
    unlink(path);
    rmdir(dir);
}

static void test_writer_contract(void **st)
{
    (void)st;
    writer_contract(NULL);
    shard_write_opts no_fsync = {.no_fsync = 1};
    writer_contract(&no_fsync);
}

/* The reference of a version-2 file checksum, from libxxhash alone: XXH64 of the
 * little-endian XXH3_64bits of each 4096-byte block (docs/FORMAT.md). */
static uint64_t ref_blocks(const unsigned char *p, size_t n)
{
    size_t nb = (n + 4095) / 4096;
    uint64_t *d = malloc((nb + 1) * 8);
    for (size_t b = 0; b < nb; b++) d[b] = XXH3_64bits(p + b * 4096, n - b * 4096 < 4096 ? n - b * 4096 : 4096);
    uint64_t h = XXH64(d, nb * 8, 0);
    free(d);
    return h;
}

/* streamed in pieces of awkward sizes (inside a block, across several, a block's
 * exact end), both kinds give libxxhash's value */
static void test_fhash_stream(void **st)
{
    (void)st;
    const size_t n = (1u << 20) + 4096 * 3 + 77;
    unsigned char *buf = malloc(n);
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(i * 2654435761u >> 11);
    const size_t steps[] = {1, 7, 4095, 4096, 4097, 12288, 65536 + 5, 1 << 20};
    const size_t lens[] = {0, 1, 4095, 4096, 4097, 8192, n};
    for (size_t li = 0; li < sizeof lens / sizeof *lens; li++)
        for (size_t si = 0; si < sizeof steps / sizeof *steps; si++) {
            shard_fhash_state a, b;
            shard_fhash_reset(&a, SHARD_FHASH_XXH3_BLOCKS);
            shard_fhash_reset(&b, SHARD_FHASH_XXH64);
            for (size_t o = 0, k = 0; o < lens[li]; k++) { /* steps alternate with 1-byte ones */
                size_t take = k % 2 ? 1 : steps[si];
                if (take > lens[li] - o) take = lens[li] - o;
                shard_fhash_update(&a, buf + o, take);
                shard_fhash_update(&b, buf + o, take);
                o += take;
            }
            assert_true(shard_fhash_digest(&a) == ref_blocks(buf, lens[li]));
            assert_true(shard_fhash_digest(&b) == XXH64(buf, lens[li], 0));
        }
    free(buf);
}

/* The background flusher (io/flusher.c): every kick gets its fdatasync before stop
 * returns, and a failed one comes back from stop (a pipe cannot be synced: EINVAL), so
 * that the writer's close can report it as its fsync's failure. */
static void test_flusher(void **st)
{
    (void)st;
    assert_null(shard_flusher_start(-1));
    shard_flusher_kick(NULL);
    assert_int_equal(shard_flusher_stop(NULL), 0);
    char path[] = "/tmp/smp-unit-fl-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    shard_flusher *f = shard_flusher_start(fd);
    assert_non_null(f);
    assert_int_equal(write(fd, "durable", 7), 7);
    shard_flusher_kick(f);
    close(fd); /* the flusher holds a duplicate: the writer may close its own first */
    assert_int_equal(shard_flusher_stop(f), 0);
    unlink(path);
    int p[2];
    assert_int_equal(pipe(p), 0);
    f = shard_flusher_start(p[1]);
    assert_non_null(f);
    assert_int_equal(shard_flusher_stop(f), 0); /* never kicked: never flushed */
    f = shard_flusher_start(p[1]);
    shard_flusher_kick(f);
    shard_flusher_kick(f);
    assert_int_equal(shard_flusher_stop(f), EINVAL);
    close(p[0]);
    close(p[1]);
}

/* A shard writer's block map: the blocks it recorded are taken from memory and only the
 * rest is read back; recorded spans start and end inside blocks or on their edges. A
 * span recorded from bytes that are not the file's shows that the map is what counts. */
static void test_blockmap(void **st)
{
    (void)st;
    char path[] = "/tmp/smp-unit-bm-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    const size_t n = (5u << 20) + 1234;
    unsigned char *buf = malloc(n);
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(i * 2246822519u >> 9);
    assert_int_equal(write(fd, buf, n), (ssize_t)n);
    shard_blockmap m;
    shard_blockmap_init(&m);
    const size_t spans[][2] = {{100, 3 << 20}, {(3u << 20) + 4096, 4096}, {(4u << 20), (1u << 20) + 1234}, {4096 * 7, 4000}};
    for (size_t i = 0; i < 4; i++) shard_blockmap_record(&m, spans[i][0], buf + spans[i][0], spans[i][1]);
    uint64_t h, bytes;
    assert_int_equal(shard_blockmap_finish(&m, fd, path, &h, &bytes), SHARD_OK);
    assert_true(h == ref_blocks(buf, n) && bytes == n);
    uint64_t h2;
    assert_int_equal(shard_fd_hash(fd, path, SHARD_FHASH_XXH3_BLOCKS, &h2, &bytes), SHARD_OK);
    assert_true(h2 == h && bytes == n);
    unsigned char *other = malloc(8192);
    memset(other, 0xab, 8192);
    shard_blockmap_record(&m, 8192, other, 8192); /* blocks 2 and 3, from other bytes */
    assert_int_equal(shard_blockmap_finish(&m, fd, path, &h2, &bytes), SHARD_OK);
    memcpy(buf + 8192, other, 8192);
    assert_true(h2 != h && h2 == ref_blocks(buf, n));
    shard_blockmap_free(&m);
    close(fd);
    unlink(path);
    free(other);
    free(buf);
}

/* A file's checksums (read in pieces: a size over many of them, not a multiple of one)
 * and the note a shard writer leaves for the commit: used once, and only while it still
 * describes the file. */
static void test_file_hash_and_note(void **st)
{
    (void)st;
    char dir[] = "/tmp/smp-unit-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[256];
    snprintf(path, sizeof path, "%s/shard-00000.h5", dir);
    const size_t n = (3u << 20) + 123;
    unsigned char *buf = malloc(n);
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(i * 2654435761u >> 13);
    FILE *fp = fopen(path, "wb");
    assert_int_equal(fwrite(buf, 1, n, fp), n);
    fclose(fp);
    uint64_t h, bytes;
    assert_int_equal(shard_file_hash(path, SHARD_FHASH_XXH64, &h, &bytes), SHARD_OK);
    assert_true(h == XXH64(buf, n, 0) && bytes == n);
    assert_int_equal(shard_file_hash(path, SHARD_FHASH_XXH3_BLOCKS, &h, &bytes), SHARD_OK);
    assert_true(h == ref_blocks(buf, n) && bytes == n);
    char empty[300];
    snprintf(empty, sizeof empty, "%s/empty", dir);
    fclose(fopen(empty, "wb"));
    assert_int_equal(shard_file_hash(empty, SHARD_FHASH_XXH64, &h, &bytes), SHARD_OK);
    assert_true(h == XXH64("", 0, 0) && bytes == 0);
    assert_int_equal(shard_file_hash(empty, SHARD_FHASH_XXH3_BLOCKS, &h, &bytes), SHARD_OK);
    assert_true(h == XXH64("", 0, 0) && bytes == 0); /* no blocks */
    unlink(empty);
    assert_int_equal(shard_file_hash("/nonexistent/x", SHARD_FHASH_XXH3_BLOCKS, &h, &bytes), SHARD_E_INVALID); /* missing: exit 3 */

    int fd = open(path, O_RDONLY);
    const char lines[] = "params\tw\tBF16\t0,0\t2,3\t4,3\t0123456789abcdef\n";
    assert_int_equal(shard_file_hash_note(path, fd, 0x1234, n, lines, strlen(lines)), SHARD_OK);
    close(fd);
    char note[300];
    snprintf(note, sizeof note, "%s.fhash", path);
    assert_int_equal(access(note, F_OK), 0);
    size_t nl = 0;
    char *got = shard_file_note_pieces(path, &nl); /* the writer's lines, as written; the note stays */
    assert_non_null(got);
    assert_true(nl == strlen(lines) && !strcmp(got, lines));
    free(got);
    assert_int_equal(access(note, F_OK), 0);
    assert_int_equal(shard_file_hash_noted(path, &h, &bytes), 1); /* the note is trusted as written */
    assert_true(h == 0x1234 && bytes == n);
    assert_int_equal(access(note, F_OK), -1); /* and used once */
    assert_int_equal(shard_file_hash_noted(path, &h, &bytes), 0);
    /* a file changed after its note: the note no longer describes it */
    assert_null(shard_file_note_pieces(path, &nl)); /* no note */
    fd = open(path, O_RDONLY);
    assert_int_equal(shard_file_hash_note(path, fd, 0x1234, n, lines, strlen(lines)), SHARD_OK);
    close(fd);
    fp = fopen(path, "r+b");
    fseek(fp, 5, SEEK_SET);
    fputc(0, fp);
    fclose(fp);
    struct timespec later[2] = {{0, UTIME_OMIT}, {1, 0}}; /* a new mtime, whatever the clock's grain */
    utimensat(AT_FDCWD, path, later, 0);
    assert_null(shard_file_note_pieces(path, &nl)); /* nor its lines */
    assert_int_equal(shard_file_hash_noted(path, &h, &bytes), 0);
    assert_int_equal(access(note, F_OK), -1);
    unlink(path);
    rmdir(dir);
    free(buf);
}

/* the XXH3 of rows lying `stride` apart (shard_xxh3_rows: a chunk read straight into a
 * column slice of a box) is libxxhash's XXH3 of the rows packed one after the other,
 * in every form this CPU runs: rows shorter and longer than XXH3's stripes and blocks,
 * one row, rows adjacent (stride = row) */
static void test_chunk_xxh3_rows(void **st)
{
    (void)st;
    const size_t shapes[][3] = {{1, 5, 3}, {7, 13, 40}, {64, 100, 9}, {250, 256, 17}, {1024, 3000, 33},
                                {4096, 8192, 64}, {300, 300, 20}, {2048, 4000, 1}, {16, 16, 0}};
    unsigned char *box = malloc(8192 * 64), *packed = malloc(4096 * 64);
    assert_non_null(box);
    assert_non_null(packed);
    for (size_t i = 0; i < 8192 * 64; i++) box[i] = (unsigned char)(i * 2654435761u >> 13);
    for (size_t t = 0; t < sizeof shapes / sizeof *shapes; t++) {
        const size_t row = shapes[t][0], stride = shapes[t][1], n = shapes[t][2];
        for (size_t i = 0; i < n; i++) memcpy(packed + i * row, box + 3 + i * stride, row);
        const uint64_t want = XXH3_64bits(packed, row * n);
        assert_true(shard_xxh3_rows(box + 3, row, stride, n) == want);
#if SHARD_XXH3_WIDE
        __builtin_cpu_init();
        assert_true(shard_xxh3_base_rows(box + 3, row, stride, n) == want);
        if (__builtin_cpu_supports("x86-64-v3")) assert_true(shard_xxh3_avx2_rows(box + 3, row, stride, n) == want);
        if (__builtin_cpu_supports("x86-64-v4")) assert_true(shard_xxh3_avx512_rows(box + 3, row, stride, n) == want);
#endif
    }
    free(box);
    free(packed);
}

/* bytes handed to shard_xxh3_stream a block at a time, blocks of uneven sizes (0, 1,
 * across XXH3's stripes and its 1 KiB blocks, a 16 KiB unshuffle block), hash as the
 * blocks laid end to end: libxxhash's one-shot XXH3, in every form this CPU runs */
typedef struct {
    const unsigned char *p;
    size_t at, len, step;
} blocks;

static const void *next_block(void *ctx, size_t *len)
{
    blocks *b = ctx;
    if (b->at >= b->len) return NULL;
    const size_t sizes[] = {0, 1, 63, 64, 255, 1024, 1029, 16384};
    size_t m = sizes[b->step++ % 8];
    if (m > b->len - b->at) m = b->len - b->at;
    *len = m;
    b->at += m;
    return b->p + b->at - m;
}

static void test_chunk_xxh3_stream(void **st)
{
    (void)st;
    const size_t lens[] = {0, 1, 17, 240, 241, 1024, 5000, 65537, (1u << 20) + 7};
    unsigned char *buf = malloc((1u << 20) + 8);
    assert_non_null(buf);
    for (size_t i = 0; i < (1u << 20) + 8; i++) buf[i] = (unsigned char)(i * 2654435761u >> 7);
    for (size_t i = 0; i < sizeof lens / sizeof *lens; i++) {
        const uint64_t want = XXH3_64bits(buf + 1, lens[i]);
        blocks b = {buf + 1, 0, lens[i], 0};
        assert_true(shard_xxh3_stream(next_block, &b) == want);
#if SHARD_XXH3_WIDE
        __builtin_cpu_init();
        b = (blocks){buf + 1, 0, lens[i], 0};
        assert_true(shard_xxh3_base_stream(next_block, &b) == want);
        b = (blocks){buf + 1, 0, lens[i], 0};
        if (__builtin_cpu_supports("x86-64-v3")) assert_true(shard_xxh3_avx2_stream(next_block, &b) == want);
        b = (blocks){buf + 1, 0, lens[i], 0};
        if (__builtin_cpu_supports("x86-64-v4")) assert_true(shard_xxh3_avx512_stream(next_block, &b) == want);
#endif
    }
    free(buf);
}

/* the chunks' XXH3 (libshard/core/xxh3.c) gives libxxhash's value in every form this
 * CPU runs, over the lengths where XXH3 changes its code path (0, 1-3, 4-8, 9-16,
 * 17-128, 129-240, longer; stripes, blocks, a 1 MiB chunk and a tail) and at odd
 * addresses */
static void test_chunk_xxh3_forms(void **st)
{
    (void)st;
    const size_t lens[] = {0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 4096, 65537, (1u << 20) + 7};
    const size_t max = (1u << 20) + 32; /* the longest length at the last offset */
    unsigned char *buf = malloc(max);
    assert_non_null(buf);
    for (size_t i = 0; i < max; i++) buf[i] = (unsigned char)(i * 2654435761u >> 11);
#if SHARD_XXH3_WIDE
    __builtin_cpu_init();
    const int v3 = __builtin_cpu_supports("x86-64-v3"), v4 = __builtin_cpu_supports("x86-64-v4");
    if (!v4) print_message("test_chunk_xxh3_forms: no AVX-512 on this CPU: its form is not run\n");
    assert_int_equal(shard_xxh3_bits(), v4 ? 512 : v3 ? 256 : 128); /* the widest form is the one run */
#endif
    for (size_t i = 0; i < sizeof lens / sizeof *lens; i++)
        for (size_t at = 0; at < 3; at++) {
            const unsigned char *p = buf + at * 5;
            const uint64_t want = XXH3_64bits(p, lens[i]);
            assert_true(shard_xxh3(p, lens[i]) == want);
#if SHARD_XXH3_WIDE
            assert_true(shard_xxh3_base(p, lens[i]) == want);
            if (v3) assert_true(shard_xxh3_avx2(p, lens[i]) == want);
            if (v4) assert_true(shard_xxh3_avx512(p, lens[i]) == want);
#endif
        }
    free(buf);
}

/* HDF5's shuffle filter (byte b of element j at b * n + j) as libshard runs it, SSE2
 * and plain tails alike, against the definition, for every element size checkpoints
 * store and lengths around the 16-element vectors; unshuffled back whole and in parts */
static void test_shuffle_forms(void **st)
{
    (void)st;
    const size_t ns[] = {0, 1, 15, 16, 17, 31, 32, 33, 1000, 262147};
    const size_t ess[] = {1, 2, 4, 8};
    const size_t most = 262147 * 8;
    uint8_t *src = malloc(most), *got = malloc(most), *want = malloc(most), *back = malloc(most);
    assert_true(src && got && want && back);
    for (size_t i = 0; i < most; i++) src[i] = (uint8_t)(i * 2654435761u >> 13);
    for (size_t a = 0; a < sizeof ess / sizeof *ess; a++)
        for (size_t k = 0; k < sizeof ns / sizeof *ns; k++) {
            const size_t es = ess[a], n = ns[k], bytes = n * es;
            for (size_t j = 0; j < n; j++)
                for (size_t b = 0; b < es; b++) want[b * n + j] = src[j * es + b];
            shard_shuffle(got, src, n, es);
            if (!n) continue; /* n = 0: the calls must not fault; nothing to compare */
            assert_memory_equal(got, want, bytes);
            shard_unshuffle(back, got, n, es);
            assert_memory_equal(back, src, bytes);
            memset(back, 0, n * es);
            const size_t cut = n / 3 + 5 < n ? n / 3 + 5 : n; /* two parts, the first not a multiple of 16 */
            shard_unshuffle_part(back, got, n, es, 0, cut);
            shard_unshuffle_part(back + cut * es, got, n, es, cut, n);
            assert_memory_equal(back, src, bytes);
        }
    free(src);
    free(got);
    free(want);
    free(back);
}

/* XINUSE bit 2 (XGETBV with ECX=1): the upper halves of ymm0-15 hold something, so that
 * every SSE instruction the thread runs next waits on them; -1 where the CPU cannot say */
static int avx_upper_in_use(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE) || !(c & bit_AVX)) return -1;
    if (!__get_cpuid_count(0xd, 1, &a, &b, &c, &d) || !(a & 4)) return -1; /* no XGETBV(1) */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
    (void)hi;
    return (int)(lo >> 2 & 1);
#else
    return -1;
#endif
}

static void dirty_upper(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __asm__ volatile("vpcmpeqd %%ymm15, %%ymm15, %%ymm15" ::: "xmm15");
#endif
}

static void clean_upper(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __asm__ volatile("vzeroupper" ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                     "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#endif
}

/* The checksums' vector forms leave the vector registers' upper halves clean: GCC put
 * no vzeroupper after xxhash's AVX2 and AVX-512 loops, and on an AVX-512 Xeon the SSE
 * code that ran next on the thread (the init fill's libm calls, zstd, dtype
 * conversions) took up to 8x its time until something cleared them. */
static void test_hashes_leave_vector_state_clean(void **st)
{
    (void)st;
    if (avx_upper_in_use() < 0) {
        print_message("test_hashes_leave_vector_state_clean: this CPU does not report XINUSE: not run\n");
        return;
    }
    dirty_upper(); /* the probe sees it, or the test proves nothing */
    const int seen = avx_upper_in_use();
    clean_upper();
    if (seen != 1 || avx_upper_in_use() != 0) {
        print_message("test_hashes_leave_vector_state_clean: XINUSE does not follow ymm15 here: not run\n");
        return;
    }
    const size_t n = (1u << 20) + 7;
    unsigned char *buf = malloc(n);
    assert_non_null(buf);
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(i * 2654435761u >> 9);
    volatile uint64_t h = shard_xxh3(buf, n);
    assert_int_equal(avx_upper_in_use(), 0);
    h = shard_xxh3_rows(buf, 4096, 4100, 200);
    assert_int_equal(avx_upper_in_use(), 0);
    blocks b = {buf, 0, n, 0};
    h = shard_xxh3_stream(next_block, &b);
    assert_int_equal(avx_upper_in_use(), 0);
    h = shard_hash64(0, buf, n);
    assert_int_equal(avx_upper_in_use(), 0);
#if SHARD_XXH3_WIDE
    if (__builtin_cpu_supports("x86-64-v3")) {
        h = shard_xxh3_avx2(buf, n);
        assert_int_equal(avx_upper_in_use(), 0);
    }
    if (__builtin_cpu_supports("x86-64-v4")) {
        h = shard_xxh3_avx512(buf, n);
        assert_int_equal(avx_upper_in_use(), 0);
    }
#endif
    (void)h;
    free(buf);
}

/* the pieces' and files' XXH64 (libshard/core/xxh64.c) gives libxxhash's value in both
 * stripe loops, one shot and streamed in uneven parts (partial stripes carried across
 * updates, updates of 0 bytes), over the lengths where XXH64 changes its code path
 * (below a stripe of 32, its tails of 8, 4 and single bytes) and at odd addresses */
static void test_xxh64_forms(void **st)
{
    (void)st;
    const size_t lens[] = {0, 1, 3, 4, 7, 8, 12, 31, 32, 33, 63, 64, 100, 1023, 4096, 65537, (1u << 20) + 7};
    const size_t max = (1u << 20) + 32;
    unsigned char *buf = malloc(max);
    assert_non_null(buf);
    for (size_t i = 0; i < max; i++) buf[i] = (unsigned char)(i * 2654435761u >> 9);
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    const int vec = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                    __builtin_cpu_supports("avx512dq");
    if (!vec) print_message("test_xxh64_forms: no AVX-512 on this CPU: the vector loop is not run\n");
    assert_int_equal(shard_xxh64_bits(), vec && __builtin_cpu_is("amd") ? 256 : 64); /* AMD's vpmullq only */
#else
    const int vec = 0;
#endif
    const size_t parts[] = {1, 5, 0, 31, 32, 33, 7, 4096, 100000};
    for (size_t i = 0; i < sizeof lens / sizeof *lens; i++)
        for (size_t at = 0; at < 3; at++) {
            const unsigned char *p = buf + at * 5;
            const uint64_t want = XXH64(p, lens[i], 0);
            assert_true(shard_xxh64(p, lens[i]) == want);
            assert_true(shard_xxh64_form(0, p, lens[i]) == want);
            if (vec) assert_true(shard_xxh64_form(1, p, lens[i]) == want);
            shard_xxh64_state h;
            shard_xxh64_reset(&h);
            for (size_t done = 0, k = 0; done < lens[i]; k++) {
                size_t n = parts[k % (sizeof parts / sizeof *parts)];
                n = n < lens[i] - done ? n : lens[i] - done;
                shard_xxh64_update(&h, p + done, n);
                done += n;
                assert_true(shard_xxh64_digest(&h) == XXH64(p, done, 0)); /* digest leaves the state be */
            }
            assert_true(shard_xxh64_digest(&h) == want);
        }
    free(buf);
}

/* config.json for weights of another dtype: the value edited in place, the rest byte
 * for byte; a text that does not allow that (the key twice) rewritten whole */
/* shard_hash64: libxxhash's XXH64 of the 8 little-endian bytes of h, then the data */
static void test_hash64_chain(void **st)
{
    (void)st;
    uint8_t buf[8 + 100];
    for (int i = 0; i < 100; i++) buf[8 + i] = (uint8_t)(i * 37 + 1);
    const uint64_t hs[] = {0, 1, 0x0123456789abcdefull};
    for (size_t k = 0; k < 3; k++)
        for (size_t n = 0; n <= 100; n += 33) {
            for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(hs[k] >> (8 * i));
            assert_true(shard_hash64(hs[k], buf + 8, n) == XXH64(buf, 8 + n, 0));
        }
}

static void remove_tree(const char *dir)
{
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "rm -rf '%.1000s'", dir);
    assert_int_equal(system(cmd), 0);
}

/* A checkpoint of a one-layer Llama (hidden 8, vocab 12) begun in dir: its model, layout
 * and stages, its writer and the writer of its one shard file (path: that file's). */
static const char TINY_CFG[] = "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"hidden_size\": 8, "
                               "\"intermediate_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                               "\"num_key_value_heads\": 1, \"vocab_size\": 12, \"rms_norm_eps\": 1e-5, \"max_position_embeddings\": 32}";
typedef struct {
    shard_model_desc d;
    shard_layout l;
    int stages[1];
    shard_ckpt_writer *cw;
    shard_h5_writer *w;
    char path[512];
} tiny_ckpt;

static void tiny_begin(tiny_ckpt *k, const char *dir)
{
    assert_int_equal(shard_config_parse(TINY_CFG, sizeof TINY_CFG - 1, "config.json", &k->d), SHARD_OK);
    assert_int_equal(shard_layout_parse("pp=1", &k->l), SHARD_OK);
    assert_int_equal(shard_stages_auto(&k->d, 1, k->stages), SHARD_OK);
    assert_int_equal(shard_ckpt_begin(dir, &k->cw), SHARD_OK);
    snprintf(k->path, sizeof k->path, "%s/shard-00000.h5", shard_ckpt_staging(k->cw));
    shard_compress c;
    assert_int_equal(shard_compress_parse("none", &c), SHARD_OK);
    c.no_fsync = 1;
    assert_int_equal(shard_h5_create(k->path, c, &k->w), SHARD_OK);
}

static void tiny_commit(tiny_ckpt *k)
{
    assert_int_equal(shard_ckpt_commit(k->cw, TINY_CFG, sizeof TINY_CFG - 1, &k->d, &k->l, k->stages, NULL, 0), SHARD_OK);
}

/* A checkpoint of two pieces (a 2-D one in params, a 1-D one in optim/exp_avg) committed
 * into dir; note 0: with its writer's note, 1: the note removed first, 2: a line that
 * does not parse added to the note (both: the commit scans the file's datasets), 3: the
 * note's last line's checksum changed to ffff... (what the commit took shows). Its
 * manifest's tensors and files. */
static json_t *commit_two_pieces(const char *dir, int note)
{
    tiny_ckpt k;
    tiny_begin(&k, dir);
    shard_h5_writer *w = k.w;
    char *path = k.path;
    float v[24];
    for (int i = 0; i < 24; i++) v[i] = (float)i * 0.5f;
    const int64_t g2[2] = {12, 8}, g1[1] = {8};
    const shard_box b2 = {2, {4, 0}, {3, 8}}, b1 = {1, {2}, {5}};
    assert_int_equal(shard_h5_write_local(w, "params", "model.embed_tokens.weight", SHARD_DT_BF16, 2, g2, &b2, v, SHARD_DT_F32), SHARD_OK);
    assert_int_equal(shard_h5_write_local(w, "optim/exp_avg", "model.norm.weight", SHARD_DT_F32, 1, g1, &b1, v, SHARD_DT_F32), SHARD_OK);
    assert_int_equal(shard_h5_close(w), SHARD_OK);
    char notep[600];
    snprintf(notep, sizeof notep, "%s.fhash", path);
    assert_int_equal(access(notep, F_OK), 0);
    if (note == 1) unlink(notep);
    if (note == 2) {
        FILE *f = fopen(notep, "a");
        assert_non_null(f);
        fputs("params\tmodel.norm.weight\tF32\t0\n", f); /* four fields of seven */
        fclose(f);
    }
    if (note == 3) {
        FILE *f = fopen(notep, "r+");
        assert_non_null(f);
        assert_int_equal(fseek(f, -17, SEEK_END), 0); /* the last line's 16 hex digits, then its line end */
        fputs("ffffffffffffffff", f);
        fclose(f);
    }
    tiny_commit(&k);
    char mpath[512];
    snprintf(mpath, sizeof mpath, "%s/smp.json", dir);
    json_t *m = json_load_file(mpath, 0, NULL);
    assert_non_null(m);
    json_t *out = json_pack("{s:O,s:O}", "tensors", json_object_get(m, "tensors"), "files", json_object_get(m, "files"));
    json_decref(m);
    snprintf(mpath, sizeof mpath, "%s/shard-00000.h5.fhash", dir);
    assert_int_equal(access(mpath, F_OK), -1); /* a committed checkpoint holds no note */
    return out;
}

/* An open checkpoint keeps no JSON of its tensors (a Qwen3-30B-A3B's is ~60 MB parsed);
 * asked for, they are read again from smp.json, and refused once it is not the one
 * opened. */
static void test_manifest_tensors_read_again(void **st)
{
    (void)st;
    char dir[] = "/tmp/smp-unit-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char ck_dir[300], path[600];
    snprintf(ck_dir, sizeof ck_dir, "%s/ck", dir);
    tiny_ckpt k;
    tiny_begin(&k, ck_dir);
    static float v[12 * 16];
    const size_t n = shard_model_tensor_count(&k.d);
    for (size_t i = 0; i < n; i++) { /* every tensor of the model, whole */
        shard_tensor_spec t;
        shard_model_tensor(&k.d, i, &t);
        shard_box b = {t.ndim, {0, 0}, {t.shape[0], t.ndim > 1 ? t.shape[1] : 0}};
        assert_int_equal(shard_h5_write_local(k.w, "params", t.name, SHARD_DT_F32, t.ndim, t.shape, &b, v, SHARD_DT_F32), SHARD_OK);
    }
    assert_int_equal(shard_h5_close(k.w), SHARD_OK);
    tiny_commit(&k);
    shard_ckpt *ck;
    assert_int_equal(shard_ckpt_open(ck_dir, &ck), SHARD_OK);
    assert_null(json_object_get((const json_t *)shard_ckpt_manifest_json(ck), "tensors"));
    assert_int_equal(shard_ckpt_tensor_count(ck), n);
    void *ts = NULL;
    assert_int_equal(shard_ckpt_manifest_tensors(ck, &ts), SHARD_OK);
    assert_int_equal(json_array_size(ts), n);
    for (size_t i = 0; i < n; i++) /* the reader's tensors, in the manifest's order */
        assert_string_equal(json_string_value(json_object_get(json_array_get(ts, i), "name")), shard_ckpt_tensor_at(ck, i)->name);
    json_decref(ts);
    snprintf(path, sizeof path, "%s/smp.json", ck_dir);
    FILE *f = fopen(path, "a");
    assert_non_null(f);
    fputc('\n', f);
    fclose(f);
    assert_int_equal(shard_ckpt_manifest_tensors(ck, &ts), SHARD_E_INVALID);
    assert_null(ts);
    shard_ckpt_close(ck);
    remove_tree(dir);
}

/* The commit takes a file's pieces from its writer's note, or scans the file's datasets
 * where the note is gone: the same manifest either way. */
static void test_commit_note_or_scan(void **st)
{
    (void)st;
    char root[] = "/tmp/smp-unit-XXXXXX";
    assert_non_null(mkdtemp(root));
    char a[300], b[300], c[300];
    snprintf(a, sizeof a, "%s/noted", root);
    snprintf(b, sizeof b, "%s/scanned", root);
    snprintf(c, sizeof c, "%s/bad-note", root);
    json_t *x = commit_two_pieces(a, 0), *y = commit_two_pieces(b, 1), *z = commit_two_pieces(c, 2);
    assert_int_equal(json_array_size(json_object_get(x, "tensors")), 2);
    json_t *t = json_array_get(json_object_get(x, "tensors"), 1); /* by group: optim/exp_avg, then params */
    assert_string_equal(json_string_value(json_object_get(t, "group")), "params");
    json_t *pc = json_array_get(json_object_get(t, "pieces"), 0);
    assert_string_equal(json_string_value(json_object_get(pc, "dataset")), "/params/model.embed_tokens.weight");
    assert_int_equal(json_integer_value(json_array_get(json_object_get(pc, "offset"), 0)), 4);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(pc, "shape"), 0)), 3);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(t, "shape"), 0)), 12);
    assert_true(json_equal(x, y));
    assert_true(json_equal(x, z)); /* the bad line's piece is not taken: the file was scanned */
    /* and with a note, its lines are what the manifest holds (the file is not read) */
    char d[300];
    snprintf(d, sizeof d, "%s/noted-other", root);
    json_t *o = commit_two_pieces(d, 3);
    const char *hex = json_string_value(json_object_get(
        json_array_get(json_object_get(json_array_get(json_object_get(o, "tensors"), 0), "pieces"), 0), "xxh64"));
    assert_string_equal(hex, "ffffffffffffffff");
    json_decref(o);
    json_decref(x);
    json_decref(y);
    json_decref(z);
    remove_tree(root);
}

/* ------------------------------------------------ the writer's batches of chunks */
/* Element e (C order) of tensor j: its own value, so that a chunk put in another place,
 * of another piece or file, shows. */
static float stream_value(int j, int64_t e) { return (float)(j * 1000003 + e % 1000003) * 0.25f; }

typedef struct {
    int j, ndim;
    int64_t gshape[2];
    int64_t fail_row; /* > 0: a fill of this row fails (of a 1-D tensor: any fill) */
} stream_src;

static shard_status stream_fill(void *ctx, const shard_box *sub, void *dst, shard_dtype dt)
{
    const stream_src *t = ctx;
    float *o = dst;
    assert_int_equal(dt, SHARD_DT_F32);
    if (t->fail_row > 0 && (t->ndim == 1 || (sub->off[0] <= t->fail_row && t->fail_row < sub->off[0] + sub->len[0])))
        return shard_fail(SHARD_E_IO, "t%02d: boom at row %lld", t->j, (long long)sub->off[0]);
    const int64_t cols = t->ndim == 2 ? t->gshape[1] : 1, r0 = t->ndim == 2 ? sub->off[0] : 0;
    const int64_t nr = t->ndim == 2 ? sub->len[0] : 1, c0 = t->ndim == 2 ? sub->off[1] : sub->off[0];
    const int64_t nc = t->ndim == 2 ? sub->len[1] : sub->len[0];
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++) *o++ = stream_value(t->j, (r0 + r) * cols + c0 + c);
    return SHARD_OK;
}

enum { STREAM_FILES = 3, STREAM_TENSORS = 40 };

/* The stream tests' case: their folder and tensors. Tensor j: mostly small 1-D ones (a
 * chunk of a few hundred bytes each: many to a batch), every 13th of 7 rows of 300 KB
 * (chunks of 3 rows, 900 KB: one to a batch, with small ones before it; a last chunk of
 * 1 row, batched with the next pieces' chunks). File f holds column block f of the 2-D
 * ones, the 1-D ones whole. */
typedef struct {
    char root[32];
    stream_src src[STREAM_TENSORS];
    char names[STREAM_TENSORS][32];
} stream_case;

static stream_case *stream_begin(void)
{
    static stream_case k;
    snprintf(k.root, sizeof k.root, "/tmp/smp-unit-XXXXXX");
    assert_non_null(mkdtemp(k.root));
    for (int j = 0; j < STREAM_TENSORS; j++) {
        k.src[j] = (stream_src){j, j % 13 == 5 ? 2 : 1, {j % 13 == 5 ? 7 : 40 + j, 75000 * STREAM_FILES}, 0};
        snprintf(k.names[j], sizeof k.names[j], "t%02d.weight", j);
    }
    return &k;
}

static const char *const STREAM_COMPS[2] = {"none", "zstd"};

/* The stream of every tensor's pieces into STREAM_FILES files in dir: its status (the
 * files closed, or on failure abandoned and removed). */
static shard_status stream_write(stream_case *k, const char *dir, const char *comp, int threads)
{
    shard_compress c;
    assert_int_equal(shard_compress_parse(comp, &c), SHARD_OK);
    c.threads = threads;
    c.no_fsync = 1;
    shard_h5_writer *w[STREAM_FILES];
    for (int f = 0; f < STREAM_FILES; f++) {
        char path[512];
        snprintf(path, sizeof path, "%.400s/shard-%05d.h5", dir, f);
        assert_int_equal(shard_h5_create(path, c, &w[f]), SHARD_OK);
    }
    static shard_h5_piece pcs[STREAM_TENSORS * STREAM_FILES];
    size_t n = 0;
    for (int j = 0; j < STREAM_TENSORS; j++) /* piece j of each file, then piece j + 1: as hf2smp lists them */
        for (int f = 0; f < STREAM_FILES; f++) {
            stream_src *t = &k->src[j];
            shard_box b = t->ndim == 2 ? (shard_box){2, {0, 75000 * f}, {7, 75000}} : (shard_box){1, {0}, {t->gshape[0]}};
            pcs[n++] = (shard_h5_piece){w[f], "params", k->names[j], SHARD_DT_F32, t->ndim, t->gshape, b, stream_fill, t};
        }
    const shard_status s = shard_h5_write_pieces(pcs, n, NULL, NULL);
    for (int f = 0; f < STREAM_FILES; f++) {
        if (s) shard_h5_abort(w[f]);
        else assert_int_equal(shard_h5_close(w[f]), SHARD_OK);
    }
    return s;
}

static char *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    *n = (size_t)ftell(f);
    rewind(f);
    char *b = malloc(*n + 1); /* room for a 0 after it */
    assert_non_null(b);
    assert_int_equal(fread(b, 1, *n, f), *n);
    fclose(f);
    return b;
}

/* What must not change with the threads or the time: shard file f / 2 of dir (f even),
 * or its note's piece lines (f odd: its first line names the file it describes, by
 * inode and time). Its *n bytes, to free. */
static char *stream_bytes(const char *dir, int f, size_t *n)
{
    char path[512];
    snprintf(path, sizeof path, "%.400s/shard-%05d.h5%s", dir, f / 2, f % 2 ? ".fhash" : "");
    char *b = slurp(path, n);
    if (f % 2) {
        b[*n] = 0;
        const char *lines = strchr(b, '\n');
        assert_non_null(lines);
        *n -= (size_t)(lines - b);
        memmove(b, lines, *n);
    }
    return b;
}

/* Every piece as HDF5 itself reads it (the zstd filter through HDF5's pipeline): its values. */
static void stream_check_values(const stream_case *k, const char *dir)
{
    static float got[7 * 75000];
    for (int f = 0; f < STREAM_FILES; f++) {
        char path[512], ds[64];
        snprintf(path, sizeof path, "%.400s/shard-%05d.h5", dir, f);
        hid_t h = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
        assert_true(h >= 0);
        for (int j = 0; j < STREAM_TENSORS; j++) {
            const stream_src *t = &k->src[j];
            snprintf(ds, sizeof ds, "/params/%.31s", k->names[j]);
            hid_t d = H5Dopen2(h, ds, H5P_DEFAULT);
            assert_true(d >= 0);
            assert_true(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, got) >= 0);
            H5Dclose(d);
            const int64_t rows = t->ndim == 2 ? 7 : 1, cols = t->ndim == 2 ? 75000 : t->gshape[0];
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++) {
                    const int64_t e = t->ndim == 2 ? r * t->gshape[1] + 75000 * f + c : c;
                    if (got[r * cols + c] != stream_value(j, e)) fail_msg("%s %s [%lld,%lld]", path, ds, (long long)r, (long long)c);
                }
        }
        H5Fclose(h);
    }
}

/* Batches of chunks (small pieces many to a batch, 900 KB chunks alone, a multi-chunk
 * piece's middle chunk and the first chunk that made its dataset in other batches),
 * written by 1 to 4 threads into 3 files, compressed or not: HDF5 reads every value in
 * its place, and the files and their notes are the same bytes whatever the threads and
 * the second they were written in. */
static void test_write_batches(void **st)
{
    (void)st;
    stream_case *k = stream_begin();
    for (int ci = 0; ci < 2; ci++) {
        char *first[STREAM_FILES * 2];
        size_t firstn[STREAM_FILES * 2];
        for (int threads = 1; threads <= 4; threads++) {
            char dir[400];
            snprintf(dir, sizeof dir, "%s/%s-%d", k->root, STREAM_COMPS[ci], threads);
            assert_int_equal(mkdir(dir, 0755), 0);
            if (threads == 2 && ci == 0) sleep(1); /* another second: HDF5 would stamp its groups with it */
            assert_int_equal(stream_write(k, dir, STREAM_COMPS[ci], threads), SHARD_OK);
            stream_check_values(k, dir);
            for (int f = 0; f < STREAM_FILES * 2 && threads > 1; f++) {
                size_t n;
                char *b = stream_bytes(dir, f, &n);
                if (n != firstn[f] || memcmp(b, first[f], n)) fail_msg("%s: file %d differs from 1 thread's", dir, f);
                free(b);
            }
            for (int f = 0; f < STREAM_FILES * 2 && threads == 1; f++) first[f] = stream_bytes(dir, f, &firstn[f]);
            if (threads > 1) remove_tree(dir);
        }
        for (int f = 0; f < STREAM_FILES * 2; f++) free(first[f]);
    }
    remove_tree(k->root);
}

/* A fill that fails in the middle of the stream (a small piece's, many to a batch; a
 * 900 KB middle chunk, whose piece's dataset another batch made), with 1 to 4 threads,
 * compressed or not: the stream stops with that failure and its message (no worker left
 * waiting for a turn), and the abandoned files are gone. */
static void test_write_batches_fail(void **st)
{
    (void)st;
    stream_case *k = stream_begin();
    const int bad[2] = {17, 18}; /* 1-D; 2-D (18 % 13 == 5), failing in its middle chunk (rows 3-5) */
    for (int ci = 0; ci < 2; ci++)
        for (int b = 0; b < 2; b++)
            for (int threads = 1; threads <= 4; threads++) {
                k->src[bad[b]].fail_row = b ? 4 : 1;
                char dir[400], want[64];
                snprintf(dir, sizeof dir, "%s/%s-%d-%d", k->root, STREAM_COMPS[ci], b, threads);
                assert_int_equal(mkdir(dir, 0755), 0);
                assert_int_equal(stream_write(k, dir, STREAM_COMPS[ci], threads), SHARD_E_IO);
                snprintf(want, sizeof want, "t%02d: boom at row %d", bad[b], b ? 3 : 0);
                if (!strstr(shard_errmsg(), want)) fail_msg("%s: \"%s\", not \"%s\"", dir, shard_errmsg(), want);
                k->src[bad[b]].fail_row = 0;
                assert_int_equal(rmdir(dir), 0); /* empty: every file removed */
            }
    remove_tree(k->root);
}

static void test_config_with_dtype(void **st)
{
    (void)st;
    char *o = NULL;
    assert_int_equal(shard_config_with_dtype("{\"eps\": 1e-05,\n  \"torch_dtype\": \"float32\"}", SHARD_DT_BF16, &o), SHARD_OK);
    assert_string_equal(o, "{\"eps\": 1e-05,\n  \"torch_dtype\": \"bfloat16\"}");
    free(o);
    assert_int_equal(shard_config_with_dtype("{\"dtype\" :\"float32\", \"torch_dtype\":\"float32\"}", SHARD_DT_F16, &o), SHARD_OK);
    assert_string_equal(o, "{\"dtype\" :\"float16\", \"torch_dtype\":\"float16\"}");
    free(o);
    /* nothing to change: the same dtype, no such key, a dtype config.json has no name for */
    assert_int_equal(shard_config_with_dtype("{\"torch_dtype\": \"bfloat16\"}", SHARD_DT_BF16, &o), SHARD_OK);
    assert_null(o);
    assert_int_equal(shard_config_with_dtype("{\"eps\": 1e-05}", SHARD_DT_BF16, &o), SHARD_OK);
    assert_null(o);
    assert_int_equal(shard_config_with_dtype("{\"torch_dtype\": \"float32\"}", SHARD_DT_I8, &o), SHARD_OK);
    assert_null(o);
    /* the key twice (a nested config): the whole object again, only the top level's changed */
    assert_int_equal(shard_config_with_dtype("{\"text_config\": {\"torch_dtype\": \"float32\"}, \"torch_dtype\": \"float32\"}",
                                             SHARD_DT_BF16, &o), SHARD_OK);
    assert_non_null(o);
    json_t *j = json_loads(o, 0, NULL);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_object_get(j, "torch_dtype")), "bfloat16");
    assert_string_equal(json_string_value(json_object_get(json_object_get(j, "text_config"), "torch_dtype")), "float32");
    assert_int_equal(o[strlen(o) - 1], '\n');
    json_decref(j);
    free(o);
    assert_int_equal(shard_config_with_dtype("[1]", SHARD_DT_BF16, &o), SHARD_E_INVALID);
    assert_null(o);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exit_codes), cmocka_unit_test(test_dtype_names), cmocka_unit_test(test_fp8_edges),
        cmocka_unit_test(test_paths), cmocka_unit_test(test_writer_contract), cmocka_unit_test(test_config_with_dtype),
        cmocka_unit_test(test_file_hash_and_note), cmocka_unit_test(test_commit_note_or_scan), cmocka_unit_test(test_manifest_tensors_read_again), cmocka_unit_test(test_fhash_stream), cmocka_unit_test(test_blockmap), cmocka_unit_test(test_flusher), cmocka_unit_test(test_chunk_xxh3_forms), cmocka_unit_test(test_chunk_xxh3_rows), cmocka_unit_test(test_chunk_xxh3_stream), cmocka_unit_test(test_hashes_leave_vector_state_clean), cmocka_unit_test(test_shuffle_forms), cmocka_unit_test(test_xxh64_forms), cmocka_unit_test(test_hash64_chain), cmocka_unit_test(test_write_batches), cmocka_unit_test(test_write_batches_fail),
    };
    return cmocka_run_group_tests_name("core", tests, NULL, NULL);
}
