/* harness.h -- what the C harnesses share: a failure counter with a CHECK
 * that reports the first failures, and a small deterministic RNG. Each
 * harness is one program; include this once. */
#ifndef MA_TEST_HARNESS_H
#define MA_TEST_HARNESS_H

#include <stdio.h>

static int failures = 0;

#define CHECK(cond, ...)                                             \
    do {                                                             \
        if (!(cond)) {                                               \
            if (failures++ < 30) {                                   \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                        \
                fprintf(stderr, "\n");                               \
            }                                                        \
        }                                                            \
    } while (0)

static unsigned rng = 12345u;
static float frand(void) { /* uniform in [-1, 1) */
    rng = rng * 1664525u + 1013904223u;
    return (float)(rng >> 8) / (float)(1u << 23) - 1.0f;
}

#endif /* MA_TEST_HARNESS_H */
