// kv_cache.cpp -- cache_write: new key / value rows copied into a KV cache in
// place (vLLM's reshape_and_cache; flash-attn's k / v append), for the
// serving paths (transformers' continuous batching, flash_attn_with_kvcache).

#include "shim/common.hpp"

namespace masked_attn_shim {

namespace {

// (pages, page_size, Hkv, dim) or (rows, Hkv, dim) as one page of all its rows.
void cache_side(ma_cache_side* side, const Tensor& src, Tensor& cache, const char* src_name,
                const char* cache_name, int64_t T, int64_t Hkv) {
  MA_CHECK(src.dim() == 3 && src.size(0) == T && src.size(1) == Hkv, "masked_attn.cache_write: ", src_name,
           " must be (T, H_kv, dim) = (", T, ", ", Hkv, ", dim), got ", shape_str(src));
  MA_CHECK(cache.dim() == 3 || cache.dim() == 4, "masked_attn.cache_write: ", cache_name,
           " must be (pages, page_size, H_kv, dim) or (rows, H_kv, dim), got ", shape_str(cache));
  const int64_t o = cache.dim() - 3;  // 1 for a paged cache
  MA_CHECK(cache.size(1 + o) == Hkv && cache.size(2 + o) == src.size(2), "masked_attn.cache_write: ", cache_name, " ",
           shape_str(cache), " does not hold rows of ", src_name, " ", shape_str(src), " (H_kv, dim)");
  MA_CHECK(src.scalar_type() == cache.scalar_type(), "masked_attn.cache_write: ", src_name, " and ", cache_name,
           " must have the same dtype");
  MA_CHECK(src.is_cpu() && cache.is_cpu(), "masked_attn.cache_write: ", src_name, " and ", cache_name,
           " must be CPU tensors");
  MA_CHECK(no_internal_overlap(cache), "masked_attn.cache_write: ", cache_name,
           " has elements that share memory (an expanded tensor?): it cannot be written in place");
  MA_CHECK(!may_overlap(src, cache), "masked_attn.cache_write: ", src_name, " overlaps ", cache_name);
  side->src = src.const_data_ptr();
  side->cache = cache.mutable_data_ptr();
  side->dim = src.size(2);
  for (int i = 0; i < 3; i++) side->src_stride[i] = src.stride(i);
  side->cache_stride[0] = o ? cache.stride(0) : 0;
  for (int i = 0; i < 3; i++) side->cache_stride[1 + i] = cache.stride(o + i);
}

}  // namespace

void cache_write(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, Tensor slots) {
  MA_CHECK(slots.dim() == 1 && (slots.scalar_type() == ScalarType::Long || slots.scalar_type() == ScalarType::Int),
           "masked_attn.cache_write: slots must be a 1-D int64 or int32 tensor, got ", shape_str(slots));
  MA_CHECK(slots.is_cpu() && slots.is_contiguous(), "masked_attn.cache_write: slots must be a contiguous CPU tensor");
  MA_CHECK(key_cache.dim() == value_cache.dim() && (key_cache.dim() == 3 || key_cache.size(1) == value_cache.size(1)),
           "masked_attn.cache_write: key_cache and value_cache must both be paged with one page size, or both flat, "
           "got ", shape_str(key_cache), " and ", shape_str(value_cache));
  ma_cache_write_params p{};
  p.T = slots.size(0);
  p.Hkv = key.dim() == 3 ? key.size(1) : 0;
  cache_side(&p.k, key, key_cache, "key", "key_cache", p.T, p.Hkv);
  cache_side(&p.v, value, value_cache, "value", "value_cache", p.T, p.Hkv);
  p.page_size = key_cache.dim() == 4 ? key_cache.size(1) : std::max<int64_t>(key_cache.size(0), 1);
  // a slot must lie in both caches (transformers' views of one buffer differ by a page)
  const int64_t pages = std::min(key_cache.size(0), value_cache.size(0));
  const int64_t n_slots = key_cache.dim() == 4 ? pages * key_cache.size(1) : pages;
  p.elem_bytes = key.element_size();
  if (slots.scalar_type() == ScalarType::Long)
    p.slots64 = static_cast<const int64_t*>(slots.const_data_ptr());
  else
    p.slots32 = static_cast<const int32_t*>(slots.const_data_ptr());
  std::vector<int64_t> used;
  used.reserve(static_cast<size_t>(p.T));
  for (int64_t t = 0; t < p.T; t++) {
    const int64_t s = p.slots64 ? p.slots64[t] : p.slots32[t];
    MA_CHECK(s < n_slots, "masked_attn.cache_write: slots[", t, "] = ", s, " is outside the caches' ", n_slots,
             " slots (pages * page_size)");
    if (s >= 0) used.push_back(s);
  }
  std::sort(used.begin(), used.end());
  const bool shared = std::adjacent_find(used.begin(), used.end()) != used.end();
  // work: a row's bytes stand for its cost; a decoding step's few rows, or rows sharing a slot
  // (written in order: the later row wins), stay on this thread
  const int64_t row_bytes = p.Hkv * (key.size(2) + value.size(2)) * static_cast<int64_t>(p.elem_bytes);
  run_tasks(ma_cache_write_task, &p, p.T, 0, key, 0, shared ? 1 : p.T * row_bytes / 4);
}

}  // namespace masked_attn_shim
