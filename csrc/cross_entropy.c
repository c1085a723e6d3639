/*
 * cross_entropy.c -- cross-entropy with class-index or probability targets,
 * ignore_index, class weights and label smoothing; forward and backward.
 *
 * The kernels are written once in cross_entropy_tmpl.h and instantiated here
 * for float accumulation (float32, bfloat16, float16 inputs) and double
 * accumulation (float64 inputs). The public task functions below are the one
 * place where the variant is chosen. Scalar reference; SIMD variants come later
 * and are tested against it.
 */
#include <math.h>

#include "dtype.h"
#include "masked_attn.h"

#define ACC float
#define FN(name) name##_f32
#define LOAD ma_load_f32
#define STORE ma_store_f32
#define EXP expf
#include "cross_entropy_tmpl.h"
#undef ACC
#undef FN
#undef LOAD
#undef STORE
#undef EXP

#define ACC double
#define FN(name) name##_f64
#define LOAD ma_load_f64
#define STORE ma_store_f64
#define EXP exp
#include "cross_entropy_tmpl.h"
#undef ACC
#undef FN
#undef LOAD
#undef STORE
#undef EXP

void ma_ce_fwd_task(int64_t begin, int64_t end, void *ctx) {
    const ma_ce_fwd_params *p = (const ma_ce_fwd_params *)((const ma_task_ctx *)ctx)->params;
    if (p->a.dtype == MA_F64) ce_fwd_f64(begin, end, ctx);
    else ce_fwd_f32(begin, end, ctx);
}

void ma_ce_bwd_task(int64_t begin, int64_t end, void *ctx) {
    const ma_ce_bwd_params *p = (const ma_ce_bwd_params *)((const ma_task_ctx *)ctx)->params;
    if (p->a.dtype == MA_F64) ce_bwd_f64(begin, end, ctx);
    else ce_bwd_f32(begin, end, ctx);
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
