/*
 * simd.h -- vector building blocks shared by the SIMD translation units
 * (attention_*.c, cross_entropy_*.c), each compiled only where that
 * translation unit's -m flags enable it. Private to the kernels.
 *
 *   exp512 / exp256   exp of 16 / 8 floats
 *   tanh512 / tanh256 tanh of 16 / 8 floats
 *   transpose16x16 / transpose8x8   a 16 x 16 / 8 x 8 block of 32-bit lanes transposed in registers
 *   stream_row512 / stream_row256   y = mul * x with non-temporal stores
 */
#ifndef MA_SIMD_H
#define MA_SIMD_H

#include <immintrin.h>

/* exp(x): x = n ln2 + r, |r| <= ln2/2 (Cody-Waite), e^r by a degree-5
 * polynomial fitted for relative error (9e-8; 1.65e-7 with float32's
 * roundings, about 2 ulp: tests/c hold it to 4e-7 of libm). Tiny results are
 * exactly 0 (-inf among them) and no operation ever makes a denormal: each
 * vector with a denormal result costs a microcode assist, and masked scores
 * (-inf) are common. exp512 zeroes results below FLT_MIN (x < -87.33, clamped
 * there first); exp256 those of x < -86.99 (below 2^-125.5, see there). NaN stays
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

#if defined(__AVX512F__)
static inline __m512 exp512(__m512 x_in) {
    const __mmask16 underflow = _mm512_cmp_ps_mask(x_in, _mm512_set1_ps(-87.33f), _CMP_LT_OQ);
    const __m512 x = _mm512_max_ps(_mm512_set1_ps(-87.33f), x_in);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(MA_EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(MA_EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(MA_EXP_LN2_LO), r);
    __m512 y = _mm512_set1_ps(ma_exp_poly[0]);
    for (int i = 1; i < MA_EXP_TERMS; i++) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(ma_exp_poly[i]));
    return _mm512_maskz_scalef_ps((__mmask16)~underflow, y, n); /* 2^n; past 88.72 it overflows to inf */
}

static inline __m512 tanh512(__m512 x) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(x)));
    const __m512 t = _mm512_mul_ps(a, a);
    __m512 p = _mm512_set1_ps(ma_tanh_poly[0]);
    for (int i = 1; i < MA_TANH_TERMS; i++) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(ma_tanh_poly[i]));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(a, t), p, a);
    const __mmask16 is_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(MA_TANH_SMALL), _CMP_LT_OQ);
    __m512 y = small;
    if (is_small != 0xFFFF) { /* some lane from 0.625 on (or NaN) */
        const __m512 a10 = _mm512_min_ps(_mm512_set1_ps(10.0f), a); /* NaN passes (the second operand) */
        const __m512 e = exp512(_mm512_add_ps(a10, a10));
        const __m512 big = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                                         _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
        y = _mm512_mask_blend_ps(is_small, big, small);
    }
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(y), _mm512_and_si512(sign, _mm512_castps_si512(x))));
}

/* r[0..15] = the 16 x 16 block whose rows they are, transposed in registers. */
static inline void transpose16x16(__m512 r[16]) {
    __m512 t[16];
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
/* y[0 : n] = mul * x[0 : n] with non-temporal stores: y 64-byte aligned, n a
 * multiple of 16. The caller fences (_mm_sfence) before others read y. */
static inline void stream_row512(float *y, const float *x, int64_t n, float mul) {
    const __m512 m = _mm512_set1_ps(mul);
    for (int64_t c = 0; c < n; c += 16) _mm512_stream_ps(y + c, _mm512_mul_ps(m, _mm512_loadu_ps(x + c)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The same exp for 8 floats, with n rounded by the 1.5 2^23 trick (one FMA:
 * n + 126 lands in t's low mantissa bits) and 2^(n-1) made by shifting those
 * bits into the exponent; the polynomial's coefficients are doubled (exactly)
 * to make up the 1/2. The bias 126 rather than 127 is what keeps results
 * normal: n = -126 (x from -87.5, the clamp, to -86.99) gives the scale's bits
 * 0, so 0, and every other n a scale of at least FLT_MIN times a polynomial
 * above 1.4. So x below -86.99 (n = -126: results under 2^-125.5) gives 0,
 * x above 88.37 about 2.4e38 rather than inf, and no compare or blend is
 * needed. */
static inline __m256 exp256(__m256 x_in) {
    __m256 x = _mm256_max_ps(_mm256_set1_ps(-87.5f), x_in);
    x = _mm256_min_ps(_mm256_set1_ps(88.37f), x);
    const __m256 magic = _mm256_set1_ps(12582912.0f + 126.0f); /* 1.5 2^23: its ulp is 1 */
    const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(MA_EXP_LOG2E), magic);
    const __m256 n = _mm256_sub_ps(t, magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(MA_EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(MA_EXP_LN2_LO), r);
    __m256 y = _mm256_set1_ps(2.0f * ma_exp_poly[0]);
    for (int i = 1; i < MA_EXP_TERMS; i++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(2.0f * ma_exp_poly[i]));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23)));
}
static inline __m256 tanh256(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_andnot_ps(sign, x);
    const __m256 t = _mm256_mul_ps(a, a);
    __m256 p = _mm256_set1_ps(ma_tanh_poly[0]);
    for (int i = 1; i < MA_TANH_TERMS; i++) p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(ma_tanh_poly[i]));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(a, t), p, a);
    const __m256 is_small = _mm256_cmp_ps(a, _mm256_set1_ps(MA_TANH_SMALL), _CMP_LT_OQ);
    __m256 y = small;
    if (_mm256_movemask_ps(is_small) != 0xFF) { /* some lane from 0.625 on (or NaN) */
        const __m256 a10 = _mm256_min_ps(_mm256_set1_ps(10.0f), a); /* NaN passes (the second operand) */
        const __m256 e = exp256(_mm256_add_ps(a10, a10));
        const __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.0f),
                                         _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
        y = _mm256_blendv_ps(big, small, is_small);
    }
    return _mm256_or_ps(y, _mm256_and_ps(sign, x));
}

/* r[0..7] = the 8 x 8 block whose rows they are, transposed in registers. */
static inline void transpose8x8(__m256 r[8]) {
    __m256 t[8], u[8];
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

/* The same for AVX2: y 32-byte aligned, n a multiple of 8. */
static inline void stream_row256(float *y, const float *x, int64_t n, float mul) {
    const __m256 m = _mm256_set1_ps(mul);
    for (int64_t c = 0; c < n; c += 8) _mm256_stream_ps(y + c, _mm256_mul_ps(m, _mm256_loadu_ps(x + c)));
}
#endif

#endif
