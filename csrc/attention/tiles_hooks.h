/*
 * tiles_hooks.h -- the template's tile hooks (forward_tmpl.h, "tile
 * hooks") on packed operands (tiles_layout.h), written once for the
 * instances that multiply bf16 pairs: amx.c and avx512bf16.c on x86
 * (packed by tiles_pack.h), svebf16.c on aarch64 (tiles_pack_mmla.h). The
 * instance defines TILE_ISA (its suffix: FN(name) is name_TILE_ISA) and
 * TILE_BLK (the suffix of the building blocks it takes: avx512, neon),
 * includes its packer, and defines before including this file:
 *
 *   tile_gemm(m, n, k, a, b, C, ldc, accumulate, terms)
 *       C (m, n) = [C +] A (m, k) @ B (k, n) from packed views, the products
 *       of the parts i + j < terms
 *   tile_begin(), tile_end()   a thread's products start and end (AMX: tile
 *       configuration and release)
 *   tile_precision(dt)         parts and terms per dtype (tiles_layout.h)
 *   tile_key_rows(...)         optional (TILE_KEY_ROWS, AMX): the rows path's scores with
 *       the key rows loaded as tiles where they lie (FN(tiles_rows_scores))
 *
 * The packer provides pack_a, pack_b, pack_a_bf16, pack_b_bf16, tile_a_keep_k
 * and i8_rows_bf16 (and pack_rows_as_b_bf16 where TILE_KEY_ROWS). Intrinsics live in the
 * instance and its packer only: this file is the instances' shared C. The loops, masks and softmax are attention_tmpl.h's; every
 * other building block is TILE_BLK's (blocks_simd.h). bfloat16 inputs (one
 * part, unit column stride) are packed straight from their rows (pack_a_bf16,
 * _b_bf16); others are converted to float32 rows and split (pack_a, _b).
 */
#define MA_TILE_CAT_(a, b) a##_##b
#define MA_TILE_CAT(a, b) MA_TILE_CAT_(a, b)
#define MA_TILE_HOOKS
#undef BLK /* the instance's, for blocks_simd.h */
#define FN(name) MA_TILE_CAT(name, TILE_ISA)
#define BLK(name) MA_TILE_CAT(name, TILE_BLK)
#include "attention_tmpl.h" /* which ends with #undef FN, BLK */
#define FN(name) MA_TILE_CAT(name, TILE_ISA)
#define BLK(name) MA_TILE_CAT(name, TILE_BLK)

/* tile_gemm where A is a view into a longer packed matrix (V^T of a whole
 * head) whose columns past k are other keys: A's last k tile is copied into
 * buf with those columns zeroed, so B's zero padding never meets them
 * (0 * inf would be NaN). */
static void tile_gemm_kclip(int64_t m, int64_t n, int64_t k, tile_view a, tile_view b, float *C, int64_t ldc,
                            int accumulate, int terms, uint16_t *buf) {
    const int64_t kfull = k / 32 * 32;
    if (kfull > 0) {
        tile_gemm(m, n, kfull, a, b, C, ldc, accumulate, terms);
        accumulate = 1;
    }
    if (kfull == k) return;
    const int64_t nmt = ma_cdiv(m, 16), rem = k - kfull;
    const tile_view ak = view_krows(a, kfull);
    for (int i = 0; i < a.parts; i++)
        for (int64_t mt = 0; mt < nmt; mt++)
            tile_a_keep_k(buf + (i * nmt + mt) * TILE_ELEMS, ak.p + i * a.part_stride + mt * a.os, rem);
    const tile_view at = view_layout(buf, nmt, 1, a.parts, 0);
    tile_gemm(m, n, rem, at, view_krows(b, kfull), C, ldc, accumulate, terms);
}

/* The product with float32 operands, as the other variants' GEMM block (the
 * C harness checks it with TERMS = 2 and 3): packs chunks of A and B on the stack. */
#define TILE_MC 64
#define TILE_KC 128
#define TILE_NC 64
static void tile_gemm_terms(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                            int64_t ldb, float *C, int64_t ldc, int accumulate, int terms) {
    uint16_t ap[TILE_PARTS * (TILE_MC / 16) * (TILE_KC / 32) * TILE_ELEMS] __attribute__((aligned(64)));
    uint16_t bp[TILE_PARTS * (TILE_NC / 16) * (TILE_KC / 32) * TILE_ELEMS] __attribute__((aligned(64)));
    if (k <= 0) {
        if (!accumulate)
            for (int64_t i = 0; i < m; i++) memset(C + i * ldc, 0, (size_t)n * sizeof(float));
        return;
    }
    tile_begin();
    for (int64_t i0 = 0; i0 < m; i0 += TILE_MC) {
        const int64_t mc = ma_min(TILE_MC, m - i0);
        for (int64_t p0 = 0; p0 < k; p0 += TILE_KC) {
            const int64_t kc = ma_min(TILE_KC, k - p0);
            const tile_view av = view_a_layout(ap, mc, kc, terms, 0);
            pack_a(av, A + i0 * ars + p0 * acs, ars, acs, mc, kc);
            for (int64_t j0 = 0; j0 < n; j0 += TILE_NC) {
                const int64_t nc = ma_min(TILE_NC, n - j0);
                const tile_view bv = view_b_layout(bp, kc, nc, terms, 0);
                pack_b(bv, B + p0 * ldb + j0, ldb, kc, nc);
                tile_gemm(mc, nc, kc, av, bv, C + i0 * ldc + j0, ldc, accumulate || p0 > 0, terms);
            }
        }
    }
    tile_end();
}

/* Carves n elements of T from *x, rounded up to a cache line. */
#define CARVE(T, x, n) ((T *)ma_carve((void **)(x), (size_t)(n) * sizeof(T)))
static inline void *ma_carve(void **x, size_t bytes) {
    void *p = *x;
    *x = (char *)*x + ma_round_up(bytes, MA_CACHE_LINE);
    return p;
}

/* src[b, h] from row r0 on as bfloat16 rows *ld elements apart, for the
 * packers that read it in place (pack_a_bf16, _b_bf16): a bfloat16 input
 * in one part with unit column stride. NULL otherwise: the float32 path. */
static const uint16_t *bf16_at(const void *src, ma_dtype dt, const int64_t st[4], int64_t b, int64_t h, int64_t r0,
                               int parts, int64_t *ld) {
    if (dt != MA_BF16 || parts != 1 || st[3] != 1) return NULL;
    *ld = st[2];
    return (const uint16_t *)src + b * st[0] + h * st[1] + r0 * st[2];
}

static inline void scale_inplace(float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

/* ---- forward hooks ----------------------------------------------------------
 * Per (b, hkv), once per thread: K as A (Lk, D) and V^T as A (Dv, Lk).
 * Per item (b, h, q-block): Q^T as B (D, nr). Per key block:
 *   sT (nc, nr) = K Q^T, times scale        (fwd_scores)
 *   oT (Dv, nr) = alpha oT + V^T P^T        (fwd_pv; P^T = sT packed as B)
 * O is kept transposed, oT, and turned into rows by fwd_o_rows. */
typedef struct {
    uint16_t *ka, *vta, *qb, *pb, *clip;
    float *rows;
    uint16_t *rq, *rk; /* the rows path's Q^T as B and its last partial tiles of keys as A */
    float *rst;        /* its S^T (BK, 16) */
} fwd_tile_scratch;

/* ---- backward hooks -----------------------------------------------------------
 * dk, dv accumulate transposed, so that P and dS are packed from rows only:
 *   per (b, hkv), for each of the G heads: Q as A (Lq, D), Q^T as A (D, Lq),
 *     dO as A (Lq, Dv), dO^T as A (Dv, Lq)                       (bwd_group)
 *   per key block: K^T as B (D, nc), V^T as B (Dv, nc), K as B (nc, D)   (bwd_keys)
 *   per tile:  s = scale Q K^T;  dP = dO V^T                    (bwd_scores, bwd_dp)
 *              dK^T += Q^T dS,  dQ += dS K,  dV^T += dO^T (hm P)  (bwd_accum) */
typedef struct {
    uint16_t *qa, *qta, *ga, *gta, *ktb, *vtb, *kb, *pb, *dsb, *dsa;
    float *rows;
} bwd_tile_scratch;

/* One thread's hook state, carved at the start of its hooks' scratch. */
struct FN(tiles) {
    tile_prec pr;
    int64_t b, hk, nr, j0, nc;
    /* forward: fp the params of the item's entry (varlen: FN(fwd_seq)'s copy in
     * loc, moved to entry b; dense: the call's, fp0) */
    const ma_attn_fwd_params *fp, *fp0;
    ma_attn_fwd_params loc;
    FN(fwd_scratch) * ft;
    ma_scratch_header *hdr;
    fwd_tile_scratch fa;
    tile_view ka, vta, qb, pb;
    int rows_k; /* the rows path may take its scores on the tiles (FN(tiles_rows_scores)) */
    /* backward: bp the params of the item's entry (varlen: FN(bwd_seq)'s copy in
     * bloc, moved to entry b; dense: the call's, bp0) */
    const ma_attn_bwd_params *bp, *bp0;
    ma_attn_bwd_params bloc;
    FN(bwd_scratch) * bt;
    bwd_tile_scratch ba;
    tile_view ktb, vtb, kb, pbb, dsb, dsa;
    float *dkT, *dvT; /* (D, nc), (Dv, nc): in t->kT, t->vT, after packing K^T and V^T from them */
};

/* The forward's precision: the instance's, except that a bfloat16 call with
 * no backward to follow (no out_lo, masked_attn.h) takes P in one part, as
 * native's flash kernel rounds it: P V is then one product. Its error stays
 * within the 2x rule on the output (docs/design.md, section 6); a backward
 * needs the second part, since its delta comes from the forward's o. */
static tile_prec fwd_precision(const ma_attn_fwd_params *p) {
    tile_prec pr = tile_precision(p->a.dtype);
    if (p->a.dtype == MA_BF16 && !p->out_lo) pr.pd = 1;
    return pr;
}

static size_t fwd_tile_bytes(const ma_attn_fwd_params *p, fwd_tile_scratch *t, void *base) {
    const tile_prec pr = fwd_precision(p);
    const int64_t BQ = p->a.block_q, BK = p->a.block_k, D = p->a.D, Dv = p->a.Dv;
    void *x = base;
    fwd_tile_scratch s;
    s.ka = CARVE(uint16_t, &x, pr.in *packed_a_elems(p->a.Lk, D));
    s.vta = CARVE(uint16_t, &x, pr.in *packed_a_elems(Dv, p->a.Lk));
    s.qb = CARVE(uint16_t, &x, pr.in *packed_b_elems(D, BQ));
    s.pb = CARVE(uint16_t, &x, pr.pd *packed_b_elems(BK, BQ));
    s.clip = CARVE(uint16_t, &x, pr.in *ma_cdiv(Dv, 16) * TILE_ELEMS);
    s.rows = CARVE(float, &x, (BQ > BK ? BQ : BK) * (D > Dv ? D : Dv)); /* K, V rows; out rows */
    s.rq = CARVE(uint16_t, &x, packed_b_elems(D, 16));
    s.rk = CARVE(uint16_t, &x, 16 * D);
    s.rst = CARVE(float, &x, ma_round_up(BK, 16) * 16);
    if (t) *t = s;
    return (size_t)((char *)x - (char *)base);
}

/* Every forward call but one asking for the weights, which need every score again: the
 * generic products. */
static int FN(tiles_apply)(const ma_attn_fwd_params *p) { return !p->weights; }

static size_t FN(tiles_fwd_scratch_bytes)(const ma_attn_fwd_params *p) {
    return ma_round_up(sizeof(struct FN(tiles)), MA_CACHE_LINE) + fwd_tile_bytes(p, NULL, NULL);
}

static void FN(tiles_fwd_begin)(FN(tiles) * *T, const ma_attn_fwd_params *p, FN(fwd_scratch) * t,
                                ma_scratch_header *hdr, void *extra) {
    FN(tiles) *s = (FN(tiles) *)extra;
    const int64_t BQ = p->a.block_q, BK = p->a.block_k;
    s->pr = fwd_precision(p);
    s->fp = s->fp0 = p, s->ft = t, s->hdr = hdr;
    fwd_tile_bytes(p, &s->fa, (char *)extra + ma_round_up(sizeof(struct FN(tiles)), MA_CACHE_LINE));
    s->ka = view_a_layout(s->fa.ka, p->a.Lk, p->a.D, s->pr.in, 0);
    s->vta = view_a_layout(s->fa.vta, p->a.Dv, p->a.Lk, s->pr.in, 1);
    s->qb = view_b_layout(s->fa.qb, p->a.D, BQ, s->pr.in, 0);
    s->pb = view_b_layout(s->fa.pb, BK, BQ, s->pr.pd, 0);
    s->rows_k = p->a.dtype == MA_BF16 && s->pr.in == 1 && p->a.q_stride[3] == 1 && p->a.D % 32 == 0;
    tile_begin();
    *T = s;
}

/* Rows r0 .. r0 + n of a head's K as A and V^T as A, from k_r, v_r: row r0 of
 * each, the rest k_stride[2], v_stride[2] apart (r0 a multiple of 32). bfloat16
 * K stored transposed (k_stride[2] = 1: keys side by side, each element
 * k_stride[3] apart, the serving cache's K^T pages) is packed as it lies too. */
static void fwd_pack_rows(FN(tiles) * s, const void *k_r, const void *v_r, int64_t r0, int64_t n) {
    const ma_attn_args *a = &s->fp->a;
    const int64_t D = a->D, Dv = a->Dv, BK = a->block_k;
    int64_t ldk = 0, ldv = 0;
    const ma_dtype kvt = FN(kv_dtype)(a); /* int8: converted (exactly) to float32 rows, then packed */
    const uint16_t *kx = bf16_at(k_r, kvt, a->k_stride, 0, 0, 0, s->pr.in, &ldk);
    const uint16_t *vx = bf16_at(v_r, kvt, a->v_stride, 0, 0, 0, s->pr.in, &ldv);
    const int k_t = !kx && kvt == MA_BF16 && s->pr.in == 1 && a->k_stride[2] == 1;
    if (k_t) kx = (const uint16_t *)k_r, ldk = a->k_stride[3];
    if (kx && vx) {
        pack_a_bf16(view_rows(s->ka, r0), kx, ldk, n, D, k_t);
        pack_a_bf16(view_krows(s->vta, r0), vx, ldv, Dv, n, 1);
    } else if (kvt == MA_I8 && s->pr.in == 1) /* bfloat16 rows of the integers, packed as bfloat16 inputs are */
        for (int64_t r1 = 0; r1 < n; r1 += BK) {
            const int64_t nr = ma_min(BK, n - r1);
            uint16_t *rows = (uint16_t *)s->fa.rows; /* room for 2 (BK, max(D, Dv)) bfloat16 blocks */
            if (a->k_stride[2] == 1) { /* K^T pages: D rows of the nr keys, converted as they lie */
                const int64_t kt_stride[4] = {0, 0, a->k_stride[3], 1};
                i8_rows_bf16(rows, (const int8_t *)k_r + r1, kt_stride, D, nr);
                pack_a_bf16(view_rows(s->ka, r0 + r1), rows, nr, nr, D, 1);
            } else {
                i8_rows_bf16(rows, (const int8_t *)k_r + r1 * a->k_stride[2], a->k_stride, nr, D);
                pack_a_bf16(view_rows(s->ka, r0 + r1), rows, D, nr, D, 0);
            }
            i8_rows_bf16(rows, (const int8_t *)v_r + r1 * a->v_stride[2], a->v_stride, nr, Dv);
            pack_a_bf16(view_krows(s->vta, r0 + r1), rows, Dv, Dv, nr, 1);
        }
    else
        for (int64_t r1 = 0; r1 < n; r1 += BK) {
            const int64_t nr = ma_min(BK, n - r1);
            int64_t ld;
            const float *k1 = FN(rows)(k_r, kvt, a->k_stride, 0, 0, r1, nr, D, s->fa.rows, &ld);
            pack_a(view_rows(s->ka, r0 + r1), k1, ld, 1, nr, D);
            const float *v1 = FN(rows)(v_r, kvt, a->v_stride, 0, 0, r1, nr, Dv, s->fa.rows, &ld);
            pack_a(view_krows(s->vta, r0 + r1), v1, 1, ld, Dv, nr);
        }
}

/* Packs K rows as A and V^T as A of head (b, hk) of the item's entry (s->fp:
 * varlen, entry b's rows and its Lk; the views are laid out for the longest,
 * p0's Lk, the scratch's size), unless this thread's cache holds them:
 * tag[0] = b * Hkv + hk + 1, one value per (entry, kv head), in the header the
 * shim zeroes before every call. Rows go by runs that are uniformly strided:
 * the whole head, or (paged) page by page through FN(key_off), a page holding
 * a multiple of 64 rows (so every run starts on a whole tile). */
static void fwd_pack_head(FN(tiles) * s, int64_t b, int64_t hk) {
    const ma_attn_args *a = &s->fp->a;
    const int64_t key = b * a->Hkv + hk + 1, Lk = a->Lk;
    if (s->hdr->tag[0] == key) return;
    const int64_t run = a->block_table ? a->page_size : Lk;
    for (int64_t r0 = 0; r0 < Lk; r0 += run) {
        const void *k_r = FN(elem_at)(a->k, FN(kv_dtype)(a),
                                      b * a->k_stride[0] + hk * a->k_stride[1] +
                                          FN(key_off)(a, a->k_stride, a->k_page_stride, b, r0));
        const void *v_r = FN(elem_at)(a->v, FN(kv_dtype)(a),
                                      b * a->v_stride[0] + hk * a->v_stride[1] +
                                          FN(key_off)(a, a->v_stride, a->v_page_stride, b, r0));
        fwd_pack_rows(s, k_r, v_r, r0, ma_min(run, Lk - r0));
    }
    s->hdr->tag[0] = key;
}

static void FN(tiles_fwd_query)(FN(tiles) * s, int64_t b, int64_t h, int64_t hk, int64_t i0, int64_t nr) {
    const ma_attn_fwd_params *p = s->fp = FN(fwd_seq)(s->fp0, b, &s->loc); /* entry b's extent */
    s->b = b, s->hk = hk, s->nr = nr;
    fwd_pack_head(s, b, hk);
    int64_t ldq = 0;
    const uint16_t *qx = bf16_at(p->a.q, p->a.dtype, p->a.q_stride, b, h, i0, s->pr.in, &ldq);
    if (qx) {
        pack_b_bf16(s->qb, qx, ldq, p->a.D, nr, 1);
        return;
    }
    FN(load_tile_t)(s->ft->qT, p->a.q, p->a.dtype, p->a.q_stride, b, h, i0, nr, p->a.D, 1);
    pack_b(s->qb, s->ft->qT, nr, p->a.D, nr);
}

/* A tile (i0, nr) x (j0, nc) that the band's upper bound (causal) cuts: its
 * products go by blocks of BAND_BLOCK queries (or keys), each over the keys
 * one of them can see (band_keys). The band then overwrites every score left
 * out with -inf (attention_tmpl.h, add_bias), and P is 0 there. */
#define BAND_BLOCK 32
static inline int band_cuts(const ma_attn_args *a, int64_t i0, int64_t j0, int64_t nc) {
    return a->band_hi < MA_BAND_INF && j0 + nc - 1 - i0 > a->band_hi;
}

/* The first keys of (j0, nc) that queries i0 + c0 .. i0 + c0 + w - 1 can see
 * (j - i <= band_hi); every later key is hidden from all of them. */
static inline int64_t band_keys(const ma_attn_args *a, int64_t i0, int64_t c0, int64_t w, int64_t j0, int64_t nc) {
    return ma_max(0, ma_min(nc, i0 + c0 + w + a->band_hi - j0));
}

/* band_keys rounded up to whole k tiles of 32 keys (at most nc), for products over the keys. */
static inline int64_t band_ktiles(const ma_attn_args *a, int64_t i0, int64_t c0, int64_t w, int64_t j0, int64_t nc) {
    return ma_min(nc, ma_cdiv(band_keys(a, i0, c0, w, j0, nc), 32) * 32);
}

static void FN(tiles_fwd_scores)(FN(tiles) * s, float *sT, int64_t i0, int64_t j0, int64_t nc) {
    const ma_attn_args *a = &s->fp->a;
    const int64_t nr = s->nr;
    if (!band_cuts(a, i0, j0, nc)) tile_gemm(nc, nr, a->D, view_rows(s->ka, j0), s->qb, sT, nr, 0, s->pr.terms);
    else
        for (int64_t c0 = 0; c0 < nr; c0 += BAND_BLOCK) {
            const int64_t w = ma_min(BAND_BLOCK, nr - c0), m = band_keys(a, i0, c0, w, j0, nc);
            if (m > 0) tile_gemm(m, w, a->D, view_rows(s->ka, j0), view_rows(s->qb, c0), sT + c0, nr, 0, s->pr.terms);
        }
    scale_inplace(sT, nc * nr, (float)a->scale);
}

static void FN(tiles_fwd_pv)(FN(tiles) * s, float *oT, const float *alpha, const float *sT, int64_t i0, int64_t j0,
                             int64_t nc) {
    const ma_attn_args *a = &s->fp->a;
    const int64_t nr = s->nr, Dv = a->Dv;
    if (alpha)
        for (int64_t d = 0; d < Dv; d++)
            for (int64_t r = 0; r < nr; r++) oT[d * nr + r] *= alpha[r];
    pack_b(s->pb, sT, nr, nc, nr);
    const tile_view vt = view_krows(s->vta, j0);
    if (!band_cuts(a, i0, j0, nc)) {
        tile_gemm_kclip(Dv, nr, nc, vt, s->pb, oT, nr, 1, s->pr.terms, s->fa.clip);
        return;
    }
    for (int64_t c0 = 0; c0 < nr; c0 += BAND_BLOCK) { /* keys past band_keys have P = 0: whole k tiles left out */
        const int64_t w = ma_min(BAND_BLOCK, nr - c0), k = band_ktiles(a, i0, c0, w, j0, nc);
        if (k == nc) tile_gemm_kclip(Dv, w, nc, vt, view_rows(s->pb, c0), oT + c0, nr, 1, s->pr.terms, s->fa.clip);
        else if (k > 0) tile_gemm(Dv, w, k, vt, view_rows(s->pb, c0), oT + c0, nr, 1, s->pr.terms);
    }
}

static float *FN(tiles_fwd_o_rows)(FN(tiles) * s, float *oT) {
    BLK(transpose)(s->fa.rows, oT, s->nr, s->fp->a.Dv, s->nr, 1);
    return s->fa.rows;
}

/* ---- the rows path's scores from key rows --------------------------------------
 * A short query block (decode_tmpl.h, FN(rows_step): decoding) of a bfloat16 call
 * reading bfloat16 key rows (ks[3] = 1: a (B, H, L, D) cache, flash-attn's pages) takes
 * S^T = K Q^T on the tiles, the key rows loaded as A tiles where they lie (tile_key_rows), Q^T
 * packed as B once per step: the tile path's product, so the tile path's scores bit for bit,
 * with no transposes of K (keys in the lanes would transpose every block to keep the GEMM's
 * order). s (R, nc) = scale (S^T)^T. A last partial tile of keys goes through a zero-padded
 * copy. Everything else stays with the AVX-512 blocks: P V (V rows are not a tile operand of
 * it), K^T pages and int8 keys (packing an operand to load it as a tile costs more than the
 * FMAs it saves: docs/design.md, section 5), and the VDPBF16PS instance (its broadcast product
 * would compute 16 query columns for R <= 8). R = nh * nr <= 8. */
#ifdef TILE_KEY_ROWS
static int FN(tiles_rows_scores)(FN(tiles) * s, const ma_attn_fwd_params *p, float *sc, int64_t b, int64_t h,
                                 int64_t i0, int64_t nr, int64_t nh, int64_t k_off, int64_t nc, int64_t pf) {
    const ma_attn_args *a = &p->a;
    if (!s->rows_k || a->k_stride[3] != 1 || FN(kv_dtype)(a) != MA_BF16) return 0;
    const int64_t D = a->D, R = nr * nh, ld = a->k_stride[2], full = nc / 16 * 16;
    const uint16_t *q = (const uint16_t *)a->q, *k = (const uint16_t *)a->k + k_off;
    const tile_view qb = view_b_layout(s->fa.rq, D, 16, 1, 0);
    const uint16_t *rows[16]; /* Q^T as B: row r is column r */
    for (int r = 0; r < 16; r++)
        rows[r] =
            r < R ? q + b * a->q_stride[0] + (h + r / nr) * a->q_stride[1] + (i0 + r % nr) * a->q_stride[2] : NULL;
    pack_rows_as_b_bf16(qb, rows, D);
    tile_key_rows(full / 16, D / 32, k, ld, 32, qb, s->fa.rst, pf);
    if (full < nc) { /* the last keys, packed as one row of zero-padded A tiles */
        pack_a_bf16(view_a_layout(s->fa.rk, 16, D, 1, 0), k + full * ld, ld, nc - full, D, 0);
        tile_key_rows(1, D / 32, s->fa.rk, 32, TILE_ELEMS, qb, s->fa.rst + full * 16, 0);
    }
    BLK(transpose)(sc, s->fa.rst, 16, nc, R, (float)a->scale);
    return 1;
}
#else
static int FN(tiles_rows_scores)(FN(tiles) * s, const ma_attn_fwd_params *p, float *sc, int64_t b, int64_t h,
                                 int64_t i0, int64_t nr, int64_t nh, int64_t k_off, int64_t nc, int64_t pf) {
    (void)s, (void)p, (void)sc, (void)b, (void)h, (void)i0, (void)nr, (void)nh, (void)k_off, (void)nc, (void)pf;
    return 0;
}
#endif

static void FN(tiles_end)(void) { tile_end(); }

static size_t bwd_tile_bytes(const ma_attn_bwd_params *p, bwd_tile_scratch *t, void *base) {
    const tile_prec pr = tile_precision(p->a.dtype);
    const int64_t BQ = p->a.block_q, BK = p->a.block_k, D = p->a.D, Dv = p->a.Dv, G = p->a.H / p->a.Hkv;
    const int64_t Lq = p->a.Lq;
    void *x = base;
    bwd_tile_scratch s;
    s.qa = CARVE(uint16_t, &x, G *pr.in *packed_a_elems(Lq, D));
    s.qta = CARVE(uint16_t, &x, G *pr.in *packed_a_elems(D, Lq));
    s.ga = CARVE(uint16_t, &x, G *pr.in *packed_a_elems(Lq, Dv));
    s.gta = CARVE(uint16_t, &x, G *pr.in *packed_a_elems(Dv, Lq));
    s.ktb = CARVE(uint16_t, &x, pr.in *packed_b_elems(D, BK));
    s.vtb = CARVE(uint16_t, &x, pr.in *packed_b_elems(Dv, BK));
    s.kb = CARVE(uint16_t, &x, pr.in *packed_b_elems(BK, D));
    s.pb = CARVE(uint16_t, &x, pr.pd *packed_b_elems(BQ, BK));
    s.dsb = CARVE(uint16_t, &x, pr.pd *packed_b_elems(BQ, BK));
    s.dsa = CARVE(uint16_t, &x, pr.pd *packed_a_elems(BQ, BK));
    s.rows = CARVE(float, &x, (BQ > BK ? BQ : BK) * (D > Dv ? D : Dv));
    if (t) *t = s;
    return (size_t)((char *)x - (char *)base);
}

static size_t FN(tiles_bwd_scratch_bytes)(const ma_attn_bwd_params *p) {
    return ma_round_up(sizeof(struct FN(tiles)), MA_CACHE_LINE) + bwd_tile_bytes(p, NULL, NULL);
}

static void FN(tiles_bwd_begin)(FN(tiles) * *T, const ma_attn_bwd_params *p, FN(bwd_scratch) * t, void *extra) {
    FN(tiles) *s = (FN(tiles) *)extra;
    const int64_t BQ = p->a.block_q, BK = p->a.block_k, D = p->a.D, Dv = p->a.Dv;
    s->pr = tile_precision(p->a.dtype);
    s->bp = s->bp0 = p, s->bt = t;
    bwd_tile_bytes(p, &s->ba, (char *)extra + ma_round_up(sizeof(struct FN(tiles)), MA_CACHE_LINE));
    s->ktb = view_b_layout(s->ba.ktb, D, BK, s->pr.in, 0);
    s->vtb = view_b_layout(s->ba.vtb, Dv, BK, s->pr.in, 0);
    s->kb = view_b_layout(s->ba.kb, BK, D, s->pr.in, 0);
    s->pbb = view_b_layout(s->ba.pb, BQ, BK, s->pr.pd, 0);
    s->dsb = view_b_layout(s->ba.dsb, BQ, BK, s->pr.pd, 0);
    s->dsa = view_a_layout(s->ba.dsa, BQ, BK, s->pr.pd, 0);
    s->dkT = t->kT, s->dvT = t->vT;
    tile_begin();
    *T = s;
}

/* The packed operands of head g of the group: Q (Lq, D), Q^T (D, Lq), dO (Lq, Dv), dO^T (Dv, Lq)
 * (the item's entry's Lq; the scratch is laid out for the longest, bp0's). */
static tile_view bwd_view(const FN(tiles) * s, int which, int64_t g) {
    const ma_attn_bwd_params *p = s->bp;
    const int64_t Lq = p->a.Lq, D = p->a.D, Dv = p->a.Dv, in = s->pr.in;
    switch (which) {
    case 0: return view_a_layout(s->ba.qa + g * in * packed_a_elems(Lq, D), Lq, D, in, 0);
    case 1: return view_a_layout(s->ba.qta + g * in * packed_a_elems(D, Lq), D, Lq, in, 1);
    case 2: return view_a_layout(s->ba.ga + g * in * packed_a_elems(Lq, Dv), Lq, Dv, in, 0);
    default: return view_a_layout(s->ba.gta + g * in * packed_a_elems(Dv, Lq), Dv, Lq, in, 1);
    }
}

/* src[b, h] rows as A (L, ncol) into rows_a (row-major) and transposed as
 * A (ncol, L) into cols_a (k-major). */
static void bwd_pack_rows(const FN(tiles) * s, const void *src, const int64_t st[4], int64_t b, int64_t h, int64_t ncol,
                          tile_view rows_a, tile_view cols_a) {
    const ma_attn_bwd_params *p = s->bp;
    const int64_t BQ = p->a.block_q, L = p->a.Lq;
    int64_t ldx = 0;
    const uint16_t *bx = bf16_at(src, p->a.dtype, st, b, h, 0, s->pr.in, &ldx);
    if (bx) {
        pack_a_bf16(rows_a, bx, ldx, L, ncol, 0);
        pack_a_bf16(cols_a, bx, ldx, ncol, L, 1);
        return;
    }
    for (int64_t r0 = 0; r0 < L; r0 += BQ) {
        const int64_t nr = ma_min(BQ, L - r0);
        int64_t ld;
        const float *x = FN(rows)(src, p->a.dtype, st, b, h, r0, nr, ncol, s->ba.rows, &ld);
        pack_a(view_rows(rows_a, r0), x, ld, 1, nr, ncol);
        pack_a(view_krows(cols_a, r0), x, 1, ld, ncol, nr);
    }
}

static void FN(tiles_bwd_group)(FN(tiles) * s, int64_t b, int64_t hk) {
    const ma_attn_bwd_params *p = s->bp = FN(bwd_seq)(s->bp0, b, &s->bloc); /* entry b's extent */
    const int64_t G = p->a.H / p->a.Hkv;
    s->b = b, s->hk = hk;
    for (int64_t g = 0; g < G; g++) {
        const int64_t h = hk * G + g;
        bwd_pack_rows(s, p->a.q, p->a.q_stride, b, h, p->a.D, bwd_view(s, 0, g), bwd_view(s, 1, g));
        bwd_pack_rows(s, p->dout, p->dout_stride, b, h, p->a.Dv, bwd_view(s, 2, g), bwd_view(s, 3, g));
    }
}

static void FN(tiles_bwd_keys)(FN(tiles) * s, int64_t j0, int64_t nc) {
    const ma_attn_bwd_params *p = s->bp;
    const int64_t D = p->a.D, Dv = p->a.Dv, b = s->b, hk = s->hk;
    s->j0 = j0, s->nc = nc;
    int64_t ldk = 0, ldv = 0;
    const uint16_t *kx = bf16_at(p->a.k, p->a.dtype, p->a.k_stride, b, hk, j0, s->pr.in, &ldk);
    const uint16_t *vx = bf16_at(p->a.v, p->a.dtype, p->a.v_stride, b, hk, j0, s->pr.in, &ldv);
    if (kx && vx) {
        pack_b_bf16(s->kb, kx, ldk, nc, D, 0);
        pack_b_bf16(s->ktb, kx, ldk, D, nc, 1);
        pack_b_bf16(s->vtb, vx, ldv, Dv, nc, 1);
    } else {
        const float *k_j = FN(rows)(p->a.k, p->a.dtype, p->a.k_stride, b, hk, j0, nc, D, s->ba.rows, &ldk);
        pack_b(s->kb, k_j, ldk, nc, D);
        FN(load_tile_t)(s->dkT, p->a.k, p->a.dtype, p->a.k_stride, b, hk, j0, nc, D, 1);
        pack_b(s->ktb, s->dkT, nc, D, nc);
        FN(load_tile_t)(s->dvT, p->a.v, p->a.dtype, p->a.v_stride, b, hk, j0, nc, Dv, 1);
        pack_b(s->vtb, s->dvT, nc, Dv, nc);
    }
    for (int64_t x = 0; x < D * nc; x++) s->dkT[x] = 0;
    for (int64_t x = 0; x < Dv * nc; x++) s->dvT[x] = 0;
}

/* C (nr, nc) = A (rows i0.., k) @ B (k, nc) for s = Q K^T and dP = dO V^T. A
 * tile the band cuts goes by blocks of 16 queries, each over the keys one of
 * them can see (band_keys); the rest of C is zeroed: the band writes -inf over
 * those scores, and dS = P (dP - delta) needs a finite dP where P is 0. */
static void bwd_query_rows(const FN(tiles) * s, float *C, tile_view a, tile_view b, int64_t k, int64_t i0, int64_t nr) {
    const ma_attn_args *ar = &s->bp->a;
    const int64_t nc = s->nc, j0 = s->j0;
    if (!band_cuts(ar, i0, j0, nc)) {
        tile_gemm(nr, nc, k, view_rows(a, i0), b, C, nc, 0, s->pr.terms);
        return;
    }
    for (int64_t r0 = 0; r0 < nr; r0 += 16) {
        const int64_t m = ma_min(16, nr - r0), n = band_keys(ar, i0, r0, m, j0, nc);
        if (n > 0) tile_gemm(m, n, k, view_rows(a, i0 + r0), b, C + r0 * nc, nc, 0, s->pr.terms);
        for (int64_t r = r0; r < r0 + m; r++) memset(C + r * nc + n, 0, (size_t)(nc - n) * sizeof(float));
    }
}

/* C (m, nc) += A (m, queries i0..) @ B (queries, nc) for dK^T = Q^T dS and
 * dV^T = dO^T P: on a tile the band cuts, each block of 32 keys from the k
 * tile of the first query that can see one of them (dS and P are 0 before). */
static void bwd_key_cols(const FN(tiles) * s, float *C, tile_view a, tile_view b, int64_t m, int64_t i0, int64_t nr) {
    const ma_attn_args *ar = &s->bp->a;
    const int64_t nc = s->nc, j0 = s->j0;
    if (!band_cuts(ar, i0, j0, nc)) {
        tile_gemm(m, nc, nr, a, b, C, nc, 1, s->pr.terms);
        return;
    }
    for (int64_t c0 = 0; c0 < nc; c0 += BAND_BLOCK) {
        const int64_t w = ma_min(BAND_BLOCK, nc - c0), k0 = ma_max(0, j0 + c0 - ar->band_hi - i0) / 32 * 32;
        if (k0 < nr)
            tile_gemm(m, w, nr - k0, view_krows(a, k0), view_krows(view_rows(b, c0), k0), C + c0, nc, 1, s->pr.terms);
    }
}

static void FN(tiles_bwd_scores)(FN(tiles) * s, int64_t g, int64_t h, int64_t i0, int64_t nr) {
    (void)h;
    const ma_attn_bwd_params *p = s->bp;
    bwd_query_rows(s, s->bt->s, bwd_view(s, 0, g), s->ktb, p->a.D, i0, nr);
    scale_inplace(s->bt->s, nr * s->nc, (float)p->a.scale);
}

static void FN(tiles_bwd_dp)(FN(tiles) * s, int64_t g, int64_t h, int64_t i0, int64_t nr) {
    (void)h;
    bwd_query_rows(s, s->bt->dp, bwd_view(s, 2, g), s->vtb, s->bp->a.Dv, i0, nr);
}

static void FN(tiles_bwd_accum)(FN(tiles) * s, float *dq_i, int64_t g, int64_t h, int64_t i0, int64_t nr) {
    (void)h;
    const ma_attn_args *a = &s->bp->a;
    const int64_t nc = s->nc, D = a->D, Dv = a->Dv, terms = s->pr.terms;
    const FN(bwd_scratch) *t = s->bt;
    pack_b(s->dsb, t->dp, nc, nr, nc);
    bwd_key_cols(s, s->dkT, view_krows(bwd_view(s, 1, g), i0), s->dsb, D, i0, nr);
    pack_a(s->dsa, t->dp, nc, 1, nr, nc);
    if (!band_cuts(a, i0, s->j0, nc)) tile_gemm(nr, D, nc, s->dsa, s->kb, dq_i, D, 1, terms);
    else /* by blocks of 16 queries, over the k tiles of the keys they can see */
        for (int64_t r0 = 0; r0 < nr; r0 += 16) {
            const int64_t m = ma_min(16, nr - r0), k = band_ktiles(a, i0, r0, m, s->j0, nc);
            if (k > 0) tile_gemm(m, D, k, view_rows(s->dsa, r0), s->kb, dq_i + r0 * D, D, 1, terms);
        }
    pack_b(s->pbb, t->s, nc, nr, nc);
    bwd_key_cols(s, s->dvT, view_krows(bwd_view(s, 3, g), i0), s->pbb, Dv, i0, nr);
}

static void FN(tiles_bwd_keys_end)(FN(tiles) * s, int64_t nc) {
    BLK(transpose)(s->bt->dk, s->dkT, nc, s->bp->a.D, nc, 1);
    BLK(transpose)(s->bt->dv, s->dvT, nc, s->bp->a.Dv, nc, 1);
}

#undef FN
#undef BLK
