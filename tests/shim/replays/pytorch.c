/*
 * Replay of PyTorch's driver lookup (c10/cuda/driver_api.cpp style): the runtime's entry point
 * taken with dlsym(RTLD_DEFAULT, "cudaGetDriverEntryPointByVersion") (runtime 12.5+; else
 * cudaGetDriverEntryPoint), every driver function asked for at 12030, the version PyTorch's
 * SymmetricMemory was written against, so cuMulticastBindMem is the v1 bind ABI (the
 * device-explicit _v2 binds are CUDA 13.1 names). Then the multicast sequence of mc_calls.h with
 * the v1 ABI through the pointers. Output: replay.h.
 */
#include "mc_calls.h"

typedef int (*gdepv_fn)(const char *, void **, unsigned, unsigned long long, int *);
typedef int (*gdep_fn)(const char *, void **, unsigned long long, int *);

static const char *k_names[F_N] = {
  "cuInit",           "cuMemCreate", "cuMemRelease", "cuMulticastCreate", "cuMulticastAddDevice", "cuMulticastBindMem",
  "cuMulticastUnbind"};

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (!dlopen("libcudart.so.13", RTLD_NOW | RTLD_GLOBAL)) return 2;   /* linked by libtorch_cuda */
  gdepv_fn byver = (gdepv_fn)dlsym(RTLD_DEFAULT, "cudaGetDriverEntryPointByVersion");
  gdep_fn plain = (gdep_fn)dlsym(RTLD_DEFAULT, "cudaGetDriverEntryPoint");
  where("cudaGetDriverEntryPointByVersion", "cudaGetDriverEntryPointByVersion", (void *)byver);
  void *fn[F_N] = {0};
  for (int i = 0; i < F_N; i++) {
    int st = -1;
    int r = byver ? byver(k_names[i], &fn[i], 12030, 0 /* cudaEnableDefault */, &st)
                  : plain(k_names[i], &fn[i], 0, &st);
    if (r != 0 || st != 0) fn[i] = NULL;
    where(k_names[i], k_names[i], fn[i]);
  }
  if (g_failed) return 1;
  mc_sequence(fn);
  return g_failed;
}
