/* Test-only LD_PRELOAD fault library of the chaos suite (tests/chaos/test_enospc.py,
 * docs/testing.md "Chaos suite"): the k-th write to a directory, and every one after it, fails
 * with ENOSPC, as a full filesystem would (write(2), open(2) "ENOSPC").
 *
 * Environment (read at each call):
 *   CHAOS_ENOSPC_PREFIX  absolute directory: only files opened under it are counted
 *   CHAOS_ENOSPC_COUNT   a file shared by every process under the library (the agent and its
 *                        CRIU child): the count of writes so far, 8 bytes, under flock(2)
 *   CHAOS_ENOSPC_AT      k >= 1: the k-th counted write and every later one fail (ENOSPC);
 *                        0 or unset: count only
 *   CHAOS_ENOSPC_LOG     optional: one line "N OP PID" appended per counted write
 *   CHAOS_ENOSPC_FIRST   "1": count only each descriptor's first write of each class (the
 *                        write family, splice, fsync/fdatasync, fallocate): every write
 *                        site once, not each of the thousands of log lines
 * A counted write: open/openat/creat with O_CREAT of a path under the prefix (fails before the
 * file is created), and write, pwrite, writev, pwritev, fallocate, posix_fallocate, fsync,
 * fdatasync, splice to a descriptor opened under the prefix. Paths relative to AT_FDCWD are
 * resolved with getcwd(3); relative to a descriptor, under the prefix when it was opened so.
 * Depends on libc and -ldl only; the counter and log are written with raw syscalls. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_FD 65536
static unsigned char marked[MAX_FD]; /* 1: opened under the prefix; | class bits seen << 1 */

static const char *prefix(void) {
  const char *p = getenv("CHAOS_ENOSPC_PREFIX");
  return p && *p == '/' ? p : NULL;
}

static int under(int dirfd, const char *path) {
  const char *p = prefix();
  if (!p || !path) return 0;
  size_t n = strlen(p);
  char buf[4096];
  if (path[0] != '/') {
    if (dirfd != AT_FDCWD) return dirfd >= 0 && dirfd < MAX_FD && marked[dirfd];
    if (!getcwd(buf, sizeof buf - 1)) return 0;
    size_t c = strlen(buf);
    snprintf(buf + c, sizeof buf - c, "/%s", path);
    path = buf;
  }
  return strncmp(path, p, n) == 0 && (path[n] == '/' || path[n] == '\0');
}

/* Count one write; returns 1 when it must fail with ENOSPC. */
static int count(const char *op) {
  const char *cf = getenv("CHAOS_ENOSPC_COUNT");
  if (!cf) return 0;
  int saved = errno;
  int fd = (int)syscall(SYS_openat, AT_FDCWD, cf, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    errno = saved;
    return 0;
  }
  syscall(SYS_flock, fd, LOCK_EX);
  uint64_t n = 0;
  if (syscall(SYS_pread64, fd, &n, sizeof n, 0) != (long)sizeof n) n = 0;
  n++;
  syscall(SYS_pwrite64, fd, &n, sizeof n, 0);
  const char *lf = getenv("CHAOS_ENOSPC_LOG");
  if (lf) {
    int lfd = (int)syscall(SYS_openat, AT_FDCWD, lf, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (lfd >= 0) {
      char line[128];
      int len = snprintf(line, sizeof line, "%llu %s %d\n", (unsigned long long)n, op, (int)getpid());
      syscall(SYS_write, lfd, line, (size_t)len);
      syscall(SYS_close, lfd);
    }
  }
  syscall(SYS_flock, fd, LOCK_UN);
  syscall(SYS_close, fd);
  const char *at = getenv("CHAOS_ENOSPC_AT");
  unsigned long long k = at ? strtoull(at, NULL, 10) : 0;
  errno = saved;
  return k && n >= k;
}

static int on_fd(int fd, const char *op, unsigned cls) {
  if (fd < 0 || fd >= MAX_FD || !marked[fd]) return 0;
  const char *first = getenv("CHAOS_ENOSPC_FIRST");
  if (first && *first == '1') {
    if (marked[fd] & (cls << 1)) return 0;
    marked[fd] |= (unsigned char)(cls << 1);
  }
  if (count(op)) {
    errno = ENOSPC;
    return 1;
  }
  return 0;
}

#define REAL(name, type)   \
  static type real_##name; \
  if (!real_##name) real_##name = (type)dlsym(RTLD_NEXT, #name)

static int opened(int fd, int dirfd, const char *path) {
  if (fd >= 0 && fd < MAX_FD) marked[fd] = (unsigned char)under(dirfd, path);
  return fd;
}

static int open_common(const char *name, int dirfd, const char *path, int flags, mode_t mode) {
  if ((flags & O_CREAT) && under(dirfd, path) && count(name)) {
    errno = ENOSPC;
    return -1;
  }
  typedef int (*openat_t)(int, const char *, int, ...);
  REAL(openat, openat_t);
  return opened(real_openat(dirfd, path, flags, mode), dirfd, path);
}

static mode_t mode_arg(int flags, va_list ap) { return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0; }

int open(const char *path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  mode_t m = mode_arg(flags, ap);
  va_end(ap);
  return open_common("open", AT_FDCWD, path, flags, m);
}
int open64(const char *path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  mode_t m = mode_arg(flags, ap);
  va_end(ap);
  return open_common("open", AT_FDCWD, path, flags, m);
}
int openat(int dirfd, const char *path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  mode_t m = mode_arg(flags, ap);
  va_end(ap);
  return open_common("openat", dirfd, path, flags, m);
}
int openat64(int dirfd, const char *path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  mode_t m = mode_arg(flags, ap);
  va_end(ap);
  return open_common("openat", dirfd, path, flags, m);
}
int __open_2(const char *path, int flags) { return open_common("open", AT_FDCWD, path, flags, 0); }
int __open64_2(const char *path, int flags) { return open_common("open", AT_FDCWD, path, flags, 0); }
int __openat_2(int dirfd, const char *path, int flags) { return open_common("openat", dirfd, path, flags, 0); }
int creat(const char *path, mode_t mode) {
  return open_common("creat", AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode);
}

int close(int fd) {
  typedef int (*close_t)(int);
  REAL(close, close_t);
  if (fd >= 0 && fd < MAX_FD) marked[fd] = 0;
  return real_close(fd);
}

ssize_t write(int fd, const void *b, size_t n) {
  typedef ssize_t (*t)(int, const void *, size_t);
  REAL(write, t);
  return on_fd(fd, "write", 1) ? -1 : real_write(fd, b, n);
}
ssize_t pwrite(int fd, const void *b, size_t n, off_t o) {
  typedef ssize_t (*t)(int, const void *, size_t, off_t);
  REAL(pwrite, t);
  return on_fd(fd, "pwrite", 1) ? -1 : real_pwrite(fd, b, n, o);
}
ssize_t pwrite64(int fd, const void *b, size_t n, off_t o) {
  typedef ssize_t (*t)(int, const void *, size_t, off_t);
  REAL(pwrite64, t);
  return on_fd(fd, "pwrite", 1) ? -1 : real_pwrite64(fd, b, n, o);
}
ssize_t writev(int fd, const struct iovec *v, int c) {
  typedef ssize_t (*t)(int, const struct iovec *, int);
  REAL(writev, t);
  return on_fd(fd, "writev", 1) ? -1 : real_writev(fd, v, c);
}
ssize_t pwritev(int fd, const struct iovec *v, int c, off_t o) {
  typedef ssize_t (*t)(int, const struct iovec *, int, off_t);
  REAL(pwritev, t);
  return on_fd(fd, "pwritev", 1) ? -1 : real_pwritev(fd, v, c, o);
}
int fallocate(int fd, int mode, off_t o, off_t l) {
  typedef int (*t)(int, int, off_t, off_t);
  REAL(fallocate, t);
  return on_fd(fd, "fallocate", 8) ? -1 : real_fallocate(fd, mode, o, l);
}
int posix_fallocate(int fd, off_t o, off_t l) {
  typedef int (*t)(int, off_t, off_t);
  REAL(posix_fallocate, t);
  return on_fd(fd, "posix_fallocate", 8) ? ENOSPC : real_posix_fallocate(fd, o, l);
}
int fsync(int fd) {
  typedef int (*t)(int);
  REAL(fsync, t);
  return on_fd(fd, "fsync", 4) ? -1 : real_fsync(fd);
}
int fdatasync(int fd) {
  typedef int (*t)(int);
  REAL(fdatasync, t);
  return on_fd(fd, "fdatasync", 4) ? -1 : real_fdatasync(fd);
}
ssize_t splice(int in, loff_t *oin, int out, loff_t *oout, size_t n, unsigned int f) {
  typedef ssize_t (*t)(int, loff_t *, int, loff_t *, size_t, unsigned int);
  REAL(splice, t);
  return on_fd(out, "splice", 2) ? -1 : real_splice(in, oin, out, oout, n, f);
}
