/*
 * attention_tmpl.h -- masked attention forward and backward, written once
 * over the accumulation type. attention.c includes it twice:
 *   ACC = float  (float32, bfloat16, float16 inputs: float32 accumulation)
 *   ACC = double (float64 inputs, for gradcheck)
 * with FN(x) giving each instance its suffix, LOAD/STORE the element access
 * of that precision, EXP/LOG the libm functions.
 *
 * Shapes: B, H, Hkv, Lq, Lk, D, Dv as in masked_attn.h; G = H / Hkv.
 * Tiles live in the thread's scratch, contiguous, in ACC:
 *   q_t (BQ, D) = scale * q     k_t (BK, D)    kT_t (D, BK) = k_t^T
 *   v_t (BK, Dv)   vT_t (Dv, BK)   s_t (BQ, BK)   o_t (BQ, Dv)
 * so that every matrix product is one GEMM call on row-major tiles.
 * where BQ, BK are block_q, block_k and a tile may be cut short at the edges
 * (nr <= BQ rows, nc <= BK columns).
 *
 * The algorithm is FlashAttention-2: the forward keeps a running max m and
 * sum l per query row over key blocks (online softmax) and saves only
 * lse = m + log l; the backward recomputes P = exp(S - lse) tile by tile.
 */

/* ---- tile building blocks --------------------------------------------- */

/* dst (nr, ncol) = mul * src[b, h, r0 : r0 + nr, 0 : ncol]; overwrites. */
static void FN(load_tile)(ACC *dst, const void *src, ma_dtype dt, const int64_t st[4],
                          int64_t b, int64_t h, int64_t r0, int64_t nr, int64_t ncol, ACC mul) {
    for (int64_t r = 0; r < nr; r++) {
        const int64_t base = b * st[0] + h * st[1] + (r0 + r) * st[2];
        ACC *dst_r = dst + r * ncol;
        if (dt == MA_F32 && st[3] == 1 && sizeof(ACC) == sizeof(float)) {
            const float *src_r = (const float *)src + base;
            for (int64_t c = 0; c < ncol; c++) dst_r[c] = mul * (ACC)src_r[c];
        } else {
            for (int64_t c = 0; c < ncol; c++) dst_r[c] = mul * LOAD(src, dt, base + c * st[3]);
        }
    }
}

/* dst (ncol, nr) = src[b, h, r0 : r0 + nr, 0 : ncol]^T; overwrites. */
static void FN(load_tile_t)(ACC *dst, const void *src, ma_dtype dt, const int64_t st[4],
                            int64_t b, int64_t h, int64_t r0, int64_t nr, int64_t ncol) {
    for (int64_t r = 0; r < nr; r++) {
        const int64_t base = b * st[0] + h * st[1] + (r0 + r) * st[2];
        for (int64_t c = 0; c < ncol; c++) dst[c * nr + r] = LOAD(src, dt, base + c * st[3]);
    }
}

/* dst[b, h, r0 : r0 + nr, 0 : ncol] = mul * src (nr, ncol); overwrites. */
static void FN(store_tile)(void *dst, ma_dtype dt, const int64_t st[4], int64_t b, int64_t h,
                           int64_t r0, int64_t nr, int64_t ncol, const ACC *src, ACC mul) {
    for (int64_t r = 0; r < nr; r++) {
        const int64_t base = b * st[0] + h * st[1] + (r0 + r) * st[2];
        const ACC *src_r = src + r * ncol;
        for (int64_t c = 0; c < ncol; c++) STORE(dst, dt, base + c * st[3], mul * src_r[c]);
    }
}

/* The additive form of one mask element: bool true -> -inf, float as is. */
static inline ACC FN(mask_value)(const ma_mask *m, int64_t off) {
    if (m->dtype == MA_BOOL) return ((const uint8_t *)m->ptr)[off] ? -(ACC)INFINITY : 0;
    return LOAD(m->ptr, m->dtype, off);
}

/* s_t (nr, nc) += bias[b, h, i0 : i0 + nr, j0 : j0 + nc]: causal, key padding
 * and attn_mask in their additive forms; accumulates. */
static void FN(add_bias)(ACC *s_t, const ma_mask *am, const ma_mask *kpm, int is_causal,
                         int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t j0, int64_t nc) {
    for (int64_t r = 0; r < nr; r++) {
        const int64_t i = i0 + r;
        ACC *s_r = s_t + r * nc;
        if (kpm->ptr) {
            const int64_t base = b * kpm->stride[0] + j0 * kpm->stride[1];
            for (int64_t c = 0; c < nc; c++) s_r[c] += FN(mask_value)(kpm, base + c * kpm->stride[1]);
        }
        if (am->ptr) {
            const int64_t base = b * am->stride[0] + h * am->stride[1] + i * am->stride[2] +
                                 j0 * am->stride[3];
            for (int64_t c = 0; c < nc; c++) s_r[c] += FN(mask_value)(am, base + c * am->stride[3]);
        }
        if (is_causal) /* key j = j0 + c is in the future of query i when j > i */
            for (int64_t c = i - j0 + 1 < 0 ? 0 : i - j0 + 1; c < nc; c++) s_r[c] = -(ACC)INFINITY;
    }
}

/* Is every key j0 .. j0 + nc - 1 of batch b padding? Such a block is skipped
 * whole: its probabilities are exactly 0 for every query. */
static int FN(keys_all_padded)(const ma_mask *kpm, int64_t b, int64_t j0, int64_t nc) {
    if (!kpm->ptr) return 0;
    const int64_t base = b * kpm->stride[0] + j0 * kpm->stride[1];
    for (int64_t c = 0; c < nc; c++)
        if (FN(mask_value)(kpm, base + c * kpm->stride[1]) != -(ACC)INFINITY) return 0;
    return 1;
}

static inline ACC FN(head_scale)(const ma_mask *hm, int64_t b, int64_t h) {
    return hm->ptr ? LOAD(hm->ptr, hm->dtype, b * hm->stride[0] + h * hm->stride[1]) : (ACC)1;
}

/* Keys a query block [i0, i0 + nr) can see: [0, kv_end). */
static inline int64_t FN(kv_end)(int is_causal, int64_t Lk, int64_t i0, int64_t nr) {
    return is_causal ? ma_min(Lk, i0 + nr) : Lk;
}

/* s_t (nr, nc) = P = exp(S - lse) in place; a fully masked row (lse = -inf) gives 0. */
static void FN(probs)(ACC *s_t, const ACC *lse_r, int64_t nr, int64_t nc) {
    for (int64_t r = 0; r < nr; r++) {
        ACC *s_r = s_t + r * nc;
        const ACC lse = lse_r[r];
        if (lse == -(ACC)INFINITY) {
            for (int64_t c = 0; c < nc; c++) s_r[c] = 0;
        } else {
            (void)EXP_SUB_SUM(s_r, nc, lse);
        }
    }
}

/* ---- forward ------------------------------------------------------------ */

typedef struct {
    ACC *q_t, *kT_t, *v_t, *s_t, *o_t, *m, *l, *lse;
} FN(fwd_scratch);

static FN(fwd_scratch) FN(fwd_carve)(void *scratch, int64_t BQ, int64_t BK, int64_t D, int64_t Dv) {
    FN(fwd_scratch) t;
    t.q_t = (ACC *)scratch;          /* (BQ, D)  */
    t.kT_t = t.q_t + BQ * D;         /* (D, BK)  */
    t.v_t = t.kT_t + BK * D;         /* (BK, Dv) */
    t.s_t = t.v_t + BK * Dv;         /* (BQ, BK) */
    t.o_t = t.s_t + BQ * BK;         /* (BQ, Dv) */
    t.m = t.o_t + BQ * Dv;           /* (BQ) */
    t.l = t.m + BQ;                  /* (BQ) */
    t.lse = t.l + BQ;                /* (BQ) */
    return t;
}

static inline size_t FN(fwd_scratch_elems)(int64_t BQ, int64_t BK, int64_t D, int64_t Dv) {
    return (size_t)(BQ * D + BK * D + BK * Dv + BQ * BK + BQ * Dv + 3 * BQ);
}

/* s_t (nr, nc) = q_t @ kT_t + bias: the scaled, masked scores of a tile. */
#define SCORES(t_s, t_q, t_kT, nr, nc)                                                      \
    do {                                                                                    \
        GEMM(nr, nc, D, t_q, D, 1, t_kT, nc, t_s, nc, 0);                                   \
        FN(add_bias)(t_s, &p->attn_mask, &p->key_padding_mask, p->is_causal, b, h, i0, nr, j0, nc); \
    } while (0)

static void FN(attn_fwd)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_fwd_params *p = (const ma_attn_fwd_params *)ctx->params;
    const int64_t H = p->H, G = p->H / p->Hkv, Lq = p->Lq, Lk = p->Lk, D = p->D, Dv = p->Dv;
    const int64_t BQ = p->block_q, BK = p->block_k, nq = ma_cdiv(Lq, BQ);
    const ACC scale = (ACC)p->scale;
    FN(fwd_scratch) t = FN(fwd_carve)(ctx->scratch, BQ, BK, D, Dv);

    for (int64_t w = begin; w < end; w++) {
        const int64_t b = w / (H * nq), h = (w / nq) % H, qb = w % nq, hk = h / G;
        const int64_t i0 = qb * BQ, nr = ma_min(BQ, Lq - i0);
        const int64_t kv_end = FN(kv_end)(p->is_causal, Lk, i0, nr);

        FN(load_tile)(t.q_t, p->q, p->dtype, p->q_stride, b, h, i0, nr, D, scale);
        for (int64_t r = 0; r < nr; r++) {
            t.m[r] = -(ACC)INFINITY;
            t.l[r] = 0;
        }
        for (int64_t x = 0; x < nr * Dv; x++) t.o_t[x] = 0;

        for (int64_t j0 = 0; j0 < kv_end; j0 += BK) {
            const int64_t nc = ma_min(BK, kv_end - j0);
            if (FN(keys_all_padded)(&p->key_padding_mask, b, j0, nc)) continue;
            FN(load_tile_t)(t.kT_t, p->k, p->dtype, p->k_stride, b, hk, j0, nc, D);
            FN(load_tile)(t.v_t, p->v, p->dtype, p->v_stride, b, hk, j0, nc, Dv, 1);
            /* S = scale * Q K^T + bias */
            SCORES(t.s_t, t.q_t, t.kT_t, nr, nc);
            /* online softmax: m_new = max(m, rowmax S); P = exp(S - m_new); O = O * exp(m - m_new) */
            for (int64_t r = 0; r < nr; r++) {
                ACC *s_r = t.s_t + r * nc, *o_r = t.o_t + r * Dv;
                ACC m_new = t.m[r];
                for (int64_t c = 0; c < nc; c++)
                    if (s_r[c] > m_new || s_r[c] != s_r[c]) m_new = s_r[c]; /* NaN sticks */
                if (m_new == -(ACC)INFINITY) { /* every key so far masked: P = 0 */
                    for (int64_t c = 0; c < nc; c++) s_r[c] = 0;
                    continue;
                }
                const ACC alpha = EXP(t.m[r] - m_new);
                t.l[r] = alpha * t.l[r] + EXP_SUB_SUM(s_r, nc, m_new);
                t.m[r] = m_new;
                if (alpha != 1)
                    for (int64_t d = 0; d < Dv; d++) o_r[d] *= alpha;
            }
            /* O += P V */
            GEMM(nr, Dv, nc, t.s_t, nc, 1, t.v_t, Dv, t.o_t, Dv, 1);
        }

        /* out = hm * O / l;  lse = m + log l.  A fully masked row (l = 0) gives 0 and -inf. */
        const ACC hm = FN(head_scale)(&p->head_mask, b, h);
        ACC *lse_bh = (ACC *)p->lse + (b * H + h) * Lq;
        for (int64_t r = 0; r < nr; r++) {
            ACC *o_r = t.o_t + r * Dv;
            if (t.l[r] == 0) {
                for (int64_t d = 0; d < Dv; d++) o_r[d] = 0;
                t.lse[r] = -(ACC)INFINITY;
            } else {
                const ACC inv = hm / t.l[r];
                for (int64_t d = 0; d < Dv; d++) o_r[d] *= inv;
                t.lse[r] = t.m[r] + LOG(t.l[r]);
            }
            lse_bh[i0 + r] = t.lse[r];
        }
        FN(store_tile)(p->out, p->dtype, p->out_stride, b, h, i0, nr, Dv, t.o_t, 1);

        /* weights = hm * exp(S - lse) over every key, on request only */
        if (p->weights) {
            const int64_t w_st[4] = {H * Lq * Lk, Lq * Lk, Lk, 1};
            for (int64_t j0 = 0; j0 < Lk; j0 += BK) {
                const int64_t nc = ma_min(BK, Lk - j0);
                FN(load_tile_t)(t.kT_t, p->k, p->dtype, p->k_stride, b, hk, j0, nc, D);
                SCORES(t.s_t, t.q_t, t.kT_t, nr, nc);
                FN(probs)(t.s_t, t.lse, nr, nc);
                for (int64_t r = 0; r < nr; r++)
                    for (int64_t c = 0; c < nc; c++)
                        STORE(p->weights, p->dtype, b * w_st[0] + h * w_st[1] + (i0 + r) * w_st[2] + j0 + c,
                              hm * t.s_t[r * nc + c]);
            }
        }
    }
}

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
 *   1. S_ij = (scale * q_i) . k_j + bias_ij
 *        dq_i   += scale * sum_j dS_ij k_j
 *        dk_j   += sum_i dS_ij (scale * q_i)
 */

typedef struct {
    ACC *q_t, *g_t, *k_t, *kT_t, *vT_t, *s_t, *dp_t, *acc_a, *acc_b, *lse, *delta, *dhm;
} FN(bwd_scratch);

static FN(bwd_scratch) FN(bwd_carve)(void *scratch, int64_t BQ, int64_t BK, int64_t D, int64_t Dv) {
    const int64_t BM = BQ > BK ? BQ : BK;
    FN(bwd_scratch) t;
    t.q_t = (ACC *)scratch;          /* (BQ, D) scaled */
    t.g_t = t.q_t + BQ * D;          /* (BQ, Dv) */
    t.k_t = t.g_t + BQ * Dv;         /* (BK, D)  */
    t.kT_t = t.k_t + BK * D;         /* (D, BK)  */
    t.vT_t = t.kT_t + BK * D;        /* (Dv, BK) */
    t.s_t = t.vT_t + BK * Dv;        /* (BQ, BK) */
    t.dp_t = t.s_t + BQ * BK;        /* (BQ, BK) */
    t.acc_a = t.dp_t + BQ * BK;      /* dq (BQ, D) or dk (BK, D) */
    t.acc_b = t.acc_a + BM * D;      /* dv (BK, Dv) */
    t.lse = t.acc_b + BK * Dv;       /* (BQ) */
    t.delta = t.lse + BQ;            /* (BQ) */
    t.dhm = t.delta + BQ;            /* (BQ) */
    return t;
}

static inline size_t FN(bwd_scratch_elems)(int64_t BQ, int64_t BK, int64_t D, int64_t Dv) {
    const int64_t BM = BQ > BK ? BQ : BK;
    return (size_t)(BQ * D + BQ * Dv + 2 * BK * D + BK * Dv + 2 * BQ * BK + BM * D + BK * Dv + 3 * BQ);
}

/* dp_t (nr, nc) = g_t (nr, Dv) @ vT_t (Dv, nc) + dW[b, h, i0:, j0:]; overwrites. */
static void FN(dprobs)(ACC *dp_t, const ACC *g_t, const ACC *vT_t, const ma_attn_bwd_params *p,
                       int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t j0, int64_t nc) {
    const int64_t Dv = p->Dv;
    GEMM(nr, nc, Dv, g_t, Dv, 1, vT_t, nc, dp_t, nc, 0);
    if (p->dweights) {
        const int64_t *st = p->dweights_stride;
        for (int64_t r = 0; r < nr; r++) {
            const int64_t base = b * st[0] + h * st[1] + (i0 + r) * st[2] + j0 * st[3];
            for (int64_t c = 0; c < nc; c++) dp_t[r * nc + c] += LOAD(p->dweights, p->dtype, base + c * st[3]);
        }
    }
}

/* ds_t (nr, nc) = P * (hm * dP - delta) in place of dp_t; returns nothing.
 * Also dhm_r[r] += sum_c P dP (the head mask's gradient, before hm). */
static void FN(dscores)(ACC *dp_t, const ACC *s_t, const ACC *delta, ACC *dhm_r, ACC hm, int64_t nr,
                        int64_t nc) {
    for (int64_t r = 0; r < nr; r++) {
        const ACC *p_r = s_t + r * nc;
        ACC *dp_r = dp_t + r * nc;
        ACC dhm = 0;
        for (int64_t c = 0; c < nc; c++) {
            dhm += p_r[c] * dp_r[c];
            dp_r[c] = p_r[c] * (hm * dp_r[c] - delta[r]);
        }
        if (dhm_r) dhm_r[r] += dhm;
    }
}

/* Pass 1, work item (b, h, q-block): delta and dq for its rows. */
static void FN(attn_bwd_dq)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_bwd_params *p = (const ma_attn_bwd_params *)ctx->params;
    const int64_t H = p->H, G = p->H / p->Hkv, Lq = p->Lq, Lk = p->Lk, D = p->D, Dv = p->Dv;
    const int64_t BQ = p->block_q, BK = p->block_k, nq = ma_cdiv(Lq, BQ);
    const ACC scale = (ACC)p->scale;
    FN(bwd_scratch) t = FN(bwd_carve)(ctx->scratch, BQ, BK, D, Dv);
    ACC *dq_t = t.acc_a;

    for (int64_t w = begin; w < end; w++) {
        const int64_t b = w / (H * nq), h = (w / nq) % H, qb = w % nq, hk = h / G;
        const int64_t i0 = qb * BQ, nr = ma_min(BQ, Lq - i0);
        const int64_t kv_end = FN(kv_end)(p->is_causal, Lk, i0, nr);
        const ACC hm = FN(head_scale)(&p->head_mask, b, h);
        const ACC *lse_bh = (const ACC *)p->lse + (b * H + h) * Lq;
        ACC *delta_bh = (ACC *)p->delta + (b * H + h) * Lq;

        FN(load_tile)(t.q_t, p->q, p->dtype, p->q_stride, b, h, i0, nr, D, scale);
        FN(load_tile)(t.g_t, p->dout, p->dtype, p->dout_stride, b, h, i0, nr, Dv, 1);
        for (int64_t r = 0; r < nr; r++) {
            t.lse[r] = lse_bh[i0 + r];
            t.dhm[r] = 0;
            /* delta_i = g_i . out_i  (+ hm * sum_j P_ij dW_ij below) */
            const int64_t base = b * p->out_stride[0] + h * p->out_stride[1] + (i0 + r) * p->out_stride[2];
            ACC dot = 0;
            for (int64_t d = 0; d < Dv; d++)
                dot += t.g_t[r * Dv + d] * LOAD(p->out, p->dtype, base + d * p->out_stride[3]);
            t.delta[r] = dot;
        }
        if (p->dweights) {
            for (int64_t j0 = 0; j0 < kv_end; j0 += BK) {
                const int64_t nc = ma_min(BK, kv_end - j0);
                if (FN(keys_all_padded)(&p->key_padding_mask, b, j0, nc)) continue;
                FN(load_tile_t)(t.kT_t, p->k, p->dtype, p->k_stride, b, hk, j0, nc, D);
                SCORES(t.s_t, t.q_t, t.kT_t, nr, nc);
                FN(probs)(t.s_t, t.lse, nr, nc);
                const int64_t *st = p->dweights_stride;
                for (int64_t r = 0; r < nr; r++) {
                    const int64_t base = b * st[0] + h * st[1] + (i0 + r) * st[2] + j0 * st[3];
                    ACC dot = 0;
                    for (int64_t c = 0; c < nc; c++)
                        dot += t.s_t[r * nc + c] * LOAD(p->dweights, p->dtype, base + c * st[3]);
                    t.delta[r] += hm * dot;
                }
            }
        }
        for (int64_t r = 0; r < nr; r++) delta_bh[i0 + r] = t.delta[r];

        for (int64_t x = 0; x < nr * D; x++) dq_t[x] = 0;
        for (int64_t j0 = 0; j0 < kv_end; j0 += BK) {
            const int64_t nc = ma_min(BK, kv_end - j0);
            if (FN(keys_all_padded)(&p->key_padding_mask, b, j0, nc)) continue;
            FN(load_tile)(t.k_t, p->k, p->dtype, p->k_stride, b, hk, j0, nc, D, 1);
            FN(load_tile_t)(t.kT_t, p->k, p->dtype, p->k_stride, b, hk, j0, nc, D);
            FN(load_tile_t)(t.vT_t, p->v, p->dtype, p->v_stride, b, hk, j0, nc, Dv);
            SCORES(t.s_t, t.q_t, t.kT_t, nr, nc);
            FN(probs)(t.s_t, t.lse, nr, nc);
            FN(dprobs)(t.dp_t, t.g_t, t.vT_t, p, b, h, i0, nr, j0, nc);
            FN(dscores)(t.dp_t, t.s_t, t.delta, t.dhm, hm, nr, nc);
            /* dQ += dS K */
            GEMM(nr, D, nc, t.dp_t, nc, 1, t.k_t, D, dq_t, D, 1);
        }
        FN(store_tile)(p->dq, p->dtype, p->dq_stride, b, h, i0, nr, D, dq_t, scale);
        if (p->dhm_rows) {
            ACC *dhm_bh = (ACC *)p->dhm_rows + (b * H + h) * Lq;
            for (int64_t r = 0; r < nr; r++) dhm_bh[i0 + r] = t.dhm[r];
        }
    }
}

/* Pass 2, work item (b, hkv, k-block): dk and dv of its keys, summed over the
 * G query heads of the group and every query row that can see the block. */
static void FN(attn_bwd_dkdv)(int64_t begin, int64_t end, void *vctx) {
    const ma_task_ctx *ctx = (const ma_task_ctx *)vctx;
    const ma_attn_bwd_params *p = (const ma_attn_bwd_params *)ctx->params;
    const int64_t H = p->H, Hkv = p->Hkv, G = p->H / p->Hkv, Lq = p->Lq, Lk = p->Lk, D = p->D, Dv = p->Dv;
    const int64_t BQ = p->block_q, BK = p->block_k, nk = ma_cdiv(Lk, BK);
    const ACC scale = (ACC)p->scale;
    FN(bwd_scratch) t = FN(bwd_carve)(ctx->scratch, BQ, BK, D, Dv);
    ACC *dk_t = t.acc_a, *dv_t = t.acc_b;

    for (int64_t w = begin; w < end; w++) {
        const int64_t b = w / (Hkv * nk), hk = (w / nk) % Hkv, kb = w % nk;
        const int64_t j0 = kb * BK, nc = ma_min(BK, Lk - j0);
        for (int64_t x = 0; x < nc * D; x++) dk_t[x] = 0;
        for (int64_t x = 0; x < nc * Dv; x++) dv_t[x] = 0;

        if (!FN(keys_all_padded)(&p->key_padding_mask, b, j0, nc)) {
            FN(load_tile_t)(t.kT_t, p->k, p->dtype, p->k_stride, b, hk, j0, nc, D);
            FN(load_tile_t)(t.vT_t, p->v, p->dtype, p->v_stride, b, hk, j0, nc, Dv);
            /* queries i < j0 see none of these keys under the causal mask */
            const int64_t i_begin = p->is_causal ? j0 : 0;
            for (int64_t h = hk * G; h < (hk + 1) * G; h++) {
                const ACC hm = FN(head_scale)(&p->head_mask, b, h);
                const ACC *lse_bh = (const ACC *)p->lse + (b * H + h) * Lq;
                const ACC *delta_bh = (const ACC *)p->delta + (b * H + h) * Lq;
                for (int64_t i0 = i_begin; i0 < Lq; i0 += BQ) {
                    const int64_t nr = ma_min(BQ, Lq - i0);
                    FN(load_tile)(t.q_t, p->q, p->dtype, p->q_stride, b, h, i0, nr, D, scale);
                    FN(load_tile)(t.g_t, p->dout, p->dtype, p->dout_stride, b, h, i0, nr, Dv, 1);
                    for (int64_t r = 0; r < nr; r++) {
                        t.lse[r] = lse_bh[i0 + r];
                        t.delta[r] = delta_bh[i0 + r];
                    }
                    SCORES(t.s_t, t.q_t, t.kT_t, nr, nc);
                    FN(probs)(t.s_t, t.lse, nr, nc);
                    FN(dprobs)(t.dp_t, t.g_t, t.vT_t, p, b, h, i0, nr, j0, nc);
                    FN(dscores)(t.dp_t, t.s_t, t.delta, NULL, hm, nr, nc);
                    /* dK += dS^T (scale Q);  dV += (hm P)^T dO */
                    GEMM(nc, D, nr, t.dp_t, 1, nc, t.q_t, D, dk_t, D, 1);
                    if (hm != 1)
                        for (int64_t x = 0; x < nr * nc; x++) t.s_t[x] *= hm;
                    GEMM(nc, Dv, nr, t.s_t, 1, nc, t.g_t, Dv, dv_t, Dv, 1);
                }
            }
        }
        FN(store_tile)(p->dk, p->dtype, p->dk_stride, b, hk, j0, nc, D, dk_t, 1);
        FN(store_tile)(p->dv, p->dtype, p->dv_stride, b, hk, j0, nc, Dv, dv_t, 1);
    }
}

#undef SCORES
