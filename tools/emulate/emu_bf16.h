/*
 * emu_bf16.h -- the two AVX512-BF16 instructions the kernels use, written in
 * AVX-512 F/BW, for tools/emulate/run.py's build of the avx512bf16 variant:
 * the emulated CPU (Bochs, as bochscpu builds it) has AVX-512 but not
 * AVX512-BF16. Force-included (-include) before the kernel's own headers;
 * immintrin.h's guard keeps it from being read again, and the two macros
 * below replace the intrinsics. Semantics as Intel's SDM gives them:
 *   VCVTNE2PS2BF16: round to nearest even, NaN quieted, denormal inputs as 0;
 *   VDPBF16PS: per float32 lane, acc += a[2i+1] b[2i+1], then += a[2i] b[2i]
 *   (each product exact in float32, each sum rounded to nearest even).
 * Not part of the library.
 */
#include <immintrin.h>

static inline __m512i emu_bf16_round(__m512 x) { /* 16 bf16 in the low halves of 16 dwords */
    const __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    const __mmask16 den =
        _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7f800000)), _mm512_setzero_si512());
    return _mm512_mask_mov_epi32(r, den, _mm512_and_si512(hi, _mm512_set1_epi32(0x8000)));
}

/* low 16 bf16 from b, high 16 from a, as _mm512_cvtne2ps_pbh(a, b) */
static inline __m512bh emu_cvtne2ps_pbh(__m512 a, __m512 b) {
    const __m256i lo = _mm512_cvtepi32_epi16(emu_bf16_round(b)), hi = _mm512_cvtepi32_epi16(emu_bf16_round(a));
    return (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline __m512 emu_bf16_daz(__m512i f) { /* bf16 widened to float32, denormals as 0 */
    const __mmask16 den =
        _mm512_cmpeq_epi32_mask(_mm512_and_si512(f, _mm512_set1_epi32(0x7f800000)), _mm512_setzero_si512());
    return _mm512_castsi512_ps(_mm512_mask_and_epi32(f, den, f, _mm512_set1_epi32((int)0x80000000)));
}

static inline __m512 emu_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b) {
    const __m512i ai = (__m512i)a, bi = (__m512i)b, hi = _mm512_set1_epi32((int)0xffff0000);
    const __m512 a_odd = emu_bf16_daz(_mm512_and_si512(ai, hi)), b_odd = emu_bf16_daz(_mm512_and_si512(bi, hi));
    const __m512 a_even = emu_bf16_daz(_mm512_slli_epi32(ai, 16)), b_even = emu_bf16_daz(_mm512_slli_epi32(bi, 16));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(a_odd, b_odd));
    return _mm512_add_ps(acc, _mm512_mul_ps(a_even, b_even));
}

#ifdef MA_EMU_COUNT
/* run.py --count: one instruction each, as on the real CPU, with the same
 * operands and no meaning (the instruction count is what is measured). */
#define _mm512_cvtne2ps_pbh(a, b) ((__m512bh)_mm512_packus_epi32(_mm512_castps_si512(b), _mm512_castps_si512(a)))
#define _mm512_dpbf16_ps(acc, a, b) _mm512_fmaddsub_ps((__m512)(a), (__m512)(b), acc) /* its own mnemonic */
#else
#define _mm512_cvtne2ps_pbh emu_cvtne2ps_pbh
#define _mm512_dpbf16_ps emu_dpbf16_ps
#endif
