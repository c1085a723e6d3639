/*
 * attention_avx512.c -- the float-accumulating attention kernels with AVX-512
 * building blocks. Compiled with -mavx512f -mavx512bw -mavx512dq -mavx512vl
 * -mfma only (setup.py); called only when the CPU has them (attention.c).
 *
 * GEMM is a BLIS-style split: register-blocked micro-kernels and the loops
 * around them. Full 64-column panels use a 6 x 64 block (24 zmm accumulators
 * + 4 of B + 1 broadcast of A = 29 of the 32 registers; each step is 10 loads
 * per 24 FMAs, the best ratio that fits); on the attention tiles (m, n, k =
 * 64 or 128, either A layout) it runs ~1.15-1.2x the 8 x 32 block it replaced.
 * The last n % 64 columns use an 8 x 32 block, masked only when fewer than 32
 * columns are left, so any n works; row tails use the same micro-kernels with
 * fewer rows.
 */
#include <immintrin.h>
#include <math.h>

#include "attention_isa.h"
#include "dtype.h"
#include "masked_attn.h"
#include "simd.h"

static inline __mmask16 tail_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* One step p of the micro-kernel: c[r][v] += A[r, p] * B[p, 16v : 16v + 16]. */
static inline __attribute__((always_inline)) void ukernel_step(const int MR, const int NV, const int masked,
                                                               const __mmask16 mk[4], __m512 c[8][4], const float *A,
                                                               int64_t ars, const float *B) {
    __m512 b[4];
    for (int v = 0; v < NV; v++) b[v] = masked ? _mm512_maskz_loadu_ps(mk[v], B + 16 * v) : _mm512_loadu_ps(B + 16 * v);
    for (int r = 0; r < MR; r++) {
        const __m512 a = _mm512_set1_ps(A[r * ars]);
        for (int v = 0; v < NV; v++) c[r][v] = _mm512_fmadd_ps(a, b[v], c[r][v]);
    }
}

/* C[0:MR, 0:16 NV] (+)= A[0:MR, 0:k] @ B[0:k, 0:16 NV], MR <= 8, NV <= 4, MR * NV + NV + 1 <= 32
 * registers. masked: only columns < nr are read and written (else nr = 16 NV). MR, NV, masked are
 * constants after inlining, so the accumulators stay in registers; k is unrolled by 2. */
static inline __attribute__((always_inline)) void ukernel(const int MR, const int NV, const int masked, int64_t nr,
                                                          int64_t k, const float *A, int64_t ars, int64_t acs,
                                                          const float *B, int64_t ldb, float *C, int64_t ldc,
                                                          int accumulate) {
    __mmask16 mk[4];
    __m512 c[8][4];
    for (int v = 0; v < NV; v++) mk[v] = masked ? tail_mask(nr - 16 * v) : (__mmask16)0xffff;
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++)
            c[r][v] = !accumulate ? _mm512_setzero_ps()
                      : masked    ? _mm512_maskz_loadu_ps(mk[v], C + r * ldc + 16 * v)
                                  : _mm512_loadu_ps(C + r * ldc + 16 * v);
#pragma GCC unroll 2 /* ~7% faster with B rows 2 KB apart (ldb 512), same elsewhere; clang reads it too */
    for (int64_t p = 0; p < k; p++) ukernel_step(MR, NV, masked, mk, c, A + p * acs, ars, B + p * ldb);
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) {
            if (masked)
                _mm512_mask_storeu_ps(C + r * ldc + 16 * v, mk[v], c[r][v]);
            else
                _mm512_storeu_ps(C + r * ldc + 16 * v, c[r][v]);
        }
}

/* C (m, n) = [C +] A (m, k) @ B (k, n); A[i, p] = A[i*ars + p*acs]. */
static void gemm_avx512(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs,
                        const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
#define MA_ROWS(MR, NV, masked)                                                                                  \
    for (; i + MR <= m; i += MR)                                                                               \
        ukernel(MR, NV, masked, nr, k, A + i * ars, ars, acs, B + j, ldb, C + i * ldc + j, ldc, accumulate);
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) { /* 6 x 64 blocks; m % 6 rows as 4 + 2 + 1 */
        const int64_t nr = 64;
        int64_t i = 0;
        MA_ROWS(6, 4, 0)
        MA_ROWS(4, 4, 0)
        MA_ROWS(2, 4, 0)
        MA_ROWS(1, 4, 0)
    }
    for (; j < n; j += 32) { /* the last n % 64 columns: 8 x 32 blocks, masked past n */
        const int64_t nr = ma_min(32, n - j);
        int64_t i = 0;
        if (nr == 32) {
            MA_ROWS(8, 2, 0)
            MA_ROWS(4, 2, 0)
            MA_ROWS(1, 2, 0)
        } else {
            MA_ROWS(8, 2, 1)
            MA_ROWS(4, 2, 1)
            MA_ROWS(1, 2, 1)
        }
    }
#undef MA_ROWS
}

/* x[c] = exp(x[c] - m) in place; returns the sum. */
static float exp_sub_sum_avx512(float *x, int64_t n, float m) {
    const __m512 mv = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 k = tail_mask(n - c);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + c), mv));
        _mm512_mask_storeu_ps(x + c, k, e);
        acc = _mm512_mask_add_ps(acc, k, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}

/* m[r] = max(m[r], max_c x[c*n + r]); NaN sticks (vmaxps alone would drop it).
 * Four running maxima per strip of 16 columns (rows c, c+1, c+2, c+3), so the
 * 4-cycle vmaxps chain does not serialise the column. */
static void col_max_avx512(const float *x, int64_t rows, int64_t n, float *m) {
    for (int64_t r = 0; r < n; r += 16) {
        const __mmask16 k = tail_mask(n - r);
        __m512 mv[4];
        mv[0] = _mm512_maskz_loadu_ps(k, m + r);
        mv[1] = mv[2] = mv[3] = mv[0];
        __mmask16 nan = _mm512_cmp_ps_mask(mv[0], mv[0], _CMP_UNORD_Q);
        int64_t c = 0;
        for (; c + 4 <= rows; c += 4)
            for (int u = 0; u < 4; u++) {
                const __m512 xv = _mm512_maskz_loadu_ps(k, x + (c + u) * n + r);
                nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
                mv[u] = _mm512_max_ps(xv, mv[u]);
            }
        for (; c < rows; c++) {
            const __m512 xv = _mm512_maskz_loadu_ps(k, x + c * n + r);
            nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
            mv[0] = _mm512_max_ps(xv, mv[0]);
        }
        __m512 mx = _mm512_max_ps(_mm512_max_ps(mv[0], mv[1]), _mm512_max_ps(mv[2], mv[3]));
        mx = _mm512_mask_mov_ps(mx, nan, _mm512_set1_ps(NAN));
        _mm512_mask_storeu_ps(m + r, k, mx);
    }
}

/* x[c*n + r] = exp(x[c*n + r] - m[r]) (m[r] = -inf counts as 0); sum[r] += it. */
static void exp_sub_col_avx512(float *x, int64_t rows, int64_t n, const float *m, float *sum) {
    for (int64_t r = 0; r < n; r += 16) {
        const __mmask16 k = tail_mask(n - r);
        __m512 mv = _mm512_maskz_loadu_ps(k, m + r);
        mv = _mm512_mask_mov_ps(mv, _mm512_cmp_ps_mask(mv, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                _mm512_setzero_ps());
        __m512 acc = _mm512_maskz_loadu_ps(k, sum + r);
        for (int64_t c = 0; c < rows; c++) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + c * n + r), mv));
            _mm512_mask_storeu_ps(x + c * n + r, k, e);
            acc = _mm512_add_ps(acc, e);
        }
        _mm512_mask_storeu_ps(sum + r, k, acc);
    }
}

/* dst (ncol, nr) = mul * src (nr, ncol)^T, src rows lds apart: 16 x 16 blocks
 * transposed in registers, masked at the edges. */
static void transpose_avx512(float *dst, const float *src, int64_t lds, int64_t nr, int64_t ncol, float mul) {
    const __m512 mv = _mm512_set1_ps(mul);
    for (int64_t r0 = 0; r0 < nr; r0 += 16) {
        const int64_t rn = ma_min(16, nr - r0);
        const __mmask16 rmask = tail_mask(rn);
        for (int64_t c0 = 0; c0 < ncol; c0 += 16) {
            const int64_t cn = ma_min(16, ncol - c0);
            const __mmask16 cmask = tail_mask(cn);
            __m512 x[16];
            for (int i = 0; i < 16; i++)
                x[i] = i < rn ? _mm512_mul_ps(mv, _mm512_maskz_loadu_ps(cmask, src + (r0 + i) * lds + c0))
                              : _mm512_setzero_ps();
            transpose16x16(x);
            for (int j = 0; j < cn; j++) _mm512_mask_storeu_ps(dst + (c0 + j) * nr + r0, rmask, x[j]);
        }
    }
}

const ma_blocks ma_blocks_avx512 = {"avx512", gemm_avx512, exp_sub_sum_avx512, col_max_avx512, exp_sub_col_avx512,
                                    transpose_avx512};

#define STREAM_ROW_F32 stream_row512
#define STREAM_FENCE _mm_sfence
#define ACC float
#define FN(name) name##_avx512
#define LOAD ma_load_f32
#define STORE ma_store_f32
#define LOG logf
#define GEMM gemm_avx512
#define EXP_SUB_SUM exp_sub_sum_avx512
#define COL_MAX col_max_avx512
#define EXP_SUB_COL exp_sub_col_avx512
#define TRANSPOSE transpose_avx512
#define MA_TMPL_SIMD
#include "attention_tmpl.h"
#undef MA_TMPL_SIMD
#include "undef_tmpl.h"

void ma_attn_fwd_avx512(int64_t begin, int64_t end, void *ctx) { attn_fwd_avx512(begin, end, ctx); }
void ma_attn_bwd_dq_avx512(int64_t begin, int64_t end, void *ctx) { attn_bwd_dq_avx512(begin, end, ctx); }
void ma_attn_bwd_dkdv_avx512(int64_t begin, int64_t end, void *ctx) { attn_bwd_dkdv_avx512(begin, end, ctx); }
void ma_attn_bwd_fused_avx512(int64_t begin, int64_t end, void *ctx) { attn_bwd_fused_avx512(begin, end, ctx); }
