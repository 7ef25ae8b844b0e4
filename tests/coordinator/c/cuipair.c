/*
 * A creator/importer pair of CUDA VMM processes for the coordinator integration test and
 * bench/phases.py. Linked against libcuda.so.1 (fakecuda or a real driver); under the shim
 * via LD_PRELOAD. Usage: cuipair <socket-fd>  (one end of a socketpair shared with the peer)
 *
 * One command per line on stdin, one answer line on stdout: "ok [values]" or "err <text>".
 *   create <k> <size>   cuMemCreate k POSIX-exportable allocations of size bytes, reserve one
 *                       range of k*size, map allocation i at base + i*size, set RW access,
 *                       fill i with pattern(seed 1, i)                       -> ok <base>
 *   send                export every allocation and send the k FDs to the peer (SCM_RIGHTS)
 *   recv <k> <size>     receive k FDs, import each, reserve, map at base + i*size, set access
 *                       (FDs closed after import)                            -> ok <base>
 *   fill <seed>         write pattern(seed, i) into every allocation (cuMemcpyHtoD)
 *   sum                 cuMemcpyDtoH every allocation, FNV-1a over all bytes -> ok <hex>
 *   quit
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int sock = -1;
static size_t k_allocs, alloc_size;
static CUmemGenericAllocationHandle *handles;
static CUdeviceptr base;
static CUdevice dev;

static const char *errname(CUresult r) {
  const char *s = NULL;
  if (cuGetErrorName(r, &s) != CUDA_SUCCESS || !s) return "CUDA_ERROR_UNKNOWN";
  return s;
}

#define CK(call)                                 \
  do {                                           \
    CUresult r_ = (call);                        \
    if (r_ != CUDA_SUCCESS) {                    \
      printf("err %s %s\n", #call, errname(r_)); \
      return -1;                                 \
    }                                            \
  } while (0)

static CUmemAllocationProp prop(void) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = (int)dev;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

static int map_all(void) {
  CK(cuMemAddressReserve(&base, k_allocs * alloc_size, 0, 0, 0));
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = (int)dev;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (size_t i = 0; i < k_allocs; i++) {
    CK(cuMemMap(base + i * alloc_size, alloc_size, 0, handles[i], 0));
    CK(cuMemSetAccess(base + i * alloc_size, alloc_size, &d, 1));
  }
  return 0;
}

static void pattern(unsigned char *p, size_t n, unsigned seed, size_t idx) {
  uint32_t x = seed * 2654435761u + (uint32_t)idx * 40503u + 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (unsigned char)(x >> 16);
  }
}

static int fill(unsigned seed) {
  unsigned char *buf = malloc(alloc_size);
  for (size_t i = 0; i < k_allocs; i++) {
    pattern(buf, alloc_size, seed, i);
    CUresult r = cuMemcpyHtoD(base + i * alloc_size, buf, alloc_size);
    if (r != CUDA_SUCCESS) {
      free(buf);
      printf("err cuMemcpyHtoD %s\n", errname(r));
      return -1;
    }
  }
  free(buf);
  return 0;
}

static int create(size_t k, size_t size) {
  k_allocs = k, alloc_size = size;
  handles = calloc(k, sizeof *handles);
  CUmemAllocationProp p = prop();
  for (size_t i = 0; i < k; i++) CK(cuMemCreate(&handles[i], size, &p, 0));
  if (map_all() || fill(1)) return -1;
  printf("ok 0x%llx\n", (unsigned long long)base);
  return 0;
}

static int send_fds(void) {
  for (size_t i = 0; i < k_allocs; i++) {
    int fd = -1;
    CK(cuMemExportToShareableHandle(&fd, handles[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    char byte = 'f', cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&byte, 1};
    struct msghdr m;
    memset(&m, 0, sizeof m);
    memset(cbuf, 0, sizeof cbuf);
    m.msg_iov = &iov, m.msg_iovlen = 1, m.msg_control = cbuf, m.msg_controllen = sizeof cbuf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_RIGHTS, c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    if (sendmsg(sock, &m, 0) != 1) {
      printf("err sendmsg\n");
      return -1;
    }
    close(fd);
  }
  printf("ok\n");
  return 0;
}

static int recv_fds(size_t k, size_t size) {
  k_allocs = k, alloc_size = size;
  handles = calloc(k, sizeof *handles);
  for (size_t i = 0; i < k; i++) {
    char byte, cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&byte, 1};
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = &iov, m.msg_iovlen = 1, m.msg_control = cbuf, m.msg_controllen = sizeof cbuf;
    if (recvmsg(sock, &m, MSG_CMSG_CLOEXEC) != 1 || !CMSG_FIRSTHDR(&m)) {
      printf("err recvmsg\n");
      return -1;
    }
    int fd;
    memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&m)), sizeof fd);
    CUresult r = cuMemImportFromShareableHandle(&handles[i], (void *)(uintptr_t)fd,
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    if (r != CUDA_SUCCESS) {
      printf("err cuMemImportFromShareableHandle %s\n", errname(r));
      return -1;
    }
  }
  if (map_all()) return -1;
  printf("ok 0x%llx\n", (unsigned long long)base);
  return 0;
}

static int sum(void) {
  unsigned char *buf = malloc(alloc_size);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < k_allocs; i++) {
    CUresult r = cuMemcpyDtoH(buf, base + i * alloc_size, alloc_size);
    if (r != CUDA_SUCCESS) {
      free(buf);
      printf("err cuMemcpyDtoH %s\n", errname(r));
      return -1;
    }
    for (size_t j = 0; j < alloc_size; j++) h = (h ^ buf[j]) * 0x100000001b3ull;
  }
  free(buf);
  printf("ok %016llx\n", (unsigned long long)h);
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc > 1) sock = atoi(argv[1]);
  CUcontext ctx;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  printf("ok %d\n", (int)getpid());
  char line[256];
  while (fgets(line, sizeof line, stdin)) {
    char cmd[32] = "";
    unsigned long long a = 0, b = 0;
    int n = sscanf(line, "%31s %lli %lli", cmd, &a, &b);
    if (n < 1) continue;
    if (!strcmp(cmd, "create") && n == 3) create(a, b);
    else if (!strcmp(cmd, "send")) send_fds();
    else if (!strcmp(cmd, "recv") && n == 3) recv_fds(a, b);
    else if (!strcmp(cmd, "fill") && n == 2) {
      if (fill((unsigned)a) == 0) printf("ok\n");
    } else if (!strcmp(cmd, "sum")) sum();
    else if (!strcmp(cmd, "quit")) {
      printf("ok\n");
      return 0;
    } else printf("err unknown command\n");
  }
  return 0;
}
