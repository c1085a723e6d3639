/*
 * tiles_layout.h -- packed operands of the bfloat16 pair products: the tiles
 * every instance of tiles_hooks.h addresses, whatever the order of the
 * elements inside a tile. That order is the packer's (tiles_pack.h: AMX's and
 * VDPBF16PS's, on x86; tiles_pack_mmla.h: BFMMLA's 2 x 4 blocks, on aarch64);
 * the hooks only move between tiles, and each instance's tile_gemm reads its
 * packer's order. Portable C.
 */
#ifndef MA_TILES_LAYOUT_H
#define MA_TILES_LAYOUT_H

#include <stdint.h>

#include "common/dtype.h"
#include "masked_attn.h"

#define TILE_PARTS 3 /* at most x0, x1, x2 */
#define TILE_ELEMS 512 /* bf16 elements of one tile: 16 rows x 64 bytes */

/* Parts per operand and product terms, by dtype: inputs (q, k, v, dout) and
 * computed operands (P, dS). */
typedef struct {
    int in, pd, terms;
} tile_prec;

/* bfloat16's, on every instance: inputs one part (exact), P and dS two, the products of parts
 * i + j < 2 (docs/design.md, section 6). */
static const tile_prec tile_prec_bf16 = {1, 2, 2};

/* ---- packed operands --------------------------------------------------------
 *
 * A packed operand holds the tiles of a matrix, part after part:
 *   A operand (m, k): tile (mt, kt) = rows 16 mt.., k 32 kt.. (16 x 32 bf16)
 *   B operand (k, n): tile (nt, kt) = k 32 kt.., columns 16 nt.. (32 x 16 bf16)
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
} tile_view;

static inline int64_t packed_a_elems(int64_t m, int64_t k) { return ma_cdiv(m, 16) * ma_cdiv(k, 32) * TILE_ELEMS; }
static inline int64_t packed_b_elems(int64_t k, int64_t n) { return ma_cdiv(k, 32) * ma_cdiv(n, 16) * TILE_ELEMS; }

static inline tile_view view_rows(tile_view v, int64_t r0) {
    v.p += (r0 / 16) * v.os;
    return v;
}
static inline tile_view view_krows(tile_view v, int64_t k0) {
    v.p += (k0 / 32) * v.ks;
    return v;
}

/* The layout of a packed matrix with nouter x nkt tiles per part. */
static inline tile_view view_layout(uint16_t *p, int64_t nouter, int64_t nkt, int parts, int kmajor) {
    const tile_view v = {p, nouter * nkt * TILE_ELEMS, kmajor ? TILE_ELEMS : nkt * TILE_ELEMS,
                         kmajor ? nouter * TILE_ELEMS : TILE_ELEMS, parts};
    return v;
}
static inline tile_view view_a_layout(uint16_t *p, int64_t m, int64_t k, int parts, int kmajor) {
    return view_layout(p, ma_cdiv(m, 16), ma_cdiv(k, 32), parts, kmajor);
}
static inline tile_view view_b_layout(uint16_t *p, int64_t k, int64_t n, int parts, int kmajor) {
    return view_layout(p, ma_cdiv(n, 16), ma_cdiv(k, 32), parts, kmajor);
}

#endif /* MA_TILES_LAYOUT_H */
