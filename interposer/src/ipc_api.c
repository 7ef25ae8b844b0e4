/*
 * ipc_api.c: the IPC adapter's handle side (docs/shim.md "IPC adapter"), on the API layer above
 * alloc_api.c, vmm_api.c and peer.c.
 *
 * cuIpcGetMemHandle of a pointer inside an adapter allocation of this process returns a virtual
 * IPC handle (protocol.h struct cui_ipc_handle: magic, version, creator pid, allocation id,
 * bytes requested, offset, the allocation's secret, bytes mapped) in the 64 bytes of
 * CUipcMemHandle; the allocation's real export FD goes into the export cache, and the
 * allocation becomes a creator (carried by SAVE_ALLOCATIONS like any exported cuMemCreate).
 * cuIpcOpenMemHandle[_v2] of a virtual handle imports it through the ticket path of
 * cuMemImportFromShareableHandle (FETCH_FD with the secret), reserves, maps at a VA the shim
 * picks and grants read-write access to the current device; the mapping is an importer mapping
 * that RESTORE_UNICAST maps at the same VA again. A second open of the same handle in one
 * process returns the same VA and counts one more reference; cuIpcCloseMemHandle drops one and
 * unmaps at zero. Opening in the creating process fails with CUDA_ERROR_INVALID_CONTEXT (the
 * driver's answer, CUDA driver API cuIpcOpenMemHandle: "cannot be opened in the process that
 * allocated it"). Any other handle or pointer passes through to the driver
 * (CUDA_ERROR_NOT_SUPPORTED when the driver has no such function); a real IPC export
 * or import that succeeds is remembered (alloc_api.c), and INSPECT then refuses the checkpoint
 * (cui_ipc_inspect_fixup) naming pid, pointer or handle bytes and why.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "api.h"

/* ---------- cuIpcGetMemHandle ---------- */

/* The export FD into the cache (once) and the handle for `p` inside adapter allocation `a`.
 * Lock held. */
static CUresult export_handle(struct cui_alloc *a, const struct cui_mapping *m, uint64_t p, struct cui_ipc_handle *h) {
  if (!cui_cache_has(a->id)) {
    CUmemGenericAllocationHandle dh;
    int temporary = 0;
    CUresult r = cui_alloc_driver_handle(a, &dh, &temporary);
    if (r != CUDA_SUCCESS) return r;
    int fd = -1;
    r = REAL(cuMemExportToShareableHandle)(&fd, dh, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (temporary) REAL(cuMemRelease)(dh);
    if (r != CUDA_SUCCESS) return r;
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    if (cui_cache_put(a->id, fd) != 0) {
      close(fd);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  uint64_t secret = cui_secret_make(a->id);
  if (!secret) return CUDA_ERROR_OUT_OF_MEMORY;
  memset(h, 0, sizeof *h);
  memcpy(h->magic, CUI_IPC_MAGIC, 8);
  h->version = CUI_PROTO_VERSION;
  h->creator_pid = a->creator_pid;
  memcpy(h->alloc_id, a->id, 16);
  h->size = a->req_size;
  h->offset = p - m->va;
  h->secret = secret;
  h->mapped = m->size;
  a->flags |= CUI_REC_EXPORTED | CUI_REC_SHARED | CUI_REC_IPC;
  a->role = CUI_ROLE_CREATOR;
  return CUDA_SUCCESS;
}

CUI_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
  cui_fn_cuIpcGetMemHandle real = REAL(cuIpcGetMemHandle);   /* NULL: a driver without legacy IPC */
  CUI_FORK_FORWARD("cuIpcGetMemHandle", real ? real(pHandle, dptr) : CUDA_ERROR_NOT_SUPPORTED);
  if (pHandle && cui_maybe_tracked(dptr, 1)) {
    pthread_mutex_lock(&cui_st.lock);
    struct cui_mapping *m = cui_map_containing(dptr);
    struct cui_alloc *a = m ? &cui_st.allocs[m->alloc] : NULL;
    if (a && (a->flags & CUI_REC_ADAPTER) && a->creator_pid == (uint32_t)getpid()) {
      CUresult r = CUDA_ERROR_NOT_READY;
      struct cui_ipc_handle h;
      if (cui_gate_open() && (r = export_handle(a, m, dptr, &h)) == CUDA_SUCCESS) memcpy(pHandle, &h, sizeof h);
      pthread_mutex_unlock(&cui_st.lock);
      return r;
    }
    pthread_mutex_unlock(&cui_st.lock);
  }
  CUresult r = real ? real(pHandle, dptr) : CUDA_ERROR_NOT_SUPPORTED;
  if (r == CUDA_SUCCESS) cui_ipc_foreign_add(dptr, NULL, 0);
  return r;
}

/* ---------- cuIpcOpenMemHandle[_v2] / cuIpcCloseMemHandle ---------- */

/* Serializes this process's opens of virtual handles, so two threads opening one handle get one
 * mapping and a count of 2 (the FETCH_FD round trip runs under it; the creator serves FETCH_FD
 * from its accept thread without any lock of this process). */
static pthread_mutex_t g_open_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult open_locked(CUdeviceptr *pdptr, const struct cui_ipc_handle *h);

static CUresult open_virtual(CUdeviceptr *pdptr, const struct cui_ipc_handle *h) {
  pthread_mutex_lock(&g_open_lock);
  CUresult r = open_locked(pdptr, h);
  pthread_mutex_unlock(&g_open_lock);
  return r;
}

static CUresult open_locked(CUdeviceptr *pdptr, const struct cui_ipc_handle *h) {
  char hex[33];
  cui_hex_id(h->alloc_id, hex);
  if (h->version != CUI_PROTO_VERSION) {
    cui_api_warn("cuIpcOpenMemHandle",
                 "IPC handle of allocation %s (creator pid %u) has version %u, this shim reads %u: "
                 "CUDA_ERROR_INVALID_VALUE",
                 hex, h->creator_pid, (unsigned)h->version, (unsigned)CUI_PROTO_VERSION);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (h->creator_pid == (uint32_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT;   /* the driver's answer */
  pthread_mutex_lock(&cui_st.lock);
  struct cui_alloc *a = cui_alloc_by_id(h->creator_pid, h->alloc_id);
  if (a && (a->flags & CUI_REC_IPC) && a->ipc_opens > 0) {   /* already open here: same VA */
    CUresult r = cui_gate_open() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
    if (r == CUDA_SUCCESS) {
      a->ipc_opens++;
      *pdptr = a->ipc_va;
    }
    pthread_mutex_unlock(&cui_st.lock);
    return r;
  }
  pthread_mutex_unlock(&cui_st.lock);
  int dev = 0;
  CUresult r = (CUresult)cui_current_device(&dev);
  if (r != CUDA_SUCCESS) return r;
  /* through the ticket path: FETCH_FD with the secret, import, one driver reference */
  struct cui_ticket t;
  memset(&t, 0, sizeof t);
  t.kind = CUI_TICKET_ALLOCATION;
  t.creator_pid = h->creator_pid;
  memcpy(t.alloc_id, h->alloc_id, 16);
  t.size = h->mapped;
  t.reserved[1] = h->secret;
  int tfd = cui_make_ticket(&t);
  if (tfd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  CUmemGenericAllocationHandle vh;
  r = cuMemImportFromShareableHandle(&vh, (void *)(uintptr_t)tfd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(tfd);
  if (r != CUDA_SUCCESS) return r;
  CUdeviceptr va;
  r = cui_adapter_map(vh, h->mapped, 0, dev, &va);
  if (r != CUDA_SUCCESS) {
    cuMemRelease(vh);
    return r;
  }
  cui_adapter_mark(vh, h->size, dev, va);
  CUcontext ctx = NULL;
  if (REAL(cuCtxGetCurrent)) REAL(cuCtxGetCurrent)(&ctx);
  r = cui_peer_grant_new(va, h->mapped, ctx);   /* devices with peer access to this context */
  if (r != CUDA_SUCCESS) {
    cuIpcCloseMemHandle(va);
    return r;
  }
  *pdptr = va;
  return CUDA_SUCCESS;
}

static CUresult open_handle(cui_fn_cuIpcOpenMemHandle_v2 real, const char *api, CUdeviceptr *pdptr,
                            CUipcMemHandle handle, unsigned int flags) {
  CUI_FORK_FORWARD(api, real ? real(pdptr, handle, flags) : CUDA_ERROR_NOT_SUPPORTED);
  struct cui_ipc_handle h;
  memcpy(&h, handle.reserved, sizeof h);
  if (memcmp(h.magic, CUI_IPC_MAGIC, 8) != 0) {
    CUresult r = real ? real(pdptr, handle, flags) : CUDA_ERROR_NOT_SUPPORTED;
    if (r == CUDA_SUCCESS && pdptr) cui_ipc_foreign_add(*pdptr, (const uint8_t *)handle.reserved, 1);
    return r;
  }
  if (!pdptr || (flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)) return CUDA_ERROR_INVALID_VALUE;
  return open_virtual(pdptr, &h);
}

CUI_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
  return open_handle(REAL(cuIpcOpenMemHandle_v2), "cuIpcOpenMemHandle_v2", pdptr, handle, Flags);
}

CUI_EXPORT CUresult cui_cuIpcOpenMemHandle_v1(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
  return open_handle((cui_fn_cuIpcOpenMemHandle_v2)REAL(cuIpcOpenMemHandle), "cuIpcOpenMemHandle", pdptr, handle,
                     Flags);
}

CUI_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
  cui_fn_cuIpcCloseMemHandle real = REAL(cuIpcCloseMemHandle);
  CUI_FORK_FORWARD("cuIpcCloseMemHandle", real ? real(dptr) : CUDA_ERROR_NOT_SUPPORTED);
  uint64_t va = 0, size = 0, vh = 0;
  if (cui_maybe_tracked(dptr, 1)) {
    pthread_mutex_lock(&cui_st.lock);
    struct cui_mapping *m = cui_map_containing(dptr);
    struct cui_alloc *a = m ? &cui_st.allocs[m->alloc] : NULL;
    if (a && (a->flags & CUI_REC_IPC) && a->role == CUI_ROLE_IMPORTER && a->ipc_opens > 0 && a->ipc_va == dptr) {
      CUresult r = CUDA_SUCCESS;
      if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
      else if (--a->ipc_opens == 0) va = m->va, size = m->size, vh = a->vhandle;
      pthread_mutex_unlock(&cui_st.lock);
      if (r != CUDA_SUCCESS || !va) return r;
      r = cuMemUnmap(va, size);
      if (r != CUDA_SUCCESS) return r;
      cuMemRelease(vh);
      return cuMemAddressFree(va, size);
    }
    pthread_mutex_unlock(&cui_st.lock);
  }
  CUresult r = real ? real(dptr) : CUDA_ERROR_NOT_SUPPORTED;
  if (r == CUDA_SUCCESS) cui_ipc_foreign_drop(dptr, 1);
  return r;
}
