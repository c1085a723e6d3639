/* avx512.c -- the cross-entropy kernels on AVX-512: cross_entropy_tmpl.h's loops
 * over the row blocks of blocks_simd.h on common/simd_avx512.h, compiled with
 * avx512's flags (setup.py). */
#include "common/simd_avx512.h"

#define BLK(name) name##_avx512
#include "blocks_simd.h"
#define FN(name) name##_avx512
#include "cross_entropy_tmpl.h"

const ma_ce_blocks ma_ce_blocks_avx512 = {"avx512", row_stats_avx512, row_grad_avx512};
const ma_ce_kernels ma_ce_kernels_avx512 = {ce_fwd_avx512, ce_bwd_avx512};
