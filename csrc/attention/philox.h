/* philox.h -- the dropout generator (masked_attn.h, "dropout"): Philox-4x32-10
 * (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), a
 * counter-based generator: 10 rounds of a keyed bijection on a 128-bit
 * counter. Written from the published description. Private to the kernels.
 *
 * Element (b, h, i, j) of a call keeps or drops from (seed, offset, b, h, i, j)
 * alone: counter {j / 8, i, (uint32)(b H + h), (uint32)offset}, key
 * {(uint32)seed, (uint32)(seed >> 32) ^ (uint32)(offset >> 32)}; one call
 * gives 4 x 32 bits = 8 numbers u of 16 bits, u of key j in word (j % 8) / 2,
 * bits 16 (j % 2) ..; the element is kept iff u >= thr = round(p 65536).
 * Results never depend on tiles, threads or the instruction set. The vector
 * blocks (dropout_X in blocks_simd.h) run 8 or 16 such counters side by side,
 * one per query row. */
#ifndef MA_ATTENTION_PHILOX_H
#define MA_ATTENTION_PHILOX_H

#include <math.h>
#include <stdint.h>

#include "masked_attn.h"

#define MA_PHILOX_M0 0xD2511F53u
#define MA_PHILOX_M1 0xCD9E8D57u
#define MA_PHILOX_W0 0x9E3779B9u
#define MA_PHILOX_W1 0xBB67AE85u

/* The dropout of one head (b, h) of a call: what every block needs. */
typedef struct {
    uint32_t k0, k1; /* key */
    uint32_t c2, c3; /* the counter words of the head */
    int32_t thr;     /* drop iff u < thr; 0 .. 65536 */
    double scale;    /* 1 / (1 - p) */
} ma_dropout;

static inline int ma_dropout_on(const ma_attn_args *a) { return a->opts.dropout_p > 0; }

static inline ma_dropout ma_dropout_head(const ma_attn_args *a, int64_t b, int64_t h) {
    ma_dropout d;
    const uint64_t bh = (uint64_t)(b * a->H + h);
    d.k0 = (uint32_t)a->opts.dropout_seed;
    d.k1 = (uint32_t)(a->opts.dropout_seed >> 32) ^ (uint32_t)(a->opts.dropout_offset >> 32);
    d.c2 = (uint32_t)bh;
    d.c3 = (uint32_t)a->opts.dropout_offset;
    double t = nearbyint(a->opts.dropout_p * 65536.0);
    d.thr = t < 0 ? 0 : t > 65536 ? 65536 : (int32_t)t;
    d.scale = a->opts.dropout_p < 1 ? 1.0 / (1.0 - a->opts.dropout_p) : 0.0; /* p = 1 drops everything */
    return d;
}

/* c (4 words) = Philox-4x32-10(c, key {k0, k1}), in place. */
static inline void ma_philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 10; round++) {
        const uint64_t p0 = (uint64_t)MA_PHILOX_M0 * c[0], p1 = (uint64_t)MA_PHILOX_M1 * c[2];
        const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0, hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c[0] = hi1 ^ c[1] ^ k0;
        c[1] = lo1;
        c[2] = hi0 ^ c[3] ^ k1;
        c[3] = lo0;
        k0 += MA_PHILOX_W0;
        k1 += MA_PHILOX_W1;
    }
}

/* Whether element (i, j) of the head is kept: the definition the vector
 * blocks reproduce. */
static inline int ma_dropout_keep(const ma_dropout *d, int64_t i, int64_t j) {
    uint32_t c[4] = {(uint32_t)(j >> 3), (uint32_t)i, d->c2, d->c3};
    ma_philox4x32_10(c, d->k0, d->k1);
    const int32_t u = (int32_t)((c[(j & 7) >> 1] >> (16 * (j & 1))) & 0xffffu);
    return u >= d->thr;
}

#endif /* MA_ATTENTION_PHILOX_H */
