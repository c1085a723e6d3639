// attention.cpp -- the attention ops: forward, backward and backward_into
// (dense (B, H, L, D) inputs; the packed variable-length ones: varlen.cpp).

#include "shim/common.hpp"

namespace masked_attn_shim {

namespace {

// A new (B, H, L, D) tensor stored as (B, L, H, D), the layout of q, k, v
// projected by one linear layer and viewed per head; gradients and outputs in
// that layout reshape to (B, L, H * D) for free.
Tensor blhd(const Tensor& like, int64_t B, int64_t H, int64_t L, int64_t D) {
  return new_strided(like, {B, H, L, D}, {L * H * D, D, H * D, 1});
}

void fill_strides4(int64_t out[4], const Tensor& t) {
  for (int i = 0; i < 4; i++) out[i] = t.stride(i);
}

// What the forward and the backward of one call both read (ma_attn_args),
// filled in one place: q, k, v and out with their strides, the canonical
// masks, the options, sizes and tiles, and the variant.
ma_attn_args attn_args(const Sizes& s, const Masks& m, const AttnOpts& o, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& out, double scale, bool stream_stores) {
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
  a.opts = o.c;
  a.diagonal = o.diagonal;
  ma_attn_band(a.diagonal, o.c.window_left, o.c.window_right, &a.band_lo, &a.band_hi);
  a.stat_stride[0] = s.H * s.Lq, a.stat_stride[1] = s.Lq;
  a.scale = scale;
  a.B = s.B, a.H = s.H, a.Hkv = s.Hkv, a.Lq = s.Lq, a.Lk = s.Lk, a.D = s.D, a.Dv = s.Dv;
  a.stream_stores = stream_stores;
  a.isa = select_isa(a.dtype);
  const ma_traits t = kernel_traits(a.dtype, a.isa);
  a.block_q = t.block_q, a.block_k = t.block_k;
  return a;
}

double default_scale(const Sizes& s, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(s.D));
}

// The forward of a checked call.
std::tuple<Tensor, Tensor, Tensor, Tensor> forward_impl(const Sizes& s, const Masks& m, const AttnOpts& o,
                                                        const Tensor& q, const Tensor& k, const Tensor& v,
                                                        double scale, bool need_weights, bool for_backward) {
  // out (B, H, Lq, Dv) is stored as (B, Lq, H, Dv): the layout the output
  // projection reads, so (B, Lq, H * Dv) is a free view.
  Tensor out = blhd(q, s.B, s.H, s.Lq, s.Dv);
  advise_huge_pages(out);
  Tensor lse = new_strided(q, {s.B, s.H, s.Lq}, {}, acc_type(q.scalar_type()));
  Tensor weights = need_weights ? new_strided(q, {s.B, s.H, s.Lq, s.Lk}, {}) : new_strided(q, {0}, {});
  // out_lo only where a backward will take it: without it, bfloat16's tile
  // products may round P to bfloat16 (masked_attn.h, out_lo)
  const bool low = low_precision(q.scalar_type()) && for_backward;
  Tensor out_lo = low ? blhd(q, s.B, s.H, s.Lq, s.Dv) : new_strided(q, {0}, {});

  ma_attn_fwd_params p{};
  p.out = out.mutable_data_ptr();
  p.lse = lse.mutable_data_ptr();
  p.weights = need_weights ? weights.mutable_data_ptr() : nullptr;
  p.out_lo = low ? out_lo.mutable_data_ptr() : nullptr;
  p.a = attn_args(s, m, o, q, k, v, out, scale, worth_streaming(out));
  if (low) fill_strides4(p.a.out_lo_stride, out_lo);

  if (s.Lk == 0) {  // no key at all: every row is fully masked
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -INFINITY);
    if (o.sinks.has_value()) {  // lse = the sink's logit (masked_attn.h)
      Tensor sk = torch::stable::contiguous(torch::stable::to(*o.sinks, acc_type(q.scalar_type())));
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
  run_attn_fwd(p);
  return {out, lse, weights, out_lo};
}

}  // namespace

// ---- ops --------------------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor, Tensor> attn_forward(const AttnOptArgs& opts, Tensor q, Tensor k, Tensor v,
                                                        std::optional<Tensor> attn_mask,
                                                        std::optional<Tensor> key_padding_mask,
                                                        std::optional<Tensor> head_mask, bool is_causal,
                                                        std::optional<double> scale, bool need_weights,
                                                        double dropout_p, std::optional<Tensor> dropout_seed,
                                                        bool for_backward, std::optional<Tensor> k_scale,
                                                        std::optional<Tensor> v_scale) {
  const Sizes s = check_qkv(q, k, v, true);
  const Masks m = check_masks(s, attn_mask, key_padding_mask);
  AttnOpts o = parse_attn_opts(s, opts, {is_causal, dropout_p, dropout_seed, head_mask}, false);
  parse_kv_scales("masked_attn", q, k, v, k_scale, v_scale, KvLayout::Dense, &o.c);
  return forward_impl(s, m, o, q, k, v, default_scale(s, scale), need_weights, for_backward);
}

namespace {

// What the backward reads besides q, k, v, the masks and the options: the
// forward's outputs, the gradients of its outputs, and the mask gradients wanted.
struct BwdIn {
  Tensor grad_out;
  std::optional<Tensor> grad_weights;
  Tensor out, lse;
  std::optional<Tensor> out_lo;
  bool head_mask_grad = false, mask_grad = false;
};

// The backward of a checked call, writing dq, dk, dv into the given (B, H,
// L, D) tensors (any strides); returns (grad_head_mask, grad_scores,
// grad_sinks), the options' gradients reduced to their shapes (options.cpp).
std::tuple<Tensor, Tensor, Tensor> backward_impl(const Sizes& s, const Masks& m, const AttnOpts& o, const Tensor& q,
                                         const Tensor& k, const Tensor& v, const BwdIn& in, double scale,
                                         Tensor dq, Tensor dk, Tensor dv) {
  check_shape(in.out, "out", {s.B, s.H, s.Lq, s.Dv}, "(B, H, Lq, Dv)", q.scalar_type());
  check_out_lo(in.out_lo, {s.B, s.H, s.Lq, s.Dv}, "(B, H, Lq, Dv)", q.scalar_type());
  check_shape(in.grad_out, "grad_out", {s.B, s.H, s.Lq, s.Dv}, "(B, H, Lq, Dv)", q.scalar_type());
  const Tensor& lse = in.lse;
  MA_CHECK(lse.dim() == 3 && lse.size(0) == s.B && lse.size(1) == s.H && lse.size(2) == s.Lq &&
                      lse.scalar_type() == acc_type(q.scalar_type()) && lse.is_contiguous(),
                  "masked_attn: lse must be the forward's contiguous (B, H, Lq) log-sum-exp");
  if (in.grad_weights.has_value())
    check_shape(*in.grad_weights, "grad_weights", {s.B, s.H, s.Lq, s.Lk}, "(B, H, Lq, Lk)",
                q.scalar_type());
  const bool head_mask_grad = in.head_mask_grad, mask_grad = in.mask_grad;
  MA_CHECK(!head_mask_grad || o.head_mask.has_value(),
                  "masked_attn: head_mask_grad=True needs a head_mask");

  check_shape(dq, "grad_q", {s.B, s.H, s.Lq, s.D}, "(B, H, Lq, D)", q.scalar_type());
  check_shape(dk, "grad_k", {s.B, s.Hkv, s.Lk, s.D}, "(B, Hkv, Lk, D)", q.scalar_type());
  check_shape(dv, "grad_v", {s.B, s.Hkv, s.Lk, s.Dv}, "(B, Hkv, Lk, Dv)", q.scalar_type());
  const ScalarType acc = acc_type(q.scalar_type());
  Tensor delta = new_strided(q, {s.B, s.H, s.Lq}, {}, acc);
  Tensor dhm_rows = torch::stable::new_zeros(q, {head_mask_grad ? s.B : 0, s.H, s.Lq}, acc);
  // dL/dS, the gradient of an additive mask: materialised only when a mask
  // requires grad; zero where no tile is computed (masked, skipped blocks)
  Tensor dscores = mask_grad ? torch::stable::new_zeros(q, {s.B, s.H, s.Lq, s.Lk}, acc)
                             : new_strided(q, {0}, {}, acc);

  ma_attn_bwd_params p{};
  p.dq = dq.mutable_data_ptr();
  p.dk = dk.mutable_data_ptr();
  p.dv = dv.mutable_data_ptr();
  p.dhm_rows = head_mask_grad ? dhm_rows.mutable_data_ptr() : nullptr;
  p.dscores = mask_grad ? dscores.mutable_data_ptr() : nullptr;
  p.dout = in.grad_out.const_data_ptr();
  p.dweights = in.grad_weights.has_value() ? in.grad_weights->const_data_ptr() : nullptr;
  p.out = in.out.const_data_ptr();
  p.out_lo = in.out_lo.has_value() ? in.out_lo->const_data_ptr() : nullptr;
  p.lse = lse.const_data_ptr();
  fill_strides4(p.dq_stride, dq);
  fill_strides4(p.dk_stride, dk);
  fill_strides4(p.dv_stride, dv);
  fill_strides4(p.dout_stride, in.grad_out);
  if (in.grad_weights.has_value()) fill_strides4(p.dweights_stride, *in.grad_weights);
  p.a = attn_args(s, m, o, q, k, v, in.out, scale,
                  worth_streaming(dq) || worth_streaming(dk) || worth_streaming(dv));
  if (in.out_lo.has_value()) fill_strides4(p.a.out_lo_stride, *in.out_lo);
  p.delta = delta.mutable_data_ptr();
  if (s.Lk == 0) {
    p.delta = nullptr;  // not written: no sink gradient (out is 0)
    torch::stable::zero_(dq);
    if (head_mask_grad) torch::stable::zero_(dhm_rows);
  } else {
    run_attn_bwd(p);  // the weights' pre-pass, the pass (key chunks: their partial sums), the reduce
  }

  return {head_mask_grad_of(o, head_mask_grad ? &dhm_rows : nullptr, q), dscores, sinks_grad_of(o, p, q)};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> attn_backward(
    const AttnOptArgs& opts, Tensor grad_out, std::optional<Tensor> grad_weights, Tensor q, Tensor k, Tensor v,
    Tensor out, Tensor lse, std::optional<Tensor> attn_mask, std::optional<Tensor> key_padding_mask,
    std::optional<Tensor> head_mask, bool is_causal, std::optional<double> scale, bool head_mask_grad,
    bool mask_grad, double dropout_p, std::optional<Tensor> dropout_seed, std::optional<Tensor> out_lo) {
  const Sizes s = check_qkv(q, k, v);
  const Masks m = check_masks(s, attn_mask, key_padding_mask);
  const AttnOpts o = parse_attn_opts(s, opts, {is_causal, dropout_p, dropout_seed, head_mask}, false);
  Tensor dq = blhd(q, s.B, s.H, s.Lq, s.D);
  Tensor dk = blhd(q, s.B, s.Hkv, s.Lk, s.D);
  Tensor dv = blhd(q, s.B, s.Hkv, s.Lk, s.Dv);
  for (Tensor* t : {&dq, &dk, &dv}) advise_huge_pages(*t);
  auto [dhm, dscores, dsinks] = backward_impl(s, m, o, q, k, v,
                                              {grad_out, grad_weights, out, lse, out_lo, head_mask_grad, mask_grad},
                                              default_scale(s, scale), dq, dk, dv);
  return {dq, dk, dv, dhm, dscores, dsinks};
}

// The backward writing dq, dk, dv into caller-provided views, e.g. three
// slices of one packed (B, L, 3, H, D) buffer: the gradient of a fused qkv
// projection, with no stack or copy after it. The views must not overlap.
std::tuple<Tensor, Tensor, Tensor> attn_backward_into(
    const AttnOptArgs& opts, Tensor grad_out, std::optional<Tensor> grad_weights, Tensor q, Tensor k, Tensor v,
    Tensor out, Tensor lse, std::optional<Tensor> attn_mask, std::optional<Tensor> key_padding_mask,
    std::optional<Tensor> head_mask, bool is_causal, std::optional<double> scale, bool head_mask_grad,
    bool mask_grad, Tensor grad_q, Tensor grad_k, Tensor grad_v, double dropout_p,
    std::optional<Tensor> dropout_seed, std::optional<Tensor> out_lo) {
  // What the kernels allow (masked_attn.h): outputs that never share memory
  // with each other or with what is read, except grad_q, grad_k, grad_v over
  // q, k, v themselves, element for element.
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
      const bool exact_alias_ok = i == j && same_view(*outs[i], *ins[j]);
      MA_CHECK(exact_alias_ok || !may_overlap(*outs[i], *ins[j]), "masked_attn.backward_into: ", names[i],
               " shares memory with ", "qkv"[j],
               " (only grad_q = q, grad_k = k, grad_v = v, element for element, is allowed)");
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
  const Sizes s = check_qkv(q, k, v);
  const Masks m = check_masks(s, attn_mask, key_padding_mask);
  const AttnOpts o = parse_attn_opts(s, opts, {is_causal, dropout_p, dropout_seed, head_mask}, false);
  return backward_impl(s, m, o, q, k, v, {grad_out, grad_weights, out, lse, out_lo, head_mask_grad, mask_grad},
                       default_scale(s, scale), grad_q, grad_k, grad_v);
}

}  // namespace masked_attn_shim
