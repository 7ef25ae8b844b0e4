/*
 * A scripted VMM application for the shim tests, linked against libcuda.so.1 (fakecuda) so
 * its calls bind by ELF name (and reach the shim when LD_PRELOADed). Reads one command per
 * line on stdin and answers one line on stdout:
 *   "ok [values...]"  or  "err <CUresult> <name>".
 * Numbers may be given in decimal or 0x-hex; handles, VAs and sizes are printed as 0x-hex.
 *
 *   init [dev]                     cuInit(0); primary context of dev (default 0) current
 *   cuinit                         cuInit(0) only: no context is made current
 *   init_threads <n>               n threads call cuInit(0) at once, then this thread again
 *   create <size> <htypes> [dev]   cuMemCreate PINNED on device dev  -> ok <handle>
 *   create_sentinel <size> <htypes>  same, handle pre-set to 0x99   -> ok|err <handle-after>
 *   release <h>
 *   churn <n> <size>               n x (cuMemCreate, cuMemRelease)   -> ok <last handle>
 *   rss                            -> ok <VmRSS in kB>
 *   retain <va>                    cuMemRetainAllocationHandle       -> ok <handle>
 *   reserve <size> [addr]          cuMemAddressReserve               -> ok <va>
 *   free <va> <size>               cuMemAddressFree
 *   map <va> <size> <off> <h>
 *   unmap <va> <size>
 *   access <va> <size> <dev> <flags>[,<dev> <flags>...]   one cuMemSetAccess call (DEVICE locations)
 *   export <h>                     POSIX fd                          -> ok <fd>
 *   import <path>                  open(path), import, close         -> ok <handle>
 *   import_sentinel <path>         same, handle pre-set to 0x99     -> ok|err <code> <handle-after>
 *   props <h>                      -> ok <type> <handle_types> <loc_type> <loc_id>
 *   fill <va> <n> <seed>           cuMemcpyHtoD of pattern(seed)
 *   check <va> <n> <seed>          cuMemcpyDtoH and compare          -> ok | err -1 mismatch@<i>
 *   ticket <fd>                    -> ok <seals> <hex of the first 64 bytes>
 *   pid                            -> ok <pid>
 *   fork                           fork(): the child answers "ok <child pid>" and reads the
 *                                  next commands; when it quits, the parent answers
 *                                  "ok <exit status>" and reads on (case 003)
 * Multicast (docs/shim.md "Multicast"):
 *   mc_create <ndev> <size> <htypes>            cuMulticastCreate        -> ok <handle>
 *   mc_add <mc> <dev>                           cuMulticastAddDevice
 *   mc_bindmem <mc> <mcoff> <mem> <memoff> <size>          v1 ABI (current context's device)
 *   mc_bindmem2 <mc> <dev> <mcoff> <mem> <memoff> <size>   13.1 device-explicit ABI
 *   mc_bindaddr <mc> <mcoff> <ptr> <size>
 *   mc_bindaddr2 <mc> <dev> <mcoff> <ptr> <size>
 *   mc_bindmem2_gpa <mc> <dev> <mcoff> <mem> <memoff> <size>  the _v2 function obtained from
 *                                               cuGetProcAddress("cuMulticastBindMem_v2", 13010)
 *   mc_unbind <mc> <dev> <mcoff> <size>
 *   memset32 <va> <value> <count>               cuMemsetD32 (through a multicast VA: broadcast)
 *   read32 <va>                                 cuMemcpyDtoH of 4 bytes  -> ok <value>
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static unsigned long long num(const char *s) { return strtoull(s, NULL, 0); }

static void pattern(unsigned char *p, size_t n, unsigned seed) {
  unsigned x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (unsigned char)(x >> 16);
  }
}

static void *init_thread(void *arg) {
  *(CUresult *)arg = cuInit(0);
  return NULL;
}

static int report(CUresult r) {
  if (r == CUDA_SUCCESS) return 0;
  const char *name = "?";
  cuGetErrorName(r, &name);
  printf("err %d %s\n", (int)r, name ? name : "?");
  return 1;
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
    CUresult r;
    if (!strcmp(c, "quit")) {
      printf("ok\n");
      return 0;
    } else if (!strcmp(c, "fork")) {
      pid_t ch = fork();
      if (ch == 0) {
        printf("ok %d\n", (int)getpid());
        continue;
      }
      int st = 0;
      if (ch < 0 || waitpid(ch, &st, 0) != ch) {
        printf("err -1 fork\n");
        continue;
      }
      printf("ok %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    } else if (!strcmp(c, "pid")) {
      printf("ok %d\n", (int)getpid());
    } else if (!strcmp(c, "init")) {
      int dev = argc > 1 ? (int)num(argv[1]) : 0;
      CUdevice d;
      CUcontext ctx;
      if (report(cuInit(0)) || report(cuDeviceGet(&d, dev)) || report(cuDevicePrimaryCtxRetain(&ctx, d)) ||
          report(cuCtxSetCurrent(ctx)))
        continue;
      printf("ok\n");
    } else if (!strcmp(c, "cuinit")) {
      if (!report(cuInit(0))) printf("ok\n");
    } else if (!strcmp(c, "init_threads")) {
      int n = (int)num(argv[1]);
      pthread_t t[64];
      CUresult res[64];
      for (int i = 0; i < n && i < 64; i++) pthread_create(&t[i], NULL, init_thread, &res[i]);
      r = CUDA_SUCCESS;
      for (int i = 0; i < n && i < 64; i++) {
        pthread_join(t[i], NULL);
        if (res[i] != CUDA_SUCCESS) r = res[i];
      }
      if (r == CUDA_SUCCESS) r = cuInit(0);
      if (!report(r)) printf("ok\n");
    } else if (!strcmp(c, "create") || !strcmp(c, "create_sentinel")) {
      CUmemAllocationProp p;
      memset(&p, 0, sizeof p);
      p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      p.requestedHandleTypes = (CUmemAllocationHandleType)num(argv[2]);
      p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      p.location.id = argc > 3 ? (int)num(argv[3]) : 0;
      CUmemGenericAllocationHandle h = 0x99;
      r = cuMemCreate(&h, num(argv[1]), &p, 0);
      if (!strcmp(c, "create_sentinel")) {
        printf("%s %d 0x%llx\n", r ? "err" : "ok", (int)r, (unsigned long long)h);
        continue;
      }
      if (report(r)) continue;
      printf("ok 0x%llx\n", (unsigned long long)h);
    } else if (!strcmp(c, "churn")) {
      CUmemAllocationProp p;
      memset(&p, 0, sizeof p);
      p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      CUmemGenericAllocationHandle h = 0;
      r = CUDA_SUCCESS;
      for (unsigned long long i = 0, n = num(argv[1]); i < n && r == CUDA_SUCCESS; i++) {
        r = cuMemCreate(&h, num(argv[2]), &p, 0);
        if (r == CUDA_SUCCESS) r = cuMemRelease(h);
      }
      if (!report(r)) printf("ok 0x%llx\n", (unsigned long long)h);
    } else if (!strcmp(c, "rss")) {
      FILE *f = fopen("/proc/self/status", "r");
      char ln[256];
      long kb = -1;
      while (f && fgets(ln, sizeof ln, f))
        if (!strncmp(ln, "VmRSS:", 6)) kb = strtol(ln + 6, NULL, 10);
      if (f) fclose(f);
      printf("ok %ld\n", kb);
    } else if (!strcmp(c, "release")) {
      if (report(cuMemRelease(num(argv[1])))) continue;
      printf("ok\n");
    } else if (!strcmp(c, "retain")) {
      CUmemGenericAllocationHandle h;
      if (report(cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)num(argv[1])))) continue;
      printf("ok 0x%llx\n", (unsigned long long)h);
    } else if (!strcmp(c, "reserve")) {
      CUdeviceptr va = 0;
      if (report(cuMemAddressReserve(&va, num(argv[1]), 0, argc > 2 ? num(argv[2]) : 0, 0))) continue;
      printf("ok 0x%llx\n", (unsigned long long)va);
    } else if (!strcmp(c, "free")) {
      if (report(cuMemAddressFree(num(argv[1]), num(argv[2])))) continue;
      printf("ok\n");
    } else if (!strcmp(c, "map")) {
      if (report(cuMemMap(num(argv[1]), num(argv[2]), num(argv[3]), num(argv[4]), 0))) continue;
      printf("ok\n");
    } else if (!strcmp(c, "unmap")) {
      if (report(cuMemUnmap(num(argv[1]), num(argv[2])))) continue;
      printf("ok\n");
    } else if (!strcmp(c, "access")) {
      CUmemAccessDesc d[40];
      size_t n = 0;
      for (int i = 3; i + 1 < argc && n < 40; i += 2, n++) {
        memset(&d[n], 0, sizeof d[n]);
        d[n].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        d[n].location.id = (int)num(argv[i]);
        d[n].flags = (CUmemAccess_flags)num(argv[i + 1]);
      }
      if (report(cuMemSetAccess(num(argv[1]), num(argv[2]), d, n))) continue;
      printf("ok\n");
    } else if (!strcmp(c, "export")) {
      int fd = -1;
      if (report(cuMemExportToShareableHandle(&fd, num(argv[1]), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
        continue;
      printf("ok %d\n", fd);
    } else if (!strcmp(c, "import") || !strcmp(c, "import_sentinel")) {
      int fd = open(argv[1], O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        printf("err -1 open\n");
        continue;
      }
      CUmemGenericAllocationHandle h = 0x99;
      r = cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      close(fd);
      if (!strcmp(c, "import_sentinel")) {
        printf("%s %d 0x%llx\n", r ? "err" : "ok", (int)r, (unsigned long long)h);
        continue;
      }
      if (report(r)) continue;
      printf("ok 0x%llx\n", (unsigned long long)h);
    } else if (!strcmp(c, "props")) {
      CUmemAllocationProp p;
      memset(&p, 0, sizeof p);
      if (report(cuMemGetAllocationPropertiesFromHandle(&p, num(argv[1])))) continue;
      printf("ok %d %d %d %d\n", (int)p.type, (int)p.requestedHandleTypes, (int)p.location.type, p.location.id);
    } else if (!strcmp(c, "fill") || !strcmp(c, "check")) {
      size_t n = num(argv[2]);
      unsigned char *want = malloc(n), *got = malloc(n);
      pattern(want, n, (unsigned)num(argv[3]));
      if (!strcmp(c, "fill")) {
        r = cuMemcpyHtoD(num(argv[1]), want, n);
        if (!report(r)) printf("ok\n");
      } else {
        r = cuMemcpyDtoH(got, num(argv[1]), n);
        if (!report(r)) {
          size_t i = 0;
          while (i < n && got[i] == want[i]) i++;
          if (i == n) printf("ok\n");
          else printf("err -1 mismatch@%zu\n", i);
        }
      }
      free(want);
      free(got);
    } else if (!strcmp(c, "mc_create")) {
      CUmulticastObjectProp p;
      memset(&p, 0, sizeof p);
      p.numDevices = (unsigned)num(argv[1]);
      p.size = num(argv[2]);
      p.handleTypes = num(argv[3]);
      CUmemGenericAllocationHandle h = 0x99;
      if (report(cuMulticastCreate(&h, &p))) continue;
      printf("ok 0x%llx\n", (unsigned long long)h);
    } else if (!strcmp(c, "mc_add")) {
      if (report(cuMulticastAddDevice(num(argv[1]), (CUdevice)num(argv[2])))) continue;
      printf("ok\n");
    } else if (!strcmp(c, "mc_bindmem")) {
      if (report(cuMulticastBindMem(num(argv[1]), num(argv[2]), num(argv[3]), num(argv[4]), num(argv[5]), 0))) continue;
      printf("ok\n");
    } else if (!strcmp(c, "mc_bindmem2")) {
      if (report(cuMulticastBindMem_v2(num(argv[1]), (CUdevice)num(argv[2]), num(argv[3]), num(argv[4]), num(argv[5]),
                                       num(argv[6]), 0)))
        continue;
      printf("ok\n");
    } else if (!strcmp(c, "mc_bindmem2_gpa")) {
      void *fn = NULL;
      CUdriverProcAddressQueryResult st;
      if (report(cuGetProcAddress("cuMulticastBindMem_v2", &fn, 13010, 0, &st))) continue;
      typedef CUresult (*bind2_t)(CUmemGenericAllocationHandle, CUdevice, size_t, CUmemGenericAllocationHandle, size_t,
                                  size_t, unsigned long long);
      if (report(((bind2_t)fn)(num(argv[1]), (CUdevice)num(argv[2]), num(argv[3]), num(argv[4]), num(argv[5]),
                               num(argv[6]), 0)))
        continue;
      printf("ok\n");
    } else if (!strcmp(c, "mc_bindaddr")) {
      if (report(cuMulticastBindAddr(num(argv[1]), num(argv[2]), num(argv[3]), num(argv[4]), 0))) continue;
      printf("ok\n");
    } else if (!strcmp(c, "mc_bindaddr2")) {
      if (report(cuMulticastBindAddr_v2(num(argv[1]), (CUdevice)num(argv[2]), num(argv[3]), num(argv[4]), num(argv[5]),
                                        0)))
        continue;
      printf("ok\n");
    } else if (!strcmp(c, "mc_unbind")) {
      if (report(cuMulticastUnbind(num(argv[1]), (CUdevice)num(argv[2]), num(argv[3]), num(argv[4])))) continue;
      printf("ok\n");
    } else if (!strcmp(c, "memset32")) {
      if (report(cuMemsetD32(num(argv[1]), (unsigned)num(argv[2]), num(argv[3])))) continue;
      printf("ok\n");
    } else if (!strcmp(c, "read32")) {
      unsigned v = 0;
      if (report(cuMemcpyDtoH(&v, num(argv[1]), 4))) continue;
      printf("ok 0x%x\n", v);
    } else if (!strcmp(c, "ticket")) {
      int fd = (int)num(argv[1]);
      unsigned char b[64];
      int seals = fcntl(fd, F_GET_SEALS);
      ssize_t k = pread(fd, b, sizeof b, 0);
      off_t end = lseek(fd, 0, SEEK_END);
      printf("ok %d %lld ", seals, (long long)end);
      for (ssize_t i = 0; i < k; i++) printf("%02x", b[i]);
      printf("\n");
    } else {
      printf("err -1 unknown-command\n");
    }
  }
  return 0;
}
