/*
 * attention_tmpl.h -- masked attention forward and backward, written once.
 *
 * Instantiated once per (accumulation type, instruction set) by a small
 * instance file (blocks.h, "An instance"): scalar.c (the float reference and
 * the float64 instance), avx2.c, avx512.c, neon.c; sve128.c, sve256.c,
 * sve512.c, sve1024.c, sve2048.c (through sve_instance.h); with tile hooks
 * (through tiles_hooks.h) amx.c, avx512bf16.c, svebf16.c. Every instance file
 * is named here (tests/project/test_docs.py checks). The instance defines
 *   FN(name)    its suffix: every function here is FN(...), static
 *   BLK(name)   the suffix of the building blocks it calls (blocks.h)
 *   MA_ACC_F64  for double accumulation (float64 inputs); float otherwise
 *   MA_TILE_HOOKS  when it supplies the tile products (those with tile hooks; tiles_contract.h lists the hooks)
 * and lists the kernels it gets (attn_fwd_<suffix>, ...) in its
 * ma_attn_kernels_<suffix> table, by their full names.
 *
 * Shapes: B, H, Hkv, Lq, Lk, D, Dv as in masked_attn.h; G = H / Hkv; a tile
 * is nr <= BQ query rows by nc <= BK keys (block_q, block_k).
 *
 * Where the masks are interpreted: FN(mask_value) (a bool or float element
 * into its additive form), FN(keys_read) (trailing key padding that is never
 * read), FN(kv_range) and FN(q_range) (causal and window block skipping),
 * FN(mask_tile_state) (an
 * attn_mask tile that blocks every entry is skipped, one that adds only
 * zeros is not added). Where they are applied: FN(add_bias), the only place
 * scores get their bias (ALiBi's too); head_mask in FN(head_scale) and the output/gradient
 * lines that use it.
 *
 * The algorithm is FlashAttention-2. The forward (and the backward's pre-pass
 * for the weights' gradient) holds one query block and streams the key blocks;
 * it works on transposed scores sT (nc, nr) = K Q^T, so that K and V are read
 * in place (no copy when they are float32 with unit last stride) and only the
 * query block is packed once (qT = scale * Q^T). Per-query statistics (max,
 * sum) are then column-wise, which vectorises across queries. The backward
 * holds key blocks (packed once as kT = scale * K^T, vT = V^T) and streams the
 * query blocks in place, on row-wise scores s (nr, nc) = Q kT, accumulating
 * dK, dV in the tile and dQ in scratch or per-chunk partial sums.
 * The forward saves only lse = m + log l per query; the backward recomputes
 * P = exp(S - lse).
 *
 * Dropout (masked_attn.h; philox.h): the keep mask of a tile is regenerated
 * wherever it is needed by DROPOUT (the blocks' dropout_X), never stored:
 * the forward drops (and rescales) P after the softmax statistics took it
 * whole, before O += P V and before the weights are written; the backward
 * drops dP = dO V^T (+ dW) before dS = P (hm dP - delta) and drops P before
 * dV += (hm P')^T dO. FN(head_dropout) is NULL when dropout is off.
 */

#include <float.h>
#include <math.h>
#include <string.h>
#if !defined(MA_ACC_F64) && defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "blocks.h"
#include "common/dtype.h"
#include "masked_attn.h"
#include "philox.h"

#ifdef MA_ACC_F64
#define ACC double
#define LOAD ma_load_f64
#define STORE ma_store_f64
#define LOG log
#define EXPF exp
#else
#define ACC float
#define LOAD ma_load_f32
#define STORE ma_store_f32
#define LOG logf
#define EXPF expf
#endif
#define GEMM BLK(gemm)
#define GEMM_ROWSCALE BLK(gemm_rowscale)
#define EXP_SUB_SUM BLK(exp_sub_sum)
#define COL_MAX BLK(col_max)
#define EXP_SUB_COL BLK(exp_sub_col)
#define TRANSPOSE BLK(transpose)
#define ROW_MAX BLK(row_max)
#define DOT_KEYS_T BLK(dot_keys_t)
#define DOT_ROWS BLK(dot_rows)
#define DOT_ROWS_I8 BLK(dot_rows_i8)
#define AXPY_KEYS BLK(axpy_keys)
#define AXPY_KEYS_I8 BLK(axpy_keys_i8)
#define DROPOUT BLK(dropout)

/* The algorithms, in the order their pieces build on each other. */
#include "shared_tmpl.h"   /* tiles, masks, sequences */
#include "tiles_contract.h" /* the scratch types; the tile hooks' and instances' contract */
#include "forward_tmpl.h"  /* the tile path and the forward task */
#include "decode_tmpl.h"   /* short query blocks over the cache in place */
#include "backward_tmpl.h" /* the backward's pieces and the weights' pre-pass */
#include "fused_bwd_tmpl.h" /* the backward's pass and its reduce */

#undef FWD_STEP
#undef ROWS_SCORES

#undef ACC
#undef LOAD
#undef STORE
#undef LOG
#undef EXPF
#undef TANH
#undef GEMM
#undef GEMM_ROWSCALE
#undef EXP_SUB_SUM
#undef COL_MAX
#undef EXP_SUB_COL
#undef TRANSPOSE
#undef ROW_MAX
#undef DOT_KEYS_T
#undef DOT_ROWS
#undef DOT_ROWS_I8
#undef AXPY_KEYS
#undef AXPY_KEYS_I8
#undef DROPOUT
#undef FN
#undef BLK
#undef MA_ACC_F64
#undef MA_TILE_HOOKS
