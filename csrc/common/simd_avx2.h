/*
 * simd_avx2.h -- the SIMD vocabulary (simd.h) on AVX2 + FMA + F16C: 8 lanes,
 * masks as vectors of all-ones lanes, 16 vector registers. Masked moves
 * (vmaskmovps, slow on AMD processors, its stores most of all) only ever
 * serve tails: the blocks move whole vectors plainly.
 */
#ifndef MA_SIMD_AVX2_H
#define MA_SIMD_AVX2_H

#include <math.h>
#include <string.h>

#include "common/simd.h"

#define MA_VL 8
typedef __m256 vf;
typedef __m256d vd;
typedef __m256i vi;
typedef __m256 vm;

/* GEMM: 6 x 16 blocks (12 accumulators + 2 of B + 1 broadcast of A = 15 of
 * the 16 registers), the same for the tail columns; panels of B at 512-byte
 * strides packed (MA_GEMM_PACK). Edges of transposes elementwise.
 * dot_keys_t: 2 vectors of keys for one query row, 1 for more. axpy_keys:
 * 2 rows x 4 vectors, 1 row x 8. */
#define MA_GEMM_MR 6
#define MA_GEMM_NV 2
#define MA_GEMM_TAIL_MR 6
#define MA_GEMM_TAIL_NV 2
#define MA_GEMM_PACK 1
#define MA_MASKED_EDGES 0
#define MA_KT_NV(nr) ((nr) == 1 ? 2 : 1)
#define MA_DR_CHAINS 8 /* dot_rows: accumulators of a register tile (rows x keys) */
#define MA_DR_ROWS 4   /* its rows at most */
#define MA_AXPY_ROWS 2
#define MA_CE_UNROLL 4
#define MA_AXPY_NV(R) ((R) == 2 ? 4 : 8)

#define vf_zero _mm256_setzero_ps
#define vf_set1 _mm256_set1_ps
#define vf_lane0 _mm256_cvtss_f32
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_load_m(p, m) _mm256_maskload_ps(p, _mm256_castps_si256(m))
#define vf_store_m(p, m, v) _mm256_maskstore_ps(p, _mm256_castps_si256(m), v)
#define vf_stream_fence _mm_sfence
#define vf_stream _mm256_stream_ps
#define vf_add _mm256_add_ps
#define vf_sub _mm256_sub_ps
#define vf_mul _mm256_mul_ps
#define vf_div _mm256_div_ps
#define vf_max _mm256_max_ps
#define vf_min _mm256_min_ps
#define vf_andnot _mm256_andnot_ps
#define vf_fma _mm256_fmadd_ps
/* v, loaded into a register where it stands: a tile's operand read once for several FMAs (else the
 * compiler folds the load into each FMA, one load per FMA) */
static inline __attribute__((always_inline)) vf vf_in_reg(vf v) {
    __asm__("" : "+x"(v));
    return v;
}
#define vf_fms _mm256_fmsub_ps
#define vf_fnma _mm256_fnmadd_ps
#define vf_lt(a, b) _mm256_cmp_ps(a, b, _CMP_LT_OQ)
#define vf_gt(a, b) _mm256_cmp_ps(a, b, _CMP_GT_OQ)
#define vf_eq(a, b) _mm256_cmp_ps(a, b, _CMP_EQ_OQ)
#define vf_neq(a, b) _mm256_cmp_ps(a, b, _CMP_NEQ_OQ)
#define vf_isnan(a) _mm256_cmp_ps(a, a, _CMP_UNORD_Q)
#define vm_or _mm256_or_ps
#define vm_and _mm256_and_ps
#define vm_bits(m) ((uint64_t)(unsigned)_mm256_movemask_ps(m))
#define vm_any(m) (_mm256_movemask_ps(m) != 0)
#define vf_blend(m, a, b) _mm256_blendv_ps(a, b, m)
#define vf_maskz(m, a) _mm256_and_ps(m, a)
#define vf_from_mask(m) (m)
#define vd_zero _mm256_setzero_pd
#define vd_lo(v) _mm256_cvtps_pd(_mm256_castps256_ps128(v))
#define vd_hi(v) _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))
#define vd_add _mm256_add_pd
#define vd_mul _mm256_mul_pd
#define vd_fma _mm256_fmadd_pd
#define vd_store _mm256_storeu_pd
#define vi_set1(x) _mm256_set1_epi32((int)(x))
#define vi_lanes() _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
#define vi_add _mm256_add_epi32
#define vi_xor _mm256_xor_si256
#define vi_and _mm256_and_si256
#define vi_srl32 _mm256_srli_epi32
#define vi_mul_even _mm256_mul_epu32
#define vi_srl64 _mm256_srli_epi64
#define vi_sll64 _mm256_slli_epi64
#define vi_blend_odd(a, b) _mm256_blend_epi32(a, b, 0xAA)
#define vi_gt(a, b) _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, b))

/* Integer products: 16 int16 a vh, vpmaddwd's pairs summed into 8 int32 lanes, then added */
#define MA_HL 16
typedef __m256i vh;
typedef __m256i vs;
#define vh_load_i8(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define vh_load_i16(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define vs_zero _mm256_setzero_si256
#define vs_dot(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#define vs_to_f _mm256_cvtepi32_ps
static inline __attribute__((always_inline)) vh vh_in_reg(vh v) {
    __asm__("" : "+x"(v));
    return v;
}
static inline int32_t vs_hsum(vs v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
/* lane i: r[i]'s 8 lanes summed (horizontal adds of pairs, then the two halves) */
#define MA_FOLD_LANES_I
static inline vs vs_fold_lanes(const vs r[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(r[0], r[1]), _mm256_hadd_epi32(r[2], r[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(r[4], r[5]), _mm256_hadd_epi32(r[6], r[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}
/* P V in integers (pairs of keys): vpunpcklwd / vpunpckhwd zip two keys' 16 values into the int16
 * pairs of each 128-bit lane's dims 0-3 and 4-7; the sums put back in order by two vperm2i128 */
#define MA_VS_PER_VH 2
#define MA_PVI_NU(R) ((R) <= 2 ? 2 : 1) /* (vh of dims a strip, R rows: 16 registers) */
typedef __m256i vp;
#define vp_set(pair) _mm256_set1_epi32(pair)
#define vh_zip_lo _mm256_unpacklo_epi16
#define vh_zip_hi _mm256_unpackhi_epi16
#define vs_pair_dot(acc, x0, x1, j, p) vs_dot(acc, (j) ? (x1) : (x0), p)
#define vs_unzip_f(a0, a1, j) \
    _mm256_cvtepi32_ps((j) ? _mm256_permute2x128_si256(a0, a1, 0x31) : _mm256_permute2x128_si256(a0, a1, 0x20))

static inline vm vm_first(int64_t n) {
    const int nn = n < 0 ? 0 : n > 8 ? 8 : (int)n;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nn), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

static inline float vf_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the lanes in order after m, a lane replacing the running value only when greater */
static inline float vf_hmax(vf v, float m) {
    float t[8], r = m;
    _mm256_storeu_ps(t, v);
    for (int i = 0; i < 8; i++) r = t[i] > r ? t[i] : r;
    return r;
}

/* 16-bit tails go through a zero-padded buffer (AVX2 has no 16-bit masked moves); int8 is
 * one 8-byte load (the tail's bytes copied into it). */
static inline __attribute__((always_inline)) vf vf_load_dt(const void *base, ma_dtype dt, int64_t off, int64_t n) {
    if (dt == MA_F32) {
        const float *x = (const float *)base + off;
        return n >= 8 ? _mm256_loadu_ps(x) : vf_load_m(x, vm_first(n));
    }
    if (dt == MA_I8) {
        const int8_t *x = (const int8_t *)base + off;
        int64_t b8 = 0;
        if (n >= 8) memcpy(&b8, x, 8);
        else memcpy(&b8, x, (size_t)(n > 0 ? n : 0));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(b8)));
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

/* bfloat16 rounds to nearest even, NaN stays a quiet NaN (ma_f32_to_bf16);
 * tails through a buffer. */
static inline __attribute__((always_inline)) void vf_store_dt(void *base, ma_dtype dt, int64_t off, int64_t n, vf v) {
    const size_t es = dt == MA_F32 ? 4 : 2;
    _Alignas(32) unsigned char buf[32];
    void *p = n >= 8 ? (void *)((char *)base + off * es) : (void *)buf;
    if (dt == MA_BF16) {
        const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
        __m256i r = _mm256_add_epi32(
            u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1))));
        r = _mm256_srli_epi32(r, 16);
        const __m256i nan = _mm256_castps_si256(vf_isnan(v));
        r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
    } else if (dt == MA_F16) {
        _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        _mm256_storeu_ps((float *)p, v);
    }
    if (n < 8 && n > 0) memcpy((char *)base + off * es, buf, (size_t)n * es);
}

/* vcvtps2dq rounds as MXCSR says: to nearest even, the default every thread starts with */
static inline __attribute__((always_inline)) void vf_store_i8(int8_t *p, int64_t n, vf v) {
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    const int64_t b8 = _mm_cvtsi128_si64(_mm_packs_epi16(w, w));
    memcpy(p, &b8, (size_t)(n >= 8 ? 8 : n > 0 ? n : 0));
}

static inline __attribute__((always_inline)) void vf_store_i16(int16_t *p, int64_t n, vf v) {
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    if (n >= 8) _mm_storeu_si128((__m128i *)(void *)p, w);
    else {
        int16_t b[8];
        _mm_storeu_si128((__m128i *)(void *)b, w);
        memcpy(p, b, sizeof(int16_t) * (size_t)(n > 0 ? n : 0));
    }
}

/* exp (simd.h) with n rounded by the 1.5 2^23 trick (one FMA: n + 126 lands
 * in t's low mantissa bits) and 2^(n-1) made by shifting those bits into the
 * exponent; the polynomial's coefficients are doubled (exactly) to make up
 * the 1/2. The bias 126 rather than 127 is what keeps results normal:
 * n = -126 (x from -87.5, the clamp, to -86.99) gives the scale's bits 0, so
 * 0, and every other n a scale of at least FLT_MIN times a polynomial above
 * 1.4. So x below -86.99 (results under 2^-125.5) gives 0, x above 88.37
 * about 2.4e38 rather than inf, and no compare or blend is needed. */
static inline vf vf_exp(vf x_in) {
    vf x = _mm256_max_ps(_mm256_set1_ps(-87.5f), x_in);
    x = _mm256_min_ps(_mm256_set1_ps(88.37f), x);
    const vf magic = _mm256_set1_ps(12582912.0f + 126.0f); /* 1.5 2^23: its ulp is 1 */
    const vf t = _mm256_fmadd_ps(x, _mm256_set1_ps(MA_EXP_LOG2E), magic);
    const vf n = _mm256_sub_ps(t, magic);
    vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(MA_EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(MA_EXP_LN2_LO), r);
    vf y = _mm256_set1_ps(2.0f * ma_exp_poly[0]);
    for (int i = 1; i < MA_EXP_TERMS; i++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(2.0f * ma_exp_poly[i]));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23)));
}

static inline vf vf_tanh(vf x) {
    const vf sign = _mm256_set1_ps(-0.0f);
    const vf a = _mm256_andnot_ps(sign, x);
    const vf t = _mm256_mul_ps(a, a);
    vf p = _mm256_set1_ps(ma_tanh_poly[0]);
    for (int i = 1; i < MA_TANH_TERMS; i++) p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(ma_tanh_poly[i]));
    const vf small = _mm256_fmadd_ps(_mm256_mul_ps(a, t), p, a);
    const vf is_small = vf_lt(a, _mm256_set1_ps(MA_TANH_SMALL));
    vf y = small;
    if (_mm256_movemask_ps(is_small) != 0xFF) { /* some lane from 0.625 on (or NaN) */
        const vf a10 = _mm256_min_ps(_mm256_set1_ps(10.0f), a); /* NaN passes (the second operand) */
        const vf e = vf_exp(_mm256_add_ps(a10, a10));
        const vf big = _mm256_sub_ps(_mm256_set1_ps(1.0f),
                                     _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
        y = _mm256_blendv_ps(big, small, is_small);
    }
    return _mm256_or_ps(y, _mm256_and_ps(sign, x));
}

/* Lane i of the result: r[i]'s lanes folded in halves (lane t + lane t + 4, then + 2, + 1), the
 * sums a transpose and three halvings give, in 15 shuffles rather than 24 */
#define MA_FOLD_LANES
static inline vf vf_fold_lanes(const vf r[8]) {
    vf y[4], z[2];
    for (int i = 0; i < 4; i++) /* y[i]: lanes t < 4 of r[2i], then of r[2i + 1], each + its lane t + 4 */
        y[i] = _mm256_add_ps(_mm256_permute2f128_ps(r[2 * i], r[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(r[2 * i], r[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* z[i]: (t, t + 1) of r[4i], r[4i + 2] | r[4i + 1], r[4i + 3], each + t + 2 */
        z[i] = _mm256_add_ps(_mm256_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
    /* r[0], r[2], r[4], r[6] | r[1], r[3], r[5], r[7], each its t + t + 1 */
    const vf w = _mm256_add_ps(_mm256_shuffle_ps(z[0], z[1], 0x88), _mm256_shuffle_ps(z[0], z[1], 0xDD));
    return _mm256_permutevar8x32_ps(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline void vf_transpose(vf r[8]) {
    vf t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

#endif /* MA_SIMD_AVX2_H */
