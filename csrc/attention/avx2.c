/* avx2.c -- the attention kernels on AVX2 + FMA: attention_tmpl.h's loops over the
 * blocks of blocks_simd.h on common/simd_avx2.h. Compiled with -mavx2 -mfma -mf16c
 * (setup.py); dispatch.c calls it only where the CPU has them (common/isa.c). */
#include "common/simd_avx2.h"

#define BLK(name) name##_avx2
#include "blocks_simd.h"
#define FN(name) name##_avx2
#include "attention_tmpl.h"

const ma_blocks ma_blocks_avx2 = {
    "avx2",           gemm_avx2,        exp_sub_sum_avx2,  col_max_avx2,       exp_sub_col_avx2,
    transpose_avx2,   row_max_avx2,     axpy_keys_avx2,    gemm_rowscale_avx2, dropout_avx2,
    softcap_avx2,     dot_keys_t_avx2,  quantize_row_avx2, dot_rows_avx2,      MA_DR_W,
    dot_rows_i8_avx2, axpy_keys_i8_avx2};
const ma_attn_kernels ma_attn_kernels_avx2 = {attn_fwd_avx2,        attn_bwd_delta_avx2,    attn_bwd_fused_avx2,
                                              attn_bwd_reduce_avx2, fwd_scratch_bytes_avx2, bwd_scratch_bytes_avx2,
                                              attn_decode_avx2,     attn_decode_merge_avx2, decode_scratch_bytes_avx2};
