/*
 * blocks_avx2.h -- the cross-entropy row blocks (blocks.h) on AVX2 + FMA.
 *
 * The same algorithm as blocks_avx512.h on 8 lanes, blocks of 4
 * vectors. AVX2 has no 16-bit masked loads: the column tail is copied
 * through a small zero-padded buffer.
 */
#ifndef MA_CE_BLOCKS_AVX2_H
#define MA_CE_BLOCKS_AVX2_H

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "blocks.h"
#include "common/dtype.h"
#include "common/simd.h"
#include "masked_attn.h"

enum { VL = 8, UNROLL = 4 };

/* lanes [0, n) set, n clamped to [0, 8] */
static inline __m256 lane_mask(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int nn = n < 0 ? 0 : n > 8 ? 8 : (int)n;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nn), idx));
}

/* 8 elements of dtype dt at p. */
static inline __attribute__((always_inline)) __m256 load8(const void *p, ma_dtype dt) {
    if (dt == MA_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (dt == MA_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_loadu_ps((const float *)p);
}

/* the first n < 8 elements, the rest 0 */
static inline __attribute__((always_inline)) __m256 load8_tail(const void *p, ma_dtype dt, int64_t n, size_t es) {
    _Alignas(32) unsigned char buf[32] = {0};
    memcpy(buf, p, (size_t)n * es);
    return load8(buf, dt);
}

/* 8 elements as dtype dt at p; bfloat16 rounds to nearest even (NaN stays a
 * quiet NaN), as ma_f32_to_bf16. */
static inline __attribute__((always_inline)) void store8(void *p, ma_dtype dt, __m256 v) {
    if (dt == MA_BF16) {
        const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
        __m256i r = _mm256_add_epi32(
            u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1))));
        r = _mm256_srli_epi32(r, 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
    } else if (dt == MA_F16) {
        _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        _mm256_storeu_ps((float *)p, v);
    }
}

static inline __attribute__((always_inline)) void store8_tail(void *p, ma_dtype dt, __m256 v, int64_t n, size_t es) {
    _Alignas(32) unsigned char buf[32];
    store8(buf, dt, v);
    memcpy(p, buf, (size_t)n * es);
}

static inline __m256 capped(__m256 x, float cap, float inv_cap) {
    return cap > 0 ? _mm256_mul_ps(_mm256_set1_ps(cap), tanh256(_mm256_mul_ps(x, _mm256_set1_ps(inv_cap)))) : x;
}

/* ---- row_stats ------------------------------------------------------------ */

/* Software prefetch PREFETCH_BYTES ahead of the row (the hardware prefetchers
 * stop at 4 KB page boundaries), one line per 64 bytes read. */
#define PREFETCH_BYTES 2048
#define PREFETCH_AHEAD(p, bytes)                                                \
    do {                                                                        \
        for (int pf = 0; pf < (int)(bytes); pf += 64)                           \
            _mm_prefetch((const char *)(p) + PREFETCH_BYTES + pf, _MM_HINT_T0); \
    } while (0)

typedef struct {
    __m256 m;             /* running max per lane                   */
    __m256d l0, l1;       /* sum exp(y - m), lanes 0-3 and 4-7       */
    __m256d ks0, ks1;     /* sum w                                   */
    __m256d kd0, kd1;     /* sum w (y - m)                           */
} lanes;

static inline __m256d lo_pd(__m256 v) { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
static inline __m256d hi_pd(__m256 v) { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }

/* One block of NV vectors y[i] (inactive lanes -inf), active masks k[i] and
 * weights wv[i] (inactive lanes 0). As stats_block in cross_entropy_avx512.c. */
static inline __attribute__((always_inline)) void stats_block(const int NV, const __m256 *y, const __m256 *k,
                                                              const __m256 *wv, int want_dot, lanes *st) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 bm = y[0];
    for (int i = 1; i < NV; i++) bm = _mm256_max_ps(y[i], bm);
    const __m256 up = _mm256_cmp_ps(bm, st->m, _CMP_GT_OQ);
    if (_mm256_movemask_ps(up)) {
        const __m256 m_new = _mm256_blendv_ps(st->m, bm, up);
        const __m256 sc = exp256(_mm256_and_ps(up, _mm256_sub_ps(st->m, m_new))); /* 1 where not grown */
        st->l0 = _mm256_mul_pd(st->l0, lo_pd(sc));
        st->l1 = _mm256_mul_pd(st->l1, hi_pd(sc));
        if (want_dot) {
            const __m256 shift = _mm256_and_ps(up, _mm256_cmp_ps(st->m, ninf, _CMP_NEQ_OQ));
            const __m256 d = _mm256_and_ps(shift, _mm256_sub_ps(st->m, m_new));
            st->kd0 = _mm256_fmadd_pd(st->ks0, lo_pd(d), st->kd0);
            st->kd1 = _mm256_fmadd_pd(st->ks1, hi_pd(d), st->kd1);
        }
        st->m = m_new;
    }
    const __m256 m_eff = _mm256_andnot_ps(_mm256_cmp_ps(st->m, ninf, _CMP_EQ_OQ), st->m);
    __m256 e = exp256(_mm256_sub_ps(y[0], m_eff));
    for (int i = 1; i < NV; i++) e = _mm256_add_ps(e, exp256(_mm256_sub_ps(y[i], m_eff)));
    st->l0 = _mm256_add_pd(st->l0, lo_pd(e));
    st->l1 = _mm256_add_pd(st->l1, hi_pd(e));
    if (want_dot) {
        __m256 ks = wv[0], kd = _mm256_mul_ps(wv[0], _mm256_and_ps(k[0], _mm256_sub_ps(y[0], m_eff)));
        for (int i = 1; i < NV; i++) {
            ks = _mm256_add_ps(ks, wv[i]);
            kd = _mm256_fmadd_ps(wv[i], _mm256_and_ps(k[i], _mm256_sub_ps(y[i], m_eff)), kd);
        }
        st->ks0 = _mm256_add_pd(st->ks0, lo_pd(ks));
        st->ks1 = _mm256_add_pd(st->ks1, hi_pd(ks));
        st->kd0 = _mm256_add_pd(st->kd0, lo_pd(kd));
        st->kd1 = _mm256_add_pd(st->kd1, hi_pd(kd));
    }
}

static inline __attribute__((always_inline)) ma_ce_stats row_stats_dt(const void *x, const void *w, ma_dtype dt,
                                                                      int64_t C, float cap, int want_dot) {
    const size_t es = dt == MA_F32 ? 4 : 2;
    const float inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
    const __m256 ninf = _mm256_set1_ps(-INFINITY), one = _mm256_set1_ps(1.0f), all = lane_mask(8);
    const __m256d zero = _mm256_setzero_pd();
    lanes st = {ninf, zero, zero, zero, zero, zero, zero};
    __m256 y[UNROLL], wv[UNROLL], k[UNROLL];
    int64_t c = 0;
    for (; c + UNROLL * VL <= C; c += UNROLL * VL) {
        PREFETCH_AHEAD((const char *)x + c * es, UNROLL * VL * es);
        for (int i = 0; i < UNROLL; i++) {
            const int64_t ci = c + i * VL;
            k[i] = all;
            y[i] = capped(load8((const char *)x + ci * es, dt), cap, inv_cap);
            wv[i] = want_dot && w ? load8((const char *)w + ci * es, dt) : one;
        }
        stats_block(UNROLL, y, k, wv, want_dot, &st);
    }
    for (; c < C; c += VL) {
        const int64_t n = C - c < VL ? C - c : VL;
        k[0] = lane_mask(n);
        const __m256 xv =
            n == VL ? load8((const char *)x + c * es, dt) : load8_tail((const char *)x + c * es, dt, n, es);
        y[0] = _mm256_blendv_ps(ninf, capped(xv, cap, inv_cap), k[0]);
        wv[0] = want_dot && w
                    ? (n == VL ? load8((const char *)w + c * es, dt) : load8_tail((const char *)w + c * es, dt, n, es))
                    : _mm256_and_ps(k[0], one);
        stats_block(1, y, k, wv, want_dot, &st);
    }
    float m[VL];
    double l[VL], ks[VL], kd[VL];
    _mm256_storeu_ps(m, st.m);
    _mm256_storeu_pd(l, st.l0), _mm256_storeu_pd(l + 4, st.l1);
    _mm256_storeu_pd(ks, st.ks0), _mm256_storeu_pd(ks + 4, st.ks1);
    _mm256_storeu_pd(kd, st.kd0), _mm256_storeu_pd(kd + 4, st.kd1);
    ma_ce_stats out = {-INFINITY, 0, 0, 0};
    for (int i = 0; i < VL; i++)
        if (m[i] > out.m) out.m = m[i];
    for (int i = 0; i < VL; i++) {
        const int live = m[i] != -INFINITY;
        out.l += live ? l[i] * exp((double)m[i] - out.m) : l[i];
        if (want_dot) {
            out.k_sum += ks[i];
            out.k_dot += live ? kd[i] + ks[i] * ((double)m[i] - out.m) : kd[i];
        }
    }
    return out;
}

static ma_ce_stats row_stats_avx2(const void *x, const void *w, ma_dtype dt, int64_t C, float cap, int want_dot) {
    switch (dt) {
    case MA_BF16: return row_stats_dt(x, w, MA_BF16, C, cap, want_dot);
    case MA_F16: return row_stats_dt(x, w, MA_F16, C, cap, want_dot);
    default: return row_stats_dt(x, w, MA_F32, C, cap, want_dot);
    }
}

/* ---- row_grad ------------------------------------------------------------- */

static inline __attribute__((always_inline)) __m256 grad8(__m256 xv, __m256 wv, float cap, float inv_cap, __m256 lse_v,
                                                          __m256 gs, __m256 gw, int use_w) {
    const __m256 one = _mm256_set1_ps(1.0f);
    if (cap > 0) {
        const __m256 t = tanh256(_mm256_mul_ps(xv, _mm256_set1_ps(inv_cap)));
        __m256 d = _mm256_mul_ps(gs, exp256(_mm256_fmsub_ps(_mm256_set1_ps(cap), t, lse_v)));
        if (use_w) d = _mm256_fnmadd_ps(gw, wv, d);
        return _mm256_mul_ps(d, _mm256_fnmadd_ps(t, t, one));
    }
    __m256 d = _mm256_mul_ps(gs, exp256(_mm256_sub_ps(xv, lse_v)));
    if (use_w) d = _mm256_fnmadd_ps(gw, wv, d);
    return d;
}

static inline __attribute__((always_inline)) void row_grad_dt(void *dx, const void *x, const void *w, ma_dtype dt,
                                                              int64_t C, float cap, float lse, float g_soft,
                                                              float g_w) {
    const size_t es = dt == MA_F32 ? 4 : 2;
    const float inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
    const __m256 lse_v = _mm256_set1_ps(lse), gs = _mm256_set1_ps(g_soft), gw = _mm256_set1_ps(g_w);
    const __m256 one = _mm256_set1_ps(1.0f);
    const int use_w = g_w != 0.0f;
    const char *xc = (const char *)x, *wc = (const char *)w;
    char *dc = (char *)dx;
    int64_t c = 0;
    for (; c + VL <= C; c += VL) {
        if ((c * es) % 64 == 0) _mm_prefetch(xc + c * es + PREFETCH_BYTES, _MM_HINT_T0);
        const __m256 xv = load8(xc + c * es, dt);
        const __m256 wv = use_w && w ? load8(wc + c * es, dt) : one;
        store8(dc + c * es, dt, grad8(xv, wv, cap, inv_cap, lse_v, gs, gw, use_w));
    }
    if (c < C) {
        const int64_t n = C - c;
        const __m256 xv = load8_tail(xc + c * es, dt, n, es);
        const __m256 wv = use_w && w ? load8_tail(wc + c * es, dt, n, es) : one;
        store8_tail(dc + c * es, dt, grad8(xv, wv, cap, inv_cap, lse_v, gs, gw, use_w), n, es);
    }
}

static void row_grad_avx2(void *dx, const void *x, const void *w, ma_dtype dt, int64_t C, float cap, float lse,
                          float g_soft, float g_w) {
    switch (dt) {
    case MA_BF16: row_grad_dt(dx, x, w, MA_BF16, C, cap, lse, g_soft, g_w); break;
    case MA_F16: row_grad_dt(dx, x, w, MA_F16, C, cap, lse, g_soft, g_w); break;
    default: row_grad_dt(dx, x, w, MA_F32, C, cap, lse, g_soft, g_w); break;
    }
}

#endif /* MA_CE_BLOCKS_AVX2_H */
