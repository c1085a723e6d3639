/* isa.h -- the instruction-set policy, in one place, and the vocabulary that turns
 * masked_attn.h's table of variants (MA_ISA_TABLE) into code.
 *
 * Which variants this CPU can run (ma_isa_available), which one a dtype gets
 * by default (ma_isa_best), and the override: MASKED_ATTN_ISA=<a name of the
 * table> (scalar, avx2, ...) in the environment, read once per process, or
 * ma_isa_force() (torch_masked_attn.ops.use_isa, which the tests use to run
 * every variant).
 * The shim asks ma_isa_for() once per op call and stores the answer in the
 * params; each op's dispatch.c maps (dtype, isa) to a kernel through
 * ma_isa_runs and a switch generated from the table. */
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

/* The variant whose kernels run a call that asks for isa: isa itself where it has kernels of its
 * own for the call (the table's own and inst: attention's in dtype dt, or the row kernels with
 * rows set: cross-entropy's and the KV cache's quantizing block), else its fallback's (fb), in
 * turn; scalar for a variant this build does not compile in. */
ma_isa ma_isa_runs(ma_isa isa, ma_dtype dt, int rows);

/* ---- the table's vocabulary (masked_attn.h, MA_ISA_TABLE) -----------------------------------
 *
 * A generator is a macro of the row's columns, (ID, name, abi, arch, bq, bk, fb, own, inst,
 * usable), handed to MA_ISA_TABLE; these turn a column's word into code. */

/* MA_ON_<arch>(...): its arguments where this build compiles arch's variants in, else nothing
 * (the architecture guard of a switch's case). */
#define MA_ON_any(...) __VA_ARGS__
#if defined(__x86_64__) || defined(__i386__)
#define MA_ON_x86(...) __VA_ARGS__
#else
#define MA_ON_x86(...)
#endif
#if defined(__aarch64__)
#define MA_ON_arm(...) __VA_ARGS__
#else
#define MA_ON_arm(...)
#endif

/* MA_ROWS_<own>(...): its arguments where the variant has row kernels of its own (own: all). */
#define MA_ROWS_all(...) __VA_ARGS__
#define MA_ROWS_attn(...)
#define MA_ROWS_bf16(...)

/* MA_OWNS_<own>(dt, rows), MA_INST_<inst>: whether the variant's own kernels take the call
 * (ma_isa_runs): attention's in dtype dt (rows 0) or the row kernels (rows 1); an SVE variant's
 * only at a length it has an instance of. */
#define MA_OWNS_all(dt, rows) 1
#define MA_OWNS_attn(dt, rows) !(rows)
#define MA_OWNS_bf16(dt, rows) (!(rows) && (dt) == MA_BF16)
#define MA_INST_one 1
#define MA_INST_vl (ma_sve_bits() > 0)

/* MA_TABLE_<inst>(kind, name): the address of variant name's table of a kind (ma_attn_kernels,
 * ma_blocks, ma_ce_kernels): kind_name, or the instance of the CPU's SVE length
 * (kind_name128 ... kind_name2048; ma_isa_runs picks a vl variant only where ma_sve_bits()
 * names one). MA_EXTERN_<inst>(kind, name) declares them. */
#define MA_TABLE_one(kind, name) (&kind##_##name)
#define MA_TABLE_vl(kind, name) MA_SVE_INSTANCE(kind##_##name)
#define MA_EXTERN_one(kind, name) extern const kind kind##_##name;
#define MA_EXTERN_vl(kind, name)                                                                       \
    extern const kind kind##_##name##128, kind##_##name##256, kind##_##name##512, kind##_##name##1024, \
        kind##_##name##2048;

/* &nameN, the instance of the CPU's SVE length N (setup.py's SVE_BITS; ma_sve_bits() > 0):
 * e.g. MA_SVE_INSTANCE(ma_attn_kernels_sve). */
#define MA_SVE_INSTANCE(name)              \
    (ma_sve_bits() == 128    ? &name##128  \
     : ma_sve_bits() == 256  ? &name##256  \
     : ma_sve_bits() == 512  ? &name##512  \
     : ma_sve_bits() == 1024 ? &name##1024 \
                             : &name##2048)

/* The CPUs this process can use: the online CPUs, lowered to its
 * container's cgroup cpuset and CPU quota, read once; >= 1. Never the
 * calling thread's affinity mask. */
int64_t ma_cpu_count(void);

#ifdef __cplusplus
}
#endif

#endif /* MA_ISA_H */
