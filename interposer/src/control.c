/*
 * control.c: the top layer: the control endpoint (docs/shim.md "Threads"; protocol.h
 * "Transport") and the cuInit hook that starts it.
 *
 * Started once, after the first successful real cuInit (never from a constructor or a symbol
 * lookup): $CUINTERPOSE_CONTROL_DIR/cuinterpose-<pid>.sock, mode 0600, directory created 0700
 * when missing. Two threads, all signals blocked in both:
 *   cui-accept  accepts connections and polls them (never blocking on one: each has one total
 *               deadline from accept), takes each 64-byte request, serves CUI_OP_FETCH_FD
 *               from the export cache (cache mutex only: it answers while a phase op of this
 *               process waits on a peer), and hands every other op to the worker. When the
 *               worker is busy it replies CUI_BUSY (retryable) before anything is mutated.
 *               INSPECT (read-only) is answered here too, under the state lock, never queued;
 *               the IPC adapter fills its record fields and refuses it (CUI_REFUSED_STATE,
 *               records still sent) while a driver IPC handle is live (alloc_api.c).
 *               FETCH_FD needs the allocation's secret (protocol.h "Secrets") and is refused
 *               in SAVED, PREPARED and FAILED.
 *               Mutating ops are refused (CUI_REFUSED_PEER) unless SO_PEERCRED names root or
 *               this process's uid and the request carries the token of this process's claim
 *               file (protocol.h "Claims"). Every reply says whether a mutating op is queued
 *               or running (CUI_SHIM_OP_RUNNING).
 *   cui-control the control worker: runs one op at a time (ops.c) and replies.
 * Every FD is CLOEXEC. Socket I/O has a 10 s timeout per call.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "ops.h"

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_listen = -1;

static pthread_mutex_t g_job_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_job_cond = PTHREAD_COND_INITIALIZER;
static struct {
  int pending, busy;
  int conn;
  struct cui_request req;
} g_job;

/* Sends reply header (+ `pass_fd` as SCM_RIGHTS when >= 0), records, message. */
static int send_reply(int conn, const struct cui_request *req, const struct cui_op_result *res, uint64_t elapsed_ns,
                      int pass_fd) {
  struct cui_reply rep;
  memset(&rep, 0, sizeof rep);
  size_t mlen = strlen(res->message);
  rep.magic = CUI_PROTO_MAGIC;
  rep.version = CUI_PROTO_VERSION;
  rep.op = req->op;
  rep.txn_id = req->txn_id;
  rep.status = res->status;
  rep.phase = __atomic_load_n(&cui_st.phase, __ATOMIC_ACQUIRE);
  rep.pid = (uint32_t)getpid();
  rep.record_count = res->record_count;
  rep.record_size = sizeof(struct cui_record);
  rep.message_len = (uint32_t)mlen;
  rep.bytes = res->bytes;
  rep.elapsed_ns = elapsed_ns;
  rep.copy_ns = res->copy_ns;
  rep.cuda_result = res->cuda_result;
  rep.records_changed = res->records_changed;
  rep.shim_flags = __atomic_load_n(&cui_st.shim_flags, __ATOMIC_RELAXED) | CUI_SHIM_CARRY_SHA256 |
                   CUI_SHIM_CARRY_STREAMED;
  pthread_mutex_lock(&g_job_lock);
  if (g_job.pending || g_job.busy) rep.shim_flags |= CUI_SHIM_OP_RUNNING; /* (the worker clears busy first) */
  pthread_mutex_unlock(&g_job_lock);
  memcpy(rep.reserved, res->reply_reserved, sizeof res->reply_reserved);

  struct iovec iov = {&rep, sizeof rep};
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } cm;
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (pass_fd >= 0) {
    memset(&cm, 0, sizeof cm);
    mh.msg_control = cm.buf;
    mh.msg_controllen = sizeof cm.buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
  }
  ssize_t k;
  do k = sendmsg(conn, &mh, MSG_NOSIGNAL);
  while (k < 0 && errno == EINTR);
  if (k < 0) return -1;
  if ((size_t)k < sizeof rep && cui_write_full(conn, (char *)&rep + k, sizeof rep - (size_t)k) != 0) return -1;
  if (res->record_count &&
      cui_write_full(conn, res->records, (size_t)res->record_count * sizeof(struct cui_record)) != 0)
    return -1;
  if (mlen && cui_write_full(conn, res->message, mlen) != 0) return -1;
  if (res->payload && res->reply_reserved[0] && cui_write_full(conn, res->payload, (size_t)res->reply_reserved[0]) != 0)
    return -1;
  return 0;
}

/* FETCH_FD (protocol.h "Secrets"): served from the export cache in the phases an import needs
 * (not SAVED, PREPARED, FAILED), and only with the allocation's secret when it has one. */
static void serve_fetch_fd(int conn, const struct cui_request *req) {
  struct cui_op_result res;
  memset(&res, 0, sizeof res);
  char hex[33];
  cui_hex_id(req->alloc_id, hex);
  uint32_t self = (uint32_t)getpid(), phase = __atomic_load_n(&cui_st.phase, __ATOMIC_ACQUIRE);
  int fd = -1;
  if (phase == CUI_PHASE_SAVED || phase == CUI_PHASE_PREPARED || phase == CUI_PHASE_FAILED) {
    res.status = CUI_REFUSED_PHASE;
    snprintf(res.message, sizeof res.message,
             "FETCH_FD: pid %u is in phase %s: allocation %s is not served to pid %u until the process is "
             "restored (FETCH_FD is served in ACTIVE and the restore phases); nothing was sent",
             (unsigned)self, cui_phase_name(phase), hex, (unsigned)req->sender_pid);
  } else {
    uint64_t want = cui_secret_of(req->alloc_id, self);
    if (want && req->reserved[0] != want) {
      struct ucred cr;
      socklen_t len = sizeof cr;
      int peer = getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0 ? (int)cr.pid : -1;
      res.status = CUI_REFUSED_PEER;
      snprintf(res.message, sizeof res.message,
               "FETCH_FD: pid %u refused allocation %s to pid %d (request names pid %u): the request does "
               "not carry the allocation's secret; only holders of its ticket or IPC handle may fetch it",
               (unsigned)self, hex, peer, (unsigned)req->sender_pid);
    } else if ((fd = cui_cache_dup(req->alloc_id)) < 0) {
      res.status = CUI_NOT_FOUND;
      snprintf(res.message, sizeof res.message,
               "FETCH_FD: pid %u (phase %s) has no exported allocation %s (requested by pid %u)", (unsigned)self,
               cui_phase_name(phase), hex, (unsigned)req->sender_pid);
    }
  }
  send_reply(conn, req, &res, 0, fd);
  if (fd >= 0) close(fd);
}

/* Claims (protocol.h): reads this process's claim file into `token` (and "PID KIND" of its
 * holder into `holder`). Returns 0, or -1 with `why` (missing, unsafe, unreadable, malformed). */
static int read_claim(const char *path, uint8_t token[16], char *holder, size_t hcap, char *why, size_t wcap) {
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    snprintf(why, wcap, "%s", errno == ENOENT ? "no such file: no checkpoint holds this process" : strerror(errno));
    return -1;
  }
  struct stat st;
  char buf[128];
  ssize_t n = -1;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (st.st_uid != 0 && st.st_uid != geteuid()) || (st.st_mode & 022)) {
    snprintf(why, wcap, "not a regular file of uid %u or root that only its owner may write (mode 0%o, uid %u)",
             (unsigned)geteuid(), (unsigned)(st.st_mode & 07777), (unsigned)st.st_uid);
  } else if ((n = read(fd, buf, sizeof buf - 1)) < 0) {
    snprintf(why, wcap, "%s", strerror(errno));
  }
  close(fd);
  if (n < 0) return -1;
  buf[n] = 0;
  for (int i = 0; i < 32; i++) {
    int c = buf[i], v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (v < 0 || (i == 31 && buf[32] != ' ' && buf[32] != '\n')) {
      snprintf(why, wcap, "malformed: the first line is not \"<32 hex digits> <pid> <kind>\"");
      return -1;
    }
    if (i % 2 == 0) token[i / 2] = (uint8_t)(v << 4);
    else token[i / 2] |= (uint8_t)v;
  }
  const char *rest = buf[32] == ' ' ? buf + 33 : "";
  snprintf(holder, hcap, "%.*s", (int)strcspn(rest, "\n"), rest);
  return 0;
}

/* A mutating op must carry the token of this process's claim file (protocol.h "Claims"):
 * refused (CUI_REFUSED_PEER, before the request is queued) otherwise; `peer`: SO_PEERCRED pid. */
static int claim_refused(const struct cui_request *req, struct cui_op_result *res, int peer) {
  char path[4096], why[200], holder[64] = "";
  uint8_t token[16];
  unsigned self = (unsigned)getpid();
  if (cui_claim_path(self, path, sizeof path) != 0) {
    snprintf(why, sizeof why, "the claim path is too long");
  } else if (read_claim(path, token, holder, sizeof holder, why, sizeof why) == 0) {
    if (memcmp(token, req->claim, sizeof token) == 0) return 0;
    snprintf(why, sizeof why, "the request does not carry the token of the claim held by %s",
             holder[0] ? holder : "an unnamed holder");
  }
  res->status = CUI_REFUSED_PEER;
  snprintf(res->message, sizeof res->message,
           "%s: pid %u refused the request of pid %d (it names pid %u): %s: %s; mutating ops are accepted "
           "only from the agent that holds the job's checkpoint (docs/protocol.md \"Claims\"); nothing was changed",
           cui_op_name(req->op), self, peer, (unsigned)req->sender_pid, path, why);
  return 1;
}

/* Case 011: SO_PEERCRED. A mutating op is served only for root or the uid that owns this
 * process (the agent runs as one of them), and only with the claim token of the checkpoint
 * that holds this process (claim_refused); anything else is refused before it is queued. */
static int peer_refused(int conn, const struct cui_request *req, struct cui_op_result *res) {
  struct ucred cr;
  socklen_t len = sizeof cr;
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0) {
    res->status = CUI_REFUSED_PEER;
    snprintf(res->message, sizeof res->message, "%s: pid %u: cannot read the peer's credentials (%s); refused",
             cui_op_name(req->op), (unsigned)getpid(), strerror(errno));
    return 1;
  }
  uid_t own = geteuid();
  if (cr.uid == 0 || cr.uid == own) return claim_refused(req, res, (int)cr.pid);
  res->status = CUI_REFUSED_PEER;
  snprintf(res->message, sizeof res->message,
           "%s: pid %u: refused for pid %d uid %u: only root or uid %u (the owner of this process) may "
           "send mutating ops; nothing was changed",
           cui_op_name(req->op), (unsigned)getpid(), (int)cr.pid, (unsigned)cr.uid, (unsigned)own);
  return 1;
}

/* One whole request from `c`: answered here (bad header, FETCH_FD, INSPECT, refusals) or
 * queued for the worker, which then owns `c`. */
static void dispatch(int c, struct cui_request req) {
  struct cui_op_result res;
  memset(&res, 0, sizeof res);
  if (req.magic != CUI_PROTO_MAGIC || req.version != CUI_PROTO_VERSION) {
    res.status = CUI_BAD_REQUEST;
    snprintf(res.message, sizeof res.message, "pid %u: bad request magic %08x or version %u (want %08x, %u)",
             (unsigned)getpid(), req.magic, req.version, CUI_PROTO_MAGIC, CUI_PROTO_VERSION);
    send_reply(c, &req, &res, 0, -1);
    close(c);
    return;
  }
  if (req.op == CUI_OP_FETCH_FD) {
    serve_fetch_fd(c, &req);
    close(c);
    return;
  }
  if (req.op == CUI_OP_INSPECT) {   /* read-only: never takes the worker slot (case 011) */
    uint64_t t0 = cui_now_ns();
    cui_run_op(&req, &res);
    /* the IPC adapter's record fields, and its refusal while a driver IPC handle is live */
    if (res.status == CUI_OK)
      cui_ipc_inspect_fixup(res.records, res.record_count, &res.status, res.message, sizeof res.message);
    cui_share_inspect_fixup(&res.status, res.message, sizeof res.message);   /* pools, IPC events, dlsym */
    send_reply(c, &req, &res, cui_now_ns() - t0, -1);
    free(res.records);
    close(c);
    return;
  }
  if (peer_refused(c, &req, &res)) {
    send_reply(c, &req, &res, 0, -1);
    close(c);
    return;
  }
  pthread_mutex_lock(&g_job_lock);
  if (g_job.pending || g_job.busy) {
    pthread_mutex_unlock(&g_job_lock);
    res.status = CUI_BUSY;
    snprintf(res.message, sizeof res.message,
             "%s: pid %u is still running another control request; nothing was changed, retry", cui_op_name(req.op),
             (unsigned)getpid());
    send_reply(c, &req, &res, 0, -1);
    close(c);
    return;
  }
  g_job.pending = 1;
  g_job.conn = c;
  g_job.req = req;
  pthread_cond_signal(&g_job_cond);
  pthread_mutex_unlock(&g_job_lock);
}

/* Connections whose 64-byte request has not fully arrived: the accept thread polls them, never
 * blocks on one, and drops each at its total deadline from accept (CUI_IO_TIMEOUT_S), so a
 * trickling client or a crowd of idle ones never holds off another (case 011). */
#define CUI_MAX_PENDING 256
static struct {
  int fd;
  size_t got;
  uint64_t deadline;
  struct cui_request req;
} g_pend[CUI_MAX_PENDING];
static int g_npend;

static void drop_pending(int i) {
  close(g_pend[i].fd);
  g_pend[i] = g_pend[--g_npend];
}

static void accept_ready(void) {
  while (g_npend < CUI_MAX_PENDING) {
    int c = accept4(g_listen, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        usleep(10000); /* out of descriptors or memory: let the pending ones finish first */
        return;
      }
      cui_api_warn("control endpoint",
                   "accept on the control socket failed: %s; endpoint stopped (no INSPECT, "
                   "FETCH_FD or checkpoint of this process from now on)",
                   strerror(errno));
      close(g_listen);
      g_listen = -1;
      return;
    }
    g_pend[g_npend].fd = c;
    g_pend[g_npend].got = 0;
    g_pend[g_npend].deadline = cui_now_ns() + (uint64_t)CUI_IO_TIMEOUT_S * 1000000000ull;
    g_npend++;
  }
}

/* Reads what has arrived on pending connection i; returns 1 when it was dispatched or dropped. */
static int read_pending(int i) {
  ssize_t k = recv(g_pend[i].fd, (char *)&g_pend[i].req + g_pend[i].got, sizeof g_pend[i].req - g_pend[i].got,
                   MSG_DONTWAIT);
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
  if (k <= 0) {
    drop_pending(i);
    return 1;
  }
  g_pend[i].got += (size_t)k;
  if (g_pend[i].got < sizeof g_pend[i].req) return 0;
  int c = g_pend[i].fd;
  struct cui_request req = g_pend[i].req;
  g_pend[i] = g_pend[--g_npend];
  fcntl(c, F_SETFL, fcntl(c, F_GETFL) & ~O_NONBLOCK);
  cui_set_io_timeouts(c);
  dispatch(c, req);
  return 1;
}

static void *accept_main(void *arg) {
  struct pollfd pf[CUI_MAX_PENDING + 1];
  int listening = 1;
  while (listening || g_npend) {
    uint64_t now = cui_now_ns();
    for (int i = 0; i < g_npend;) {
      if (g_pend[i].deadline <= now) drop_pending(i); /* slow or idle: no reply, it had its time */
      else i++;
    }
    int n = 0, lst = -1;
    if (g_listen >= 0 && g_npend < CUI_MAX_PENDING) {
      pf[n] = (struct pollfd){g_listen, POLLIN, 0};
      lst = n++;
    }
    uint64_t next = UINT64_MAX;
    for (int i = 0; i < g_npend; i++) {
      pf[n++] = (struct pollfd){g_pend[i].fd, POLLIN, 0};
      if (g_pend[i].deadline < next) next = g_pend[i].deadline;
    }
    int ms = next == UINT64_MAX ? -1 : (int)((next - now) / 1000000ull + 1);
    int r = poll(pf, (nfds_t)n, ms);
    if (r < 0) continue; /* EINTR (all signals are blocked here) or ENOMEM: try again */
    /* pending connections first, from the back (a dispatch moves the last one into its slot) */
    int np = g_npend;
    for (int i = np - 1; i >= 0; i--) {
      short ev = pf[n - np + i].revents;
      if (ev && i < g_npend) read_pending(i);
    }
    if (lst >= 0 && (pf[lst].revents & POLLIN)) accept_ready();
    listening = g_listen >= 0;
  }
  return NULL;
}

static void *worker_main(void *arg) {
  for (;;) {
    pthread_mutex_lock(&g_job_lock);
    while (!g_job.pending) pthread_cond_wait(&g_job_cond, &g_job_lock);
    int c = g_job.conn;
    struct cui_request req = g_job.req;
    g_job.pending = 0;
    g_job.busy = 1;
    pthread_mutex_unlock(&g_job_lock);

    struct cui_op_result res;
    memset(&res, 0, sizeof res);
    uint64_t t0 = cui_now_ns();
    struct cui_carry_in carry;
    memset(&carry, 0, sizeof carry);
    int carries = req.op == CUI_OP_SAVE_ALLOCATIONS || req.op == CUI_OP_LOAD_ALLOCATIONS;
    if (!carries || cui_carry_recv(c, &req, &carry, &res) == 0) {
      res.carry = carries ? &carry : NULL;
      cui_run_op(&req, &res);
    }
    cui_carry_free(&carry);   /* every descriptor is closed before the reply */
    res.carry = NULL;
    uint64_t elapsed = cui_now_ns() - t0;
    /* Not busy from here: a client that got this reply may send the next op at once. It is
     * queued in the single slot and runs after the deferred work below. */
    pthread_mutex_lock(&g_job_lock);
    g_job.busy = 0;
    pthread_mutex_unlock(&g_job_lock);
    send_reply(c, &req, &res, elapsed, -1);
    free(res.records);
    free(res.payload);
    close(c);
  }
  return NULL;
}

/* Every reason for not serving is one line on stderr (this runs once per process): what,
 * where, and that CUDA keeps working without INSPECT or checkpoint. */
#define NO_ENDPOINT "; no control endpoint: CUDA keeps working, but this process cannot be inspected or checkpointed"

/* Case 004: what is at our path is removed only when it is a socket nobody listens on
 * (connect answers ECONNREFUSED: a stale socket of an earlier process with this pid). A live
 * socket (another pid namespace's process with the same pid, sharing this directory) or any
 * other file is left alone, and the process runs without an endpoint. Returns 0 when the path
 * is free for bind. */
static int reclaim_path(const struct sockaddr_un *sa, const char *dir) {
  struct stat st;
  if (lstat(sa->sun_path, &st) != 0) {
    if (errno == ENOENT) return 0;
    cui_api_warn("cuInit", "cannot inspect %s: %s" NO_ENDPOINT, sa->sun_path, strerror(errno));
    return -1;
  }
  if (!S_ISSOCK(st.st_mode)) {
    cui_api_warn("cuInit",
                 "%s exists and is not a socket (mode 0%o, uid %u); left alone" NO_ENDPOINT
                 ". Remove it if it is not needed, or set CUINTERPOSE_CONTROL_DIR to a directory of this job",
                 sa->sun_path, (unsigned)st.st_mode, (unsigned)st.st_uid);
    return -1;
  }
  int p = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (p < 0) {
    cui_api_warn("cuInit", "socket: %s" NO_ENDPOINT, strerror(errno));
    return -1;
  }
  int rc = connect(p, (const struct sockaddr *)sa, sizeof *sa);
  int err = rc == 0 ? 0 : errno;
  close(p);
  if (rc != 0 && err == ECONNREFUSED) {
    if (unlink(sa->sun_path) == 0 || errno == ENOENT) return 0;
    cui_api_warn("cuInit", "cannot remove the stale socket %s: %s" NO_ENDPOINT, sa->sun_path, strerror(errno));
    return -1;
  }
  if (rc == 0)
    cui_api_warn("cuInit",
                 "%s is a live socket of another process (a process with pid %u in another pid namespace "
                 "sharing control directory %s?); left alone" NO_ENDPOINT
                 ". Give each container its own CUINTERPOSE_CONTROL_DIR",
                 sa->sun_path, (unsigned)cui_st.pid, dir);
  else
    cui_api_warn("cuInit", "%s is a socket that cannot be probed (connect: %s); left alone" NO_ENDPOINT, sa->sun_path,
                 strerror(err));
  return -1;
}

static void start_endpoint(void) {
  cui_st.pid = (uint32_t)getpid();
  pthread_atfork(NULL, NULL, cui_fork_child);   /* case 003: a forked child uses no inherited state */
  char who[256];
  if (cui_dlsym_foreign(who, sizeof who)) {
    __atomic_or_fetch(&cui_st.shim_flags, CUI_SHIM_FOREIGN_DLSYM, __ATOMIC_RELAXED);
    cui_api_warn("cuInit",
                 "dlsym resolves to %s, not to libcuinterpose: another dlsym interposer is preloaded "
                 "before the shim, so dlsym, cuGetProcAddress and ctypes lookups through it bypass "
                 "tracking and a checkpoint may be refused; put libcuinterpose.so first in LD_PRELOAD "
                 "(docs/shim.md \"Preload order\")",
                 who);
  }
  const char *dir = cui_control_dir();
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  if (cui_socket_path(cui_st.pid, sa.sun_path, sizeof sa.sun_path) != 0) {
    cui_api_warn("cuInit",
                 "control socket path %s/" CUI_SOCKET_PREFIX "%u.sock (CUINTERPOSE_CONTROL_DIR) is longer "
                 "than a UNIX socket path may be (%zu bytes)" NO_ENDPOINT,
                 dir, cui_st.pid, sizeof sa.sun_path - 1);
    return;
  }
  if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
    cui_api_warn("cuInit", "cannot create control directory %s: %s" NO_ENDPOINT, dir, strerror(errno));
    return;
  }
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) {
    cui_api_warn("cuInit", "socket: %s" NO_ENDPOINT, strerror(errno));
    return;
  }
  if (reclaim_path(&sa, dir) != 0) {
    close(s);
    return;
  }
  if (bind(s, (struct sockaddr *)&sa, sizeof sa) != 0) {   /* never unlink what we did not bind */
    cui_api_warn("cuInit", "cannot serve %s in control directory %s: %s" NO_ENDPOINT, sa.sun_path, dir,
                 strerror(errno));
    close(s);
    return;
  }
  if (chmod(sa.sun_path, 0600) != 0 || listen(s, 64) != 0) {
    cui_api_warn("cuInit", "cannot serve %s in control directory %s: %s" NO_ENDPOINT, sa.sun_path, dir,
                 strerror(errno));
    close(s);
    unlink(sa.sun_path);
    return;
  }
  fcntl(s, F_SETFL, fcntl(s, F_GETFL) | O_NONBLOCK); /* accept_ready takes all that wait, then polls */
  g_listen = s;

  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  pthread_t t1, t2;
  int e1 = pthread_create(&t2, &at, worker_main, NULL);
  int e2 = e1 ? e1 : pthread_create(&t1, &at, accept_main, NULL);
  pthread_attr_destroy(&at);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (e1 || e2) {
    cui_api_warn("cuInit", "cannot start control threads: %s" NO_ENDPOINT, strerror(e1 ? e1 : e2));
    close(s);
    unlink(sa.sun_path);
    g_listen = -1;
    return;   /* a started worker just idles */
  }
  pthread_setname_np(t2, "cui-control");
  pthread_setname_np(t1, "cui-accept");
}

/* cuInit: the endpoint starts once, after the first successful real cuInit. */
CUI_EXPORT CUresult cuInit(unsigned int flags) {
  cui_fn_cuInit real = REAL(cuInit);
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
  CUI_FORK_FORWARD("cuInit", real(flags));
  CUresult r = real(flags);
  if (r == CUDA_SUCCESS) pthread_once(&g_once, start_endpoint);
  return r;
}

/* At exit, remove our socket so short-lived CUDA processes leave no stale paths behind. A
 * forked child (another pid) leaves its parent's socket alone. */
__attribute__((destructor)) static void remove_socket(void) {
  char path[108];
  if (g_listen >= 0 && cui_st.pid == (uint32_t)getpid() && cui_socket_path(cui_st.pid, path, sizeof path) == 0)
    unlink(path);
}
