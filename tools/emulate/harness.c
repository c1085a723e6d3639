/*
 * harness.c -- one attention forward and backward called from C with no C
 * library at all, for tools/emulate/run.py, which runs it on an emulated CPU
 * (Bochs, through bochscpu) to test instruction-set variants this machine
 * lacks (AVX-512, AVX512-BF16). run.py writes a struct emu_io and the
 * inputs into the emulated memory and calls emu_main(io); emu_main fills the
 * params as the shim does (csrc/shim/attention.cpp), runs the forward's plan
 * (ma_attn_plan_fwd) on one thread, then the backward's (and its
 * reduce when the keys are split in chunks), and returns to emu_halt.
 * Layouts: q, dout, out, out_lo, dq (B, H, Lq, D|Dv); k, v, dk, dv (B, Hkv,
 * Lk, D|Dv), contiguous, in dtype (k, v int8 with k_scale); lse, delta (B, H, Lq) float32.
 */
#include <stddef.h>
#include <stdint.h>

#include "common/isa.h" /* MA_ISA_TABLE's vocabulary */
#include "masked_attn.h"

struct emu_io {
    int64_t B, H, Hkv, Lq, Lk, D, Dv;
    int64_t dtype, isa, is_causal, window_left, window_right;
    double scale, softcap;
    /* inputs */
    uint64_t q, k, v, dout;
    uint64_t kpm;       /* (B, Lk) uint8, 1 = padding; 0: none */
    uint64_t attn_mask; /* (Lq, Lk) float32, added to every head; 0: none */
    uint64_t head_mask; /* (H,) float32; 0: none */
    /* outputs */
    uint64_t out, out_lo, lse, dq, dk, dv, delta; /* out_lo: 0 for float32 (the shim passes none) */
    /* scratch arena */
    uint64_t arena, arena_bytes;
    int64_t forward_only;
    /* 1: the same call as packed sequences (masked_attn::varlen_*): B entries of Lq queries and
     * Lk keys, H = Hkv = 1 (the (B, 1, L, D) layout is then the packed (B L, 1, D)), no masks */
    int64_t varlen;
    /* k_scale, v_scale: (B, Hkv, Lk) float32, the 8-bit cache's (k and v then int8; forward only),
     * 0: none */
    uint64_t k_scale, v_scale;
    int64_t status; /* 0 ok, 1 arena too small, 2 no backward plan, 3 not a varlen shape, 4 no
                     * kernels for the dtype and variant (ma_attn_traits) */
};

static void contig4(int64_t st[4], int64_t d1, int64_t d2, int64_t d3) {
    st[0] = d1 * d2 * d3, st[1] = d2 * d3, st[2] = d3, st[3] = 1;
}

static void zero(void *p, size_t n) {
    volatile char *c = p; /* volatile: not turned into a call to memset */
    for (size_t i = 0; i < n; i++) c[i] = 0;
}

/* the task function over all its items with one scratch slice (header zeroed), as the shim on one thread */
static int run(struct emu_io *io, ma_task_fn fn, const void *params, int64_t n, size_t bytes, char *arena) {
    if (bytes + MA_CACHE_LINE > io->arena_bytes - (size_t)(arena - (char *)io->arena)) return 1;
    zero(arena, MA_CACHE_LINE);
    ma_task_ctx ctx = {params, arena};
    fn(0, n, &ctx);
    return 0;
}

/* a plan's workspace (the key chunks' partial sums of dq) at the start of the arena, then its passes in order */
static int run_plan(struct emu_io *io, const ma_plan *plan, void *params, char *arena) {
    if (plan->bind) {
        if (plan->workspace_bytes + MA_CACHE_LINE > io->arena_bytes - (size_t)(arena - (char *)io->arena)) return 1;
        plan->bind(params, arena);
        arena += plan->workspace_bytes + MA_CACHE_LINE;
        arena -= (uintptr_t)arena % MA_CACHE_LINE;
    }
    for (int i = 0; i < plan->n_passes; i++)
        if (run(io, plan->pass[i].fn, params, plan->pass[i].n, plan->pass[i].scratch_bytes, arena)) return 1;
    return 0;
}

void emu_main(struct emu_io *io) {
    const int64_t B = io->B, H = io->H, Hkv = io->Hkv, Lq = io->Lq, Lk = io->Lk, D = io->D, Dv = io->Dv;
    ma_attn_args a;
    zero(&a, sizeof a);
    a.q = (const void *)io->q, a.k = (const void *)io->k, a.v = (const void *)io->v;
    a.dtype = (ma_dtype)io->dtype;
    contig4(a.q_stride, H, Lq, D), contig4(a.k_stride, Hkv, Lk, D), contig4(a.v_stride, Hkv, Lk, Dv);
    contig4(a.out_stride, H, Lq, Dv), contig4(a.out_lo_stride, H, Lq, Dv);
    if (io->kpm) {
        a.key_padding_mask.ptr = (const void *)io->kpm, a.key_padding_mask.dtype = MA_BOOL;
        a.key_padding_mask.stride[0] = Lk, a.key_padding_mask.stride[1] = 1;
    }
    if (io->attn_mask) {
        a.attn_mask.ptr = (const void *)io->attn_mask, a.attn_mask.dtype = MA_F32;
        a.attn_mask.stride[2] = Lk, a.attn_mask.stride[3] = 1;
    }
    if (io->k_scale) { /* the 8-bit cache: strides of its rows, as the shim passes them */
        ma_mask *sc[2] = {&a.opts.k_scale, &a.opts.v_scale};
        const uint64_t at[2] = {io->k_scale, io->v_scale};
        for (int x = 0; x < 2; x++) {
            sc[x]->ptr = (const void *)at[x], sc[x]->dtype = MA_F32;
            sc[x]->stride[0] = Hkv * Lk, sc[x]->stride[1] = Lk, sc[x]->stride[2] = 1;
        }
    }
    if (io->head_mask) {
        a.opts.head_mask.ptr = (const void *)io->head_mask, a.opts.head_mask.dtype = MA_F32;
        a.opts.head_mask.stride[1] = 1;
    }
    /* the shim's: top-left diagonal, causal the right side 0 */
    a.diagonal = 0;
    a.opts.window_left = io->window_left, a.opts.window_right = io->is_causal ? 0 : io->window_right;
    ma_attn_band(a.diagonal, a.opts.window_left, a.opts.window_right, &a.band_lo, &a.band_hi);
    a.opts.softcap = io->softcap, a.scale = io->scale;
    a.B = B, a.H = H, a.Hkv = Hkv, a.Lq = Lq, a.Lk = Lk, a.D = D, a.Dv = Dv;
    a.stat_stride[0] = H * Lq, a.stat_stride[1] = Lq;
    a.isa = (ma_isa)io->isa;
    ma_traits traits; /* the shim's tile: the variant's row of MA_ISA_TABLE */
    if (ma_attn_traits((int)io->dtype, (int)io->isa, &traits) != 0) {
        io->status = 4;
        return;
    }
    a.block_q = traits.block_q, a.block_k = traits.block_k;
    int32_t cu_q[17], cu_k[17];
    int64_t *batch_strides[] = {a.q_stride, a.k_stride, a.v_stride, a.out_stride, a.out_lo_stride};
    if (io->varlen) { /* the shim's varlen_args: entries at cu_q, cu_k, the band per entry (bottom right) */
        if (H != 1 || Hkv != 1 || B > 16 || io->kpm || io->attn_mask || io->head_mask) {
            io->status = 3;
            return;
        }
        for (int64_t b = 0; b <= B; b++) cu_q[b] = (int32_t)(b * Lq), cu_k[b] = (int32_t)(b * Lk);
        a.cu_q = cu_q, a.cu_k = cu_k;
        for (int x = 0; x < 5; x++) batch_strides[x][0] = 0;
        a.stat_stride[0] = 0, a.stat_stride[1] = B * Lq;
        a.band_lo = -MA_BAND_INF, a.band_hi = MA_BAND_INF;
    }

    ma_attn_fwd_params f;
    zero(&f, sizeof f);
    f.out = (void *)io->out, f.lse = (void *)io->lse, f.out_lo = (void *)io->out_lo, f.a = a;
    ma_plan plan;
    ma_attn_plan_fwd(&f, 1, &plan);
    char *arena = (char *)io->arena;
    if (run_plan(io, &plan, &f, arena)) {
        io->status = 1;
        return;
    }

    if (io->forward_only) {
        io->status = 0;
        return;
    }
    ma_attn_bwd_params p;
    zero(&p, sizeof p);
    p.dq = (void *)io->dq, p.dk = (void *)io->dk, p.dv = (void *)io->dv;
    p.dout = (const void *)io->dout, p.out = (const void *)io->out, p.out_lo = (const void *)io->out_lo;
    p.lse = (const void *)io->lse, p.delta = (void *)io->delta, p.a = a;
    contig4(p.dq_stride, H, Lq, D), contig4(p.dk_stride, Hkv, Lk, D), contig4(p.dv_stride, Hkv, Lk, Dv);
    contig4(p.dout_stride, H, Lq, Dv);
    if (io->varlen) p.dq_stride[0] = p.dk_stride[0] = p.dv_stride[0] = p.dout_stride[0] = 0;
    if (ma_attn_plan_bwd(&p, 1, &plan) != 0) {
        io->status = 2;
        return;
    }
    io->status = run_plan(io, &plan, &p, arena);
}

/* emu_main returns here: run.py pushes this address before calling it. */
__asm__(".globl emu_halt\nemu_halt:\n\thlt\n\tjmp emu_halt\n");

/* ---- what the compiler and the kernels call: no C library in the emulator ---- */
#ifdef EMU_STUBS
/* The instances run.py does not build (it never asks for them): empty tables for dispatch.c. */
typedef struct {
    void *fn[7];
} emu_kernels_stub;
const emu_kernels_stub ma_attn_kernels_avx2, ma_attn_kernels_amx;
#endif
int ma_isa_available(ma_isa isa) {
    (void)isa;
    return 1; /* run.py picks the variant; the emulated CPU has it */
}
/* common/isa.c's, which dispatch.c calls (isa.c needs a C library): generated from MA_ISA_TABLE
 * as there. */
int ma_isa_built(int isa) {
    switch (isa) {
#define BUILT(ID, name, abi, arch, bq, bk, fb, own, inst, usable) MA_ON_##arch(case MA_ISA_##ID : return 1;)
        MA_ISA_TABLE(BUILT)
#undef BUILT
    default: return 0;
    }
}
ma_isa ma_isa_runs(ma_isa isa, ma_dtype dt, int rows) {
    switch (isa) {
#define RUNS(ID, name, abi, arch, bq, bk, fb, own, inst, usable)                               \
    MA_ON_##arch(case MA_ISA_##ID : if (MA_OWNS_##own(dt, rows) && MA_INST_##inst) return isa; \
                 return ma_isa_runs(MA_ISA_##fb, dt, rows);)
        MA_ISA_TABLE(RUNS)
#undef RUNS
    default: return MA_ISA_SCALAR;
    }
}
ma_isa ma_isa_best(ma_dtype dt) {
    (void)dt;
    return MA_ISA_SCALAR;
}
int64_t ma_cpu_count(void);
int64_t ma_cpu_count(void) { return 1; } /* one emulated CPU: the backward's key chunks of a small machine */

/* Word at a time, as a C library's would be, so that instruction counts (run.py --count) stay
 * near a real build's; -fno-tree-loop-distribute-patterns keeps them from calling themselves. */
typedef uint64_t __attribute__((may_alias, aligned(1))) word;

void *memset(void *d, int c, size_t n) {
    unsigned char *p = d;
    const uint64_t w = 0x0101010101010101ull * (unsigned char)c;
    for (; n >= 8; n -= 8, p += 8) *(word *)p = w;
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)c;
    return d;
}
void *memcpy(void *restrict d, const void *restrict s, size_t n) {
    unsigned char *p = d;
    const unsigned char *q = s;
    for (; n >= 8; n -= 8, p += 8, q += 8) *(word *)p = *(const word *)q;
    for (size_t i = 0; i < n; i++) p[i] = q[i];
    return d;
}
void *memmove(void *d, const void *s, size_t n) {
    unsigned char *p = d;
    const unsigned char *q = s;
    if (p < q)
        for (size_t i = 0; i < n; i++) p[i] = q[i];
    else
        for (size_t i = n; i-- > 0;) p[i] = q[i];
    return d;
}
