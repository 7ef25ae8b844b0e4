/*
 * multicast_api.c: multicast objects and their wrappers (docs/shim.md "Multicast"), on the
 * state layer; the phase ops that tear them down and rebuild them are in ops_multicast.c.
 *
 * The app sees virtual handles for multicast objects too (same tag and counter as allocations). Per object the shim
 * records the requested properties, the effective extent (largest mcOffset + size bound or mapped in this process),
 * the devices this process added, its bindings (by handle or by address, v1 or device-explicit _v2 ABI: the wrapper
 * the app reached), its mappings of the object and their access. An object whose handle types are not exactly
 * POSIX_FILE_DESCRIPTOR (0, FABRIC) is created and used normally but flagged CUI_REC_PASSTHROUGH: it cannot be
 * rebuilt, so PREPARE_MULTICAST refuses and the coordinator's validation names it. Binding memory the shim does not
 * track into a tracked object is refused before the driver sees the call (CUDA_ERROR_NOT_SUPPORTED, nothing
 * recorded). A creator's exported object outlives the app's release of the create handle as the team's anchor
 * (mc_maybe_destroy; docs/shim.md "Creator lets go", decisions.md D23).
 *
 * Locking: create, add-device, bind and map are collective (bind and map block until every
 * device of the team was added, in every process), so they run with cui_st.lock dropped and
 * counted in cui_st.inflight; the object is looked up again afterwards. Unbind, unmap, access,
 * release and export are local and keep the lock.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api.h"

/* ---------- tables (lock held) ---------- */

static struct cui_mc *mc_by_vhandle(uint64_t vh) {
  if (!CUI_IS_VHANDLE(vh)) return NULL;
  for (size_t i = 0; i < cui_st.nmcs; i++)
    if (cui_st.mcs[i].live && cui_st.mcs[i].vhandle == vh) return &cui_st.mcs[i];
  return NULL;
}

static struct cui_mc *mc_by_id(uint32_t creator_pid, const uint8_t id[16]) {
  for (struct cui_mc *m = cui_st.mcs; m < cui_st.mcs + cui_st.nmcs; m++)
    if (m->live && m->creator_pid == creator_pid && memcmp(m->id, id, 16) == 0) return m;
  return NULL;
}

static struct cui_mc *mc_new(const uint8_t id[16], uint32_t creator_pid) {
  if (cui_st.nmcs == cui_st.cap_mcs) {
    size_t cap = cui_st.cap_mcs ? 2 * cui_st.cap_mcs : 16;
    struct cui_mc *n = realloc(cui_st.mcs, cap * sizeof *n);
    if (!n) return NULL;
    cui_st.mcs = n;
    cui_st.cap_mcs = cap;
  }
  struct cui_mc *m = &cui_st.mcs[cui_st.nmcs];
  __atomic_store_n(&cui_st.nmcs, cui_st.nmcs + 1, __ATOMIC_RELEASE);   /* read unlocked below */
  memset(m, 0, sizeof *m);
  memcpy(m->id, id, 16);
  m->creator_pid = creator_pid;
  m->vhandle = cui_new_vhandle();
  m->live = 1;
  return m;
}

/* The driver reference goes when nothing refers to the object any more, except in the creator
 * of an exported object: its anchor keeps the reference, the cached export FD and the devices
 * (importers fetch it, the restore rebuilds it) until the process exits. */
static void mc_maybe_destroy(struct cui_mc *m) {
  if (!m->live || m->vrefs || m->nbinds || m->nmaps) return;
  if (m->role == CUI_ROLE_CREATOR && (m->flags & CUI_REC_EXPORTED) && !(m->flags & CUI_REC_PASSTHROUGH)) return;
  if (m->role == CUI_ROLE_CREATOR) cui_cache_close(m->id);   /* first: an open export FD is a reference */
  if (m->has_real) {
    REAL(cuMemRelease)(m->real);
    m->has_real = 0;
  }
  free(m->binds);
  free(m->maps);
  m->binds = NULL;
  m->maps = NULL;
  m->live = 0;
}

static void note_extent(struct cui_mc *m, uint64_t off, uint64_t size) {
  if (off + size > m->extent) m->extent = off + size;
}

int cui_mc_is_handle(uint64_t vh) {
  /* unicast-only processes (no object ever created or imported) never take the lock here */
  if (!CUI_IS_VHANDLE(vh) || !__atomic_load_n(&cui_st.nmcs, __ATOMIC_ACQUIRE)) return 0;
  pthread_mutex_lock(&cui_st.lock);
  int found = mc_by_vhandle(vh) != NULL;
  pthread_mutex_unlock(&cui_st.lock);
  return found;
}

int cui_mc_live_count(void) {
  int n = 0;
  for (size_t i = 0; i < cui_st.nmcs; i++) n += cui_st.mcs[i].live;
  return n;
}

const struct cui_mc *cui_mc_passthrough(void) {
  for (size_t i = 0; i < cui_st.nmcs; i++)
    if (cui_st.mcs[i].live && (cui_st.mcs[i].flags & CUI_REC_PASSTHROUGH)) return &cui_st.mcs[i];
  return NULL;
}

/* The mapping record exactly [va, va+size), or NULL; *overlap set when a record overlaps. */
static struct cui_mcmap *mcmap_find(uint64_t va, uint64_t size, struct cui_mc **owner, int *overlap) {
  *overlap = 0;
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live) continue;
    for (uint32_t k = 0; k < m->nmaps; k++) {
      struct cui_mcmap *x = &m->maps[k];
      if (x->va < va + size && va < x->va + x->size) {
        *overlap = 1;
        if (x->va == va && x->size == size) {
          *owner = m;
          return x;
        }
      }
    }
  }
  return NULL;
}

int cui_mc_range(uint64_t va, uint64_t size) {
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mc *o = NULL;
  int overlap;
  mcmap_find(va, size, &o, &overlap);
  pthread_mutex_unlock(&cui_st.lock);
  return overlap;
}

/* cuMemRetainAllocationHandle on an address inside a multicast mapping: the object's virtual
 * handle (+1 reference), never the driver's; NOT_READY outside ACTIVE. Returns 0 when the
 * address is in no multicast mapping (the caller continues). */
int cui_mc_retain(uint64_t p, CUmemGenericAllocationHandle *handle, CUresult *r) {
  if (!__atomic_load_n(&cui_st.mc_maps, __ATOMIC_RELAXED)) return 0;
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mc *owner = NULL;
  for (size_t i = 0; i < cui_st.nmcs && !owner; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    for (uint32_t k = 0; m->live && k < m->nmaps && !owner; k++)
      if (p - m->maps[k].va < m->maps[k].size) owner = m;
  }
  if (owner) {
    if (!cui_gate_open()) *r = CUDA_ERROR_NOT_READY;
    else if (!handle) *r = CUDA_ERROR_INVALID_VALUE;
    else {
      owner->vrefs++;
      *handle = owner->vhandle;
      *r = CUDA_SUCCESS;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return owner != NULL;
}

/* ---------- cuMulticastCreate / AddDevice ---------- */

CUI_EXPORT CUresult cuMulticastCreate(CUmemGenericAllocationHandle *mcHandle, const CUmulticastObjectProp *prop) {
  cui_fn_cuMulticastCreate real = REAL(cuMulticastCreate);
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
  CUI_FORK_FORWARD("cuMulticastCreate", real(mcHandle, prop));
  if (!mcHandle || !prop) return real(mcHandle, prop);
  pthread_mutex_lock(&cui_st.lock);
  if (!cui_gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  cui_st.inflight++;
  pthread_mutex_unlock(&cui_st.lock);
  CUmemGenericAllocationHandle h;
  CUresult r = real(&h, prop);   /* collective: no shim lock held */
  pthread_mutex_lock(&cui_st.lock);
  cui_st.inflight--;
  if (r == CUDA_SUCCESS) {
    uint8_t id[16];
    cui_random_id(id);
    struct cui_mc *m = CUI_IS_VHANDLE(h) ? NULL : mc_new(id, (uint32_t)getpid());
    if (!m) {
      REAL(cuMemRelease)(h);
      r = CUI_IS_VHANDLE(h) ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      m->role = CUI_ROLE_CREATOR;
      m->prop = *prop;
      m->real = h;
      m->has_real = 1;
      m->vrefs = 1;
      if (prop->handleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        m->flags |= CUI_REC_PASSTHROUGH;
        char hex[33];
        cui_hex_id(m->id, hex);
        cui_api_warn("cuMulticastCreate",
                     "multicast object %s has handle types 0x%llx (not exactly "
                     "POSIX_FILE_DESCRIPTOR): it works, but a checkpoint of this process will be refused",
                     hex, (unsigned long long)prop->handleTypes);
      }
      *mcHandle = m->vhandle;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMulticastAddDevice(CUmemGenericAllocationHandle mcHandle, CUdevice dev) {
  cui_fn_cuMulticastAddDevice real = REAL(cuMulticastAddDevice);
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
  CUI_FORK_FORWARD("cuMulticastAddDevice", real(mcHandle, dev));
  if (!CUI_IS_VHANDLE(mcHandle)) return real(mcHandle, dev);
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mc *m = mc_by_vhandle(mcHandle);
  CUresult r = CUDA_SUCCESS;
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!m || !m->has_real || m->vrefs == 0) r = CUDA_ERROR_INVALID_VALUE;
  else if (m->ndevs >= CUI_MC_MAX_DEVICES) r = CUDA_ERROR_NOT_SUPPORTED;
  if (r != CUDA_SUCCESS) {
    pthread_mutex_unlock(&cui_st.lock);
    return r;
  }
  CUmemGenericAllocationHandle h = m->real;
  cui_st.inflight++;
  pthread_mutex_unlock(&cui_st.lock);
  r = real(h, dev);
  pthread_mutex_lock(&cui_st.lock);
  cui_st.inflight--;
  m = mc_by_vhandle(mcHandle);
  if (r == CUDA_SUCCESS && m) m->devs[m->ndevs++] = dev;
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* ---------- binds ---------- */

const char *cui_mc_bind_api(int by_addr, int v2) {
  return by_addr ? (v2 ? "cuMulticastBindAddr_v2" : "cuMulticastBindAddr")
                 : (v2 ? "cuMulticastBindMem_v2" : "cuMulticastBindMem");
}

/* Every bind form. dev: the explicit device (v2) or ignored (v1). by_addr: memptr, else memHandle. */
static CUresult do_bind(uint64_t mch, int v2, CUdevice dev, size_t mc_off, int by_addr, uint64_t memh,
                        CUdeviceptr memptr, size_t mem_off, size_t size, unsigned long long flags) {
  const char *api = cui_mc_bind_api(by_addr, v2);
  void *real = cui_real(by_addr ? (v2 ? CUI_ROW_cuMulticastBindAddr_v2 : CUI_ROW_cuMulticastBindAddr)
                                : (v2 ? CUI_ROW_cuMulticastBindMem_v2 : CUI_ROW_cuMulticastBindMem));
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
  if (by_addr && v2)
    CUI_FORK_FORWARD(api, ((cui_fn_cuMulticastBindAddr_v2)real)(mch, dev, mc_off, memptr, size, flags));
  if (by_addr) CUI_FORK_FORWARD(api, ((cui_fn_cuMulticastBindAddr)real)(mch, mc_off, memptr, size, flags));
  if (v2) CUI_FORK_FORWARD(api, ((cui_fn_cuMulticastBindMem_v2)real)(mch, dev, mc_off, memh, mem_off, size, flags));
  CUI_FORK_FORWARD(api, ((cui_fn_cuMulticastBindMem)real)(mch, mc_off, memh, mem_off, size, flags));
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mc *m = CUI_IS_VHANDLE(mch) ? mc_by_vhandle(mch) : NULL;
  CUresult r = CUDA_SUCCESS;
  CUmemGenericAllocationHandle real_mc = mch, real_mem = memh;
  struct cui_alloc *member = NULL;
  uint64_t member_off = mem_off;
  int tracked_mem = 0;
  if (CUI_IS_VHANDLE(mch) && !m) {
    r = CUDA_ERROR_INVALID_VALUE;   /* a tagged value that is no live multicast object */
  } else if (m || (!by_addr && CUI_IS_VHANDLE(memh))) {
    if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  }
  if (r == CUDA_SUCCESS && m) {
    if (!m->has_real || m->vrefs == 0) r = CUDA_ERROR_INVALID_VALUE;
    else real_mc = m->real;
  }
  if (r == CUDA_SUCCESS) {
    if (by_addr) {
      struct cui_mapping *mp = cui_map_containing(memptr);
      if (mp && mp->mapped) {
        member = &cui_st.allocs[mp->alloc];
        member_off = mp->offset + (memptr - mp->va);
        tracked_mem = 1;
      }
    } else if (CUI_IS_VHANDLE(memh)) {
      member = cui_alloc_by_vhandle(memh);
      if (!member || !member->has_real || member->vrefs == 0) r = CUDA_ERROR_INVALID_VALUE;
      else {
        real_mem = member->real;
        tracked_mem = 1;
      }
    }
  }
  if (r == CUDA_SUCCESS && m && !(m->flags & CUI_REC_PASSTHROUGH) && !tracked_mem) {
    char hex[33];
    cui_hex_id(m->id, hex);
    if (by_addr)
      cui_api_warn(api,
                   "address 0x%llx is not in a mapping of a tracked cuMemCreate allocation; binding it into "
                   "multicast object %s could not be restored after a checkpoint; no driver call: "
                   "CUDA_ERROR_NOT_SUPPORTED",
                   (unsigned long long)memptr, hex);
    else
      cui_api_warn(api,
                   "memory handle 0x%llx is not a tracked allocation; binding it into multicast object %s "
                   "could not be restored after a checkpoint; no driver call: CUDA_ERROR_NOT_SUPPORTED",
                   (unsigned long long)memh, hex);
    r = CUDA_ERROR_NOT_SUPPORTED;
  }
  if (r == CUDA_SUCCESS && m && m->nbinds == UINT32_MAX) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r != CUDA_SUCCESS) {
    pthread_mutex_unlock(&cui_st.lock);
    return r;
  }
  uint64_t member_vh = member ? member->vhandle : 0;
  cui_st.inflight++;
  pthread_mutex_unlock(&cui_st.lock);

  /* collective: blocks until the team is complete; no shim lock held */
  if (by_addr)
    r = v2 ? ((cui_fn_cuMulticastBindAddr_v2)real)(real_mc, dev, mc_off, memptr, size, flags)
           : ((cui_fn_cuMulticastBindAddr)real)(real_mc, mc_off, memptr, size, flags);
  else
    r = v2 ? ((cui_fn_cuMulticastBindMem_v2)real)(real_mc, dev, mc_off, real_mem, mem_off, size, flags)
           : ((cui_fn_cuMulticastBindMem)real)(real_mc, mc_off, real_mem, mem_off, size, flags);
  CUdevice bound_dev = dev;
  if (r == CUDA_SUCCESS && !v2) {
    cui_fn_cuCtxGetDevice getdev = REAL(cuCtxGetDevice);
    if (!getdev || getdev(&bound_dev) != CUDA_SUCCESS) bound_dev = -1;
  }

  pthread_mutex_lock(&cui_st.lock);
  cui_st.inflight--;
  m = CUI_IS_VHANDLE(mch) ? mc_by_vhandle(mch) : NULL;
  if (r == CUDA_SUCCESS && m) {
    member = NULL;
    for (size_t i = 0; member_vh && i < cui_st.nallocs; i++)
      if (cui_st.allocs[i].live && cui_st.allocs[i].vhandle == member_vh) member = &cui_st.allocs[i];
    if (m->nbinds == m->cap_binds) {
      uint32_t cap = m->cap_binds ? 2 * m->cap_binds : 8;
      struct cui_mcbind *n = realloc(m->binds, cap * sizeof *n);
      if (n) m->binds = n, m->cap_binds = cap;
    }
    if (m->nbinds == m->cap_binds) {   /* cannot record: undo, so nothing unrestorable remains */
      REAL(cuMulticastUnbind)(m->real, bound_dev, mc_off, size);
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      struct cui_mcbind *b = &m->binds[m->nbinds++];
      memset(b, 0, sizeof *b);
      b->dev = bound_dev;
      b->flags = (by_addr ? CUI_REC_MC_BY_ADDR : 0) | (v2 ? CUI_REC_MC_V2_ABI : 0);
      b->mc_off = mc_off;
      b->size = size;
      b->mem_off = member_off;
      b->memptr = by_addr ? memptr : 0;
      b->bound = 1;
      if (member) {
        b->has_member = 1;
        b->member = (uint32_t)(member - cui_st.allocs);
        member->nbinds++;
        if (!(m->flags & CUI_REC_PASSTHROUGH)) {
          /* bound into a tracked object: shared from now on; its creator carries the bytes */
          member->flags |= CUI_REC_SHARED;
          if (member->role == CUI_ROLE_PRIVATE) member->role = CUI_ROLE_CREATOR;
        }
      }
      note_extent(m, mc_off, size);
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                       CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size,
                                       unsigned long long flags) {
  return do_bind(mcHandle, 0, 0, mcOffset, 0, memHandle, 0, memOffset, size, flags);
}

CUI_EXPORT CUresult cuMulticastBindMem_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,
                                          CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size,
                                          unsigned long long flags) {
  return do_bind(mcHandle, 1, dev, mcOffset, 0, memHandle, 0, memOffset, size, flags);
}

CUI_EXPORT CUresult cuMulticastBindAddr(CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUdeviceptr memptr,
                                        size_t size, unsigned long long flags) {
  return do_bind(mcHandle, 0, 0, mcOffset, 1, 0, memptr, 0, size, flags);
}

CUI_EXPORT CUresult cuMulticastBindAddr_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,
                                           CUdeviceptr memptr, size_t size, unsigned long long flags) {
  return do_bind(mcHandle, 1, dev, mcOffset, 1, 0, memptr, 0, size, flags);
}

static void drop_binding(struct cui_mc *m, uint32_t k) {
  struct cui_mcbind *b = &m->binds[k];
  if (b->has_member) {
    struct cui_alloc *a = &cui_st.allocs[b->member];
    if (a->nbinds) a->nbinds--;
    cui_maybe_destroy(a);
  }
  m->binds[k] = m->binds[--m->nbinds];
}

CUI_EXPORT CUresult cuMulticastUnbind(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,
                                      size_t size) {
  cui_fn_cuMulticastUnbind real = REAL(cuMulticastUnbind);
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
  CUI_FORK_FORWARD("cuMulticastUnbind", real(mcHandle, dev, mcOffset, size));
  if (!CUI_IS_VHANDLE(mcHandle)) return real(mcHandle, dev, mcOffset, size);
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mc *m = mc_by_vhandle(mcHandle);
  CUresult r = CUDA_SUCCESS;
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!m || !m->has_real) r = CUDA_ERROR_INVALID_VALUE;
  else {
    r = real(m->real, dev, mcOffset, size);
    if (r == CUDA_SUCCESS) {
      for (uint32_t k = 0; k < m->nbinds; k++)
        if (m->binds[k].dev == dev && m->binds[k].mc_off == mcOffset && m->binds[k].size == size) {
          drop_binding(m, k);
          break;
        }
      mc_maybe_destroy(m);
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* ---------- release / map / unmap / access (branches of the vmm_api.c wrappers) ---------- */

CUresult cui_mc_release(uint64_t vh) {
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mc *m = mc_by_vhandle(vh);
  CUresult r = CUDA_SUCCESS;
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!m || m->vrefs == 0) {
    cui_api_warn("cuMemRelease",
                 "multicast virtual handle 0x%llx has no references left; no driver call: "
                 "CUDA_ERROR_INVALID_VALUE",
                 (unsigned long long)vh);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    m->vrefs--;
    mc_maybe_destroy(m);   /* the driver reference stays while bindings or mappings remain */
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUresult cui_mc_map(CUdeviceptr ptr, size_t size, size_t offset, uint64_t vh, unsigned long long flags) {
  cui_fn_cuMemMap real = REAL(cuMemMap);
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mc *m = mc_by_vhandle(vh);
  CUresult r = CUDA_SUCCESS;
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!m || !m->has_real || m->vrefs == 0) r = CUDA_ERROR_INVALID_VALUE;
  if (r != CUDA_SUCCESS) {
    pthread_mutex_unlock(&cui_st.lock);
    return r;
  }
  CUmemGenericAllocationHandle h = m->real;
  cui_st.inflight++;
  pthread_mutex_unlock(&cui_st.lock);
  r = real(ptr, size, offset, h, flags);   /* blocks until the team is complete: no lock held */
  pthread_mutex_lock(&cui_st.lock);
  cui_st.inflight--;
  m = mc_by_vhandle(vh);
  if (r == CUDA_SUCCESS && m) {
    if (m->nmaps == m->cap_maps) {
      uint32_t cap = m->cap_maps ? 2 * m->cap_maps : 4;
      struct cui_mcmap *n = realloc(m->maps, cap * sizeof *n);
      if (n) m->maps = n, m->cap_maps = cap;
    }
    if (m->nmaps == m->cap_maps) {
      REAL(cuMemUnmap)(ptr, size);
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      struct cui_mcmap *x = &m->maps[m->nmaps++];
      memset(x, 0, sizeof *x);
      x->va = ptr;
      x->size = size;
      x->offset = offset;
      x->mapped = 1;
      __atomic_add_fetch(&cui_st.mc_maps, 1, __ATOMIC_RELAXED);
      note_extent(m, offset, size);
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUresult cui_mc_unmap(CUdeviceptr ptr, size_t size) {
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mc *m = NULL;
  int overlap;
  struct cui_mcmap *x = mcmap_find(ptr, size, &m, &overlap);
  CUresult r = CUDA_SUCCESS;
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!x) {
    cui_api_warn("cuMemUnmap",
                 "range 0x%llx+0x%llx is not exactly one multicast mapping; no driver call: "
                 "CUDA_ERROR_INVALID_VALUE",
                 (unsigned long long)ptr, (unsigned long long)size);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    r = REAL(cuMemUnmap)(ptr, size);
    if (r == CUDA_SUCCESS) {
      *x = m->maps[--m->nmaps];
      __atomic_sub_fetch(&cui_st.mc_maps, 1, __ATOMIC_RELAXED);
      mc_maybe_destroy(m);
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUresult cui_mc_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mc *m = NULL;
  int overlap;
  struct cui_mcmap *x = mcmap_find(ptr, size, &m, &overlap);
  CUresult r = CUDA_SUCCESS;
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!x) {
    cui_api_warn("cuMemSetAccess",
                 "range 0x%llx+0x%llx is not exactly one multicast mapping; its access could "
                 "not be replayed after a restore: CUDA_ERROR_NOT_SUPPORTED",
                 (unsigned long long)ptr, (unsigned long long)size);
    r = CUDA_ERROR_NOT_SUPPORTED;
  } else {
    uint32_t n = cui_access_count_after(x->access, x->access_count, desc, count);
    if (n > CUI_MAX_ACCESS) r = CUDA_ERROR_NOT_SUPPORTED;
    else r = REAL(cuMemSetAccess)(ptr, size, desc, count);
    if (r == CUDA_SUCCESS) cui_access_merge(x->access, &x->access_count, desc, count);
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* ---------- export / import ---------- */

/* The ticket of `m`, reserved[1] its secret (protocol.h "Secrets"); -1: none made (no memory). */
static int fill_ticket(struct cui_ticket *t, const struct cui_mc *m) {
  memset(t, 0, sizeof *t);
  t->kind = CUI_TICKET_MULTICAST;
  t->creator_pid = m->creator_pid;
  memcpy(t->alloc_id, m->id, 16);
  t->size = m->prop.size;
  t->reserved0 = m->prop.numDevices;
  t->reserved[0] = m->prop.handleTypes;
  int own = m->creator_pid == (uint32_t)getpid();
  t->reserved[1] = own ? cui_secret_make(m->id) : cui_secret_of(m->id, m->creator_pid);
  return own && !t->reserved[1] ? -1 : 0;
}

CUresult cui_mc_export(void *shareableHandle, uint64_t vh, CUmemAllocationHandleType type, unsigned long long flags) {
  cui_fn_cuMemExportToShareableHandle real = REAL(cuMemExportToShareableHandle);
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mc *m = mc_by_vhandle(vh);
  CUresult r = CUDA_SUCCESS;
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!m || m->vrefs == 0 || !m->has_real || !shareableHandle) r = CUDA_ERROR_INVALID_VALUE;
  else if (m->flags & CUI_REC_PASSTHROUGH) r = real(shareableHandle, m->real, type, flags);
  else if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) r = CUDA_ERROR_NOT_SUPPORTED;
  else if (flags != 0) r = CUDA_ERROR_INVALID_VALUE;
  else {
    if (m->role == CUI_ROLE_CREATOR && !cui_cache_has(m->id)) {
      int fd = -1;
      r = real(&fd, m->real, type, 0);
      if (r == CUDA_SUCCESS && cui_cache_put(m->id, fd) != 0) {
        close(fd);
        r = CUDA_ERROR_OUT_OF_MEMORY;
      }
    }
    if (r == CUDA_SUCCESS) {
      struct cui_ticket t;
      int fd = fill_ticket(&t, m) == 0 ? cui_make_ticket(&t) : -1;
      if (fd < 0) r = CUDA_ERROR_OUT_OF_MEMORY;
      else {
        *(int *)shareableHandle = fd;
        m->flags |= CUI_REC_EXPORTED | CUI_REC_SHARED;
      }
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUresult cui_mc_import_ticket(CUmemGenericAllocationHandle *handle, const struct cui_ticket *t) {
  cui_secret_learn(t->alloc_id, t->creator_pid, t->reserved[1]); /* FETCH_FD sends it (peer.c) */
  pthread_mutex_lock(&cui_st.lock);
  if (!cui_gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  struct cui_mc *m = mc_by_id(t->creator_pid, t->alloc_id);
  if (m && m->has_real && m->vrefs > 0) {   /* alias: one driver reference per process */
    m->vrefs++;
    *handle = m->vhandle;
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_SUCCESS;
  }
  if (m && m->has_real) {   /* bound or mapped but released: hand out the same handle again */
    m->vrefs = 1;
    *handle = m->vhandle;
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_SUCCESS;
  }
  cui_st.inflight++;
  pthread_mutex_unlock(&cui_st.lock);

  char why[256], hex[33];
  cui_hex_id(t->alloc_id, hex);
  CUresult r = CUDA_SUCCESS;
  CUmemGenericAllocationHandle h = 0;
  int fd = t->creator_pid == (uint32_t)getpid() ? -1 : cui_fetch_fd(t->creator_pid, t->alloc_id, why, sizeof why);
  if (t->creator_pid == (uint32_t)getpid()) snprintf(why, sizeof why, "this process released it (dead ticket)");
  if (fd < 0) {
    cui_api_warn("cuMemImportFromShareableHandle",
                 "cannot import multicast object %s from creator pid %u: %s; "
                 "output untouched: CUDA_ERROR_INVALID_VALUE",
                 hex, t->creator_pid, why);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    r = REAL(cuMemImportFromShareableHandle)(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    if (r == CUDA_SUCCESS && CUI_IS_VHANDLE(h)) {
      REAL(cuMemRelease)(h);
      r = CUDA_ERROR_INVALID_HANDLE;
    }
  }
  pthread_mutex_lock(&cui_st.lock);
  cui_st.inflight--;
  if (r == CUDA_SUCCESS) {
    m = mc_by_id(t->creator_pid, t->alloc_id);
    if (m && m->has_real) {   /* a concurrent import won */
      REAL(cuMemRelease)(h);
      m->vrefs++;
    } else if ((m = mc_new(t->alloc_id, t->creator_pid)) == NULL) {
      REAL(cuMemRelease)(h);
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      m->role = CUI_ROLE_IMPORTER;
      m->flags = CUI_REC_SHARED;
      m->prop.numDevices = t->reserved0;
      m->prop.size = t->size;
      m->prop.handleTypes = t->reserved[0];
      m->real = h;
      m->has_real = 1;
      m->vrefs = 1;
    }
    if (r == CUDA_SUCCESS) *handle = m->vhandle;
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}
