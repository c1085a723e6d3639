/*
 * tiles_pack_mmla.h -- operands packed for BFMMLA (Armv8.6 BF16: SVE's and
 * Advanced SIMD's bfloat16 matrix multiply-accumulate), read by svebf16.c's
 * tile_gemm. The tiles are tiles_layout.h's (an A tile 16 rows x 32 k, a B
 * tile 32 k x 16 columns, 512 bf16 each), the parts and terms tiles_pack.h's
 * (x = x0 + x1 + x2, each bf16; the products of parts i + j < terms). Only
 * the order inside a tile is BFMMLA's own.
 *
 * One BFMMLA multiplies, in each 128-bit segment of its operands, a 2 x 4
 * block of A (two rows, four k) by a 4 x 2 block of B (four k, two columns),
 * both given as two 4-element rows (B's by column), and adds the 2 x 2
 * result to four float32 lanes. So a tile holds 8 x 8 such blocks of 8 bf16
 * (16 bytes): block (o2, g) of outer index pair o2 (rows 2 o2, 2 o2 + 1 of A;
 * columns of B) and k quad g (k 4 g .. 4 g + 3) at element 8 (8 g + o2), its
 * outer index o at 4 (o % 2), k at k % 4. A and B tiles are laid out alike.
 * A k quad's 8 blocks are contiguous: a vector of B blocks at quad g is one
 * load, whatever the vector length, and an A block is one 16-byte load that
 * SVE's LD1RQ replicates into every segment.
 *
 * Whole tiles are packed with NEON (baseline on aarch64): from rows along k, a
 * block is two 4-element loads; from rows along the outer index, 4 k rows of
 * 8 outer elements are interleaved by ZIP1/ZIP2 on 16 and 32 bits. float32 is
 * rounded to bfloat16 in integer lanes, exactly as ma_f32_to_bf16, so that a
 * tile at an edge (packed element by element) holds the same bits as a whole
 * one: a row's results never depend on where its tile ends.
 */
#ifndef MA_TILES_PACK_MMLA_H
#define MA_TILES_PACK_MMLA_H

#include <arm_neon.h>
#include <string.h>

#include "common/dtype.h"
#include "masked_attn.h"
#include "tiles_layout.h"

/* The element of a tile at outer index o (A's row, B's column) and k index kk. */
static inline int mmla_off(int o, int kk) { return ((kk >> 2) * 8 + (o >> 1)) * 8 + (o & 1) * 4 + (kk & 3); }

/* The parts of x (float32), nparts of them: part[i] = bf16(x - part[0] - .. - part[i-1]). */
static inline void split_parts(float x, int nparts, uint16_t part[TILE_PARTS]) {
    for (int i = 0; i < nparts; i++) {
        part[i] = ma_f32_to_bf16(x);
        x -= ma_bf16_to_f32(part[i]);
    }
}

/* ma_f32_to_bf16 on 4 lanes: round to nearest even, NaN quieted. */
static inline uint16x4_t bf16x4_of(float32x4_t x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t r = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1))));
    const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    return vmovn_u32(vshrq_n_u32(vbslq_u32(nan, vorrq_u32(u, vdupq_n_u32(0x400000)), r), 16));
}
static inline float32x4_t f32x4_of(uint16x4_t h) { return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); }

/* The 4 k rows r[0..3] of 8 outer elements each as the 4 blocks of outer pairs 0..3: block
 * o2 = x(2 o2, 0..3), x(2 o2 + 1, 0..3), stored at d + o2 * 8. */
static inline void store_blocks_4x8(uint16_t *d, const uint16x8_t r[4]) {
    const uint16x8_t z01 = vzip1q_u16(r[0], r[1]), z23 = vzip1q_u16(r[2], r[3]);
    const uint16x8_t w01 = vzip2q_u16(r[0], r[1]), w23 = vzip2q_u16(r[2], r[3]);
    const uint32x4_t a = vreinterpretq_u32_u16(z01), b = vreinterpretq_u32_u16(z23);
    const uint32x4_t c = vreinterpretq_u32_u16(w01), e = vreinterpretq_u32_u16(w23);
    vst1q_u16(d, vreinterpretq_u16_u32(vzip1q_u32(a, b)));
    vst1q_u16(d + 8, vreinterpretq_u16_u32(vzip2q_u32(a, b)));
    vst1q_u16(d + 16, vreinterpretq_u16_u32(vzip1q_u32(c, e)));
    vst1q_u16(d + 24, vreinterpretq_u16_u32(vzip2q_u32(c, e)));
}

/* One tile of an operand with no x nk elements X(o, kk) = X[o so + kk sk], from outer o0 and
 * k p0, in parts tile + i part_stride; zero past no and nk. */
static void pack_tile_f32(uint16_t *tile, int64_t part_stride, int parts, const float *X, int64_t so, int64_t sk,
                          int64_t o0, int64_t no, int64_t p0, int64_t nk) {
    const int whole = o0 + 16 <= no && p0 + 32 <= nk;
    if (whole && sk == 1) { /* rows along k: a block is 4 elements of two rows */
        for (int g = 0; g < 8; g++)
            for (int o2 = 0; o2 < 8; o2++) {
                const float *x = X + (o0 + 2 * o2) * so + p0 + 4 * g;
                float32x4_t a = vld1q_f32(x), b = vld1q_f32(x + so);
                for (int i = 0; i < parts; i++) {
                    const uint16x4_t ha = bf16x4_of(a), hb = bf16x4_of(b);
                    vst1q_u16(tile + i * part_stride + (8 * g + o2) * 8, vcombine_u16(ha, hb));
                    a = vsubq_f32(a, f32x4_of(ha)), b = vsubq_f32(b, f32x4_of(hb));
                }
            }
        return;
    }
    if (whole && so == 1) { /* rows along the outer index: 4 k rows of 8 at a time */
        for (int g = 0; g < 8; g++)
            for (int oc = 0; oc < 16; oc += 8) {
                float32x4_t lo[4], hi[4];
                for (int q = 0; q < 4; q++) {
                    const float *x = X + (p0 + 4 * g + q) * sk + o0 + oc;
                    lo[q] = vld1q_f32(x), hi[q] = vld1q_f32(x + 4);
                }
                for (int i = 0; i < parts; i++) {
                    uint16x8_t r[4];
                    for (int q = 0; q < 4; q++) {
                        const uint16x4_t hl = bf16x4_of(lo[q]), hh = bf16x4_of(hi[q]);
                        r[q] = vcombine_u16(hl, hh);
                        lo[q] = vsubq_f32(lo[q], f32x4_of(hl)), hi[q] = vsubq_f32(hi[q], f32x4_of(hh));
                    }
                    store_blocks_4x8(tile + i * part_stride + (8 * g + oc / 2) * 8, r);
                }
            }
        return;
    }
    for (int o = 0; o < 16; o++)
        for (int kk = 0; kk < 32; kk++) {
            const float x = o0 + o < no && p0 + kk < nk ? X[(o0 + o) * so + (p0 + kk) * sk] : 0.0f;
            uint16_t part[TILE_PARTS];
            split_parts(x, parts, part);
            for (int i = 0; i < parts; i++) tile[i * part_stride + mmla_off(o, kk)] = part[i];
        }
}

/* The same from bfloat16 elements, one part (exact). */
static void pack_tile_bf16(uint16_t *tile, const uint16_t *X, int64_t so, int64_t sk, int64_t o0, int64_t no,
                           int64_t p0, int64_t nk) {
    const int whole = o0 + 16 <= no && p0 + 32 <= nk;
    if (whole && sk == 1) {
        for (int g = 0; g < 8; g++)
            for (int o2 = 0; o2 < 8; o2++) {
                const uint16_t *x = X + (o0 + 2 * o2) * so + p0 + 4 * g;
                vst1q_u16(tile + (8 * g + o2) * 8, vcombine_u16(vld1_u16(x), vld1_u16(x + so)));
            }
        return;
    }
    if (whole && so == 1) {
        for (int g = 0; g < 8; g++)
            for (int oc = 0; oc < 16; oc += 8) {
                uint16x8_t r[4];
                for (int q = 0; q < 4; q++) r[q] = vld1q_u16(X + (p0 + 4 * g + q) * sk + o0 + oc);
                store_blocks_4x8(tile + (8 * g + oc / 2) * 8, r);
            }
        return;
    }
    for (int g = 0; g < 8; g++)
        for (int o = 0; o < 16; o++) {
            uint16_t *d = tile + mmla_off(o, 4 * g);
            for (int q = 0; q < 4; q++) {
                const int64_t kk = p0 + 4 * g + q;
                d[q] = o0 + o < no && kk < nk ? X[(o0 + o) * so + kk * sk] : 0;
            }
        }
}

/* Pack A (m, k), A[i, p] = A[i*ars + p*acs], as tiles (mt, kt) in dst.parts parts; overwrites. */
static void pack_a(tile_view dst, const float *A, int64_t ars, int64_t acs, int64_t m, int64_t k) {
    for (int64_t mt = 0; mt < ma_cdiv(m, 16); mt++)
        for (int64_t kt = 0; kt < ma_cdiv(k, 32); kt++)
            pack_tile_f32(dst.p + mt * dst.os + kt * dst.ks, dst.part_stride, dst.parts, A, ars, acs, mt * 16, m,
                          kt * 32, k);
}

/* Pack B (k, n), rows ldb apart, as tiles (nt, kt) into the view dst; overwrites. */
static void pack_b(tile_view dst, const float *B, int64_t ldb, int64_t k, int64_t n) {
    for (int64_t nt = 0; nt < ma_cdiv(n, 16); nt++)
        for (int64_t kt = 0; kt < ma_cdiv(k, 32); kt++)
            pack_tile_f32(dst.p + nt * dst.os + kt * dst.ks, dst.part_stride, dst.parts, B, 1, ldb, nt * 16, n, kt * 32,
                          k);
}

/* bfloat16 inputs, one part, read as they lie: A (m, k) with A[i, p] = X[i ld + p] (trans 0)
 * or X[p ld + i] (trans 1). */
static void pack_a_bf16(tile_view dst, const uint16_t *X, int64_t ld, int64_t m, int64_t k, int trans) {
    for (int64_t mt = 0; mt < ma_cdiv(m, 16); mt++)
        for (int64_t kt = 0; kt < ma_cdiv(k, 32); kt++)
            pack_tile_bf16(dst.p + mt * dst.os + kt * dst.ks, X, trans ? 1 : ld, trans ? ld : 1, mt * 16, m, kt * 32,
                           k);
}

/* B (k, n): B[p, j] = X[p ld + j] (trans 0) or X[j ld + p] (trans 1). */
static void pack_b_bf16(tile_view dst, const uint16_t *X, int64_t ld, int64_t k, int64_t n, int trans) {
    for (int64_t nt = 0; nt < ma_cdiv(n, 16); nt++)
        for (int64_t kt = 0; kt < ma_cdiv(k, 32); kt++)
            pack_tile_bf16(dst.p + nt * dst.os + kt * dst.ks, X, trans ? ld : 1, trans ? 1 : ld, nt * 16, n, kt * 32,
                           k);
}

/* dst = the A tile src with its k columns from rem on zeroed (0 < rem < 32): the last k
 * tile of a view into a longer packed matrix (tile_gemm_kclip, tiles_hooks.h). */
static inline void tile_a_keep_k(uint16_t *dst, const uint16_t *src, int64_t rem) {
    for (int o = 0; o < 16; o++)
        for (int kk = 0; kk < 32; kk++) dst[mmla_off(o, kk)] = kk < rem ? src[mmla_off(o, kk)] : 0;
}

/* dst (nr, ncol) = the int8 rows of src (row r at src + r st[2], elements st[3] apart) as
 * bfloat16, exactly (an 8-bit integer has at most 8 significant bits): an 8-bit cache's K
 * and V for the one-part packers, without float32 rows between. */
static void i8_rows_bf16(uint16_t *dst, const int8_t *src, const int64_t st[4], int64_t nr, int64_t ncol) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < ncol; c++) dst[r * ncol + c] = ma_f32_to_bf16((float)src[r * st[2] + c * st[3]]);
}

#endif /* MA_TILES_PACK_MMLA_H */
