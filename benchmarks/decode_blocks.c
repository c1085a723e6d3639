/*
 * decode_blocks.c -- the decode kernel's products alone: dot_rows (scores from key rows) and
 * axpy_keys (P V from value rows) of the AVX2 (or AVX-512) instance over 64 keys in L1, as a share of the
 * FMA peak measured in the same process (12 chains of FMAs, alternated with the kernels), and
 * beside them a prototype of the scores in 4 rows x 3 keys; over int8 keys (the 8-bit cache),
 * dot_rows' and axpy_keys' float products beside dot_rows_i8's and axpy_keys_i8's integer ones,
 * as multiply-adds a second over the FMA peak's (docs/decoding-performance.md, "The products'
 * own speed"). Built with -mavx512vnni too, the integer products take vpdpwssd (the avx512bf16
 * unit's build).
 * What a decode step costs where its cache is in cache. x86-64, AVX2 or (built with -mavx512f) the
 * AVX-512 instance, whose line has no 4 x 3 prototype (an AVX2 tile):
 *
 *   cc -std=c11 -O3 -mavx2 -mfma -mf16c -Icsrc -include csrc/common/glibc_compat.h \
 *      benchmarks/decode_blocks.c -lm -o /tmp/decode_blocks && taskset -c 1 /tmp/decode_blocks 4
 *   (AVX-512: -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c, setup.py's flags)
 *
 * Arguments: query rows a key head (1-16), the key rows' stride in elements (D: one after
 * another; 8 D: 8 key heads side by side), repetitions (100000), D (128, a multiple of 16).
 */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef __AVX512F__
#include "common/simd_avx512.h"
#else
#include "common/simd_avx2.h"
#endif
#define BLK(name) name##_bench
#pragma GCC diagnostic ignored "-Wunused-function" /* the blocks this program does not time */
#include "attention/blocks_simd.h"

typedef void (*dot_fn)(float *, int64_t, const float *, int64_t, int64_t, const void *, ma_dtype, int64_t, int64_t,
                       int64_t, int64_t);
typedef void (*i8_fn)(float *, int64_t, const int16_t *, const float *, int64_t, int64_t, const int8_t *, int64_t,
                      int64_t, int64_t, int64_t);
typedef void (*axpy_fn)(float *, const float *, int64_t, int64_t, int64_t, const void *, ma_dtype, int64_t, int64_t,
                        int64_t, int64_t, float *);

#if MA_VL == 8
/* The library's order (one vector of 8 partial sums a score) in the tile it measured and did not
 * keep: 4 rows x 3 keys (12 accumulators, 3 key and 4 q loads to 12 FMAs; the library's is 4 x 2),
 * folded by the transposes. Timed only. */
MA_INLINE void natural_tile(const int RP, const int KI, vf *xs, int64_t i, const float *q, int64_t D, const void *k,
                            const ma_dtype dt, int64_t ld, int64_t c) {
    vf acc[12];
    for (int x = 0; x < RP * KI; x++) acc[x] = vf_zero();
    for (int64_t d = 0; d < D; d += 8) {
        vf kv[3];
        for (int j = 0; j < KI; j++) kv[j] = vf_in_reg(vf_load_dt(k, dt, (c + j) * ld + d, 8));
        for (int r = 0; r < RP; r++) {
            const vf qv = vf_in_reg(vf_load(q + r * D + d));
            for (int j = 0; j < KI; j++) acc[j * RP + r] = vf_fma(kv[j], qv, acc[j * RP + r]);
        }
    }
    for (int j = 0; j < KI; j++)
        for (int r = 0; r < RP; r++) xs[r * 8 + i + j] = acc[j * RP + r];
}

MA_INLINE void natural_pass(const int RP, float *s, int64_t lds, const float *q, int64_t D, const void *k,
                            const ma_dtype dt, int64_t ld, int64_t nc) {
    vf xs[4 * 8];
    for (int64_t c0 = 0; c0 < nc; c0 += 8) {
        natural_tile(RP, 3, xs, 0, q, D, k, dt, ld, c0);
        natural_tile(RP, 3, xs, 3, q, D, k, dt, ld, c0 + 3);
        natural_tile(RP, 2, xs, 6, q, D, k, dt, ld, c0 + 6);
        for (int r = 0; r < RP; r++) {
            vf *x = xs + r * 8;
            vf_transpose(x);
            for (int w = 8; w > 1; w /= 2)
                for (int t = 0; t < w / 2; t++) x[t] = vf_add(x[t], x[t + w / 2]);
            vf_store(s + r * lds + c0, x[0]);
        }
    }
}

static void natural_bench(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                          int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    (void)off, (void)pf;
    for (int64_t r = 0; r < nr; r += 4) {
        if (nr - r >= 4) natural_pass(4, s + r * lds, lds, q + r * D, D, k, dt, ld, nc);
        else if (nr - r == 3) natural_pass(3, s + r * lds, lds, q + r * D, D, k, dt, ld, nc);
        else if (nr - r == 2) natural_pass(2, s + r * lds, lds, q + r * D, D, k, dt, ld, nc);
        else natural_pass(1, s + r * lds, lds, q + r * D, D, k, dt, ld, nc);
    }
}

#endif

/* called through pointers the compiler cannot see through, so that nothing is specialised */
#if MA_VL == 8
static dot_fn volatile natural = natural_bench;
#else
static dot_fn volatile natural = NULL; /* (an AVX2 tile) */
#endif
static dot_fn volatile dot_rows = dot_rows_bench;
static axpy_fn volatile axpy_keys = axpy_keys_bench;
static i8_fn volatile dot_rows_i8 = dot_rows_i8_bench;
typedef void (*pv_i8_fn)(float *, const float *, int64_t, int64_t, int64_t, const int8_t *, int64_t, int64_t, int64_t,
                         int64_t);
static pv_i8_fn volatile axpy_keys_i8 = axpy_keys_i8_bench;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* n x 12 x VL FMAs in 12 independent chains: the FMA peak's yardstick. */
static volatile float g_a = 0.999999f, g_b = 1e-6f;
static float fma_loop(int64_t n) {
    const vf a = vf_set1(g_a), b = vf_set1(g_b);
    vf c0 = vf_set1(0.1f), c1 = vf_set1(0.2f), c2 = vf_set1(0.3f), c3 = vf_set1(0.4f), c4 = vf_set1(0.5f),
       c5 = vf_set1(0.6f), c6 = vf_set1(0.7f), c7 = vf_set1(0.8f), c8 = vf_set1(0.9f), c9 = vf_set1(1.0f),
       c10 = vf_set1(1.1f), c11 = vf_set1(1.2f);
    for (int64_t i = 0; i < n; i++) {
        c0 = vf_fma(c0, a, b), c1 = vf_fma(c1, a, b), c2 = vf_fma(c2, a, b), c3 = vf_fma(c3, a, b);
        c4 = vf_fma(c4, a, b), c5 = vf_fma(c5, a, b), c6 = vf_fma(c6, a, b), c7 = vf_fma(c7, a, b);
        c8 = vf_fma(c8, a, b), c9 = vf_fma(c9, a, b), c10 = vf_fma(c10, a, b), c11 = vf_fma(c11, a, b);
    }
    const vf x = vf_add(vf_add(vf_add(c0, c1), vf_add(c2, c3)), vf_add(vf_add(c4, c5), vf_add(c6, c7)));
    return vf_hsum(vf_add(x, vf_add(vf_add(c8, c9), vf_add(c10, c11))));
}

int main(int argc, char **argv) {
    const int64_t nc = 64, nr = argc > 1 ? atoi(argv[1]) : 4, D = argc > 4 ? atoi(argv[4]) : 128;
    const int64_t ld = argc > 2 ? atoi(argv[2]) : D, reps = argc > 3 ? atoi(argv[3]) : 100000;
    if (nr < 1 || nr > 16 || D < 16 || D % 16 || ld < D || reps < 1)
        return fprintf(stderr, "rows 1-16, D a multiple of 16, stride >= D, reps >= 1\n"), 2;
    float *q = malloc(sizeof(float) * 16 * D), *s = malloc(sizeof(float) * 16 * nc),
          *o = malloc(sizeof(float) * 16 * D);
    float *k = malloc(sizeof(float) * nc * ld);
    uint16_t *kb = malloc(sizeof(uint16_t) * nc * ld);
    int8_t *k8 = malloc((size_t)(nc * ld));
    int16_t *q16 = malloc(sizeof(int16_t) * 16 * D);
    float qs[16];
    for (int64_t i = 0; i < 16 * D; i++) q[i] = 0.01f * (float)(i % 7), o[i] = 0, q16[i] = (int16_t)(i % 2001 - 1000);
    for (int64_t i = 0; i < 16; i++) qs[i] = 1e-3f;
    for (int64_t i = 0; i < nc * ld; i++)
        k[i] = 0.001f * (float)(i % 13), kb[i] = ma_f32_to_bf16(k[i]), k8[i] = (int8_t)(i % 255 - 127);
    for (int64_t i = 0; i < 16 * nc; i++) s[i] = 0.001f;
    const int64_t fma_n = reps * nr * nc * D / (12 * MA_VL) + 1; /* about a kernel's FMAs */
    volatile float sink = 0;
    for (int t = 0; t < 3; t++) {
        const void *kv = t == 2 ? (const void *)k8 : t ? (const void *)kb : (const void *)k;
        const ma_dtype dt = t == 2 ? MA_I8 : t ? MA_BF16 : MA_F32;
        /* the best of many short runs of each, alternated (the machine is shared: interference
         * only ever slows a run) */
        double best[5] = {1e9, 1e9, 1e9, 1e9, 1e9}; /* seconds an FMA: the peak loop, the kernels */
        for (int x = 0; x < 21; x++) {
            double t0 = now();
            sink += fma_loop(fma_n);
            double e = (now() - t0) / (double)(fma_n * 12 * MA_VL);
            best[0] = e < best[0] ? e : best[0];
            for (int i = 1; i < 5; i++) {
                if ((i == 3 && t < 2 && !natural) || (i == 4 && t < 2)) continue;
                t0 = now();
                for (int64_t r = 0; r < reps; r++)
                    if (i == 1) dot_rows(s, nc, q, nr, D, kv, dt, 0, ld, nc, 0);
                    else if (i == 2) axpy_keys(o, s, nc, nr, D, kv, dt, 0, ld, nc, 0, NULL);
                    else if (i == 4) axpy_keys_i8(o, s, nc, nr, D, k8, 0, ld, nc, 0);
                    else if (t < 2) natural(s, nc, q, nr, D, kv, dt, 0, ld, nc, 0);
                    else dot_rows_i8(s, nc, q16, qs, nr, D, k8, 0, ld, nc, 0);
                e = (now() - t0) / (double)(reps * nr * nc * D);
                best[i] = e < best[i] ? e : best[i];
            }
        }
        const double peak = best[0],
                     share[4] = {best[0] / best[1], best[0] / best[2], best[0] / best[3], best[0] / best[4]};
        char third[16] = "-"; /* (no 4 x 3 prototype on AVX-512) */
        if (t == 2 || natural) snprintf(third, sizeof third, "%.0f", 100 * share[2]);
        printf("%s rows=%ld stride=%ld D=%ld, %% of the FMA peak (%.1f GFLOP/s): dot_rows %.0f, axpy_keys %.0f; "
               "%s %s",
               t == 2 ? "int8"
               : t    ? "bf16"
                      : "f32 ",
               (long)nr, (long)ld, (long)D, 2e-9 / peak, 100 * share[0], 100 * share[1],
               t == 2 ? "dot_rows_i8 (integer)" : "4 x 3 scores", third);
        if (t == 2) printf("; axpy_keys_i8 (integer) %.0f\n", 100 * share[3]);
        else printf("\n");
    }
    free(q), free(s), free(o), free(k), free(kb), free(k8), free(q16);
    return sink == 12345.f;
}
