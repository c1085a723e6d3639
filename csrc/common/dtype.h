/*
 * dtype.h -- element loads and stores for every ma_dtype, private to the
 * kernels. Reduced-precision types are read into float32 and written back
 * with round-to-nearest-even; float64 is read into double by the f64 pair.
 */
#ifndef MA_DTYPE_H
#define MA_DTYPE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "masked_attn.h"

static inline float ma_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t ma_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* float16 <-> float32, IEEE round-to-nearest-even, NaN quieted: F16C's instructions in the
 * units compiled with it, aarch64's own (_Float16), and elsewhere (the x86 scalar units) in
 * integer arithmetic. Not _Float16 on x86: without F16C GCC 12 compiles its conversions to
 * libgcc calls versioned GCC_12.0.0, which would lift the wheel's glibc floor
 * (common/glibc_compat.h) to 2.35. tests/c/test_blocks.c checks the integer conversions
 * against _Float16 over every float16 and every rounding case of float32. */
#if defined(__F16C__)
#include <immintrin.h>
static inline float ma_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t ma_f32_to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#elif defined(__aarch64__)
static inline float ma_f16_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}

static inline uint16_t ma_f32_to_f16(float f) {
    const _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, sizeof h);
    return h;
}
#else
static inline float ma_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0x1f) u = sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0); /* inf; NaN, quiet */
    else if (e) u = sign | ((e + 112) << 23) | (m << 13);                     /* normal */
    else { /* 0, subnormal: m 2^-24 */ const float f = (float)m * 0x1p-24f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t ma_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN, quiet */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and up: infinity */
    if (a >= 0x38800000u) {                                   /* a normal float16: rebias, round 13 bits */
        uint32_t r = a - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    const int shift = 126 - (int)(a >> 23); /* a subnormal float16 (or 0): a in units of 2^-24 */
    if (shift > 24) return sign;            /* below 2^-25, or 2^-25 itself (a tie to even 0) */
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u, half = 1u << (shift - 1);
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((half << 1) - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}
#endif

/* base[off] as float, whatever the element type. MA_BOOL reads 0 or 1. */
static inline float ma_load_f32(const void *base, ma_dtype dt, int64_t off) {
    switch (dt) {
    case MA_F32: return ((const float *)base)[off];
    case MA_F64: return (float)((const double *)base)[off];
    case MA_BF16: return ma_bf16_to_f32(((const uint16_t *)base)[off]);
    case MA_F16: return ma_f16_to_f32(((const uint16_t *)base)[off]);
    case MA_BOOL: return ((const uint8_t *)base)[off] ? 1.0f : 0.0f;
    case MA_I8: return (float)((const int8_t *)base)[off];
    }
    return 0.0f;
}

static inline double ma_load_f64(const void *base, ma_dtype dt, int64_t off) {
    if (dt == MA_F64) return ((const double *)base)[off];
    return (double)ma_load_f32(base, dt, off);
}

static inline void ma_store_f32(void *base, ma_dtype dt, int64_t off, float x) {
    switch (dt) {
    case MA_F32: ((float *)base)[off] = x; break;
    case MA_F64: ((double *)base)[off] = x; break;
    case MA_BF16: ((uint16_t *)base)[off] = ma_f32_to_bf16(x); break;
    case MA_F16: ((uint16_t *)base)[off] = ma_f32_to_f16(x); break;
    case MA_BOOL: ((uint8_t *)base)[off] = x != 0.0f; break;
    case MA_I8: break; /* never an output: quantize_kv rounds and clamps itself */
    }
}

static inline void ma_store_f64(void *base, ma_dtype dt, int64_t off, double x) {
    if (dt == MA_F64) ((double *)base)[off] = x;
    else ma_store_f32(base, dt, off, (float)x);
}

/* Bytes per element of dt. */
static inline int64_t ma_dtype_size(ma_dtype dt) {
    switch (dt) {
    case MA_F32: return 4;
    case MA_F64: return 8;
    case MA_BF16:
    case MA_F16: return 2;
    case MA_BOOL:
    case MA_I8: return 1;
    }
    return 1;
}

static inline int64_t ma_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t ma_min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t ma_max(int64_t a, int64_t b) { return a > b ? a : b; }
static inline size_t ma_round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

#endif /* MA_DTYPE_H */
