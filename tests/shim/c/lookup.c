/*
 * Resolves cuInit, cuMemCreate, cuMemRelease and cuMemGetAllocationGranularity through one
 * lookup path (argv[1]), reports where each pointer lies, then creates and releases a
 * 2 MiB allocation with them. Output lines:
 *   fn <name> <library basename> <ELF symbol>
 *   handle 0x<hex>          the handle cuMemCreate returned
 *   release <CUresult>
 * Paths: elf (binary linked against libcuda.so.1; build with -DLINKED), dlsym,
 * dlsym_default, rtld_next (dlsym(RTLD_NEXT, ...) from the executable: the next object after
 * it is the preloaded shim, so a forwarder that lost the caller's address would answer
 * libcuda's function instead), gpa (legacy 4-argument cuGetProcAddress), gpa2 (cuGetProcAddress_v2),
 * cudart (cudaGetDriverEntryPoint), cudart_ver (cudaGetDriverEntryPointByVersion),
 * cudart_default (dlsym(RTLD_DEFAULT, "cudaGetDriverEntryPointByVersion")).
 * Then the multicast entry points through the same path (version 13010, the _v2 binds by
 * their full names), reported only: "mcfn <name> <library basename> <ELF symbol>".
 * Exit status 0 unless a lookup or call failed.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef CUresult (*init_fn)(unsigned);
typedef CUresult (*create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*gran_fn)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
typedef CUresult (*gpa1_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef int (*gdep_fn)(const char *, void **, unsigned long long, int *);
typedef int (*gdepv_fn)(const char *, void **, unsigned, unsigned long long, int *);

static void where(const char *name, void *p) {
  Dl_info di;
  const char *lib = "?", *sym = "?";
  if (p && dladdr(p, &di)) {
    if (di.dli_fname) {
      lib = strrchr(di.dli_fname, '/');
      lib = lib ? lib + 1 : di.dli_fname;
    }
    if (di.dli_sname && di.dli_saddr == p) sym = di.dli_sname;
  }
  printf("fn %s %s %s\n", name, p ? lib : "NULL", sym);
}

static const char *k_names[4] = {"cuInit", "cuMemCreate", "cuMemRelease", "cuMemGetAllocationGranularity"};
static const int k_versions[4] = {2000, 10020, 10020, 10020};

static const char *k_mc[7] = {"cuMulticastCreate",   "cuMulticastAddDevice",  "cuMulticastBindMem",
                              "cuMulticastBindAddr", "cuMulticastBindMem_v2", "cuMulticastBindAddr_v2",
                              "cuMulticastUnbind"};

static void *mc_lookup(const char *path, void *cuda, const char *name, int i) {
  void *f = NULL;
  if (!strcmp(path, "elf")) {
#ifdef LINKED
    void *direct[7] = {(void *)cuMulticastCreate,   (void *)cuMulticastAddDevice,  (void *)cuMulticastBindMem,
                       (void *)cuMulticastBindAddr, (void *)cuMulticastBindMem_v2, (void *)cuMulticastBindAddr_v2,
                       (void *)cuMulticastUnbind};
    f = direct[i];
#endif
  } else if (!strcmp(path, "dlsym") || !strcmp(path, "dlsym_default") || !strcmp(path, "rtld_next")) {
    f = dlsym(!strcmp(path, "dlsym") ? cuda : !strcmp(path, "rtld_next") ? RTLD_NEXT : RTLD_DEFAULT, name);
  } else if (!strcmp(path, "gpa")) {
    if (((gpa1_fn)dlsym(cuda, "cuGetProcAddress"))(name, &f, 13010, 0) != CUDA_SUCCESS) f = NULL;
  } else if (!strcmp(path, "gpa2")) {
    CUdriverProcAddressQueryResult st;
    if (((gpa2_fn)dlsym(cuda, "cuGetProcAddress_v2"))(name, &f, 13010, 0, &st) != CUDA_SUCCESS) f = NULL;
  } else {
    void *rt = dlopen("libcudart.so.13", RTLD_NOW);
    int st = 1;
    if (!strcmp(path, "cudart")) {
      if (((gdep_fn)dlsym(rt, "cudaGetDriverEntryPoint"))(name, &f, 0, &st) != 0) f = NULL;
    } else if (((gdepv_fn)dlsym(!strcmp(path, "cudart_ver") ? rt : RTLD_DEFAULT, "cudaGetDriverEntryPointByVersion"))(
                   name, &f, 13010, 0, &st) != 0) {
      f = NULL;
    }
  }
  return f;
}

int main(int argc, char **argv) {
  const char *path = argc > 1 ? argv[1] : "dlsym";
  void *fns[4] = {0};
  void *cuda = NULL;
  if (strcmp(path, "elf") != 0 && strncmp(path, "cudart", 6) != 0) {
    cuda = dlopen("libcuda.so.1", strcmp(path, "dlsym") != 0 ? RTLD_NOW | RTLD_GLOBAL : RTLD_NOW);
    if (!cuda) {
      printf("dlopen failed: %s\n", dlerror());
      return 2;
    }
  }
  if (!strcmp(path, "elf")) {
#ifdef LINKED
    fns[0] = (void *)cuInit;
    fns[1] = (void *)cuMemCreate;
    fns[2] = (void *)cuMemRelease;
    fns[3] = (void *)cuMemGetAllocationGranularity;
#else
    return 3;
#endif
  } else if (!strcmp(path, "dlsym") || !strcmp(path, "dlsym_default") || !strcmp(path, "rtld_next")) {
    void *h = !strcmp(path, "dlsym") ? cuda : !strcmp(path, "rtld_next") ? RTLD_NEXT : RTLD_DEFAULT;
    for (int i = 0; i < 4; i++) fns[i] = dlsym(h, k_names[i]);
  } else if (!strcmp(path, "gpa")) {
    gpa1_fn gpa = (gpa1_fn)dlsym(cuda, "cuGetProcAddress");
    where("cuGetProcAddress", (void *)gpa);
    void *self1 = NULL, *self2 = NULL;
    gpa("cuGetProcAddress", &self1, 11030, 0);
    gpa("cuGetProcAddress", &self2, 12000, 0);
    where("cuGetProcAddress@11030", self1);
    where("cuGetProcAddress@12000", self2);
    for (int i = 0; i < 4; i++)
      if (gpa(k_names[i], &fns[i], k_versions[i], 0) != CUDA_SUCCESS) fns[i] = NULL;
  } else if (!strcmp(path, "gpa2")) {
    gpa2_fn gpa = (gpa2_fn)dlsym(cuda, "cuGetProcAddress_v2");
    where("cuGetProcAddress_v2", (void *)gpa);
    void *self1 = NULL, *self2 = NULL;
    CUdriverProcAddressQueryResult st;
    gpa("cuGetProcAddress", &self1, 11030, 0, &st);
    gpa("cuGetProcAddress", &self2, 12000, 0, &st);
    where("cuGetProcAddress@11030", self1);
    where("cuGetProcAddress@12000", self2);
    for (int i = 0; i < 4; i++) {
      st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
      if (gpa(k_names[i], &fns[i], 12000, 0, &st) != CUDA_SUCCESS || st != CU_GET_PROC_ADDRESS_SUCCESS) fns[i] = NULL;
    }
  } else if (!strncmp(path, "cudart", 6)) {
    void *rt = dlopen("libcudart.so.13", strcmp(path, "cudart_default") == 0 ? RTLD_NOW | RTLD_GLOBAL : RTLD_NOW);
    if (!rt) {
      printf("dlopen cudart failed: %s\n", dlerror());
      return 2;
    }
    for (int i = 0; i < 4; i++) {
      int st = 1;
      if (!strcmp(path, "cudart")) {
        gdep_fn f = (gdep_fn)dlsym(rt, "cudaGetDriverEntryPoint");
        if (i == 0) where("cudaGetDriverEntryPoint", (void *)f);
        if (f(k_names[i], &fns[i], 0, &st) != 0 || st != 0) fns[i] = NULL;
      } else {
        gdepv_fn f = (gdepv_fn)dlsym(!strcmp(path, "cudart_ver") ? rt : RTLD_DEFAULT,
                                     "cudaGetDriverEntryPointByVersion");
        if (i == 0) where("cudaGetDriverEntryPointByVersion", (void *)f);
        if (f(k_names[i], &fns[i], 12000, 0, &st) != 0 || st != 0) fns[i] = NULL;
      }
    }
  } else {
    printf("unknown path %s\n", path);
    return 2;
  }
  for (int i = 0; i < 4; i++) where(k_names[i], fns[i]);
  for (int i = 0; i < 7; i++) {
    printf("mc");
    where(k_mc[i], mc_lookup(path, cuda, k_mc[i], i));
  }
  if (!fns[0] || !fns[1] || !fns[2] || !fns[3]) return 1;
  if (((init_fn)fns[0])(0) != CUDA_SUCCESS) return 1;
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  size_t g = 0;
  if (((gran_fn)fns[3])(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) return 1;
  CUmemGenericAllocationHandle h = 0;
  if (((create_fn)fns[1])(&h, g, &p, 0) != CUDA_SUCCESS) return 1;
  printf("handle 0x%llx\n", (unsigned long long)h);
  printf("release %d\n", (int)((release_fn)fns[2])(h));
  return 0;
}
