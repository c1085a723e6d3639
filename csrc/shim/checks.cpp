// checks.cpp -- dtypes, input checks, mask canonicalisation and the overlap
// rules of what a kernel writes (torch's out= rules), for every op.

#include "shim/common.hpp"

namespace masked_attn_shim {

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

bool is_int8_kv(const Tensor& k, const Tensor& v) {
  return k.scalar_type() == ScalarType::Char && v.scalar_type() == ScalarType::Char;
}

// The accumulation type of the saved log-sum-exp and of the backward's scratch.
ScalarType acc_type(ScalarType t) {
  return t == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

// bfloat16 / float16: the forward also writes out_lo, out's rounding error (masked_attn.h)
bool low_precision(ScalarType dt) { return dt == ScalarType::BFloat16 || dt == ScalarType::Half; }

// ---- memory overlap ------------------------------------------------------------
//
// The rules torch applies to out= arguments (at::assert_no_internal_overlap,
// at::assert_no_overlap), restated on the stable ABI: a tensor a kernel
// writes must not have two indices at one address; two tensors overlap when
// they start at the same element, or when both are dense and their byte
// ranges intersect. Views that interleave without sharing an element (the
// q, k, v thirds of one packed projection) are allowed, as torch allows them.

namespace {

// One past the last byte of t, from its first element.
uintptr_t end_byte(const Tensor& t) {
  uintptr_t span = 1;
  for (int64_t i = 0; i < t.dim(); i++)
    if (t.size(i) > 1) span += static_cast<uintptr_t>(t.size(i) - 1) * static_cast<uintptr_t>(t.stride(i));
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) + span * t.element_size();
}

}  // namespace

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

namespace {

// Dense: its elements fill [first, end) exactly.
bool is_dense(const Tensor& t) {
  return no_internal_overlap(t) &&
         end_byte(t) - reinterpret_cast<uintptr_t>(t.const_data_ptr()) ==
             static_cast<uintptr_t>(t.numel()) * t.element_size();
}

}  // namespace

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

Sizes check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, bool int8_kv) {
  MA_CHECK(q.dim() == 4, "masked_attn: q must be 4-D (B, H, Lq, D), got shape ", shape_str(q));
  MA_CHECK(k.dim() == 4, "masked_attn: k must be 4-D (B, Hkv, Lk, D), got shape ", shape_str(k));
  MA_CHECK(v.dim() == 4, "masked_attn: v must be 4-D (B, Hkv, Lk, Dv), got shape ", shape_str(v));
  MA_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu(), "masked_attn: q, k, v must be CPU tensors");
  MA_CHECK(is_floating(q.scalar_type()),
                  "masked_attn: q must be float32, float64, bfloat16 or float16");
  MA_CHECK((k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type()) ||
               (int8_kv && is_int8_kv(k, v)),
           "masked_attn: q, k and v must have the same dtype",
           int8_kv ? " (or k and v int8, an 8-bit cache, with k_scale and v_scale)" : "");
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

Masks check_masks(const Sizes& s, const std::optional<Tensor>& attn_mask,
                  const std::optional<Tensor>& key_padding_mask) {
  Masks m;
  m.attn_mask = canonical_mask(attn_mask, "attn_mask", {s.B, s.H, s.Lq, s.Lk}, "(B, H, Lq, Lk)", true);
  if (key_padding_mask.has_value())
    MA_CHECK(key_padding_mask->dim() == 2 && key_padding_mask->size(0) == s.B &&
                        key_padding_mask->size(1) == s.Lk,
                    "masked_attn: key_padding_mask must have shape (B, Lk) = (", s.B, ", ", s.Lk,
                    "), got ", shape_str(*key_padding_mask));
  m.key_padding_mask = canonical_mask(key_padding_mask, "key_padding_mask", {s.B, s.Lk}, "(B, Lk)", true);
  return m;
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

ma_traits kernel_traits(ma_dtype dt, ma_isa isa) {
  ma_traits t{};
  MA_CHECK(ma_attn_traits(dt, isa, &t) == 0, "masked_attn: no attention kernels for dtype ", ma_dtype_name(dt),
           " and variant ", ma_isa_name(isa));
  return t;
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

}  // namespace masked_attn_shim
