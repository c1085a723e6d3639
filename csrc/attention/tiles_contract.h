/*
 * tiles_contract.h -- the tile contract, declared once (attention_tmpl.h includes it before
 * the algorithms; every instance sees the first part).
 *
 * 1. The template's scratch types, named here so the hooks can take them.
 * 2. The hooks (MA_TILE_HOOKS: amx.c, avx512bf16.c, svebf16.c): FN(tiles_*), defined once for
 *    all of them by tiles_hooks.h. The forward task calls FN(tiles_apply) to know whether the
 *    hooks take a call, then begin / query / scores / pv / o_rows per query block and end; the
 *    decode rows step asks FN(tiles_rows_scores) for its scores (0: not taken); the single-pass
 *    backward calls begin / group / keys / scores / dp / accum / keys_end (query and group move
 *    the hooks to the item's varlen entry, FN(fwd_seq), FN(bwd_seq)). Each replaces the
 *    generic step of the same name (forward_tmpl.h, fused_bwd_tmpl.h): same inputs, same
 *    outputs.
 * 3. What an instance defines before including tiles_hooks.h, and what its packer
 *    (tiles_pack.h on x86, tiles_pack_mmla.h on aarch64) provides: declared here with the
 *    signatures tiles_hooks.h calls, so an instance that differs does not compile. The
 *    instance's intrinsics stay in the instance and its packer.
 */

typedef struct FN(fwd_scratch) FN(fwd_scratch);
typedef struct FN(bwd_scratch) FN(bwd_scratch);

#ifdef MA_TILE_HOOKS
typedef struct FN(tiles) FN(tiles);

/* forward (forward_tmpl.h) and decode (decode_tmpl.h, FN(rows_hooked)) */
static int FN(tiles_apply)(const ma_attn_fwd_params *p);
static size_t FN(tiles_fwd_scratch_bytes)(const ma_attn_fwd_params *p);
static void FN(tiles_fwd_begin)(FN(tiles) * *T, const ma_attn_fwd_params *p, FN(fwd_scratch) * t,
                                ma_scratch_header *hdr, void *extra);
static void FN(tiles_fwd_query)(FN(tiles) * T, int64_t b, int64_t h, int64_t hk, int64_t i0, int64_t nr);
static void FN(tiles_fwd_scores)(FN(tiles) * T, ACC *sT, int64_t i0, int64_t j0, int64_t nc);
static void FN(tiles_fwd_pv)(FN(tiles) * T, ACC *o, const ACC *alpha, const ACC *sT, int64_t i0, int64_t j0,
                             int64_t nc);
static ACC *FN(tiles_fwd_o_rows)(FN(tiles) * T, ACC *o);
static int FN(tiles_rows_scores)(FN(tiles) * T, const ma_attn_fwd_params *p, ACC *s, int64_t b, int64_t h, int64_t i0,
                                 int64_t nr, int64_t nh, int64_t k_off, int64_t nc, int64_t pf);
static void FN(tiles_end)(void);

/* single-pass backward (fused_bwd_tmpl.h) */
static size_t FN(tiles_bwd_scratch_bytes)(const ma_attn_bwd_params *p);
static void FN(tiles_bwd_begin)(FN(tiles) * *T, const ma_attn_bwd_params *p, FN(bwd_scratch) * t, void *extra);
static void FN(tiles_bwd_group)(FN(tiles) * T, int64_t b, int64_t hk);
static void FN(tiles_bwd_keys)(FN(tiles) * T, int64_t j0, int64_t nc);
static void FN(tiles_bwd_scores)(FN(tiles) * T, int64_t gi, int64_t h, int64_t i0, int64_t nr);
static void FN(tiles_bwd_dp)(FN(tiles) * T, int64_t gi, int64_t h, int64_t i0, int64_t nr);
static void FN(tiles_bwd_accum)(FN(tiles) * T, ACC *dq_i, int64_t gi, int64_t h, int64_t i0, int64_t nr);
static void FN(tiles_bwd_keys_end)(FN(tiles) * T, int64_t nc);

/* the instance's products (tiles_layout.h: tile_view, tile_prec) */
static void tile_gemm(int64_t m, int64_t n, int64_t k, tile_view a, tile_view b, float *C, int64_t ldc, int accumulate,
                      int terms);
static inline void tile_begin(void);
static inline void tile_end(void);
static tile_prec tile_precision(ma_dtype dt);
#ifdef TILE_KEY_ROWS
static void tile_key_rows(int64_t mtiles, int64_t nkt, const uint16_t *A, int64_t lda, int64_t a_kstep, tile_view b,
                          float *C, int64_t pf);
static inline void pack_rows_as_b_bf16(tile_view dst, const uint16_t *const rows[16], int64_t D);
#endif

/* the packer's */
static void pack_a(tile_view dst, const float *A, int64_t ars, int64_t acs, int64_t m, int64_t k);
static void pack_b(tile_view dst, const float *B, int64_t ldb, int64_t k, int64_t n);
static void pack_a_bf16(tile_view dst, const uint16_t *X, int64_t ld, int64_t m, int64_t k, int trans);
static void pack_b_bf16(tile_view dst, const uint16_t *X, int64_t ld, int64_t k, int64_t n, int trans);
static inline void tile_a_keep_k(uint16_t *dst, const uint16_t *src, int64_t rem);
static void i8_rows_bf16(uint16_t *dst, const int8_t *src, const int64_t st[4], int64_t nr, int64_t ncol);
#endif
