/* isa.c -- the instruction-set policy (isa.h). */
#define _GNU_SOURCE /* syscall() */
#include "common/isa.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__linux__)
#include <fcntl.h>
#include <unistd.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
/* Linux hands out the AMX tile data state (8 KB per thread) only on request:
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once per process. */
static int amx_permitted(void) {
    static atomic_int state = -1;
    int s = atomic_load(&state);
    if (s < 0) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
        atomic_store(&state, s);
    }
    return s;
}
#elif defined(__x86_64__) || defined(__i386__)
static int amx_permitted(void) { return 0; }
#endif
#if defined(__linux__) && defined(__aarch64__)
#include <sys/auxv.h>
#include <sys/prctl.h>
/* The SVE vector length in bytes (the thread's, which Linux gives every thread of the
 * process alike unless one changes it), or 0 without SVE; asked once. */
static int sve_vector_bytes(void) {
    static atomic_int bytes = -1;
    int b = atomic_load(&bytes);
    if (b < 0) {
        b = 0;
        if (getauxval(AT_HWCAP) & (1UL << 22) /* HWCAP_SVE */) {
            const int vl = prctl(51 /* PR_SVE_GET_VL */);
            b = vl < 0 ? 0 : vl & 0xffff; /* PR_SVE_VL_LEN_MASK */
        }
        atomic_store(&bytes, b);
    }
    return b;
}
/* SVE's BFMMLA and BFDOT (FEAT_BF16 with SVE). */
static int sve_bf16(void) {
    return sve_vector_bytes() > 0 && (getauxval(AT_HWCAP2) & (1UL << 12) /* HWCAP2_SVEBF16 */);
}
#else
static int sve_vector_bytes(void) { return 0; }
#if defined(__aarch64__)
static int sve_bf16(void) { return 0; }
#endif
#endif

/* setup.py compiles the SVE instances at the powers of two from 128 to 2048 bits; SVE also
 * allows the multiples of 128 between them, where NEON runs. */
int ma_sve_bits(void) {
    const int bits = 8 * sve_vector_bytes();
    return bits >= 128 && bits <= 2048 && (bits & (bits - 1)) == 0 ? bits : 0;
}

/* ---- what the table (masked_attn.h, MA_ISA_TABLE) generates ------------------------------- */

/* The rows' values are 0 .. N_ISAS - 1, each once: every row's is below the count and they add
 * up to 0 + 1 + ... + (N_ISAS - 1) (a value twice also repeats an isa_names index: -Woverride-init). */
#define COUNT(ID, name, abi, arch, bq, bk, fb, own, inst, usable) +1
#define SUM(ID, name, abi, arch, bq, bk, fb, own, inst, usable) +MA_ISA_##ID
enum { N_ISAS = 0 MA_ISA_TABLE(COUNT), VALUE_SUM = 0 MA_ISA_TABLE(SUM) };
_Static_assert(VALUE_SUM == N_ISAS * (N_ISAS - 1) / 2, "MA_ISA_TABLE's values must be 0, 1, 2, ... (the C ABI)");
#define BELOW(ID, name, abi, arch, bq, bk, fb, own, inst, usable)           \
    _Static_assert((int)MA_ISA_##ID >= 0 && (int)MA_ISA_##ID < (int)N_ISAS, \
                   "MA_ISA_TABLE: " #name "'s value is past the rows");
MA_ISA_TABLE(BELOW)
#undef COUNT
#undef SUM
#undef BELOW

#define NAME(ID, name, abi, arch, bq, bk, fb, own, inst, usable) [MA_ISA_##ID] = #name,
static const char *const isa_names[N_ISAS] = {MA_ISA_TABLE(NAME)}; /* ma_isa's order */
#undef NAME

const char *ma_isa_name(int isa) { return isa >= 0 && isa < N_ISAS ? isa_names[isa] : NULL; }

int ma_isa_built(int isa) {
    switch (isa) {
#define BUILT(ID, name, abi, arch, bq, bk, fb, own, inst, usable) MA_ON_##arch(case MA_ISA_##ID : return 1;)
        MA_ISA_TABLE(BUILT)
#undef BUILT
    default: return 0;
    }
}

const char *ma_dtype_name(int dt) {
    static const char *const names[] = {"bool", "float32", "float64", "bfloat16", "float16", "int8"}; /* ma_dtype's */
    return dt >= 0 && dt < (int)(sizeof names / sizeof names[0]) ? names[dt] : NULL;
}

/* The table's usable column: a CPU feature, another variant usable here. */
#define MA_CPU(feature) __builtin_cpu_supports(feature)
#define MA_USABLE(ID) ma_isa_available(MA_ISA_##ID)

int ma_isa_available(ma_isa isa) {
    switch (isa) {
#define USABLE(ID, name, abi, arch, bq, bk, fb, own, inst, usable) MA_ON_##arch(case MA_ISA_##ID : return usable;)
        MA_ISA_TABLE(USABLE)
#undef USABLE
    default: return 0;
    }
}

ma_isa ma_isa_runs(ma_isa isa, ma_dtype dt, int rows) {
    switch (isa) {
#define RUNS(ID, name, abi, arch, bq, bk, fb, own, inst, usable)                               \
    MA_ON_##arch(case MA_ISA_##ID : if (MA_OWNS_##own(dt, rows) && MA_INST_##inst) return isa; \
                 return ma_isa_runs(MA_ISA_##fb, dt, rows);)
        MA_ISA_TABLE(RUNS)
#undef RUNS
    default: return MA_ISA_SCALAR;
    }
}

/* AMX for bfloat16 and float16 only: float32 on tiles needs 6 bf16 products
 * per float product to keep float32's accuracy, and is no faster than the
 * AVX-512 FMAs (docs/performance.md). Without AMX, bfloat16 gets avx512bf16
 * where VDPBF16PS issues at the FMA's instruction rate, so that each does twice
 * an FMA's multiply-adds: AMD's (Zen 4 and 5). On a 2-vCPU Zen 4 it took
 * bfloat16 forwards 1.27 - 1.48x and trainings 1.00 - 1.08x faster than
 * AVX-512 (P and dS in two bf16 parts: the accuracy rule; docs/design/
 * 06-bf16-pair-products.md); on Intel's, VDPBF16PS runs at half the FMA's
 * flops (a Xeon with AMX: the variant 1.8 - 2.9x slower than AVX-512), so
 * there MASKED_ATTN_ISA=avx512bf16 asks for it. Decode steps take AVX-512's
 * kernels in either. On aarch64 NEON: sve and svebf16 (BFMMLA) wait for an ARM
 * CPU to time them (docs/performance/aarch64-qemu.md gives their instruction
 * counts under qemu); MASKED_ATTN_ISA asks for them. */
#if defined(__x86_64__) || defined(__i386__)
static int bf16_dot_at_fma_rate(void) { return __builtin_cpu_is("amd"); }
#else
static int bf16_dot_at_fma_rate(void) { return 0; }
#endif

ma_isa ma_isa_best(ma_dtype dt) {
    if ((dt == MA_BF16 || dt == MA_F16) && ma_isa_available(MA_ISA_AMX)) return MA_ISA_AMX;
    if (dt == MA_BF16 && ma_isa_available(MA_ISA_AVX512BF16) && bf16_dot_at_fma_rate()) return MA_ISA_AVX512BF16;
    if (ma_isa_available(MA_ISA_AVX512)) return MA_ISA_AVX512;
    if (ma_isa_available(MA_ISA_AVX2)) return MA_ISA_AVX2;
    if (ma_isa_available(MA_ISA_NEON)) return MA_ISA_NEON;
    return MA_ISA_SCALAR;
}

/* -2: not decided yet (the environment is read at the first call), -1: none,
 * else the forced ma_isa. env_error is set once, with the first decision. */
static atomic_int forced = -2;
static const char *env_error = NULL;
static char env_error_buf[512];

static void read_env(void) {
    const char *env = getenv("MASKED_ATTN_ISA");
    int isa = -1, unknown = 0;
    const char *err = NULL;
    if (env && *env) {
        for (int i = 0; i < N_ISAS; i++)
            if (strcmp(env, isa_names[i]) == 0) isa = i;
        if (isa < 0) {
            err = "masked_attn: MASKED_ATTN_ISA is not a kernel variant; expected ";
            unknown = 1;
        } else if (!ma_isa_available((ma_isa)isa)) {
            err = "masked_attn: MASKED_ATTN_ISA names a variant this CPU does not support";
            isa = -1;
        }
    }
    int expected = -2;
    if (atomic_compare_exchange_strong(&forced, &expected, isa) && err) {
        /* the message names the value, so that no other place reads the variable; for an
         * unknown name, every variant's ("scalar, avx2, ... or svebf16") */
        const size_t size = sizeof env_error_buf;
        size_t n = (size_t)snprintf(env_error_buf, size, "%s", err);
        for (int i = 0; unknown && i < N_ISAS && n < size; i++) {
            const char *sep = i == 0 ? "" : i == N_ISAS - 1 ? " or " : ", ";
            n += (size_t)snprintf(env_error_buf + n, size - n, "%s%s", sep, isa_names[i]);
        }
        if (n < size) snprintf(env_error_buf + n, size - n, " (MASKED_ATTN_ISA='%.40s')", env);
        env_error = env_error_buf;
    }
}

int ma_isa_forced(void) {
    if (atomic_load(&forced) == -2) read_env();
    return atomic_load(&forced);
}

const char *ma_isa_env_error(void) {
    (void)ma_isa_forced();
    return env_error;
}

int ma_isa_force(int isa) {
    if (isa >= 0 && !ma_isa_available((ma_isa)isa)) return -1;
    (void)ma_isa_forced(); /* the environment is decided first, so it never overrides this later */
    env_error = NULL;
    atomic_store(&forced, isa < 0 ? -1 : isa);
    return 0;
}

ma_isa ma_isa_for(ma_dtype dt) {
    const int f = ma_isa_forced();
    return f >= 0 ? (ma_isa)f : ma_isa_best(dt);
}

#if defined(__linux__)
/* A small file (a cgroup setting) into buf, NUL-terminated; open/read: no allocation. */
static int read_small(const char *path, char *buf, size_t size) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    const ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    return 1;
}

/* Up to two numbers from a file such as cgroup v2's cpu.max ("max 100000" or "200000 100000"),
 * "max" read as -1; returns how many it read. */
static int read_numbers(const char *path, long long v[2]) {
    char buf[64];
    if (!read_small(path, buf, sizeof buf)) return 0;
    int got = 0;
    for (const char *s = buf; got < 2;) {
        while (*s == ' ' || *s == '\n') s++;
        if (strncmp(s, "max", 3) == 0) {
            v[got++] = -1, s += 3;
            continue;
        }
        char *end;
        const long long x = strtoll(s, &end, 10);
        if (end == s) break;
        v[got++] = x, s = end;
    }
    return got;
}

/* The CPUs a cgroup CPU quota allows this process's container (cgroup v2's cpu.max, else v1's
 * cfs quota, as a container sees them under /sys/fs/cgroup), rounded up; 0 where there is none. */
static long long quota_cpus(void) {
    long long v[2], w[2];
    if (read_numbers("/sys/fs/cgroup/cpu.max", v) == 2) return v[0] > 0 && v[1] > 0 ? (v[0] + v[1] - 1) / v[1] : 0;
    if (read_numbers("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", v) == 1 &&
        read_numbers("/sys/fs/cgroup/cpu/cpu.cfs_period_us", w) == 1)
        return v[0] > 0 && w[0] > 0 ? (v[0] + w[0] - 1) / w[0] : 0;
    return 0;
}

/* The CPUs of a cgroup cpuset list ("0-15,32-47"): v2's cpuset.cpus.effective, else v1's
 * cpuset.effective_cpus; 0 where neither can be read. */
static long long cpuset_cpus(void) {
    char buf[4096];
    if (!read_small("/sys/fs/cgroup/cpuset.cpus.effective", buf, sizeof buf) &&
        !read_small("/sys/fs/cgroup/cpuset/cpuset.effective_cpus", buf, sizeof buf))
        return 0;
    long long n = 0;
    for (const char *s = buf;;) {
        char *end;
        const long long lo = strtoll(s, &end, 10);
        if (end == s) break;
        long long hi = lo;
        if (*end == '-') {
            s = end + 1;
            hi = strtoll(s, &end, 10);
            if (end == s) return 0;
        }
        if (hi >= lo) n += hi - lo + 1;
        if (*end != ',') break;
        s = end + 1;
    }
    return n;
}
#endif

/* The CPUs this process can use: the online CPUs, lowered to its container's cgroup cpuset and
 * CPU quota where they are set, read once; 1 where none can be read. Not the calling thread's
 * affinity mask: a thread pinned to one CPU (OMP_PROC_BIND, KMP_AFFINITY) would set the count
 * for the whole process, and which thread asks first would decide the results' bits. Unlike
 * the thread count it does not change while the process runs, so a rule on it keeps results
 * the same bits for any thread count (ma_attn_bwd_kv_chunks). A process restricted with
 * taskset keeps the machine's count. */
int64_t ma_cpu_count(void) {
    static atomic_llong count = 0;
    long long n = atomic_load(&count);
    if (n == 0) {
        n = 1;
#if defined(__linux__)
        const long online = sysconf(_SC_NPROCESSORS_ONLN);
        if (online > 0) n = online;
        const long long c = cpuset_cpus(), q = quota_cpus();
        if (c > 0 && c < n) n = c;
        if (q > 0 && q < n) n = q;
#endif
        atomic_store(&count, n);
    }
    return (int64_t)n;
}
