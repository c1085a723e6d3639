// shim.cpp -- the only C++ file: op schemas, input checks, allocation and the
// bridge from the C task functions to PyTorch's intra-op thread pool.
//
// Built against the libtorch stable ABI (TORCH_TARGET_VERSION = 2.10), so one
// binary serves every torch from 2.10 on. The kernels (masked_attn.h) are C11
// and see only pointers, element strides and sizes filled in here.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

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
#include <vector>

#include "common/isa.h"
#include "masked_attn.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

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

namespace {

// ---- dtypes ----------------------------------------------------------------

bool to_ma_dtype(ScalarType t, ma_dtype* out) {
  switch (t) {
    case ScalarType::Bool: *out = MA_BOOL; return true;
    case ScalarType::Float: *out = MA_F32; return true;
    case ScalarType::Double: *out = MA_F64; return true;
    case ScalarType::BFloat16: *out = MA_BF16; return true;
    case ScalarType::Half: *out = MA_F16; return true;
    default: return false;
  }
}

bool is_floating(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::BFloat16 ||
         t == ScalarType::Half;
}

std::string shape_str(const Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); i++) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + ")";
}

// The accumulation type of the saved log-sum-exp and of the backward's scratch.
ScalarType acc_type(ScalarType t) {
  return t == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

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
    b.ptr = std::aligned_alloc(kAlign, b.bytes);
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
    for (const Block& d : drop) std::free(d.ptr);
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
      std::free(d.ptr);
    }
    return n;
  }

  size_t idle_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return idle_bytes_;
  }

  ~ScratchPool() { release(); }

 private:
  static constexpr size_t kAlign = 4096;
  static constexpr size_t kPoolBlocks = 4;
  static constexpr size_t kPoolBytes = size_t{1} << 30;
  std::mutex mu_;
  std::vector<Block> idle_;
  size_t idle_bytes_ = 0;
};

ScratchPool& scratch_pool() {
  static ScratchPool pool;
  return pool;
}

// Bytes of scratch the last parallel region used (the benchmarks report it).
std::atomic<size_t> last_scratch_bytes{0};

// Gives a block back to the pool when the parallel region ends, even on an error.
struct ScratchLease {
  ScratchPool::Block block;
  explicit ScratchLease(size_t bytes) : block(scratch_pool().take(bytes)) {}
  ~ScratchLease() { scratch_pool().give(block); }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
};

// ---- running a task function on the thread pool ---------------------------

// Runs fn over work items [0, n) on PyTorch's intra-op pool, in at most one
// chunk per thread. Each chunk gets its own slice of scratch, so scratch is
// sized by the work (slices = chunks, never more than the threads) and taken
// from the pool before the parallel region; the kernels never allocate.
// Items are handed out dynamically, `grain` at a time (default: about 16
// grabs per thread), so threads stay busy when items cost different amounts
// (causal blocks, padded sequences). Every item is computed the same way
// whichever thread takes it: results do not depend on the schedule.
// `work` (multiply-adds, 0: unknown) below kSerialWork runs on the calling
// thread alone: waking the pool costs more than such a call's arithmetic
// (a decoding step against a short cache, a small model's layer).
constexpr int64_t kSerialWork = int64_t{1} << 17;

void run_tasks(ma_task_fn fn, const void* params, int64_t n, size_t scratch_bytes,
               const Tensor& like, int64_t grain = 0, int64_t work = 0) {
  (void)like;
  if (n <= 0) return;
  const int64_t nthreads =
      work > 0 && work < kSerialWork ? 1 : std::max<int64_t>(1, torch::stable::get_num_threads());
  if (grain <= 0) grain = std::max<int64_t>(1, n / (16 * nthreads));
  const int64_t nchunks = std::min(nthreads, (n + grain - 1) / grain);
  const size_t total = scratch_bytes * static_cast<size_t>(nchunks);
  last_scratch_bytes.store(total);
  ScratchLease lease(std::max<size_t>(total, 1));
  const uintptr_t base = reinterpret_cast<uintptr_t>(lease.block.ptr);
  if (scratch_bytes >= MA_CACHE_LINE)  // each slice's header (masked_attn.h) starts zeroed
    for (int64_t c = 0; c < nchunks; c++) std::memset(reinterpret_cast<void*>(base + c * scratch_bytes), 0, MA_CACHE_LINE);
  std::atomic<int64_t> next{0};
  // chunk_begin identifies this invocation: parallel_for hands out disjoint
  // ranges of [0, nchunks), so no two running at once share a slice.
  auto worker = [&](int64_t chunk_begin, int64_t) {
    ma_task_ctx ctx{params, reinterpret_cast<void*>(base + chunk_begin * scratch_bytes)};
    for (int64_t begin; (begin = next.fetch_add(grain)) < n;)
      fn(begin, std::min(begin + grain, n), &ctx);
  };
  if (nchunks == 1) {
    worker(0, 1);
  } else {
    torch::stable::parallel_for(0, nchunks, 1, worker);
  }
}

// A new (B, H, L, D) tensor stored as (B, L, H, D), the layout of q, k, v
// projected by one linear layer and viewed per head; gradients and outputs in
// that layout reshape to (B, L, H * D) for free.
// Made in one call of the C shim (aoti_torch_empty_strided) rather than new_empty + transpose:
// torch::stable::transpose finds aten::transpose by name in the dispatcher on every call, a few
// microseconds that a decoding step pays for every output.
Tensor blhd(const Tensor& like, int64_t B, int64_t H, int64_t L, int64_t D) {
  const int64_t sizes[4] = {B, H, L, D}, strides[4] = {L * H * D, D, H * D, 1};
  int32_t dtype, device_type, device_index;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(like.get(), &dtype));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  AtenTensorHandle t;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(4, sizes, strides, dtype, device_type, device_index, &t));
  return Tensor(t);
}

void fill_strides4(int64_t out[4], const Tensor& t) {
  for (int i = 0; i < 4; i++) out[i] = t.stride(i);
}

// A large output (4 MB or more) the kernels are about to write for the first
// time (an (N, C) gradient, attention outputs and gradients): ask Linux for
// transparent huge pages on the 2 MB-aligned part of it. Where the allocator
// hands out fresh memory (glibc gave it back to the OS after the last step),
// its first touch then costs one fault per 2 MB instead of one per 4 KB page
// per writing thread: threads writing interleaved heads of a (B, L, H, D)
// output share pages, and each takes its own fault on each. On gpt-train's
// 8 MB gradients (2-core Zen 3) that is 2,000 - 3,700 faults, about 4 - 7 ms,
// down to 0 - 900. With THP in "madvise" mode, the default on many
// distributions, only an madvise gives them; it is advice: where THP is off,
// or the pages are already there, nothing changes. The memory still belongs
// to PyTorch's allocator.
void advise_huge_pages(Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t bytes = static_cast<uintptr_t>(t.numel()) * t.element_size();
  if (bytes < 2 * kHuge) return;
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.mutable_data_ptr());
  const uintptr_t lo = (base + kHuge - 1) & ~(kHuge - 1), hi = (base + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

// Outputs of at least this many bytes are written with non-temporal stores
// (stream_stores, masked_attn.h): twice a core's L2 here, so the caches could
// not have kept them for their reader anyway. Smaller ones (decoding, short
// batches) stay in cache for the next op (figures: docs/performance.md).
constexpr int64_t kStreamBytes = int64_t{4} << 20;

bool worth_streaming(const Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()) >= kStreamBytes; }

// Forward work items a thread takes at a time. Where runs of heads are taken
// (head_group > 1: decoding from a cache whose heads lie side by side in each
// row), up to a run's heads, while every thread still gets 2 takes. Else
// consecutive query blocks of one head (the kernel orders a head's blocks
// cheap, expensive, cheap, ...), up to the whole head, so that a thread reads
// that head's K and V into its own L2 once instead of both threads pulling
// every head; at least 8 takes per thread are left for balance; varlen one
// item at a time (its items come most expensive first). Results do not
// depend on it: every query block is computed the same way by whichever
// thread takes it, alone or in a run.
int64_t fwd_grain(const ma_attn_fwd_params& p) {
  const int64_t n = ma_attn_fwd_work_items(&p), nq = (p.a.Lq + p.a.block_q - 1) / p.a.block_q;
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  if (p.head_group > 1) return std::max<int64_t>(1, std::min<int64_t>(p.head_group, n / (2 * threads)));
  if (p.a.cu_q) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(nq, n / (8 * threads)));
}

// ---- memory overlap ------------------------------------------------------------
//
// The rules torch applies to out= arguments (at::assert_no_internal_overlap,
// at::assert_no_overlap), restated on the stable ABI: a tensor a kernel
// writes must not have two indices at one address; two tensors overlap when
// they start at the same element, or when both are dense and their byte
// ranges intersect. Views that interleave without sharing an element (the
// q, k, v thirds of one packed projection) are allowed, as torch allows them.

// One past the last byte of t, from its first element.
uintptr_t end_byte(const Tensor& t) {
  uintptr_t span = 1;
  for (int64_t i = 0; i < t.dim(); i++)
    if (t.size(i) > 1) span += static_cast<uintptr_t>(t.size(i) - 1) * static_cast<uintptr_t>(t.stride(i));
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) + span * t.element_size();
}

// No two indices of t share an address: with its dims of size > 1 sorted by
// stride, each stride exceeds the span of the smaller ones.
bool no_internal_overlap(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t i = 0; i < t.dim(); i++)
    if (t.size(i) > 1) dims.emplace_back(t.stride(i), t.size(i));
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // elements covered by the smaller dims, minus 1
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return false;
    span += stride * (size - 1);
  }
  return true;
}

// Dense: its elements fill [first, end) exactly.
bool is_dense(const Tensor& t) {
  return no_internal_overlap(t) &&
         end_byte(t) - reinterpret_cast<uintptr_t>(t.const_data_ptr()) ==
             static_cast<uintptr_t>(t.numel()) * t.element_size();
}

bool may_overlap(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(a.const_data_ptr());
  const uintptr_t b0 = reinterpret_cast<uintptr_t>(b.const_data_ptr());
  if (a0 == b0) return true;
  return is_dense(a) && is_dense(b) && a0 < end_byte(b) && b0 < end_byte(a);
}

// The same elements, element for element: same start, shape and strides.
bool same_view(const Tensor& a, const Tensor& b) {
  if (a.const_data_ptr() != b.const_data_ptr() || a.dim() != b.dim()) return false;
  for (int64_t i = 0; i < a.dim(); i++)
    if (a.size(i) != b.size(i) || (a.size(i) > 1 && a.stride(i) != b.stride(i))) return false;
  return true;
}

// ---- input checks -----------------------------------------------------------

struct Sizes {
  int64_t B, H, Hkv, Lq, Lk, D, Dv;
};

Sizes check_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  MA_CHECK(q.dim() == 4, "masked_attn: q must be 4-D (B, H, Lq, D), got shape ", shape_str(q));
  MA_CHECK(k.dim() == 4, "masked_attn: k must be 4-D (B, Hkv, Lk, D), got shape ", shape_str(k));
  MA_CHECK(v.dim() == 4, "masked_attn: v must be 4-D (B, Hkv, Lk, Dv), got shape ", shape_str(v));
  MA_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu(), "masked_attn: q, k, v must be CPU tensors");
  MA_CHECK(is_floating(q.scalar_type()),
                  "masked_attn: q must be float32, float64, bfloat16 or float16");
  MA_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                  "masked_attn: q, k and v must have the same dtype");
  Sizes s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  MA_CHECK(k.size(0) == s.B && v.size(0) == s.B, "masked_attn: q, k, v batch sizes differ: q ",
                  shape_str(q), ", k ", shape_str(k), ", v ", shape_str(v));
  MA_CHECK(k.size(3) == s.D, "masked_attn: k head dim must equal q's (", s.D, "), got k ",
                  shape_str(k));
  MA_CHECK(v.size(1) == s.Hkv && v.size(2) == s.Lk,
                  "masked_attn: v must have k's heads and length (B, Hkv, Lk, Dv): k ", shape_str(k),
                  ", v ", shape_str(v));
  MA_CHECK(s.Hkv > 0 ? s.H % s.Hkv == 0 : s.H == 0,
                  "masked_attn: the number of q heads (", s.H,
                  ") must be a multiple of the number of k/v heads (", s.Hkv, ")");
  return s;
}

// A mask as (pointer, dtype, strides), broadcast to `dims` by zero strides.
// `dims` are the sizes of the full mask, e.g. (B, H, Lq, Lk); the mask's own
// dimensions align to the right, and each must be 1 or equal.
ma_mask canonical_mask(const std::optional<Tensor>& m, const char* name, std::vector<int64_t> dims,
                       const char* dims_str, bool allow_bool) {
  ma_mask out{};
  if (!m.has_value()) return out;
  const Tensor& t = *m;
  const int64_t n = static_cast<int64_t>(dims.size());
  MA_CHECK(t.is_cpu(), "masked_attn: ", name, " must be a CPU tensor");
  MA_CHECK(t.dim() <= n, "masked_attn: ", name, " must broadcast to ", dims_str, ", got shape ",
                  shape_str(t));
  ScalarType st = t.scalar_type();
  MA_CHECK((allow_bool && st == ScalarType::Bool) || is_floating(st), "masked_attn: ", name,
                  allow_bool ? " must be bool or floating point" : " must be floating point");
  to_ma_dtype(st, &out.dtype);
  for (int64_t i = 0; i < n; i++) {
    const int64_t ti = t.dim() - n + i;
    if (ti < 0) {
      out.stride[i] = 0;
      continue;
    }
    const int64_t sz = t.size(ti);
    MA_CHECK(sz == dims[i] || sz == 1, "masked_attn: ", name, " of shape ", shape_str(t),
                    " does not broadcast to ", dims_str, " = (", dims[0], ", ", dims[1],
                    n > 2 ? ", ..." : "", ")");
    out.stride[i] = sz == 1 ? 0 : t.stride(ti);
  }
  out.ptr = t.const_data_ptr();
  return out;
}

struct Masks {
  ma_mask attn_mask, key_padding_mask, head_mask;
};

Masks check_masks(const Sizes& s, const std::optional<Tensor>& attn_mask,
                  const std::optional<Tensor>& key_padding_mask, const std::optional<Tensor>& head_mask) {
  Masks m;
  m.attn_mask = canonical_mask(attn_mask, "attn_mask", {s.B, s.H, s.Lq, s.Lk}, "(B, H, Lq, Lk)", true);
  if (key_padding_mask.has_value())
    MA_CHECK(key_padding_mask->dim() == 2 && key_padding_mask->size(0) == s.B &&
                        key_padding_mask->size(1) == s.Lk,
                    "masked_attn: key_padding_mask must have shape (B, Lk) = (", s.B, ", ", s.Lk,
                    "), got ", shape_str(*key_padding_mask));
  m.key_padding_mask = canonical_mask(key_padding_mask, "key_padding_mask", {s.B, s.Lk}, "(B, Lk)", true);
  if (head_mask.has_value())
    MA_CHECK((head_mask->dim() == 1 && head_mask->size(0) == s.H) ||
                        (head_mask->dim() == 2 && head_mask->size(0) == s.B && head_mask->size(1) == s.H),
                    "masked_attn: head_mask must have shape (H,) = (", s.H, ",) or (B, H) = (", s.B,
                    ", ", s.H, "), got ", shape_str(*head_mask));
  m.head_mask = canonical_mask(head_mask, "head_mask", {s.B, s.H}, "(B, H)", false);
  return m;
}

// ---- dropout (issue 14) ----
// dropout_p in [0, 1]; with dropout_p > 0, dropout_seed is an int64 CPU tensor
// of shape (2,): (seed, offset), the Philox key and counter words
// (csrc/attention/philox.h). The op draws nothing: the caller does (Python,
// from PyTorch's default generator), so a given seed reproduces the mask.
struct Dropout {
  double p = 0;
  uint64_t seed = 0, offset = 0;
};

Dropout check_dropout(const Sizes& s, double dropout_p, const std::optional<Tensor>& dropout_seed) {
  Dropout d;
  MA_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "masked_attn: dropout_p must be in [0, 1], got ", dropout_p);
  if (dropout_p == 0.0) return d;
  MA_CHECK(dropout_seed.has_value(), "masked_attn: dropout_p > 0 needs dropout_seed, an int64 tensor (seed, offset)");
  const Tensor& t = *dropout_seed;
  MA_CHECK(t.is_cpu() && t.scalar_type() == ScalarType::Long && t.dim() == 1 && t.size(0) == 2,
           "masked_attn: dropout_seed must be an int64 CPU tensor of shape (2,) (seed, offset), got shape ",
           shape_str(t), t.scalar_type() == ScalarType::Long ? ", int64" : ", not int64",
           t.is_cpu() ? ", on the CPU" : ", not on the CPU");
  MA_CHECK(s.Lq <= (int64_t{1} << 32) && s.Lk <= (int64_t{1} << 35),
           "masked_attn: dropout needs Lq <= 2^32 and Lk <= 2^35 (the Philox counter's words)");
  const int64_t* x = static_cast<const int64_t*>(t.const_data_ptr());
  d.p = dropout_p;
  d.seed = static_cast<uint64_t>(x[0]);
  d.offset = static_cast<uint64_t>(x[t.stride(0)]);
  return d;
}
// ---- end dropout ----
// The sliding window, soft-capping and sinks of one call (issue 15), checked
// and normalised: a window side that reaches every key (left >= Lq - 1,
// right >= Lk - 1) is unbounded (-1), is_causal caps the right side at 0, and
// a right side of 0 is is_causal itself (which has the causal block skipping
// and diagonal split): the kernels see window_right -1 or > 0.
struct WindowCapSinks {
  int64_t left = -1, right = -1;
  bool is_causal = false;
  double softcap = 0;
  ma_mask sinks{};
};

// softcap (> 0, finite, or None: 0) and sinks ((H,), or None: ptr NULL), checked.
void check_cap_sinks(int64_t H, std::optional<double> softcap, const std::optional<Tensor>& sinks, double* cap,
                     ma_mask* sk) {
  if (softcap.has_value()) {
    MA_CHECK(std::isfinite(*softcap) && *softcap > 0, "masked_attn: softcap must be None or a finite number > 0, got ",
             *softcap);
    *cap = *softcap;
  }
  if (sinks.has_value()) {
    MA_CHECK(sinks->dim() == 1 && sinks->size(0) == H, "masked_attn: sinks must have shape (H,) = (", H,
             ",), got ", shape_str(*sinks));
    *sk = canonical_mask(sinks, "sinks", {H}, "(H,)", false);
  }
}

WindowCapSinks check_window_cap_sinks(const Sizes& s, bool is_causal, int64_t window_left, int64_t window_right,
                                      std::optional<double> softcap, const std::optional<Tensor>& sinks) {
  MA_CHECK(window_left >= -1, "masked_attn: window_left must be -1 (no bound) or >= 0, got ", window_left);
  MA_CHECK(window_right >= -1, "masked_attn: window_right must be -1 (no bound) or >= 0, got ", window_right);
  WindowCapSinks w;
  w.left = window_left >= s.Lq - 1 ? -1 : window_left;
  w.right = is_causal ? 0 : window_right >= s.Lk - 1 ? -1 : window_right;
  w.is_causal = is_causal || w.right == 0;
  if (w.right == 0) w.right = -1;
  check_cap_sinks(s.H, softcap, sinks, &w.softcap, &w.sinks);
  return w;
}

// The instruction-set variant for this call: common/isa.h decides (the CPU's
// best for the dtype, or MASKED_ATTN_ISA read once per process, or
// torch_masked_attn.ops.use_isa); a MASKED_ATTN_ISA it cannot honour is an error.
ma_isa select_isa(ma_dtype dt) {
  if (const char* err = ma_isa_env_error()) {
    MA_CHECK(false, err);
  }
  return ma_isa_for(dt);
}

// Tile sizes: a q-block of 64 rows by a k-block of 64 keys.
constexpr int64_t kBlockQ = 64, kBlockK = 64;
// The AMX kernels' packed views start at multiples of 32 rows and keys.
static_assert(kBlockQ % 32 == 0 && kBlockK % 32 == 0, "block sizes must be multiples of 32");

// What the forward and the backward of one call both read (ma_attn_args),
// filled in one place: q, k, v and out with their strides, the canonical
// masks, the flags, sizes and tiles, and the variant.
ma_attn_args attn_args(const Sizes& s, const Masks& m, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& out, const WindowCapSinks& w, double scale, bool stream_stores, const Dropout& dr) {
  ma_attn_args a{};
  a.q = q.const_data_ptr();
  a.k = k.const_data_ptr();
  a.v = v.const_data_ptr();
  to_ma_dtype(q.scalar_type(), &a.dtype);
  fill_strides4(a.q_stride, q);
  fill_strides4(a.k_stride, k);
  fill_strides4(a.v_stride, v);
  fill_strides4(a.out_stride, out);
  a.attn_mask = m.attn_mask;
  a.key_padding_mask = m.key_padding_mask;
  a.head_mask = m.head_mask;
  a.is_causal = w.is_causal;
  // the band the loops read (ma_attn_args): top-left aligned
  a.band_lo = w.left >= 0 ? -w.left : -MA_BAND_INF;
  a.band_hi = w.is_causal ? 0 : w.right >= 0 ? w.right : MA_BAND_INF;
  a.stat_stride[0] = s.H * s.Lq, a.stat_stride[1] = s.Lq;
  a.scale = scale;
  // window, soft-capping, sinks
  a.window_left = w.left;
  a.window_right = w.right;
  a.softcap = w.softcap;
  a.sinks = w.sinks;
  a.B = s.B, a.H = s.H, a.Hkv = s.Hkv, a.Lq = s.Lq, a.Lk = s.Lk, a.D = s.D, a.Dv = s.Dv;
  a.block_q = kBlockQ, a.block_k = kBlockK;
  a.stream_stores = stream_stores;
  a.isa = select_isa(a.dtype);
  a.dropout_p = dr.p, a.dropout_seed = dr.seed, a.dropout_offset = dr.offset;
  return a;
}

// ---- ops --------------------------------------------------------------------

// bfloat16 / float16: the forward also writes out_lo, out's rounding error (masked_attn.h)
bool low_precision(ScalarType dt) { return dt == ScalarType::BFloat16 || dt == ScalarType::Half; }

std::tuple<Tensor, Tensor, Tensor, Tensor> attn_forward(Tensor q, Tensor k, Tensor v,
                                                std::optional<Tensor> attn_mask,
                                                std::optional<Tensor> key_padding_mask,
                                                std::optional<Tensor> head_mask, bool is_causal,
                                                std::optional<double> scale, bool need_weights,
                                                double dropout_p, std::optional<Tensor> dropout_seed,
                                                int64_t window_left, int64_t window_right,
                                                std::optional<double> softcap, std::optional<Tensor> sinks) {
  const Sizes s = check_qkv(q, k, v);
  const Masks m = check_masks(s, attn_mask, key_padding_mask, head_mask);
  const Dropout dr = check_dropout(s, dropout_p, dropout_seed);
  const WindowCapSinks w = check_window_cap_sinks(s, is_causal, window_left, window_right, softcap, sinks);
  const double sc = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(s.D));

  // out (B, H, Lq, Dv) is stored as (B, Lq, H, Dv): the layout the output
  // projection reads, so (B, Lq, H * Dv) is a free view.
  Tensor out = blhd(q, s.B, s.H, s.Lq, s.Dv);
  advise_huge_pages(out);
  Tensor lse = torch::stable::new_empty(q, {s.B, s.H, s.Lq}, acc_type(q.scalar_type()));
  Tensor weights = need_weights ? torch::stable::new_empty(q, {s.B, s.H, s.Lq, s.Lk})
                                : torch::stable::new_empty(q, {0});
  const bool low = low_precision(q.scalar_type());
  Tensor out_lo = low ? blhd(q, s.B, s.H, s.Lq, s.Dv) : torch::stable::new_empty(q, {0});

  ma_attn_fwd_params p{};
  p.out = out.mutable_data_ptr();
  p.lse = lse.mutable_data_ptr();
  p.weights = need_weights ? weights.mutable_data_ptr() : nullptr;
  p.out_lo = low ? out_lo.mutable_data_ptr() : nullptr;
  p.a = attn_args(s, m, q, k, v, out, w, sc, worth_streaming(out), dr);
  if (low) fill_strides4(p.a.out_lo_stride, out_lo);

  if (s.Lk == 0) {  // no key at all: every row is fully masked
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -INFINITY);
    if (w.sinks.ptr) {  // lse = the sink's logit (masked_attn.h)
      Tensor sk = torch::stable::contiguous(torch::stable::to(*sinks, acc_type(q.scalar_type())));
      const size_t esz = q.scalar_type() == ScalarType::Double ? sizeof(double) : sizeof(float);
      char* dst = static_cast<char*>(lse.mutable_data_ptr());
      const char* src = static_cast<const char*>(sk.const_data_ptr());
      for (int64_t bh = 0; bh < s.B * s.H; bh++)
        for (int64_t i = 0; i < s.Lq; i++) std::memcpy(dst + (bh * s.Lq + i) * esz, src + (bh % s.H) * esz, esz);
    }
    if (need_weights) torch::stable::zero_(weights);
    if (low) torch::stable::zero_(out_lo);
    return {out, lse, weights, out_lo};
  }
  p.head_group = ma_attn_fwd_head_group(&p);
  run_tasks(ma_attn_fwd_task, &p, ma_attn_fwd_work_items(&p), ma_attn_fwd_scratch_bytes(&p), q, fwd_grain(p),
            s.B * s.H * s.Lq * s.Lk * (s.D + s.Dv));
  return {out, lse, weights, out_lo};
}

// t must be a CPU tensor of `dims` and `dtype`.
void check_shape(const Tensor& t, const char* name, std::vector<int64_t> dims, const char* dims_str,
                 ScalarType dtype) {
  bool ok = t.is_cpu() && t.scalar_type() == dtype && t.dim() == static_cast<int64_t>(dims.size());
  for (int64_t i = 0; ok && i < t.dim(); i++) ok = t.size(i) == dims[i];
  MA_CHECK(ok, "masked_attn: ", name, " must be a CPU tensor of shape ", dims_str,
                  " with the dtype of q, got shape ", shape_str(t));
}

// out_lo (optional): the forward's fourth output, in q's dtype, shaped like out.
void check_out_lo(const std::optional<Tensor>& out_lo, std::vector<int64_t> dims, const char* dims_str,
                  ScalarType dtype) {
  if (out_lo.has_value()) check_shape(*out_lo, "out_lo", std::move(dims), dims_str, dtype);
}

// The backward, writing dq, dk, dv into the given (B, H, L, D) tensors (any
// strides); returns (grad_head_mask, grad_scores).
std::tuple<Tensor, Tensor> attn_backward_impl(
    Tensor grad_out, std::optional<Tensor> grad_weights, Tensor q, Tensor k, Tensor v, Tensor out,
    Tensor lse, std::optional<Tensor> attn_mask, std::optional<Tensor> key_padding_mask,
    std::optional<Tensor> head_mask, bool is_causal, std::optional<double> scale,
    bool head_mask_grad, bool mask_grad, double dropout_p, std::optional<Tensor> dropout_seed, Tensor dq,
    Tensor dk, Tensor dv, int64_t window_left, int64_t window_right, std::optional<double> softcap,
    std::optional<Tensor> sinks, std::optional<Tensor> out_lo) {
  const Sizes s = check_qkv(q, k, v);
  const Masks m = check_masks(s, attn_mask, key_padding_mask, head_mask);
  const Dropout dr = check_dropout(s, dropout_p, dropout_seed);
  const WindowCapSinks w = check_window_cap_sinks(s, is_causal, window_left, window_right, softcap, sinks);
  const double sc = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(s.D));
  check_shape(out, "out", {s.B, s.H, s.Lq, s.Dv}, "(B, H, Lq, Dv)", q.scalar_type());
  check_out_lo(out_lo, {s.B, s.H, s.Lq, s.Dv}, "(B, H, Lq, Dv)", q.scalar_type());
  check_shape(grad_out, "grad_out", {s.B, s.H, s.Lq, s.Dv}, "(B, H, Lq, Dv)", q.scalar_type());
  MA_CHECK(lse.dim() == 3 && lse.size(0) == s.B && lse.size(1) == s.H && lse.size(2) == s.Lq &&
                      lse.scalar_type() == acc_type(q.scalar_type()) && lse.is_contiguous(),
                  "masked_attn: lse must be the forward's contiguous (B, H, Lq) log-sum-exp");
  if (grad_weights.has_value())
    check_shape(*grad_weights, "grad_weights", {s.B, s.H, s.Lq, s.Lk}, "(B, H, Lq, Lk)",
                q.scalar_type());
  MA_CHECK(!head_mask_grad || head_mask.has_value(),
                  "masked_attn: head_mask_grad=True needs a head_mask");

  check_shape(dq, "grad_q", {s.B, s.H, s.Lq, s.D}, "(B, H, Lq, D)", q.scalar_type());
  check_shape(dk, "grad_k", {s.B, s.Hkv, s.Lk, s.D}, "(B, Hkv, Lk, D)", q.scalar_type());
  check_shape(dv, "grad_v", {s.B, s.Hkv, s.Lk, s.Dv}, "(B, Hkv, Lk, Dv)", q.scalar_type());
  const ScalarType acc = acc_type(q.scalar_type());
  Tensor delta = torch::stable::new_empty(q, {s.B, s.H, s.Lq}, acc);
  Tensor dhm_rows = torch::stable::new_zeros(q, {head_mask_grad ? s.B : 0, s.H, s.Lq}, acc);
  // dL/dS, the gradient of an additive mask: materialised only when a mask
  // requires grad; zero where no tile is computed (masked, skipped blocks)
  Tensor dscores = mask_grad ? torch::stable::new_zeros(q, {s.B, s.H, s.Lq, s.Lk}, acc)
                             : torch::stable::new_empty(q, {0}, acc);

  ma_attn_bwd_params p{};
  p.dq = dq.mutable_data_ptr();
  p.dk = dk.mutable_data_ptr();
  p.dv = dv.mutable_data_ptr();
  p.dhm_rows = head_mask_grad ? dhm_rows.mutable_data_ptr() : nullptr;
  p.dscores = mask_grad ? dscores.mutable_data_ptr() : nullptr;
  p.dout = grad_out.const_data_ptr();
  p.dweights = grad_weights.has_value() ? grad_weights->const_data_ptr() : nullptr;
  p.out = out.const_data_ptr();
  p.out_lo = out_lo.has_value() ? out_lo->const_data_ptr() : nullptr;
  p.lse = lse.const_data_ptr();
  fill_strides4(p.dq_stride, dq);
  fill_strides4(p.dk_stride, dk);
  fill_strides4(p.dv_stride, dv);
  fill_strides4(p.dout_stride, grad_out);
  if (grad_weights.has_value()) fill_strides4(p.dweights_stride, *grad_weights);
  p.a = attn_args(s, m, q, k, v, out, w, sc,
                  worth_streaming(dq) || worth_streaming(dk) || worth_streaming(dv), dr);
  if (out_lo.has_value()) fill_strides4(p.a.out_lo_stride, *out_lo);
  p.delta = delta.mutable_data_ptr();
  p.kv_chunks = 1;
  p.key_group = ma_attn_bwd_key_group(&p);

  const size_t bytes = ma_attn_bwd_scratch_bytes(&p);
  const int64_t work = s.B * s.H * s.Lq * s.Lk * (3 * s.D + 2 * s.Dv);  // the five products
  if (s.Lk == 0) {
    torch::stable::zero_(dq);
    if (head_mask_grad) torch::stable::zero_(dhm_rows);
  } else if (ma_attn_bwd_single_pass(&p)) {
    // key chunks > 1: per-chunk partial sums of dq (and dhm), added up in chunk order
    p.kv_chunks = ma_attn_bwd_kv_chunks(&p);
    // the chunks' partial sums come from the scratch pool like the per-thread
    // scratch, so a call with them faults in no fresh pages once the pool
    // holds a large enough block (one head at L = 8192, D = 128: 32 MB)
    const size_t esz = q.scalar_type() == ScalarType::Double ? sizeof(double) : sizeof(float);
    const size_t dq_elems = p.kv_chunks > 1 ? static_cast<size_t>(p.kv_chunks * s.B * s.H * s.Lq * s.D) : 0;
    const size_t dhm_elems =
        p.kv_chunks > 1 && head_mask_grad ? static_cast<size_t>(p.kv_chunks * s.B * s.H * s.Lq) : 0;
    std::optional<ScratchLease> parts;
    if (dq_elems) parts.emplace((dq_elems + dhm_elems) * esz);
    p.dq_part = dq_elems ? parts->block.ptr : nullptr;
    p.dhm_part = dhm_elems ? static_cast<char*>(parts->block.ptr) + dq_elems * esz : nullptr;
    run_tasks(ma_attn_bwd_fused_task, &p, ma_attn_bwd_fused_work_items(&p), bytes, q, 1, work);
    if (p.kv_chunks > 1)
      run_tasks(ma_attn_bwd_reduce_task, &p, ma_attn_bwd_reduce_work_items(&p), bytes, q, 1, work);
  } else {
    run_tasks(ma_attn_bwd_dq_task, &p, ma_attn_bwd_dq_work_items(&p), bytes, q, 1, work);
  }
  if (s.Lk > 0 && !ma_attn_bwd_single_pass(&p))
    run_tasks(ma_attn_bwd_dkdv_task, &p, ma_attn_bwd_dkdv_work_items(&p), bytes, q, 1, work);

  // d head_mask[b, h] = sum over the rows of (b, h), in a fixed order, in the
  // accumulation type: the caller rounds once, after summing over what the
  // head mask broadcasts over (ops.attention_backward).
  Tensor dhm = head_mask_grad ? torch::stable::sum(dhm_rows, std::vector<int64_t>{2})
                              : torch::stable::new_empty(q, {0}, acc);
  return {dhm, dscores};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> attn_backward(
    Tensor grad_out, std::optional<Tensor> grad_weights, Tensor q, Tensor k, Tensor v, Tensor out,
    Tensor lse, std::optional<Tensor> attn_mask, std::optional<Tensor> key_padding_mask,
    std::optional<Tensor> head_mask, bool is_causal, std::optional<double> scale,
    bool head_mask_grad, bool mask_grad, double dropout_p, std::optional<Tensor> dropout_seed,
    int64_t window_left, int64_t window_right, std::optional<double> softcap, std::optional<Tensor> sinks,
    std::optional<Tensor> out_lo) {
  const Sizes s = check_qkv(q, k, v);
  Tensor dq = blhd(q, s.B, s.H, s.Lq, s.D);
  Tensor dk = blhd(q, s.B, s.Hkv, s.Lk, s.D);
  Tensor dv = blhd(q, s.B, s.Hkv, s.Lk, s.Dv);
  for (Tensor* t : {&dq, &dk, &dv}) advise_huge_pages(*t);
  auto [dhm, dscores] = attn_backward_impl(grad_out, grad_weights, q, k, v, out, lse, attn_mask,
                                           key_padding_mask, head_mask, is_causal, scale,
                                           head_mask_grad, mask_grad, dropout_p, dropout_seed, dq, dk, dv,
                                           window_left, window_right, softcap, sinks, out_lo);
  return {dq, dk, dv, dhm, dscores};
}

// The backward writing dq, dk, dv into caller-provided views, e.g. three
// slices of one packed (B, L, 3, H, D) buffer: the gradient of a fused qkv
// projection, with no stack or copy after it. The views must not overlap.
std::tuple<Tensor, Tensor> attn_backward_into(
    Tensor grad_out, std::optional<Tensor> grad_weights, Tensor q, Tensor k, Tensor v, Tensor out,
    Tensor lse, std::optional<Tensor> attn_mask, std::optional<Tensor> key_padding_mask,
    std::optional<Tensor> head_mask, bool is_causal, std::optional<double> scale,
    bool head_mask_grad, bool mask_grad, Tensor grad_q, Tensor grad_k, Tensor grad_v, double dropout_p,
    std::optional<Tensor> dropout_seed, int64_t window_left, int64_t window_right, std::optional<double> softcap,
    std::optional<Tensor> sinks, std::optional<Tensor> out_lo) {
  // What the kernels allow (masked_attn.h): outputs that never share memory
  // with each other or with what is read, except that the single pass (no
  // grad_weights) may write grad_q, grad_k, grad_v over q, k, v themselves,
  // element for element.
  const bool two_passes = grad_weights.has_value();
  const char* names[3] = {"grad_q", "grad_k", "grad_v"};
  const Tensor* outs[3] = {&grad_q, &grad_k, &grad_v};
  const Tensor* ins[3] = {&q, &k, &v};
  for (int i = 0; i < 3; i++) {
    MA_CHECK(no_internal_overlap(*outs[i]), "masked_attn.backward_into: ", names[i],
             " has elements that share memory (an expanded or overlapping view); it must be writable element "
             "by element");
    for (int j = 0; j < i; j++)
      MA_CHECK(!may_overlap(*outs[i], *outs[j]), "masked_attn.backward_into: ", names[i], " and ", names[j],
               " share memory; each gradient needs memory of its own");
    for (int j = 0; j < 3; j++) {
      const bool exact_alias_ok = i == j && !two_passes && same_view(*outs[i], *ins[j]);
      MA_CHECK(exact_alias_ok || !may_overlap(*outs[i], *ins[j]), "masked_attn.backward_into: ", names[i],
               " shares memory with ", "qkv"[j],
               two_passes ? " (with grad_weights the gradients must not share memory with q, k, v)"
                          : " (only grad_q = q, grad_k = k, grad_v = v, element for element, is allowed)");
    }
    const Tensor* read[3] = {&grad_out, &out, &lse};
    const char* read_names[3] = {"grad_out", "out", "lse"};
    for (int j = 0; j < 3; j++)
      MA_CHECK(!may_overlap(*outs[i], *read[j]), "masked_attn.backward_into: ", names[i], " shares memory with ",
               read_names[j]);
    if (grad_weights.has_value())
      MA_CHECK(!may_overlap(*outs[i], *grad_weights), "masked_attn.backward_into: ", names[i],
               " shares memory with grad_weights");
    if (out_lo.has_value())
      MA_CHECK(!may_overlap(*outs[i], *out_lo), "masked_attn.backward_into: ", names[i], " shares memory with out_lo");
  }
  return attn_backward_impl(grad_out, grad_weights, q, k, v, out, lse, attn_mask, key_padding_mask,
                            head_mask, is_causal, scale, head_mask_grad, mask_grad, dropout_p, dropout_seed,
                            grad_q, grad_k, grad_v, window_left, window_right, softcap, sinks, out_lo);
}


// ---- packed variable-length sequences -------------------------------------------
//
// varlen_forward / varlen_backward: torch.nn.attention.varlen's conventions.
// q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv); cu_seq_q, cu_seq_k int32
// (N + 1) offsets; lse (H, Tq). The kernels run the dense template one
// sequence at a time (ma_attn_args' varlen group); this checks the offsets,
// finds the real lengths and builds the work-item tables from them.

struct Varlen {
  int64_t N = 0, Tq = 0, Tk = 0, H = 0, Hkv = 0, D = 0, Dv = 0, max_q = 0, max_k = 0;
  std::vector<int64_t> q_items, kv_items;
};

// A 1-D int32 CPU tensor of n entries, contiguous (it is read as an array).
void check_index_tensor(const Tensor& t, const char* name, int64_t n, const char* what) {
  MA_CHECK(t.is_cpu(), "masked_attn.varlen: ", name, " must be a CPU tensor");
  MA_CHECK(t.scalar_type() == ScalarType::Int, "masked_attn.varlen: ", name, " must be int32 (", what,
           "), got another dtype");
  MA_CHECK(t.dim() == 1 && (n < 0 || t.size(0) == n), "masked_attn.varlen: ", name, " must be 1-D ", what,
           ", got shape ", shape_str(t));
  MA_CHECK(t.is_contiguous(), "masked_attn.varlen: ", name, " must be contiguous");
}

// Checks q, k, v, the offsets, seqused_k, max_q, max_k and the window; fills
// the sizes and, when `plan`, the work-item tables.
// With block_table, key and value are page pools (pages, page_size, H_kv, D)
// and cu_k is not read (may be absent); seqused_k gives the lengths.
Varlen check_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
                    const std::optional<Tensor>& cu_k_opt, int64_t max_q, int64_t max_k, int64_t wl, int64_t wr,
                    const std::optional<Tensor>& seqused_k, const std::optional<Tensor>& block_table = std::nullopt) {
  Varlen r;
  const bool paged = block_table.has_value();
  MA_CHECK(q.dim() == 3, "masked_attn.varlen: query must be 3-D (T_q, H, D), got shape ", shape_str(q));
  if (paged) {
    MA_CHECK(k.dim() == 4, "masked_attn.varlen: with block_table, key must be 4-D (pages, page_size, H_kv, D), got shape ",
             shape_str(k));
    MA_CHECK(v.dim() == 4 && v.size(0) == k.size(0) && v.size(1) == k.size(1),
             "masked_attn.varlen: with block_table, value must be 4-D (pages, page_size, H_kv, Dv) like key, got key ",
             shape_str(k), ", value ", shape_str(v));
    MA_CHECK(k.size(1) > 0 && k.size(1) % kBlockK == 0, "masked_attn.varlen: page_size = key.size(1) must be a "
             "positive multiple of ", kBlockK, ", got ", k.size(1));
    MA_CHECK(seqused_k.has_value(), "masked_attn.varlen: block_table requires seqused_k");
  } else {
    MA_CHECK(cu_k_opt.has_value(), "masked_attn.varlen: cu_seq_k is required without block_table");
    MA_CHECK(k.dim() == 3, "masked_attn.varlen: key must be 3-D (T_k, H_kv, D), got shape ", shape_str(k));
    MA_CHECK(v.dim() == 3, "masked_attn.varlen: value must be 3-D (T_k, H_kv, Dv), got shape ", shape_str(v));
  }
  const int64_t kd = paged ? 1 : 0;  // key/value dims are shifted by the page dim
  MA_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu(), "masked_attn.varlen: query, key, value must be CPU tensors");
  MA_CHECK(is_floating(q.scalar_type()), "masked_attn.varlen: query must be float32, float64, bfloat16 or float16");
  MA_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
           "masked_attn.varlen: query, key and value must have the same dtype");
  r.Tq = q.size(0), r.H = q.size(1), r.D = q.size(2), r.Tk = k.size(0), r.Hkv = k.size(1 + kd),
  r.Dv = v.size(2 + kd);
  MA_CHECK(k.size(2 + kd) == r.D, "masked_attn.varlen: key head dim must equal query's (", r.D, "), got key ",
           shape_str(k));
  MA_CHECK(v.size(0) == r.Tk && v.size(1 + kd) == r.Hkv,
           "masked_attn.varlen: value must have key's tokens and heads (T_k, H_kv, Dv): key ", shape_str(k),
           ", value ", shape_str(v));
  MA_CHECK(r.Hkv > 0 ? r.H % r.Hkv == 0 : r.H == 0, "masked_attn.varlen: the number of query heads (", r.H,
           ") must be a multiple of the number of key/value heads (", r.Hkv, ")");
  MA_CHECK(cu_q.dim() == 1 && cu_q.size(0) >= 1, "masked_attn.varlen: cu_seq_q must be 1-D (N + 1,), got shape ",
           shape_str(cu_q));
  r.N = cu_q.size(0) - 1;
  check_index_tensor(cu_q, "cu_seq_q", r.N + 1, "(N + 1,)");
  if (cu_k_opt.has_value()) check_index_tensor(*cu_k_opt, "cu_seq_k", r.N + 1, "(N + 1,) like cu_seq_q");
  if (seqused_k.has_value()) check_index_tensor(*seqused_k, "seqused_k", r.N, "(N,)");
  if (paged) {
    const Tensor& bt = *block_table;
    MA_CHECK(bt.is_cpu() && bt.scalar_type() == ScalarType::Int && bt.dim() == 2 && bt.size(0) == r.N &&
                 bt.is_contiguous(),
             "masked_attn.varlen: block_table must be a contiguous int32 CPU tensor (N, max_pages) = (", r.N,
             ", ...), got shape ", shape_str(bt));
  }
  MA_CHECK(wl >= -1 && wr >= -1, "masked_attn.varlen: window_size must be (left, right) with each -1 (unbounded) "
           "or >= 0, got (", wl, ", ", wr, ")");
  const int32_t* cq = static_cast<const int32_t*>(cu_q.const_data_ptr());
  // paged: the key offsets are not read; every sequence may use all its table's pages
  std::vector<int32_t> no_ck;
  if (paged) no_ck.assign(static_cast<size_t>(r.N + 1), 0);
  const int32_t* ck = paged ? no_ck.data() : static_cast<const int32_t*>(cu_k_opt->const_data_ptr());
  const int32_t* used = seqused_k.has_value() ? static_cast<const int32_t*>(seqused_k->const_data_ptr()) : nullptr;
  MA_CHECK(cq[0] == 0 && ck[0] == 0, "masked_attn.varlen: cu_seq_q and cu_seq_k must start at 0, got ", cq[0],
           " and ", ck[0]);
  int64_t real_q = 0, real_k = 0;
  for (int64_t b = 0; b < r.N; b++) {
    MA_CHECK(cq[b + 1] >= cq[b], "masked_attn.varlen: cu_seq_q must be nondecreasing, got cu_seq_q[", b, "] = ",
             cq[b], " > cu_seq_q[", b + 1, "] = ", cq[b + 1]);
    MA_CHECK(ck[b + 1] >= ck[b], "masked_attn.varlen: cu_seq_k must be nondecreasing, got cu_seq_k[", b, "] = ",
             ck[b], " > cu_seq_k[", b + 1, "] = ", ck[b + 1]);
    int64_t lk = ck[b + 1] - ck[b];
    if (paged) {
      const Tensor& bt = *block_table;
      const int64_t P = k.size(1), pages = (used[b] + P - 1) / P;
      MA_CHECK(used[b] >= 0 && pages <= bt.size(1), "masked_attn.varlen: seqused_k[", b, "] = ", used[b],
               " needs ", pages, " pages of ", P, " but block_table has ", bt.size(1), " columns");
      const int32_t* row = static_cast<const int32_t*>(bt.const_data_ptr()) + b * bt.size(1);
      for (int64_t i = 0; i < pages; i++)
        MA_CHECK(row[i] >= 0 && row[i] < k.size(0), "masked_attn.varlen: block_table[", b, ", ", i, "] = ", row[i],
                 " is not a page of key (", k.size(0), " pages)");
      lk = used[b];
    } else if (used) {
      MA_CHECK(used[b] >= 0 && used[b] <= lk, "masked_attn.varlen: seqused_k[", b, "] = ", used[b],
               " must be in [0, cu_seq_k[", b + 1, "] - cu_seq_k[", b, "]] = [0, ", lk, "]");
      lk = used[b];
    }
    real_q = std::max<int64_t>(real_q, cq[b + 1] - cq[b]);
    real_k = std::max<int64_t>(real_k, lk);
  }
  MA_CHECK(cq[r.N] == r.Tq, "masked_attn.varlen: cu_seq_q[-1] = ", cq[r.N],
           " must equal the number of query tokens T_q = query.size(0) = ", r.Tq);
  MA_CHECK(paged || ck[r.N] == r.Tk, "masked_attn.varlen: cu_seq_k[-1] = ", ck[r.N],
           " must equal the number of key tokens T_k = key.size(0) = ", r.Tk);
  MA_CHECK(max_q >= real_q, "masked_attn.varlen: max_q = ", max_q, " is less than the longest query sequence (",
           real_q, ")");
  MA_CHECK(max_k >= real_k, "masked_attn.varlen: max_k = ", max_k, " is less than the longest key sequence (",
           real_k, ")");
  r.max_q = real_q, r.max_k = real_k;  // scratch is sized by the real longest

  // Work items, most expensive first (run_tasks hands them out one at a
  // time, so one long sequence among short ones never leaves a thread
  // idle at the end). Cost: keys read per query block, queries per key block.
  const int64_t BQ = kBlockQ, BK = kBlockK, G = r.Hkv > 0 ? r.H / r.Hkv : 1;
  struct Item {
    int64_t cost, b, h, blk;
  };
  std::vector<Item> qi, ki;
  for (int64_t b = 0; b < r.N; b++) {
    const int64_t Lq = cq[b + 1] - cq[b], Lk = used ? used[b] : ck[b + 1] - ck[b];
    const int64_t lo = wl >= 0 ? Lk - Lq - wl : -MA_BAND_INF, hi = wr >= 0 ? Lk - Lq + wr : MA_BAND_INF;
    for (int64_t qb = 0; qb * BQ < Lq; qb++) {
      const int64_t i0 = qb * BQ, nr = std::min(BQ, Lq - i0);
      const int64_t kb = lo > -MA_BAND_INF ? std::max<int64_t>(0, i0 + lo) : 0;
      const int64_t ke = hi < MA_BAND_INF ? std::min(Lk, i0 + nr + hi) : Lk;
      const int64_t cost = nr * std::max<int64_t>(ke - kb, 0) + nr;
      for (int64_t h = 0; h < r.H; h++) qi.push_back({cost, b, h, qb});
    }
    for (int64_t kb = 0; kb * BK < Lk; kb++) {
      const int64_t j0 = kb * BK, nc = std::min(BK, Lk - j0);
      const int64_t qb = hi < MA_BAND_INF ? std::max<int64_t>(0, j0 - hi) : 0;
      const int64_t qe = lo > -MA_BAND_INF ? std::min(Lq, j0 + nc - lo) : Lq;
      const int64_t cost = G * nc * std::max<int64_t>(qe - qb, 0) + nc;
      for (int64_t h = 0; h < r.Hkv; h++) ki.push_back({cost, b, h, kb});
    }
  }
  auto order = [](std::vector<Item>& v, std::vector<int64_t>& out) {
    std::stable_sort(v.begin(), v.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
    out.reserve(3 * v.size());
    for (const Item& it : v) out.insert(out.end(), {it.b, it.h, it.blk});
  };
  order(qi, r.q_items);
  order(ki, r.kv_items);
  return r;
}

// (T, H, D) as the kernels' 4-D strides {0, head, row, dim}.
void fill_strides_thd(int64_t out[4], const Tensor& t) {
  out[0] = 0, out[1] = t.stride(1), out[2] = t.stride(0), out[3] = t.stride(2);
}

// (pages, page_size, H, D) as {0, head, row, dim} and the page stride.
int64_t fill_strides_paged(int64_t out[4], const Tensor& t) {
  out[0] = 0, out[1] = t.stride(2), out[2] = t.stride(1), out[3] = t.stride(3);
  return t.stride(0);
}

ma_attn_args varlen_args(const Varlen& r, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                         const Tensor& cu_q, const std::optional<Tensor>& cu_k, const std::optional<Tensor>& seqused_k,
                         double scale, int64_t wl, int64_t wr, double softcap, const ma_mask& sinks,
                         bool stream_stores, const std::optional<Tensor>& block_table = std::nullopt) {
  ma_attn_args a{};
  a.q = q.const_data_ptr();
  a.k = k.const_data_ptr();
  a.v = v.const_data_ptr();
  to_ma_dtype(q.scalar_type(), &a.dtype);
  fill_strides_thd(a.q_stride, q);
  if (block_table.has_value()) {
    a.k_page_stride = fill_strides_paged(a.k_stride, k);
    a.v_page_stride = fill_strides_paged(a.v_stride, v);
    a.block_table = static_cast<const int32_t*>(block_table->const_data_ptr());
    a.bt_stride = block_table->size(1);
    a.page_size = k.size(1);
  } else {
    fill_strides_thd(a.k_stride, k);
    fill_strides_thd(a.v_stride, v);
  }
  fill_strides_thd(a.out_stride, out);
  a.scale = scale;
  a.softcap = softcap;
  a.sinks = sinks;
  a.B = r.N, a.H = r.H, a.Hkv = r.Hkv, a.Lq = r.max_q, a.Lk = r.max_k, a.D = r.D, a.Dv = r.Dv;
  a.block_q = kBlockQ, a.block_k = kBlockK;
  a.band_lo = -MA_BAND_INF, a.band_hi = MA_BAND_INF;  // per sequence: FN(seq_args)
  a.stat_stride[0] = 0, a.stat_stride[1] = r.Tq;
  a.stream_stores = stream_stores;
  a.isa = select_isa(a.dtype);
  a.cu_q = static_cast<const int32_t*>(cu_q.const_data_ptr());
  a.cu_k = cu_k.has_value() && !block_table.has_value() ? static_cast<const int32_t*>(cu_k->const_data_ptr()) : nullptr;
  a.seqused_k = seqused_k.has_value() ? static_cast<const int32_t*>(seqused_k->const_data_ptr()) : nullptr;
  a.window_left = wl, a.window_right = wr;  // bottom-right aligned per sequence: FN(seq_args)
  a.q_items = r.q_items.data(), a.n_q_items = static_cast<int64_t>(r.q_items.size() / 3);
  a.kv_items = r.kv_items.data(), a.n_kv_items = static_cast<int64_t>(r.kv_items.size() / 3);
  return a;
}

std::tuple<Tensor, Tensor, Tensor> varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seq_q,
                                                  std::optional<Tensor> cu_seq_k, int64_t max_q, int64_t max_k,
                                                  std::optional<double> scale, int64_t window_left,
                                                  int64_t window_right, std::optional<Tensor> seqused_k,
                                                  std::optional<Tensor> block_table, std::optional<double> softcap,
                                                  std::optional<Tensor> sinks) {
  const Varlen r = check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, window_left, window_right, seqused_k,
                                block_table);
  double cap = 0;
  ma_mask sk{};
  check_cap_sinks(r.H, softcap, sinks, &cap, &sk);
  const double sc = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(r.D));
  Tensor out = torch::stable::new_empty(q, {r.Tq, r.H, r.Dv});
  advise_huge_pages(out);
  Tensor lse = torch::stable::new_empty(q, {r.H, r.Tq}, acc_type(q.scalar_type()));
  const bool low = low_precision(q.scalar_type());
  Tensor out_lo = torch::stable::new_empty(q, {low ? r.Tq : 0, r.H, r.Dv});
  ma_attn_fwd_params p{};
  p.out = out.mutable_data_ptr();
  p.lse = lse.mutable_data_ptr();
  p.out_lo = low ? out_lo.mutable_data_ptr() : nullptr;
  p.a = varlen_args(r, q, k, v, out, cu_seq_q, cu_seq_k, seqused_k, sc, window_left, window_right, cap, sk,
                    worth_streaming(out), block_table);
  if (low) fill_strides_thd(p.a.out_lo_stride, out_lo);
  p.head_group = ma_attn_fwd_head_group(&p);
  run_tasks(ma_attn_fwd_task, &p, ma_attn_fwd_work_items(&p), ma_attn_fwd_scratch_bytes(&p), q, fwd_grain(p));
  return {out, lse, out_lo};
}

std::tuple<Tensor, Tensor, Tensor> varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out,
                                                   Tensor lse, Tensor cu_seq_q, Tensor cu_seq_k, int64_t max_q,
                                                   int64_t max_k, std::optional<double> scale,
                                                   int64_t window_left, int64_t window_right,
                                                   std::optional<double> softcap, std::optional<Tensor> sinks,
                                                   std::optional<Tensor> out_lo) {
  const Varlen r = check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, window_left, window_right, std::nullopt);
  double cap = 0;
  ma_mask sk{};
  check_cap_sinks(r.H, softcap, sinks, &cap, &sk);
  const double sc = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(r.D));
  check_shape(out, "out", {r.Tq, r.H, r.Dv}, "(T_q, H, Dv)", q.scalar_type());
  check_out_lo(out_lo, {r.Tq, r.H, r.Dv}, "(T_q, H, Dv)", q.scalar_type());
  check_shape(grad_out, "grad_out", {r.Tq, r.H, r.Dv}, "(T_q, H, Dv)", q.scalar_type());
  MA_CHECK(lse.dim() == 2 && lse.size(0) == r.H && lse.size(1) == r.Tq &&
               lse.scalar_type() == acc_type(q.scalar_type()) && lse.is_contiguous(),
           "masked_attn.varlen: lse must be the forward's contiguous (H, T_q) log-sum-exp");
  Tensor dq = torch::stable::new_empty(q, {r.Tq, r.H, r.D});
  Tensor dk = torch::stable::new_empty(q, {r.Tk, r.Hkv, r.D});
  Tensor dv = torch::stable::new_empty(q, {r.Tk, r.Hkv, r.Dv});
  for (Tensor* t : {&dq, &dk, &dv}) advise_huge_pages(*t);
  Tensor delta = torch::stable::new_empty(q, {r.H, r.Tq}, acc_type(q.scalar_type()));
  ma_attn_bwd_params p{};
  p.dq = dq.mutable_data_ptr();
  p.dk = dk.mutable_data_ptr();
  p.dv = dv.mutable_data_ptr();
  p.dout = grad_out.const_data_ptr();
  p.out = out.const_data_ptr();
  p.out_lo = out_lo.has_value() ? out_lo->const_data_ptr() : nullptr;
  p.lse = lse.const_data_ptr();
  fill_strides_thd(p.dq_stride, dq);
  fill_strides_thd(p.dk_stride, dk);
  fill_strides_thd(p.dv_stride, dv);
  fill_strides_thd(p.dout_stride, grad_out);
  p.a = varlen_args(r, q, k, v, out, cu_seq_q, cu_seq_k, std::nullopt, sc, window_left, window_right, cap, sk,
                    worth_streaming(dq) || worth_streaming(dk) || worth_streaming(dv));
  if (out_lo.has_value()) fill_strides_thd(p.a.out_lo_stride, *out_lo);
  p.delta = delta.mutable_data_ptr();
  p.kv_chunks = 1;
  const size_t bytes = ma_attn_bwd_scratch_bytes(&p);
  run_tasks(ma_attn_bwd_dq_task, &p, ma_attn_bwd_dq_work_items(&p), bytes, q, 1);
  run_tasks(ma_attn_bwd_dkdv_task, &p, ma_attn_bwd_dkdv_work_items(&p), bytes, q, 1);
  // key rows no item covers (none: cu_seq_k[-1] == T_k and no seqused_k) would stay unwritten
  return {dq, dk, dv};
}

// ---- cross-entropy -------------------------------------------------------------
//
// input (C,), (N, C) or (N, C, d1, ..., dk) is seen by the kernels as (N, C, S),
// S = d1 * ... * dk, through a reshape that is a view whenever the d dims can
// be flattened (always for contiguous and for class-last layouts such as
// logits.transpose(1, 2)); the class stride is passed, nothing is transposed.
//
// Ops: cross_entropy (forward, saves lse), cross_entropy_backward (a new
// gradient), cross_entropy_backward_ (the gradient overwrites input: the
// opt-in inplace_backward), cross_entropy_chunk_ (per-row forward and, on
// request, the gradient in the same pass, overwriting input: the chunk step of
// linear_cross_entropy).

enum class CeReduction { None, Mean, Sum };

CeReduction ce_reduction(const std::string& r) {
  if (r == "none") return CeReduction::None;
  if (r == "mean") return CeReduction::Mean;
  MA_CHECK(r == "sum", "masked_attn.cross_entropy: reduction must be 'none', 'mean' or 'sum', got '",
                  r, "'");
  return CeReduction::Sum;
}

std::string dims_str(const std::vector<int64_t>& d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); i++) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

bool has_shape(const Tensor& t, const std::vector<int64_t>& d) {
  if (t.dim() != static_cast<int64_t>(d.size())) return false;
  for (int64_t i = 0; i < t.dim(); i++)
    if (t.size(i) != d[i]) return false;
  return true;
}

struct CeShape {
  int64_t N, C, S;
  std::vector<int64_t> rows;  // input's shape without the class dim: lse, unreduced loss
};

CeShape ce_shape(const Tensor& input) {
  MA_CHECK(input.dim() >= 1,
                  "masked_attn.cross_entropy: input must be (C,), (N, C) or (N, C, d1, ..., dk), got shape ()");
  CeShape s{1, input.size(0), 1, {}};
  if (input.dim() >= 2) {
    s.N = input.size(0);
    s.C = input.size(1);
    s.rows.push_back(s.N);
    for (int64_t i = 2; i < input.dim(); i++) {
      s.S *= input.size(i);
      s.rows.push_back(input.size(i));
    }
  }
  return s;
}

// Everything the forward and the backward both read, checked, with the
// (N, C, S) / (N, S) views the pointers point into (kept alive here).
struct CeInputs {
  ma_ce_args a{};
  Tensor input, target, weight;
};

CeInputs ce_inputs(const Tensor& input, const Tensor& target, const std::optional<Tensor>& weight,
                   int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap,
                   const CeShape& s) {
  MA_CHECK(input.is_cpu() && target.is_cpu() && (!weight.has_value() || weight->is_cpu()),
                  "masked_attn.cross_entropy: input, target and weight must be CPU tensors");
  const ScalarType dt = input.scalar_type();
  MA_CHECK(is_floating(dt), "masked_attn.cross_entropy: input must be float32, float64, bfloat16 or float16");
  MA_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0,
                  "masked_attn.cross_entropy: label_smoothing must be in [0, 1], got ", label_smoothing);
  MA_CHECK(z_loss >= 0.0 && std::isfinite(z_loss),
                  "masked_attn.cross_entropy: z_loss must be a finite number >= 0, got ", z_loss);
  MA_CHECK(!softcap.has_value() || (*softcap > 0.0 && std::isfinite(*softcap)),
                  "masked_attn.cross_entropy: softcap must be None or a finite number > 0, got ",
                  softcap.has_value() ? *softcap : 0.0);
  CeInputs in;
  ma_ce_args& a = in.a;
  to_ma_dtype(dt, &a.dtype);
  a.N = s.N, a.C = s.C, a.S = s.S;
  a.ignore_index = ignore_index;
  a.label_smoothing = label_smoothing;
  a.z_loss = z_loss;
  a.softcap = softcap.has_value() ? *softcap : 0.0;
  a.isa = select_isa(a.dtype);
  in.input = torch::stable::reshape(input, {s.N, s.C, s.S});
  a.input = in.input.const_data_ptr();
  for (int i = 0; i < 3; i++) a.input_stride[i] = in.input.stride(i);

  if (target.scalar_type() == ScalarType::Long) {  // class indices
    const bool ok = has_shape(target, s.rows) || (input.dim() == 1 && has_shape(target, {1}));
    MA_CHECK(ok, "masked_attn.cross_entropy: class-index target must have shape ", dims_str(s.rows),
                    " (input ", shape_str(input), " without its class dim), got ", shape_str(target));
    in.target = torch::stable::reshape(target, {s.N, s.S});
    a.target = static_cast<const int64_t*>(in.target.const_data_ptr());
    a.target_stride[0] = in.target.stride(0), a.target_stride[1] = in.target.stride(1);
    for (int64_t n = 0; n < s.N; n++)
      for (int64_t j = 0; j < s.S; j++) {
        const int64_t t = a.target[n * a.target_stride[0] + j * a.target_stride[1]];
        MA_CHECK(t == ignore_index || (t >= 0 && t < s.C), "masked_attn.cross_entropy: Target ", t,
                        " is out of bounds.");
      }
  } else {  // class probabilities
    MA_CHECK(is_floating(target.scalar_type()),
                    "masked_attn.cross_entropy: target must be int64 class indices or floating point "
                    "class probabilities");
    MA_CHECK(target.scalar_type() == dt && target.dim() == input.dim() &&
                        has_shape(target, std::vector<int64_t>(input.sizes().begin(), input.sizes().end())),
                    "masked_attn.cross_entropy: probability target must have input's shape ", shape_str(input),
                    " and dtype, got shape ", shape_str(target));
    in.target = torch::stable::reshape(target, {s.N, s.C, s.S});
    a.target_prob = in.target.const_data_ptr();
    for (int i = 0; i < 3; i++) a.target_stride[i] = in.target.stride(i);
  }

  if (weight.has_value()) {
    MA_CHECK(weight->dim() == 1 && weight->size(0) == s.C && weight->scalar_type() == dt,
                    "masked_attn.cross_entropy: weight must be a (C,) = (", s.C,
                    ",) tensor with input's dtype, got shape ", shape_str(*weight));
    in.weight = *weight;
    a.weight = in.weight.const_data_ptr();
    a.weight_stride = in.weight.stride(0);
  }
  return in;
}

// The in-place ops write the gradient through the (N, C, S) view of input:
// it must be a view (not a copy) whose elements do not overlap.
void check_writable_in_place(const CeInputs& in, const Tensor& input, const char* op) {
  bool ok = in.input.data_ptr() == input.data_ptr();
  for (int i = 0; i < 3 && ok; i++) ok = in.input.stride(i) > 0 || in.input.size(i) <= 1;
  MA_CHECK(ok, "masked_attn.", op, ": input must be a tensor whose memory can be written in place "
                  "(its dims after the class dim flattenable, no expanded dims), got shape ", shape_str(input));
  MA_CHECK(no_internal_overlap(input), "masked_attn.", op,
           ": input has elements that share memory (an overlapping view); the gradient cannot be written over it");
  if (in.a.weight) MA_CHECK(!may_overlap(input, in.weight), "masked_attn.", op, ": input shares memory with weight");
  if (in.a.target_prob)
    MA_CHECK(!may_overlap(input, in.target), "masked_attn.", op, ": input shares memory with target");
}


// Rows are independent work items. A job too small to pay for waking the
// pool's threads runs inline (no scratch: the kernels need none).
void run_ce_rows(ma_task_fn fn, const void* params, int64_t R, int64_t C, const Tensor& like) {
  constexpr int64_t kInlineElems = 1 << 15;
  if (R * (C > 0 ? C : 1) < kInlineElems) {
    ma_task_ctx ctx{params, nullptr};
    if (R > 0) fn(0, R, &ctx);
    return;
  }
  run_tasks(fn, params, R, 0, like);
}

std::tuple<Tensor, Tensor> ce_forward(Tensor input, Tensor target, std::optional<Tensor> weight,
                                      std::string reduction, int64_t ignore_index, double label_smoothing,
                                      double z_loss, std::optional<double> softcap, bool inplace_backward) {
  const CeReduction red = ce_reduction(reduction);
  const CeShape s = ce_shape(input);
  const CeInputs in = ce_inputs(input, target, weight, ignore_index, label_smoothing, z_loss, softcap, s);
  // the backward will write its gradient over input: say now if it cannot
  if (inplace_backward) check_writable_in_place(in, input, "cross_entropy(inplace_backward=True)");
  const int64_t R = s.N * s.S;
  const ScalarType acc = acc_type(input.scalar_type());

  Tensor lse = torch::stable::new_empty(input, s.rows, acc);
  Tensor loss = red == CeReduction::None ? torch::stable::new_empty(input, s.rows)
                                         : torch::stable::new_empty(input, {R}, acc);
  ma_ce_fwd_params p{};
  p.loss = loss.mutable_data_ptr();
  to_ma_dtype(loss.scalar_type(), &p.loss_dtype);
  p.lse = lse.mutable_data_ptr();
  p.a = in.a;
  run_ce_rows(ma_ce_fwd_task, &p, R, s.C, input);
  if (red == CeReduction::None) return {loss, lse};

  // Reduced in double, serially in row order: the same bits for any thread count.
  double total = ma_ce_sum(p.loss, p.loss_dtype, R);
  if (red == CeReduction::Mean) {  // no kept weight (no kept row, or all of weight 0): NaN, as PyTorch
    const double kept = ma_ce_total_weight(&p.a);
    total = kept == 0.0 ? NAN : total / kept;
  }
  Tensor out = torch::stable::new_empty(input, std::vector<int64_t>{});
  torch::stable::fill_(out, total);
  return {out, lse};
}

// The backward into dinput3 ((N, C, S), input's dtype; may be the input's own
// (N, C, S) view) and, for probability targets, dtarget3 (or none).
void ce_backward_into(const Tensor& grad_loss, const CeInputs& in, const CeShape& s, const Tensor& input,
                      const Tensor& lse, CeReduction red, Tensor& dinput3, Tensor* dtarget3) {
  const int64_t R = s.N * s.S;
  MA_CHECK(has_shape(lse, s.rows) && lse.scalar_type() == acc_type(input.scalar_type()) &&
                      lse.is_contiguous() && lse.is_cpu(),
                  "masked_attn.cross_entropy_backward: lse must be the forward's contiguous ", dims_str(s.rows),
                  " log-sum-exp, got shape ", shape_str(lse));
  const bool grad_ok = red == CeReduction::None ? has_shape(grad_loss, s.rows) : grad_loss.numel() == 1;
  MA_CHECK(grad_ok && grad_loss.is_cpu() && grad_loss.scalar_type() == input.scalar_type(),
                  "masked_attn.cross_entropy_backward: grad_loss must have the loss's shape ",
                  red == CeReduction::None ? dims_str(s.rows) : std::string("()"), " and input's dtype, got shape ",
                  shape_str(grad_loss));
  Tensor dloss = red == CeReduction::None ? torch::stable::reshape(grad_loss, {s.N, s.S}) : grad_loss;

  ma_ce_bwd_params p{};
  p.dinput = dinput3.mutable_data_ptr();
  p.dtarget = dtarget3 ? dtarget3->mutable_data_ptr() : nullptr;
  for (int i = 0; i < 3; i++) {
    p.dinput_stride[i] = dinput3.stride(i);
    p.dtarget_stride[i] = dtarget3 ? dtarget3->stride(i) : 0;
  }
  p.dloss = dloss.const_data_ptr();
  p.dloss_stride[0] = red == CeReduction::None ? dloss.stride(0) : 0;
  p.dloss_stride[1] = red == CeReduction::None ? dloss.stride(1) : 0;
  p.a = in.a;
  p.dloss_scale = red == CeReduction::Mean ? 1.0 / ma_ce_total_weight(&p.a) : 1.0;  // 0 kept rows: inf, unused
  p.lse = lse.const_data_ptr();
  run_ce_rows(ma_ce_bwd_task, &p, R, s.C, input);
}

std::tuple<Tensor, Tensor> ce_backward(Tensor grad_loss, Tensor input, Tensor target,
                                       std::optional<Tensor> weight, Tensor lse, std::string reduction,
                                       int64_t ignore_index, double label_smoothing, bool target_grad,
                                       double z_loss, std::optional<double> softcap) {
  const CeReduction red = ce_reduction(reduction);
  const CeShape s = ce_shape(input);
  const CeInputs in = ce_inputs(input, target, weight, ignore_index, label_smoothing, z_loss, softcap, s);
  MA_CHECK(!target_grad || in.a.target_prob,
                  "masked_attn.cross_entropy_backward: target_grad=True needs probability targets");
  Tensor dinput = torch::stable::new_empty(input, {s.N, s.C, s.S});
  Tensor dtarget = torch::stable::new_empty(input, {target_grad ? s.N : 0, s.C, s.S});
  advise_huge_pages(dinput);
  ce_backward_into(grad_loss, in, s, input, lse, red, dinput, target_grad ? &dtarget : nullptr);
  return {torch::stable::reshape(dinput, input.sizes()),
          target_grad ? torch::stable::reshape(dtarget, input.sizes()) : torch::stable::new_empty(input, {0})};
}

// In place: the gradient overwrites input (no new (N, C) buffer).
void ce_backward_inplace(Tensor grad_loss, Tensor input, Tensor target, std::optional<Tensor> weight, Tensor lse,
                         std::string reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                         std::optional<double> softcap) {
  const CeReduction red = ce_reduction(reduction);
  const CeShape s = ce_shape(input);
  CeInputs in = ce_inputs(input, target, weight, ignore_index, label_smoothing, z_loss, softcap, s);
  check_writable_in_place(in, input, "cross_entropy_backward_");
  ce_backward_into(grad_loss, in, s, input, lse, red, in.input, nullptr);
}

// The chunk step of linear_cross_entropy: per-row loss and lse (acc type,
// input's shape without the class dim) of class targets and, when grad_scale
// is given, the gradient (times grad_scale, the same for every row) written
// over input in the same pass over each row, while the row is in cache.
std::tuple<Tensor, Tensor> ce_chunk_inplace(Tensor input, Tensor target, std::optional<Tensor> weight,
                                            std::optional<double> grad_scale, int64_t ignore_index,
                                            double label_smoothing, double z_loss, std::optional<double> softcap) {
  const CeShape s = ce_shape(input);
  CeInputs in = ce_inputs(input, target, weight, ignore_index, label_smoothing, z_loss, softcap, s);
  MA_CHECK(in.a.target != nullptr, "masked_attn.cross_entropy_chunk_: target must be int64 class indices");
  const ScalarType acc = acc_type(input.scalar_type());
  Tensor lse = torch::stable::new_empty(input, s.rows, acc);
  Tensor loss = torch::stable::new_empty(input, s.rows, acc);
  ma_ce_fwd_params p{};
  p.loss = loss.mutable_data_ptr();
  to_ma_dtype(acc, &p.loss_dtype);
  p.lse = lse.mutable_data_ptr();
  if (grad_scale.has_value()) {
    check_writable_in_place(in, input, "cross_entropy_chunk_");
    p.dinput = in.input.mutable_data_ptr();
    for (int i = 0; i < 3; i++) p.dinput_stride[i] = in.input.stride(i);
    p.dloss_scale = *grad_scale;
  }
  p.a = in.a;
  run_ce_rows(ma_ce_fwd_task, &p, s.N * s.S, s.C, input);
  return {loss, lse};
}

}  // namespace

// Plain C entry points for torch_masked_attn (ops.py, through ctypes).
extern "C" {
// Frees the scratch blocks the pool keeps between calls; returns the bytes freed.
size_t ma_release_memory(void) { return scratch_pool().release(); }
// Bytes the pool keeps now (idle), and the scratch the last parallel region used.
size_t ma_scratch_idle_bytes(void) { return scratch_pool().idle_bytes(); }
size_t ma_scratch_last_bytes(void) { return last_scratch_bytes.load(); }
}

STABLE_TORCH_LIBRARY(masked_attn, m) {
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, Tensor? key_padding_mask=None, "
      "Tensor? head_mask=None, bool is_causal=False, float? scale=None, bool need_weights=False, "
      "float dropout_p=0., Tensor? dropout_seed=None, "
      "int window_left=-1, int window_right=-1, float? softcap=None, Tensor? sinks=None) "
      "-> (Tensor out, Tensor lse, Tensor weights, Tensor out_lo)");
  m.def(
      "backward(Tensor grad_out, Tensor? grad_weights, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor? attn_mask=None, Tensor? key_padding_mask=None, Tensor? head_mask=None, "
      "bool is_causal=False, float? scale=None, bool head_mask_grad=False, bool mask_grad=False, "
      "float dropout_p=0., Tensor? dropout_seed=None, "
      "int window_left=-1, int window_right=-1, float? softcap=None, Tensor? sinks=None, Tensor? out_lo=None) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_head_mask, Tensor grad_scores)");
  m.def(
      "backward_into(Tensor grad_out, Tensor? grad_weights, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor? attn_mask, Tensor? key_padding_mask, Tensor? head_mask, bool is_causal, "
      "float? scale, bool head_mask_grad, bool mask_grad, Tensor(a!) grad_q, Tensor(b!) grad_k, "
      "Tensor(c!) grad_v, float dropout_p=0., Tensor? dropout_seed=None, "
      "int window_left=-1, int window_right=-1, float? softcap=None, Tensor? sinks=None, Tensor? out_lo=None) "
      "-> (Tensor grad_head_mask, Tensor grad_scores)");
  m.def(
      "varlen_forward(Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor? cu_seq_k, int max_q, "
      "int max_k, float? scale=None, int window_left=-1, int window_right=-1, Tensor? seqused_k=None, "
      "Tensor? block_table=None, float? softcap=None, Tensor? sinks=None) -> (Tensor out, Tensor lse, Tensor out_lo)");
  m.def(
      "varlen_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
      "Tensor cu_seq_q, Tensor cu_seq_k, int max_q, int max_k, float? scale=None, int window_left=-1, "
      "int window_right=-1, float? softcap=None, Tensor? sinks=None, Tensor? out_lo=None) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  m.def(
      "cross_entropy(Tensor input, Tensor target, Tensor? weight=None, str reduction='mean', "
      "int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, float? softcap=None, "
      "bool inplace_backward=False) -> (Tensor loss, Tensor lse)");
  m.def(
      "cross_entropy_backward(Tensor grad_loss, Tensor input, Tensor target, Tensor? weight, Tensor lse, "
      "str reduction, int ignore_index, float label_smoothing, bool target_grad=False, float z_loss=0.0, "
      "float? softcap=None) -> (Tensor grad_input, Tensor grad_target)");
  m.def(
      "cross_entropy_backward_(Tensor grad_loss, Tensor(a!) input, Tensor target, Tensor? weight, Tensor lse, "
      "str reduction, int ignore_index, float label_smoothing, float z_loss=0.0, float? softcap=None) -> ()");
  m.def(
      "cross_entropy_chunk_(Tensor(a!) input, Tensor target, Tensor? weight=None, float? grad_scale=None, "
      "int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, float? softcap=None) "
      "-> (Tensor loss, Tensor lse)");
}

STABLE_TORCH_LIBRARY_IMPL(masked_attn, CPU, m) {
  m.impl("forward", TORCH_BOX(&attn_forward));
  m.impl("backward", TORCH_BOX(&attn_backward));
  m.impl("backward_into", TORCH_BOX(&attn_backward_into));
  m.impl("varlen_forward", TORCH_BOX(&varlen_forward));
  m.impl("varlen_backward", TORCH_BOX(&varlen_backward));
  m.impl("cross_entropy", TORCH_BOX(&ce_forward));
  m.impl("cross_entropy_backward", TORCH_BOX(&ce_backward));
  m.impl("cross_entropy_backward_", TORCH_BOX(&ce_backward_inplace));
  m.impl("cross_entropy_chunk_", TORCH_BOX(&ce_chunk_inplace));
}
