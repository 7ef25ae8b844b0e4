/*
 * proc_address.c: the resolver wrappers (docs/shim.md "Interception", paths 3 and 4):
 * cuGetProcAddress (legacy 4-argument ABI) and cuGetProcAddress_v2, and
 * cudaGetDriverEntryPoint[ByVersion][_ptsz]. Each runs the real resolver, then lets
 * cui_substitute (resolve.c) swap in the wrapper; a tracked API that resolved to something
 * unrecognised is refused here (fail closed) and named on stderr.
 */
#define _GNU_SOURCE
#include "api.h"

/* cui_substitute, or NULL and CUDA_ERROR_NOT_SUPPORTED with one line on stderr. */
static CUresult substitute_or_refuse(const char *symbol, void **pfn) {
  if (cui_substitute(symbol, pfn) == 0) return CUDA_SUCCESS;
  cui_api_warn("driver entry point lookup",
               "%s resolved to %p, which is not a known libcuda function; refused "
               "(NULL, CUDA_ERROR_NOT_SUPPORTED)",
               symbol, *pfn);
  *pfn = NULL;
  return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cui_cuGetProcAddress_v1(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
  cui_fn_cuGetProcAddress real = REAL(cuGetProcAddress);
  if (!real) return CUDA_ERROR_NOT_FOUND;
  CUresult r = real(symbol, pfn, cudaVersion, flags);
  if (r != CUDA_SUCCESS || !pfn) return r;
  return substitute_or_refuse(symbol, pfn);
}

CUresult cui_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                 CUdriverProcAddressQueryResult *status) {
  cui_fn_cuGetProcAddress_v2 real = REAL(cuGetProcAddress_v2);
  if (!real) return CUDA_ERROR_NOT_FOUND;
  CUresult r = real(symbol, pfn, cudaVersion, flags, status);
  if (r != CUDA_SUCCESS || !pfn) return r;
  r = substitute_or_refuse(symbol, pfn);
  if (r != CUDA_SUCCESS && status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return r;
}

/* ---------- runtime entry points ---------- */

enum { CUI_cudaErrorInitializationError = 3, CUI_cudaDriverEntryPointSymbolNotFound = 1 };

static int runtime_substitute(int r, const char *symbol, void **funcPtr, int *status) {
  if (r != 0 || !funcPtr) return r;
  if (substitute_or_refuse(symbol, funcPtr) != CUDA_SUCCESS && status) *status = CUI_cudaDriverEntryPointSymbolNotFound;
  return r;
}

int cudaGetDriverEntryPoint(const char *symbol, void **funcPtr, unsigned long long flags, int *status) {
  cui_fn_cudaGetDriverEntryPoint real = REAL(cudaGetDriverEntryPoint);
  if (!real) return CUI_cudaErrorInitializationError;
  return runtime_substitute(real(symbol, funcPtr, flags, status), symbol, funcPtr, status);
}

int cudaGetDriverEntryPoint_ptsz(const char *symbol, void **funcPtr, unsigned long long flags, int *status) {
  cui_fn_cudaGetDriverEntryPoint_ptsz real = REAL(cudaGetDriverEntryPoint_ptsz);
  if (!real) return CUI_cudaErrorInitializationError;
  return runtime_substitute(real(symbol, funcPtr, flags, status), symbol, funcPtr, status);
}

int cudaGetDriverEntryPointByVersion(const char *symbol, void **funcPtr, unsigned int cudaVersion,
                                     unsigned long long flags, int *status) {
  cui_fn_cudaGetDriverEntryPointByVersion real = REAL(cudaGetDriverEntryPointByVersion);
  if (!real) return CUI_cudaErrorInitializationError;
  return runtime_substitute(real(symbol, funcPtr, cudaVersion, flags, status), symbol, funcPtr, status);
}

int cudaGetDriverEntryPointByVersion_ptsz(const char *symbol, void **funcPtr, unsigned int cudaVersion,
                                          unsigned long long flags, int *status) {
  cui_fn_cudaGetDriverEntryPointByVersion_ptsz real = REAL(cudaGetDriverEntryPointByVersion_ptsz);
  if (!real) return CUI_cudaErrorInitializationError;
  return runtime_substitute(real(symbol, funcPtr, cudaVersion, flags, status), symbol, funcPtr, status);
}
