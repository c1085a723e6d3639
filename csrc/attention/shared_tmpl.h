/*
 * shared_tmpl.h -- what every algorithm of the template shares: the tiles (loads, stores,
 * conversions), the masks (where they are interpreted and applied), the sequences (varlen
 * entries, pages, key ranges).
 *
 * Part of attention_tmpl.h (included by it, first): FN, BLK, ACC and the blocks are
 * the instance's.
 */

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
    a->diagonal = Lk - Lq; /* bottom-right aligned */
    ma_attn_band(a->diagonal, a->opts.window_left, a->opts.window_right, &a->band_lo, &a->band_hi);
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
    loc->dhm_rows = p->dhm_rows ? (ACC *)p->dhm_rows + q0 : NULL;
    loc->kv_chunks = p->entry_chunks ? p->entry_chunks[2 * b] : 1; /* the single pass's, entry b's own */
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

/* Work item w of the forward, the dq pass and the single pass's reduce: (b, h,
 * query block). Dense: the blocks of head (b, h) in FN(interleave) order;
 * varlen: the plan's table. */
static inline void FN(q_item)(const ma_attn_args *a, int64_t w, int64_t *b, int64_t *h, int64_t *qb) {
    if (a->q_items) {
        *b = a->q_items[3 * w], *h = a->q_items[3 * w + 1], *qb = a->q_items[3 * w + 2];
        return;
    }
    const int64_t nq = ma_cdiv(a->Lq, a->block_q);
    *b = w / (a->H * nq), *h = (w / nq) % a->H, *qb = FN(interleave)(w % nq, nq);
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
