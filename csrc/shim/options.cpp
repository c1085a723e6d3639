// options.cpp -- the options of an attention call (the masks aside: window,
// soft-cap, sinks, ALiBi; the dense ops' head mask and dropout), checked and
// normalised in one place for the five attention ops (forward, backward,
// backward_into, varlen_forward, varlen_backward) into ma_attn_opts, what the
// kernels read. The options all five take are declared once, in kOpts: the
// schemas' shared tail (attn_schema) and how each value is read off the stack.

#include "shim/common.hpp"

namespace masked_attn_shim {

namespace {

// The options every attention schema ends with, in their order: a new one is
// a row here, its index in OptIndex and its check in parse_attn_opts.
enum class OptKind { Int, OptFloat, OptTensor };
struct OptDecl {
  const char* schema;  // as the schema spells it, with its default
  OptKind kind;
};
constexpr OptDecl kOpts[] = {
    {"int window_left=-1", OptKind::Int},         {"int window_right=-1", OptKind::Int},
    {"float? softcap=None", OptKind::OptFloat},   {"Tensor? sinks=None", OptKind::OptTensor},
    {"Tensor? alibi_slopes=None", OptKind::OptTensor}, {"int diagonal=0", OptKind::Int},
};
enum OptIndex { kWindowLeft, kWindowRight, kSoftcap, kSinks, kAlibi, kDiagonal, kOptCount };
static_assert(kOptCount == sizeof(kOpts) / sizeof(kOpts[0]), "kOpts and OptIndex must list the same options");

int64_t opt_int(const AttnOptArgs& in, OptIndex i) { return std::get<int64_t>(in[i]); }
const std::optional<double>& opt_float(const AttnOptArgs& in, OptIndex i) {
  return std::get<std::optional<double>>(in[i]);
}
const std::optional<Tensor>& opt_tensor(const AttnOptArgs& in, OptIndex i) {
  return std::get<std::optional<Tensor>>(in[i]);
}

}  // namespace

std::string attn_schema(const char* head, const char* tail) {
  std::string s = head;
  for (const OptDecl& o : kOpts) s += std::string(", ") + o.schema;
  return s + tail;
}

uint64_t attn_opt_count() { return kOptCount; }

AttnOptArgs take_attn_opt_args(const StableIValue* values) {
  namespace d = torch::stable::detail;
  AttnOptArgs r;
  r.reserve(kOptCount);
  for (int i = 0; i < kOptCount; i++) switch (kOpts[i].kind) {  // each value converted once: it is owned then
      case OptKind::Int: r.emplace_back(d::to<int64_t>(values[i])); break;
      case OptKind::OptFloat: r.emplace_back(d::to<std::optional<double>>(values[i])); break;
      case OptKind::OptTensor: r.emplace_back(d::to<std::optional<Tensor>>(values[i])); break;
    }
  return r;
}

namespace {

// dropout_p in [0, 1]; with dropout_p > 0, dropout_seed is an int64 CPU tensor
// of shape (2,): (seed, offset), the Philox key and counter words
// (csrc/attention/philox.h). The op draws nothing: the caller does (Python,
// from PyTorch's default generator), so a given seed reproduces the mask.
void parse_dropout(const Sizes& s, double dropout_p, const std::optional<Tensor>& dropout_seed, ma_attn_opts* o) {
  MA_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "masked_attn: dropout_p must be in [0, 1], got ", dropout_p);
  if (dropout_p == 0.0) return;
  MA_CHECK(dropout_seed.has_value(), "masked_attn: dropout_p > 0 needs dropout_seed, an int64 tensor (seed, offset)");
  const Tensor& t = *dropout_seed;
  MA_CHECK(t.is_cpu() && t.scalar_type() == ScalarType::Long && t.dim() == 1 && t.size(0) == 2,
           "masked_attn: dropout_seed must be an int64 CPU tensor of shape (2,) (seed, offset), got shape ",
           shape_str(t), t.scalar_type() == ScalarType::Long ? ", int64" : ", not int64",
           t.is_cpu() ? ", on the CPU" : ", not on the CPU");
  MA_CHECK(s.Lq <= (int64_t{1} << 32) && s.Lk <= (int64_t{1} << 35),
           "masked_attn: dropout needs Lq <= 2^32 and Lk <= 2^35 (the Philox counter's words)");
  const int64_t* x = static_cast<const int64_t*>(t.const_data_ptr());
  o->dropout_p = dropout_p;
  o->dropout_seed = static_cast<uint64_t>(x[0]);
  o->dropout_offset = static_cast<uint64_t>(x[t.stride(0)]);
}

// The window: each side -1 (no bound) or >= 0, about the diagonal (query i's
// is key i + diagonal: ma_attn_args). Dense calls normalise it: a side that
// reaches every key (i + diagonal - left <= 0 for every i, or i + diagonal +
// right >= Lk - 1) is unbounded (-1), after is_causal sets the right side to 0.
// Varlen calls keep it as given (bottom-right aligned per sequence:
// FN(seq_args)) and take no diagonal of their own.
void parse_window(const Sizes& s, int64_t left, int64_t right, int64_t d, const DenseOptArgs& dense, bool varlen,
                  ma_attn_opts* o, int64_t* diagonal) {
  MA_CHECK(left >= -1, "masked_attn: window_left must be -1 (no bound) or >= 0, got ", left);
  MA_CHECK(right >= -1, "masked_attn: window_right must be -1 (no bound) or >= 0, got ", right);
  if (varlen) {
    MA_CHECK(d == 0, "masked_attn.varlen: diagonal must be 0 (each sequence is aligned to its bottom right), got ",
             d);
    o->window_left = left, o->window_right = right;
    *diagonal = 0;
    return;
  }
  constexpr int64_t kMaxDiagonal = int64_t{1} << 40;  // the band's sums stay far from MA_BAND_INF
  MA_CHECK(d > -kMaxDiagonal && d < kMaxDiagonal, "masked_attn: diagonal must be within +-2^40, got ", d);
  o->window_left = left < 0 || d - left <= -(s.Lq - 1) ? -1 : left;
  const int64_t r = dense.is_causal ? 0 : right;
  o->window_right = r < 0 || d + r >= s.Lk - 1 ? -1 : r;
  *diagonal = d;
}

}  // namespace

AttnOpts parse_attn_opts(const Sizes& s, const AttnOptArgs& in, const DenseOptArgs& dense, bool varlen) {
  MA_CHECK(in.size() == kOptCount, "masked_attn: the options' values do not match their declarations");
  AttnOpts r;
  ma_attn_opts& o = r.c;
  parse_window(s, opt_int(in, kWindowLeft), opt_int(in, kWindowRight), opt_int(in, kDiagonal), dense, varlen, &o,
               &r.diagonal);
  if (const auto& softcap = opt_float(in, kSoftcap); softcap.has_value()) {
    MA_CHECK(std::isfinite(*softcap) && *softcap > 0, "masked_attn: softcap must be None or a finite number > 0, got ",
             *softcap);
    o.softcap = *softcap;
  }
  if (const auto& sinks = opt_tensor(in, kSinks); sinks.has_value()) {
    MA_CHECK(sinks->dim() == 1 && sinks->size(0) == s.H, "masked_attn: sinks must have shape (H,) = (", s.H,
             ",), got ", shape_str(*sinks));
    o.sinks = canonical_mask(sinks, "sinks", {s.H}, "(H,)", false);
    r.sinks = sinks;
  }
  if (dense.head_mask.has_value()) {
    const Tensor& hm = *dense.head_mask;
    MA_CHECK((hm.dim() == 1 && hm.size(0) == s.H) || (hm.dim() == 2 && hm.size(0) == s.B && hm.size(1) == s.H),
             "masked_attn: head_mask must have shape (H,) = (", s.H, ",) or (B, H) = (", s.B, ", ", s.H,
             "), got ", shape_str(hm));
    o.head_mask = canonical_mask(dense.head_mask, "head_mask", {s.B, s.H}, "(B, H)", false);
    r.head_mask = dense.head_mask;
  }
  if (const auto& alibi = opt_tensor(in, kAlibi); alibi.has_value()) {  // flash-attn's: (H,) or (B, H) float32
    const Tensor& al = *alibi;
    MA_CHECK(al.scalar_type() == ScalarType::Float, "masked_attn: alibi_slopes must be float32, got another dtype");
    MA_CHECK((al.dim() == 1 && al.size(0) == s.H) || (al.dim() == 2 && al.size(0) == s.B && al.size(1) == s.H),
             "masked_attn: alibi_slopes must have shape (H,) = (", s.H, ",) or (B, H) = (", s.B, ", ", s.H,
             "), got ", shape_str(al));
    o.alibi = canonical_mask(alibi, "alibi_slopes", {s.B, s.H}, "(B, H)", false);
  }
  parse_dropout(s, dense.dropout_p, dense.dropout_seed, &o);
  return r;
}

namespace {

ma_mask kv_scale(const char* fn, const char* name, const Tensor& x, const char* x_name, const Tensor& sc,
                 KvLayout layout) {
  bool ok = sc.is_cpu() && sc.scalar_type() == ScalarType::Float && sc.dim() == x.dim() - 1;
  for (int64_t i = 0; ok && i < sc.dim(); i++) ok = sc.size(i) == x.size(i);
  std::string want = "(";
  for (int64_t i = 0; i + 1 < x.dim(); i++) want += (i ? ", " : "") + std::to_string(x.size(i));
  MA_CHECK(ok, fn, ": ", name, " must be a float32 CPU tensor of ", x_name, ".shape[:-1] = ", want, "), got shape ",
           shape_str(sc), sc.scalar_type() == ScalarType::Float ? "" : ", not float32",
           sc.is_cpu() ? "" : ", not on the CPU");
  ma_mask m{};
  m.ptr = sc.const_data_ptr();
  m.dtype = MA_F32;
  switch (layout) {  // (b, head, row, page)
    case KvLayout::Dense: m.stride[0] = sc.stride(0), m.stride[1] = sc.stride(1), m.stride[2] = sc.stride(2); break;
    case KvLayout::Packed: m.stride[1] = sc.stride(1), m.stride[2] = sc.stride(0); break;
    case KvLayout::Paged: m.stride[1] = sc.stride(2), m.stride[2] = sc.stride(1), m.stride[3] = sc.stride(0); break;
  }
  return m;
}

}  // namespace

void parse_kv_scales(const char* fn, const Tensor& q, const Tensor& k, const Tensor& v,
                     const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale, KvLayout layout,
                     ma_attn_opts* o) {
  if (!is_int8_kv(k, v)) {
    MA_CHECK(!k_scale.has_value() && !v_scale.has_value(), fn,
             ": k_scale and v_scale are the scales of an 8-bit cache: they need int8 k and v");
    return;
  }
  MA_CHECK(k_scale.has_value() && v_scale.has_value(), fn,
           ": int8 k and v (an 8-bit cache) need both k_scale and v_scale (torch_masked_attn.functional.quantize_kv)");
  MA_CHECK(q.scalar_type() == ScalarType::Float || low_precision(q.scalar_type()), fn,
           ": with an 8-bit cache q must be float32, bfloat16 or float16");
  o->k_scale = kv_scale(fn, "k_scale", k, "k", *k_scale, layout);
  o->v_scale = kv_scale(fn, "v_scale", v, "v", *v_scale, layout);
}

Tensor head_mask_grad_of(const AttnOpts& o, const Tensor* dhm_rows, const Tensor& like) {
  if (!dhm_rows) return new_strided(like, {0}, {}, acc_type(like.scalar_type()));
  const Tensor& hm = *o.head_mask;
  Tensor dhm = torch::stable::sum(*dhm_rows, std::vector<int64_t>{2});  // (B, H)
  if (hm.dim() == 1) dhm = torch::stable::sum(dhm, std::vector<int64_t>{0});
  return torch::stable::to(dhm, hm.scalar_type());
}

Tensor sinks_grad_of(const AttnOpts& o, const ma_attn_bwd_params& p, const Tensor& like) {
  if (!o.sinks.has_value()) return new_strided(like, {0}, {}, acc_type(like.scalar_type()));
  Tensor d = torch::stable::new_zeros(like, {p.a.H}, ScalarType::Double);
  if (p.delta) ma_attn_bwd_sinks_grad(&p, static_cast<double*>(d.mutable_data_ptr()));
  return torch::stable::to(d, o.sinks->scalar_type());
}

}  // namespace masked_attn_shim
