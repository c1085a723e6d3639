/* Whether one core hides a decode step's products under its reads, and which prefetch does it:
 * the bound of the decode rows that read at 40-70% of the stream (docs/decoding-performance.md,
 * "What bounds the rows under 80%"). One thread (pin it: taskset), AVX2 + FMA, float32, the G = 4
 * query rows of one key head, D = 128, K and V of LK keys (2 x 32 MB: past L3), each pass after
 * a 96 MB flush. Every case is timed from memory and over NL2 keys again and again (in L2: the
 * products' own time), the cases alternated, ROUNDS rounds, each figure a median of the rounds'
 * best of REPS:
 *
 *   stream         K then V summed: the yardstick, in the same rounds;
 *   synth W ...    the stream with W FMAs on registers per 32 bytes read (W = 6 takes about the
 *                  decode's products' time in L2), no prefetch or one line per line read, 8 KB
 *                  on, into L1 (t0) or L2 (t1);
 *   synth q        4 FMAs per 32 bytes, each with a query vector loaded from L1, as the scores';
 *   decode ...     the library's products (csrc/attention/blocks_simd.h): the scores of a step
 *                  of 512 keys as 4 rows x 2 keys of one vector each, folded per key, then P V as
 *                  4 rows x 16 columns over runs of 8 value rows; the scores prefetch each key
 *                  line 8 KB on as they read it, P V each run's lines at its start ("burst") or
 *                  each line as it reads it ("spread").
 *
 * share = the stream's time for the bytes / the case's; "if hidden" = the stream's time over the
 * larger of the stream's and the products' (in L2) times, "if added" over their sum. Outputs go
 * to a sink; the products are not checked (the library's are, in its tests).
 *
 *   cc -std=c11 -O3 -mavx2 -mfma benchmarks/decode_overlap.c -o /tmp/decode_overlap
 *   taskset -c 1 /tmp/decode_overlap [ROUNDS=5] [REPS=3]
 *
 * Not part of the library; docs/decoding-performance.md quotes it. */
#define _POSIX_C_SOURCE 200809L
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define D 128
#define G 4
#define LK 65536 /* keys from memory */
#define NL2 256  /* keys in L2: 256 KB of K and V */
#define STEP 512 /* keys a softmax step (in L2: NL2) */
#define RUN 8    /* value rows a run of P V */
#define PF 8192  /* prefetch distance, bytes */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

enum { NONE, T0, T1 };
static inline void pf_line(const void *p, int hint) {
    if (hint == T0) _mm_prefetch((const char *)p, _MM_HINT_T0);
    else if (hint == T1) _mm_prefetch((const char *)p, _MM_HINT_T1);
}

static float q[G * D], o[G * D], s[G * STEP];

/* ---- the decode's products ---------------------------------------------------------------- */

/* s[r][c] = q_r . k_c, keys c0 .. c0 + n: 4 rows x 2 keys, one vector a score */
static void scores(const float *k, int64_t c0, int n, int hint) {
    for (int c = 0; c < n; c += 2) {
        const float *k0 = k + (c0 + c) * D, *k1 = k0 + D;
        __m256 a[8];
        for (int x = 0; x < 8; x++) a[x] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            if (d % 16 == 0) pf_line((const char *)(k0 + d) + PF, hint), pf_line((const char *)(k1 + d) + PF, hint);
            const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d);
            for (int r = 0; r < G; r++) {
                const __m256 qv = _mm256_loadu_ps(q + r * D + d);
                a[r] = _mm256_fmadd_ps(x0, qv, a[r]);
                a[G + r] = _mm256_fmadd_ps(x1, qv, a[G + r]);
            }
        }
        for (int r = 0; r < G; r++) s[r * STEP + c] = hsum(a[r]), s[r * STEP + c + 1] = hsum(a[G + r]);
    }
}

/* o[r] += sum_c s[r][c] v_c: runs of RUN keys inside a 4 x 16 tile of o; spread: each line
 * prefetched as read, else a run's lines at its start */
static void pv(const float *v, int64_t c0, int n, int hint, int spread) {
    for (int c1 = 0; c1 < n; c1 += RUN) {
        if (!spread)
            for (int c = c1; c < c1 + RUN; c++)
                for (int b = 0; b < D * 4; b += 64) pf_line((const char *)(v + (c0 + c) * D) + b + PF, hint);
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m256 a[8];
            for (int r = 0; r < G; r++)
                a[2 * r] = _mm256_loadu_ps(o + r * D + d0), a[2 * r + 1] = _mm256_loadu_ps(o + r * D + d0 + 8);
            for (int c = c1; c < c1 + RUN; c++) {
                const float *vc = v + (c0 + c) * D + d0;
                if (spread) pf_line((const char *)vc + PF, hint);
                const __m256 v0 = _mm256_loadu_ps(vc), v1 = _mm256_loadu_ps(vc + 8);
                for (int r = 0; r < G; r++) {
                    const __m256 pr = _mm256_broadcast_ss(s + r * STEP + c);
                    a[2 * r] = _mm256_fmadd_ps(pr, v0, a[2 * r]);
                    a[2 * r + 1] = _mm256_fmadd_ps(pr, v1, a[2 * r + 1]);
                }
            }
            for (int r = 0; r < G; r++)
                _mm256_storeu_ps(o + r * D + d0, a[2 * r]), _mm256_storeu_ps(o + r * D + d0 + 8, a[2 * r + 1]);
        }
    }
}

static float decode(const float *k, const float *v, int64_t n, int hint, int spread) {
    const int step = n < STEP ? (int)n : STEP;
    for (int64_t j = 0; j < n; j += step) {
        scores(k, j, step, hint);
        for (int x = 0; x < G * STEP; x++) s[x] *= 1e-3f; /* (the softmax's place) */
        pv(v, j, step, hint, spread);
    }
    return o[0];
}

/* ---- synthetic: a stream with FMAs on registers -------------------------------------------- */

#define SYNTH(W)                                                                                                    \
    static float synth##W(const float *a, int64_t n, int hint) {                                                    \
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, c[8];                                           \
        for (int x = 0; x < 8; x++) c[x] = _mm256_set1_ps(1.0f + (float)x);                                         \
        const __m256 m = _mm256_set1_ps(0.999f);                                                                    \
        for (int64_t i = 0; i < n; i += 32) {                                                                       \
            pf_line((const char *)(a + i) + PF, hint), pf_line((const char *)(a + i + 16) + PF, hint);              \
            const __m256 x0 = _mm256_loadu_ps(a + i), x1 = _mm256_loadu_ps(a + i + 8);                              \
            const __m256 x2 = _mm256_loadu_ps(a + i + 16), x3 = _mm256_loadu_ps(a + i + 24);                        \
            s0 = _mm256_add_ps(s0, x0), s1 = _mm256_add_ps(s1, x1), s2 = _mm256_add_ps(s2, x2);                     \
            s3 = _mm256_add_ps(s3, x3);                                                                             \
            _Pragma("GCC unroll 32") for (int x = 0; x < 4 * (W); x++) c[x & 7] = _mm256_fmadd_ps(c[x & 7], m, x0); \
        }                                                                                                           \
        for (int x = 0; x < 8; x++) s0 = _mm256_add_ps(s0, c[x]);                                                   \
        return hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));                                   \
    }
SYNTH(0)
SYNTH(6)

/* 4 FMAs per 32 bytes, each with its own query vector from L1 (the scores' loads) */
static float synth_q(const float *a, int64_t n, int hint) {
    __m256 c[8];
    for (int x = 0; x < 8; x++) c[x] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 32) {
        pf_line((const char *)(a + i) + PF, hint), pf_line((const char *)(a + i + 16) + PF, hint);
        const int64_t d = i % D;
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            const __m256 x = _mm256_loadu_ps(a + i + 8 * u);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
                c[(u & 1) * 4 + r] = _mm256_fmadd_ps(x, _mm256_loadu_ps(q + r * D + d + 8 * u), c[(u & 1) * 4 + r]);
        }
    }
    for (int x = 1; x < 8; x++) c[0] = _mm256_add_ps(c[0], c[x]);
    return hsum(c[0]);
}

/* ---- the cases ----------------------------------------------------------------------------- */

static float *K, *V;
static char *flush_buf;
static volatile float sink;

/* case x over keys 0 .. n of K and V */
enum { STREAM, SYN6, SYN6_T0, SYN6_T1, SYNQ_T0, DEC_BURST_T0, DEC_SPREAD_T0, DEC_SPREAD_T1, NCASES };
static const char *names[NCASES] = {"stream",
                                    "synth 6 FMAs / 32 B, no prefetch",
                                    "synth 6 FMAs / 32 B, prefetch t0",
                                    "synth 6 FMAs / 32 B, prefetch t1",
                                    "synth q, prefetch t0",
                                    "decode, P V burst, t0",
                                    "decode, P V spread, t0",
                                    "decode, P V spread, t1"};
static void run(int x, int64_t n) {
    const int64_t e = n * D;
    switch (x) {
    case STREAM: sink += synth0(K, e, NONE) + synth0(V, e, NONE); break;
    case SYN6: sink += synth6(K, e, NONE) + synth6(V, e, NONE); break;
    case SYN6_T0: sink += synth6(K, e, T0) + synth6(V, e, T0); break;
    case SYN6_T1: sink += synth6(K, e, T1) + synth6(V, e, T1); break;
    case SYNQ_T0: sink += synth_q(K, e, T0) + synth_q(V, e, T0); break;
    case DEC_BURST_T0: sink += decode(K, V, n, T0, 0); break;
    case DEC_SPREAD_T0: sink += decode(K, V, n, T0, 1); break;
    default: sink += decode(K, V, n, T1, 1); break;
    }
}

static double best_of(int reps, int x, int in_l2) {
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        for (size_t i = 0; i < (size_t)96 << 20; i += 64) flush_buf[i]++;
        if (in_l2) run(x, NL2); /* (warm) */
        const double t = now();
        if (in_l2)
            for (int i = 0; i < LK / NL2; i++) run(x, NL2);
        else run(x, LK);
        const double e = now() - t;
        if (e < best) best = e;
    }
    return best;
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 5, reps = argc > 2 ? atoi(argv[2]) : 3;
    if (rounds < 1 || rounds > 64 || reps < 1)
        return fprintf(stderr, "usage: decode_overlap [ROUNDS 1-64] [REPS]\n"), 2;
    K = aligned_alloc(64, (size_t)LK * D * 4), V = aligned_alloc(64, (size_t)LK * D * 4);
    flush_buf = calloc((size_t)96 << 20, 1);
    if (!K || !V || !flush_buf) return fprintf(stderr, "out of memory\n"), 1;
    for (int64_t i = 0; i < (int64_t)LK * D; i++) K[i] = (float)(i % 7) * 0.1f, V[i] = (float)(i % 5) * 0.1f;
    for (int i = 0; i < G * D; i++) q[i] = (float)(i % 3) * 0.01f;
    static double mem[NCASES][64], l2[NCASES][64];
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < NCASES; i++) {
            const int x = r % 2 ? NCASES - 1 - i : i;
            mem[x][r] = best_of(reps, x, 0), l2[x][r] = best_of(reps, x, 1);
        }
    for (int x = 0; x < NCASES; x++)
        qsort(mem[x], (size_t)rounds, sizeof(double), cmp), qsort(l2[x], (size_t)rounds, sizeof(double), cmp);
    const double ts = mem[STREAM][rounds / 2];
    printf("one thread, G = %d, D = %d, %d keys of K and V (%.0f MB), prefetch %d bytes on; medians of %d rounds\n", G,
           D, LK, 2.0 * LK * D * 4 / 1e6, PF, rounds);
    printf("%-36s %12s %10s %7s %10s %9s\n", "case", "memory ns/key", "L2 ns/key", "share", "if hidden", "if added");
    for (int x = 0; x < NCASES; x++) {
        const double tm = mem[x][rounds / 2], tl = l2[x][rounds / 2];
        printf("%-36s %12.1f %10.1f %6.0f%% %9.0f%% %8.0f%%\n", names[x], 1e9 * tm / LK, 1e9 * tl / LK, 100 * ts / tm,
               100 * ts / (ts > tl ? ts : tl), 100 * ts / (ts + tl));
    }
    return 0;
}
