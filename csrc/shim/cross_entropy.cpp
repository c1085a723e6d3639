// cross_entropy.cpp -- the cross-entropy ops.

#include "shim/common.hpp"

namespace masked_attn_shim {

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

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

}  // namespace masked_attn_shim
