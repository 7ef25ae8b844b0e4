/*
 * vmm_api.c: the tracked VMM wrappers (docs/shim.md "Object model"), on the state layer.
 *
 * A driver handle carrying the virtual tag is released and refused (CUDA_ERROR_INVALID_HANDLE).
 * The last cuMemRelease of a virtual handle releases the one driver reference. Untagged handles
 * and untracked address ranges are forwarded untouched; a range outside the bounds of every
 * mapping record (map_lo/map_hi, read without the lock) is untracked at once. While the shim
 * is not ACTIVE (or a phase op owns the state) tracked calls return CUDA_ERROR_NOT_READY
 * without calling the driver. Multicast handles and ranges branch into multicast_api.c.
 *
 * Locking: cui_st.lock is held across the ordinary VMM driver calls here (none waits on a
 * peer). The one call that waits on a peer, the FETCH_FD round trip of an import (peer.c),
 * runs with the lock dropped and the call counted in cui_st.inflight.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api.h"

#define REAL_OR_FAIL(var, row)  \
  cui_fn_##row var = REAL(row); \
  if (!var) return CUDA_ERROR_NOT_INITIALIZED

/* ---------- cuMemCreate / Release / Retain ---------- */

CUI_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags) {
  REAL_OR_FAIL(real, cuMemCreate);
  CUI_FORK_FORWARD("cuMemCreate", real(handle, size, prop, flags));
  if (!prop || !handle) return real(handle, size, prop, flags);
  /* Only "no export" and POSIX FDs can be carried across a restore: refuse the rest (FABRIC,
   * combinations) before the driver sees the call, output untouched. */
  if (prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE &&
      prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    char what[96];
    snprintf(what, sizeof what, "requested handle types 0x%x", (unsigned)prop->requestedHandleTypes);
    if (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC)
      cui_fabric_refused("cuMemCreate", what);   /* rate-limited, names the fallback */
    else
      cui_api_warn("cuMemCreate",
                   "%s refused (only 0 or POSIX_FILE_DESCRIPTOR can be rebuilt after a checkpoint): "
                   "CUDA_ERROR_NOT_SUPPORTED",
                   what);
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  pthread_mutex_lock(&cui_st.lock);
  if (!cui_gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  CUmemGenericAllocationHandle h;
  CUresult r = real(&h, size, prop, flags);
  if (r == CUDA_SUCCESS) {
    uint8_t id[16];
    cui_random_id(id);
    struct cui_alloc *a = CUI_IS_VHANDLE(h) ? NULL : cui_alloc_new(id, (uint32_t)getpid());
    if (!a) {
      REAL(cuMemRelease)(h);
      r = CUI_IS_VHANDLE(h) ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_OUT_OF_MEMORY;
      if (CUI_IS_VHANDLE(h))
        cui_api_warn("cuMemCreate",
                     "the driver returned handle 0x%llx, which carries the shim's tag 0x%llx; "
                     "released it: CUDA_ERROR_INVALID_HANDLE",
                     (unsigned long long)h, CUI_VHANDLE_TAG);
    } else {
      a->role = CUI_ROLE_PRIVATE;
      a->prop = *prop;
      a->size = size;
      a->real = h;
      a->has_real = 1;
      a->vrefs = 1;
      *handle = a->vhandle;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  REAL_OR_FAIL(real, cuMemRelease);
  CUI_FORK_FORWARD("cuMemRelease", real(handle));
  if (!CUI_IS_VHANDLE(handle)) return real(handle);
  if (cui_mc_is_handle(handle)) return cui_mc_release(handle);
  pthread_mutex_lock(&cui_st.lock);
  CUresult r = CUDA_SUCCESS;
  struct cui_alloc *a = cui_alloc_by_vhandle(handle);
  if (!cui_gate_open()) {
    r = CUDA_ERROR_NOT_READY;
  } else if (!a || a->vrefs == 0) {
    /* Releasing a handle more often than it was obtained is not defined by the CUDA driver API
     * (cuMemRelease): refuse, no driver call. */
    cui_api_warn("cuMemRelease",
                 "virtual handle 0x%llx has no references left (released %s); no driver call: "
                 "CUDA_ERROR_INVALID_VALUE",
                 (unsigned long long)handle, a ? "more often than obtained, still mapped" : "already, or never issued");
    r = CUDA_ERROR_INVALID_VALUE;
  } else if (a->vrefs == 1 && a->has_real) {
    r = real(a->real);   /* the last virtual reference: the one driver reference goes */
    if (r == CUDA_SUCCESS) {
      a->has_real = 0;
      a->vrefs = 0;
      cui_maybe_destroy(a);
    }
  } else if (--a->vrefs == 0) {
    cui_maybe_destroy(a);
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
  REAL_OR_FAIL(real, cuMemRetainAllocationHandle);
  CUI_FORK_FORWARD("cuMemRetainAllocationHandle", real(handle, addr));
  uint64_t p = (uint64_t)(uintptr_t)addr;
  CUresult mr;
  if (cui_mc_retain(p, handle, &mr)) return mr;   /* a multicast VA: the object's virtual handle */
  struct cui_mapping *m = NULL;
  if (cui_maybe_tracked(p, 1)) {
    pthread_mutex_lock(&cui_st.lock);
    m = cui_map_containing(p);   /* mapped, or torn down by PREPARE_UNICAST */
    if (!m || (m->mapped == 0 && cui_gate_open())) {
      pthread_mutex_unlock(&cui_st.lock);
      m = NULL;
    }
  }
  if (!m) {   /* untracked: the driver's handle, unless it collides with the virtual tag */
    if (!handle) return real(handle, addr);
    CUmemGenericAllocationHandle h;
    CUresult r = real(&h, addr);
    if (r == CUDA_SUCCESS && CUI_IS_VHANDLE(h)) {
      cui_api_warn("cuMemRetainAllocationHandle",
                   "address 0x%llx: the driver returned handle 0x%llx, which "
                   "carries the shim's tag 0x%llx; released it: CUDA_ERROR_INVALID_HANDLE",
                   (unsigned long long)p, (unsigned long long)h, CUI_VHANDLE_TAG);
      REAL(cuMemRelease)(h);
      r = CUDA_ERROR_INVALID_HANDLE;
    } else if (r == CUDA_SUCCESS) {
      *handle = h;
    }
    return r;
  }
  CUresult r = CUDA_SUCCESS;
  struct cui_alloc *a = &cui_st.allocs[m->alloc];
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!handle) r = CUDA_ERROR_INVALID_VALUE;
  else if (a->vrefs > 0) {
    a->vrefs++;
    *handle = a->vhandle;
  } else {
    CUmemGenericAllocationHandle h;
    r = real(&h, addr);
    if (r == CUDA_SUCCESS) {
      a->real = h;
      a->has_real = 1;
      a->vrefs = 1;
      *handle = a->vhandle;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* ---------- cuMemMap / Unmap / SetAccess ---------- */

CUI_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags) {
  REAL_OR_FAIL(real, cuMemMap);
  CUI_FORK_FORWARD("cuMemMap", real(ptr, size, offset, handle, flags));
  if (!CUI_IS_VHANDLE(handle)) return real(ptr, size, offset, handle, flags);
  if (cui_mc_is_handle(handle)) return cui_mc_map(ptr, size, offset, handle, flags);
  pthread_mutex_lock(&cui_st.lock);
  CUresult r;
  struct cui_alloc *a = cui_alloc_by_vhandle(handle);
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!a || !a->has_real) {
    cui_api_warn("cuMemMap",
                 "virtual handle 0x%llx is not a live allocation handle (released?): "
                 "CUDA_ERROR_INVALID_VALUE",
                 (unsigned long long)handle);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    r = real(ptr, size, offset, a->real, flags);
    if (r == CUDA_SUCCESS && !cui_map_add(a, ptr, size, offset)) {
      REAL(cuMemUnmap)(ptr, size);   /* an unrecorded mapping could not be restored */
      r = CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  REAL_OR_FAIL(real, cuMemUnmap);
  CUI_FORK_FORWARD("cuMemUnmap", real(ptr, size));
  if (__atomic_load_n(&cui_st.mc_maps, __ATOMIC_RELAXED) && cui_mc_range(ptr, size)) return cui_mc_unmap(ptr, size);
  if (!cui_maybe_tracked(ptr, size)) return real(ptr, size);
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mapping *first = cui_map_first(ptr, size);
  if (!first) {
    pthread_mutex_unlock(&cui_st.lock);
    return real(ptr, size);
  }
  CUresult r = CUDA_SUCCESS;
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  /* Only whole mappings may be unmapped (CUDA driver API, cuMemUnmap: "the entire contiguous
   * address range that was mapped"); refused before the driver, so a
   * driver that accepted a partial unmap could not leave a record describing a half mapping. */
  CUI_FOR_MAPS_IN(m, ptr, size) {
    if (r != CUDA_SUCCESS) break;
    if (m->va < ptr || cui_range_end(m->va, m->size) > cui_range_end(ptr, size)) {
      cui_api_warn("cuMemUnmap",
                   "range 0x%llx+0x%llx covers only part of the mapping 0x%llx+0x%llx (virtual "
                   "handle 0x%llx); no driver call: CUDA_ERROR_INVALID_VALUE",
                   (unsigned long long)ptr, (unsigned long long)size, (unsigned long long)m->va,
                   (unsigned long long)m->size, (unsigned long long)cui_st.allocs[m->alloc].vhandle);
      r = CUDA_ERROR_INVALID_VALUE;
    }
  }
  if (r == CUDA_SUCCESS) r = real(ptr, size);
  if (r == CUDA_SUCCESS) {
    struct cui_mapping *m = cui_map_first(ptr, size);
    while (m) {
      struct cui_mapping *next = cui_map_next(m, ptr, size);
      cui_map_remove(m);
      m = next;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  REAL_OR_FAIL(real, cuMemSetAccess);
  CUI_FORK_FORWARD("cuMemSetAccess", real(ptr, size, desc, count));
  if (desc && count && __atomic_load_n(&cui_st.mc_maps, __ATOMIC_RELAXED) && cui_mc_range(ptr, size))
    return cui_mc_set_access(ptr, size, desc, count);
  if (!desc || count == 0 || !cui_maybe_tracked(ptr, size)) return real(ptr, size, desc, count);
  pthread_mutex_lock(&cui_st.lock);
  if (!cui_map_first(ptr, size)) {
    pthread_mutex_unlock(&cui_st.lock);
    return real(ptr, size, desc, count);
  }
  CUresult r = CUDA_SUCCESS;
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  /* Refused before the driver: a range covering only part of a tracked mapping (its access
   * could not be replayed exactly), and more than CUI_MAX_ACCESS locations per mapping. A range
   * spanning several whole mappings is fine: each records the grant. */
  CUI_FOR_MAPS_IN(m, ptr, size) {
    if (r != CUDA_SUCCESS) break;
    if (m->va < ptr || cui_range_end(m->va, m->size) > cui_range_end(ptr, size)) {
      cui_api_warn("cuMemSetAccess",
                   "range 0x%llx+0x%llx covers only part of the mapping 0x%llx+0x%llx (virtual "
                   "handle 0x%llx); its access could not be replayed after a restore: CUDA_ERROR_NOT_SUPPORTED",
                   (unsigned long long)ptr, (unsigned long long)size, (unsigned long long)m->va,
                   (unsigned long long)m->size, (unsigned long long)cui_st.allocs[m->alloc].vhandle);
      r = CUDA_ERROR_NOT_SUPPORTED;
      break;
    }
    uint32_t n = cui_access_count_after(m->access, m->access_count, desc, count);
    if (n > CUI_MAX_ACCESS) {
      cui_api_warn("cuMemSetAccess",
                   "mapping 0x%llx+0x%llx (virtual handle 0x%llx) would have %u access "
                   "locations, more than the %d the shim records; no driver call: CUDA_ERROR_NOT_SUPPORTED",
                   (unsigned long long)m->va, (unsigned long long)m->size,
                   (unsigned long long)cui_st.allocs[m->alloc].vhandle, n, CUI_MAX_ACCESS);
      r = CUDA_ERROR_NOT_SUPPORTED;
    }
  }
  if (r == CUDA_SUCCESS) r = real(ptr, size, desc, count);
  if (r == CUDA_SUCCESS) {
    CUI_FOR_MAPS_IN(m, ptr, size) cui_access_merge(m->access, &m->access_count, desc, count);
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* ---------- export / import ---------- */

CUI_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType, unsigned long long flags) {
  REAL_OR_FAIL(real, cuMemExportToShareableHandle);
  CUI_FORK_FORWARD("cuMemExportToShareableHandle", real(shareableHandle, handle, handleType, flags));
  if (!CUI_IS_VHANDLE(handle)) return real(shareableHandle, handle, handleType, flags);
  if (cui_mc_is_handle(handle)) return cui_mc_export(shareableHandle, handle, handleType, flags);
  pthread_mutex_lock(&cui_st.lock);
  CUresult r = CUDA_SUCCESS;
  struct cui_alloc *a = cui_alloc_by_vhandle(handle);
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!a || a->vrefs == 0 || !a->has_real || !shareableHandle) r = CUDA_ERROR_INVALID_VALUE;
  else if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    r = CUDA_ERROR_NOT_SUPPORTED;
    if (handleType == CU_MEM_HANDLE_TYPE_FABRIC)
      cui_fabric_refused("cuMemExportToShareableHandle", "export as a FABRIC handle");
  } else if (flags != 0) r = CUDA_ERROR_INVALID_VALUE;
  else if (a->flags & CUI_REC_RAW_IMPORT) {
    r = real(shareableHandle, a->real, handleType, flags);   /* untracked sharing: passes through */
  } else {
    if (a->role != CUI_ROLE_IMPORTER && !cui_cache_has(a->id)) {
      int fd = -1;
      r = real(&fd, a->real, handleType, 0);
      if (r == CUDA_SUCCESS) {
        fcntl(fd, F_SETFD, FD_CLOEXEC);
        if (cui_cache_put(a->id, fd) != 0) {
          close(fd);
          r = CUDA_ERROR_OUT_OF_MEMORY;
        }
      }
    }
    if (r == CUDA_SUCCESS) {
      int t = cui_alloc_ticket(a);
      if (t < 0) r = CUDA_ERROR_OUT_OF_MEMORY;
      else {
        *(int *)shareableHandle = t;
        a->flags |= CUI_REC_EXPORTED | CUI_REC_SHARED;
        if (a->role == CUI_ROLE_PRIVATE) a->role = CUI_ROLE_CREATOR;
      }
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* The properties of h, an allocation imported from a POSIX FD. The real driver (R580 on an
 * H200, docs/gpu-validation.md) reports requestedHandleTypes 0 for an imported handle; the
 * allocation was shared as a POSIX FD, so that is its handle type in our records (the
 * coordinator refuses a shared record with any other). */
static CUresult imported_prop(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
  CUresult r = REAL(cuMemGetAllocationPropertiesFromHandle)(prop, h);
  if (r == CUDA_SUCCESS) prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return r;
}

/* Imports `fd` (a real driver FD) and records or joins the allocation. Lock held. */
static CUresult import_real(int fd, CUmemGenericAllocationHandle *out) {
  cui_fn_cuMemImportFromShareableHandle real = REAL(cuMemImportFromShareableHandle);
  CUresult r = real(out, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r == CUDA_SUCCESS && CUI_IS_VHANDLE(*out)) {
    cui_api_warn("cuMemImportFromShareableHandle",
                 "the driver returned handle 0x%llx, which carries the shim's "
                 "tag 0x%llx; released it: CUDA_ERROR_INVALID_HANDLE",
                 (unsigned long long)*out, CUI_VHANDLE_TAG);
    REAL(cuMemRelease)(*out);
    r = CUDA_ERROR_INVALID_HANDLE;
  }
  return r;
}

static CUresult import_ticket(CUmemGenericAllocationHandle *handle, const struct cui_ticket *t) {
  cui_fn_cuMemRelease rel = REAL(cuMemRelease);
  pthread_mutex_lock(&cui_st.lock);
  if (!cui_gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  uint32_t self = (uint32_t)getpid();
  struct cui_alloc *a = cui_alloc_by_id(t->creator_pid, t->alloc_id);
  if (a && a->vrefs > 0) {            /* alias: collapse onto the driver reference we hold */
    a->vrefs++;
    a->flags |= CUI_REC_SHARED;
    *handle = a->vhandle;
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_SUCCESS;
  }
  if (t->creator_pid == self) {       /* our own ticket */
    CUresult r = CUDA_ERROR_INVALID_VALUE;   /* dead ticket: allocation gone */
    if (a) {
      struct cui_mapping *m = NULL;
      CUI_FOR_MAPS_OF(x, a) if (x->mapped && !m) m = x;
      CUmemGenericAllocationHandle h;
      if (m && (r = REAL(cuMemRetainAllocationHandle)(&h, (void *)(uintptr_t)m->va)) == CUDA_SUCCESS) {
        a->real = h;
        a->has_real = 1;
        a->vrefs = 1;
        *handle = a->vhandle;
      }
    }
    pthread_mutex_unlock(&cui_st.lock);
    return r;
  }
  cui_st.inflight++;
  pthread_mutex_unlock(&cui_st.lock);

  char why[256];
  int fd = cui_fetch_fd(t->creator_pid, t->alloc_id, why, sizeof why);
  CUresult r = CUDA_SUCCESS;
  CUmemGenericAllocationHandle h = 0;
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  if (fd < 0) {
    char hex[33];
    cui_hex_id(t->alloc_id, hex);
    cui_api_warn("cuMemImportFromShareableHandle",
                 "cannot import allocation %s from creator pid %u: %s; output "
                 "untouched: CUDA_ERROR_INVALID_VALUE",
                 hex, t->creator_pid, why);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    pthread_mutex_lock(&cui_st.lock);
    r = import_real(fd, &h);
    pthread_mutex_unlock(&cui_st.lock);
    close(fd);
    if (r == CUDA_SUCCESS) {
      r = imported_prop(&prop, h);
      if (r != CUDA_SUCCESS) rel(h);   /* nothing published */
    }
  }

  pthread_mutex_lock(&cui_st.lock);
  cui_st.inflight--;
  if (r == CUDA_SUCCESS) {
    a = cui_alloc_by_id(t->creator_pid, t->alloc_id);
    if (a && a->vrefs > 0) {          /* a concurrent import won: keep one driver reference */
      rel(h);
      a->vrefs++;
    } else if (a) {
      a->real = h;
      a->has_real = 1;
      a->vrefs = 1;
    } else if ((a = cui_alloc_new(t->alloc_id, t->creator_pid)) == NULL) {
      rel(h);
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      a->role = CUI_ROLE_IMPORTER;
      a->flags = CUI_REC_SHARED;
      a->prop = prop;
      a->size = t->size;
      a->real = h;
      a->has_real = 1;
      a->vrefs = 1;
    }
    if (r == CUDA_SUCCESS) *handle = a->vhandle;
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                   CUmemAllocationHandleType shHandleType) {
  REAL_OR_FAIL(real, cuMemImportFromShareableHandle);
  CUI_FORK_FORWARD("cuMemImportFromShareableHandle", real(handle, osHandle, shHandleType));
  if (shHandleType == CU_MEM_HANDLE_TYPE_FABRIC) {   /* untracked sharing */
    cui_fabric_refused("cuMemImportFromShareableHandle", "import of a FABRIC handle");
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !handle) return real(handle, osHandle, shHandleType);
  int fd = (int)(intptr_t)osHandle;
  struct cui_ticket t;
  /* The FD may be a pidfd_getfd(2) duplicate of the exporter's ticket (PyTorch expandable
   * segments) sharing its file offset: cui_read_ticket preads at 0 and never moves it, and the
   * real FD comes from the creator's export cache, whatever either side did with its ticket FD
   * (docs/shim.md "pidfd importers"). */
  if (cui_read_ticket(fd, &t)) {
    if (t.version == CUI_PROTO_VERSION && t.kind == CUI_TICKET_MULTICAST) return cui_mc_import_ticket(handle, &t);
    if (t.version != CUI_PROTO_VERSION || t.kind != CUI_TICKET_ALLOCATION) {
      char hex[33];
      cui_hex_id(t.alloc_id, hex);
      cui_api_warn("cuMemImportFromShareableHandle",
                   "ticket for allocation %s of creator pid %u has version %u kind "
                   "%u (this shim reads version %u kind %u); output untouched: CUDA_ERROR_INVALID_VALUE",
                   hex, t.creator_pid, (unsigned)t.version, (unsigned)t.kind, (unsigned)CUI_PROTO_VERSION,
                   (unsigned)CUI_TICKET_ALLOCATION);
      return CUDA_ERROR_INVALID_VALUE;
    }
    return import_ticket(handle, &t);
  }
  /* A raw (non-ticket) FD: passes through, recorded; a live one blocks capture. */
  pthread_mutex_lock(&cui_st.lock);
  if (!cui_gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  CUmemGenericAllocationHandle h;
  CUresult r = import_real(fd, &h);
  if (r == CUDA_SUCCESS) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    imported_prop(&prop, h);
    uint8_t id[16];
    cui_random_id(id);
    struct cui_alloc *a = cui_alloc_new(id, 0);   /* creator unknown */
    if (!a) {
      REAL(cuMemRelease)(h);
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      a->role = CUI_ROLE_IMPORTER;
      a->flags = CUI_REC_SHARED | CUI_REC_RAW_IMPORT;
      a->prop = prop;
      a->real = h;
      a->has_real = 1;
      a->vrefs = 1;
      *handle = a->vhandle;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle handle) {
  REAL_OR_FAIL(real, cuMemGetAllocationPropertiesFromHandle);
  CUI_FORK_FORWARD("cuMemGetAllocationPropertiesFromHandle", real(prop, handle));
  if (!CUI_IS_VHANDLE(handle)) return real(prop, handle);
  pthread_mutex_lock(&cui_st.lock);
  CUresult r;
  struct cui_alloc *a = cui_alloc_by_vhandle(handle);
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!a || a->vrefs == 0 || !a->has_real) r = CUDA_ERROR_INVALID_VALUE;
  else r = real(prop, a->real);
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* ---------- reservations ---------- */

CUI_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                        unsigned long long flags) {
  REAL_OR_FAIL(real, cuMemAddressReserve);
  CUI_FORK_FORWARD("cuMemAddressReserve", real(ptr, size, alignment, addr, flags));
  pthread_mutex_lock(&cui_st.lock);
  if (!cui_gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  if (cui_st.nresv == cui_st.cap_resv) {
    size_t cap = cui_st.cap_resv ? 2 * cui_st.cap_resv : 32;
    struct cui_reservation *n = realloc(cui_st.resv, cap * sizeof *n);
    if (!n) {
      pthread_mutex_unlock(&cui_st.lock);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    cui_st.resv = n;
    cui_st.cap_resv = cap;
  }
  CUresult r = real(ptr, size, alignment, addr, flags);
  if (r == CUDA_SUCCESS && ptr) {
    if (cui_tab_put(&cui_st.resv_va, (struct cui_key){*ptr, 0, 0}, (uint32_t)cui_st.nresv) != 0) {
      REAL(cuMemAddressFree)(*ptr, size);   /* unrecorded: could not be kept across a restore */
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      cui_st.resv[cui_st.nresv++] = (struct cui_reservation){*ptr, size, alignment};
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  REAL_OR_FAIL(real, cuMemAddressFree);
  CUI_FORK_FORWARD("cuMemAddressFree", real(ptr, size));
  pthread_mutex_lock(&cui_st.lock);
  if (!cui_gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  CUresult r = real(ptr, size);
  uint32_t *at = cui_tab_get(&cui_st.resv_va, (struct cui_key){ptr, 0, 0});
  if (r == CUDA_SUCCESS && at && cui_st.resv[*at].size == size) {
    uint32_t i = *at;
    cui_tab_del(&cui_st.resv_va, (struct cui_key){ptr, 0, 0});
    if (i != --cui_st.nresv) {   /* move the last one into the hole */
      cui_st.resv[i] = cui_st.resv[cui_st.nresv];
      *cui_tab_get(&cui_st.resv_va, (struct cui_key){cui_st.resv[i].va, 0, 0}) = i;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}
