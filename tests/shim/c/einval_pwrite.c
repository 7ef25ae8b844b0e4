/* einval_pwrite.h: pwrite(2) that fails with EINVAL while the descriptor has O_DIRECT (what a
 * device wanting a larger alignment than 4096 bytes answers), else writes. The flag is looked
 * at 2 ms after the call, as a device sees a request a little after its submission, so that
 * concurrent writers overlap the moment one of them turns the flag off. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "einval_pwrite.h"

ssize_t einval_pwrite(int fd, const void *buf, size_t n, off_t off) {
  usleep(2000);
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0 && (fl & O_DIRECT)) {
    errno = EINVAL;
    return -1;
  }
  return syscall(SYS_pwrite64, fd, buf, n, off);
}
