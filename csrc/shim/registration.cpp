// registration.cpp -- the op schemas (STABLE_TORCH_LIBRARY) and their CPU
// kernels, the functions of attention.cpp, varlen.cpp, cross_entropy.cpp and kv_cache.cpp.

#include "shim/common.hpp"

// libstdc++'s "is this process single-threaded" flag, renamed here by setup.py's shim flags
// (__libc_single_threaded is glibc 2.32's; the wheels' floor is 2.28, csrc/common/glibc_compat.h):
// 0, so reference counts always take their atomic path, as they must in a threaded library.
extern "C" {
__attribute__((visibility("hidden"))) char ma_libc_single_threaded = 0;
}

using namespace masked_attn_shim;

STABLE_TORCH_LIBRARY(masked_attn, m) {
  // The attention schemas end with the options all five share (attn_schema, options.cpp).
  m.def(attn_schema("forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, Tensor? key_padding_mask=None, "
                    "Tensor? head_mask=None, bool is_causal=False, float? scale=None, bool need_weights=False, "
                    "float dropout_p=0., Tensor? dropout_seed=None, bool for_backward=True, "
                    "Tensor? k_scale=None, Tensor? v_scale=None",
                    ") -> (Tensor out, Tensor lse, Tensor weights, Tensor out_lo)")
            .c_str());
  m.def(attn_schema("backward(Tensor grad_out, Tensor? grad_weights, Tensor q, Tensor k, Tensor v, Tensor out, "
                    "Tensor lse, Tensor? attn_mask=None, Tensor? key_padding_mask=None, Tensor? head_mask=None, "
                    "bool is_causal=False, float? scale=None, bool head_mask_grad=False, bool mask_grad=False, "
                    "float dropout_p=0., Tensor? dropout_seed=None, Tensor? out_lo=None",
                    ") -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_head_mask, Tensor grad_scores, "
                    "Tensor grad_sinks)")
            .c_str());
  m.def(attn_schema("backward_into(Tensor grad_out, Tensor? grad_weights, Tensor q, Tensor k, Tensor v, Tensor out, "
                    "Tensor lse, Tensor? attn_mask, Tensor? key_padding_mask, Tensor? head_mask, bool is_causal, "
                    "float? scale, bool head_mask_grad, bool mask_grad, Tensor(a!) grad_q, Tensor(b!) grad_k, "
                    "Tensor(c!) grad_v, float dropout_p=0., Tensor? dropout_seed=None, Tensor? out_lo=None",
                    ") -> (Tensor grad_head_mask, Tensor grad_scores, Tensor grad_sinks)")
            .c_str());
  m.def(attn_schema("varlen_forward(Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor? cu_seq_k, "
                    "int max_q, int max_k, float? scale=None, Tensor? seqused_k=None, Tensor? block_table=None, "
                    "bool for_backward=True, Tensor? k_scale=None, Tensor? v_scale=None",
                    ") -> (Tensor out, Tensor lse, Tensor out_lo)")
            .c_str());
  m.def(attn_schema("varlen_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
                    "Tensor lse, Tensor cu_seq_q, Tensor cu_seq_k, int max_q, int max_k, float? scale=None, "
                    "Tensor? out_lo=None",
                    ") -> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_sinks)")
            .c_str());
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
  m.def(
      "cache_write(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slots, "
      "Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> ()");
  m.def("quantize_kv(Tensor x) -> (Tensor q, Tensor scale)");
}

STABLE_TORCH_LIBRARY_IMPL(masked_attn, CPU, m) {
  m.impl("forward", ATTN_BOX(&attn_forward));
  m.impl("backward", ATTN_BOX(&attn_backward));
  m.impl("backward_into", ATTN_BOX(&attn_backward_into));
  m.impl("varlen_forward", ATTN_BOX(&varlen_forward));
  m.impl("varlen_backward", ATTN_BOX(&varlen_backward));
  m.impl("cross_entropy", TORCH_BOX(&ce_forward));
  m.impl("cross_entropy_backward", TORCH_BOX(&ce_backward));
  m.impl("cross_entropy_backward_", TORCH_BOX(&ce_backward_inplace));
  m.impl("cross_entropy_chunk_", TORCH_BOX(&ce_chunk_inplace));
  m.impl("cache_write", TORCH_BOX(&cache_write));
  m.impl("quantize_kv", TORCH_BOX(&quantize_kv));
}
