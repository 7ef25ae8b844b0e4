/*
 * Replay of NCCL's driver lookup (src/misc/cudawrap.cc style, runtime 12.5+): every driver
 * function through cudaGetDriverEntryPointByVersion with the oldest version of the ABI NCCL was
 * written against (cuMulticast* at 12010, the VMM functions at 11030), called by ELF name in a
 * program linked against libcudart; and, as NCCL before 2.19 did, the driver's resolver itself
 * through cudaGetDriverEntryPoint("cuGetProcAddress") (the runtime's version: the 5-argument
 * cuGetProcAddress_v2), then cuMulticastBindMem through that resolver at 12010. Then the
 * multicast sequence of mc_calls.h through the pointers. Output: replay.h.
 */
#include "mc_calls.h"

int cudaGetDriverEntryPoint(const char *, void **, unsigned long long, int *);
int cudaGetDriverEntryPointByVersion(const char *, void **, unsigned, unsigned long long, int *);

static const char *k_names[F_N] = {
  "cuInit",           "cuMemCreate", "cuMemRelease", "cuMulticastCreate", "cuMulticastAddDevice", "cuMulticastBindMem",
  "cuMulticastUnbind"};
static const unsigned k_versions[F_N] = {2000, 11030, 11030, 12010, 12010, 12010, 12010};

typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  where("cudaGetDriverEntryPointByVersion", "cudaGetDriverEntryPointByVersion",
        (void *)cudaGetDriverEntryPointByVersion);
  void *fn[F_N] = {0};
  for (int i = 0; i < F_N; i++) {
    int st = -1;
    if (cudaGetDriverEntryPointByVersion(k_names[i], &fn[i], k_versions[i], 0 /* cudaEnableDefault */, &st) != 0 ||
        st != 0)
      fn[i] = NULL;
    where(k_names[i], k_names[i], fn[i]);
  }
  void *gpa = NULL, *bind = NULL;
  int st = -1;
  if (cudaGetDriverEntryPoint("cuGetProcAddress", &gpa, 0, &st) != 0 || st != 0) gpa = NULL;
  where("cuGetProcAddress", "cuGetProcAddress_v2", gpa);
  CUdriverProcAddressQueryResult q = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  if (gpa && (((gpa2_fn)gpa)("cuMulticastBindMem", &bind, 12010, 0, &q) != CUDA_SUCCESS || q != 0)) bind = NULL;
  where("cuMulticastBindMem@gpa", "cuMulticastBindMem", bind);
  if (g_failed) return 1;
  mc_sequence(fn);
  return g_failed;
}
