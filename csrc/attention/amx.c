/*
 * amx.c -- the float-accumulating attention kernels with their matrix
 * products on AMX tiles (TDPBF16PS). Compiled with -mamx-tile -mamx-bf16
 * -mavx512bf16 and AVX-512 flags (setup.py); called only when the CPU has
 * them and Linux has granted this process the tile data state
 * (common/isa.c). Operands are packed by tiles_pack.h, the hooks are
 * tiles_hooks.h's; every other building block (exp, column max, transpose)
 * is the AVX-512 one.
 *
 * Tiles: every tile is configured as 16 rows x 64 bytes; C tiles 0-3 (a 2 x 2
 * block of 16 x 16 float32), A tiles 4-5, B tiles 6-7 (tiles_pack.h's
 * layout). C tiles at an edge go through a 16 x 16 buffer.
 *
 * Precision: bfloat16 inputs are one part (exact), float16 inputs two parts
 * (their 11 significant bits exactly), P and dS two parts (about 16 bits
 * where native bfloat16 attention keeps 8). bfloat16 takes TERMS = 2; float16
 * TERMS = 3, every product of its two-part inputs, so that dO V^T is exact to
 * float32 noise as the backward's delta = dO . (out + out_lo) is (with 2
 * terms a query that sees one key got |dq| ~ 4e-5 where it should get 0).
 * The float32 instance (MASKED_ATTN_ISA=amx only) uses TERMS = 3.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "common/simd_avx512.h"

#define BLK(name) name##_avx512 /* every block but the products: AVX-512's */
#include "blocks_simd.h"
#include "common/dtype.h"
#include "masked_attn.h"
#include "tiles_pack.h"

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
    const __mmask16 nm = vm_first(n - j0);
    for (int r = 0; r < 16; r++)
        _mm512_storeu_ps(buf + r * 16,
                         load && i0 + r < m ? _mm512_maskz_loadu_ps(nm, C + (i0 + r) * ldc + j0) : _mm512_setzero_ps());
    t.ptr = buf, t.stride_bytes = 64, t.edge = 1;
    return t;
}

static inline void ctile_end(const ctile *t, float *C, int64_t ldc, int64_t m, int64_t n, int64_t i0, int64_t j0) {
    if (!t->edge) return;
    const __mmask16 nm = vm_first(n - j0);
    for (int r = 0; r < 16 && i0 + r < m; r++)
        _mm512_mask_storeu_ps(C + (i0 + r) * ldc + j0, nm, _mm512_loadu_ps(t->ptr + r * 16));
}

/* MT x NT (1 or 2) C tiles += sum over k tiles and parts (i, j), i + j < terms,
 * of A_i B_j. Tile numbers are immediates, hence the constant MT, NT. The
 * parts' products run in an order that keeps the loaded tiles: A_i stays
 * while B_j changes, and the last B part loaded is used first by the next A
 * part (i = 0: j = 2, 1, 0; i = 1: j = 0, 1; i = 2: j = 0): 16 tile loads
 * for 24 products at 3 parts instead of 24. */
static inline __attribute__((always_inline)) void amx_block(const int MT, const int NT, tile_view a, int64_t mt,
                                                            tile_view b, int64_t nt, int64_t nkt, int terms) {
    for (int64_t kt = 0; kt < nkt; kt++) {
        int loaded = -1; /* the B part in tiles 6, 7 */
        for (int i = 0; i < a.parts && i < terms; i++) {
            const uint16_t *a0 = a.p + i * a.part_stride + mt * a.os + kt * a.ks;
            _tile_loadd(4, a0, 64);
            if (MT == 2) _tile_loadd(5, a0 + a.os, 64);
            const int nj = b.parts < terms - i ? b.parts : terms - i; /* j < nj */
            int order[TILE_PARTS], n = 0; /* the loaded part first, the others descending */
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

/* C (m, n) = [C +] A (m, k) @ B (k, n) from packed views (tiles_hooks.h); the
 * tiles must be configured (tile_begin). */
static void tile_gemm(int64_t m, int64_t n, int64_t k, tile_view a, tile_view b, float *C, int64_t ldc, int accumulate,
                      int terms) {
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

/* C (16 mtiles, 16) = A (16 mtiles, 32 nkt) @ B (32 nkt, 16) for the rows path's scores
 * (tiles_hooks.h, FN(tiles_rows_scores)): A tile (mt, kt) loaded where it lies, at
 * A + 16 mt lda + kt a_kstep with rows lda elements apart (key rows in a cache); B packed, one
 * part; C tiles 256 floats apart. Two C tiles at a time share each B tile. With pf, each A
 * tile's 16 lines are prefetched pf elements on as it is loaded (prefetch_ahead: a burst of
 * a block's prefetches before its loads stalled on the fill buffers). */
static inline void tile_key_prefetch(const uint16_t *a, int64_t lda, int64_t pf) {
    if (pf)
        for (int r = 0; r < 16; r++) prefetch_ahead(a + r * lda + pf, pf * (int64_t)sizeof(uint16_t));
}

static void tile_key_rows(int64_t mtiles, int64_t nkt, const uint16_t *A, int64_t lda, int64_t a_kstep, tile_view b,
                          float *C, int64_t pf) {
    const int64_t stride = lda * (int64_t)sizeof(uint16_t);
    int64_t mt = 0;
    for (; mt + 2 <= mtiles; mt += 2) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t kt = 0; kt < nkt; kt++) {
            const uint16_t *a0 = A + mt * 16 * lda + kt * a_kstep, *a1 = a0 + 16 * lda;
            _tile_loadd(6, b.p + kt * b.ks, 64);
            _tile_loadd(4, a0, stride);
            _tile_loadd(5, a1, stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            tile_key_prefetch(a0, lda, pf);
            tile_key_prefetch(a1, lda, pf);
        }
        _tile_stored(0, C + mt * 256, 64);
        _tile_stored(1, C + (mt + 1) * 256, 64);
    }
    if (mt < mtiles) {
        _tile_zero(0);
        for (int64_t kt = 0; kt < nkt; kt++) {
            const uint16_t *a0 = A + mt * 16 * lda + kt * a_kstep;
            _tile_loadd(6, b.p + kt * b.ks, 64);
            _tile_loadd(4, a0, stride);
            _tile_dpbf16ps(0, 4, 6);
            tile_key_prefetch(a0, lda, pf);
        }
        _tile_stored(0, C + mt * 256, 64);
    }
}
#define TILE_KEY_ROWS

static inline void tile_begin(void) { amx_configure(); }
static inline void tile_end(void) { _tile_release(); }

static tile_prec tile_precision(ma_dtype dt) {
    if (dt == MA_BF16) return tile_prec_bf16;
    if (dt == MA_F16) return (tile_prec){2, 2, 3};
    return (tile_prec){3, 3, 3};
}

/* ---- the instance: the template's loops, AVX-512 blocks, tile hooks on AMX ---- */
#define TILE_ISA amx
#define TILE_BLK avx512
#include "tiles_hooks.h"

static void gemm_amx2(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                      int64_t ldb, float *C, int64_t ldc, int accumulate) {
    tile_gemm_terms(m, n, k, A, ars, acs, B, ldb, C, ldc, accumulate, 2);
}

static void gemm_amx3(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                      int64_t ldb, float *C, int64_t ldc, int accumulate) {
    tile_gemm_terms(m, n, k, A, ars, acs, B, ldb, C, ldc, accumulate, 3);
}

/* The harness tests the two precisions' GEMMs and the integer scores (VNNI's in this unit's
 * copy of AVX-512's blocks); the other blocks are AVX-512's. */
const ma_blocks ma_blocks_amx2 = {
    .name = "amx2", .gemm = gemm_amx2, .dot_rows_i8 = dot_rows_i8_avx512, .axpy_keys_i8 = axpy_keys_i8_avx512};
const ma_blocks ma_blocks_amx3 = {.name = "amx3", .gemm = gemm_amx3};
const ma_attn_kernels ma_attn_kernels_amx = {attn_fwd_amx,        attn_bwd_delta_amx,    attn_bwd_fused_amx,
                                             attn_bwd_reduce_amx, fwd_scratch_bytes_amx, bwd_scratch_bytes_amx,
                                             attn_decode_amx,     attn_decode_merge_amx, decode_scratch_bytes_amx};
