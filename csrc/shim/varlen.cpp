// varlen.cpp -- the attention ops on packed variable-length sequences.

#include "shim/common.hpp"

namespace masked_attn_shim {

// ---- packed variable-length sequences -------------------------------------------
//
// varlen_forward / varlen_backward: torch.nn.attention.varlen's conventions.
// q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv); cu_seq_q, cu_seq_k int32
// (N + 1) offsets; lse (H, Tq). The kernels run the dense template one
// sequence at a time (ma_attn_args' varlen group); this checks the offsets
// and finds the real lengths (the work-item tables: ma_attn_plan_fwd / _bwd).

namespace {

struct Varlen {
  int64_t N = 0, Tq = 0, Tk = 0, H = 0, Hkv = 0, D = 0, Dv = 0, max_q = 0, max_k = 0;
  ma_isa isa = MA_ISA_SCALAR;  // the call's variant (select_isa), and its kernels' tile
  ma_traits traits{};
  // as the options see them: N entries, the longest lengths
  Sizes sizes() const { return {N, H, Hkv, max_q, max_k, D, Dv}; }
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

// Checks q, k, v, the offsets, seqused_k, max_q, max_k; fills the sizes.
// With block_table, key and value are page pools (pages, page_size, H_kv, D)
// and cu_k is not read (may be absent); seqused_k gives the lengths.
Varlen check_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
                    const std::optional<Tensor>& cu_k_opt, int64_t max_q, int64_t max_k,
                    const std::optional<Tensor>& seqused_k, const std::optional<Tensor>& block_table = std::nullopt,
                    bool int8_kv = false) {
  Varlen r;
  const bool paged = block_table.has_value();
  MA_CHECK(q.dim() == 3, "masked_attn.varlen: query must be 3-D (T_q, H, D), got shape ", shape_str(q));
  if (paged) {
    MA_CHECK(k.dim() == 4, "masked_attn.varlen: with block_table, key must be 4-D (pages, page_size, H_kv, D), got shape ",
             shape_str(k));
    MA_CHECK(v.dim() == 4 && v.size(0) == k.size(0) && v.size(1) == k.size(1),
             "masked_attn.varlen: with block_table, value must be 4-D (pages, page_size, H_kv, Dv) like key, got key ",
             shape_str(k), ", value ", shape_str(v));
    MA_CHECK(seqused_k.has_value(), "masked_attn.varlen: block_table requires seqused_k");
  } else {
    MA_CHECK(cu_k_opt.has_value(), "masked_attn.varlen: cu_seq_k is required without block_table");
    MA_CHECK(k.dim() == 3, "masked_attn.varlen: key must be 3-D (T_k, H_kv, D), got shape ", shape_str(k));
    MA_CHECK(v.dim() == 3, "masked_attn.varlen: value must be 3-D (T_k, H_kv, Dv), got shape ", shape_str(v));
  }
  const int64_t kd = paged ? 1 : 0;  // key/value dims are shifted by the page dim
  MA_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu(), "masked_attn.varlen: query, key, value must be CPU tensors");
  MA_CHECK(is_floating(q.scalar_type()), "masked_attn.varlen: query must be float32, float64, bfloat16 or float16");
  MA_CHECK((k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type()) ||
               (int8_kv && is_int8_kv(k, v)),
           "masked_attn.varlen: query, key and value must have the same dtype",
           int8_kv ? " (or key and value int8, an 8-bit cache, with k_scale and v_scale)" : "");
  ma_dtype dt = MA_F32;
  to_ma_dtype(q.scalar_type(), &dt);
  r.isa = select_isa(dt);
  r.traits = kernel_traits(dt, r.isa);
  const int64_t page = r.traits.block_k;  // a key block lies in one page
  MA_CHECK(!paged || (k.size(1) > 0 && k.size(1) % page == 0), "masked_attn.varlen: page_size = key.size(1) must be a "
           "positive multiple of ", page, ", got ", k.size(1));
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
                         const AttnOpts& o, double scale, bool stream_stores,
                         const std::optional<Tensor>& block_table = std::nullopt) {
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
  a.opts = o.c;  // the window bottom-right aligned per sequence: FN(seq_args)
  a.B = r.N, a.H = r.H, a.Hkv = r.Hkv, a.Lq = r.max_q, a.Lk = r.max_k, a.D = r.D, a.Dv = r.Dv;
  a.block_q = r.traits.block_q, a.block_k = r.traits.block_k;
  a.band_lo = -MA_BAND_INF, a.band_hi = MA_BAND_INF;  // diagonal and band per sequence: FN(seq_args)
  a.stat_stride[0] = 0, a.stat_stride[1] = r.Tq;
  a.stream_stores = stream_stores;
  a.isa = r.isa;
  a.cu_q = static_cast<const int32_t*>(cu_q.const_data_ptr());
  a.cu_k = cu_k.has_value() && !block_table.has_value() ? static_cast<const int32_t*>(cu_k->const_data_ptr()) : nullptr;
  a.seqused_k = seqused_k.has_value() ? static_cast<const int32_t*>(seqused_k->const_data_ptr()) : nullptr;
  return a;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> varlen_forward(const AttnOptArgs& opts, Tensor q, Tensor k, Tensor v,
                                                  Tensor cu_seq_q, std::optional<Tensor> cu_seq_k, int64_t max_q,
                                                  int64_t max_k, std::optional<double> scale,
                                                  std::optional<Tensor> seqused_k, std::optional<Tensor> block_table,
                                                  bool for_backward, std::optional<Tensor> k_scale,
                                                  std::optional<Tensor> v_scale) {
  const Varlen r = check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table, true);
  AttnOpts o = parse_attn_opts(r.sizes(), opts, {}, true);
  parse_kv_scales("masked_attn.varlen", q, k, v, k_scale, v_scale,
                  block_table.has_value() ? KvLayout::Paged : KvLayout::Packed, &o.c);
  const double sc = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(r.D));
  Tensor out = new_strided(q, {r.Tq, r.H, r.Dv}, {});
  advise_huge_pages(out);
  Tensor lse = new_strided(q, {r.H, r.Tq}, {}, acc_type(q.scalar_type()));
  const bool low = low_precision(q.scalar_type()) && for_backward;  // as attn_forward
  Tensor out_lo = new_strided(q, {low ? r.Tq : 0, r.H, r.Dv}, {});
  ma_attn_fwd_params p{};
  p.out = out.mutable_data_ptr();
  p.lse = lse.mutable_data_ptr();
  p.out_lo = low ? out_lo.mutable_data_ptr() : nullptr;
  p.a = varlen_args(r, q, k, v, out, cu_seq_q, cu_seq_k, seqused_k, o, sc, worth_streaming(out), block_table);
  if (low) fill_strides_thd(p.a.out_lo_stride, out_lo);
  run_attn_fwd(p);
  return {out, lse, out_lo};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> varlen_backward(const AttnOptArgs& opts, Tensor grad_out, Tensor q,
                                                           Tensor k, Tensor v, Tensor out, Tensor lse,
                                                           Tensor cu_seq_q, Tensor cu_seq_k, int64_t max_q,
                                                           int64_t max_k, std::optional<double> scale,
                                                           std::optional<Tensor> out_lo) {
  const Varlen r = check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, std::nullopt);
  const AttnOpts o = parse_attn_opts(r.sizes(), opts, {}, true);
  const double sc = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(r.D));
  check_shape(out, "out", {r.Tq, r.H, r.Dv}, "(T_q, H, Dv)", q.scalar_type());
  check_out_lo(out_lo, {r.Tq, r.H, r.Dv}, "(T_q, H, Dv)", q.scalar_type());
  check_shape(grad_out, "grad_out", {r.Tq, r.H, r.Dv}, "(T_q, H, Dv)", q.scalar_type());
  MA_CHECK(lse.dim() == 2 && lse.size(0) == r.H && lse.size(1) == r.Tq &&
               lse.scalar_type() == acc_type(q.scalar_type()) && lse.is_contiguous(),
           "masked_attn.varlen: lse must be the forward's contiguous (H, T_q) log-sum-exp");
  Tensor dq = new_strided(q, {r.Tq, r.H, r.D}, {});
  Tensor dk = new_strided(q, {r.Tk, r.Hkv, r.D}, {});
  Tensor dv = new_strided(q, {r.Tk, r.Hkv, r.Dv}, {});
  for (Tensor* t : {&dq, &dk, &dv}) advise_huge_pages(*t);
  Tensor delta = new_strided(q, {r.H, r.Tq}, {}, acc_type(q.scalar_type()));
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
  p.a = varlen_args(r, q, k, v, out, cu_seq_q, cu_seq_k, std::nullopt, o, sc,
                    worth_streaming(dq) || worth_streaming(dk) || worth_streaming(dv));
  if (out_lo.has_value()) fill_strides_thd(p.a.out_lo_stride, *out_lo);
  p.delta = delta.mutable_data_ptr();
  run_attn_bwd(p);
  // key rows no item covers (none: cu_seq_k[-1] == T_k and no seqused_k) would stay unwritten
  return {dq, dk, dv, sinks_grad_of(o, p, q)};
}

}  // namespace masked_attn_shim
