/* Float32 FMA peak of this machine: NACC independent chains of vector FMAs
 * per thread (enough to cover FMA latency x FMA ports), no memory traffic.
 * Built with -DBF16_DP -mavx512bf16, the bfloat16 peak instead: the same
 * chains of VDPBF16PS, 32 bf16 products with float32 accumulation per
 * instruction (64 flops), the yardstick of the avx512bf16 variant.
 *
 *   cc -O2 -mavx512f -mfma fma_peak.c -o fma_peak -lpthread   (or -mavx2 -mfma)
 *   cc -O2 -mavx512f -mavx512bf16 -DBF16_DP fma_peak.c -o bf16_peak -lpthread
 *   ./fma_peak THREADS SECONDS  ->  {"isa": ..., "threads": T, "gflops": G}
 *
 * Built and run by benchmarks/run.py; not part of the library.
 */
#define _POSIX_C_SOURCE 200809L
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#if defined(BF16_DP)
typedef __m512 vec;
typedef __m512bh opnd;
#define ISA "avx512bf16"
#define WIDTH 32                  /* multiply-adds per instruction: 16 lanes x a pair */
#define NACC 24
#define SET1 _mm512_set1_ps
#define SET1OP(x) ((opnd)_mm512_set1_epi16((short)0x3f80)) /* bf16 1.0 */
#define FMA(c, a, b) _mm512_dpbf16_ps(c, a, b)
#define ADD _mm512_add_ps
#define STORE _mm512_storeu_ps
#elif defined(__AVX512F__)
typedef __m512 vec;
typedef __m512 opnd;
#define ISA "avx512f"
#define WIDTH 16
#define NACC 24                   /* 32 zmm registers: 24 accumulators + 2 constants */
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define STORE _mm512_storeu_ps
#else
typedef __m256 vec;
typedef __m256 opnd;
#define ISA "avx2"
#define WIDTH 8
#define NACC 12                   /* 16 ymm registers: 12 accumulators + 2 constants */
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define STORE _mm256_storeu_ps
#endif
#ifndef SET1OP
#define SET1OP SET1
#endif

static volatile float g_a = 0.999999f, g_b = 1e-6f; /* not compile-time constants */
static long g_iters;
static double g_sink[256];

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* Explicit register variables, in groups of 4 chains with distinct starting
 * values (with an array, or equal starts, the compiler keeps the chains in
 * memory or merges them). */
#define DECL4(p, o) vec p##0 = SET1(o + 0.001f), p##1 = SET1(o + 0.002f), \
    p##2 = SET1(o + 0.003f), p##3 = SET1(o + 0.004f)
#define STEP4(p) p##0 = FMA(p##0, a, b); p##1 = FMA(p##1, a, b); \
    p##2 = FMA(p##2, a, b); p##3 = FMA(p##3, a, b)
#define SUM4(p) ADD(ADD(p##0, p##1), ADD(p##2, p##3))

static void *run(void *arg) {
    long tid = (long)arg;
    opnd a = SET1OP(g_a), b = SET1OP(g_b);
    DECL4(c, 0.1f); DECL4(d, 0.2f); DECL4(e, 0.3f);
#if NACC == 24
    DECL4(f, 0.4f); DECL4(g, 0.5f); DECL4(h, 0.6f);
#endif
    for (long i = 0; i < g_iters; i++) {
        STEP4(c); STEP4(d); STEP4(e);
#if NACC == 24
        STEP4(f); STEP4(g); STEP4(h);
#endif
    }
    vec s = ADD(ADD(SUM4(c), SUM4(d)), SUM4(e));
#if NACC == 24
    s = ADD(s, ADD(ADD(SUM4(f), SUM4(g)), SUM4(h)));
#endif
    float out[WIDTH];
    STORE(out, s);
    g_sink[tid & 255] = out[0];
    return NULL;
}

static double timed(int threads) {
    pthread_t th[256];
    double t0 = now();
    for (long t = 0; t < threads; t++) pthread_create(&th[t], NULL, run, (void *)t);
    for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    return now() - t0;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    double seconds = argc > 2 ? atof(argv[2]) : 0.5;
    if (threads < 1 || threads > 256) threads = 1;
    g_iters = 1000000;
    double t = timed(1); /* calibrate on one thread */
    g_iters = (long)(g_iters * seconds / (t > 1e-6 ? t : 1e-6)) + 1;
    double best = 0.0;
    for (int rep = 0; rep < 7; rep++) { /* best of 7: the machine may be shared */
        double dt = timed(threads);
        double gflops = 2.0 * NACC * WIDTH * (double)g_iters * threads / dt * 1e-9;
        if (gflops > best) best = gflops;
    }
    printf("{\"isa\": \"%s\", \"threads\": %d, \"gflops\": %.2f, \"sink\": %g}\n", ISA, threads, best,
           g_sink[0]);
    return 0;
}
