/*
 * ck_target.c: the CUDA process the conformance suite checkpoints (tests/conformance). It finds
 * the driver as CRIU's plugin and cuda-python do, dlopen("libcuda.so.1") (whichever the loader
 * finds: the real driver, or fakecuda), so one binary runs on both; under LD_PRELOAD it runs
 * under the shim. One command per stdin line, one reply line on stdout: "ok [values...]" or
 * "err <CUresult number> <what>".
 *
 *   init DEV         cuInit(0), the primary context of ordinal DEV current, 4096 bytes of
 *                    cuMemAlloc filled with 0x5A (what r570-features' child and cuda-core's
 *                    target do) -> ok
 *   check            cuMemcpyDtoH of the buffer -> ok <1 if every byte is still 0x5A>
 *   uuid             -> ok GPU-xxxxxxxx-... of the context's ordinal (cuDeviceGetUuid)
 *   pci DEV          -> ok <domain> <bus> <device> (CU_DEVICE_ATTRIBUTE_PCI_*_ID)
 *   name DEV         -> ok <cuDeviceGetName, spaces as '_'>
 *   count            -> ok <cuDeviceGetCount>
 *   ipcget           cuIpcGetMemHandle of the buffer -> ok <128 hex digits>
 *   ipcopen HEX      cuIpcOpenMemHandle of that handle -> ok <1 if it reads 0x5A>; then
 *                    cuIpcCloseMemHandle happens at "ipcclose"
 *   ipcclose         -> ok
 *   quit             exit 0
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef CUresult (*fn_t)();
static void *lib;
static fn_t sym(const char *n) {
  fn_t f = (fn_t)dlsym(lib, n);
  if (!f) {
    printf("err -1 no %s in libcuda.so.1\n", n);
    fflush(stdout);
    exit(1);
  }
  return f;
}
#define CALL(name, ...) ((CUresult (*)())sym(#name))(__VA_ARGS__)

static CUdeviceptr buf;
static CUdeviceptr opened;
static CUcontext ctx;

static int reply(CUresult r, const char *what) {
  if (r != CUDA_SUCCESS) printf("err %d %s\n", (int)r, what);
  return r == CUDA_SUCCESS;
}

static int all_5a(CUdeviceptr p) {
  unsigned char h[4096];
  if (CALL(cuMemcpyDtoH_v2, h, p, sizeof h) != CUDA_SUCCESS) return 0;
  for (size_t i = 0; i < sizeof h; i++)
    if (h[i] != 0x5A) return 0;
  return 1;
}

int main(void) {
  lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    printf("err -1 %s\n", dlerror());
    return 1;
  }
  char line[512];
  setvbuf(stdout, NULL, _IOLBF, 0);
  while (fgets(line, sizeof line, stdin)) {
    char cmd[32] = "", arg[256] = "";
    if (sscanf(line, "%31s %255s", cmd, arg) < 1) continue;
    int dev = atoi(arg);
    if (!strcmp(cmd, "quit")) return 0;
    if (!strcmp(cmd, "init")) {
      unsigned char h[4096];
      memset(h, 0x5A, sizeof h);
      CUdevice d;
      if (reply(CALL(cuInit, 0), "cuInit") && reply(CALL(cuDeviceGet, &d, dev), "cuDeviceGet") &&
          reply(CALL(cuDevicePrimaryCtxRetain, &ctx, d), "cuDevicePrimaryCtxRetain") &&
          reply(CALL(cuCtxSetCurrent, ctx), "cuCtxSetCurrent") &&
          reply(CALL(cuMemAlloc_v2, &buf, (size_t)4096), "cuMemAlloc") &&
          reply(CALL(cuMemcpyHtoD_v2, buf, h, sizeof h), "cuMemcpyHtoD"))
        printf("ok\n");
    } else if (!strcmp(cmd, "check")) {
      printf("ok %d\n", all_5a(buf));
    } else if (!strcmp(cmd, "uuid")) {
      CUdevice d;
      CUuuid u;
      if (reply(CALL(cuCtxGetDevice, &d), "cuCtxGetDevice") && reply(CALL(cuDeviceGetUuid, &u, d), "uuid")) {
        const unsigned char *b = (const unsigned char *)u.bytes;
        printf("ok GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", b[0], b[1], b[2], b[3],
               b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
      }
    } else if (!strcmp(cmd, "pci")) {
      int v[3];
      static const CUdevice_attribute a[3] = {CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
                                              CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID};
      int ok = 1;
      for (int i = 0; i < 3 && ok; i++)
        ok = reply(CALL(cuDeviceGetAttribute, &v[i], a[i], dev), "cuDeviceGetAttribute");
      if (ok) printf("ok %d %d %d\n", v[0], v[1], v[2]);
    } else if (!strcmp(cmd, "name")) {
      char n[128];
      if (reply(CALL(cuDeviceGetName, n, (int)sizeof n, dev), "cuDeviceGetName")) {
        for (char *c = n; *c; c++) *c = *c == ' ' ? '_' : *c;
        printf("ok %s\n", n);
      }
    } else if (!strcmp(cmd, "count")) {
      int n = 0;
      if (reply(CALL(cuDeviceGetCount, &n), "cuDeviceGetCount")) printf("ok %d\n", n);
    } else if (!strcmp(cmd, "ipcget")) {
      CUipcMemHandle h;
      if (reply(CALL(cuIpcGetMemHandle, &h, buf), "cuIpcGetMemHandle")) {
        printf("ok ");
        for (int i = 0; i < CU_IPC_HANDLE_SIZE; i++) printf("%02x", (unsigned char)h.reserved[i]);
        printf("\n");
      }
    } else if (!strcmp(cmd, "ipcopen")) {
      CUipcMemHandle h;
      for (int i = 0; i < CU_IPC_HANDLE_SIZE; i++) {
        unsigned v = 0;
        sscanf(arg + 2 * i, "%2x", &v);
        h.reserved[i] = (char)v;
      }
      if (reply(CALL(cuIpcOpenMemHandle_v2, &opened, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle"))
        printf("ok %d\n", all_5a(opened));
    } else if (!strcmp(cmd, "ipcclose")) {
      if (reply(CALL(cuIpcCloseMemHandle, opened), "cuIpcCloseMemHandle")) printf("ok\n");
    } else {
      printf("err -1 unknown command %s\n", cmd);
    }
  }
  return 0;
}
