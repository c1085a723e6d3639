/*
 * blocks_avx512.h -- the cross-entropy row blocks (blocks.h) on AVX-512.
 *
 * row_stats keeps a running max and sum per lane (16 lanes), updated once per
 * block of 8 vectors: the block's max first (from registers), the lanes whose
 * max grew are rescaled (one vector exp), then one exp per element. Sums of a
 * block are float, carried across blocks in double. The lanes are combined at
 * the end of the row. row_grad is one exp per element and one store.
 * float32, bfloat16 and float16 rows are converted in registers; the column
 * tail uses masked loads and stores.
 */
#ifndef MA_CE_BLOCKS_AVX512_H
#define MA_CE_BLOCKS_AVX512_H

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "blocks.h"
#include "common/dtype.h"
#include "common/simd.h"
#include "masked_attn.h"

enum { VL = 16, UNROLL = 8 };

static inline __mmask16 tail_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* 16 elements of a row of dtype dt at p, lanes outside k read as 0. */
static inline __attribute__((always_inline)) __m512 load16(const void *p, ma_dtype dt, __mmask16 k) {
    if (dt == MA_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
    if (dt == MA_F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
    return _mm512_maskz_loadu_ps(k, p);
}

/* stores lanes k of v as dtype dt at p; bfloat16 rounds to nearest even
 * (NaN stays a quiet NaN), as ma_f32_to_bf16. */
static inline __attribute__((always_inline)) void store16(void *p, ma_dtype dt, __mmask16 k, __m512 v) {
    if (dt == MA_BF16) {
        const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
        __m512i r = _mm512_add_epi32(
            u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1))));
        r = _mm512_srli_epi32(r, 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
        _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(r));
    } else if (dt == MA_F16) {
        _mm256_mask_storeu_epi16(p, k, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        _mm512_mask_storeu_ps(p, k, v);
    }
}

/* y = cap tanh(x / cap), or x */
static inline __m512 capped(__m512 x, float cap, float inv_cap) {
    return cap > 0 ? _mm512_mul_ps(_mm512_set1_ps(cap), tanh512(_mm512_mul_ps(x, _mm512_set1_ps(inv_cap)))) : x;
}

/* ---- row_stats ------------------------------------------------------------ */

/* The hardware prefetchers stop at 4 KB page boundaries; a row is read
 * straight through, so ask for the lines PREFETCH_BYTES ahead (a block of
 * UNROLL vectors is 512 bytes of float32: 8 lines). */
#define PREFETCH_BYTES 2048
#define PREFETCH_AHEAD(p)                                                       \
    do {                                                                        \
        for (int pf = 0; pf < UNROLL * VL * (int)es; pf += 64)                  \
            _mm_prefetch((const char *)(p) + PREFETCH_BYTES + pf, _MM_HINT_T0); \
    } while (0)

typedef struct {
    __m512 m;             /* running max per lane                            */
    __m512d l0, l1;       /* sum exp(y - m) per lane, lanes 0-7 and 8-15      */
    __m512d ks0, ks1;     /* sum w                                            */
    __m512d kd0, kd1;     /* sum w (y - m)                                    */
} lanes;

static inline __m512d lo_pd(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
static inline __m512d hi_pd(__m512 v) { return _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)); }

/* One block of NV vectors y[i] (inactive lanes -inf) with active masks k[i]
 * and weights wv[i] (inactive lanes 0): update the lanes' max, sums. */
static inline __attribute__((always_inline)) void stats_block(const int NV, const __m512 *y, const __mmask16 *k,
                                                              const __m512 *wv, int want_dot, lanes *st) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 bm = y[0];
    for (int i = 1; i < NV; i++) bm = _mm512_max_ps(y[i], bm);
    const __mmask16 up = _mm512_cmp_ps_mask(bm, st->m, _CMP_GT_OQ);
    if (up) { /* some lanes' max grew: rescale what they hold */
        const __m512 m_new = _mm512_mask_mov_ps(st->m, up, bm);
        /* 0 where the old max was -inf, 1 in the lanes that did not grow */
        const __m512 sc = exp512(_mm512_maskz_sub_ps(up, st->m, m_new));
        st->l0 = _mm512_mul_pd(st->l0, lo_pd(sc));
        st->l1 = _mm512_mul_pd(st->l1, hi_pd(sc));
        if (want_dot) { /* sum w (y - m) shifts by sum w (m - m_new), unless m was -inf */
            const __mmask16 shift = up & _mm512_cmp_ps_mask(st->m, ninf, _CMP_NEQ_OQ);
            const __m512 d = _mm512_maskz_sub_ps(shift, st->m, m_new);
            st->kd0 = _mm512_fmadd_pd(st->ks0, lo_pd(d), st->kd0);
            st->kd1 = _mm512_fmadd_pd(st->ks1, hi_pd(d), st->kd1);
        }
        st->m = m_new;
    }
    /* a lane whose max is -inf has seen only -inf: subtract 0 there */
    const __m512 m_eff = _mm512_mask_mov_ps(st->m, _mm512_cmp_ps_mask(st->m, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
    __m512 e = exp512(_mm512_sub_ps(y[0], m_eff));
    for (int i = 1; i < NV; i++) e = _mm512_add_ps(e, exp512(_mm512_sub_ps(y[i], m_eff)));
    st->l0 = _mm512_add_pd(st->l0, lo_pd(e));
    st->l1 = _mm512_add_pd(st->l1, hi_pd(e));
    if (want_dot) {
        __m512 ks = wv[0], kd = _mm512_mul_ps(wv[0], _mm512_maskz_sub_ps(k[0], y[0], m_eff));
        for (int i = 1; i < NV; i++) {
            ks = _mm512_add_ps(ks, wv[i]);
            kd = _mm512_fmadd_ps(wv[i], _mm512_maskz_sub_ps(k[i], y[i], m_eff), kd);
        }
        st->ks0 = _mm512_add_pd(st->ks0, lo_pd(ks));
        st->ks1 = _mm512_add_pd(st->ks1, hi_pd(ks));
        st->kd0 = _mm512_add_pd(st->kd0, lo_pd(kd));
        st->kd1 = _mm512_add_pd(st->kd1, hi_pd(kd));
    }
}

static inline __attribute__((always_inline)) ma_ce_stats row_stats_dt(const void *x, const void *w, ma_dtype dt,
                                                                      int64_t C, float cap, int want_dot) {
    const size_t es = dt == MA_F32 ? 4 : 2;
    const float inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
    const __m512 ninf = _mm512_set1_ps(-INFINITY), one = _mm512_set1_ps(1.0f);
    const __m512d zero = _mm512_setzero_pd();
    lanes st = {ninf, zero, zero, zero, zero, zero, zero};
    __m512 y[UNROLL], wv[UNROLL];
    __mmask16 k[UNROLL];
    int64_t c = 0;
    for (; c + UNROLL * VL <= C; c += UNROLL * VL) {
        PREFETCH_AHEAD((const char *)x + c * es);
        for (int i = 0; i < UNROLL; i++) {
            const int64_t ci = c + i * VL;
            k[i] = 0xffff;
            y[i] = capped(load16((const char *)x + ci * es, dt, k[i]), cap, inv_cap);
            wv[i] = want_dot && w ? load16((const char *)w + ci * es, dt, k[i]) : one;
        }
        stats_block(UNROLL, y, k, wv, want_dot, &st);
    }
    for (; c < C; c += VL) {
        k[0] = tail_mask(C - c);
        y[0] = _mm512_mask_mov_ps(ninf, k[0], capped(load16((const char *)x + c * es, dt, k[0]), cap, inv_cap));
        wv[0] = want_dot && w ? load16((const char *)w + c * es, dt, k[0]) : _mm512_maskz_mov_ps(k[0], one);
        stats_block(1, y, k, wv, want_dot, &st);
    }
    /* combine the lanes */
    float m[VL];
    double l[VL], ks[VL], kd[VL];
    _mm512_storeu_ps(m, st.m);
    _mm512_storeu_pd(l, st.l0), _mm512_storeu_pd(l + 8, st.l1);
    _mm512_storeu_pd(ks, st.ks0), _mm512_storeu_pd(ks + 8, st.ks1);
    _mm512_storeu_pd(kd, st.kd0), _mm512_storeu_pd(kd + 8, st.kd1);
    ma_ce_stats out = {-INFINITY, 0, 0, 0};
    for (int i = 0; i < VL; i++)
        if (m[i] > out.m) out.m = m[i];
    for (int i = 0; i < VL; i++) {
        /* a lane still at -inf holds 0 (or NaN, which must survive) */
        const int live = m[i] != -INFINITY;
        out.l += live ? l[i] * exp((double)m[i] - out.m) : l[i];
        if (want_dot) {
            out.k_sum += ks[i];
            out.k_dot += live ? kd[i] + ks[i] * ((double)m[i] - out.m) : kd[i];
        }
    }
    return out;
}

static ma_ce_stats row_stats_avx512(const void *x, const void *w, ma_dtype dt, int64_t C, float cap, int want_dot) {
    switch (dt) {
    case MA_BF16: return row_stats_dt(x, w, MA_BF16, C, cap, want_dot);
    case MA_F16: return row_stats_dt(x, w, MA_F16, C, cap, want_dot);
    default: return row_stats_dt(x, w, MA_F32, C, cap, want_dot);
    }
}

/* ---- row_grad ------------------------------------------------------------- */

static inline __attribute__((always_inline)) __m512 grad16(__m512 xv, const void *w, ma_dtype dt, __mmask16 k,
                                                           float cap, __m512 invv, __m512 capv, __m512 lse_v, __m512 gs,
                                                           __m512 gw, int use_w) {
    const __m512 one = _mm512_set1_ps(1.0f);
    if (cap > 0) {
        const __m512 t = tanh512(_mm512_mul_ps(xv, invv));
        __m512 d = _mm512_mul_ps(gs, exp512(_mm512_fmsub_ps(capv, t, lse_v)));
        if (use_w) d = _mm512_fnmadd_ps(gw, w ? load16(w, dt, k) : one, d);
        return _mm512_mul_ps(d, _mm512_fnmadd_ps(t, t, one));
    }
    __m512 d = _mm512_mul_ps(gs, exp512(_mm512_sub_ps(xv, lse_v)));
    if (use_w) d = _mm512_fnmadd_ps(gw, w ? load16(w, dt, k) : one, d);
    return d;
}

static inline __attribute__((always_inline)) void row_grad_dt(void *dx, const void *x, const void *w, ma_dtype dt,
                                                              int64_t C, float cap, float lse, float g_soft,
                                                              float g_w) {
    const size_t es = dt == MA_F32 ? 4 : 2;
    const __m512 lse_v = _mm512_set1_ps(lse), gs = _mm512_set1_ps(g_soft), gw = _mm512_set1_ps(g_w);
    const __m512 capv = _mm512_set1_ps(cap), invv = _mm512_set1_ps(cap > 0 ? 1.0f / cap : 0.0f);
    const int use_w = g_w != 0.0f;
    const char *xc = (const char *)x, *wc = (const char *)w;
    char *dc = (char *)dx;
    int64_t c = 0;
    for (; c < C; c += 16) {
        const __mmask16 k = tail_mask(C - c);
        _mm_prefetch(xc + c * es + PREFETCH_BYTES, _MM_HINT_T0);
        store16(
            dc + c * es, dt, k,
            grad16(load16(xc + c * es, dt, k), w ? wc + c * es : NULL, dt, k, cap, invv, capv, lse_v, gs, gw, use_w));
    }
}

static void row_grad_avx512(void *dx, const void *x, const void *w, ma_dtype dt, int64_t C, float cap, float lse,
                            float g_soft, float g_w) {
    switch (dt) {
    case MA_BF16: row_grad_dt(dx, x, w, MA_BF16, C, cap, lse, g_soft, g_w); break;
    case MA_F16: row_grad_dt(dx, x, w, MA_F16, C, cap, lse, g_soft, g_w); break;
    default: row_grad_dt(dx, x, w, MA_F32, C, cap, lse, g_soft, g_w); break;
    }
}

#endif /* MA_CE_BLOCKS_AVX512_H */
