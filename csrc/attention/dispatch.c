/* dispatch.c -- the public attention task functions (masked_attn.h): the one
 * switch from (dtype, instruction set) to an instance of attention_tmpl.h;
 * and the plans, the schedule of a call (passes, work items, grain, threads,
 * the groups and chunks the kernels read, varlen's work-item tables), the
 * same rules for dense and varlen calls. */
#include <stdatomic.h>

#include "blocks.h"
#include "common/dtype.h"
#include "common/isa.h"
#include "masked_attn.h"

/* float64 runs the double-accumulating instance whatever the ISA (the shim
 * asked common/isa.c for p->isa); float32, bfloat16, float16 the ISA's, but
 * AVX512-BF16's and SVE-BF16's products are for bfloat16 only (avx512bf16.c,
 * svebf16.c): their other dtypes run AVX-512's and NEON's. */
static const ma_attn_kernels *kernels(ma_dtype dt, ma_isa isa) {
    if (dt == MA_F64) return &ma_attn_kernels_f64;
    switch (isa) { /* the architecture's variants only: the others are not compiled in */
#if defined(__x86_64__) || defined(__i386__)
    case MA_ISA_AMX: return &ma_attn_kernels_amx;
    case MA_ISA_AVX512BF16: return dt == MA_BF16 ? &ma_attn_kernels_avx512bf16 : &ma_attn_kernels_avx512;
    case MA_ISA_AVX512: return &ma_attn_kernels_avx512;
    case MA_ISA_AVX2: return &ma_attn_kernels_avx2;
#elif defined(__aarch64__)
    case MA_ISA_NEON: return &ma_attn_kernels_neon;
    case MA_ISA_SVEBF16: return dt == MA_BF16 ? &ma_attn_kernels_svebf16 : &ma_attn_kernels_neon;
    case MA_ISA_SVE: return MA_SVE_INSTANCE(ma_attn_kernels, ma_attn_kernels_neon);
#endif
    case MA_ISA_SCALAR:
    default: return &ma_attn_kernels_scalar;
    }
}

#define KERNELS(P) kernels((P)->a.dtype, (P)->a.isa)
#define PARAMS(T, ctx) ((const T *)((const ma_task_ctx *)(ctx))->params)

void ma_attn_fwd_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_fwd_params, ctx))->fwd(begin, end, ctx);
}
void ma_attn_bwd_dq_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_bwd_params, ctx))->bwd_dq(begin, end, ctx);
}
void ma_attn_bwd_dkdv_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_bwd_params, ctx))->bwd_dkdv(begin, end, ctx);
}
void ma_attn_bwd_fused_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_bwd_params, ctx))->bwd_fused(begin, end, ctx);
}
void ma_attn_bwd_reduce_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_bwd_params, ctx))->bwd_reduce(begin, end, ctx);
}

/* ---- rules on the shape ------------------------------------------------- */

/* Heads of one query block a task may take together (masked_attn.h,
 * ma_attn_fwd_task): every query block short (varlen: a.Lq is the longest
 * sequence), no weights, and K's and V's heads side by side within a row
 * (head stride below the row stride). */
static int64_t fwd_head_group(const ma_attn_fwd_params *p) {
    const ma_attn_args *a = &p->a;
    /* K rows with the heads side by side, or a K^T page (keys side by side, each head's block
     * of them once per key block of every head in the run: a grouped-query head's G heads
     * take it from L1) */
    const int k_rows = a->k_stride[3] == 1 && a->k_stride[1] < a->k_stride[2];
    const int k_t = a->k_stride[2] == 1 && a->k_stride[3] != 1;
    const int v_rows = a->v_stride[3] == 1 && a->v_stride[1] < a->v_stride[2];
    /* varlen: an entry's own length decides (a mixed batch's decodes take runs, its chunks one
     * head at a time), so a long entry elsewhere does not stop them */
    const int short_rows = a->Lq <= MA_FWD_ROWS || a->cu_q;
    return short_rows && a->H > 1 && !p->weights && (k_rows || k_t) && v_rows ? MA_FWD_HEAD_GROUP_MAX : 1;
}

/* Varlen always takes the two passes: their items are sized by the real lengths. */
int ma_attn_bwd_single_pass(const ma_attn_bwd_params *p) { return p->dweights == NULL && !p->a.cu_q; }

/* Enough (b, hkv, chunk) items for one per CPU the process can use, and at
 * least 8; never more chunks than key blocks, nor than MA_BWD_KV_CHUNKS_MAX
 * (the partial sums of dq take C times dq's memory). The CPU count is the
 * machine's (ma_cpu_count), not the thread count, so results stay the same
 * bits for any thread count. Two items per CPU measured no faster on 16
 * cores than one, and cost as much on 2 threads (docs/performance.md,
 * "Intel Xeon, 16 cores"). */
#define MA_BWD_KV_CHUNKS_MAX 16
static _Atomic int64_t forced_cpus = 0;

int64_t ma_attn_bwd_cpus_force(int64_t n) { return atomic_exchange(&forced_cpus, n > 0 ? n : 0); }

static int64_t bwd_kv_chunks(const ma_attn_bwd_params *p) {
    const int64_t items = p->a.B * p->a.Hkv, nk = ma_cdiv(p->a.Lk, p->a.block_k);
    const int64_t forced = atomic_load(&forced_cpus), cpus = forced > 0 ? forced : ma_cpu_count();
    const int64_t want = cpus > 8 ? cpus : 8;
    if (items <= 0 || nk <= 1 || items >= want) return 1;
    const int64_t c = ma_min(ma_cdiv(want, items), MA_BWD_KV_CHUNKS_MAX);
    return c < nk ? c : nk;
}

/* More than 1 MB of Q, dO, dq rows per item: MA_BWD_KEY_GROUP_MAX (4). Measured on Zen 3 (512 KB
 * L2), in one process: one-head-long (D = 128, L = 8192, 12 MB) 6% faster
 * forward + backward on 2 threads, 10% on one; long-causal (3 MB) and
 * gpt-train (384 KB) the same within 0.5%. */
static _Atomic int64_t forced_key_group = 0;

int64_t ma_attn_bwd_key_group_force(int64_t n) { return atomic_exchange(&forced_key_group, n > 0 ? n : 0); }

static int64_t bwd_key_group(const ma_attn_bwd_params *p) {
    const int64_t forced = atomic_load(&forced_key_group);
    if (forced > 0) return forced;
    const int64_t G = p->a.H / p->a.Hkv;
    const double acc = p->a.dtype == MA_F64 ? 8.0 : 4.0;
    const double query_side = (double)G * (double)p->a.Lq * (double)(2 * p->a.D + p->a.Dv) * acc;
    return query_side > (double)(1 << 20) ? MA_BWD_KEY_GROUP_MAX : 1;
}

/* ---- varlen: work items sized by the real lengths ------------------------ */

static int64_t seq_lq(const ma_attn_args *a, int64_t b) { return a->cu_q[b + 1] - a->cu_q[b]; }
static int64_t seq_lk(const ma_attn_args *a, int64_t b) {
    return a->seqused_k ? a->seqused_k[b] : a->cu_k[b + 1] - a->cu_k[b];
}

/* Sets n_q_items, n_kv_items; returns the multiply-adds per (head, dim) of
 * the matrix products, sum_b Lq_b Lk_b (a dense call's B Lq Lk). */
static double varlen_count(ma_attn_args *a) {
    int64_t nq = 0, nk = 0;
    double work = 0;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t Lq = seq_lq(a, b), Lk = seq_lk(a, b);
        nq += ma_cdiv(Lq, a->block_q), nk += ma_cdiv(Lk, a->block_k);
        work += (double)Lq * (double)Lk;
    }
    a->n_q_items = a->H * nq, a->n_kv_items = a->Hkv * nk;
    return work;
}

/* An item group (every head of one entry's block): cost, entry, block. */
static int before(const int64_t *x, const int64_t *y) {
    return x[0] != y[0] ? x[0] > y[0] : x[1] != y[1] ? x[1] < y[1] : x[2] < y[2];
}
static void swap3(int64_t *x, int64_t *y) {
    for (int i = 0; i < 3; i++) {
        const int64_t t = x[i];
        x[i] = y[i], y[i] = t;
    }
}
static void sift_down(int64_t *g, int64_t i, int64_t n) {
    for (int64_t c; (c = 2 * i + 1) < n; i = c) {
        if (c + 1 < n && before(g + 3 * c, g + 3 * (c + 1))) c++;
        if (!before(g + 3 * i, g + 3 * c)) return;
        swap3(g + 3 * i, g + 3 * c);
    }
}

/* Fills a work-item table of n_items (b, head, block), most expensive first:
 * the cost of an item is the keys it reads per query block (kv: the queries
 * per key block, times the G query heads) within its entry's window, plus
 * its rows. Equal costs keep the order (b, block, head), so the heads of one
 * entry's block follow each other (the forward's runs of heads). The groups
 * (one per entry's block) are sorted in the table's own first rows (heap
 * sort on (cost, b, block): one order, no allocation), then spread over
 * their heads from the last. */
static void varlen_fill(const ma_attn_args *a, int kv, int64_t *t, int64_t n_items) {
    const int64_t heads = kv ? a->Hkv : a->H, G = a->Hkv > 0 ? a->H / a->Hkv : 1;
    const int64_t BQ = a->block_q, BK = a->block_k;
    const int64_t wl = a->opts.window_left, wr = a->opts.window_right;
    if (heads <= 0 || n_items <= 0) return;
    int64_t ng = 0;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t Lq = seq_lq(a, b), Lk = seq_lk(a, b);
        const int64_t lo = wl >= 0 ? Lk - Lq - wl : -MA_BAND_INF, hi = wr >= 0 ? Lk - Lq + wr : MA_BAND_INF;
        if (!kv)
            for (int64_t qb = 0; qb * BQ < Lq; qb++, ng++) {
                const int64_t i0 = qb * BQ, nr = ma_min(BQ, Lq - i0);
                const int64_t kb = lo > -MA_BAND_INF ? ma_max(0, i0 + lo) : 0;
                const int64_t ke = hi < MA_BAND_INF ? ma_min(Lk, i0 + nr + hi) : Lk;
                t[3 * ng] = nr * ma_max(ke - kb, 0) + nr, t[3 * ng + 1] = b, t[3 * ng + 2] = qb;
            }
        else
            for (int64_t kb = 0; kb * BK < Lk; kb++, ng++) {
                const int64_t j0 = kb * BK, nc = ma_min(BK, Lk - j0);
                const int64_t qb = hi < MA_BAND_INF ? ma_max(0, j0 - hi) : 0;
                const int64_t qe = lo > -MA_BAND_INF ? ma_min(Lq, j0 + nc - lo) : Lq;
                t[3 * ng] = G * nc * ma_max(qe - qb, 0) + nc, t[3 * ng + 1] = b, t[3 * ng + 2] = kb;
            }
    }
    for (int64_t i = ng / 2; i-- > 0;) sift_down(t, i, ng);
    for (int64_t e = ng - 1; e > 0; e--) {
        swap3(t, t + 3 * e);
        sift_down(t, 0, e);
    }
    /* now ascending in `before` order, most expensive first; group g's items go
     * to rows g * heads .. : at or after row g, so from the last group down no
     * group is overwritten before it is read */
    for (int64_t g = ng - 1; g >= 0; g--) {
        const int64_t b = t[3 * g + 1], blk = t[3 * g + 2];
        for (int64_t h = heads - 1; h >= 0; h--) {
            int64_t *row = t + 3 * (g * heads + h);
            row[0] = b, row[1] = h, row[2] = blk;
        }
    }
}

/* ---- the plans ---------------------------------------------------------- */

/* The threads a call of this many multiply-adds runs on. */
static int64_t plan_threads(double work, int64_t threads) {
    return work < (double)MA_SERIAL_WORK || threads < 1 ? 1 : threads;
}

/* Items of `unit` a thread takes at a time, leaving every thread `takes`
 * takes or more for balance (none needed on one thread). */
static int64_t grain(int64_t unit, int64_t n, int64_t threads, int64_t takes) {
    return ma_max(1, threads > 1 ? ma_min(unit, n / (takes * threads)) : unit);
}

static void add_pass(ma_plan *plan, ma_task_fn fn, int64_t n, int64_t g, size_t scratch_bytes) {
    plan->pass[plan->n_passes++] = (ma_pass){fn, n, g, scratch_bytes};
}

static void plan_init(ma_plan *plan) {
    plan->n_passes = 0, plan->threads = 1, plan->work = 0;
    plan->workspace_bytes = 0, plan->bind = NULL;
}

static void fwd_bind(void *params, void *workspace) {
    ma_attn_fwd_params *p = params;
    varlen_fill(&p->a, 0, workspace, p->a.n_q_items);
    p->a.q_items = workspace;
}

/* Forward work items a thread takes at a time. Where runs of heads are
 * taken (head_group > 1: decoding from a cache whose heads lie side by side
 * in each row, or K^T pages; varlen calls with such a cache, whose items of
 * equal cost, consecutive heads of one entry and query block, follow each
 * other), up to a run's heads, while every thread still gets 2 takes. Else
 * consecutive query blocks of one head (the kernel orders a head's blocks
 * cheap, expensive, cheap, ...), up to the whole head, so that a thread
 * reads that head's K and V into its own L2 once instead of both threads
 * pulling every head; at least 8 takes per thread are left for balance;
 * other varlen calls one item at a time (its items come most expensive
 * first). */
int ma_attn_plan_fwd(ma_attn_fwd_params *p, int64_t threads, ma_plan *plan) {
    if (!p || !plan) return -1;
    ma_attn_args *a = &p->a;
    plan_init(plan);
    p->head_group = fwd_head_group(p);
    const double per_head = (double)a->H * (double)(a->D + a->Dv);
    int64_t n, g;
    if (a->cu_q) {
        plan->work = varlen_count(a) * per_head;
        n = a->n_q_items;
        plan->workspace_bytes = ma_round_up((size_t)n * 3 * sizeof(int64_t), MA_CACHE_LINE);
        plan->bind = fwd_bind;
    } else {
        plan->work = (double)a->B * (double)a->Lq * (double)a->Lk * per_head;
        n = a->B * a->H * ma_cdiv(a->Lq, a->block_q);
    }
    plan->threads = plan_threads(plan->work, threads);
    if (p->head_group > 1) g = grain(p->head_group, n, plan->threads, 2);
    else g = a->cu_q ? 1 : grain(ma_cdiv(a->Lq, a->block_q), n, plan->threads, 8);
    add_pass(plan, ma_attn_fwd_task, n, g, KERNELS(p)->fwd_scratch_bytes(p));
    return 0;
}

/* Where the backward's workspace puts what it holds: varlen's two tables;
 * the single pass's partial sums of dq and dhm with more than one key chunk. */
static size_t bwd_layout(const ma_attn_bwd_params *p, size_t *second) {
    const ma_attn_args *a = &p->a;
    if (a->cu_q) {
        *second = ma_round_up((size_t)a->n_q_items * 3 * sizeof(int64_t), MA_CACHE_LINE);
        return *second + ma_round_up((size_t)a->n_kv_items * 3 * sizeof(int64_t), MA_CACHE_LINE);
    }
    const size_t esz = a->dtype == MA_F64 ? sizeof(double) : sizeof(float);
    const size_t rows = (size_t)(p->kv_chunks * a->B * a->H * a->Lq);
    *second = ma_round_up(rows * (size_t)a->D * esz, MA_CACHE_LINE);
    return *second + (p->dhm_rows ? ma_round_up(rows * esz, MA_CACHE_LINE) : 0);
}

static void bwd_bind(void *params, void *workspace) {
    ma_attn_bwd_params *p = params;
    size_t second;
    bwd_layout(p, &second);
    char *w = workspace;
    if (p->a.cu_q) {
        varlen_fill(&p->a, 0, (int64_t *)w, p->a.n_q_items);
        varlen_fill(&p->a, 1, (int64_t *)(w + second), p->a.n_kv_items);
        p->a.q_items = (const int64_t *)w, p->a.kv_items = (const int64_t *)(w + second);
    } else {
        p->dq_part = w;
        p->dhm_part = p->dhm_rows ? w + second : NULL;
    }
}

/* The single pass (one item per (b, hkv, key chunk), then, with more than
 * one chunk, the reduce over (b, h, query block)), or the two passes (dq,
 * then dk and dv). One item at a time: items cost whole heads (single
 * pass) or come most expensive first (varlen). */
int ma_attn_plan_bwd(ma_attn_bwd_params *p, int64_t threads, ma_plan *plan) {
    if (!p || !plan) return -1;
    ma_attn_args *a = &p->a;
    plan_init(plan);
    p->kv_chunks = 1;
    p->key_group = bwd_key_group(p);
    const double per_head = (double)a->H * (double)(3 * a->D + 2 * a->Dv); /* the five products */
    plan->work = (a->cu_q ? varlen_count(a) : (double)a->B * (double)a->Lq * (double)a->Lk) * per_head;
    plan->threads = plan_threads(plan->work, threads);
    const size_t bytes = KERNELS(p)->bwd_scratch_bytes(p);
    const int64_t nq = a->cu_q ? a->n_q_items : a->B * a->H * ma_cdiv(a->Lq, a->block_q);
    if (ma_attn_bwd_single_pass(p)) {
        p->kv_chunks = bwd_kv_chunks(p);
        add_pass(plan, ma_attn_bwd_fused_task, a->B * a->Hkv * p->kv_chunks, 1, bytes);
        if (p->kv_chunks > 1) {
            add_pass(plan, ma_attn_bwd_reduce_task, nq, 1, bytes);
            size_t second;
            plan->workspace_bytes = bwd_layout(p, &second);
            plan->bind = bwd_bind;
        }
    } else {
        const int64_t nk = a->cu_q ? a->n_kv_items : a->B * a->Hkv * ma_cdiv(a->Lk, a->block_k);
        add_pass(plan, ma_attn_bwd_dq_task, nq, 1, bytes);
        add_pass(plan, ma_attn_bwd_dkdv_task, nk, 1, bytes);
        if (a->cu_q) {
            size_t second;
            plan->workspace_bytes = bwd_layout(p, &second);
            plan->bind = bwd_bind;
        }
    }
    return 0;
}
