/*
 * Replay of how libcudart reaches the driver for cudaMalloc, cudaFree and cudaIpc*: it
 * dlopen()s libcuda.so.1, takes dlsym(handle, "cuGetProcAddress_v2") once and asks it for each
 * driver function with its own version (13010 here) and CU_GET_PROC_ADDRESS_DEFAULT; the driver
 * answers the newest ABI of each base name up to that version (cuMemAlloc -> cuMemAlloc_v2,
 * cuIpcOpenMemHandle -> cuIpcOpenMemHandle_v2; cuda.h's #defines). Then cuInit, cuMemAlloc of
 * 1 MiB, cuMemGetAddressRange of an address inside it, cuIpcGetMemHandle (64 bytes) and cuMemFree
 * through the pointers. Output: replay.h, plus "pid <pid>", "ptr 0x<va>", "range 0x<base> 0x<size>"
 * and "ipc <hex of the 64 handle bytes>".
 */
#include "replay.h"

#include <unistd.h>

typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

enum { F_INIT, F_ALLOC, F_FREE, F_RANGE, F_IPC_GET, F_IPC_OPEN, F_IPC_CLOSE, F_N };
static const char *k_names[F_N] = {"cuInit",
                                   "cuMemAlloc",
                                   "cuMemFree",
                                   "cuMemGetAddressRange",
                                   "cuIpcGetMemHandle",
                                   "cuIpcOpenMemHandle",
                                   "cuIpcCloseMemHandle"};
static const char *k_elf[F_N] = {"cuInit",
                                 "cuMemAlloc_v2",
                                 "cuMemFree_v2",
                                 "cuMemGetAddressRange_v2",
                                 "cuIpcGetMemHandle",
                                 "cuIpcOpenMemHandle_v2",
                                 "cuIpcCloseMemHandle"};

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  printf("pid %d\n", (int)getpid());
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cuda) return 2;
  gpa2_fn gpa = (gpa2_fn)dlsym(cuda, "cuGetProcAddress_v2");
  where("cuGetProcAddress_v2", "cuGetProcAddress_v2", (void *)gpa);
  if (!gpa) return 1;
  void *fn[F_N] = {0};
  for (int i = 0; i < F_N; i++) {
    CUdriverProcAddressQueryResult q = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if (gpa(k_names[i], &fn[i], 13010, CU_GET_PROC_ADDRESS_DEFAULT, &q) != CUDA_SUCCESS || q != 0) fn[i] = NULL;
    where(k_names[i], k_elf[i], fn[i]);
  }
  if (g_failed) return 1;
  called("cuInit", ((CUresult (*)(unsigned))fn[F_INIT])(0));
  CUdevice dev;
  CUcontext ctx;
  if (cuDeviceGet(&dev, 0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
      cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
    return 1;
  CUdeviceptr p = 0, base = 0;
  size_t size = 0;
  called("cuMemAlloc", ((CUresult (*)(CUdeviceptr *, size_t))fn[F_ALLOC])(&p, 1 << 20));
  printf("ptr 0x%llx\n", (unsigned long long)p);
  called("cuMemGetAddressRange",
         ((CUresult (*)(CUdeviceptr *, size_t *, CUdeviceptr))fn[F_RANGE])(&base, &size, p + 4096));
  printf("range 0x%llx 0x%zx\n", (unsigned long long)base, size);
  CUipcMemHandle ipc;
  memset(&ipc, 0, sizeof ipc);
  called("cuIpcGetMemHandle", ((CUresult (*)(CUipcMemHandle *, CUdeviceptr))fn[F_IPC_GET])(&ipc, p));
  printf("ipc ");
  for (size_t i = 0; i < sizeof ipc.reserved; i++) printf("%02x", (unsigned char)ipc.reserved[i]);
  printf("\n");
  called("cuMemFree", ((CUresult (*)(CUdeviceptr))fn[F_FREE])(p));
  return g_failed;
}
