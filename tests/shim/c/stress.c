/*
 * Concurrency: application threads create, map, set access, fill, export and tear down while the
 * shim serves FETCH_FD and INSPECT for another process. No exec, no shell (it also runs under
 * ASan/UBSan, test_sanitize.py).
 *
 * The parent forks a creator before any CUDA call, then is the importer:
 *   creator   THREADS threads x ROUNDS rounds: create a POSIX allocation, map, grant access,
 *             fill with a pattern of (thread, round), export, send the ticket (SOCK_SEQPACKET,
 *             SCM_RIGHTS) with its seed; meanwhile churn a private allocation (create, map,
 *             access, unmap, release). Shared allocations stay alive until the importer is done.
 *   importer  2 threads receive tickets and import each (the creator's accept thread answers
 *             FETCH_FD while the creator's threads hold the state lock), map, check the pattern,
 *             unmap, release; a third thread sends INSPECT to the creator in a loop.
 * Prints "stress ok <imports>" and exits 0 on success.
 */
#define _GNU_SOURCE
#include <cuda.h>
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

#define THREADS 4
#define ROUNDS  12
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

static size_t g_gran;
static CUcontext g_ctx;
static int g_sock;   /* SOCK_SEQPACKET to the peer */

static void pattern(unsigned char *p, size_t n, unsigned seed) {
  unsigned x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (unsigned char)(x >> 16);
  }
}

static void init_ctx(void) {
  CUdevice d;
  CU(cuInit(0));
  CU(cuDeviceGet(&d, 0));
  CU(cuDevicePrimaryCtxRetain(&g_ctx, d));
  CU(cuCtxSetCurrent(g_ctx));
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CU(cuMemGetAllocationGranularity(&g_gran, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
}

static CUmemGenericAllocationHandle create(int posix) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requestedHandleTypes = posix ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemGenericAllocationHandle h;
  CU(cuMemCreate(&h, g_gran, &p, 0));
  return h;
}

static CUdeviceptr map_rw(CUmemGenericAllocationHandle h) {
  CUdeviceptr va;
  CU(cuMemAddressReserve(&va, g_gran, 0, 0, 0));
  CU(cuMemMap(va, g_gran, 0, h, 0));
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU(cuMemSetAccess(va, g_gran, &d, 1));
  return va;
}

static void unmap_free(CUdeviceptr va) {
  CU(cuMemUnmap(va, g_gran));
  CU(cuMemAddressFree(va, g_gran));
}

struct shared {
  CUmemGenericAllocationHandle h;
  CUdeviceptr va;
};
static struct shared g_shared[THREADS][ROUNDS];

static void *creator_thread(void *arg) {
  int t = (int)(intptr_t)arg;
  CU(cuCtxSetCurrent(g_ctx));
  unsigned char *buf = malloc(g_gran);
  for (int r = 0; r < ROUNDS; r++) {
    unsigned seed = (unsigned)(t * 1000 + r);
    CUmemGenericAllocationHandle h = create(1);
    CUdeviceptr va = map_rw(h);
    pattern(buf, g_gran, seed);
    CU(cuMemcpyHtoD(va, buf, g_gran));
    int fd = -1;
    CU(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    g_shared[t][r] = (struct shared){h, va};
    struct iovec iov = {&seed, sizeof seed};
    union {
      char b[CMSG_SPACE(sizeof(int))];
      struct cmsghdr a;
    } cm;
    memset(&cm, 0, sizeof cm);
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.b, .msg_controllen = sizeof cm.b};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    CHECK(sendmsg(g_sock, &mh, 0) == (ssize_t)sizeof seed, "sendmsg: %s", strerror(errno));
    close(fd);
    /* private churn: records come and go while the importer fetches */
    CUmemGenericAllocationHandle hp = create(0);
    CUdeviceptr vp = map_rw(hp);
    CUmemGenericAllocationHandle again;
    CU(cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)(vp + g_gran / 2)));
    CHECK(again == hp, "retain alias");
    CU(cuMemRelease(again));
    CU(cuMemRelease(hp));   /* released while mapped: the mapping keeps it */
    unmap_free(vp);
  }
  free(buf);
  return NULL;
}

static int creator(void) {
  init_ctx();
  pthread_t th[THREADS];
  for (int t = 0; t < THREADS; t++) pthread_create(&th[t], NULL, creator_thread, (void *)(intptr_t)t);
  for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
  char c;
  CHECK(read(g_sock, &c, 1) == 1 && c == 'd', "importer done");
  for (int t = 0; t < THREADS; t++)
    for (int r = 0; r < ROUNDS; r++) {
      unmap_free(g_shared[t][r].va);
      CU(cuMemRelease(g_shared[t][r].h));
    }
  return 0;
}

static pid_t g_creator;
static int g_imports;
static pthread_mutex_t g_count_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_stop;   /* atomic */

static void *importer_thread(void *arg) {
  CU(cuCtxSetCurrent(g_ctx));
  unsigned char *want = malloc(g_gran), *got = malloc(g_gran);
  for (;;) {
    pthread_mutex_lock(&g_count_lock);
    int mine = g_imports < THREADS * ROUNDS ? ++g_imports : 0;
    pthread_mutex_unlock(&g_count_lock);
    if (!mine) break;
    unsigned seed;
    struct iovec iov = {&seed, sizeof seed};
    union {
      char b[CMSG_SPACE(sizeof(int))];
      struct cmsghdr a;
    } cm;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.b, .msg_controllen = sizeof cm.b};
    CHECK(recvmsg(g_sock, &mh, MSG_CMSG_CLOEXEC) == (ssize_t)sizeof seed, "recvmsg");
    int fd = -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    CHECK(c && c->cmsg_type == SCM_RIGHTS, "no fd");
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    CUmemGenericAllocationHandle h;
    CU(cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    CUdeviceptr va = map_rw(h);
    pattern(want, g_gran, seed);
    CU(cuMemcpyDtoH(got, va, g_gran));
    CHECK(memcmp(want, got, g_gran) == 0, "bytes of seed %u", seed);
    unmap_free(va);
    CU(cuMemRelease(h));
  }
  free(want);
  free(got);
  return NULL;
}

static void *inspect_thread(void *arg) {
  int n = 0;
  while (!__atomic_load_n(&g_stop, __ATOMIC_ACQUIRE)) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s/cuinterpose-%d.sock", getenv("CUINTERPOSE_CONTROL_DIR"),
             (int)g_creator);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) {   /* not up yet */
      close(s);
      usleep(1000);
      continue;
    }
    struct cui_request q;
    memset(&q, 0, sizeof q);
    q.magic = CUI_PROTO_MAGIC;
    q.version = CUI_PROTO_VERSION;
    q.op = CUI_OP_INSPECT;
    q.expected_phase = CUI_PHASE_ACTIVE;
    q.sender_pid = (uint32_t)getpid();
    CHECK(write(s, &q, sizeof q) == sizeof q, "send");
    struct cui_reply rep;
    size_t got = 0;
    while (got < sizeof rep) {
      ssize_t k = read(s, (char *)&rep + got, sizeof rep - got);
      CHECK(k > 0, "reply");
      got += (size_t)k;
    }
    CHECK(rep.status == CUI_OK || rep.status == CUI_BAD_REQUEST, "INSPECT status %d", rep.status);   /* or busy */
    char buf[4096];
    while (read(s, buf, sizeof buf) > 0) {}
    close(s);
    n++;
  }
  return NULL;
}

int main(void) {
  int sp[2];
  alarm(240);   /* a failure that leaves a peer waiting ends the run (each process sets its own) */
  CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) == 0, "socketpair");
  g_creator = fork();
  if (g_creator == 0) {
    alarm(240);
    g_sock = sp[0];
    exit(creator());
  }
  g_sock = sp[1];
  init_ctx();
  pthread_t imp[2], ins;
  pthread_create(&ins, NULL, inspect_thread, NULL);
  for (int i = 0; i < 2; i++) pthread_create(&imp[i], NULL, importer_thread, NULL);
  for (int i = 0; i < 2; i++) pthread_join(imp[i], NULL);
  __atomic_store_n(&g_stop, 1, __ATOMIC_RELEASE);
  pthread_join(ins, NULL);
  CHECK(write(g_sock, "d", 1) == 1, "done");
  int st;
  waitpid(g_creator, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "creator status %d", st);
  printf("stress ok %d\n", g_imports);
  return 0;
}
