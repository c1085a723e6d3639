/* scalar.c -- the attention kernels (attention_tmpl.h) on the scalar
 * building blocks (blocks_scalar.h): the float reference every SIMD variant
 * is tested against, and the float64 instance (double accumulation), which
 * float64 inputs always run. */
#include <math.h>

#include "blocks.h"
#include "common/dtype.h"
#include "masked_attn.h"

#define T float
#define X scalar
#define EXP expf
#define TANHT tanhf
#define LOADT ma_load_f32
#include "blocks_scalar.h"
#undef T
#undef X
#undef EXP
#undef TANHT
#undef LOADT

#define T double
#define X f64
#define EXP exp
#define TANHT tanh
#define LOADT ma_load_f64
#include "blocks_scalar.h"
#undef T
#undef X
#undef EXP
#undef TANHT
#undef LOADT

#define FN(name) name##_scalar
#define BLK(name) name##_scalar
#include "attention_tmpl.h"

const ma_blocks ma_blocks_scalar = {
    "scalar",           gemm_scalar,        exp_sub_sum_scalar,  col_max_scalar,       exp_sub_col_scalar,
    transpose_scalar,   row_max_scalar,     axpy_keys_scalar,    gemm_rowscale_scalar, dropout_scalar,
    softcap_scalar,     dot_keys_t_scalar,  quantize_row_scalar, dot_rows_scalar,      16,
    dot_rows_i8_scalar, axpy_keys_i8_scalar};
const ma_attn_kernels ma_attn_kernels_scalar = {
    attn_fwd_scalar,        attn_bwd_delta_scalar,    attn_bwd_fused_scalar,
    attn_bwd_reduce_scalar, fwd_scratch_bytes_scalar, bwd_scratch_bytes_scalar,
    attn_decode_scalar,     attn_decode_merge_scalar, decode_scratch_bytes_scalar};

#define MA_ACC_F64
#define FN(name) name##_f64
#define BLK(name) name##_f64
#include "attention_tmpl.h"

const ma_attn_kernels ma_attn_kernels_f64 = {attn_fwd_f64,        attn_bwd_delta_f64,    attn_bwd_fused_f64,
                                             attn_bwd_reduce_f64, fwd_scratch_bytes_f64, bwd_scratch_bytes_f64,
                                             attn_decode_f64,     attn_decode_merge_f64, decode_scratch_bytes_f64};
