/*
 * peer.c: the FETCH_FD client (protocol.h "Transport"; docs/shim.md "Threads"): an importer
 * asks the creator's control socket for the real export FD of an allocation or multicast
 * object, which arrives as SCM_RIGHTS on the reply. Used by the import wrappers and the
 * RESTORE_UNICAST / RESTORE_MULTICAST_IMPORTERS ops; never touches the state lock. The request
 * carries the allocation's secret learnt from its ticket or virtual IPC handle (protocol.h
 * "Secrets"; the secrets' own mutex). In two halves as well (send, then receive), so that
 * RESTORE_UNICAST keeps several requests in flight. Calls util and state.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "api.h"

int cui_fetch_send(uint32_t creator_pid, const uint8_t id[16], char *why, size_t cap) {
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  if (cui_socket_path(creator_pid, sa.sun_path, sizeof sa.sun_path) != 0) {
    snprintf(why, cap, "control socket path too long");
    return -1;
  }
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) {
    snprintf(why, cap, "socket: %s", strerror(errno));
    return -1;
  }
  cui_set_io_timeouts(s);
  if (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) {
    int e = errno;
    if (kill((pid_t)creator_pid, 0) != 0 && errno == ESRCH)
      snprintf(why, cap, "creator pid %u is not running (the ticket outlived its creator; %s: %s)", creator_pid,
               sa.sun_path, strerror(e));
    else snprintf(why, cap, "cannot connect to %s: %s", sa.sun_path, strerror(e));
    close(s);
    return -1;
  }
  struct cui_request req;
  memset(&req, 0, sizeof req);
  req.magic = CUI_PROTO_MAGIC;
  req.version = CUI_PROTO_VERSION;
  req.op = CUI_OP_FETCH_FD;
  req.sender_pid = (uint32_t)getpid();
  memcpy(req.alloc_id, id, 16);
  req.reserved[0] = cui_secret_of(id, creator_pid);   /* protocol.h "Secrets"; 0: none known */
  if (cui_write_full(s, &req, sizeof req) != 0) {
    snprintf(why, cap, "send to %s: %s", sa.sun_path, strerror(errno));
    close(s);
    return -1;
  }
  return s;
}

int cui_fetch_recv(int s, uint32_t creator_pid, char *why, size_t cap, int32_t *status) {
  *status = -1;
  struct cui_reply rep;
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } cm;
  struct iovec iov = {&rep, sizeof rep};
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = cm.buf;
  mh.msg_controllen = sizeof cm.buf;
  ssize_t k;
  do k = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
  while (k < 0 && errno == EINTR);
  int fd = -1;
  if (k > 0)
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof(int));
  if (k <= 0 || ((size_t)k < sizeof rep && cui_read_full(s, (char *)&rep + k, sizeof rep - (size_t)k) != 0)) {
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)] = "";
    int e = errno;
    cui_socket_path(creator_pid, path, sizeof path);
    snprintf(why, cap, "no reply from %s: %s", path, k == 0 ? "connection closed" : strerror(e));
    if (fd >= 0) close(fd);
    close(s);
    return -1;
  }
  *status = rep.status;
  if (rep.status != CUI_OK || fd < 0) {
    char msg[256] = "";
    size_t n = rep.message_len < sizeof msg - 1 ? rep.message_len : sizeof msg - 1;
    if (n && cui_read_full(s, msg, n) == 0) msg[n] = 0;
    if (rep.status == CUI_NOT_FOUND && rep.phase == CUI_PHASE_ACTIVE)
      snprintf(why, cap, "dead ticket: the creator holds no handle or mapping of the allocation any more (%s)", msg);
    else if (rep.status == CUI_NOT_FOUND || rep.status == CUI_REFUSED_PHASE)
      snprintf(why, cap, "creator pid %u is in phase %s, its exports are closed until it is restored (%s)", creator_pid,
               cui_phase_name(rep.phase), msg);
    else snprintf(why, cap, "creator replied status %d: %s", rep.status, msg);
    if (fd >= 0) close(fd);
    close(s);
    return -1;
  }
  close(s);
  return fd;
}

int cui_fetch_fd_status(uint32_t creator_pid, const uint8_t id[16], char *why, size_t cap, int32_t *status) {
  *status = -1;
  int s = cui_fetch_send(creator_pid, id, why, cap);
  return s < 0 ? -1 : cui_fetch_recv(s, creator_pid, why, cap, status);
}

int cui_fetch_fd(uint32_t creator_pid, const uint8_t id[16], char *why, size_t cap) {
  int32_t status;
  return cui_fetch_fd_status(creator_pid, id, why, cap, &status);
}
