/*
 * simd.h -- the SIMD vocabulary: what a vector instruction set provides so
 * that the blocks written once over it (attention/blocks_simd.h,
 * cross_entropy/blocks_simd.h) run on it. One header per instruction set
 * implements it (simd_avx2.h, simd_avx512.h, simd_neon.h, simd_sve.h), included by the
 * translation units compiled with that set's flags (setup.py). Private to the kernels.
 *
 * Types and shape:
 *   MA_VL            float32 lanes per vector (4, 8, 16; SVE 4 to 64)
 *   vf, vd, vi       MA_VL floats, MA_VL / 2 doubles, MA_VL int32
 *   vm               a lane mask: a vector of all-ones lanes (AVX2, NEON) or a
 *                    mask register (AVX-512, SVE); vm_bits(m) its lanes as the
 *                    bits of a uint64_t, lane 0 the lowest; vm_any(m): some lane set
 * Memory (p any address; _m: lanes outside the mask read 0, are not written):
 *   vf_load, vf_store, vf_load_m, vf_store_m, vf_stream (non-temporal where
 *   the set has such stores, aligned), vf_stream_fence() (orders them)
 *   vf_load_dt(base, dt, off, n)      n elements from base + off of dtype dt
 *                                     (float32, bfloat16, float16, int8) as float32;
 *                                     n >= MA_VL: a whole vector, else the rest 0
 *   vf_store_dt(base, dt, off, n, v)  the first min(n, MA_VL) lanes as dt,
 *                                     rounded to nearest even
 *   vf_store_i8(p, n, v)              the first min(n, MA_VL) lanes rounded to the
 *                                     nearest integer (ties to even) as int8 at p;
 *                                     lanes in [-128, 127] (the caller clamps)
 * Lanes: vf_zero, vf_set1, vf_add, vf_sub, vf_mul, vf_div, vf_max, vf_min
 *   (vmaxps / vminps: the second operand where either is NaN), vf_andnot,
 *   vf_fma(a, b, c) = a b + c, vf_fms = a b - c, vf_fnma = c - a b (one
 *   rounding), vf_exp, vf_tanh (below); vf_in_reg(v) (v, held in a register where it stands:
 *   a register tile's operand loaded once for its FMAs, which x86 compilers otherwise fold
 *   into each FMA as a load of its own)
 * Masks: vm_first(n) (lanes < n, n clamped to [0, MA_VL]), vf_lt, vf_gt,
 *   vf_eq, vf_neq, vf_isnan, vm_or, vm_and, vf_blend(m, a, b) (m ? b : a),
 *   vf_maskz(m, a) (m ? a : 0), vf_from_mask (all-ones lanes where m)
 * Across lanes: vf_lane0(v) (lane 0, where it lies: of a broadcast, the scalar without
 *   keeping it in a register of its own), vf_hsum(v) (a fixed tree per set), vf_hmax(v, m) (max of m
 *   and the lanes), vf_transpose(r) (the MA_VL x MA_VL block in r[0..MA_VL)
 *   transposed in registers); optionally (#define MA_FOLD_LANES) vf_fold_lanes(r) (lane i:
 *   r[i]'s lanes folded in halves, what vf_transpose and log2(VL) halvings give), and with it
 *   optionally (#define MA_FOLD_QUARTER) that fold in two steps: vf_fold_quarter(a, b, c, d)
 *   (four vectors' first halvings, to MA_VL / 4 partial sums each, in one vector) and
 *   vf_fold_quarters(z) (MA_VL / 4 of those: vf_fold_lanes of their 4 MA_VL vectors)
 * Doubles: vd_zero, vd_lo(v), vd_hi(v) (lanes [0, MA_VL/2) and the rest of a
 *   vf, widened), vd_add, vd_mul, vd_fma, vd_store
 * Integers (Philox): vi_set1, vi_lanes (0, 1, ...), vi_add, vi_xor, vi_and,
 *   vi_srl32, vi_mul_even (even lanes' unsigned 32 x 32 -> 64-bit products),
 *   vi_srl64, vi_sll64, vi_blend_odd(a, b) (odd lanes from b), vi_gt -> vm
 * Integer products (the 8-bit cache's scores: exact, so every set's sums are the same):
 *   vh: MA_HL int8 or int16 elements as the set's product takes them (AVX2, AVX-512: int16,
 *   NEON: int16, SVE: widened to int32 lanes); vs: signed int32 lanes (sums).
 *   vh_load_i8(p), vh_load_i16(p) (MA_HL elements at p, widened), vh_in_reg (as vf_in_reg),
 *   vs_zero, vs_dot(acc, a, b) (acc + a's and b's elementwise products, summed into acc's
 *   lanes: which lane takes which product is the set's), vs_hsum(v) (its lanes' sum), vs_to_f
 *   (lanes to float32, rounded to nearest even);
 *   optionally (#define MA_FOLD_LANES_I) vs_fold_lanes(r) (lane i: the sum of r[i]'s lanes)
 *   optionally (#define MA_VH_LOAD_N) vh_load_i8_n(p, n), vh_load_i16_n(p, n) (n < MA_HL
 *   elements at p, the other lanes 0: D's last elements in the vectors, not in scalar integers)
 *   P V in integers (two keys a step: the 8-bit cache's values, blocks_simd.h axpy_keys_i8):
 *   vh_zip_lo(a, b), vh_zip_hi(a, b) (two keys' MA_HL values as the set's pair product takes
 *   them), vp and vp_set(pair) (a row's two int16 probabilities, key c's in pair's low half),
 *   vs_pair_dot(acc, x0, x1, j, p) (sum j of the MA_VS_PER_VH a vh's dims fill: acc + each
 *   dim's two products), vs_unzip_f(a0, a1, j) (the float32 of dims j MA_VL .. j MA_VL + MA_VL
 *   of the pair's sums a0, a1, in order), vf_store_i16(p, n, v) (as vf_store_i8, int16; lanes
 *   within int16); MA_PVI_NU(R) vh of dims a tile of R rows keeps
 * Block shapes, constants the blocks read (attention/blocks_simd.h says what
 * each shapes): MA_GEMM_MR, MA_GEMM_NV, MA_GEMM_TAIL_MR, MA_GEMM_TAIL_NV,
 *   MA_GEMM_PACK, MA_MASKED_EDGES, MA_KT_NV(nr), MA_AXPY_ROWS, MA_AXPY_NV(R),
 *   MA_DR_CHAINS, MA_DR_ROWS;
 *   MA_CE_UNROLL (cross_entropy/blocks_simd.h: vectors per block)
 *
 * A new instruction set X: 3 new files, simd_X.h defining the above and an
 * instance file per op (attention/X.c, cross_entropy/X.c) that includes
 * simd_X.h, the op's blocks_simd.h and its template and ends with its tables
 * (attention/blocks.h, "An instance"); then X beside AVX2 on each of the 8
 * lines outside AVX2's own files that name it, in 5 files
 * (tests/project/test_docs.py counts them): masked_attn.h (AVX2's row of
 * MA_ISA_TABLE, two lines: name, enum value, architecture, tile, fallback,
 * kernels, CPU probe; the enum, the names, the checks, the fallbacks, the
 * externs and the three dispatch switches are generated from the rows),
 * setup.py (flags, C units), common/isa.c (ma_isa_best: to make it a
 * default), tests/c/test_blocks.c and tests/c/test_ce_blocks.c (the C
 * harnesses' tables).
 */
#ifndef MA_SIMD_H
#define MA_SIMD_H

#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "common/dtype.h"
#include "masked_attn.h"

/* ma_prefetch: into L1. ma_prefetch_l2: into L2 only, for the decoding rows' streams (K and
 * V a key block ahead): a prefetch into L1 holds one of the core's few L1 fill buffers until
 * its line arrives, which caps what one core streams at about that many lines per memory
 * latency; into L2 it does not (docs/performance/intel-amx-2cpu.md, "Decoding"). */
#if defined(__x86_64__) || defined(__i386__)
#define ma_prefetch(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define ma_prefetch_l2(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)
#else
#define ma_prefetch(p) __builtin_prefetch((const void *)(p), 0, 3)
#define ma_prefetch_l2(p) __builtin_prefetch((const void *)(p), 0, 2)
#endif

/* exp(x): x = n ln2 + r, |r| <= ln2/2 (Cody-Waite), e^r by a degree-5
 * polynomial fitted for relative error (9e-8; 1.65e-7 with float32's
 * roundings, about 2 ulp: tests/c hold it to 4e-7 of libm). Tiny results are
 * exactly 0 (-inf among them) and no operation ever makes a denormal: each
 * vector with a denormal result costs a microcode assist, and masked scores
 * (-inf) are common. AVX-512's vf_exp zeroes results below FLT_MIN (x < -87.33,
 * clamped there first); AVX2's those of x < -86.99 (below 2^-125.5, see there). NaN stays
 * NaN (it passes the clamps as their second operand). */
/* The constants both widths share: x = n ln2 + r with ln2 split in two
 * (Cody-Waite, the high part exact in 9 bits), and e^r's polynomial,
 * highest degree first, evaluated by Horner's rule. */
#define MA_EXP_LOG2E 1.44269504088896341f
#define MA_EXP_LN2_HI 0.693359375f
#define MA_EXP_LN2_LO -2.12194440e-4f
#define MA_EXP_TERMS 6
static const float ma_exp_poly[MA_EXP_TERMS] = {8.290285244584084e-3f, 4.1897889226675034e-2f, 1.666763573884964e-1f,
                                                4.999915063381195e-1f, 9.999997019767761e-1f,  1.0f};

/* tanh(x) = sign(x) t(|x|): below 0.625, t(a) = a + a^3 P(a^2) with P of degree 4,
 * fitted here for relative error (8e-8 in float32 over (0, 0.625)); from 0.625
 * on, t(a) = 1 - 2 / (exp(2 min(a, 10)) + 1), which loses at most a bit there
 * (tanh(10) rounds to 1: the clamp keeps the quotient from going denormal).
 * NaN stays NaN. Within 2.4e-7 relative of tanh everywhere (tests/c). P highest
 * degree first. Attention's soft-capping and cross-entropy's share it. A vector
 * whose lanes are all below 0.625 skips the exp branch: a soft cap is meant to
 * be rarely reached (Gemma 2: scores / 50), so that is nearly every vector. */
#define MA_TANH_SMALL 0.625f
#define MA_TANH_TERMS 5
static const float ma_tanh_poly[MA_TANH_TERMS] = {-5.775798112154007e-3f, 2.070450969040394e-2f,
                                                  -5.3760722279548645e-2f, 1.3331712782382965e-1f,
                                                  -3.3333292603492737e-1f};

#endif
