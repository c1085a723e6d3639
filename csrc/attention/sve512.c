/* sve512.c -- the attention kernels on SVE with 512-bit vectors: attention_tmpl.h's loops
 * over the blocks of blocks_simd.h on common/simd_sve.h. Compiled with
 * -march=armv8.2-a+sve -msve-vector-bits=512 (setup.py); dispatch.c calls it only where
 * the CPU's SVE vectors are 512 bits (common/isa.c). */
#include "common/simd_sve.h"

#define BLK(name) name##_sve512
#include "blocks_simd.h"
#define FN(name) name##_sve512
#include "attention_tmpl.h"

const ma_blocks ma_blocks_sve512 = {"sve512",           gemm_sve512,          exp_sub_sum_sve512, col_max_sve512,
                                    exp_sub_col_sve512, transpose_sve512,     row_max_sve512,     dot_keys_sve512,
                                    axpy_keys_sve512,   gemm_rowscale_sve512, dropout_sve512,     softcap_sve512,
                                    dot_keys_t_sve512,  quantize_row_sve512};
const ma_attn_kernels ma_attn_kernels_sve512 = {
    attn_fwd_sve512,        attn_bwd_dq_sve512,       attn_bwd_dkdv_sve512,    attn_bwd_fused_sve512,
    attn_bwd_reduce_sve512, fwd_scratch_bytes_sve512, bwd_scratch_bytes_sve512};
