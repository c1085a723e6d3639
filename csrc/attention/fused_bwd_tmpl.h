/*
 * fused_bwd_tmpl.h -- the backward: dq, dk and dv from one pass over a key chunk's tiles (every
 * call), and the reduce of its per-chunk dq.
 *
 * Part of attention_tmpl.h (included by it, after backward_tmpl.h): FN, BLK, ACC and the blocks are
 * the instance's.
 */

/* The per-row values of head (b, h) the single pass needs, rows 0 .. Lq:
 * delta_i = dout_i . out_i (where the weights have a gradient, the pre-pass's
 * delta, FN(attn_bwd_delta)), lse_i (-inf -> 0) and dhm_i = 0; overwrites.
 * Rows are read in place when they are ACC with unit stride, else converted
 * into gbuf (2 Dv). The dot product runs in 8 interleaved partial sums. */
static void FN(delta_rows)(const ma_attn_bwd_params *p, int64_t b, int64_t h, ACC *gbuf, ACC *delta, ACC *lse,
                           ACC *dhm) {
    const int64_t Lq = p->a.Lq, Dv = p->a.Dv;
    const ACC *lse_bh = (const ACC *)p->lse + FN(stat_row0)(&p->a, b, h);
    const int direct = FN(is_native)(p->a.dtype) && p->dout_stride[3] == 1 && p->a.out_stride[3] == 1 && !p->out_lo;
    const ACC *pre = p->dweights ? (const ACC *)p->delta + FN(stat_row0)(&p->a, b, h) : NULL;
    for (int64_t i = 0; i < Lq; i++) {
        lse[i] = FN(finite_or_zero)(lse_bh[i]);
        dhm[i] = 0;
        if (pre) {
            delta[i] = pre[i];
            continue;
        }
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
/* The scores are the forward's bits: scale q_d k_d summed in d's order, as forward_tmpl.h's
 * K (scale Q)^T, so that P = exp(s - lse) of a row the tile holds whole sums to 1 within lse's
 * rounding (FN(bwd_tile_softmax)). q_d (scale k_d) is the same product where the scale is a
 * power of two (1 / sqrt(D) for D = 4^n, 2): then K^T takes the scale as it is loaded; else
 * each tile scales its Q rows. */
static inline int FN(scale_on_keys)(const ma_attn_bwd_params *p) {
    uint64_t bits; /* a normal double with no mantissa bits (no frexp: the emulator's libm has none) */
    memcpy(&bits, &p->a.scale, sizeof bits);
    const uint64_t e = (bits >> 52) & 0x7ff;
    return (bits & 0xfffffffffffffull) == 0 && e != 0 && e != 0x7ff;
}

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
    FN(load_tile_t)(t->kT, p->a.k, p->a.dtype, p->a.k_stride, g->b, g->hk, j0, nc, p->a.D, /* see gen_bwd_scores */
                    FN(scale_on_keys)(p) ? (ACC)p->a.scale : 1);
    FN(load_tile_t)(t->vT, p->a.v, p->a.dtype, p->a.v_stride, g->b, g->hk, j0, nc, p->a.Dv, 1);
}

static void FN(gen_bwd_scores)(FN(gen_bwd) * g, int64_t gi, int64_t h, int64_t i0, int64_t nr) {
    const ma_attn_bwd_params *p = g->p;
    const int64_t Lq = p->a.Lq;
    g->q_i = FN(rows_in)(p->a.q, p->a.dtype, p->a.q_stride, g->b, h, i0, g->q_bg ? g->q_bg + gi * Lq * p->a.D : NULL,
                         p->a.D, &g->ldq);
    g->g_i = FN(rows_in)(p->dout, p->a.dtype, p->dout_stride, g->b, h, i0, g->g_bg ? g->g_bg + gi * Lq * p->a.Dv : NULL,
                         p->a.Dv, &g->ldg);
    if (FN(scale_on_keys)(p)) {
        FN(gen_bwd_scores_at)(g->t, p, i0, nr, g->j0, g->nc, g->q_i, g->ldq);
        return;
    }
    /* (scale Q) K^T, in t->qT (the dq pass's, free here) */
    const int64_t D = p->a.D;
    ACC *sq = g->t->qT;
    for (int64_t r = 0; r < nr; r++)
        for (int64_t d = 0; d < D; d++) sq[r * D + d] = (ACC)p->a.scale * g->q_i[r * g->ldq + d];
    FN(gen_bwd_scores_at)(g->t, p, i0, nr, g->j0, g->nc, sq, D);
}

static void FN(gen_bwd_dp)(FN(gen_bwd) * g, int64_t gi, int64_t h, int64_t i0, int64_t nr) {
    (void)gi, (void)h;
    FN(gen_bwd_dp_at)(g->t, g->p, i0, nr, g->j0, g->nc, g->g_i, g->ldg);
}

/* dK += dS^T Q, dV += (hm P)^T dO; dQ += dS K (times scale at the store): rows r0 .. r0 + w of a split diagonal tile see keys ..r0 + w */
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

/* step(args) of key block x (c: the task). The hooks take every call and hold
 * one key block (FN(bwd_key_group) is 1): x is 0. */
#ifdef MA_TILE_HOOKS
#define BWD_STEP(step, x, ...) FN(tiles_bwd_##step)(c->tiles, __VA_ARGS__)
#else
#define BWD_STEP(step, x, ...) FN(gen_bwd_##step)(&c->gen[x], __VA_ARGS__)
#endif

/* Single pass, work item (b, hkv, key chunk c) (FN(fused_item); varlen: on
 * entry b's params, which the loops take as a dense entry, C its own): the
 * chunk's key blocks are c, c + C, c + 2C, ... (C = kv_chunks), taken KG =
 * FN(bwd_key_group) at a time. For every query block of the G heads of the group (outer loop) and
 * every key block of the KG (inner loop), dk and dv of the key block
 * accumulate in its tiles while dq of every query of the group accumulates
 * in scratch, (G, Lq, D), or in chunk c's partial sums. So a query block's
 * Q, dO and dq rows serve KG key blocks while they are in cache. Each dq row
 * still sums its key blocks in key order and each dk, dv row its query
 * blocks in (head, query) order: the results are those of KG = 1, bit for
 * bit. 5 matrix products and one exp per tile; the chunks are a rule on the
 * shape alone, so results never depend on the thread count. Where the weights
 * have a gradient, their term is in delta (the pre-pass) and dW joins dP in
 * each tile (FN(bwd_tile_softmax)). */
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
                const FN(bwd_tile) w = {.b = b,
                                        .h = h,
                                        .i0 = i0,
                                        .nr = nr,
                                        .j0 = k->j0[x],
                                        .nc = k->nc[x],
                                        .hm = hm,
                                        .am_state = ms,
                                        .lse = c->lse_all + g * Lq + i0,
                                        .delta = c->delta_all + g * Lq + i0,
                                        .dhm = p->dhm_rows ? c->dhm_all + g * Lq + i0 : NULL,
                                        .dr = dr,
                                        .row_delta = p->a.opts.sinks.ptr ? NULL : t->tmp};
                FN(bwd_tile_softmax)(t->s, t->dp, t->th, t->z, p, &w, 1);
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

/* Work item w of the single pass: entry b, key head *hk, key chunk *ch, and the
 * params of entry b (dense: the call's, kv_chunks chunks; varlen: FN(bwd_seq)'s copy
 * in loc, moved to entry b, with its own kv_chunks C_b; the plan's table). */
static const ma_attn_bwd_params *FN(fused_item)(const ma_attn_bwd_params *p0, int64_t w, ma_attn_bwd_params *loc,
                                                int64_t *b, int64_t *hk, int64_t *ch) {
    if (!p0->a.cu_q) {
        const int64_t C = p0->kv_chunks;
        *ch = w % C, *b = w / C / p0->a.Hkv, *hk = (w / C) % p0->a.Hkv;
        return p0;
    }
    const int64_t *it = p0->a.kv_items + 3 * w;
    *b = it[0], *hk = it[1], *ch = it[2];
    return FN(bwd_seq)(p0, *b, loc);
}

/* Row i of head h of entry b in key chunk ch's partial sums (dq_part: rows of D; dhm_part):
 * dense (C, B, H, Lq); varlen entry b's own (C_b, H, Lq_b), from its first row. p: entry b's params. */
static inline int64_t FN(part_row)(const ma_attn_bwd_params *p, int64_t b, int64_t h, int64_t ch, int64_t i) {
    if (p->a.cu_q) return p->entry_chunks[2 * b + 1] + (ch * p->a.H + h) * p->a.Lq + i;
    return ((ch * p->a.B + b) * p->a.H + h) * p->a.Lq + i;
}

static void FN(attn_bwd_fused)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_bwd_params *p0 = (const ma_attn_bwd_params *)ctx->params;
    const int64_t G = p0->a.H / p0->a.Hkv, D = p0->a.D, BK = p0->a.block_k;
    FN(fused_task) task, *c = &task;
    FN(fused_carve)(c, ctx->scratch, p0, FN(bwd_key_group)(p0)); /* sized by the longest entry */
#ifdef MA_TILE_HOOKS
    c->tiles = NULL;
    FN(tiles_bwd_begin)(&c->tiles, p0, &c->tk[0], (char *)ctx->scratch + FN(generic_bwd_scratch_bytes)(p0));
#endif

    for (int64_t w = begin; w < end; w++) {
        ma_attn_bwd_params loc;
        int64_t b, hk, ch;
        const ma_attn_bwd_params *p = FN(fused_item)(p0, w, &loc, &b, &hk, &ch); /* entry b's extent */
        const int64_t Lq = p->a.Lq, Lk = p->a.Lk, C = p->kv_chunks, KG = FN(bwd_key_group)(p);
        /* dq of the group's heads accumulates in this thread's scratch, or in chunk ch's partial sums */
        ACC *dq_acc = C > 1 ? (ACC *)p->dq_part + FN(part_row)(p, b, hk * G, ch, 0) * D : c->dq_all;
        for (int64_t x = 0; x < KG; x++) {
            c->gen[x].p = p;
            BWD_STEP(group, x, b, hk); /* converts Q, dO once: the caches are shared */
        }
        for (int64_t g = 0; g < G; g++)
            FN(delta_rows)(p, b, hk * G + g, c->tk[0].gbuf, c->delta_all + g * Lq, c->lse_all + g * Lq,
                           c->dhm_all + g * Lq);
        if (ch == 0 && p->a.opts.sinks.ptr &&
            !p->dweights) /* delta for ma_attn_bwd_sinks_grad (the pre-pass wrote it) */
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
            if (C == 1)
                FN(store_tile)(p->dq, p->a.dtype, p->dq_stride, b, h, 0, Lq, D, dq_acc + g * Lq * D, (ACC)p->a.scale,
                               p->a.stream_stores);
            if (p->dhm_rows) {
                ACC *dhm_out = C > 1 ? (ACC *)p->dhm_part + FN(part_row)(p, b, h, ch, 0)
                                     : (ACC *)p->dhm_rows + FN(stat_row0)(&p->a, b, h);
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

/* After the single pass with C > 1 key chunks, work item (b, h, q-block)
 * (FN(q_item); varlen: of the entries with C_b > 1): dq = scale * sum_c
 * dq_part[c] and dhm_rows = sum_c dhm_part[c], in chunk order. */
static void FN(attn_bwd_reduce)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_bwd_params *p0 = (const ma_attn_bwd_params *)ctx->params;
    const int64_t D = p0->a.D, BQ = p0->a.block_q;
    FN(bwd_scratch) t = FN(bwd_carve)(ctx->scratch, BQ, p0->a.block_k, D, p0->a.Dv);
    for (int64_t w = begin; w < end; w++) {
        int64_t b, h, qb;
        FN(q_item)(&p0->a, w, &b, &h, &qb);
        ma_attn_bwd_params loc;
        const ma_attn_bwd_params *p = FN(bwd_seq)(p0, b, &loc); /* entry b's extent and chunks */
        const int64_t C = p->kv_chunks, i0 = qb * BQ, nr = ma_min(BQ, p->a.Lq - i0);
        const ACC *part = (const ACC *)p->dq_part;
        const ACC *part_0 = part + FN(part_row)(p, b, h, 0, i0) * D;
        for (int64_t x = 0; x < nr * D; x++) t.dq[x] = part_0[x];
        for (int64_t ch = 1; ch < C; ch++) {
            const ACC *part_c = part + FN(part_row)(p, b, h, ch, i0) * D;
            for (int64_t x = 0; x < nr * D; x++) t.dq[x] += part_c[x];
        }
        FN(store_tile)(p->dq, p->a.dtype, p->dq_stride, b, h, i0, nr, D, t.dq, (ACC)p->a.scale, p->a.stream_stores);
        if (p->dhm_rows) {
            const ACC *dpart = (const ACC *)p->dhm_part;
            ACC *dhm_bh = (ACC *)p->dhm_rows + FN(stat_row0)(&p->a, b, h);
            for (int64_t r = 0; r < nr; r++) {
                ACC acc = 0;
                for (int64_t ch = 0; ch < C; ch++) acc += dpart[FN(part_row)(p, b, h, ch, i0 + r)];
                dhm_bh[i0 + r] = acc;
            }
        }
    }
}
