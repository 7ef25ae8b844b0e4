/*
 * carry_in.c: receives what follows a SAVE_ALLOCATIONS / LOAD_ALLOCATIONS request (control
 * layer; protocol.h "Carriers" and "Chunk store"): the stream entries with their descriptors,
 * then, when the request's flags say so, the known-digest table (SAVE, CUI_CARRY_KNOWN) or the
 * source files and chunk refs (LOAD, CUI_CARRY_SOURCES). With CUI_CARRY_STREAMED (SAVE) the entries
 * come without descriptors and the op takes each descriptor group when it needs it (recv_fd).
 * Checks what needs no allocation table (counts, order, source indices); ops_carriers.c and
 * ops_load.c check the rest against the allocations.
 * Every descriptor received is CLOEXEC and is closed by cui_carry_free.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "phase_ops.h"

/* Reads exactly `want` bytes into buf, collecting SCM_RIGHTS descriptors into fds (at most
 * maxfd; *nfd counts them). Returns NULL, or why it stopped (descriptors kept in fds). */
static const char *recv_group(int conn, void *buf, size_t want, int *fds, uint32_t maxfd, uint32_t *nfd) {
  size_t got = 0;
  const char *why = NULL;
  while (got < want && !why) {
    union {
      char buf[CMSG_SPACE(sizeof(int) * CUI_STREAM_FDS_PER_MSG)];
      struct cmsghdr align;
    } cm;
    struct iovec iov = {(char *)buf + got, want - got};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cm.buf;
    mh.msg_controllen = sizeof cm.buf;
    ssize_t k = recvmsg(conn, &mh, MSG_CMSG_CLOEXEC);
    if (k < 0 && errno == EINTR) continue;
    for (struct cmsghdr *c = k >= 0 ? CMSG_FIRSTHDR(&mh) : NULL; c; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t m = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < m; i++) {
        int fd;
        memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        if (*nfd < maxfd) fds[(*nfd)++] = fd;
        else close(fd), why = "more descriptors than entries";
      }
    }
    if (k < 0) why = strerror(errno);
    else if (k == 0) why = "connection closed before the end of the table";
    else if (mh.msg_flags & MSG_CTRUNC) why = "descriptors truncated (more than CUI_STREAM_FDS_PER_MSG in a group)";
    else got += (size_t)k;
  }
  return why;
}

/* The known-digest table (SAVE) or the sources and refs (LOAD). Returns NULL or why not. */
static const char *recv_store_tables(int conn, struct cui_carry_in *in, int load) {
  struct cui_table_head h;
  uint32_t none = 0;
  const char *why = recv_group(conn, &h, sizeof h, NULL, 0, &none);
  if (why) return why;
  if (!load) {
    if (h.count > CUI_KNOWN_MAX || h.sources || h.reserved) return "bad known-digest table head";
    in->known = calloc(h.count ? h.count : 1, CUI_DIGEST_BYTES);
    if (!in->known) return "out of memory for the known-digest table";
    if ((why = recv_group(conn, in->known, (size_t)h.count * CUI_DIGEST_BYTES, NULL, 0, &none))) return why;
    in->nknown = h.count;
    static const uint8_t zero[CUI_DIGEST_BYTES];
    for (uint32_t i = 0; i < h.count; i++) {
      if (!memcmp(in->known[i], zero, CUI_DIGEST_BYTES)) return "an all-zero digest in the known-digest table";
      if (i && memcmp(in->known[i - 1], in->known[i], CUI_DIGEST_BYTES) >= 0)
        return "the known-digest table is not strictly ascending";
    }
    return NULL;
  }
  if (h.count > CUI_REFS_MAX || h.sources > (1u << 20) || h.reserved) return "bad source table head";
  in->sources = calloc(h.sources ? h.sources : 1, sizeof *in->sources);
  in->src_fds = calloc(h.sources ? h.sources : 1, sizeof *in->src_fds);
  in->refs = calloc(h.count ? h.count : 1, sizeof *in->refs);
  if (!in->sources || !in->src_fds || !in->refs) return "out of memory for the source table";
  why = recv_group(conn, in->sources, (size_t)h.sources * sizeof *in->sources, in->src_fds, h.sources, &in->nsources);
  if (!why && in->nsources != h.sources) why = "fewer source descriptors than source entries";
  if (!why) why = recv_group(conn, in->refs, (size_t)h.count * sizeof *in->refs, NULL, 0, &none);
  if (why) return why;
  in->nrefs = h.count;
  for (uint32_t i = 0; i < h.count; i++) {
    const struct cui_chunk_ref *r = &in->refs[i], *p = i ? &in->refs[i - 1] : NULL;
    if (r->stream >= in->count || r->source >= in->nsources || r->reserved)
      return "a chunk ref names a stream or source that is not in the request";
    if (p && (p->stream > r->stream || (p->stream == r->stream && p->chunk >= r->chunk)))
      return "the chunk refs are not strictly ascending by (stream, chunk)";
  }
  return NULL;
}

/* cui_carry_in.recv_fd of a CUI_CARRY_STREAMED request (phase_ops.h). */
static int recv_fd(struct cui_carry_in *in, uint32_t j, int *err, const char **why) {
  *err = 0;
  *why = NULL;
  while (j >= in->nfd && !*err && !*why) {
    struct cui_fd_group g;
    uint32_t had = in->nfd;
    if (in->conn < 0) {
      *why = "no descriptor came for this entry";
      break;
    }
    *why = recv_group(in->conn, &g, sizeof g, in->fds, in->count, &in->nfd);
    uint32_t got = in->nfd - had;
    if (!*why && g.count == 0 && g.error > 0 && !got) *err = g.error;   /* the sender's own failure */
    else if (!*why && (g.error || g.count == 0 || g.count > CUI_STREAM_FDS_PER_MSG || got != g.count))
      *why = "a descriptor group whose count is not the descriptors it carries (1..CUI_STREAM_FDS_PER_MSG)";
    if (*err || *why || in->nfd == in->count) in->conn = -1;   /* nothing more is read */
  }
  return j < in->nfd && !*err && !*why ? in->fds[j] : -1;   /* a bad group gives none of its descriptors */
}

int cui_carry_recv(int conn, const struct cui_request *req, struct cui_carry_in *in, struct cui_op_result *res) {
  memset(in, 0, sizeof *in);
  in->chunk_bytes = req->reserved[0];
  in->staging_bytes = req->reserved[1];
  in->writers = (uint32_t)(req->reserved[2] & 0xFFFF);
  in->flags = (uint32_t)(req->reserved[2] >> 16) & 0xFFFF;
  uint32_t count = (uint32_t)(req->reserved[2] >> 32);
  int load = req->op == CUI_OP_LOAD_ALLOCATIONS;
  const char *op = cui_op_name(req->op);
  unsigned pid = (unsigned)getpid();
  const char *why = NULL;
  uint32_t allowed = (load ? CUI_CARRY_SOURCES : CUI_CARRY_KNOWN | CUI_CARRY_STREAMED) | CUI_CARRY_SHA256;
  in->conn = -1;
  if (count > (1u << 20)) why = "more than 1048576 chunk files announced";
  else if (in->flags & ~allowed)
    why = load ? "flags other than CUI_CARRY_SOURCES and CUI_CARRY_SHA256"
               : "flags other than CUI_CARRY_KNOWN, CUI_CARRY_STREAMED and CUI_CARRY_SHA256";
  if (!why) {
    in->entries = calloc(count ? count : 1, sizeof *in->entries);
    in->fds = calloc(count ? count : 1, sizeof *in->fds);
    if (!in->entries || !in->fds) why = "out of memory";
  }
  if (!why) {
    in->count = count;
    int streamed = (in->flags & CUI_CARRY_STREAMED) != 0;   /* the table alone; the descriptors later */
    why = recv_group(conn, in->entries, (size_t)count * sizeof *in->entries, in->fds, streamed ? 0 : count, &in->nfd);
    if (!why && !streamed && in->nfd != count) why = "fewer descriptors than entries";
    if (!why && (in->flags & (CUI_CARRY_KNOWN | CUI_CARRY_SOURCES))) why = recv_store_tables(conn, in, load);
    if (!why && streamed && count) in->conn = conn, in->recv_fd = recv_fd;
  }
  if (!why) return 0;
  res->status = CUI_BAD_REQUEST;
  snprintf(res->message, sizeof res->message,
           "%s: pid %u: bad chunk file table (%u entries announced, flags 0x%x): %s; nothing was changed", op, pid,
           count, in->flags, why);
  cui_carry_free(in);
  return -1;
}

void cui_carry_free(struct cui_carry_in *in) {
  for (uint32_t i = 0; i < in->nfd; i++) close(in->fds[i]);
  for (uint32_t i = 0; i < in->nsources; i++) close(in->src_fds[i]);
  free(in->entries);
  free(in->fds);
  free(in->known);
  free(in->sources);
  free(in->src_fds);
  free(in->refs);
  memset(in, 0, sizeof *in);
}
