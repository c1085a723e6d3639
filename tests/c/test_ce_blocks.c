/*
 * test_ce_blocks.c -- the C harness for the cross-entropy row blocks: every
 * SIMD variant this CPU supports against the scalar reference, on row lengths
 * that hit every vector, block and tail edge, in float32, bfloat16 and
 * float16, with and without class weights and soft-capping, on the special
 * values the kernels must handle (-inf logits, fully -inf rows, NaN, +inf,
 * large offsets), and in place (dx == x). Exit status 0 = all passed.
 *
 *   built and run by tests/project/test_c_harness.py (make test)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "cross_entropy/blocks.h"
#include "common/isa.h"
#include "masked_attn.h"

#include "harness.h"

static int same_nan(double a, double b) { return isnan(a) == isnan(b); }

/* |a - b| <= atol + rtol |b|; NaN only with NaN, infinities only equal */
static int close_d(double a, double b, double rtol, double atol) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    if (isinf(a) || isinf(b)) return a == b;
    return fabs(a - b) <= atol + rtol * fabs(b);
}

static const char *dt_name(ma_dtype dt) { return dt == MA_F32 ? "f32" : dt == MA_BF16 ? "bf16" : "f16"; }

static size_t esize(ma_dtype dt) { return dt == MA_F32 ? 4 : 2; }

/* n values of kind `kind` stored as dtype dt */
enum { PLAIN, NEG_INF_SOME, ALL_NEG_INF, HAS_NAN, HAS_POS_INF, OFFSET, HUGE_RANGE, N_KINDS };
static const char *kind_name[] = {"plain", "-inf some", "all -inf", "NaN", "+inf", "offset 1e3", "range 200"};

static void fill(void *x, ma_dtype dt, int64_t n, int kind) {
    for (int64_t i = 0; i < n; i++) {
        float v = 4.0f * frand();
        if (kind == NEG_INF_SOME && i % 3 == 1) v = -INFINITY;
        if (kind == ALL_NEG_INF) v = -INFINITY;
        if (kind == OFFSET) v += 1000.0f;
        if (kind == HUGE_RANGE) v *= 50.0f;
        ma_store_f32(x, dt, i, v);
    }
    if (kind == HAS_NAN) ma_store_f32(x, dt, n / 2, NAN);
    if (kind == HAS_POS_INF) ma_store_f32(x, dt, (n * 2) / 3, INFINITY);
}

static void test_row_stats(const ma_ce_blocks *v) {
    static const int64_t lengths[] = {1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129,
                                      255, 256, 257, 1000, 4099, 32000};
    const ma_dtype dts[] = {MA_F32, MA_BF16, MA_F16};
    const float caps[] = {0.0f, 30.0f, 1.5f};
    for (size_t il = 0; il < sizeof lengths / sizeof lengths[0]; il++)
        for (int id = 0; id < 3; id++)
            for (int kind = 0; kind < N_KINDS; kind++)
                for (int ic = 0; ic < 3; ic++)
                    for (int weighted = 0; weighted < 2; weighted++) {
                        const int64_t n = lengths[il];
                        const ma_dtype dt = dts[id];
                        const float cap = caps[ic];
                        if (kind == OFFSET && dt == MA_F16) continue; /* 1e3 + x in float16: too coarse to mean much */
                        void *x = malloc(n * esize(dt)), *w = malloc(n * esize(dt));
                        fill(x, dt, n, kind);
                        for (int64_t i = 0; i < n; i++) ma_store_f32(w, dt, i, 0.25f + fabsf(frand()));
                        for (int want_dot = 0; want_dot < 2; want_dot++) {
                            const void *wp = weighted ? w : NULL;
                            const ma_ce_stats a = ma_ce_blocks_scalar.row_stats(x, wp, dt, n, cap, want_dot);
                            const ma_ce_stats b = v->row_stats(x, wp, dt, n, cap, want_dot);
                            /* lse = m + log l is what the kernels use */
                            const double lse_a = a.m + log(a.l), lse_b = b.m + log(b.l);
                            const double rtol = cap > 0 ? 2e-6 : 1e-6;
                            /* a +inf logit: the kernels turn m = +inf into a NaN lse */
                            CHECK(a.m == INFINITY ? b.m == INFINITY : close_d(lse_b, lse_a, rtol, 2e-6),
                                  "%s row_stats n=%ld %s %s cap=%g w=%d: lse %.9g vs %.9g (m %g vs %g)", v->name,
                                  (long)n, dt_name(dt), kind_name[kind], cap, weighted, lse_b, lse_a, b.m, a.m);
                            if (cap == 0.0f && !isnan(lse_a)) /* a NaN row's max is unspecified */
                                CHECK(b.m == a.m || (isnan(b.m) && isnan(a.m)), "%s max n=%ld %s %s: %g vs %g",
                                      v->name, (long)n, dt_name(dt), kind_name[kind], b.m, a.m);
                            if (!want_dot) continue;
                            CHECK(close_d(b.k_sum, a.k_sum, 1e-6, 0), "%s k_sum n=%ld %s: %g vs %g", v->name,
                                  (long)n, dt_name(dt), b.k_sum, a.k_sum);
                            /* sum_c w_c (lse - y_c) = k_sum log l - k_dot, the smoothing term */
                            const double sa = a.k_sum * log(a.l) - a.k_dot, sb = b.k_sum * log(b.l) - b.k_dot;
                            CHECK(close_d(sb, sa, 2e-6, 1e-5 * (1 + fabs(a.k_sum))) || (same_nan(sb, sa) && isnan(sa)),
                                  "%s smoothing term n=%ld %s %s cap=%g w=%d: %.9g vs %.9g", v->name, (long)n,
                                  dt_name(dt), kind_name[kind], cap, weighted, sb, sa);
                        }
                        free(x), free(w);
                    }
}

/* modes: 0 a separate, 64-byte aligned output, 1 in place (dx == x),
 * 2 an output misaligned by one element */
static const char *mode_name[] = {"separate", "in place", "misaligned"};

static void test_row_grad(const ma_ce_blocks *v) {
    static const int64_t lengths[] = {1, 3, 8, 9, 16, 17, 33, 100, 129, 1000};
    const ma_dtype dts[] = {MA_F32, MA_BF16, MA_F16};
    const float caps[] = {0.0f, 30.0f, 1.5f};
    for (size_t il = 0; il < sizeof lengths / sizeof lengths[0]; il++)
        for (int id = 0; id < 3; id++)
            for (int kind = 0; kind < N_KINDS; kind++)
                for (int ic = 0; ic < 3; ic++)
                    for (int weighted = 0; weighted < 2; weighted++)
                        for (int mode = 0; mode < 3; mode++) {
                            const int64_t n = lengths[il];
                            const ma_dtype dt = dts[id];
                            const float cap = caps[ic];
                            const size_t es = esize(dt), bytes = n * es + 128;
                            unsigned char *x = malloc(n * es), *w = malloc(n * es);
                            unsigned char *da = malloc(bytes), *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
                            unsigned char *db = buf + (mode == 2 ? es : 0);
                            fill(x, dt, n, kind);
                            for (int64_t i = 0; i < n; i++) ma_store_f32(w, dt, i, 0.25f + fabsf(frand()));
                            memset(da, 0x5a, bytes), memset(buf, 0x5a, bytes);
                            const ma_ce_stats st = ma_ce_blocks_scalar.row_stats(x, NULL, dt, n, cap, 0);
                            const float lse = (float)(st.m + log(st.l));
                            const float g_soft = 0.7f, g_w = weighted ? 0.01f : (n % 2 ? 0.02f : 0.0f);
                            const void *wp = weighted ? w : NULL;
                            ma_ce_blocks_scalar.row_grad(da, x, wp, dt, n, cap, lse, g_soft, g_w);
                            if (mode == 1) {
                                memcpy(db, x, n * es);
                                v->row_grad(db, db, wp, dt, n, cap, lse, g_soft, g_w);
                            } else {
                                v->row_grad(db, x, wp, dt, n, cap, lse, g_soft, g_w);
                            }
                            const double rtol = dt == MA_F32 ? (cap > 0 ? 4e-6 : 2e-6) : dt == MA_BF16 ? 8e-3 : 1e-3;
                            for (int64_t i = 0; i < n; i++) {
                                const double a = ma_load_f32(da, dt, i), b = ma_load_f32(db, dt, i);
                                CHECK(close_d(b, a, rtol, 1e-7), "%s row_grad n=%ld %s %s cap=%g w=%d %s i=%ld: %g vs %g",
                                      v->name, (long)n, dt_name(dt), kind_name[kind], cap, weighted, mode_name[mode],
                                      (long)i, b, a);
                            }
                            for (unsigned char *q = buf; q < db; q++)
                                CHECK(*q == 0x5a, "%s row_grad wrote before the row: n=%ld %s", v->name, (long)n,
                                      dt_name(dt));
                            for (int64_t i = n * (int64_t)es; i < n * (int64_t)es + 64; i++)
                                CHECK(db[i] == 0x5a, "%s row_grad wrote past the row: n=%ld %s %s", v->name, (long)n,
                                      dt_name(dt), mode_name[mode]);
                            free(x), free(w), free(da), free(buf);
                        }
}

/* The exp and tanh inside the blocks, on a fine grid: a single-element row
 * y gives lse = y exactly (l = 1), so row_grad with g_soft = 1 at lse = 0
 * returns exp(y) (times 1 - tanh^2 with a cap). */
static void test_functions(const ma_ce_blocks *v) {
    enum { N = 4001 };
    static float x[N], a[N], b[N];
    for (int i = 0; i < N; i++) x[i] = -100.0f + 100.0f * (float)i / (N - 1); /* exp: the range x - lse <= 0 */
    ma_ce_blocks_scalar.row_grad(a, x, NULL, MA_F32, N, 0.0f, 0.0f, 1.0f, 0.0f);
    v->row_grad(b, x, NULL, MA_F32, N, 0.0f, 0.0f, 1.0f, 0.0f);
    for (int i = 0; i < N; i++) {
        if (a[i] >= 2.3509887e-38f) /* below 2^-125 a variant may flush to 0 */
            CHECK(close_d(b[i], a[i], 4e-7, 0), "%s exp(%g) = %g, libm %g", v->name, x[i], b[i], a[i]);
        else
            CHECK(b[i] >= 0.0f && b[i] <= 2.36e-38f, "%s exp underflow at %g: %g", v->name, x[i], b[i]);
    }
    /* tanh through the cap: cap = 1, lse = cap * tanh(x) - 0 makes the exp 1,
     * leaving 1 - tanh(x)^2; compare tanh via the row stats' max instead */
    for (int i = 0; i < N; i++) x[i] = -12.0f + 24.0f * (float)i / (N - 1);
    for (int i = 0; i < N; i++) {
        const float cap = 7.0f;
        const ma_ce_stats sa = ma_ce_blocks_scalar.row_stats(x + i, NULL, MA_F32, 1, cap, 0);
        const ma_ce_stats sb = v->row_stats(x + i, NULL, MA_F32, 1, cap, 0);
        CHECK(close_d(sb.m, sa.m, 3e-7, 1e-7 * cap), "%s cap tanh(%g): %.9g vs %.9g", v->name, x[i], sb.m, sa.m);
    }
}

int main(void) {
    rng = 2024u;
    const struct {
        ma_isa isa;
        const ma_ce_blocks *blocks;
        int sve_bits; /* sve's instances: the vector length each is for */
    } variants[] = {
        {MA_ISA_SCALAR, &ma_ce_blocks_scalar},
#if defined(__x86_64__) || defined(__i386__)
        {MA_ISA_AVX2, &ma_ce_blocks_avx2},
        {MA_ISA_AVX512, &ma_ce_blocks_avx512},
#elif defined(__aarch64__)
        {MA_ISA_NEON, &ma_ce_blocks_neon},
        {MA_ISA_SVE, &ma_ce_blocks_sve128, 128},
        {MA_ISA_SVE, &ma_ce_blocks_sve256, 256},
        {MA_ISA_SVE, &ma_ce_blocks_sve512, 512},
        {MA_ISA_SVE, &ma_ce_blocks_sve1024, 1024},
        {MA_ISA_SVE, &ma_ce_blocks_sve2048, 2048},
#endif
    };
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
        if (!ma_isa_available(variants[i].isa) || (variants[i].sve_bits && variants[i].sve_bits != ma_sve_bits())) {
            printf("%-7s not supported by this CPU, skipped\n", variants[i].blocks->name);
            continue;
        }
        const int before = failures;
        test_row_stats(variants[i].blocks);
        test_row_grad(variants[i].blocks);
        test_functions(variants[i].blocks);
        printf("%-7s %s\n", variants[i].blocks->name, failures == before ? "ok" : "FAILED");
    }
    return failures ? 1 : 0;
}
