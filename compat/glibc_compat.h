/* glibc_compat.h: the glibc ceiling of the shim and fakecuda (docs/shim.md "Old containers").
 *
 * Both libraries must load in images whose glibc is 2.17 or newer (Ubuntu 20.04, RHEL 8, older
 * inference images), so they may need no glibc symbol version above GLIBC_2.17 (x86_64's
 * baseline is GLIBC_2.2.5, aarch64's GLIBC_2.17), whatever glibc they are built against.
 * CMake force-includes this header (`-include`, top CMakeLists.txt) in every file of both
 * libraries built against glibc, before anything else, so no source file changes. It:
 *
 * 1. binds each function that glibc 2.32/2.34 moved into libc.so.6 (pthread_*, dl*, sem_*) to
 *    its old version with `.symver` (the rows of glibc_moved.def). libc.so.6 still exports the
 *    old versions, and on a glibc older than 2.34 they are found in libpthread.so.0 and
 *    libdl.so.2, which CMake links explicitly (DT_NEEDED) for that reason;
 * 2. replaces the functions that have no version at or below 2.17 with their system calls:
 *    getrandom (2.25), memfd_create (2.27), gettid (2.30); errors are -1 and errno as before;
 * 3. when built against glibc 2.33 or newer (CUI_GLIBC_COMPAT_STAT, set by CMake), calls
 *    stat, fstat, lstat and fstatat through __xstat, __fxstat, __lxstat and __fxstatat, as
 *    glibc's own headers did before 2.33.
 *
 * It includes no libc header (the sources define _GNU_SOURCE after it), only <asm/unistd.h>
 * for the system call numbers. The replacements are function-like macros, so that glibc's own
 * declarations of these names, seen later, declare the static functions below again.
 * tests/shim/test_glibc.py checks the built libraries with objdump -T. */
#ifndef CUI_GLIBC_COMPAT_H
#define CUI_GLIBC_COMPAT_H

#if defined(__linux__) && defined(__LP64__) && !defined(__ASSEMBLER__)

#if defined(__x86_64__)
#define CUI_GLIBC_OLD(name, x86_64_version) __asm__(".symver " #name "," #name "@GLIBC_" x86_64_version);
#define CUI_GLIBC_STAT_VER                  1 /* _STAT_VER_LINUX */
#elif defined(__aarch64__)
#define CUI_GLIBC_OLD(name, x86_64_version) __asm__(".symver " #name "," #name "@GLIBC_2.17");
#define CUI_GLIBC_STAT_VER                  0 /* _STAT_VER_KERNEL */
#else /* another architecture: no table of its versions; test_glibc.py says what is needed */
#define CUI_GLIBC_OLD(name, x86_64_version)
#endif

#include "glibc_moved.def"

#include <asm/unistd.h>

extern long syscall(long number, ...);

/* getrandom: GLIBC_2.25 */
static inline __attribute__((unused)) long cui_compat_getrandom(void *buf, __SIZE_TYPE__ len, unsigned int flags) {
  return syscall(__NR_getrandom, buf, len, flags);
}
#define getrandom(buf, len, flags) cui_compat_getrandom(buf, len, flags)

/* memfd_create: GLIBC_2.27 */
static inline __attribute__((unused)) int cui_compat_memfd_create(const char *name, unsigned int flags) {
  return (int)syscall(__NR_memfd_create, name, flags);
}
#define memfd_create(name, flags) cui_compat_memfd_create(name, flags)

/* gettid: GLIBC_2.30 */
static inline __attribute__((unused)) int cui_compat_gettid(void) { return (int)syscall(__NR_gettid); }
#define gettid(...) cui_compat_gettid(__VA_ARGS__) /* also glibc's `gettid (void)` */

#if defined(CUI_GLIBC_COMPAT_STAT) && defined(CUI_GLIBC_STAT_VER)
/* stat, fstat, lstat, fstatat: GLIBC_2.33; before, <sys/stat.h> called these. */
struct stat;
extern int __xstat(int ver, const char *path, struct stat *buf);
extern int __fxstat(int ver, int fd, struct stat *buf);
extern int __lxstat(int ver, const char *path, struct stat *buf);
extern int __fxstatat(int ver, int dirfd, const char *path, struct stat *buf, int flags);
CUI_GLIBC_OLD(__xstat, "2.2.5")
CUI_GLIBC_OLD(__fxstat, "2.2.5")
CUI_GLIBC_OLD(__lxstat, "2.2.5")
CUI_GLIBC_OLD(__fxstatat, "2.4")

static inline __attribute__((unused)) int cui_compat_stat(const char *path, struct stat *buf) {
  return __xstat(CUI_GLIBC_STAT_VER, path, buf);
}
static inline __attribute__((unused)) int cui_compat_fstat(int fd, struct stat *buf) {
  return __fxstat(CUI_GLIBC_STAT_VER, fd, buf);
}
static inline __attribute__((unused)) int cui_compat_lstat(const char *path, struct stat *buf) {
  return __lxstat(CUI_GLIBC_STAT_VER, path, buf);
}
static inline __attribute__((unused)) int cui_compat_fstatat(int dirfd, const char *path, struct stat *buf, int flags) {
  return __fxstatat(CUI_GLIBC_STAT_VER, dirfd, path, buf, flags);
}
#define stat(path, buf)                  cui_compat_stat(path, buf)
#define fstat(fd, buf)                   cui_compat_fstat(fd, buf)
#define lstat(path, buf)                 cui_compat_lstat(path, buf)
#define fstatat(dirfd, path, buf, flags) cui_compat_fstatat(dirfd, path, buf, flags)
#endif

#undef CUI_GLIBC_OLD
#endif /* __linux__ && __LP64__ */
#endif /* CUI_GLIBC_COMPAT_H */
