/*
 * forward_tmpl.h -- the forward's tile path (ma_attn_fwd_task): one query block of one head
 * against its key blocks, FlashAttention-2's online softmax; the forward task's set-up the
 * decode kernel shares.
 *
 * Part of attention_tmpl.h (included by it, after shared_tmpl.h; decode_tmpl.h follows it):
 * FN, BLK, ACC and the blocks are the instance's.
 */

/* ---- forward ------------------------------------------------------------ */

/* C (m, n) = diag(rs) C: the online softmax's rescaling of the running output
 * (rows whose factor is 1 are left alone). */
static void FN(scale_rows)(ACC *C, int64_t ldc, int64_t m, int64_t n, const ACC *rs) {
    for (int64_t r = 0; r < m; r++)
        if (rs[r] != 1)
            for (int64_t d = 0; d < n; d++) C[r * ldc + d] *= rs[r];
}

struct FN(fwd_scratch) {
    ACC *qT, *sT, *o, *m, *m_new, *l, *lsum, *lse;
    ACC *kc, *vc; /* head caches (Lk, D), (Lk, Dv) when K, V need converting */
};

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
 * MA_TILE_HOOKS (AMX, AVX512-BF16, SVE-BF16) defines FN(tiles_*) with the same meaning and its own
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

/* MA_TILE_HOOKS: the hooks FN(tiles_*) are declared in tiles_contract.h. */

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
