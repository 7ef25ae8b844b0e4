/*
 * Resolves the entry points the shim hooks for what real stacks share besides memory (docs/shim.md
 * sections 10-12: events, peer access, pool IPC, cuMemHostRegister) through one lookup path
 * (argv[1]) and prints "fn <label> <library basename> <ELF symbol>" for each. Labels are
 * base@version[+pt]; "+pt" asks with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (the
 * runtime's cudaEnablePerThreadDefaultStream, 2). Paths: dlsym (ELF name on the libcuda handle),
 * dlsym_default, gpa (legacy 4-argument cuGetProcAddress), gpa2 (cuGetProcAddress_v2),
 * cudart_ver (cudaGetDriverEntryPointByVersion of the fixture libcudart.so.13). The ELF name of a
 * "+pt" row is its _ptsz twin, which the dlsym paths ask for directly. Exit 0 unless one failed.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef CUresult (*gpa1_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef int (*gdepv_fn)(const char *, void **, unsigned, unsigned long long, int *);

static const struct {
  const char *base, *elf;
  int ver, pt;
} k_rows[] = {
  {"cuEventCreate", "cuEventCreate", 2000, 0},
  {"cuEventRecord", "cuEventRecord", 2000, 0},
  {"cuEventRecord", "cuEventRecord_ptsz", 2000, 1},
  {"cuEventRecordWithFlags", "cuEventRecordWithFlags", 11010, 0},
  {"cuEventRecordWithFlags", "cuEventRecordWithFlags_ptsz", 11010, 1},
  {"cuEventQuery", "cuEventQuery", 2000, 0},
  {"cuEventSynchronize", "cuEventSynchronize", 2000, 0},
  {"cuEventDestroy", "cuEventDestroy", 2000, 0},
  {"cuEventDestroy", "cuEventDestroy_v2", 4000, 0},
  {"cuStreamWaitEvent", "cuStreamWaitEvent", 3020, 0},
  {"cuStreamWaitEvent", "cuStreamWaitEvent_ptsz", 3020, 1},
  {"cuIpcGetEventHandle", "cuIpcGetEventHandle", 4010, 0},
  {"cuIpcOpenEventHandle", "cuIpcOpenEventHandle", 4010, 0},
  {"cuCtxEnablePeerAccess", "cuCtxEnablePeerAccess", 4000, 0},
  {"cuCtxDisablePeerAccess", "cuCtxDisablePeerAccess", 4000, 0},
  {"cuMemPoolExportToShareableHandle", "cuMemPoolExportToShareableHandle", 11020, 0},
  {"cuMemPoolImportFromShareableHandle", "cuMemPoolImportFromShareableHandle", 11020, 0},
  {"cuMemPoolExportPointer", "cuMemPoolExportPointer", 11020, 0},
  {"cuMemPoolImportPointer", "cuMemPoolImportPointer", 11020, 0},
  {"cuMemHostRegister", "cuMemHostRegister", 4000, 0},
  {"cuMemHostRegister", "cuMemHostRegister_v2", 6050, 0},
  {"cuMemHostUnregister", "cuMemHostUnregister", 4000, 0},
};
#define N (int)(sizeof k_rows / sizeof k_rows[0])

int main(int argc, char **argv) {
  const char *path = argc > 1 ? argv[1] : "dlsym";
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
  void *rt = !strcmp(path, "cudart_ver") ? dlopen("libcudart.so.13", RTLD_NOW) : NULL;
  if (!cuda || (!strcmp(path, "cudart_ver") && !rt)) {
    printf("dlopen failed: %s\n", dlerror());
    return 2;
  }
  int failed = 0;
  for (int i = 0; i < N; i++) {
    void *f = NULL;
    unsigned long long flags = k_rows[i].pt ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0;
    if (!strcmp(path, "dlsym") || !strcmp(path, "dlsym_default")) {
      f = dlsym(!strcmp(path, "dlsym") ? cuda : RTLD_DEFAULT, k_rows[i].elf);
    } else if (!strcmp(path, "gpa")) {
      if (((gpa1_fn)dlsym(cuda, "cuGetProcAddress"))(k_rows[i].base, &f, k_rows[i].ver, flags) != CUDA_SUCCESS)
        f = NULL;
    } else if (!strcmp(path, "gpa2")) {
      CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
      if (((gpa2_fn)dlsym(cuda, "cuGetProcAddress_v2"))(k_rows[i].base, &f, k_rows[i].ver, flags, &st) !=
              CUDA_SUCCESS ||
          st != CU_GET_PROC_ADDRESS_SUCCESS)
        f = NULL;
    } else if (!strcmp(path, "cudart_ver")) {
      int st = 1;
      if (((gdepv_fn)dlsym(rt, "cudaGetDriverEntryPointByVersion"))(k_rows[i].base, &f, (unsigned)k_rows[i].ver, flags,
                                                                    &st) != 0 ||
          st != 0)
        f = NULL;
    } else {
      printf("unknown path %s\n", path);
      return 2;
    }
    Dl_info di;
    const char *lib = "NULL", *sym = "?";
    if (f && dladdr(f, &di)) {
      lib = di.dli_fname && strrchr(di.dli_fname, '/') ? strrchr(di.dli_fname, '/') + 1 : "?";
      if (di.dli_sname && di.dli_saddr == f) sym = di.dli_sname;
    }
    printf("fn %s@%d%s %s %s\n", k_rows[i].base, k_rows[i].ver, k_rows[i].pt ? "+pt" : "", lib, sym);
    failed |= !f;
  }
  return failed;
}
