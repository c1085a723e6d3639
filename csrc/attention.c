/*
 * attention.c -- masked multi-head attention, forward and backward.
 *
 * The kernels are written once in attention_tmpl.h and instantiated here for
 * float accumulation (float32, bfloat16, float16 inputs) and double
 * accumulation (float64 inputs). The public task functions below are the one
 * place where the variant is chosen.
 */
#define _GNU_SOURCE /* syscall() */
#include <math.h>

#include "dtype.h"
#include "masked_attn.h"
#include "attention_isa.h"

/* ---- the scalar building blocks (the reference for every SIMD variant) ----
 *
 * gemm:  C (m, n) = [C +] A (m, k) @ B (k, n); A[i, p] = A[i*ars + p*acs] (a
 *        transposed A costs nothing), B and C row-major. Overwrites C unless
 *        accumulate.
 * exp_sub_sum:  x[c] = exp(x[c] - m) in place; returns the sum.
 * col_max, exp_sub_col:  the same per column of a (rows, n) tile.
 */
static void gemm_scalar_f32(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs,
                            const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
    for (int64_t i = 0; i < m; i++) {
        float *c_i = C + i * ldc;
        if (!accumulate)
            for (int64_t j = 0; j < n; j++) c_i[j] = 0;
        for (int64_t p = 0; p < k; p++) {
            const float a = A[i * ars + p * acs], *b_p = B + p * ldb;
            for (int64_t j = 0; j < n; j++) c_i[j] += a * b_p[j];
        }
    }
}

static float exp_sub_sum_scalar_f32(float *x, int64_t n, float m) {
    float sum = 0;
    for (int64_t c = 0; c < n; c++) {
        x[c] = expf(x[c] - m);
        sum += x[c];
    }
    return sum;
}

/* m[r] = max(m[r], max_c x[c*n + r]), c < rows; a NaN anywhere makes m[r] NaN. */
static void col_max_scalar_f32(const float *x, int64_t rows, int64_t n, float *m) {
    for (int64_t c = 0; c < rows; c++)
        for (int64_t r = 0; r < n; r++)
            if (x[c * n + r] > m[r] || x[c * n + r] != x[c * n + r]) m[r] = x[c * n + r];
}

/* x[c*n + r] = exp(x[c*n + r] - m[r]) (m[r] = -inf counts as 0); sum[r] += it. */
static void exp_sub_col_scalar_f32(float *x, int64_t rows, int64_t n, const float *m, float *sum) {
    for (int64_t c = 0; c < rows; c++)
        for (int64_t r = 0; r < n; r++) {
            const float m_r = m[r] == -INFINITY ? 0.0f : m[r];
            x[c * n + r] = expf(x[c * n + r] - m_r);
            sum[r] += x[c * n + r];
        }
}

/* dst (ncol, nr) = mul * src (nr, ncol)^T, src rows lds apart. */
static void transpose_scalar_f32(float *dst, const float *src, int64_t lds, int64_t nr, int64_t ncol, float mul) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < ncol; c++) dst[c * nr + r] = mul * src[r * lds + c];
}

static void transpose_f64(double *dst, const double *src, int64_t lds, int64_t nr, int64_t ncol, double mul) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < ncol; c++) dst[c * nr + r] = mul * src[r * lds + c];
}

static void gemm_f64(int64_t m, int64_t n, int64_t k, const double *A, int64_t ars, int64_t acs,
                     const double *B, int64_t ldb, double *C, int64_t ldc, int accumulate) {
    for (int64_t i = 0; i < m; i++) {
        double *c_i = C + i * ldc;
        if (!accumulate)
            for (int64_t j = 0; j < n; j++) c_i[j] = 0;
        for (int64_t p = 0; p < k; p++) {
            const double a = A[i * ars + p * acs], *b_p = B + p * ldb;
            for (int64_t j = 0; j < n; j++) c_i[j] += a * b_p[j];
        }
    }
}

static double exp_sub_sum_f64(double *x, int64_t n, double m) {
    double sum = 0;
    for (int64_t c = 0; c < n; c++) {
        x[c] = exp(x[c] - m);
        sum += x[c];
    }
    return sum;
}

static void col_max_f64(const double *x, int64_t rows, int64_t n, double *m) {
    for (int64_t c = 0; c < rows; c++)
        for (int64_t r = 0; r < n; r++)
            if (x[c * n + r] > m[r] || x[c * n + r] != x[c * n + r]) m[r] = x[c * n + r];
}

static void exp_sub_col_f64(double *x, int64_t rows, int64_t n, const double *m, double *sum) {
    for (int64_t c = 0; c < rows; c++)
        for (int64_t r = 0; r < n; r++) {
            const double m_r = m[r] == -INFINITY ? 0.0 : m[r];
            x[c * n + r] = exp(x[c * n + r] - m_r);
            sum[r] += x[c * n + r];
        }
}

/* max(m, x[c] for c < n); a NaN anywhere (or m NaN) gives NaN. */
static float row_max_scalar_f32(const float *x, int64_t n, float m) {
    for (int64_t c = 0; c < n; c++)
        if (x[c] > m || x[c] != x[c]) m = x[c];
    return m;
}

/* s[r * lds + c] = sum_d q[r * D + d] k[off + c * ld + d] (k in its own dtype). */
static void dot_keys_scalar_f32(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k,
                                ma_dtype dt, int64_t off, int64_t ld, int64_t nc) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++) {
            float acc = 0;
            for (int64_t d = 0; d < D; d++) acc += q[r * D + d] * ma_load_f32(k, dt, off + c * ld + d);
            s[r * lds + c] = acc;
        }
}

/* o[r * Dv + d] += sum_c p[r * ldp + c] v[off + c * ld + d] (v in its own dtype). */
static void axpy_keys_scalar_f32(float *o, const float *p, int64_t ldp, int64_t nr, int64_t Dv, const void *v,
                                 ma_dtype dt, int64_t off, int64_t ld, int64_t nc) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++)
            for (int64_t d = 0; d < Dv; d++) o[r * Dv + d] += p[r * ldp + c] * ma_load_f32(v, dt, off + c * ld + d);
}

static double row_max_f64(const double *x, int64_t n, double m) {
    for (int64_t c = 0; c < n; c++)
        if (x[c] > m || x[c] != x[c]) m = x[c];
    return m;
}

static void dot_keys_f64(double *s, int64_t lds, const double *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                         int64_t off, int64_t ld, int64_t nc) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++) {
            double acc = 0;
            for (int64_t d = 0; d < D; d++) acc += q[r * D + d] * ma_load_f64(k, dt, off + c * ld + d);
            s[r * lds + c] = acc;
        }
}

static void axpy_keys_f64(double *o, const double *p, int64_t ldp, int64_t nr, int64_t Dv, const void *v, ma_dtype dt,
                          int64_t off, int64_t ld, int64_t nc) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++)
            for (int64_t d = 0; d < Dv; d++) o[r * Dv + d] += p[r * ldp + c] * ma_load_f64(v, dt, off + c * ld + d);
}

/* float accumulation, scalar: the reference */
#define ACC float
#define FN(name) name##_scalar
#define LOAD ma_load_f32
#define STORE ma_store_f32
#define LOG logf
#define GEMM gemm_scalar_f32
#define EXP_SUB_SUM exp_sub_sum_scalar_f32
#define COL_MAX col_max_scalar_f32
#define EXP_SUB_COL exp_sub_col_scalar_f32
#define TRANSPOSE transpose_scalar_f32
#define ROW_MAX row_max_scalar_f32
#define DOT_KEYS dot_keys_scalar_f32
#define AXPY_KEYS axpy_keys_scalar_f32
#include "attention_tmpl.h"
#include "undef_tmpl.h"

/* gemm_rowscale_scalar: attention_tmpl.h's rescaling pass, then the product */
const ma_blocks ma_blocks_scalar = {"scalar",           gemm_scalar_f32,     exp_sub_sum_scalar_f32,
                                    col_max_scalar_f32, exp_sub_col_scalar_f32, transpose_scalar_f32,
                                    row_max_scalar_f32, dot_keys_scalar_f32, axpy_keys_scalar_f32,
                                    gemm_rowscale_scalar};

/* double accumulation (float64 inputs) */
#define ACC double
#define FN(name) name##_f64
#define LOAD ma_load_f64
#define STORE ma_store_f64
#define LOG log
#define GEMM gemm_f64
#define EXP_SUB_SUM exp_sub_sum_f64
#define COL_MAX col_max_f64
#define EXP_SUB_COL exp_sub_col_f64
#define TRANSPOSE transpose_f64
#define ROW_MAX row_max_f64
#define DOT_KEYS dot_keys_f64
#define AXPY_KEYS axpy_keys_f64
#include "attention_tmpl.h"
#include "undef_tmpl.h"

/* ---- the one place where the variant is chosen ---------------------------- */

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
/* Linux hands out the AMX tile data state (8 KB per thread) only on request:
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once per process. */
static int amx_permitted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}
#else
static int amx_permitted(void) { return 0; }
#endif

int ma_isa_available(ma_isa isa) {
    switch (isa) {
    case MA_ISA_SCALAR: return 1;
#if defined(__x86_64__) || defined(__i386__)
    case MA_ISA_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case MA_ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    case MA_ISA_AMX:
        return ma_isa_available(MA_ISA_AVX512) && __builtin_cpu_supports("avx512bf16") &&
               __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted();
#endif
    default: return 0;
    }
}

/* AMX for bfloat16 and float16 only: float32 on tiles needs 6 bf16 products
 * per float product to keep float32's accuracy, and measured no faster than
 * the AVX-512 FMAs here (README, "How the kernels work"), with larger packs. */
ma_isa ma_isa_best(ma_dtype dt) {
    if ((dt == MA_BF16 || dt == MA_F16) && ma_isa_available(MA_ISA_AMX)) return MA_ISA_AMX;
    if (ma_isa_available(MA_ISA_AVX512)) return MA_ISA_AVX512;
    if (ma_isa_available(MA_ISA_AVX2)) return MA_ISA_AVX2;
    return MA_ISA_SCALAR;
}

#define DISPATCH(P, NAME, begin, end, ctx)                                               \
    do {                                                                                 \
        if ((P)->dtype == MA_F64) NAME##_f64(begin, end, ctx);                           \
        else if ((P)->isa == MA_ISA_AMX) ma_##NAME##_amx(begin, end, ctx);               \
        else if ((P)->isa == MA_ISA_AVX512) ma_##NAME##_avx512(begin, end, ctx);         \
        else if ((P)->isa == MA_ISA_AVX2) ma_##NAME##_avx2(begin, end, ctx);             \
        else NAME##_scalar(begin, end, ctx);                                             \
    } while (0)

int64_t ma_attn_fwd_work_items(const ma_attn_fwd_params *p) {
    return p->B * p->H * ma_cdiv(p->Lq, p->block_q);
}

size_t ma_attn_fwd_scratch_bytes(const ma_attn_fwd_params *p) {
    const size_t n = p->dtype == MA_F64 ? fwd_scratch_elems_f64(p) * sizeof(double)
                                        : fwd_scratch_elems_scalar(p) * sizeof(float);
    const size_t generic = ma_round_up(MA_CACHE_LINE + n, MA_CACHE_LINE);
    if (p->dtype != MA_F64 && p->isa == MA_ISA_AMX) {
        const size_t amx = ma_attn_fwd_scratch_bytes_amx(p);
        return amx > generic ? amx : generic;
    }
    return generic;
}

void ma_attn_fwd_task(int64_t begin, int64_t end, void *ctx) {
    const ma_attn_fwd_params *p = (const ma_attn_fwd_params *)((const ma_task_ctx *)ctx)->params;
    DISPATCH(p, attn_fwd, begin, end, ctx);
}

int64_t ma_attn_bwd_dq_work_items(const ma_attn_bwd_params *p) {
    return p->B * p->H * ma_cdiv(p->Lq, p->block_q);
}

int64_t ma_attn_bwd_dkdv_work_items(const ma_attn_bwd_params *p) {
    return p->B * p->Hkv * ma_cdiv(p->Lk, p->block_k);
}

size_t ma_attn_bwd_scratch_bytes(const ma_attn_bwd_params *p) {
    const int single = ma_attn_bwd_single_pass(p);
    const size_t n = p->dtype == MA_F64
                         ? (bwd_scratch_elems_f64(p->block_q, p->block_k, p->D, p->Dv) +
                            bwd_extra_elems_f64(p, single)) * sizeof(double)
                         : (bwd_scratch_elems_scalar(p->block_q, p->block_k, p->D, p->Dv) +
                            bwd_extra_elems_scalar(p, single)) * sizeof(float);
    const size_t generic = ma_round_up(MA_CACHE_LINE + n, MA_CACHE_LINE);
    if (p->dtype != MA_F64 && p->isa == MA_ISA_AMX && single) {
        const size_t amx = ma_attn_bwd_fused_scratch_bytes_amx(p);
        return amx > generic ? amx : generic;
    }
    return generic;
}

void ma_attn_bwd_dq_task(int64_t begin, int64_t end, void *ctx) {
    const ma_attn_bwd_params *p = (const ma_attn_bwd_params *)((const ma_task_ctx *)ctx)->params;
    DISPATCH(p, attn_bwd_dq, begin, end, ctx);
}

void ma_attn_bwd_fused_task(int64_t begin, int64_t end, void *ctx) {
    const ma_attn_bwd_params *p = (const ma_attn_bwd_params *)((const ma_task_ctx *)ctx)->params;
    DISPATCH(p, attn_bwd_fused, begin, end, ctx);
}

int ma_attn_bwd_single_pass(const ma_attn_bwd_params *p) { return p->dweights == NULL; }

/* Enough (b, hkv, chunk) items for 8 threads, never more chunks than key blocks. */
int64_t ma_attn_bwd_kv_chunks(const ma_attn_bwd_params *p) {
    const int64_t items = p->B * p->Hkv, nk = ma_cdiv(p->Lk, p->block_k);
    if (items <= 0 || nk <= 1 || items >= 8) return 1;
    const int64_t c = ma_cdiv(8, items);
    return c < nk ? c : nk;
}

int64_t ma_attn_bwd_fused_work_items(const ma_attn_bwd_params *p) { return p->B * p->Hkv * p->kv_chunks; }

int64_t ma_attn_bwd_reduce_work_items(const ma_attn_bwd_params *p) {
    return p->B * p->H * ma_cdiv(p->Lq, p->block_q);
}

void ma_attn_bwd_reduce_task(int64_t begin, int64_t end, void *ctx) {
    const ma_attn_bwd_params *p = (const ma_attn_bwd_params *)((const ma_task_ctx *)ctx)->params;
    if (p->dtype == MA_F64) attn_bwd_reduce_f64(begin, end, ctx);
    else attn_bwd_reduce_scalar(begin, end, ctx);
}

void ma_attn_bwd_dkdv_task(int64_t begin, int64_t end, void *ctx) {
    const ma_attn_bwd_params *p = (const ma_attn_bwd_params *)((const ma_task_ctx *)ctx)->params;
    DISPATCH(p, attn_bwd_dkdv, begin, end, ctx);
}
