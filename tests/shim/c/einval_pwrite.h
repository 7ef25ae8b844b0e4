/* A device that refuses every O_DIRECT write (tests/shim/test_chunkio.py): chunkio.c is built
 * with -include einval_pwrite.h -Dpwrite=einval_pwrite against einval_pwrite.c. */
#define _GNU_SOURCE   /* first: this header is included before the source's own */
#include <sys/types.h>
ssize_t einval_pwrite(int fd, const void *buf, size_t n, off_t off);
