/*
 * simd_sve.h -- the SIMD vocabulary (simd.h) on SVE at one vector length, the
 * one -msve-vector-bits=N gives: N / 32 lanes, predicates for masks and tails,
 * 32 vector registers. A fixed length gives SVE's types a size, so that the
 * blocks keep vectors in arrays as on every other set. setup.py compiles the
 * instances (attention/sve_instance.h, cross_entropy/sve_instance.h) at each
 * of 128, 256, 512, 1024 and 2048 bits, and the variant "sve" runs the one of
 * the CPU's length (common/isa.c): one binary for every length, with each
 * length's machine code. vf_max / vf_min keep x86's rule (the second operand
 * where either is NaN).
 */
#ifndef MA_SIMD_SVE_H
#define MA_SIMD_SVE_H

#include <arm_sve.h>
#include <math.h>
#include <string.h>

#include "common/simd.h"

#if !defined(__ARM_FEATURE_SVE_BITS) ||                                                                 \
    (__ARM_FEATURE_SVE_BITS != 128 && __ARM_FEATURE_SVE_BITS != 256 && __ARM_FEATURE_SVE_BITS != 512 && \
     __ARM_FEATURE_SVE_BITS != 1024 && __ARM_FEATURE_SVE_BITS != 2048)
#error "simd_sve.h needs -msve-vector-bits=128, 256, 512, 1024 or 2048"
#endif

#define MA_SVE_BITS __ARM_FEATURE_SVE_BITS
/* An instance's names: MA_SVE_NAME(gemm) is gemm_sve256 at 256 bits; MA_SVE_LABEL "sve256". */
#define MA_SVE_PASTE(name, bits) name##_sve##bits
#define MA_SVE_PASTE_(name, bits) MA_SVE_PASTE(name, bits)
#define MA_SVE_NAME(name) MA_SVE_PASTE_(name, MA_SVE_BITS)
#define MA_SVE_STR(bits) "sve" #bits
#define MA_SVE_STR_(bits) MA_SVE_STR(bits)
#define MA_SVE_LABEL MA_SVE_STR_(MA_SVE_BITS)
#define MA_VL (MA_SVE_BITS / 32)
typedef svfloat32_t vf __attribute__((arm_sve_vector_bits(MA_SVE_BITS)));
typedef svfloat64_t vd __attribute__((arm_sve_vector_bits(MA_SVE_BITS)));
typedef svuint32_t vi __attribute__((arm_sve_vector_bits(MA_SVE_BITS)));
typedef svbool_t vm __attribute__((arm_sve_vector_bits(MA_SVE_BITS)));

/* GEMM: full 4-vector panels in 6-row blocks (24 accumulators + 4 of B + 1
 * broadcast of A = 29 of the 32 registers), the last columns in 8 x 2-vector
 * blocks; no packing; predicated edges. dot_keys_t: 4 vectors of keys per
 * strip for up to 4 query rows, 2 for more. axpy_keys: 4 rows x 4 vectors, 2
 * rows x 8. Cross-entropy: 8 vectors a block. */
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
#define MA_AXPY_NV(R) ((R) >= 3 ? 4 : 8)
#define MA_CE_UNROLL 8

#define MA_PT svptrue_b32()
#define MA_PT64 svptrue_b64()

/* Functions, not macros: SVE's intrinsics return sizeless types, which mix with the sized
 * ones of the blocks only through a conversion (a return, an assignment), never in ?: . */
#define MA_F static inline __attribute__((always_inline))
MA_F vf vf_zero(void) { return svdup_n_f32(0.0f); }
MA_F vf vf_set1(float x) { return svdup_n_f32(x); }
MA_F float vf_lane0(vf v) { return svlastb_f32(svptrue_pat_b32(SV_VL1), v); }
MA_F vf vf_load(const float *p) { return svld1_f32(MA_PT, p); }
MA_F void vf_store(float *p, vf v) { svst1_f32(MA_PT, p, v); }
MA_F vf vf_load_m(const float *p, vm m) { return svld1_f32(m, p); }
MA_F void vf_store_m(float *p, vm m, vf v) { svst1_f32(m, p, v); }
MA_F void vf_stream(float *p, vf v) { svst1_f32(MA_PT, p, v); }
#define vf_stream_fence() ((void)0)
MA_F vf vf_add(vf a, vf b) { return svadd_f32_x(MA_PT, a, b); }
MA_F vf vf_sub(vf a, vf b) { return svsub_f32_x(MA_PT, a, b); }
MA_F vf vf_mul(vf a, vf b) { return svmul_f32_x(MA_PT, a, b); }
MA_F vf vf_div(vf a, vf b) { return svdiv_f32_x(MA_PT, a, b); }
MA_F vf vf_andnot(vf a, vf b) {
    return svreinterpret_f32_u32(svbic_u32_x(MA_PT, svreinterpret_u32_f32(b), svreinterpret_u32_f32(a)));
}
MA_F vf vf_fma(vf a, vf b, vf c) { return svmla_f32_x(MA_PT, c, a, b); }  /* c + a b */
MA_F vf vf_in_reg(vf v) { return v; } /* (an FMA's operands are registers) */
MA_F vf vf_fms(vf a, vf b, vf c) { return svnmls_f32_x(MA_PT, c, a, b); } /* a b - c */
MA_F vf vf_fnma(vf a, vf b, vf c) { return svmls_f32_x(MA_PT, c, a, b); } /* c - a b */
MA_F vm vf_lt(vf a, vf b) { return svcmplt_f32(MA_PT, a, b); }
MA_F vm vf_gt(vf a, vf b) { return svcmpgt_f32(MA_PT, a, b); }
MA_F vm vf_eq(vf a, vf b) { return svcmpeq_f32(MA_PT, a, b); }
MA_F vm vf_isnan(vf a) { return svcmpuo_f32(MA_PT, a, a); }
MA_F vm vm_or(vm a, vm b) { return svorr_b_z(MA_PT, a, b); }
MA_F vm vm_and(vm a, vm b) { return svand_b_z(MA_PT, a, b); }
MA_F vf vf_blend(vm m, vf a, vf b) { return svsel_f32(m, b, a); }
MA_F vf vf_maskz(vm m, vf a) { return svsel_f32(m, a, svdup_n_f32(0.0f)); }
MA_F vf vf_from_mask(vm m) { return svreinterpret_f32_u32(svdup_n_u32_z(m, 0xffffffffu)); }
MA_F float vf_hsum(vf v) { return svaddv_f32(MA_PT, v); }
MA_F vd vd_zero(void) { return svdup_n_f64(0.0); }
MA_F vd vd_lo(vf v) { return svcvt_f64_f32_x(MA_PT64, svzip1_f32(v, v)); } /* the low half, widened */
MA_F vd vd_hi(vf v) { return svcvt_f64_f32_x(MA_PT64, svzip2_f32(v, v)); } /* the high half */
MA_F vd vd_add(vd a, vd b) { return svadd_f64_x(MA_PT64, a, b); }
MA_F vd vd_mul(vd a, vd b) { return svmul_f64_x(MA_PT64, a, b); }
MA_F vd vd_fma(vd a, vd b, vd c) { return svmla_f64_x(MA_PT64, c, a, b); }
MA_F void vd_store(double *p, vd v) { svst1_f64(MA_PT64, p, v); }
MA_F vi vi_set1(uint32_t x) { return svdup_n_u32(x); }
MA_F vi vi_lanes(void) { return svindex_u32(0, 1); }
MA_F vi vi_add(vi a, vi b) { return svadd_u32_x(MA_PT, a, b); }
MA_F vi vi_xor(vi a, vi b) { return sveor_u32_x(MA_PT, a, b); }
MA_F vi vi_and(vi a, vi b) { return svand_u32_x(MA_PT, a, b); }
MA_F vi vi_srl32(vi a, int n) { return svlsr_n_u32_x(MA_PT, a, (uint32_t)n); }
MA_F vi vi_srl64(vi a, int n) {
    return svreinterpret_u32_u64(svlsr_n_u64_x(MA_PT64, svreinterpret_u64_u32(a), (uint64_t)n));
}
MA_F vi vi_sll64(vi a, int n) {
    return svreinterpret_u32_u64(svlsl_n_u64_x(MA_PT64, svreinterpret_u64_u32(a), (uint64_t)n));
}
MA_F vm vi_gt(vi a, vi b) { return svcmpgt_s32(MA_PT, svreinterpret_s32_u32(a), svreinterpret_s32_u32(b)); }

/* Integer products: VL elements a vh, each widened to an int32 lane as loaded, multiply-added */
#define MA_HL MA_VL
typedef svint32_t vh __attribute__((arm_sve_vector_bits(MA_SVE_BITS)));
typedef svint32_t vs __attribute__((arm_sve_vector_bits(MA_SVE_BITS)));
MA_F vh vh_load_i8(const int8_t *p) { return svld1sb_s32(MA_PT, p); }
MA_F vh vh_load_i16(const int16_t *p) { return svld1sh_s32(MA_PT, p); }
MA_F vh vh_in_reg(vh v) { return v; }
MA_F vs vs_zero(void) { return svdup_n_s32(0); }
MA_F vs vs_dot(vs acc, vh a, vh b) { return svmla_s32_x(MA_PT, acc, a, b); }
MA_F int32_t vs_hsum(vs v) { return (int32_t)svaddv_s32(MA_PT, v); }
MA_F vf vs_to_f(vs v) { return svcvt_f32_s32_x(MA_PT, v); }
/* P V in integers (pairs of keys): a vh's lanes are dims already (widened to int32), so a pair
 * is two multiply-adds, each key's values by its p16 */
#define MA_VS_PER_VH 1
#define MA_PVI_NU(R) ((R) <= 2 ? 8 : 4)
typedef struct {
    vh a, b;
} vp;
MA_F vp vp_set(int32_t pair) {
    const vp p = {svdup_n_s32((int16_t)(pair & 0xffff)), svdup_n_s32(pair >> 16)};
    return p;
}
#define vh_zip_lo(a, b) (a)
#define vh_zip_hi(a, b) (b)
#define vs_pair_dot(acc, x0, x1, j, p) svmla_s32_x(MA_PT, svmla_s32_x(MA_PT, acc, x0, (p).a), x1, (p).b)
#define vs_unzip_f(a0, a1, j) vs_to_f(a0)

/* x86's maxps / minps: a where a > b (a < b), else b (so b where either is NaN) */
MA_F vf vf_max(vf a, vf b) { return svsel_f32(svcmpgt_f32(MA_PT, a, b), a, b); }
MA_F vf vf_min(vf a, vf b) { return svsel_f32(svcmplt_f32(MA_PT, a, b), a, b); }
/* ordered and not equal (x86's _CMP_NEQ_OQ): false where either is NaN */
MA_F vm vf_neq(vf a, vf b) { return svbic_b_z(MA_PT, svcmpne_f32(MA_PT, a, b), svcmpuo_f32(MA_PT, a, b)); }
MA_F vm vm_first(int64_t n) { return svwhilelt_b32_s64(0, n < 0 ? 0 : n); }
/* a lane's bit is 1 << lane summed over the set lanes, in two halves at 64 lanes */
MA_F uint64_t vm_bits(vm m) {
    const svuint32_t one = svdup_n_u32(1), lanes = vi_lanes();
#if MA_VL <= 32
    return svaddv_u32(m, svlsl_u32_x(MA_PT, one, lanes));
#else
    const vm low = svcmplt_n_u32(MA_PT, lanes, 32);
    const uint64_t lo = svaddv_u32(svand_b_z(MA_PT, m, low), svlsl_u32_x(MA_PT, one, lanes));
    const uint64_t hi = svaddv_u32(svbic_b_z(MA_PT, m, low), svlsl_u32_x(MA_PT, one, svsub_n_u32_x(MA_PT, lanes, 32)));
    return lo | hi << 32;
#endif
}
MA_F int vm_any(vm m) { return svptest_any(MA_PT, m); }
/* even lanes' unsigned 32 x 32 -> 64-bit products (x86's pmuludq): exact in 64-bit lanes */
static inline vi vi_mul_even(vi a, vi b) {
    const svuint64_t lo = svdup_n_u64(0xffffffffu);
    return svreinterpret_u32_u64(svmul_u64_x(MA_PT64, svand_u64_x(MA_PT64, svreinterpret_u64_u32(a), lo),
                                             svand_u64_x(MA_PT64, svreinterpret_u64_u32(b), lo)));
}
static inline vi vi_blend_odd(vi a, vi b) {
    return svsel_u32(svcmpne_n_u32(MA_PT, svand_n_u32_x(MA_PT, vi_lanes(), 1), 0), b, a);
}

/* the lanes in order after m, a lane replacing the running value only when greater */
static inline float vf_hmax(vf v, float m) {
    float t[MA_VL], r = m;
    svst1_f32(MA_PT, t, v);
    for (int i = 0; i < MA_VL; i++) r = t[i] > r ? t[i] : r;
    return r;
}

/* 16-bit values into 32-bit lanes (LD1H), bfloat16 shifted into the high half, float16 by
 * FCVT; tails predicated (nothing read past n). */
static inline __attribute__((always_inline)) vf vf_load_dt(const void *base, ma_dtype dt, int64_t off, int64_t n) {
    const vm k = n >= MA_VL ? MA_PT : vm_first(n);
    if (dt == MA_F32) return svld1_f32(k, (const float *)base + off);
    if (dt == MA_I8) return svcvt_f32_s32_x(MA_PT, svld1sb_s32(k, (const int8_t *)base + off)); /* LD1SB */
    const svuint32_t h = svld1uh_u32(k, (const uint16_t *)base + off);
    if (dt == MA_BF16) return svreinterpret_f32_u32(svlsl_n_u32_x(MA_PT, h, 16));
    return svcvt_f32_f16_x(MA_PT, svreinterpret_f16_u32(h));
}

/* bfloat16 rounds to nearest even, NaN stays a quiet NaN (ma_f32_to_bf16); float16 by FCVT
 * under the default rounding (nearest even); the low halves stored by ST1H. */
static inline __attribute__((always_inline)) void vf_store_dt(void *base, ma_dtype dt, int64_t off, int64_t n, vf v) {
    const vm k = n >= MA_VL ? MA_PT : vm_first(n);
    if (dt == MA_F32) {
        svst1_f32(k, (float *)base + off, v);
        return;
    }
    svuint32_t h;
    if (dt == MA_BF16) {
        const svuint32_t u = svreinterpret_u32_f32(v), hi = svlsr_n_u32_x(MA_PT, u, 16);
        const svuint32_t r = svadd_u32_x(MA_PT, u, svadd_n_u32_x(MA_PT, svand_n_u32_x(MA_PT, hi, 1), 0x7fff));
        h = svsel_u32(vf_isnan(v), svorr_n_u32_x(MA_PT, hi, 0x40), svlsr_n_u32_x(MA_PT, r, 16));
    } else {
        h = svreinterpret_u32_f16(svcvt_f16_f32_x(MA_PT, v));
    }
    svst1h_u32(k, (uint16_t *)base + off, h);
}

/* FRINTN (to nearest, ties to even), then an exact conversion; ST1B keeps the low bytes */
static inline __attribute__((always_inline)) void vf_store_i8(int8_t *p, int64_t n, vf v) {
    svst1b_s32(n >= MA_VL ? MA_PT : vm_first(n), p, svcvt_s32_f32_x(MA_PT, svrintn_f32_x(MA_PT, v)));
}
static inline __attribute__((always_inline)) void vf_store_i16(int16_t *p, int64_t n, vf v) {
    svst1h_s32(n >= MA_VL ? MA_PT : vm_first(n), p, svcvt_s32_f32_x(MA_PT, svrintn_f32_x(MA_PT, v)));
}

/* exp (simd.h) as AVX2's and NEON's: n = round(x log2e), the polynomial's coefficients doubled
 * (exactly) and the scale 2^(n-1) made by putting n + 126 in the exponent field, so x below
 * -86.99 gives 0 and every other n a normal scale; NaN passes the clamps and stays NaN. */
static inline vf vf_exp(vf x_in) {
    vf x = vf_max(svdup_n_f32(-87.5f), x_in);
    x = vf_min(svdup_n_f32(88.37f), x);
    const vf n = svrintn_f32_x(MA_PT, svmul_n_f32_x(MA_PT, x, MA_EXP_LOG2E));
    vf r = svmls_f32_x(MA_PT, x, n, svdup_n_f32(MA_EXP_LN2_HI));
    r = svmls_f32_x(MA_PT, r, n, svdup_n_f32(MA_EXP_LN2_LO));
    vf y = svdup_n_f32(2.0f * ma_exp_poly[0]);
    for (int i = 1; i < MA_EXP_TERMS; i++) y = svmad_f32_x(MA_PT, y, r, svdup_n_f32(2.0f * ma_exp_poly[i]));
    const svint32_t e = svlsl_n_s32_x(MA_PT, svadd_n_s32_x(MA_PT, svcvt_s32_f32_x(MA_PT, n), 126), 23);
    return svmul_f32_x(MA_PT, y, svreinterpret_f32_s32(e));
}

static inline vf vf_tanh(vf x) {
    const vf a = svabs_f32_x(MA_PT, x);
    const vf t = svmul_f32_x(MA_PT, a, a);
    vf p = svdup_n_f32(ma_tanh_poly[0]);
    for (int i = 1; i < MA_TANH_TERMS; i++) p = svmad_f32_x(MA_PT, p, t, svdup_n_f32(ma_tanh_poly[i]));
    const vf small = svmla_f32_x(MA_PT, a, svmul_f32_x(MA_PT, a, t), p);
    const vm is_small = svcmplt_n_f32(MA_PT, a, MA_TANH_SMALL);
    vf y = small;
    if (svptest_any(MA_PT, svnot_b_z(MA_PT, is_small))) { /* some lane from 0.625 on (or NaN) */
        const vf a10 = vf_min(svdup_n_f32(10.0f), a);        /* NaN passes (the second operand) */
        const vf e = vf_exp(svadd_f32_x(MA_PT, a10, a10));
        const vf big =
            svsub_f32_x(MA_PT, svdup_n_f32(1.0f), svdiv_f32_x(MA_PT, svdup_n_f32(2.0f), svadd_n_f32_x(MA_PT, e, 1.0f)));
        y = svsel_f32(is_small, small, big);
    }
    const svuint32_t sign = svand_n_u32_x(MA_PT, svreinterpret_u32_f32(x), 0x80000000u);
    return svreinterpret_f32_u32(svorr_u32_x(MA_PT, svreinterpret_u32_f32(y), sign));
}

/* VL x VL in log2(VL) rounds of zips: each pairs rows i and i + VL / 2 (a perfect shuffle). */
static inline void vf_transpose(vf r[MA_VL]) {
    for (int round = 1; round < MA_VL; round *= 2) {
        vf t[MA_VL];
        for (int i = 0; i < MA_VL / 2; i++) {
            t[2 * i] = svzip1_f32(r[i], r[i + MA_VL / 2]);
            t[2 * i + 1] = svzip2_f32(r[i], r[i + MA_VL / 2]);
        }
        for (int i = 0; i < MA_VL; i++) r[i] = t[i];
    }
}

#endif /* MA_SIMD_SVE_H */
