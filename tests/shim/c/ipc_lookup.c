/*
 * Resolves the IPC adapter's entry points (docs/shim.md "IPC adapter") through one lookup path
 * (argv[1]) and prints where each pointer lies: "fn <name> <library basename> <ELF symbol>".
 * The names are asked for as cudart does, by base name at the version that selects each ABI
 * (cuMemAlloc/cuMemFree/cuMemGetAddressRange at 3020 = the _v2 functions, cuIpcOpenMemHandle at
 * 11000 = _v2 and at 4010 = the v1 ELF function). Paths: elf (linked against libcuda.so.1, build
 * with -DLINKED), dlsym (on the libcuda handle), dlsym_default, gpa (legacy 4-argument
 * cuGetProcAddress), gpa2 (cuGetProcAddress_v2), cudart (cudaGetDriverEntryPoint, the fixture
 * libcudart.so.13: its own version), cudart_ver (cudaGetDriverEntryPointByVersion at each
 * name's version). dlsym paths use the ELF names. Exit status 0 unless a lookup failed.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef CUresult (*gpa1_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef int (*gdep_fn)(const char *, void **, unsigned long long, int *);
typedef int (*gdepv_fn)(const char *, void **, unsigned, unsigned long long, int *);

#define N 9
static const char *k_base[N] = {
  "cuMemAlloc",        "cuMemFree",          "cuMemGetAddressRange", "cuPointerGetAttribute", "cuPointerGetAttributes",
  "cuIpcGetMemHandle", "cuIpcOpenMemHandle", "cuIpcOpenMemHandle",   "cuIpcCloseMemHandle"};
static const char *k_elf[N] = {"cuMemAlloc_v2",         "cuMemFree_v2",           "cuMemGetAddressRange_v2",
                               "cuPointerGetAttribute", "cuPointerGetAttributes", "cuIpcGetMemHandle",
                               "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle",     "cuIpcCloseMemHandle"};
static const int k_ver[N] = {3020, 3020, 3020, 4000, 7000, 4010, 11000, 4010, 4010};

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

int main(int argc, char **argv) {
  const char *path = argc > 1 ? argv[1] : "dlsym";
  void *f[N] = {0};
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
  void *rt = !strncmp(path, "cudart", 6) ? dlopen("libcudart.so.13", RTLD_NOW) : NULL;
  if (!cuda || (!strncmp(path, "cudart", 6) && !rt)) {
    printf("dlopen failed: %s\n", dlerror());
    return 2;
  }
#ifdef LINKED
  void *direct[N] = {(void *)cuMemAlloc,
                     (void *)cuMemFree,
                     (void *)cuMemGetAddressRange,
                     (void *)cuPointerGetAttribute,
                     (void *)cuPointerGetAttributes,
                     (void *)cuIpcGetMemHandle,
                     (void *)cuIpcOpenMemHandle,
                     NULL,
                     (void *)cuIpcCloseMemHandle};
#endif
  for (int i = 0; i < N; i++) {
    if (!strcmp(path, "elf")) {
#ifdef LINKED
      f[i] = direct[i];
      if (i == 7) f[i] = dlsym(RTLD_DEFAULT, k_elf[i]); /* cuda.h names only the _v2 */
#else
      return 3;
#endif
    } else if (!strcmp(path, "dlsym") || !strcmp(path, "dlsym_default")) {
      f[i] = dlsym(!strcmp(path, "dlsym") ? cuda : RTLD_DEFAULT, k_elf[i]);
    } else if (!strcmp(path, "gpa")) {
      if (((gpa1_fn)dlsym(cuda, "cuGetProcAddress"))(k_base[i], &f[i], k_ver[i], 0) != CUDA_SUCCESS) f[i] = NULL;
    } else if (!strcmp(path, "gpa2")) {
      CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
      if (((gpa2_fn)dlsym(cuda, "cuGetProcAddress_v2"))(k_base[i], &f[i], k_ver[i], 0, &st) != CUDA_SUCCESS ||
          st != CU_GET_PROC_ADDRESS_SUCCESS)
        f[i] = NULL;
    } else if (!strcmp(path, "cudart")) {
      int st = 1;
      if (i == 7) continue; /* one version only: the newest ABI of each name */
      if (((gdep_fn)dlsym(rt, "cudaGetDriverEntryPoint"))(k_base[i], &f[i], 0, &st) != 0 || st != 0) f[i] = NULL;
    } else if (!strcmp(path, "cudart_ver")) {
      int st = 1;
      if (((gdepv_fn)dlsym(rt, "cudaGetDriverEntryPointByVersion"))(k_base[i], &f[i], (unsigned)k_ver[i], 0, &st) !=
              0 ||
          st != 0)
        f[i] = NULL;
    } else {
      printf("unknown path %s\n", path);
      return 2;
    }
    char label[64];
    snprintf(label, sizeof label, "%s@%d", k_base[i], k_ver[i]);
    where(label, f[i]);
  }
  for (int i = 0; i < N; i++)
    if (!f[i] && !(i == 7 && !strcmp(path, "cudart"))) return 1;
  return 0;
}
