/*
 * decode_tmpl.h -- the decode kernel (ma_attn_decode_task, masked_attn.h "Decoding"): every
 * call, or varlen entry, of at most MA_DECODE_QROWS query rows (decoding, speculative
 * verification), over the key and value rows in place.
 *
 * Part of attention_tmpl.h (included by it, after forward_tmpl.h): FN, BLK, ACC
 * and the blocks are the instance's.
 *
 * The work item is (b, hkv, slab, split): the query heads of one key head (a slab of them,
 * at most MA_DECODE_ROWS rows in all) as one block of rows, so that every key and value row
 * crosses the memory bus once per key head, not once per query head; and a range of the
 * entry's key chunks (MA_DECODE_CHUNK keys each, at multiples of it from key 0), so that one
 * long sequence has work for every core. Each chunk's softmax starts afresh (m = -inf, l = 0,
 * O = 0) and the chunks' states are folded in chunk order (FN(decode_fold)): by the item
 * itself when it holds all of the entry's chunks, else by the merge task from the partial
 * states the items left in the workspace. The same fold in the same order either way, so a
 * row's bits depend on neither the split, the thread count, nor the rows around it
 * (docs/design.md, "Decoding").
 */

/* ---- the rows step ------------------------------------------------------- */

/* The rows of one step: nh heads h .. h + nh (all of key head hk) of batch
 * entry b, nr query rows i0 .. i0 + nr each, head-major: row y nr + r is query
 * i0 + r of head h + y. */
typedef struct {
    const ACC *q;                /* (R, D): scale * Q, R = nh nr */
    const int16_t *q16;          /* (R, D): q in int16 for the 8-bit cache's key rows, else NULL */
    const float *qs;             /* (R): q16's scales (FN(quantize_q16)) */
    ACC *o, *m, *l;              /* (R, Dv), (R), (R): running output, max and sum */
    const ma_dropout *const *dr; /* dr[y]: head h + y's dropout (NULL: the call has none) */
    int64_t b, h, hk, i0, nr, nh;
} FN(row_block);

/* Scratch of a step: s (R, nc) scores then probabilities; m_new, lsum, alpha (R); sums (every
 * key head's rows: P's row sums, which P V adds up, FN(rows_step)). */
typedef struct {
    ACC *s, *m_new, *lsum, *alpha, *sums;
} FN(rows_tmp);

/* Where an item's key heads go in lockstep (their rows side by side in each key row), the
 * products take MA_DECODE_SUB keys at a time, every key head's before the next keys': the key
 * and value rows are then read whole, in order, as one key head's rows are; a whole key block
 * per key head (64 rows a KB apart) measured 0.6x that stream on Zen 3. A key's score and its
 * term of P V do not depend on the keys taken with it, so the bits are those of one product (the
 * 8-bit cache's P V, rounded per call, takes MA_DECODE_SUB keys a call in every layout). */
#define MA_DECODE_SUB 16

/* Scores of one key head's rows w (every row, blocked or not) for the n keys from the one at
 * k_off (in one page): DOT_ROWS from key rows, DOT_KEYS_T from a K^T page. s: (R, lds), the
 * first key's column. */
static void FN(rows_scores)(const ma_attn_fwd_params *p, const FN(row_block) * w, ACC *s, int64_t lds, int64_t k_off,
                            int64_t n, int64_t pf) {
    const ma_attn_args *a = &p->a;
    const int64_t D = a->D, R = w->nh * w->nr, *ks = a->k_stride;
    const ma_dtype kvt = FN(kv_dtype)(a);
#ifndef MA_ACC_F64
    if (w->q16) { /* the 8-bit cache's key rows: integer products */
        DOT_ROWS_I8(s, lds, w->q16, w->qs, R, D, (const int8_t *)a->k, k_off, ks[2], n, pf);
        return;
    }
#endif
    if (ks[3] == 1) DOT_ROWS(s, lds, w->q, R, D, a->k, kvt, k_off, ks[2], n, pf);
    else /* keys side by side, each element a row apart: a K^T page (the serving cache's layout) */
        for (int64_t i = 0; i < R; i += 8)
            DOT_KEYS_T(s + i * lds, lds, w->q + i * D, ma_min(8, R - i), D, a->k, kvt, k_off, ks[3], n,
                       i == 0 ? pf : 0);
}

/* The instance's scores of one key head's rows from bfloat16 key rows on its tiles (AMX:
 * FN(tiles_rows_scores), 8 rows at a time), the whole block; 0 where it takes none. */
static int FN(rows_hooked)(FN(fwd_task) * c, const ma_attn_fwd_params *p, const FN(row_block) * w, ACC *s,
                           int64_t k_off, int64_t nc, int64_t pf) {
    const int64_t nr = w->nr, heads_per_product = nr <= 8 ? 8 / nr : 1;
    (void)p, (void)s, (void)k_off, (void)nc, (void)pf; /* unread where the instance has no hooks */
    int hooked = 1;
    for (int64_t y = 0; hooked && y < w->nh; y += heads_per_product)
        for (int64_t i = 0; hooked && i < nr; i += 8) {
            const int64_t nh8 = ma_min(heads_per_product, w->nh - y), n = nr <= 8 ? nh8 * nr : ma_min(8, nr - i);
            const int64_t row = y * nr + i;
            (void)c, (void)n, (void)row; /* unread where the instance has no hooks */
            hooked = ROWS_SCORES(p, s + row * nc, w->b, w->h + y, w->i0 + i, nr <= 8 ? nr : n, nr <= 8 ? nh8 : 1, k_off,
                                 nc, row == 0 ? pf : 0);
            if (nr <= 8) break;
        }
    return hooked;
}

/* Where key head x of nw in lockstep (heads hs apart) prefetches: the next head's part of the
 * same rows; the last head the first head's part of the next keys, step on from these. */
static inline int64_t FN(lockstep_pf)(int64_t x, int64_t nw, int64_t hs, int64_t step) {
    return x + 1 < nw ? hs : step - x * hs;
}

/* Where the keys from j of entry b start in k or v (st: their strides; a page's rows through
 * the block table). */
static inline int64_t FN(kv_at)(const ma_attn_args *a, const int64_t st[4], int64_t page_st, int64_t b, int64_t j) {
    return b * st[0] + FN(key_off)(a, st, page_st, b, j);
}

/* One softmax step j0 .. j0 + nc (FN(decode_block) keys at most, read a key block of block_k
 * keys, or MA_DECODE_SUB, at a time: each in one page) for the row blocks w[0 .. nw) (nw key
 * heads, in lockstep where more than one): scores plus bias, m_new = max(m, row max),
 * P = exp(S - m_new) (m_new = -inf as 0), l = alpha l + sum P (in key order), O = alpha O + P V
 * (AXPY_KEYS: the tiles' order of that product; AXPY_KEYS_I8 over int8 values, MA_DECODE_SUB
 * keys a call in every layout). l's sum of P in key order is AXPY_KEYS' own (its lsum: the chain
 * of adds runs beside P V's FMAs, where after the exps it stood alone, 7% of a step at D = 32),
 * l taking alpha l first, then the sums after P V: the same roundings; where P V does not see P
 * (dropout, the 8-bit cache's scales) the sums come before. The scores from key rows are
 * DOT_ROWS' (each key row read once, in order, for every row of the block: the query heads of
 * a key head share it), from K^T pages
 * DOT_KEYS_T's (the tiles' order, 8 rows a product), or the instance's hook's. Heads whose
 * attn_mask tile differs are taken in runs of equal FN(mask_tile_state); a MA_TILE_BLOCKED
 * run contributes exactly 0 (its scores, where computed with the others, are not read).
 * pf_k, pf_v: one key head's prefetch distances (0: none); next_k, next_v: the next step's
 * offset from this one's (the lockstep's prefetch). t->s holds nw blocks of the rows' scores
 * (FN(decode_scores)). */
static void FN(rows_step)(FN(fwd_task) * c, const ma_attn_fwd_params *p, const FN(row_block) * w, int64_t nw,
                          const FN(rows_tmp) * t, int64_t j0, int64_t nc, int64_t pf_k, int64_t pf_v, int64_t next_k,
                          int64_t next_v) {
    const ma_attn_args *a = &p->a;
    const int64_t Dv = a->Dv, nr = w->nr, b = w->b, *ks = a->k_stride, *vs = a->v_stride, RL = w->nh * nr;
    const int64_t BK = a->block_k, kps = a->k_page_stride, vps = a->v_page_stride;
    const ma_dtype kvt = FN(kv_dtype)(a);
    const int64_t k_off = FN(kv_at)(a, ks, kps, b, j0), v_off = FN(kv_at)(a, vs, vps, b, j0);
    /* P V sums P (AXPY_KEYS' lsum) where it reads P itself: l = alpha l + 0 below, then + sums */
    ACC *const sums = !ma_dropout_on(a) && !a->opts.v_scale.ptr && kvt != MA_I8 ? t->sums : NULL;
    int ms[MA_DECODE_KV_HEADS][MA_DECODE_ROWS], live[MA_DECODE_KV_HEADS], any = 0;
    for (int64_t x = 0; x < nw; x++) {
        live[x] = 0;
        for (int64_t y = 0; y < w[x].nh; y++) {
            ms[x][y] = FN(mask_tile_state)(&a->attn_mask, b, w[x].h + y, w[x].i0, nr, j0, nc);
            live[x] |= ms[x][y] != MA_TILE_BLOCKED;
        }
        any |= live[x];
    }
    if (!any) return;
    if (sums)
        for (int64_t x = 0; x < nw * RL; x++) sums[x] = 0;
#define S_X(x) (t->s + (x) * RL * nc) /* (every key head's rows: RL) */
    /* key rows of heads in lockstep: MA_DECODE_SUB keys at a time; else (one key head, K^T
     * pages) a key block at a time; the hook each head's whole step (then of block_k keys) */
    const int64_t piece_k = nw > 1 && ks[3] == 1 ? MA_DECODE_SUB : BK;
    int hooked = 0;
    for (int64_t x = 0; x < nw; x++)
        if (live[x] && !(hooked = FN(rows_hooked)(c, p, &w[x], S_X(x), k_off + w[x].hk * ks[1], nc,
                                                  nw == 1 ? pf_k : FN(lockstep_pf)(x, nw, ks[1], next_k))))
            break;
    for (int64_t c0 = 0; !hooked && c0 < nc; c0 += piece_k) {
        const int64_t n = ma_min(piece_k, nc - c0), at = FN(kv_at)(a, ks, kps, b, j0 + c0);
        const int64_t step = (c0 + n < nc ? FN(kv_at)(a, ks, kps, b, j0 + c0 + n) : k_off + next_k) - at;
        for (int64_t x = 0; x < nw; x++)
            if (live[x])
                FN(rows_scores)(p, &w[x], S_X(x) + c0, nc, at + w[x].hk * ks[1], n,
                                nw == 1 ? pf_k : FN(lockstep_pf)(x, nw, ks[1], step));
    }
    for (int64_t x = 0; x < nw; x++)
        for (int64_t y0 = 0, ny; y0 < w[x].nh; y0 += ny) {
            for (ny = 1; y0 + ny < w[x].nh && ms[x][y0 + ny] == ms[x][y0];) ny++;
            if (ms[x][y0] == MA_TILE_BLOCKED) continue;
            const int64_t r0 = y0 * nr, R = ny * nr;
            ACC *s = S_X(x) + r0 * nc, *m = w[x].m + r0, *l = w[x].l + r0, *o = w[x].o + r0 * Dv;
            for (int64_t c0 = 0; c0 < nc; c0 += BK) /* (scales in pages, as the keys) */
                FN(kv_scale)(s + c0, nc, 1, R, a, &a->opts.k_scale, b, w[x].hk, j0 + c0, ma_min(BK, nc - c0));
            FN(apply_softcap)(s, R * nc, a->opts.softcap, NULL);
            for (int64_t y = 0; y < ny; y++)
                FN(add_bias)(s + y * nr * nc, nc, 1, a, ms[x][y0], b, w[x].h + y0 + y, w[x].i0, nr, j0, nc);
            for (int64_t r = 0; r < R; r++) {
                t->m_new[r] = ROW_MAX(s + r * nc, nc, m[r]);
                (void)EXP_SUB_SUM(s + r * nc, nc, t->m_new[r] == -(ACC)INFINITY ? 0 : t->m_new[r]);
            }
            if (!sums) FN(sum_rows_in_order)(s, nc, R, t->lsum);
            if (FN(online_step)(m, t->m_new, l, sums ? sums + x * RL + r0 : t->lsum, t->alpha, R))
                FN(scale_rows)(o, Dv, R, Dv, t->alpha);
            if (w[x].dr) /* l summed the whole P; O takes P' */
                for (int64_t y = 0; y < ny; y++)
                    DROPOUT(s + y * nr * nc, NULL, nc, 1, nr, nc, w[x].dr[y0 + y], w[x].i0, j0);
            for (int64_t c0 = 0; c0 < nc; c0 += BK)
                FN(kv_scale)(s + c0, nc, 1, R, a, &a->opts.v_scale, b, w[x].hk, j0 + c0, ma_min(BK, nc - c0));
        }
    /* (the 8-bit cache's values MA_DECODE_SUB keys at a time in every layout: AXPY_KEYS_I8 rounds
     * P per call, so that a row's bits are the same whether its key heads lie apart or side by
     * side; a key block a call where they lie side by side ran its pages 0.9x) */
    const int64_t piece_v = nw == 1 && kvt != MA_I8 ? BK : MA_DECODE_SUB;
    for (int64_t c0 = 0; c0 < nc; c0 += piece_v) {
        const int64_t n = ma_min(piece_v, nc - c0), at = FN(kv_at)(a, vs, vps, b, j0 + c0);
        const int64_t step = (c0 + n < nc ? FN(kv_at)(a, vs, vps, b, j0 + c0 + n) : v_off + next_v) - at;
        for (int64_t x = 0; x < nw; x++) {
            const int64_t pf = nw == 1 ? pf_v : FN(lockstep_pf)(x, nw, vs[1], step);
            for (int64_t y0 = 0, ny; y0 < w[x].nh; y0 += ny) {
                for (ny = 1; y0 + ny < w[x].nh && ms[x][y0 + ny] == ms[x][y0];) ny++;
                if (ms[x][y0] == MA_TILE_BLOCKED) continue;
#ifndef MA_ACC_F64
                if (kvt == MA_I8) /* the 8-bit cache's values: integer products */
                    AXPY_KEYS_I8(w[x].o + y0 * nr * Dv, S_X(x) + y0 * nr * nc + c0, nc, ny * nr, Dv,
                                 (const int8_t *)a->v, at + w[x].hk * vs[1], vs[2], n, y0 == 0 ? pf : 0);
                else
#endif
                    AXPY_KEYS(w[x].o + y0 * nr * Dv, S_X(x) + y0 * nr * nc + c0, nc, ny * nr, Dv, a->v, kvt,
                              at + w[x].hk * vs[1], vs[2], n, y0 == 0 ? pf : 0, sums ? sums + x * RL + y0 * nr : NULL);
            }
        }
    }
    if (sums) /* (a blocked run's rows add 0) */
        for (int64_t x = 0; x < nw; x++)
            for (int64_t r = 0; r < RL; r++) w[x].l[r] += sums[x * RL + r];
#undef S_X
}

/* ---- the decode kernel --------------------------------------------------- */

/* How far ahead the products prefetch: 8 KB of key and of value rows (at least 2 rows), into
 * L2 (prefetch_ahead: from MA_PREFETCH_FAR on). With the register tiles (a run of value rows read
 * strip by strip) that measured best on Zen 3 of 1, 4, 8 and 16 KB (docs/decoding-performance.md).
 * The products' earlier one-key loops were best with 1 KB into L1, a key block into L2 40% slower. */
#define MA_DECODE_PF_BYTES 8192

/* Folds a chunk's state (m, l, o: R rows) into the running one (M, L, O), row
 * by row: N = max(M, m), L = e^(M - N) L + e^(m - N) l, O likewise. A row the
 * chunk did not reach (m = -inf) is left as it is; into an empty row (M =
 * -inf) the chunk's state is copied. NaN sticks. */
static void FN(decode_fold)(ACC *M, ACC *L, ACC *O, const ACC *m, const ACC *l, const ACC *o, int64_t R, int64_t Dv) {
    for (int64_t r = 0; r < R; r++) {
        ACC *O_r = O + r * Dv;
        const ACC *o_r = o + r * Dv;
        if (m[r] == -(ACC)INFINITY) continue;
        if (M[r] == -(ACC)INFINITY) {
            M[r] = m[r], L[r] = l[r];
            for (int64_t d = 0; d < Dv; d++) O_r[d] = o_r[d];
            continue;
        }
        const ACC N = M[r] != M[r] || m[r] != m[r] ? (ACC)NAN : M[r] >= m[r] ? M[r] : m[r];
        const ACC x = EXPF(M[r] - N), y = EXPF(m[r] - N);
        L[r] = x * L[r] + y * l[r];
        for (int64_t d = 0; d < Dv; d++) O_r[d] = x * O_r[d] + y * o_r[d];
        M[r] = N;
    }
}

/* The softmax step from key block *j0 (block_k keys each, j0 a multiple of block_k, up to
 * j_end): the key blocks that key padding leaves wholly blocked before it skipped (*j0 moves
 * past them), then up to DB keys of blocks read whole, ending after a block whose trailing
 * keys padding blocks: the keys FN(keys_read) reads block by block, the same as 64-key steps
 * read, so keys a block's padding ends are never read. Returns the keys read (0: none left
 * before j_end); *j1: where the next step starts. */
static int64_t FN(decode_step)(const ma_attn_args *a, int64_t b, int64_t *j0, int64_t j_end, int64_t DB, int64_t *j1) {
    const int64_t BK = a->block_k;
    int64_t nc = 0, j = *j0;
    while (j < j_end && nc == j - *j0 && nc < DB) {
        const int64_t len = ma_min(BK, j_end - j), n = FN(keys_read)(&a->key_padding_mask, b, j, len);
        if (n == 0 && nc == 0) *j0 = j + len; /* (wholly padded, before the step) */
        else nc += n;
        j += len;
    }
    *j1 = j;
    return nc;
}

/* Whether the scores of the 8-bit cache's key rows are integer products (DOT_ROWS_I8): key rows
 * (not K^T pages) of int8 in a float32 instance. */
static inline int FN(i8_scores)(const ma_attn_args *a) {
#ifdef MA_ACC_F64
    (void)a;
    return 0;
#else
    return FN(kv_dtype)(a) == MA_I8 && a->k_stride[3] == 1;
#endif
}

/* A query row q (D elements, scale * Q) for DOT_ROWS_I8: q16 = round(q Qm / max |q|) (ties to
 * even), *qs = max |q| / Qm, Qm = min(32767, (2^31 - 1) / (128 D)), so that a dot product with
 * int8 keys (|k| <= 128) stays exact in int32. A row of zeros: qs 0; with inf or NaN: qs NaN (its
 * scores NaN, as the float products give). q16's rounding (half a step of max |q| / Qm an
 * element) is 1/256 of the int8 keys' own (docs/design/16-kv-int8.md). */
static void FN(quantize_q16)(const ACC *q, int64_t D, int16_t *q16, float *qs) {
    const float qm = (float)ma_min(32767, (int64_t)INT32_MAX / (128 * D));
    float mx = 0;
    int finite = 1;
    for (int64_t d = 0; d < D; d++) {
        const float v = (float)q[d];
        if (!isfinite(v)) finite = 0;
        else if (fabsf(v) > mx) mx = fabsf(v);
    }
    if (!finite || mx == 0) {
        memset(q16, 0, (size_t)D * sizeof(int16_t));
        *qs = finite ? 0.0f : NAN;
        return;
    }
    const float inv = qm / mx;
    for (int64_t d = 0; d < D; d++) q16[d] = (int16_t)lrintf((float)q[d] * inv);
    *qs = mx / qm;
}

/* A decode task's state: for each of its key heads (p->decode_kv_heads of them), rows (at most
 * p->decode_rows): scale * Q, the chunk's running state (o, m, l), the fold's (O, M, L); and the
 * step's scratch (one key head's rows). */
typedef struct {
    ACC *q, *o, *m, *l, *O, *M, *L;
    int16_t *q16; /* (KG, rows, D): q for DOT_ROWS_I8 (FN(i8_scores)) */
    float *qs;    /* (KG, rows): its scales */
    FN(rows_tmp) tmp;
    ma_dropout *drop;         /* (KG, rows): each head's dropout, where the call has one */
    const ma_dropout **drops; /* (KG, rows): pointers to them */
} FN(decode_scratch);

/* Keys per softmax step (FN(rows_step)) of an entry of nr query rows: up to MA_DECODE_CHUNK,
 * halved (to block_k at least) while the scores of a key head's G nr rows take more than
 * MA_DECODE_SCORES elements. Every step rescales O and switches the stream from K to V and
 * back: on Zen 3, 512-key steps ran 1.01-1.11x 64-key ones over (B, H_kv, L, D) caches
 * (float32, bfloat16, int8; grouped and multi-head) and 0.92-0.96x in float32 over key heads
 * side by side (8 in lockstep, their scores past L1; docs/performance.md). A function of the
 * entry's own rows, never of the batch, layout, split or threads, so a row's bits are those of
 * any of them. K^T pages keep block_k (the tiles' rescales: a prefill's bits within a chunk),
 * as do the instances whose tiles take the scores (of block_k keys). */
#define MA_DECODE_SCORES 4096
static inline int64_t FN(decode_block)(const ma_attn_fwd_params *p, int64_t nr) {
    const int64_t BK = p->a.block_k, rows = p->a.H / p->a.Hkv * nr;
    if (p->a.k_stride[3] != 1) return BK;
#ifdef MA_TILE_HOOKS
    if (FN(tiles_apply)(p)) return BK;
#endif
    int64_t n = MA_DECODE_CHUNK;
    while (n > BK && rows * n > MA_DECODE_SCORES) n /= 2;
    return ma_max(n, BK);
}

/* A key head's scores: a slab's rows (at most p->decode_rows) over a step's keys. */
static inline int64_t FN(decode_scores)(const ma_attn_fwd_params *p) {
    return ma_max(MA_DECODE_SCORES, p->decode_rows * p->a.block_k);
}

static inline size_t FN(decode_extra_elems)(const ma_attn_fwd_params *p) {
    const int64_t R = p->decode_rows, RA = p->decode_kv_heads * R;
    return (size_t)(RA * (p->a.D + 2 * p->a.Dv + 5) + p->decode_kv_heads * FN(decode_scores)(p) + 3 * R);
}

static inline size_t FN(decode_drop_bytes)(const ma_attn_fwd_params *p) {
    return ma_round_up((size_t)(p->decode_kv_heads * p->decode_rows) * (sizeof(ma_dropout) + sizeof(void *)),
                       MA_CACHE_LINE);
}

static inline size_t FN(decode_fwd_bytes)(const ma_attn_fwd_params *p) {
    const int64_t BQ = p->a.block_q, BK = p->a.block_k, D = p->a.D, Dv = p->a.Dv;
    return ma_round_up(MA_CACHE_LINE + (size_t)(D * BQ + BK * BQ + BQ * Dv + 5 * BQ) * sizeof(ACC), MA_CACHE_LINE);
}

/* q16 and qs of the 8-bit cache's key rows (FN(i8_scores)), else none */
static inline size_t FN(decode_q16_bytes)(const ma_attn_fwd_params *p) {
    const size_t RA = (size_t)(p->decode_kv_heads * p->decode_rows);
    return FN(i8_scores)(&p->a) ? ma_round_up(RA * (size_t)p->a.D * sizeof(int16_t), MA_CACHE_LINE) +
                                      ma_round_up(RA * sizeof(float), MA_CACHE_LINE)
                                : 0;
}

/* Where the hooks' scratch starts: after the forward's, the decode state, the dropouts and q16. */
static size_t FN(decode_tiles_at)(const ma_attn_fwd_params *p) {
    return FN(decode_fwd_bytes)(p) + ma_round_up(FN(decode_extra_elems)(p) * sizeof(ACC), MA_CACHE_LINE) +
           FN(decode_drop_bytes)(p) + FN(decode_q16_bytes)(p);
}

/* The forward's scratch (FN(fwd_carve): c->t, which FN(fwd_head_end) uses) without its head
 * caches (the rows are read in place), then the decode state. */
static size_t FN(decode_scratch_bytes)(const ma_attn_fwd_params *p) {
    size_t n = FN(decode_tiles_at)(p);
#ifdef MA_TILE_HOOKS
    if (FN(tiles_apply)(p)) n += FN(tiles_fwd_scratch_bytes)(p);
#endif
    return n;
}

static FN(decode_scratch) FN(decode_carve)(void *scratch, const ma_attn_fwd_params *p) {
    const int64_t D = p->a.D, Dv = p->a.Dv, R = p->decode_rows, RA = p->decode_kv_heads * R;
    ACC *x = (ACC *)((char *)scratch + FN(decode_fwd_bytes)(p));
    FN(decode_scratch) d;
    d.q = x, x += RA * D;
    d.o = x, x += RA * Dv;
    d.O = x, x += RA * Dv;
    d.m = x, d.l = x + RA, d.M = x + 2 * RA, d.L = x + 3 * RA, x += 4 * RA;
    d.tmp.s = x, x += p->decode_kv_heads * FN(decode_scores)(p);
    d.tmp.m_new = x, d.tmp.lsum = x + R, d.tmp.alpha = x + 2 * R, x += 3 * R;
    d.tmp.sums = x;
    char *y =
        (char *)scratch + FN(decode_fwd_bytes)(p) + ma_round_up(FN(decode_extra_elems)(p) * sizeof(ACC), MA_CACHE_LINE);
    d.drop = (ma_dropout *)y; /* (sizeof(ma_dropout) a multiple of a pointer's) */
    d.drops = (const ma_dropout **)(y + (size_t)RA * sizeof(ma_dropout));
    y += FN(decode_drop_bytes)(p);
    d.q16 = FN(i8_scores)(&p->a) ? (int16_t *)y : NULL;
    d.qs = FN(i8_scores)(&p->a) ? (float *)(y + ma_round_up((size_t)(RA * D) * sizeof(int16_t), MA_CACHE_LINE)) : NULL;
    return d;
}

static void FN(decode_reset)(ACC *o, ACC *m, ACC *l, int64_t R, int64_t Dv) {
    for (int64_t r = 0; r < R; r++) m[r] = -(ACC)INFINITY, l[r] = 0;
    for (int64_t x = 0; x < R * Dv; x++) o[x] = 0;
}

/* Rows (b, key head hk, slab): heads h0 .. h0 + nh, nr query rows each, and the entry's chunks
 * [c_lo, c_hi) that its rows see; entry b's params (FN(fwd_seq)) into *loc where varlen. */
typedef struct {
    int64_t b, hk, slab, h0, nh, nr, c_lo, c_hi, kv_begin, kv_end;
} FN(decode_rows);

static const ma_attn_fwd_params *FN(decode_locate)(const ma_attn_fwd_params *p0, int64_t b, int64_t hk, int64_t slab,
                                                   ma_attn_fwd_params *loc, FN(decode_rows) * it) {
    const int64_t G = p0->a.H / p0->a.Hkv, CK = MA_DECODE_CHUNK;
    const ma_attn_fwd_params *p = FN(fwd_seq)(p0, b, loc);
    it->b = b, it->hk = hk, it->slab = slab;
    it->h0 = hk * G + slab * p0->decode_slab_heads;
    it->nh = ma_min(p0->decode_slab_heads, G - slab * p0->decode_slab_heads);
    it->nr = p->a.Lq;
    FN(kv_range)(&p->a, 0, it->nr, &it->kv_begin, &it->kv_end);
    it->c_lo = it->kv_begin / CK;
    it->c_hi = it->kv_end > it->kv_begin ? ma_cdiv(it->kv_end, CK) : it->c_lo;
    return p;
}

/* Where chunk c of (b, hk, slab) leaves its partial state: (rows, Dv) o, then m, l. */
static ACC *FN(decode_part)(const ma_attn_fwd_params *p0, const FN(decode_rows) * it, int64_t c) {
    const int64_t c0 = p0->decode_chunk0 ? p0->decode_chunk0[it->b] : it->b * ma_cdiv(p0->a.Lk, MA_DECODE_CHUNK);
    const int64_t slot = ((c0 + c) * p0->a.Hkv + it->hk) * p0->decode_slabs + it->slab;
    return (ACC *)p0->decode_part + slot * p0->decode_rows * (p0->a.Dv + 2);
}

/* out, lse of the rows from the folded state (FN(fwd_head_end), head by head). */
static void FN(decode_end)(FN(fwd_task) * c, const ma_attn_fwd_params *p, const FN(decode_rows) * it, ACC *o, ACC *m,
                           ACC *l) {
    const int64_t nr = it->nr, Dv = p->a.Dv;
    for (int64_t y = 0; y < it->nh; y++) {
        FN(fwd_head) e;
        e.o = o + y * nr * Dv, e.m = m + y * nr, e.l = l + y * nr, e.dr = NULL;
        FN(fwd_head_end)(c, p, &e, it->b, it->h0 + y, 0, nr, 1);
    }
}

/* Work item w = ((b (Hkv / KG) + g) slabs + slab) splits + split, KG = p->decode_kv_heads:
 * key heads g KG .. g KG + KG in lockstep, key block by key block (where the heads lie side by
 * side in each row: the rows are read whole, each head's step prefetching the next head's
 * part of them, the last head's the first head's part of the next block). */
static void FN(attn_decode)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_fwd_params *p0 = (const ma_attn_fwd_params *)ctx->params;
    FN(fwd_task) task, *c = &task;
    FN(fwd_task_begin)(c, ctx, FN(decode_tiles_at)(p0));
    FN(decode_scratch) d = FN(decode_carve)(ctx->scratch, p0);
    const int64_t S = p0->decode_splits, KG = p0->decode_kv_heads, D = p0->a.D, Dv = p0->a.Dv;
    const int64_t CK = MA_DECODE_CHUNK, RM = p0->decode_rows, slabs = p0->decode_slabs;
    const int64_t es = ma_dtype_size(FN(kv_dtype)(&p0->a));
    const int64_t pf_rows_k = ma_max(2, ma_cdiv(MA_DECODE_PF_BYTES, D * es));
    const int64_t pf_rows_v = ma_max(2, ma_cdiv(MA_DECODE_PF_BYTES, Dv * es));
    for (int64_t w = begin; w < end; w++) {
        const int64_t split = w % S, slab = (w / S) % slabs, g = (w / (S * slabs)) % (p0->a.Hkv / KG);
        const int64_t b = w / (S * slabs * (p0->a.Hkv / KG));
        ma_attn_fwd_params loc;
        FN(decode_rows) it[MA_DECODE_KV_HEADS];
        const ma_attn_fwd_params *p = NULL;
        for (int64_t x = 0; x < KG; x++) p = FN(decode_locate)(p0, b, g * KG + x, slab, &loc, &it[x]);
        c->gen.p = p;
        const int64_t n = it[0].c_hi - it[0].c_lo, nr = it[0].nr, R = it[0].nh * nr, *ks = p->a.k_stride,
                      *vs = p->a.v_stride;
        const int whole = S == 1 || n <= 1; /* this item holds all of the entry's chunks: it ends the rows */
        const int64_t DB = FN(decode_block)(p, nr);
        if (nr == 0 || nr > MA_DECODE_QROWS || (whole && split > 0)) continue; /* long: the tile path's */
        const int64_t cb = whole ? it[0].c_lo : it[0].c_lo + split * n / S;
        const int64_t ce = whole ? it[0].c_hi : it[0].c_lo + (split + 1) * n / S;
        for (int64_t x = 0; x < KG; x++)
            for (int64_t y = 0; y < it[x].nh; y++)
                for (int64_t r = 0; r < nr; r++)
                    FN(convert_row)(d.q + (x * RM + y * nr + r) * D, 1, p->a.q, p->a.dtype,
                                    b * p->a.q_stride[0] + (it[x].h0 + y) * p->a.q_stride[1] + r * p->a.q_stride[2],
                                    p->a.q_stride[3], D, (ACC)p->a.scale);
        if (d.q16)
            for (int64_t x = 0; x < KG; x++)
                for (int64_t r = 0; r < R; r++)
                    FN(quantize_q16)(d.q + (x * RM + r) * D, D, d.q16 + (x * RM + r) * D, d.qs + x * RM + r);
        for (int64_t x = 0; x < KG; x++) FN(decode_reset)(d.O + x * RM * Dv, d.M + x * RM, d.L + x * RM, R, Dv);
        for (int64_t ch = cb; ch < ce; ch++) {
            const int64_t j_end = ma_min(it[0].kv_end, (ch + 1) * CK);
            for (int64_t x = 0; x < KG; x++) FN(decode_reset)(d.o + x * RM * Dv, d.m + x * RM, d.l + x * RM, R, Dv);
            for (int64_t j0 = ma_max(it[0].kv_begin, ch * CK), j1; j0 < j_end; j0 = j1) {
                const int64_t nc = FN(decode_step)(&p->a, b, &j0, j_end, DB, &j1);
                if (nc == 0) continue;
                const int64_t jn = j1 < it[0].kv_end ? j1 : j0; /* the next step, or this one */
                const int64_t next_k = FN(key_off)(&p->a, ks, p->a.k_page_stride, b, jn) -
                                       FN(key_off)(&p->a, ks, p->a.k_page_stride, b, j0);
                const int64_t next_v = FN(key_off)(&p->a, vs, p->a.v_page_stride, b, jn) -
                                       FN(key_off)(&p->a, vs, p->a.v_page_stride, b, j0);
                FN(row_block) rw[MA_DECODE_KV_HEADS];
                for (int64_t x = 0; x < KG; x++) {
                    if (ma_dropout_on(&p->a))
                        for (int64_t y = 0; y < it[x].nh; y++)
                            d.drops[x * RM + y] = FN(head_dropout)(&p->a, b, it[x].h0 + y, &d.drop[x * RM + y]);
                    const FN(row_block) r = {d.q + x * RM * D,
                                             d.q16 ? d.q16 + x * RM * D : NULL,
                                             d.qs ? d.qs + x * RM : NULL,
                                             d.o + x * RM * Dv,
                                             d.m + x * RM,
                                             d.l + x * RM,
                                             ma_dropout_on(&p->a) ? d.drops + x * RM : NULL,
                                             b,
                                             it[x].h0,
                                             it[x].hk,
                                             0,
                                             nr,
                                             it[x].nh};
                    rw[x] = r;
                }
                /* prefetch: one key head, key and value rows MA_DECODE_PF_BYTES on (the stream the
                 * products read; K^T pages the next key block); heads in lockstep, FN(lockstep_pf) */
                FN(rows_step)(c, p, rw, KG, &d.tmp, j0, nc, ks[3] == 1 ? pf_rows_k * ks[2] : next_k, pf_rows_v * vs[2],
                              next_k, next_v);
            }
            for (int64_t x = 0; x < KG; x++) {
                ACC *o = d.o + x * RM * Dv, *m = d.m + x * RM, *l = d.l + x * RM;
                if (whole) FN(decode_fold)(d.M + x * RM, d.L + x * RM, d.O + x * RM * Dv, m, l, o, R, Dv);
                else { /* the partial state, for the merge */ ACC *part = FN(decode_part)(p0, &it[x], ch);
                    memcpy(part, o, (size_t)(R * Dv) * sizeof(ACC));
                    memcpy(part + RM * Dv, m, (size_t)R * sizeof(ACC));
                    memcpy(part + RM * (Dv + 1), l, (size_t)R * sizeof(ACC));
                }
            }
        }
        if (whole)
            for (int64_t x = 0; x < KG; x++)
                FN(decode_end)(c, p, &it[x], d.O + x * RM * Dv, d.M + x * RM, d.L + x * RM);
    }
    FN(fwd_task_end)(c);
}

/* After the decode task where an entry's chunks were split between items, work item
 * w = (b Hkv + hk) slabs + slab: the chunks' partial states folded in chunk order
 * (FN(decode_fold), as an item holding them all folds them), then out and lse. */
static void FN(attn_decode_merge)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_fwd_params *p0 = (const ma_attn_fwd_params *)ctx->params;
    FN(fwd_task) task, *c = &task;
    FN(fwd_task_begin)(c, ctx, FN(decode_tiles_at)(p0));
    FN(decode_scratch) d = FN(decode_carve)(ctx->scratch, p0);
    const int64_t Dv = p0->a.Dv, S = p0->decode_splits, RM = p0->decode_rows, slabs = p0->decode_slabs;
    for (int64_t w = begin; w < end; w++) {
        ma_attn_fwd_params loc;
        FN(decode_rows) it;
        const ma_attn_fwd_params *p =
            FN(decode_locate)(p0, w / (slabs * p0->a.Hkv), (w / slabs) % p0->a.Hkv, w % slabs, &loc, &it);
        c->gen.p = p;
        const int64_t R = it.nh * it.nr;
        if (it.nr == 0 || it.nr > MA_DECODE_QROWS || S == 1 || it.c_hi - it.c_lo <= 1) continue; /* ended by its item */
        FN(decode_reset)(d.O, d.M, d.L, R, Dv);
        for (int64_t ch = it.c_lo; ch < it.c_hi; ch++) {
            const ACC *part = FN(decode_part)(p0, &it, ch);
            FN(decode_fold)(d.M, d.L, d.O, part + RM * Dv, part + RM * (Dv + 1), part, R, Dv);
        }
        FN(decode_end)(c, p, &it, d.O, d.M, d.L);
    }
    FN(fwd_task_end)(c);
}
