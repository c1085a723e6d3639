/*
 * attention.c -- masked multi-head attention, forward and backward.
 *
 * The kernels are written once in attention_tmpl.h and instantiated here for
 * float accumulation (float32, bfloat16, float16 inputs) and double
 * accumulation (float64 inputs). The public task functions below are the one
 * place where the variant is chosen.
 */
#include <math.h>

#include "dtype.h"
#include "masked_attn.h"

#define ACC float
#define FN(name) name##_f32
#define LOAD ma_load_f32
#define STORE ma_store_f32
#define EXP expf
#define LOG logf
#include "attention_tmpl.h"
#undef ACC
#undef FN
#undef LOAD
#undef STORE
#undef EXP
#undef LOG

#define ACC double
#define FN(name) name##_f64
#define LOAD ma_load_f64
#define STORE ma_store_f64
#define EXP exp
#define LOG log
#include "attention_tmpl.h"
#undef ACC
#undef FN
#undef LOAD
#undef STORE
#undef EXP
#undef LOG

int64_t ma_attn_fwd_work_items(const ma_attn_fwd_params *p) {
    return p->B * p->H * ma_cdiv(p->Lq, p->block_q);
}

size_t ma_attn_fwd_scratch_bytes(const ma_attn_fwd_params *p) {
    const size_t n = p->dtype == MA_F64
                         ? fwd_scratch_elems_f64(p->block_q, p->block_k, p->D, p->Dv) * sizeof(double)
                         : fwd_scratch_elems_f32(p->block_q, p->block_k, p->D, p->Dv) * sizeof(float);
    return ma_round_up(n, MA_CACHE_LINE);
}

void ma_attn_fwd_task(int64_t begin, int64_t end, void *ctx) {
    const ma_attn_fwd_params *p = (const ma_attn_fwd_params *)((const ma_task_ctx *)ctx)->params;
    if (p->dtype == MA_F64) attn_fwd_f64(begin, end, ctx);
    else attn_fwd_f32(begin, end, ctx);
}

int64_t ma_attn_bwd_dq_work_items(const ma_attn_bwd_params *p) {
    return p->B * p->H * ma_cdiv(p->Lq, p->block_q);
}

int64_t ma_attn_bwd_dkdv_work_items(const ma_attn_bwd_params *p) {
    return p->B * p->Hkv * ma_cdiv(p->Lk, p->block_k);
}

size_t ma_attn_bwd_scratch_bytes(const ma_attn_bwd_params *p) {
    const size_t n = p->dtype == MA_F64
                         ? bwd_scratch_elems_f64(p->block_q, p->block_k, p->D, p->Dv) * sizeof(double)
                         : bwd_scratch_elems_f32(p->block_q, p->block_k, p->D, p->Dv) * sizeof(float);
    return ma_round_up(n, MA_CACHE_LINE);
}

void ma_attn_bwd_dq_task(int64_t begin, int64_t end, void *ctx) {
    const ma_attn_bwd_params *p = (const ma_attn_bwd_params *)((const ma_task_ctx *)ctx)->params;
    if (p->dtype == MA_F64) attn_bwd_dq_f64(begin, end, ctx);
    else attn_bwd_dq_f32(begin, end, ctx);
}

void ma_attn_bwd_dkdv_task(int64_t begin, int64_t end, void *ctx) {
    const ma_attn_bwd_params *p = (const ma_attn_bwd_params *)((const ma_task_ctx *)ctx)->params;
    if (p->dtype == MA_F64) attn_bwd_dkdv_f64(begin, end, ctx);
    else attn_bwd_dkdv_f32(begin, end, ctx);
}
