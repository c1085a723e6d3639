/* head_grads.c -- the backward's per-head reductions that follow its passes
 * (masked_attn.h): the sinks' gradient, from the saved lse and the delta the
 * passes wrote. Serial and in a fixed order (entries, then rows): the same
 * bits for any thread count. */
#include <math.h>

#include "common/dtype.h"
#include "masked_attn.h"

/* Row i of head h of lse or delta (acc type: double for MA_F64, float else). */
static double stat_at(const void *x, ma_dtype dt, int64_t off) {
    return dt == MA_F64 ? ((const double *)x)[off] : (double)((const float *)x)[off];
}

void ma_attn_bwd_sinks_grad(const ma_attn_bwd_params *p, double *dsinks) {
    const ma_attn_args *a = &p->a;
    const ma_mask *sk = &a->opts.sinks;
    /* varlen: one run of rows per head, every entry's rows in order */
    const int64_t nb = a->cu_q ? 1 : a->B, rows = a->cu_q ? a->cu_q[a->B] : a->Lq;
    for (int64_t h = 0; h < a->H; h++) {
        const double sink = ma_load_f64(sk->ptr, sk->dtype, h * sk->stride[0]);
        double sum = 0;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t row0 = b * a->stat_stride[0] + h * a->stat_stride[1];
            for (int64_t i = 0; i < rows; i++) {
                const double lse = stat_at(p->lse, a->dtype, row0 + i);
                if (lse != -INFINITY) sum += exp(sink - lse) * stat_at(p->delta, a->dtype, row0 + i);
            }
        }
        dsinks[h] = -sum;
    }
}
