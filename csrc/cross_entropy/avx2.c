/* avx2.c -- the cross-entropy kernels (cross_entropy_tmpl.h) on the row
 * blocks of blocks_avx2.h, compiled with avx2's flags (setup.py). */
#include "blocks_avx2.h"

#define FN(name) name##_avx2
#define BLK(name) name##_avx2
#include "cross_entropy_tmpl.h"

const ma_ce_blocks ma_ce_blocks_avx2 = MA_CE_BLOCKS(avx2);
