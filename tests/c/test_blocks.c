/*
 * test_blocks.c -- the C harness: every SIMD variant of the attention
 * building blocks this CPU supports, against the scalar reference, on sizes
 * that hit every vector and micro-tile edge and on the special values
 * (-inf, NaN, huge) the kernels rely on. Exit status 0 = all passed.
 *
 *   built and run by tests/project/test_c_harness.py (make test)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/blocks.h"
#include "common/dtype.h"
#include "common/isa.h"
#include "masked_attn.h"

#include "harness.h"

static int close_enough(float a, float b, float rtol, float atol) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    if (isinf(a) || isinf(b)) return a == b;
    return fabsf(a - b) <= atol + rtol * fabsf(b);
}

/* B (k, n) copied to rows WIDE_LDB floats (512 bytes) apart, the stride of
 * D = 128 rows, which the AVX2 GEMM reads through a packed copy */
#define WIDE_LDB 128
static float *wide_rows(const float *B, int64_t k, int64_t n, int64_t ldb) {
    float *w = malloc(sizeof(float) * k * WIDE_LDB);
    for (int64_t x = 0; x < k * WIDE_LDB; x++) w[x] = NAN; /* never read: NaN would show */
    for (int64_t p = 0; p < k; p++) memcpy(w + p * WIDE_LDB, B + p * ldb, sizeof(float) * n);
    return w;
}

/* rtol: 1e-5 for float32 FMAs and the 6-product AMX split, 1e-4 for the 3-product one */
static void test_gemm(const ma_blocks *v, float rtol) {
    static const int64_t sizes[] = {1, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 64, 65};
    const int ns = (int)(sizeof sizes / sizeof sizes[0]);
    for (int im = 0; im < ns; im++)
        for (int in = 0; in < ns; in++)
            for (int64_t k = 1; k <= 133; k += 33) /* 133: more than one packed chunk of AMX */
                for (int trans = 0; trans < 2; trans++)
                    for (int accumulate = 0; accumulate < 2; accumulate++) {
                        const int64_t m = sizes[im], n = sizes[in], ldc = n + 3, ldb = n + 1;
                        float *A = malloc(sizeof(float) * m * k), *B = malloc(sizeof(float) * k * ldb);
                        float *C0 = malloc(sizeof(float) * m * ldc), *C1 = malloc(sizeof(float) * m * ldc);
                        for (int64_t x = 0; x < m * k; x++) A[x] = frand();
                        for (int64_t x = 0; x < k * ldb; x++) B[x] = frand();
                        float *Cin = malloc(sizeof(float) * m * ldc);
                        for (int64_t x = 0; x < m * ldc; x++) Cin[x] = C0[x] = C1[x] = frand();
                        const int64_t ars = trans ? 1 : k, acs = trans ? m : 1;
                        ma_blocks_scalar.gemm(m, n, k, A, ars, acs, B, ldb, C0, ldc, accumulate);
                        v->gemm(m, n, k, A, ars, acs, B, ldb, C1, ldc, accumulate);
                        /* B rows 512 bytes apart (AVX2 copies such panels first): the same bits */
                        float *Bw = wide_rows(B, k, n, ldb), *C2 = malloc(sizeof(float) * m * ldc);
                        memcpy(C2, Cin, sizeof(float) * m * ldc);
                        v->gemm(m, n, k, A, ars, acs, Bw, WIDE_LDB, C2, ldc, accumulate);
                        CHECK(memcmp(C1, C2, sizeof(float) * m * ldc) == 0,
                              "%s gemm m=%ld n=%ld k=%ld trans=%d acc=%d: ldb %d differs from ldb %ld", v->name,
                              (long)m, (long)n, (long)k, trans, accumulate, WIDE_LDB, (long)ldb);
                        free(Bw), free(C2);
                        for (int64_t i = 0; i < m; i++)
                            for (int64_t j = 0; j < ldc; j++) {
                                const float a = C1[i * ldc + j], b = C0[i * ldc + j];
                                if (j < n)
                                    CHECK(close_enough(a, b, rtol, rtol),
                                          "%s gemm m=%ld n=%ld k=%ld trans=%d acc=%d C[%ld,%ld] %g vs %g", v->name,
                                          (long)m, (long)n, (long)k, trans, accumulate, (long)i, (long)j, a, b);
                                else /* padding columns of C are never touched */
                                    CHECK(a == b, "%s gemm wrote past n: m=%ld n=%ld", v->name, (long)m, (long)n);
                            }
                        free(A), free(B), free(C0), free(C1), free(Cin);
                    }
}

/* gemm_rowscale: C = diag(rs) C + A B, bit for bit what a rescaling pass
 * followed by the same variant's accumulating gemm gives (the forward's
 * O = alpha O + P V must not depend on whether the variant fuses it), and
 * close to the scalar reference. rs has 1s (rows left alone), 0s (a row
 * whose running max was -inf), NaN-free values below 1; NULL = no rescale. */
static void test_gemm_rowscale(const ma_blocks *v) {
    static const int64_t sizes[] = {1, 5, 6, 7, 8, 13, 16, 31, 33, 64, 65, 128};
    const int ns = (int)(sizeof sizes / sizeof sizes[0]);
    for (int im = 0; im < ns; im++)
        for (int in = 0; in < ns; in++)
            for (int64_t k = 1; k <= 65; k += 32)
                for (int with_rs = 0; with_rs < 2; with_rs++) {
                    const int64_t m = sizes[im], n = sizes[in], ldc = n + 3, ldb = n + 1, ars = 1, acs = m;
                    float *A = malloc(sizeof(float) * m * k), *B = malloc(sizeof(float) * k * ldb);
                    float *C0 = malloc(sizeof(float) * m * ldc), *C1 = malloc(sizeof(float) * m * ldc);
                    float *C2 = malloc(sizeof(float) * m * ldc), *rs = malloc(sizeof(float) * m);
                    for (int64_t x = 0; x < m * k; x++) A[x] = frand();
                    for (int64_t x = 0; x < k * ldb; x++) B[x] = frand();
                    float *Cin = malloc(sizeof(float) * m * ldc);
                    for (int64_t x = 0; x < m * ldc; x++) Cin[x] = C0[x] = C1[x] = C2[x] = frand();
                    for (int64_t i = 0; i < m; i++)
                        rs[i] = i % 3 == 0 ? 1.0f : i % 7 == 1 ? 0.0f : 0.5f + 0.4f * frand();
                    const float *r = with_rs ? rs : NULL;
                    ma_blocks_scalar.gemm_rowscale(m, n, k, A, ars, acs, B, ldb, C0, ldc, r);
                    v->gemm_rowscale(m, n, k, A, ars, acs, B, ldb, C1, ldc, r);
                    for (int64_t i = 0; i < m; i++) /* the separate pass */
                        for (int64_t j = 0; j < n; j++) C2[i * ldc + j] *= r ? r[i] : 1.0f;
                    v->gemm(m, n, k, A, ars, acs, B, ldb, C2, ldc, 1);
                    if (n <= WIDE_LDB) { /* B rows 512 bytes apart: the same bits */
                        float *Bw = wide_rows(B, k, n, ldb), *C3 = malloc(sizeof(float) * m * ldc);
                        memcpy(C3, Cin, sizeof(float) * m * ldc);
                        v->gemm_rowscale(m, n, k, A, ars, acs, Bw, WIDE_LDB, C3, ldc, r);
                        CHECK(memcmp(C1, C3, sizeof(float) * m * ldc) == 0,
                              "%s gemm_rowscale m=%ld n=%ld k=%ld rs=%d: ldb %d differs from ldb %ld", v->name, (long)m,
                              (long)n, (long)k, with_rs, WIDE_LDB, (long)ldb);
                        free(Bw), free(C3);
                    }
                    for (int64_t i = 0; i < m; i++)
                        for (int64_t j = 0; j < ldc; j++) {
                            const float a = C1[i * ldc + j];
                            CHECK(memcmp(&a, &C2[i * ldc + j], sizeof a) == 0,
                                  "%s gemm_rowscale m=%ld n=%ld k=%ld rs=%d C[%ld,%ld] %g vs pass + gemm %g", v->name,
                                  (long)m, (long)n, (long)k, with_rs, (long)i, (long)j, a, C2[i * ldc + j]);
                            if (j < n)
                                CHECK(close_enough(a, C0[i * ldc + j], 1e-5f, 1e-5f),
                                      "%s gemm_rowscale m=%ld n=%ld k=%ld C[%ld,%ld] %g vs scalar %g", v->name, (long)m,
                                      (long)n, (long)k, (long)i, (long)j, a, C0[i * ldc + j]);
                        }
                    free(A), free(B), free(C0), free(C1), free(C2), free(rs), free(Cin);
                }
}

static void test_exp(const ma_blocks *v) {
    /* the exp itself, over the range softmax uses (x - max <= 0) and beyond */
    enum { N = 4001 };
    static float x0[N], x1[N];
    for (int i = 0; i < N; i++) x0[i] = x1[i] = -110.0f + 120.0f * (float)i / (N - 1);
    const float s0 = ma_blocks_scalar.exp_sub_sum(x0, N, 0.0f), s1 = v->exp_sub_sum(x1, N, 0.0f);
    for (int i = 0; i < N; i++) {
        const float ref = expf(-110.0f + 120.0f * (float)i / (N - 1));
        if (ref >= 2.3509887e-38f) /* 2^-125 on: a few ulp */
            CHECK(close_enough(x1[i], ref, 4e-7f, 0.0f), "%s exp(%g) = %g, libm %g", v->name,
                  -110.0f + 120.0f * (float)i / (N - 1), x1[i], ref);
        else /* below 2^-125 a variant may flush to 0 (AVX2's vf_exp from 2^-125.5, AVX-512's from FLT_MIN) */
            CHECK(x1[i] >= 0.0f && x1[i] <= 2.36e-38f, "%s exp underflow %g", v->name, x1[i]);
    }
    CHECK(close_enough(s1, s0, 1e-5f, 0.0f), "%s exp_sub_sum sum %g vs %g", v->name, s1, s0);

    /* special values: exp(-inf) = 0 exactly, NaN propagates; every length */
    for (int64_t n = 1; n <= 40; n++) {
        float a[40], b[40];
        for (int64_t i = 0; i < n; i++) a[i] = b[i] = (i % 3 == 0) ? -INFINITY : frand() * 5.0f;
        const float sa = ma_blocks_scalar.exp_sub_sum(a, n, 1.5f), sb = v->exp_sub_sum(b, n, 1.5f);
        for (int64_t i = 0; i < n; i++) {
            if (i % 3 == 0) CHECK(b[i] == 0.0f, "%s exp(-inf) = %g", v->name, b[i]);
            else CHECK(close_enough(b[i], a[i], 1e-6f, 0.0f), "%s n=%ld i=%ld", v->name, (long)n, (long)i);
        }
        CHECK(close_enough(sb, sa, 1e-5f, 0.0f), "%s exp_sub_sum n=%ld sum %g vs %g", v->name, (long)n, sb, sa);
        b[n / 2] = NAN;
        CHECK(isnan(v->exp_sub_sum(b, n, 0.0f)), "%s NaN did not propagate to the sum", v->name);
    }
}

static void test_softcap(const ma_blocks *v) {
    /* cap tanh(s / cap) against tanh in double, over scores from 0 through the polynomial's
     * edge (|s / cap| = 0.625) to saturation, both signs; every length for the tails */
    enum { N = 8001 };
    static float s[N], th[N];
    const float cap = 30.0f, inv = 1.0f / 30.0f;
    for (int i = 0; i < N; i++) s[i] = -3000.0f + 6000.0f * (float)i / (N - 1) * ((i % 7) ? 0.01f : 1.0f);
    float in[N];
    memcpy(in, s, sizeof s);
    v->softcap(s, N, cap, inv, th);
    for (int i = 0; i < N; i++) {
        const double ref = tanh((double)(in[i] * inv));
        CHECK(fabs(th[i] - ref) <= 2.4e-7 * fabs(ref) + 1e-37, "%s tanh(%g) = %.9g, libm %.9g", v->name,
              (double)(in[i] * inv), th[i], ref);
        CHECK(s[i] == cap * th[i], "%s softcap %g != cap * tanh %g", v->name, s[i], cap * th[i]);
    }
    /* vectors whose lanes are all below the edge (the polynomial alone), then the same with
     * one lane past it (or NaN) at each position of a 16-lane vector: that lane takes the exp
     * branch, the others keep the polynomial's value */
    for (int big = -1; big < 16; big++) {
        float a[64], b[64], t[64];
        for (int i = 0; i < 64; i++) a[i] = b[i] = frand() * 0.62f * cap; /* |s / cap| < 0.62 */
        if (big >= 0)
            for (int i = big; i < 64; i += 16) a[i] = b[i] = (i & 32) ? NAN : (i & 1 ? -1.0f : 1.0f) * 0.9f * cap;
        v->softcap(b, 64, cap, inv, t);
        for (int i = 0; i < 64; i++) {
            const double ref = tanh((double)(a[i] * inv));
            CHECK(isnan(a[i]) ? isnan(t[i]) : fabs(t[i] - ref) <= 2.4e-7 * fabs(ref) + 1e-37,
                  "%s tanh(%g) = %.9g, libm %.9g (lane %d past the edge)", v->name, (double)(a[i] * inv), t[i], ref,
                  big);
        }
    }
    for (int64_t n = 1; n <= 40; n++) {
        float a[40], b[40], t[41];
        for (int64_t i = 0; i < n; i++)
            a[i] = b[i] = (i % 5 == 0) ? -INFINITY : (i % 5 == 1) ? INFINITY : frand() * 80.0f;
        t[n] = 12345.0f;
        ma_blocks_scalar.softcap(a, n, cap, inv, NULL);
        v->softcap(b, n, cap, inv, t);
        for (int64_t i = 0; i < n; i++)
            CHECK(close_enough(b[i], a[i], 2.4e-7f, 1e-30f), "%s softcap n=%ld i=%ld %g vs %g", v->name, (long)n,
                  (long)i, b[i], a[i]);
        CHECK(t[n] == 12345.0f, "%s softcap wrote past n=%ld", v->name, (long)n);
        b[n / 2] = NAN;
        v->softcap(b, n, cap, inv, NULL);
        CHECK(isnan(b[n / 2]), "%s softcap lost a NaN", v->name);
    }
}

static void test_columns(const ma_blocks *v) {
    for (int64_t rows = 1; rows <= 9; rows += 4)
        for (int64_t n = 1; n <= 40; n++) {
            float x0[9 * 40], x1[9 * 40], m0[40], m1[40], s0[40], s1[40];
            for (int64_t i = 0; i < rows * n; i++) x0[i] = x1[i] = frand() * 30.0f;
            for (int64_t r = 0; r < n; r++) {
                m0[r] = m1[r] = (r % 4 == 0) ? -INFINITY : frand();
                s0[r] = s1[r] = 1.0f;
            }
            for (int64_t c = 0; c < rows; c++) x0[c * n] = x1[c * n] = -INFINITY; /* a fully masked column */
            if (n > 2) x0[(rows - 1) * n + 2] = x1[(rows - 1) * n + 2] = NAN;
            ma_blocks_scalar.col_max(x0, rows, n, m0);
            v->col_max(x1, rows, n, m1);
            for (int64_t r = 0; r < n; r++)
                CHECK(m1[r] == m0[r] || (isnan(m1[r]) && isnan(m0[r])), "%s col_max rows=%ld n=%ld r=%ld %g vs %g",
                      v->name, (long)rows, (long)n, (long)r, m1[r], m0[r]);
            ma_blocks_scalar.exp_sub_col(x0, rows, n, m0, s0);
            v->exp_sub_col(x1, rows, n, m1, s1);
            for (int64_t i = 0; i < rows * n; i++)
                CHECK(close_enough(x1[i], x0[i], 1e-6f, 1e-30f), "%s exp_sub_col rows=%ld n=%ld i=%ld %g vs %g",
                      v->name, (long)rows, (long)n, (long)i, x1[i], x0[i]);
            for (int64_t r = 0; r < n; r++)
                CHECK(close_enough(s1[r], s0[r], 1e-5f, 0.0f), "%s exp_sub_col sum r=%ld %g vs %g", v->name, (long)r,
                      s1[r], s0[r]);
            CHECK(x1[0] == 0.0f && s1[0] == 1.0f, "%s fully masked column: p %g, sum %g", v->name, x1[0], s1[0]);
        }
}

static void test_transpose(const ma_blocks *v) {
    static const int64_t sizes[] = {1, 3, 15, 16, 17, 31, 32, 33, 64, 65};
    const int ns = (int)(sizeof sizes / sizeof sizes[0]);
    for (int ir = 0; ir < ns; ir++)
        for (int ic = 0; ic < ns; ic++) {
            const int64_t nr = sizes[ir], ncol = sizes[ic], lds = ncol + 5;
            float *src = malloc(sizeof(float) * nr * lds);
            float *d0 = malloc(sizeof(float) * (ncol * nr + 16)), *d1 = malloc(sizeof(float) * (ncol * nr + 16));
            for (int64_t x = 0; x < nr * lds; x++) src[x] = frand();
            for (int64_t x = 0; x < ncol * nr + 16; x++) d0[x] = d1[x] = 7.0f;
            ma_blocks_scalar.transpose(d0, src, lds, nr, ncol, 0.5f);
            v->transpose(d1, src, lds, nr, ncol, 0.5f);
            for (int64_t x = 0; x < ncol * nr + 16; x++)
                CHECK(d0[x] == d1[x], "%s transpose nr=%ld ncol=%ld at %ld: %g vs %g", v->name, (long)nr, (long)ncol,
                      (long)x, d1[x], d0[x]);
            free(src), free(d0), free(d1);
        }
}

/* dot_rows' order (blocks.h): W = v->dot_rows_w partial sums, partial j the terms
 * d = j (mod W) in order, folded in halves; each term one FMA (fmaf: exact) in a SIMD
 * variant, a product and a sum in the scalar one (compiled without FMA contraction). */
static float rows_expect(const ma_blocks *v, const float *q, const float *k, int64_t D) {
    const int fma = strcmp(v->name, "scalar") != 0, W = v->dot_rows_w;
    float p[16] = {0};
    for (int64_t d = 0; d < D; d++) p[d % W] = fma ? fmaf(q[d], k[d], p[d % W]) : p[d % W] + q[d] * k[d];
    for (int w = W; w > 1; w /= 2)
        for (int t = 0; t < w / 2; t++) p[t] += p[t + w / 2];
    return p[0];
}

/* The short-query blocks: row_max against the scalar one (exact, NaN
 * included); dot_rows bit for bit its order (rows_expect); dot_keys_t and
 * axpy_keys bit for bit equal to the variant's own GEMM on the same operands
 * (a K^T page's decode row gets the tile's value), for float32 keys, and on
 * bfloat16 and float16 keys bit for bit equal to float32 keys of the same
 * values. */
static void test_rows(const ma_blocks *v) {
    static const int64_t ns[] = {1, 5, 15, 16, 17, 33, 64};
    static const int64_t ds[] = {1, 7, 16, 17, 64, 80, 128, 256};
    static const int64_t nrs[] = {1, 2, 3, 4, 5, 7, 8, 16}; /* query rows: the tiles' shapes and their edges */
    CHECK(v->dot_rows_w >= 1 && v->dot_rows_w <= 16 && (v->dot_rows_w & (v->dot_rows_w - 1)) == 0,
          "%s dot_rows_w %d: a power of 2 up to 16", v->name, v->dot_rows_w);
    for (int in = 0; in < 7; in++) { /* row_max */
        const int64_t n = ns[in];
        float x[64];
        for (int64_t c = 0; c < n; c++) x[c] = frand();
        CHECK(v->row_max(x, n, -INFINITY) == ma_blocks_scalar.row_max(x, n, -INFINITY), "%s row_max n=%ld", v->name,
              (long)n);
        CHECK(v->row_max(x, n, 5.0f) == 5.0f, "%s row_max keeps m n=%ld", v->name, (long)n);
        x[n / 2] = NAN;
        CHECK(isnan(v->row_max(x, n, -INFINITY)), "%s row_max lost a NaN n=%ld", v->name, (long)n);
        x[n / 2] = 0;
        CHECK(isnan(v->row_max(x, n, NAN)), "%s row_max lost a NaN m n=%ld", v->name, (long)n);
    }
    for (int inc = 0; inc < 7; inc++)
        for (int id = 0; id < 8; id++)
            for (int inr = 0; inr < 8; inr++) {
                /* rows one after another (ld = D) and apart */
                const int64_t nc = ns[inc], D = ds[id], ld = D + 3 * (inc % 2), lds = nc + 2, nr = nrs[inr];
                float *k = malloc(sizeof(float) * nc * ld), *q = malloc(sizeof(float) * nr * D);
                float *qT = malloc(sizeof(float) * D * nr), *sT = malloc(sizeof(float) * nc * nr);
                float *s = malloc(sizeof(float) * nr * lds), *s2 = malloc(sizeof(float) * nr * lds);
                uint16_t *kb = malloc(sizeof(uint16_t) * nc * ld), *kh = malloc(sizeof(uint16_t) * nc * ld);
                for (int64_t x = 0; x < nc * ld; x++) {
                    kb[x] = ma_f32_to_bf16(frand()); /* the same values as bfloat16, float16 and float32 */
                    kh[x] = ma_f32_to_f16(ma_bf16_to_f32(kb[x]));
                    k[x] = ma_bf16_to_f32(kb[x]);
                }
                for (int64_t r = 0; r < nr; r++)
                    for (int64_t d = 0; d < D; d++) qT[d * nr + r] = q[r * D + d] = frand();
                v->gemm(nc, nr, D, k, ld, 1, qT, nr, sT, nr, 0); /* the tiles' scores, transposed */
                for (int64_t x = 0; x < nr * lds; x++) s[x] = s2[x] = 7.0f;
                v->dot_rows(s2, lds, q, nr, D, k, MA_F32, 0, ld, nc, 64 * ld);
                for (int64_t r = 0; r < nr; r++)
                    for (int64_t c = 0; c < lds; c++) {
                        const float want = c < nc ? rows_expect(v, q + r * D, k + c * ld, D) : 7.0f;
                        CHECK(s2[r * lds + c] == want, "%s dot_rows nr=%ld nc=%ld D=%ld s[%ld,%ld] %g vs %g", v->name,
                              (long)nr, (long)nc, (long)D, (long)r, (long)c, s2[r * lds + c], want);
                    }
                float *s3 = malloc(sizeof(float) * nr * lds);
                for (int64_t x = 0; x < nr * lds; x++) s3[x] = 7.0f;
                v->dot_rows(s3, lds, q, nr, D, kb, MA_BF16, 0, ld, nc, 0);
                CHECK(memcmp(s2, s3, sizeof(float) * nr * lds) == 0, "%s dot_rows bfloat16 nr=%ld nc=%ld D=%ld",
                      v->name, (long)nr, (long)nc, (long)D);
                v->dot_rows(s3, lds, q, nr, D, kh, MA_F16, 0, ld, nc, D);
                CHECK(memcmp(s2, s3, sizeof(float) * nr * lds) == 0, "%s dot_rows float16 nr=%ld nc=%ld D=%ld", v->name,
                      (long)nr, (long)nc, (long)D);
                free(s3);
                for (int64_t r = 0; r < nr; r++) /* the tiles' scores as rows, for dot_keys_t and axpy_keys */
                    for (int64_t c = 0; c < nc; c++) s[r * lds + c] = sT[c * nr + r];
                { /* the same keys stored transposed (a K^T page, keys ldt = nc + 5 apart per element) */
                    const int64_t ldt = nc + 5;
                    float *kt = malloc(sizeof(float) * D * ldt);
                    uint16_t *ktb = malloc(sizeof(uint16_t) * D * ldt), *kth = malloc(sizeof(uint16_t) * D * ldt);
                    for (int64_t c = 0; c < nc; c++)
                        for (int64_t d = 0; d < D; d++)
                            kt[d * ldt + c] = k[c * ld + d], ktb[d * ldt + c] = kb[c * ld + d],
                                         kth[d * ldt + c] = kh[c * ld + d];
                    const ma_dtype dts[3] = {MA_F32, MA_BF16, MA_F16};
                    const void *kts[3] = {kt, ktb, kth};
                    for (int t = 0; t < 3; t++) {
                        for (int64_t x = 0; x < nr * lds; x++) s2[x] = 7.0f;
                        for (int64_t r = 0; r < nr; r += 8) /* (8 rows a call at most: blocks.h) */
                            v->dot_keys_t(s2 + r * lds, lds, q + r * D, ma_min(8, nr - r), D, kts[t], dts[t], 0, ldt,
                                          nc, t == 0 ? 64 : 0);
                        CHECK(memcmp(s, s2, sizeof(float) * nr * lds) == 0,
                              "%s dot_keys_t dtype %d nr=%ld nc=%ld D=%ld", v->name, (int)dts[t], (long)nr, (long)nc,
                              (long)D);
                    }
                    free(kt), free(ktb), free(kth);
                }
                /* o += P V with the keys as rows of V (Dv = D): against the GEMM with P transposed */
                float *o = malloc(sizeof(float) * nr * D), *o2 = malloc(sizeof(float) * nr * D);
                float *o3 = malloc(sizeof(float) * nr * D);
                for (int64_t x = 0; x < nr * D; x++) o[x] = o2[x] = o3[x] = frand();
                v->gemm(nr, D, nc, sT, 1, nr, k, ld, o, D, 1);
                v->axpy_keys(o2, s, lds, nr, D, k, MA_F32, 0, ld, nc, 64 * ld, NULL);
                CHECK(memcmp(o, o2, sizeof(float) * nr * D) == 0, "%s axpy_keys nr=%ld nc=%ld Dv=%ld", v->name,
                      (long)nr, (long)nc, (long)D);
                { /* with lsum: the same o, and lsum[r] += each p in key order, from what it held */
                    float ls[16], want[16];
                    for (int64_t r = 0; r < nr; r++) {
                        ls[r] = want[r] = frand();
                        for (int64_t c = 0; c < nc; c++) want[r] += s[r * lds + c];
                    }
                    v->axpy_keys(o3, s, lds, nr, D, kb, MA_BF16, 0, ld, nc, 0, ls);
                    CHECK(memcmp(ls, want, sizeof(float) * nr) == 0, "%s axpy_keys lsum nr=%ld nc=%ld Dv=%ld", v->name,
                          (long)nr, (long)nc, (long)D);
                }
                CHECK(memcmp(o, o3, sizeof(float) * nr * D) == 0, "%s axpy_keys bfloat16 nr=%ld nc=%ld Dv=%ld", v->name,
                      (long)nr, (long)nc, (long)D);
                free(k), free(q), free(qT), free(sT), free(s), free(s2), free(kb), free(kh), free(o), free(o2),
                    free(o3);
            }
}

/* The 8-bit cache: dot_rows, dot_keys_t and axpy_keys over int8 keys bit for bit the
 * same blocks over float32 keys of the same (integer) values, on the D the word-transposing
 * path takes (multiples of 4 MA_VL) and the others; quantize_row bit for bit the scalar
 * block's, from each dtype, on rows with ties, zeros, infinities and NaN. */
static void test_int8(const ma_blocks *v) {
    static const int64_t ns[] = {1, 15, 16, 33, 64, 100};
    static const int64_t ds[] = {1, 16, 17, 32, 64, 80, 128, 256};
    for (int in = 0; in < 6; in++)
        for (int id = 0; id < 8; id++)
            for (int64_t nr = 1; nr <= 8; nr += 2) {
                const int64_t nc = ns[in], D = ds[id], ld = D + 5, lds = nc + 1, ldt = nc + 3;
                int8_t *k8 = malloc((size_t)(nc * ld)), *kt8 = malloc((size_t)(D * ldt));
                float *k = malloc(sizeof(float) * nc * ld), *kt = malloc(sizeof(float) * D * ldt);
                float *q = malloc(sizeof(float) * nr * D), *s = malloc(sizeof(float) * nr * lds);
                float *s2 = malloc(sizeof(float) * nr * lds);
                for (int64_t x = 0; x < nc * ld; x++) k[x] = k8[x] = (int8_t)(rand() % 255 - 127);
                for (int64_t c = 0; c < nc; c++)
                    for (int64_t d = 0; d < D; d++) kt[d * ldt + c] = kt8[d * ldt + c] = k8[c * ld + d];
                for (int64_t x = 0; x < nr * D; x++) q[x] = frand();
                for (int64_t x = 0; x < nr * lds; x++) s[x] = s2[x] = 7.0f;
                v->dot_rows(s, lds, q, nr, D, k, MA_F32, 0, ld, nc, 0);
                v->dot_rows(s2, lds, q, nr, D, k8, MA_I8, 0, ld, nc, 64 * ld);
                CHECK(memcmp(s, s2, sizeof(float) * nr * lds) == 0, "%s dot_rows int8 nr=%ld nc=%ld D=%ld", v->name,
                      (long)nr, (long)nc, (long)D);
                for (int64_t x = 0; x < nr * lds; x++) s[x] = s2[x] = 7.0f;
                v->dot_keys_t(s, lds, q, nr, D, kt, MA_F32, 0, ldt, nc, 0);
                v->dot_keys_t(s2, lds, q, nr, D, kt8, MA_I8, 0, ldt, nc, 0);
                CHECK(memcmp(s, s2, sizeof(float) * nr * lds) == 0, "%s dot_keys_t int8 nr=%ld nc=%ld D=%ld", v->name,
                      (long)nr, (long)nc, (long)D);
                float *o = malloc(sizeof(float) * nr * D), *o2 = malloc(sizeof(float) * nr * D);
                for (int64_t x = 0; x < nr * D; x++) o[x] = o2[x] = frand();
                v->axpy_keys(o, s, lds, nr, D, k, MA_F32, 0, ld, nc, 0, NULL);
                v->axpy_keys(o2, s, lds, nr, D, k8, MA_I8, 0, ld, nc, 64 * ld, NULL);
                CHECK(memcmp(o, o2, sizeof(float) * nr * D) == 0, "%s axpy_keys int8 nr=%ld nc=%ld Dv=%ld", v->name,
                      (long)nr, (long)nc, (long)D);
                free(k8), free(kt8), free(k), free(kt), free(q), free(s), free(s2), free(o), free(o2);
            }
    for (int id = 0; id < 8; id++)
        for (int kind = 0; kind < 5; kind++) {
            const int64_t n = ds[id];
            float x[256];
            uint16_t xb[256], xh[256];
            for (int64_t c = 0; c < n; c++) x[c] = frand() * (kind == 1 ? 1e-30f : 3.0f);
            if (kind == 2) /* ties: multiples of absmax / 254 */
                for (int64_t c = 0; c < n; c++) x[c] = (float)(c % 255 - 127) + 0.5f;
            if (kind == 3) x[n / 2] = INFINITY;
            if (kind == 4) x[n - 1] = NAN;
            if (kind == 0 && n > 1) x[0] = 0, x[1] = 0;
            for (int64_t c = 0; c < n; c++) xb[c] = ma_f32_to_bf16(x[c]), xh[c] = ma_f32_to_f16(x[c]);
            const void *src[3] = {x, xb, xh};
            const ma_dtype dts[3] = {MA_F32, MA_BF16, MA_F16};
            for (int t = 0; t < 3; t++) {
                int8_t q0[257], q1[257];
                float s0, s1;
                memset(q1, 99, sizeof q1);
                ma_blocks_scalar.quantize_row(src[t], dts[t], n, q0, &s0);
                v->quantize_row(src[t], dts[t], n, q1, &s1);
                CHECK(memcmp(q0, q1, (size_t)n) == 0 && (s0 == s1 || (isnan(s0) && isnan(s1))) && q1[n] == 99,
                      "%s quantize_row dtype %d n=%ld kind %d", v->name, (int)dts[t], (long)n, kind);
            }
        }
    /* the zero row: scale 0, q 0 */
    float z[20] = {0};
    int8_t qz[20];
    float sz = 1;
    v->quantize_row(z, MA_F32, 20, qz, &sz);
    CHECK(sz == 0 && qz[0] == 0 && qz[19] == 0, "%s quantize_row of zeros", v->name);
}

/* dropout: bit for bit the scalar block's, both layouts, in place and the
 * multiplier form, at every row/key edge of the 8- and 16-lane blocks and
 * unaligned key starts; and the mask is the definition (ma_dropout_keep). */
/* dot_rows_i8: the exact integer dot product (an int64 sum here), rounded once to float and
 * multiplied by the row's scale, bit for bit in every variant; q16 and keys at their extremes
 * (|q16| at the bound the decode keeps, keys -128 and 127), D past and not a multiple of every
 * variant's step, rows and keys past every tile; columns past nc untouched; scale 0 and NaN. */
static void test_dot_rows_i8(const ma_blocks *v) {
    static const int64_t ns[] = {1, 7, 8, 9, 16, 33, 100};
    static const int64_t ds[] = {1, 16, 17, 32, 64, 80, 96, 128, 256, 512};
    static const int64_t rs[] = {1, 2, 3, 4, 5, 7, 8, 16};
    for (int in = 0; in < 7; in++)
        for (int id = 0; id < 10; id++)
            for (int ir = 0; ir < 8; ir++)
                for (int kind = 0; kind < 3; kind++) { /* random; extremes; scales 0 and NaN */
                    const int64_t nc = ns[in], D = ds[id], nr = rs[ir], ld = D + 3 * (in % 2), off = 5, lds = nc + 2;
                    const int64_t qm = 32767 < INT32_MAX / (128 * D) ? 32767 : INT32_MAX / (128 * D);
                    int8_t *k = malloc((size_t)(off + nc * ld));
                    int16_t *q = malloc(sizeof(int16_t) * nr * D);
                    float *s = malloc(sizeof(float) * nr * lds), qs[16];
                    for (int64_t x = 0; x < off + nc * ld; x++)
                        k[x] = kind == 1 ? (x % 3 ? -128 : 127) : (int8_t)(rand() % 256 - 128);
                    for (int64_t x = 0; x < nr * D; x++)
                        q[x] = (int16_t)(kind == 1 ? (x % 3 ? qm : -qm) : rand() % (2 * qm + 1) - qm);
                    for (int64_t r = 0; r < nr; r++) qs[r] = kind == 2 ? (r % 2 ? NAN : 0.0f) : 1e-3f * (float)(r + 1);
                    for (int64_t x = 0; x < nr * lds; x++) s[x] = 7.0f;
                    v->dot_rows_i8(s, lds, q, qs, nr, D, k, off, ld, nc, 64 * ld);
                    int bad = 0;
                    for (int64_t r = 0; r < nr; r++)
                        for (int64_t c = 0; c < lds; c++) {
                            int64_t acc = 0;
                            for (int64_t d = 0; c < nc && d < D; d++)
                                acc += (int64_t)q[r * D + d] * k[off + c * ld + d];
                            const float want = c < nc ? (float)acc * qs[r] : 7.0f, got = s[r * lds + c];
                            if (c < nc && (acc > INT32_MAX || acc < -INT32_MAX)) bad = 1; /* (the bound) */
                            if (!(got == want || (isnan(got) && isnan(want)))) bad = 1;
                        }
                    CHECK(!bad, "%s dot_rows_i8 nr=%ld nc=%ld D=%ld kind=%d", v->name, (long)nr, (long)nc, (long)D,
                          kind);
                    free(k), free(q), free(s);
                }
}

/* axpy_keys_i8: the definition (blocks.h) written out here, with an int64 sum that must stay
 * within int32, is the scalar block's bit for bit, and every variant's; rows, keys (odd, past a
 * run of 512) and Dv past and not a multiple of every tile; values at -128 and 127 and
 * probabilities all at the run's largest; a row of zeros, one with NaN (NaN only where the float
 * product gives it), one whose largest is too small for 32767 / m (the float product's: one fma
 * a key, in key order). */
static void test_axpy_keys_i8(const ma_blocks *v) {
    static const int64_t ns[] = {1, 2, 7, 33, 64, 513, 600};
    static const int64_t ds[] = {1, 16, 17, 32, 64, 80, 96, 128, 256};
    static const int64_t rs[] = {1, 2, 3, 4, 5, 7, 8, 16};
    for (int in = 0; in < 7; in++)
        for (int id = 0; id < 9; id++)
            for (int ir = 0; ir < 8; ir++)
                for (int kind = 0; kind < 3; kind++) { /* random; extremes; a zero, a NaN and a tiny row */
                    const int64_t nc = ns[in], Dv = ds[id], nr = rs[ir], ld = Dv + 3 * (in % 2), off = 5, ldp = nc + 2;
                    int8_t *val = malloc((size_t)(off + nc * ld));
                    float *p = malloc(sizeof(float) * nr * ldp), *o = malloc(sizeof(float) * nr * Dv);
                    float *o0 = malloc(sizeof(float) * nr * Dv), *want = malloc(sizeof(float) * nr * Dv);
                    for (int64_t x = 0; x < off + nc * ld; x++)
                        val[x] = kind == 1 ? (x % 3 ? -128 : 127) : (int8_t)(rand() % 256 - 128);
                    for (int64_t x = 0; x < nr * ldp; x++)
                        p[x] = kind == 1 ? 0.75f : (float)rand() / (float)RAND_MAX * (x % 5 ? 1.0f : 1e-3f);
                    if (kind == 2 && nr > 2) {
                        for (int64_t c = 0; c < nc; c++) p[ldp + c] = 0, p[2 * ldp + c] *= 1e-40f;
                        p[nc / 2] = NAN;
                    }
                    for (int64_t x = 0; x < nr * Dv; x++) o[x] = o0[x] = (float)rand() / (float)RAND_MAX - 0.5f;
                    memcpy(want, o0, sizeof(float) * nr * Dv);
                    int bad = 0, special[16] = {0};
                    for (int64_t r = 0; r < nr; r++)
                        for (int64_t c0 = 0; c0 < nc; c0 += 512) {
                            const int64_t n = nc - c0 < 512 ? nc - c0 : 512;
                            float m = 0;
                            int nan = 0;
                            for (int64_t c = 0; c < n; c++)
                                m = fmaxf(m, fabsf(p[r * ldp + c0 + c])), nan |= isnan(p[r * ldp + c0 + c]);
                            special[r] |= nan || (m > 0 && isinf(32767.0f / m));
                            for (int64_t d = 0; d < Dv && m > 0 && !special[r]; d++) {
                                int64_t acc = 0;
                                for (int64_t c = 0; c < n; c++) {
                                    const long q = lrintf(p[r * ldp + c0 + c] * (32767.0f / m));
                                    bad |= q > 32767 || q < -32767;
                                    acc += (int64_t)q * val[off + (c0 + c) * ld + d];
                                }
                                bad |= acc > INT32_MAX || acc < -INT32_MAX;
                                want[r * Dv + d] = fmaf((float)acc, m / 32767.0f, want[r * Dv + d]);
                            }
                        }
                    v->axpy_keys_i8(o, p, ldp, nr, Dv, val, off, ld, nc, 64 * ld);
                    for (int64_t r = 0; r < nr; r++)
                        for (int64_t d = 0; d < Dv; d++) {
                            const float got = o[r * Dv + d], w = want[r * Dv + d];
                            if (!special[r]) bad |= !(got == w);
                            else if (r == 0) bad |= !isnan(got); /* the NaN row */
                            else { /* the float product: one fma a key, in key order */ float f = o0[r * Dv + d];
                                for (int64_t c = 0; c < nc; c++) f = fmaf(p[r * ldp + c], val[off + c * ld + d], f);
                                bad |= !(got == f);
                            }
                        }
                    CHECK(!bad, "%s axpy_keys_i8 nr=%ld nc=%ld Dv=%ld kind=%d", v->name, (long)nr, (long)nc, (long)Dv,
                          kind);
                    free(val), free(p), free(o), free(o0), free(want);
                }
}

static void test_dropout(const ma_blocks *v) {
    static const int64_t nrs[] = {1, 5, 8, 13, 16, 17, 64}, ncs[] = {1, 7, 8, 9, 64}, j0s[] = {0, 3, 64},
                         i0s[] = {0, 5};
    ma_attn_args a;
    memset(&a, 0, sizeof a);
    a.H = 3, a.opts.dropout_p = 0.3, a.opts.dropout_seed = 0x0123456789abcdefull,
    a.opts.dropout_offset = 0xfedcba9876543210ull;
    const ma_dropout d = ma_dropout_head(&a, 1, 2);
    float *x0 = malloc(sizeof(float) * 64 * 64), *x1 = malloc(sizeof(float) * 64 * 64);
    for (size_t a1 = 0; a1 < sizeof nrs / sizeof nrs[0]; a1++)
        for (size_t a2 = 0; a2 < sizeof ncs / sizeof ncs[0]; a2++)
            for (size_t a3 = 0; a3 < sizeof j0s / sizeof j0s[0]; a3++)
                for (size_t a4 = 0; a4 < sizeof i0s / sizeof i0s[0]; a4++)
                    for (int mode = 0; mode < 4; mode++) { /* bit 0: transposed; bit 1: multiplier form */
                        const int64_t nr = nrs[a1], nc = ncs[a2], j0 = j0s[a3], i0 = i0s[a4];
                        const int64_t rs = mode & 1 ? 1 : nc, cs = mode & 1 ? nr : 1;
                        for (int64_t e = 0; e < nr * nc; e++) x0[e] = x1[e] = (float)rand() / RAND_MAX + 0.5f;
                        float *z0 = mode & 2 ? x0 : NULL, *z1 = mode & 2 ? x1 : NULL;
                        ma_blocks_scalar.dropout(x0, z0, rs, cs, nr, nc, &d, i0, j0);
                        v->dropout(x1, z1, rs, cs, nr, nc, &d, i0, j0);
                        CHECK(memcmp(x0, x1, sizeof(float) * nr * nc) == 0,
                              "%s dropout nr=%ld nc=%ld j0=%ld i0=%ld mode=%d", v->name, (long)nr, (long)nc, (long)j0,
                              (long)i0, mode);
                        int def = 1;
                        for (int64_t r = 0; r < nr; r++)
                            for (int64_t c = 0; c < nc; c++)
                                def &= (x1[r * rs + c * cs] != 0) == ma_dropout_keep(&d, i0 + r, j0 + c);
                        CHECK(def, "%s dropout mask != definition nr=%ld nc=%ld mode=%d", v->name, (long)nr, (long)nc,
                              mode);
                    }
    free(x0), free(x1);
}

/* dtype.h's float16 conversions, in integers, against the compiler's _Float16: every float16
 * to float32; to float16, every float32 from 2^-27 to 2^18 whose bits below the rounding point
 * are a rounding case (0, 1, just below, at and just above the half, all ones) with every
 * value of the bits kept (normal and subnormal float16 results, the last finite value,
 * overflow), a million others, zeros, infinities and NaN payloads. */
static int f32_to_f16_differs(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    const _Float16 w = (_Float16)f;
    uint16_t want;
    memcpy(&want, &w, sizeof want);
    const uint16_t got = ma_f32_to_f16(f);
    if (want != got) printf("f32_to_f16 %08x: want %04x got %04x\n", u, want, got);
    return want != got;
}

static void test_f16_conversions(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        _Float16 x;
        const uint16_t h16 = (uint16_t)h;
        memcpy(&x, &h16, sizeof x);
        const float want = (float)x, got = ma_f16_to_f32(h16);
        uint32_t wb, gb;
        memcpy(&wb, &want, sizeof wb);
        memcpy(&gb, &got, sizeof gb);
        if (wb != gb && bad++ < 5) printf("f16_to_f32 %04x: want %08x got %08x\n", h, wb, gb);
    }
    for (uint32_t s = 0; s < 2 && bad < 5; s++)
        for (uint32_t e = 100; e < 145; e++) {
            /* bits of the 24-bit significand dropped: 13 for a normal float16, more below 2^-14 */
            const int drop = e >= 113 ? 13 : ma_min(24, 13 + (int)(113 - e));
            const uint32_t half = 1u << (drop - 1), low[6] = {0, 1, half - 1, half, half + 1, 2 * half - 1};
            for (uint32_t kept = 0; kept < (1u << (23 - drop + 1)) && bad < 5; kept++)
                for (int i = 0; i < 6; i++) {
                    const uint32_t mant = ((kept << drop) | low[i]) & 0x7fffffu;
                    bad += f32_to_f16_differs(s << 31 | e << 23 | mant);
                }
        }
    uint32_t x = 2463534242u;
    for (int i = 0; i < 1000000 && bad < 5; i++) {
        x ^= x << 13, x ^= x >> 17, x ^= x << 5;
        bad += f32_to_f16_differs(x);
    }
    const uint32_t edges[] = {0u, 1u, 0x7f800000u, 0x7f800001u, 0x7fc00000u, 0x7fbfe000u, 0x7fffffffu, 0x33000000u};
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++)
        bad += f32_to_f16_differs(edges[i]) + f32_to_f16_differs(edges[i] | 0x80000000u);
    CHECK(bad == 0, "float16 conversions: %d differ from _Float16's", bad);
}

int main(void) {
    test_f16_conversions();
    const struct {
        ma_isa isa;
        const ma_blocks *blocks;
        int sve_bits; /* sve's instances: the vector length each is for */
    } variants[] = {
        {MA_ISA_SCALAR, &ma_blocks_scalar},
#if defined(__x86_64__) || defined(__i386__)
        {MA_ISA_AVX2, &ma_blocks_avx2},
        {MA_ISA_AVX512, &ma_blocks_avx512},
        {MA_ISA_AMX, &ma_blocks_amx2},
        {MA_ISA_AMX, &ma_blocks_amx3},
        {MA_ISA_AVX512BF16, &ma_blocks_avx512bf16_2},
        {MA_ISA_AVX512BF16, &ma_blocks_avx512bf16_3},
#elif defined(__aarch64__)
        {MA_ISA_NEON, &ma_blocks_neon},         {MA_ISA_SVE, &ma_blocks_sve128, 128},
        {MA_ISA_SVE, &ma_blocks_sve256, 256},   {MA_ISA_SVE, &ma_blocks_sve512, 512},
        {MA_ISA_SVE, &ma_blocks_sve1024, 1024}, {MA_ISA_SVE, &ma_blocks_sve2048, 2048},
        {MA_ISA_SVEBF16, &ma_blocks_svebf16_2},
#endif
    };
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
        if (!ma_isa_available(variants[i].isa) || (variants[i].sve_bits && variants[i].sve_bits != ma_sve_bits())) {
            printf("%-7s not supported by this CPU, skipped\n", variants[i].blocks->name);
            continue;
        }
        const int before = failures;
        const ma_blocks *v = variants[i].blocks;
        const int bf16_2 =
            strcmp(v->name, "amx2") == 0 || strcmp(v->name, "avx512bf16_2") == 0 || strcmp(v->name, "svebf16_2") == 0;
        test_gemm(v, bf16_2 ? 1e-4f : 1e-5f); /* 2 bfloat16 products per float one */
        if (variants[i].isa != MA_ISA_AMX && variants[i].isa != MA_ISA_AVX512BF16 &&
            variants[i].isa != MA_ISA_SVEBF16) {
            /* the pair-product variants have the GEMM only; the rest is AVX-512's or NEON's */
            test_gemm_rowscale(v);
            test_exp(v);
            test_softcap(v);
            test_columns(v);
            test_transpose(v);
            test_rows(v);
            test_int8(v);
            test_dot_rows_i8(v);
            test_axpy_keys_i8(v);
            test_dropout(v);
        } else if (v->dot_rows_i8) { /* the pair-product units' copy of the integer products (VNNI) */
            test_dot_rows_i8(v);
            test_axpy_keys_i8(v);
        }
        printf("%-7s %s\n", v->name, failures == before ? "ok" : "FAILED");
    }
    return failures ? 1 : 0;
}
