/*
 * glibc_compat.h -- the build's glibc floor: manylinux_2_28, PyTorch's own wheels' (RHEL 8,
 * Ubuntu 20.04 and later). Force-included into every C unit (setup.py, C_FLAGS) where the C
 * library is glibc.
 *
 * glibc 2.29 gave exp and log new symbol versions (the same functions without the SVID error
 * wrapper); a unit compiled against a newer glibc references those and the wheel would need
 * 2.29. The directives below bind the references to the versions every glibc of the
 * architecture has. The kernels call them on doubles only in scalar paths (float64, the
 * cross-entropy's sums), with -fno-math-errno, so the wrapper costs nothing that matters.
 * The C++ shim's one newer symbol, libstdc++'s __libc_single_threaded (glibc 2.32), is
 * renamed by setup.py's shim flags and defined in csrc/shim/registration.cpp.
 */
#ifndef MA_GLIBC_COMPAT_H
#define MA_GLIBC_COMPAT_H

#if defined(__linux__) && defined(__has_include)
#if __has_include(<gnu/libc-version.h>) /* glibc, not musl */
#if defined(__x86_64__)
__asm__(".symver exp, exp@GLIBC_2.2.5");
__asm__(".symver log, log@GLIBC_2.2.5");
#elif defined(__aarch64__)
__asm__(".symver exp, exp@GLIBC_2.17");
__asm__(".symver log, log@GLIBC_2.17");
#endif
#endif
#endif

#endif /* MA_GLIBC_COMPAT_H */
