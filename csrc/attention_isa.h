/* attention_isa.h -- the SIMD instances of attention_tmpl.h, each defined in
 * its own translation unit (attention_<isa>.c) compiled with that
 * instruction set's flags. Private to the kernels; attention.c dispatches. */
#ifndef MA_ATTENTION_ISA_H
#define MA_ATTENTION_ISA_H

#include <stddef.h>
#include <stdint.h>

#include "masked_attn.h"

/* The float building blocks of one instruction set (see attention_tmpl.h),
 * exported so that the C harness (tests/c/test_blocks.c) can check every
 * variant against the scalar reference directly. */
typedef struct {
    const char *name;
    void (*gemm)(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs,
                 const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate);
    float (*exp_sub_sum)(float *x, int64_t n, float m);
    void (*col_max)(const float *x, int64_t rows, int64_t n, float *m);
    void (*exp_sub_col)(float *x, int64_t rows, int64_t n, const float *m, float *sum);
    void (*transpose)(float *dst, const float *src, int64_t lds, int64_t nr, int64_t ncol, float mul);
    /* a few query rows against key / value rows read in place in their own
     * dtype (float32, bfloat16, float16; unit column stride), row c at
     * src[off + c * ld], and the row max of their scores: the forward of a
     * short query block (decoding) */
    float (*row_max)(const float *x, int64_t n, float m);
    void (*dot_keys)(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                     int64_t off, int64_t ld, int64_t nc);
    void (*axpy_keys)(float *o, const float *p, int64_t ldp, int64_t nr, int64_t Dv, const void *v, ma_dtype dt,
                      int64_t off, int64_t ld, int64_t nc);
    /* C = diag(rs) C + A B (rs NULL: C + A B): the forward's O = alpha O + P V */
    void (*gemm_rowscale)(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs,
                          const float *B, int64_t ldb, float *C, int64_t ldc, const float *rs);
} ma_blocks;

extern const ma_blocks ma_blocks_scalar, ma_blocks_avx2, ma_blocks_avx512;
extern const ma_blocks ma_blocks_amx2, ma_blocks_amx3; /* GEMM only: 3 and 6 bf16 products */

void ma_attn_fwd_avx2(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_dq_avx2(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_dkdv_avx2(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_fused_avx2(int64_t begin, int64_t end, void *ctx);

void ma_attn_fwd_avx512(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_dq_avx512(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_dkdv_avx512(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_fused_avx512(int64_t begin, int64_t end, void *ctx);

void ma_attn_fwd_amx(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_dq_amx(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_dkdv_amx(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_fused_amx(int64_t begin, int64_t end, void *ctx);
size_t ma_attn_fwd_scratch_bytes_amx(const ma_attn_fwd_params *p);
size_t ma_attn_bwd_fused_scratch_bytes_amx(const ma_attn_bwd_params *p);

#endif
