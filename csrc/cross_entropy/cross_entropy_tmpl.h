/*
 * cross_entropy_tmpl.h -- cross-entropy forward and backward, written once
 * over the accumulation type and the row building blocks. Instances (each a
 * few lines): scalar.c (float with the scalar blocks, the reference; and
 * double for float64 inputs, generic loops only), avx2.c, avx512.c. An
 * instance defines FN(x) (its suffix), BLK(x) (the suffix of its row blocks,
 * blocks.h; none for the double instance) and MA_ACC_F64 for double, and
 * lists the kernels it gets (ce_fwd_<suffix>, ce_bwd_<suffix>) in its
 * ma_ce_kernels_<suffix> table. Per-element arithmetic is in
 * ACC; the sums over a row's C classes (sum of exponentials, the smoothing
 * and probability terms) are kept in double, so a 128k-class vocabulary
 * loses nothing to a long float32 running sum.
 *
 * Shapes: N, C, S, R as in masked_attn.h. Row r = n * S + s is x[n, :, s],
 * read in place with the class stride: an (N, C, d1, ..., dk) input is never
 * transposed or copied. A row with class stride 1 and a class-index target
 * (every (N, C) input) goes through the blocks; any other row through the
 * generic loops below, which read through strides.
 *
 * The forward reads each row once: max, sum of exponentials (online, as in
 * flash attention) and the linear term sum_c k_c y_c of label smoothing or
 * probability targets. The backward writes each row once from the saved lse.
 * A row whose target is ignore_index costs one compare in the forward and a
 * row of zeros in the backward.
 */
#include <math.h>
#include <string.h>

#include "blocks.h"
#include "common/dtype.h"
#include "masked_attn.h"

#ifdef MA_ACC_F64
#define ACC double
#define LOAD ma_load_f64
#define STORE ma_store_f64
#define EXP exp
#define TANH tanh
#else
#define ACC float
#define LOAD ma_load_f32
#define STORE ma_store_f32
#define EXP expf
#define TANH tanhf
#endif
#ifdef BLK
#define ROW_STATS BLK(row_stats)
#define ROW_GRAD BLK(row_grad)
#endif

/* ---- per-element and per-row helpers ------------------------------------ */

static inline size_t FN(elem_size)(ma_dtype dt) { return dt == MA_F64 ? 8 : dt == MA_F32 ? 4 : dt == MA_BOOL ? 1 : 2; }

/* y = cap tanh(x / cap) (soft-capping), or x when cap = 0 */
static inline ACC FN(cap_fn)(ACC x, ACC cap) { return cap > 0 ? cap * TANH(x / cap) : x; }

/* dy/dx = 1 - tanh(x / cap)^2, or 1 */
static inline ACC FN(cap_grad)(ACC x, ACC cap) {
    if (!(cap > 0)) return 1;
    const ACC t = TANH(x / cap);
    return 1 - t * t;
}

/* W = sum_c w_c (C without weight): the weight of the uniform smoothing target. */
static double FN(weight_sum)(const ma_ce_args *a) {
    if (!a->weight) return (double)a->C;
    double W = 0;
    for (int64_t c = 0; c < a->C; c++) W += LOAD(a->weight, a->dtype, c * a->weight_stride);
    return W;
}

static inline ACC FN(class_weight)(const ma_ce_args *a, int64_t c) {
    return a->weight ? LOAD(a->weight, a->dtype, c * a->weight_stride) : (ACC)1;
}

/* k_c, the coefficient of (lse - y_c) in the row's loss:
 *   class targets, smoothing term:  w_c
 *   probabilities:                  w_c p'_c,  p'_c = (1 - ls) p_c + ls / C
 * p_row is the offset of the row's p[n, 0, s]. */
static inline ACC FN(coef)(const ma_ce_args *a, int64_t c, int64_t p_row, ACC ls, ACC ls_c) {
    ACC k = FN(class_weight)(a, c);
    if (a->target_prob) {
        ACC pc = LOAD(a->target_prob, a->dtype, p_row + c * a->target_stride[1]);
        if (ls > 0) pc = (1 - ls) * pc + ls_c;
        k *= pc;
    }
    return k;
}

typedef struct {
    ACC m;         /* max_c y_c                                    */
    double log_l;  /* log sum_c exp(y_c - m); lse = m + log_l       */
    double k_sum;  /* sum_c k_c                 (when want_k)       */
    double k_dot;  /* sum_c k_c (y_c - m)       (when want_k)       */
} FN(row_summary);

/* Generic: one read of the row x[n, :, s] (x_row = offset of x[n, 0, s]),
 * online. k_dot is kept relative to the running max: when the max grows from
 * m to m', the terms so far shift by k_sum (m - m'). A -inf logit adds
 * nothing to l and k_c * -inf to k_dot, as k_c * log_softmax_c does in
 * PyTorch; a +inf logit makes the row NaN, as it does in PyTorch's
 * log_softmax. NaN propagates. */
static FN(row_summary) FN(row_pass)(const ma_ce_args *a, int64_t x_row, int64_t p_row, int want_k, ACC ls, ACC ls_c) {
    const int64_t C = a->C, cs = a->input_stride[1];
    const ACC NEG_INF = -(ACC)INFINITY, cap = (ACC)a->softcap;
    ACC m = NEG_INF;
    double l = 0, k_sum = 0, k_dot = 0;
    for (int64_t c = 0; c < C; c++) {
        const ACC x = FN(cap_fn)(LOAD(a->input, a->dtype, x_row + c * cs), cap);
        if (x > m) {
            l = l * EXP(m - x) + 1;
            if (want_k && m != NEG_INF) k_dot += k_sum * (m - x);
            m = x;
        } else if (x != NEG_INF) {
            l += EXP(x - m);
        }
        if (want_k) {
            const ACC k = FN(coef)(a, c, p_row, ls, ls_c);
            k_sum += k;
            k_dot += k * (m == NEG_INF ? x : x - m);
        }
    }
    FN(row_summary) st = {m, m == (ACC)INFINITY ? (double)NAN : log(l), k_sum, k_dot};
    return st;
}

/* Does row r go through the blocks? Class targets, class stride 1, a
 * contiguous weight (and, for a gradient, a contiguous gradient row). */
static inline int FN(fast_row)(const ma_ce_args *a, const int64_t *dinput_stride) {
#ifdef ROW_STATS
    return a->target && a->input_stride[1] == 1 && (!a->weight || a->weight_stride == 1) &&
           (!dinput_stride || dinput_stride[1] == 1);
#else
    (void)a, (void)dinput_stride;
    return 0;
#endif
}

/* The statistics of a class-target row, by the blocks when it can. */
static inline FN(row_summary)
    FN(class_row_stats)(const ma_ce_args *a, int64_t x_row, int fast, int want_k, ACC ls, ACC ls_c) {
#ifdef ROW_STATS
    if (fast) {
        const size_t es = FN(elem_size)(a->dtype);
        const ma_ce_stats b =
            ROW_STATS((const char *)a->input + x_row * es, a->weight, a->dtype, a->C, (float)a->softcap, want_k);
        FN(row_summary) st = {b.m, b.m == INFINITY ? (double)NAN : log(b.l), b.k_sum, b.k_dot};
        return st;
    }
#endif
    (void)fast;
    return FN(row_pass)(a, x_row, 0, want_k, ls, ls_c);
}

/* Writes zeros over the row dx[n, :, s] (dx_row = offset of dx[n, 0, s]). */
static inline void FN(zero_row)(void *dx, ma_dtype dt, int64_t dx_row, int64_t dcs, int64_t C) {
    if (dcs == 1) {
        const size_t es = FN(elem_size)(dt);
        if (C > 0) memset((char *)dx + dx_row * es, 0, (size_t)C * es); /* never memset(NULL, 0, 0) */
        return;
    }
    for (int64_t c = 0; c < C; c++) STORE(dx, dt, dx_row + c * dcs, 0);
}

/* The gradient of one kept class-target row (target t), written over dx's
 * row:
 *   dx_c = y'_c (g_soft softmax_c - g_w w_c - g_t [c == t])
 *   g_soft = g ((1 - ls) w_t + ls / C W + 2 z lse),  g_w = g ls / C,  g_t = g (1 - ls) w_t
 * dx may be the input itself: x_t is read before the row is written. */
static inline void FN(class_row_grad)(const ma_ce_args *a, void *dx, const int64_t *ds, int64_t dx_row, int64_t x_row,
                                      int64_t t, int fast, ACC g, ACC lse_r, ACC W) {
    const int64_t C = a->C, cs = a->input_stride[1], dcs = ds[1];
    const ACC ls = (ACC)a->label_smoothing, ls_c = C > 0 ? ls / (ACC)C : 0, cap = (ACC)a->softcap;
    const ACC w_t = FN(class_weight)(a, t);
    const ACC g_soft = g * ((1 - ls) * w_t + ls_c * W + 2 * (ACC)a->z_loss * lse_r);
    const ACC g_t = g * (1 - ls) * w_t, g_w = g * ls_c;
#ifdef ROW_STATS
    if (fast) {
        const size_t es = FN(elem_size)(a->dtype);
        const ACC x_t = LOAD(a->input, a->dtype, x_row + t * cs);
        ROW_GRAD((char *)dx + dx_row * es, (const char *)a->input + x_row * es, a->weight, a->dtype, C, (float)cap,
                 lse_r, g_soft, g_w);
        /* the target's element, from the x_t read before the row was written */
        ACC d = g_soft * EXP(FN(cap_fn)(x_t, cap) - lse_r);
        if (ls > 0) d -= g_w * w_t;
        STORE(dx, a->dtype, dx_row + t, (d - g_t) * FN(cap_grad)(x_t, cap));
        return;
    }
#endif
    (void)fast;
    for (int64_t c = 0; c < C; c++) {
        const ACC x = LOAD(a->input, a->dtype, x_row + c * cs);
        ACC d = g_soft * EXP(FN(cap_fn)(x, cap) - lse_r);
        if (ls > 0) d -= g_w * FN(class_weight)(a, c);
        if (c == t) d -= g_t;
        STORE(dx, a->dtype, dx_row + c * dcs, d * FN(cap_grad)(x, cap));
    }
}

/* ---- forward -------------------------------------------------------------
 *
 *   1. lse   = log sum_c exp y_c                                  (row stats)
 *   2. class target t, kept row:
 *        loss = (1 - ls) w_t (lse - y_t) + ls / C sum_c w_c (lse - y_c) + z lse^2
 *      probabilities:
 *        loss = sum_c k_c (lse - y_c) + z lse^2,  k_c = w_c p'_c
 *   with sum_c k_c (lse - y_c) = k_sum log_l - k_dot.
 *   3. (fused, dinput set) the gradient of the row, as the backward writes it,
 *      with g = dloss_scale.
 */
static void FN(ce_fwd)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_ce_fwd_params *p = (const ma_ce_fwd_params *)ctx->params;
    const ma_ce_args *a = &p->a;
    const int64_t C = a->C, S = a->S;
    const int64_t *xs = a->input_stride, *ts = a->target_stride, *ds = p->dinput_stride;
    const ACC ls = (ACC)a->label_smoothing, ls_c = C > 0 ? ls / (ACC)C : 0, cap = (ACC)a->softcap;
    const double z = a->z_loss;
    const int fused = p->dinput != NULL && a->target != NULL;
    const int fast = FN(fast_row)(a, fused ? ds : NULL);
    const ACC W = fused && ls > 0 ? (ACC)FN(weight_sum)(a) : 0;
    ACC *lse = (ACC *)p->lse;

    for (int64_t r = begin; r < end; r++) {
        const int64_t n = r / S, s = r - n * S;
        const int64_t x_row = n * xs[0] + s * xs[2];
        double loss, lse_d;
        if (a->target) {
            const int64_t t = a->target[n * ts[0] + s * ts[1]];
            if (t == a->ignore_index) { /* skipped, not computed */
                STORE(p->loss, p->loss_dtype, r, 0);
                lse[r] = 0;
                if (fused) FN(zero_row)(p->dinput, a->dtype, n * ds[0] + s * ds[2], ds[1], C);
                continue;
            }
            const FN(row_summary) st = FN(class_row_stats)(a, x_row, fast, ls > 0, ls, ls_c);
            lse_d = st.m + st.log_l;
            lse[r] = (ACC)lse_d;
            /* lse - y_t as (m - y_t) + log_l: no rounding of a large lse */
            const ACC y_t = FN(cap_fn)(LOAD(a->input, a->dtype, x_row + t * xs[1]), cap);
            loss = FN(class_weight)(a, t) * ((double)(st.m - y_t) + st.log_l);
            if (ls > 0) loss = (1 - ls) * loss + ls_c * (st.k_sum * st.log_l - st.k_dot);
            if (z > 0) loss += z * lse_d * lse_d;
            if (fused)
                FN(class_row_grad)(a, p->dinput, ds, n * ds[0] + s * ds[2], x_row, t, fast, (ACC)p->dloss_scale, lse[r],
                                   W);
        } else {
            const FN(row_summary) st = FN(row_pass)(a, x_row, n * ts[0] + s * ts[2], 1, ls, ls_c);
            lse_d = st.m + st.log_l;
            lse[r] = (ACC)lse_d;
            loss = C > 0 ? st.k_sum * st.log_l - st.k_dot : 0; /* no class: an empty sum */
            if (C > 0 && z > 0) loss += z * lse_d * lse_d;
        }
        STORE(p->loss, p->loss_dtype, r, (ACC)loss);
    }
}

/* ---- backward ------------------------------------------------------------
 *
 * Forward lines, differentiated in reverse (g = dloss[n, s] * dloss_scale,
 * softmax_c = exp(y_c - lse)):
 *   2. loss = (1 - ls) w_t (lse - y_t) + ls / C sum_c w_c (lse - y_c) + z lse^2
 *        dy_c = g ((1 - ls) w_t + ls / C W + 2 z lse) softmax_c - g (1 - ls) w_t [c == t] - g ls / C w_c
 *      loss = sum_c k_c (lse - y_c) + z lse^2
 *        dy_c = g ((k_sum + 2 z lse) softmax_c - k_c)
 *        dp_c = g (1 - ls) w_c (lse - y_c)           (d k_c / d p_c = (1 - ls) w_c)
 *   1. lse = log sum_c exp y_c
 *        d lse / d y_c = softmax_c
 *   0. y_c = cap tanh(x_c / cap)
 *        dx_c = dy_c (1 - tanh(x_c / cap)^2)
 * Every element of dinput (and dtarget) is written, ignored rows with zeros.
 */
static void FN(ce_bwd)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_ce_bwd_params *p = (const ma_ce_bwd_params *)ctx->params;
    const ma_ce_args *a = &p->a;
    const int64_t C = a->C, S = a->S;
    const int64_t *xs = a->input_stride, *ts = a->target_stride;
    const int64_t *ds = p->dinput_stride, *dts = p->dtarget_stride, *gs = p->dloss_stride;
    const ACC ls = (ACC)a->label_smoothing, ls_c = C > 0 ? ls / (ACC)C : 0, cap = (ACC)a->softcap;
    const ACC z2 = 2 * (ACC)a->z_loss;
    const ACC W = a->target && ls > 0 ? (ACC)FN(weight_sum)(a) : 0;
    const int fast = FN(fast_row)(a, ds);
    const ACC *lse = (const ACC *)p->lse;

    for (int64_t r = begin; r < end; r++) {
        const int64_t n = r / S, s = r - n * S;
        const int64_t x_row = n * xs[0] + s * xs[2], dx_row = n * ds[0] + s * ds[2];
        const int64_t t = a->target ? a->target[n * ts[0] + s * ts[1]] : 0;
        if (a->target && t == a->ignore_index) { /* skipped, not computed */
            FN(zero_row)(p->dinput, a->dtype, dx_row, ds[1], C);
            continue;
        }
        const ACC g = (ACC)((double)LOAD(p->dloss, a->dtype, n * gs[0] + s * gs[1]) * p->dloss_scale);
        const ACC lse_r = lse[r];
        if (a->target) {
            FN(class_row_grad)(a, p->dinput, ds, dx_row, x_row, t, fast, g, lse_r, W);
        } else {
            const int64_t p_row = n * ts[0] + s * ts[2], dp_row = n * dts[0] + s * dts[2];
            double k_sum_d = 0;
            for (int64_t c = 0; c < C; c++) k_sum_d += FN(coef)(a, c, p_row, ls, ls_c);
            const ACC g_soft = g * ((ACC)k_sum_d + z2 * lse_r);
            for (int64_t c = 0; c < C; c++) {
                const ACC x = LOAD(a->input, a->dtype, x_row + c * xs[1]), y = FN(cap_fn)(x, cap);
                const ACC k = FN(coef)(a, c, p_row, ls, ls_c);
                if (p->dtarget)
                    STORE(p->dtarget, a->dtype, dp_row + c * dts[1],
                          g * (1 - ls) * FN(class_weight)(a, c) * (lse_r - y));
                STORE(p->dinput, a->dtype, dx_row + c * ds[1],
                      (g_soft * EXP(y - lse_r) - g * k) * FN(cap_grad)(x, cap));
            }
        }
    }
}

#undef ACC
#undef LOAD
#undef STORE
#undef EXP
#undef TANH
#undef ROW_STATS
#undef ROW_GRAD
#undef FN
#undef BLK
#undef MA_ACC_F64
