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
 * asked common/isa.c for p->isa); float32, bfloat16, float16 the instance of the
 * variant that runs the call (ma_isa_runs: AVX512-BF16's and SVE-BF16's products
 * are for bfloat16 only, avx512bf16.c, svebf16.c: their other dtypes run AVX-512's
 * and NEON's). One case per row of MA_ISA_TABLE compiled in here. */
static const ma_attn_kernels *kernels(ma_dtype dt, ma_isa isa) {
    if (dt == MA_F64) return &ma_attn_kernels_f64;
    switch (ma_isa_runs(isa, dt, 0)) {
#define CASE(ID, name, abi, arch, bq, bk, fb, own, inst, usable) \
    MA_ON_##arch(case MA_ISA_##ID : return MA_TABLE_##inst(ma_attn_kernels, name);)
        MA_ISA_TABLE(CASE)
#undef CASE
    default: return &ma_attn_kernels_scalar;
    }
}

/* Each variant's tile (the table's bq, bk), by ma_isa; multiples of 32, as the tile products'
 * packed views start at multiples of 32 rows and keys (tiles_layout.h). */
#define TILE(ID, name, abi, arch, bq, bk, fb, own, inst, usable) [MA_ISA_##ID] = {bq, bk},
static const int64_t tiles[][2] = {MA_ISA_TABLE(TILE)};
#undef TILE
#define TILE_OK(ID, name, abi, arch, bq, bk, fb, own, inst, usable) \
    _Static_assert((bq) > 0 && (bk) > 0 && (bq) % 32 == 0 && (bk) % 32 == 0, #name "'s tile: multiples of 32");
MA_ISA_TABLE(TILE_OK)
#undef TILE_OK

int ma_attn_traits(int dt, int isa, ma_traits *t) {
    if (!t || (dt != MA_F32 && dt != MA_F64 && dt != MA_BF16 && dt != MA_F16) || !ma_isa_built(isa)) return -1;
    const ma_isa runs = dt == MA_F64 ? MA_ISA_SCALAR : ma_isa_runs((ma_isa)isa, (ma_dtype)dt, 0);
    t->block_q = tiles[runs][0], t->block_k = tiles[runs][1];
    t->decode_qrows = MA_DECODE_QROWS, t->decode_rows = MA_DECODE_ROWS;
    t->decode_chunk = MA_DECODE_CHUNK, t->decode_kv_heads = MA_DECODE_KV_HEADS;
    return 0;
}

#define KERNELS(P) kernels((P)->a.dtype, (P)->a.isa)
#define PARAMS(T, ctx) ((const T *)((const ma_task_ctx *)(ctx))->params)

void ma_attn_fwd_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_fwd_params, ctx))->fwd(begin, end, ctx);
}
void ma_attn_bwd_delta_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_bwd_params, ctx))->bwd_delta(begin, end, ctx);
}
void ma_attn_bwd_fused_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_bwd_params, ctx))->bwd_fused(begin, end, ctx);
}
void ma_attn_bwd_reduce_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_bwd_params, ctx))->bwd_reduce(begin, end, ctx);
}
void ma_attn_decode_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_fwd_params, ctx))->decode(begin, end, ctx);
}
void ma_attn_decode_merge_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_fwd_params, ctx))->decode_merge(begin, end, ctx);
}

/* ---- rules on the shape ------------------------------------------------- */

/* Enough (b, hkv, chunk) items for one per CPU the process can use, and at
 * least 8; never more chunks than key blocks, nor than MA_BWD_KV_CHUNKS_MAX
 * (the partial sums of dq take C times dq's memory). The CPU count is the
 * machine's (ma_cpu_count), not the thread count, so results stay the same
 * bits for any thread count. Two items per CPU measured no faster on 16
 * cores than one, and cost as much on 2 threads
 * (docs/performance/intel-amx-16cpu.md, "Key chunks"). */
#define MA_BWD_KV_CHUNKS_MAX 16
static _Atomic int64_t forced_cpus = 0;

int64_t ma_attn_bwd_cpus_force(int64_t n) { return atomic_exchange(&forced_cpus, n > 0 ? n : 0); }

/* The CPU count of the rules: forced, else the process's. */
static int64_t rule_cpus(void) {
    const int64_t forced = atomic_load(&forced_cpus);
    return forced > 0 ? forced : ma_cpu_count();
}

static int64_t bwd_kv_chunks(const ma_attn_bwd_params *p) {
    const int64_t items = p->a.B * p->a.Hkv, nk = ma_cdiv(p->a.Lk, p->a.block_k);
    const int64_t cpus = rule_cpus();
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

/* Sets n_q_items (the forward's); returns the multiply-adds per (head, dim)
 * of the matrix products, sum_b Lq_b Lk_b (a dense call's B Lq Lk). */
static double varlen_count(ma_attn_args *a) {
    int64_t nq = 0;
    double work = 0;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t Lq = seq_lq(a, b), Lk = seq_lk(a, b);
        nq += ma_cdiv(Lq, a->block_q);
        work += (double)Lq * (double)Lk;
    }
    a->n_q_items = a->H * nq, a->n_kv_items = 0;
    return work;
}

/* Entry b's key chunks in the single-pass backward: one per MA_BWD_VARLEN_CHUNK_BLOCKS key
 * blocks or part of it, at most MA_BWD_KV_CHUNKS_MAX. A rule on the entry's own Lk alone, never
 * on the batch or the CPUs (unlike a dense call's, bwd_kv_chunks), so that a sequence's
 * gradients are the same bits alone or packed, on any machine: entries up to 2048 keys (at
 * block_k 64) are one chunk, and need no partial sums nor reduce; longer ones give more
 * items, for more threads, whose partial sums of dq are C_b times the entry's dq. */
#define MA_BWD_VARLEN_CHUNK_BLOCKS 32

static int64_t varlen_chunks(const ma_attn_args *a, int64_t b) {
    const int64_t nk = ma_cdiv(seq_lk(a, b), a->block_k);
    return ma_max(1, ma_min(ma_cdiv(nk, MA_BWD_VARLEN_CHUNK_BLOCKS), MA_BWD_KV_CHUNKS_MAX));
}

/* The varlen single pass's tables: sets n_kv_items (its items, (b, hkv, chunk): Hkv C_b per
 * entry) and n_q_items (the reduce's, (b, h, query block), of the entries of more than one
 * chunk only); fills entry (B, 2) when not NULL with each entry's C_b and the first row of its
 * partial sums (C_b > 1: C_b H Lq_b rows, (chunk, head, row)); returns the partial sums' rows
 * (0: no reduce). */
static int64_t varlen_chunk_tables(ma_attn_args *a, int64_t *entry) {
    int64_t n_items = 0, n_reduce = 0, rows = 0;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t C = varlen_chunks(a, b), Lq = seq_lq(a, b);
        if (entry) entry[2 * b] = C, entry[2 * b + 1] = rows;
        n_items += a->Hkv * C;
        if (C > 1) n_reduce += a->H * ma_cdiv(Lq, a->block_q), rows += C * a->H * Lq;
    }
    a->n_kv_items = n_items, a->n_q_items = n_reduce;
    return rows;
}

/* An item group (every head of one entry's block or key chunk): cost, entry, block. */
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

/* Rows 0 .. n of t (3 int64 each) in `before` order, most expensive first, in place. */
static void heap_sort3(int64_t *t, int64_t n) {
    for (int64_t i = n / 2; i-- > 0;) sift_down(t, i, n);
    for (int64_t e = n - 1; e > 0; e--) {
        swap3(t, t + 3 * e);
        sift_down(t, 0, e);
    }
}

/* What the items of one group read: the query block qb's keys (q items), or the queries of
 * every key block of chunk ch of C (the single pass's items, chunks) times the G query heads,
 * within the entry's band, plus its rows (chunks: the G heads' query rows it converts). */
static int64_t group_cost(const ma_attn_args *a, int chunks, int64_t Lq, int64_t Lk, int64_t lo, int64_t hi,
                          int64_t blk, int64_t C) {
    const int64_t G = a->Hkv > 0 ? a->H / a->Hkv : 1, BQ = a->block_q, BK = a->block_k;
    if (!chunks) {
        const int64_t i0 = blk * BQ, nr = ma_min(BQ, Lq - i0);
        const int64_t kb = lo > -MA_BAND_INF ? ma_max(0, i0 + lo) : 0;
        const int64_t ke = hi < MA_BAND_INF ? ma_min(Lk, i0 + nr + hi) : Lk;
        return nr * ma_max(ke - kb, 0) + nr;
    }
    int64_t cost = G * Lq;
    for (int64_t j0 = blk * BK; j0 < Lk; j0 += C * BK) {
        const int64_t nc = ma_min(BK, Lk - j0);
        const int64_t qb = hi < MA_BAND_INF ? ma_max(0, j0 - hi) : 0;
        const int64_t qe = lo > -MA_BAND_INF ? ma_min(Lq, j0 + nc - lo) : Lq;
        cost += G * nc * ma_max(qe - qb, 0) + nc;
    }
    return cost;
}

/* Fills the single pass's work-item table of n_items (b, key head, key chunk), most
 * expensive first (group_cost). Equal costs keep the order (b, chunk, head). The groups (one
 * per entry's chunk) are sorted in the table's own first rows (heap sort on (cost, b, chunk):
 * one order, no allocation), then spread over their key heads from the last. */
static void varlen_fill_chunks(const ma_attn_args *a, int64_t *t, int64_t n_items) {
    const int64_t heads = a->Hkv;
    if (heads <= 0 || n_items <= 0) return;
    int64_t ng = 0;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t Lq = seq_lq(a, b), Lk = seq_lk(a, b);
        const int64_t n = varlen_chunks(a, b);
        int64_t lo, hi;
        ma_attn_band(Lk - Lq, a->opts.window_left, a->opts.window_right, &lo, &hi); /* FN(seq_args)'s */
        for (int64_t blk = 0; blk < n; blk++, ng++)
            t[3 * ng] = group_cost(a, 1, Lq, Lk, lo, hi, blk, n), t[3 * ng + 1] = b, t[3 * ng + 2] = blk;
    }
    heap_sort3(t, ng);
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

/* The forward's work-item table (b, h, query block), n_items = H * the entries' blocks: the
 * entries most expensive first (group_cost summed over their blocks; equal costs in entry
 * order), and within an entry its key heads in order, each head's query blocks from the most
 * expensive end of the band (causal: the last block first) and, inner, the G query heads of
 * the key head. So the items that read one key head's K and V follow each other: a thread
 * converts them into its head cache (FN(kv_head_cache): paged or heads side by side) once a
 * key head, not once an item, as the (b, block, head) order did (12 decodes + 4 chunks of
 * 256 queries over paged float32, H = 32/8, 2 threads: a fifth of the step in the copies).
 * The entries are sorted in the table's first rows (heap sort on (cost, b): one order, no
 * allocation), then spread over their items from the last: entry i's items start at row
 * H * (blocks of entries 0 .. i-1) >= i, so no entry is overwritten before it is read. */
static void varlen_fill_q(const ma_attn_args *a, int64_t *t, int64_t n_items) {
    if (a->H <= 0 || n_items <= 0) return;
    const int64_t Hkv = a->Hkv > 0 && a->H % a->Hkv == 0 ? a->Hkv : 1, G = a->H / Hkv;
    int64_t ne = 0;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t Lq = seq_lq(a, b), Lk = seq_lk(a, b), n = ma_cdiv(Lq, a->block_q);
        if (n == 0) continue;
        int64_t lo, hi, cost = 0;
        ma_attn_band(Lk - Lq, a->opts.window_left, a->opts.window_right, &lo, &hi); /* FN(seq_args)'s */
        for (int64_t blk = 0; blk < n; blk++) cost += group_cost(a, 0, Lq, Lk, lo, hi, blk, n);
        t[3 * ne] = cost, t[3 * ne + 1] = b, t[3 * ne + 2] = 0;
        ne++;
    }
    heap_sort3(t, ne);
    int64_t end = n_items;
    for (int64_t i = ne - 1; i >= 0; i--) {
        const int64_t b = t[3 * i + 1], Lq = seq_lq(a, b), Lk = seq_lk(a, b), n = ma_cdiv(Lq, a->block_q);
        int64_t lo, hi;
        ma_attn_band(Lk - Lq, a->opts.window_left, a->opts.window_right, &lo, &hi);
        const int last_first = group_cost(a, 0, Lq, Lk, lo, hi, n - 1, n) >= group_cost(a, 0, Lq, Lk, lo, hi, 0, n);
        const int64_t start = end - a->H * n;
        for (int64_t hk = 0; hk < Hkv; hk++)
            for (int64_t k = 0; k < n; k++)
                for (int64_t g = 0; g < G; g++) {
                    int64_t *row = t + 3 * (start + (hk * n + k) * G + g);
                    row[0] = b, row[1] = hk * G + g, row[2] = last_first ? n - 1 - k : k;
                }
        end = start;
    }
}

/* The reduce's items (b, h, query block) of the entries of more than one key chunk, in order. */
static void varlen_reduce_fill(const ma_attn_args *a, const int64_t *entry, int64_t *t) {
    for (int64_t b = 0, n = 0; b < a->B; b++)
        if (entry[2 * b] > 1)
            for (int64_t h = 0; h < a->H; h++)
                for (int64_t qb = 0; qb * a->block_q < seq_lq(a, b); qb++, n++)
                    t[3 * n] = b, t[3 * n + 1] = h, t[3 * n + 2] = qb;
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

/* ---- decoding (masked_attn.h, "Decoding") --------------------------------- */

/* The shortest entry's query rows (dense: Lq). */
static int64_t shortest_rows(const ma_attn_args *a) {
    if (!a->cu_q) return a->Lq;
    int64_t m = a->Lq;
    for (int64_t b = 0; b < a->B; b++) m = ma_min(m, ma_max(seq_lq(a, b), 1));
    return m;
}

/* Some entry's query block short (dense: every one), no weights, K rows or K^T pages and V
 * rows read in place (unit last stride): the decode kernel takes those entries. */
static int decode_applies(const ma_attn_fwd_params *p) {
    const ma_attn_args *a = &p->a;
    return a->Lq >= 1 && !p->weights && a->Hkv > 0 && (a->k_stride[3] == 1 || a->k_stride[2] == 1) &&
           a->v_stride[3] == 1 && shortest_rows(a) <= MA_DECODE_QROWS;
}

/* Slabs: the query heads of a key head in as few slabs of at most MA_DECODE_ROWS rows as
 * there can be, of equal sizes but the last. Splits: where the (b, hkv, slab) items are fewer
 * than twice the CPUs, each entry's key chunks go to enough items for twice the CPUs (two
 * items per CPU let the pool even out a core slowed by other work; the chunks' partial
 * states cost the same for any number of splits above one), at most one chunk an item. */
int ma_attn_decode_shape(int64_t B, int64_t H, int64_t Hkv, int64_t kv_heads, int64_t Lq, int64_t Lk, int64_t cpus,
                         ma_decode_shape *s) {
    if (!s || B < 0 || Hkv <= 0 || H % Hkv != 0 || kv_heads < 1 || Hkv % kv_heads != 0 || Lq < 1 || Lk < 0) return -1;
    const int64_t G = H / Hkv, per_slab = ma_max(1, ma_min(G, MA_DECODE_ROWS / Lq));
    s->slabs = ma_max(1, ma_cdiv(G, per_slab));
    s->slab_heads = ma_max(1, ma_cdiv(G, s->slabs));
    s->chunks = ma_max(1, ma_cdiv(Lk, MA_DECODE_CHUNK));
    const int64_t base = B * (Hkv / kv_heads) * s->slabs, want = 2 * ma_max(cpus, 1);
    s->splits = base >= want || base == 0 ? 1 : ma_min(s->chunks, ma_cdiv(want, base));
    s->items = base * s->splits;
    s->item_chunks = ma_cdiv(s->chunks, s->splits);
    return 0;
}

static _Atomic int64_t forced_splits = 0;

int64_t ma_attn_decode_splits_force(int64_t n) { return atomic_exchange(&forced_splits, n > 0 ? n : 0); }

/* Each entry's first chunk slot in the partial states (varlen): the chunks of the entries before it. */
static int64_t decode_chunk_slots(const ma_attn_args *a, int64_t *chunk0) {
    int64_t n = 0;
    for (int64_t b = 0; b < a->B; b++) {
        if (chunk0) chunk0[b] = n;
        const int64_t Lk = a->cu_q ? (a->seqused_k ? a->seqused_k[b] : a->cu_k[b + 1] - a->cu_k[b]) : a->Lk;
        n += ma_cdiv(Lk, MA_DECODE_CHUNK);
    }
    if (chunk0) chunk0[a->B] = n;
    return n;
}

static size_t decode_part_bytes(const ma_attn_fwd_params *p) {
    const size_t esz = p->a.dtype == MA_F64 ? sizeof(double) : sizeof(float);
    const size_t slot = (size_t)(p->decode_rows * (p->a.Dv + 2)) * esz;
    return ma_round_up((size_t)(decode_chunk_slots(&p->a, NULL) * p->a.Hkv * p->decode_slabs) * slot, MA_CACHE_LINE);
}

/* The forward's workspace: varlen's work-item table (where the tile path runs), then the
 * decode kernel's partial states and (varlen) its entries' first chunk slots (where
 * sequences are split). Returns its size; *at gets the two offsets. */
static size_t fwd_layout(const ma_attn_fwd_params *p, int tiles, size_t at[2]) {
    const ma_attn_args *a = &p->a;
    size_t n = tiles && a->cu_q ? ma_round_up((size_t)a->n_q_items * 3 * sizeof(int64_t), MA_CACHE_LINE) : 0;
    at[0] = n;
    if (p->decode_splits > 1) n += decode_part_bytes(p);
    at[1] = n;
    if (p->decode_splits > 1 && a->cu_q) n += ma_round_up((size_t)(a->B + 1) * sizeof(int64_t), MA_CACHE_LINE);
    return n;
}

static void fwd_bind(void *params, void *workspace) {
    ma_attn_fwd_params *p = params;
    char *w = workspace;
    const int tiles = p->a.cu_q && (p->decode_splits == 0 || p->a.Lq > MA_DECODE_QROWS);
    size_t at[2];
    fwd_layout(p, tiles, at);
    if (tiles) {
        varlen_fill_q(&p->a, (int64_t *)w, p->a.n_q_items);
        p->a.q_items = (const int64_t *)w;
    }
    if (p->decode_splits > 1) {
        p->decode_part = w + at[0];
        if (p->a.cu_q) {
            int64_t *chunk0 = (int64_t *)(w + at[1]);
            decode_chunk_slots(&p->a, chunk0);
            p->decode_chunk0 = chunk0;
        }
    }
}

/* The decode kernel's schedule (ma_attn_decode_shape on the entries' short query blocks,
 * at most MA_DECODE_QROWS rows) into p; returns the (b, hkv, slab) items. */
static int64_t decode_schedule(ma_attn_fwd_params *p) {
    const ma_attn_args *a = &p->a;
    const int64_t Lq = ma_min(a->Lq, MA_DECODE_QROWS);
    /* a token's key heads side by side in each row (paged and packed caches, (B, L, H, D)
     * projections), or K^T pages: as many key heads together as divide Hkv, at most
     * MA_DECODE_KV_HEADS */
    const int k_rows = a->k_stride[3] == 1 && a->k_stride[1] < a->k_stride[2];
    const int k_t = a->k_stride[2] == 1 && a->k_stride[3] != 1;
    const int v_rows = a->v_stride[3] == 1 && a->v_stride[1] < a->v_stride[2];
    int64_t kg = 1;
    if ((k_rows || k_t) && v_rows)
        for (int64_t x = ma_min(a->Hkv, MA_DECODE_KV_HEADS); x > 1; x--)
            if (a->Hkv % x == 0) {
                kg = x;
                break;
            }
    p->decode_kv_heads = kg;
    ma_decode_shape s;
    ma_attn_decode_shape(a->B, a->H, a->Hkv, kg, Lq, a->Lk, rule_cpus(), &s);
    const int64_t forced = atomic_load(&forced_splits);
    if (forced > 0) s.splits = ma_min(forced, s.chunks);
    p->decode_slab_heads = s.slab_heads, p->decode_slabs = s.slabs, p->decode_splits = s.splits;
    p->decode_rows = s.slab_heads * Lq;
    return a->B * (a->Hkv / kg) * s.slabs;
}

/* The passes of a forward call: the decode kernel's (then its merge, where sequences are
 * split) for the entries whose query rows are at most MA_DECODE_QROWS (every one of a dense
 * call of such rows), the tile path's for the others (every query block of them, a last short
 * one too, so that a prefill's rows have the tiles' bits whatever its length). Tile items a
 * thread takes at a time: consecutive query blocks of one head (the kernel orders a head's
 * blocks cheap, expensive, cheap, ...), up to the whole head, so that a thread reads that
 * head's K and V into its own L2 once instead of both threads pulling every head; at least 8
 * takes per thread are left for balance; varlen calls one item at a time (its items come
 * entry by entry, most expensive first, a key head's together: varlen_fill_q). Decode items
 * are of equal cost where the call is dense. */
int ma_attn_plan_fwd(ma_attn_fwd_params *p, int64_t threads, ma_plan *plan) {
    if (!p || !plan) return -1;
    ma_attn_args *a = &p->a;
    plan_init(plan);
    p->decode_splits = 0, p->decode_part = NULL, p->decode_chunk0 = NULL;
    const double per_head = (double)a->H * (double)(a->D + a->Dv);
    plan->work = (a->cu_q ? varlen_count(a) : (double)a->B * (double)a->Lq * (double)a->Lk) * per_head;
    plan->threads = plan_threads(plan->work, threads);
    const int64_t T = plan->threads;
    const int decode = decode_applies(p), tiles = !decode || a->Lq > MA_DECODE_QROWS;
    int64_t bases = 0;
    if (decode) {
        bases = decode_schedule(p);
        const int64_t n = bases * p->decode_splits;
        add_pass(plan, ma_attn_decode_task, n, a->cu_q ? 1 : grain(16, n, T, 8), KERNELS(p)->decode_scratch_bytes(p));
    }
    if (tiles) {
        const int64_t n = a->cu_q ? a->n_q_items : a->B * a->H * ma_cdiv(a->Lq, a->block_q);
        const int64_t g = a->cu_q ? 1 : grain(ma_cdiv(a->Lq, a->block_q), n, T, 8);
        add_pass(plan, ma_attn_fwd_task, n, g, KERNELS(p)->fwd_scratch_bytes(p));
    }
    if (decode && p->decode_splits > 1) {
        const int64_t m = a->B * a->Hkv * p->decode_slabs;
        add_pass(plan, ma_attn_decode_merge_task, m, grain(16, m, T, 8), KERNELS(p)->decode_scratch_bytes(p));
    }
    size_t at[2];
    plan->workspace_bytes = fwd_layout(p, tiles, at);
    if (plan->workspace_bytes) plan->bind = fwd_bind;
    return 0;
}

/* Where the backward's workspace puts what it holds: varlen's tables (the
 * single pass's items, the reduce's, the entries' chunks: at[0], at[1],
 * at[2]), then the partial sums of dq (at[3]) and of dhm (at[4]) where some
 * item has more than one key chunk. Returns its size. */
static size_t bwd_layout(const ma_attn_bwd_params *p, size_t at[5]) {
    ma_attn_args a = p->a; /* varlen_chunk_tables sets its counts (as the plan did) */
    const size_t esz = a.dtype == MA_F64 ? sizeof(double) : sizeof(float), row3 = 3 * sizeof(int64_t);
    size_t n = 0;
    int64_t rows = p->kv_chunks > 1 ? p->kv_chunks * a.B * a.H * a.Lq : 0;
    if (a.cu_q) {
        rows = varlen_chunk_tables(&a, NULL);
        at[0] = 0;
        at[1] = n = ma_round_up((size_t)a.n_kv_items * row3, MA_CACHE_LINE);
        at[2] = n += ma_round_up((size_t)a.n_q_items * row3, MA_CACHE_LINE);
        n += ma_round_up((size_t)a.B * 2 * sizeof(int64_t), MA_CACHE_LINE);
    }
    at[3] = n;
    n += ma_round_up((size_t)rows * (size_t)a.D * esz, MA_CACHE_LINE);
    at[4] = n;
    if (p->dhm_rows) n += ma_round_up((size_t)rows * esz, MA_CACHE_LINE);
    return n;
}

static void bwd_bind(void *params, void *workspace) {
    ma_attn_bwd_params *p = params;
    size_t at[5];
    const size_t n = bwd_layout(p, at);
    char *w = workspace;
    const int part = at[4] > at[3];
    if (p->a.cu_q) {
        int64_t *entry = (int64_t *)(w + at[2]);
        varlen_chunk_tables(&p->a, entry);
        varlen_fill_chunks(&p->a, (int64_t *)w, p->a.n_kv_items);
        varlen_reduce_fill(&p->a, entry, (int64_t *)(w + at[1]));
        p->a.kv_items = (const int64_t *)w, p->a.q_items = (const int64_t *)(w + at[1]);
        p->entry_chunks = entry;
    }
    p->dq_part = part ? w + at[3] : NULL;
    p->dhm_part = part && n > at[4] ? w + at[4] : NULL;
}

/* Where the weights have a gradient (dense calls; varlen returns no weights: -1), the
 * pre-pass over (b, h, query block) that puts their term in delta; then the single pass
 * (one item per (b, hkv, key chunk)), then, where some item has more than one chunk, the
 * reduce over (b, h, query block). One item at a time: items cost whole heads, and varlen's
 * come most expensive first. */
int ma_attn_plan_bwd(ma_attn_bwd_params *p, int64_t threads, ma_plan *plan) {
    if (!p || !plan) return -1;
    ma_attn_args *a = &p->a;
    plan_init(plan);
    p->kv_chunks = 1, p->entry_chunks = NULL, p->dq_part = p->dhm_part = NULL;
    p->key_group = bwd_key_group(p);
    /* the five products, and the pre-pass's scores */
    const double per_head = (double)a->H * (double)((p->dweights ? 4 : 3) * a->D + 2 * a->Dv);
    plan->work = (a->cu_q ? varlen_count(a) : (double)a->B * (double)a->Lq * (double)a->Lk) * per_head;
    plan->threads = plan_threads(plan->work, threads);
    const size_t bytes = KERNELS(p)->bwd_scratch_bytes(p);
    const int64_t nq = a->B * a->H * ma_cdiv(a->Lq, a->block_q);
    if (p->dweights) {
        if (a->cu_q) return -1;
        add_pass(plan, ma_attn_bwd_delta_task, nq, 1, bytes);
    }
    int64_t reduce = 0;
    if (a->cu_q) {
        reduce = varlen_chunk_tables(a, NULL) > 0;
        for (int64_t b = 0; b < a->B; b++) p->kv_chunks = ma_max(p->kv_chunks, varlen_chunks(a, b));
    } else {
        p->kv_chunks = bwd_kv_chunks(p);
        reduce = p->kv_chunks > 1;
    }
    add_pass(plan, ma_attn_bwd_fused_task, a->cu_q ? a->n_kv_items : a->B * a->Hkv * p->kv_chunks, 1, bytes);
    if (reduce) add_pass(plan, ma_attn_bwd_reduce_task, a->cu_q ? a->n_q_items : nq, 1, bytes);
    size_t at[5];
    plan->workspace_bytes = bwd_layout(p, at);
    if (plan->workspace_bytes) plan->bind = bwd_bind;
    return 0;
}
