/*
 * decode_blocks.c -- the decode kernel's products alone: dot_rows (scores from key rows) and
 * axpy_keys (P V from value rows) of the AVX2 instance over 64 keys in L1, D = Dv = 128, in
 * cycles per query head and key at the clock the FMA peak implies (argument 3, GHz), and their
 * share of the FMA peak (2 FMAs of 8 lanes a cycle). What a decode step costs where its cache is
 * in cache; docs/decoding-performance.md ("The products' own speed"). x86-64 with AVX2 only:
 *
 *   cc -std=c11 -O3 -mavx2 -mfma -mf16c -Icsrc -include csrc/common/glibc_compat.h \
 *      benchmarks/decode_blocks.c -lm -o /tmp/decode_blocks && /tmp/decode_blocks 4 128 2.94
 *
 * Arguments: query rows a key head (1-8), the key rows' stride in elements (128: one after
 * another; 1024: 8 key heads side by side), GHz, repetitions (200000).
 */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "common/simd_avx2.h"
#define BLK(name) name##_bench
#pragma GCC diagnostic ignored "-Wunused-function" /* the blocks this program does not time */
#include "attention/blocks_simd.h"

typedef void (*dot_fn)(float *, int64_t, const float *, int64_t, int64_t, const void *, ma_dtype, int64_t, int64_t,
                       int64_t, int64_t);
typedef void (*axpy_fn)(float *, const float *, int64_t, int64_t, int64_t, const void *, ma_dtype, int64_t, int64_t,
                        int64_t, int64_t);
/* called through pointers the compiler cannot see through, so that nothing is specialised */
static dot_fn volatile dot_rows = dot_rows_bench;
static axpy_fn volatile axpy_keys = axpy_keys_bench;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    const int64_t D = 128, nc = 64, reps = argc > 4 ? atoi(argv[4]) : 200000;
    const int64_t nr = argc > 1 ? atoi(argv[1]) : 4, ld = argc > 2 ? atoi(argv[2]) : D;
    const double ghz = argc > 3 ? atof(argv[3]) : 2.94;
    if (nr < 1 || nr > 8 || ld < D || reps < 1) return fprintf(stderr, "rows 1-8, stride >= 128, reps >= 1\n"), 2;
    float *q = malloc(sizeof(float) * 8 * D), *s = malloc(sizeof(float) * 8 * nc), *o = malloc(sizeof(float) * 8 * D);
    float *k = malloc(sizeof(float) * nc * ld);
    uint16_t *kb = malloc(sizeof(uint16_t) * nc * ld);
    for (int64_t i = 0; i < 8 * D; i++) q[i] = 0.01f * (float)(i % 7), o[i] = 0;
    for (int64_t i = 0; i < nc * ld; i++) k[i] = 0.001f * (float)(i % 13), kb[i] = ma_f32_to_bf16(k[i]);
    for (int64_t i = 0; i < 8 * nc; i++) s[i] = 0.001f;
    for (int t = 0; t < 2; t++) {
        const void *kv = t ? (const void *)kb : (const void *)k;
        const ma_dtype dt = t ? MA_BF16 : MA_F32;
        double best_s = 1e9, best_o = 1e9;
        for (int x = 0; x < 5; x++) {
            const double t0 = now();
            for (int64_t r = 0; r < reps; r++) dot_rows(s, nc, q, nr, D, kv, dt, 0, ld, nc, 0);
            const double t1 = now();
            for (int64_t r = 0; r < reps; r++) axpy_keys(o, s, nc, nr, D, kv, dt, 0, ld, nc, 0);
            const double t2 = now();
            best_s = t1 - t0 < best_s ? t1 - t0 : best_s;
            best_o = t2 - t1 < best_o ? t2 - t1 : best_o;
        }
        const double per = ghz * 1e9 / (double)(reps * nr * nc), peak = (double)D / 16; /* cycles at the peak */
        printf("%s rows=%ld stride=%ld: dot_rows %.1f cycles a query head and key (%.0f%% of the FMA peak), "
               "axpy_keys %.1f (%.0f%%)\n",
               t ? "bf16" : "f32 ", (long)nr, (long)ld, best_s * per, 100 * peak / (best_s * per), best_o * per,
               100 * peak / (best_o * per));
    }
    free(q), free(s), free(o), free(k), free(kb);
    return 0;
}
