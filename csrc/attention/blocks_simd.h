/*
 * blocks_simd.h -- the attention building blocks (blocks.h) written once over
 * the SIMD vocabulary (common/simd.h). The including file has included one
 * instruction set's mapping (common/simd_X.h) and defined BLK(name), the
 * blocks' names (name_X). Shapes that differ between instruction sets are
 * the mapping's constants (MA_VL, MA_GEMM_*, MA_KT_NV, MA_AXPY_*), so each
 * keeps its register blocking.
 *
 * Every element of a product is computed the same way in every block and on
 * every instruction set: c = 0 (or C, or rs[r] * C rounded once), then
 * c = fma(a_p, b_p, c) for p = 0, 1, ... in order, one FMA per p in one lane.
 * So results never depend on the block shape or where a tile is split, and
 * dot_keys_t and axpy_keys are bit for bit the GEMM's
 * (tests/c/test_blocks.c).
 */
#ifndef MA_ATTENTION_BLOCKS_SIMD_H
#define MA_ATTENTION_BLOCKS_SIMD_H

#include <math.h>
#include <string.h>

#include "blocks.h"
#include "common/dtype.h"
#include "masked_attn.h"
#include "philox.h"

#define MA_INLINE static inline __attribute__((always_inline))

/* A vector at x: whole (full), or the lanes of k (the rest read as 0, never written). */
MA_INLINE vf load_k(const int full, const float *x, vm k) { return full ? vf_load(x) : vf_load_m(x, k); }
MA_INLINE void store_k(const int full, float *x, vm k, vf v) {
    if (full) vf_store(x, v);
    else vf_store_m(x, k, v);
}

/* The decoding rows' prefetch, pf_bytes ahead: far (a key block on, a head alone) into L2
 * only, near (the next head's part of the same rows, in a run of heads) into L1. A prefetch
 * into L1 holds one of the core's few fill buffers until its line arrives from memory, which
 * capped bfloat16 decoding of one head at 63% of the bandwidth (75% into L2); a near one is
 * needed in L1 soon and its line is usually on its way already. */
#define MA_PREFETCH_FAR 4096
MA_INLINE void prefetch_ahead(const void *p, int64_t pf_bytes) {
    if (pf_bytes >= MA_PREFETCH_FAR) ma_prefetch_l2(p);
    else ma_prefetch(p);
}

/* ---- GEMM: register-blocked micro-kernels, B read in place, A through its strides by
 * broadcasts. C[0:MR, 0:NV VL] (+)= A[0:MR, 0:k] @ B[0:k, 0:NV VL]; masked: only columns < nr
 * are read and written. MR, NV, masked are constants after inlining, so the accumulators stay
 * in registers (MR <= 8, NV <= 4). With accumulate and rs, row r of C is first multiplied by
 * rs[r] (rounded once, as a separate pass would store it). */
MA_INLINE void ukernel(const int MR, const int NV, const int masked, int64_t nr, int64_t k, const float *A, int64_t ars,
                       int64_t acs, const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate,
                       const float *rs) {
    vm mk[4];
    vf c[8][4];
    for (int v = 0; v < NV; v++) mk[v] = vm_first(masked ? nr - MA_VL * v : MA_VL);
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++)
            c[r][v] = !accumulate ? vf_zero() : load_k(!masked, C + r * ldc + MA_VL * v, mk[v]);
    if (accumulate && rs)
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < NV; v++) c[r][v] = vf_mul(c[r][v], vf_set1(rs[r]));
#pragma GCC unroll 2 /* two steps in flight: hides the load latency of B rows far apart */
    for (int64_t p = 0; p < k; p++) {
        const float *Ap = A + p * acs, *Bp = B + p * ldb;
        vf b[4];
        for (int v = 0; v < NV; v++) b[v] = load_k(!masked, Bp + MA_VL * v, mk[v]);
        for (int r = 0; r < MR; r++) {
            const vf a = vf_set1(Ap[r * ars]);
            for (int v = 0; v < NV; v++) c[r][v] = vf_fma(a, b[v], c[r][v]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) store_k(!masked, C + r * ldc + MA_VL * v, mk[v], c[r][v]);
}

/* One column panel C[0:m, 0:NV VL]: blocks of MR rows, then the m % MR rows in one block. */
MA_INLINE void gemm_panel(const int MR, const int NV, const int masked, int64_t m, int64_t nr, int64_t k,
                          const float *A, int64_t ars, int64_t acs, const float *B, int64_t ldb, float *C, int64_t ldc,
                          int accumulate, const float *rs) {
#define MA_BLOCK(R) \
    ukernel(R, NV, masked, nr, k, A + i * ars, ars, acs, B, ldb, C + i * ldc, ldc, accumulate, rs ? rs + i : NULL)
    int64_t i = 0;
    for (; i + MR <= m; i += MR) MA_BLOCK(MR);
    switch (m - i) { /* MR > R: no block of R rows where MR rows are the most */
    case 7:
        if (MR > 7) MA_BLOCK(7);
        break;
    case 6:
        if (MR > 6) MA_BLOCK(6);
        break;
    case 5: MA_BLOCK(5); break;
    case 4: MA_BLOCK(4); break;
    case 3: MA_BLOCK(3); break;
    case 2: MA_BLOCK(2); break;
    case 1: MA_BLOCK(1); break;
    default: break;
    }
#undef MA_BLOCK
}

/* Rows of B that lie a multiple of 512 bytes apart (D = 128 floats, or rows
 * H * D apart) map to 8 of L1's 64 sets: a k = 64 panel's 64 lines then fill
 * them and evict each other between the row blocks that reuse the panel.
 * With MA_GEMM_PACK such panels (full, k <= MA_PACK_K) are copied to a
 * contiguous buffer on the stack first when more than one row block reads
 * them; the FMAs and their order are unchanged. */
#define MA_PACK_K 256
#define MA_PANEL (MA_GEMM_NV * MA_VL)

/* C (m, n) = [diag(rs) C +] A (m, k) @ B (k, n); A[i, p] = A[i*ars + p*acs]; rs only with
 * accumulate. Full panels of MA_PANEL columns, then whole tail panels, then the last columns:
 * more than one vector's worth in a masked tail panel, else one vector (masked unless whole). */
MA_INLINE void gemm_rs(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                       int64_t ldb, float *C, int64_t ldc, int accumulate, const float *rs) {
    int64_t j = 0;
    if (MA_GEMM_PACK && m > MA_GEMM_MR && k <= MA_PACK_K && ldb % 128 == 0) { /* see MA_PACK_K */
        _Alignas(64) float pk[MA_PACK_K * MA_PANEL];
        for (; j + MA_PANEL <= n; j += MA_PANEL) {
            for (int64_t p = 0; p < k; p++)
                for (int v = 0; v < MA_GEMM_NV; v++)
                    vf_store(pk + p * MA_PANEL + MA_VL * v, vf_load(B + p * ldb + j + MA_VL * v));
            gemm_panel(MA_GEMM_MR, MA_GEMM_NV, 0, m, MA_PANEL, k, A, ars, acs, pk, MA_PANEL, C + j, ldc, accumulate,
                       rs);
        }
    }
    for (; j + MA_PANEL <= n; j += MA_PANEL)
        gemm_panel(MA_GEMM_MR, MA_GEMM_NV, 0, m, MA_PANEL, k, A, ars, acs, B + j, ldb, C + j, ldc, accumulate, rs);
    const int64_t tail = MA_GEMM_TAIL_NV * MA_VL;
    for (; j + tail <= n; j += tail)
        gemm_panel(MA_GEMM_TAIL_MR, MA_GEMM_TAIL_NV, 0, m, tail, k, A, ars, acs, B + j, ldb, C + j, ldc, accumulate,
                   rs);
    const int64_t nr = n - j;
    if (nr > MA_VL)
        gemm_panel(MA_GEMM_TAIL_MR, MA_GEMM_TAIL_NV, 1, m, nr, k, A, ars, acs, B + j, ldb, C + j, ldc, accumulate, rs);
    else if (nr == MA_VL)
        gemm_panel(MA_GEMM_TAIL_MR, 1, 0, m, nr, k, A, ars, acs, B + j, ldb, C + j, ldc, accumulate, rs);
    else if (nr > 0) gemm_panel(MA_GEMM_TAIL_MR, 1, 1, m, nr, k, A, ars, acs, B + j, ldb, C + j, ldc, accumulate, rs);
}

static void BLK(gemm)(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                      int64_t ldb, float *C, int64_t ldc, int accumulate) {
    gemm_rs(m, n, k, A, ars, acs, B, ldb, C, ldc, accumulate, NULL);
}

/* the online softmax's rescaling of O folded into the product that accumulates into it */
static void BLK(gemm_rowscale)(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs,
                               const float *B, int64_t ldb, float *C, int64_t ldc, const float *rs) {
    gemm_rs(m, n, k, A, ars, acs, B, ldb, C, ldc, 1, rs);
}

/* ---- rows and columns of scores ------------------------------------------ */

static float BLK(exp_sub_sum)(float *x, int64_t n, float m) {
    const vf mv = vf_set1(m);
    vf acc = vf_zero();
    int64_t c = 0;
    for (; c + MA_VL <= n; c += MA_VL) {
        const vf e = vf_exp(vf_sub(vf_load(x + c), mv));
        vf_store(x + c, e);
        acc = vf_add(acc, e);
    }
    if (c < n) {
        const vm k = vm_first(n - c);
        const vf e = vf_maskz(k, vf_exp(vf_sub(vf_load_m(x + c, k), mv))); /* lanes past n add nothing */
        vf_store_m(x + c, k, e);
        acc = vf_add(acc, e);
    }
    return vf_hsum(acc);
}

static void BLK(softcap)(float *s, int64_t n, float cap, float inv, float *th) {
    const vf cv = vf_set1(cap), iv = vf_set1(inv);
    for (int64_t x = 0; x < n; x += MA_VL) {
        const int full = x + MA_VL <= n;
        const vm k = vm_first(n - x);
        const vf t = vf_tanh(vf_mul(load_k(full, s + x, k), iv));
        if (th) store_k(full, th + x, k, t);
        store_k(full, s + x, k, vf_mul(cv, t));
    }
}

/* One strip of VL columns of col_max: four running maxima (rows c .. c + 3), so the vmaxps
 * chain does not serialise the column; NaN sticks (vmaxps alone would drop it). */
MA_INLINE void col_max_strip(const int full, const float *x, int64_t rows, int64_t n, float *m, vm k) {
    vf mv[4];
    mv[0] = load_k(full, m, k);
    mv[1] = mv[2] = mv[3] = mv[0];
    vm nan = vf_isnan(mv[0]);
    int64_t c = 0;
    for (; c + 4 <= rows; c += 4)
        for (int u = 0; u < 4; u++) {
            const vf xv = load_k(full, x + (c + u) * n, k);
            nan = vm_or(nan, vf_isnan(xv));
            mv[u] = vf_max(xv, mv[u]);
        }
    for (; c < rows; c++) {
        const vf xv = load_k(full, x + c * n, k);
        nan = vm_or(nan, vf_isnan(xv));
        mv[0] = vf_max(xv, mv[0]);
    }
    const vf mx = vf_max(vf_max(mv[0], mv[1]), vf_max(mv[2], mv[3]));
    store_k(full, m, k, vf_blend(nan, mx, vf_set1(NAN)));
}

static void BLK(col_max)(const float *x, int64_t rows, int64_t n, float *m) {
    int64_t r = 0;
    for (; r + MA_VL <= n; r += MA_VL) col_max_strip(1, x + r, rows, n, m + r, vm_first(MA_VL));
    if (r < n) col_max_strip(0, x + r, rows, n, m + r, vm_first(n - r));
}

MA_INLINE void exp_sub_col_strip(const int full, float *x, int64_t rows, int64_t n, const float *m, float *sum, vm k) {
    vf mv = load_k(full, m, k);
    mv = vf_blend(vf_eq(mv, vf_set1(-INFINITY)), mv, vf_zero());
    vf acc = load_k(full, sum, k);
    for (int64_t c = 0; c < rows; c++) {
        const vf e = vf_exp(vf_sub(load_k(full, x + c * n, k), mv));
        store_k(full, x + c * n, k, e);
        acc = vf_add(acc, e);
    }
    store_k(full, sum, k, acc);
}

static void BLK(exp_sub_col)(float *x, int64_t rows, int64_t n, const float *m, float *sum) {
    int64_t r = 0;
    for (; r + MA_VL <= n; r += MA_VL) exp_sub_col_strip(1, x + r, rows, n, m + r, sum + r, vm_first(MA_VL));
    if (r < n) exp_sub_col_strip(0, x + r, rows, n, m + r, sum + r, vm_first(n - r));
}

/* VL x VL blocks transposed in registers; edge blocks masked (MA_MASKED_EDGES) or
 * elementwise. Each element is the one rounding of mul * x either way. */
static void BLK(transpose)(float *dst, const float *src, int64_t lds, int64_t nr, int64_t ncol, float mul) {
    const vf mv = vf_set1(mul);
    for (int64_t r0 = 0; r0 < nr; r0 += MA_VL) {
        const int64_t rn = ma_min(MA_VL, nr - r0);
        for (int64_t c0 = 0; c0 < ncol; c0 += MA_VL) {
            const int64_t cn = ma_min(MA_VL, ncol - c0);
            const int whole = rn == MA_VL && cn == MA_VL;
            if (whole || MA_MASKED_EDGES) {
                const vm cmask = vm_first(cn), rmask = vm_first(rn);
                vf x[MA_VL];
                for (int i = 0; i < MA_VL; i++)
                    x[i] = i < rn ? vf_mul(mv, load_k(whole, src + (r0 + i) * lds + c0, cmask)) : vf_zero();
                vf_transpose(x); /* x[j] lane i = src[r0 + i][c0 + j] */
                for (int j = 0; j < cn; j++) store_k(whole, dst + (c0 + j) * nr + r0, rmask, x[j]);
            } else {
                for (int64_t r = r0; r < r0 + rn; r++)
                    for (int64_t c = c0; c < c0 + cn; c++) dst[c * nr + r] = mul * src[r * lds + c];
            }
        }
    }
}

static float BLK(row_max)(const float *x, int64_t n, float m) {
    vf mx = vf_set1(m);
    vm nan = vf_isnan(mx);
    int64_t c = 0;
    for (; c + MA_VL <= n; c += MA_VL) {
        const vf xv = vf_load(x + c);
        nan = vm_or(nan, vf_isnan(xv));
        mx = vf_max(xv, mx);
    }
    if (c < n) {
        const vm k = vm_first(n - c);
        const vf xv = vf_blend(k, vf_set1(-INFINITY), vf_load_m(x + c, k));
        nan = vm_or(nan, vf_isnan(xv));
        mx = vf_max(xv, mx);
    }
    return vm_any(nan) ? NAN : vf_hmax(mx, m);
}

/* ---- keys and values in their own dtype ----------------------------------- */

/* The decoding rows' second prefetch: MA_PREFETCH_L2_AHEAD bytes on, into L2, beside the one
 * pf_bytes on. The near one (1 KB, into L1) keeps few lines in flight: where the products take a
 * fraction of the reads' time (float32, one query head a key head) or stop reading for a while
 * (the second pass of 8 query heads' rows), the memory idles between them. On Zen 3 the far one
 * took float32 decoding 1.03-1.19x faster (2 KB: slower than 4 KB and 8 KB), bfloat16 and int8
 * 0.99-1.05x (docs/decoding-performance.md). */
#define MA_PREFETCH_L2_AHEAD 8192

/* Prefetches every line of n bytes at p + pf_bytes (a vector of SVE from 1024 bits is longer than a
 * line), and into L2 the line MA_PREFETCH_L2_AHEAD on where pf_bytes is nearer. */
MA_INLINE void prefetch_lines(const char *p, int64_t n, int64_t pf_bytes) {
    for (int64_t b = 0; b < n; b += MA_CACHE_LINE) {
        prefetch_ahead(p + pf_bytes + b, pf_bytes);
        if (pf_bytes < MA_PREFETCH_L2_AHEAD) ma_prefetch_l2(p + MA_PREFETCH_L2_AHEAD + b);
    }
}

/* ---- dot_rows: scores from key rows read in order ------------------------------------------
 *
 * s[r * lds + c] = q_r . k_c as MA_DR_W partial sums (one vector a score: the ISA's natural
 * order, VL lanes up to 16), partial j the terms d = j (mod MA_DR_W) in order from d = 0 (one
 * FMA each), folded in halves: p_j + p_(j + W/2), then + W/4, ..., + 1 (blocks.h). Each key row
 * is read once, in order, a vector of D at a time: the decoding's stream (the keys-in-lanes
 * order of the GEMM reads VL rows a vector each, which the hardware prefetchers do not follow:
 * 3.8 GB/s of K on one Zen 3 core against 10 in order). A register tile of RP rows x KI keys
 * (RP KI accumulators, MA_DR_CHAINS at most: the mapping's constant, as MA_DR_ROWS) takes D a
 * vector at a time, each key and q vector loaded once into a register for its FMAs (AVX2: 4
 * rows x 2 keys, 6 loads to 8 FMAs). The folds are of VL keys' sums at a time. */
#define MA_DR_W (MA_VL < 16 ? MA_VL : 16)
/* keys a tile: MA_DR_CHAINS / RP to a power of 2 (they divide a group of VL keys), VL at most; one
 * row takes half (its decoding is the memory's: from memory, 4 key rows at a time kept the
 * stream's rate where 8 lost 10-15% on Zen 3) */
#define MA_POW2_FLOOR(x) ((x) >= 16 ? 16 : (x) >= 8 ? 8 : (x) >= 4 ? 4 : (x) >= 2 ? 2 : 1)
#define MA_DR_KI(RP) ma_min(MA_VL, MA_POW2_FLOOR((RP) == 1 ? MA_DR_CHAINS / 2 : MA_DR_CHAINS / (RP)))

/* Rows 0 .. RP of q against keys c .. c + KI: each key's partial sums into xs[r * VL + i + j]
 * (key c + j). full: D % MA_DR_W == 0; 2: and KI a multiple of 4, each 4 keys' sums folded a
 * quarter (vf_fold_quarter) into xs[r * VL + (i + j) / 4]. */
MA_INLINE void dot_rows_keys(const int RP, const int KI, const int full, vf *xs, int64_t i, const float *q, int64_t D,
                             const void *k, const ma_dtype dt, int64_t off, int64_t ld, int64_t c, int64_t pf) {
    const int64_t es = ma_dtype_size(dt);
    vf acc[MA_DR_CHAINS]; /* acc[j * RP + r] */
#pragma GCC unroll 32
    for (int x = 0; x < KI * RP; x++) acc[x] = vf_zero();
    for (int64_t d = 0; d < D; d += MA_DR_W) {
        const int64_t n = full ? MA_DR_W : ma_min(MA_DR_W, D - d);
        if (pf && (d * es) % MA_CACHE_LINE == 0)
#pragma GCC unroll 16
            for (int j = 0; j < KI; j++)
                prefetch_lines((const char *)k + (off + (c + j) * ld + d) * es, MA_DR_W * es, pf * es);
        vf kv[MA_DR_CHAINS];
#pragma GCC unroll 16
        for (int j = 0; j < KI; j++) { /* (a key vector for one row only: the FMA's own load) */
            kv[j] = vf_load_dt(k, dt, off + (c + j) * ld + d, n);
            if (RP > 1) kv[j] = vf_in_reg(kv[j]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < RP; r++) {
            const vf qv = vf_in_reg(vf_load_dt(q, MA_F32, r * D + d, n));
#pragma GCC unroll 16
            for (int j = 0; j < KI; j++) acc[j * RP + r] = vf_fma(kv[j], qv, acc[j * RP + r]);
        }
    }
#ifdef MA_FOLD_QUARTER
    if (full == 2) {
#pragma GCC unroll 4
        for (int j = 0; j < KI; j += 4)
#pragma GCC unroll 8
            for (int r = 0; r < RP; r++)
                xs[r * MA_VL + (i + j) / 4] = vf_fold_quarter(acc[j * RP + r], acc[(j + 1) * RP + r],
                                                              acc[(j + 2) * RP + r], acc[(j + 3) * RP + r]);
        return;
    }
#endif
#pragma GCC unroll 16
    for (int j = 0; j < KI; j++)
#pragma GCC unroll 8
        for (int r = 0; r < RP; r++) xs[r * MA_VL + i + j] = acc[j * RP + r];
}

/* Rows 0 .. RP (at most MA_DR_ROWS) against keys c0 .. c0 + nk (nk <= VL): tiles of
 * MA_DR_KI(RP) keys (a short group's rest: a tile of 2, then single keys); each score's
 * partial sums then folded across the lanes, VL keys' at a time. */
MA_INLINE void dot_rows_group(const int RP, float *s, int64_t lds, const float *q, int64_t D, const void *k,
                              const ma_dtype dt, int64_t off, int64_t ld, int64_t c0, int64_t nk, int64_t pf) {
    const int KI = MA_DR_KI(RP);
    vf xs[MA_DR_ROWS * MA_VL];
    int64_t i = 0;
#ifdef MA_FOLD_QUARTER /* a whole group in tiles of 4 keys or a multiple: each folded as it ends */
    if (KI % 4 == 0 && nk == MA_VL && D % MA_DR_W == 0) {
        for (; i < nk; i += KI) dot_rows_keys(RP, KI, 2, xs, i, q, D, k, dt, off, ld, c0 + i, pf);
        for (int r = 0; r < RP; r++) vf_store(s + r * lds + c0, vf_fold_quarters(xs + r * MA_VL));
        return;
    }
#endif
    if (D % MA_DR_W == 0) {
        for (; i + KI <= nk; i += KI) dot_rows_keys(RP, KI, 1, xs, i, q, D, k, dt, off, ld, c0 + i, pf);
        if (KI > 2 && i + 2 <= nk) dot_rows_keys(RP, ma_min(2, KI), 1, xs, i, q, D, k, dt, off, ld, c0 + i, pf), i += 2;
        for (; i < nk; i++) dot_rows_keys(RP, 1, 1, xs, i, q, D, k, dt, off, ld, c0 + i, pf);
    } else {
        for (; i < nk; i++) dot_rows_keys(RP, 1, 0, xs, i, q, D, k, dt, off, ld, c0 + i, pf);
    }
    for (int r = 0; r < RP; r++) {
        vf *x = xs + r * MA_VL;
        for (int64_t y = nk; y < MA_VL; y++) x[y] = vf_zero();
#ifdef MA_FOLD_LANES /* the mapping's own (MA_DR_W = MA_VL) */
        x[0] = vf_fold_lanes(x);
#else /* lane t of every key in x[t], the first MA_DR_W folded */
        vf_transpose(x);
        for (int w = MA_DR_W; w > 1; w /= 2)
            for (int t = 0; t < w / 2; t++) x[t] = vf_add(x[t], x[t + w / 2]);
#endif
        store_k(nk == MA_VL, s + r * lds + c0, vm_first(nk), x[0]);
    }
}

/* ---- dot_rows_i8: the 8-bit cache's scores in integers ---------------------------------------
 *
 * s[r * lds + c] = (float)(q_r . k_c) * qs[r] with q_r in int16 (the decode's query rows, each
 * quantized with its scale qs[r]: FN(quantize_q16)) and k_c int8: the dot product is exact in
 * int32 (the caller keeps |q| D 128 under 2^31), so its value, its one rounding to float and the
 * one of the product with qs are the same on every instruction set and in the scalar block,
 * whatever the tile or the order. The register tile is dot_rows' (RP rows x KI keys, each key and
 * q vector loaded once into a register), MA_HL elements of D a step (AVX2: vpmaddwd, 16 products
 * an instruction against an FMA's 8, and no conversion of the keys to float32); the rest of D
 * (D % MA_HL) in one more step of masked loads where the set has them (MA_VH_LOAD_N: AVX-512,
 * whose 32 elements a step leave 16 of D = 80; those in scalar integers ran the scores at a
 * third of D = 128's rate), else in scalar integers. */
#ifdef MA_VH_LOAD_N
#define MA_I8_TAIL(D) 0 /* (no scalar rest) */
#else
#define MA_I8_TAIL(D) ((D) % MA_HL)
#endif
MA_INLINE void dot_i8_keys(const int RP, const int KI, vs *xs, int32_t *xt, int64_t i, const int16_t *q, int64_t D,
                           const int8_t *k, int64_t ld, int64_t c, int64_t pf) {
    vs acc[MA_DR_CHAINS]; /* acc[j * RP + r] */
#pragma GCC unroll 32
    for (int x = 0; x < KI * RP; x++) acc[x] = vs_zero();
    if (pf) /* (the keys' lines at once: a test in the loop below cost 5-10% in L1) */
#pragma GCC unroll 16
        for (int j = 0; j < KI; j++) prefetch_lines((const char *)(k + (c + j) * ld), D, pf);
    int64_t d = 0;
    for (; d + MA_HL <= D; d += MA_HL) {
        vh kv[MA_DR_CHAINS];
#pragma GCC unroll 16
        for (int j = 0; j < KI; j++) {
            kv[j] = vh_load_i8(k + (c + j) * ld + d);
            if (RP > 1) kv[j] = vh_in_reg(kv[j]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < RP; r++) {
            const vh qv = vh_in_reg(vh_load_i16(q + r * D + d));
#pragma GCC unroll 16
            for (int j = 0; j < KI; j++) acc[j * RP + r] = vs_dot(acc[j * RP + r], kv[j], qv);
        }
    }
#ifdef MA_VH_LOAD_N
    if (d < D) {
        const int64_t n = D - d;
        vh kv[MA_DR_CHAINS];
#pragma GCC unroll 16
        for (int j = 0; j < KI; j++) kv[j] = vh_load_i8_n(k + (c + j) * ld + d, n);
#pragma GCC unroll 8
        for (int r = 0; r < RP; r++) {
            const vh qv = vh_load_i16_n(q + r * D + d, n);
#pragma GCC unroll 16
            for (int j = 0; j < KI; j++) acc[j * RP + r] = vs_dot(acc[j * RP + r], kv[j], qv);
        }
        d = D;
    }
#endif
#pragma GCC unroll 16
    for (int j = 0; j < KI; j++)
#pragma GCC unroll 8
        for (int r = 0; r < RP; r++) xs[r * MA_VL + i + j] = acc[j * RP + r];
    if (d < D)
        for (int j = 0; j < KI; j++)
            for (int r = 0; r < RP; r++) {
                int32_t t = 0;
                for (int64_t e = d; e < D; e++) t += (int32_t)q[r * D + e] * k[(c + j) * ld + e];
                xt[r * MA_VL + i + j] = t;
            }
}

/* Rows 0 .. RP against keys c0 .. c0 + nk (nk <= VL), dot_rows_group's tiles; the sums folded */
MA_INLINE void dot_i8_group(const int RP, float *s, int64_t lds, const int16_t *q, const float *qs, int64_t D,
                            const int8_t *k, int64_t ld, int64_t c0, int64_t nk, int64_t pf) {
    const int KI = MA_DR_KI(RP);
    vs xs[MA_DR_ROWS * MA_VL];
    int32_t xt[MA_DR_ROWS * MA_VL];
    int64_t i = 0;
    for (; i + KI <= nk; i += KI) dot_i8_keys(RP, KI, xs, xt, i, q, D, k, ld, c0 + i, pf);
    if (KI > 2 && i + 2 <= nk) dot_i8_keys(RP, ma_min(2, KI), xs, xt, i, q, D, k, ld, c0 + i, pf), i += 2;
    for (; i < nk; i++) dot_i8_keys(RP, 1, xs, xt, i, q, D, k, ld, c0 + i, pf);
    for (int r = 0; r < RP; r++) {
        const vs *x = xs + r * MA_VL;
        const int32_t *t = xt + r * MA_VL;
        float *sr = s + r * lds + c0;
#ifdef MA_FOLD_LANES_I
        if (nk == MA_VL && MA_I8_TAIL(D) == 0) {
            vf_store(sr, vf_mul(vs_to_f(vs_fold_lanes(x)), vf_set1(qs[r])));
            continue;
        }
#endif
        for (int64_t y = 0; y < nk; y++) sr[y] = (float)(vs_hsum(x[y]) + (MA_I8_TAIL(D) ? t[y] : 0)) * qs[r];
    }
}

/* VL keys at a time, every row for them (in passes as even as MA_DR_ROWS allows: AVX2's 7
 * rows 4 + 3, 6 rows 3 + 3) before the next keys, which stay in L1 meanwhile; integer: the 8-bit
 * cache's integer products (q16, qs; k int8), else the float ones (q). */
MA_INLINE void dot_rows_dt(const int integer, float *s, int64_t lds, const float *q, const int16_t *q16,
                           const float *qs, int64_t nr, int64_t D, const void *k, const ma_dtype dt, int64_t off,
                           int64_t ld, int64_t nc, int64_t pf) {
    const int64_t passes = ma_cdiv(nr, MA_DR_ROWS), RP = nr / passes, wide = nr % passes; /* wide: RP + 1 rows */
    for (int64_t c0 = 0; c0 < nc; c0 += MA_VL) {
        const int64_t nk = ma_min(MA_VL, nc - c0);
        for (int64_t x = 0, r0 = 0; x < passes; x++) {
            const int64_t R = RP + (x < wide), pr = r0 == 0 ? pf : 0;
#define MA_PASS(R)                                                                                                   \
    (integer ? dot_i8_group(R, s + r0 * lds, lds, q16 + r0 * D, qs + r0, D, (const int8_t *)k + off, ld, c0, nk, pr) \
             : dot_rows_group(R, s + r0 * lds, lds, q + r0 * D, D, k, dt, off, ld, c0, nk, pr))
            switch (R) { /* (R <= MA_DR_ROWS: the cases past it never run, but compile within bounds) */
            case 1: MA_PASS(1); break;
            case 2: MA_PASS(ma_min(2, MA_DR_ROWS)); break;
            case 3: MA_PASS(ma_min(3, MA_DR_ROWS)); break;
            default: MA_PASS(ma_min(4, MA_DR_ROWS)); break;
            }
#undef MA_PASS
            r0 += R;
        }
    }
}

static void BLK(dot_rows)(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                          int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    if (dt == MA_F32) dot_rows_dt(0, s, lds, q, NULL, NULL, nr, D, k, MA_F32, off, ld, nc, pf);
    else if (dt == MA_BF16) dot_rows_dt(0, s, lds, q, NULL, NULL, nr, D, k, MA_BF16, off, ld, nc, pf);
    else if (dt == MA_I8) dot_rows_dt(0, s, lds, q, NULL, NULL, nr, D, k, MA_I8, off, ld, nc, pf);
    else dot_rows_dt(0, s, lds, q, NULL, NULL, nr, D, k, MA_F16, off, ld, nc, pf);
}

static void BLK(dot_rows_i8)(float *s, int64_t lds, const int16_t *q, const float *qs, int64_t nr, int64_t D,
                             const int8_t *k, int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    dot_rows_dt(1, s, lds, NULL, q, qs, nr, D, k, MA_I8, off, ld, nc, pf);
}

/* ---- axpy_rows: P V with the value rows read in order ----------------------------------------
 *
 * axpy_keys' sums (o[r][d] += p[r][c] v_c[d], one FMA per key in key order, so its bits) as a
 * register tile: MA_PV_ROWS rows x MA_PV_NV vectors of O (AVX2: 4 x 2, 8 accumulators) loaded
 * once, then a run of keys inside (each value vector loaded once into a register for its rows'
 * FMAs, each probability a broadcast), then stored: O goes through the registers once per run,
 * not once per key or two. A run's value rows are read strip by strip (the first strip from
 * memory, the others from L1), so the prefetch keeps the memory busy meanwhile. Runs of
 * MA_PV_KEYS; MA_PV_KEYS_SEQ where the rows follow one another (ld = Dv, one stream) for at
 * most one tile of rows, MA_PV_KEYS_ONE for one row: shorter runs keep the hardware's stream prefetch
 * following the rows (Zen 3, decoding from memory: 8 against 2 and 32; one row, 2 against 8).
 * The prefetch of a run's value rows, pf on: runs of MA_PV_KEYS (32) for at most two tiles of
 * rows take each line as the first tile's strip reads it ("spread"); the others all the run's
 * lines as it starts. 32 rows' lines at once (256 at D = 128 float32) are more than a core keeps
 * in flight while one or two tiles take little time; over more tiles (speculative verification:
 * 8) the run is long enough for them, and spread over its first tile they are a burst again.
 * On Zen 3 spread read the key heads side by side (pages, (B, L, H_kv, D)) and 8 query heads
 * a key head closer to the stream; 8 rows' lines ran as fast at once, and verification slower
 * spread (docs/decoding-performance.md). */
#define MA_PV_KEYS 32
#define MA_PV_KEYS_SEQ 8
#define MA_PV_KEYS_ONE 2
#define MA_PV_ROWS 4
#define MA_PV_NV(R) ((R) >= 4 ? 2 : (R) == 3 ? 2 : (R) == 2 ? 4 : 8)

/* o's rows 0 .. R, columns d0 .. d0 + NV VL, += keys c0 .. c0 + ks; each key's line at d0 (a
 * strip that starts one) prefetched pf elements on (0: none); ls (or NULL): ls[r] += each key's
 * p in order, in registers over the run (a chain of adds a row beside the FMAs). */
MA_INLINE void axpy_rows_block(const int R, const int NV, float *o, const float *p, int64_t ldp, int64_t Dv,
                               const void *v, const ma_dtype dt, int64_t off, int64_t ld, int64_t d0, int64_t c0,
                               int64_t ks, int64_t pf, float *ls) {
    const int64_t es = ma_dtype_size(dt);
    vf acc[8]; /* acc[r * NV + u] */
    float sum[4] = {0, 0, 0, 0};
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        if (ls) sum[r] = ls[r];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int u = 0; u < NV; u++) acc[r * NV + u] = vf_load(o + r * Dv + d0 + MA_VL * u);
#pragma GCC unroll 2
    for (int64_t c = c0; c < c0 + ks; c++) {
        if (pf && (d0 * es) % MA_CACHE_LINE == 0)
            prefetch_lines((const char *)v + (off + c * ld + d0) * es, ma_max(NV * MA_VL * es, MA_CACHE_LINE), pf * es);
        vf vv[8];
#pragma GCC unroll 8
        for (int u = 0; u < NV; u++) vv[u] = vf_in_reg(vf_load_dt(v, dt, off + c * ld + d0 + MA_VL * u, MA_VL));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            /* the sums' adds: over float32 values from p's scalar (its broadcast then from the
             * register), else from the broadcast's lane 0 (the broadcast then a load, not a
             * shuffle beside the values' widening ones) */
            const float ps = p[r * ldp + c];
            const vf pr = dt == MA_F32 ? vf_set1(ps) : vf_in_reg(vf_set1(ps));
            if (ls) sum[r] += dt == MA_F32 ? ps : vf_lane0(pr);
#pragma GCC unroll 8
            for (int u = 0; u < NV; u++) acc[r * NV + u] = vf_fma(pr, vv[u], acc[r * NV + u]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int u = 0; u < NV; u++) vf_store(o + r * Dv + d0 + MA_VL * u, acc[r * NV + u]);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        if (ls) ls[r] = sum[r];
}

/* Scores from a K^T page (element d of key c at off + c + d * ldd): keys in the lanes as
 * they lie, one FMA per d in order from 0, the same bits without the transposes. A strip takes
 * NV vectors of keys for NR query rows (the query heads of one key head), NR * NV chains;
 * each line read prefetches the line pf elements on (the next key block, or the next head's). */
MA_INLINE void dot_keys_t_strip(const int NV, const int NR, float *s, int64_t lds, const float *q, int64_t D,
                                const void *k, const ma_dtype dt, int64_t off, int64_t ldd, int64_t c0, int64_t pf) {
    const int64_t es = ma_dtype_size(dt);
    vf acc[8][4];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) acc[r][v] = vf_zero();
    for (int64_t d = 0; d < D; d++) {
        const int64_t o = off + d * ldd + c0;
        vf x[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            x[v] = vf_load_dt(k, dt, o + MA_VL * v, MA_VL);
            if (pf && (MA_VL * v * es) % MA_CACHE_LINE == 0)
                prefetch_ahead((const char *)k + (o + MA_VL * v + pf) * es, pf * es);
        }
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const vf qd = vf_set1(q[r * D + d]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) acc[r][v] = vf_fma(x[v], qd, acc[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) vf_store(s + r * lds + c0 + MA_VL * v, acc[r][v]);
}

MA_INLINE void dot_keys_t_dt(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k,
                             const ma_dtype dt, int64_t off, int64_t ldd, int64_t nc, int64_t pf) {
    int64_t c0 = 0;
#define MA_KT_STRIPS(NR)                                                \
    for (; c0 + MA_VL * MA_KT_NV(NR) <= nc; c0 += MA_VL * MA_KT_NV(NR)) \
    dot_keys_t_strip(MA_KT_NV(NR), NR, s, lds, q, D, k, dt, off, ldd, c0, pf)
    switch (nr) {
    case 1: MA_KT_STRIPS(1); break;
    case 2: MA_KT_STRIPS(2); break;
    case 3: MA_KT_STRIPS(3); break;
    case 4: MA_KT_STRIPS(4); break;
    case 5: MA_KT_STRIPS(5); break;
    case 6: MA_KT_STRIPS(6); break;
    case 7: MA_KT_STRIPS(7); break;
    default: MA_KT_STRIPS(8); break;
    }
#undef MA_KT_STRIPS
    for (; c0 < nc; c0 += MA_VL) {
        const int64_t nk = ma_min(MA_VL, nc - c0);
        vf acc[8];
        for (int r = 0; r < 8; r++) acc[r] = vf_zero();
        for (int64_t d = 0; d < D; d++) {
            const vf x = vf_load_dt(k, dt, off + d * ldd + c0, nk);
            for (int r = 0; r < 8; r++)
                if (r < nr) acc[r] = vf_fma(x, vf_set1(q[r * D + d]), acc[r]);
        }
        for (int r = 0; r < 8; r++)
            if (r < nr) store_k(nk == MA_VL, s + r * lds + c0, vm_first(nk), acc[r]);
    }
}

/* o[r * Dv + d] += sum_c p[r * ldp + c] v_c[d] (one FMA per key, in order): R rows x NV
 * vectors of columns in registers while the keys stream past; the R rows share each value
 * row read. full: the strip's columns all exist (no tests in the key loop). */
MA_INLINE void axpy_keys_strip(const int R, const int NV, const int full, float *o, const float *p, int64_t ldp,
                               int64_t Dv, const void *v, const ma_dtype dt, int64_t off, int64_t ld, int64_t nc,
                               int64_t d0, int64_t pf) {
    const int64_t es = ma_dtype_size(dt);
    int64_t n[8];
    vf acc[4][8];
    for (int u = 0; u < NV; u++) {
        n[u] = full ? MA_VL : Dv - d0 - MA_VL * u < 0 ? 0 : ma_min(MA_VL, Dv - d0 - MA_VL * u);
        for (int r = 0; r < R; r++) acc[r][u] = vf_load_dt(o, MA_F32, r * Dv + d0 + MA_VL * u, n[u]);
    }
    for (int64_t c = 0; c < nc; c++) {
        vf pv[4];
        for (int r = 0; r < R; r++) pv[r] = vf_set1(p[r * ldp + c]);
        for (int u = 0; u < NV; u++) {
            if (n[u] == 0) break;
            const vf vv = vf_load_dt(v, dt, off + c * ld + d0 + MA_VL * u, n[u]);
            for (int r = 0; r < R; r++) acc[r][u] = vf_fma(pv[r], vv, acc[r][u]);
            if (pf && (MA_VL * u * es) % MA_CACHE_LINE == 0) /* d0 * es is a multiple of a line */
                prefetch_ahead((const char *)v + (off + c * ld + d0 + MA_VL * u + pf) * es, pf * es);
        }
    }
    for (int u = 0; u < NV; u++)
        for (int r = 0; r < R; r++)
            if (n[u] > 0) store_k(n[u] == MA_VL, o + r * Dv + d0 + MA_VL * u, vm_first(n[u]), acc[r][u]);
}

/* Rows r .. r + R of o, strips of MA_AXPY_NV(R) vectors; only the first rows prefetch. */
MA_INLINE void axpy_keys_rows(const int R, float *o, const float *p, int64_t ldp, int64_t Dv, const void *v,
                              const ma_dtype dt, int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    const int64_t w = MA_VL * MA_AXPY_NV(R);
    for (int64_t d0 = 0; d0 < Dv; d0 += w)
        if (d0 + w <= Dv) axpy_keys_strip(R, MA_AXPY_NV(R), 1, o, p, ldp, Dv, v, dt, off, ld, nc, d0, pf);
        else axpy_keys_strip(R, MA_AXPY_NV(R), 0, o, p, ldp, Dv, v, dt, off, ld, nc, d0, pf);
}

/* MA_AXPY_ROWS = 4: the query heads of a key head, 4 (or 3) rows at a time; then pairs, then
 * the last row alone. */
/* Rows 0 .. R of o += keys c0 .. c0 + ks of P V (axpy_rows_block), every column: strips of
 * MA_PV_NV(R) vectors, single vectors, then the last columns (Dv % VL) by axpy_keys_strip; the
 * first strip adds the keys' p to ls (Dv >= VL). */
MA_INLINE void axpy_rows_keys(const int R, float *o, const float *p, int64_t ldp, int64_t Dv, const void *v,
                              const ma_dtype dt, int64_t off, int64_t ld, int64_t c0, int64_t ks, int64_t pf,
                              float *ls) {
    const int NV = MA_PV_NV(R);
    int64_t d0 = 0;
    for (; d0 + NV * MA_VL <= Dv; d0 += NV * MA_VL, ls = NULL)
        axpy_rows_block(R, NV, o, p, ldp, Dv, v, dt, off, ld, d0, c0, ks, pf, ls);
    for (; d0 + MA_VL <= Dv; d0 += MA_VL, ls = NULL)
        axpy_rows_block(R, 1, o, p, ldp, Dv, v, dt, off, ld, d0, c0, ks, pf, ls);
    if (d0 < Dv)
        for (int r = 0; r < R; r++)
            axpy_keys_strip(1, 1, 0, o + r * Dv, p + r * ldp + c0, ldp, Dv, v, dt, off + c0 * ld, ld, ks, d0,
                            r == 0 ? pf : 0);
}

/* Every key, KS at a time (axpy_rows_block), every row for them before the next keys; the
 * value rows prefetched pf elements on, spread over the first tile's strips or at each run's
 * start (above). */
MA_INLINE void axpy_rows_all(const int64_t KS, float *o, const float *p, int64_t ldp, int64_t nr, int64_t Dv,
                             const void *v, const ma_dtype dt, int64_t off, int64_t ld, int64_t nc, int64_t pf,
                             float *lsum) {
    const int64_t es = ma_dtype_size(dt);
    const int spread = KS > MA_PV_KEYS_SEQ && nr <= 2 * MA_PV_ROWS;
    for (int64_t c0 = 0; c0 < nc; c0 += KS) {
        const int64_t ks = ma_min(KS, nc - c0);
        if (pf && !spread)
            for (int64_t c = 0; c < ks; c++)
                prefetch_lines((const char *)v + (off + (c0 + c) * ld) * es, Dv * es, pf * es);
        for (int64_t r = 0; r < nr; r += MA_PV_ROWS) {
            const int64_t R = ma_min(MA_PV_ROWS, nr - r);
            float *o_r = o + r * Dv;
            const float *p_r = p + r * ldp;
#define MA_ROWS(R) \
    axpy_rows_keys(R, o_r, p_r, ldp, Dv, v, dt, off, ld, c0, ks, (spread && r == 0) ? pf : 0, lsum ? lsum + r : NULL)
            switch (R) {
            case 1: MA_ROWS(1); break;
            case 2: MA_ROWS(2); break;
            case 3: MA_ROWS(3); break;
            default: MA_ROWS(4); break;
            }
#undef MA_ROWS
        }
    }
}

MA_INLINE void axpy_keys_dt(float *o, const float *p, int64_t ldp, int64_t nr, int64_t Dv, const void *v,
                            const ma_dtype dt, int64_t off, int64_t ld, int64_t nc, int64_t pf, float *lsum) {
    if (Dv >= MA_VL) {
        axpy_rows_all(ld == Dv && nr <= MA_PV_ROWS ? (nr == 1 ? MA_PV_KEYS_ONE : MA_PV_KEYS_SEQ) : MA_PV_KEYS, o, p,
                      ldp, nr, Dv, v, dt, off, ld, nc, pf, lsum);
        return;
    }
    if (lsum) /* (rows narrower than a vector: the sums first) */
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < nc; c++) lsum[r] += p[r * ldp + c];
#define MA_ROWS(R) axpy_keys_rows(R, o + r * Dv, p + r * ldp, ldp, Dv, v, dt, off, ld, nc, r == 0 ? pf : 0)
    int64_t r = 0;
    if (MA_AXPY_ROWS >= 4 && nr >= 3) {
        for (; r + 4 <= nr; r += 4) MA_ROWS(4);
        if (nr - r == 3) MA_ROWS(3), r += 3;
    }
    for (; r + 2 <= nr; r += 2) MA_ROWS(2);
    if (r < nr) MA_ROWS(1);
#undef MA_ROWS
}

static void BLK(dot_keys_t)(float *s, int64_t lds, const float *q, int64_t nr, int64_t D, const void *k, ma_dtype dt,
                            int64_t off, int64_t ldd, int64_t nc, int64_t pf) {
    if (dt == MA_F32) dot_keys_t_dt(s, lds, q, nr, D, k, MA_F32, off, ldd, nc, pf);
    else if (dt == MA_BF16) dot_keys_t_dt(s, lds, q, nr, D, k, MA_BF16, off, ldd, nc, pf);
    else if (dt == MA_I8) dot_keys_t_dt(s, lds, q, nr, D, k, MA_I8, off, ldd, nc, pf);
    else dot_keys_t_dt(s, lds, q, nr, D, k, MA_F16, off, ldd, nc, pf);
}

static void BLK(axpy_keys)(float *o, const float *p, int64_t ldp, int64_t nr, int64_t Dv, const void *v, ma_dtype dt,
                           int64_t off, int64_t ld, int64_t nc, int64_t pf, float *lsum) {
    if (dt == MA_F32) axpy_keys_dt(o, p, ldp, nr, Dv, v, MA_F32, off, ld, nc, pf, lsum);
    else if (dt == MA_BF16) axpy_keys_dt(o, p, ldp, nr, Dv, v, MA_BF16, off, ld, nc, pf, lsum);
    else if (dt == MA_I8) axpy_keys_dt(o, p, ldp, nr, Dv, v, MA_I8, off, ld, nc, pf, lsum);
    else axpy_keys_dt(o, p, ldp, nr, Dv, v, MA_F16, off, ld, nc, pf, lsum);
}

/* ---- axpy_keys_i8: the 8-bit cache's P V in integers ----------------------------------------
 *
 * The definition (blocks.h): per row and run of at most MA_PV_I8_RUN keys, the probabilities
 * rounded to int16 steps of the run's largest (p16 = round(p 32767 / m)), the sums over the
 * keys exact in int32 (512 keys x 32767 x 128 < 2^31), then o = fma((float)sum, m / 32767, o):
 * one rounding of the sum, so every variant's bits are the scalar block's. The tile: two keys
 * at a time, their int8 values widened and zipped (vh_zip_lo, vh_zip_hi) so that each int32 lane's pair is
 * the two keys' values of one dim, a row's two p16 broadcast as one int32 (vp_set), one vs_dot
 * a pair: AVX2 / AVX-512 vpmaddwd (VNNI: vpdpwssd), 16 or 32 multiply-adds an instruction
 * where an FMA does 8 or 16, and no conversion of the values to float32. MA_PV_ROWS rows x
 * MA_PVI_NU(R) vh of dims in registers over the run (a whole row of 128 for one or two rows on
 * AVX-512: strips of half a row read every other line of the run's rows, then the others); vs_unzip_f puts the sums back in dim order. */
#define MA_PV_I8_RUN 512
#define MA_PV_I8_QM 32767.0f

/* p16[c] = round(p[c] 32767 / m) for c < n, m = max |p[c]|, *ps = m / 32767; returns 1 (p16 0,
 * *ps 0) where some p is inf or NaN or 32767 / m overflows: the run is axpy_keys' then. m = 0:
 * p16 0, *ps 0. */
MA_INLINE int quantize_p16(const float *p, int64_t n, int16_t *p16, float *ps) {
    vf mx = vf_zero();
    vm bad = vf_isnan(mx);
    const vf sign = vf_set1(-0.0f);
    for (int64_t c = 0; c < n; c += MA_VL) {
        const vf x = vf_load_dt(p, MA_F32, c, n - c);
        bad = vm_or(bad, vf_isnan(vf_sub(x, x)));
        mx = vf_max(mx, vf_andnot(sign, x));
    }
    const float m = vf_hmax(mx, 0.0f), inv = MA_PV_I8_QM / m;
    if (vm_any(bad) || m == 0 || !(inv < INFINITY)) {
        memset(p16, 0, sizeof(int16_t) * (size_t)n);
        *ps = 0;
        return vm_any(bad) || (m > 0 && !(inv < INFINITY));
    }
    for (int64_t c = 0; c < n; c += MA_VL)
        vf_store_i16(p16 + c, n - c, vf_mul(vf_load_dt(p, MA_F32, c, n - c), vf_set1(inv)));
    *ps = m / MA_PV_I8_QM;
    return 0;
}

/* Rows 0 .. R of o, the nd dims from d0 (NU vh of them; fewer only in a last, masked, vh) +=
 * the run's nc keys: p16 (R rows, ldp apart, one 0 past an odd nc) by pairs against v's rows. */
MA_INLINE void axpy_i8_strip(const int R, const int NU, const int PF, float *o, int64_t Dv, const int16_t *p16,
                             int64_t ldp, const float *ps, const int8_t *v, int64_t ld, int64_t nc, int64_t d0,
                             int64_t nd, int64_t pf) {
    vs acc[4 * 8]; /* acc[(r NU + u) MA_VS_PER_VH + j]; R NU MA_VS_PER_VH <= 16 */
#pragma GCC unroll 32
    for (int x = 0; x < R * NU * MA_VS_PER_VH; x++) acc[x] = vs_zero();
    for (int64_t c = 0; c < nc; c += 2) {
        const int8_t *va = v + c * ld + d0, *vb = c + 1 < nc ? va + ld : va; /* (odd nc: a p16 of 0) */
        if (PF) prefetch_lines((const char *)va, Dv, pf), prefetch_lines((const char *)vb, Dv, pf);
        vh x0[8], x1[8];
#pragma GCC unroll 4
        for (int u = 0; u < NU; u++) {
            vh a, b;
#ifdef MA_VH_LOAD_N
            if (nd < MA_HL) a = vh_load_i8_n(va, nd), b = vh_load_i8_n(vb, nd);
            else
#endif
                a = vh_load_i8(va + MA_HL * u), b = vh_load_i8(vb + MA_HL * u);
            x0[u] = vh_in_reg(vh_zip_lo(a, b)), x1[u] = vh_in_reg(vh_zip_hi(a, b));
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, p16 + r * ldp + c, sizeof pair);
            const vp pr = vp_set(pair);
#pragma GCC unroll 4
            for (int u = 0; u < NU; u++)
#pragma GCC unroll 2
                for (int j = 0; j < MA_VS_PER_VH; j++) {
                    const int x = (r * NU + u) * MA_VS_PER_VH + j;
                    acc[x] = vs_pair_dot(acc[x], x0[u], x1[u], j, pr);
                }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const vf s = vf_set1(ps[r]);
#pragma GCC unroll 4
        for (int u = 0; u < NU; u++)
#pragma GCC unroll 2
            for (int j = 0; j < MA_VS_PER_VH; j++) {
                const int64_t at = MA_HL * u + MA_VL * j, n = ma_min(MA_VL, nd - at);
                const int x = (r * NU + u) * MA_VS_PER_VH;
                float *od = o + r * Dv + d0 + at;
                const vf y = vs_unzip_f(acc[x], acc[x + MA_VS_PER_VH - 1], j);
                if (n > 0) store_k(n == MA_VL, od, vm_first(n), vf_fma(y, s, load_k(n == MA_VL, od, vm_first(n))));
            }
    }
}

/* Rows 0 .. R: strips of MA_PVI_NU(R) vh, then single vh, then the last Dv % MA_HL dims (one masked
 * vh where the set has MA_VH_LOAD_N, else scalar integers); only the first strip prefetches. */
MA_INLINE void axpy_i8_rows(const int R, float *o, int64_t Dv, const int16_t *p16, int64_t ldp, const float *ps,
                            const int8_t *v, int64_t ld, int64_t nc, int64_t pf) {
    const int64_t W = MA_PVI_NU(R) * MA_HL;
    int64_t d0 = 0;
    /* (the prefetch a loop of its own: its test in the loop over the keys cost the tile registers) */
#define MA_STRIP(NU, nd)                                                                 \
    (d0 == 0 && pf ? axpy_i8_strip(R, NU, 1, o, Dv, p16, ldp, ps, v, ld, nc, d0, nd, pf) \
                   : axpy_i8_strip(R, NU, 0, o, Dv, p16, ldp, ps, v, ld, nc, d0, nd, 0))
    for (; d0 + W <= Dv; d0 += W) MA_STRIP(MA_PVI_NU(R), W);
    for (; d0 + MA_HL <= Dv; d0 += MA_HL) MA_STRIP(1, MA_HL);
#ifdef MA_VH_LOAD_N
    if (d0 < Dv) MA_STRIP(1, Dv - d0), d0 = Dv;
#endif
#undef MA_STRIP
    for (; d0 < Dv; d0++)
        for (int r = 0; r < R; r++) {
            int32_t acc = 0;
            for (int64_t c = 0; c < nc; c++) acc += (int32_t)p16[r * ldp + c] * v[c * ld + d0];
            o[r * Dv + d0] = fmaf((float)acc, ps[r], o[r * Dv + d0]);
        }
}

/* each row count a function of its own: inlined into one, GCC kept half the accumulators on the
 * stack (a load and a store each per pair of keys) */
#define MA_I8_ROWS(R)                                                                                                \
    static __attribute__((noinline)) void axpy_i8_rows_##R(float *o, int64_t Dv, const int16_t *p16, int64_t ldp,    \
                                                           const float *ps, const int8_t *v, int64_t ld, int64_t nc, \
                                                           int64_t pf) {                                             \
        axpy_i8_rows(ma_min(R, MA_PV_ROWS), o, Dv, p16, ldp, ps, v, ld, nc, pf);                                     \
    }
MA_I8_ROWS(1)
MA_I8_ROWS(2)
MA_I8_ROWS(3)
MA_I8_ROWS(4)
#undef MA_I8_ROWS

static void BLK(axpy_keys_i8)(float *o, const float *p, int64_t ldp, int64_t nr, int64_t Dv, const int8_t *v,
                              int64_t off, int64_t ld, int64_t nc, int64_t pf) {
    enum { LDQ = MA_PV_I8_RUN + 2 };
    int16_t p16[MA_PV_ROWS * LDQ];
    float ps[MA_PV_ROWS];
    for (int64_t c0 = 0; c0 < nc; c0 += MA_PV_I8_RUN) {
        const int64_t n = ma_min(MA_PV_I8_RUN, nc - c0);
        for (int64_t r0 = 0; r0 < nr; r0 += MA_PV_ROWS) {
            const int64_t R = ma_min(MA_PV_ROWS, nr - r0);
            int bad[MA_PV_ROWS];
            for (int64_t r = 0; r < R; r++) {
                bad[r] = quantize_p16(p + (r0 + r) * ldp + c0, n, p16 + r * LDQ, &ps[r]);
                p16[r * LDQ + n] = 0; /* (the pair of an odd run's last key) */
            }
            float *o_r = o + r0 * Dv;
            const int8_t *vc = v + off + c0 * ld;
            const int64_t pr = r0 == 0 ? pf : 0;
            switch (R) {
            case 1: axpy_i8_rows_1(o_r, Dv, p16, LDQ, ps, vc, ld, n, pr); break;
            case 2: axpy_i8_rows_2(o_r, Dv, p16, LDQ, ps, vc, ld, n, pr); break;
            case 3: axpy_i8_rows_3(o_r, Dv, p16, LDQ, ps, vc, ld, n, pr); break;
            default: axpy_i8_rows_4(o_r, Dv, p16, LDQ, ps, vc, ld, n, pr); break;
            }
            for (int64_t r = 0; r < R; r++) /* inf or NaN: the float product's */
                if (bad[r])
                    axpy_keys_dt(o_r + r * Dv, p + (r0 + r) * ldp + c0, ldp, 1, Dv, v, MA_I8, off + c0 * ld, ld, n, 0,
                                 NULL);
        }
    }
}

/* ---- 8-bit KV cache ---------------------------------------------------------- */

/* blocks.h, quantize_row: absmax in lanes (exact, so any order gives the scalar's), a
 * non-finite element found by x * 0 (NaN for inf and NaN, 0 otherwise), then q = the
 * clamped x * (127 / absmax) rounded to nearest even, as the scalar block computes it. */
/* Unused where an instance's table holds only the product (the tile instances). */
__attribute__((unused)) static void BLK(quantize_row)(const void *x, ma_dtype dt, int64_t n, int8_t *q, float *scale) {
    const vf sign = vf_set1(-0.0f);
    vf mx = vf_zero(), nf = vf_zero();
    for (int64_t c = 0; c < n; c += MA_VL) { /* a tail's lanes past n read 0 */
        const vf v = vf_load_dt(x, dt, c, n - c);
        mx = vf_max(vf_andnot(sign, v), mx);
        nf = vf_fma(v, vf_zero(), nf);
    }
    const float m = vf_hmax(mx, 0.0f);
    const int finite = vf_hsum(nf) == 0.0f;
    *scale = finite ? m / 127.0f : NAN;
    if (!finite || m == 0) {
        memset(q, 0, (size_t)n);
        return;
    }
    const vf iv = vf_set1(127.0f / m), lo = vf_set1(-127.0f), hi = vf_set1(127.0f);
    for (int64_t c = 0; c < n; c += MA_VL)
        vf_store_i8(q + c, n - c, vf_min(vf_max(vf_mul(vf_load_dt(x, dt, c, n - c), iv), lo), hi));
}

/* ---- dropout --------------------------------------------------------------- */

/* Philox-4x32-10 (philox.h) on VL counters side by side, lane l = query row i + l: c (4
 * vectors of VL words) in place. */
MA_INLINE vi philox_mulhilo(vi a, vi m, vi *lo) {
    const vi pe = vi_mul_even(a, m), po = vi_mul_even(vi_srl64(a, 32), m);
    *lo = vi_blend_odd(pe, vi_sll64(po, 32));
    return vi_blend_odd(vi_srl64(pe, 32), po);
}

MA_INLINE void philox(vi c[4], uint32_t k0, uint32_t k1) {
    const vi m0 = vi_set1(MA_PHILOX_M0), m1 = vi_set1(MA_PHILOX_M1);
    for (int round = 0; round < 10; round++) {
        vi lo0, lo1;
        const vi hi0 = philox_mulhilo(c[0], m0, &lo0), hi1 = philox_mulhilo(c[2], m1, &lo1);
        c[0] = vi_xor(vi_xor(hi1, c[1]), vi_set1(k0));
        c[1] = lo1;
        c[2] = vi_xor(vi_xor(hi0, c[3]), vi_set1(k1));
        c[3] = lo0;
        k0 += MA_PHILOX_W0;
        k1 += MA_PHILOX_W1;
    }
}

/* dropout_scalar's contract (blocks_scalar.h), VL query rows at a time: one vector Philox
 * call gives rows r0 .. r0 + VL - 1 x the 8 keys of a group as drop masks over the rows; a
 * transposed tile (rs == 1) takes them as they are, a row-wise one (cs == 1) through an
 * 8 x 8 transpose where VL = 8, other layouts and the edges elementwise. */
static void BLK(dropout)(float *x, float *z, int64_t rs, int64_t cs, int64_t nr, int64_t nc, const ma_dropout *d,
                         int64_t i0, int64_t j0) {
    const vf scale = vf_set1((float)d->scale);
    const vi thr = vi_set1(d->thr), low16 = vi_set1(0xffff);
    for (int64_t r0 = 0; r0 < nr; r0 += MA_VL) {
        const int64_t nl = ma_min(MA_VL, nr - r0);
        const vi ci = vi_add(vi_set1((uint32_t)(i0 + r0)), vi_lanes());
        for (int64_t g = j0 >> 3; g * 8 < j0 + nc; g++) {
            vi c[4] = {vi_set1((uint32_t)g), ci, vi_set1(d->c2), vi_set1(d->c3)};
            philox(c, d->k0, d->k1);
            vm drop[8]; /* drop[m], lane l: element (r0 + l, key 8 g + m) is dropped */
            for (int m = 0; m < 8; m++)
                drop[m] = vi_gt(thr, m & 1 ? vi_srl32(c[m >> 1], 16) : vi_and(c[m >> 1], low16));
            const int64_t c0 = g * 8 - j0; /* tile column of key 8 g */
            if (nl == MA_VL && rs == 1) {
                for (int m = 0; m < 8; m++) {
                    if (c0 + m < 0 || c0 + m >= nc) continue;
                    float *e = (z ? z : x) + (c0 + m) * cs + r0;
                    const vf mul = vf_blend(drop[m], scale, vf_zero());
                    vf_store(e, z ? mul : vf_mul(vf_load(e), mul));
                }
            } else if (MA_VL == 8 && nl == 8 && c0 >= 0 && c0 + 8 <= nc && cs == 1) {
                vf t[MA_VL];
                for (int m = 0; m < MA_VL; m++) t[m] = m < 8 ? vf_from_mask(drop[m]) : vf_zero();
                vf_transpose(t); /* t[l], lane m: element (r0 + l, key 8 g + m) */
                for (int l = 0; l < 8; l++) {
                    float *e = (z ? z : x) + (r0 + l) * rs + c0;
                    const vf mul = vf_andnot(t[l], scale);
                    vf_store(e, z ? mul : vf_mul(vf_load(e), mul));
                }
            } else {
                const float s = (float)d->scale;
                for (int64_t l = 0; l < nl; l++)
                    for (int m = 0; m < 8; m++) {
                        if (c0 + m < 0 || c0 + m >= nc) continue;
                        float *e = (z ? z : x) + (r0 + l) * rs + (c0 + m) * cs;
                        const float mul = (vm_bits(drop[m]) >> l) & 1 ? 0 : s;
                        *e = z ? mul : *e * mul;
                    }
            }
        }
    }
}

/* ---- non-temporal stores of whole float32 rows (store_tile, stream_stores) --- */
#define MA_BLK_STREAM

/* y[0 : n] = mul * x[0 : n]: y 64-byte aligned, n a multiple of 16; stream_fence before
 * others read y. */
static inline void BLK(stream_row_f32)(float *y, const float *x, int64_t n, float mul) {
    const vf m = vf_set1(mul);
    for (int64_t c = 0; c < n; c += MA_VL) vf_stream(y + c, vf_mul(m, vf_load(x + c)));
}

static inline void BLK(stream_fence)(void) { vf_stream_fence(); }

#endif /* MA_ATTENTION_BLOCKS_SIMD_H */
