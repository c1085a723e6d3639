/*
 * simd_neon.h -- the SIMD vocabulary (simd.h) on AArch64's Advanced SIMD
 * (NEON, in every aarch64 CPU, so no flags): 4 lanes, masks as vectors of
 * all-ones lanes, 32 vector registers. NEON has no masked moves: tails go
 * lane by lane through a buffer, reading and writing only the lanes of the
 * mask. vf_max / vf_min keep x86's rule (the second operand where either is
 * NaN: a compare and a select), so the blocks' NaN handling is the same on
 * every set. There are no non-temporal vector stores: vf_stream is a plain
 * store and vf_stream_fence nothing.
 */
#ifndef MA_SIMD_NEON_H
#define MA_SIMD_NEON_H

#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "common/simd.h"

#define MA_VL 4
typedef float32x4_t vf;
typedef float64x2_t vd;
typedef uint32x4_t vi;
typedef uint32x4_t vm;

/* GEMM: full 16-column panels in 6 x 16 blocks (24 accumulators + 4 of B + 1
 * broadcast of A = 29 of the 32 registers), the last n % 16 columns in 8 x 8
 * blocks; no packing; edges of transposes elementwise (no masked moves).
 * dot_keys_t: 4 vectors of keys per strip for up to 4 query rows, 2 for more.
 * axpy_keys: 4 rows x 4 vectors, 2 rows x 8. Cross-entropy: 8 vectors a block. */
#define MA_GEMM_MR 6
#define MA_GEMM_NV 4
#define MA_GEMM_TAIL_MR 8
#define MA_GEMM_TAIL_NV 2
#define MA_GEMM_PACK 0
#define MA_MASKED_EDGES 0
#define MA_KT_NV(nr) ((nr) <= 4 ? 4 : 2)
#define MA_DR_CHAINS 16 /* dot_rows: accumulators of a register tile (rows x keys) */
#define MA_DR_ROWS 4    /* its rows at most */
#define MA_AXPY_ROWS 4
#define MA_AXPY_NV(R) ((R) >= 3 ? 4 : 8)
#define MA_CE_UNROLL 8

#define vf_zero() vdupq_n_f32(0.0f)
#define vf_set1 vdupq_n_f32
#define vf_lane0(v) vgetq_lane_f32(v, 0)
#define vf_load vld1q_f32
#define vf_store vst1q_f32
#define vf_stream vst1q_f32
#define vf_stream_fence() ((void)0)
#define vf_add vaddq_f32
#define vf_sub vsubq_f32
#define vf_mul vmulq_f32
#define vf_div vdivq_f32
#define vf_andnot(a, b) vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(b), vreinterpretq_u32_f32(a)))
#define vf_fma(a, b, c) vfmaq_f32(c, a, b)
#define vf_in_reg(v) (v) /* (an FMA's operands are registers) */
#define vf_fms(a, b, c) vnegq_f32(vfmsq_f32(c, a, b)) /* -(c - a b): one rounding, exact negation */
#define vf_fnma(a, b, c) vfmsq_f32(c, a, b)
#define vf_lt vcltq_f32
#define vf_gt vcgtq_f32
#define vf_eq vceqq_f32
#define vm_or vorrq_u32
#define vm_and vandq_u32
#define vf_blend(m, a, b) vbslq_f32(m, b, a)
#define vf_maskz(m, a) vreinterpretq_f32_u32(vandq_u32(m, vreinterpretq_u32_f32(a)))
#define vf_from_mask(m) vreinterpretq_f32_u32(m)
#define vd_zero() vdupq_n_f64(0.0)
#define vd_lo(v) vcvt_f64_f32(vget_low_f32(v))
#define vd_hi(v) vcvt_high_f64_f32(v)
#define vd_add vaddq_f64
#define vd_mul vmulq_f64
#define vd_fma(a, b, c) vfmaq_f64(c, a, b)
#define vd_store vst1q_f64
#define vi_set1(x) vdupq_n_u32((uint32_t)(x))
#define vi_add vaddq_u32
#define vi_xor veorq_u32
#define vi_and vandq_u32
#define vi_srl32 vshrq_n_u32
#define vi_srl64(a, n) vreinterpretq_u32_u64(vshrq_n_u64(vreinterpretq_u64_u32(a), n))
#define vi_sll64(a, n) vreinterpretq_u32_u64(vshlq_n_u64(vreinterpretq_u64_u32(a), n))
#define vi_gt(a, b) vcgtq_s32(vreinterpretq_s32_u32(a), vreinterpretq_s32_u32(b))

/* Integer products: 8 int16 a vh, widening multiply-adds of each half into 4 int32 lanes */
#define MA_HL 8
typedef int16x8_t vh;
typedef int32x4_t vs;
#define vh_load_i8(p) vmovl_s8(vld1_s8((const int8_t *)(p)))
#define vh_load_i16(p) vld1q_s16((const int16_t *)(p))
#define vh_in_reg(v) (v)
#define vs_zero() vdupq_n_s32(0)
#define vs_dot(acc, a, b) vmlal_high_s16(vmlal_s16(acc, vget_low_s16(a), vget_low_s16(b)), a, b)
#define vs_hsum vaddvq_s32
#define vs_to_f vcvtq_f32_s32
/* P V in integers (pairs of keys): a vh holds 4 dims of one key, then the same 4 of the next;
 * vs_dot's two halves are then the pair's two products of each dim, in order */
#define MA_VS_PER_VH 2
#define MA_PVI_NU(R) ((R) <= 2 ? 4 : 2) /* (vh of dims a strip, R rows: one row whole at D = 128) */
typedef int16x8_t vp;
static inline vp vp_set(int32_t pair) {
    return vcombine_s16(vdup_n_s16((int16_t)(pair & 0xffff)), vdup_n_s16((int16_t)(pair >> 16)));
}
#define vh_zip_lo(a, b) vcombine_s16(vget_low_s16(a), vget_low_s16(b))
#define vh_zip_hi(a, b) vcombine_s16(vget_high_s16(a), vget_high_s16(b))
#define vs_pair_dot(acc, x0, x1, j, p) vs_dot(acc, (j) ? (x1) : (x0), p)
#define vs_unzip_f(a0, a1, j) vcvtq_f32_s32((j) ? (a1) : (a0))

/* x86's maxps / minps: a where a > b (a < b), else b (so b where either is NaN) */
static inline vf vf_max(vf a, vf b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline vf vf_min(vf a, vf b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
static inline vm vf_isnan(vf a) { return vmvnq_u32(vceqq_f32(a, a)); }
/* ordered and not equal (x86's _CMP_NEQ_OQ): false where either is NaN */
static inline vm vf_neq(vf a, vf b) {
    return vandq_u32(vmvnq_u32(vceqq_f32(a, b)), vandq_u32(vceqq_f32(a, a), vceqq_f32(b, b)));
}

static inline vi vi_lanes(void) {
    static const uint32_t l[4] = {0, 1, 2, 3};
    return vld1q_u32(l);
}
static inline vm vm_first(int64_t n) {
    const uint32_t nn = n < 0 ? 0 : n > 4 ? 4 : (uint32_t)n;
    return vcltq_u32(vi_lanes(), vdupq_n_u32(nn));
}
static inline uint64_t vm_bits(vm m) {
    static const uint32_t w[4] = {1, 2, 4, 8};
    return vaddvq_u32(vandq_u32(m, vld1q_u32(w)));
}
static inline int vm_any(vm m) { return vmaxvq_u32(m) != 0; }
/* even lanes' unsigned 32 x 32 -> 64-bit products (x86's pmuludq) */
static inline vi vi_mul_even(vi a, vi b) {
    return vreinterpretq_u32_u64(vmull_u32(vmovn_u64(vreinterpretq_u64_u32(a)), vmovn_u64(vreinterpretq_u64_u32(b))));
}
static inline vi vi_blend_odd(vi a, vi b) {
    static const uint32_t odd[4] = {0, 0xffffffffu, 0, 0xffffffffu};
    return vbslq_u32(vld1q_u32(odd), b, a);
}

/* Masked moves, lane by lane: only the lanes of m are read (the rest are 0) or written. */
static inline vf vf_load_m(const float *p, vm m) {
    uint32_t k[4];
    float buf[4];
    vst1q_u32(k, m);
    for (int i = 0; i < 4; i++) buf[i] = k[i] ? p[i] : 0.0f;
    return vld1q_f32(buf);
}
static inline void vf_store_m(float *p, vm m, vf v) {
    uint32_t k[4];
    float buf[4];
    vst1q_u32(k, m);
    vst1q_f32(buf, v);
    for (int i = 0; i < 4; i++)
        if (k[i]) p[i] = buf[i];
}

static inline float vf_hsum(vf v) { return vaddvq_f32(v); }

/* the lanes in order after m, a lane replacing the running value only when greater */
static inline float vf_hmax(vf v, float m) {
    float t[4], r = m;
    vst1q_f32(t, v);
    for (int i = 0; i < 4; i++) r = t[i] > r ? t[i] : r;
    return r;
}

/* 16-bit values (bfloat16: the high half of a float32; float16: FCVTL), tails through a
 * zero-padded buffer. */
static inline __attribute__((always_inline)) vf vf_load_dt(const void *base, ma_dtype dt, int64_t off, int64_t n) {
    if (dt == MA_F32) {
        const float *x = (const float *)base + off;
        return n >= 4 ? vld1q_f32(x) : vf_load_m(x, vm_first(n));
    }
    if (dt == MA_I8) { /* 4 bytes, widened twice (SXTL) and converted */
        const int8_t *x = (const int8_t *)base + off;
        int32_t b4 = 0;
        memcpy(&b4, x, (size_t)(n >= 4 ? 4 : n > 0 ? n : 0));
        const int16x8_t w = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(b4)));
        return vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
    }
    const uint16_t *x = (const uint16_t *)base + off;
    uint16x4_t h;
    if (n >= 4) {
        h = vld1_u16(x);
    } else {
        uint16_t buf[4] = {0, 0, 0, 0};
        for (int64_t i = 0; i < n; i++) buf[i] = x[i];
        h = vld1_u16(buf);
    }
    if (dt == MA_BF16) return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

/* bfloat16 rounds to nearest even, NaN stays a quiet NaN (ma_f32_to_bf16); float16 by
 * FCVTN under the default rounding (nearest even); tails through a buffer. */
static inline __attribute__((always_inline)) void vf_store_dt(void *base, ma_dtype dt, int64_t off, int64_t n, vf v) {
    if (dt == MA_F32) {
        if (n >= 4) vst1q_f32((float *)base + off, v);
        else vf_store_m((float *)base + off, vm_first(n), v);
        return;
    }
    uint16x4_t h;
    if (dt == MA_BF16) {
        const uint32x4_t u = vreinterpretq_u32_f32(v), hi = vshrq_n_u32(u, 16);
        uint32x4_t r = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), vandq_u32(hi, vdupq_n_u32(1))));
        r = vbslq_u32(vf_isnan(v), vorrq_u32(hi, vdupq_n_u32(0x40)), vshrq_n_u32(r, 16));
        h = vmovn_u32(r);
    } else {
        h = vreinterpret_u16_f16(vcvt_f16_f32(v));
    }
    uint16_t *x = (uint16_t *)base + off;
    if (n >= 4) {
        vst1_u16(x, h);
    } else {
        uint16_t buf[4];
        vst1_u16(buf, h);
        for (int64_t i = 0; i < n; i++) x[i] = buf[i];
    }
}

/* FCVTNS rounds to nearest even; narrowed twice with saturation (SQXTN) */
static inline __attribute__((always_inline)) void vf_store_i8(int8_t *p, int64_t n, vf v) {
    const int16x4_t h = vqmovn_s32(vcvtnq_s32_f32(v));
    const int8x8_t b = vqmovn_s16(vcombine_s16(h, h));
    int8_t buf[8];
    vst1_s8(buf, b);
    memcpy(p, buf, (size_t)(n >= 4 ? 4 : n > 0 ? n : 0));
}

static inline __attribute__((always_inline)) void vf_store_i16(int16_t *p, int64_t n, vf v) {
    const int16x4_t h = vqmovn_s32(vcvtnq_s32_f32(v));
    if (n >= 4) vst1_s16(p, h);
    else {
        int16_t buf[4];
        vst1_s16(buf, h);
        memcpy(p, buf, sizeof(int16_t) * (size_t)(n > 0 ? n : 0));
    }
}

/* exp (simd.h) as AVX2's: n = round(x log2e), the polynomial's coefficients doubled (exactly)
 * and the scale 2^(n-1) made by putting n + 126 in the exponent field, so x below -86.99
 * (results under 2^-125.5) gives 0 (n = -126: the field is 0) and every other n a normal
 * scale; x above 88.37 about 2.4e38 rather than inf. NaN passes the clamps and stays NaN. */
static inline vf vf_exp(vf x_in) {
    vf x = vf_max(vdupq_n_f32(-87.5f), x_in);
    x = vf_min(vdupq_n_f32(88.37f), x);
    const vf n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(MA_EXP_LOG2E)));
    vf r = vfmsq_f32(x, n, vdupq_n_f32(MA_EXP_LN2_HI));
    r = vfmsq_f32(r, n, vdupq_n_f32(MA_EXP_LN2_LO));
    vf y = vdupq_n_f32(2.0f * ma_exp_poly[0]);
    for (int i = 1; i < MA_EXP_TERMS; i++) y = vfmaq_f32(vdupq_n_f32(2.0f * ma_exp_poly[i]), y, r);
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(126)), 23);
    return vmulq_f32(y, vreinterpretq_f32_s32(e));
}

static inline vf vf_tanh(vf x) {
    const uint32x4_t sign = vdupq_n_u32(0x80000000u);
    const vf a = vabsq_f32(x);
    const vf t = vmulq_f32(a, a);
    vf p = vdupq_n_f32(ma_tanh_poly[0]);
    for (int i = 1; i < MA_TANH_TERMS; i++) p = vfmaq_f32(vdupq_n_f32(ma_tanh_poly[i]), p, t);
    const vf small = vfmaq_f32(a, vmulq_f32(a, t), p);
    const vm is_small = vcltq_f32(a, vdupq_n_f32(MA_TANH_SMALL));
    vf y = small;
    if (vminvq_u32(is_small) == 0) { /* some lane from 0.625 on (or NaN) */
        const vf a10 = vf_min(vdupq_n_f32(10.0f), a); /* NaN passes (the second operand) */
        const vf e = vf_exp(vaddq_f32(a10, a10));
        const vf big = vsubq_f32(vdupq_n_f32(1.0f), vdivq_f32(vdupq_n_f32(2.0f), vaddq_f32(e, vdupq_n_f32(1.0f))));
        y = vbslq_f32(is_small, small, big);
    }
    return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(y), vandq_u32(sign, vreinterpretq_u32_f32(x))));
}

static inline void vf_transpose(vf r[4]) {
    const float32x4x2_t t0 = vtrnq_f32(r[0], r[1]), t1 = vtrnq_f32(r[2], r[3]);
    r[0] = vcombine_f32(vget_low_f32(t0.val[0]), vget_low_f32(t1.val[0]));
    r[1] = vcombine_f32(vget_low_f32(t0.val[1]), vget_low_f32(t1.val[1]));
    r[2] = vcombine_f32(vget_high_f32(t0.val[0]), vget_high_f32(t1.val[0]));
    r[3] = vcombine_f32(vget_high_f32(t0.val[1]), vget_high_f32(t1.val[1]));
}

#endif /* MA_SIMD_NEON_H */
