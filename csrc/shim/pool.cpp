// pool.cpp -- the scratch pool, running task functions on PyTorch's intra-op
// thread pool, huge-page advice and streaming stores for large outputs, and
// the plain C entry points of the pool (_library.py, through ctypes).

#include "shim/common.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace masked_attn_shim {

// A new tensor on like's device, of like's dtype (or dtype), with these sizes and strides
// (none: contiguous), made by one call of the C shim (aoti_torch_empty_strided). Not
// torch::stable::new_empty / transpose: built for torch 2.10, they find aten::new_empty and
// aten::transpose by name in the dispatcher on every call, about 6,000 instructions each,
// which a decoding step pays for every output (docs/performance/amd-avx2-2cpu.md, "Per-call overhead").
Tensor new_strided(const Tensor& like, std::initializer_list<int64_t> sizes, std::initializer_list<int64_t> strides,
                   std::optional<ScalarType> dtype) {
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  int64_t st[8];
  MA_CHECK(ndim <= 8 && (strides.size() == 0 || strides.size() == sizes.size()),
           "masked_attn: new_strided: bad strides");
  if (strides.size() == 0) {
    int64_t n = 1;
    for (int64_t i = ndim - 1; i >= 0; i--) {
      st[i] = n;
      n *= std::max<int64_t>(sizes.begin()[i], 1);
    }
  } else {
    std::copy(strides.begin(), strides.end(), st);
  }
  int32_t dt, device_type, device_index;
  if (dtype.has_value())
    dt = torch::stable::detail::to<int32_t>(torch::stable::detail::from(*dtype));
  else
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(like.get(), &dt));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  AtenTensorHandle t;
  TORCH_ERROR_CODE_CHECK(
      aoti_torch_empty_strided(ndim, sizes.begin(), st, dt, device_type, device_index, &t));
  return Tensor(t);
}

ScratchPool& scratch_pool() {
  static ScratchPool pool;
  return pool;
}

namespace {

// Bytes of scratch the last parallel region used (the benchmarks report it).
std::atomic<size_t> last_scratch_bytes{0};

}  // namespace

// ---- running a task function on the thread pool ---------------------------

namespace {

// Runs a pass (fn over work items [0, n)) on PyTorch's intra-op pool, on at
// most `threads` threads (1: the calling thread alone), in at most one chunk
// per thread. Each chunk gets its own slice of scratch, so scratch is sized
// by the work (slices = chunks, never more than the threads) and taken from
// the pool before the parallel region; the kernels never allocate. Items
// are handed out dynamically, `grain` at a time, so threads stay busy when
// items cost different amounts (causal blocks, padded sequences). Every item
// is computed the same way whichever thread takes it: results do not depend
// on the schedule.
void run_pass(const ma_pass& pass, const void* params, int64_t threads) {
  const int64_t n = pass.n, grain = std::max<int64_t>(1, pass.grain);
  const size_t scratch_bytes = pass.scratch_bytes;
  if (n <= 0) return;
  const int64_t nchunks = std::min(std::max<int64_t>(1, threads), (n + grain - 1) / grain);
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
      pass.fn(begin, std::min(begin + grain, n), &ctx);
  };
  if (nchunks == 1) {
    worker(0, 1);
  } else {
    torch::stable::parallel_for(0, nchunks, 1, worker);
  }
}

int64_t num_threads() { return std::max<int64_t>(1, torch::stable::get_num_threads()); }

// Executes a plan (masked_attn.h): its workspace, bound to the params, then
// its passes in order.
void run_plan(const ma_plan& plan, void* params) {
  std::optional<ScratchLease> workspace;
  if (plan.bind) {
    workspace.emplace(std::max<size_t>(plan.workspace_bytes, 1));
    plan.bind(params, workspace->block.ptr);
  }
  for (int i = 0; i < plan.n_passes; i++) run_pass(plan.pass[i], params, plan.threads);
}

}  // namespace

// Ops without a plan (cross-entropy, the cache write): `grain` 0 takes about
// 16 grabs per thread; `work` (multiply-adds or bytes, 0: unknown) below
// MA_SERIAL_WORK runs on the calling thread alone.
void run_tasks(ma_task_fn fn, const void* params, int64_t n, size_t scratch_bytes,
               const Tensor& like, int64_t grain, int64_t work) {
  (void)like;
  const int64_t threads = work > 0 && work < MA_SERIAL_WORK ? 1 : num_threads();
  if (grain <= 0) grain = std::max<int64_t>(1, n / (16 * threads));
  run_pass({fn, n, grain, scratch_bytes}, params, threads);
}

// The attention ops' calls: planned in C (dispatch.c), executed here.
void run_attn_fwd(ma_attn_fwd_params& p) {
  ma_plan plan;
  MA_CHECK(ma_attn_plan_fwd(&p, num_threads(), &plan) == 0, "masked_attn: the forward could not be planned");
  run_plan(plan, &p);
}

void run_attn_bwd(ma_attn_bwd_params& p) {
  ma_plan plan;
  MA_CHECK(ma_attn_plan_bwd(&p, num_threads(), &plan) == 0, "masked_attn: the backward could not be planned");
  run_plan(plan, &p);
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
namespace {

void advise_range(void* p, uintptr_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 2 * kHuge) return;
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (base + kHuge - 1) & ~(kHuge - 1), hi = (base + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
}

}  // namespace

void advise_huge_pages(Tensor& t) {
  advise_range(t.mutable_data_ptr(), static_cast<uintptr_t>(t.numel()) * t.element_size());
}

// Outputs of at least this many bytes are written with non-temporal stores
// (stream_stores, masked_attn.h): twice a core's L2 here, so the caches could
// not have kept them for their reader anyway. Smaller ones (decoding, short
// batches) stay in cache for the next op (figures: docs/performance.md).
constexpr int64_t kStreamBytes = int64_t{4} << 20;

bool worth_streaming(const Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()) >= kStreamBytes; }

}  // namespace masked_attn_shim

using namespace masked_attn_shim;

// Plain C entry points for torch_masked_attn (_library.py, through ctypes).
extern "C" {
// Frees the scratch blocks the pool keeps between calls; returns the bytes freed.
size_t ma_release_memory(void) { return scratch_pool().release(); }
// Bytes the pool keeps now (idle), and the scratch the last parallel region used.
size_t ma_scratch_idle_bytes(void) { return scratch_pool().idle_bytes(); }
size_t ma_scratch_last_bytes(void) { return last_scratch_bytes.load(); }
// advise_huge_pages for memory Python allocated (hf.Int8Cache's buffers), before its first touch.
void ma_advise_huge_pages(void* p, size_t bytes) { advise_range(p, bytes); }
}
