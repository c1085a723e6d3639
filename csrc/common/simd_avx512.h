/*
 * simd_avx512.h -- the SIMD vocabulary (simd.h) on AVX-512 (F, BW, DQ, VL +
 * FMA): 16 lanes, mask registers for tails, 32 vector registers.
 */
#ifndef MA_SIMD_AVX512_H
#define MA_SIMD_AVX512_H

#include <math.h>
#include <string.h>

#include "common/simd.h"

#define MA_VL 16
typedef __m512 vf;
typedef __m512d vd;
typedef __m512i vi;
typedef __mmask16 vm;

/* GEMM: full 64-column panels in 6 x 64 blocks (24 accumulators + 4 of B + 1
 * broadcast of A = 29 of the 32 registers), the last n % 64 columns in 8 x 32
 * blocks; no packing. Masked edges are as fast as plain moves. dot_keys_t:
 * 4 vectors of keys per strip for up to 4 query rows, 2 for more. axpy_keys:
 * 4 rows x 4 vectors, 2 rows x 8. */
#define MA_GEMM_MR 6
#define MA_GEMM_NV 4
#define MA_GEMM_TAIL_MR 8
#define MA_GEMM_TAIL_NV 2
#define MA_GEMM_PACK 0
#define MA_MASKED_EDGES 1
#define MA_KT_NV(nr) ((nr) <= 4 ? 4 : 2)
#define MA_DR_CHAINS 16 /* dot_rows: accumulators of a register tile (rows x keys) */
#define MA_DR_ROWS 4    /* its rows at most */
#define MA_AXPY_ROWS 4
#define MA_CE_UNROLL 8
#define MA_AXPY_NV(R) ((R) >= 3 ? 4 : 8)

#define vf_zero _mm512_setzero_ps
#define vf_set1 _mm512_set1_ps
#define vf_lane0 _mm512_cvtss_f32
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_load_m(p, m) _mm512_maskz_loadu_ps(m, p)
#define vf_store_m(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#define vf_stream_fence _mm_sfence
#define vf_stream _mm512_stream_ps
#define vf_add _mm512_add_ps
#define vf_sub _mm512_sub_ps
#define vf_mul _mm512_mul_ps
#define vf_div _mm512_div_ps
#define vf_max _mm512_max_ps
#define vf_min _mm512_min_ps
#define vf_andnot _mm512_andnot_ps
#define vf_fma _mm512_fmadd_ps
/* v in a register where it stands (simd.h) */
static inline __attribute__((always_inline)) vf vf_in_reg(vf v) {
    __asm__("" : "+v"(v));
    return v;
}
#define vf_fms _mm512_fmsub_ps
#define vf_fnma _mm512_fnmadd_ps
#define vf_lt(a, b) _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ)
#define vf_gt(a, b) _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ)
#define vf_eq(a, b) _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ)
#define vf_neq(a, b) _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ)
#define vf_isnan(a) _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q)
#define vm_or(a, b) ((vm)((a) | (b)))
#define vm_and(a, b) ((vm)((a) & (b)))
#define vm_bits(m) ((uint64_t)(m))
#define vm_any(m) ((m) != 0)
#define vf_blend(m, a, b) _mm512_mask_blend_ps(m, a, b)
#define vf_maskz(m, a) _mm512_maskz_mov_ps(m, a)
#define vf_from_mask(m) _mm512_castsi512_ps(_mm512_movm_epi32(m))
#define vf_hsum _mm512_reduce_add_ps
#define vf_hmax(v, m) _mm512_reduce_max_ps(v) /* m is among the lanes where the blocks use it */
#define vd_zero _mm512_setzero_pd
#define vd_lo(v) _mm512_cvtps_pd(_mm512_castps512_ps256(v))
#define vd_hi(v) _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1))
#define vd_add _mm512_add_pd
#define vd_mul _mm512_mul_pd
#define vd_fma _mm512_fmadd_pd
#define vd_store _mm512_storeu_pd
#define vi_set1(x) _mm512_set1_epi32((int)(x))
#define vi_lanes() _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define vi_add _mm512_add_epi32
#define vi_xor _mm512_xor_si512
#define vi_and _mm512_and_si512
#define vi_srl32 _mm512_srli_epi32
#define vi_mul_even _mm512_mul_epu32
#define vi_srl64 _mm512_srli_epi64
#define vi_sll64 _mm512_slli_epi64
#define vi_blend_odd(a, b) _mm512_mask_blend_epi32(0xAAAA, a, b)
#define vi_gt(a, b) _mm512_cmpgt_epi32_mask(a, b)

/* Integer products: 32 int16 a vh, vpmaddwd's pairs (VNNI: vpdpwssd) into 16 int32 lanes */
#define MA_HL 32
typedef __m512i vh;
typedef __m512i vs;
#define vh_load_i8(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#define vh_load_i16(p) _mm512_loadu_si512((const void *)(p))
#define MA_VH_LOAD_N /* (masked: no byte past the n read) */
#define vh_load_i8_n(p, n) _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8((__mmask32)((1ull << (n)) - 1), (p)))
#define vh_load_i16_n(p, n) _mm512_maskz_loadu_epi16((__mmask32)((1ull << (n)) - 1), (p))
#define vs_zero _mm512_setzero_si512
#ifdef __AVX512VNNI__
/* (in asm: GCC 12 copies each accumulator of the intrinsic's tile to another register and back) */
static inline __attribute__((always_inline)) __m512i vs_dot(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}
#else
#define vs_dot(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
#define vs_hsum _mm512_reduce_add_epi32
#define vs_to_f _mm512_cvtepi32_ps
/* P V in integers (pairs of keys): vpunpcklwd / vpunpckhwd zip two keys' 32 values into the int16
 * pairs of each 128-bit lane's dims 0-3 and 4-7; the sums put back in order by two vpermt2q */
#define MA_VS_PER_VH 2
#define MA_PVI_NU(R) ((R) <= 2 ? 4 : 2) /* (vh of dims a strip, R rows: one row whole at D = 128) */
typedef __m512i vp;
#define vp_set(pair) _mm512_set1_epi32(pair)
#define vh_zip_lo _mm512_unpacklo_epi16
#define vh_zip_hi _mm512_unpackhi_epi16
#define vs_pair_dot(acc, x0, x1, j, p) vs_dot(acc, (j) ? (x1) : (x0), p)
#define vs_unzip_f(a0, a1, j)                     \
    _mm512_cvtepi32_ps(_mm512_permutex2var_epi64( \
        a0, (j) ? _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15) : _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), a1))
/* The fold of 16 vectors' lanes in halves (lane i: r[i]'s, t + t + 8, then + 4, + 2, + 1): 31
 * shuffles where a transpose takes 64. After the three 4-lane levels lane 4c + m holds r[c + 4m]. */
#define MA_FOLD_LANES_I
static inline vs vs_fold_lanes(const vs r[16]) {
    __m512i y[8], z[4], w[2];
    for (int i = 0; i < 8; i++) /* y[i]: r[2i]'s t < 8, r[2i + 1]'s, each + its t + 8 */
        y[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(r[2 * i], r[2 * i + 1], 0x44),
                                _mm512_shuffle_i32x4(r[2 * i], r[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* z[i], 128 bits c: r[4i + c]'s t < 4, each + t + 4 */
        z[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(y[2 * i], y[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(y[2 * i], y[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* w[i], 128 bits c: r[8i + c]'s, r[8i + 4 + c]'s t < 2, each + t + 2 */
        w[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(z[2 * i], z[2 * i + 1]),
                                _mm512_unpackhi_epi64(z[2 * i], z[2 * i + 1]));
    const __m512i v = _mm512_add_epi32(
        _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(w[0]), _mm512_castsi512_ps(w[1]), 0x88)),
        _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(w[0]), _mm512_castsi512_ps(w[1]), 0xDD)));
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
}

static inline __attribute__((always_inline)) vh vh_in_reg(vh v) {
    __asm__("" : "+v"(v));
    return v;
}

static inline vm vm_first(int64_t n) { return n >= 16 ? (vm)0xffff : n <= 0 ? (vm)0 : (vm)((1u << n) - 1u); }

static inline __attribute__((always_inline)) vf vf_load_dt(const void *base, ma_dtype dt, int64_t off, int64_t n) {
    const vm k = vm_first(n);
    if (dt == MA_F32)
        return n >= 16 ? _mm512_loadu_ps((const float *)base + off) : vf_load_m((const float *)base + off, k);
    if (dt == MA_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, (const int8_t *)base + off)));
    const __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)base + off);
    if (dt == MA_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* bfloat16 rounds to nearest even, NaN stays a quiet NaN (ma_f32_to_bf16). */
static inline __attribute__((always_inline)) void vf_store_dt(void *base, ma_dtype dt, int64_t off, int64_t n, vf v) {
    const vm k = vm_first(n);
    if (dt == MA_BF16) {
        const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
        __m512i r = _mm512_add_epi32(
            u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1))));
        r = _mm512_srli_epi32(r, 16);
        r = _mm512_mask_mov_epi32(r, vf_isnan(v), _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
        _mm256_mask_storeu_epi16((uint16_t *)base + off, k, _mm512_cvtepi32_epi16(r));
    } else if (dt == MA_F16) {
        _mm256_mask_storeu_epi16((uint16_t *)base + off, k,
                                 _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        _mm512_mask_storeu_ps((float *)base + off, k, v);
    }
}

static inline __attribute__((always_inline)) void vf_store_i8(int8_t *p, int64_t n, vf v) {
    _mm512_mask_cvtepi32_storeu_epi8(p, vm_first(n),
                                     _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline __attribute__((always_inline)) void vf_store_i16(int16_t *p, int64_t n, vf v) {
    _mm512_mask_cvtepi32_storeu_epi16(p, vm_first(n),
                                      _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* exp (simd.h): 2^n by vscalefps, results below FLT_MIN (x < -87.33) zeroed
 * by a mask; past 88.72 it overflows to inf. */
static inline vf vf_exp(vf x_in) {
    const vm underflow = vf_lt(x_in, _mm512_set1_ps(-87.33f));
    const vf x = _mm512_max_ps(_mm512_set1_ps(-87.33f), x_in);
    const vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(MA_EXP_LOG2E)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(MA_EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(MA_EXP_LN2_LO), r);
    vf y = _mm512_set1_ps(ma_exp_poly[0]);
    for (int i = 1; i < MA_EXP_TERMS; i++) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(ma_exp_poly[i]));
    return _mm512_maskz_scalef_ps((vm)~underflow, y, n);
}

static inline vf vf_tanh(vf x) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const vf a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(x)));
    const vf t = _mm512_mul_ps(a, a);
    vf p = _mm512_set1_ps(ma_tanh_poly[0]);
    for (int i = 1; i < MA_TANH_TERMS; i++) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(ma_tanh_poly[i]));
    const vf small = _mm512_fmadd_ps(_mm512_mul_ps(a, t), p, a);
    const vm is_small = vf_lt(a, _mm512_set1_ps(MA_TANH_SMALL));
    vf y = small;
    if (is_small != 0xFFFF) { /* some lane from 0.625 on (or NaN) */
        const vf a10 = _mm512_min_ps(_mm512_set1_ps(10.0f), a); /* NaN passes (the second operand) */
        const vf e = vf_exp(_mm512_add_ps(a10, a10));
        const vf big = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                                     _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
        y = _mm512_mask_blend_ps(is_small, big, small);
    }
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(y), _mm512_and_si512(sign, _mm512_castps_si512(x))));
}

/* vs_fold_lanes' fold in float32, in the same order (blocks.h's: t + t + 8, + 4, + 2, + 1), in two
 * steps: four keys' first two halvings as their tile ends (128 bits c: r[c]'s t < 4), then four of
 * those (the quarters of VL keys) */
#define MA_FOLD_LANES
#define MA_FOLD_QUARTER
static inline vf vf_fold_quarter(vf a, vf b, vf c, vf d) {
    const vf y0 = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const vf y1 = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

static inline vf vf_fold_quarters(const vf z[4]) {
    vf w[2];
    for (int i = 0; i < 2; i++) {
        const __m512d a = _mm512_castps_pd(z[2 * i]), b = _mm512_castps_pd(z[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const vf v = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
}

static inline vf vf_fold_lanes(const vf r[16]) {
    const vf z[4] = {vf_fold_quarter(r[0], r[1], r[2], r[3]), vf_fold_quarter(r[4], r[5], r[6], r[7]),
                     vf_fold_quarter(r[8], r[9], r[10], r[11]), vf_fold_quarter(r[12], r[13], r[14], r[15])};
    return vf_fold_quarters(z);
}

static inline void vf_transpose(vf r[16]) {
    vf t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 16; i += 8) {
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
}

#endif /* MA_SIMD_AVX512_H */
