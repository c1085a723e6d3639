/* sve512.c -- the cross-entropy kernels on SVE with 512-bit vectors: cross_entropy_tmpl.h's
 * loops over the row blocks of blocks_simd.h on common/simd_sve.h, compiled with
 * sve512's flags (setup.py). */
#include "common/simd_sve.h"

#define BLK(name) name##_sve512
#include "blocks_simd.h"
#define FN(name) name##_sve512
#include "cross_entropy_tmpl.h"

const ma_ce_blocks ma_ce_blocks_sve512 = {"sve512", row_stats_sve512, row_grad_sve512};
const ma_ce_kernels ma_ce_kernels_sve512 = {ce_fwd_sve512, ce_bwd_sve512};
