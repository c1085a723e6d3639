/* cache_write.c -- new key / value rows written into a paged KV cache
 * (masked_attn.h, "KV cache write"), and the 8-bit cache's quantizing
 * ("8-bit KV cache: quantizing"). A copy has no arithmetic, so one scalar
 * instance serves every instruction set; runs that are contiguous on both
 * sides (a whole row of heads, or one head) go through memcpy, which the C
 * library vectorises. Quantizing runs the variant's quantize_row block
 * (attention/blocks.h). */
#include <stdint.h>
#include <string.h>

#include "attention/blocks.h"
#include "common/isa.h"
#include "masked_attn.h"

const ma_blocks *ma_blocks_for(ma_isa isa) {
    switch (ma_isa_runs(isa, MA_F32, 1)) {
#define CASE(ID, name, abi, arch, bq, bk, fb, own, inst, usable) \
    MA_ON_##arch(MA_ROWS_##own(case MA_ISA_##ID : return MA_TABLE_##inst(ma_blocks, name);))
        MA_ISA_TABLE(CASE)
#undef CASE
    default: return &ma_blocks_scalar;
    }
}

/* One head's row at a time into an 8-bit cache; a row whose elements lie
 * apart (a K^T page: each a page row apart) goes through the stack (its dim
 * at most MA_KV_STRIDED_I8_ROW: the shim checks). */
static void quantize_heads(const ma_cache_write_params *p, const ma_cache_side *side, int8_t *dst, const char *src,
                           float *scale) {
    const ma_blocks *blk = ma_blocks_for(p->isa);
    const int64_t step = side->cache_stride[3];
    int8_t row[MA_KV_STRIDED_I8_ROW];
    for (int64_t h = 0; h < p->Hkv; h++) {
        const char *x = src + (size_t)(h * side->src_stride[1]) * p->elem_bytes;
        int8_t *d = dst + h * side->cache_stride[2];
        if (step == 1 || side->dim <= 1) {
            blk->quantize_row(x, p->src_dtype, side->dim, d, scale + h * side->scale_stride[2]);
            continue;
        }
        blk->quantize_row(x, p->src_dtype, side->dim, row, scale + h * side->scale_stride[2]);
        for (int64_t i = 0; i < side->dim; i++) d[i * step] = row[i];
    }
}

static void copy_row(const ma_cache_side *side, int64_t Hkv, size_t bytes, char *dst, const char *src) {
    const int64_t *ss = side->src_stride, *cs = side->cache_stride;
    const int64_t dim = side->dim;
    if (ss[2] == 1 && cs[3] == 1 && (Hkv == 1 || (ss[1] == dim && cs[2] == dim))) {
        memcpy(dst, src, (size_t)(Hkv * dim) * bytes);
        return;
    }
    for (int64_t h = 0; h < Hkv; h++) {
        char *d = dst + (size_t)(h * cs[2]) * bytes;
        const char *s = src + (size_t)(h * ss[1]) * bytes;
        if (ss[2] == 1 && cs[3] == 1) memcpy(d, s, (size_t)dim * bytes);
        else if (bytes == 4) /* a K^T page: each element a page row apart */
            for (int64_t i = 0; i < dim; i++) ((uint32_t *)d)[i * cs[3]] = ((const uint32_t *)s)[i * ss[2]];
        else if (bytes == 2)
            for (int64_t i = 0; i < dim; i++) ((uint16_t *)d)[i * cs[3]] = ((const uint16_t *)s)[i * ss[2]];
        else
            for (int64_t i = 0; i < dim; i++)
                memcpy(d + (size_t)(i * cs[3]) * bytes, s + (size_t)(i * ss[2]) * bytes, bytes);
    }
}

void ma_cache_write_task(int64_t begin, int64_t end, void *ctx) {
    const ma_cache_write_params *p = (const ma_cache_write_params *)((const ma_task_ctx *)ctx)->params;
    for (int64_t t = begin; t < end; t++) {
        const int64_t s = p->slots64 ? p->slots64[t] : (int64_t)p->slots32[t];
        if (s < 0) continue;
        const int64_t page = s / p->page_size, row = s % p->page_size;
        for (int side_i = 0; side_i < 2; side_i++) {
            const ma_cache_side *side = side_i ? &p->v : &p->k;
            if (side->scale) {
                quantize_heads(p, side,
                               (int8_t *)side->cache + page * side->cache_stride[0] + row * side->cache_stride[1],
                               (const char *)side->src + (size_t)(t * side->src_stride[0]) * p->elem_bytes,
                               side->scale + page * side->scale_stride[0] + row * side->scale_stride[1]);
                continue;
            }
            char *dst = (char *)side->cache +
                        (size_t)(page * side->cache_stride[0] + row * side->cache_stride[1]) * p->elem_bytes;
            const char *src = (const char *)side->src + (size_t)(t * side->src_stride[0]) * p->elem_bytes;
            copy_row(side, p->Hkv, p->elem_bytes, dst, src);
        }
    }
}

void ma_kv_quantize_task(int64_t begin, int64_t end, void *ctx) {
    const ma_kv_quant_params *p = (const ma_kv_quant_params *)((const ma_task_ctx *)ctx)->params;
    const ma_blocks *blk = ma_blocks_for(p->isa);
    const size_t es = p->dtype == MA_F32 ? 4 : 2;
    for (int64_t r = begin; r < end; r++)
        blk->quantize_row((const char *)p->x + (size_t)(r * p->x_stride) * es, p->dtype, p->D, p->q + r * p->q_stride,
                          p->scale + r);
}
