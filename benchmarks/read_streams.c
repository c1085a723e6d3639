/* How fast a core reads memory in order, by the number of places it reads at once: the
 * decode kernel reads each key head's K and V rows in order, one stream at a time, where
 * torch.sum (the roofline's yardstick in benchmarks/decode.py) reads several. Each thread
 * reads its own buffer of MB megabytes split into S equal streams, ROW bytes of each in turn
 * (ROW = 512: a float32 key row of D = 128), every row prefetched PF bytes ahead (0: none).
 * Prints GB/s over all threads for S = 1, 2, 4, 8, best of REPS passes.
 *
 *   cc -O2 -mavx2 read_streams.c -o read_streams -lpthread
 *   ./read_streams THREADS [MB=256] [PF=0] [REPS=5]
 *
 * Not part of the library; docs/decoding-performance.md ("What bounds the rows under 80%") quotes it. */
#define _POSIX_C_SOURCE 200809L
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ROW 512
#define MAX_THREADS 64

typedef struct {
    const float *buf;
    long bytes, pf;
    int streams;
    float sink;
} job;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *reader(void *arg) {
    job *j = arg;
    const long per = j->bytes / j->streams / ROW * ROW; /* each stream's bytes */
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long at = 0; at < per; at += ROW)
        for (int s = 0; s < j->streams; s++) {
            const char *row = (const char *)j->buf + s * per + at;
            if (j->pf)
                for (int b = 0; b < ROW; b += 64) _mm_prefetch(row + j->pf + b, _MM_HINT_T0);
            for (int b = 0; b < ROW; b += 64) {
                acc[0] = _mm256_add_ps(acc[0], _mm256_loadu_ps((const float *)(row + b)));
                acc[1] = _mm256_add_ps(acc[1], _mm256_loadu_ps((const float *)(row + b + 32)));
            }
        }
    acc[0] = _mm256_add_ps(acc[0], acc[1]);
    j->sink = _mm256_cvtss_f32(acc[0]);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s THREADS [MB=256] [PF=0] [REPS=5]\n", argv[0]);
        return 2;
    }
    const int nt = atoi(argv[1]);
    const long bytes = (argc > 2 ? atol(argv[2]) : 256) << 20;
    const long pf = argc > 3 ? atol(argv[3]) : 0;
    const int reps = argc > 4 ? atoi(argv[4]) : 5;
    if (nt < 1 || nt > MAX_THREADS || bytes < (8L << 20) || pf < 0 || reps < 1) {
        fprintf(stderr, "THREADS: 1 .. %d; MB: at least 8; PF: at least 0; REPS: at least 1\n", MAX_THREADS);
        return 2;
    }
    static job jobs[MAX_THREADS];
    for (int t = 0; t < nt; t++) {
        float *buf = aligned_alloc(4096, (size_t)(bytes + pf + ROW));
        if (!buf) return 1;
        for (long i = 0; i < (bytes + pf + ROW) / 4; i++) buf[i] = 1.0f;
        jobs[t] = (job){buf, bytes, pf, 1, 0.0f};
    }
    printf("{\"threads\": %d, \"mb_per_thread\": %ld, \"pf\": %ld, \"gbs\": {", nt, bytes >> 20, pf);
    for (int streams = 1; streams <= 8; streams *= 2) {
        double best = 1e30;
        for (int r = 0; r < reps; r++) {
            pthread_t th[MAX_THREADS];
            for (int t = 0; t < nt; t++) jobs[t].streams = streams;
            const double t0 = now();
            for (int t = 0; t < nt; t++) pthread_create(&th[t], NULL, reader, &jobs[t]);
            for (int t = 0; t < nt; t++) pthread_join(th[t], NULL);
            const double dt = now() - t0;
            if (dt < best) best = dt;
        }
        printf("%s\"%d\": %.1f", streams > 1 ? ", " : "", streams, (double)nt * (double)bytes / best / 1e9);
    }
    printf("}}\n");
    return 0;
}
