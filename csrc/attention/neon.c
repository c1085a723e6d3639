/* neon.c -- the attention kernels on AArch64's Advanced SIMD: attention_tmpl.h's loops
 * over the blocks of blocks_simd.h on common/simd_neon.h. Every aarch64 CPU has NEON,
 * so it needs no flags (setup.py) and is the baseline there (common/isa.c). */
#include "common/simd_neon.h"

#define BLK(name) name##_neon
#include "blocks_simd.h"
#define FN(name) name##_neon
#include "attention_tmpl.h"

const ma_blocks ma_blocks_neon = {
    "neon",           gemm_neon,        exp_sub_sum_neon,  col_max_neon,       exp_sub_col_neon,
    transpose_neon,   row_max_neon,     axpy_keys_neon,    gemm_rowscale_neon, dropout_neon,
    softcap_neon,     dot_keys_t_neon,  quantize_row_neon, dot_rows_neon,      MA_DR_W,
    dot_rows_i8_neon, axpy_keys_i8_neon};
const ma_attn_kernels ma_attn_kernels_neon = {attn_fwd_neon,        attn_bwd_delta_neon,    attn_bwd_fused_neon,
                                              attn_bwd_reduce_neon, fwd_scratch_bytes_neon, bwd_scratch_bytes_neon,
                                              attn_decode_neon,     attn_decode_merge_neon, decode_scratch_bytes_neon};
