/*
 * tiles_pack.h -- operands packed for bfloat16 pair products, shared by the
 * two instances whose matrix products multiply pairs of bf16 with float32
 * accumulation: amx.c (AMX tiles, TDPBF16PS) and avx512bf16.c (VDPBF16PS on
 * zmm registers). Both read the same layout: AMX's tiles, which is also what
 * VDPBF16PS wants (an A row holds k pairs side by side, a B row the pair
 * (B[2p][n], B[2p+1][n]) of each column n). Included by an instance compiled
 * with AVX-512 and AVX512-BF16 flags, after common/simd_avx512.h.
 *
 * GEMM takes the same float32 operands as every other variant. Each operand
 * is split while it is packed: x = x0 + x1 + x2 with x0 = bf16(x),
 * x1 = bf16(x - x0), x2 = bf16(x - x0 - x1), and the products with
 * i + j < TERMS of the parts x_i y_j are summed in float32:
 *   TERMS = 1:  x0 y0                        (1 product, bf16 operands)
 *   TERMS = 2:  x0 y0 + x0 y1 + x1 y0        (3 products, error ~2^-16 |x y|)
 *   TERMS = 3:  ... + x0 y2 + x1 y1 + x2 y0  (6 products, error ~2^-24 |x y|, float32's own)
 * An operand whose later parts are all zero (a bfloat16 input, exactly
 * converted) skips the products with them, so a bfloat16 Q K^T is one
 * product. How many parts and terms each instance takes per dtype is its
 * tile_precision (tiles_hooks.h).
 *
 * Tiles: 16 rows x 64 bytes. An A tile is 16 rows x 32 bf16; a B tile is 16
 * rows x 16 pairs of bf16 (row p holds B[2p][n], B[2p+1][n] for each n).
 * Operands are packed with zeros beyond m, n, k, so every tile is full.
 */
#ifndef MA_TILES_PACK_H
#define MA_TILES_PACK_H

#include <immintrin.h>
#include <string.h>

#include "common/dtype.h"
#include "masked_attn.h"
#include "tiles_layout.h"

/* The 16 float32 values of the bf16 in the low or high half of v. */
static inline __m512 bf16_lo_to_ps(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
}
static inline __m512 bf16_hi_to_ps(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}

/* part[i] = 32 bf16: the i-th parts of a (low 16) and b (high 16), i < nparts. */
static inline void split32(__m512 a, __m512 b, int nparts, __m512i part[TILE_PARTS]) {
    for (int i = 0; i < nparts; i++) {
        part[i] = (__m512i)_mm512_cvtne2ps_pbh(b, a);
        if (i + 1 < nparts) {
            a = _mm512_sub_ps(a, bf16_lo_to_ps(part[i]));
            b = _mm512_sub_ps(b, bf16_hi_to_ps(part[i]));
        }
    }
}

/* 16 x 16 transpose of 32-bit elements (pairs of bf16), in registers. */
static inline void transpose16x16_epi32(__m512i r[16]) {
    __m512 f[16];
    for (int i = 0; i < 16; i++) f[i] = _mm512_castsi512_ps(r[i]);
    vf_transpose(f);
    for (int i = 0; i < 16; i++) r[i] = _mm512_castps_si512(f[i]);
}

/* Index that interleaves the two halves of 32 bf16: out[2n + s] = in[16 s + n]. */
static inline __m512i interleave_idx(void) {
    static const uint16_t idx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_loadu_si512(idx);
}

/* Pack A (m, k), A[i, p] = A[i*ars + p*acs] with acs == 1 (rows) or ars == 1
 * (transposed), as tiles (mt, kt), mt < ceil(m/16), kt < ceil(k/32), in
 * dst.parts parts into the view dst; overwrites. */
static void pack_a(tile_view dst, const float *A, int64_t ars, int64_t acs, int64_t m, int64_t k) {
    const int parts = dst.parts;
    const int64_t part_stride = dst.part_stride;
    const __m512i ileave = interleave_idx();
    for (int64_t mt = 0; mt < ma_cdiv(m, 16); mt++)
        for (int64_t kt = 0; kt < ma_cdiv(k, 32); kt++) {
            const int64_t i0 = mt * 16, p0 = kt * 32;
            uint16_t *tile = dst.p + mt * dst.os + kt * dst.ks;
            __m512i part[TILE_PARTS];
            if (acs == 1) { /* a tile row is 32 consecutive floats of a row */
                const __mmask16 k0 = vm_first(k - p0), k1 = vm_first(k - p0 - 16);
                for (int r = 0; r < 16; r++) {
                    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
                    if (i0 + r < m) {
                        lo = _mm512_maskz_loadu_ps(k0, A + (i0 + r) * ars + p0);
                        hi = _mm512_maskz_loadu_ps(k1, A + (i0 + r) * ars + p0 + 16);
                    }
                    split32(lo, hi, parts, part);
                    for (int i = 0; i < parts; i++) _mm512_storeu_si512(tile + i * part_stride + r * 32, part[i]);
                }
            } else { /* pairs of k rows interleaved, then a 32-bit transpose */
                const __mmask16 km = vm_first(m - i0);
                __m512i t[TILE_PARTS][16];
                for (int q = 0; q < 16; q++) {
                    __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
                    if (p0 + 2 * q < k) x0 = _mm512_maskz_loadu_ps(km, A + i0 + (p0 + 2 * q) * acs);
                    if (p0 + 2 * q + 1 < k) x1 = _mm512_maskz_loadu_ps(km, A + i0 + (p0 + 2 * q + 1) * acs);
                    split32(x0, x1, parts, part);
                    for (int i = 0; i < parts; i++) t[i][q] = _mm512_permutexvar_epi16(ileave, part[i]);
                }
                for (int i = 0; i < parts; i++) {
                    transpose16x16_epi32(t[i]);
                    for (int r = 0; r < 16; r++) _mm512_storeu_si512(tile + i * part_stride + r * 32, t[i][r]);
                }
            }
        }
}

/* Pack B (k, n), rows ldb apart, as tiles (nt, kt) into the view dst; overwrites. */
static void pack_b(tile_view dst, const float *B, int64_t ldb, int64_t k, int64_t n) {
    const int parts = dst.parts;
    const int64_t part_stride = dst.part_stride;
    const __m512i ileave = interleave_idx();
    for (int64_t nt = 0; nt < ma_cdiv(n, 16); nt++) {
        const __mmask16 nm = vm_first(n - nt * 16);
        for (int64_t kt = 0; kt < ma_cdiv(k, 32); kt++) {
            uint16_t *tile = dst.p + nt * dst.os + kt * dst.ks;
            for (int q = 0; q < 16; q++) {
                const int64_t p = kt * 32 + 2 * q;
                __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
                if (p < k) x0 = _mm512_maskz_loadu_ps(nm, B + p * ldb + nt * 16);
                if (p + 1 < k) x1 = _mm512_maskz_loadu_ps(nm, B + (p + 1) * ldb + nt * 16);
                __m512i part[TILE_PARTS];
                split32(x0, x1, parts, part);
                for (int i = 0; i < parts; i++)
                    _mm512_storeu_si512(tile + i * part_stride + q * 32, _mm512_permutexvar_epi16(ileave, part[i]));
            }
        }
    }
}

/* ---- bfloat16 inputs, packed from memory ----------------------------------
 *
 * A bfloat16 input is one part (exact), and its rows already hold bf16 pairs:
 * the packers below read X (rows ld elements apart, unit column stride) as it
 * is, with no float32 round trip, into the same layout as pack_a / _b
 * with one part. trans = 0: the operand is X itself; trans = 1: X^T. */

/* The mask of the first n of 32 elements (vm_first for 16-bit lanes). */
static inline __mmask32 tail_mask32(int64_t n) {
    return n >= 32 ? (__mmask32)0xffffffffu : n <= 0 ? (__mmask32)0 : (__mmask32)((1u << n) - 1u);
}

/* One tile's 16 registers from X (rows ld elements apart), tile (outer o0,
 * k p0) of an operand with nouter x k elements:
 *   pairs = 0: t[r] = the 32 elements p0.. of row o0 + r;
 *   pairs = 1: t[q] = rows p0 + 2q and p0 + 2q + 1 at the 16 columns o0..,
 *              interleaved (dword n = the pair of column o0 + n);
 * zero past k and nouter; then transposed as 16 x 16 dwords when tr. */
static inline void bf16_tile(__m512i t[16], const uint16_t *X, int64_t ld, int64_t o0, int64_t nouter, int64_t p0,
                             int64_t k, int pairs, int tr, __m512i ileave) {
    if (!pairs) {
        const __mmask32 km = tail_mask32(k - p0);
        for (int r = 0; r < 16; r++)
            t[r] = o0 + r < nouter ? _mm512_maskz_loadu_epi16(km, X + (o0 + r) * ld + p0) : _mm512_setzero_si512();
    } else {
        const __mmask16 cm = vm_first(nouter - o0);
        for (int q = 0; q < 16; q++) {
            const int64_t p = p0 + 2 * q;
            const __m256i lo = p < k ? _mm256_maskz_loadu_epi16(cm, X + p * ld + o0) : _mm256_setzero_si256();
            const __m256i hi = p + 1 < k ? _mm256_maskz_loadu_epi16(cm, X + (p + 1) * ld + o0) : _mm256_setzero_si256();
            t[q] = _mm512_permutexvar_epi16(ileave, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
        }
    }
    if (tr) transpose16x16_epi32(t);
}

/* Every tile (outer, kt) of an operand with nouter x k elements into the
 * one-part view dst, by bf16_tile; overwrites. */
static void pack_bf16(tile_view dst, const uint16_t *X, int64_t ld, int64_t nouter, int64_t k, int pairs, int tr) {
    const __m512i ileave = interleave_idx();
    for (int64_t ot = 0; ot < ma_cdiv(nouter, 16); ot++)
        for (int64_t kt = 0; kt < ma_cdiv(k, 32); kt++) {
            uint16_t *tile = dst.p + ot * dst.os + kt * dst.ks;
            __m512i t[16];
            bf16_tile(t, X, ld, ot * 16, nouter, kt * 32, k, pairs, tr, ileave);
            for (int r = 0; r < 16; r++) _mm512_storeu_si512(tile + r * 32, t[r]);
        }
}

/* A (m, k): A[i, p] = X[i ld + p] (trans 0: a tile row is 32 elements of a
 * row) or X[p ld + i] (trans 1: pairs of rows interleaved, then a 32-bit
 * transpose). */
static void pack_a_bf16(tile_view dst, const uint16_t *X, int64_t ld, int64_t m, int64_t k, int trans) {
    pack_bf16(dst, X, ld, m, k, trans, trans);
}

/* B (k, n): B[p, j] = X[p ld + j] (trans 0: pairs of rows interleaved) or
 * X[j ld + p] (trans 1: a row's pairs are a tile column: 16 rows, then a
 * 32-bit transpose). */
static void pack_b_bf16(tile_view dst, const uint16_t *X, int64_t ld, int64_t k, int64_t n, int trans) {
    pack_bf16(dst, X, ld, n, k, !trans, trans);
}

/* B (D, 16): column r = the D bfloat16 at rows[r] (NULL: zeros), D a multiple of 32: each
 * row's 16 pairs of a k tile are a tile column (16 rows, then a 32-bit transpose). The rows
 * path's Q^T (FN(tiles_rows_scores), tiles_hooks.h). */
static inline void pack_rows_as_b_bf16(tile_view dst, const uint16_t *const rows[16], int64_t D) {
    for (int64_t kt = 0; kt < D / 32; kt++) {
        __m512i t[16];
        for (int r = 0; r < 16; r++) t[r] = rows[r] ? _mm512_loadu_si512(rows[r] + kt * 32) : _mm512_setzero_si512();
        transpose16x16_epi32(t);
        for (int r = 0; r < 16; r++) _mm512_storeu_si512(dst.p + kt * dst.ks + r * 32, t[r]);
    }
}

/* dst = the A tile src with its k columns from rem on zeroed (0 < rem < 32): the last k
 * tile of a view into a longer packed matrix (tile_gemm_kclip, tiles_hooks.h). */
static inline void tile_a_keep_k(uint16_t *dst, const uint16_t *src, int64_t rem) {
    const __mmask32 keep = (__mmask32)((1ull << rem) - 1);
    for (int r = 0; r < 16; r++)
        _mm512_storeu_si512(dst + r * 32, _mm512_maskz_mov_epi16(keep, _mm512_loadu_si512(src + r * 32)));
}

/* dst (nr, ncol) = the int8 rows of src (row r at src + r st[2], elements st[3] apart) as
 * bfloat16, exactly (an 8-bit integer has at most 8 significant bits): an 8-bit cache's K
 * and V for the one-part packers, without float32 rows between. */
static void i8_rows_bf16(uint16_t *dst, const int8_t *src, const int64_t st[4], int64_t nr, int64_t ncol) {
    for (int64_t r = 0; r < nr; r++) {
        const int8_t *x = src + r * st[2];
        uint16_t *y = dst + r * ncol;
        int64_t c = 0;
        if (st[3] == 1)
            for (; c + 16 <= ncol; c += 16) {
                const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x + c))));
                _mm256_storeu_si256((__m256i *)(y + c),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16)));
            }
        for (; c < ncol; c++) y[c] = ma_f32_to_bf16((float)x[c * st[3]]);
    }
}

#endif /* MA_TILES_PACK_H */
