/* Test drivers' side of protocol.h "Carriers" (and "Claims", below): send a SAVE/LOAD_ALLOCATIONS request with one
 * memfd chunk file per carried allocation of `recs` (the process's INSPECT records: its
 * creator allocations), chunk_bytes 64 KiB, a two-slot ring, three writers. `fds` (8 slots,
 * -1 = none yet) keeps the memfds from SAVE to LOAD. Returns 0, or -1 (errno set). */
#ifndef CUI_TEST_CARRY_H
#define CUI_TEST_CARRY_H

#include <cuinterpose/protocol.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

static inline int cui_test_send_carriers(int s, struct cui_request *q, const struct cui_record *recs, uint32_t nrecs,
                                         int fds[8]) {
  struct cui_stream_entry e[8];
  int pass[8];
  uint32_t n = 0;
  for (uint32_t i = 0; i < nrecs && n < 8; i++) {
    const struct cui_record *r = &recs[i];
    if (r->kind != CUI_RECORD_ALLOCATION || r->role != CUI_ROLE_CREATOR) continue;
    if (fds[n] < 0) fds[n] = memfd_create("chunks", MFD_CLOEXEC);
    if (fds[n] < 0) return -1;
    memset(&e[n], 0, sizeof e[n]);
    memcpy(e[n].alloc_id, r->alloc_id, 16);
    e[n].bytes = r->size;
    pass[n] = fds[n];
    n++;
  }
  q->reserved[0] = 64 << 10;
  q->reserved[1] = 128 << 10;
  q->reserved[2] = 3u | (uint64_t)n << 32;
  if (write(s, q, sizeof *q) != (ssize_t)sizeof *q) return -1;
  if (!n) return 0;
  union {
    char buf[CMSG_SPACE(sizeof pass)];
    struct cmsghdr align;
  } cm;
  struct iovec iov = {e, n * sizeof e[0]};
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = cm.buf;
  mh.msg_controllen = CMSG_SPACE(n * sizeof(int));
  struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(n * sizeof(int));
  memcpy(CMSG_DATA(c), pass, n * sizeof(int));
  return sendmsg(s, &mh, 0) == (ssize_t)(n * sizeof e[0]) ? 0 : -1;
}

/* Test drivers' side of protocol.h "Claims": the drivers send mutating ops as an agent does,
 * holding a claim on the process `pid` they drive: write $CUINTERPOSE_CONTROL_DIR/
 * cuinterpose-<pid>.claim with CUI_TEST_CLAIM (put it in cui_request.claim). Returns 0 or -1. */
static const uint8_t CUI_TEST_CLAIM[16] = {0xc1, 0x4a, 0x17, 0x3e, 0x55, 0x02, 0x9b, 0xd0,
                                           0x6f, 0x81, 0x2c, 0xe4, 0x38, 0x7a, 0xb5, 0x19};

static inline int cui_test_claim(int pid) {
  char path[4096], tmp[4128], line[64];
  snprintf(path, sizeof path, "%s/" CUI_SOCKET_PREFIX "%d" CUI_CLAIM_SUFFIX, getenv("CUINTERPOSE_CONTROL_DIR"), pid);
  snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
  for (int i = 0; i < 16; i++) snprintf(line + 2 * i, 3, "%02x", CUI_TEST_CLAIM[i]);
  int n = snprintf(line + 32, sizeof line - 32, " %d test\n", (int)getpid()) + 32;
  mkdir(getenv("CUINTERPOSE_CONTROL_DIR"), 0700); /* as the shim does at cuInit, if missing */
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return -1;
  int ok = write(fd, line, (size_t)n) == n;
  close(fd);
  return ok && rename(tmp, path) == 0 ? 0 : -1;
}

#endif
