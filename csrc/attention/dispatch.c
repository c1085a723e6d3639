/* dispatch.c -- the public attention task functions (masked_attn.h): the one
 * switch from (dtype, instruction set) to an instance of attention_tmpl.h,
 * and the work split the shim plans with. */
#include <stdatomic.h>

#include "blocks.h"
#include "common/dtype.h"
#include "common/isa.h"
#include "masked_attn.h"

/* float64 runs the double-accumulating instance whatever the ISA (the shim
 * asked common/isa.c for p->isa); float32, bfloat16, float16 the ISA's, but
 * AVX512-BF16's products are for bfloat16 only (avx512bf16.c). */
static const ma_attn_kernels *kernels(ma_dtype dt, ma_isa isa) {
    if (dt == MA_F64) return &ma_attn_kernels_f64;
    switch (isa) {
    case MA_ISA_AMX: return &ma_attn_kernels_amx;
    case MA_ISA_AVX512BF16: return dt == MA_BF16 ? &ma_attn_kernels_avx512bf16 : &ma_attn_kernels_avx512;
    case MA_ISA_AVX512: return &ma_attn_kernels_avx512;
    case MA_ISA_AVX2: return &ma_attn_kernels_avx2;
    case MA_ISA_SCALAR:
    default: return &ma_attn_kernels_scalar;
    }
}

#define KERNELS(P) kernels((P)->a.dtype, (P)->a.isa)
#define PARAMS(T, ctx) ((const T *)((const ma_task_ctx *)(ctx))->params)

/* Varlen (a.cu_q): the shim's work-item tables, sized by the real lengths. */
int64_t ma_attn_fwd_work_items(const ma_attn_fwd_params *p) {
    return p->a.cu_q ? p->a.n_q_items : p->a.B * p->a.H * ma_cdiv(p->a.Lq, p->a.block_q);
}
size_t ma_attn_fwd_scratch_bytes(const ma_attn_fwd_params *p) { return KERNELS(p)->fwd_scratch_bytes(p); }

/* Every query block short (varlen: a.Lq is the longest sequence), no weights,
 * and K's and V's heads side by side within a row (head stride below the row
 * stride). */
int64_t ma_attn_fwd_head_group(const ma_attn_fwd_params *p) {
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
void ma_attn_fwd_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_fwd_params, ctx))->fwd(begin, end, ctx);
}

int64_t ma_attn_bwd_dq_work_items(const ma_attn_bwd_params *p) {
    return p->a.cu_q ? p->a.n_q_items : p->a.B * p->a.H * ma_cdiv(p->a.Lq, p->a.block_q);
}
int64_t ma_attn_bwd_dkdv_work_items(const ma_attn_bwd_params *p) {
    return p->a.cu_q ? p->a.n_kv_items : p->a.B * p->a.Hkv * ma_cdiv(p->a.Lk, p->a.block_k);
}
size_t ma_attn_bwd_scratch_bytes(const ma_attn_bwd_params *p) { return KERNELS(p)->bwd_scratch_bytes(p); }
void ma_attn_bwd_dq_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_bwd_params, ctx))->bwd_dq(begin, end, ctx);
}
void ma_attn_bwd_dkdv_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_bwd_params, ctx))->bwd_dkdv(begin, end, ctx);
}

/* Varlen always takes the two passes: their items are sized by the real lengths. */
int ma_attn_bwd_single_pass(const ma_attn_bwd_params *p) { return p->dweights == NULL && !p->a.cu_q; }

/* Enough (b, hkv, chunk) items for one per CPU the process can use, and at
 * least 8; never more chunks than key blocks, nor than MA_BWD_KV_CHUNKS_MAX
 * (the partial sums of dq take C times dq's memory). The CPU count is the
 * machine's (ma_cpu_count), not the thread count, so results stay the same
 * bits for any thread count. Before 2026-11-26 the target was 8 items on
 * every machine: on 16 cores, 8 heads of one sequence kept half of them idle
 * in the backward. Two items per CPU measured no faster there than one, and
 * cost as much on 2 threads (docs/performance.md, "Intel Xeon, 16 cores"). */
#define MA_BWD_KV_CHUNKS_MAX 16
static _Atomic int64_t forced_cpus = 0;

int64_t ma_attn_bwd_cpus_force(int64_t n) { return atomic_exchange(&forced_cpus, n > 0 ? n : 0); }

int64_t ma_attn_bwd_kv_chunks(const ma_attn_bwd_params *p) {
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

int64_t ma_attn_bwd_key_group_force(int64_t n) {
    const int64_t old = forced_key_group;
    forced_key_group = n > 0 ? n : 0;
    return old;
}

int64_t ma_attn_bwd_key_group(const ma_attn_bwd_params *p) {
    if (forced_key_group > 0) return forced_key_group;
    const int64_t G = p->a.H / p->a.Hkv;
    const double acc = p->a.dtype == MA_F64 ? 8.0 : 4.0;
    const double query_side = (double)G * (double)p->a.Lq * (double)(2 * p->a.D + p->a.Dv) * acc;
    return query_side > (double)(1 << 20) ? MA_BWD_KEY_GROUP_MAX : 1;
}

int64_t ma_attn_bwd_fused_work_items(const ma_attn_bwd_params *p) { return p->a.B * p->a.Hkv * p->kv_chunks; }
void ma_attn_bwd_fused_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_bwd_params, ctx))->bwd_fused(begin, end, ctx);
}

int64_t ma_attn_bwd_reduce_work_items(const ma_attn_bwd_params *p) {
    return p->a.B * p->a.H * ma_cdiv(p->a.Lq, p->a.block_q);
}
void ma_attn_bwd_reduce_task(int64_t begin, int64_t end, void *ctx) {
    KERNELS(PARAMS(ma_attn_bwd_params, ctx))->bwd_reduce(begin, end, ctx);
}
