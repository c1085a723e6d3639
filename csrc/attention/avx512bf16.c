/*
 * avx512bf16.c -- the float-accumulating attention kernels with their
 * bfloat16 matrix products on VDPBF16PS (AVX512-BF16): for CPUs that have
 * AVX512-BF16 but no AMX (AMD Zen 4 and 5, Intel Cooper Lake). Compiled with
 * -mavx512bf16 and AVX-512 flags (setup.py); called only where the CPU has
 * them: bfloat16's default on AMD's (common/isa.c, ma_isa_best, says why),
 * else where MASKED_ATTN_ISA=avx512bf16 asks for it. Operands are packed by tiles_pack.h in AMX's tile
 * layout, the hooks are tiles_hooks.h's, as on AMX; every other building
 * block (exp, column max, transpose, short query blocks) is AVX-512's.
 *
 * One VDPBF16PS multiplies 16 pairs of bf16 by 16 pairs and adds each pair's
 * two products to a float32 lane: twice the multiply-adds of one float32
 * FMA. With a B tile row (16 columns x a k pair) in a register and an A
 * element pair broadcast, C row r of a 16-column tile takes one instruction
 * per k pair, exactly what TDPBF16PS computes for the whole tile.
 *
 * Precision: bfloat16 only, AMX's: Q, K, V and dO are one part (exact), P and
 * dS two (about 16 bits; TERMS = 2), so Q K^T and dO V^T are one product and
 * P V, dS K, dS^T Q, P^T dO two. One part for P and dS (8 bits, as native's
 * flash kernel rounds them) would make every product one instruction, but
 * its error is up to 3.8x that of native's math kernel, which keeps them in
 * float32 (docs/design.md, section 6): past the 2x rule. float16 would need
 * two parts per input (three products for Q K^T), no faster than the float32
 * FMAs, so dispatch.c sends float16 and float32 calls of this variant to the
 * AVX-512 instance: this one only ever sees bfloat16.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "common/simd_avx512.h"

#define BLK(name) name##_avx512 /* every block but the products: AVX-512's */
#include "blocks_simd.h"
#include "common/dtype.h"
#include "masked_attn.h"
#include "tiles_pack.h"

/* ---- the matrix product on zmm registers ------------------------------------ */

/* One element pair of a packed A tile, as 32 bits. */
static inline int32_t dp_pair(const uint16_t *p) {
    int32_t x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* C rows r0..r0+7 of A tile row block mt, columns of B tiles nt (and nt + 1
 * when NT == 2): c[r][t] += sum over k tiles, parts (i, j) with i + j <
 * terms, and the 16 k pairs q of A_i[r][2q, 2q+1] . B_j[2q, 2q+1][column].
 * 8 x NT accumulators; per k pair NT row loads of B and 8 broadcasts of A. */
static inline __attribute__((always_inline)) void dp_block(const int NT, tile_view a, int64_t mt, int64_t r0,
                                                           tile_view b, int64_t nt, int64_t nkt, int terms,
                                                           __m512 c[8][2]) {
    for (int64_t kt = 0; kt < nkt; kt++)
        for (int i = 0; i < a.parts && i < terms; i++) {
            const uint16_t *at = a.p + i * a.part_stride + mt * a.os + kt * a.ks + r0 * 32;
            for (int j = 0; j < b.parts && i + j < terms; j++) {
                const uint16_t *bt = b.p + j * b.part_stride + nt * b.os + kt * b.ks;
                for (int q = 0; q < 16; q++) {
                    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bt + q * 32);
                    const __m512bh b1 = NT == 2 ? (__m512bh)_mm512_loadu_si512(bt + b.os + q * 32) : b0;
#pragma GCC unroll 8
                    for (int r = 0; r < 8; r++) {
                        const __m512bh ar = (__m512bh)_mm512_set1_epi32(dp_pair(at + r * 32 + 2 * q));
                        c[r][0] = _mm512_dpbf16_ps(c[r][0], ar, b0);
                        if (NT == 2) c[r][1] = _mm512_dpbf16_ps(c[r][1], ar, b1);
                    }
                }
            }
        }
}

/* C (m, n) = [C +] A (m, k) @ B (k, n) from packed views (tiles_hooks.h):
 * blocks of 8 rows x 32 columns (16 at the last odd B tile), C read and
 * written once per block with masks at the edges. */
static void tile_gemm(int64_t m, int64_t n, int64_t k, tile_view a, tile_view b, float *C, int64_t ldc, int accumulate,
                      int terms) {
    const int64_t nmt = ma_cdiv(m, 16), nnt = ma_cdiv(n, 16), nkt = ma_cdiv(k, 32);
    for (int64_t mt = 0; mt < nmt; mt++)
        for (int64_t r0 = 0; r0 < 16 && mt * 16 + r0 < m; r0 += 8) {
            const int64_t i0 = mt * 16 + r0, rows = ma_min(8, m - i0);
            for (int64_t nt = 0; nt < nnt; nt += 2) {
                const int NT = nnt - nt >= 2 ? 2 : 1;
                const int64_t j0 = nt * 16;
                const __mmask16 m0 = vm_first(n - j0), m1 = NT == 2 ? vm_first(n - j0 - 16) : 0;
                __m512 c[8][2];
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    const int live = accumulate && r < rows;
                    c[r][0] = live ? _mm512_maskz_loadu_ps(m0, C + (i0 + r) * ldc + j0) : _mm512_setzero_ps();
                    c[r][1] =
                        live && NT == 2 ? _mm512_maskz_loadu_ps(m1, C + (i0 + r) * ldc + j0 + 16) : _mm512_setzero_ps();
                }
                if (NT == 2) dp_block(2, a, mt, r0, b, nt, nkt, terms, c);
                else dp_block(1, a, mt, r0, b, nt, nkt, terms, c);
                for (int r = 0; r < rows; r++) {
                    _mm512_mask_storeu_ps(C + (i0 + r) * ldc + j0, m0, c[r][0]);
                    if (NT == 2) _mm512_mask_storeu_ps(C + (i0 + r) * ldc + j0 + 16, m1, c[r][1]);
                }
            }
        }
}

static inline void tile_begin(void) {}
static inline void tile_end(void) {}

/* bfloat16 only (dispatch.c): inputs one part, P and dS two (see the top). */
static tile_prec tile_precision(ma_dtype dt) {
    (void)dt;
    return tile_prec_bf16;
}

/* ---- the instance: the template's loops, AVX-512 blocks, tile hooks on VDPBF16PS ---- */
#define TILE_ISA avx512bf16
#define TILE_BLK avx512
#include "tiles_hooks.h"

static void gemm_avx512bf16_2(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                              int64_t ldb, float *C, int64_t ldc, int accumulate) {
    tile_gemm_terms(m, n, k, A, ars, acs, B, ldb, C, ldc, accumulate, 2);
}

static void gemm_avx512bf16_3(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                              int64_t ldb, float *C, int64_t ldc, int accumulate) {
    tile_gemm_terms(m, n, k, A, ars, acs, B, ldb, C, ldc, accumulate, 3);
}

/* The harness tests the product on split operands (2 and 3 parts, as AMX's), and the integer
 * scores, which this unit's copy of AVX-512's blocks takes on VNNI (vpdpwssd); the other
 * blocks are AVX-512's. */
const ma_blocks ma_blocks_avx512bf16_2 = {.name = "avx512bf16_2",
                                          .gemm = gemm_avx512bf16_2,
                                          .dot_rows_i8 = dot_rows_i8_avx512,
                                          .axpy_keys_i8 = axpy_keys_i8_avx512};
const ma_blocks ma_blocks_avx512bf16_3 = {.name = "avx512bf16_3", .gemm = gemm_avx512bf16_3};
const ma_attn_kernels ma_attn_kernels_avx512bf16 = {
    attn_fwd_avx512bf16,        attn_bwd_delta_avx512bf16,    attn_bwd_fused_avx512bf16,
    attn_bwd_reduce_avx512bf16, fwd_scratch_bytes_avx512bf16, bwd_scratch_bytes_avx512bf16,
    attn_decode_avx512bf16,     attn_decode_merge_avx512bf16, decode_scratch_bytes_avx512bf16};
