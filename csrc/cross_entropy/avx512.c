/* avx512.c -- the cross-entropy kernels (cross_entropy_tmpl.h) on the row
 * blocks of blocks_avx512.h, compiled with avx512's flags (setup.py). */
#include "blocks_avx512.h"

#define FN(name) name##_avx512
#define BLK(name) name##_avx512
#include "cross_entropy_tmpl.h"

const ma_ce_blocks ma_ce_blocks_avx512 = MA_CE_BLOCKS(avx512);
