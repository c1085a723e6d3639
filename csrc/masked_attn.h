/*
 * masked_attn.h -- the C interface of the torch_masked_attn kernels.
 *
 * Plain C11. No torch, no C++, no allocation. The shim (csrc/shim/) validates
 * every input, allocates outputs, fills one params struct, asks
 * ma_attn_plan_fwd / ma_attn_plan_bwd for the schedule, allocates the
 * scratch and workspace it names and runs its passes, task functions over
 * ranges of independent work items, on PyTorch's intra-op thread pool.
 *
 * Dimensions, named once:
 *   B    batch
 *   H    query heads;  Hkv key/value heads (H % Hkv == 0, grouped-query)
 *   Lq   query length; Lk key/value length
 *   D    q/k head dim; Dv v head dim
 *
 * Every tensor is passed as (pointer, dtype, element strides). A stride of 0
 * broadcasts that dimension: masks are never expanded or copied.
 */
#ifndef MASKED_ATTN_H
#define MASKED_ATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types the kernels read and write. Values are ours, not torch's. */
typedef enum {
    MA_BOOL = 0, /* 1 byte, nonzero = true */
    MA_F32 = 1,
    MA_F64 = 2,
    MA_BF16 = 3,
    MA_F16 = 4,
    MA_I8 = 5,   /* int8: the 8-bit KV cache's values (ma_attn_opts.k_scale), never q or an output */
} ma_dtype;

/* Instruction-set variants of the float32-accumulating kernels: the one table of them. Every
 * list of the variants is generated from its rows: the enum below, their names, the built and
 * usable checks and the fallbacks (common/isa.c), the kernel tables' externs (attention/blocks.h,
 * cross_entropy/blocks.h), the three dispatch switches (attention/dispatch.c,
 * cross_entropy/dispatch.c, kv_cache/cache_write.c) and each variant's tile (ma_attn_traits).
 * The policy (which one a call gets) is common/isa.h's; float64 always runs the
 * double-accumulating scalar kernels. Only the current architecture's variants are compiled in
 * (setup.py); the others are never available. Columns (common/isa.h writes the generators'
 * vocabulary):
 *   ID      the enum's MA_ISA_<ID>
 *   name    MASKED_ATTN_ISA's word, and the suffix of the variant's kernel tables
 *           (ma_attn_kernels_<name>, ma_blocks_<name>, ma_ce_kernels_<name>, ma_ce_blocks_<name>)
 *   abi     MA_ISA_<ID> = its value: the C ABI that Python and the shim share (never
 *           renumbered; a new row takes the next number)
 *   arch    where it is compiled in: any, x86 (x86_64, i386) or arm (aarch64)
 *   bq, bk  its tile: query rows by keys (ma_attn_args.block_q, block_k), multiples of 32 (the
 *           tile products' packed views); a paged cache's page_size is a multiple of bk
 *   fb      the variant whose kernels run where this one has none (own, inst)
 *   own     its kernels: all (attention's, and the row kernels: cross-entropy's and the float
 *           blocks the KV cache's quantizing runs); attn (attention's, fb's row kernels); bf16
 *           (attention's in bfloat16, fb's for the other dtypes and the row kernels)
 *   inst    one: one table of each kind (ma_attn_kernels_<name>); vl: one per SVE vector length
 *           (ma_attn_kernels_<name>128 ... <name>2048), the CPU's length's (fb's at the others)
 *   usable  whether this CPU runs it: an expression common/isa.c evaluates on arch only, over
 *           MA_CPU("feature") (__builtin_cpu_supports), MA_USABLE(ID), amx_permitted() (Linux
 *           grants the AMX tile state), ma_sve_bits() and sve_bf16() (HWCAP2_SVEBF16)
 * A new variant: a row here, its mapping (common/simd_<name>.h), its instance files and its
 * units in setup.py (common/simd.h lists them). */
/* clang-format off */
#define MA_ISA_TABLE(X)                                                                                         \
    /* ID,        name,       abi,                    arch, bq, bk, fb,     own,  inst, usable */               \
    X(SCALAR,     scalar,     MA_ISA_SCALAR = 0,      any,  64, 64, SCALAR, all,  one, 1)                       \
    X(AVX2,       avx2,       MA_ISA_AVX2 = 1,        x86,  64, 64, SCALAR, all,  one,                          \
      MA_CPU("avx2") && MA_CPU("fma"))                                                                          \
    X(AVX512,     avx512,     MA_ISA_AVX512 = 2,      x86,  64, 64, SCALAR, all,  one,                          \
      /* F, BW, DQ, VL */ MA_CPU("avx512f") && MA_CPU("avx512bw") && MA_CPU("avx512dq") &&                      \
      MA_CPU("avx512vl"))                                                                                       \
    X(AMX,        amx,        MA_ISA_AMX = 3,         x86,  64, 64, AVX512, attn, one,                          \
      /* + AVX512-BF16, -VNNI and AMX-BF16 tiles */ MA_USABLE(AVX512BF16) &&                                  \
      MA_CPU("amx-tile") && MA_CPU("amx-bf16") && amx_permitted())                                              \
    X(AVX512BF16, avx512bf16, MA_ISA_AVX512BF16 = 4,  x86,  64, 64, AVX512, bf16, one,                          \
      /* VDPBF16PS; VNNI's vpdpwssd */ MA_USABLE(AVX512) && MA_CPU("avx512bf16") && MA_CPU("avx512vnni"))     \
    X(NEON,       neon,       MA_ISA_NEON = 5,        arm,  64, 64, SCALAR, all,  one,                          \
      1 /* in every aarch64 CPU */)                                                                             \
    X(SVE,        sve,        MA_ISA_SVE = 6,         arm,  64, 64, NEON,   all,  vl,  ma_sve_bits() > 0)       \
    X(SVEBF16,    svebf16,    MA_ISA_SVEBF16 = 7,     arm,  64, 64, NEON,   bf16, one,                          \
      sve_bf16() /* BFMMLA, any vector length */)
/* clang-format on */

#define MA_ISA_ENUM_ROW(ID, name, abi, arch, bq, bk, fb, own, inst, usable) abi,
typedef enum { MA_ISA_TABLE(MA_ISA_ENUM_ROW) } ma_isa;
#undef MA_ISA_ENUM_ROW

int ma_isa_available(ma_isa isa); /* compiled in and supported by this CPU */
ma_isa ma_isa_best(ma_dtype dt);

/* The enums' names, written once (common/isa.c) and read by the Python side and the tests:
 * a variant's name (MASKED_ATTN_ISA's word), whether this build compiles it in (this
 * architecture's variants, whatever the CPU), and a dtype's name (torch's: "float32", ...).
 * NULL, 0 past the last. */
const char *ma_isa_name(int isa);
int ma_isa_built(int isa);
const char *ma_dtype_name(int dt);

/* What every task function receives as ctx: the op's params (shared by all
 * threads) and this thread's scratch slice (cache-line aligned, sized by the
 * matching *_scratch_bytes function). */
typedef struct {
    const void *params;
    void *scratch;
} ma_task_ctx;

typedef void (*ma_task_fn)(int64_t begin, int64_t end, void *ctx);

/* ------------------------------------------------------------------------
 * Attention
 *
 *   S[b,h,i,j] = scale * q[b,h,i,:] . k[b,h/G,j,:] + bias[b,h,i,j]     G = H/Hkv
 *   P = softmax_j(S)          (a row whose every bias is -inf gives P = 0)
 *   out[b,h,i,:] = hm[b,h] * sum_j P[b,h,i,j] v[b,h/G,j,:]
 *   lse[b,h,i]   = log sum_j exp(S[b,h,i,j])   (-inf for a fully masked row)
 *
 * With dropout (dropout_p = p > 0), P' = P * Z / (1 - p) replaces P in out
 * (and weights) before the head mask: out = hm * sum_j P'_ij v_j; lse stays
 * the undropped softmax's. Z[b,h,i,j] = 1 iff the 16-bit number
 *   u = (philox4x32_10(ctr, key)[(j % 8) / 2] >> (16 * (j % 2))) & 0xffff
 * with ctr = {j / 8, i, (uint32)(b*H + h), (uint32)offset} and
 * key = {(uint32)seed, (uint32)(seed >> 32) ^ (uint32)(offset >> 32)}
 * is >= round(p * 65536): keep probability 1 - round(p * 65536) / 65536.
 *
 * bias is the sum of the additive forms of the masks:
 *   is_causal           j > i               -> -inf
 *   window              j < i - left or j > i + right -> -inf (a side of -1: none)
 *   key_padding_mask    (B, Lk)       bool: true -> -inf;  float: added
 *   attn_mask           (B, H, Lq, Lk) broadcast by strides
 *                                     bool: true -> -inf;  float: added
 *   alibi (slopes m)    (B, H) float32: -m[b,h] |i + Lk - Lq - j| (flash-attn's
 *                       alibi_slopes; Lq, Lk a varlen entry's own lengths)
 *
 * Soft-capping (softcap = c > 0) replaces the scaled product before the bias:
 *   S[b,h,i,j] = c tanh(scale * q . k / c) + bias[b,h,i,j]
 *   dS/d(scale q . k) = 1 - tanh^2 = 1 - ((S - bias) / c)^2
 * A sink (sinks[h], a logit of its own per head) joins every row's softmax
 * denominator and has no value:
 *   P[b,h,i,j] = exp(S_ij - lse_i),  lse_i = log(exp(sinks[h]) + sum_j exp(S_ij))
 * so lse includes the sink, a row with no allowed key has out 0 and lse =
 * sinks[h], and d sinks[h] = -sum_{b,i} exp(sinks[h] - lse_i) delta_i with
 * delta_i = sum_j P_ij dP_ij = dO_i . (out_i + out_lo_i) (+ sum_j P_ij dW_ij), the
 * backward's delta (ma_attn_bwd_sinks_grad).
 * The backward needs nothing else from the sink: P from the saved lse already
 * carries it.
 * ---------------------------------------------------------------------- */

typedef struct {
    const void *ptr;     /* NULL: no such mask */
    ma_dtype dtype;
    int64_t stride[4];   /* attn_mask: b, h, i, j; key_padding_mask: b, j; head_mask: b, h */
} ma_mask;

/* The options of one attention call (the masks aside), checked and filled
 * once by the shim (shim/options.cpp, parse_attn_opts) for every op. */
typedef struct {
    /* Sliding window about the diagonal (ma_attn_args.diagonal: query i's is
     * key i + diagonal): query i sees keys i + diagonal - window_left <= j <=
     * i + diagonal + window_right; causal is window_right = 0. Dense calls
     * take the call's diagonal (0: top-left aligned, Lk - Lq: bottom-right),
     * normalised by the shim (a side that reaches every key is -1); varlen
     * calls (cu_q below) each entry's bottom right, Lk_b - Lq_b. The loops
     * read only the band (ma_attn_args.band_lo, band_hi, ma_attn_band). */
    int64_t window_left;    /* query i sees keys j >= i + diagonal - window_left; -1: no bound */
    int64_t window_right;   /* ... and j <= i + diagonal + window_right; -1: no bound */
    double softcap;         /* > 0: scores s -> softcap tanh(s / softcap) before the bias; 0: off */
    ma_mask sinks;          /* (H,) one logit per head in every row's denominator, stride[0] = h; ptr NULL: none */
    ma_mask head_mask;      /* (B, H) strides b, h: multiplies head (b, h)'s probabilities; ptr NULL: none */
    /* ALiBi (flash-attn's alibi_slopes): float32 slopes, strides b, h (0 for
     * (H,)); see "Attention" above. ptr NULL: none. */
    ma_mask alibi;
    /* 8-bit K, V: with k_scale.ptr set, k and v hold int8 (MA_I8) and these
     * their float32 scales, one per row of D (per key and key head): key j's
     * values are k_scale[j] * k[j, :] and v_scale[j] * v[j, :]. Strides b, h,
     * row, and (paged) the page's in stride[3], as the rows they scale. The
     * scales never multiply K or V: the scores are scale * (q . k_j) * k_scale[j]
     * (the product over the integers, converted exactly to float; a decode step's
     * with q rounded to int16 and the dot product in integers, docs/design/16-kv-int8.md),
     * and P V takes
     * P_ij v_scale[j] (after l has summed P): no dequantized copy of a row
     * exists. Forward only; both set or neither. */
    ma_mask k_scale, v_scale;
    /* Dropout: P' = P * Z / (1 - p), Z ~ Bernoulli(1 - p) per element
     * (b, h, i, j), never stored: Philox-4x32-10 keyed by the seed,
     * regenerated by the backward (philox.h). dropout_p = 0: off. */
    double dropout_p;           /* in [0, 1] */
    uint64_t dropout_seed;      /* Philox key */
    uint64_t dropout_offset;    /* folded into the counter and the key */
} ma_attn_opts;

/* What the forward and the backward of one call both read. Filled once by
 * the shim (attn_args in shim/attention.cpp, varlen_args in shim/varlen.cpp). */
typedef struct {
    const void *q;          /* (B, H, Lq, D)   */
    const void *k;          /* (B, Hkv, Lk, D) */
    const void *v;          /* (B, Hkv, Lk, Dv) */
    ma_dtype dtype;         /* of q, k, v and of every output but lse */
    int64_t q_stride[4], k_stride[4], v_stride[4];
    int64_t out_stride[4];  /* of out: written by the forward, read by the backward */
    int64_t out_lo_stride[4];  /* of out_lo (below), when there is one */
    ma_mask attn_mask, key_padding_mask;
    /* The diagonal: query i's is key i + diagonal, the causal mask's and the
     * window's reference (0: top-left aligned, SDPA's is_causal; Lk - Lq:
     * bottom-right, flash-attn's). Varlen: set per entry to Lk_b - Lq_b. */
    int64_t diagonal;
    double scale;
    ma_attn_opts opts;
    /* sizes */
    int64_t B, H, Hkv, Lq, Lk, D, Dv;
    int64_t block_q, block_k;   /* tile sizes, set by the shim (ma_attn_traits) */
    /* The band every score must pass: key j is visible to query i iff
     * band_lo <= j - i <= band_hi (MA_BAND_INF: no bound): ma_attn_band of
     * the diagonal and the window, by the shim (dense) or per entry by the
     * template (varlen). */
    int64_t band_lo, band_hi;
    /* Where the per-row statistics (lse, delta, dhm_rows) of row i of head
     * (b, h) live: b * stat_stride[0] + h * stat_stride[1] + i. Dense
     * (B, H, Lq): {H * Lq, Lq}; varlen (H, Tq): {0, Tq}, from the sequence's first row. */
    int64_t stat_stride[2];
    int stream_stores;          /* write the large outputs with non-temporal stores (see below) */
    ma_isa isa;                 /* the variant for this call (common/isa.h) */
    /* ---- packed variable-length sequences (masked_attn::varlen_*); cu_q NULL for a dense call ----
     * q, out, dq, dout are (Tq, H, D) and k, v, dk, dv (Tk, Hkv, D), passed as
     * 4-D strides {0, head, row, dim}; batch entry b is the rows
     * [cu_q[b], cu_q[b + 1]) of q and [cu_k[b], cu_k[b] + Lk_b) of k, v, with
     * Lk_b = seqused_k ? seqused_k[b] : cu_k[b + 1] - cu_k[b]. The loops see
     * one entry at a time through FN(seq) (attention_tmpl.h): pointers moved to
     * the entry's first row, Lq, Lk its own, the band its window's. B is the
     * number of sequences, Lq and Lk (set by the shim) the longest ones. No
     * masks, no head mask, no weights; the single-pass backward, each entry
     * with key chunks of its own (ma_attn_bwd_params.entry_chunks). */
    const int32_t *cu_q, *cu_k;  /* (B + 1), nondecreasing from 0, checked by the shim */
    const int32_t *seqused_k;    /* (B) or NULL; required with block_table */
    /* paged KV cache (forward only): k, v are pools (pages, page_size, Hkv, D)
     * passed with strides {0, head, row, dim} plus the page strides; key row j
     * of entry b is row j % page_size of page block_table[b * bt_stride + j / page_size].
     * page_size is a multiple of block_k, so a key block lies in one page. cu_k unused. */
    const int32_t *block_table;  /* NULL: no paging */
    int64_t bt_stride, page_size, k_page_stride, v_page_stride;
    /* work-item tables, 3 int64 per item: (b, h, q-block) for the forward,
     * (b, hkv, key chunk) for the single-pass backward, both ordered most
     * expensive first (the pool hands items out dynamically); (b, h, q-block)
     * of the entries of more than one key chunk for its reduce, in order.
     * Sized by ma_attn_plan_*, placed and filled by its bind; NULL for dense calls. */
    const int64_t *q_items, *kv_items;
    int64_t n_q_items, n_kv_items;
} ma_attn_args;

/* No bound on that side of the band (ma_attn_args.band_lo = -MA_BAND_INF). */
#define MA_BAND_INF ((int64_t)1 << 60)

/* The band of a diagonal and a window (ma_attn_opts.window_*, -1: no bound):
 * key j is visible to query i iff *band_lo <= j - i <= *band_hi. The one place
 * the alignment becomes the band (|diagonal| < 2^40, checked by the shim). */
static inline void ma_attn_band(int64_t diagonal, int64_t window_left, int64_t window_right, int64_t *band_lo,
                                int64_t *band_hi) {
    *band_lo = window_left >= 0 ? diagonal - window_left : -MA_BAND_INF;
    *band_hi = window_right >= 0 ? diagonal + window_right : MA_BAND_INF;
}

typedef struct {
    /* outputs */
    void *out;              /* (B, H, Lq, Dv)  dtype, strides a.out_stride        */
    void *lse;              /* (B, H, Lq)      contiguous, float32 (float64 for MA_F64) */
    void *weights;          /* (B, H, Lq, Lk)  contiguous, dtype; NULL unless need_weights */
    /* (B, H, Lq, Dv) dtype, strides a.out_lo_stride: out's rounding error,
     * round(o - out) for the float32 o that out = round(o) was rounded from,
     * so that out + out_lo holds o to 16 (bfloat16) / 22 (float16)
     * significant bits (0 where out is not finite). The backward's delta
     * dO . o is then exact to float32 noise, whatever scaled o before it was
     * rounded (a head mask, dropout, a sink; docs/design.md, section 4).
     * bfloat16 / float16 only; NULL: not written. The shim passes it only
     * where a backward will follow (the op's for_backward); without it the
     * bfloat16 tile products (amx, avx512bf16) round P to bfloat16 where it
     * enters P V, as native's flash kernel does (docs/design.md, section 6). */
    void *out_lo;
    /* inputs */
    ma_attn_args a;
    /* The decode kernel's schedule (set by ma_attn_plan_fwd where it takes the call, else
     * decode_splits 0; see "Decoding" below): query heads per slab, slabs per key head, splits per (b, hkv, slab),
     * rows per slab at most (slab heads x the longest query block); and, with more than one
     * split, the workspace of the chunks' partial states and (varlen) each entry's first chunk
     * slot (B + 1), both placed by the plan's bind. */
    int64_t decode_slab_heads, decode_slabs, decode_splits, decode_rows;
    int64_t decode_kv_heads; /* key heads an item takes in lockstep (heads side by side in a row) */
    void *decode_part;
    const int64_t *decode_chunk0;
} ma_attn_fwd_params;

/* ---- Decoding --------------------------------------------------------------
 *
 * A forward call of at most MA_DECODE_QROWS query rows (decoding, speculative
 * verification; varlen: each entry of so few), without weights, over key rows
 * (or K^T pages) and value rows with unit last stride, runs the decode kernel (ma_attn_decode_task, then
 * ma_attn_decode_merge_task where an entry's keys were split between items):
 *   work item w = ((b * Hkv + hkv) * slabs + slab) * splits + split
 * (with kv = Hkv / kv_heads: b * kv + g in place of b * Hkv + hkv, an item then
 * taking key heads g kv_heads .. g kv_heads + kv_heads in lockstep where the
 * cache holds a token's heads side by side in a row, so that rows are read
 * whole) holds the query heads of slab `slab` of key head hkv (consecutive heads,
 * slab_heads of them, at most MA_DECODE_ROWS rows with the query rows) as one
 * block of rows, which share every load of K and V (scores from key rows:
 * dot_rows' order, each row read once in order: not the tile path's bits;
 * from K^T pages: the tiles' order); and split `split` of the
 * key chunks its rows see. Chunk c is the keys [c MA_DECODE_CHUNK, (c + 1)
 * MA_DECODE_CHUNK): boundaries set by the keys' positions alone. Each chunk's
 * softmax (max m, sum l, output O) starts afresh; the chunks' states are then
 * folded in chunk order,
 *   N = max(M, m),  L = e^(M - N) L + e^(m - N) l,  O = e^(M - N) O + e^(m - N) o,
 * by the item that holds all of an entry's chunks, or by the merge task from
 * the partial states the items left (the same fold, in the same order): a
 * row's bits depend on neither the split, the thread count nor the batch
 * around it. The merge's item is (b, hkv, slab). */
#define MA_DECODE_QROWS 16
#define MA_DECODE_ROWS 64
#define MA_DECODE_CHUNK 512
#define MA_DECODE_KV_HEADS 16

/* The constants a call's kernels are built on, for the shim and Python
 * (torch_masked_attn.ops.kernel_traits): the tile of the variant whose attention kernels run a
 * call in dtype dt asking for variant isa (MA_ISA_TABLE's bq, bk, after its fallbacks; float64's
 * are scalar's), which the shim sets as ma_attn_args.block_q, block_k and a paged cache's
 * page_size must be a multiple of; and the decode kernel's constants above, the same for every
 * variant (the templates size their arrays and place their chunks by them). Returns 0, or -1
 * for a dtype q cannot have or a variant this build does not compile in. */
typedef struct {
    int64_t block_q, block_k;                                         /* the tile path's tile */
    int64_t decode_qrows, decode_rows, decode_chunk, decode_kv_heads; /* MA_DECODE_* */
} ma_traits;
int ma_attn_traits(int dt, int isa, ma_traits *t);

/* The decode kernel's shape for a call (ma_attn_plan_fwd's rule, on the CPU count cpus;
 * kv_heads: the key heads an item takes together, 1 unless the cache holds a token's heads
 * side by side): slab heads, slabs per key head, key chunks of the longest entry, splits,
 * work items, and the chunks of the longest item. */
typedef struct {
    int64_t slab_heads, slabs, chunks, splits, items, item_chunks;
} ma_decode_shape;
int ma_attn_decode_shape(int64_t B, int64_t H, int64_t Hkv, int64_t kv_heads, int64_t Lq, int64_t Lk, int64_t cpus,
                         ma_decode_shape *s);
/* Forces the decode kernel's splits to n (n <= 0: the rule again; at most the chunks) for
 * every later call, process-wide; returns the previous setting. The same bits for every n
 * (torch_masked_attn.ops.decode_splits, for tests and benchmarks). */
int64_t ma_attn_decode_splits_force(int64_t n);
void ma_attn_decode_task(int64_t begin, int64_t end, void *ctx);
void ma_attn_decode_merge_task(int64_t begin, int64_t end, void *ctx);

typedef struct {
    /* outputs (overwritten, never accumulated) */
    void *dq;               /* (B, H, Lq, D)   dtype, strides dq_stride */
    void *dk;               /* (B, Hkv, Lk, D) */
    void *dv;               /* (B, Hkv, Lk, Dv) */
    void *dhm_rows;         /* (B, H, Lq) acc type: sum_j P dP/hm per row; NULL unless head_mask grad wanted */
    void *dscores;          /* (B, H, Lq, Lk) acc type, contiguous, zero-filled by the shim: dL/dS,
                               the gradient of an additive mask; NULL unless a mask needs it */
    int64_t dq_stride[4], dk_stride[4], dv_stride[4];
    /* gradients of the forward's outputs */
    const void *dout;       /* (B, H, Lq, Dv) */
    const void *dweights;   /* (B, H, Lq, Lk) NULL if the weights were not used */
    int64_t dout_stride[4], dweights_stride[4];
    /* what the forward saw and saved */
    const void *out;        /* (B, H, Lq, Dv) strides a.out_stride */
    const void *lse;        /* (B, H, Lq) contiguous, acc type */
    ma_attn_args a;
    const void *out_lo;     /* the forward's out_lo (strides a.out_lo_stride) or NULL: delta = dO . out */
    void *delta;            /* (B, H, Lq) acc type: D_i = sum_j P_ij dP_ij = dO_i . (out_i + out_lo_i)
                               (+ sum_j P_ij dW_ij), written by the pre-pass where dweights
                               (read by the pass), else by the pass's first key chunk where
                               sinks (for ma_attn_bwd_sinks_grad) */
    /* single pass with kv_chunks > 1: dq and dhm partial sums of each key
     * chunk, (kv_chunks, B, H, Lq, D) and (kv_chunks, B, H, Lq), acc type
     * (varlen: entry b's (C_b, H, Lq_b, D) and (C_b, H, Lq_b) from row
     * entry_chunks[2 b + 1], for the entries with C_b > 1), summed in chunk
     * order by the reduce task; placed by ma_attn_plan_bwd's bind (dhm_part
     * only with dhm_rows) */
    void *dq_part, *dhm_part;
    int64_t kv_chunks; /* varlen: the most of any entry */
    /* single pass: key blocks an item holds at once (set by ma_attn_plan_bwd;
     * 0 or 1: one; at most MA_BWD_KEY_GROUP_MAX); the same bits for every value */
    int64_t key_group;
    /* varlen single pass, (B, 2): entry b's key chunks C_b (a rule on its own
     * Lk_b alone: a sequence's gradients are the same bits alone or packed)
     * and the first row of its partial sums (C_b > 1); placed and filled by
     * ma_attn_plan_bwd's bind; NULL for dense calls */
    const int64_t *entry_chunks;
} ma_attn_bwd_params;

#define MA_BWD_KEY_GROUP_MAX 4

/* After the passes: d sinks[h] = -sum_{b,i} exp(sinks[h] - lse_i) delta_i
 * (see "Attention" above) into dsinks (H,), accumulated in double, entries
 * then rows in order. Needs a.opts.sinks and the backward's delta (p->delta:
 * the pre-pass writes it, or the pass from the items of the first key chunk). */
void ma_attn_bwd_sinks_grad(const ma_attn_bwd_params *p, double *dsinks);

/* stream_stores: the outputs are large (the shim sets it from their size), so
 * no cache could keep them until they are read: the SIMD variants write their
 * float32 rows that are whole, aligned cache lines with non-temporal stores,
 * which skip reading each line in before overwriting it (and the cache-set
 * conflicts of rows H * D apart). Values are the same either way; every task
 * that may stream ends with a store fence. */

/* Forward, the tile path: work item w = ((b * H) + h) * nq + qb,  nq = ceil(Lq / block_q)
 * (varlen: q_items[3 w ..]).
 * Writes out, lse (and weights) of its (b, h, q-block). Calls (varlen: entries)
 * whose query rows are at most MA_DECODE_QROWS run the decode kernel instead
 * ("Decoding" above). */
void ma_attn_fwd_task(int64_t begin, int64_t end, void *ctx);

/* Backward, one algorithm for every call: where the weights have a gradient
 * (dweights; dense calls only), first ma_attn_bwd_delta_task, work item (b, h,
 * q-block) (FN(q_item)'s order): delta of its rows into p->delta, their
 * weights' term hm sum_j P'_ij dW_ij with P' recomputed (the scores again).
 * Then one pass over the key blocks, work item = (b, hkv, key chunk c), chunk
 * c holding key blocks c, c + C, c + 2C, ... (C = kv_chunks, a rule on the
 * shape and the CPUs the process can use (ma_cpu_count), never on the thread
 * count: one item per CPU, at least 8, at most 16 chunks; varlen: item
 * a.kv_items[3 w ..], C entry b's own C_b, entry_chunks, a rule on its key
 * length alone). dk, dv of a key block are written by the one item holding
 * it; dq (and dhm) are accumulated per item: straight into dq when C = 1,
 * else into the chunk's partial sums, which ma_attn_bwd_reduce_task (work
 * item (b, h, q-block); varlen: a.q_items[3 w ..]) then adds up in chunk
 * order. 5 matrix products per tile (6 with dweights: the pre-pass's
 * scores). An item takes its chunk's key blocks key_group at a time,
 * visiting each query block once per group rather than once per key block:
 * more than one where the Q, dO and dq rows of an item's heads would not
 * stay in a core's L2 between key blocks (a rule on the shape; the kernels
 * may still take 1, attention_tmpl.h FN(bwd_key_group)). Every output
 * element is written by exactly one work item in a fixed order: bitwise
 * deterministic for any thread count, no atomics.
 * dq, dk, dv may be q, k, v themselves (the same elements, element for
 * element): the pre-pass only reads, an item reads a key block's k, v before
 * it writes that block's dk, dv, no other item reads them, and q is read by
 * the items of its head group only, before dq is written at the end of the
 * item or by the reduce task. (MultiheadAttention's recomputed projection
 * relies on this.) */
void ma_attn_bwd_delta_task(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_fused_task(int64_t begin, int64_t end, void *ctx);
void ma_attn_bwd_reduce_task(int64_t begin, int64_t end, void *ctx);
/* Takes the CPU count of the key chunks' rule as n (n <= 0: the machine's
 * again) for every later call, process-wide; returns the previous setting.
 * For tests (torch_masked_attn.ops.bwd_cpus) and benchmarks. */
int64_t ma_attn_bwd_cpus_force(int64_t n);
/* Forces the key group to n (n <= 0: the shape rule again) for every later
 * call, process-wide; returns the previous setting. The results are the same
 * bits for every n: the tests check it (torch_masked_attn.ops.bwd_key_group),
 * benchmarks compare speeds. */
int64_t ma_attn_bwd_key_group_force(int64_t n);

/* ---- The schedule of one call ----------------------------------------------
 *
 * ma_attn_plan_fwd / ma_attn_plan_bwd decide everything about how a call is
 * run, for dense and varlen calls alike, and write the decisions the
 * kernels read into the params (decode_*; kv_chunks, key_group;
 * n_q_items, n_kv_items); the caller (the shim) fills the params but for
 * these, plans, then executes the plan:
 *  1. if bind is set: one block of workspace_bytes (cache-line aligned) for
 *     the call, handed to bind(params, block), which places in it what the
 *     passes share (varlen's work-item tables, which it fills, and the key
 *     chunks' partial sums of dq and dhm);
 *  2. the passes in order, each over its items [0, n), handed out grain at a
 *     time to at most `threads` threads, each with a scratch slice of
 *     scratch_bytes (a multiple of MA_CACHE_LINE, its header zeroed) as
 *     ma_task_ctx.scratch; a pass starts when the previous one has ended.
 * threads is 1 where the call's multiply-adds (work) are fewer than
 * MA_SERIAL_WORK: waking a pool costs more than such a call's arithmetic (a
 * decoding step against a short cache, a small model's layer). No decision
 * but kv_chunks' (made on the machine's CPU count) changes a result's bits:
 * every item is computed the same way by whichever thread takes it, alone
 * or in a run. Both return 0, or -1 for a NULL argument. */
#define MA_PLAN_PASSES_MAX 4
#define MA_SERIAL_WORK ((int64_t)1 << 17)

typedef struct {
    ma_task_fn fn;
    int64_t n;            /* work items */
    int64_t grain;        /* items a thread takes at a time, >= 1 */
    size_t scratch_bytes; /* per thread */
} ma_pass;

typedef struct {
    ma_pass pass[MA_PLAN_PASSES_MAX];
    int n_passes;
    int64_t threads;         /* at most the caller's thread count; 1: run on the calling thread */
    double work;             /* the multiply-adds of the matrix products, every key counted */
    size_t workspace_bytes;  /* with bind */
    void (*bind)(void *params, void *workspace); /* NULL: no workspace */
} ma_plan;

int ma_attn_plan_fwd(ma_attn_fwd_params *p, int64_t threads, ma_plan *plan);
int ma_attn_plan_bwd(ma_attn_bwd_params *p, int64_t threads, ma_plan *plan);

/* Scratch slices are padded to this many bytes. The first MA_CACHE_LINE
 * bytes of each thread's slice are a header the shim zero-fills before every
 * parallel region: kernels keep there what lives for one op call on one
 * thread (the tags of the converted-rows caches, ma_scratch_header). */
#define MA_CACHE_LINE 64

typedef struct {
    int64_t tag[4]; /* which (b, head) each cache holds, + 1; 0 = none */
} ma_scratch_header;

/* ------------------------------------------------------------------------
 * Cross-entropy (F.cross_entropy semantics, plus z-loss and logit soft-capping)
 *
 * Dimensions, named once:
 *   N    batch
 *   C    classes
 *   S    spatial positions, d1 * ... * dk (1 for (N, C) and (C,) inputs)
 *   R    rows, N * S: one row = the C logits of one position, x[n, :, s]
 *
 * The logits a row is scored on are y_c = x_c, or y_c = cap tanh(x_c / cap)
 * with soft-capping (cap > 0, Gemma 2's final-logit softcap). With w the class
 * weights (all 1 without weight), ls the label smoothing, z the z-loss
 * coefficient and lse = log sum_c exp y_c, per kept row:
 *   class target t:  loss = (1 - ls) * w_t (lse - y_t) + ls / C * sum_c w_c (lse - y_c) + z lse^2
 *   probabilities p: loss = sum_c w_c p'_c (lse - y_c) + z lse^2,   p'_c = (1 - ls) p_c + ls / C
 * (z lse^2 is PaLM's z-loss; it is not multiplied by a class weight.)
 * A row whose target is ignore_index is skipped: loss 0, lse 0, gradient 0.
 * 'mean' divides the summed losses by the summed w_t of the kept rows (class
 * targets) or by R (probabilities), NaN when that is 0; the shim reduces
 * (ma_ce_sum, ma_ce_total_weight), serially and in row order.
 *
 * Gradients (g = d total / d loss of the row, y'_c = dy_c / dx_c = 1 - (y_c / cap)^2
 * with soft-capping, 1 without):
 *   class target t:  dx_c = y'_c g (((1 - ls) w_t + ls / C * W + 2 z lse) softmax_c
 *                                  - (1 - ls) w_t [c == t] - ls / C * w_c),  W = sum_c w_c
 *   probabilities p: dx_c = y'_c g ((A + 2 z lse) softmax_c - w_c p'_c),  A = sum_c w_c p'_c
 *                    dp_c = g (1 - ls) w_c (lse - y_c)
 * ---------------------------------------------------------------------- */

/* What the forward and the backward both read. Filled by the shim. */
typedef struct {
    const void *input;        /* (N, C, S) logits, dtype, strides input_stride     */
    const int64_t *target;    /* (N, S) class indices, strides target_stride;
                                 NULL with probability targets                     */
    const void *target_prob;  /* (N, C, S) probabilities, dtype, strides target_stride;
                                 NULL with class targets                           */
    const void *weight;       /* (C,) dtype, stride weight_stride; NULL: all 1     */
    ma_dtype dtype;           /* of input, target_prob, weight                     */
    int64_t input_stride[3];  /* n, c, s */
    int64_t target_stride[3]; /* class targets: n, s; probabilities: n, c, s       */
    int64_t weight_stride;
    int64_t ignore_index;     /* class targets only; any value, also outside [0, C) */
    double label_smoothing;   /* in [0, 1]; 0 skips the smoothing term             */
    double z_loss;            /* >= 0; 0 skips the z-loss term                     */
    double softcap;           /* > 0: y = softcap tanh(x / softcap); 0: y = x      */
    ma_isa isa;               /* variant of the float-accumulating kernels         */
    int64_t N, C, S;
} ma_ce_args;

typedef struct {
    /* outputs (overwritten) */
    void *loss;               /* (R,) contiguous, loss_dtype: per-row loss         */
    ma_dtype loss_dtype;      /* dtype for reduction 'none'; the acc type when the
                                 shim reduces                                      */
    void *lse;                /* (R,) contiguous, acc type (float32, float64 for MA_F64) */
    /* optional, the fused gradient: NULL for a plain forward. With it, each
     * kept row's gradient is written right after its statistics, while the
     * row is still in cache, with g = dloss_scale for every row (class
     * targets only). dinput may be input itself (the gradient replaces the
     * logits, row by row). */
    void *dinput;             /* (N, C, S) dtype, strides dinput_stride            */
    int64_t dinput_stride[3];
    double dloss_scale;
    /* inputs */
    ma_ce_args a;
} ma_ce_fwd_params;

typedef struct {
    /* outputs (overwritten, every element) */
    void *dinput;             /* (N, C, S) dtype, strides dinput_stride; may be the
                                 input itself (in-place backward)                  */
    void *dtarget;            /* (N, C, S) dtype, strides dtarget_stride;
                                 probability targets only, NULL unless wanted      */
    int64_t dinput_stride[3], dtarget_stride[3];
    /* gradient of the forward's output */
    const void *dloss;        /* (N, S) dtype, strides dloss_stride ({0, 0} for a
                                 reduced loss)                                     */
    int64_t dloss_stride[2];
    double dloss_scale;       /* 1, or 1 / total weight for 'mean'                 */
    /* what the forward saw and saved */
    const void *lse;          /* (R,) contiguous, acc type                         */
    ma_ce_args a;
} ma_ce_bwd_params;

/* Work item = one row r = n * S + s. No scratch. Each element of a row is
 * read before the same element of dinput is written, so dinput may alias
 * input exactly (same pointer and strides). */
void ma_ce_fwd_task(int64_t begin, int64_t end, void *ctx);
void ma_ce_bwd_task(int64_t begin, int64_t end, void *ctx);

/* Serial, in row order, in double (bitwise the same for any thread count):
 * sum_r w[target_r] over the kept rows (their count without weight), and
 * sum_r x[r] of an (R,) contiguous vector. */
double ma_ce_total_weight(const ma_ce_args *a);
double ma_ce_sum(const void *x, ma_dtype dt, int64_t n);

/* ------------------------------------------------------------------------
 * KV cache write (vLLM's reshape_and_cache, flash-attn's k / v append)
 *
 * Row t of the new keys (T, Hkv, D) and values (T, Hkv, Dv) goes to slot
 * s = slots[t] of its cache: row s % page_size of page s / page_size (a flat
 * (rows, Hkv, D) cache is one page of all its rows; the two caches may
 * differ in their number of pages or rows); a negative slot skips the row.
 * Elements are copied as they are (the shim requires equal dtypes), or, into
 * an 8-bit cache (side.scale set), each head's row quantized as
 * ma_kv_quantize_task does, its scale stored at the same (page, row, head);
 * an 8-bit row whose elements are not adjacent (a K^T page) is quantized on
 * the stack and then scattered, so its dim is at most MA_KV_STRIDED_I8_ROW.
 * Work item = one new row (its keys, then its values). Where two rows share
 * a slot, the later one is what the cache holds: the shim then runs the
 * items in order on one thread. No scratch.
 * ---------------------------------------------------------------------- */
typedef struct {
    const void *src;          /* (T, Hkv, dim) new rows */
    void *cache;              /* pages of (page_size, Hkv, dim) */
    int64_t dim;
    int64_t src_stride[3];    /* t, head, element */
    int64_t cache_stride[4];  /* page, row in page, head, element */
    float *scale;             /* 8-bit cache: its scales (pages, page_size, Hkv); NULL: a copy */
    int64_t scale_stride[3];  /* page, row in page, head */
} ma_cache_side;

typedef struct {
    ma_cache_side k, v;
    const int64_t *slots64;   /* (T) one of the two, in [-inf, pages * page_size) (checked by the shim) */
    const int32_t *slots32;
    int64_t T, Hkv, page_size;
    size_t elem_bytes;        /* of the new rows */
    ma_dtype src_dtype;       /* of the new rows (read when quantizing) */
    ma_isa isa;               /* the quantizing block's variant */
} ma_cache_write_params;

#define MA_KV_STRIDED_I8_ROW 1024

void ma_cache_write_task(int64_t begin, int64_t end, void *ctx);

/* ------------------------------------------------------------------------
 * 8-bit KV cache: quantizing (torch_masked_attn.functional.quantize_kv)
 *
 * Symmetric int8, one float32 scale per row of D values (per token and
 * head). In float32 arithmetic, for row x of D elements:
 *   scale = absmax(x) / 127,   q_c = round(clamp(x_c * (127 / absmax(x)), -127, 127))
 * rounding to nearest, ties to even. A row of zeros has scale 0 and q 0; a
 * row holding an inf or NaN has scale NaN and q 0 (attention then gives NaN
 * where that key is read, as a float cache holding it would). Every variant
 * gives the same bits. Work item = one row; no scratch.
 * ---------------------------------------------------------------------- */
typedef struct {
    const void *x;            /* (rows, D), each row unit stride */
    ma_dtype dtype;           /* float32, bfloat16 or float16 */
    int64_t x_stride;         /* between rows */
    int8_t *q;                /* (rows, D) rows q_stride apart */
    int64_t q_stride;
    float *scale;             /* (rows) contiguous */
    int64_t D;
    ma_isa isa;
} ma_kv_quant_params;

void ma_kv_quantize_task(int64_t begin, int64_t end, void *ctx);

#ifdef __cplusplus
}
#endif

#endif /* MASKED_ATTN_H */
