/* blocks_scalar.h -- the scalar building blocks (blocks.h): the reference
 * every SIMD variant is tested against, and the float64 instance's blocks.
 * Written once over the element type: included with T = float, X = scalar
 * and with T = double, X = f64 (scalar.c). Plain loops in the order the
 * contract states, nothing else. */
#include "philox.h"

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define B_(name) CAT(name, X)

static void B_(gemm)(int64_t m, int64_t n, int64_t k, const T *A, int64_t ars, int64_t acs, const T *B, int64_t ldb,
                     T *C, int64_t ldc, int accumulate) {
    for (int64_t i = 0; i < m; i++) {
        T *c_i = C + i * ldc;
        if (!accumulate)
            for (int64_t j = 0; j < n; j++) c_i[j] = 0;
        for (int64_t p = 0; p < k; p++) {
            const T a = A[i * ars + p * acs], *b_p = B + p * ldb;
            for (int64_t j = 0; j < n; j++) c_i[j] += a * b_p[j];
        }
    }
}

/* the rescaling as a pass of its own (rows whose factor is 1 left alone), then the product */
static void B_(gemm_rowscale)(int64_t m, int64_t n, int64_t k, const T *A, int64_t ars, int64_t acs, const T *B,
                              int64_t ldb, T *C, int64_t ldc, const T *rs) {
    if (rs)
        for (int64_t r = 0; r < m; r++)
            if (rs[r] != 1)
                for (int64_t d = 0; d < n; d++) C[r * ldc + d] *= rs[r];
    B_(gemm)(m, n, k, A, ars, acs, B, ldb, C, ldc, 1);
}

static T B_(exp_sub_sum)(T *x, int64_t n, T m) {
    T sum = 0;
    for (int64_t c = 0; c < n; c++) {
        x[c] = EXP(x[c] - m);
        sum += x[c];
    }
    return sum;
}

/* s[x] = cap tanh(s[x] inv) in place; th, when not NULL, keeps the tanh */
static void B_(softcap)(T *s, int64_t n, T cap, T inv, T *th) {
    for (int64_t x = 0; x < n; x++) {
        const T t = TANHT(s[x] * inv);
        if (th) th[x] = t;
        s[x] = cap * t;
    }
}

static void B_(col_max)(const T *x, int64_t rows, int64_t n, T *m) {
    for (int64_t c = 0; c < rows; c++)
        for (int64_t r = 0; r < n; r++)
            if (x[c * n + r] > m[r] || x[c * n + r] != x[c * n + r]) m[r] = x[c * n + r];
}

static void B_(exp_sub_col)(T *x, int64_t rows, int64_t n, const T *m, T *sum) {
    for (int64_t c = 0; c < rows; c++)
        for (int64_t r = 0; r < n; r++) {
            const T m_r = m[r] == -INFINITY ? 0 : m[r];
            x[c * n + r] = EXP(x[c * n + r] - m_r);
            sum[r] += x[c * n + r];
        }
}

static void B_(transpose)(T *dst, const T *src, int64_t lds, int64_t nr, int64_t ncol, T mul) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < ncol; c++) dst[c * nr + r] = mul * src[r * lds + c];
}

static T B_(row_max)(const T *x, int64_t n, T m) {
    for (int64_t c = 0; c < n; c++)
        if (x[c] > m || x[c] != x[c]) m = x[c];
    return m;
}

/* 16 partial sums (partial j: the terms d = j mod 16, in order), folded in halves */
static void B_(dot_rows)(T *s, int64_t lds, const T *q, int64_t nr, int64_t D, const void *k, ma_dtype dt, int64_t off,
                         int64_t ld, int64_t nc, int64_t pf) {
    (void)pf;
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++) {
            T p[16] = {0};
            for (int64_t d = 0; d < D; d++) p[d % 16] += q[r * D + d] * LOADT(k, dt, off + c * ld + d);
            for (int w = 16; w > 1; w /= 2)
                for (int t = 0; t < w / 2; t++) p[t] += p[t + w / 2];
            s[r * lds + c] = p[0];
        }
}

static void B_(dot_keys_t)(T *s, int64_t lds, const T *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                           int64_t off, int64_t ldd, int64_t nc, int64_t pf) {
    (void)pf;
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++) {
            T acc = 0;
            for (int64_t d = 0; d < D; d++) acc += q[r * D + d] * LOADT(k, dt, off + c + d * ldd);
            s[r * lds + c] = acc;
        }
}

static void B_(axpy_keys)(T *o, const T *p, int64_t ldp, int64_t nr, int64_t Dv, const void *v, ma_dtype dt,
                          int64_t off, int64_t ld, int64_t nc, int64_t pf, T *lsum) {
    (void)pf;
    if (lsum)
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < nc; c++) lsum[r] += p[r * ldp + c];
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++)
            for (int64_t d = 0; d < Dv; d++) o[r * Dv + d] += p[r * ldp + c] * LOADT(v, dt, off + c * ld + d);
}

#ifndef MA_DOT_ROWS_I8_SCALAR /* integers and float32 whatever T: defined once, by the float instance */
#define MA_DOT_ROWS_I8_SCALAR
/* the exact integer dot product, rounded once to float, times qs[r] (blocks.h) */
static void dot_rows_i8_scalar(float *s, int64_t lds, const int16_t *q, const float *qs, int64_t nr, int64_t D,
                               const int8_t *k, int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    (void)pf;
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++) {
            int32_t acc = 0;
            for (int64_t d = 0; d < D; d++) acc += (int32_t)q[r * D + d] * k[off + c * ld + d];
            s[r * lds + c] = (float)acc * qs[r];
        }
}

/* the 8-bit cache's P V in integers (blocks.h): per row and run of MA_PV_I8_RUN keys, p16 =
 * round(p 32767 / m), the exact sum, one fma; a run with inf or NaN (or 32767 / m past float) the
 * float product (one fma a key, in key order: the SIMD blocks' bits) after a sum of 0 */
static void axpy_keys_i8_scalar(float *o, const float *p, int64_t ldp, int64_t nr, int64_t Dv, const int8_t *v,
                                int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    (void)pf;
    for (int64_t c0 = 0; c0 < nc; c0 += 512)
        for (int64_t r = 0; r < nr; r++) {
            const int64_t n = nc - c0 < 512 ? nc - c0 : 512;
            const float *pr = p + r * ldp + c0;
            float m = 0;
            int bad = 0;
            for (int64_t c = 0; c < n; c++) {
                if (!isfinite(pr[c])) bad = 1;
                else if (fabsf(pr[c]) > m) m = fabsf(pr[c]);
            }
            const float inv = 32767.0f / m;
            bad |= m > 0 && !isfinite(inv);
            const int zero = bad || m == 0;
            const float ps = zero ? 0.0f : m / 32767.0f;
            for (int64_t d = 0; d < Dv; d++) {
                int32_t acc = 0;
                for (int64_t c = 0; c < n && !zero; c++)
                    acc += (int32_t)lrintf(pr[c] * inv) * v[off + (c0 + c) * ld + d];
                o[r * Dv + d] = fmaf((float)acc, ps, o[r * Dv + d]);
            }
            for (int64_t c = 0; c < n && bad; c++) /* (axpy_keys' one FMA a key, in key order) */
                for (int64_t d = 0; d < Dv; d++)
                    o[r * Dv + d] = fmaf(pr[c], (float)v[off + (c0 + c) * ld + d], o[r * Dv + d]);
        }
}
#endif

#ifndef MA_QUANTIZE_ROW_SCALAR /* float arithmetic whatever T: defined once, by the float instance */
#define MA_QUANTIZE_ROW_SCALAR
static void quantize_row_scalar(const void *x, ma_dtype dt, int64_t n, int8_t *q, float *scale) {
    float mx = 0;
    int finite = 1;
    for (int64_t c = 0; c < n; c++) {
        const float v = ma_load_f32(x, dt, c);
        if (!isfinite(v)) finite = 0;
        else if (fabsf(v) > mx) mx = fabsf(v);
    }
    *scale = finite ? mx / 127.0f : NAN;
    if (!finite || mx == 0) { /* scale NaN or 0: the row's values are 0 */
        memset(q, 0, (size_t)n);
        return;
    }
    const float inv = 127.0f / mx;
    for (int64_t c = 0; c < n; c++) {
        float y = ma_load_f32(x, dt, c) * inv;
        y = y < -127.0f ? -127.0f : y > 127.0f ? 127.0f : y;
        q[c] = (int8_t)rintf(y);
    }
}
#endif

/* Dropout of the elements (i0 + r, j0 + c), r < nr, c < nc, of one head
 * (philox.h): element (r, c) at [r * rs + c * cs], multiplier m = kept ?
 * scale : 0. z NULL: x = x * m in place (a dropped NaN stays NaN, as
 * P * Z / (1 - p) does); else z = m (x unused). One Philox call per 8 keys
 * of a row. */
static void B_(dropout)(T *x, T *z, int64_t rs, int64_t cs, int64_t nr, int64_t nc, const ma_dropout *d, int64_t i0,
                        int64_t j0) {
    const T scale = (T)d->scale;
    for (int64_t r = 0; r < nr; r++)
        for (int64_t g = j0 >> 3; g * 8 < j0 + nc; g++) {
            uint32_t ctr[4] = {(uint32_t)g, (uint32_t)(i0 + r), d->c2, d->c3};
            ma_philox4x32_10(ctr, d->k0, d->k1);
            for (int m = 0; m < 8; m++) {
                const int64_t c = g * 8 + m - j0;
                if (c < 0 || c >= nc) continue;
                const int keep = (int32_t)((ctr[m >> 1] >> (16 * (m & 1))) & 0xffffu) >= d->thr;
                const T mul = keep ? scale : 0;
                T *e = (z ? z : x) + r * rs + c * cs;
                *e = z ? mul : *e * mul;
            }
        }
}

#undef B_
#undef CAT
#undef CAT_
