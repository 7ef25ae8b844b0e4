/*
 * The IPC adapter end to end for the sanitizer build (no exec, no shell; docs/shim.md "IPC
 * adapter"): the parent forks a creator and an importer before any CUDA call and acts as the
 * coordinator over the control sockets (protocol.h).
 *
 * Creator: cuMemAlloc_v2 of 3 MiB (ELF), fill, cuIpcGetMemHandle at an offset (dlsym), the
 * 64 bytes to the importer and the parent over pipes. Importer: cuIpcOpenMemHandle_v2 from 4
 * threads at once (one VA), check the bytes, write another pattern. Parent: FETCH_FD with a wrong secret
 * (CUI_REFUSED_PEER) and the right one (an FD), INSPECT both, SAVE_ALLOCATIONS,
 * PREPARE_UNICAST, LOAD_ALLOCATIONS, RESTORE_UNICAST on both, INSPECT again (records identical,
 * so the importer's VA is too). Then the importer checks the bytes after the restore and
 * writes a third pattern the creator must see; the importer closes 4 times, the creator frees.
 * Prints "ipc ok" and exits 0 on success. Needs CUINTERPOSE_CONTROL_DIR and libcuda.so.1
 * (fakecuda) on the library path.
 */
#define _GNU_SOURCE
#include "carry.h"
#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuinterpose/protocol.h"

#define REQ    (3u << 20)
#define MAPPED (4u << 20)

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "[%d] FAIL %s:%d: ", (int)getpid(), __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                            \
      fprintf(stderr, "\n");                                                   \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

static void put_all(int fd, const void *p, size_t n) {
  CHECK(write(fd, p, n) == (ssize_t)n, "write: %s", strerror(errno));
}
static void get_all(int fd, void *p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t k = read(fd, (char *)p + got, n - got);
    CHECK(k > 0, "read: peer gone");
    got += (size_t)k;
  }
}
static void put(int fd, char c) { put_all(fd, &c, 1); }
static char get(int fd) {
  char c;
  get_all(fd, &c, 1);
  return c;
}

static void pattern(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 31u + seed);
}
static void fill(CUdeviceptr va, unsigned seed) {
  unsigned char *b = malloc(REQ);
  pattern(b, REQ, seed);
  CHECK(cuMemcpyHtoD(va, b, REQ) == CUDA_SUCCESS, "fill");
  free(b);
}
static void check(CUdeviceptr va, unsigned seed) {
  unsigned char *want = malloc(REQ), *got = malloc(REQ);
  pattern(want, REQ, seed);
  CHECK(cuMemcpyDtoH(got, va, REQ) == CUDA_SUCCESS, "copy");
  CHECK(memcmp(want, got, REQ) == 0, "bytes differ (seed %u)", seed);
  free(want);
  free(got);
}

static void init(void) {
  CUdevice d;
  CUcontext ctx;
  CHECK(cuInit(0) == CUDA_SUCCESS && cuDeviceGet(&d, 0) == CUDA_SUCCESS &&
            cuDevicePrimaryCtxRetain(&ctx, d) == CUDA_SUCCESS && cuCtxSetCurrent(ctx) == CUDA_SUCCESS,
        "init");
}

typedef CUresult (*get_fn)(CUipcMemHandle *, CUdeviceptr);
typedef CUresult (*open_fn)(CUdeviceptr *, CUipcMemHandle, unsigned int);
typedef CUresult (*close_fn)(CUdeviceptr);

static int creator(int in, int out, int to_importer) {
  init();
  CUdeviceptr va = 0;
  CHECK(cuMemAlloc(&va, REQ) == CUDA_SUCCESS, "cuMemAlloc");
  fill(va, 1);
  get_fn gh = (get_fn)dlsym(RTLD_DEFAULT, "cuIpcGetMemHandle");
  CUipcMemHandle h;
  CHECK(gh && gh(&h, va + 4096) == CUDA_SUCCESS, "cuIpcGetMemHandle");
  put_all(to_importer, &h, sizeof h);
  put_all(out, &h, sizeof h);
  CHECK(get(in) == 'w', "wait for the cycle");
  check(va, 2);   /* the importer's write, carried and reloaded */
  put(out, 'd');
  CHECK(get(in) == 'v', "wait for the importer");
  check(va, 3);
  CHECK(cuMemFree(va) == CUDA_SUCCESS, "cuMemFree");
  put(out, 'x');
  return 0;
}

#define OPENERS 4
struct opener {
  open_fn op;
  CUipcMemHandle h;
  CUcontext ctx;
  CUdeviceptr va;
  CUresult r;
};

static void *open_thread(void *arg) {
  struct opener *o = arg;
  o->r = cuCtxSetCurrent(o->ctx);
  if (o->r == CUDA_SUCCESS) o->r = o->op(&o->va, o->h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  return NULL;
}

static int importer(int in, int out, int from_creator) {
  init();
  CUipcMemHandle h;
  get_all(from_creator, &h, sizeof h);
  open_fn op = (open_fn)dlsym(RTLD_DEFAULT, "cuIpcOpenMemHandle_v2");
  close_fn cl = (close_fn)dlsym(RTLD_DEFAULT, "cuIpcCloseMemHandle");
  CHECK(op && cl, "dlsym");
  struct opener o[OPENERS];
  pthread_t t[OPENERS];
  for (int k = 0; k < OPENERS; k++) {
    o[k].op = op;
    o[k].h = h;
    cuCtxGetCurrent(&o[k].ctx);
    CHECK(pthread_create(&t[k], NULL, open_thread, &o[k]) == 0, "pthread_create");
  }
  for (int k = 0; k < OPENERS; k++) {
    pthread_join(t[k], NULL);
    CHECK(o[k].r == CUDA_SUCCESS && o[k].va == o[0].va, "open %d: %d", k, (int)o[k].r);
  }
  CUdeviceptr v1 = o[0].va;
  check(v1, 1);
  fill(v1, 2);
  put_all(out, &v1, sizeof v1);
  CHECK(get(in) == 'c', "wait for the cycle");
  check(v1, 2);
  fill(v1, 3);
  put(out, 'd');
  CHECK(get(in) == 'q', "wait");
  for (int k = 0; k < OPENERS; k++) CHECK(cl(v1) == CUDA_SUCCESS, "close %d", k);
  CHECK(cl(v1) != CUDA_SUCCESS, "a close more than opened must fail");
  put(out, 'x');
  return 0;
}

/* ---- coordinator side ---- */

static int connect_to(pid_t pid) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s/cuinterpose-%d.sock", getenv("CUINTERPOSE_CONTROL_DIR"), (int)pid);
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  CHECK(connect(s, (struct sockaddr *)&sa, sizeof sa) == 0, "connect %s: %s", sa.sun_path, strerror(errno));
  return s;
}

/* One request; the reply header in `rep`, the records (malloc'd) in *recs, an SCM_RIGHTS FD in
 * *fd (or -1). */
static const struct cui_record *g_carry_recs; /* the creator's records (carry.h) */
static uint32_t g_carry_n;
static int g_carry_fd[8] = {-1, -1, -1, -1, -1, -1, -1, -1};

static int request(pid_t pid, const struct cui_request *q, struct cui_reply *rep, struct cui_record **recs, int *fd) {
  int s = connect_to(pid);
  if (q->op == CUI_OP_SAVE_ALLOCATIONS || q->op == CUI_OP_LOAD_ALLOCATIONS) {
    struct cui_request qq = *q;
    CHECK(cui_test_send_carriers(s, &qq, g_carry_recs, g_carry_n, g_carry_fd) == 0, "send carriers");
  } else {
    put_all(s, q, sizeof *q);
  }
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } cm;
  struct iovec iov = {rep, sizeof *rep};
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = sizeof cm.buf};
  ssize_t k = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
  CHECK(k > 0, "reply");
  if (fd) *fd = -1;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      int got;
      memcpy(&got, CMSG_DATA(c), sizeof got);
      if (fd) *fd = got;
      else close(got);
    }
  if ((size_t)k < sizeof *rep) get_all(s, (char *)rep + k, sizeof *rep - (size_t)k);
  size_t n = (size_t)rep->record_count * rep->record_size + rep->message_len;
  if (q->op == CUI_OP_SAVE_ALLOCATIONS) n += rep->reserved[0]; /* the chunk table */
  char *body = malloc(n + 1);
  get_all(s, body, n);
  body[n] = 0;
  close(s);
  if (recs) *recs = (struct cui_record *)body;
  else free(body);
  return rep->status;
}

static int op(pid_t pid, uint16_t code, uint64_t txn, uint32_t phase, struct cui_reply *rep, struct cui_record **recs) {
  struct cui_request q;
  memset(&q, 0, sizeof q);
  q.magic = CUI_PROTO_MAGIC;
  q.version = CUI_PROTO_VERSION;
  q.op = code;
  q.txn_id = txn;
  q.expected_phase = phase;
  q.sender_pid = (uint32_t)getpid();
  memcpy(q.claim, CUI_TEST_CLAIM, sizeof q.claim); /* main() claimed both (carry.h) */
  return request(pid, &q, rep, recs, NULL);
}

static int fetch(pid_t pid, const struct cui_ipc_handle *h, uint64_t secret, int *fd) {
  struct cui_request q;
  memset(&q, 0, sizeof q);
  q.magic = CUI_PROTO_MAGIC;
  q.version = CUI_PROTO_VERSION;
  q.op = CUI_OP_FETCH_FD;
  q.sender_pid = (uint32_t)getpid();
  memcpy(q.alloc_id, h->alloc_id, 16);
  q.reserved[0] = secret;
  struct cui_reply rep;
  return request(pid, &q, &rep, NULL, fd);
}

int main(void) {
  int c_in[2], c_out[2], i_in[2], i_out[2], ci[2];
  alarm(240);
  CHECK(pipe(c_in) == 0 && pipe(c_out) == 0 && pipe(i_in) == 0 && pipe(i_out) == 0 && pipe(ci) == 0, "pipe");
  pid_t cp = fork();
  if (cp == 0) exit((alarm(240), creator(c_in[0], c_out[1], ci[1])));
  pid_t ip = fork();
  if (ip == 0) exit((alarm(240), importer(i_in[0], i_out[1], ci[0])));
  pid_t who[2] = {cp, ip};
  CHECK(cui_test_claim(cp) == 0 && cui_test_claim(ip) == 0, "claim: %s", strerror(errno));

  struct cui_ipc_handle h;
  get_all(c_out[0], &h, sizeof h);
  CHECK(memcmp(h.magic, CUI_IPC_MAGIC, 8) == 0 && h.creator_pid == (uint32_t)cp && h.size == REQ && h.offset == 4096 &&
            h.mapped == MAPPED && h.secret != 0,
        "virtual handle fields");
  CUdeviceptr vi;
  get_all(i_out[0], &vi, sizeof vi);
  int fd = -1;
  CHECK(fetch(cp, &h, h.secret ^ 1, &fd) == CUI_REFUSED_PEER && fd < 0, "wrong secret served");
  CHECK(fetch(cp, &h, h.secret, &fd) == CUI_OK && fd >= 0, "right secret refused");
  close(fd);

  struct cui_reply rep;
  struct cui_record *before[2], *after[2];
  uint32_t nbefore[2];
  for (int k = 0; k < 2; k++) {
    CHECK(op(who[k], CUI_OP_INSPECT, 0, CUI_PHASE_ACTIVE, &rep, &before[k]) == CUI_OK, "inspect");
    nbefore[k] = rep.record_count;
  }
  CHECK(nbefore[0] == 3 && nbefore[1] == 3, "records %u %u", nbefore[0], nbefore[1]);
  CHECK(before[1][1].kind == CUI_RECORD_MAPPING && before[1][1].va == vi, "importer mapping");
  CHECK(before[0][0].reserved[0] == REQ && before[0][0].size == MAPPED, "adapter sizes");
  const struct {
    uint16_t op;
    uint32_t from;
  } steps[] = {{CUI_OP_SAVE_ALLOCATIONS, CUI_PHASE_ACTIVE},
               {CUI_OP_PREPARE_UNICAST, CUI_PHASE_SAVED},
               {CUI_OP_LOAD_ALLOCATIONS, CUI_PHASE_PREPARED},
               {CUI_OP_RESTORE_UNICAST, CUI_PHASE_LOADED}};
  for (unsigned s = 0; s < 4; s++)
    for (int k = 0; k < 2; k++) {
      g_carry_recs = before[k], g_carry_n = nbefore[k];
      CHECK(op(who[k], steps[s].op, s + 1, steps[s].from, &rep, NULL) == CUI_OK, "step %u", s);
    }
  for (int k = 0; k < 2; k++) {
    CHECK(op(who[k], CUI_OP_INSPECT, 0, CUI_PHASE_ACTIVE, &rep, &after[k]) == CUI_OK, "inspect");
    CHECK(rep.record_count == nbefore[k] && memcmp(before[k], after[k], nbefore[k] * sizeof(struct cui_record)) == 0,
          "records changed across the cycle (pid %d)", (int)who[k]);
    free(before[k]);
    free(after[k]);
  }
  put(c_in[1], 'w');
  CHECK(get(c_out[0]) == 'd', "creator verify");
  put(i_in[1], 'c');
  CHECK(get(i_out[0]) == 'd', "importer verify");
  put(c_in[1], 'v');
  put(i_in[1], 'q');
  CHECK(get(c_out[0]) == 'x' && get(i_out[0]) == 'x', "teardown");
  int st1, st2;
  waitpid(cp, &st1, 0);
  waitpid(ip, &st2, 0);
  CHECK(WIFEXITED(st1) && WEXITSTATUS(st1) == 0 && WIFEXITED(st2) && WEXITSTATUS(st2) == 0, "child status");
  printf("ipc ok\n");
  return 0;
}
