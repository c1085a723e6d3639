/* undef_tmpl.h -- clears the macros an instance of attention_tmpl.h defined. */
#undef ACC
#undef FN
#undef LOAD
#undef STORE
#undef LOG
#undef GEMM
#undef EXP_SUB_SUM
#undef COL_MAX
#undef EXP_SUB_COL
#undef TRANSPOSE
#undef ROW_MAX
#undef DOT_KEYS
#undef AXPY_KEYS
#undef STREAM_ROW_F32
#undef STREAM_FENCE
#undef GEMM_ROWSCALE
