/*
 * svebf16.c -- the float-accumulating attention kernels with their bfloat16
 * matrix products on SVE's BFMMLA (SVE + BF16: AWS Graviton 3 and 4, NVIDIA
 * Grace, Neoverse V1, V2, N2), at any SVE vector length: one build for 128 to
 * 2048 bits. Compiled with -march=armv8.6-a+sve+bf16 and no fixed length
 * (setup.py); called only where the CPU has SVE-BF16 (common/isa.c) and for
 * bfloat16 only (dispatch.c sends float32 and float16 calls of this variant to
 * NEON's instance, as x86 sends avx512bf16's to avx512). Operands are packed
 * by tiles_pack_mmla.h, the hooks are tiles_hooks.h's, as on AMX and
 * AVX512-BF16; every other building block (exp, column max, transpose, short
 * query blocks) is NEON's, whose fixed 128-bit vectors run on every length.
 *
 * One BFMMLA takes, per 128-bit segment, a 2 x 4 block of A and a 4 x 2 block
 * of B to a 2 x 2 block of C: 16 multiply-adds per segment, four times a
 * float32 FMA's. The block below keeps 8 rows (4 row pairs) x 4 vectors of
 * column pairs in 16 accumulators; an A block is loaded replicated into every
 * segment (LD1RQ), a vector of B blocks is one load. A result's k order is
 * the same at every vector length (each accumulator lane sums its own k quads
 * in order), so the bits do not depend on it.
 *
 * Precision, as avx512bf16's (same parts and terms): Q, K, V and dO one part,
 * P and dS two. BFMMLA rounds its sums to odd and flushes denormals
 * (Armv8.6's BF16 arithmetic, FPCR ignored): each of a k quad's two pair sums
 * is rounded once, then added to the accumulator and rounded again, where
 * VDPBF16PS and AMX round to nearest even. Round-to-odd's error is one ulp
 * where nearest's is half of one: the accuracy tests hold it to the same
 * bounds as the x86 tile variants.
 */
#include <arm_sve.h>
#include <math.h>
#include <string.h>

#include "common/simd_neon.h"

#define BLK(name) name##_neon /* every block but the products: NEON's */
#include "blocks_simd.h"
#include "common/dtype.h"
#include "masked_attn.h"
#include "tiles_pack_mmla.h"

/* ---- the matrix product on BFMMLA ------------------------------------------- */

/* The 16 accumulators of a block: row pair r (rows 2r, 2r + 1), vector v (column pairs). */
#define ACC_EACH(X) \
    X(0, 0)         \
    X(0, 1)         \
    X(0, 2) X(0, 3) X(1, 0) X(1, 1) X(1, 2) X(1, 3) X(2, 0) X(2, 1) X(2, 2) X(2, 3) X(3, 0) X(3, 1) X(3, 2) X(3, 3)

/* C rows i0 .. i0 + rows (<= 8, rows of A tile mt from r0) by the columns of the four
 * vectors (vector v: columns jc[v] .. jc[v] + cols, B tile offset bo[v], nb[v] live bf16 lanes). An
 * accumulator's lanes hold, per segment s, C[2r][c], C[2r][c + 1], C[2r + 1][c],
 * C[2r + 1][c + 1], c = jc[v] + 2 s: the two rows' pairs of floats interleaved as 64-bit
 * elements, which ZIP1 builds from C's rows and UZP1 / UZP2 take apart. */
static inline void mmla_block(tile_view a, int64_t mt, int64_t r0, int64_t rows, tile_view b, const int64_t bo[4],
                              const int64_t jc[4], const int64_t nb[4], int64_t cols, int64_t n, int64_t nkt, int terms,
                              float *C, int64_t ldc, int accumulate) {
    const svbool_t all16 = svptrue_b16();
    const int64_t i0 = mt * 16 + r0;
    /* each vector's B lanes (pb), and its live float32 lanes of a C row: its columns below n (pc) */
#define PREDS(v)                                             \
    const svbool_t pb##v = svwhilelt_b16((int64_t)0, nb[v]); \
    const svbool_t pc##v = svwhilelt_b32((int64_t)0, ma_max(0, ma_min(n - jc[v], cols)));
    PREDS(0)
    PREDS(1)
    PREDS(2)
    PREDS(3)
#undef PREDS
#define INIT(r, v)                                                                                                 \
    svfloat32_t c##r##v = svdup_n_f32(0.0f);                                                                       \
    if (accumulate && 2 * (r) < rows) {                                                                            \
        const svfloat64_t lo = svreinterpret_f64_f32(svld1_f32(pc##v, C + (i0 + 2 * (r)) * ldc + jc[v]));          \
        const svfloat64_t hi = 2 * (r) + 1 < rows                                                                  \
                                   ? svreinterpret_f64_f32(svld1_f32(pc##v, C + (i0 + 2 * (r) + 1) * ldc + jc[v])) \
                                   : svdup_n_f64(0.0);                                                             \
        c##r##v = svreinterpret_f32_f64(svzip1_f64(lo, hi));                                                       \
    }
    ACC_EACH(INIT)
#undef INIT
    for (int64_t kt = 0; kt < nkt; kt++)
        for (int i = 0; i < a.parts && i < terms; i++) {
            const bfloat16_t *at = (const bfloat16_t *)(a.p + i * a.part_stride + mt * a.os + kt * a.ks) + (r0 / 2) * 8;
            for (int j = 0; j < b.parts && i + j < terms; j++) {
                const bfloat16_t *bt = (const bfloat16_t *)(b.p + j * b.part_stride + kt * b.ks);
                for (int g = 0; g < 8; g++) {
                    const bfloat16_t *ag = at + g * 64, *bg = bt + g * 64;
                    const svbfloat16_t a0 = svld1rq_bf16(all16, ag), a1 = svld1rq_bf16(all16, ag + 8),
                                       a2 = svld1rq_bf16(all16, ag + 16), a3 = svld1rq_bf16(all16, ag + 24);
                    const svbfloat16_t b0 = svld1_bf16(pb0, bg + bo[0]), b1 = svld1_bf16(pb1, bg + bo[1]),
                                       b2 = svld1_bf16(pb2, bg + bo[2]), b3 = svld1_bf16(pb3, bg + bo[3]);
#define MMLA(r, v) c##r##v = svbfmmla_f32(c##r##v, a##r, b##v);
                    ACC_EACH(MMLA)
#undef MMLA
                }
            }
        }
#define STORE(r, v)                                                                                          \
    if (2 * (r) < rows) {                                                                                    \
        const svfloat64_t x = svreinterpret_f64_f32(c##r##v);                                                \
        svst1_f32(pc##v, C + (i0 + 2 * (r)) * ldc + jc[v], svreinterpret_f32_f64(svuzp1_f64(x, x)));         \
        if (2 * (r) + 1 < rows)                                                                              \
            svst1_f32(pc##v, C + (i0 + 2 * (r) + 1) * ldc + jc[v], svreinterpret_f32_f64(svuzp2_f64(x, x))); \
    }
    ACC_EACH(STORE)
#undef STORE
}

/* C (m, n) = [C +] A (m, k) @ B (k, n) from packed views (tiles_hooks.h): blocks of 8 rows by
 * 4 vectors of column pairs, cpv = min(segments, 8) pairs a vector (a vector never crosses a
 * B tile's 8 pairs; from 1024 bits on it holds one tile's and leaves the rest of its lanes
 * off). Vectors past n read nothing (no live lanes). */
static void tile_gemm(int64_t m, int64_t n, int64_t k, tile_view a, tile_view b, float *C, int64_t ldc, int accumulate,
                      int terms) {
    const int64_t nmt = ma_cdiv(m, 16), nkt = ma_cdiv(k, 32), seg = (int64_t)svcntb() / 16;
    const int64_t cpv = seg < 8 ? seg : 8, ncols = 4 * 2 * cpv;
    for (int64_t mt = 0; mt < nmt; mt++)
        for (int64_t r0 = 0; r0 < 16 && mt * 16 + r0 < m; r0 += 8)
            for (int64_t j0 = 0; j0 < n; j0 += ncols) {
                int64_t bo[4], jc[4], nb[4];
                for (int v = 0; v < 4; v++) {
                    jc[v] = j0 + v * 2 * cpv;
                    nb[v] = jc[v] < n ? 8 * cpv : 0;
                    bo[v] = jc[v] < n ? (jc[v] / 16) * b.os + ((jc[v] % 16) / 2) * 8 : 0;
                }
                mmla_block(a, mt, r0, ma_min(8, m - mt * 16 - r0), b, bo, jc, nb, 2 * cpv, n, nkt, terms, C, ldc,
                           accumulate);
            }
}

static inline void tile_begin(void) {}
static inline void tile_end(void) {}

/* bfloat16 only (dispatch.c): inputs one part, P and dS two (see the top). */
static tile_prec tile_precision(ma_dtype dt) {
    (void)dt;
    return tile_prec_bf16;
}

/* ---- the instance: the template's loops, NEON blocks, tile hooks on BFMMLA ---- */
#define TILE_ISA svebf16
#define TILE_BLK neon
#include "tiles_hooks.h"

static void gemm_svebf16_2(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                           int64_t ldb, float *C, int64_t ldc, int accumulate) {
    tile_gemm_terms(m, n, k, A, ars, acs, B, ldb, C, ldc, accumulate, 2);
}

/* The harness tests the product on split operands, 2 parts, as the kernels take P and dS; the
 * other blocks are NEON's. (3 parts, float32's own precision on AMX, are not offered: BFMMLA's
 * round-to-odd sums leave about 2^-23 of the sum's magnitude per k quad, past that bound.) */
const ma_blocks ma_blocks_svebf16_2 = {.name = "svebf16_2", .gemm = gemm_svebf16_2};
const ma_attn_kernels ma_attn_kernels_svebf16 = {
    attn_fwd_svebf16,        attn_bwd_delta_svebf16,    attn_bwd_fused_svebf16,
    attn_bwd_reduce_svebf16, fwd_scratch_bytes_svebf16, bwd_scratch_bytes_svebf16,
    attn_decode_svebf16,     attn_decode_merge_svebf16, decode_scratch_bytes_svebf16};
