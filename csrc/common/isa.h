/* isa.h -- the instruction-set policy, in one place.
 *
 * Which variants this CPU can run (ma_isa_available), which one a dtype gets
 * by default (ma_isa_best), and the override: MASKED_ATTN_ISA=scalar|avx2|
 * avx512|amx|avx512bf16|neon|sve|svebf16 in the environment, read
 * once per process, or ma_isa_force() (torch_masked_attn.ops.use_isa, which
 * the tests use to run every variant).
 * The shim asks ma_isa_for() once per op call and stores the answer in the
 * params; each op's dispatch.c maps (dtype, isa) to a kernel. */
#ifndef MA_ISA_H
#define MA_ISA_H

#include "masked_attn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The variant for a call on dtype dt: the forced one if any, else the best. */
ma_isa ma_isa_for(ma_dtype dt);

/* NULL, or why MASKED_ATTN_ISA cannot be honoured (an unknown name, or a
 * variant this CPU lacks); the shim raises it as the op's error. */
const char *ma_isa_env_error(void);

/* Force a variant for the whole process (-1: none, back to the CPU's best;
 * the environment is not read again). Returns 0, or -1 when isa is not
 * available here (nothing changes then). */
int ma_isa_force(int isa);

/* The forced variant, or -1. */
int ma_isa_forced(void);

/* The SVE vector length in bits where an instance of "sve" is compiled for it (128, 256,
 * 512, 1024, 2048), else 0 (no SVE, or a length between those). */
int ma_sve_bits(void);

/* &name_sveN, the instance of the CPU's SVE length N (setup.py's SVE_BITS), else &other:
 * e.g. MA_SVE_INSTANCE(ma_attn_kernels, ma_attn_kernels_neon). */
#define MA_SVE_INSTANCE(name, other)           \
    (ma_sve_bits() == 128    ? &name##_sve128  \
     : ma_sve_bits() == 256  ? &name##_sve256  \
     : ma_sve_bits() == 512  ? &name##_sve512  \
     : ma_sve_bits() == 1024 ? &name##_sve1024 \
     : ma_sve_bits() == 2048 ? &name##_sve2048 \
                             : &other)

/* The CPUs this process can use: the online CPUs, lowered to its
 * container's cgroup cpuset and CPU quota, read once; >= 1. Never the
 * calling thread's affinity mask. */
int64_t ma_cpu_count(void);

#ifdef __cplusplus
}
#endif

#endif /* MA_ISA_H */
