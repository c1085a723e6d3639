/*
 * backward_tmpl.h -- what the backward's single pass (fused_bwd_tmpl.h) is made of: its
 * scratch, the softmax lines of a tile between its products, the generic products, and the
 * pre-pass that takes the weights' gradient into delta.
 *
 * Part of attention_tmpl.h (included by it, after decode_tmpl.h): FN, BLK, ACC and the blocks are
 * the instance's.
 */

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

struct FN(bwd_scratch) {
    /* the weights' pre-pass: transposed tiles (nc, nr); the reduce: dq */
    ACC *qT, *gT, *kbuf, *sT, *dpT, *dq;
    /* the single pass: row tiles (nr, nc) */
    ACC *kT, *vT, *gbuf, *s, *dp, *dk, *dv;
    /* per query row */
    ACC *lse, *delta, *dhm, *tmp;
    ACC *z; /* (BQ, BK) dropout multipliers of a row-wise tile (DROPOUT's z form) */
    ACC *th; /* softcap's tanh of the tile's scores */
    ACC *extra;
};

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

/* Elements after the tiles that the single pass carves from t.extra: dq (G, Lq, D), delta,
 * lse, dhm (G, Lq), then the Q, dO caches of the G heads (G, Lq, D), (G, Lq, Dv) where they
 * need converting, then the regions of key blocks 2 .. of a group (FN(bwd_key_slot_elems)) */
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

static inline size_t FN(bwd_extra_elems)(const ma_attn_bwd_params *p) {
    const int64_t G = p->a.H / p->a.Hkv;
    return (size_t)(G * p->a.Lq * (p->a.D + 3) + FN(bwd_qg_cache_elems)(p) +
                    (FN(bwd_key_group)(p) - 1) * FN(bwd_key_slot_elems)(p));
}

/* Bytes of a thread's backward scratch without the hooks' own; with tile
 * hooks the single pass needs no Q, dO caches (the hooks pack from rows). */
static size_t FN(generic_bwd_scratch_bytes)(const ma_attn_bwd_params *p) {
    size_t n = FN(bwd_scratch_elems)(p->a.block_q, p->a.block_k, p->a.D, p->a.Dv) + FN(bwd_extra_elems)(p);
#ifdef MA_TILE_HOOKS
    n -= (size_t)FN(bwd_qg_cache_elems)(p);
#endif
    return ma_round_up(MA_CACHE_LINE + n * sizeof(ACC), MA_CACHE_LINE);
}

static size_t FN(bwd_scratch_bytes)(const ma_attn_bwd_params *p) {
    size_t n = FN(generic_bwd_scratch_bytes)(p);
#ifdef MA_TILE_HOOKS
    n += FN(tiles_bwd_scratch_bytes)(p);
#endif
    return n;
}

/* dW[b, h, i0 + r, j0 + c] added to dP at dp[r * rs + c * cs]; rows of ACC with unit stride
 * read in place (one loop the compiler vectorises where cs is 1), others converted. */
static void FN(add_dweights)(ACC *dp, int64_t rs, int64_t cs, const ma_attn_bwd_params *p, int64_t b, int64_t h,
                             int64_t i0, int64_t nr, int64_t j0, int64_t nc) {
    const int64_t *st = p->dweights_stride;
    const int direct = FN(is_native)(p->a.dtype) && st[3] == 1;
    for (int64_t r = 0; r < nr; r++) {
        const int64_t base = b * st[0] + h * st[1] + (i0 + r) * st[2] + j0 * st[3];
        ACC *d = dp + r * rs;
        if (direct) {
            const ACC *w = (const ACC *)p->dweights + base;
            for (int64_t c = 0; c < nc; c++) d[c * cs] += w[c];
        } else {
            for (int64_t c = 0; c < nc; c++) d[c * cs] += LOAD(p->dweights, p->a.dtype, base + c * st[3]);
        }
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

/* The backward's pre-pass where the weights have a gradient (FN(attn_bwd_delta)), rows
 * i0 .. i0 + nr of head (b, h), qT = (scale Q)^T and gT = dO^T loaded: their delta into
 * p->delta, g_i . (out_i + out_lo_i) + hm sum_j P'_ij dW_ij, P' = P Z / (1 - p) the weights'
 * own P (scores again over the rows' key range, as the forward's weights), summed key block
 * by key block in key order. */
static void FN(weights_delta)(FN(bwd_scratch) * t, const ma_attn_bwd_params *p, ACC hm, const ma_dropout *dr, int64_t b,
                              int64_t h, int64_t i0, int64_t nr) {
    const int64_t D = p->a.D, Dv = p->a.Dv, BK = p->a.block_k, hk = h / (p->a.H / p->a.Hkv);
    const ACC *lse_bh = (const ACC *)p->lse + FN(stat_row0)(&p->a, b, h);
    ACC *delta_bh = (ACC *)p->delta + FN(stat_row0)(&p->a, b, h);
    for (int64_t r = 0; r < nr; r++) {
        t->lse[r] = FN(finite_or_zero)(lse_bh[i0 + r]);
        ACC *o_r = t->gbuf;
        FN(out_row)(p, b, h, i0 + r, o_r, t->gbuf + Dv);
        ACC dot = 0;
        for (int64_t d = 0; d < Dv; d++) dot += t->gT[d * nr + r] * o_r[d];
        t->delta[r] = dot;
    }
    int64_t kv_begin, kv_end;
    FN(kv_range)(&p->a, i0, nr, &kv_begin, &kv_end);
    for (int64_t j0 = kv_begin; j0 < kv_end; j0 += BK) {
        const int64_t nc = FN(keys_read)(&p->a.key_padding_mask, b, j0, ma_min(BK, kv_end - j0));
        if (nc == 0) continue;
        const int ms = FN(mask_tile_state)(&p->a.attn_mask, b, h, i0, nr, j0, nc);
        if (ms == MA_TILE_BLOCKED) continue;
        int64_t ldk;
        const ACC *k_j = FN(rows)(p->a.k, p->a.dtype, p->a.k_stride, b, hk, j0, nc, D, t->kbuf, &ldk);
        GEMM(nc, nr, D, k_j, ldk, 1, t->qT, nr, t->sT, nr, 0); /* S^T = K (scale Q)^T */
        FN(apply_softcap)(t->sT, nc * nr, p->a.opts.softcap, NULL);
        FN(add_bias)(t->sT, 1, nr, &p->a, ms, b, h, i0, nr, j0, nc);
        EXP_SUB_COL(t->sT, nc, nr, t->lse, t->tmp);
        for (int64_t x = 0; x < nc * nr; x++) t->dpT[x] = 0;
        FN(add_dweights)(t->dpT, 1, nr, p, b, h, i0, nr, j0, nc);
        if (dr) DROPOUT(t->dpT, NULL, 1, nr, nr, nc, dr, i0, j0); /* P' dW = P (Z dW / (1 - p)) */
        ACC *dot = t->dhm; /* the rows' sums over this block, keys in order, rows in the lanes */
        for (int64_t r = 0; r < nr; r++) dot[r] = 0;
        for (int64_t c = 0; c < nc; c++)
            for (int64_t r = 0; r < nr; r++) dot[r] += t->sT[c * nr + r] * t->dpT[c * nr + r];
        for (int64_t r = 0; r < nr; r++) t->delta[r] += hm * dot[r];
    }
    for (int64_t r = 0; r < nr; r++) delta_bh[i0 + r] = t->delta[r];
}

/* The pre-pass, work item (b, h, q-block) (FN(q_item)), where the weights have a gradient
 * (dense calls: varlen returns no weights): delta of the block's rows into p->delta,
 * which the single pass then reads (FN(delta_rows)). One product (the scores) and an exp
 * per tile more than the single pass alone; the pass itself is unchanged. */
static void FN(attn_bwd_delta)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_bwd_params *p = (const ma_attn_bwd_params *)ctx->params;
    const int64_t D = p->a.D, Dv = p->a.Dv, BQ = p->a.block_q;
    FN(bwd_scratch) t = FN(bwd_carve)(ctx->scratch, BQ, p->a.block_k, D, Dv);
    for (int64_t w = begin; w < end; w++) {
        int64_t b, h, qb;
        FN(q_item)(&p->a, w, &b, &h, &qb);
        const int64_t i0 = qb * BQ, nr = ma_min(BQ, p->a.Lq - i0);
        const ACC hm = FN(head_scale)(&p->a.opts.head_mask, b, h);
        ma_dropout dr_buf;
        const ma_dropout *dr = FN(head_dropout)(&p->a, b, h, &dr_buf);
        FN(load_tile_t)(t.qT, p->a.q, p->a.dtype, p->a.q_stride, b, h, i0, nr, D, (ACC)p->a.scale);
        FN(load_tile_t)(t.gT, p->dout, p->a.dtype, p->dout_stride, b, h, i0, nr, Dv, 1);
        FN(weights_delta)(&t, p, hm, dr, b, h, i0, nr);
    }
}

/* One (query block, key block) tile of the single pass, rows i0 .. i0 + nr
 * of head h against keys j0 .. j0 + nc, in three steps:
 *   products     s = Q (scale K^T),  dp = dO V^T              (gen_bwd_scores, gen_bwd_dp, or the hooks)
 *   FN(bwd_tile_softmax)   P = exp(s + bias - lse) in s;  dS = P (hm (dp + dW) - delta) in dp;  s = hm P
 *   products     dK += dS^T Q (times scale at the store),  dV += (hm P)^T dO,  dQ += dS K
 *                                                           (gen_bwd_accum, or the hooks)
 * The generic products split a causal diagonal tile (FN(diag_split)): the part they skip
 * has dp 0 and P 0 (the band's -inf), so dS is 0 there, with or without dW. */
#ifndef MA_TILE_HOOKS /* the generic products (the hooks replace them in the tile instances) */
static inline int64_t FN(bwd_split)(const ma_attn_bwd_params *p, int64_t i0, int64_t nr, int64_t j0, int64_t nc) {
    return FN(diag_split)(p->a.band_hi, p->a.block_q, p->a.block_k, i0, nr, j0, nc);
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
#endif

/* One row-wise backward tile: query rows i0 .. i0 + nr of head h of batch entry b against
 * keys j0 .. j0 + nc; the head's mask scale hm, the tile's FN(mask_tile_state) (never
 * MA_TILE_BLOCKED: the loops skip those tiles), the rows' lse (-inf already 0) and delta,
 * dhm the head mask's row sums (NULL: none wanted), dr the head's dropout (NULL: none). */
typedef struct {
    int64_t b, h, i0, nr, j0, nc;
    ACC hm;
    int am_state;
    const ACC *lse, *delta;
    ACC *dhm;
    const ma_dropout *dr;
    ACC *row_delta; /* not NULL: rows this tile holds whole take their delta here (FN(bwd_tile_softmax)) */
} FN(bwd_tile);

/* sum_c x[c] (sum8) and sum_c x[c] y[c] (dot8) in 8 partial sums, term c into sum c mod 8,
 * then those in order: the same bits in every instance (they vectorise), and for a row with
 * keys padded on (terms +0: a key padding mask cut off, or given as a tensor). */
static inline ACC FN(sum8)(const ACC *x, int64_t n) {
    ACC part[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sum = 0;
    int64_t c = 0;
    for (; c + 8 <= n; c += 8)
        for (int u = 0; u < 8; u++) part[u] += x[c + u];
    for (int u = 0; c + u < n; u++) part[u] += x[c + u];
    for (int u = 0; u < 8; u++) sum += part[u];
    return sum;
}

static inline ACC FN(dot8)(const ACC *x, const ACC *y, int64_t n) {
    ACC part[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sum = 0;
    int64_t c = 0;
    for (; c + 8 <= n; c += 8)
        for (int u = 0; u < 8; u++) part[u] += x[c + u] * y[c + u];
    for (int u = 0; c + u < n; u++) part[u] += x[c + u] * y[c + u];
    for (int u = 0; u < 8; u++) sum += part[u];
    return sum;
}

/* The softmax lines of tile w, between the products: s holds the scores, dp holds dO V^T;
 * th, z: scratch for softcap's tanh and the dropout multipliers; store_ds: write dS out
 * where the call wants it.
 * With w->row_delta (the single pass, without sinks, whose gradient reads the forward's
 * delta), a row whose P sums to 1 within this tile, to within the rounding of lse and of the
 * sum (eps (4 + |lse|)), has every key it sees here, or all but a share below that rounding:
 * it takes the delta of PyTorch's softmax backward from the tile's own values,
 * delta = hm sum_c P dP' / sum_c P, rather than dO . out. The rounding of dP and of P then
 * cancels in dP - delta as in the math path: one key gives dS = 0 exactly (P = 1: the scores
 * are the forward's bits, FN(gen_bwd_scores); dq = dk = 0, as PyTorch), a row's dS sums to 0
 * up to its last rounding. The test reads the tile's own values, so a band and the same mask
 * as a tensor, or a document alone and packed, keep the same bits. Elsewhere delta is the
 * forward's, whose error does not cancel against the recomputed dP:
 * docs/design/05-attention-algorithm.md, "The float32 backward's error". */
static void FN(bwd_tile_softmax)(ACC *s, ACC *dp, ACC *th, ACC *z, const ma_attn_bwd_params *p, const FN(bwd_tile) * w,
                                 int store_ds) {
    const int64_t b = w->b, h = w->h, i0 = w->i0, nr = w->nr, j0 = w->j0, nc = w->nc;
    const ACC eps = sizeof(ACC) == sizeof(float) ? (ACC)FLT_EPSILON : (ACC)DBL_EPSILON;
    FN(apply_softcap)(s, nr * nc, p->a.opts.softcap, th);
    FN(add_bias)(s, nc, 1, &p->a, w->am_state, b, h, i0, nr, j0, nc);
    for (int64_t r = 0; r < nr; r++) {
        const ACC any = EXP_SUB_SUM(s + r * nc, nc, w->lse[r]); /* summed in the instance's own order */
        if (!w->row_delta) continue;
        w->row_delta[r] = 0; /* the row's sum where whole, else 0 */
        const ACC tol = eps * (4 + (w->lse[r] < 0 ? -w->lse[r] : w->lse[r]));
        /* any order's sum is within (nc - 1) eps sum of sum8's: rows further from 1 are not whole in any instance */
        const ACC far = tol + 2 * (ACC)nc * eps * (any > 1 ? any : 1);
        if (any - 1 > far || 1 - any > far) continue;
        const ACC sum = FN(sum8)(s + r * nc, nc); /* the test's sum: the same bits in every instance */
        if (sum > 0 && sum - 1 <= tol && 1 - sum <= tol) w->row_delta[r] = sum;
    }
    if (p->dweights) FN(add_dweights)(dp, nc, 1, p, b, h, i0, nr, j0, nc);
    if (w->dr) { /* one mask for both: dP' = dP Z / (1 - p) before dS, P' = P Z / (1 - p) after it */
        DROPOUT(NULL, z, nc, 1, nr, nc, w->dr, i0, j0);
        FN(apply_dropout)(dp, z, nr * nc);
    }
    if (w->row_delta)
        for (int64_t r = 0; r < nr; r++)
            w->row_delta[r] =
                w->row_delta[r] != 0 ? w->hm * (FN(dot8)(s + r * nc, dp + r * nc, nc) / w->row_delta[r]) : w->delta[r];
    FN(dscores)(dp, s, nc, 1, w->row_delta ? w->row_delta : w->delta, w->dhm, w->hm, nr, nc);
    if (w->dr) FN(apply_dropout)(s, z, nr * nc);
    if (store_ds && p->dscores) FN(store_dscores)(p, dp, nc, 1, b, h, i0, nr, j0, nc);
    FN(softcap_grad)(dp, th, nr * nc, p->a.opts.softcap); /* through the cap: dS (1 - tanh^2) */
    if (w->hm != 1)
        for (int64_t x = 0; x < nr * nc; x++) s[x] *= w->hm;
}
