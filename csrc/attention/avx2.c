/* avx2.c -- the attention kernels (attention_tmpl.h) on the AVX2 + FMA building blocks
 * of blocks_avx2.h. Compiled with -mavx2 -mfma (setup.py); dispatch.c calls it only
 * where the CPU has them (common/isa.c). */
#include "blocks_avx2.h"

#define FN(name) name##_avx2
#define BLK(name) name##_avx2
#include "attention_tmpl.h"

const ma_blocks ma_blocks_avx2 = MA_ATTN_BLOCKS(avx2);
