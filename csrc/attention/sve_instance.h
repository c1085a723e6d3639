/* sve_instance.h -- the attention kernels on SVE at the length the including unit is
 * compiled for (sve128.c ... sve2048.c; setup.py: -march=armv8.2-a+sve -msve-vector-bits=N):
 * attention_tmpl.h's loops over the blocks of blocks_simd.h on common/simd_sve.h, named
 * *_sveN. dispatch.c calls the instance of the CPU's length (common/isa.c, ma_sve_bits). */
#ifndef MA_ATTENTION_SVE_INSTANCE_H
#define MA_ATTENTION_SVE_INSTANCE_H

#include "common/simd_sve.h"

#define BLK(name) MA_SVE_NAME(name)
#include "blocks_simd.h"
#define FN(name) MA_SVE_NAME(name)
#include "attention_tmpl.h" /* #undefs BLK and FN */

#define S(name) MA_SVE_NAME(name)
const ma_blocks S(ma_blocks) = {MA_SVE_LABEL,   S(gemm),        S(exp_sub_sum),  S(col_max),       S(exp_sub_col),
                                S(transpose),   S(row_max),     S(axpy_keys),    S(gemm_rowscale), S(dropout),
                                S(softcap),     S(dot_keys_t),  S(quantize_row), S(dot_rows),      MA_DR_W,
                                S(dot_rows_i8), S(axpy_keys_i8)};
const ma_attn_kernels S(ma_attn_kernels) = {S(attn_fwd),        S(attn_bwd_delta),    S(attn_bwd_fused),
                                            S(attn_bwd_reduce), S(fwd_scratch_bytes), S(bwd_scratch_bytes),
                                            S(attn_decode),     S(attn_decode_merge), S(decode_scratch_bytes)};
#undef S

#endif /* MA_ATTENTION_SVE_INSTANCE_H */
