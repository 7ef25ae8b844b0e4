/* Test drivers' side of protocol.h "Carriers": send a SAVE/LOAD_ALLOCATIONS request with one
 * memfd chunk file per carried allocation of `recs` (the process's INSPECT records: its
 * creator allocations), chunk_bytes 64 KiB, a two-slot ring, three writers. `fds` (8 slots,
 * -1 = none yet) keeps the memfds from SAVE to LOAD. Returns 0, or -1 (errno set). */
#ifndef CUI_TEST_CARRY_H
#define CUI_TEST_CARRY_H

#include <cuinterpose/protocol.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

static int cui_test_send_carriers(int s, struct cui_request *q, const struct cui_record *recs, uint32_t nrecs,
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

#endif
