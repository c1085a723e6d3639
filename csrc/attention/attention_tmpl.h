/*
 * attention_tmpl.h -- masked attention forward and backward, written once.
 *
 * Instantiated once per (accumulation type, instruction set) by a small
 * instance file (blocks.h, "An instance"): scalar.c (the float reference and
 * the float64 instance), avx2.c, avx512.c, amx.c, avx512bf16.c. The instance defines
 *   FN(name)    its suffix: every function here is FN(...), static
 *   BLK(name)   the suffix of the building blocks it calls (blocks.h)
 *   MA_ACC_F64  for double accumulation (float64 inputs); float otherwise
 *   MA_TILE_HOOKS  when it supplies the tile products (AMX; "tile hooks" below)
 * and lists the kernels it gets (attn_fwd_<suffix>, ...) in its
 * ma_attn_kernels_<suffix> table, by their full names.
 *
 * Shapes: B, H, Hkv, Lq, Lk, D, Dv as in masked_attn.h; G = H / Hkv; a tile
 * is nr <= BQ query rows by nc <= BK keys (block_q, block_k).
 *
 * Where the masks are interpreted: FN(mask_value) (a bool or float element
 * into its additive form), FN(keys_read) (trailing key padding that is never
 * read), FN(kv_range) and FN(q_range) (causal and window block skipping),
 * FN(mask_tile_state) (an
 * attn_mask tile that blocks every entry is skipped, one that adds only
 * zeros is not added). Where they are applied: FN(add_bias), the only place
 * scores get their bias (ALiBi's too); head_mask in FN(head_scale) and the output/gradient
 * lines that use it.
 *
 * The algorithm is FlashAttention-2. The forward and the dq pass hold one
 * query block and stream the key blocks; they work on transposed scores
 * sT (nc, nr) = K Q^T, so that K and V are read in place (no copy when they
 * are float32 with unit last stride) and only the query block is packed once
 * (qT = scale * Q^T). Per-query statistics (max, sum) are then column-wise,
 * which vectorises across queries. The dkdv pass holds one key block (packed
 * once as kT = scale * K^T, vT = V^T) and streams the query blocks in place,
 * on row-wise scores s (nr, nc) = Q kT.
 * The forward saves only lse = m + log l per query; the backward recomputes
 * P = exp(S - lse).
 *
 * Dropout (masked_attn.h; philox.h): the keep mask of a tile is regenerated
 * wherever it is needed by DROPOUT (the blocks' dropout_X), never stored:
 * the forward drops (and rescales) P after the softmax statistics took it
 * whole, before O += P V and before the weights are written; the backward
 * drops dP = dO V^T (+ dW) before dS = P (hm dP - delta) and drops P before
 * dV += (hm P')^T dO. FN(head_dropout) is NULL when dropout is off.
 */

#include <math.h>
#include <string.h>
#if !defined(MA_ACC_F64) && defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "blocks.h"
#include "common/dtype.h"
#include "masked_attn.h"
#include "philox.h"

#ifdef MA_ACC_F64
#define ACC double
#define LOAD ma_load_f64
#define STORE ma_store_f64
#define LOG log
#define EXPF exp
#else
#define ACC float
#define LOAD ma_load_f32
#define STORE ma_store_f32
#define LOG logf
#define EXPF expf
#endif
#define GEMM BLK(gemm)
#define GEMM_ROWSCALE BLK(gemm_rowscale)
#define EXP_SUB_SUM BLK(exp_sub_sum)
#define COL_MAX BLK(col_max)
#define EXP_SUB_COL BLK(exp_sub_col)
#define TRANSPOSE BLK(transpose)
#define ROW_MAX BLK(row_max)
#define DOT_KEYS_T BLK(dot_keys_t)
#define DOT_ROWS BLK(dot_rows)
#define AXPY_KEYS BLK(axpy_keys)
#define DROPOUT BLK(dropout)

/* ---- tiles ----------------------------------------------------------------- */

static inline int FN(is_native)(ma_dtype dt) { return sizeof(ACC) == sizeof(float) ? dt == MA_F32 : dt == MA_F64; }

/* The element type of k and v: the call's, or int8 with their scales (ma_attn_opts.k_scale). */
static inline ma_dtype FN(kv_dtype)(const ma_attn_args *a) { return a->opts.k_scale.ptr ? MA_I8 : a->dtype; }

/* dst[c] = mul * src[c], c < n, from 16-bit floats, MA_VL at a time through the instance's
 * vocabulary (vf_load_dt), as the scalar loop computes them (the conversion is exact, then one
 * rounding of the product); returns how many it did (0 in the scalar instances). GCC leaves the
 * scalar loop over bfloat16 unvectorised (the bits moved through memcpy): on the emulated CPU
 * a bfloat16 backward's delta = dO . O took about 1,600 instructions a row of D = 64. */
static inline int64_t FN(convert_16bit_row)(ACC *dst, const uint16_t *x, ma_dtype dt, int64_t n, ACC mul) {
    int64_t c = 0;
#if !defined(MA_ACC_F64) && defined(MA_VL)
    const vf mv = vf_set1(mul);
    for (; c + MA_VL <= n; c += MA_VL) vf_store(dst + c, vf_mul(mv, vf_load_dt(x, dt, c, MA_VL)));
#else
    (void)dst, (void)x, (void)dt, (void)n, (void)mul;
#endif
    return c;
}

/* dst[c * dst_stride] = mul * src[off + c * st], c < n: one row, converted to
 * ACC. The element type is switched on once per row, so each loop is plain
 * and vectorisable. */
static void FN(convert_row)(ACC *dst, int64_t dst_stride, const void *src, ma_dtype dt, int64_t off, int64_t st,
                            int64_t n, ACC mul) {
    if ((dt == MA_BF16 || dt == MA_F16) && st == 1 && dst_stride == 1) {
        const uint16_t *x = (const uint16_t *)src + off;
        const int64_t c = FN(convert_16bit_row)(dst, x, dt, n, mul);
        dst += c, off += c, n -= c;
    }
    switch (dt) {
    case MA_F32: {
        const float *x = (const float *)src + off;
        if (st == 1 && dst_stride == 1)
            for (int64_t c = 0; c < n; c++) dst[c] = mul * (ACC)x[c];
        else
            for (int64_t c = 0; c < n; c++) dst[c * dst_stride] = mul * (ACC)x[c * st];
        break;
    }
    case MA_F64: {
        const double *x = (const double *)src + off;
        for (int64_t c = 0; c < n; c++) dst[c * dst_stride] = mul * (ACC)x[c * st];
        break;
    }
    case MA_I8: { /* the 8-bit cache's integers, exactly */
        const int8_t *x = (const int8_t *)src + off;
        if (st == 1 && dst_stride == 1)
            for (int64_t c = 0; c < n; c++) dst[c] = mul * (ACC)x[c];
        else
            for (int64_t c = 0; c < n; c++) dst[c * dst_stride] = mul * (ACC)x[c * st];
        break;
    }
    case MA_BF16: {
        const uint16_t *x = (const uint16_t *)src + off;
        if (st == 1 && dst_stride == 1)
            for (int64_t c = 0; c < n; c++) dst[c] = mul * (ACC)ma_bf16_to_f32(x[c]);
        else
            for (int64_t c = 0; c < n; c++) dst[c * dst_stride] = mul * (ACC)ma_bf16_to_f32(x[c * st]);
        break;
    }
    default:
        for (int64_t c = 0; c < n; c++) dst[c * dst_stride] = mul * LOAD(src, dt, off + c * st);
        break;
    }
}

/* dst (nr, ncol) = src[b, h, r0 : r0 + nr, 0 : ncol]; overwrites. */
static void FN(load_tile)(ACC *dst, const void *src, ma_dtype dt, const int64_t st[4], int64_t b, int64_t h, int64_t r0,
                          int64_t nr, int64_t ncol) {
    for (int64_t r = 0; r < nr; r++)
        FN(convert_row)(dst + r * ncol, 1, src, dt, b * st[0] + h * st[1] + (r0 + r) * st[2], st[3], ncol, 1);
}

/* dst (ncol, nr) = mul * src[b, h, r0 : r0 + nr, 0 : ncol]^T; overwrites. */
static void FN(load_tile_t)(ACC *dst, const void *src, ma_dtype dt, const int64_t st[4], int64_t b, int64_t h,
                            int64_t r0, int64_t nr, int64_t ncol, ACC mul) {
    if (FN(is_native)(dt) && st[3] == 1) {
        TRANSPOSE(dst, (const ACC *)src + b * st[0] + h * st[1] + r0 * st[2], st[2], nr, ncol, mul);
        return;
    }
    for (int64_t r = 0; r < nr; r++)
        FN(convert_row)(dst + r, nr, src, dt, b * st[0] + h * st[1] + (r0 + r) * st[2], st[3], ncol, mul);
}

/* Rows r0 .. r0 + nr of src[b, h] as an ACC matrix with row stride *ld:
 * the tensor itself when it already is one (no copy), else converted into
 * buf (nr, ncol). */
static const ACC *FN(rows)(const void *src, ma_dtype dt, const int64_t st[4], int64_t b, int64_t h, int64_t r0,
                           int64_t nr, int64_t ncol, ACC *buf, int64_t *ld) {
    if (FN(is_native)(dt) && st[3] == 1) {
        *ld = st[2];
        return (const ACC *)src + b * st[0] + h * st[1] + r0 * st[2];
    }
    FN(load_tile)(buf, src, dt, st, b, h, r0, nr, ncol);
    *ld = ncol;
    return buf;
}

/* Does src need converting before the kernels can read it in place? */
static inline int FN(needs_copy)(ma_dtype dt, const int64_t st[4]) {
    /* rows a multiple of 4 KB apart (heads side by side with H * D a multiple of 1024 floats:
     * a (B, L, H, D) projection, a paged or packed cache) all fall in one L1 set, where the tile
     * products thrash: copied into the head cache like strided rows (the same values) */
    return !(FN(is_native)(dt) && st[3] == 1) || (st[2] * (int64_t)sizeof(ACC)) % 4096 == 0;
}

/* src[b, h0 : h0 + nh, 0 : L, 0 : ncol] as ACC rows (row stride ncol, head
 * stride L * ncol) in a per-thread cache, converted once per (b, h0) and
 * thread rather than once per tile: *tag (in the scratch header, zeroed by
 * the shim for every call) remembers what the cache holds. Only for inputs
 * that need converting (bfloat16, float16, strided). */
static const ACC *FN(head_cache)(int64_t *tag, ACC *cache, const void *src, ma_dtype dt, const int64_t st[4], int64_t b,
                                 int64_t h0, int64_t nh, int64_t L, int64_t ncol) {
    const int64_t key = b * 65536 + h0 + 1;
    if (*tag != key) {
        for (int64_t h = 0; h < nh; h++) FN(load_tile)(cache + h * L * ncol, src, dt, st, b, h0 + h, 0, L, ncol);
        *tag = key;
    }
    return cache;
}

/* Rows r0 .. r0 + nr of src[b, h] (row stride *ld): in place when possible,
 * else from the head cache (head_base = what FN(head_cache) returned for h). */
static inline const ACC *FN(rows_in)(const void *src, ma_dtype dt, const int64_t st[4], int64_t b, int64_t h,
                                     int64_t r0, const ACC *head_base, int64_t ncol, int64_t *ld) {
    if (!FN(needs_copy)(dt, st)) {
        *ld = st[2];
        return (const ACC *)src + b * st[0] + h * st[1] + r0 * st[2];
    }
    *ld = ncol;
    return head_base + r0 * ncol;
}

/* dst[b, h, r0 : r0 + nr, 0 : ncol] = mul * src (nr, ncol); overwrites. With
 * stream (masked_attn.h, stream_stores), float32 rows that are whole cache
 * lines go out through the blocks' stream_row_f32 where they have one
 * (MA_BLK_STREAM); the task then ends with FN(fence_streams). */
static void FN(store_tile)(void *dst, ma_dtype dt, const int64_t st[4], int64_t b, int64_t h, int64_t r0, int64_t nr,
                           int64_t ncol, const ACC *src, ACC mul, int stream) {
    (void)stream;
    for (int64_t r = 0; r < nr; r++) {
        const int64_t base = b * st[0] + h * st[1] + (r0 + r) * st[2];
        const ACC *src_r = src + r * ncol;
        if (dt == MA_F32 && st[3] == 1) {
            float *y = (float *)dst + base;
#ifdef MA_BLK_STREAM
            if (stream && ((uintptr_t)y & 63) == 0 && ncol % 16 == 0) {
                BLK(stream_row_f32)(y, src_r, ncol, mul);
                continue;
            }
#endif
            for (int64_t c = 0; c < ncol; c++) y[c] = (float)(mul * src_r[c]);
        } else if (dt == MA_F32) {
            float *y = (float *)dst + base;
            for (int64_t c = 0; c < ncol; c++) y[c * st[3]] = (float)(mul * src_r[c]);
        } else if (dt == MA_BF16) {
            uint16_t *y = (uint16_t *)dst + base;
            for (int64_t c = 0; c < ncol; c++) y[c * st[3]] = ma_f32_to_bf16((float)(mul * src_r[c]));
        } else {
            for (int64_t c = 0; c < ncol; c++) STORE(dst, dt, base + c * st[3], mul * src_r[c]);
        }
    }
}

/* round(x - round(x)) in bfloat16 / float16, 0 where x - round(x) is not
 * finite: out_lo's element (masked_attn.h). Branch-free, so that the
 * contiguous loops below vectorise. */
static inline uint16_t FN(bf16_lo)(float x) {
    const float e = x - ma_bf16_to_f32(ma_f32_to_bf16(x));
    return fabsf(e) <= 3.402823466e38f ? ma_f32_to_bf16(e) : 0;
}
static inline uint16_t FN(f16_lo)(float x) {
    const float e = x - ma_f16_to_f32(ma_f32_to_f16(x));
    return fabsf(e) <= 3.402823466e38f ? ma_f32_to_f16(e) : 0;
}

/* lo[b, h, r0 : r0 + nr, 0 : ncol] = the out_lo of src (nr, ncol) in dt
 * (bfloat16 or float16). */
static void FN(store_tile_lo)(void *lo, ma_dtype dt, const int64_t st[4], int64_t b, int64_t h, int64_t r0, int64_t nr,
                              int64_t ncol, const ACC *src) {
    const int64_t cs = st[3];
    for (int64_t r = 0; r < nr; r++) {
        uint16_t *y = (uint16_t *)lo + b * st[0] + h * st[1] + (r0 + r) * st[2];
        const ACC *x = src + r * ncol;
        if (dt == MA_BF16 && cs == 1)
            for (int64_t c = 0; c < ncol; c++) y[c] = FN(bf16_lo)((float)x[c]);
        else if (dt == MA_BF16)
            for (int64_t c = 0; c < ncol; c++) y[c * cs] = FN(bf16_lo)((float)x[c]);
        else if (cs == 1)
            for (int64_t c = 0; c < ncol; c++) y[c] = FN(f16_lo)((float)x[c]);
        else
            for (int64_t c = 0; c < ncol; c++) y[c * cs] = FN(f16_lo)((float)x[c]);
    }
}

/* Orders the non-temporal stores of a task before its end (MA_BLK_STREAM). */
static inline void FN(fence_streams)(void) {
#ifdef MA_BLK_STREAM
    BLK(stream_fence)();
#endif
}

/* ---- masks ----------------------------------------------------------------- */

/* The additive form of one mask element: bool true -> -inf, float as is. */
static inline ACC FN(mask_value)(const ma_mask *m, int64_t off) {
    if (m->dtype == MA_BOOL) return ((const uint8_t *)m->ptr)[off] ? -(ACC)INFINITY : 0;
    return LOAD(m->ptr, m->dtype, off);
}

#ifndef MA_TILE_STATES
#define MA_TILE_STATES
enum { MA_TILE_MIXED = 0, MA_TILE_BLOCKED = 1, MA_TILE_ZERO = 2 };
#endif

/* What the attn_mask entries of one tile (queries i0 .. i0 + nr, keys
 * j0 .. j0 + nc of head (b, h)) say, read from those entries alone (not from
 * any assumed structure), through the broadcasting strides (a dimension of
 * stride 0 is read once):
 *   MA_TILE_BLOCKED  every entry blocks (bool true, float -inf). For finite
 *                    q, k, v the tile contributes exactly nothing (P =
 *                    exp(-inf) = 0, the running max does not move), so the
 *                    loops skip it whole: no products, and its keys' k, v are
 *                    not read for its queries (NaN there reaches no other row);
 *   MA_TILE_ZERO     every entry adds 0 (bool false, float +-0), or there is
 *                    no attn_mask: FN(add_bias) adds nothing from it;
 *   MA_TILE_MIXED    anything else (NaN and +inf included): added as is.
 * Other masks (causal, key padding) are not consulted: each has its own skip. */
static int FN(mask_tile_state)(const ma_mask *m, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t j0, int64_t nc) {
    if (!m->ptr) return MA_TILE_ZERO;
    const int64_t *st = m->stride;
    const int64_t rows = st[2] ? nr : 1, cols = st[3] ? nc : 1, cst = st[3] ? st[3] : 1;
    const int64_t base = b * st[0] + h * st[1] + i0 * st[2] + j0 * st[3];
    int blocked = 1, zero = 1;
    for (int64_t r = 0; r < rows && (blocked | zero); r++) {
        const int64_t off = base + r * st[2];
        if (m->dtype == MA_BOOL && cst == 1) { /* bytes 0 / 1: AND and OR over the row */
            const uint8_t *x = (const uint8_t *)m->ptr + off;
            uint8_t all = 1, any = 0;
            for (int64_t c = 0; c < cols; c++) all &= x[c], any |= x[c];
            blocked &= all != 0;
            zero &= any == 0;
        } else if (m->dtype == MA_F32 && cst == 1) {
            const float *x = (const float *)m->ptr + off;
            int all = 1, none = 1;
            for (int64_t c = 0; c < cols; c++) all &= x[c] == -INFINITY, none &= x[c] == 0;
            blocked &= all;
            zero &= none;
        } else {
            for (int64_t c = 0; c < cols; c++) {
                const ACC x = FN(mask_value)(m, off + c * cst);
                blocked &= x == -(ACC)INFINITY;
                zero &= x == 0;
            }
        }
    }
    return blocked ? MA_TILE_BLOCKED : zero ? MA_TILE_ZERO : MA_TILE_MIXED;
}

/* |d| as ACC: ALiBi's distance (exact below 2^24) */
static inline ACC FN(dist)(int64_t d) { return (ACC)(d < 0 ? -d : d); }

/* Scores of queries i0 .. i0 + nr against keys j0 .. j0 + nc, plus the bias
 * of every mask (additive forms) and ALiBi's; accumulates. Element (r, c) lives at
 * s[r * rs + c * cs]: rs = nc, cs = 1 for row-wise s (nr, nc), rs = 1,
 * cs = nr for transposed sT (nc, nr). am_state is FN(mask_tile_state) of
 * the tile: MA_TILE_ZERO adds nothing from am (s + 0 = s: the same values). */
static void FN(add_bias)(ACC *s, int64_t rs, int64_t cs, const ma_attn_args *a, int am_state, int64_t b, int64_t h,
                         int64_t i0, int64_t nr, int64_t j0, int64_t nc) {
    const ma_mask *am = &a->attn_mask, *kpm = &a->key_padding_mask;
    const int64_t lo = a->band_lo, hi = a->band_hi;
    if (kpm->ptr) {
        const int64_t base = b * kpm->stride[0] + j0 * kpm->stride[1];
        if (cs == 1) { /* row-wise: the keys' biases as one row, added to every row */
            for (int64_t c0 = 0; c0 < nc; c0 += 64) {
                const int64_t n = ma_min(64, nc - c0);
                ACC row[64];
                int any = 0;
                for (int64_t c = 0; c < n; c++) {
                    row[c] = FN(mask_value)(kpm, base + (c0 + c) * kpm->stride[1]);
                    any |= row[c] != 0;
                }
                if (any)
                    for (int64_t r = 0; r < nr; r++)
                        for (int64_t c = 0; c < n; c++) s[r * rs + c0 + c] += row[c];
            }
        } else {
            for (int64_t c = 0; c < nc; c++) {
                const ACC x = FN(mask_value)(kpm, base + c * kpm->stride[1]);
                if (x != 0)
                    for (int64_t r = 0; r < nr; r++) s[r * rs + c * cs] += x;
            }
        }
    }
    if (am->ptr && am_state != MA_TILE_ZERO) {
        for (int64_t r = 0; r < nr; r++) {
            const int64_t base = b * am->stride[0] + h * am->stride[1] + (i0 + r) * am->stride[2] + j0 * am->stride[3];
            for (int64_t c = 0; c < nc; c++) s[r * rs + c * cs] += FN(mask_value)(am, base + c * am->stride[3]);
        }
    }
    if (a->opts.alibi.ptr) { /* ALiBi: -slope |i + Lk - Lq - j|, after the soft-cap, as flash-attn */
        const ma_mask *al = &a->opts.alibi;
        const ACC m = -LOAD(al->ptr, al->dtype, b * al->stride[0] + h * al->stride[1]);
        const int64_t d0 = i0 + a->Lk - a->Lq - j0; /* i - j + Lk - Lq at r = c = 0 */
        if (rs == 1)
            for (int64_t c = 0; c < nc; c++)
                for (int64_t r = 0; r < nr; r++) s[c * cs + r] += m * FN(dist)(d0 + r - c);
        else
            for (int64_t r = 0; r < nr; r++)
                for (int64_t c = 0; c < nc; c++) s[r * rs + c * cs] += m * FN(dist)(d0 + r - c);
    }
    /* the band (ma_attn_args.band_lo, band_hi; causal: hi = 0): key j = j0 + c
     * is hidden from query i = i0 + r when j - i > hi or j - i < lo */
    if (hi < MA_BAND_INF && j0 + nc - 1 - i0 > hi) {
        if (rs == 1) /* transposed: key c hides itself from the rows r < j0 + c - hi - i0 of its column */
            for (int64_t c = 0; c < nc; c++)
                for (int64_t r = 0; r < ma_min(nr, j0 + c - hi - i0); r++) s[c * cs + r] = -(ACC)INFINITY;
        else
            for (int64_t r = 0; r < nr; r++)
                for (int64_t c = i0 + r + hi - j0 + 1 < 0 ? 0 : i0 + r + hi - j0 + 1; c < nc; c++)
                    s[r * rs + c * cs] = -(ACC)INFINITY;
    }
    if (lo > -MA_BAND_INF && j0 - (i0 + nr - 1) < lo) {
        if (rs == 1) /* transposed: key c hides itself from the rows r > j0 + c - lo - i0 */
            for (int64_t c = 0; c < nc; c++)
                for (int64_t r = j0 + c - lo - i0 + 1 < 0 ? 0 : j0 + c - lo - i0 + 1; r < nr; r++)
                    s[c * cs + r] = -(ACC)INFINITY;
        else
            for (int64_t r = 0; r < nr; r++)
                for (int64_t c = 0; c < ma_min(nc, i0 + r + lo - j0); c++) s[r * rs + c * cs] = -(ACC)INFINITY;
    }
}

/* Soft-capping of n scores before their bias: s = c tanh(s / c), c > 0 (a
 * c of 0 leaves s alone). th, when not NULL, keeps tanh(s / c) for the
 * backward's factor 1 - tanh^2 (FN(softcap_grad)). */
static void FN(apply_softcap)(ACC *s, int64_t n, double cap, ACC *th) {
    if (cap > 0) BLK(softcap)(s, n, (ACC)cap, (ACC)(1.0 / cap), th);
}

/* dS -> dS (1 - th^2): the gradient of the capped product from the gradient
 * of the score, over n elements. An exact 0 stays 0 (th of a never-computed
 * entry, such as the skipped quarter of a split diagonal tile, may be stale). */
static void FN(softcap_grad)(ACC *ds, const ACC *th, int64_t n, double cap) {
    if (cap <= 0) return;
    for (int64_t x = 0; x < n; x++) ds[x] = ds[x] == 0 ? ds[x] : ds[x] * (1 - th[x] * th[x]);
}

/* How many of the keys j0 .. j0 + nc - 1 of batch b the kernels read: all
 * but the trailing ones that key padding blocks (-inf). Those have
 * probability exactly 0 for every query, so they are never read, and NaN or
 * inf in their k, v cannot come in as 0 * NaN; 0 means the block is skipped
 * whole. (Padding between unpadded keys is read, and has probability 0.) */
static int64_t FN(keys_read)(const ma_mask *kpm, int64_t b, int64_t j0, int64_t nc) {
    if (!kpm->ptr) return nc;
    const int64_t base = b * kpm->stride[0] + j0 * kpm->stride[1];
    while (nc > 0 && FN(mask_value)(kpm, base + (nc - 1) * kpm->stride[1]) == -(ACC)INFINITY) nc--;
    return nc;
}

/* The same for a backward key block: also not the keys after the last query's
 * band (causal: after the last query; no query sees them). */
static inline int64_t FN(bwd_keys_read)(const ma_attn_bwd_params *p, int64_t b, int64_t j0, int64_t nc) {
    if (p->a.band_hi < MA_BAND_INF) nc = ma_min(nc, p->a.Lq + p->a.band_hi - j0);
    return nc > 0 ? FN(keys_read)(&p->a.key_padding_mask, b, j0, nc) : 0;
}

static inline ACC FN(head_scale)(const ma_mask *hm, int64_t b, int64_t h) {
    return hm->ptr ? LOAD(hm->ptr, hm->dtype, b * hm->stride[0] + h * hm->stride[1]) : (ACC)1;
}

/* The dropout of head (b, h) in *d, or NULL when the call has none. */
static inline const ma_dropout *FN(head_dropout)(const ma_attn_args *a, int64_t b, int64_t h, ma_dropout *d) {
    if (!ma_dropout_on(a)) return NULL;
    *d = ma_dropout_head(a, b, h);
    return d;
}

/* x[e] *= z[e] (z from DROPOUT's multiplier form, 1 / (1 - p) or 0): the
 * same values as DROPOUT applied to x itself. */
static inline void FN(apply_dropout)(ACC *restrict x, const ACC *restrict z, int64_t n) {
    for (int64_t e = 0; e < n; e++) x[e] *= z[e];
}

/* Keys a query block [i0, i0 + nr) can see in the band: [*j_begin, *j_end),
 * j_begin a multiple of block_k (the key blocks stay those of a call without
 * a band), j_end where the last query's band ends. Key blocks outside are
 * never read. (An empty range, j_end <= j_begin, leaves the rows fully masked.) */
static inline void FN(kv_range)(const ma_attn_args *a, int64_t i0, int64_t nr, int64_t *j_begin, int64_t *j_end) {
    *j_end = a->band_hi < MA_BAND_INF ? ma_min(a->Lk, i0 + nr + a->band_hi) : a->Lk;
    *j_begin = a->band_lo > -MA_BAND_INF && i0 + a->band_lo > 0 ? (i0 + a->band_lo) / a->block_k * a->block_k : 0;
}

/* Queries that can see keys [j0, j0 + nc): query blocks from *i_begin (j0
 * itself under a causal band_hi of 0, where the diagonal tiles split; else a
 * multiple of block_q) to below *i_end. */
static inline void FN(q_range)(const ma_attn_args *a, int64_t j0, int64_t nc, int64_t *i_begin, int64_t *i_end) {
    const int64_t first = a->band_hi < MA_BAND_INF ? j0 - a->band_hi : 0; /* the first query j0 can see */
    *i_begin = first <= 0 ? 0 : a->band_hi == 0 ? first : first / a->block_q * a->block_q;
    *i_end = a->band_lo > -MA_BAND_INF ? ma_min(a->Lq, j0 + nc - a->band_lo) : a->Lq;
}

/* Where row 0 of head (b, h) of lse, delta, dhm_rows is (ma_attn_args.stat_stride). */
static inline int64_t FN(stat_row0)(const ma_attn_args *a, int64_t b, int64_t h) {
    return b * a->stat_stride[0] + h * a->stat_stride[1];
}

/* The strips of a causal diagonal tile (queries and keys i0 .. i0 + nr, nc,
 * block_q == block_k): with w = MA_DIAG_STRIP, the queries of the strip
 * [r0, r0 + w) see none of the keys from r0 + w on, and the keys of the
 * strip [c0, c0 + w) are seen by no query before c0, so the tile's part
 * above the staircase is never computed: each product runs strip by strip
 * (four strips of 16 in a 64 x 64 tile compute 5/8 of it). The skipped
 * entries are exactly 0 in P and dS, so for finite inputs every other value
 * is the same, bit for bit (a sum only loses terms 0 * x at its ends; a mask
 * gradient's skipped zeros may differ in sign). NaN or inf in those hidden
 * keys' v (or in those queries' dout) reaches only the rows (keys) that see
 * them, never the whole tile through 0 * NaN, as every other masked key
 * reaches only its own tiles. The skipped part of the score tile holds stale
 * scratch until add_bias's causal fill overwrites it with -inf (its bias adds
 * before that act on garbage and are discarded); every later read comes
 * after the fill, and the backward zeroes that part of dP. Returns w, or 0
 * when the tile is not split. */
#define MA_DIAG_STRIP 16
static inline int64_t FN(diag_split)(int64_t band_hi, int64_t BQ, int64_t BK, int64_t i0, int64_t nr, int64_t j0,
                                     int64_t nc) {
    const int64_t w = MA_DIAG_STRIP;
    return band_hi == 0 && BQ == BK && i0 == j0 && nr > w && nc > w ? w : 0;
}

/* Block index of the idx-th work item among n: 0, n-1, 1, n-2, ... so that
 * any contiguous range of items mixes cheap and expensive causal blocks and
 * the thread pool's static split stays balanced. */
static inline int64_t FN(interleave)(int64_t idx, int64_t n) { return idx % 2 == 0 ? idx / 2 : n - 1 - idx / 2; }

/* ---- sequences ---------------------------------------------------------------
 *
 * A batch entry's extent: where its rows start in q (and out, dq, dout, the
 * statistics) and in k (and v, dk, dv), how many there are, and its band.
 * Dense: every entry is (B, H, Lq, D) / (B, Hkv, Lk, D) at b * stride[0], so
 * the params are used as they are. Varlen (ma_attn_args.cu_q): FN(fwd_seq)
 * and FN(bwd_seq) return a copy of the params moved to entry b (pointers at
 * its first rows, its own Lq, Lk and band); the loops then run on it as on a
 * dense entry of those lengths. b itself is kept (its stride[0] is 0), so the
 * head caches' tags stay distinct per entry. */

/* x + off elements of dt (NULL stays NULL). */
static inline const void *FN(elem_at)(const void *x, ma_dtype dt, int64_t off) {
    return x ? (const char *)x + off * ma_dtype_size(dt) : x;
}

/* Moves args a (a copy) to varlen entry b; returns its first q row, *k0 its
 * first k row (paged: k, v stay at the pool, FN(key_off) finds the rows). */
static int64_t FN(seq_args)(ma_attn_args *a, int64_t b, int64_t *k0) {
    const int64_t q0 = a->cu_q[b], Lq = a->cu_q[b + 1] - q0;
    *k0 = a->block_table ? 0 : a->cu_k[b];
    const int64_t Lk = a->seqused_k ? a->seqused_k[b] : a->cu_k[b + 1] - *k0;
    a->q = FN(elem_at)(a->q, a->dtype, q0 * a->q_stride[2]);
    a->k = FN(elem_at)(a->k, FN(kv_dtype)(a), *k0 * a->k_stride[2]);
    a->v = FN(elem_at)(a->v, FN(kv_dtype)(a), *k0 * a->v_stride[2]);
    a->opts.k_scale.ptr = FN(elem_at)(a->opts.k_scale.ptr, MA_F32, *k0 * a->opts.k_scale.stride[2]);
    a->opts.v_scale.ptr = FN(elem_at)(a->opts.v_scale.ptr, MA_F32, *k0 * a->opts.v_scale.stride[2]);
    a->Lq = Lq, a->Lk = Lk;
    /* bottom-right aligned: the diagonal of query i is key i + Lk - Lq */
    a->band_lo = a->opts.window_left >= 0 ? Lk - Lq - a->opts.window_left : -MA_BAND_INF;
    a->band_hi = a->opts.window_right >= 0 ? Lk - Lq + a->opts.window_right : MA_BAND_INF;
    return q0;
}

static const ma_attn_fwd_params *FN(fwd_seq)(const ma_attn_fwd_params *p, int64_t b, ma_attn_fwd_params *loc) {
    if (!p->a.cu_q) return p;
    *loc = *p;
    int64_t k0;
    const int64_t q0 = FN(seq_args)(&loc->a, b, &k0);
    loc->out = (void *)FN(elem_at)(p->out, p->a.dtype, q0 * p->a.out_stride[2]);
    loc->out_lo = (void *)FN(elem_at)(p->out_lo, p->a.dtype, q0 * p->a.out_lo_stride[2]);
    loc->lse = (ACC *)p->lse + q0;
    return loc;
}

static const ma_attn_bwd_params *FN(bwd_seq)(const ma_attn_bwd_params *p, int64_t b, ma_attn_bwd_params *loc) {
    if (!p->a.cu_q) return p;
    *loc = *p;
    int64_t k0;
    const int64_t q0 = FN(seq_args)(&loc->a, b, &k0);
    const ma_dtype dt = p->a.dtype;
    loc->dq = (void *)FN(elem_at)(p->dq, dt, q0 * p->dq_stride[2]);
    loc->dk = (void *)FN(elem_at)(p->dk, dt, k0 * p->dk_stride[2]);
    loc->dv = (void *)FN(elem_at)(p->dv, dt, k0 * p->dv_stride[2]);
    loc->dout = FN(elem_at)(p->dout, dt, q0 * p->dout_stride[2]);
    loc->out = FN(elem_at)(p->out, dt, q0 * p->a.out_stride[2]);
    loc->out_lo = FN(elem_at)(p->out_lo, dt, q0 * p->a.out_lo_stride[2]);
    loc->lse = (const ACC *)p->lse + q0;
    loc->delta = (ACC *)p->delta + q0;
    return loc;
}

/* The offset of key row j of entry b in k (page_st = k_page_stride) or v
 * (v_page_stride), without the head's: j * st[2], or through the block table. */
static inline int64_t FN(key_off)(const ma_attn_args *a, const int64_t st[4], int64_t page_st, int64_t b, int64_t j) {
    if (!a->block_table) return j * st[2];
    return (int64_t)a->block_table[b * a->bt_stride + j / a->page_size] * page_st + (j % a->page_size) * st[2];
}

/* FN(head_cache) and FN(rows_in) for the keys or values of head (b, h) of
 * the forward: through FN(key_off) (paged: row by row; a key block never
 * crosses a page). */
static const ACC *FN(kv_head_cache)(const ma_attn_args *a, int64_t *tag, ACC *cache, const void *src,
                                    const int64_t st[4], int64_t page_st, int64_t b, int64_t h, int64_t ncol) {
    if (!a->block_table) return FN(head_cache)(tag, cache, src, FN(kv_dtype)(a), st, b, h, 1, a->Lk, ncol);
    const int64_t key = b * 65536 + h + 1;
    if (*tag != key) {
        for (int64_t r = 0; r < a->Lk; r++)
            FN(convert_row)(cache + r * ncol, 1, src, FN(kv_dtype)(a),
                            b * st[0] + h * st[1] + FN(key_off)(a, st, page_st, b, r), st[3], ncol, 1);
        *tag = key;
    }
    return cache;
}

static inline const ACC *FN(kv_rows_in)(const ma_attn_args *a, const void *src, const int64_t st[4], int64_t page_st,
                                        int64_t b, int64_t h, int64_t j0, const ACC *head_base, int64_t ncol,
                                        int64_t *ld) {
    if (!FN(needs_copy)(FN(kv_dtype)(a), st)) {
        *ld = st[2];
        return (const ACC *)src + b * st[0] + h * st[1] + FN(key_off)(a, st, page_st, b, j0);
    }
    *ld = ncol;
    return head_base + j0 * ncol;
}

/* 8-bit K, V (ma_attn_opts.k_scale): x[c * cs + r * rs] *= sc's scale of key j0 + c of head
 * (b, h), c < nc, r < nr; the keys' scales on their scores (sc = k_scale) or on P before
 * P V (v_scale). A key block lies in one page. Nothing without scales. */
static void FN(kv_scale)(ACC *x, int64_t rs, int64_t cs, int64_t nr, const ma_attn_args *a, const ma_mask *sc,
                         int64_t b, int64_t h, int64_t j0, int64_t nc) {
    if (!sc->ptr) return;
    const float *s = (const float *)sc->ptr + b * sc->stride[0] + h * sc->stride[1] +
                     FN(key_off)(a, sc->stride, sc->stride[3], b, j0);
    const int64_t st = sc->stride[2];
    if (cs == 1) /* rows of keys: the scales along each row */
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < nc; c++) x[r * rs + c] *= (ACC)s[c * st];
    else
        for (int64_t c = 0; c < nc; c++) {
            const ACC m = (ACC)s[c * st];
            for (int64_t r = 0; r < nr; r++) x[c * cs + r * rs] *= m;
        }
}

/* Work item w of the forward and the dq pass: (b, h, query block). Dense:
 * the blocks of head (b, h) in FN(interleave) order; varlen: the shim's table. */
static inline void FN(q_item)(const ma_attn_args *a, int64_t w, int64_t *b, int64_t *h, int64_t *qb) {
    if (a->q_items) {
        *b = a->q_items[3 * w], *h = a->q_items[3 * w + 1], *qb = a->q_items[3 * w + 2];
        return;
    }
    const int64_t nq = ma_cdiv(a->Lq, a->block_q);
    *b = w / (a->H * nq), *h = (w / nq) % a->H, *qb = FN(interleave)(w % nq, nq);
}

/* Work item w of the dkdv pass: (b, hkv, key block). */
static inline void FN(kv_item)(const ma_attn_args *a, int64_t w, int64_t *b, int64_t *hk, int64_t *kb) {
    if (a->kv_items) {
        *b = a->kv_items[3 * w], *hk = a->kv_items[3 * w + 1], *kb = a->kv_items[3 * w + 2];
        return;
    }
    const int64_t nk = ma_cdiv(a->Lk, a->block_k);
    *b = w / (a->Hkv * nk), *hk = (w / nk) % a->Hkv, *kb = FN(interleave)(w % nk, nk);
}

/* The online-softmax step after a key block, rows 0 .. nr: alpha[r] =
 * exp(m[r] - m_new[r]), exactly 1 where the max did not move and 0 where it
 * was -inf; l = alpha l + lsum; m = m_new. The exps go through EXP_SUB_SUM
 * (vectorised). Returns whether any row's max moved (some alpha != 1). */
static int FN(online_step)(ACC *m, const ACC *m_new, ACC *l, const ACC *lsum, ACC *alpha, int64_t nr) {
    int moved = 0;
    for (int64_t r = 0; r < nr; r++) {
        const int same = m_new[r] == m[r];
        alpha[r] = same ? 0 : m[r] - m_new[r];
        moved |= !same;
    }
    if (moved) (void)EXP_SUB_SUM(alpha, nr, 0);
    else
        for (int64_t r = 0; r < nr; r++) alpha[r] = 1;
    for (int64_t r = 0; r < nr; r++) {
        l[r] = alpha[r] * l[r] + lsum[r];
        m[r] = m_new[r];
    }
    return moved;
}

/* lse with -inf (fully masked row) replaced by 0: exp(-inf - 0) = 0. */
static inline ACC FN(finite_or_zero)(ACC x) { return x == -(ACC)INFINITY ? 0 : x; }

/* ---- forward ------------------------------------------------------------ */

/* C (m, n) = diag(rs) C: the online softmax's rescaling of the running output
 * (rows whose factor is 1 are left alone). */
static void FN(scale_rows)(ACC *C, int64_t ldc, int64_t m, int64_t n, const ACC *rs) {
    for (int64_t r = 0; r < m; r++)
        if (rs[r] != 1)
            for (int64_t d = 0; d < n; d++) C[r * ldc + d] *= rs[r];
}

typedef struct {
    ACC *qT, *sT, *o, *m, *m_new, *l, *lsum, *lse;
    ACC *kc, *vc; /* head caches (Lk, D), (Lk, Dv) when K, V need converting */
} FN(fwd_scratch);

/* One head's query block: scale * Q (the tile path: qT), O (nr, Dv), running max m and sum
 * l, its dropout (the decode kernel's rows: decode_tmpl.h). */
typedef struct {
    ACC *q, *o, *m, *l;
    const ma_dropout *dr;
    ma_dropout dr_buf;
} FN(fwd_head);

static FN(fwd_scratch) FN(fwd_carve)(void *scratch, const ma_attn_fwd_params *p) {
    const int64_t BQ = p->a.block_q, BK = p->a.block_k, D = p->a.D, Dv = p->a.Dv;
    FN(fwd_scratch) t;
    t.qT = (ACC *)((char *)scratch + MA_CACHE_LINE); /* after the header: (D, BQ) = scale * Q^T */
    t.sT = t.qT + D * BQ;            /* (BK, BQ) scores, then probabilities */
    t.o = t.sT + BK * BQ;            /* (BQ, Dv) */
    t.m = t.o + BQ * Dv;             /* (BQ) running max */
    t.m_new = t.m + BQ;              /* (BQ) */
    t.l = t.m_new + BQ;              /* (BQ) running sum */
    t.lsum = t.l + BQ;               /* (BQ) */
    t.lse = t.lsum + BQ;             /* (BQ) */
    t.kc = t.lse + BQ;               /* the head caches (FN(fwd_scratch_elems)) */
    t.vc = NULL;
    return t;
}

/* Elements of ACC after the header; caches included when K, V need converting. */
static inline size_t FN(fwd_scratch_elems)(const ma_attn_fwd_params *p) {
    const int64_t BQ = p->a.block_q, BK = p->a.block_k, D = p->a.D, Dv = p->a.Dv;
    return (size_t)(D * BQ + BK * BQ + BQ * Dv + 5 * BQ) +
           (size_t)((FN(needs_copy)(FN(kv_dtype)(&p->a), p->a.k_stride) ? p->a.Lk * D : 0) +
                    (FN(needs_copy)(FN(kv_dtype)(&p->a), p->a.v_stride) ? p->a.Lk * Dv : 0));
}

/* lsum[r] = sum of s[r * nc + c] over c = 0 .. nc in key order (as
 * EXP_SUB_COL sums a column), from 0. With the row count (up to 8)
 * a constant the partial sums stay in registers: nr chains of adds side by
 * side, where sums kept in lsum[] went through memory (a store and a reload
 * per key, ~10 cycles a key at nr = 1). Same additions, same order. */
static void FN(sum_rows_in_order)(const ACC *s, int64_t nc, int64_t nr, ACC *lsum) {
#define MA_SUM_ROWS(NR)                                         \
    case NR: {                                                  \
        ACC a[NR];                                              \
        for (int r = 0; r < NR; r++) a[r] = 0;                  \
        for (int64_t c = 0; c < nc; c++)                        \
            for (int r = 0; r < NR; r++) a[r] += s[r * nc + c]; \
        for (int r = 0; r < NR; r++) lsum[r] = a[r];            \
        return;                                                 \
    }
    // clang-format off
    switch (nr) {
        MA_SUM_ROWS(1) MA_SUM_ROWS(2) MA_SUM_ROWS(3) MA_SUM_ROWS(4)
        MA_SUM_ROWS(5) MA_SUM_ROWS(6) MA_SUM_ROWS(7) MA_SUM_ROWS(8)
    default:
        for (int64_t r = 0; r < nr; r++) lsum[r] = 0;
        for (int64_t c = 0; c < nc; c++)
            for (int64_t r = 0; r < nr; r++) lsum[r] += s[r * nc + c];
    }
    // clang-format on
#undef MA_SUM_ROWS
}

/* ---- tile hooks -------------------------------------------------------------
 *
 * The tile path of the forward and the single-pass backward do their matrix
 * products (and the packing of operands for them) through these steps. The
 * generic ones below (FN(gen_*)) call the instance's GEMM; an instance with
 * MA_TILE_HOOKS (AMX) defines FN(tiles_*) with the same meaning and its own
 * per-thread state FN(tiles), used whenever FN(tiles_apply)(p) (AMX: always
 * but with weights, which need every score again). Everything else (masks,
 * softmax, online rescaling, output and gradient lines, scheduling) is the
 * loops' own, written once below.
 *
 *   forward, per work item (b, h, query block i0..i0+nr):
 *     fwd_query(b, h, hk, i0, nr)    prepare K, V of head (b, hk) and the query block
 *     fwd_scores(sT, j0, nc, nr)     sT (nc, nr) = scale K Q^T          (before the bias)
 *     fwd_pv(o, alpha, sT, j0, nc)   O = diag(alpha) O + P V, P^T in sT (alpha NULL: 1);
 *                                    O in the step's own layout, zeroed by the loop
 *     fwd_o_rows(o)                  O as rows (nr, Dv)
 *     rows_scores(p, s, b, h, i0, nr, nh, k_off, nc, pf)
 *                                    the rows path's s (nh nr, nc) = scale Q K^T of a run's
 *                                    nh heads; returns 0 where it leaves them to DOT_ROWS
 *   single-pass backward, per (b, hkv), key block j0..j0+nc, query block i0..i0+nr of head g:
 *     bwd_group(b, hk)               prepare Q, dO of the G heads
 *     bwd_keys(b, hk, j0, nc)        prepare K, V of the key block; zero its dK, dV sums
 *     bwd_scores(s, g, h, i0, nr)    s (nr, nc) = scale Q K^T           (before the bias)
 *     bwd_dp(dp, g, h, i0, nr)       dp (nr, nc) = dO V^T
 *     bwd_accum(dq, g, h, i0, nr)    dK += dS^T Q, dV += (hm P)^T dO, dq (nr, D) += dS K,
 *                                    dS in t->dp, hm P in t->s (unscaled by scale: the stores scale)
 *     bwd_keys_end(nc)               dK, dV sums of the key block into t->dk (nc, D), t->dv (nc, Dv)
 */

/* Generic forward state: the converted head caches when K, V need converting. */
typedef struct {
    FN(fwd_scratch) * t;
    ma_scratch_header *hdr;
    const ma_attn_fwd_params *p;
    int64_t b, hk, nr;
    const ACC *k_bh, *v_bh;
} FN(gen_fwd);

static void FN(gen_fwd_query)(FN(gen_fwd) * g, int64_t b, int64_t h, int64_t hk, int64_t i0, int64_t nr) {
    const ma_attn_fwd_params *p = g->p;
    FN(fwd_scratch) *t = g->t;
    g->b = b, g->hk = hk, g->nr = nr;
    g->k_bh =
        FN(needs_copy)(FN(kv_dtype)(&p->a), p->a.k_stride)
            ? FN(kv_head_cache)(&p->a, &g->hdr->tag[0], t->kc, p->a.k, p->a.k_stride, p->a.k_page_stride, b, hk, p->a.D)
            : NULL;
    g->v_bh = FN(needs_copy)(FN(kv_dtype)(&p->a), p->a.v_stride)
                  ? FN(kv_head_cache)(&p->a, &g->hdr->tag[1], t->vc, p->a.v, p->a.v_stride, p->a.v_page_stride, b, hk,
                                      p->a.Dv)
                  : NULL;
    FN(load_tile_t)(t->qT, p->a.q, p->a.dtype, p->a.q_stride, b, h, i0, nr, p->a.D, (ACC)p->a.scale);
}

/* sT = K (scale Q)^T; a split diagonal tile: keys c0.. x queries ..c0 are left to the causal fill */
static void FN(gen_fwd_scores)(FN(gen_fwd) * g, ACC *sT, int64_t i0, int64_t j0, int64_t nc) {
    const ma_attn_fwd_params *p = g->p;
    const int64_t nr = g->nr, D = p->a.D;
    int64_t ldk;
    const ACC *k_j =
        FN(kv_rows_in)(&p->a, p->a.k, p->a.k_stride, p->a.k_page_stride, g->b, g->hk, j0, g->k_bh, D, &ldk);
    const int64_t w = FN(diag_split)(p->a.band_hi, p->a.block_q, p->a.block_k, i0, nr, j0, nc);
    if (w) { /* keys c0 .. c0 + w against queries c0 .. nr */
        for (int64_t c0 = 0; c0 < ma_min(nc, nr); c0 += w)
            GEMM(ma_min(w, nc - c0), nr - c0, D, k_j + c0 * ldk, ldk, 1, g->t->qT + c0, nr, sT + c0 * nr + c0, nr, 0);
    } else {
        GEMM(nc, nr, D, k_j, ldk, 1, g->t->qT, nr, sT, nr, 0);
    }
}

static void FN(gen_fwd_pv)(FN(gen_fwd) * g, ACC *o, const ACC *alpha, const ACC *sT, int64_t i0, int64_t j0,
                           int64_t nc) {
    const ma_attn_fwd_params *p = g->p;
    const int64_t nr = g->nr, Dv = p->a.Dv;
    int64_t ldv;
    const ACC *v_j =
        FN(kv_rows_in)(&p->a, p->a.v, p->a.v_stride, p->a.v_page_stride, g->b, g->hk, j0, g->v_bh, Dv, &ldv);
    const int64_t w = FN(diag_split)(p->a.band_hi, p->a.block_q, p->a.block_k, i0, nr, j0, nc);
    if (w) { /* queries r0 .. r0 + w against keys ..r0 + w */
        for (int64_t r0 = 0; r0 < nr; r0 += w)
            GEMM_ROWSCALE(ma_min(w, nr - r0), Dv, ma_min(nc, r0 + w), sT + r0, 1, nr, v_j, ldv, o + r0 * Dv, Dv,
                          alpha ? alpha + r0 : NULL);
    } else {
        GEMM_ROWSCALE(nr, Dv, nc, sT, 1, nr, v_j, ldv, o, Dv, alpha);
    }
}

static ACC *FN(gen_fwd_o_rows)(FN(gen_fwd) * g, ACC *o) {
    (void)g;
    return o;
}

#ifdef MA_TILE_HOOKS
typedef struct FN(tiles) FN(tiles);
static int FN(tiles_apply)(const ma_attn_fwd_params *p);
static size_t FN(tiles_fwd_scratch_bytes)(const ma_attn_fwd_params *p);
static void FN(tiles_fwd_begin)(FN(tiles) * *T, const ma_attn_fwd_params *p, FN(fwd_scratch) * t,
                                ma_scratch_header *hdr, void *extra);
static void FN(tiles_fwd_query)(FN(tiles) * T, int64_t b, int64_t h, int64_t hk, int64_t i0, int64_t nr);
static void FN(tiles_fwd_scores)(FN(tiles) * T, ACC *sT, int64_t i0, int64_t j0, int64_t nc);
static void FN(tiles_fwd_pv)(FN(tiles) * T, ACC *o, const ACC *alpha, const ACC *sT, int64_t i0, int64_t j0,
                             int64_t nc);
static ACC *FN(tiles_fwd_o_rows)(FN(tiles) * T, ACC *o);
static int FN(tiles_rows_scores)(FN(tiles) * T, const ma_attn_fwd_params *p, ACC *s, int64_t b, int64_t h, int64_t i0,
                                 int64_t nr, int64_t nh, int64_t k_off, int64_t nc, int64_t pf);
static void FN(tiles_end)(void);
#endif

/* A forward task's state: its scratch, the generic steps' state and, with
 * MA_TILE_HOOKS, whether the hooks take this call and their state. */
typedef struct {
    FN(fwd_scratch) t;
    FN(gen_fwd) gen; /* gen.t = &t */
#ifdef MA_TILE_HOOKS
    int hooked;
    FN(tiles) * tiles;
#endif
} FN(fwd_task);

/* step(args): the hooks' step when they apply to this call, else the generic one (c: the task) */
#ifdef MA_TILE_HOOKS
#define FWD_STEP(step, ...) \
    (c->hooked ? FN(tiles_fwd_##step)(c->tiles, __VA_ARGS__) : FN(gen_fwd_##step)(&c->gen, __VA_ARGS__))
#else
#define FWD_STEP(step, ...) FN(gen_fwd_##step)(&c->gen, __VA_ARGS__)
#endif
/* the rows step's scores on the hooks where they take them (FN(tiles_rows_scores) returns 1), else 0 */
#ifdef MA_TILE_HOOKS
#define ROWS_SCORES(...) (c->hooked && FN(tiles_rows_scores)(c->tiles, __VA_ARGS__))
#else
#define ROWS_SCORES(...) ((void)c, 0)
#endif

static size_t FN(generic_fwd_scratch_bytes)(const ma_attn_fwd_params *p) {
    return ma_round_up(MA_CACHE_LINE + FN(fwd_scratch_elems)(p) * sizeof(ACC), MA_CACHE_LINE);
}

static size_t FN(fwd_scratch_bytes)(const ma_attn_fwd_params *p) {
    size_t n = FN(generic_fwd_scratch_bytes)(p);
#ifdef MA_TILE_HOOKS
    if (FN(tiles_apply)(p)) n += FN(tiles_fwd_scratch_bytes)(p);
#endif
    return n;
}

/* A tile-path item's state in c->t: scale * Q packed (FWD_STEP(query)), m = -inf, l = 0,
 * O = 0, and its dropout. */
static void FN(fwd_item_begin)(FN(fwd_task) * c, const ma_attn_fwd_params *p, int64_t b, int64_t h, int64_t i0,
                               int64_t nr, FN(fwd_head) * e) {
    e->q = c->t.qT, e->o = c->t.o, e->m = c->t.m, e->l = c->t.l;
    e->dr = FN(head_dropout)(&p->a, b, h, &e->dr_buf);
    FWD_STEP(query, b, h, h / (p->a.H / p->a.Hkv), i0, nr);
    for (int64_t r = 0; r < nr; r++) {
        e->m[r] = -(ACC)INFINITY;
        e->l[r] = 0;
    }
    for (int64_t y = 0; y < nr * p->a.Dv; y++) e->o[y] = 0;
}

/* One key block j0 .. j0 + nc of the tile path (head h, query block i0 .. i0 + nr,
 * its state in c->t; ms its FN(mask_tile_state), not MA_TILE_BLOCKED). */
static void FN(fwd_tile_block)(FN(fwd_task) * c, const ma_attn_fwd_params *p, const ma_dropout *dr, int64_t b,
                               int64_t h, int64_t i0, int64_t nr, int64_t j0, int64_t nc, int ms) {
    FN(fwd_scratch) *t = &c->t;
    /* sT = K (scale Q)^T + bias^T */
    FWD_STEP(scores, t->sT, i0, j0, nc);
    FN(kv_scale)(t->sT, 1, nr, nr, &p->a, &p->a.opts.k_scale, b, h / (p->a.H / p->a.Hkv), j0, nc);
    FN(apply_softcap)(t->sT, nc * nr, p->a.opts.softcap, NULL);
    FN(add_bias)(t->sT, 1, nr, &p->a, ms, b, h, i0, nr, j0, nc);
    /* online softmax: m_new = max(m, colmax sT); P = exp(sT - m_new); l, O rescaled */
    for (int64_t r = 0; r < nr; r++) {
        t->m_new[r] = t->m[r];
        t->lsum[r] = 0;
    }
    COL_MAX(t->sT, nc, nr, t->m_new);
    EXP_SUB_COL(t->sT, nc, nr, t->m_new, t->lsum);
    /* alpha (in t->lse for now), or NULL where no row's max moved */
    const ACC *alpha = FN(online_step)(t->m, t->m_new, t->l, t->lsum, t->lse, nr) ? t->lse : NULL;
    /* dropout: l summed the whole P; O takes P' = P Z / (1 - p) */
    if (dr) DROPOUT(t->sT, NULL, 1, nr, nr, nc, dr, i0, j0);
    FN(kv_scale)(t->sT, 1, nr, nr, &p->a, &p->a.opts.v_scale, b, h / (p->a.H / p->a.Hkv), j0, nc);
    /* O = alpha O + P V */
    FWD_STEP(pv, t->o, alpha, t->sT, i0, j0, nc);
}

/* The end of head hx's query block (state e): out = hm * O / l; lse = m + log l.
 * A fully masked row (l = 0) gives 0 and -inf. With a sink (-inf: none):
 * l' = l exp(m - M) + exp(sink - M), M = max(m, sink); out = hm * exp(m - M) O / l',
 * lse = M + log l'; a fully masked row gives 0 and sink. Leaves lse, with -inf
 * as 0, in c->t.m_new for FN(fwd_weights). */
static void FN(fwd_head_end)(FN(fwd_task) * c, const ma_attn_fwd_params *p, const FN(fwd_head) * e, int64_t b,
                             int64_t hx, int64_t i0, int64_t nr, int by_rows) {
    FN(fwd_scratch) *t = &c->t;
    const int64_t Dv = p->a.Dv;
    const ACC hm = FN(head_scale)(&p->a.opts.head_mask, b, hx);
    const ACC sink = p->a.opts.sinks.ptr
                         ? LOAD(p->a.opts.sinks.ptr, p->a.opts.sinks.dtype, hx * p->a.opts.sinks.stride[0])
                         : -(ACC)INFINITY;
    ACC *lse_bh = (ACC *)p->lse + FN(stat_row0)(&p->a, b, hx);
    ACC *o = by_rows ? e->o : FWD_STEP(o_rows, t->o);
    for (int64_t r = 0; r < nr; r++) {
        ACC *o_r = o + r * Dv;
        if (e->l[r] == 0) {
            for (int64_t d = 0; d < Dv; d++) o_r[d] = 0;
            t->lse[r] = sink;
        } else if (sink != -(ACC)INFINITY) {
            const ACC M = e->m[r] >= sink ? e->m[r] : sink; /* NaN sink: NaN */
            const ACC a_m = EXPF(e->m[r] - M), l = e->l[r] * a_m + EXPF(sink - M);
            const ACC inv = hm * a_m / l;
            for (int64_t d = 0; d < Dv; d++) o_r[d] *= inv;
            t->lse[r] = M + LOG(l);
        } else {
            const ACC inv = hm / e->l[r];
            for (int64_t d = 0; d < Dv; d++) o_r[d] *= inv;
            t->lse[r] = e->m[r] + LOG(e->l[r]);
        }
        lse_bh[i0 + r] = t->lse[r];
        t->m_new[r] = FN(finite_or_zero)(t->lse[r]);
    }
    FN(store_tile)(p->out, p->a.dtype, p->a.out_stride, b, hx, i0, nr, Dv, o, 1, p->a.stream_stores);
    if (p->out_lo) FN(store_tile_lo)(p->out_lo, p->a.dtype, p->a.out_lo_stride, b, hx, i0, nr, Dv, o);
}

/* weights = hm * exp(S - lse) over every key of head h's query block, on
 * request only: never hooked, never in a run (by rows takes no weights).
 * The scores again, from c->t.qT; keys not read get weight 0. */
static void FN(fwd_weights)(FN(fwd_task) * c, const ma_attn_fwd_params *p, const ma_dropout *dr, int64_t b, int64_t h,
                            int64_t i0, int64_t nr, int64_t kv_begin, int64_t kv_end) {
    FN(fwd_scratch) *t = &c->t;
    const int64_t Lq = p->a.Lq, Lk = p->a.Lk, D = p->a.D, BK = p->a.block_k, hk = h / (p->a.H / p->a.Hkv);
    const ACC hm = FN(head_scale)(&p->a.opts.head_mask, b, h);
    const int64_t w_st[4] = {p->a.H * Lq * Lk, Lq * Lk, Lk, 1};
    for (int64_t j0 = 0; j0 < Lk; j0 += BK) {
        const int64_t nw = ma_min(BK, Lk - j0); /* weights written */
        int64_t nc =
            j0 >= kv_begin && j0 < kv_end ? FN(keys_read)(&p->a.key_padding_mask, b, j0, ma_min(nw, kv_end - j0)) : 0;
        const int ms = nc > 0 ? FN(mask_tile_state)(&p->a.attn_mask, b, h, i0, nr, j0, nc) : MA_TILE_BLOCKED;
        if (ms == MA_TILE_BLOCKED) nc = 0;
        if (nc > 0) {
            int64_t ldk;
            const ACC *k_j = FN(rows_in)(p->a.k, FN(kv_dtype)(&p->a), p->a.k_stride, b, hk, j0, c->gen.k_bh, D, &ldk);
            GEMM(nc, nr, D, k_j, ldk, 1, t->qT, nr, t->sT, nr, 0);
            FN(kv_scale)(t->sT, 1, nr, nr, &p->a, &p->a.opts.k_scale, b, hk, j0, nc);
            FN(apply_softcap)(t->sT, nc * nr, p->a.opts.softcap, NULL);
            FN(add_bias)(t->sT, 1, nr, &p->a, ms, b, h, i0, nr, j0, nc);
            EXP_SUB_COL(t->sT, nc, nr, t->m_new, t->lsum);
            if (dr) DROPOUT(t->sT, NULL, 1, nr, nr, nc, dr, i0, j0); /* the weights after dropout */
        }
        for (int64_t r = 0; r < nr; r++)
            for (int64_t col = 0; col < nw; col++)
                STORE(p->weights, p->a.dtype, b * w_st[0] + h * w_st[1] + (i0 + r) * w_st[2] + j0 + col,
                      col < nc ? hm * t->sT[col * nr + r] : 0);
    }
}

/* A forward task's set-up (its scratch, the generic steps' state, the hooks', whose scratch
 * starts tiles_at bytes into the task's) and end. */
static void FN(fwd_task_begin)(FN(fwd_task) * c, const ma_task_ctx *ctx, size_t tiles_at) {
    const ma_attn_fwd_params *p0 = (const ma_attn_fwd_params *)ctx->params;
    ma_scratch_header *hdr = (ma_scratch_header *)ctx->scratch;
    c->t = FN(fwd_carve)(ctx->scratch, p0);
    c->t.vc =
        c->t.kc + (FN(needs_copy)(FN(kv_dtype)(&p0->a), p0->a.k_stride) ? p0->a.Lk * p0->a.D : 0); /* the longest */
    c->gen = (FN(gen_fwd)){&c->t, hdr, p0, 0, 0, 0, NULL, NULL};
#ifdef MA_TILE_HOOKS
    c->hooked = FN(tiles_apply)(p0); /* varlen too: the hooks move to each item's entry (FN(fwd_seq)) */
    c->tiles = NULL;
    if (c->hooked) FN(tiles_fwd_begin)(&c->tiles, p0, &c->t, hdr, (char *)ctx->scratch + tiles_at);
#else
    (void)tiles_at;
#endif
}

static void FN(fwd_task_end)(FN(fwd_task) * c) {
#ifdef MA_TILE_HOOKS
    if (c->hooked) FN(tiles_end)();
#endif
    (void)c;
    FN(fence_streams)();
}

#include "decode_tmpl.h"

/* The forward task (the tile path): work items begin .. end (b, h, query block); per key block
 * of the item's range FN(fwd_tile_block), then the head's end (out, lse) and, on request, its
 * weights. Where the call also runs the decode kernel (a varlen batch with entries of at most
 * MA_DECODE_QROWS rows), those entries' items are the decode kernel's and skipped here. */
static void FN(attn_fwd)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_fwd_params *p0 = (const ma_attn_fwd_params *)ctx->params;
    FN(fwd_task) task, *c = &task;
    FN(fwd_task_begin)(c, ctx, FN(generic_fwd_scratch_bytes)(p0));
    const int64_t BQ = p0->a.block_q, BK = p0->a.block_k;
    for (int64_t w = begin; w < end; w++) {
        int64_t b, h, qb;
        FN(q_item)(&p0->a, w, &b, &h, &qb);
        ma_attn_fwd_params loc;
        const ma_attn_fwd_params *p = FN(fwd_seq)(p0, b, &loc); /* entry b's extent */
        if (p0->decode_splits > 0 && p->a.Lq <= MA_DECODE_QROWS) continue;
        c->gen.p = p;
        const int64_t i0 = qb * BQ, nr = ma_min(BQ, p->a.Lq - i0);
        int64_t kv_begin, kv_end;
        FN(kv_range)(&p->a, i0, nr, &kv_begin, &kv_end);
        FN(fwd_head) e;
        FN(fwd_item_begin)(c, p, b, h, i0, nr, &e);
        for (int64_t j0 = kv_begin; j0 < kv_end; j0 += BK) {
            const int64_t nc = FN(keys_read)(&p->a.key_padding_mask, b, j0, ma_min(BK, kv_end - j0));
            if (nc == 0) continue;
            const int ms = FN(mask_tile_state)(&p->a.attn_mask, b, h, i0, nr, j0, nc);
            if (ms != MA_TILE_BLOCKED) FN(fwd_tile_block)(c, p, e.dr, b, h, i0, nr, j0, nc, ms);
        }
        FN(fwd_head_end)(c, p, &e, b, h, i0, nr, 0);
        if (p->weights) FN(fwd_weights)(c, p, e.dr, b, h, i0, nr, kv_begin, kv_end);
    }
    FN(fwd_task_end)(c);
}
#undef FWD_STEP
#undef ROWS_SCORES

/* ---- backward ------------------------------------------------------------
 *
 * Forward lines, differentiated in reverse (per row i of head (b, h), with
 * g = dout, hm = head_mask[b, h], dW = dweights):
 *   3. out_i = hm * sum_j P_ij v_j,  weights_ij = hm * P_ij
 *        dv_j   += hm * P_ij * g_i
 *        dP_ij   = hm * (g_i . v_j + dW_ij)
 *        dhm    += sum_j P_ij (g_i . v_j + dW_ij)
 *   2. P_ij = exp(S_ij - lse_i)
 *        dS_ij   = P_ij (dP_ij - delta_i),  delta_i = sum_j P_ij dP_ij
 *                = g_i . out_i + hm * sum_j P_ij dW_ij
 *   1. S_ij = scale * q_i . k_j + bias_ij
 *        dq_i   += scale * sum_j dS_ij k_j
 *        dk_j   += scale * sum_i dS_ij q_i
 */

typedef struct {
    /* dq pass: transposed tiles (nc, nr) */
    ACC *qT, *gT, *kbuf, *sT, *dpT, *dq;
    /* dkdv pass: row tiles (nr, nc) */
    ACC *kT, *vT, *gbuf, *s, *dp, *dk, *dv;
    /* per query row */
    ACC *lse, *delta, *dhm, *tmp;
    ACC *z; /* (BQ, BK) dropout multipliers of a row-wise tile (DROPOUT's z form) */
    ACC *th; /* softcap's tanh of the tile's scores */
    ACC *extra;
} FN(bwd_scratch);

static FN(bwd_scratch) FN(bwd_carve)(void *scratch, int64_t BQ, int64_t BK, int64_t D, int64_t Dv) {
    FN(bwd_scratch) t;
    ACC *x = (ACC *)((char *)scratch + MA_CACHE_LINE); /* after the header */
    t.qT = x;
    x += D * BQ;   /* (D, BQ) scale * Q^T */
    t.gT = x;
    x += Dv * BQ;  /* (Dv, BQ) dO^T */
    t.kbuf = x;
    x += BK * D;   /* (BK, D) K rows converted, when not float */
    t.sT = x;
    x += BK * BQ;  /* (BK, BQ) */
    t.dpT = x;
    x += BK * BQ;  /* (BK, BQ) */
    t.dq = x;
    x += BQ * D;   /* (BQ, D) */
    t.kT = x;
    x += D * BK;   /* (D, BK) scale * K^T */
    t.vT = x;
    x += Dv * BK;  /* (Dv, BK) */
    t.gbuf = x;
    x += BQ * Dv;  /* (BQ, Dv) rows of dO and out, converted */
    t.s = x;
    x += BQ * BK;  /* (BQ, BK) */
    t.dp = x;
    x += BQ * BK;  /* (BQ, BK) */
    t.dk = x;
    x += BK * D;   /* (BK, D) */
    t.dv = x;
    x += BK * Dv;  /* (BK, Dv) */
    t.lse = x;
    x += BQ;
    t.delta = x;
    x += BQ;
    t.dhm = x;
    x += BQ;
    t.tmp = x;
    x += BQ;
    t.z = x;
    x += BQ * BK;
    t.th = x;
    x += BQ * BK;  /* (BQ, BK) or (BK, BQ): tanh of the capped scores (softcap) */
    t.extra = x;               /* the pass's own regions, see bwd_extra_elems */
    return t;
}

static inline size_t FN(bwd_scratch_elems)(int64_t BQ, int64_t BK, int64_t D, int64_t Dv) {
    return (size_t)(2 * D * BQ + 2 * Dv * BQ + 3 * BK * D + 2 * BK * Dv + 6 * BK * BQ + 4 * BQ);
}

/* Elements after the tiles that each backward pass carves from t.extra:
 *   dq pass    K, V head caches (Lk, D), (Lk, Dv)            if they need converting
 *   dkdv pass  Q, dO caches of the G heads (G, Lq, D), (G, Lq, Dv)   if they need converting
 *   single pass  dq (G, Lq, D), delta, lse, dhm (G, Lq), then the Q, dO caches,
 *              then the regions of key blocks 2 .. of a group (FN(bwd_key_slot_elems)) */
static inline int64_t FN(bwd_qg_cache_elems)(const ma_attn_bwd_params *p) {
    const int64_t G = p->a.H / p->a.Hkv;
    return (FN(needs_copy)(p->a.dtype, p->a.q_stride) ? G * p->a.Lq * p->a.D : 0) +
           (FN(needs_copy)(p->a.dtype, p->dout_stride) ? G * p->a.Lq * p->a.Dv : 0);
}

/* Key blocks the single pass holds at once (FN(attn_bwd_fused)):
 * p->key_group (ma_attn_bwd_key_group) up to MA_BWD_KEY_GROUP_MAX, where every
 * key block's query blocks start on one grid so that a query block's tiles
 * are visited together (a causal band with block_k a multiple of block_q, or
 * any other band); else 1, as with tile hooks (they keep one key block's
 * operands). */
static inline int64_t FN(bwd_key_group)(const ma_attn_bwd_params *p) {
#ifdef MA_TILE_HOOKS
    (void)p;
    return 1;
#else
    const int grid = p->a.band_hi != 0 || p->a.block_k % p->a.block_q == 0;
    return grid ? ma_max(1, ma_min(p->key_group, MA_BWD_KEY_GROUP_MAX)) : 1;
#endif
}

/* A key block's own regions in the single pass, for each block of the group after the first (whose are the tiles') */
static inline int64_t FN(bwd_key_slot_elems)(const ma_attn_bwd_params *p) {
    return p->a.block_k * (3 * p->a.D + 2 * p->a.Dv); /* kT, kbuf, dk (BK, D); vT, dv (BK, Dv) */
}

static inline size_t FN(bwd_extra_elems)(const ma_attn_bwd_params *p, int single_pass) {
    const int64_t G = p->a.H / p->a.Hkv;
    if (single_pass)
        return (size_t)(G * p->a.Lq * (p->a.D + 3) + FN(bwd_qg_cache_elems)(p) +
                        (FN(bwd_key_group)(p) - 1) * FN(bwd_key_slot_elems)(p));
    const int64_t kv = (FN(needs_copy)(p->a.dtype, p->a.k_stride) ? p->a.Lk * p->a.D : 0) +
                       (FN(needs_copy)(p->a.dtype, p->a.v_stride) ? p->a.Lk * p->a.Dv : 0);
    const int64_t qg = FN(bwd_qg_cache_elems)(p);
    return (size_t)(kv > qg ? kv : qg);
}

/* Bytes of a thread's backward scratch without the hooks' own; with tile
 * hooks the single pass needs no Q, dO caches (the hooks pack from rows). */
static size_t FN(generic_bwd_scratch_bytes)(const ma_attn_bwd_params *p) {
    const int single = ma_attn_bwd_single_pass(p);
    size_t n = FN(bwd_scratch_elems)(p->a.block_q, p->a.block_k, p->a.D, p->a.Dv) + FN(bwd_extra_elems)(p, single);
#ifdef MA_TILE_HOOKS
    if (single) n -= (size_t)FN(bwd_qg_cache_elems)(p);
#endif
    return ma_round_up(MA_CACHE_LINE + n * sizeof(ACC), MA_CACHE_LINE);
}

#ifdef MA_TILE_HOOKS
static size_t FN(tiles_bwd_scratch_bytes)(const ma_attn_bwd_params *p);
#endif

static size_t FN(bwd_scratch_bytes)(const ma_attn_bwd_params *p) {
    size_t n = FN(generic_bwd_scratch_bytes)(p);
#ifdef MA_TILE_HOOKS
    if (ma_attn_bwd_single_pass(p)) n += FN(tiles_bwd_scratch_bytes)(p);
#endif
    return n;
}

/* dW[b, h, i0 + r, j0 + c] added to dP at dp[r * rs + c * cs]. */
static void FN(add_dweights)(ACC *dp, int64_t rs, int64_t cs, const ma_attn_bwd_params *p, int64_t b, int64_t h,
                             int64_t i0, int64_t nr, int64_t j0, int64_t nc) {
    const int64_t *st = p->dweights_stride;
    for (int64_t r = 0; r < nr; r++) {
        const int64_t base = b * st[0] + h * st[1] + (i0 + r) * st[2] + j0 * st[3];
        for (int64_t c = 0; c < nc; c++) dp[r * rs + c * cs] += LOAD(p->dweights, p->a.dtype, base + c * st[3]);
    }
}

/* Row i of head (b, h) of the forward's output as it was before rounding,
 * out + out_lo (out alone without out_lo), into o (Dv) in ACC. */
static void FN(out_row)(const ma_attn_bwd_params *p, int64_t b, int64_t h, int64_t i, ACC *o, ACC *tmp) {
    const int64_t *st = p->a.out_stride, *ls = p->a.out_lo_stride, Dv = p->a.Dv;
    FN(convert_row)(o, 1, p->out, p->a.dtype, b * st[0] + h * st[1] + i * st[2], st[3], Dv, 1);
    if (!p->out_lo) return;
    FN(convert_row)(tmp, 1, p->out_lo, p->a.dtype, b * ls[0] + h * ls[1] + i * ls[2], ls[3], Dv, 1);
    for (int64_t d = 0; d < Dv; d++) o[d] += tmp[d];
}

/* dS = P (hm dP - delta) in place of dP, element (r, c) at [r * rs + c * cs];
 * dhm[r] += sum_c P dP when dhm is not NULL. */
static void FN(dscores)(ACC *dp, const ACC *pr, int64_t rs, int64_t cs, const ACC *delta, ACC *dhm, ACC hm, int64_t nr,
                        int64_t nc) {
    if (dhm)
        for (int64_t r = 0; r < nr; r++) {
            ACC acc = 0;
            for (int64_t c = 0; c < nc; c++) acc += pr[r * rs + c * cs] * dp[r * rs + c * cs];
            dhm[r] += acc;
        }
    if (cs == 1) { /* row-wise */
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < nc; c++) dp[r * rs + c] = pr[r * rs + c] * (hm * dp[r * rs + c] - delta[r]);
    } else { /* transposed: r is the inner, contiguous index */
        for (int64_t c = 0; c < nc; c++)
            for (int64_t r = 0; r < nr; r++) dp[c * cs + r] = pr[c * cs + r] * (hm * dp[c * cs + r] - delta[r]);
    }
}

/* dscores[b, h, i0 + r, j0 + c] = dS (r, c), at ds[r * rs + c * cs]: the gradient
 * of the scores, which is the gradient of an additive mask; overwrites. */
static void FN(store_dscores)(const ma_attn_bwd_params *p, const ACC *ds, int64_t rs, int64_t cs, int64_t b, int64_t h,
                              int64_t i0, int64_t nr, int64_t j0, int64_t nc) {
    ACC *out = (ACC *)p->dscores + ((b * p->a.H + h) * p->a.Lq + i0) * p->a.Lk + j0;
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++) out[r * p->a.Lk + c] = ds[r * rs + c * cs];
}

/* delta of rows i0 .. i0 + nr of head (b, h) (qT and gT loaded) into t->delta
 * and p->delta: g_i . (out_i + out_lo_i), plus hm * sum_j P_ij dW_ij where the
 * weights have a gradient (P from the scores again). t->lse gets the rows' lse,
 * -inf as 0. */
static void FN(dq_delta)(FN(bwd_scratch) * t, const ma_attn_bwd_params *p, const ACC *k_bh, ACC hm,
                         const ma_dropout *dr, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t kv_begin,
                         int64_t kv_end) {
    const int64_t D = p->a.D, Dv = p->a.Dv, BK = p->a.block_k, hk = h / (p->a.H / p->a.Hkv);
    const ACC *lse_bh = (const ACC *)p->lse + FN(stat_row0)(&p->a, b, h);
    ACC *delta_bh = (ACC *)p->delta + FN(stat_row0)(&p->a, b, h);
    for (int64_t r = 0; r < nr; r++) {
        t->lse[r] = FN(finite_or_zero)(lse_bh[i0 + r]);
        t->dhm[r] = 0;
        ACC *o_r = t->gbuf;
        FN(out_row)(p, b, h, i0 + r, o_r, t->gbuf + Dv);
        ACC dot = 0;
        for (int64_t d = 0; d < Dv; d++) dot += t->gT[d * nr + r] * o_r[d];
        t->delta[r] = dot;
    }
    if (p->dweights)
        for (int64_t j0 = kv_begin; j0 < kv_end; j0 += BK) {
            const int64_t nc = FN(keys_read)(&p->a.key_padding_mask, b, j0, ma_min(BK, kv_end - j0));
            if (nc == 0) continue;
            const int ms = FN(mask_tile_state)(&p->a.attn_mask, b, h, i0, nr, j0, nc);
            if (ms == MA_TILE_BLOCKED) continue;
            int64_t ldk;
            const ACC *k_j = FN(rows_in)(p->a.k, p->a.dtype, p->a.k_stride, b, hk, j0, k_bh, D, &ldk);
            GEMM(nc, nr, D, k_j, ldk, 1, t->qT, nr, t->sT, nr, 0);
            FN(apply_softcap)(t->sT, nc * nr, p->a.opts.softcap, NULL);
            FN(add_bias)(t->sT, 1, nr, &p->a, ms, b, h, i0, nr, j0, nc);
            EXP_SUB_COL(t->sT, nc, nr, t->lse, t->tmp);
            for (int64_t x = 0; x < nc * nr; x++) t->dpT[x] = 0;
            FN(add_dweights)(t->dpT, 1, nr, p, b, h, i0, nr, j0, nc);
            if (dr) DROPOUT(t->dpT, NULL, 1, nr, nr, nc, dr, i0, j0); /* P' dW = P (Z dW / (1 - p)) */
            for (int64_t r = 0; r < nr; r++) {
                ACC dot = 0;
                for (int64_t c = 0; c < nc; c++) dot += t->sT[c * nr + r] * t->dpT[c * nr + r];
                t->delta[r] += hm * dot;
            }
        }
    for (int64_t r = 0; r < nr; r++) delta_bh[i0 + r] = t->delta[r];
}

/* One key block j0 .. j0 + nc of the dq pass (ms: its mask state, not blocked):
 * P^T again, dS^T = P^T (hm dP^T - delta), dscores and dhm_rows where asked,
 * then t->dq += dS K. */
static void FN(dq_block)(FN(bwd_scratch) * t, const ma_attn_bwd_params *p, const ACC *k_bh, const ACC *v_bh, ACC hm,
                         const ma_dropout *dr, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t j0, int64_t nc,
                         int ms) {
    const int64_t D = p->a.D, Dv = p->a.Dv, hk = h / (p->a.H / p->a.Hkv);
    int64_t ldk, ldv;
    const ACC *k_j = FN(rows_in)(p->a.k, p->a.dtype, p->a.k_stride, b, hk, j0, k_bh, D, &ldk);
    const ACC *v_j = FN(rows_in)(p->a.v, p->a.dtype, p->a.v_stride, b, hk, j0, v_bh, Dv, &ldv);
    /* P^T = exp(K (scale Q)^T + bias^T - lse) */
    GEMM(nc, nr, D, k_j, ldk, 1, t->qT, nr, t->sT, nr, 0);
    FN(apply_softcap)(t->sT, nc * nr, p->a.opts.softcap, t->th);
    FN(add_bias)(t->sT, 1, nr, &p->a, ms, b, h, i0, nr, j0, nc);
    EXP_SUB_COL(t->sT, nc, nr, t->lse, t->tmp);
    /* dP^T = V dO^T (+ dW^T);  dS^T = P^T (hm dP^T - delta) */
    GEMM(nc, nr, Dv, v_j, ldv, 1, t->gT, nr, t->dpT, nr, 0);
    if (p->dweights) FN(add_dweights)(t->dpT, 1, nr, p, b, h, i0, nr, j0, nc);
    if (dr) DROPOUT(t->dpT, NULL, 1, nr, nr, nc, dr, i0, j0); /* dP = (dO V^T + dW) Z / (1 - p) */
    FN(dscores)(t->dpT, t->sT, 1, nr, t->delta, p->dhm_rows ? t->dhm : NULL, hm, nr, nc);
    if (p->dscores) FN(store_dscores)(p, t->dpT, 1, nr, b, h, i0, nr, j0, nc);
    FN(softcap_grad)(t->dpT, t->th, nc * nr, p->a.opts.softcap); /* through the cap: dS (1 - tanh^2) */
    /* dQ += dS K */
    GEMM(nr, D, nc, t->dpT, 1, nr, k_j, ldk, t->dq, D, 1);
}

/* Pass 1, work item (b, h, q-block): delta (FN(dq_delta)), then dq over the
 * block's key range (FN(dq_block)), stored with dhm_rows. */
static void FN(attn_bwd_dq)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_bwd_params *p0 = (const ma_attn_bwd_params *)ctx->params;
    const int64_t G = p0->a.H / p0->a.Hkv, D = p0->a.D, Dv = p0->a.Dv;
    const int64_t BQ = p0->a.block_q, BK = p0->a.block_k;
    FN(bwd_scratch) t = FN(bwd_carve)(ctx->scratch, BQ, BK, D, Dv);
    ma_scratch_header *hdr = (ma_scratch_header *)ctx->scratch;
    ACC *kc = t.extra, *vc = kc + (FN(needs_copy)(p0->a.dtype, p0->a.k_stride) ? p0->a.Lk * D : 0);

    for (int64_t w = begin; w < end; w++) {
        int64_t b, h, qb;
        FN(q_item)(&p0->a, w, &b, &h, &qb);
        ma_attn_bwd_params loc;
        const ma_attn_bwd_params *p = FN(bwd_seq)(p0, b, &loc); /* entry b's extent */
        const int64_t Lk = p->a.Lk, hk = h / G, i0 = qb * BQ, nr = ma_min(BQ, p->a.Lq - i0);
        int64_t kv_begin, kv_end;
        FN(kv_range)(&p->a, i0, nr, &kv_begin, &kv_end);
        const ACC hm = FN(head_scale)(&p->a.opts.head_mask, b, h);
        ma_dropout dr_buf;
        const ma_dropout *dr = FN(head_dropout)(&p->a, b, h, &dr_buf);
        const ACC *k_bh = FN(needs_copy)(p->a.dtype, p->a.k_stride)
                              ? FN(head_cache)(&hdr->tag[0], kc, p->a.k, p->a.dtype, p->a.k_stride, b, hk, 1, Lk, D)
                              : NULL;
        const ACC *v_bh = FN(needs_copy)(p->a.dtype, p->a.v_stride)
                              ? FN(head_cache)(&hdr->tag[1], vc, p->a.v, p->a.dtype, p->a.v_stride, b, hk, 1, Lk, Dv)
                              : NULL;
        FN(load_tile_t)(t.qT, p->a.q, p->a.dtype, p->a.q_stride, b, h, i0, nr, D, (ACC)p->a.scale);
        FN(load_tile_t)(t.gT, p->dout, p->a.dtype, p->dout_stride, b, h, i0, nr, Dv, 1);
        FN(dq_delta)(&t, p, k_bh, hm, dr, b, h, i0, nr, kv_begin, kv_end);

        for (int64_t x = 0; x < nr * D; x++) t.dq[x] = 0;
        for (int64_t j0 = kv_begin; j0 < kv_end; j0 += BK) {
            const int64_t nc = FN(keys_read)(&p->a.key_padding_mask, b, j0, ma_min(BK, kv_end - j0));
            if (nc == 0) continue;
            const int ms = FN(mask_tile_state)(&p->a.attn_mask, b, h, i0, nr, j0, nc);
            if (ms == MA_TILE_BLOCKED) continue; /* P = 0, dS = 0: dq, dhm unchanged, dscores stays 0 */
            FN(dq_block)(&t, p, k_bh, v_bh, hm, dr, b, h, i0, nr, j0, nc, ms);
        }
        FN(store_tile)(p->dq, p->a.dtype, p->dq_stride, b, h, i0, nr, D, t.dq, (ACC)p->a.scale, p->a.stream_stores);
        if (p->dhm_rows) {
            ACC *dhm_bh = (ACC *)p->dhm_rows + FN(stat_row0)(&p->a, b, h);
            for (int64_t r = 0; r < nr; r++) dhm_bh[i0 + r] = t.dhm[r];
        }
    }
    FN(fence_streams)();
}

/* One (query block, key block) tile of the row-wise backward, rows i0 .. i0 + nr
 * of head h against keys j0 .. j0 + nc, in three steps:
 *   products     s = Q (scale K^T),  dp = dO V^T              (gen_bwd_scores, gen_bwd_dp, or the hooks)
 *   FN(bwd_tile_softmax)   P = exp(s + bias - lse) in s;  dS = P (hm (dp + dW) - delta) in dp;  s = hm P
 *   products     dK += dS^T Q (times scale at the store),  dV += (hm P)^T dO,  and dQ += dS K in
 *                the single pass                            (gen_bwd_accum, or the hooks)
 * The generic products split a causal diagonal tile (FN(diag_split)) unless
 * dweights are read (their dP needs every entry). */
static inline int64_t FN(bwd_split)(const ma_attn_bwd_params *p, int64_t i0, int64_t nr, int64_t j0, int64_t nc) {
    return p->dweights ? 0 : FN(diag_split)(p->a.band_hi, p->a.block_q, p->a.block_k, i0, nr, j0, nc);
}

/* s (nr, nc) = Q kT: a split tile's rows r0 .. r0 + w x keys r0 + w.. are left to the causal fill (P = 0) */
static void FN(gen_bwd_scores_at)(const FN(bwd_scratch) * t, const ma_attn_bwd_params *p, int64_t i0, int64_t nr,
                                  int64_t j0, int64_t nc, const ACC *q_i, int64_t ldq) {
    const int64_t D = p->a.D, w = FN(bwd_split)(p, i0, nr, j0, nc);
    if (w) {
        for (int64_t r0 = 0; r0 < nr; r0 += w)
            GEMM(ma_min(w, nr - r0), ma_min(nc, r0 + w), D, q_i + r0 * ldq, ldq, 1, t->kT, nc, t->s + r0 * nc, nc, 0);
    } else {
        GEMM(nr, nc, D, q_i, ldq, 1, t->kT, nc, t->s, nc, 0);
    }
}

/* dp (nr, nc) = dO vT, the part a split tile skips zeroed */
static void FN(gen_bwd_dp_at)(const FN(bwd_scratch) * t, const ma_attn_bwd_params *p, int64_t i0, int64_t nr,
                              int64_t j0, int64_t nc, const ACC *g_i, int64_t ldg) {
    const int64_t Dv = p->a.Dv, w = FN(bwd_split)(p, i0, nr, j0, nc);
    if (w) {
        for (int64_t r0 = 0; r0 < nr; r0 += w) {
            const int64_t rw = ma_min(w, nr - r0), kc = ma_min(nc, r0 + w);
            GEMM(rw, kc, Dv, g_i + r0 * ldg, ldg, 1, t->vT, nc, t->dp + r0 * nc, nc, 0);
            for (int64_t r = r0; r < r0 + rw; r++)
                for (int64_t c = kc; c < nc; c++) t->dp[r * nc + c] = 0;
        }
    } else {
        GEMM(nr, nc, Dv, g_i, ldg, 1, t->vT, nc, t->dp, nc, 0);
    }
}

/* dK += dS^T Q, dV += (hm P)^T dO: in a split tile, keys c0 .. c0 + w take rows c0.. only */
static void FN(gen_bwd_dkdv_at)(const FN(bwd_scratch) * t, const ma_attn_bwd_params *p, int64_t i0, int64_t nr,
                                int64_t j0, int64_t nc, const ACC *q_i, int64_t ldq, const ACC *g_i, int64_t ldg) {
    const int64_t D = p->a.D, Dv = p->a.Dv, w = FN(bwd_split)(p, i0, nr, j0, nc);
    if (w) {
        for (int64_t c0 = 0; c0 < ma_min(nc, nr); c0 += w) {
            const int64_t cw = ma_min(w, nc - c0);
            GEMM(cw, D, nr - c0, t->dp + c0 * nc + c0, 1, nc, q_i + c0 * ldq, ldq, t->dk + c0 * D, D, 1);
            GEMM(cw, Dv, nr - c0, t->s + c0 * nc + c0, 1, nc, g_i + c0 * ldg, ldg, t->dv + c0 * Dv, Dv, 1);
        }
    } else {
        GEMM(nc, D, nr, t->dp, 1, nc, q_i, ldq, t->dk, D, 1);
        GEMM(nc, Dv, nr, t->s, 1, nc, g_i, ldg, t->dv, Dv, 1);
    }
}

/* The softmax lines of a row-wise tile, between the products: s holds the
 * scores, dp holds dO V^T; lse_r and delta_r are the tile's rows (lse with
 * -inf already 0); dhm_r gets the head mask's row sums when not NULL;
 * am_state is the tile's FN(mask_tile_state) (never MA_TILE_BLOCKED: the
 * loops skip those tiles). */
static void FN(bwd_tile_softmax)(ACC *s, ACC *dp, ACC *th, const ma_attn_bwd_params *p, int64_t b, int64_t h, ACC hm,
                                 int64_t i0, int64_t nr, int64_t j0, int64_t nc, int am_state, const ACC *lse_r,
                                 const ACC *delta_r, ACC *dhm_r, const ma_dropout *dr, ACC *z, int store_ds) {
    FN(apply_softcap)(s, nr * nc, p->a.opts.softcap, th);
    FN(add_bias)(s, nc, 1, &p->a, am_state, b, h, i0, nr, j0, nc);
    for (int64_t r = 0; r < nr; r++) (void)EXP_SUB_SUM(s + r * nc, nc, lse_r[r]);
    if (p->dweights) FN(add_dweights)(dp, nc, 1, p, b, h, i0, nr, j0, nc);
    if (dr) { /* one mask for both: dP' = dP Z / (1 - p) before dS, P' = P Z / (1 - p) after it */
        DROPOUT(NULL, z, nc, 1, nr, nc, dr, i0, j0);
        FN(apply_dropout)(dp, z, nr * nc);
    }
    FN(dscores)(dp, s, nc, 1, delta_r, dhm_r, hm, nr, nc);
    if (dr) FN(apply_dropout)(s, z, nr * nc);
    if (store_ds && p->dscores) FN(store_dscores)(p, dp, nc, 1, b, h, i0, nr, j0, nc);
    FN(softcap_grad)(dp, th, nr * nc, p->a.opts.softcap); /* through the cap: dS (1 - tanh^2) */
    if (hm != 1)
        for (int64_t x = 0; x < nr * nc; x++) s[x] *= hm;
}

/* The whole generic tile of the two-pass dkdv pass (kT, vT packed in t). */
static void FN(bwd_key_tile)(const FN(bwd_scratch) * t, const ma_attn_bwd_params *p, int64_t b, int64_t h, ACC hm,
                             int64_t i0, int64_t nr, int64_t j0, int64_t nc, int am_state, const ACC *q_i, int64_t ldq,
                             const ACC *g_i, int64_t ldg, const ACC *lse_r, const ACC *delta_r, ACC *dhm_r,
                             const ma_dropout *dr) {
    FN(gen_bwd_scores_at)(t, p, i0, nr, j0, nc, q_i, ldq);
    FN(gen_bwd_dp_at)(t, p, i0, nr, j0, nc, g_i, ldg);
    FN(bwd_tile_softmax)(t->s, t->dp, t->th, p, b, h, hm, i0, nr, j0, nc, am_state, lse_r, delta_r, dhm_r, dr, t->z, 0);
    FN(gen_bwd_dkdv_at)(t, p, i0, nr, j0, nc, q_i, ldq, g_i, ldg);
}

/* Pass 2, work item (b, hkv, k-block): dk and dv of its keys, summed over the
 * G query heads of the group and every query row that can see the block. */
static void FN(attn_bwd_dkdv)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_bwd_params *p0 = (const ma_attn_bwd_params *)ctx->params;
    const int64_t G = p0->a.H / p0->a.Hkv, D = p0->a.D, Dv = p0->a.Dv;
    const int64_t BQ = p0->a.block_q, BK = p0->a.block_k;
    FN(bwd_scratch) t = FN(bwd_carve)(ctx->scratch, BQ, BK, D, Dv);
    ma_scratch_header *hdr = (ma_scratch_header *)ctx->scratch;
    ACC *qc = t.extra, *gc = qc + (FN(needs_copy)(p0->a.dtype, p0->a.q_stride) ? G * p0->a.Lq * D : 0);

    for (int64_t w = begin; w < end; w++) {
        int64_t b, hk, kb;
        FN(kv_item)(&p0->a, w, &b, &hk, &kb);
        ma_attn_bwd_params loc;
        const ma_attn_bwd_params *p = FN(bwd_seq)(p0, b, &loc); /* entry b's extent */
        const int64_t Lq = p->a.Lq, Lk = p->a.Lk;
        const ACC *q_bg = FN(needs_copy)(p->a.dtype, p->a.q_stride)
                              ? FN(head_cache)(&hdr->tag[2], qc, p->a.q, p->a.dtype, p->a.q_stride, b, hk * G, G, Lq, D)
                              : NULL;
        const ACC *g_bg =
            FN(needs_copy)(p->a.dtype, p->dout_stride)
                ? FN(head_cache)(&hdr->tag[3], gc, p->dout, p->a.dtype, p->dout_stride, b, hk * G, G, Lq, Dv)
                : NULL;
        const int64_t j0 = kb * BK, nc_out = ma_min(BK, Lk - j0); /* rows of dk, dv written */
        const int64_t nc = FN(bwd_keys_read)(p, b, j0, nc_out);      /* keys read; the rest get 0 */
        for (int64_t x = 0; x < nc_out * D; x++) t.dk[x] = 0;
        for (int64_t x = 0; x < nc_out * Dv; x++) t.dv[x] = 0;

        if (nc > 0) {
            FN(load_tile_t)(t.kT, p->a.k, p->a.dtype, p->a.k_stride, b, hk, j0, nc, D, (ACC)p->a.scale);
            FN(load_tile_t)(t.vT, p->a.v, p->a.dtype, p->a.v_stride, b, hk, j0, nc, Dv, 1);
            /* queries i < j0 see none of these keys under the causal mask, nor those outside the band */
            int64_t i_begin, i_end;
            FN(q_range)(&p->a, j0, nc, &i_begin, &i_end);
            for (int64_t h = hk * G; h < (hk + 1) * G; h++) {
                const ACC hm = FN(head_scale)(&p->a.opts.head_mask, b, h);
                ma_dropout dr_buf;
                const ma_dropout *dr = FN(head_dropout)(&p->a, b, h, &dr_buf);
                const ACC *lse_bh = (const ACC *)p->lse + FN(stat_row0)(&p->a, b, h);
                const ACC *delta_bh = (const ACC *)p->delta + FN(stat_row0)(&p->a, b, h);
                const ACC *q_bh = q_bg ? q_bg + (h - hk * G) * Lq * D : NULL;
                const ACC *g_bh = g_bg ? g_bg + (h - hk * G) * Lq * Dv : NULL;
                for (int64_t i0 = i_begin; i0 < i_end; i0 += BQ) {
                    const int64_t nr = ma_min(BQ, Lq - i0);
                    const int ms = FN(mask_tile_state)(&p->a.attn_mask, b, h, i0, nr, j0, nc);
                    if (ms == MA_TILE_BLOCKED) continue; /* dS = 0, hm P = 0: dk, dv unchanged */
                    int64_t ldq, ldg;
                    const ACC *q_i = FN(rows_in)(p->a.q, p->a.dtype, p->a.q_stride, b, h, i0, q_bh, D, &ldq);
                    const ACC *g_i = FN(rows_in)(p->dout, p->a.dtype, p->dout_stride, b, h, i0, g_bh, Dv, &ldg);
                    for (int64_t r = 0; r < nr; r++) t.lse[r] = FN(finite_or_zero)(lse_bh[i0 + r]);
                    FN(bwd_key_tile)(&t, p, b, h, hm, i0, nr, j0, nc, ms, q_i, ldq, g_i, ldg, t.lse, delta_bh + i0,
                                     NULL, dr);
                }
            }
        }
        FN(store_tile)(p->dk, p->a.dtype, p->dk_stride, b, hk, j0, nc_out, D, t.dk, (ACC)p->a.scale,
                       p->a.stream_stores);
        FN(store_tile)(p->dv, p->a.dtype, p->dv_stride, b, hk, j0, nc_out, Dv, t.dv, 1, p->a.stream_stores);
    }
    FN(fence_streams)();
}

/* The per-row values of head (b, h) the single pass needs, rows 0 .. Lq:
 * delta_i = dout_i . out_i, lse_i (-inf -> 0) and dhm_i = 0; overwrites.
 * Rows are read in place when they are ACC with unit stride, else converted
 * into gbuf (2 Dv). The dot product runs in 8 interleaved partial sums. */
static void FN(delta_rows)(const ma_attn_bwd_params *p, int64_t b, int64_t h, ACC *gbuf, ACC *delta, ACC *lse,
                           ACC *dhm) {
    const int64_t Lq = p->a.Lq, Dv = p->a.Dv;
    const ACC *lse_bh = (const ACC *)p->lse + (b * p->a.H + h) * Lq;
    const int direct = FN(is_native)(p->a.dtype) && p->dout_stride[3] == 1 && p->a.out_stride[3] == 1 && !p->out_lo;
    for (int64_t i = 0; i < Lq; i++) {
        const int64_t g_off = b * p->dout_stride[0] + h * p->dout_stride[1] + i * p->dout_stride[2];
        const int64_t o_off = b * p->a.out_stride[0] + h * p->a.out_stride[1] + i * p->a.out_stride[2];
        const ACC *g_r = (const ACC *)p->dout + g_off, *o_r = (const ACC *)p->out + o_off;
        if (!direct) {
            FN(out_row)(p, b, h, i, gbuf + Dv, gbuf); /* gbuf: out_lo's row, then dout's */
            FN(convert_row)(gbuf, 1, p->dout, p->a.dtype, g_off, p->dout_stride[3], Dv, 1);
            g_r = gbuf, o_r = gbuf + Dv;
        }
        ACC part[8] = {0, 0, 0, 0, 0, 0, 0, 0}, dot = 0;
        int64_t d = 0;
        for (; d + 8 <= Dv; d += 8)
            for (int u = 0; u < 8; u++) part[u] += g_r[d + u] * o_r[d + u];
        for (; d < Dv; d++) dot += g_r[d] * o_r[d];
        for (int u = 0; u < 8; u++) dot += part[u];
        delta[i] = dot;
        lse[i] = FN(finite_or_zero)(lse_bh[i]);
        dhm[i] = 0;
    }
}

/* Generic single-pass state: the converted Q, dO caches of the group's heads
 * and the tile's rows in place (set by gen_bwd_scores, used by the later steps
 * of the same tile). */
typedef struct {
    FN(bwd_scratch) * t;
    ma_scratch_header *hdr;
    const ma_attn_bwd_params *p;
    ACC *qc, *gc;
    int64_t b, hk, j0, nc, ldk, ldq, ldg;
    const ACC *q_bg, *g_bg, *k_j, *q_i, *g_i;
} FN(gen_bwd);

#ifndef MA_TILE_HOOKS /* the generic steps (the hooks replace them in the tile instances) */
static void FN(gen_bwd_group)(FN(gen_bwd) * g, int64_t b, int64_t hk) {
    const ma_attn_bwd_params *p = g->p;
    const int64_t G = p->a.H / p->a.Hkv;
    g->b = b, g->hk = hk;
    g->q_bg = FN(needs_copy)(p->a.dtype, p->a.q_stride) ? FN(head_cache)(&g->hdr->tag[2], g->qc, p->a.q, p->a.dtype,
                                                                         p->a.q_stride, b, hk * G, G, p->a.Lq, p->a.D)
                                                        : NULL;
    g->g_bg = FN(needs_copy)(p->a.dtype, p->dout_stride)
                  ? FN(head_cache)(&g->hdr->tag[3], g->gc, p->dout, p->a.dtype, p->dout_stride, b, hk * G, G, p->a.Lq,
                                   p->a.Dv)
                  : NULL;
}

static void FN(gen_bwd_keys)(FN(gen_bwd) * g, int64_t j0, int64_t nc) {
    const ma_attn_bwd_params *p = g->p;
    FN(bwd_scratch) *t = g->t;
    g->j0 = j0, g->nc = nc;
    g->k_j = FN(rows)(p->a.k, p->a.dtype, p->a.k_stride, g->b, g->hk, j0, nc, p->a.D, t->kbuf, &g->ldk);
    FN(load_tile_t)(t->kT, p->a.k, p->a.dtype, p->a.k_stride, g->b, g->hk, j0, nc, p->a.D, (ACC)p->a.scale);
    FN(load_tile_t)(t->vT, p->a.v, p->a.dtype, p->a.v_stride, g->b, g->hk, j0, nc, p->a.Dv, 1);
}

static void FN(gen_bwd_scores)(FN(gen_bwd) * g, int64_t gi, int64_t h, int64_t i0, int64_t nr) {
    const ma_attn_bwd_params *p = g->p;
    const int64_t Lq = p->a.Lq;
    g->q_i = FN(rows_in)(p->a.q, p->a.dtype, p->a.q_stride, g->b, h, i0, g->q_bg ? g->q_bg + gi * Lq * p->a.D : NULL,
                         p->a.D, &g->ldq);
    g->g_i = FN(rows_in)(p->dout, p->a.dtype, p->dout_stride, g->b, h, i0, g->g_bg ? g->g_bg + gi * Lq * p->a.Dv : NULL,
                         p->a.Dv, &g->ldg);
    FN(gen_bwd_scores_at)(g->t, p, i0, nr, g->j0, g->nc, g->q_i, g->ldq);
}

static void FN(gen_bwd_dp)(FN(gen_bwd) * g, int64_t gi, int64_t h, int64_t i0, int64_t nr) {
    (void)gi, (void)h;
    FN(gen_bwd_dp_at)(g->t, g->p, i0, nr, g->j0, g->nc, g->g_i, g->ldg);
}

/* dK, dV as the dkdv pass; dQ += dS K (times scale at the store): rows r0 .. r0 + w of a split diagonal tile see keys ..r0 + w */
static void FN(gen_bwd_accum)(FN(gen_bwd) * g, ACC *dq_i, int64_t gi, int64_t h, int64_t i0, int64_t nr) {
    (void)gi, (void)h;
    const ma_attn_bwd_params *p = g->p;
    const FN(bwd_scratch) *t = g->t;
    const int64_t nc = g->nc, D = p->a.D, w = FN(bwd_split)(p, i0, nr, g->j0, nc);
    FN(gen_bwd_dkdv_at)(t, p, i0, nr, g->j0, nc, g->q_i, g->ldq, g->g_i, g->ldg);
    if (w) {
        for (int64_t r0 = 0; r0 < nr; r0 += w)
            GEMM(ma_min(w, nr - r0), D, ma_min(nc, r0 + w), t->dp + r0 * nc, nc, 1, g->k_j, g->ldk, dq_i + r0 * D, D,
                 1);
    } else {
        GEMM(nr, D, nc, t->dp, nc, 1, g->k_j, g->ldk, dq_i, D, 1);
    }
}

static void FN(gen_bwd_keys_end)(FN(gen_bwd) * g, int64_t nc) { (void)g, (void)nc; }
#endif

#ifdef MA_TILE_HOOKS
static void FN(tiles_bwd_begin)(FN(tiles) * *T, const ma_attn_bwd_params *p, FN(bwd_scratch) * t, void *extra);
static void FN(tiles_bwd_group)(FN(tiles) * T, int64_t b, int64_t hk);
static void FN(tiles_bwd_keys)(FN(tiles) * T, int64_t j0, int64_t nc);
static void FN(tiles_bwd_scores)(FN(tiles) * T, int64_t gi, int64_t h, int64_t i0, int64_t nr);
static void FN(tiles_bwd_dp)(FN(tiles) * T, int64_t gi, int64_t h, int64_t i0, int64_t nr);
static void FN(tiles_bwd_accum)(FN(tiles) * T, ACC *dq_i, int64_t gi, int64_t h, int64_t i0, int64_t nr);
static void FN(tiles_bwd_keys_end)(FN(tiles) * T, int64_t nc);
#endif

/* A single-pass task's state: the scratch of key block x of a group (tk[x]: tk[0]
 * the tiles' regions, the others their own kT, vT, kbuf, dk, dv), the generic
 * steps' state per key block, the group's per-row sums, and the hooks' state. */
typedef struct {
    FN(bwd_scratch) tk[MA_BWD_KEY_GROUP_MAX];
    FN(gen_bwd) gen[MA_BWD_KEY_GROUP_MAX]; /* gen[x].t = &tk[x] */
    ACC *dq_all; /* (G, Lq, D) */
    ACC *delta_all, *lse_all, *dhm_all; /* (G, Lq) each; lse with -inf as 0 */
#ifdef MA_TILE_HOOKS
    FN(tiles) * tiles;
#endif
} FN(fused_task);

/* A group of key blocks j0[x] = jg + x C BK of one (b, hkv), x < n: keys read
 * nc[x], query blocks [ib[x], ie[x]), and their union [i_lo, i_hi). */
typedef struct {
    int64_t n, j0[MA_BWD_KEY_GROUP_MAX], nc[MA_BWD_KEY_GROUP_MAX], ib[MA_BWD_KEY_GROUP_MAX], ie[MA_BWD_KEY_GROUP_MAX];
    int64_t i_lo, i_hi;
} FN(key_group);

/* step(args) of key block x (c: the task). The hooks take every single pass (it
 * never reads dweights) and hold one key block (FN(bwd_key_group) is 1): x is 0. */
#ifdef MA_TILE_HOOKS
#define BWD_STEP(step, x, ...) FN(tiles_bwd_##step)(c->tiles, __VA_ARGS__)
#else
#define BWD_STEP(step, x, ...) FN(gen_bwd_##step)(&c->gen[x], __VA_ARGS__)
#endif

/* Single pass, work item (b, hkv, key chunk c): the chunk's key blocks are
 * c, c + C, c + 2C, ... (C = kv_chunks), taken KG = FN(bwd_key_group) at a
 * time. For every query block of the G heads of the group (outer loop) and
 * every key block of the KG (inner loop), dk and dv of the key block
 * accumulate in its tiles while dq of every query of the group accumulates
 * in scratch, (G, Lq, D), or in chunk c's partial sums. So a query block's
 * Q, dO and dq rows serve KG key blocks while they are in cache. Each dq row
 * still sums its key blocks in key order and each dk, dv row its query
 * blocks in (head, query) order: the results are those of KG = 1, bit for
 * bit. 5 matrix products and one exp per tile instead of the two passes' 7
 * and two; chosen by shape alone (ma_attn_bwd_single_pass) so results never
 * depend on the thread count. No dweights here (the two passes handle them). */
static void FN(fused_carve)(FN(fused_task) * c, void *scratch, const ma_attn_bwd_params *p, int64_t KG) {
    const int64_t G = p->a.H / p->a.Hkv, Lq = p->a.Lq, D = p->a.D, Dv = p->a.Dv, BK = p->a.block_k;
    const FN(bwd_scratch) t = FN(bwd_carve)(scratch, p->a.block_q, BK, D, Dv);
    c->dq_all = t.extra;
    c->delta_all = c->dq_all + G * Lq * D;
    c->lse_all = c->delta_all + G * Lq;
    c->dhm_all = c->lse_all + G * Lq;
    ACC *qc = c->dhm_all + G * Lq, *gc = qc + (FN(needs_copy)(p->a.dtype, p->a.q_stride) ? G * Lq * D : 0);
    ACC *slot = gc + (FN(needs_copy)(p->a.dtype, p->dout_stride) ? G * Lq * Dv : 0);
    for (int64_t x = 0; x < KG; x++) {
        c->tk[x] = t;
        if (x > 0) {
            c->tk[x].kT = slot;
            slot += D * BK;
            c->tk[x].kbuf = slot;
            slot += BK * D;
            c->tk[x].dk = slot;
            slot += BK * D;
            c->tk[x].vT = slot;
            slot += Dv * BK;
            c->tk[x].dv = slot;
            slot += BK * Dv;
        }
        c->gen[x] = (FN(gen_bwd)){
            &c->tk[x], (ma_scratch_header *)scratch, p, qc, gc, 0, 0, 0, 0, 0, 0, 0, NULL, NULL, NULL, NULL, NULL};
    }
}

/* The group from key block jg of (b, hk) on: each block's dK, dV sums zeroed and its keys prepared. */
static void FN(fused_keys_begin)(FN(fused_task) * c, const ma_attn_bwd_params *p, int64_t b, int64_t jg, int64_t KG,
                                 FN(key_group) * k) {
    const int64_t Lk = p->a.Lk, D = p->a.D, Dv = p->a.Dv, BK = p->a.block_k, C = p->kv_chunks;
    k->i_lo = p->a.Lq, k->i_hi = 0;
    for (k->n = 0; k->n < KG && jg + k->n * C * BK < Lk; k->n++) {
        const int64_t x = k->n;
        k->j0[x] = jg + x * C * BK;
        const int64_t nc_out = ma_min(BK, Lk - k->j0[x]); /* rows of dk, dv written */
        k->nc[x] = FN(bwd_keys_read)(p, b, k->j0[x], nc_out); /* keys read; the rest get 0 */
        for (int64_t e = 0; e < nc_out * D; e++) c->tk[x].dk[e] = 0;
        for (int64_t e = 0; e < nc_out * Dv; e++) c->tk[x].dv[e] = 0;
        k->ib[x] = k->ie[x] = 0;
        if (k->nc[x] > 0) {
            BWD_STEP(keys, x, k->j0[x], k->nc[x]);
            FN(q_range)(&p->a, k->j0[x], k->nc[x], &k->ib[x], &k->ie[x]);
            if (k->ib[x] < k->ie[x]) k->i_lo = ma_min(k->i_lo, k->ib[x]), k->i_hi = ma_max(k->i_hi, k->ie[x]);
        }
    }
}

/* Every query block of the G heads against the group's key blocks: per tile the
 * scores, dP, the softmax's gradient, then dK, dV and dq (dq_acc, (G, Lq, D)). */
static void FN(fused_queries)(FN(fused_task) * c, const ma_attn_bwd_params *p, int64_t b, int64_t hk,
                              const FN(key_group) * k, ACC *dq_acc) {
    const int64_t G = p->a.H / p->a.Hkv, Lq = p->a.Lq, D = p->a.D, BQ = p->a.block_q;
    for (int64_t g = 0; g < G; g++) {
        const int64_t h = hk * G + g;
        const ACC hm = FN(head_scale)(&p->a.opts.head_mask, b, h);
        ma_dropout dr_buf;
        const ma_dropout *dr = FN(head_dropout)(&p->a, b, h, &dr_buf);
        for (int64_t i0 = k->i_lo; i0 < k->i_hi; i0 += BQ) { /* every ib[x] is on this grid (bwd_key_group) */
            const int64_t nr = ma_min(BQ, Lq - i0);
            for (int64_t x = 0; x < k->n; x++) {
                if (k->nc[x] <= 0 || i0 < k->ib[x] || i0 >= k->ie[x]) continue;
                const int ms = FN(mask_tile_state)(&p->a.attn_mask, b, h, i0, nr, k->j0[x], k->nc[x]);
                if (ms == MA_TILE_BLOCKED) continue; /* dS = 0, hm P = 0: nothing to add; dscores stays 0 */
                FN(bwd_scratch) *t = &c->tk[x];
                BWD_STEP(scores, x, g, h, i0, nr);
                BWD_STEP(dp, x, g, h, i0, nr);
                FN(bwd_tile_softmax)(t->s, t->dp, t->th, p, b, h, hm, i0, nr, k->j0[x], k->nc[x], ms,
                                     c->lse_all + g * Lq + i0, c->delta_all + g * Lq + i0,
                                     p->dhm_rows ? c->dhm_all + g * Lq + i0 : NULL, dr, t->z, 1);
                BWD_STEP(accum, x, dq_acc + (g * Lq + i0) * D, g, h, i0, nr);
            }
        }
    }
}

/* The group's dK, dV sums out (scaled), rows of keys not read as 0. */
static void FN(fused_keys_end)(FN(fused_task) * c, const ma_attn_bwd_params *p, int64_t b, int64_t hk,
                               const FN(key_group) * k) {
    for (int64_t x = 0; x < k->n; x++) {
        const int64_t nc_out = ma_min(p->a.block_k, p->a.Lk - k->j0[x]);
        if (k->nc[x] > 0) BWD_STEP(keys_end, x, k->nc[x]);
        FN(store_tile)(p->dk, p->a.dtype, p->dk_stride, b, hk, k->j0[x], nc_out, p->a.D, c->tk[x].dk, (ACC)p->a.scale,
                       p->a.stream_stores);
        FN(store_tile)(p->dv, p->a.dtype, p->dv_stride, b, hk, k->j0[x], nc_out, p->a.Dv, c->tk[x].dv, 1,
                       p->a.stream_stores);
    }
}

static void FN(attn_bwd_fused)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_bwd_params *p = (const ma_attn_bwd_params *)ctx->params;
    const int64_t H = p->a.H, Hkv = p->a.Hkv, G = p->a.H / p->a.Hkv, Lq = p->a.Lq, Lk = p->a.Lk, D = p->a.D;
    const int64_t BK = p->a.block_k, C = p->kv_chunks, KG = FN(bwd_key_group)(p);
    FN(fused_task) task, *c = &task;
    FN(fused_carve)(c, ctx->scratch, p, KG);
#ifdef MA_TILE_HOOKS
    c->tiles = NULL;
    FN(tiles_bwd_begin)(&c->tiles, p, &c->tk[0], (char *)ctx->scratch + FN(generic_bwd_scratch_bytes)(p));
#endif

    for (int64_t w = begin; w < end; w++) {
        const int64_t ch = w % C, b = w / C / Hkv, hk = (w / C) % Hkv;
        /* dq of the group's heads accumulates in this thread's scratch, or in chunk ch's partial sums */
        ACC *dq_acc = p->dq_part ? (ACC *)p->dq_part + ((ch * p->a.B + b) * H + hk * G) * Lq * D : c->dq_all;
        for (int64_t x = 0; x < KG; x++) BWD_STEP(group, x, b, hk); /* converts Q, dO once: the caches are shared */
        for (int64_t g = 0; g < G; g++)
            FN(delta_rows)(p, b, hk * G + g, c->tk[0].gbuf, c->delta_all + g * Lq, c->lse_all + g * Lq,
                           c->dhm_all + g * Lq);
        if (ch == 0 && p->a.opts.sinks.ptr) /* delta for ma_attn_bwd_sinks_grad */
            for (int64_t g = 0; g < G; g++)
                memcpy((ACC *)p->delta + FN(stat_row0)(&p->a, b, hk * G + g), c->delta_all + g * Lq, Lq * sizeof(ACC));
        for (int64_t x = 0; x < G * Lq * D; x++) dq_acc[x] = 0;

        for (int64_t jg = ch * BK; jg < Lk; jg += KG * C * BK) {
            FN(key_group) k;
            FN(fused_keys_begin)(c, p, b, jg, KG, &k);
            FN(fused_queries)(c, p, b, hk, &k, dq_acc);
            FN(fused_keys_end)(c, p, b, hk, &k);
        }
        for (int64_t g = 0; g < G; g++) {
            const int64_t h = hk * G + g;
            if (!p->dq_part)
                FN(store_tile)(p->dq, p->a.dtype, p->dq_stride, b, h, 0, Lq, D, dq_acc + g * Lq * D, (ACC)p->a.scale,
                               p->a.stream_stores);
            if (p->dhm_rows) {
                ACC *dhm_out = p->dhm_part ? (ACC *)p->dhm_part + ((ch * p->a.B + b) * H + h) * Lq
                                           : (ACC *)p->dhm_rows + (b * H + h) * Lq;
                for (int64_t i = 0; i < Lq; i++) dhm_out[i] = c->dhm_all[g * Lq + i];
            }
        }
    }
#ifdef MA_TILE_HOOKS
    FN(tiles_end)();
#endif
    FN(fence_streams)();
}
#undef BWD_STEP

/* After the single pass with C > 1 key chunks, work item (b, h, q-block):
 * dq = scale * sum_c dq_part[c] and dhm_rows = sum_c dhm_part[c], in chunk
 * order. */
static void FN(attn_bwd_reduce)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_bwd_params *p = (const ma_attn_bwd_params *)ctx->params;
    const int64_t H = p->a.H, Lq = p->a.Lq, D = p->a.D, BQ = p->a.block_q, nq = ma_cdiv(Lq, BQ), C = p->kv_chunks;
    const int64_t part_stride = p->a.B * H * Lq; /* rows per chunk */
    FN(bwd_scratch) t = FN(bwd_carve)(ctx->scratch, BQ, p->a.block_k, D, p->a.Dv);
    for (int64_t w = begin; w < end; w++) {
        const int64_t b = w / (H * nq), h = (w / nq) % H, i0 = (w % nq) * BQ, nr = ma_min(BQ, Lq - i0);
        const int64_t row0 = (b * H + h) * Lq + i0;
        const ACC *part = (const ACC *)p->dq_part;
        for (int64_t x = 0; x < nr * D; x++) t.dq[x] = part[row0 * D + x];
        for (int64_t c = 1; c < C; c++) {
            const ACC *part_c = part + (c * part_stride + row0) * D;
            for (int64_t x = 0; x < nr * D; x++) t.dq[x] += part_c[x];
        }
        FN(store_tile)(p->dq, p->a.dtype, p->dq_stride, b, h, i0, nr, D, t.dq, (ACC)p->a.scale, p->a.stream_stores);
        if (p->dhm_rows) {
            const ACC *dpart = (const ACC *)p->dhm_part;
            for (int64_t r = 0; r < nr; r++) {
                ACC acc = 0;
                for (int64_t c = 0; c < C; c++) acc += dpart[c * part_stride + row0 + r];
                ((ACC *)p->dhm_rows)[row0 + r] = acc;
            }
        }
    }
}

#undef ACC
#undef LOAD
#undef STORE
#undef LOG
#undef EXPF
#undef TANH
#undef GEMM
#undef GEMM_ROWSCALE
#undef EXP_SUB_SUM
#undef COL_MAX
#undef EXP_SUB_COL
#undef TRANSPOSE
#undef ROW_MAX
#undef DOT_KEYS_T
#undef DOT_ROWS
#undef AXPY_KEYS
#undef DROPOUT
#undef FN
#undef BLK
#undef MA_ACC_F64
#undef MA_TILE_HOOKS
