/*
 * Replay of NVSHMEM's driver lookup: dlopen("libcuda.so.1"), dlsym(handle, "cuGetProcAddress")
 * (the ELF name of the legacy 4-argument resolver, CUDA driver API "Driver Entry Point
 * Access"), then every driver function through that resolver with the old ABI
 * (symbol, pfn, cudaVersion, flags) at the CUDA version it was built with (12040 here: 12.4),
 * the VMM and multicast functions its symmetric heap uses among them. Then cuInit, cuMemCreate, cuMulticastCreate and
 * the two releases through the resolved pointers. Output: replay.h.
 */
#include "replay.h"

typedef CUresult (*gpa1_fn)(const char *, void **, int, cuuint64_t);

static const char *k_names[] = {"cuInit",
                                "cuMemCreate",
                                "cuMemRelease",
                                "cuMemMap",
                                "cuMemUnmap",
                                "cuMemSetAccess",
                                "cuMemAddressReserve",
                                "cuMemAddressFree",
                                "cuMemExportToShareableHandle",
                                "cuMemImportFromShareableHandle",
                                "cuMemRetainAllocationHandle",
                                "cuMemGetAllocationPropertiesFromHandle",
                                "cuMulticastCreate",
                                "cuMulticastAddDevice",
                                "cuMulticastBindMem",
                                "cuMulticastUnbind"};
#define N (sizeof k_names / sizeof k_names[0])

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  void *cuda = dlopen("libcuda.so.1", RTLD_LAZY);
  if (!cuda) return 2;
  gpa1_fn gpa = (gpa1_fn)dlsym(cuda, "cuGetProcAddress");
  where("cuGetProcAddress", "cuGetProcAddress", (void *)gpa);
  if (!gpa) return 1;
  void *fn[N] = {0};
  for (size_t i = 0; i < N; i++) {
    if (gpa(k_names[i], &fn[i], 12040, CU_GET_PROC_ADDRESS_DEFAULT) != CUDA_SUCCESS) fn[i] = NULL;
    where(k_names[i], k_names[i], fn[i]);
  }
  if (g_failed) return 1;
  called("cuInit", ((CUresult (*)(unsigned))fn[0])(0));
  CUmemAllocationProp p = device_prop();
  CUmemGenericAllocationHandle h = 0, mc = 0;
  CUresult r = ((CUresult (*)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                              unsigned long long))fn[1])(&h, 2 << 20, &p, 0);
  called("cuMemCreate", r);
  printf("handle cuMemCreate 0x%llx\n", (unsigned long long)h);
  CUmulticastObjectProp mp;
  memset(&mp, 0, sizeof mp);
  mp.numDevices = 1;
  mp.size = 2 << 20;
  mp.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  called("cuMulticastCreate",
         ((CUresult (*)(CUmemGenericAllocationHandle *, const CUmulticastObjectProp *))fn[12])(&mc, &mp));
  printf("handle cuMulticastCreate 0x%llx\n", (unsigned long long)mc);
  called("cuMemRelease", ((CUresult (*)(CUmemGenericAllocationHandle))fn[2])(mc));
  called("cuMemRelease", ((CUresult (*)(CUmemGenericAllocationHandle))fn[2])(h));
  return g_failed;
}
