/*
 * control.c: the top layer: the control endpoint (docs/shim.md "Threads"; protocol.h
 * "Transport") and the cuInit hook that starts it.
 *
 * Started once, after the first successful real cuInit (never from a constructor or a symbol
 * lookup): $CUINTERPOSE_CONTROL_DIR/cuinterpose-<pid>.sock, mode 0600, directory created 0700
 * when missing. Two threads, all signals blocked in both:
 *   cui-accept  accepts connections, reads the 64-byte request, serves CUI_OP_FETCH_FD inline
 *               from the export cache (cache mutex only: it answers while a phase op of this
 *               process waits on a peer), and hands every other op to the worker. When the
 *               worker is busy it replies CUI_BAD_REQUEST "busy" before anything is mutated.
 *   cui-control the control worker: runs one op at a time (ops.c) and replies.
 * Every FD is CLOEXEC. Socket I/O has a 10 s timeout per call.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
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
  rep.shim_flags = __atomic_load_n(&cui_st.shim_flags, __ATOMIC_RELAXED);

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
  return 0;
}

static void serve_fetch_fd(int conn, const struct cui_request *req) {
  struct cui_op_result res;
  memset(&res, 0, sizeof res);
  int fd = cui_cache_dup(req->alloc_id);
  if (fd < 0) {
    char hex[33];
    cui_hex_id(req->alloc_id, hex);
    res.status = CUI_NOT_FOUND;
    snprintf(res.message, sizeof res.message,
             "FETCH_FD: pid %u (phase %s) has no exported allocation %s (requested by pid %u)", (unsigned)getpid(),
             cui_phase_name(__atomic_load_n(&cui_st.phase, __ATOMIC_ACQUIRE)), hex, (unsigned)req->sender_pid);
  }
  send_reply(conn, req, &res, 0, fd);
  if (fd >= 0) close(fd);
}

/* Case 011: SO_PEERCRED. A mutating op is served only for root or the uid that owns this
 * process (the agent runs as one of them); anything else is refused before it is queued. */
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
  if (cr.uid == 0 || cr.uid == own) return 0;
  res->status = CUI_REFUSED_PEER;
  snprintf(res->message, sizeof res->message,
           "%s: pid %u: refused for pid %d uid %u: only root or uid %u (the owner of this process) may "
           "send mutating ops; nothing was changed",
           cui_op_name(req->op), (unsigned)getpid(), (int)cr.pid, (unsigned)cr.uid, (unsigned)own);
  return 1;
}

static void *accept_main(void *arg) {
  for (;;) {
    int c = accept4(g_listen, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
          errno == ENOMEM) {
        if (errno == EMFILE || errno == ENFILE) usleep(10000);
        continue;
      }
      cui_api_warn("control endpoint",
                   "accept on the control socket failed: %s; endpoint stopped (no INSPECT, "
                   "FETCH_FD or checkpoint of this process from now on)",
                   strerror(errno));
      return NULL;
    }
    cui_set_io_timeouts(c);
    struct cui_request req;
    if (cui_read_full(c, &req, sizeof req) != 0) {
      close(c);
      continue;
    }
    struct cui_op_result res;
    memset(&res, 0, sizeof res);
    if (req.magic != CUI_PROTO_MAGIC || req.version != CUI_PROTO_VERSION) {
      res.status = CUI_BAD_REQUEST;
      snprintf(res.message, sizeof res.message, "pid %u: bad request magic %08x or version %u (want %08x, %u)",
               (unsigned)getpid(), req.magic, req.version, CUI_PROTO_MAGIC, CUI_PROTO_VERSION);
      send_reply(c, &req, &res, 0, -1);
      close(c);
      continue;
    }
    if (req.op == CUI_OP_FETCH_FD) {
      serve_fetch_fd(c, &req);
      close(c);
      continue;
    }
    if (req.op == CUI_OP_INSPECT) {   /* read-only: never takes the worker slot (case 011) */
      uint64_t t0 = cui_now_ns();
      cui_run_op(&req, &res);
      send_reply(c, &req, &res, cui_now_ns() - t0, -1);
      free(res.records);
      close(c);
      continue;
    }
    if (peer_refused(c, &req, &res)) {
      send_reply(c, &req, &res, 0, -1);
      close(c);
      continue;
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
      continue;
    }
    g_job.pending = 1;
    g_job.conn = c;
    g_job.req = req;
    pthread_cond_signal(&g_job_cond);
    pthread_mutex_unlock(&g_job_lock);
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
    cui_run_op(&req, &res);
    uint64_t elapsed = cui_now_ns() - t0;
    /* Not busy from here: a client that got this reply may send the next op at once. It is
     * queued in the single slot and runs after the deferred work below. */
    pthread_mutex_lock(&g_job_lock);
    g_job.busy = 0;
    pthread_mutex_unlock(&g_job_lock);
    send_reply(c, &req, &res, elapsed, -1);
    free(res.records);
    close(c);
    cui_after_reply();
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
