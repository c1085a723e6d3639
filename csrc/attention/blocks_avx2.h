/*
 * blocks_avx2.h -- the attention building blocks (blocks.h) on AVX2 + FMA,
 * for avx2.c.
 *
 * GEMM: register-blocked micro-kernels and the loops around them, B read in
 * place (row-major, leading dimension ldb), A through its (ars, acs) strides
 * by broadcasts, nothing packed.
 *   - Full 16-column panels use a 6 x 16 block: 12 ymm accumulators + 2 rows
 *     of B + 1 broadcast of A = 15 of the 16 registers; each step p is 8 loads
 *     per 12 FMAs. Its loads and stores are plain (unmasked).
 *   - Row tails (m % 6) use the same block with fewer rows (MR = 1..5).
 *   - Column tails (n % 16): 9..15 columns a masked 2-vector block, exactly 8
 *     an unmasked 1-vector block, 1..7 a masked 1-vector block; only columns
 *     < n are read and written.
 * Every element of C is computed the same way in every block: c = 0 (or C,
 * or, in gemm_rowscale_avx2, rs[r] * C rounded once as it is loaded), then
 * c = fma(A[i, p], B[p, j], c) for p = 0, 1, ..., k - 1 in order, one FMA
 * per p in one register lane. So results never depend on the block shape,
 * m, n or where a tile is split, and dot_keys_avx2 / axpy_keys_avx2, which
 * sum in the same order, are bit for bit the GEMM's (tests/c/test_blocks.c).
 *
 * Memory moves: whole 8-float vectors are loaded and stored plainly; masked
 * moves (vmaskmovps, slow on AMD processors, its stores most of all) only
 * for the last n % 8 columns (GEMM, col_max, exp_sub_col, exp_sub_sum).
 */
#ifndef MA_ATTENTION_BLOCKS_AVX2_H
#define MA_ATTENTION_BLOCKS_AVX2_H

#include <immintrin.h>
#include <math.h>

#include "blocks.h"
#include "common/dtype.h"
#include "common/simd.h"
#include "masked_attn.h"
#include "philox.h"

/* lanes [0, n) set, n clamped to [0, 8] */
static inline __m256i tail_mask(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int nn = n < 0 ? 0 : n > 8 ? 8 : (int)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(nn), idx);
}

/* One step p of the micro-kernel: c[r][v] = fma(A[r, p], B[p, 8v : 8v + 8], c[r][v]). */
static inline __attribute__((always_inline)) void ukernel_step(const int MR, const int NV, const int masked,
                                                               const __m256i mk[2], __m256 c[6][2], const float *A,
                                                               int64_t ars, const float *B) {
    __m256 b[2];
    for (int v = 0; v < NV; v++) b[v] = masked ? _mm256_maskload_ps(B + 8 * v, mk[v]) : _mm256_loadu_ps(B + 8 * v);
    for (int r = 0; r < MR; r++) {
        const __m256 a = _mm256_broadcast_ss(A + r * ars);
        for (int v = 0; v < NV; v++) c[r][v] = _mm256_fmadd_ps(a, b[v], c[r][v]);
    }
}

/* C[0:MR, 0:8 NV] (+)= A[0:MR, 0:k] @ B[0:k, 0:8 NV], MR <= 6, NV <= 2. masked: only columns < nr
 * are read and written (else nr = 8 NV). MR, NV, masked are constants after inlining, so the
 * accumulators stay in registers. With accumulate and rs, row r of C is first multiplied by
 * rs[r] (rounded once, as a separate pass would store it). */
static inline __attribute__((always_inline)) void ukernel(const int MR, const int NV, const int masked, int64_t nr,
                                                          int64_t k, const float *A, int64_t ars, int64_t acs,
                                                          const float *B, int64_t ldb, float *C, int64_t ldc,
                                                          int accumulate, const float *rs) {
    __m256i mk[2];
    __m256 c[6][2];
    for (int v = 0; v < NV; v++) mk[v] = tail_mask(masked ? nr - 8 * v : 8);
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++)
            c[r][v] = !accumulate ? _mm256_setzero_ps()
                      : masked    ? _mm256_maskload_ps(C + r * ldc + 8 * v, mk[v])
                                  : _mm256_loadu_ps(C + r * ldc + 8 * v);
    if (accumulate && rs)
        for (int r = 0; r < MR; r++) {
            const __m256 sv = _mm256_set1_ps(rs[r]);
            for (int v = 0; v < NV; v++) c[r][v] = _mm256_mul_ps(c[r][v], sv);
        }
#pragma GCC unroll 2
    for (int64_t p = 0; p < k; p++) ukernel_step(MR, NV, masked, mk, c, A + p * acs, ars, B + p * ldb);
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) {
            if (masked) _mm256_maskstore_ps(C + r * ldc + 8 * v, mk[v], c[r][v]);
            else _mm256_storeu_ps(C + r * ldc + 8 * v, c[r][v]);
        }
}

/* One column panel C[0:m, 0:8 NV]: 6-row blocks, then the m % 6 rows in one block. */
static inline __attribute__((always_inline)) void gemm_panel(const int NV, const int masked, int64_t m, int64_t nr,
                                                             int64_t k, const float *A, int64_t ars, int64_t acs,
                                                             const float *B, int64_t ldb, float *C, int64_t ldc,
                                                             int accumulate, const float *rs) {
#define MA_BLOCK(MR) \
    ukernel(MR, NV, masked, nr, k, A + i * ars, ars, acs, B, ldb, C + i * ldc, ldc, accumulate, rs ? rs + i : NULL)
    int64_t i = 0;
    for (; i + 6 <= m; i += 6) MA_BLOCK(6);
    switch (m - i) {
    case 5: MA_BLOCK(5); break;
    case 4: MA_BLOCK(4); break;
    case 3: MA_BLOCK(3); break;
    case 2: MA_BLOCK(2); break;
    case 1: MA_BLOCK(1); break;
    default: break;
    }
#undef MA_BLOCK
}

/* Rows of B that lie a multiple of 512 bytes apart (D = 128 floats, or rows
 * H * D apart) map to 8 of L1's 64 sets: a k = 64 panel's 64 lines then fill
 * them and evict each other between the row blocks that reuse the panel.
 * Such panels (full 16 columns, k <= MA_PACK_K) are therefore copied to a
 * contiguous (k, 16) buffer on the stack first when more than one row block
 * reads them; the FMAs and their order are unchanged. At 256-byte strides
 * (D = 64) a panel's 64 lines fit the 16 sets they map to, and the copy
 * cost more than it saved (C harness, 6% of a backward tile). */
#define MA_PACK_K 256

/* C (m, n) = [diag(rs) C +] A (m, k) @ B (k, n); A[i, p] = A[i*ars + p*acs]; rs only with accumulate. */
static inline __attribute__((always_inline)) void gemm_avx2_rs(int64_t m, int64_t n, int64_t k, const float *A,
                                                               int64_t ars, int64_t acs, const float *B, int64_t ldb,
                                                               float *C, int64_t ldc, int accumulate, const float *rs) {
    int64_t j = 0;
    if (m > 6 && k <= MA_PACK_K && ldb % 128 == 0) { /* see MA_PACK_K */
        _Alignas(32) float pk[MA_PACK_K * 16];
        for (; j + 16 <= n; j += 16) {
            for (int64_t p = 0; p < k; p++) {
                _mm256_store_ps(pk + p * 16, _mm256_loadu_ps(B + p * ldb + j));
                _mm256_store_ps(pk + p * 16 + 8, _mm256_loadu_ps(B + p * ldb + j + 8));
            }
            gemm_panel(2, 0, m, 16, k, A, ars, acs, pk, 16, C + j, ldc, accumulate, rs);
        }
    }
    for (; j + 16 <= n; j += 16) gemm_panel(2, 0, m, 16, k, A, ars, acs, B + j, ldb, C + j, ldc, accumulate, rs);
    const int64_t nr = n - j; /* the last n % 16 columns */
    if (nr > 8) gemm_panel(2, 1, m, nr, k, A, ars, acs, B + j, ldb, C + j, ldc, accumulate, rs);
    else if (nr == 8) gemm_panel(1, 0, m, 8, k, A, ars, acs, B + j, ldb, C + j, ldc, accumulate, rs);
    else if (nr > 0) gemm_panel(1, 1, m, nr, k, A, ars, acs, B + j, ldb, C + j, ldc, accumulate, rs);
}

/* C (m, n) = [C +] A (m, k) @ B (k, n); A[i, p] = A[i*ars + p*acs]. */
static void gemm_avx2(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                      int64_t ldb, float *C, int64_t ldc, int accumulate) {
    gemm_avx2_rs(m, n, k, A, ars, acs, B, ldb, C, ldc, accumulate, NULL);
}

/* C (m, n) = diag(rs) C + A (m, k) @ B (k, n): the online softmax's rescaling of O folded
 * into the product that accumulates into it (rs NULL: no rescaling). */
static void gemm_rowscale_avx2(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs,
                               const float *B, int64_t ldb, float *C, int64_t ldc, const float *rs) {
    gemm_avx2_rs(m, n, k, A, ars, acs, B, ldb, C, ldc, 1, rs);
}

/* 8 floats at x: all of them (full), or lanes where k is set (the rest read as 0, never
 * written). Masked moves are slow on some processors (vmaskmovps stores on AMD), so whole
 * vectors use plain ones; the values are the same. */
static inline __attribute__((always_inline)) __m256 load_ps(const int full, const float *x, __m256i k) {
    return full ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, k);
}
static inline __attribute__((always_inline)) void store_ps(const int full, float *x, __m256i k, __m256 v) {
    if (full) _mm256_storeu_ps(x, v);
    else _mm256_maskstore_ps(x, k, v);
}

/* x[c] = exp(x[c] - m) in place; returns the sum. */
static float exp_sub_sum_avx2(float *x, int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + c), mv));
        _mm256_storeu_ps(x + c, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (c < n) {
        const __m256i k = tail_mask(n - c);
        __m256 e = exp256(_mm256_sub_ps(_mm256_maskload_ps(x + c, k), mv));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(k)); /* lanes past n add nothing */
        _mm256_maskstore_ps(x + c, k, e);
        acc = _mm256_add_ps(acc, e);
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* s[x] = cap tanh(s[x] inv) in place (tanh256); th, when not NULL, keeps the tanh. */
static void softcap_avx2(float *s, int64_t n, float cap, float inv, float *th) {
    const __m256 cv = _mm256_set1_ps(cap), iv = _mm256_set1_ps(inv);
    for (int64_t x = 0; x < n; x += 8) {
        const int full = x + 8 <= n;
        const __m256i k = full ? _mm256_set1_epi32(-1) : tail_mask(n - x);
        const __m256 t = tanh256(_mm256_mul_ps(load_ps(full, s + x, k), iv));
        if (th) store_ps(full, th + x, k, t);
        store_ps(full, s + x, k, _mm256_mul_ps(cv, t));
    }
}

/* One strip of 8 columns r.. of col_max_avx2 (full: all 8 inside n). */
static inline __attribute__((always_inline)) void col_max_strip(const int full, const float *x, int64_t rows, int64_t n,
                                                                float *m, __m256i k) {
    __m256 mv[4];
    mv[0] = load_ps(full, m, k);
    mv[1] = mv[2] = mv[3] = mv[0];
    __m256 nan = _mm256_cmp_ps(mv[0], mv[0], _CMP_UNORD_Q);
    int64_t c = 0;
    for (; c + 4 <= rows; c += 4)
        for (int u = 0; u < 4; u++) {
            const __m256 xv = load_ps(full, x + (c + u) * n, k);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
            mv[u] = _mm256_max_ps(xv, mv[u]);
        }
    for (; c < rows; c++) {
        const __m256 xv = load_ps(full, x + c * n, k);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
        mv[0] = _mm256_max_ps(xv, mv[0]);
    }
    __m256 mx = _mm256_max_ps(_mm256_max_ps(mv[0], mv[1]), _mm256_max_ps(mv[2], mv[3]));
    mx = _mm256_blendv_ps(mx, _mm256_set1_ps(NAN), nan);
    store_ps(full, m, k, mx);
}

/* m[r] = max(m[r], max_c x[c*n + r]); NaN sticks (vmaxps alone would drop it). Four running
 * maxima per strip of 8 columns, as in AVX-512. */
static void col_max_avx2(const float *x, int64_t rows, int64_t n, float *m) {
    int64_t r = 0;
    for (; r + 8 <= n; r += 8) col_max_strip(1, x + r, rows, n, m + r, tail_mask(8));
    if (r < n) col_max_strip(0, x + r, rows, n, m + r, tail_mask(n - r));
}

/* One strip of 8 columns r.. of exp_sub_col_avx2 (full: all 8 inside n). */
static inline __attribute__((always_inline)) void exp_sub_col_strip(const int full, float *x, int64_t rows, int64_t n,
                                                                    const float *m, float *sum, __m256i k) {
    __m256 mv = load_ps(full, m, k);
    mv = _mm256_blendv_ps(mv, _mm256_setzero_ps(), _mm256_cmp_ps(mv, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
    __m256 acc = load_ps(full, sum, k);
    for (int64_t c = 0; c < rows; c++) {
        const __m256 e = exp256(_mm256_sub_ps(load_ps(full, x + c * n, k), mv));
        store_ps(full, x + c * n, k, e);
        acc = _mm256_add_ps(acc, e);
    }
    store_ps(full, sum, k, acc);
}

/* x[c*n + r] = exp(x[c*n + r] - m[r]) (m[r] = -inf counts as 0); sum[r] += it. */
static void exp_sub_col_avx2(float *x, int64_t rows, int64_t n, const float *m, float *sum) {
    int64_t r = 0;
    for (; r + 8 <= n; r += 8) exp_sub_col_strip(1, x + r, rows, n, m + r, sum + r, tail_mask(8));
    if (r < n) exp_sub_col_strip(0, x + r, rows, n, m + r, sum + r, tail_mask(n - r));
}

/* dst (ncol, nr) = mul * src (nr, ncol)^T, src rows lds apart: 8 x 8 blocks
 * transposed in registers, the edges (nr % 8 rows, ncol % 8 columns) by plain
 * loops. Each element is the one rounding of mul * x either way. */
static void transpose_avx2(float *dst, const float *src, int64_t lds, int64_t nr, int64_t ncol, float mul) {
    const __m256 mv = _mm256_set1_ps(mul);
    int64_t r0 = 0;
    for (; r0 + 8 <= nr; r0 += 8) {
        int64_t c0 = 0;
        for (; c0 + 8 <= ncol; c0 += 8) {
            __m256 x[8];
            for (int i = 0; i < 8; i++) x[i] = _mm256_mul_ps(mv, _mm256_loadu_ps(src + (r0 + i) * lds + c0));
            transpose8x8(x); /* x[j] lane i = src[r0 + i][c0 + j] */
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(dst + (c0 + j) * nr + r0, x[j]);
        }
        for (; c0 < ncol; c0++)
            for (int64_t r = r0; r < r0 + 8; r++) dst[c0 * nr + r] = mul * src[r * lds + c0];
    }
    for (; r0 < nr; r0++)
        for (int64_t c = 0; c < ncol; c++) dst[c * nr + r0] = mul * src[r0 * lds + c];
}

/* 8 elements of a row in its own dtype (float32, bfloat16 or float16) as
 * float32; n < 8 reads only the first n (the rest are 0). */
static inline __attribute__((always_inline)) __m256 load8(const void *base, ma_dtype dt, int64_t off, int64_t n) {
    if (dt == MA_F32) {
        const float *x = (const float *)base + off;
        return n >= 8 ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, tail_mask(n));
    }
    const uint16_t *x = (const uint16_t *)base + off;
    __m128i h;
    if (n >= 8) {
        h = _mm_loadu_si128((const __m128i *)x);
    } else {
        uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < n; i++) buf[i] = x[i];
        h = _mm_loadu_si128((const __m128i *)buf);
    }
    if (dt == MA_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* max(m, x[c] for c < n); NaN sticks. */
static float row_max_avx2(const float *x, int64_t n, float m) {
    __m256 mx = _mm256_set1_ps(m), nan = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
    for (int64_t c = 0; c < n; c += 8) {
        const int64_t k = ma_min(8, n - c);
        const __m256 xv = k == 8 ? _mm256_loadu_ps(x + c)
                                 : _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(x + c, tail_mask(k)),
                                                    _mm256_castsi256_ps(tail_mask(k)));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
        mx = _mm256_max_ps(xv, mx);
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    float t[8], r = m;
    _mm256_storeu_ps(t, mx);
    for (int i = 0; i < 8; i++) r = t[i] > r ? t[i] : r;
    return r;
}

/* One query row against keys c0 .. c0 + 16: 2 groups of 8 keys side by side,
 * 2 independent FMA chains. Each group takes a whole cache line of its 8 rows
 * before the other group's, so that 8 rows, not 16, share an L1 set where
 * rows are a multiple of 4 KB apart (a (B, L, H, D) cache: the heads' rows).
 * full: D % 8 == 0, every block whole (no tests in the FMA sequence: 5 - 40%
 * faster decoding from caches, Zen 3). */
static inline __attribute__((always_inline)) void dot_keys_row(const int full, float *s, const float *q, int64_t D,
                                                               const void *k, const ma_dtype dt, int64_t off,
                                                               int64_t ld, int64_t c0, int64_t pf) {
    const int64_t es = dt == MA_F32 ? 4 : 2, le = MA_CACHE_LINE / es; /* elements per line */
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t dl = 0; dl < D; dl += le)
#pragma GCC unroll 2
        for (int g = 0; g < 2; g++)
            for (int64_t d0 = dl; d0 < ma_min(dl + le, D); d0 += 8) {
                const int64_t dn = full ? 8 : ma_min(8, D - d0);
                const int line = pf && d0 == dl; /* the first 8 elements of a line */
                __m256 x[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) {
                    x[i] = load8(k, dt, off + (c0 + 8 * g + i) * ld + d0, dn);
                    if (line) _mm_prefetch((const char *)k + (off + (c0 + 8 * g + i) * ld + d0 + pf) * es, _MM_HINT_T0);
                }
                transpose8x8(x);
#pragma GCC unroll 8 /* x[dd] at constant indices: the block stays in registers */
                for (int dd = 0; dd < 8; dd++)
                    if (full || dd < dn) acc[g] = _mm256_fmadd_ps(x[dd], _mm256_set1_ps(q[d0 + dd]), acc[g]);
            }
    for (int g = 0; g < 2; g++) _mm256_storeu_ps(s + c0 + 8 * g, acc[g]);
}

/* s[r * lds + c] = q_r . k_c, bit for bit the GEMM's value (one FMA per d,
 * in order, from 0): 8 keys in the lanes, their 8 x 8 blocks of K transposed
 * in registers, so every query row reuses each block. nr <= 8. Instantiated
 * per dtype (dt a constant after inlining), as in AVX-512.
 * Decoding (nr = 1) streams K and V from memory once, so dot_keys and
 * axpy_keys prefetch the line pf elements past each line they read (the
 * template: for one head alone the rows a key block ahead; in a run of heads
 * the next head's part of the same rows, and after the last head the first
 * head's rows a key block ahead). Past the last key the prefetches touch memory
 * that is not the tensor's: a prefetch is a hint that never faults. */
static inline __attribute__((always_inline)) void dot_keys_dt(float *s, int64_t lds, const float *q, int64_t nr,
                                                              int64_t D, const void *k, const ma_dtype dt, int64_t off,
                                                              int64_t ld, int64_t nc, int64_t pf) {
    int64_t c0 = 0;
    if (nr == 1) /* decoding: 16 keys at a time (32, in 4 chains, were no faster from caches and
                  * 10 - 20% slower from memory: B=8 H=32 Lk=2048 D=128, 2 threads, Zen 3) */
        for (; c0 + 16 <= nc; c0 += 16)
            if (D % 8 == 0) dot_keys_row(1, s, q, D, k, dt, off, ld, c0, pf);
            else dot_keys_row(0, s, q, D, k, dt, off, ld, c0, pf);
    for (; c0 < nc; c0 += 8) {
        const int64_t nk = ma_min(8, nc - c0);
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            const int64_t dn = ma_min(8, D - d0);
            __m256 x[8];
            for (int i = 0; i < 8; i++) /* keys past nc: nothing read */
                x[i] = i < nk ? load8(k, dt, off + (c0 + i) * ld + d0, dn) : _mm256_setzero_ps();
            transpose8x8(x); /* x[dd] lane i = k[c0 + i][d0 + dd] */
#pragma GCC unroll 8 /* x[dd] at constant indices: the block stays in registers */
            for (int dd = 0; dd < 8; dd++)
                for (int r = 0; r < 8; r++)
                    if (dd < dn && r < nr) acc[r] = _mm256_fmadd_ps(x[dd], _mm256_set1_ps(q[r * D + d0 + dd]), acc[r]);
        }
        for (int r = 0; r < 8; r++)
            if (r < nr) {
                if (nk == 8) _mm256_storeu_ps(s + r * lds + c0, acc[r]);
                else _mm256_maskstore_ps(s + r * lds + c0, tail_mask(nk), acc[r]);
            }
    }
}

static void dot_keys_avx2(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                          int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    if (dt == MA_F32) dot_keys_dt(s, lds, q, nr, D, k, MA_F32, off, ld, nc, pf);
    else if (dt == MA_BF16) dot_keys_dt(s, lds, q, nr, D, k, MA_BF16, off, ld, nc, pf);
    else dot_keys_dt(s, lds, q, nr, D, k, MA_F16, off, ld, nc, pf);
}

/* dot_keys from a K^T page (element d of key c at off + c + d * ldd): 8 keys
 * in the lanes as they lie, one FMA per d in order from 0 (the same bits as
 * dot_keys and the GEMM, no transposes). Decoding: 2 groups of 8 keys, 2
 * chains; each line read prefetches the line pf elements on. */
static inline __attribute__((always_inline)) void dot_keys_t_dt(float *s, int64_t lds, const float *q, int64_t nr,
                                                                int64_t D, const void *k, const ma_dtype dt,
                                                                int64_t off, int64_t ldd, int64_t nc, int64_t pf) {
    const int64_t es = dt == MA_F32 ? 4 : 2;
    int64_t c0 = 0;
    if (nr == 1)
        for (; c0 + 16 <= nc; c0 += 16) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                const int64_t o = off + d * ldd + c0;
                const __m256 qd = _mm256_set1_ps(q[d]);
                if (pf) _mm_prefetch((const char *)k + (o + pf) * es, _MM_HINT_T0);
                a0 = _mm256_fmadd_ps(load8(k, dt, o, 8), qd, a0);
                a1 = _mm256_fmadd_ps(load8(k, dt, o + 8, 8), qd, a1);
            }
            _mm256_storeu_ps(s + c0, a0);
            _mm256_storeu_ps(s + c0 + 8, a1);
        }
    for (; c0 < nc; c0 += 8) {
        const int64_t nk = ma_min(8, nc - c0);
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const __m256 x = load8(k, dt, off + d * ldd + c0, nk);
            for (int r = 0; r < 8; r++)
                if (r < nr) acc[r] = _mm256_fmadd_ps(x, _mm256_set1_ps(q[r * D + d]), acc[r]);
        }
        for (int r = 0; r < 8; r++)
            if (r < nr) {
                if (nk == 8) _mm256_storeu_ps(s + r * lds + c0, acc[r]);
                else _mm256_maskstore_ps(s + r * lds + c0, tail_mask(nk), acc[r]);
            }
    }
}

static void dot_keys_t_avx2(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                            int64_t off, int64_t ldd, int64_t nc, int64_t pf) {
    if (dt == MA_F32) dot_keys_t_dt(s, lds, q, nr, D, k, MA_F32, off, ldd, nc, pf);
    else if (dt == MA_BF16) dot_keys_t_dt(s, lds, q, nr, D, k, MA_BF16, off, ldd, nc, pf);
    else dot_keys_t_dt(s, lds, q, nr, D, k, MA_F16, off, ldd, nc, pf);
}

/* o[r * Dv + d] += sum_c p[r * ldp + c] v_c[d] (one FMA per key, in order):
 * R rows x 8 NV columns in registers (8 accumulators) while the keys stream
 * past; two rows share each value row read. full: the strip's 8 NV columns
 * all exist (no tests in the key loop). Per dtype, as dot_keys. */
static inline __attribute__((always_inline)) void axpy_keys_strip(const int R, const int NV, const int full, float *o,
                                                                  const float *p, int64_t ldp, int64_t Dv,
                                                                  const void *v, const ma_dtype dt, int64_t off,
                                                                  int64_t ld, int64_t nc, int64_t d0, int64_t pf) {
    const int64_t es = dt == MA_F32 ? 4 : 2;
    int64_t n[8];
    __m256 acc[2][8];
    for (int u = 0; u < NV; u++) {
        n[u] = full ? 8 : Dv - d0 - 8 * u < 0 ? 0 : ma_min(8, Dv - d0 - 8 * u);
        for (int r = 0; r < R; r++) acc[r][u] = load8(o, MA_F32, r * Dv + d0 + 8 * u, n[u]);
    }
    for (int64_t c = 0; c < nc; c++) {
        __m256 pv[2];
        for (int r = 0; r < R; r++) pv[r] = _mm256_set1_ps(p[r * ldp + c]);
        for (int u = 0; u < NV; u++) {
            if (n[u] == 0) break;
            const __m256 vv = load8(v, dt, off + c * ld + d0 + 8 * u, n[u]);
            for (int r = 0; r < R; r++) acc[r][u] = _mm256_fmadd_ps(pv[r], vv, acc[r][u]);
            if (pf && (8 * u * es) % MA_CACHE_LINE == 0) /* see dot_keys; d0 * es is a multiple of a line */
                _mm_prefetch((const char *)v + (off + c * ld + d0 + 8 * u + pf) * es, _MM_HINT_T0);
        }
    }
    for (int u = 0; u < NV; u++)
        for (int r = 0; r < R; r++) {
            if (n[u] == 8) _mm256_storeu_ps(o + r * Dv + d0 + 8 * u, acc[r][u]);
            else if (n[u] > 0) _mm256_maskstore_ps(o + r * Dv + d0 + 8 * u, tail_mask(n[u]), acc[r][u]);
        }
}

static inline __attribute__((always_inline)) void axpy_keys_dt(float *o, const float *p, int64_t ldp, int64_t nr,
                                                               int64_t Dv, const void *v, const ma_dtype dt,
                                                               int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    int64_t r = 0;
    for (; r + 2 <= nr; r += 2) /* 2 rows x 32 columns */
        for (int64_t d0 = 0; d0 < Dv; d0 += 32)
            if (d0 + 32 <= Dv)
                axpy_keys_strip(2, 4, 1, o + r * Dv, p + r * ldp, ldp, Dv, v, dt, off, ld, nc, d0, r == 0 ? pf : 0);
            else axpy_keys_strip(2, 4, 0, o + r * Dv, p + r * ldp, ldp, Dv, v, dt, off, ld, nc, d0, r == 0 ? pf : 0);
    if (r < nr) /* the last row alone: 64 columns */
        for (int64_t d0 = 0; d0 < Dv; d0 += 64)
            if (d0 + 64 <= Dv)
                axpy_keys_strip(1, 8, 1, o + r * Dv, p + r * ldp, ldp, Dv, v, dt, off, ld, nc, d0, r == 0 ? pf : 0);
            else axpy_keys_strip(1, 8, 0, o + r * Dv, p + r * ldp, ldp, Dv, v, dt, off, ld, nc, d0, r == 0 ? pf : 0);
}

static void axpy_keys_avx2(float *o, const float *p, int64_t ldp, int64_t nr, int64_t Dv, const void *v, ma_dtype dt,
                           int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    if (dt == MA_F32) axpy_keys_dt(o, p, ldp, nr, Dv, v, MA_F32, off, ld, nc, pf);
    else if (dt == MA_BF16) axpy_keys_dt(o, p, ldp, nr, Dv, v, MA_BF16, off, ld, nc, pf);
    else axpy_keys_dt(o, p, ldp, nr, Dv, v, MA_F16, off, ld, nc, pf);
}

/* non-temporal stores of whole float32 rows (store_tile, stream_stores) */
/* Philox-4x32-10 (philox.h) on 8 counters side by side, lane l = query row
 * i + l: c (4 vectors of 8 words) in place. */
static inline __attribute__((always_inline)) __m256i philox_mulhilo_avx2(__m256i a, __m256i m, __m256i *lo) {
    const __m256i pe = _mm256_mul_epu32(a, m), po = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    *lo = _mm256_blend_epi32(pe, _mm256_slli_epi64(po, 32), 0xAA);
    return _mm256_blend_epi32(_mm256_srli_epi64(pe, 32), po, 0xAA);
}

static inline __attribute__((always_inline)) void philox_avx2(__m256i c[4], uint32_t k0, uint32_t k1) {
    const __m256i m0 = _mm256_set1_epi32((int)MA_PHILOX_M0), m1 = _mm256_set1_epi32((int)MA_PHILOX_M1);
    for (int round = 0; round < 10; round++) {
        __m256i lo0, lo1;
        const __m256i hi0 = philox_mulhilo_avx2(c[0], m0, &lo0), hi1 = philox_mulhilo_avx2(c[2], m1, &lo1);
        c[0] = _mm256_xor_si256(_mm256_xor_si256(hi1, c[1]), _mm256_set1_epi32((int)k0));
        c[1] = lo1;
        c[2] = _mm256_xor_si256(_mm256_xor_si256(hi0, c[3]), _mm256_set1_epi32((int)k1));
        c[3] = lo0;
        k0 += MA_PHILOX_W0;
        k1 += MA_PHILOX_W1;
    }
}

/* dropout_scalar's contract (blocks_scalar.h), 8 query rows at a time: one
 * vector Philox call gives rows r0 .. r0 + 7 x the 8 keys of a group; the
 * drop masks go straight to a transposed tile (rs == 1), through an 8 x 8
 * transpose to a row-wise one (cs == 1), elementwise at the edges. */
static void dropout_avx2(float *x, float *z, int64_t rs, int64_t cs, int64_t nr, int64_t nc, const ma_dropout *d,
                         int64_t i0, int64_t j0) {
    const __m256 scale = _mm256_set1_ps((float)d->scale);
    const __m256i thr = _mm256_set1_epi32(d->thr), low16 = _mm256_set1_epi32(0xffff);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t r0 = 0; r0 < nr; r0 += 8) {
        const int64_t nl = ma_min(8, nr - r0);
        const __m256i ci = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)(i0 + r0)), lane);
        for (int64_t g = j0 >> 3; g * 8 < j0 + nc; g++) {
            __m256i c[4] = {_mm256_set1_epi32((int)(uint32_t)g), ci, _mm256_set1_epi32((int)d->c2),
                            _mm256_set1_epi32((int)d->c3)};
            philox_avx2(c, d->k0, d->k1);
            __m256i drop[8]; /* drop[m], lane l: element (r0 + l, key 8 g + m) is dropped */
            for (int m = 0; m < 8; m++) {
                const __m256i u = m & 1 ? _mm256_srli_epi32(c[m >> 1], 16) : _mm256_and_si256(c[m >> 1], low16);
                drop[m] = _mm256_cmpgt_epi32(thr, u);
            }
            const int64_t c0 = g * 8 - j0; /* tile column of key 8 g */
            const int whole = nl == 8 && c0 >= 0 && c0 + 8 <= nc;
            if (nl == 8 && rs == 1) {
                for (int m = 0; m < 8; m++) {
                    if (c0 + m < 0 || c0 + m >= nc) continue;
                    float *e = (z ? z : x) + (c0 + m) * cs + r0;
                    const __m256 mul = _mm256_andnot_ps(_mm256_castsi256_ps(drop[m]), scale);
                    _mm256_storeu_ps(e, z ? mul : _mm256_mul_ps(_mm256_loadu_ps(e), mul));
                }
            } else if (whole && cs == 1) {
                __m256 t[8];
                for (int m = 0; m < 8; m++) t[m] = _mm256_castsi256_ps(drop[m]);
                transpose8x8(t); /* t[l], lane m: element (r0 + l, key 8 g + m) */
                for (int l = 0; l < 8; l++) {
                    float *e = (z ? z : x) + (r0 + l) * rs + c0;
                    const __m256 mul = _mm256_andnot_ps(t[l], scale);
                    _mm256_storeu_ps(e, z ? mul : _mm256_mul_ps(_mm256_loadu_ps(e), mul));
                }
            } else {
                int32_t dm[8][8];
                for (int m = 0; m < 8; m++) _mm256_storeu_si256((__m256i *)dm[m], drop[m]);
                const float s = (float)d->scale;
                for (int64_t l = 0; l < nl; l++)
                    for (int m = 0; m < 8; m++) {
                        if (c0 + m < 0 || c0 + m >= nc) continue;
                        float *e = (z ? z : x) + (r0 + l) * rs + (c0 + m) * cs;
                        const float mul = dm[m][l] ? 0 : s;
                        *e = z ? mul : *e * mul;
                    }
            }
        }
    }
}

#define MA_BLK_STREAM
#define stream_row_f32_avx2 stream_row256
#define stream_fence_avx2 _mm_sfence

#endif /* MA_ATTENTION_BLOCKS_AVX2_H */
