/* dispatch.c -- the public cross-entropy task functions (masked_attn.h): the
 * one switch from (dtype, instruction set) to an instance of
 * cross_entropy_tmpl.h, and the serial reductions the shim finishes with. */
#include "blocks.h"
#include "common/dtype.h"
#include "common/isa.h"
#include "masked_attn.h"

/* float64 runs the double instance; there are no AMX, AVX512-BF16 or SVE-BF16
 * kernels for cross-entropy (no matrix products), so those run their fallbacks',
 * AVX-512's and NEON's (ma_isa_runs over the row kernels). One case per row of
 * MA_ISA_TABLE with row kernels of its own, compiled in here. */
static const ma_ce_kernels *kernels(const ma_ce_args *a) {
    if (a->dtype == MA_F64) return &ma_ce_kernels_f64;
    switch (ma_isa_runs(a->isa, a->dtype, 1)) {
#define CASE(ID, name, abi, arch, bq, bk, fb, own, inst, usable) \
    MA_ON_##arch(MA_ROWS_##own(case MA_ISA_##ID : return MA_TABLE_##inst(ma_ce_kernels, name);))
        MA_ISA_TABLE(CASE)
#undef CASE
    default: return &ma_ce_kernels_scalar;
    }
}

void ma_ce_fwd_task(int64_t begin, int64_t end, void *ctx) {
    kernels(&((const ma_ce_fwd_params *)((const ma_task_ctx *)ctx)->params)->a)->fwd(begin, end, ctx);
}

void ma_ce_bwd_task(int64_t begin, int64_t end, void *ctx) {
    kernels(&((const ma_ce_bwd_params *)((const ma_task_ctx *)ctx)->params)->a)->bwd(begin, end, ctx);
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
