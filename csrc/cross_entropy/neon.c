/* neon.c -- the cross-entropy kernels on AArch64's Advanced SIMD: cross_entropy_tmpl.h's
 * loops over the row blocks of blocks_simd.h on common/simd_neon.h (no flags: every
 * aarch64 CPU has NEON). */
#include "common/simd_neon.h"

#define BLK(name) name##_neon
#include "blocks_simd.h"
#define FN(name) name##_neon
#include "cross_entropy_tmpl.h"

const ma_ce_blocks ma_ce_blocks_neon = {"neon", row_stats_neon, row_grad_neon};
const ma_ce_kernels ma_ce_kernels_neon = {ce_fwd_neon, ce_bwd_neon};
