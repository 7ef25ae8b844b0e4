/*
 * alloc_api.c: the IPC adapter's allocation side (docs/shim.md "IPC adapter"), on the API layer
 * above vmm_api.c, whose tracked wrappers it calls.
 *
 * cuMemAlloc_v2 is backed from birth by cuMemCreate (POSIX_FILE_DESCRIPTOR handle type, pinned,
 * on the device of the current context) + cuMemAddressReserve + cuMemMap + cuMemSetAccess
 * (read-write for that device), the size rounded up to the allocation granularity
 * (cuMemGetAllocationGranularity, MINIMUM). The allocation is an ordinary tracked allocation
 * (flag CUI_REC_ADAPTER, the bytes requested kept): private until cuIpcGetMemHandle shares it,
 * then a creator like any exported cuMemCreate, carried and rebuilt at the same VA by the phase
 * ops. cuMemFree_v2 unmaps, releases and frees the reservation. cuMemGetAddressRange_v2 and
 * cuPointerGetAttribute[s] answer for adapter ranges as the driver does for cuMemAlloc memory:
 * base = the returned pointer, size = the bytes requested (CUDA driver API,
 * cuMemGetAddressRange; also RANGE_* and MAPPING_* attributes), IS_LEGACY_CUDA_IPC_CAPABLE = 1
 * (0 for memory opened from another process, as the driver), MEMORY_TYPE = DEVICE, CONTEXT of
 * the context current at the allocation (or open), DEVICE_ORDINAL of the allocation's device (an
 * import: the exporter's, as the driver reports), MAPPED 1, IS_MANAGED 0,
 * ALLOWED_HANDLE_TYPES 0 (cuMemAlloc memory has none); every other pointer and attribute goes
 * to the driver.
 *
 * Also here: the driver IPC handles that pass through (ipc_api.c records them; a live one makes
 * INSPECT refuse the checkpoint, cui_ipc_inspect_fixup) and the INSPECT fields of adapter and
 * IPC allocations.
 *
 * Policy: CUINTERPOSE_IPC_ADAPTER = all (default) | off | MIN_BYTES (decimal: only allocations of
 * at least that many bytes), read once at the first cuMemAlloc_v2. Any other value is refused
 * loud (docs/decisions.md): every cuMemAlloc_v2 fails with CUDA_ERROR_INVALID_VALUE, and stderr
 * says once which variable and value, and what is accepted. Unset in a job of
 * `cuda-checkpoint --launch-job` (CUDA_CHECKPOINT_JOB_FILE set: from r610 the driver itself
 * checkpoints such a job's CUDA IPC, NVIDIA/cuda-checkpoint #56) the default is off, said once
 * on stderr: the adapter's cached export FD would make NVIDIA's own checkpoint of the job fail
 * (an open exported FD) and leave it locked. CUINTERPOSE_IPC_ADAPTER=all keeps the adapter there
 * (for a job checkpointed by cuinterpose-agent).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api.h"

#define ALLOC_REAL_OR_FAIL(var, row) \
  cui_fn_##row var = REAL(row);      \
  if (!var) return CUDA_ERROR_NOT_INITIALIZED

/* ---------- policy ---------- */

enum { POLICY_ALL, POLICY_OFF, POLICY_MIN, POLICY_BAD };
static pthread_once_t g_policy_once = PTHREAD_ONCE_INIT;
static int g_policy;
static uint64_t g_policy_min;
static char g_policy_text[64];

static void policy_read(void) {
  const char *v = getenv("CUINTERPOSE_IPC_ADAPTER");
  const char *job = getenv("CUDA_CHECKPOINT_JOB_FILE");
  if ((!v || !*v) && job && *job) {
    g_policy = POLICY_OFF;
    cui_api_warn("cuMemAlloc_v2",
                 "this process runs under cuda-checkpoint --launch-job (CUDA_CHECKPOINT_JOB_FILE=%s), whose driver "
                 "(r610+) checkpoints legacy CUDA IPC itself: the IPC adapter is off, so cuda-checkpoint can "
                 "checkpoint the job; set CUINTERPOSE_IPC_ADAPTER=all to checkpoint it with cuinterpose-agent instead",
                 job);
    return;
  }
  if (!v || !*v || !strcmp(v, "all")) {
    g_policy = POLICY_ALL;
    return;
  }
  if (!strcmp(v, "off")) {
    g_policy = POLICY_OFF;
    return;
  }
  char *end = NULL;
  errno = 0;
  unsigned long long n = strtoull(v, &end, 10);
  if (v[0] >= '0' && v[0] <= '9' && end && *end == 0 && errno == 0) {
    g_policy = POLICY_MIN;
    g_policy_min = n;
    return;
  }
  g_policy = POLICY_BAD;
  snprintf(g_policy_text, sizeof g_policy_text, "%s", v);
  cui_api_warn("cuMemAlloc_v2",
               "CUINTERPOSE_IPC_ADAPTER=\"%s\" is not all, off or a decimal byte count; every cuMemAlloc_v2 of "
               "this process fails with CUDA_ERROR_INVALID_VALUE until the variable is fixed",
               g_policy_text);
}

/* 1: back this allocation by the adapter; 0: pass through; -1: refused (bad policy). */
static int policy_wants(size_t bytes) {
  pthread_once(&g_policy_once, policy_read);
  switch (g_policy) {
    case POLICY_ALL: return 1;
    case POLICY_OFF: return 0;
    case POLICY_MIN: return bytes >= g_policy_min;
    default: return -1;
  }
}

/* ---------- driver IPC handles that pass through (they block a checkpoint) ---------- */

#define FOREIGN_MAX 64
static pthread_mutex_t g_foreign_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  uint64_t ptr;     /* exports: the pointer; imports: the VA the driver returned */
  uint8_t head[8];  /* imports: the handle's first bytes */
  int import;
} g_foreign[FOREIGN_MAX];
static uint32_t g_nforeign, g_foreign_lost;   /* lost: records beyond FOREIGN_MAX (sticky) */

void cui_ipc_foreign_add(uint64_t ptr, const uint8_t *head, int import) {
  pthread_mutex_lock(&g_foreign_lock);
  if (g_nforeign < FOREIGN_MAX) {
    g_foreign[g_nforeign].ptr = ptr;
    memset(g_foreign[g_nforeign].head, 0, 8);
    if (head) memcpy(g_foreign[g_nforeign].head, head, 8);
    g_foreign[g_nforeign].import = import;
    g_nforeign++;
  } else {
    g_foreign_lost++;
  }
  pthread_mutex_unlock(&g_foreign_lock);
}

void cui_ipc_foreign_drop(uint64_t ptr, int import) {
  pthread_mutex_lock(&g_foreign_lock);
  for (uint32_t i = 0; i < g_nforeign; i++)
    if (g_foreign[i].ptr == ptr && g_foreign[i].import == import) {
      g_foreign[i] = g_foreign[--g_nforeign];
      break;
    }
  pthread_mutex_unlock(&g_foreign_lock);
}

void cui_ipc_inspect_fixup(struct cui_record *recs, uint32_t n, int32_t *status, char *msg, size_t cap) {
  pthread_mutex_lock(&cui_st.lock);
  for (uint32_t i = 0; i < n; i++) {
    if (recs[i].kind != CUI_RECORD_ALLOCATION || !(recs[i].flags & (CUI_REC_ADAPTER | CUI_REC_IPC))) continue;
    const struct cui_alloc *a = cui_alloc_by_id(recs[i].creator_pid, recs[i].alloc_id);
    if (!a) continue;
    recs[i].reserved[0] = a->req_size;
    recs[i].reserved[1] = a->ipc_opens;
  }
  pthread_mutex_unlock(&cui_st.lock);
  pthread_mutex_lock(&g_foreign_lock);
  if ((g_nforeign || g_foreign_lost) && *status == CUI_OK) {
    unsigned pid = (unsigned)getpid(), others = g_nforeign ? g_nforeign - 1 + g_foreign_lost : g_foreign_lost;
    char more[64] = "";
    if (others && g_nforeign) snprintf(more, sizeof more, " (and %u more driver IPC handles)", others);
    *status = CUI_REFUSED_STATE;
    if (!g_nforeign) {
      snprintf(msg, cap,
               "INSPECT: pid %u used %u driver CUDA IPC handles (not the shim's; more than %d, no longer "
               "counted one by one): native checkpoint cannot carry IPC memory; restart it with "
               "CUINTERPOSE_IPC_ADAPTER=all",
               pid, others, FOREIGN_MAX);
    } else if (g_foreign[0].import) {
      const uint8_t *h = g_foreign[0].head;
      snprintf(msg, cap,
               "INSPECT: pid %u opened a driver CUDA IPC handle %02x%02x%02x%02x%02x%02x%02x%02x... at 0x%llx%s (not a "
               "cuinterpose handle: its memory was not allocated under the IPC adapter); native checkpoint cannot "
               "carry IPC memory: close it, or run the exporter with the shim and CUINTERPOSE_IPC_ADAPTER=all",
               pid, h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], (unsigned long long)g_foreign[0].ptr, more);
    } else {
      snprintf(msg, cap,
               "INSPECT: pid %u exported pointer 0x%llx%s through the driver's cuIpcGetMemHandle (memory not "
               "allocated under the IPC adapter); native checkpoint cannot carry IPC memory: free it, or allocate "
               "it with CUINTERPOSE_IPC_ADAPTER covering its size",
               pid, (unsigned long long)g_foreign[0].ptr, more);
    }
  }
  pthread_mutex_unlock(&g_foreign_lock);
}

/* ---------- lookups ---------- */

int cui_adapter_find(uint64_t p, struct cui_adapter_range *out) {
  if (!cui_maybe_tracked(p, 1)) return 0;
  int found = 0;
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mapping *m = cui_map_containing(p);
  if (m) {
    const struct cui_alloc *a = &cui_st.allocs[m->alloc];
    if (a->flags & CUI_REC_ADAPTER) {
      out->va = m->va;
      out->mapped = m->size;
      out->requested = a->req_size;
      out->vhandle = a->vhandle;
      out->ctx = a->adapter_ctx;
      out->device = a->adapter_dev;
      out->importer = a->role == CUI_ROLE_IMPORTER;
      found = 1;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return found;
}

int cui_current_device(int *dev) {
  cui_fn_cuCtxGetDevice get = REAL(cuCtxGetDevice);
  CUdevice d;
  CUresult r = get ? get(&d) : CUDA_ERROR_NOT_INITIALIZED;
  if (r == CUDA_SUCCESS) *dev = (int)d;
  return (int)r;
}

void cui_adapter_mark(uint64_t vh, uint64_t requested, int dev, uint64_t ipc_va) {
  CUcontext ctx = NULL;
  cui_fn_cuCtxGetCurrent cur = REAL(cuCtxGetCurrent);
  if (cur) cur(&ctx);
  pthread_mutex_lock(&cui_st.lock);
  struct cui_alloc *a = cui_alloc_by_vhandle(vh);
  if (a) {
    a->flags |= CUI_REC_ADAPTER | (ipc_va ? CUI_REC_IPC : 0);
    a->req_size = requested;
    a->adapter_ctx = ctx;
    a->adapter_dev = ipc_va ? a->prop.location.id : dev;   /* an import: the exporter's device */
    if (ipc_va) {
      a->ipc_va = ipc_va;
      a->ipc_opens = 1;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
}

/* Reserve `size` bytes, map `vh` there and grant read-write access to `dev`; undoes itself on
 * failure. */
CUresult cui_adapter_map(uint64_t vh, size_t size, size_t align, int dev, CUdeviceptr *va) {
  CUdeviceptr p = 0;
  CUresult r = cuMemAddressReserve(&p, size, align, 0, 0);
  if (r != CUDA_SUCCESS) return r;
  r = cuMemMap(p, size, 0, vh, 0);
  if (r != CUDA_SUCCESS) {
    cuMemAddressFree(p, size);
    return r;
  }
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = dev;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = cuMemSetAccess(p, size, &acc, 1);
  if (r != CUDA_SUCCESS) {
    cuMemUnmap(p, size);
    cuMemAddressFree(p, size);
    return r;
  }
  *va = p;
  return CUDA_SUCCESS;
}

/* ---------- cuMemAlloc_v2 / cuMemFree_v2 ---------- */

CUI_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
  ALLOC_REAL_OR_FAIL(real, cuMemAlloc_v2);
  CUI_FORK_FORWARD("cuMemAlloc_v2", real(dptr, bytesize));
  if (!dptr || bytesize == 0) return real(dptr, bytesize);   /* the driver's own answer */
  int want = policy_wants(bytesize);
  if (want < 0) return CUDA_ERROR_INVALID_VALUE;
  if (want == 0) return real(dptr, bytesize);
  cui_fn_cuMemGetAllocationGranularity gran = REAL(cuMemGetAllocationGranularity);
  if (!gran) return real(dptr, bytesize);
  int dev = 0;
  CUresult r = (CUresult)cui_current_device(&dev);
  if (r != CUDA_SUCCESS) return r;   /* no current context: what cuMemAlloc answers too */
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t g = 0;
  r = gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) return r;
  if (g == 0) g = 1;
  if (bytesize > SIZE_MAX - (g - 1)) return CUDA_ERROR_OUT_OF_MEMORY;
  size_t size = (bytesize + g - 1) / g * g;
  CUmemGenericAllocationHandle vh;
  r = cuMemCreate(&vh, size, &prop, 0);
  if (r != CUDA_SUCCESS) return r;
  CUdeviceptr va;
  r = cui_adapter_map(vh, size, g, dev, &va);
  if (r != CUDA_SUCCESS) {
    cuMemRelease(vh);
    return r;
  }
  cui_adapter_mark(vh, bytesize, dev, 0);
  CUcontext ctx = NULL;
  if (REAL(cuCtxGetCurrent)) REAL(cuCtxGetCurrent)(&ctx);
  r = cui_peer_grant_new(va, size, ctx);   /* devices with peer access to this context (peer_access.c) */
  if (r != CUDA_SUCCESS) {
    cuMemFree_v2(va);
    return r;
  }
  *dptr = va;
  return CUDA_SUCCESS;
}

CUI_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
  ALLOC_REAL_OR_FAIL(real, cuMemFree_v2);
  CUI_FORK_FORWARD("cuMemFree_v2", real(dptr));
  struct cui_adapter_range ar;
  if (!cui_adapter_find(dptr, &ar) || ar.importer) {
    CUresult r = real(dptr);
    if (r == CUDA_SUCCESS) cui_ipc_foreign_drop(dptr, 0);
    return r;
  }
  if (ar.va != dptr) {   /* inside an allocation, not its start: the driver refuses it too */
    cui_api_warn("cuMemFree_v2",
                 "address 0x%llx is inside the allocation at 0x%llx, not its start: CUDA_ERROR_INVALID_VALUE",
                 (unsigned long long)dptr, (unsigned long long)ar.va);
    return CUDA_ERROR_INVALID_VALUE;
  }
  CUresult r = cuMemUnmap(ar.va, ar.mapped);
  if (r != CUDA_SUCCESS) return r;
  cuMemRelease(ar.vhandle);
  return cuMemAddressFree(ar.va, ar.mapped);
}

/* ---------- address range and pointer attributes ---------- */

CUI_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
  ALLOC_REAL_OR_FAIL(real, cuMemGetAddressRange_v2);
  CUI_FORK_FORWARD("cuMemGetAddressRange_v2", real(pbase, psize, dptr));
  struct cui_adapter_range ar;
  if (!cui_adapter_find(dptr, &ar)) return real(pbase, psize, dptr);
  if (pbase) *pbase = ar.va;
  if (psize) *psize = (size_t)ar.requested;
  return CUDA_SUCCESS;
}

/* The adapter's answer for one attribute of an adapter range: 1 answered, 0 ask the driver. */
static int adapter_attribute(void *data, CUpointer_attribute attr, CUdeviceptr ptr,
                             const struct cui_adapter_range *ar) {
  switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
      if (!ar->ctx) return 0;
      *(CUcontext *)data = (CUcontext)ar->ctx;
      return 1;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *(int *)data = !ar->importer; return 1;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: *(CUdeviceptr *)data = ar->va; return 1;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE: *(size_t *)data = (size_t)ar->requested; return 1;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; return 1;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; return 1;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = ar->device; return 1;
    case CU_POINTER_ATTRIBUTE_MAPPED: *(int *)data = 1; return 1;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)data = 0; return 1;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: *(unsigned long long *)data = CU_MEM_HANDLE_TYPE_NONE; return 1;
    default: return 0;
  }
}

/* The driver's answer; CUDA_ERROR_NOT_SUPPORTED when the driver has no cuPointerGetAttribute. */
static CUresult real_attribute(void *data, CUpointer_attribute attr, CUdeviceptr ptr) {
  cui_fn_cuPointerGetAttribute real = REAL(cuPointerGetAttribute);
  return real ? real(data, attr, ptr) : CUDA_ERROR_NOT_SUPPORTED;
}

CUI_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  CUI_FORK_FORWARD("cuPointerGetAttribute", real_attribute(data, attribute, ptr));
  struct cui_adapter_range ar;
  if (!data || !cui_adapter_find(ptr, &ar)) return real_attribute(data, attribute, ptr);
  return adapter_attribute(data, attribute, ptr, &ar) ? CUDA_SUCCESS : real_attribute(data, attribute, ptr);
}

CUI_EXPORT CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                           CUdeviceptr ptr) {
  cui_fn_cuPointerGetAttributes real = REAL(cuPointerGetAttributes);
  CUI_FORK_FORWARD("cuPointerGetAttributes",
                   real ? real(numAttributes, attributes, data, ptr) : CUDA_ERROR_NOT_SUPPORTED);
  struct cui_adapter_range ar;
  if (!attributes || !data || !cui_adapter_find(ptr, &ar))
    return real ? real(numAttributes, attributes, data, ptr) : CUDA_ERROR_NOT_SUPPORTED;
  for (unsigned int i = 0; i < numAttributes; i++) {
    if (!data[i] || adapter_attribute(data[i], attributes[i], ptr, &ar)) continue;
    CUresult r = real_attribute(data[i], attributes[i], ptr);
    if (r != CUDA_SUCCESS) return r;
  }
  return CUDA_SUCCESS;
}
