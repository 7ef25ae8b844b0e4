/*
 * A minimal stand-in libcuda.so.1 whose handles carry the shim's virtual tag (0xC01E in the top
 * 16 bits), which fakecuda never produces: to prove the shim releases and refuses such driver
 * handles instead of confusing them with its own. Only what tag_app.c and the shim call exist.
 * Every call appends "<function> <handle>" to $TAGCUDA_LOG.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

#define TAGGED 0xC01E000000000001ULL

static void note(const char *fn, unsigned long long h) {
  const char *p = getenv("TAGCUDA_LOG");
  FILE *f = p ? fopen(p, "a") : NULL;
  if (!f) return;
  fprintf(f, "%s 0x%llx\n", fn, h);
  fclose(f);
}

CUresult cuInit(unsigned int flags) { return CUDA_SUCCESS; }
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
  *h = TAGGED;
  note("cuMemCreate", *h);
  return CUDA_SUCCESS;
}
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
  *h = TAGGED + 1;
  note("cuMemRetainAllocationHandle", *h);
  return CUDA_SUCCESS;
}
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, CUmemAllocationHandleType t) {
  *h = TAGGED + 2;
  note("cuMemImportFromShareableHandle", *h);
  return CUDA_SUCCESS;
}
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
  return CUDA_SUCCESS;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  note("cuMemRelease", h);
  return CUDA_SUCCESS;
}
