/*
 * cross_entropy_tmpl.h -- cross-entropy forward and backward, written once
 * over the accumulation type. cross_entropy.c includes it twice:
 *   ACC = float  (float32, bfloat16, float16 inputs: float32 accumulation)
 *   ACC = double (float64 inputs, for gradcheck)
 * with FN(x) giving each instance its suffix, LOAD/STORE the element access
 * of that precision, EXP the libm exp. Per-element arithmetic is in
 * ACC; the sums over a row's C classes (sum of exponentials, the smoothing and
 * probability terms) are kept in double in both instances, so a 32k-class
 * vocabulary loses nothing to a long float32 running sum.
 *
 * Shapes: N, C, S, R as in masked_attn.h. Row r = n * S + s is x[n, :, s],
 * read in place with the class stride: an (N, C, d1, ..., dk) input is never
 * transposed or copied.
 *
 * The forward reads each row once: max, sum of exponentials (online, as in
 * flash attention) and the linear term sum_c k_c x_c of label smoothing or
 * probability targets. The backward writes each row once from the saved lse.
 * A row whose target is ignore_index costs one compare in the forward and a
 * row of zeros in the backward.
 */

/* ---- row building blocks ------------------------------------------------ */

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

/* k_c, the coefficient of (lse - x_c) in the row's loss:
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
    ACC m;         /* max_c x_c                                    */
    double log_l;  /* log sum_c exp(x_c - m); lse = m + log_l       */
    double k_sum;  /* sum_c k_c                 (when want_k)       */
    double k_dot;  /* sum_c k_c (x_c - m)       (when want_k)       */
} FN(row_stats);

/* One read of the row x[n, :, s] (x_row = offset of x[n, 0, s]), online.
 * k_dot is kept relative to the running max: when the max grows from m to m',
 * the terms so far shift by k_sum (m - m'). A -inf logit adds nothing to l and
 * k_c * -inf to k_dot, as k_c * log_softmax_c does in PyTorch; a +inf logit
 * makes the row NaN, as it does in PyTorch's log_softmax. NaN propagates. */
static FN(row_stats) FN(row_pass)(const ma_ce_args *a, int64_t x_row, int64_t p_row, int want_k,
                                  ACC ls, ACC ls_c) {
    const int64_t C = a->C, cs = a->input_stride[1];
    const ACC NEG_INF = -(ACC)INFINITY;
    ACC m = NEG_INF;
    double l = 0, k_sum = 0, k_dot = 0;
    for (int64_t c = 0; c < C; c++) {
        const ACC x = LOAD(a->input, a->dtype, x_row + c * cs);
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
    FN(row_stats) st = {m, m == (ACC)INFINITY ? (double)NAN : log(l), k_sum, k_dot};
    return st;
}

/* ---- forward -------------------------------------------------------------
 *
 *   1. lse   = log sum_c exp x_c                                  (row_pass)
 *   2. class target t, kept row:
 *        loss = (1 - ls) w_t (lse - x_t) + ls / C sum_c w_c (lse - x_c)
 *      probabilities:
 *        loss = sum_c k_c (lse - x_c),  k_c = w_c p'_c
 *   with sum_c k_c (lse - x_c) = k_sum log_l - k_dot.
 */
static void FN(ce_fwd)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_ce_fwd_params *p = (const ma_ce_fwd_params *)ctx->params;
    const ma_ce_args *a = &p->a;
    const int64_t C = a->C, S = a->S;
    const int64_t *xs = a->input_stride, *ts = a->target_stride;
    const ACC ls = (ACC)a->label_smoothing, ls_c = C > 0 ? ls / (ACC)C : 0;
    ACC *lse = (ACC *)p->lse;

    for (int64_t r = begin; r < end; r++) {
        const int64_t n = r / S, s = r - n * S;
        const int64_t x_row = n * xs[0] + s * xs[2];
        double loss;
        if (a->target) {
            const int64_t t = a->target[n * ts[0] + s * ts[1]];
            if (t == a->ignore_index) { /* skipped, not computed */
                STORE(p->loss, p->loss_dtype, r, 0);
                lse[r] = 0;
                continue;
            }
            const FN(row_stats) st = FN(row_pass)(a, x_row, 0, ls > 0, ls, ls_c);
            lse[r] = (ACC)(st.m + st.log_l);
            /* lse - x_t as (m - x_t) + log_l: no rounding of a large lse */
            loss = FN(class_weight)(a, t) * ((double)(st.m - LOAD(a->input, a->dtype, x_row + t * xs[1])) + st.log_l);
            if (ls > 0) loss = (1 - ls) * loss + ls_c * (st.k_sum * st.log_l - st.k_dot);
        } else {
            const FN(row_stats) st = FN(row_pass)(a, x_row, n * ts[0] + s * ts[2], 1, ls, ls_c);
            lse[r] = (ACC)(st.m + st.log_l);
            loss = C > 0 ? st.k_sum * st.log_l - st.k_dot : 0; /* no class: an empty sum */
        }
        STORE(p->loss, p->loss_dtype, r, (ACC)loss);
    }
}

/* ---- backward ------------------------------------------------------------
 *
 * Forward lines, differentiated in reverse (g = dloss[n, s] * dloss_scale,
 * softmax_c = exp(x_c - lse)):
 *   2. loss = (1 - ls) w_t (lse - x_t) + ls / C sum_c w_c (lse - x_c)
 *        dx_c = g ((1 - ls) w_t + ls / C W) softmax_c - g (1 - ls) w_t [c == t] - g ls / C w_c
 *      loss = sum_c k_c (lse - x_c)
 *        dx_c = g (k_sum softmax_c - k_c)
 *        dp_c = g (1 - ls) w_c (lse - x_c)           (d k_c / d p_c = (1 - ls) w_c)
 *   1. lse = log sum_c exp x_c
 *        d lse / d x_c = softmax_c
 * Every element of dinput (and dtarget) is written, ignored rows with zeros.
 */
static void FN(ce_bwd)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_ce_bwd_params *p = (const ma_ce_bwd_params *)ctx->params;
    const ma_ce_args *a = &p->a;
    const int64_t C = a->C, S = a->S;
    const int64_t *xs = a->input_stride, *ts = a->target_stride;
    const int64_t *ds = p->dinput_stride, *dts = p->dtarget_stride, *gs = p->dloss_stride;
    const ACC ls = (ACC)a->label_smoothing, ls_c = C > 0 ? ls / (ACC)C : 0;
    const ACC W = a->target && ls > 0 ? (ACC)FN(weight_sum)(a) : 0;
    const ACC *lse = (const ACC *)p->lse;

    for (int64_t r = begin; r < end; r++) {
        const int64_t n = r / S, s = r - n * S;
        const int64_t x_row = n * xs[0] + s * xs[2], dx_row = n * ds[0] + s * ds[2];
        const int64_t t = a->target ? a->target[n * ts[0] + s * ts[1]] : 0;
        if (a->target && t == a->ignore_index) { /* skipped, not computed */
            for (int64_t c = 0; c < C; c++) STORE(p->dinput, a->dtype, dx_row + c * ds[1], 0);
            continue;
        }
        const ACC g = (ACC)((double)LOAD(p->dloss, a->dtype, n * gs[0] + s * gs[1]) * p->dloss_scale);
        const ACC lse_r = lse[r];
        if (a->target) {
            const ACC w_t = FN(class_weight)(a, t);
            const ACC g_soft = g * ((1 - ls) * w_t + ls_c * W), g_t = g * (1 - ls) * w_t, g_c = g * ls_c;
            for (int64_t c = 0; c < C; c++) {
                ACC d = g_soft * EXP(LOAD(a->input, a->dtype, x_row + c * xs[1]) - lse_r);
                if (ls > 0) d -= g_c * FN(class_weight)(a, c);
                if (c == t) d -= g_t;
                STORE(p->dinput, a->dtype, dx_row + c * ds[1], d);
            }
        } else {
            const int64_t p_row = n * ts[0] + s * ts[2], dp_row = n * dts[0] + s * dts[2];
            double k_sum_d = 0;
            for (int64_t c = 0; c < C; c++) k_sum_d += FN(coef)(a, c, p_row, ls, ls_c);
            const ACC k_sum = (ACC)k_sum_d;
            for (int64_t c = 0; c < C; c++) {
                const ACC x = LOAD(a->input, a->dtype, x_row + c * xs[1]);
                const ACC k = FN(coef)(a, c, p_row, ls, ls_c);
                STORE(p->dinput, a->dtype, dx_row + c * ds[1], g * (k_sum * EXP(x - lse_r) - k));
                if (p->dtarget)
                    STORE(p->dtarget, a->dtype, dp_row + c * dts[1],
                          g * (1 - ls) * FN(class_weight)(a, c) * (lse_r - x));
            }
        }
    }
}
