/* kernel_bwd.c -- the attention forward and backward called
 * straight from C (no torch, one thread), timed per tile: the tool to find
 * where a tile costs more in place than the same products in isolation (see
 * docs/performance.md). Float32, causal, q/k/v/dout contiguous (B, H, L, D),
 * out and gradients (B, L, H, D) as the shim makes them, the variant's tiles, the
 * variant MASKED_ATTN_ISA would pick by default unless ISA is given; then the
 * same call on the scalar reference, and exit 1 if any output or gradient
 * differs by more than 1e-3 (tests/project/test_c_harness.py runs it so, on a small
 * shape, for every variant the CPU has). With bf16 after ISA, inputs, outputs
 * and gradients are bfloat16 (out_lo too, as the shim passes it before a
 * backward), and the bound is 2^-6 (|reference| + 1): a few bfloat16 roundings. Not part of the library or of
 * `make bench`. After a build of the package (its C
 * objects are in build/):
 *
 *   O=$(ls -d build/temp.*)/c11
 *   gcc -O2 -std=c11 -Icsrc -D_POSIX_C_SOURCE=200809L benchmarks/kernel_bwd.c \
 *       $O/attention_*.o $O/common_isa.o -o /tmp/kernel_bwd -lm
 *   /tmp/kernel_bwd B H L D REPS [ISA [bf16]]   e.g. 8 8 512 64 5 avx2 (ISA: a name of
 *                                               MA_ISA_TABLE, masked_attn.h: scalar, avx2, ...)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/dtype.h"
#include "masked_attn.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static float frand(void) { /* about N(0, 1) */
    float s = 0;
    for (int i = 0; i < 4; i++) s += (float)rand() / RAND_MAX - 0.5f;
    return s * 1.7f;
}

static void *alloc_or_die(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

/* the task function over all its items with one scratch slice, as the shim's run_tasks on one thread */
static double run(ma_task_fn fn, const void *params, int64_t n, size_t scratch_bytes) {
    void *scratch = alloc_or_die(scratch_bytes + MA_CACHE_LINE);
    memset(scratch, 0, MA_CACHE_LINE); /* the slice's header starts zeroed */
    ma_task_ctx ctx = {params, scratch};
    const double t0 = now();
    fn(0, n, &ctx);
    const double t = now() - t0;
    free(scratch);
    return t;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s B H L D REPS [ISA [bf16]]  (ISA:", argv[0]);
        for (int i = 0; ma_isa_name(i); i++) fprintf(stderr, " %s", ma_isa_name(i));
        fprintf(stderr, ")\n");
        return 2;
    }
    const int64_t B = atoll(argv[1]), H = atoll(argv[2]), L = atoll(argv[3]), D = atoll(argv[4]);
    const int reps = atoi(argv[5]);
    ma_isa isa = ma_isa_best(MA_F32);
    if (argc > 6) {
        int found = 0;
        for (int i = 0; ma_isa_name(i); i++) /* MA_ISA_TABLE's names */
            if (!strcmp(argv[6], ma_isa_name(i))) isa = (ma_isa)i, found = 1;
        if (!found || !ma_isa_available(isa)) {
            fprintf(stderr, "ISA %s: unknown or not on this CPU\n", argv[6]);
            return 2;
        }
    }
    if (B < 1 || H < 1 || L < 1 || D < 1 || reps < 1) {
        fprintf(stderr, "B, H, L, D, REPS must be positive\n");
        return 2;
    }
    const int bf16 = argc > 7 && !strcmp(argv[7], "bf16");
    const ma_dtype dt = bf16 ? MA_BF16 : MA_F32;
    const size_t n = (size_t)(B * H * L * D), es = bf16 ? 2 : 4;
    void *q = alloc_or_die(es * n), *k = alloc_or_die(es * n), *v = alloc_or_die(es * n), *g = alloc_or_die(es * n);
    void *out = alloc_or_die(es * n), *dq = alloc_or_die(es * n), *dk = alloc_or_die(es * n),
         *dv = alloc_or_die(es * n);
    void *out_lo = bf16 ? alloc_or_die(es * n) : NULL;
    float *lse = alloc_or_die(4 * (size_t)(B * H * L)), *delta = alloc_or_die(4 * (size_t)(B * H * L));
    void *in[4] = {q, k, v, g};
    for (int t = 0; t < 4; t++)
        for (size_t i = 0; i < n; i++) ma_store_f32(in[t], dt, (int64_t)i, frand());
    const int64_t st[4] = {H * L * D, L * D, D, 1};  /* (B, H, L, D) */
    const int64_t ost[4] = {L * H * D, D, H * D, 1}; /* (B, L, H, D) seen as (B, H, L, D) */

    ma_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = q, a.k = k, a.v = v, a.dtype = dt;
    memcpy(a.q_stride, st, sizeof st), memcpy(a.k_stride, st, sizeof st), memcpy(a.v_stride, st, sizeof st);
    memcpy(a.out_stride, ost, sizeof ost), memcpy(a.out_lo_stride, ost, sizeof ost);
    a.diagonal = 0, a.scale = 1.0 / sqrt((double)D); /* causal: the top-left diagonal, right side 0 */
    a.opts.window_left = -1, a.opts.window_right = 0;
    a.B = B, a.H = H, a.Hkv = H, a.Lq = L, a.Lk = L, a.D = D, a.Dv = D;
    ma_traits traits;
    ma_attn_traits(dt, isa, &traits);
    a.block_q = traits.block_q, a.block_k = traits.block_k;
    ma_attn_band(a.diagonal, a.opts.window_left, a.opts.window_right, &a.band_lo, &a.band_hi);
    a.stat_stride[0] = H * L, a.stat_stride[1] = L;
    a.isa = isa;

    ma_attn_fwd_params f;
    memset(&f, 0, sizeof f);
    f.out = out, f.out_lo = out_lo, f.lse = lse, f.a = a;
    ma_plan fplan;
    ma_attn_plan_fwd(&f, 1, &fplan);
    const int64_t nq = (L + a.block_q - 1) / a.block_q, tiles = B * H * nq * (nq + 1) / 2;
    double fbest = 1e30;
    for (int r = 0; r < reps; r++) {
        const double t = run(fplan.pass[0].fn, &f, fplan.pass[0].n, fplan.pass[0].scratch_bytes);
        if (t < fbest) fbest = t;
    }

    ma_attn_bwd_params p;
    memset(&p, 0, sizeof p);
    p.dq = dq, p.dk = dk, p.dv = dv, p.dout = g, p.out = out, p.out_lo = out_lo, p.lse = lse, p.delta = delta, p.a = a;
    memcpy(p.dq_stride, ost, sizeof ost), memcpy(p.dk_stride, ost, sizeof ost), memcpy(p.dv_stride, ost, sizeof ost);
    memcpy(p.dout_stride, st, sizeof st);
    ma_attn_bwd_cpus_force(1); /* one thread: key chunks as on a machine of up to 8 CPUs (8 items) */
    ma_plan bplan;
    ma_attn_plan_bwd(&p, 1, &bplan);
    if (bplan.n_passes != 1 || p.kv_chunks != 1) {
        fprintf(stderr, "this shape takes key chunks (B * H < 8): use B * H >= 8\n");
        return 2;
    }
    double bbest = 1e30;
    for (int r = 0; r < reps; r++) {
        const double t = run(bplan.pass[0].fn, &p, bplan.pass[0].n, bplan.pass[0].scratch_bytes);
        if (t < bbest) bbest = t;
    }
    /* a hash of the variant's output and gradients (FNV-1a over their bytes): the same
     * variant at another SVE length must print the same (tools/arm.py) */
    uint64_t bits = 1469598103934665603ull;
    const void *res[4] = {out, dq, dk, dv};
    for (int t = 0; t < 4; t++)
        for (size_t i = 0; i < es * n; i++) bits = (bits ^ ((const unsigned char *)res[t])[i]) * 1099511628211ull;
    printf("output bits %016llx\n", (unsigned long long)bits);
    /* the same call on the scalar reference: the timed variant's results must agree (exit 1 if not) */
    float maxdiff = 0;
    if (isa != MA_ISA_SCALAR) {
        void *out_s = alloc_or_die(es * n), *dq_s = alloc_or_die(es * n), *dk_s = alloc_or_die(es * n),
             *dv_s = alloc_or_die(es * n), *lo_s = bf16 ? alloc_or_die(es * n) : NULL;
        float *lse_s = alloc_or_die(4 * (size_t)(B * H * L));
        ma_attn_fwd_params fs = f;
        fs.a.isa = MA_ISA_SCALAR, fs.out = out_s, fs.out_lo = lo_s, fs.lse = lse_s;
        ma_attn_plan_fwd(&fs, 1, &fplan);
        run(fplan.pass[0].fn, &fs, fplan.pass[0].n, fplan.pass[0].scratch_bytes);
        ma_attn_bwd_params ps = p;
        ps.a.isa = MA_ISA_SCALAR, ps.dq = dq_s, ps.dk = dk_s, ps.dv = dv_s, ps.out = out_s, ps.out_lo = lo_s;
        ps.lse = lse_s;
        ma_attn_plan_bwd(&ps, 1, &bplan);
        run(bplan.pass[0].fn, &ps, bplan.pass[0].n, bplan.pass[0].scratch_bytes);
        const void *got[4] = {out, dq, dk, dv}, *want[4] = {out_s, dq_s, dk_s, dv_s};
        for (int t = 0; t < 4; t++)
            for (size_t i = 0; i < n; i++) {
                const float w = ma_load_f32(want[t], dt, (int64_t)i);
                /* bfloat16: relative to 2^-6 (|w| + 1), so that one bound reads both */
                const float d = fabsf(ma_load_f32(got[t], dt, (int64_t)i) - w) / (bf16 ? (fabsf(w) + 1) / 64.0f : 1);
                if (!(d <= maxdiff)) maxdiff = d; /* NaN sticks */
            }
        free(out_s), free(dq_s), free(dk_s), free(dv_s), free(lo_s), free(lse_s);
    }
    const double tile_flops = 2.0 * 64 * 64 * (double)D; /* one 64 x 64 x D product */
    printf("B=%lld H=%lld L=%lld D=%lld, isa %d, one thread, best of %d: forward %.2f ms (%.2f us a tile, "
           "%.1f GFLOP/s counting whole tiles), backward %.2f ms (%.2f us a tile, %.1f GFLOP/s counting whole tiles), "
           "%lld causal tiles\n",
           (long long)B, (long long)H, (long long)L, (long long)D, (int)isa, reps, fbest * 1e3, fbest * 1e6 / tiles,
           2 * tile_flops * tiles / fbest * 1e-9, bbest * 1e3, bbest * 1e6 / tiles,
           5 * tile_flops * tiles / bbest * 1e-9, (long long)tiles);
    free(q), free(k), free(v), free(g), free(out), free(dq), free(dk), free(dv), free(out_lo), free(lse), free(delta);
    if (isa != MA_ISA_SCALAR) {
        printf("max |difference| from the scalar reference (out, dq, dk, dv)%s: %.3g\n",
               bf16 ? ", bfloat16, in units of 2^-6 (|reference| + 1)" : "", maxdiff);
        if (!(maxdiff <= (bf16 ? 1.0f : 1e-3f))) return 1;
    }
    return 0;
}
