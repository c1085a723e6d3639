/*
 * cross_entropy.c -- cross-entropy with class-index or probability targets,
 * ignore_index, class weights, label smoothing, z-loss and logit
 * soft-capping; forward and backward.
 *
 * The kernels are written once in cross_entropy_tmpl.h and instantiated here
 * for float accumulation with the scalar row blocks (the reference every SIMD
 * variant is tested against) and for double accumulation (float64 inputs).
 * cross_entropy_avx2.c and cross_entropy_avx512.c instantiate it with their
 * blocks. The public task functions below are the one place where the
 * variant is chosen.
 */
#include <math.h>
#include <string.h>

#include "cross_entropy_isa.h"
#include "dtype.h"
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

const ma_ce_blocks ma_ce_blocks_scalar = {"scalar", row_stats_scalar, row_grad_scalar};

/* float accumulation, scalar blocks: the reference */
#define ACC float
#define FN(name) name##_scalar
#define LOAD ma_load_f32
#define STORE ma_store_f32
#define EXP expf
#define TANH tanhf
#define ROW_STATS row_stats_scalar
#define ROW_GRAD row_grad_scalar
#include "cross_entropy_tmpl.h"
#undef ACC
#undef FN
#undef LOAD
#undef STORE
#undef EXP
#undef TANH
#undef ROW_STATS
#undef ROW_GRAD

/* double accumulation (float64 inputs): the generic loops only */
#define ACC double
#define FN(name) name##_f64
#define LOAD ma_load_f64
#define STORE ma_store_f64
#define EXP exp
#define TANH tanh
#include "cross_entropy_tmpl.h"
#undef ACC
#undef FN
#undef LOAD
#undef STORE
#undef EXP
#undef TANH

/* ---- the one place where the variant is chosen ---------------------------- */

void ma_ce_fwd_task(int64_t begin, int64_t end, void *ctx) {
    const ma_ce_fwd_params *p = (const ma_ce_fwd_params *)((const ma_task_ctx *)ctx)->params;
    if (p->a.dtype == MA_F64) ce_fwd_f64(begin, end, ctx);
    else if (p->a.isa == MA_ISA_AVX512 || p->a.isa == MA_ISA_AMX) ma_ce_fwd_avx512(begin, end, ctx);
    else if (p->a.isa == MA_ISA_AVX2) ma_ce_fwd_avx2(begin, end, ctx);
    else ce_fwd_scalar(begin, end, ctx);
}

void ma_ce_bwd_task(int64_t begin, int64_t end, void *ctx) {
    const ma_ce_bwd_params *p = (const ma_ce_bwd_params *)((const ma_task_ctx *)ctx)->params;
    if (p->a.dtype == MA_F64) ce_bwd_f64(begin, end, ctx);
    else if (p->a.isa == MA_ISA_AVX512 || p->a.isa == MA_ISA_AMX) ma_ce_bwd_avx512(begin, end, ctx);
    else if (p->a.isa == MA_ISA_AVX2) ma_ce_bwd_avx2(begin, end, ctx);
    else ce_bwd_scalar(begin, end, ctx);
}

/* The divisor of 'mean': sum of w[target] over the kept rows (their count
 * without weight); R for probability targets, 0 when there is no class (an
 * empty input, whose mean is NaN as in PyTorch). */
double ma_ce_total_weight(const ma_ce_args *a) {
    if (!a->target) return a->C > 0 ? (double)(a->N * a->S) : 0.0;
    double total = 0;
    for (int64_t n = 0; n < a->N; n++)
        for (int64_t s = 0; s < a->S; s++) {
            const int64_t t = a->target[n * a->target_stride[0] + s * a->target_stride[1]];
            if (t == a->ignore_index) continue;
            total += a->weight ? ma_load_f64(a->weight, a->dtype, t * a->weight_stride) : 1.0;
        }
    return total;
}

double ma_ce_sum(const void *x, ma_dtype dt, int64_t n) {
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += ma_load_f64(x, dt, i);
    return sum;
}
