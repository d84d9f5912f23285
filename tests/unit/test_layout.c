/* libshard layout: parsing layouts and stages, rank <-> coordinates, the checks
 * that refuse a layout a model cannot take, boxes and the partition rules. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "shard.h"

static shard_model_desc model(int64_t H, int64_t F, int64_t L, int64_t nH, int64_t nKV, int64_t hd, int64_t V, int tie)
{
    shard_model_desc d;
    memset(&d, 0, sizeof d);
    snprintf(d.architecture, sizeof d.architecture, "LlamaForCausalLM");
    snprintf(d.model_type, sizeof d.model_type, "llama");
    d.hidden = H; d.intermediate = F; d.layers = L; d.heads = nH; d.kv_heads = nKV; d.head_dim = hd; d.vocab = V;
    d.tie_word_embeddings = tie;
    return d;
}

static void test_parse_good(void **st)
{
    (void)st;
    shard_layout l;
    char buf[64];
    assert_int_equal(shard_layout_parse("pp=2,tp=4", &l), SHARD_OK);
    assert_int_equal(l.pp, 2); assert_int_equal(l.tp, 4); assert_int_equal(l.cp, 1); assert_int_equal(l.dp, 1);
    assert_string_equal(shard_layout_format(&l, buf, sizeof buf), "pp=2,tp=4,cp=1,dp=1");
    assert_int_equal(shard_layout_parse("dp=3,cp=2,tp=1,pp=5", &l), SHARD_OK);
    assert_string_equal(shard_layout_format(&l, buf, sizeof buf), "pp=5,tp=1,cp=2,dp=3");
    assert_int_equal(shard_layout_size(&l), 30);
    assert_int_equal(shard_layout_parse("tp=8", &l), SHARD_OK);
    assert_int_equal(l.tp, 8); assert_int_equal(l.pp, 1);
    assert_int_equal(shard_layout_parse("tp=65536,pp=16", &l), SHARD_OK); /* exactly 2^20 ranks */
    shard_layout back;
    assert_int_equal(shard_layout_parse(shard_layout_format(&l, buf, sizeof buf), &back), SHARD_OK);
    assert_memory_equal(&l, &back, sizeof l);
}

static void test_parse_bad(void **st)
{
    (void)st;
    static const struct { const char *text, *says; } bad[] = {
        {"pp=0", "at least 1"}, {"tp=2,tp=2", "tp is given twice"}, {"xx=1", "unknown key \"xx\""},
        {"tp=2,", "empty item"}, {"tp=1e3", "not a positive integer"}, {"tp=99999999", "exceeds 65536"},
        {"", "empty"}, {",tp=2", "empty item"}, {"tp=", "no value"}, {"tp", "not key=value"},
        {"tp=-1", "not a positive integer"}, {"tp=+2", "not a positive integer"}, {" tp=2", "unknown key"},
        {"tp=2 ", "not a positive integer"}, {"TP=2", "unknown key"}, {"tp=2,,pp=2", "empty item"},
        {"tp=65537", "exceeds 65536"}, {"pp=1024,tp=1024,cp=2", "2097152 ranks exceeds"},
        {"tp=2;pp=2", "not a positive integer"}, {"tp=0x10", "not a positive integer"},
        {"tp=999999999999999999999999", "exceeds 65536"}, {"pp=2=3", "not a positive integer"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        shard_layout l = {7, 7, 7, 7, 1};
        assert_int_equal(shard_layout_parse(bad[i].text, &l), SHARD_E_USAGE);
        const char *m = shard_errmsg();
        if (!strstr(m, bad[i].says) || strncmp(m, "layout \"", 8) != 0) fail_msg("\"%s\": message \"%s\"", bad[i].text, m);
        assert_int_equal(l.pp, 7); /* untouched on failure */
    }
}

static void test_rank_coords(void **st)
{
    (void)st;
    static const shard_layout ls[] = {{1, 1, 1, 1, 1}, {2, 4, 1, 1, 1}, {3, 2, 2, 2, 1}, {1, 8, 1, 3, 1}, {4, 1, 3, 1, 1}, {2, 3, 5, 7, 1}};
    for (size_t i = 0; i < sizeof ls / sizeof *ls; i++) {
        const shard_layout *l = &ls[i];
        int n = shard_layout_size(l);
        assert_int_equal(n, l->pp * l->tp * l->cp * l->dp);
        for (int r = 0; r < n; r++) {
            shard_coords c = shard_layout_coords(l, r);
            assert_true(c.pp >= 0 && c.pp < l->pp && c.tp >= 0 && c.tp < l->tp);
            assert_true(c.cp >= 0 && c.cp < l->cp && c.dp >= 0 && c.dp < l->dp);
            assert_int_equal(((c.pp * l->dp + c.dp) * l->cp + c.cp) * l->tp + c.tp, r);
            assert_int_equal(shard_layout_rank(l, c), r);
        }
        assert_int_equal(shard_layout_coords(l, n).pp, -1);
        assert_int_equal(shard_layout_coords(l, -1).tp, -1);
        shard_coords out = {0, l->tp, 0, 0};
        assert_int_equal(shard_layout_rank(l, out), -1);
    }
    /* tp is fastest, pp slowest */
    shard_layout l = {2, 4, 2, 2, 1};
    shard_coords c = shard_layout_coords(&l, 1);
    assert_int_equal(c.tp, 1);
    c = shard_layout_coords(&l, 4);
    assert_int_equal(c.tp, 0); assert_int_equal(c.cp, 1);
    c = shard_layout_coords(&l, 8);
    assert_int_equal(c.cp, 0); assert_int_equal(c.dp, 1);
    c = shard_layout_coords(&l, 16);
    assert_int_equal(c.dp, 0); assert_int_equal(c.pp, 1);
    shard_layout zero = {0, 1, 1, 1, 1};
    assert_int_equal(shard_layout_size(&zero), 0);
    assert_int_equal(shard_layout_coords(&zero, 0).pp, -1);
}

static void test_stages_explicit(void **st)
{
    (void)st;
    shard_model_desc d = model(64, 128, 8, 4, 4, 16, 100, 0);
    int s[8];
    assert_int_equal(shard_stages_parse("3,5", &d, 2, s), SHARD_OK);
    assert_int_equal(s[0], 3); assert_int_equal(s[1], 5);
    assert_int_equal(shard_stages_parse("8", &d, 1, s), SHARD_OK);
    assert_int_equal(shard_stages_parse("1,1,1,1,1,1,1,1", &d, 8, s), SHARD_OK);
    static const struct { const char *spec; int pp; const char *says; } bad[] = {
        {"3,4", 2, "hold 7 layers but the model has 8"}, {"8", 2, "1 stages given but pp=2"},
        {"0,8", 2, "stage 0 has no layers"}, {"4,4,", 2, "expected"}, {"4,,4", 2, "expected"},
        {"a,b", 2, "expected"}, {"4, 4", 2, "expected"}, {"-1,9", 2, "expected"}, {"2,2,4", 2, "more than pp=2"},
        {"", 2, "expected"}, {"9,-1", 2, "more than the model's 8 layers"}, {"4,4", 9, "exceeds the 8 layers"},
        {"4,4", 0, "out of range"}, {"99999999999999999999,1", 2, "more than the model's"}, {"Auto", 2, "expected"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(shard_stages_parse(bad[i].spec, &d, bad[i].pp, s), SHARD_E_USAGE);
        if (!strstr(shard_errmsg(), bad[i].says)) fail_msg("\"%s\": message \"%s\"", bad[i].spec, shard_errmsg());
    }
    s[0] = 42;
    assert_int_equal(shard_stages_parse("2,9", &d, 2, s), SHARD_E_USAGE);
    assert_int_equal(s[0], 42); /* untouched on failure */
    int lps[3] = {2, 5, 1};
    int want[8] = {0, 0, 1, 1, 1, 1, 1, 2};
    for (int l = 0; l < 8; l++) assert_int_equal(shard_stage_of_layer(lps, 3, l), want[l]);
    assert_int_equal(shard_stage_of_layer(lps, 3, 8), -1);
    assert_int_equal(shard_stage_of_layer(lps, 3, -1), -1);
}

static int sum(const int *s, int n)
{
    int t = 0;
    for (int i = 0; i < n; i++) t += s[i];
    return t;
}

static void test_stages_auto(void **st)
{
    (void)st;
    int s[64];
    /* The head (6 VH) outweighs the embedding (4 VH): the last stage takes fewer
     * layers. Layer cost 246272, embedding 512000, head 768256: [5,3] costs
     * max(1743360, 1507072); [4,4] would cost 1753344. */
    shard_model_desc d = model(64, 128, 8, 4, 4, 16, 2000, 0);
    assert_int_equal(shard_stages_parse("auto", &d, 2, s), SHARD_OK);
    assert_int_equal(s[0], 5); assert_int_equal(s[1], 3);
    /* Tiny vocabulary: ties broken towards fewer layers on earlier stages. */
    d = model(64, 128, 5, 4, 4, 16, 2, 0);
    assert_int_equal(shard_stages_auto(&d, 4, s), SHARD_OK);
    int tie[4] = {1, 1, 2, 1};
    assert_memory_equal(s, tie, sizeof tie);
    d = model(64, 128, 6, 4, 4, 16, 2, 0);
    assert_int_equal(shard_stages_auto(&d, 4, s), SHARD_OK);
    int mid[4] = {1, 2, 2, 1};
    assert_memory_equal(s, mid, sizeof mid);
    /* pp = layers: one each; pp = 1: all */
    for (int L = 1; L <= 40; L += 3) {
        d = model(48, 88, L, 6, 2, 8, 101, L % 2);
        for (int pp = 1; pp <= L && pp <= 16; pp++) {
            assert_int_equal(shard_stages_auto(&d, pp, s), SHARD_OK);
            assert_int_equal(sum(s, pp), L);
            for (int i = 0; i < pp; i++) assert_true(s[i] >= 1);
            if (pp == L) for (int i = 0; i < pp; i++) assert_int_equal(s[i], 1);
        }
        assert_int_equal(shard_stages_auto(&d, L + 1, s), SHARD_E_USAGE);
    }
    assert_int_equal(shard_stages_auto(&d, 0, s), SHARD_E_USAGE);
    assert_int_equal(shard_stages_auto(&d, SHARD_MAX_PP + 1, s), SHARD_E_USAGE);
    /* A Llama-3-8B-sized model balances without overflow. */
    d = model(4096, 14336, 32, 32, 8, 128, 128256, 0);
    assert_int_equal(shard_stages_auto(&d, 4, s), SHARD_OK);
    assert_int_equal(sum(s, 4), 32);
    assert_true(s[0] >= s[3]); /* the head weighs more than the embedding */
}

static void test_layout_check(void **st)
{
    (void)st;
    shard_model_desc d = model(64, 128, 4, 8, 2, 8, 100, 0);
    shard_layout l = {1, 3, 1, 1, 1};
    assert_int_equal(shard_layout_check(&l, &d), SHARD_E_USAGE);
    assert_string_equal(shard_errmsg(), "layout pp=1,tp=3,cp=1,dp=1: tp=3 does not divide the 8 attention heads");
    l.tp = 8; /* 4 kv heads each replicated 4x */
    assert_int_equal(shard_layout_check(&l, &d), SHARD_OK);
    l.tp = 2;
    assert_int_equal(shard_layout_check(&l, &d), SHARD_OK);
    l.pp = 5;
    assert_int_equal(shard_layout_check(&l, &d), SHARD_E_USAGE);
    assert_non_null(strstr(shard_errmsg(), "pp=5 exceeds the 4 layers"));
    l.pp = 4;
    assert_int_equal(shard_layout_check(&l, &d), SHARD_OK);
    shard_model_desc g = model(96, 128, 4, 12, 4, 8, 100, 0);
    shard_layout t6 = {1, 6, 1, 1, 1};
    assert_int_equal(shard_layout_check(&t6, &g), SHARD_E_USAGE);
    assert_non_null(strstr(shard_errmsg(), "tp=6 neither divides nor is a multiple of the 4 key/value heads"));
    shard_layout zero = {1, 1, 0, 1, 1};
    assert_int_equal(shard_layout_check(&zero, &d), SHARD_E_USAGE);
    assert_non_null(strstr(shard_errmsg(), "cp=0 is out of range"));
    shard_layout huge = {1, 1, 2048, 1024, 1};
    assert_int_equal(shard_layout_check(&huge, &d), SHARD_E_USAGE);
}

static void test_boxes(void **st)
{
    (void)st;
    shard_box a = {2, {0, 0}, {4, 6}}, b = {2, {2, 3}, {5, 5}}, o;
    assert_int_equal(shard_box_numel(&a), 24);
    assert_int_equal(shard_box_intersect(&a, &b, &o), 1);
    assert_int_equal(o.off[0], 2); assert_int_equal(o.len[0], 2);
    assert_int_equal(o.off[1], 3); assert_int_equal(o.len[1], 3);
    assert_int_equal(shard_box_intersect(&a, &b, &a), 1); /* out may alias */
    assert_int_equal(shard_box_numel(&a), 6);
    shard_box touch = {2, {4, 0}, {1, 6}}, c = {2, {0, 0}, {4, 6}};
    assert_int_equal(shard_box_intersect(&c, &touch, &o), 0); /* sharing an edge is no overlap */
    shard_box one = {1, {0}, {4}};
    assert_int_equal(shard_box_intersect(&c, &one, &o), 0);
    shard_box empty = {1, {3}, {0}};
    assert_int_equal(shard_box_numel(&empty), 0);
    assert_int_equal(shard_box_intersect(&one, &empty, &o), 0);
    shard_box scalar = {0, {0}, {0}};
    assert_int_equal(shard_box_numel(&scalar), 1);
}

/* shard_box_copy against the element-by-element definition: a 3-D x inside a
 * source and a destination box that both only partly overlap each other. */
static void test_box_copy(void **st)
{
    (void)st;
    const shard_box sb = {3, {1, 0, 2}, {3, 4, 5}}, db = {3, {2, 1, 0}, {4, 3, 9}}, x = {3, {2, 1, 3}, {2, 2, 3}};
    int32_t src[3 * 4 * 5], dst[4 * 3 * 9], want[4 * 3 * 9];
    for (int i = 0; i < 60; i++) src[i] = 1000 + i;
    for (int i = 0; i < 108; i++) dst[i] = want[i] = -1;
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < 3; c++) {
                const int g0 = 2 + a, g1 = 1 + b, g2 = 3 + c; /* global index */
                want[((g0 - 2) * 3 + (g1 - 1)) * 9 + g2] = src[((g0 - 1) * 4 + g1) * 5 + (g2 - 2)];
            }
    assert_int_equal(shard_box_copy(dst, SHARD_DT_I32, &db, src, SHARD_DT_I32, &sb, &x), SHARD_OK);
    assert_memory_equal(dst, want, sizeof want);
    const shard_box empty = {3, {2, 1, 3}, {2, 0, 3}}; /* nothing to copy: nothing written */
    int32_t before[108];
    memcpy(before, dst, sizeof dst);
    assert_int_equal(shard_box_copy(dst, SHARD_DT_I32, &db, src, SHARD_DT_I32, &sb, &empty), SHARD_OK);
    assert_memory_equal(dst, before, sizeof dst);
    /* 1-D, bf16 -> f32 on the way (1.0, 2.0, -0.5 ... as bf16 bits) */
    const shard_box one = {1, {5}, {3}}, s1 = {1, {4}, {6}}, d1 = {1, {5}, {3}};
    const uint16_t a1[6] = {0x3f80, 0x4000, 0xbf00, 0x4040, 0x4080, 0x40a0};
    float b1[3] = {0};
    assert_int_equal(shard_box_copy(b1, SHARD_DT_F32, &d1, a1, SHARD_DT_BF16, &s1, &one), SHARD_OK);
    assert_true(b1[0] == 2.0f && b1[1] == -0.5f && b1[2] == 3.0f);
    assert_int_equal(shard_box_copy(b1, SHARD_DT_I32, &d1, a1, SHARD_DT_BF16, &s1, &one), SHARD_E_USAGE);
}

static shard_piece piece(const shard_model_desc *d, const shard_layout *l, const int *lps, int role_index, int rank)
{
    shard_tensor_spec t;
    shard_model_tensor(d, (size_t)role_index, &t);
    shard_piece p;
    assert_int_equal(shard_partition(d, l, lps, &t, rank, &p), SHARD_OK);
    return p;
}

static void test_partition(void **st)
{
    (void)st;
    /* 8 heads, 2 kv heads, head_dim 8, vocab 5, tied; tp=4: kv heads twice each. */
    shard_model_desc d = model(64, 30, 2, 8, 2, 8, 5, 1);
    shard_layout l = {2, 4, 1, 2, 1};
    int lps[2] = {1, 1};
    /* tensor order: 0 embed; layer 0: 1 norm_attn, 2 q, 3 k, 4 v, 5 o, 6 norm_mlp, 7 gate, 8 up, 9 down */
    for (int r = 0; r < 4; r++) {
        shard_piece e = piece(&d, &l, lps, 0, r);
        int64_t off[4] = {0, 2, 4, 5}, len[4] = {2, 2, 1, 0};
        assert_int_equal(e.holds, 1);
        assert_int_equal(e.box.off[0], off[r]); assert_int_equal(e.box.len[0], len[r]);
        assert_int_equal(e.writes, r < 3); /* the empty block stores nothing */
        shard_piece k = piece(&d, &l, lps, 3, r);
        assert_int_equal(k.box.off[0], (r / 2) * 8); assert_int_equal(k.box.len[0], 8);
        assert_int_equal(k.writes, r % 2 == 0);
        shard_piece q = piece(&d, &l, lps, 2, r), o = piece(&d, &l, lps, 5, r);
        assert_int_equal(q.box.off[0], r * 16); assert_int_equal(q.box.len[0], 16);
        assert_int_equal(o.box.off[1], r * 16); assert_int_equal(o.box.len[1], 16);
        assert_int_equal(o.box.off[0], 0); assert_int_equal(o.box.len[0], 64);
        shard_piece n = piece(&d, &l, lps, 1, r);
        assert_int_equal(n.box.len[0], 64); assert_int_equal(n.writes, r == 0);
        shard_piece g = piece(&d, &l, lps, 7, r), dn = piece(&d, &l, lps, 9, r);
        assert_int_equal(g.box.off[0], r * 8); assert_int_equal(g.box.len[0], r < 3 ? 8 : 6);
        assert_int_equal(dn.box.off[1], r * 8); assert_int_equal(dn.box.len[1], r < 3 ? 8 : 6);
        /* layer 1 lives on stage 1 */
        assert_int_equal(piece(&d, &l, lps, 12, r).holds, 0);
        /* dp replica 1 (ranks 4..7) holds the same, writes nothing */
        shard_piece e1 = piece(&d, &l, lps, 0, r + 4);
        assert_int_equal(e1.holds, 1); assert_int_equal(e1.writes, 0);
        assert_memory_equal(&e1.box, &e.box, sizeof e.box);
        /* the last stage holds the tied embedding's copy, never writes it */
        shard_piece c = piece(&d, &l, lps, 0, r + 8);
        assert_int_equal(c.holds, 1); assert_int_equal(c.writes, 0);
        assert_memory_equal(&c.box, &e.box, sizeof e.box);
        shard_piece fin = piece(&d, &l, lps, 19, r + 8);
        assert_int_equal(fin.holds, 1); assert_int_equal(fin.writes, r == 0);
        assert_int_equal(piece(&d, &l, lps, 19, r).holds, 0);
    }
    shard_tensor_spec t;
    shard_piece p;
    shard_model_tensor(&d, 2, &t);
    assert_int_equal(shard_partition(&d, &l, lps, &t, 16, &p), SHARD_E_USAGE);
    assert_int_equal(shard_partition(&d, &l, lps, &t, -1, &p), SHARD_E_USAGE);
    int bad_lps[2] = {2, 0};
    assert_int_equal(shard_partition(&d, &l, bad_lps, &t, 0, &p), SHARD_E_USAGE);
    t.shape[0] = 63;
    assert_int_equal(shard_partition(&d, &l, lps, &t, 0, &p), SHARD_E_USAGE);
    shard_model_tensor(&d, 2, &t);
    t.layer = 2;
    assert_int_equal(shard_partition(&d, &l, lps, &t, 0, &p), SHARD_E_USAGE);
    shard_layout l3 = {1, 3, 1, 1, 1};
    int one[1] = {2};
    shard_model_tensor(&d, 2, &t);
    assert_int_equal(shard_partition(&d, &l3, one, &t, 0, &p), SHARD_E_USAGE);
    assert_non_null(strstr(shard_errmsg(), "does not divide the 8 attention heads"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_good),     cmocka_unit_test(test_parse_bad),   cmocka_unit_test(test_rank_coords),
        cmocka_unit_test(test_stages_explicit), cmocka_unit_test(test_stages_auto), cmocka_unit_test(test_layout_check),
        cmocka_unit_test(test_boxes),          cmocka_unit_test(test_box_copy),          cmocka_unit_test(test_partition),
    };
    return cmocka_run_group_tests_name("layout", tests, NULL, NULL);
}
