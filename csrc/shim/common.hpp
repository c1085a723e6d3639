// common.hpp -- what the shim's files share (csrc/shim/*.cpp, the only C++):
// the includes, MA_CHECK, the scratch pool's block and lease, and the
// declarations of the helpers, checks and ops defined in checks.cpp, pool.cpp,
// attention.cpp, varlen.cpp and cross_entropy.cpp (registration.cpp registers
// the ops).
//
// Built against the libtorch stable ABI (TORCH_TARGET_VERSION = 2.10), so one
// binary serves every torch from 2.10 on. The kernels (masked_attn.h) are C11
// and see only pointers, element strides and sizes filled in here.
//
// Everything shared lives in namespace masked_attn_shim, with hidden
// visibility: the extension exports only the ops' registration and the plain
// C entry points (pool.cpp), as when the shim was one file with an anonymous
// namespace.

#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/shim_utils.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <mutex>
#include <cstdio>
#include <stdexcept>
#include <type_traits>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <initializer_list>
#include <vector>

#include "common/isa.h"
#include "masked_attn.h"

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// ---- errors -------------------------------------------------------------------

// MA_CHECK(cond, parts...) throws std::runtime_error("parts...") when cond is
// false; torch turns it into a Python RuntimeError. The message is built with
// std::string and std::to_string only. STD_TORCH_CHECK formats through an
// std::ostringstream (its __LINE__ at least), and a toolchain that links
// libstdc++ statically into the extension (seen with torch 2.11 and a
// source build) crashes there instead of raising: iostreams' locale is never
// initialised in the extension's private copy.
namespace ma_err {
inline void append(std::string& s, const std::string& x) { s += x; }
inline void append(std::string& s, const char* x) { s += x; }
inline void append(std::string& s, char x) { s += x; }
inline void append(std::string& s, double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  s += buf;
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T x) { s += std::to_string(x); }
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  throw std::runtime_error(s);
}
}  // namespace ma_err
#define MA_CHECK(cond, ...)                      \
  do {                                           \
    if (!(cond)) ::ma_err::fail(__VA_ARGS__);    \
  } while (0)

namespace masked_attn_shim __attribute__((visibility("hidden"))) {

// ---- dtypes (checks.cpp) -------------------------------------------------------

bool to_ma_dtype(ScalarType t, ma_dtype* out);
// k and v of an 8-bit cache (int8, with k_scale and v_scale: options.cpp, parse_kv_scales)
bool is_int8_kv(const Tensor& k, const Tensor& v);
bool is_floating(ScalarType t);
std::string shape_str(const Tensor& t);
// The accumulation type of the saved log-sum-exp and of the backward's scratch.
ScalarType acc_type(ScalarType t);
// bfloat16 / float16: the forward also writes out_lo, out's rounding error (masked_attn.h)
bool low_precision(ScalarType dt);

// ---- scratch memory ----------------------------------------------------------
//
// The kernels' per-thread scratch comes from blocks kept between calls: a
// block's pages stay mapped, so a call faults in no fresh page once the pool
// holds a large enough block (fresh pages touched by many threads at once
// serialise in the OS). Each call takes a block for the duration of its
// parallel region and gives it back, so Python threads calling at once get
// blocks of their own. At most kPoolBlocks idle blocks and kPoolBytes idle
// bytes are kept; torch_masked_attn.release_memory() frees the idle ones, and
// so does process exit.
class ScratchPool {
 public:
  struct Block {
    void* ptr = nullptr;
    size_t bytes = 0;
  };

  Block take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // the smallest idle block that fits
      size_t best = idle_.size();
      for (size_t i = 0; i < idle_.size(); i++)
        if (idle_[i].bytes >= bytes && (best == idle_.size() || idle_[i].bytes < idle_[best].bytes)) best = i;
      if (best < idle_.size()) {
        Block b = idle_[best];
        idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(best));
        idle_bytes_ -= b.bytes;
        return b;
      }
    }
    Block b;
    b.bytes = (bytes + kAlign - 1) / kAlign * kAlign;
    b.ptr = map_pages(b.bytes);
    MA_CHECK(b.ptr != nullptr, "masked_attn: could not allocate ", b.bytes, " bytes of scratch memory");
    return b;
  }

  void give(Block b) {
    std::vector<Block> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle_.push_back(b);
      idle_bytes_ += b.bytes;
      // over the bounds: free the smallest idle blocks first (the largest serves every call)
      std::sort(idle_.begin(), idle_.end(), [](const Block& x, const Block& y) { return x.bytes > y.bytes; });
      while (idle_.size() > kPoolBlocks || (idle_bytes_ > kPoolBytes && idle_.size() > 1)) {
        drop.push_back(idle_.back());
        idle_bytes_ -= idle_.back().bytes;
        idle_.pop_back();
      }
    }
    for (const Block& d : drop) unmap_pages(d);
  }

  // Frees every idle block; returns the bytes freed.
  size_t release() {
    std::vector<Block> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      drop.swap(idle_);
      idle_bytes_ = 0;
    }
    size_t n = 0;
    for (const Block& d : drop) {
      n += d.bytes;
      unmap_pages(d);
    }
    return n;
  }

  size_t idle_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return idle_bytes_;
  }

  ~ScratchPool() { release(); }

 private:
  // Blocks are whole pages straight from the OS (mmap), never from malloc's heap: a freed block's
  // pages leave the process at once (release_memory's promise), whatever threshold glibc's
  // allocator has grown to for its own mmaps.
  static void* map_pages(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  static void unmap_pages(const Block& b) { munmap(b.ptr, b.bytes); }

  static constexpr size_t kAlign = 4096;
  static constexpr size_t kPoolBlocks = 4;
  static constexpr size_t kPoolBytes = size_t{1} << 30;
  std::mutex mu_;
  std::vector<Block> idle_;
  size_t idle_bytes_ = 0;
};

ScratchPool& scratch_pool();

// Gives a block back to the pool when the parallel region ends, even on an error.
struct ScratchLease {
  ScratchPool::Block block;
  explicit ScratchLease(size_t bytes) : block(scratch_pool().take(bytes)) {}
  ~ScratchLease() { scratch_pool().give(block); }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
};

// ---- threading, memory advice (pool.cpp) -----------------------------------------

// Runs fn over work items [0, n) on PyTorch's intra-op pool (pool.cpp).
void run_tasks(ma_task_fn fn, const void* params, int64_t n, size_t scratch_bytes,
               const Tensor& like, int64_t grain = 0, int64_t work = 0);
// Plans an attention call (ma_attn_plan_fwd / ma_attn_plan_bwd, which set the
// params' schedule fields) and runs the plan (pool.cpp).
void run_attn_fwd(ma_attn_fwd_params& p);
void run_attn_bwd(ma_attn_bwd_params& p);
void advise_huge_pages(Tensor& t);
bool worth_streaming(const Tensor& t);

// ---- memory overlap (checks.cpp) ---------------------------------------------------

bool no_internal_overlap(const Tensor& t);
bool may_overlap(const Tensor& a, const Tensor& b);
bool same_view(const Tensor& a, const Tensor& b);

// ---- input checks (checks.cpp) -----------------------------------------------------

struct Sizes {
  int64_t B, H, Hkv, Lq, Lk, D, Dv;
};

// int8_kv: k and v may be an 8-bit cache (the forward; its scales: parse_kv_scales)
Sizes check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, bool int8_kv = false);
ma_mask canonical_mask(const std::optional<Tensor>& m, const char* name, std::vector<int64_t> dims,
                       const char* dims_str, bool allow_bool);

// attn_mask and key_padding_mask, canonical (the head mask is an option: AttnOpts).
struct Masks {
  ma_mask attn_mask, key_padding_mask;
};

Masks check_masks(const Sizes& s, const std::optional<Tensor>& attn_mask,
                  const std::optional<Tensor>& key_padding_mask);

// ---- the options of an attention call (options.cpp) ----------------------------------

// The options every attention op's schema ends with, declared once (kOpts,
// options.cpp): attn_schema() appends their text to each of the five schemas,
// and AttnBox hands the op the call's last attn_opt_count() values, taken over
// from its boxed stack, one per option in the schema's order; parse_attn_opts
// reads them. A new option of this kind is a row of kOpts and its check there:
// no edit here, in the schemas or in the ops.
using AttnOptValue = std::variant<int64_t, std::optional<double>, std::optional<Tensor>>;
using AttnOptArgs = std::vector<AttnOptValue>;
std::string attn_schema(const char* head, const char* tail);  // head + the options + tail
uint64_t attn_opt_count();
AttnOptArgs take_attn_opt_args(const StableIValue* values);

// The options only the dense ops (forward, backward, backward_into) have.
struct DenseOptArgs {
  bool is_causal = false;
  double dropout_p = 0;
  std::optional<Tensor> dropout_seed, head_mask;
};

// A boxed kernel (registration.cpp) for an attention op written as
// R fn(const AttnOptArgs&, A...): A... are the schema's leading arguments,
// the options its last attn_opt_count().
template <typename Sig, Sig* fn>
struct AttnBox;
template <typename... R, typename... A, std::tuple<R...> (*fn)(const AttnOptArgs&, A...)>
struct AttnBox<std::tuple<R...>(const AttnOptArgs&, A...), fn> {
  static void boxed(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
    namespace d = torch::stable::detail;
    MA_CHECK(num_args == sizeof...(A) + attn_opt_count() && num_outputs == sizeof...(R),
             "masked_attn: an attention op's schema and its kernel disagree");
    AttnOptArgs opts = take_attn_opt_args(stack + sizeof...(A));
    auto args = d::unbox_to_tuple<d::unbox_type_t<A>...>(stack);
    auto res = std::apply([&](auto&&... a) { return fn(opts, a...); }, std::move(args));
    d::box_from_tuple<R...>(stack, res);
  }
};
#define ATTN_BOX(f) (masked_attn_shim::AttnBox<std::remove_pointer_t<decltype(f)>, (f)>::boxed)

// The options checked and normalised, once per call (parse_attn_opts): c is
// what the kernels read (ma_attn_args.opts, masked_attn.h); the tensors are
// kept for what the shim computes from them itself.
struct AttnOpts {
  ma_attn_opts c{};
  int64_t diagonal = 0;  // dense: the call's (ma_attn_args.diagonal); varlen: 0, per entry in the kernels
  std::optional<Tensor> sinks, head_mask;
};

// Every check of the options lives here: the five attention ops call it
// with the call's sizes (varlen: B = N sequences, Lq, Lk the longest).
AttnOpts parse_attn_opts(const Sizes& s, const AttnOptArgs& in, const DenseOptArgs& dense, bool varlen);

// The options' gradients the backward ops return, reduced to their shapes:
// the head mask's ((H,) or (B, H), its dtype) from the kernels' per-row sums
// dhm_rows (B, H, Lq) (acc type; nullptr: not wanted), summed over the rows
// and then over what the head mask broadcasts over, in the accumulation type,
// rounded once; the sinks' ((H,), their dtype) from the passes' lse and delta
// (ma_attn_bwd_sinks_grad; p.delta NULL: no key, 0). Empty (acc type) where
// the call has none.
Tensor head_mask_grad_of(const AttnOpts& o, const Tensor* dhm_rows, const Tensor& like);

// The 8-bit cache's scales into o->k_scale, o->v_scale (masked_attn.h): with
// int8 k and v, float32 CPU tensors of k's and v's shapes without their last
// dim (one scale per row), required; without, absent. layout maps the rows'
// dims to the kernels' (b, head, row, page): dense (B, H_kv, L), packed (T, H_kv),
// paged (pages, page_size, H_kv).
enum class KvLayout { Dense, Packed, Paged };
void parse_kv_scales(const char* fn, const Tensor& q, const Tensor& k, const Tensor& v,
                     const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale, KvLayout layout,
                     ma_attn_opts* o);
Tensor sinks_grad_of(const AttnOpts& o, const ma_attn_bwd_params& p, const Tensor& like);

ma_isa select_isa(ma_dtype dt);
// The constants of the kernels a call on dt with variant isa runs (ma_attn_traits): their tile,
// which ma_attn_args.block_q, block_k and a paged cache's page size follow.
ma_traits kernel_traits(ma_dtype dt, ma_isa isa);
void check_shape(const Tensor& t, const char* name, std::vector<int64_t> dims, const char* dims_str,
                 ScalarType dtype);
void check_out_lo(const std::optional<Tensor>& out_lo, std::vector<int64_t> dims, const char* dims_str,
                  ScalarType dtype);

// A new tensor on like's device, of like's dtype (or dtype), with these sizes and strides
// (none: contiguous), in one call of the C shim (pool.cpp; why not torch::stable::new_empty there).
Tensor new_strided(const Tensor& like, std::initializer_list<int64_t> sizes, std::initializer_list<int64_t> strides,
                   std::optional<ScalarType> dtype = std::nullopt);

// ---- ops (attention.cpp, varlen.cpp, cross_entropy.cpp; registered in registration.cpp) ----

// The attention ops take their options first (AttnBox), then the schema's
// leading arguments in its order.
std::tuple<Tensor, Tensor, Tensor, Tensor> attn_forward(const AttnOptArgs& opts, Tensor q, Tensor k, Tensor v,
                                                        std::optional<Tensor> attn_mask,
                                                        std::optional<Tensor> key_padding_mask,
                                                        std::optional<Tensor> head_mask, bool is_causal,
                                                        std::optional<double> scale, bool need_weights,
                                                        double dropout_p, std::optional<Tensor> dropout_seed,
                                                        bool for_backward, std::optional<Tensor> k_scale,
                                                        std::optional<Tensor> v_scale);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> attn_backward(
    const AttnOptArgs& opts, Tensor grad_out, std::optional<Tensor> grad_weights, Tensor q, Tensor k, Tensor v,
    Tensor out, Tensor lse, std::optional<Tensor> attn_mask, std::optional<Tensor> key_padding_mask,
    std::optional<Tensor> head_mask, bool is_causal, std::optional<double> scale, bool head_mask_grad,
    bool mask_grad, double dropout_p, std::optional<Tensor> dropout_seed, std::optional<Tensor> out_lo);
std::tuple<Tensor, Tensor, Tensor> attn_backward_into(
    const AttnOptArgs& opts, Tensor grad_out, std::optional<Tensor> grad_weights, Tensor q, Tensor k, Tensor v,
    Tensor out, Tensor lse, std::optional<Tensor> attn_mask, std::optional<Tensor> key_padding_mask,
    std::optional<Tensor> head_mask, bool is_causal, std::optional<double> scale, bool head_mask_grad,
    bool mask_grad, Tensor grad_q, Tensor grad_k, Tensor grad_v, double dropout_p,
    std::optional<Tensor> dropout_seed, std::optional<Tensor> out_lo);
std::tuple<Tensor, Tensor, Tensor> varlen_forward(const AttnOptArgs& opts, Tensor q, Tensor k, Tensor v,
                                                  Tensor cu_seq_q, std::optional<Tensor> cu_seq_k, int64_t max_q,
                                                  int64_t max_k, std::optional<double> scale,
                                                  std::optional<Tensor> seqused_k, std::optional<Tensor> block_table,
                                                  bool for_backward, std::optional<Tensor> k_scale,
                                                  std::optional<Tensor> v_scale);
std::tuple<Tensor, Tensor, Tensor, Tensor> varlen_backward(const AttnOptArgs& opts, Tensor grad_out, Tensor q,
                                                           Tensor k, Tensor v, Tensor out, Tensor lse,
                                                           Tensor cu_seq_q, Tensor cu_seq_k, int64_t max_q,
                                                           int64_t max_k, std::optional<double> scale,
                                                           std::optional<Tensor> out_lo);
std::tuple<Tensor, Tensor> ce_forward(Tensor input, Tensor target, std::optional<Tensor> weight,
                                      std::string reduction, int64_t ignore_index, double label_smoothing,
                                      double z_loss, std::optional<double> softcap, bool inplace_backward);
std::tuple<Tensor, Tensor> ce_backward(Tensor grad_loss, Tensor input, Tensor target,
                                       std::optional<Tensor> weight, Tensor lse, std::string reduction,
                                       int64_t ignore_index, double label_smoothing, bool target_grad,
                                       double z_loss, std::optional<double> softcap);
void ce_backward_inplace(Tensor grad_loss, Tensor input, Tensor target, std::optional<Tensor> weight, Tensor lse,
                         std::string reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                         std::optional<double> softcap);
std::tuple<Tensor, Tensor> ce_chunk_inplace(Tensor input, Tensor target, std::optional<Tensor> weight,
                                            std::optional<double> grad_scale, int64_t ignore_index,
                                            double label_smoothing, double z_loss, std::optional<double> softcap);
void cache_write(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, Tensor slots,
                 std::optional<Tensor> key_scale, std::optional<Tensor> value_scale);
std::tuple<Tensor, Tensor> quantize_kv(Tensor x);

}  // namespace masked_attn_shim
