/* avx512.c -- the attention kernels on AVX-512: attention_tmpl.h's loops over the
 * blocks of blocks_simd.h on common/simd_avx512.h. Compiled with -mavx512f/bw/dq/vl
 * (setup.py); dispatch.c calls it only where the CPU has them (common/isa.c). */
#include "common/simd_avx512.h"

#define BLK(name) name##_avx512
#include "blocks_simd.h"
#define FN(name) name##_avx512
#include "attention_tmpl.h"

const ma_blocks ma_blocks_avx512 = {
    "avx512",           gemm_avx512,        exp_sub_sum_avx512,  col_max_avx512,       exp_sub_col_avx512,
    transpose_avx512,   row_max_avx512,     axpy_keys_avx512,    gemm_rowscale_avx512, dropout_avx512,
    softcap_avx512,     dot_keys_t_avx512,  quantize_row_avx512, dot_rows_avx512,      MA_DR_W,
    dot_rows_i8_avx512, axpy_keys_i8_avx512};
const ma_attn_kernels ma_attn_kernels_avx512 = {
    attn_fwd_avx512,        attn_bwd_delta_avx512,    attn_bwd_fused_avx512,
    attn_bwd_reduce_avx512, fwd_scratch_bytes_avx512, bwd_scratch_bytes_avx512,
    attn_decode_avx512,     attn_decode_merge_avx512, decode_scratch_bytes_avx512};
