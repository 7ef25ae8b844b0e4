/*
 * A scripted sharing application for the host-memory, pidfd and creator-release tests
 * (tests/shim/test_host_mem.py, test_pidfd.py, test_creator_release.py), linked against
 * libcuda.so.1 (fakecuda) like vmm_app.c. One command per line on stdin, one line on stdout:
 * "ok [values...]" or "err <CUresult> <name>" ("err -1 <what>" for a libc failure).
 * Numbers in decimal or 0x-hex; handles, VAs and sizes are printed as 0x-hex.
 *
 *   init [dev]                          cuInit(0), primary context of dev current
 *   create <size> <htypes> [<loctype> <locid>]   cuMemCreate PINNED at that location
 *                                       (CUmemLocationType: DEVICE 1, HOST 2, HOST_NUMA 3,
 *                                       HOST_NUMA_CURRENT 4; default DEVICE 0) -> ok <handle>
 *   release <h> | reserve <size> | map <va> <size> <off> <h> | unmap <va> <size>
 *   access <va> <size> <loctype> <locid> <flags> [<loctype> <locid> <flags>...]  one cuMemSetAccess
 *   props <h>                           -> ok <type> <handle_types> <loc_type> <loc_id>
 *   export <h>                          POSIX fd (a ticket under the shim)  -> ok <fd>
 *   close <fd>                          close(2) of the app's copy
 *   seek <fd> <off> / offset <fd>       lseek SEEK_SET / SEEK_CUR           -> ok <offset>
 *   ptracer                             prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY); "ok -1"
 *                                       without Yama (EINVAL: nothing to allow)
 *   getfd <pid> <fd>                    pidfd_getfd(pidfd_open(pid), fd) (PyTorch expandable
 *                                       segments' way to take an exporter's FD) -> ok <newfd>
 *   import_fd <fd>                      cuMemImportFromShareableHandle(fd); fd stays open
 *   fill|check <va> <n> <seed>          cuMemcpyHtoD / cuMemcpyDtoH of pattern(seed)
 *   cpu_fill|cpu_check <va> <n> <seed>  the same through the CPU (host-location mappings)
 *   mc_create <ndev> <size> <htypes> | mc_add <mc> <dev> | mc_bindmem <mc> <mcoff> <mem> <memoff> <size>
 *   memset32 <va> <value> <count> | read32 <va>    -> ok <value>
 *   pid | quit
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

static unsigned long long num(const char *s) { return strtoull(s, NULL, 0); }

static void pattern(unsigned char *p, size_t n, unsigned seed) {
  unsigned x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (unsigned char)(x >> 16);
  }
}

static int report(CUresult r) {
  if (r == CUDA_SUCCESS) return 0;
  const char *name = "?";
  cuGetErrorName(r, &name);
  printf("err %d %s\n", (int)r, name ? name : "?");
  return 1;
}

static void ok_or_errno(int rc, const char *what) {
  if (rc == -2) printf("ok -1\n");
  else if (rc < 0) printf("err -1 %s\n", what);
  else printf("ok %d\n", rc);
}

static void fill_check(const char *c, char **argv) {
  CUdeviceptr va = num(argv[1]);
  size_t n = num(argv[2]);
  unsigned char *want = malloc(n), *got = malloc(n);
  pattern(want, n, (unsigned)num(argv[3]));
  int cpu = !strncmp(c, "cpu_", 4), fill = strstr(c, "fill") != NULL;
  CUresult r = CUDA_SUCCESS;
  if (fill) {
    if (cpu) memcpy((void *)(uintptr_t)va, want, n);
    else r = cuMemcpyHtoD(va, want, n);
    if (!report(r)) printf("ok\n");
  } else {
    if (cpu) memcpy(got, (void *)(uintptr_t)va, n);
    else r = cuMemcpyDtoH(got, va, n);
    if (!report(r)) {
      size_t i = 0;
      while (i < n && got[i] == want[i]) i++;
      if (i == n) printf("ok\n");
      else printf("err -1 mismatch@%zu\n", i);
    }
  }
  free(want);
  free(got);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  char line[4096];
  while (fgets(line, sizeof line, stdin)) {
    char *argv[128];
    int argc = 0;
    for (char *t = strtok(line, " \t\r\n"); t && argc < 128; t = strtok(NULL, " \t\r\n")) argv[argc++] = t;
    if (argc == 0) continue;
    const char *c = argv[0];
    CUmemGenericAllocationHandle h = 0;
    if (!strcmp(c, "quit")) {
      printf("ok\n");
      return 0;
    } else if (!strcmp(c, "pid")) {
      printf("ok %d\n", (int)getpid());
    } else if (!strcmp(c, "init")) {
      CUdevice d;
      CUcontext ctx;
      if (report(cuInit(0)) || report(cuDeviceGet(&d, argc > 1 ? (int)num(argv[1]) : 0)) ||
          report(cuDevicePrimaryCtxRetain(&ctx, d)) || report(cuCtxSetCurrent(ctx)))
        continue;
      printf("ok\n");
    } else if (!strcmp(c, "create")) {
      CUmemAllocationProp p;
      memset(&p, 0, sizeof p);
      p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      p.requestedHandleTypes = (CUmemAllocationHandleType)num(argv[2]);
      p.location.type = argc > 3 ? (CUmemLocationType)num(argv[3]) : CU_MEM_LOCATION_TYPE_DEVICE;
      p.location.id = argc > 4 ? (int)num(argv[4]) : 0;
      if (!report(cuMemCreate(&h, num(argv[1]), &p, 0))) printf("ok 0x%llx\n", (unsigned long long)h);
    } else if (!strcmp(c, "release")) {
      if (!report(cuMemRelease(num(argv[1])))) printf("ok\n");
    } else if (!strcmp(c, "reserve")) {
      CUdeviceptr va = 0;
      if (!report(cuMemAddressReserve(&va, num(argv[1]), 0, 0, 0))) printf("ok 0x%llx\n", (unsigned long long)va);
    } else if (!strcmp(c, "map")) {
      if (!report(cuMemMap(num(argv[1]), num(argv[2]), num(argv[3]), num(argv[4]), 0))) printf("ok\n");
    } else if (!strcmp(c, "unmap")) {
      if (!report(cuMemUnmap(num(argv[1]), num(argv[2])))) printf("ok\n");
    } else if (!strcmp(c, "access")) {
      CUmemAccessDesc d[40];
      size_t n = 0;
      for (int i = 3; i + 2 < argc && n < 40; i += 3, n++) {
        memset(&d[n], 0, sizeof d[n]);
        d[n].location.type = (CUmemLocationType)num(argv[i]);
        d[n].location.id = (int)num(argv[i + 1]);
        d[n].flags = (CUmemAccess_flags)num(argv[i + 2]);
      }
      if (!report(cuMemSetAccess(num(argv[1]), num(argv[2]), d, n))) printf("ok\n");
    } else if (!strcmp(c, "props")) {
      CUmemAllocationProp p;
      memset(&p, 0, sizeof p);
      if (report(cuMemGetAllocationPropertiesFromHandle(&p, num(argv[1])))) continue;
      printf("ok %d %d %d %d\n", (int)p.type, (int)p.requestedHandleTypes, (int)p.location.type, p.location.id);
    } else if (!strcmp(c, "export")) {
      int fd = -1;
      if (!report(cuMemExportToShareableHandle(&fd, num(argv[1]), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
        printf("ok %d\n", fd);
    } else if (!strcmp(c, "close")) {
      ok_or_errno(close((int)num(argv[1])), "close");
    } else if (!strcmp(c, "seek") || !strcmp(c, "offset")) {
      int seek = !strcmp(c, "seek");
      off_t o = lseek((int)num(argv[1]), seek ? (off_t)num(argv[2]) : 0, seek ? SEEK_SET : SEEK_CUR);
      ok_or_errno((int)o, "lseek");
    } else if (!strcmp(c, "ptracer")) {
      /* EINVAL: no Yama LSM, so same-uid ptrace needs nothing more ("ok -1") */
      int rc = prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
      ok_or_errno(rc < 0 && errno == EINVAL ? -2 : rc, "prctl");
    } else if (!strcmp(c, "getfd")) {
      int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)num(argv[1]), 0);
      int fd = pidfd < 0 ? -1 : (int)syscall(SYS_pidfd_getfd, pidfd, (int)num(argv[2]), 0);
      if (pidfd >= 0) close(pidfd);
      ok_or_errno(fd, pidfd < 0 ? "pidfd_open" : "pidfd_getfd");
    } else if (!strcmp(c, "import_fd")) {
      int fd = (int)num(argv[1]);
      if (!report(cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)))
        printf("ok 0x%llx\n", (unsigned long long)h);
    } else if (!strcmp(c, "fill") || !strcmp(c, "check") || !strcmp(c, "cpu_fill") || !strcmp(c, "cpu_check")) {
      fill_check(c, argv);
    } else if (!strcmp(c, "mc_create")) {
      CUmulticastObjectProp p;
      memset(&p, 0, sizeof p);
      p.numDevices = (unsigned)num(argv[1]);
      p.size = num(argv[2]);
      p.handleTypes = num(argv[3]);
      if (!report(cuMulticastCreate(&h, &p))) printf("ok 0x%llx\n", (unsigned long long)h);
    } else if (!strcmp(c, "mc_add")) {
      if (!report(cuMulticastAddDevice(num(argv[1]), (CUdevice)num(argv[2])))) printf("ok\n");
    } else if (!strcmp(c, "mc_bindmem")) {
      if (!report(cuMulticastBindMem(num(argv[1]), num(argv[2]), num(argv[3]), num(argv[4]), num(argv[5]), 0)))
        printf("ok\n");
    } else if (!strcmp(c, "memset32")) {
      if (!report(cuMemsetD32(num(argv[1]), (unsigned)num(argv[2]), num(argv[3])))) printf("ok\n");
    } else if (!strcmp(c, "read32")) {
      unsigned v = 0;
      if (!report(cuMemcpyDtoH(&v, num(argv[1]), 4))) printf("ok 0x%x\n", v);
    } else {
      printf("err -1 unknown-command\n");
    }
  }
  return 0;
}
