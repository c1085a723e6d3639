/* blocks.h -- the contract between the cross-entropy loops
 * (cross_entropy_tmpl.h) and the instruction sets: the row building blocks an
 * instruction set X provides as row_stats_X and row_grad_X (blocks_simd.h on
 * common/simd_X.h; the scalar reference in scalar.c), the table of them the C harness
 * (tests/c/test_ce_blocks.c) checks against the reference, and the kernels
 * of an instance, which dispatch.c picks. Private to the kernels.
 *
 * A row here is C contiguous logits x[0:C] of dtype dt (float32, bfloat16 or
 * float16), optionally with C contiguous class weights w[0:C] of the same
 * dtype (NULL: all 1). y_c = x_c, or cap tanh(x_c / cap) when cap > 0.
 */
#ifndef MA_CROSS_ENTROPY_BLOCKS_H
#define MA_CROSS_ENTROPY_BLOCKS_H

#include <stdint.h>

#include "common/isa.h"
#include "masked_attn.h"

/* What one read of a row gives. */
typedef struct {
    float m;       /* max_c y_c; -inf when every y_c is -inf; NaN or +inf make lse NaN */
    double l;      /* sum_c exp(y_c - m)   (0 when m = -inf)                          */
    double k_sum;  /* sum_c w_c            (want_dot only)                            */
    double k_dot;  /* sum_c w_c (y_c - m)  (want_dot only; y_c itself while m = -inf) */
} ma_ce_stats;

typedef struct {
    const char *name;
    /* Statistics of one row, read once (online max and sum). */
    ma_ce_stats (*row_stats)(const void *x, const void *w, ma_dtype dt, int64_t C, float cap, int want_dot);
    /* dx_c = (g_soft exp(y_c - lse) - g_w w_c) y'_c, stored as dt (overwrites;
     * dx may be x itself). The target's -g_t term is the caller's. */
    void (*row_grad)(void *dx, const void *x, const void *w, ma_dtype dt, int64_t C, float cap, float lse, float g_soft,
                     float g_w);
} ma_ce_blocks;

#define MA_CE_BLOCKS(X) {#X, row_stats_##X, row_grad_##X}

/* The kernels of one instance (cross_entropy_tmpl.h); dispatch.c picks one. */
typedef struct {
    ma_task_fn fwd, bwd;
} ma_ce_kernels;

/* The tables of every variant of MA_ISA_TABLE with row kernels of its own (sve's one per vector
 * length; the others run their fallbacks', ma_isa_runs), and the float64 kernels. */
#define MA_CE_EXTERNS(ID, name, abi, arch, bq, bk, fb, own, inst, usable) \
    MA_ROWS_##own(MA_EXTERN_##inst(ma_ce_kernels, name) MA_EXTERN_##inst(ma_ce_blocks, name))
MA_ISA_TABLE(MA_CE_EXTERNS)
#undef MA_CE_EXTERNS
extern const ma_ce_kernels ma_ce_kernels_f64;

#endif
