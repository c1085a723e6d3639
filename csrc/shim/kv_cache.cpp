// kv_cache.cpp -- cache_write: new key / value rows copied into a KV cache in
// place (vLLM's reshape_and_cache; flash-attn's k / v append), for the
// serving paths (transformers' continuous batching, flash_attn_with_kvcache),
// or quantized into an 8-bit one; quantize_kv: rows of an 8-bit cache.

#include "shim/common.hpp"

namespace masked_attn_shim {

namespace {

// (pages, page_size, Hkv, dim) or (rows, Hkv, dim) as one page of all its rows.
void cache_side(ma_cache_side* side, const Tensor& src, Tensor& cache, const char* src_name,
                const char* cache_name, int64_t T, int64_t Hkv, const std::optional<Tensor>& scale,
                const char* scale_name) {
  MA_CHECK(src.dim() == 3 && src.size(0) == T && src.size(1) == Hkv, "masked_attn.cache_write: ", src_name,
           " must be (T, H_kv, dim) = (", T, ", ", Hkv, ", dim), got ", shape_str(src));
  MA_CHECK(cache.dim() == 3 || cache.dim() == 4, "masked_attn.cache_write: ", cache_name,
           " must be (pages, page_size, H_kv, dim) or (rows, H_kv, dim), got ", shape_str(cache));
  const int64_t o = cache.dim() - 3;  // 1 for a paged cache
  MA_CHECK(cache.size(1 + o) == Hkv && cache.size(2 + o) == src.size(2), "masked_attn.cache_write: ", cache_name, " ",
           shape_str(cache), " does not hold rows of ", src_name, " ", shape_str(src), " (H_kv, dim)");
  // quantizing: float rows into an int8 cache (int8 rows into one are copied as they are)
  const bool i8 = cache.scalar_type() == ScalarType::Char && src.scalar_type() != ScalarType::Char;
  MA_CHECK(src.scalar_type() == cache.scalar_type() || (i8 && src.scalar_type() != ScalarType::Double &&
                                                        is_floating(src.scalar_type())),
           "masked_attn.cache_write: ", src_name, " and ", cache_name,
           " must have the same dtype (or ", cache_name, " int8, an 8-bit cache, and ", src_name,
           " float32, bfloat16 or float16)");
  MA_CHECK(i8 == scale.has_value(), "masked_attn.cache_write: ",
           i8 ? "float rows into an int8 (8-bit) cache are quantized and need its scales, " : "", scale_name,
           i8 ? ", a float32 tensor of the cache's shape without its last dim"
              : " is for float rows quantized into an int8 (8-bit) cache only");
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
  if (!i8) return;
  const Tensor& sc = *scale;
  bool ok = sc.is_cpu() && sc.scalar_type() == ScalarType::Float && sc.dim() == cache.dim() - 1;
  for (int64_t i = 0; ok && i < sc.dim(); i++) ok = sc.size(i) == cache.size(i);
  MA_CHECK(ok, "masked_attn.cache_write: ", scale_name, " must be a float32 CPU tensor of ", cache_name,
           ".shape[:-1], got shape ", shape_str(sc), " for ", cache_name, " ", shape_str(cache));
  MA_CHECK(side->cache_stride[3] == 1 || side->dim <= MA_KV_STRIDED_I8_ROW, "masked_attn.cache_write: an int8 ",
           cache_name, " whose rows are not contiguous (a K^T page) takes rows of at most ", MA_KV_STRIDED_I8_ROW,
           " elements, got ", side->dim);
  MA_CHECK(no_internal_overlap(sc) && !may_overlap(sc, cache), "masked_attn.cache_write: ", scale_name,
           " cannot be written in place (shared or overlapping memory)");
  side->scale = static_cast<float*>(sc.mutable_data_ptr());
  side->scale_stride[0] = o ? sc.stride(0) : 0;
  side->scale_stride[1] = sc.stride(o), side->scale_stride[2] = sc.stride(o + 1);
}

}  // namespace

void cache_write(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, Tensor slots,
                 std::optional<Tensor> key_scale, std::optional<Tensor> value_scale) {
  MA_CHECK(slots.dim() == 1 && (slots.scalar_type() == ScalarType::Long || slots.scalar_type() == ScalarType::Int),
           "masked_attn.cache_write: slots must be a 1-D int64 or int32 tensor, got ", shape_str(slots));
  MA_CHECK(slots.is_cpu() && slots.is_contiguous(), "masked_attn.cache_write: slots must be a contiguous CPU tensor");
  MA_CHECK(key_cache.dim() == value_cache.dim() && (key_cache.dim() == 3 || key_cache.size(1) == value_cache.size(1)),
           "masked_attn.cache_write: key_cache and value_cache must both be paged with one page size, or both flat, "
           "got ", shape_str(key_cache), " and ", shape_str(value_cache));
  ma_cache_write_params p{};
  p.T = slots.size(0);
  p.Hkv = key.dim() == 3 ? key.size(1) : 0;
  MA_CHECK(key.scalar_type() == value.scalar_type(), "masked_attn.cache_write: key and value must have the same dtype");
  // an 8-bit cache quantizes rows of unit stride: others are copied first
  if (key_scale.has_value() && key.dim() == 3 && key.stride(2) != 1) key = torch::stable::contiguous(key);
  if (value_scale.has_value() && value.dim() == 3 && value.stride(2) != 1) value = torch::stable::contiguous(value);
  cache_side(&p.k, key, key_cache, "key", "key_cache", p.T, p.Hkv, key_scale, "key_scale");
  cache_side(&p.v, value, value_cache, "value", "value_cache", p.T, p.Hkv, value_scale, "value_scale");
  if (key_scale.has_value() || value_scale.has_value()) {
    to_ma_dtype(key.scalar_type(), &p.src_dtype);
    p.isa = select_isa(p.src_dtype);
  }
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

std::tuple<Tensor, Tensor> quantize_kv(Tensor x) {
  MA_CHECK(x.is_cpu(), "masked_attn.quantize_kv: x must be a CPU tensor");
  MA_CHECK(x.scalar_type() == ScalarType::Float || low_precision(x.scalar_type()),
           "masked_attn.quantize_kv: x must be float32, bfloat16 or float16");
  MA_CHECK(x.dim() >= 1 && x.size(x.dim() - 1) > 0, "masked_attn.quantize_kv: x must have a last dim (D > 0) to "
           "quantize by rows, got shape ", shape_str(x));
  Tensor xc = torch::stable::contiguous(x);
  const int64_t D = x.size(x.dim() - 1), rows = x.numel() / D;
  Tensor q = new_strided(x, {rows, D}, {}, ScalarType::Char);
  advise_huge_pages(q);  // a cache decoding streams: 2 MB pages read it 12% faster (docs/performance.md)
  Tensor scale = new_strided(x, {rows}, {}, ScalarType::Float);
  ma_kv_quant_params p{};
  p.x = xc.const_data_ptr();
  to_ma_dtype(x.scalar_type(), &p.dtype);
  p.x_stride = D, p.q_stride = D, p.D = D;
  p.q = static_cast<int8_t*>(q.mutable_data_ptr());
  p.scale = static_cast<float*>(scale.mutable_data_ptr());
  p.isa = select_isa(p.dtype);
  run_tasks(ma_kv_quantize_task, &p, rows, 0, x, 0, rows * D);
  return {q, scale};
}

}  // namespace masked_attn_shim
