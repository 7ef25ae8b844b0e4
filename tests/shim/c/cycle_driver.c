/*
 * A self-contained two-process unicast cycle, for the sanitizer build (no exec, no shell):
 * the parent forks a creator and an importer before any CUDA call, then acts as the
 * coordinator over the control sockets (protocol.h), while the children use the driver API
 * through three lookup paths (ELF, dlsym, cuGetProcAddress_v2). The ticket travels from the
 * creator to the importer over a socketpair (SCM_RIGHTS), as NCCL and afdwin pass FDs.
 *
 * Steps: the parent INSPECTs the creator before it recorded anything; creator runs the object model's edge paths
 * (spanning and partial ranges, retain inside a mapping at an offset, release while mapped, double release) and cleans
 * up, then creates+maps+fills 2 granules, exports; importer imports the ticket twice, maps, retains (alias collapse),
 * checks bytes. Parent: INSPECT, SAVE_ALLOCATIONS, PREPARE_UNICAST, LOAD_ALLOCATIONS, RESTORE_UNICAST on both, a
 * refused duplicate, INSPECT again (records must be identical). Then the creator writes a new pattern and the importer
 * must see it; both tear everything down. Prints "cycle ok" and exits 0 on success.
 * Needs CUINTERPOSE_CONTROL_DIR set and libcuda.so.1 (fakecuda) on the library path.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuinterpose/protocol.h"

#include "carry.h" /* cui_test_claim (protocol.h "Claims") */

#define GRAN (2u << 20)
#define SIZE (2 * GRAN)

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "[%d] FAIL %s:%d: ", (int)getpid(), __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                            \
      fprintf(stderr, "\n");                                                   \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)
#define CU(call)                                          \
  do {                                                    \
    CUresult r_ = (call);                                 \
    CHECK(r_ == CUDA_SUCCESS, "%s = %d", #call, (int)r_); \
  } while (0)

static void pattern(unsigned char *p, size_t n, unsigned seed) {
  unsigned x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (unsigned char)(x >> 16);
  }
}

/* ---- line-less control pipes: one byte per step ---- */
static void put(int fd, char c) { CHECK(write(fd, &c, 1) == 1, "pipe write"); }
static char get(int fd) {
  char c = 0;
  CHECK(read(fd, &c, 1) == 1, "pipe read");
  return c;
}

static void send_fd(int s, int fd) {
  char b = 't';
  struct iovec iov = {&b, 1};
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr a;
  } cm;
  memset(&cm, 0, sizeof cm);
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = sizeof cm.buf};
  struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof fd);
  CHECK(sendmsg(s, &mh, 0) == 1, "sendmsg");
}

static int recv_fd(int s) {
  char b;
  struct iovec iov = {&b, 1};
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr a;
  } cm;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = sizeof cm.buf};
  CHECK(recvmsg(s, &mh, 0) == 1, "recvmsg");
  int fd = -1;
  struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
  CHECK(c && c->cmsg_type == SCM_RIGHTS, "no fd");
  memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

static void init_ctx(void) {
  CUdevice d;
  CUcontext ctx;
  CU(cuInit(0));
  CU(cuDeviceGet(&d, 0));
  CU(cuDevicePrimaryCtxRetain(&ctx, d));
  CU(cuCtxSetCurrent(ctx));
}

static void set_rw(CUdeviceptr va, size_t n, int ndev) {
  CUmemAccessDesc d[2];
  memset(d, 0, sizeof d);
  for (int i = 0; i < ndev; i++) {
    d[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d[i].location.id = i;
    d[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU(cuMemSetAccess(va, n, &d[i], 1));   /* once per device, like PyTorch */
  }
}

static void check_bytes(CUdeviceptr va, size_t n, unsigned seed) {
  unsigned char *want = malloc(n), *got = malloc(n);
  pattern(want, n, seed);
  CU(cuMemcpyDtoH(got, va, n));
  CHECK(memcmp(want, got, n) == 0, "bytes differ (seed %u)", seed);
  free(want);
  free(got);
}

static void fill_bytes(CUdeviceptr va, size_t n, unsigned seed) {
  unsigned char *p = malloc(n);
  pattern(p, n, seed);
  CU(cuMemcpyHtoD(va, p, n));
  free(p);
}

/* The object model's edge paths (tests/shim/test_robust.py), left with nothing recorded. */
static void edge_paths(void) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemGenericAllocationHandle ha, hb, hr;
  CUdeviceptr va;
  CU(cuMemCreate(&ha, SIZE, &p, 0));
  CU(cuMemCreate(&hb, SIZE, &p, 0));
  CU(cuMemAddressReserve(&va, 2 * SIZE, 0, 0, 0));
  CU(cuMemMap(va, SIZE, 0, ha, 0));
  CU(cuMemMap(va + SIZE, GRAN, GRAN, hb, 0));              /* non-zero offset */
  CU(cuMemMap(va + SIZE + GRAN, GRAN, 0, hb, 0));
  set_rw(va, 2 * SIZE, 2);                                 /* spans three mappings */
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
  CHECK(cuMemSetAccess(va + GRAN, SIZE, &d, 1) == CUDA_ERROR_NOT_SUPPORTED, "partial access");
  CHECK(cuMemUnmap(va + GRAN, SIZE) == CUDA_ERROR_INVALID_VALUE, "partial unmap");
  fill_bytes(va, 2 * SIZE, 5);
  CU(cuMemRetainAllocationHandle(&hr, (void *)(uintptr_t)(va + SIZE + GRAN + 77)));
  CHECK(hr == hb, "retain inside");
  CU(cuMemRelease(hr));
  CU(cuMemRelease(ha));                                    /* while mapped */
  CHECK(cuMemRelease(ha) == CUDA_ERROR_INVALID_VALUE, "double release");
  check_bytes(va, 2 * SIZE, 5);
  CU(cuMemUnmap(va, SIZE + GRAN));                         /* two whole mappings */
  CU(cuMemUnmap(va + SIZE + GRAN, GRAN));
  CU(cuMemRelease(hb));
  CHECK(cuMemRelease(hb) == CUDA_ERROR_INVALID_VALUE, "release after the last");
  CU(cuMemAddressFree(va, 2 * SIZE));
}

static int creator(int ctl_in, int ctl_out, int peer) {
  init_ctx();
  put(ctl_out, 'i');                    /* INSPECTed with no reservation recorded yet */
  CHECK(get(ctl_in) == 'g', "expected g");
  edge_paths();
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemGenericAllocationHandle h, hp;
  CU(cuMemCreate(&h, SIZE, &p, 0));
  CHECK((h >> 48) == 0xC01E, "not a virtual handle: %llx", (unsigned long long)h);
  CUdeviceptr va;
  CU(cuMemAddressReserve(&va, 2 * SIZE, 0, 0, 0));
  CU(cuMemMap(va, SIZE, 0, h, 0));
  set_rw(va, SIZE, 1);
  fill_bytes(va, SIZE, 7);
  CU(cuMemCreate(&hp, GRAN, &p, 0));   /* private */
  CU(cuMemMap(va + SIZE, GRAN, 0, hp, 0));
  set_rw(va + SIZE, GRAN, 1);
  fill_bytes(va + SIZE, GRAN, 3);
  int t = -1;
  CU(cuMemExportToShareableHandle(&t, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  send_fd(peer, t);
  close(t);
  put(ctl_out, 'r');                    /* ready for the cycle */
  CHECK(get(ctl_in) == 'w', "expected w");
  check_bytes(va, SIZE, 7);
  check_bytes(va + SIZE, GRAN, 3);
  fill_bytes(va, SIZE, 9);
  put(ctl_out, 'd');
  CHECK(get(ctl_in) == 'q', "expected q");
  CU(cuMemUnmap(va, SIZE));
  CU(cuMemUnmap(va + SIZE, GRAN));
  CU(cuMemRelease(h));
  CU(cuMemRelease(hp));
  CU(cuMemAddressFree(va, 2 * SIZE));
  put(ctl_out, 'x');
  return 0;
}

typedef CUresult (*import_fn)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
typedef CUresult (*retain_fn)(CUmemGenericAllocationHandle *, void *);
typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static int importer(int ctl_in, int ctl_out, int peer) {
  init_ctx();
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  CHECK(lib, "dlopen");
  import_fn imp = (import_fn)dlsym(lib, "cuMemImportFromShareableHandle");
  gpa2_fn gpa = (gpa2_fn)dlsym(lib, "cuGetProcAddress_v2");
  retain_fn ret = NULL;
  CUdriverProcAddressQueryResult st;
  CU(gpa("cuMemRetainAllocationHandle", (void **)&ret, 12000, 0, &st));
  CHECK(imp && ret && st == CU_GET_PROC_ADDRESS_SUCCESS, "lookups");
  int t = recv_fd(peer);
  CUmemGenericAllocationHandle h1, h2, h3;
  CU(imp(&h1, (void *)(uintptr_t)t, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CU(imp(&h2, (void *)(uintptr_t)t, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(t);
  CHECK(h1 == h2 && (h1 >> 48) == 0xC01E, "alias collapse");
  CUdeviceptr va;
  CU(cuMemAddressReserve(&va, SIZE, 0, 0, 0));
  CU(cuMemMap(va, SIZE, 0, h1, 0));
  set_rw(va, SIZE, 2);
  CU(ret(&h3, (void *)(uintptr_t)(va + 4096)));
  CHECK(h3 == h1, "retain alias");
  check_bytes(va, SIZE, 7);
  put(ctl_out, 'r');
  CHECK(get(ctl_in) == 'c', "expected c");
  check_bytes(va, SIZE, 9);
  put(ctl_out, 'd');
  CHECK(get(ctl_in) == 'q', "expected q");
  CU(cuMemUnmap(va, SIZE));
  CU(cuMemRelease(h1));
  CU(cuMemRelease(h2));
  CU(cuMemRelease(h3));
  CHECK(cuMemRelease(h3) == CUDA_ERROR_INVALID_VALUE, "fourth release must fail");
  CU(cuMemAddressFree(va, SIZE));
  dlclose(lib);
  put(ctl_out, 'x');
  return 0;
}

/* ---- coordinator side ---- */

/* The chunk files of SAVE/LOAD_ALLOCATIONS (protocol.h "Carriers"): one memfd per carried
 * allocation of g_carry_recs (the creator's INSPECT records), kept from SAVE to LOAD. */
static const struct cui_record *g_carry_recs;
static uint32_t g_carry_n;
static int g_carry_fd[8] = {-1, -1, -1, -1, -1, -1, -1, -1};

static void send_carriers(int s, struct cui_request *q) {
  struct cui_stream_entry e[8];
  int fds[8];
  uint32_t n = 0;
  for (uint32_t i = 0; i < g_carry_n && n < 8; i++) {
    const struct cui_record *r = &g_carry_recs[i];
    if (r->kind != CUI_RECORD_ALLOCATION || r->role != CUI_ROLE_CREATOR) continue;
    if (g_carry_fd[n] < 0) g_carry_fd[n] = memfd_create("chunks", MFD_CLOEXEC);
    memset(&e[n], 0, sizeof e[n]);
    memcpy(e[n].alloc_id, r->alloc_id, 16);
    e[n].bytes = r->size;
    fds[n] = g_carry_fd[n];
    n++;
  }
  /* SAVE streams its descriptors (CUI_CARRY_STREAMED: the entries, then one group per file);
   * LOAD sends them with the entries */
  int streamed = q->op == CUI_OP_SAVE_ALLOCATIONS;
  q->reserved[0] = 64 << 10; /* chunk_bytes */
  q->reserved[1] = 128 << 10; /* staging_bytes: two slots */
  q->reserved[2] = 3u | (uint64_t)(streamed ? CUI_CARRY_STREAMED : 0) << 16 | (uint64_t)n << 32; /* three writers */
  CHECK(write(s, q, sizeof *q) == sizeof *q, "send");
  if (!n) return;
  if (streamed) CHECK(write(s, e, n * sizeof e[0]) == (ssize_t)(n * sizeof e[0]), "send entries");
  for (uint32_t k = 0; k < (streamed ? n : 1); k++) {
    struct cui_fd_group g = {1, 0};
    union {
      char buf[CMSG_SPACE(sizeof fds)];
      struct cmsghdr align;
    } cm;
    uint32_t nfd = streamed ? 1 : n;
    struct iovec iov = streamed ? (struct iovec){&g, sizeof g} : (struct iovec){e, n * sizeof e[0]};
    struct msghdr mh = {
      .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = CMSG_SPACE(nfd * sizeof(int))};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(nfd * sizeof(int));
    memcpy(CMSG_DATA(c), fds + k, nfd * sizeof(int));
    CHECK(sendmsg(s, &mh, 0) == (ssize_t)iov.iov_len, "send carriers");
  }
}

static int request(pid_t pid, uint16_t op, uint64_t txn, uint32_t phase, struct cui_reply *rep,
                   struct cui_record **recs) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s/cuinterpose-%d.sock", getenv("CUINTERPOSE_CONTROL_DIR"), (int)pid);
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  CHECK(connect(s, (struct sockaddr *)&sa, sizeof sa) == 0, "connect %s: %s", sa.sun_path, strerror(errno));
  struct cui_request q;
  memset(&q, 0, sizeof q);
  q.magic = CUI_PROTO_MAGIC;
  q.version = CUI_PROTO_VERSION;
  q.op = op;
  q.txn_id = txn;
  q.expected_phase = phase;
  q.sender_pid = (uint32_t)getpid();
  memcpy(q.claim, CUI_TEST_CLAIM, sizeof q.claim); /* main() claimed both (carry.h) */
  if (op == CUI_OP_SAVE_ALLOCATIONS || op == CUI_OP_LOAD_ALLOCATIONS) send_carriers(s, &q);
  else CHECK(write(s, &q, sizeof q) == sizeof q, "send");
  size_t got = 0;
  while (got < sizeof *rep) {
    ssize_t k = read(s, (char *)rep + got, sizeof *rep - got);
    CHECK(k > 0, "reply");
    got += (size_t)k;
  }
  size_t n = (size_t)rep->record_count * rep->record_size + rep->message_len;
  if (op == CUI_OP_SAVE_ALLOCATIONS) n += rep->reserved[0]; /* the chunk table */
  char *body = malloc(n + 1);
  got = 0;
  while (got < n) {
    ssize_t k = read(s, body + got, n - got);
    CHECK(k > 0, "body");
    got += (size_t)k;
  }
  body[n] = 0;
  close(s);
  if (rep->status != CUI_OK)
    fprintf(stderr, "op %u pid %d: status %d: %s\n", op, (int)pid, rep->status,
            body + (size_t)rep->record_count * rep->record_size);
  if (recs) *recs = (struct cui_record *)body;
  else free(body);
  return rep->status;
}

int main(void) {
  int c_in[2], c_out[2], i_in[2], i_out[2], sp[2];
  alarm(240);   /* a failure that leaves a peer waiting ends the run (each process sets its own) */
  CHECK(pipe(c_in) == 0 && pipe(c_out) == 0 && pipe(i_in) == 0 && pipe(i_out) == 0, "pipe");
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sp) == 0, "socketpair");
  pid_t cp = fork();
  if (cp == 0) exit((alarm(240), creator(c_in[0], c_out[1], sp[0])));
  pid_t ip = fork();
  if (ip == 0) exit((alarm(240), importer(i_in[0], i_out[1], sp[1])));
  pid_t who[2] = {cp, ip};
  struct cui_reply rep;
  CHECK(cui_test_claim(cp) == 0 && cui_test_claim(ip) == 0, "claim: %s", strerror(errno));
  CHECK(get(c_out[0]) == 'i', "creator not initialised");
  CHECK(request(cp, CUI_OP_INSPECT, 0, CUI_PHASE_ACTIVE, &rep, NULL) == CUI_OK && rep.record_count == 0, "empty");
  put(c_in[1], 'g');
  CHECK(get(c_out[0]) == 'r' && get(i_out[0]) == 'r', "children not ready");

  struct cui_record *before[2], *after[2];
  uint32_t nbefore[2];
  for (int k = 0; k < 2; k++) {
    CHECK(request(who[k], CUI_OP_INSPECT, 0, CUI_PHASE_ACTIVE, &rep, &before[k]) == CUI_OK, "inspect");
    nbefore[k] = rep.record_count;
  }
  CHECK(nbefore[0] == 5 && nbefore[1] == 3, "records %u %u", nbefore[0], nbefore[1]);
  const struct {
    uint16_t op;
    uint32_t from;
  } steps[] = {{CUI_OP_SAVE_ALLOCATIONS, CUI_PHASE_ACTIVE},
               {CUI_OP_PREPARE_UNICAST, CUI_PHASE_SAVED},
               {CUI_OP_LOAD_ALLOCATIONS, CUI_PHASE_PREPARED},
               {CUI_OP_RESTORE_UNICAST, CUI_PHASE_LOADED}};
  for (unsigned s = 0; s < 4; s++)
    for (int k = 0; k < 2; k++) {
      g_carry_recs = before[k], g_carry_n = k == 0 ? nbefore[k] : 0;   /* only the creator carries */
      CHECK(request(who[k], steps[s].op, s + 1, steps[s].from, &rep, NULL) == CUI_OK, "step %u", s);
      if (s == 0 || s == 2) CHECK(rep.bytes == (k == 0 ? SIZE : 0), "bytes %llu", (unsigned long long)rep.bytes);
    }
  CHECK(request(cp, CUI_OP_RESTORE_UNICAST, 4, CUI_PHASE_LOADED, &rep, NULL) == CUI_REFUSED_DUPLICATE, "dup");
  for (int k = 0; k < 2; k++) {
    CHECK(request(who[k], CUI_OP_INSPECT, 0, CUI_PHASE_ACTIVE, &rep, &after[k]) == CUI_OK, "inspect");
    CHECK(rep.record_count == nbefore[k] && memcmp(before[k], after[k], nbefore[k] * sizeof(struct cui_record)) == 0,
          "records changed across the cycle (pid %d)", (int)who[k]);
    free(before[k]);
    free(after[k]);
  }
  put(c_in[1], 'w');
  CHECK(get(c_out[0]) == 'd', "creator verify");
  put(i_in[1], 'c');
  CHECK(get(i_out[0]) == 'd', "importer verify");
  put(c_in[1], 'q');
  put(i_in[1], 'q');
  CHECK(get(c_out[0]) == 'x' && get(i_out[0]) == 'x', "teardown");
  int st1, st2;
  waitpid(cp, &st1, 0);
  waitpid(ip, &st2, 0);
  CHECK(WIFEXITED(st1) && WEXITSTATUS(st1) == 0 && WIFEXITED(st2) && WEXITSTATUS(st2) == 0, "child status");
  printf("cycle ok\n");
  return 0;
}
