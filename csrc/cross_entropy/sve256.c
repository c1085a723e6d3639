/* sve256.c -- the cross-entropy kernels on SVE with 256-bit vectors: cross_entropy_tmpl.h's
 * loops over the row blocks of blocks_simd.h on common/simd_sve.h, compiled with
 * sve256's flags (setup.py). */
#include "common/simd_sve.h"

#define BLK(name) name##_sve256
#include "blocks_simd.h"
#define FN(name) name##_sve256
#include "cross_entropy_tmpl.h"

const ma_ce_blocks ma_ce_blocks_sve256 = {"sve256", row_stats_sve256, row_grad_sve256};
const ma_ce_kernels ma_ce_kernels_sve256 = {ce_fwd_sve256, ce_bwd_sve256};
