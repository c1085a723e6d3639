/* sve256.c -- the attention kernels on SVE with 256-bit vectors: attention_tmpl.h's loops
 * over the blocks of blocks_simd.h on common/simd_sve.h. Compiled with
 * -march=armv8.2-a+sve -msve-vector-bits=256 (setup.py); dispatch.c calls it only where
 * the CPU's SVE vectors are 256 bits (common/isa.c). */
#include "common/simd_sve.h"

#define BLK(name) name##_sve256
#include "blocks_simd.h"
#define FN(name) name##_sve256
#include "attention_tmpl.h"

const ma_blocks ma_blocks_sve256 = {"sve256",           gemm_sve256,          exp_sub_sum_sve256, col_max_sve256,
                                    exp_sub_col_sve256, transpose_sve256,     row_max_sve256,     dot_keys_sve256,
                                    axpy_keys_sve256,   gemm_rowscale_sve256, dropout_sve256,     softcap_sve256,
                                    dot_keys_t_sve256,  quantize_row_sve256};
const ma_attn_kernels ma_attn_kernels_sve256 = {
    attn_fwd_sve256,        attn_bwd_dq_sve256,       attn_bwd_dkdv_sve256,    attn_bwd_fused_sve256,
    attn_bwd_reduce_sve256, fwd_scratch_bytes_sve256, bwd_scratch_bytes_sve256};
