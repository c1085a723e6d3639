/*
 * blocks_avx512.h -- the attention building blocks (blocks.h) on AVX-512
 * (F, BW, DQ, VL + FMA), for avx512.c and, beside its tile hooks, amx.c.
 *
 * GEMM is a BLIS-style split: register-blocked micro-kernels and the loops
 * around them. Full 64-column panels use a 6 x 64 block (24 zmm accumulators
 * + 4 of B + 1 broadcast of A = 29 of the 32 registers; each step is 10 loads
 * per 24 FMAs, the best ratio that fits); on the attention tiles (m, n, k =
 * 64 or 128, either A layout) it runs faster than an 8 x 32 block.
 * The last n % 64 columns use an 8 x 32 block, masked only when fewer than 32
 * columns are left, so any n works; row tails use the same micro-kernels with
 * fewer rows.
 */
#ifndef MA_ATTENTION_BLOCKS_AVX512_H
#define MA_ATTENTION_BLOCKS_AVX512_H

#include <immintrin.h>
#include <math.h>

#include "blocks.h"
#include "common/dtype.h"
#include "common/simd.h"
#include "masked_attn.h"
#include "philox.h"

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
 * constants after inlining, so the accumulators stay in registers; k is unrolled by 2. With
 * accumulate and rs, row r of C is first multiplied by rs[r] (rounded once, as a separate pass
 * would store it). */
static inline __attribute__((always_inline)) void ukernel(const int MR, const int NV, const int masked, int64_t nr,
                                                          int64_t k, const float *A, int64_t ars, int64_t acs,
                                                          const float *B, int64_t ldb, float *C, int64_t ldc,
                                                          int accumulate, const float *rs) {
    __mmask16 mk[4];
    __m512 c[8][4];
    for (int v = 0; v < NV; v++) mk[v] = masked ? tail_mask(nr - 16 * v) : (__mmask16)0xffff;
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++)
            c[r][v] = !accumulate ? _mm512_setzero_ps()
                      : masked    ? _mm512_maskz_loadu_ps(mk[v], C + r * ldc + 16 * v)
                                  : _mm512_loadu_ps(C + r * ldc + 16 * v);
    if (accumulate && rs)
        for (int r = 0; r < MR; r++) {
            const __m512 sv = _mm512_set1_ps(rs[r]);
            for (int v = 0; v < NV; v++) c[r][v] = _mm512_mul_ps(c[r][v], sv);
        }
#pragma GCC unroll 2 /* two steps in flight: hides the load latency of B rows far apart (clang reads it too) */
    for (int64_t p = 0; p < k; p++) ukernel_step(MR, NV, masked, mk, c, A + p * acs, ars, B + p * ldb);
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) {
            if (masked) _mm512_mask_storeu_ps(C + r * ldc + 16 * v, mk[v], c[r][v]);
            else _mm512_storeu_ps(C + r * ldc + 16 * v, c[r][v]);
        }
}

/* C (m, n) = [diag(rs) C +] A (m, k) @ B (k, n); A[i, p] = A[i*ars + p*acs]; rs only with accumulate. */
static inline __attribute__((always_inline)) void gemm_avx512_rs(int64_t m, int64_t n, int64_t k, const float *A,
                                                                 int64_t ars, int64_t acs, const float *B, int64_t ldb,
                                                                 float *C, int64_t ldc, int accumulate,
                                                                 const float *rs) {
#define MA_ROWS(MR, NV, masked)                                                                             \
    for (; i + MR <= m; i += MR)                                                                            \
        ukernel(MR, NV, masked, nr, k, A + i * ars, ars, acs, B + j, ldb, C + i * ldc + j, ldc, accumulate, \
                rs ? rs + i : NULL);
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

/* C (m, n) = [C +] A (m, k) @ B (k, n); A[i, p] = A[i*ars + p*acs]. */
static void gemm_avx512(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                        int64_t ldb, float *C, int64_t ldc, int accumulate) {
    gemm_avx512_rs(m, n, k, A, ars, acs, B, ldb, C, ldc, accumulate, NULL);
}

/* C (m, n) = diag(rs) C + A (m, k) @ B (k, n): the online softmax's rescaling of O folded
 * into the product that accumulates into it (rs NULL: no rescaling). */
static void gemm_rowscale_avx512(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs,
                                 const float *B, int64_t ldb, float *C, int64_t ldc, const float *rs) {
    gemm_avx512_rs(m, n, k, A, ars, acs, B, ldb, C, ldc, 1, rs);
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

/* s[x] = cap tanh(s[x] inv) in place (tanh512); th, when not NULL, keeps the tanh. */
static void softcap_avx512(float *s, int64_t n, float cap, float inv, float *th) {
    const __m512 cv = _mm512_set1_ps(cap), iv = _mm512_set1_ps(inv);
    for (int64_t x = 0; x < n; x += 16) {
        const __mmask16 k = tail_mask(n - x);
        const __m512 t = tanh512(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + x), iv));
        if (th) _mm512_mask_storeu_ps(th + x, k, t);
        _mm512_mask_storeu_ps(s + x, k, _mm512_mul_ps(cv, t));
    }
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
        mv = _mm512_mask_mov_ps(mv, _mm512_cmp_ps_mask(mv, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), _mm512_setzero_ps());
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

/* 16 elements of a row in its own dtype (float32, bfloat16 or float16) as
 * float32; lanes outside k read nothing and are 0. */
static inline __m512 load16(const void *base, ma_dtype dt, int64_t off, __mmask16 k) {
    if (dt == MA_F32) return _mm512_maskz_loadu_ps(k, (const float *)base + off);
    const __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)base + off);
    if (dt == MA_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* max(m, x[c] for c < n); NaN sticks (vmaxps alone would drop it). */
static float row_max_avx512(const float *x, int64_t n, float m) {
    __m512 mx = _mm512_set1_ps(m);
    __mmask16 nan = _mm512_cmp_ps_mask(mx, mx, _CMP_UNORD_Q);
    for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 k = tail_mask(n - c);
        const __m512 xv = _mm512_maskz_loadu_ps(k, x + c);
        nan |= _mm512_mask_cmp_ps_mask(k, xv, xv, _CMP_UNORD_Q);
        mx = _mm512_mask_max_ps(mx, k, xv, mx);
    }
    return nan ? NAN : _mm512_reduce_max_ps(mx);
}

/* s[r * lds + c] = q_r . k_c, bit for bit the GEMM's value (one FMA per d,
 * in order, from 0): 16 keys in the lanes, their 16 x 16 blocks of K
 * transposed in registers, so every query row reuses each block. nr <= 8.
 * Instantiated per dtype (dt a constant after inlining).
 * Decoding (nr = 1) streams K and V from memory once, so dot_keys and
 * axpy_keys prefetch the line pf elements past each line they read (the
 * template: for one head alone the rows a key block ahead, about 1.1-1.3x
 * on a decoding step whose cache is in DRAM; in a run of heads the next
 * head's part of the same rows). Past the last key the prefetches touch memory that is
 * not the tensor's: a prefetch is a hint that never faults. */
static inline __attribute__((always_inline)) void dot_keys_dt(float *s, int64_t lds, const float *q, int64_t nr,
                                                              int64_t D, const void *k, const ma_dtype dt, int64_t off,
                                                              int64_t ld, int64_t nc, int64_t pf) {
    int64_t c0 = 0;
    if (nr == 1) /* decoding: 2 groups of 16 keys side by side, 2 independent FMA chains */
        for (; c0 + 32 <= nc; c0 += 32) {
            __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
                const int64_t dn = ma_min(16, D - d0);
                const __mmask16 dm = tail_mask(dn);
#pragma GCC unroll 2
                for (int g = 0; g < 2; g++) {
                    __m512 x[16];
#pragma GCC unroll 16
                    for (int i = 0; i < 16; i++) {
                        x[i] = load16(k, dt, off + (c0 + 16 * g + i) * ld + d0, dm);
                        if (pf)
                            _mm_prefetch((const char *)k +
                                             (off + (c0 + 16 * g + i) * ld + d0 + pf) * (dt == MA_F32 ? 4 : 2),
                                         _MM_HINT_T0);
                    }
                    transpose16x16(x);
#pragma GCC unroll 16 /* x[dd] at constant indices: the block stays in registers */
                    for (int dd = 0; dd < 16; dd++)
                        if (dd < dn) acc[g] = _mm512_fmadd_ps(x[dd], _mm512_set1_ps(q[d0 + dd]), acc[g]);
                }
            }
            for (int g = 0; g < 2; g++) _mm512_storeu_ps(s + c0 + 16 * g, acc[g]);
        }
    for (; c0 < nc; c0 += 16) {
        const int64_t nk = ma_min(16, nc - c0);
        __m512 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            const int64_t dn = ma_min(16, D - d0);
            const __mmask16 dm = tail_mask(dn);
            __m512 x[16];
            for (int i = 0; i < 16; i++) /* keys past nc: nothing read */
                x[i] = i < nk ? load16(k, dt, off + (c0 + i) * ld + d0, dm) : _mm512_setzero_ps();
            transpose16x16(x); /* x[dd] lane i = k[c0 + i][d0 + dd] */
#pragma GCC unroll 16
            for (int dd = 0; dd < 16; dd++)
                for (int r = 0; r < 8; r++)
                    if (dd < dn && r < nr) acc[r] = _mm512_fmadd_ps(x[dd], _mm512_set1_ps(q[r * D + d0 + dd]), acc[r]);
        }
        for (int r = 0; r < 8; r++)
            if (r < nr) _mm512_mask_storeu_ps(s + r * lds + c0, tail_mask(nk), acc[r]);
    }
}

static void dot_keys_avx512(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                            int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    if (dt == MA_F32) dot_keys_dt(s, lds, q, nr, D, k, MA_F32, off, ld, nc, pf);
    else if (dt == MA_BF16) dot_keys_dt(s, lds, q, nr, D, k, MA_BF16, off, ld, nc, pf);
    else dot_keys_dt(s, lds, q, nr, D, k, MA_F16, off, ld, nc, pf);
}

/* dot_keys from a K^T page (element d of key c at off + c + d * ldd): keys in
 * the lanes as they lie, one FMA per d in order from 0, so the same bits as
 * dot_keys and the GEMM without the transposes. A strip takes NV vectors of
 * 16 keys (whole lines of the page row) for NR query rows (the query heads of
 * one key head, attention_tmpl.h), NR * NV chains; each line read prefetches
 * the line pf elements on (the next key block, or the next head's). */
static inline __attribute__((always_inline)) void dot_keys_t_strip(const int NV, const int NR, float *s, int64_t lds,
                                                                   const float *q, int64_t D, const void *k,
                                                                   const ma_dtype dt, int64_t off, int64_t ldd,
                                                                   int64_t c0, int64_t pf) {
    const int64_t es = dt == MA_F32 ? 4 : 2;
    __m512 acc[8][4];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const int64_t o = off + d * ldd + c0;
        __m512 x[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            x[v] = load16(k, dt, o + 16 * v, 0xffff);
            if (pf && (es == 4 || v % 2 == 0)) _mm_prefetch((const char *)k + (o + 16 * v + pf) * es, _MM_HINT_T0);
        }
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const __m512 qd = _mm512_set1_ps(q[r * D + d]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(x[v], qd, acc[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(s + r * lds + c0 + 16 * v, acc[r][v]);
}

static inline __attribute__((always_inline)) void dot_keys_t_dt(float *s, int64_t lds, const float *q, int64_t nr,
                                                                int64_t D, const void *k, const ma_dtype dt,
                                                                int64_t off, int64_t ldd, int64_t nc, int64_t pf) {
    int64_t c0 = 0;
#define MA_KT_STRIPS(NV, NR) \
    for (; c0 + 16 * (NV) <= nc; c0 += 16 * (NV)) dot_keys_t_strip(NV, NR, s, lds, q, D, k, dt, off, ldd, c0, pf)
    switch (nr) {
    case 1: MA_KT_STRIPS(4, 1); break;
    case 2: MA_KT_STRIPS(4, 2); break;
    case 3: MA_KT_STRIPS(4, 3); break;
    case 4: MA_KT_STRIPS(4, 4); break;
    case 5: MA_KT_STRIPS(2, 5); break;
    case 6: MA_KT_STRIPS(2, 6); break;
    case 7: MA_KT_STRIPS(2, 7); break;
    default: MA_KT_STRIPS(2, 8); break;
    }
#undef MA_KT_STRIPS
    for (; c0 < nc; c0 += 16) {
        const __mmask16 km = tail_mask(ma_min(16, nc - c0));
        __m512 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const __m512 x = load16(k, dt, off + d * ldd + c0, km);
            for (int r = 0; r < 8; r++)
                if (r < nr) acc[r] = _mm512_fmadd_ps(x, _mm512_set1_ps(q[r * D + d]), acc[r]);
        }
        for (int r = 0; r < 8; r++)
            if (r < nr) _mm512_mask_storeu_ps(s + r * lds + c0, km, acc[r]);
    }
}

static void dot_keys_t_avx512(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                              int64_t off, int64_t ldd, int64_t nc, int64_t pf) {
    if (dt == MA_F32) dot_keys_t_dt(s, lds, q, nr, D, k, MA_F32, off, ldd, nc, pf);
    else if (dt == MA_BF16) dot_keys_t_dt(s, lds, q, nr, D, k, MA_BF16, off, ldd, nc, pf);
    else dot_keys_t_dt(s, lds, q, nr, D, k, MA_F16, off, ldd, nc, pf);
}

/* axpy_keys for R = 3 or 4 rows: 4 vectors (64 columns) of every row in
 * registers while the keys stream past, then the next 64 columns; each
 * (row, column) sums its keys in order, as in the two-row form. */
static inline __attribute__((always_inline)) void axpy_keys_rows(const int R, float *o, const float *p, int64_t ldp,
                                                                 int64_t Dv, const void *v, const ma_dtype dt,
                                                                 int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    const int es = dt == MA_F32 ? 4 : 2;
    for (int64_t d0 = 0; d0 < Dv; d0 += 64) {
        __mmask16 mk[4];
        __m512 acc[4][4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            mk[u] = tail_mask(Dv - d0 - 16 * u);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][u] = _mm512_maskz_loadu_ps(mk[u], o + r * Dv + d0 + 16 * u);
        }
        for (int64_t c = 0; c < nc; c++) {
            __m512 pr[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) pr[r] = _mm512_set1_ps(p[r * ldp + c]);
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) {
                const __m512 vv = load16(v, dt, off + c * ld + d0 + 16 * u, mk[u]);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) acc[r][u] = _mm512_fmadd_ps(pr[r], vv, acc[r][u]);
                if (pf && (16 * u * es) % MA_CACHE_LINE == 0)
                    _mm_prefetch((const char *)v + (off + c * ld + d0 + 16 * u + pf) * es, _MM_HINT_T0);
            }
        }
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(o + r * Dv + d0 + 16 * u, mk[u], acc[r][u]);
    }
}

/* o[r * Dv + d] += sum_c p[r * ldp + c] v_c[d]: 128 columns of one row in
 * registers while the keys stream past, so a value row of D <= 128 is read
 * once, front to back (per dtype, as dot_keys). */
static inline __attribute__((always_inline)) void axpy_keys_dt(float *o, const float *p, int64_t ldp, int64_t nr,
                                                               int64_t Dv, const void *v, const ma_dtype dt,
                                                               int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    const int es = dt == MA_F32 ? 4 : 2;
    int64_t r = 0;
    if (nr >= 3) { /* the query heads of a key head: 4 (or 3) rows share each read, 64 columns at a time */
        for (; r + 4 <= nr; r += 4)
            axpy_keys_rows(4, o + r * Dv, p + r * ldp, ldp, Dv, v, dt, off, ld, nc, r == 0 ? pf : 0);
        if (nr - r == 3)
            axpy_keys_rows(3, o + r * Dv, p + r * ldp, ldp, Dv, v, dt, off, ld, nc, r == 0 ? pf : 0), r += 3;
    }
    for (; r < nr; r += 2) { /* two rows share each value row read: 2 x 8 accumulators */
        const int two = r + 1 < nr;
        for (int64_t d0 = 0; d0 < Dv; d0 += 128) {
            __mmask16 mk[8];
            __m512 acc[2][8];
            for (int u = 0; u < 8; u++) {
                mk[u] = tail_mask(Dv - d0 - 16 * u);
                acc[0][u] = _mm512_maskz_loadu_ps(mk[u], o + r * Dv + d0 + 16 * u);
                acc[1][u] = two ? _mm512_maskz_loadu_ps(mk[u], o + (r + 1) * Dv + d0 + 16 * u) : _mm512_setzero_ps();
            }
            for (int64_t c = 0; c < nc; c++) {
                const __m512 p0 = _mm512_set1_ps(p[r * ldp + c]), p1 = _mm512_set1_ps(two ? p[(r + 1) * ldp + c] : 0);
                for (int u = 0; u < 8; u++) {
                    if (mk[u] == 0) break;
                    const __m512 vv = load16(v, dt, off + c * ld + d0 + 16 * u, mk[u]);
                    acc[0][u] = _mm512_fmadd_ps(p0, vv, acc[0][u]);
                    if (two) acc[1][u] = _mm512_fmadd_ps(p1, vv, acc[1][u]);
                    if (pf && r == 0 && (16 * u * es) % MA_CACHE_LINE == 0) /* see dot_keys */
                        _mm_prefetch((const char *)v + (off + c * ld + d0 + 16 * u + pf) * es, _MM_HINT_T0);
                }
            }
            for (int u = 0; u < 8; u++) {
                _mm512_mask_storeu_ps(o + r * Dv + d0 + 16 * u, mk[u], acc[0][u]);
                if (two) _mm512_mask_storeu_ps(o + (r + 1) * Dv + d0 + 16 * u, mk[u], acc[1][u]);
            }
        }
    }
}

static void axpy_keys_avx512(float *o, const float *p, int64_t ldp, int64_t nr, int64_t Dv, const void *v, ma_dtype dt,
                             int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    if (dt == MA_F32) axpy_keys_dt(o, p, ldp, nr, Dv, v, MA_F32, off, ld, nc, pf);
    else if (dt == MA_BF16) axpy_keys_dt(o, p, ldp, nr, Dv, v, MA_BF16, off, ld, nc, pf);
    else axpy_keys_dt(o, p, ldp, nr, Dv, v, MA_F16, off, ld, nc, pf);
}

/* Philox-4x32-10 (philox.h) on 16 counters side by side, lane l = query row
 * i + l: c (4 vectors of 16 words) in place. */
static inline __attribute__((always_inline)) __m512i philox_mulhilo_avx512(__m512i a, __m512i m, __m512i *lo) {
    const __m512i pe = _mm512_mul_epu32(a, m), po = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    *lo = _mm512_mask_blend_epi32(0xAAAA, pe, _mm512_slli_epi64(po, 32));
    return _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(pe, 32), po);
}

static inline __attribute__((always_inline)) void philox_avx512(__m512i c[4], uint32_t k0, uint32_t k1) {
    const __m512i m0 = _mm512_set1_epi32((int)MA_PHILOX_M0), m1 = _mm512_set1_epi32((int)MA_PHILOX_M1);
    for (int round = 0; round < 10; round++) {
        __m512i lo0, lo1;
        const __m512i hi0 = philox_mulhilo_avx512(c[0], m0, &lo0), hi1 = philox_mulhilo_avx512(c[2], m1, &lo1);
        c[0] = _mm512_xor_si512(_mm512_xor_si512(hi1, c[1]), _mm512_set1_epi32((int)k0));
        c[1] = lo1;
        c[2] = _mm512_xor_si512(_mm512_xor_si512(hi0, c[3]), _mm512_set1_epi32((int)k1));
        c[3] = lo0;
        k0 += MA_PHILOX_W0;
        k1 += MA_PHILOX_W1;
    }
}

/* dropout_scalar's contract (blocks_scalar.h), 16 query rows at a time: one
 * vector Philox call gives rows r0 .. r0 + 15 x the 8 keys of a group, as
 * drop bit masks over the rows; a transposed tile (rs == 1) takes them as
 * store masks, other layouts elementwise. */
static void dropout_avx512(float *x, float *z, int64_t rs, int64_t cs, int64_t nr, int64_t nc, const ma_dropout *d,
                           int64_t i0, int64_t j0) {
    const __m512 scale = _mm512_set1_ps((float)d->scale);
    const __m512i thr = _mm512_set1_epi32(d->thr), low16 = _mm512_set1_epi32(0xffff);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t r0 = 0; r0 < nr; r0 += 16) {
        const int64_t nl = ma_min(16, nr - r0);
        const __m512i ci = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)(i0 + r0)), lane);
        for (int64_t g = j0 >> 3; g * 8 < j0 + nc; g++) {
            __m512i c[4] = {_mm512_set1_epi32((int)(uint32_t)g), ci, _mm512_set1_epi32((int)d->c2),
                            _mm512_set1_epi32((int)d->c3)};
            philox_avx512(c, d->k0, d->k1);
            __mmask16 drop[8]; /* drop[m], bit l: element (r0 + l, key 8 g + m) is dropped */
            for (int m = 0; m < 8; m++) {
                const __m512i u = m & 1 ? _mm512_srli_epi32(c[m >> 1], 16) : _mm512_and_si512(c[m >> 1], low16);
                drop[m] = _mm512_cmpgt_epi32_mask(thr, u);
            }
            const int64_t c0 = g * 8 - j0; /* tile column of key 8 g */
            if (nl == 16 && rs == 1) {
                for (int m = 0; m < 8; m++) {
                    if (c0 + m < 0 || c0 + m >= nc) continue;
                    float *e = (z ? z : x) + (c0 + m) * cs + r0;
                    const __m512 mul = _mm512_maskz_mov_ps((__mmask16)~drop[m], scale);
                    _mm512_storeu_ps(e, z ? mul : _mm512_mul_ps(_mm512_loadu_ps(e), mul));
                }
            } else {
                const float s = (float)d->scale;
                for (int64_t l = 0; l < nl; l++)
                    for (int m = 0; m < 8; m++) {
                        if (c0 + m < 0 || c0 + m >= nc) continue;
                        float *e = (z ? z : x) + (r0 + l) * rs + (c0 + m) * cs;
                        const float mul = (drop[m] >> l) & 1 ? 0 : s;
                        *e = z ? mul : *e * mul;
                    }
            }
        }
    }
}

/* non-temporal stores of whole float32 rows (store_tile, stream_stores) */
#define MA_BLK_STREAM
#define stream_row_f32_avx512 stream_row512
#define stream_fence_avx512 _mm_sfence

#endif /* MA_ATTENTION_BLOCKS_AVX512_H */
