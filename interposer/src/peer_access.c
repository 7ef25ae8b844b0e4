/*
 * peer_access.c: peer context access under the IPC adapter (docs/shim.md "IPC adapter", peer
 * access; CUDA driver API "Peer Context Memory Access"), on the API layer above vmm_api.c.
 *
 * The driver's cuCtxEnablePeerAccess makes every legacy allocation of the peer context (its
 * cuMemAlloc memory, existing and future) accessible to the current context; it does not touch
 * VMM memory, whose access is what cuMemSetAccess granted ("Virtual Memory Management"). Under
 * the adapter a cuMemAlloc is VMM memory, so the shim does the driver's part itself:
 * - cuCtxEnablePeerAccess(peer): the driver's call, then read-write access for the current
 *   context's device on every adapter mapping of `peer` (its cuMemAlloc_v2 allocations and the
 *   IPC memory opened in it), through the tracked cuMemSetAccess, so the grant is recorded and
 *   replayed by a restore; and on every later one (cui_peer_grant_new, called by
 *   cuMemAlloc_v2 and cuIpcOpenMemHandle).
 * - cuCtxDisablePeerAccess(peer): the driver's call, then PROT_NONE for that device on the
 *   same mappings, unless another context of that device still has access to `peer`.
 * The grants are a small table under the state lock (contexts are few); a failed grant undoes
 * the driver's enable and the grants made, and returns the driver's error.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api.h"

#define GRANTS_MAX 64

struct grant {
  void *from, *to;  /* the context that enabled access, and its peer */
  int dev;          /* from's device */
};
static struct grant g_grants[GRANTS_MAX];
static uint32_t g_ngrants;

/* The adapter mappings of context `ctx` as malloc'd (va, size) pairs in *out (lock taken
 * here); their count, or -1 out of memory. */
static int64_t adapter_maps_of(void *ctx, uint64_t (**out)[2]) {
  pthread_mutex_lock(&cui_st.lock);
  *out = malloc((cui_st.nmaps ? cui_st.nmaps : 1) * sizeof **out);
  int64_t n = *out ? 0 : -1;
  for (size_t i = 0; i < cui_st.nallocs && n >= 0; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (!a->live || !(a->flags & CUI_REC_ADAPTER) || a->adapter_ctx != ctx) continue;
    CUI_FOR_MAPS_OF(m, a) {
      (*out)[n][0] = m->va;
      (*out)[n][1] = m->size;
      n++;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return n;
}

static CUresult grant(uint64_t va, uint64_t size, int dev, CUmemAccess_flags flags) {
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = dev;
  d.flags = flags;
  return cuMemSetAccess(va, size, &d, 1);
}

CUresult cui_peer_grant_new(CUdeviceptr va, size_t size, void *ctx) {
  int devs[GRANTS_MAX], n = 0;
  pthread_mutex_lock(&cui_st.lock);
  for (uint32_t i = 0; i < g_ngrants; i++) {
    int seen = 0;
    for (int k = 0; k < n; k++) seen |= devs[k] == g_grants[i].dev;
    if (g_grants[i].to == ctx && !seen) devs[n++] = g_grants[i].dev;
  }
  pthread_mutex_unlock(&cui_st.lock);
  for (int k = 0; k < n; k++) {
    CUresult r = grant(va, size, devs[k], CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    if (r != CUDA_SUCCESS) return r;
  }
  return CUDA_SUCCESS;
}

static void *current_ctx(int *dev) {
  CUcontext c = NULL;
  CUdevice d = -1;
  if (REAL(cuCtxGetCurrent)) REAL(cuCtxGetCurrent)(&c);
  if (!REAL(cuCtxGetDevice) || REAL(cuCtxGetDevice)(&d) != CUDA_SUCCESS) d = -1;
  *dev = (int)d;
  return c;
}

CUI_EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags) {
  cui_fn_cuCtxEnablePeerAccess real = REAL(cuCtxEnablePeerAccess);
  if (!real) return CUDA_ERROR_NOT_SUPPORTED;
  CUI_FORK_FORWARD("cuCtxEnablePeerAccess", real(peerContext, Flags));
  if (!cui_gate_open()) return CUDA_ERROR_NOT_READY;
  CUresult r = real(peerContext, Flags);
  int dev;
  void *from = current_ctx(&dev);
  if (r != CUDA_SUCCESS || dev < 0) return r;
  pthread_mutex_lock(&cui_st.lock);
  int room = g_ngrants < GRANTS_MAX;
  if (room) g_grants[g_ngrants++] = (struct grant){from, peerContext, dev};
  pthread_mutex_unlock(&cui_st.lock);
  uint64_t (*maps)[2] = NULL;
  int64_t n = room ? adapter_maps_of(peerContext, &maps) : 0, done = 0;
  CUresult g = !room ? CUDA_ERROR_TOO_MANY_PEERS : n < 0 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
  for (; done < n && g == CUDA_SUCCESS; done++)
    g = grant(maps[done][0], maps[done][1], dev, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  if (g == CUDA_SUCCESS) {
    free(maps);
    return CUDA_SUCCESS;
  }
  /* undo: the grants made, the table row, the driver's enable */
  for (int64_t k = 0; k + 1 < done; k++) grant(maps[k][0], maps[k][1], dev, CU_MEM_ACCESS_FLAGS_PROT_NONE);
  free(maps);
  pthread_mutex_lock(&cui_st.lock);
  if (room) g_ngrants--;
  pthread_mutex_unlock(&cui_st.lock);
  if (REAL(cuCtxDisablePeerAccess)) REAL(cuCtxDisablePeerAccess)(peerContext);
  cui_api_warn("cuCtxEnablePeerAccess",
               "device %d (context %p) could not be granted access to the IPC adapter's memory of context %p "
               "(%lld mappings): %s; peer access was disabled again",
               dev, from, (void *)peerContext, (long long)n, cui_cu_error_name(g));
  return g;
}

CUI_EXPORT CUresult cuCtxDisablePeerAccess(CUcontext peerContext) {
  cui_fn_cuCtxDisablePeerAccess real = REAL(cuCtxDisablePeerAccess);
  if (!real) return CUDA_ERROR_NOT_SUPPORTED;
  CUI_FORK_FORWARD("cuCtxDisablePeerAccess", real(peerContext));
  if (!cui_gate_open()) return CUDA_ERROR_NOT_READY;
  CUresult r = real(peerContext);
  int dev;
  void *from = current_ctx(&dev);
  if (r != CUDA_SUCCESS || dev < 0) return r;
  int still = 0, found = 0;
  pthread_mutex_lock(&cui_st.lock);
  for (uint32_t i = 0; i < g_ngrants; i++) {
    if (!found && g_grants[i].from == from && g_grants[i].to == peerContext) {
      g_grants[i--] = g_grants[--g_ngrants];
      found = 1;
    } else if (g_grants[i].to == peerContext && g_grants[i].dev == dev) {
      still = 1;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  if (!found || still) return CUDA_SUCCESS;
  uint64_t (*maps)[2] = NULL;
  int64_t n = adapter_maps_of(peerContext, &maps);
  CUresult g = n < 0 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
  for (int64_t k = 0; k < n && g == CUDA_SUCCESS; k++) {
    g = grant(maps[k][0], maps[k][1], dev, CU_MEM_ACCESS_FLAGS_PROT_NONE);
    if (g != CUDA_SUCCESS)
      cui_api_warn("cuCtxDisablePeerAccess",
                   "device %d keeps access to the IPC adapter's mapping 0x%llx (+%llu) of context %p: %s", dev,
                   (unsigned long long)maps[k][0], (unsigned long long)maps[k][1], (void *)peerContext,
                   cui_cu_error_name(g));
  }
  free(maps);
  return g;
}
