/*
 * share_api.c: what real stacks share besides the memory the shim carries, on the API layer
 * (docs/shim.md "What real stacks share"): refused, carried or named.
 *
 * - Stream-ordered pool IPC (CUDA driver API "Stream Ordered Memory Allocator":
 *   cuMemPoolExportToShareableHandle, cuMemPoolImportFromShareableHandle,
 *   cuMemPoolExportPointer, cuMemPoolImportPointer) passes through; every call that succeeds is
 *   remembered, and INSPECT refuses the capture naming pid, pool or pointer and why: the shim
 *   does not track pools and native checkpoint cannot carry a pool shared between processes
 *   (fakecuda refuses it; scripts/gpu_check_share.py asks the driver).
 * - cuMemHostRegister over shared host memory (NCCL's SHM fallback registers its unlinked
 *   /dev/shm/nccl-* mappings PORTABLE | DEVICEMAP, src/misc/shmutils.cc): remembered with its
 *   flags and context; PREPARE_UNICAST unregisters it (native checkpoint is silent on such
 *   registrations; fakecuda refuses them) and LOAD_ALLOCATIONS registers it again at the same
 *   address, once CRIU restored the mapping. Private host memory is left alone.
 * - FABRIC refusals: one rate-limited line naming pid, call and the fallback (the answer stays
 *   CUDA_ERROR_NOT_SUPPORTED: NCCL, PyTorch and vLLM fall back to POSIX FDs on exactly it).
 * - INSPECT's refusals for all of them, and for a process whose dlsym is another library's.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api.h"

/* ---------- FABRIC ---------- */

static pthread_mutex_t g_fabric_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  const char *api;
  uint64_t n;
} g_fabric[8];

void cui_fabric_refused(const char *api, const char *what) {
  pthread_mutex_lock(&g_fabric_lock);
  uint64_t n = 0;
  for (int i = 0; i < 8; i++)
    if (!g_fabric[i].api || !strcmp(g_fabric[i].api, api)) {
      g_fabric[i].api = api;
      n = ++g_fabric[i].n;
      break;
    }
  pthread_mutex_unlock(&g_fabric_lock);
  uint64_t p = 1;
  while (p < n && p <= UINT64_MAX / 10) p *= 10;
  if (p != n) return; /* the 1st, 10th, 100th, ... refusal of this call */
  cui_api_warn(api,
               "%s: FABRIC handles cannot be rebuilt after a restore, so the shim refuses them with "
               "CUDA_ERROR_NOT_SUPPORTED; NCCL, PyTorch (expandable segments, symmetric memory) and vLLM fall back "
               "to POSIX file descriptors on that answer (refusal %llu of this call; the next line at refusal %llu)",
               what, (unsigned long long)n, (unsigned long long)(n * 10));
}

/* ---------- pool IPC (remembered; INSPECT refuses) ---------- */

enum { POOL_EXPORT, POOL_IMPORT, PTR_EXPORT, PTR_IMPORT };
static const char *const k_pool_what[] = {"exported memory pool", "imported memory pool", "exported pool pointer",
                                          "imported pool pointer"};
static const char *const k_pool_api[] = {"cuMemPoolExportToShareableHandle", "cuMemPoolImportFromShareableHandle",
                                         "cuMemPoolExportPointer", "cuMemPoolImportPointer"};
static pthread_mutex_t g_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  int kind;
  uint64_t obj;
} g_pool_first;
static uint32_t g_npool;

static void pool_used(int kind, uint64_t obj) {
  pthread_mutex_lock(&g_pool_lock);
  if (g_npool++ == 0) {
    g_pool_first.kind = kind;
    g_pool_first.obj = obj;
  }
  pthread_mutex_unlock(&g_pool_lock);
}

#define SHARE_REAL_OR(var, row) \
  cui_fn_##row var = REAL(row); \
  if (!var) return CUDA_ERROR_NOT_SUPPORTED

CUI_EXPORT CUresult cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool,
                                                     CUmemAllocationHandleType handleType, unsigned long long flags) {
  SHARE_REAL_OR(real, cuMemPoolExportToShareableHandle);
  CUresult r = real(handle_out, pool, handleType, flags);
  if (r == CUDA_SUCCESS && !cui_forked) pool_used(POOL_EXPORT, (uint64_t)(uintptr_t)pool);
  return r;
}

CUI_EXPORT CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle,
                                                       CUmemAllocationHandleType handleType, unsigned long long flags) {
  SHARE_REAL_OR(real, cuMemPoolImportFromShareableHandle);
  CUresult r = real(pool_out, handle, handleType, flags);
  if (r == CUDA_SUCCESS && pool_out && !cui_forked) pool_used(POOL_IMPORT, (uint64_t)(uintptr_t)*pool_out);
  return r;
}

CUI_EXPORT CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *shareData_out, CUdeviceptr ptr) {
  SHARE_REAL_OR(real, cuMemPoolExportPointer);
  CUresult r = real(shareData_out, ptr);
  if (r == CUDA_SUCCESS && !cui_forked) pool_used(PTR_EXPORT, ptr);
  return r;
}

CUI_EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool, CUmemPoolPtrExportData *shareData) {
  SHARE_REAL_OR(real, cuMemPoolImportPointer);
  CUresult r = real(ptr_out, pool, shareData);
  if (r == CUDA_SUCCESS && ptr_out && !cui_forked) pool_used(PTR_IMPORT, *ptr_out);
  return r;
}

/* ---------- registrations of shared host memory ---------- */

struct hostreg {
  void *p;
  size_t size;
  unsigned flags;
  CUcontext ctx;
  int registered;          /* 0 between PREPARE_UNICAST and LOAD_ALLOCATIONS */
  char path[128];          /* the shared mapping, as /proc/self/maps names it */
};
#define HOSTREG_MAX 256
static pthread_mutex_t g_hr_lock = PTHREAD_MUTEX_INITIALIZER;
static struct hostreg g_hr[HOSTREG_MAX];
static uint32_t g_nhr;

/* 1 when [p, p+size) overlaps a MAP_SHARED mapping (/proc/self/maps flags "s"), its path in `path`. */
static int shared_mapping(uintptr_t p, size_t size, char *path, size_t cap) {
  FILE *f = fopen("/proc/self/maps", "re");
  char line[512];
  int found = 0;
  while (f && !found && fgets(line, sizeof line, f)) {
    unsigned long a, b;
    char perms[8] = "";
    int off = 0;
    if (sscanf(line, "%lx-%lx %7s %*s %*s %*s%n", &a, &b, perms, &off) < 3 || perms[3] != 's' || b <= p ||
        a >= p + size)
      continue;
    const char *q = line + off;
    while (*q == ' ') q++;
    snprintf(path, cap, "%s", q);
    path[strcspn(path, "\n")] = 0;
    found = 1;
  }
  if (f) fclose(f);
  return found;
}

static CUresult host_register(cui_fn_cuMemHostRegister_v2 real, const char *api, void *p, size_t size, unsigned flags) {
  if (!real) return CUDA_ERROR_NOT_SUPPORTED;
  CUI_FORK_FORWARD(api, real(p, size, flags));
  char path[128];
  if (!p || !size || !shared_mapping((uintptr_t)p, size, path, sizeof path)) return real(p, size, flags);
  if (!cui_gate_open()) return CUDA_ERROR_NOT_READY;
  CUresult r = real(p, size, flags);
  if (r != CUDA_SUCCESS) return r;
  CUcontext ctx = NULL;
  if (REAL(cuCtxGetCurrent)) REAL(cuCtxGetCurrent)(&ctx);
  pthread_mutex_lock(&g_hr_lock);
  if (g_nhr < HOSTREG_MAX)
    g_hr[g_nhr++] = (struct hostreg){.p = p, .size = size, .flags = flags, .ctx = ctx, .registered = 1};
  else r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) snprintf(g_hr[g_nhr - 1].path, sizeof g_hr[g_nhr - 1].path, "%s", path);
  pthread_mutex_unlock(&g_hr_lock);
  if (r != CUDA_SUCCESS) {
    cui_api_warn(api, "more than %d registrations of shared host memory (%p, %zu bytes, %s): CUDA_ERROR_OUT_OF_MEMORY",
                 HOSTREG_MAX, p, size, path);
    if (REAL(cuMemHostUnregister)) REAL(cuMemHostUnregister)(p);
  }
  return r;
}

CUI_EXPORT CUresult cui_cuMemHostRegister_v1(void *p, size_t bytesize, unsigned int Flags) {
  return host_register((cui_fn_cuMemHostRegister_v2)REAL(cuMemHostRegister), "cuMemHostRegister", p, bytesize, Flags);
}

CUI_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
  return host_register(REAL(cuMemHostRegister_v2), "cuMemHostRegister_v2", p, bytesize, Flags);
}

CUI_EXPORT CUresult cuMemHostUnregister(void *p) {
  cui_fn_cuMemHostUnregister real = REAL(cuMemHostUnregister);
  if (!real) return CUDA_ERROR_NOT_SUPPORTED;
  CUI_FORK_FORWARD("cuMemHostUnregister", real(p));
  pthread_mutex_lock(&g_hr_lock);
  int64_t at = -1;
  for (uint32_t i = 0; i < g_nhr && at < 0; i++)
    if (g_hr[i].p == p) at = i;
  pthread_mutex_unlock(&g_hr_lock);
  if (at < 0) return real(p);
  if (!cui_gate_open()) return CUDA_ERROR_NOT_READY;
  CUresult r = real(p);
  if (r == CUDA_SUCCESS) {
    pthread_mutex_lock(&g_hr_lock);
    for (uint32_t i = 0; i < g_nhr; i++)
      if (g_hr[i].p == p) {
        g_hr[i] = g_hr[--g_nhr];
        break;
      }
    pthread_mutex_unlock(&g_hr_lock);
  }
  return r;
}

static int hr_fail(char *msg, size_t cap, const char *op, const struct hostreg *h, const char *what, CUresult r) {
  snprintf(msg, cap, "%s: pid %u registration of shared host memory %p (%zu bytes, flags 0x%x, %s): %s failed: %s", op,
           (unsigned)getpid(), h->p, h->size, h->flags, h->path, what, cui_cu_error_name(r));
  return -1;
}

int cui_hostreg_teardown(char *msg, size_t cap, uint32_t *changed) {
  pthread_mutex_lock(&g_hr_lock);
  int rc = 0;
  for (uint32_t i = 0; i < g_nhr && rc == 0; i++) {
    if (!g_hr[i].registered) continue;
    if (g_hr[i].ctx && REAL(cuCtxSetCurrent)) REAL(cuCtxSetCurrent)(g_hr[i].ctx);
    CUresult r = REAL(cuMemHostUnregister)(g_hr[i].p);
    if (r != CUDA_SUCCESS) rc = hr_fail(msg, cap, "PREPARE_UNICAST", &g_hr[i], "cuMemHostUnregister", r);
    else g_hr[i].registered = 0, (*changed)++;
  }
  pthread_mutex_unlock(&g_hr_lock);
  return rc;
}

int cui_hostreg_restore(char *msg, size_t cap, uint32_t *changed) {
  pthread_mutex_lock(&g_hr_lock);
  int rc = 0;
  for (uint32_t i = 0; i < g_nhr && rc == 0; i++) {
    if (g_hr[i].registered) continue;
    if (g_hr[i].ctx && REAL(cuCtxSetCurrent)) REAL(cuCtxSetCurrent)(g_hr[i].ctx);
    CUresult r = REAL(cuMemHostRegister_v2)(g_hr[i].p, g_hr[i].size, g_hr[i].flags);
    if (r != CUDA_SUCCESS) rc = hr_fail(msg, cap, "LOAD_ALLOCATIONS", &g_hr[i], "cuMemHostRegister", r);
    else g_hr[i].registered = 1, (*changed)++;
  }
  pthread_mutex_unlock(&g_hr_lock);
  return rc;
}

/* ---------- INSPECT ---------- */

void cui_share_inspect_fixup(int32_t *status, char *msg, size_t cap) {
  if (*status != CUI_OK) return;
  unsigned pid = (unsigned)getpid();
  char who[256];
  if (cui_dlsym_foreign(who, sizeof who)) {
    *status = CUI_REFUSED_STATE;
    snprintf(msg, cap,
             "INSPECT: pid %u: dlsym resolves to %s, not to libcuinterpose: lookups through it (dlsym, "
             "cuGetProcAddress, ctypes) bypass the shim, so this process may hold CUDA memory the checkpoint "
             "would miss; nothing was changed: put libcuinterpose.so first in LD_PRELOAD",
             pid, who);
    return;
  }
  uint32_t live, opened;
  cui_events_inspect(status, msg, cap, &live, &opened);
  if (*status != CUI_OK) return;
  pthread_mutex_lock(&g_pool_lock);
  if (g_npool) {
    *status = CUI_REFUSED_STATE;
    int k = g_pool_first.kind;
    snprintf(msg, cap,
             "INSPECT: pid %u %s 0x%llx (%s)%s: memory shared through stream-ordered pool IPC is not tracked by "
             "cuinterpose and native checkpoint cannot carry a pool shared between processes; nothing was "
             "changed: share it with cuMemCreate and POSIX file descriptors, or cudaMalloc and CUDA IPC",
             pid, k_pool_what[k], (unsigned long long)g_pool_first.obj, k_pool_api[k],
             g_npool > 1 ? ", and more pool IPC calls" : "");
  }
  pthread_mutex_unlock(&g_pool_lock);
}
