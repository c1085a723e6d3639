/*
 * libm.c -- the few C math functions the kernels call, for the harness run
 * on an emulated CPU with no C library (tools/emulate/run.py). Double
 * precision throughout, good to about 1e-15 relative: far below what the
 * emulated runs are compared at. Not part of the library.
 */
#include <stdint.h>
#include <string.h>

static double from_bits(uint64_t u) {
    double x;
    memcpy(&x, &u, sizeof x);
    return x;
}
static uint64_t to_bits(double x) {
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

double nearbyint(double x) { /* round half to even, the default rounding mode */
    const double big = 4503599627370496.0; /* 2^52 */
    const double a = x < 0 ? -x : x;
    if (!(a < big)) return x; /* integral already, inf or NaN */
    volatile double t = a + big;
    double r = t - big;
    return x < 0 ? -r : r;
}

double exp(double x) {
    if (x != x) return x;
    if (x > 709.8) return from_bits(0x7ff0000000000000ull);
    if (x < -745.2) return 0.0;
    const double ln2 = 0.6931471805599453094172321;
    const double k = nearbyint(x / ln2);
    const double r = (x - k * 0.6931471803691238164901733) - k * 1.9082149292705877e-10; /* ln2 = hi + lo */
    double term = 1.0, sum = 1.0;
    for (int i = 1; i < 18; i++) {
        term *= r / i;
        sum += term;
    }
    int64_t e = (int64_t)k;
    while (e > 1000) sum *= from_bits((uint64_t)(1023 + 1000) << 52), e -= 1000;
    while (e < -1000) sum *= from_bits((uint64_t)(1023 - 1000) << 52), e += 1000;
    return sum * from_bits((uint64_t)(1023 + e) << 52);
}

double log(double x) {
    if (x != x || x < 0) return from_bits(0x7ff8000000000000ull);
    if (x == 0) return -from_bits(0x7ff0000000000000ull);
    if (x == from_bits(0x7ff0000000000000ull)) return x;
    int64_t ex = 0;
    if (x < 2.2250738585072014e-308) x *= 18446744073709551616.0, ex = -64; /* subnormal: times 2^64 */
    const uint64_t u = to_bits(x);
    ex += (int64_t)((u >> 52) & 0x7ff) - 1023;
    double m = from_bits((u & 0x000fffffffffffffull) | 0x3ff0000000000000ull); /* [1, 2) */
    if (m > 1.4142135623730951) m *= 0.5, ex += 1;
    const double s = (m - 1) / (m + 1), s2 = s * s;
    double term = s, sum = 0;
    for (int i = 1; i < 60; i += 2) {
        sum += term / i;
        term *= s2;
    }
    return 2 * sum + (double)ex * 0.6931471805599453094172321;
}

double tanh(double x) {
    if (x != x) return x;
    const double a = x < 0 ? -x : x;
    double t;
    if (a > 20) t = 1.0;
    else if (a < 1e-6) t = a;
    else {
        const double e = exp(-2 * a);
        t = (1 - e) / (1 + e);
    }
    return x < 0 ? -t : t;
}

float expf(float x) { return (float)exp(x); }
float logf(float x) { return (float)log(x); }
float tanhf(float x) { return (float)tanh(x); }
float fabsf(float x) { return x < 0 ? -x : x; }
/* one rounding, as C's: the emulated CPU's FMA instruction (it runs AVX-512) */
__attribute__((target("fma"))) float fmaf(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
