/* sve_instance.h -- the cross-entropy kernels on SVE at the length the including unit is
 * compiled for (sve128.c ... sve2048.c, setup.py): cross_entropy_tmpl.h's loops over the
 * row blocks of blocks_simd.h on common/simd_sve.h, named *_sveN. */
#ifndef MA_CROSS_ENTROPY_SVE_INSTANCE_H
#define MA_CROSS_ENTROPY_SVE_INSTANCE_H

#include "common/simd_sve.h"

#define BLK(name) MA_SVE_NAME(name)
#include "blocks_simd.h"
#define FN(name) MA_SVE_NAME(name)
#include "cross_entropy_tmpl.h" /* #undefs BLK and FN */

const ma_ce_blocks MA_SVE_NAME(ma_ce_blocks) = {MA_SVE_LABEL, MA_SVE_NAME(row_stats), MA_SVE_NAME(row_grad)};
const ma_ce_kernels MA_SVE_NAME(ma_ce_kernels) = {MA_SVE_NAME(ce_fwd), MA_SVE_NAME(ce_bwd)};

#endif /* MA_CROSS_ENTROPY_SVE_INSTANCE_H */
