/* avx512.c -- the attention kernels (attention_tmpl.h) on the AVX-512 building blocks
 * of blocks_avx512.h. Compiled with -mavx512f/bw/dq/vl (setup.py); dispatch.c calls it only
 * where the CPU has them (common/isa.c). */
#include "blocks_avx512.h"

#define FN(name) name##_avx512
#define BLK(name) name##_avx512
#include "attention_tmpl.h"

const ma_blocks ma_blocks_avx512 = MA_ATTN_BLOCKS(avx512);
