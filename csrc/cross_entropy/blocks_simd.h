/*
 * blocks_simd.h -- the cross-entropy row blocks (blocks.h) written once over
 * the SIMD vocabulary (common/simd.h); the including file has included one
 * instruction set's mapping (common/simd_X.h) and defined BLK(name).
 *
 * row_stats keeps a running max and sum per lane, updated once per block of
 * UNROLL vectors: the block's max first (from registers), the lanes whose max
 * grew are rescaled (one vector exp), then one exp per element. Sums of a
 * block are float, carried across blocks in double. The lanes are combined
 * at the end of the row. row_grad is one exp per element and one store.
 * float32, bfloat16 and float16 rows are converted in registers.
 */
#ifndef MA_CE_BLOCKS_SIMD_H
#define MA_CE_BLOCKS_SIMD_H

#include <math.h>

#include "blocks.h"
#include "common/dtype.h"
#include "masked_attn.h"

/* vectors per block (the mapping's MA_CE_UNROLL): 8 of 16 lanes, 4 of 8, 8 of 4 */
enum { VL = MA_VL, UNROLL = MA_CE_UNROLL };

/* y = cap tanh(x / cap), or x */
static inline vf capped(vf x, float cap, float inv_cap) {
    return cap > 0 ? vf_mul(vf_set1(cap), vf_tanh(vf_mul(x, vf_set1(inv_cap)))) : x;
}

/* The hardware prefetchers stop at 4 KB page boundaries; a row is read
 * straight through, so ask for the lines PREFETCH_BYTES ahead. */
#define PREFETCH_BYTES 2048

typedef struct {
    vf m;       /* running max per lane                         */
    vd l0, l1;  /* sum exp(y - m) per lane, lanes [0, VL/2) and the rest */
    vd ks0, ks1; /* sum w                                        */
    vd kd0, kd1; /* sum w (y - m)                                */
} lanes;

/* One block of NV vectors y[i] (inactive lanes -inf) with active masks k[i]
 * and weights wv[i] (inactive lanes 0): update the lanes' max, sums. */
static inline __attribute__((always_inline)) void stats_block(const int NV, const vf *y, const vm *k, const vf *wv,
                                                              int want_dot, lanes *st) {
    const vf ninf = vf_set1(-INFINITY);
    vf bm = y[0];
    for (int i = 1; i < NV; i++) bm = vf_max(y[i], bm);
    const vm up = vf_gt(bm, st->m);
    if (vm_any(up)) { /* some lanes' max grew: rescale what they hold */
        const vf m_new = vf_blend(up, st->m, bm);
        /* 0 where the old max was -inf, 1 in the lanes that did not grow */
        const vf sc = vf_exp(vf_maskz(up, vf_sub(st->m, m_new)));
        st->l0 = vd_mul(st->l0, vd_lo(sc));
        st->l1 = vd_mul(st->l1, vd_hi(sc));
        if (want_dot) { /* sum w (y - m) shifts by sum w (m - m_new), unless m was -inf */
            const vf d = vf_maskz(vm_and(up, vf_neq(st->m, ninf)), vf_sub(st->m, m_new));
            st->kd0 = vd_fma(st->ks0, vd_lo(d), st->kd0);
            st->kd1 = vd_fma(st->ks1, vd_hi(d), st->kd1);
        }
        st->m = m_new;
    }
    /* a lane whose max is -inf has seen only -inf: subtract 0 there */
    const vf m_eff = vf_blend(vf_eq(st->m, ninf), st->m, vf_zero());
    vf e = vf_exp(vf_sub(y[0], m_eff));
    for (int i = 1; i < NV; i++) e = vf_add(e, vf_exp(vf_sub(y[i], m_eff)));
    st->l0 = vd_add(st->l0, vd_lo(e));
    st->l1 = vd_add(st->l1, vd_hi(e));
    if (want_dot) {
        vf ks = wv[0], kd = vf_mul(wv[0], vf_maskz(k[0], vf_sub(y[0], m_eff)));
        for (int i = 1; i < NV; i++) {
            ks = vf_add(ks, wv[i]);
            kd = vf_fma(wv[i], vf_maskz(k[i], vf_sub(y[i], m_eff)), kd);
        }
        st->ks0 = vd_add(st->ks0, vd_lo(ks));
        st->ks1 = vd_add(st->ks1, vd_hi(ks));
        st->kd0 = vd_add(st->kd0, vd_lo(kd));
        st->kd1 = vd_add(st->kd1, vd_hi(kd));
    }
}

static inline __attribute__((always_inline)) ma_ce_stats row_stats_dt(const void *x, const void *w, ma_dtype dt,
                                                                      int64_t C, float cap, int want_dot) {
    const int64_t es = dt == MA_F32 ? 4 : 2;
    const float inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
    const vf ninf = vf_set1(-INFINITY), one = vf_set1(1.0f);
    const vd zero = vd_zero();
    lanes st = {ninf, zero, zero, zero, zero, zero, zero};
    vf y[UNROLL], wv[UNROLL];
    vm k[UNROLL];
    int64_t c = 0;
    for (; c + UNROLL * VL <= C; c += UNROLL * VL) {
        for (int64_t pf = 0; pf < UNROLL * VL * es; pf += 64)
            ma_prefetch((const char *)x + c * es + PREFETCH_BYTES + pf);
        for (int i = 0; i < UNROLL; i++) {
            const int64_t ci = c + i * VL;
            k[i] = vm_first(VL);
            y[i] = capped(vf_load_dt(x, dt, ci, VL), cap, inv_cap);
            wv[i] = want_dot && w ? vf_load_dt(w, dt, ci, VL) : one;
        }
        stats_block(UNROLL, y, k, wv, want_dot, &st);
    }
    for (; c < C; c += VL) {
        k[0] = vm_first(C - c);
        y[0] = vf_blend(k[0], ninf, capped(vf_load_dt(x, dt, c, C - c), cap, inv_cap));
        wv[0] = want_dot && w ? vf_load_dt(w, dt, c, C - c) : vf_maskz(k[0], one);
        stats_block(1, y, k, wv, want_dot, &st);
    }
    /* combine the lanes */
    float m[VL];
    double l[VL], ks[VL], kd[VL];
    vf_store(m, st.m);
    vd_store(l, st.l0), vd_store(l + VL / 2, st.l1);
    vd_store(ks, st.ks0), vd_store(ks + VL / 2, st.ks1);
    vd_store(kd, st.kd0), vd_store(kd + VL / 2, st.kd1);
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

static ma_ce_stats BLK(row_stats)(const void *x, const void *w, ma_dtype dt, int64_t C, float cap, int want_dot) {
    switch (dt) {
    case MA_BF16: return row_stats_dt(x, w, MA_BF16, C, cap, want_dot);
    case MA_F16: return row_stats_dt(x, w, MA_F16, C, cap, want_dot);
    default: return row_stats_dt(x, w, MA_F32, C, cap, want_dot);
    }
}

static inline __attribute__((always_inline)) vf grad_v(vf xv, vf wv, vf capv, vf invv, vf lse_v, vf gs, vf gw,
                                                       float cap, int use_w) {
    const vf one = vf_set1(1.0f);
    if (cap > 0) {
        const vf t = vf_tanh(vf_mul(xv, invv));
        vf d = vf_mul(gs, vf_exp(vf_fms(capv, t, lse_v)));
        if (use_w) d = vf_fnma(gw, wv, d);
        return vf_mul(d, vf_fnma(t, t, one));
    }
    vf d = vf_mul(gs, vf_exp(vf_sub(xv, lse_v)));
    if (use_w) d = vf_fnma(gw, wv, d);
    return d;
}

static inline __attribute__((always_inline)) void row_grad_dt(void *dx, const void *x, const void *w, ma_dtype dt,
                                                              int64_t C, float cap, float lse, float g_soft,
                                                              float g_w) {
    const int64_t es = dt == MA_F32 ? 4 : 2;
    const vf lse_v = vf_set1(lse), gs = vf_set1(g_soft), gw = vf_set1(g_w), one = vf_set1(1.0f);
    const vf capv = vf_set1(cap), invv = vf_set1(cap > 0 ? 1.0f / cap : 0.0f);
    const int use_w = g_w != 0.0f;
    int64_t c = 0;
    for (; c + VL <= C; c += VL) {
        if ((c * es) % 64 == 0) ma_prefetch((const char *)x + c * es + PREFETCH_BYTES);
        const vf wv = use_w && w ? vf_load_dt(w, dt, c, VL) : one;
        vf_store_dt(dx, dt, c, VL, grad_v(vf_load_dt(x, dt, c, VL), wv, capv, invv, lse_v, gs, gw, cap, use_w));
    }
    if (c < C) {
        const vf wv = use_w && w ? vf_load_dt(w, dt, c, C - c) : one;
        vf_store_dt(dx, dt, c, C - c, grad_v(vf_load_dt(x, dt, c, C - c), wv, capv, invv, lse_v, gs, gw, cap, use_w));
    }
}

static void BLK(row_grad)(void *dx, const void *x, const void *w, ma_dtype dt, int64_t C, float cap, float lse,
                          float g_soft, float g_w) {
    switch (dt) {
    case MA_BF16: row_grad_dt(dx, x, w, MA_BF16, C, cap, lse, g_soft, g_w); break;
    case MA_F16: row_grad_dt(dx, x, w, MA_F16, C, cap, lse, g_soft, g_w); break;
    default: row_grad_dt(dx, x, w, MA_F32, C, cap, lse, g_soft, g_w); break;
    }
}

#endif /* MA_CE_BLOCKS_SIMD_H */
