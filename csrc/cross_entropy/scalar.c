/*
 * scalar.c -- the scalar cross-entropy row blocks (the reference every SIMD
 * variant is tested against) and two instances of cross_entropy_tmpl.h:
 * float accumulation on those blocks, and double accumulation (float64
 * inputs, generic loops only).
 */
#include <math.h>
#include <string.h>

#include "blocks.h"
#include "common/dtype.h"
#include "masked_attn.h"

/* ---- the scalar row blocks (the reference for every SIMD variant) --------
 *
 * Rows are C contiguous logits x of dtype dt, weights w contiguous or NULL
 * (all 1); y_c = cap tanh(x_c / cap) when cap > 0, else x_c.
 */
static inline float cap_scalar(float x, float cap) { return cap > 0 ? cap * tanhf(x / cap) : x; }

/* max, sum of exponentials and (want_dot) sum_c w_c, sum_c w_c (y_c - m),
 * online in one read. A -inf logit adds nothing to l and w_c * -inf to
 * k_dot; NaN propagates into l. */
static ma_ce_stats row_stats_scalar(const void *x, const void *w, ma_dtype dt, int64_t C, float cap, int want_dot) {
    float m = -INFINITY;
    double l = 0, k_sum = 0, k_dot = 0;
    for (int64_t c = 0; c < C; c++) {
        const float y = cap_scalar(ma_load_f32(x, dt, c), cap);
        if (y > m) {
            l = l * expf(m - y) + 1;
            if (want_dot && m != -INFINITY) k_dot += k_sum * (m - y);
            m = y;
        } else if (y != -INFINITY) {
            l += expf(y - m);
        }
        if (want_dot) {
            const float k = w ? ma_load_f32(w, dt, c) : 1.0f;
            k_sum += k;
            k_dot += k * (m == -INFINITY ? y : y - m);
        }
    }
    ma_ce_stats st = {m, l, k_sum, k_dot};
    return st;
}

/* dx_c = (g_soft exp(y_c - lse) - g_w w_c) dy_c/dx_c, overwriting dx (which may be x). */
static void row_grad_scalar(void *dx, const void *x, const void *w, ma_dtype dt, int64_t C, float cap, float lse,
                            float g_soft, float g_w) {
    for (int64_t c = 0; c < C; c++) {
        const float xc = ma_load_f32(x, dt, c);
        float d, dy = 1.0f;
        if (cap > 0) {
            const float t = tanhf(xc / cap);
            d = g_soft * expf(cap * t - lse);
            dy = 1.0f - t * t;
        } else {
            d = g_soft * expf(xc - lse);
        }
        if (g_w != 0.0f) d -= g_w * (w ? ma_load_f32(w, dt, c) : 1.0f);
        ma_store_f32(dx, dt, c, d * dy);
    }
}

const ma_ce_blocks ma_ce_blocks_scalar = MA_CE_BLOCKS(scalar);

/* float accumulation, scalar blocks: the reference */
#define FN(name) name##_scalar
#define BLK(name) name##_scalar
#include "cross_entropy_tmpl.h"
const ma_ce_kernels ma_ce_kernels_scalar = {ce_fwd_scalar, ce_bwd_scalar};

/* double accumulation (float64 inputs): the generic loops only */
#define MA_ACC_F64
#define FN(name) name##_f64
#include "cross_entropy_tmpl.h"
const ma_ce_kernels ma_ce_kernels_f64 = {ce_fwd_f64, ce_bwd_f64};
