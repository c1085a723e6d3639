/* blocks.h -- the contract between the attention loops (attention_tmpl.h)
 * and the instruction sets. Private to the kernels.
 *
 * 1. Building blocks, named <block>_X for instruction set X (static, so the
 *    loops inline them): the scalar reference in blocks_scalar.h (X = scalar;
 *    X = f64 with ACC double), the vector ones written once in blocks_simd.h
 *    over the SIMD vocabulary (common/simd.h; X = every vector instance's
 *    suffix, attention_tmpl.h lists the instances). ACC is
 *    float (double for the float64 instance):
 *
 *   gemm_X(m, n, k, A, ars, acs, B, ldb, C, ldc, accumulate)
 *       C (m, n) [+]= A (m, k) @ B (k, n); A[i, p] = A[i*ars + p*acs] (a
 *       transposed A is free), B and C row-major; overwrites C unless accumulate
 *   gemm_rowscale_X(m, n, k, A, ars, acs, B, ldb, C, ldc, rs)
 *       C = diag(rs) C + A B (rs NULL: C + A B), one rounding of rs * C as a
 *       pass of its own would give: the forward's O = alpha O + P V
 *   exp_sub_sum_X(x, n, m)         x[c] = exp(x[c] - m); returns the sum (a row)
 *   col_max_X(x, rows, n, m)       m[r] = max(m[r], x[c*n + r] for c < rows); NaN sticks
 *   exp_sub_col_X(x, rows, n, m, sum)
 *       x[c*n + r] = exp(x[c*n + r] - m[r]), sum[r] += it; m[r] = -inf acts as 0
 *   transpose_X(dst, src, lds, nr, ncol, mul)
 *       dst (ncol, nr) = mul * src (nr, ncol)^T, src rows lds apart
 *   row_max_X(x, n, m)             max(m, x[c] for c < n); NaN sticks
 *   softcap_X(s, n, cap, inv, th)  s[x] = cap tanh(s[x] inv) in place; th (or NULL)
 *                                  keeps the tanh for the backward. The scalar
 *                                  block is libm's tanh; the SIMD one the
 *                                  vocabulary's vf_tanh (a few float32 ulps off it)
 *   dot_rows_X(s, lds, q, nr, D, k, dt, off, ld, nc, pf)
 *       s[r*lds + c] = q[r*D : r*D + D] . k[off + c*ld : ... + D], k in its own
 *       dtype, in the decoding's order: W partial sums (the table's dot_rows_w:
 *       one vector of the instance, min(VL, 16) lanes; 16 in the scalar block),
 *       partial j the terms d = j (mod W) in order from d = 0 (one FMA each; the
 *       scalar block a product and a sum), then folded in halves (p_j +
 *       p_(j+W/2), then + W/4, ..., + 1), so that each key row is read once, in
 *       order; not the GEMM's bits (docs/design.md, "Decoding")
 *   dot_rows_i8_X(s, lds, q16, qs, nr, D, k, off, ld, nc, pf)
 *       the 8-bit cache's scores in integers: s[r*lds + c] = (float)(q16 row r . k
 *       row c) * qs[r], q16 int16 (D elements a row), k int8; the dot product
 *       exact in int32 (the caller keeps sum |q16| 128 under 2^31), then one
 *       rounding to float and one of the product: bit for bit the same in every
 *       variant (float arithmetic whatever the instance's ACC)
 *   dot_keys_t_X(s, lds, q, nr, D, k, dt, off, ldd, nc, pf)     (nr <= 8)
 *       the scores from keys stored transposed: element d of key c at
 *       k[off + c + d*ldd] (a K^T page), summed in gemm_X's order (bit for bit
 *       the tile's score), no transposes
 *   axpy_keys_X(o, p, ldp, nr, Dv, v, dt, off, ld, nc, pf, lsum)
 *       o[r*Dv + d] += sum_c p[r*ldp + c] v[off + c*ld + d], v in its own dtype,
 *       in gemm_X's order; and where lsum is not NULL, lsum[r] += p[r*ldp + c] one key
 *       at a time in key order (the online softmax's row sums, bit for bit a sum in order
 *       from lsum[r]: the decode step's l, whose chain of adds then runs beside the FMAs)
 *   axpy_keys_i8_X(o, p, ldp, nr, Dv, v, off, ld, nc, pf)
 *       the 8-bit cache's P V in integers, v int8: per row r and run of keys c0 ..
 *       c0 + n (n = 512, the last fewer): m = max |p[r*ldp + c]| over the run,
 *       p16_c = round(p[r*ldp + c] (32767 / m)) (float32 products, ties to even),
 *       sum_d = sum_c p16_c v[off + c*ld + d] (exact in int32), then
 *       o[r*Dv + d] = fma((float)sum_d, m / 32767, o[r*Dv + d]): bit for bit the
 *       same in every variant. m = 0: sums 0. Some p inf or NaN, or 32767 / m
 *       past float32: the sums 0 and scale 0 (the fma adds 0), then the run as
 *       axpy_keys (its NaN)
 *       pf: as they read a line of a key or value row, these two may prefetch
 *       the line pf elements further (0: none); a hint, values never change
 *   quantize_row_X(x, dt, n, q, scale)
 *       one row of the 8-bit KV cache (masked_attn.h, "8-bit KV cache"): x[0:n]
 *       of dtype dt (float32, bfloat16, float16, unit stride) into q[0:n] and
 *       *scale, float32 arithmetic only (the scalar block is the float one in
 *       every instance), bit for bit the same in every variant
 *   dropout_X(x, z, rs, cs, nr, nc, d, i0, j0)
 *       dropout of the elements (i0 + r, j0 + c) of one head, element (r, c)
 *       at [r * rs + c * cs], m = kept ? scale : 0: z NULL: x = x * m in
 *       place, else z = m; kept as philox.h defines it, bit for bit the same
 *       in every variant (the mask and the one rounding of x * m)
 *   and, optionally (with #define MA_BLK_STREAM), stream_row_f32_X(y, src, n,
 *   mul): y[c] = mul * src[c] with non-temporal stores (y 64-byte aligned,
 *   n % 16 == 0), and stream_fence_X().
 *
 *   exp(-inf) is exactly 0 in every block: masked keys get exactly zero
 *   probability, so they cannot leak into any output.
 *
 * 2. An instance: a translation unit compiled with X's flags (X.c) that
 *    includes common/simd_X.h, defines BLK(name) (the blocks' suffix) and
 *    includes blocks_simd.h, then defines FN(name) (the instance's suffix,
 *    usually the same) and includes attention_tmpl.h. It ends with its
 *    tables, every name spelled out (so a name a profiler shows, such as
 *    attn_fwd_avx2, is found by grep): const ma_blocks ma_blocks_X (the
 *    float blocks the C harness tests) and const ma_attn_kernels
 *    ma_attn_kernels_X (the kernels dispatch.c picks), declared below from
 *    X's row of MA_ISA_TABLE (masked_attn.h).
 *
 * 3. Tile hooks (optional): tiles_hooks.h writes them once for the three
 *    instances that include it, amx.c, avx512bf16.c and svebf16.c (AMX,
 *    AVX512-BF16, SVE-BF16). With #define MA_TILE_HOOKS the instance
 *    supplies the tile products and their operand packing of the forward's
 *    tile path and of the backward (tiles_contract.h lists
 *    them); the loops, masks and softmax stay the template's.
 *    The instance's other blocks serve everything else (short query blocks,
 *    weights, the backward's pre-pass for the weights' gradient).
 */
#ifndef MA_ATTENTION_BLOCKS_H
#define MA_ATTENTION_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

#include "common/isa.h"
#include "masked_attn.h"
#include "philox.h"

/* The float building blocks of one instruction set, for the C harness
 * (tests/c/test_blocks.c checks every variant against the scalar reference). */
typedef struct {
    const char *name;
    void (*gemm)(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B, int64_t ldb,
                 float *C, int64_t ldc, int accumulate);
    float (*exp_sub_sum)(float *x, int64_t n, float m);
    void (*col_max)(const float *x, int64_t rows, int64_t n, float *m);
    void (*exp_sub_col)(float *x, int64_t rows, int64_t n, const float *m, float *sum);
    void (*transpose)(float *dst, const float *src, int64_t lds, int64_t nr, int64_t ncol, float mul);
    float (*row_max)(const float *x, int64_t n, float m);
    void (*axpy_keys)(float *o, const float *p, int64_t ldp, int64_t nr, int64_t Dv, const void *v, ma_dtype dt,
                      int64_t off, int64_t ld, int64_t nc, int64_t pf, float *lsum);
    void (*gemm_rowscale)(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                          int64_t ldb, float *C, int64_t ldc, const float *rs);
    void (*dropout)(float *x, float *z, int64_t rs, int64_t cs, int64_t nr, int64_t nc, const ma_dropout *d, int64_t i0,
                    int64_t j0);
    void (*softcap)(float *s, int64_t n, float cap, float inv, float *th);
    void (*dot_keys_t)(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                       int64_t off, int64_t ldd, int64_t nc, int64_t pf);
    void (*quantize_row)(const void *x, ma_dtype dt, int64_t n, int8_t *q, float *scale);
    void (*dot_rows)(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                     int64_t off, int64_t ld, int64_t nc, int64_t pf);
    int dot_rows_w; /* dot_rows' partial sums (W) */
    void (*dot_rows_i8)(float *s, int64_t lds, const int16_t *q, const float *qs, int64_t nr, int64_t D,
                        const int8_t *k, int64_t off, int64_t ld, int64_t nc, int64_t pf);
    void (*axpy_keys_i8)(float *o, const float *p, int64_t ldp, int64_t nr, int64_t Dv, const int8_t *v, int64_t off,
                         int64_t ld, int64_t nc, int64_t pf);
} ma_blocks;

/* The float blocks of variant isa (AMX and AVX512-BF16: AVX-512's, SVE-BF16: NEON's, which their
 * kernels use outside the tile products: ma_isa_runs); kv_cache/cache_write.c, its user (the
 * quantizing block), so that harnesses linking a few variants need not link it. */
const ma_blocks *ma_blocks_for(ma_isa isa);

/* The C harness's products of the tile variants (their other blocks are their fallbacks'). */
extern const ma_blocks ma_blocks_amx2, ma_blocks_amx3; /* GEMM only: 3 and 6 bf16 products */
extern const ma_blocks ma_blocks_avx512bf16_2, ma_blocks_avx512bf16_3; /* the same on VDPBF16PS */
extern const ma_blocks ma_blocks_svebf16_2;                             /* 3 products (2 parts) on BFMMLA */

/* The kernels of one instance (attention_tmpl.h); dispatch.c picks one. */
typedef struct {
    ma_task_fn fwd, bwd_delta, bwd_fused, bwd_reduce;
    size_t (*fwd_scratch_bytes)(const ma_attn_fwd_params *p);
    size_t (*bwd_scratch_bytes)(const ma_attn_bwd_params *p);
    ma_task_fn decode, decode_merge; /* decode_tmpl.h */
    size_t (*decode_scratch_bytes)(const ma_attn_fwd_params *p);
} ma_attn_kernels;

/* Every variant's tables (MA_ISA_TABLE: its kernels; its float blocks where it has row kernels of
 * its own; sve's one per vector length), and the float64 kernels. */
#define MA_ATTN_EXTERNS(ID, name, abi, arch, bq, bk, fb, own, inst, usable) \
    MA_EXTERN_##inst(ma_attn_kernels, name) MA_ROWS_##own(MA_EXTERN_##inst(ma_blocks, name))
MA_ISA_TABLE(MA_ATTN_EXTERNS)
#undef MA_ATTN_EXTERNS
extern const ma_attn_kernels ma_attn_kernels_f64;

#endif /* MA_ATTENTION_BLOCKS_H */
