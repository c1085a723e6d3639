/* attention_isa.h -- the SIMD instances of attention_tmpl.h, each defined in
 * its own translation unit (attention_<isa>.c) compiled with that
 * instruction set's flags. Private to the kernels; attention.c dispatches. */
#ifndef MA_ATTENTION_ISA_H
#define MA_ATTENTION_ISA_H

#include <stdint.h>

void ma_attn_fwd_avx2(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_dq_avx2(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_dkdv_avx2(int64_t begin, int64_t end, void *ctx);

void ma_attn_fwd_avx512(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_dq_avx512(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_dkdv_avx512(int64_t begin, int64_t end, void *ctx);

#endif
