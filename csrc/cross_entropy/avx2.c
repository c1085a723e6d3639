/* avx2.c -- the cross-entropy kernels on AVX2 + FMA: cross_entropy_tmpl.h's loops
 * over the row blocks of blocks_simd.h on common/simd_avx2.h, compiled with
 * avx2's flags (setup.py). */
#include "common/simd_avx2.h"

#define BLK(name) name##_avx2
#include "blocks_simd.h"
#define FN(name) name##_avx2
#include "cross_entropy_tmpl.h"

const ma_ce_blocks ma_ce_blocks_avx2 = {"avx2", row_stats_avx2, row_grad_avx2};
const ma_ce_kernels ma_ce_kernels_avx2 = {ce_fwd_avx2, ce_bwd_avx2};
