/*
 * attention_amx.c -- the float-accumulating attention kernels with their
 * matrix products on AMX tiles (TDPBF16PS). Compiled with -mamx-tile
 * -mamx-bf16 -mavx512bf16 and AVX-512 flags (setup.py); called only when the
 * CPU has them and Linux has granted this process the tile data state
 * (ma_amx_permitted, attention.c). Every other building block (exp, column
 * max, transpose) is the AVX-512 one.
 *
 * GEMM takes the same float32 operands as every other variant. Each operand
 * is split while it is packed into tiles: x = x0 + x1 + x2 with x0 = bf16(x),
 * x1 = bf16(x - x0), x2 = bf16(x - x0 - x1), and the products with
 * i + j < TERMS of the parts x_i y_j are summed in float32 by the tiles:
 *   TERMS = 2:  x0 y0 + x0 y1 + x1 y0        (3 products, error ~2^-16 |x y|)
 *   TERMS = 3:  ... + x0 y2 + x1 y1 + x2 y0  (6 products, error ~2^-24 |x y|, float32's own)
 * An operand whose later parts are all zero (a bfloat16 input, exactly
 * converted) skips the products with them, so a bfloat16 Q K^T is one
 * product. The bfloat16 and float16 instances use TERMS = 2: their inputs
 * have at most 11 significant bits, which two parts hold exactly, and their
 * outputs are rounded to 8 or 11 bits. The float32 instance uses TERMS = 3.
 *
 * Tiles: every tile is configured as 16 rows x 64 bytes; C tiles 0-3 (a 2 x 2
 * block of 16 x 16 float32), A tiles 4-5 (16 rows x 32 bf16), B tiles 6-7
 * (16 rows x 16 pairs of bf16, the VNNI layout: row p holds B[2p][n],
 * B[2p+1][n] for each n). Operands are packed with zeros beyond m, n, k, so
 * every tile is full; C tiles at an edge go through a 16 x 16 buffer.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "blocks_avx512.h" /* every block but the products: exp, column max, transposes, rows */
#include "common/dtype.h"
#include "masked_attn.h"

#define AMX_PARTS 3 /* at most x0, x1, x2 */
#define AMX_TILE 512 /* bf16 elements of one tile: 16 rows x 64 bytes */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

static inline void amx_configure(void) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* The 16 float32 values of the bf16 in the low or high half of v. */
static inline __m512 bf16_lo_to_ps(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
}
static inline __m512 bf16_hi_to_ps(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}

/* part[i] = 32 bf16: the i-th parts of a (low 16) and b (high 16), i < nparts. */
static inline void split32(__m512 a, __m512 b, int nparts, __m512i part[AMX_PARTS]) {
    for (int i = 0; i < nparts; i++) {
        part[i] = (__m512i)_mm512_cvtne2ps_pbh(b, a);
        if (i + 1 < nparts) {
            a = _mm512_sub_ps(a, bf16_lo_to_ps(part[i]));
            b = _mm512_sub_ps(b, bf16_hi_to_ps(part[i]));
        }
    }
}

/* 16 x 16 transpose of 32-bit elements (pairs of bf16), in registers. */
static inline void transpose16x16_epi32(__m512i r[16]) {
    __m512 f[16];
    for (int i = 0; i < 16; i++) f[i] = _mm512_castsi512_ps(r[i]);
    transpose16x16(f);
    for (int i = 0; i < 16; i++) r[i] = _mm512_castps_si512(f[i]);
}

/* Index that interleaves the two halves of 32 bf16: out[2n + s] = in[16 s + n]. */
static inline __m512i interleave_idx(void) {
    static const uint16_t idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_loadu_si512(idx);
}


/* ---- packed operands --------------------------------------------------------
 *
 * A packed operand holds the tiles of a matrix, part after part:
 *   A operand (m, k): tile (mt, kt) = rows 16 mt.., k 32 kt.. (16 x 32 bf16)
 *   B operand (k, n): tile (nt, kt) = k pairs 16 kt.., columns 16 nt.. (VNNI)
 * at p + i * part_stride + outer * os + kt * ks, outer = mt or nt: row-major
 * (os = nkt tiles, ks = 1 tile) for views that move along the outer index,
 * k-major (os = 1 tile, ks = nouter tiles) for views that move along k, so
 * that the tiles one product reads are contiguous either way. Elements beyond
 * m, n, k within the last tiles are zero. A view starts at a later tile (rows
 * r0 of A, r0 a multiple of 16; k0 of B or A, a multiple of 32) and keeps the
 * strides. */
typedef struct {
    uint16_t *p;
    int64_t part_stride, os, ks;
    int parts;
} amx_view;

static inline int64_t amx_a_elems(int64_t m, int64_t k) { return ma_cdiv(m, 16) * ma_cdiv(k, 32) * AMX_TILE; }
static inline int64_t amx_b_elems(int64_t k, int64_t n) { return ma_cdiv(k, 32) * ma_cdiv(n, 16) * AMX_TILE; }

static inline amx_view amx_rows(amx_view v, int64_t r0) { v.p += (r0 / 16) * v.os; return v; }
static inline amx_view amx_krows(amx_view v, int64_t k0) { v.p += (k0 / 32) * v.ks; return v; }

/* The layout of a packed matrix with nouter x nkt tiles per part. */
static inline amx_view amx_layout(uint16_t *p, int64_t nouter, int64_t nkt, int parts, int kmajor) {
    const amx_view v = {p, nouter * nkt * AMX_TILE, kmajor ? AMX_TILE : nkt * AMX_TILE,
                        kmajor ? nouter * AMX_TILE : AMX_TILE, parts};
    return v;
}
static inline amx_view amx_a_layout(uint16_t *p, int64_t m, int64_t k, int parts, int kmajor) {
    return amx_layout(p, ma_cdiv(m, 16), ma_cdiv(k, 32), parts, kmajor);
}
static inline amx_view amx_b_layout(uint16_t *p, int64_t k, int64_t n, int parts, int kmajor) {
    return amx_layout(p, ma_cdiv(n, 16), ma_cdiv(k, 32), parts, kmajor);
}

/* Pack A (m, k), A[i, p] = A[i*ars + p*acs] with acs == 1 (rows) or ars == 1
 * (transposed), as tiles (mt, kt), mt < ceil(m/16), kt < ceil(k/32), in
 * dst.parts parts into the view dst; overwrites. */
static void amx_pack_a(amx_view dst, const float *A, int64_t ars, int64_t acs, int64_t m, int64_t k) {
    const int parts = dst.parts;
    const int64_t part_stride = dst.part_stride;
    const __m512i ileave = interleave_idx();
    for (int64_t mt = 0; mt < ma_cdiv(m, 16); mt++)
        for (int64_t kt = 0; kt < ma_cdiv(k, 32); kt++) {
            const int64_t i0 = mt * 16, p0 = kt * 32;
            uint16_t *tile = dst.p + mt * dst.os + kt * dst.ks;
            __m512i part[AMX_PARTS];
            if (acs == 1) { /* a tile row is 32 consecutive floats of a row */
                const __mmask16 k0 = tail_mask(k - p0), k1 = tail_mask(k - p0 - 16);
                for (int r = 0; r < 16; r++) {
                    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
                    if (i0 + r < m) {
                        lo = _mm512_maskz_loadu_ps(k0, A + (i0 + r) * ars + p0);
                        hi = _mm512_maskz_loadu_ps(k1, A + (i0 + r) * ars + p0 + 16);
                    }
                    split32(lo, hi, parts, part);
                    for (int i = 0; i < parts; i++) _mm512_storeu_si512(tile + i * part_stride + r * 32, part[i]);
                }
            } else { /* pairs of k rows interleaved, then a 32-bit transpose */
                const __mmask16 km = tail_mask(m - i0);
                __m512i t[AMX_PARTS][16];
                for (int q = 0; q < 16; q++) {
                    __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
                    if (p0 + 2 * q < k) x0 = _mm512_maskz_loadu_ps(km, A + i0 + (p0 + 2 * q) * acs);
                    if (p0 + 2 * q + 1 < k) x1 = _mm512_maskz_loadu_ps(km, A + i0 + (p0 + 2 * q + 1) * acs);
                    split32(x0, x1, parts, part);
                    for (int i = 0; i < parts; i++) t[i][q] = _mm512_permutexvar_epi16(ileave, part[i]);
                }
                for (int i = 0; i < parts; i++) {
                    transpose16x16_epi32(t[i]);
                    for (int r = 0; r < 16; r++) _mm512_storeu_si512(tile + i * part_stride + r * 32, t[i][r]);
                }
            }
        }
}

/* Pack B (k, n), rows ldb apart, as tiles (nt, kt) into the view dst; overwrites. */
static void amx_pack_b(amx_view dst, const float *B, int64_t ldb, int64_t k, int64_t n) {
    const int parts = dst.parts;
    const int64_t part_stride = dst.part_stride;
    const __m512i ileave = interleave_idx();
    for (int64_t nt = 0; nt < ma_cdiv(n, 16); nt++) {
        const __mmask16 nm = tail_mask(n - nt * 16);
        for (int64_t kt = 0; kt < ma_cdiv(k, 32); kt++) {
            uint16_t *tile = dst.p + nt * dst.os + kt * dst.ks;
            for (int q = 0; q < 16; q++) {
                const int64_t p = kt * 32 + 2 * q;
                __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
                if (p < k) x0 = _mm512_maskz_loadu_ps(nm, B + p * ldb + nt * 16);
                if (p + 1 < k) x1 = _mm512_maskz_loadu_ps(nm, B + (p + 1) * ldb + nt * 16);
                __m512i part[AMX_PARTS];
                split32(x0, x1, parts, part);
                for (int i = 0; i < parts; i++)
                    _mm512_storeu_si512(tile + i * part_stride + q * 32, _mm512_permutexvar_epi16(ileave, part[i]));
            }
        }
    }
}

/* ---- the matrix product on tiles ------------------------------------------ */

/* C tile (16 x 16 float32) at rows i0, columns j0 of C (m, n): a tile inside
 * C is loaded and stored in place, one at an edge through buf. */
typedef struct {
    float *ptr;
    int64_t stride_bytes;
    int edge;
} ctile;

static inline ctile ctile_begin(float *C, int64_t ldc, int64_t m, int64_t n, int64_t i0, int64_t j0, int load,
                                float *buf) {
    ctile t = {C + i0 * ldc + j0, ldc * (int64_t)sizeof(float), 0};
    if (i0 + 16 <= m && j0 + 16 <= n) return t;
    const __mmask16 nm = tail_mask(n - j0);
    for (int r = 0; r < 16; r++)
        _mm512_storeu_ps(buf + r * 16, load && i0 + r < m ? _mm512_maskz_loadu_ps(nm, C + (i0 + r) * ldc + j0)
                                                          : _mm512_setzero_ps());
    t.ptr = buf, t.stride_bytes = 64, t.edge = 1;
    return t;
}

static inline void ctile_end(const ctile *t, float *C, int64_t ldc, int64_t m, int64_t n, int64_t i0, int64_t j0) {
    if (!t->edge) return;
    const __mmask16 nm = tail_mask(n - j0);
    for (int r = 0; r < 16 && i0 + r < m; r++)
        _mm512_mask_storeu_ps(C + (i0 + r) * ldc + j0, nm, _mm512_loadu_ps(t->ptr + r * 16));
}

/* MT x NT (1 or 2) C tiles += sum over k tiles and parts (i, j), i + j < terms,
 * of A_i B_j. Tile numbers are immediates, hence the constant MT, NT. The
 * parts' products run in an order that keeps the loaded tiles: A_i stays
 * while B_j changes, and the last B part loaded is used first by the next A
 * part (i = 0: j = 2, 1, 0; i = 1: j = 0, 1; i = 2: j = 0): 16 tile loads
 * for 24 products at 3 parts instead of 24. */
static inline __attribute__((always_inline)) void amx_block(const int MT, const int NT, amx_view a, int64_t mt,
                                                            amx_view b, int64_t nt, int64_t nkt, int terms) {
    for (int64_t kt = 0; kt < nkt; kt++) {
        int loaded = -1; /* the B part in tiles 6, 7 */
        for (int i = 0; i < a.parts && i < terms; i++) {
            const uint16_t *a0 = a.p + i * a.part_stride + mt * a.os + kt * a.ks;
            _tile_loadd(4, a0, 64);
            if (MT == 2) _tile_loadd(5, a0 + a.os, 64);
            const int nj = b.parts < terms - i ? b.parts : terms - i; /* j < nj */
            int order[AMX_PARTS], n = 0; /* the loaded part first, the others descending */
            if (loaded >= 0 && loaded < nj) order[n++] = loaded;
            for (int j = nj - 1; j >= 0; j--)
                if (j != loaded) order[n++] = j;
            for (int x = 0; x < nj; x++) {
                const int j = order[x];
                if (j != loaded) {
                    const uint16_t *b0 = b.p + j * b.part_stride + nt * b.os + kt * b.ks;
                    _tile_loadd(6, b0, 64);
                    if (NT == 2) _tile_loadd(7, b0 + b.os, 64);
                    loaded = j;
                }
                _tile_dpbf16ps(0, 4, 6);
                if (NT == 2) _tile_dpbf16ps(1, 4, 7);
                if (MT == 2) _tile_dpbf16ps(2, 5, 6);
                if (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
}

/* C (m, n) = [C +] A (m, k) @ B (k, n) from packed views; the tiles must be
 * configured (amx_configure). */
static void amx_gemm(int64_t m, int64_t n, int64_t k, amx_view a, amx_view b, float *C, int64_t ldc,
                     int accumulate, int terms) {
    float cbuf[4][256] __attribute__((aligned(64)));
    const int64_t nmt = ma_cdiv(m, 16), nnt = ma_cdiv(n, 16), nkt = ma_cdiv(k, 32);
    for (int64_t mt = 0; mt < nmt; mt += 2)
        for (int64_t nt = 0; nt < nnt; nt += 2) {
            const int MT = nmt - mt >= 2 ? 2 : 1, NT = nnt - nt >= 2 ? 2 : 1;
            ctile ct[4];
            for (int x = 0; x < 4; x++)
                if ((x >> 1) < MT && (x & 1) < NT)
                    ct[x] = ctile_begin(C, ldc, m, n, (mt + (x >> 1)) * 16, (nt + (x & 1)) * 16, accumulate, cbuf[x]);
            if (accumulate) {
                _tile_loadd(0, ct[0].ptr, ct[0].stride_bytes);
                if (NT == 2) _tile_loadd(1, ct[1].ptr, ct[1].stride_bytes);
                if (MT == 2) _tile_loadd(2, ct[2].ptr, ct[2].stride_bytes);
                if (MT == 2 && NT == 2) _tile_loadd(3, ct[3].ptr, ct[3].stride_bytes);
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            }
            if (MT == 2 && NT == 2) amx_block(2, 2, a, mt, b, nt, nkt, terms);
            else if (MT == 2) amx_block(2, 1, a, mt, b, nt, nkt, terms);
            else if (NT == 2) amx_block(1, 2, a, mt, b, nt, nkt, terms);
            else amx_block(1, 1, a, mt, b, nt, nkt, terms);
            _tile_stored(0, ct[0].ptr, ct[0].stride_bytes);
            if (NT == 2) _tile_stored(1, ct[1].ptr, ct[1].stride_bytes);
            if (MT == 2) _tile_stored(2, ct[2].ptr, ct[2].stride_bytes);
            if (MT == 2 && NT == 2) _tile_stored(3, ct[3].ptr, ct[3].stride_bytes);
            for (int x = 0; x < 4; x++)
                if ((x >> 1) < MT && (x & 1) < NT)
                    ctile_end(&ct[x], C, ldc, m, n, (mt + (x >> 1)) * 16, (nt + (x & 1)) * 16);
        }
}

/* The same where A is a view into a longer packed matrix (V^T of a whole
 * head) whose columns past k are other keys: A's last k tile is copied into
 * buf with those columns zeroed, so B's zero padding never meets them
 * (0 * inf would be NaN). */
static void amx_gemm_kclip(int64_t m, int64_t n, int64_t k, amx_view a, amx_view b, float *C, int64_t ldc,
                           int accumulate, int terms, uint16_t *buf) {
    const int64_t kfull = k / 32 * 32;
    if (kfull > 0) {
        amx_gemm(m, n, kfull, a, b, C, ldc, accumulate, terms);
        accumulate = 1;
    }
    if (kfull == k) return;
    const int64_t nmt = ma_cdiv(m, 16), rem = k - kfull;
    const __mmask32 keep = (__mmask32)((1ull << rem) - 1);
    const amx_view ak = amx_krows(a, kfull);
    for (int i = 0; i < a.parts; i++)
        for (int64_t mt = 0; mt < nmt; mt++) {
            const uint16_t *src = ak.p + i * a.part_stride + mt * a.os;
            uint16_t *dst = buf + (i * nmt + mt) * AMX_TILE;
            for (int r = 0; r < 16; r++)
                _mm512_storeu_si512(dst + r * 32, _mm512_maskz_mov_epi16(keep, _mm512_loadu_si512(src + r * 32)));
        }
    const amx_view at = amx_layout(buf, nmt, 1, a.parts, 0);
    amx_gemm(m, n, rem, at, amx_krows(b, kfull), C, ldc, accumulate, terms);
}

/* The building block with float32 operands, as the other variants have it
 * (the C harness checks it): packs chunks of A and B on the stack. */
#define AMX_MC 64
#define AMX_KC 128
#define AMX_NC 64
static void gemm_amx_terms(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs,
                           const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate, int terms) {
    uint16_t ap[AMX_PARTS * (AMX_MC / 16) * (AMX_KC / 32) * AMX_TILE] __attribute__((aligned(64)));
    uint16_t bp[AMX_PARTS * (AMX_NC / 16) * (AMX_KC / 32) * AMX_TILE] __attribute__((aligned(64)));
    if (k <= 0) {
        if (!accumulate)
            for (int64_t i = 0; i < m; i++) memset(C + i * ldc, 0, (size_t)n * sizeof(float));
        return;
    }
    amx_configure();
    for (int64_t i0 = 0; i0 < m; i0 += AMX_MC) {
        const int64_t mc = ma_min(AMX_MC, m - i0);
        for (int64_t p0 = 0; p0 < k; p0 += AMX_KC) {
            const int64_t kc = ma_min(AMX_KC, k - p0);
            const amx_view av = amx_a_layout(ap, mc, kc, terms, 0);
            amx_pack_a(av, A + i0 * ars + p0 * acs, ars, acs, mc, kc);
            for (int64_t j0 = 0; j0 < n; j0 += AMX_NC) {
                const int64_t nc = ma_min(AMX_NC, n - j0);
                const amx_view bv = amx_b_layout(bp, kc, nc, terms, 0);
                amx_pack_b(bv, B + p0 * ldb + j0, ldb, kc, nc);
                amx_gemm(mc, nc, kc, av, bv, C + i0 * ldc + j0, ldc, accumulate || p0 > 0, terms);
            }
        }
    }
    _tile_release();
}

static void gemm_amx2(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                      int64_t ldb, float *C, int64_t ldc, int accumulate) {
    gemm_amx_terms(m, n, k, A, ars, acs, B, ldb, C, ldc, accumulate, 2);
}

static void gemm_amx3(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                      int64_t ldb, float *C, int64_t ldc, int accumulate) {
    gemm_amx_terms(m, n, k, A, ars, acs, B, ldb, C, ldc, accumulate, 3);
}

/* The harness tests the two precisions' GEMMs; the other blocks are AVX-512's. */
const ma_blocks ma_blocks_amx2 = {"amx2", gemm_amx2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
const ma_blocks ma_blocks_amx3 = {"amx3", gemm_amx3, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};

/* ---- the instance: the template's loops, AVX-512 blocks, tile hooks -------------
 *
 * The loops, masks and softmax are attention_tmpl.h's; the building blocks
 * are AVX-512's (blocks_avx512.h); the tile hooks below do the tile path's
 * products on AMX tiles. */
#define MA_TILE_HOOKS
#define FN(name) name##_amx
#define BLK(name) name##_avx512
#include "attention_tmpl.h"

/* Parts per operand and product terms, by dtype (see the top): inputs (q, k,
 * v, dout) and computed operands (P, dS). */
typedef struct {
    int in, pd, terms;
} amx_prec;

static amx_prec amx_precision(ma_dtype dt) {
    if (dt == MA_BF16) return (amx_prec){1, 2, 2};
    if (dt == MA_F16) return (amx_prec){2, 2, 2};
    return (amx_prec){3, 3, 3};
}

/* Carves n elements of T from *x, rounded up to a cache line. */
#define CARVE(T, x, n) ((T *)ma_carve((void **)(x), (size_t)(n) * sizeof(T)))
static inline void *ma_carve(void **x, size_t bytes) {
    void *p = *x;
    *x = (char *)*x + ma_round_up(bytes, MA_CACHE_LINE);
    return p;
}

static inline void scale_inplace(float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

/* ---- forward hooks ----------------------------------------------------------
 * Per (b, hkv), once per thread: K as A (Lk, D) and V^T as A (Dv, Lk).
 * Per item (b, h, q-block): Q^T as B (D, nr). Per key block:
 *   sT (nc, nr) = K Q^T, times scale        (fwd_scores)
 *   oT (Dv, nr) = alpha oT + V^T P^T        (fwd_pv; P^T = sT packed as B)
 * O is kept transposed, oT, and turned into rows by fwd_o_rows. */
typedef struct {
    uint16_t *ka, *vta, *qb, *pb, *clip;
    float *rows;
} fwd_amx_scratch;

/* ---- backward hooks -----------------------------------------------------------
 * dk, dv accumulate transposed, so that P and dS are packed from rows only:
 *   per (b, hkv), for each of the G heads: Q as A (Lq, D), Q^T as A (D, Lq),
 *     dO as A (Lq, Dv), dO^T as A (Dv, Lq)                       (bwd_group)
 *   per key block: K^T as B (D, nc), V^T as B (Dv, nc), K as B (nc, D)   (bwd_keys)
 *   per tile:  s = scale Q K^T;  dP = dO V^T                    (bwd_scores, bwd_dp)
 *              dK^T += Q^T dS,  dQ += dS K,  dV^T += dO^T (hm P)  (bwd_accum) */
typedef struct {
    uint16_t *qa, *qta, *ga, *gta, *ktb, *vtb, *kb, *pb, *dsb, *dsa;
    float *rows;
} bwd_amx_scratch;

/* One thread's hook state, carved at the start of its hooks' scratch. */
struct tiles_amx {
    amx_prec pr;
    int64_t b, hk, nr, j0, nc;
    /* forward */
    const ma_attn_fwd_params *fp;
    fwd_scratch_amx *ft;
    ma_scratch_header *hdr;
    fwd_amx_scratch fa;
    amx_view ka, vta, qb, pb;
    /* backward */
    const ma_attn_bwd_params *bp;
    bwd_scratch_amx *bt;
    bwd_amx_scratch ba;
    amx_view ktb, vtb, kb, pbb, dsb, dsa;
    float *dkT, *dvT; /* (D, nc), (Dv, nc): in t->kT, t->vT, after packing K^T and V^T from them */
};

static size_t fwd_amx_bytes(const ma_attn_fwd_params *p, fwd_amx_scratch *t, void *base) {
    const amx_prec pr = amx_precision(p->a.dtype);
    const int64_t BQ = p->a.block_q, BK = p->a.block_k, D = p->a.D, Dv = p->a.Dv;
    void *x = base;
    fwd_amx_scratch s;
    s.ka = CARVE(uint16_t, &x, pr.in * amx_a_elems(p->a.Lk, D));
    s.vta = CARVE(uint16_t, &x, pr.in * amx_a_elems(Dv, p->a.Lk));
    s.qb = CARVE(uint16_t, &x, pr.in * amx_b_elems(D, BQ));
    s.pb = CARVE(uint16_t, &x, pr.pd * amx_b_elems(BK, BQ));
    s.clip = CARVE(uint16_t, &x, pr.in * ma_cdiv(Dv, 16) * AMX_TILE);
    s.rows = CARVE(float, &x, (BQ > BK ? BQ : BK) * (D > Dv ? D : Dv)); /* K, V rows; out rows */
    if (t) *t = s;
    return (size_t)((char *)x - (char *)base);
}

static int tiles_apply_amx(const ma_attn_fwd_params *p) {
    return !p->weights; /* the weights need every score again: the generic products */
}

static size_t tiles_fwd_scratch_bytes_amx(const ma_attn_fwd_params *p) {
    return ma_round_up(sizeof(struct tiles_amx), MA_CACHE_LINE) + fwd_amx_bytes(p, NULL, NULL);
}

static void tiles_fwd_begin_amx(tiles_amx **T, const ma_attn_fwd_params *p, fwd_scratch_amx *t,
                                ma_scratch_header *hdr, void *extra) {
    tiles_amx *s = (tiles_amx *)extra;
    const int64_t BQ = p->a.block_q, BK = p->a.block_k;
    s->pr = amx_precision(p->a.dtype);
    s->fp = p, s->ft = t, s->hdr = hdr;
    fwd_amx_bytes(p, &s->fa, (char *)extra + ma_round_up(sizeof(struct tiles_amx), MA_CACHE_LINE));
    s->ka = amx_a_layout(s->fa.ka, p->a.Lk, p->a.D, s->pr.in, 0);
    s->vta = amx_a_layout(s->fa.vta, p->a.Dv, p->a.Lk, s->pr.in, 1);
    s->qb = amx_b_layout(s->fa.qb, p->a.D, BQ, s->pr.in, 0);
    s->pb = amx_b_layout(s->fa.pb, BK, BQ, s->pr.pd, 0);
    amx_configure();
    *T = s;
}

/* Packs K rows as A and V^T as A of head (b, hk), unless this thread's cache holds them. */
static void fwd_pack_head(tiles_amx *s, int64_t b, int64_t hk) {
    const ma_attn_fwd_params *p = s->fp;
    const int64_t key = b * 65536 + hk + 1, Lk = p->a.Lk, D = p->a.D, Dv = p->a.Dv, BK = p->a.block_k;
    if (s->hdr->tag[0] == key) return;
    for (int64_t r0 = 0; r0 < Lk; r0 += BK) {
        const int64_t nr = ma_min(BK, Lk - r0);
        int64_t ld;
        const float *k_r = rows_amx(p->a.k, p->a.dtype, p->a.k_stride, b, hk, r0, nr, D, s->fa.rows, &ld);
        amx_pack_a(amx_rows(s->ka, r0), k_r, ld, 1, nr, D);
        const float *v_r = rows_amx(p->a.v, p->a.dtype, p->a.v_stride, b, hk, r0, nr, Dv, s->fa.rows, &ld);
        amx_pack_a(amx_krows(s->vta, r0), v_r, 1, ld, Dv, nr);
    }
    s->hdr->tag[0] = key;
}

static void tiles_fwd_query_amx(tiles_amx *s, int64_t b, int64_t h, int64_t hk, int64_t i0, int64_t nr) {
    const ma_attn_fwd_params *p = s->fp;
    s->b = b, s->hk = hk, s->nr = nr;
    fwd_pack_head(s, b, hk);
    load_tile_t_amx(s->ft->qT, p->a.q, p->a.dtype, p->a.q_stride, b, h, i0, nr, p->a.D, 1);
    amx_pack_b(s->qb, s->ft->qT, nr, p->a.D, nr);
}

static void tiles_fwd_scores_amx(tiles_amx *s, float *sT, int64_t i0, int64_t j0, int64_t nc) {
    (void)i0;
    amx_gemm(nc, s->nr, s->fp->a.D, amx_rows(s->ka, j0), s->qb, sT, s->nr, 0, s->pr.terms);
    scale_inplace(sT, nc * s->nr, (float)s->fp->a.scale);
}

static void tiles_fwd_pv_amx(tiles_amx *s, float *oT, const float *alpha, const float *sT, int64_t i0, int64_t j0,
                             int64_t nc) {
    (void)i0;
    const int64_t nr = s->nr, Dv = s->fp->a.Dv;
    if (alpha)
        for (int64_t d = 0; d < Dv; d++)
            for (int64_t r = 0; r < nr; r++) oT[d * nr + r] *= alpha[r];
    amx_pack_b(s->pb, sT, nr, nc, nr);
    amx_gemm_kclip(Dv, nr, nc, amx_krows(s->vta, j0), s->pb, oT, nr, 1, s->pr.terms, s->fa.clip);
}

static float *tiles_fwd_o_rows_amx(tiles_amx *s, float *oT) {
    transpose_avx512(s->fa.rows, oT, s->nr, s->fp->a.Dv, s->nr, 1);
    return s->fa.rows;
}

static void tiles_end_amx(void) { _tile_release(); }

static size_t bwd_amx_bytes(const ma_attn_bwd_params *p, bwd_amx_scratch *t, void *base) {
    const amx_prec pr = amx_precision(p->a.dtype);
    const int64_t BQ = p->a.block_q, BK = p->a.block_k, D = p->a.D, Dv = p->a.Dv, G = p->a.H / p->a.Hkv;
    const int64_t Lq = p->a.Lq;
    void *x = base;
    bwd_amx_scratch s;
    s.qa = CARVE(uint16_t, &x, G * pr.in * amx_a_elems(Lq, D));
    s.qta = CARVE(uint16_t, &x, G * pr.in * amx_a_elems(D, Lq));
    s.ga = CARVE(uint16_t, &x, G * pr.in * amx_a_elems(Lq, Dv));
    s.gta = CARVE(uint16_t, &x, G * pr.in * amx_a_elems(Dv, Lq));
    s.ktb = CARVE(uint16_t, &x, pr.in * amx_b_elems(D, BK));
    s.vtb = CARVE(uint16_t, &x, pr.in * amx_b_elems(Dv, BK));
    s.kb = CARVE(uint16_t, &x, pr.in * amx_b_elems(BK, D));
    s.pb = CARVE(uint16_t, &x, pr.pd * amx_b_elems(BQ, BK));
    s.dsb = CARVE(uint16_t, &x, pr.pd * amx_b_elems(BQ, BK));
    s.dsa = CARVE(uint16_t, &x, pr.pd * amx_a_elems(BQ, BK));
    s.rows = CARVE(float, &x, (BQ > BK ? BQ : BK) * (D > Dv ? D : Dv));
    if (t) *t = s;
    return (size_t)((char *)x - (char *)base);
}

static size_t tiles_bwd_scratch_bytes_amx(const ma_attn_bwd_params *p) {
    return ma_round_up(sizeof(struct tiles_amx), MA_CACHE_LINE) + bwd_amx_bytes(p, NULL, NULL);
}

static void tiles_bwd_begin_amx(tiles_amx **T, const ma_attn_bwd_params *p, bwd_scratch_amx *t, void *extra) {
    tiles_amx *s = (tiles_amx *)extra;
    const int64_t BQ = p->a.block_q, BK = p->a.block_k, D = p->a.D, Dv = p->a.Dv;
    s->pr = amx_precision(p->a.dtype);
    s->bp = p, s->bt = t;
    bwd_amx_bytes(p, &s->ba, (char *)extra + ma_round_up(sizeof(struct tiles_amx), MA_CACHE_LINE));
    s->ktb = amx_b_layout(s->ba.ktb, D, BK, s->pr.in, 0);
    s->vtb = amx_b_layout(s->ba.vtb, Dv, BK, s->pr.in, 0);
    s->kb = amx_b_layout(s->ba.kb, BK, D, s->pr.in, 0);
    s->pbb = amx_b_layout(s->ba.pb, BQ, BK, s->pr.pd, 0);
    s->dsb = amx_b_layout(s->ba.dsb, BQ, BK, s->pr.pd, 0);
    s->dsa = amx_a_layout(s->ba.dsa, BQ, BK, s->pr.pd, 0);
    s->dkT = t->kT, s->dvT = t->vT;
    amx_configure();
    *T = s;
}

/* The packed operands of head g of the group: Q (Lq, D), Q^T (D, Lq), dO (Lq, Dv), dO^T (Dv, Lq). */
static amx_view bwd_view(const tiles_amx *s, int which, int64_t g) {
    const ma_attn_bwd_params *p = s->bp;
    const int64_t Lq = p->a.Lq, D = p->a.D, Dv = p->a.Dv, in = s->pr.in;
    switch (which) {
    case 0: return amx_a_layout(s->ba.qa + g * in * amx_a_elems(Lq, D), Lq, D, in, 0);
    case 1: return amx_a_layout(s->ba.qta + g * in * amx_a_elems(D, Lq), D, Lq, in, 1);
    case 2: return amx_a_layout(s->ba.ga + g * in * amx_a_elems(Lq, Dv), Lq, Dv, in, 0);
    default: return amx_a_layout(s->ba.gta + g * in * amx_a_elems(Dv, Lq), Dv, Lq, in, 1);
    }
}

/* src[b, h] rows as A (L, ncol) into rows_a (row-major) and transposed as
 * A (ncol, L) into cols_a (k-major). */
static void bwd_pack_rows(const tiles_amx *s, const void *src, const int64_t st[4], int64_t b, int64_t h,
                          int64_t ncol, amx_view rows_a, amx_view cols_a) {
    const ma_attn_bwd_params *p = s->bp;
    const int64_t BQ = p->a.block_q, L = p->a.Lq;
    for (int64_t r0 = 0; r0 < L; r0 += BQ) {
        const int64_t nr = ma_min(BQ, L - r0);
        int64_t ld;
        const float *x = rows_amx(src, p->a.dtype, st, b, h, r0, nr, ncol, s->ba.rows, &ld);
        amx_pack_a(amx_rows(rows_a, r0), x, ld, 1, nr, ncol);
        amx_pack_a(amx_krows(cols_a, r0), x, 1, ld, ncol, nr);
    }
}

static void tiles_bwd_group_amx(tiles_amx *s, int64_t b, int64_t hk) {
    const ma_attn_bwd_params *p = s->bp;
    const int64_t G = p->a.H / p->a.Hkv;
    s->b = b, s->hk = hk;
    for (int64_t g = 0; g < G; g++) {
        const int64_t h = hk * G + g;
        bwd_pack_rows(s, p->a.q, p->a.q_stride, b, h, p->a.D, bwd_view(s, 0, g), bwd_view(s, 1, g));
        bwd_pack_rows(s, p->dout, p->dout_stride, b, h, p->a.Dv, bwd_view(s, 2, g), bwd_view(s, 3, g));
    }
}

static void tiles_bwd_keys_amx(tiles_amx *s, int64_t j0, int64_t nc) {
    const ma_attn_bwd_params *p = s->bp;
    const int64_t D = p->a.D, Dv = p->a.Dv, b = s->b, hk = s->hk;
    s->j0 = j0, s->nc = nc;
    int64_t ldk;
    const float *k_j = rows_amx(p->a.k, p->a.dtype, p->a.k_stride, b, hk, j0, nc, D, s->ba.rows, &ldk);
    amx_pack_b(s->kb, k_j, ldk, nc, D);
    load_tile_t_amx(s->dkT, p->a.k, p->a.dtype, p->a.k_stride, b, hk, j0, nc, D, 1);
    amx_pack_b(s->ktb, s->dkT, nc, D, nc);
    load_tile_t_amx(s->dvT, p->a.v, p->a.dtype, p->a.v_stride, b, hk, j0, nc, Dv, 1);
    amx_pack_b(s->vtb, s->dvT, nc, Dv, nc);
    for (int64_t x = 0; x < D * nc; x++) s->dkT[x] = 0;
    for (int64_t x = 0; x < Dv * nc; x++) s->dvT[x] = 0;
}

static void tiles_bwd_scores_amx(tiles_amx *s, int64_t g, int64_t h, int64_t i0, int64_t nr) {
    (void)h;
    const ma_attn_bwd_params *p = s->bp;
    amx_gemm(nr, s->nc, p->a.D, amx_rows(bwd_view(s, 0, g), i0), s->ktb, s->bt->s, s->nc, 0, s->pr.terms);
    scale_inplace(s->bt->s, nr * s->nc, (float)p->a.scale);
}

static void tiles_bwd_dp_amx(tiles_amx *s, int64_t g, int64_t h, int64_t i0, int64_t nr) {
    (void)h;
    amx_gemm(nr, s->nc, s->bp->a.Dv, amx_rows(bwd_view(s, 2, g), i0), s->vtb, s->bt->dp, s->nc, 0, s->pr.terms);
}

static void tiles_bwd_accum_amx(tiles_amx *s, float *dq_i, int64_t g, int64_t h, int64_t i0, int64_t nr) {
    (void)h;
    const int64_t nc = s->nc, D = s->bp->a.D, Dv = s->bp->a.Dv, terms = s->pr.terms;
    const bwd_scratch_amx *t = s->bt;
    amx_pack_b(s->dsb, t->dp, nc, nr, nc);
    amx_gemm(D, nc, nr, amx_krows(bwd_view(s, 1, g), i0), s->dsb, s->dkT, nc, 1, terms);
    amx_pack_a(s->dsa, t->dp, nc, 1, nr, nc);
    amx_gemm(nr, D, nc, s->dsa, s->kb, dq_i, D, 1, terms);
    amx_pack_b(s->pbb, t->s, nc, nr, nc);
    amx_gemm(Dv, nc, nr, amx_krows(bwd_view(s, 3, g), i0), s->pbb, s->dvT, nc, 1, terms);
}

static void tiles_bwd_keys_end_amx(tiles_amx *s, int64_t nc) {
    transpose_avx512(s->bt->dk, s->dkT, nc, s->bp->a.D, nc, 1);
    transpose_avx512(s->bt->dv, s->dvT, nc, s->bp->a.Dv, nc, 1);
}
