/*
 * Multicast objects (docs/shim.md "Multicast"; cuda-driver.md §3; DESIGN.md §2-§3).
 *
 * The app sees virtual handles for multicast objects too (same tag and counter as allocations).
 * Per object the shim records the requested properties, the effective extent (largest
 * mcOffset + size bound or mapped in this process), the devices this process added, its
 * bindings (by handle or by address, v1 or device-explicit _v2 ABI: the wrapper the app
 * reached), its mappings of the object and their access. An object whose handle types are not
 * exactly POSIX_FILE_DESCRIPTOR (0, FABRIC) is created and used normally but flagged
 * CUI_REC_PASSTHROUGH: it cannot be rebuilt, so PREPARE_MULTICAST refuses and the coordinator's
 * validation names it. Binding memory the shim does not track into a tracked object is refused
 * before the driver sees the call (CUDA_ERROR_NOT_SUPPORTED, nothing recorded).
 *
 * Locking: create, add-device, bind and map are collective (bind and map block until every
 * device of the team was added, in every process), so they run with cui_st.lock dropped and
 * counted in cui_st.inflight; the object is looked up again afterwards. Unbind, unmap, access,
 * release and export are local and keep the lock.
 *
 * Phase ops (run on the control worker with op_running set, lock not held):
 *   PREPARE_MULTICAST: unmap every multicast mapping (reservations stay), unbind every binding,
 *     close the cached export FD, release the driver handle: in that order, across all objects.
 *   RESTORE_MULTICAST_CREATORS: creators cuMulticastCreate with the requested properties and
 *     re-export into the export cache; IMPORTERS: importers fetch the FD and import; DEVICES:
 *     every recorded add-device; BINDINGS: bind (same ABI), map at the original VA, set access.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cui.h"



/* ---------- tables (lock held) ---------- */

static struct cui_mc *mc_by_vhandle(uint64_t vh) {
  if (!CUI_IS_VHANDLE(vh)) return NULL;
  for (size_t i = 0; i < cui_st.nmcs; i++)
    if (cui_st.mcs[i].live && cui_st.mcs[i].vhandle == vh) return &cui_st.mcs[i];
  return NULL;
}

static struct cui_mc *mc_by_id(uint32_t creator_pid, const uint8_t id[16]) {
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (m->live && m->creator_pid == creator_pid && memcmp(m->id, id, 16) == 0) return m;
  }
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

static void hexid(const uint8_t id[16], char out[33]) { cui_hex_id(id, out); }

/* The driver reference goes when nothing refers to the object any more. */
static void mc_maybe_destroy(struct cui_mc *m) {
  if (!m->live || m->vrefs || m->nbinds || m->nmaps) return;
  if (m->has_real) {
    if (m->role == CUI_ROLE_CREATOR) cui_cache_close(m->id);   /* an open export FD is a reference */
    REAL(cuMemRelease, fn_release)(m->real);
    m->has_real = 0;
  }
  if (m->role == CUI_ROLE_CREATOR) cui_cache_close(m->id);
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
  fn_mc_create real = REAL(cuMulticastCreate, fn_mc_create);
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
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
      REAL(cuMemRelease, fn_release)(h);
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
        hexid(m->id, hex);
        cui_api_warn("cuMulticastCreate", "multicast object %s has handle types 0x%llx (not exactly "
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
  fn_mc_add real = REAL(cuMulticastAddDevice, fn_mc_add);
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
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

static const char *bind_api(int by_addr, int v2) {
  return by_addr ? (v2 ? "cuMulticastBindAddr_v2" : "cuMulticastBindAddr") : (v2 ? "cuMulticastBindMem_v2" : "cuMulticastBindMem");
}

/* Every bind form. dev: the explicit device (v2) or ignored (v1). by_addr: memptr, else memHandle. */
static CUresult do_bind(uint64_t mch, int v2, CUdevice dev, size_t mc_off, int by_addr, uint64_t memh,
                        CUdeviceptr memptr, size_t mem_off, size_t size, unsigned long long flags) {
  const char *api = bind_api(by_addr, v2);
  void *real = cui_real(by_addr ? (v2 ? CUI_ROW_cuMulticastBindAddr_v2 : CUI_ROW_cuMulticastBindAddr)
                                : (v2 ? CUI_ROW_cuMulticastBindMem_v2 : CUI_ROW_cuMulticastBindMem));
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
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
    hexid(m->id, hex);
    if (by_addr)
      cui_api_warn(api, "address 0x%llx is not in a mapping of a tracked cuMemCreate allocation; binding it into "
                   "multicast object %s could not be restored after a checkpoint; no driver call: "
                   "CUDA_ERROR_NOT_SUPPORTED", (unsigned long long)memptr, hex);
    else
      cui_api_warn(api, "memory handle 0x%llx is not a tracked allocation; binding it into multicast object %s "
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
  if (by_addr) r = v2 ? ((fn_mc_bindaddr2)real)(real_mc, dev, mc_off, memptr, size, flags)
                      : ((fn_mc_bindaddr)real)(real_mc, mc_off, memptr, size, flags);
  else r = v2 ? ((fn_mc_bindmem2)real)(real_mc, dev, mc_off, real_mem, mem_off, size, flags)
              : ((fn_mc_bindmem)real)(real_mc, mc_off, real_mem, mem_off, size, flags);
  CUdevice bound_dev = dev;
  if (r == CUDA_SUCCESS && !v2) {
    fn_ctxdev getdev = REAL(cuCtxGetDevice, fn_ctxdev);
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
      REAL(cuMulticastUnbind, fn_mc_unbind)(m->real, bound_dev, mc_off, size);
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

CUI_EXPORT CUresult cuMulticastUnbind(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset, size_t size) {
  fn_mc_unbind real = REAL(cuMulticastUnbind, fn_mc_unbind);
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
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

/* ---------- release / map / unmap / access (branches of the vmm.c wrappers) ---------- */

CUresult cui_mc_release(uint64_t vh) {
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mc *m = mc_by_vhandle(vh);
  CUresult r = CUDA_SUCCESS;
  if (!cui_gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!m || m->vrefs == 0) {
    cui_api_warn("cuMemRelease", "multicast virtual handle 0x%llx has no references left; no driver call: "
                 "CUDA_ERROR_INVALID_VALUE", (unsigned long long)vh);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    m->vrefs--;
    mc_maybe_destroy(m);   /* the driver reference stays while bindings or mappings remain */
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUresult cui_mc_map(CUdeviceptr ptr, size_t size, size_t offset, uint64_t vh, unsigned long long flags) {
  fn_map real = REAL(cuMemMap, fn_map);
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
      REAL(cuMemUnmap, fn_unmap)(ptr, size);
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
    cui_api_warn("cuMemUnmap", "range 0x%llx+0x%llx is not exactly one multicast mapping; no driver call: "
                 "CUDA_ERROR_INVALID_VALUE", (unsigned long long)ptr, (unsigned long long)size);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    r = REAL(cuMemUnmap, fn_unmap)(ptr, size);
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
    cui_api_warn("cuMemSetAccess", "range 0x%llx+0x%llx is not exactly one multicast mapping; its access could "
                 "not be replayed after a restore: CUDA_ERROR_NOT_SUPPORTED", (unsigned long long)ptr,
                 (unsigned long long)size);
    r = CUDA_ERROR_NOT_SUPPORTED;
  } else {
    uint32_t n = cui_access_count_after(x->access, x->access_count, desc, count);
    if (n > CUI_MAX_ACCESS) r = CUDA_ERROR_NOT_SUPPORTED;
    else r = REAL(cuMemSetAccess, fn_setaccess)(ptr, size, desc, count);
    if (r == CUDA_SUCCESS) cui_access_merge(x->access, &x->access_count, desc, count);
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* ---------- export / import ---------- */

static void fill_ticket(struct cui_ticket *t, const struct cui_mc *m) {
  memset(t, 0, sizeof *t);
  t->kind = CUI_TICKET_MULTICAST;
  t->creator_pid = m->creator_pid;
  memcpy(t->alloc_id, m->id, 16);
  t->size = m->prop.size;
  t->reserved0 = m->prop.numDevices;
  t->reserved[0] = m->prop.handleTypes;
}

CUresult cui_mc_export(void *shareableHandle, uint64_t vh, CUmemAllocationHandleType type, unsigned long long flags) {
  fn_export real = REAL(cuMemExportToShareableHandle, fn_export);
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
      fill_ticket(&t, m);
      int fd = cui_make_ticket(&t);
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
  hexid(t->alloc_id, hex);
  CUresult r = CUDA_SUCCESS;
  CUmemGenericAllocationHandle h = 0;
  int fd = t->creator_pid == (uint32_t)getpid() ? -1 : cui_fetch_fd(t->creator_pid, t->alloc_id, why, sizeof why);
  if (t->creator_pid == (uint32_t)getpid()) snprintf(why, sizeof why, "this process released it (dead ticket)");
  if (fd < 0) {
    cui_api_warn("cuMemImportFromShareableHandle", "cannot import multicast object %s from creator pid %u: %s; "
                 "output untouched: CUDA_ERROR_INVALID_VALUE", hex, t->creator_pid, why);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    r = REAL(cuMemImportFromShareableHandle, fn_import)(&h, (void *)(uintptr_t)fd,
                                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    if (r == CUDA_SUCCESS && CUI_IS_VHANDLE(h)) {
      REAL(cuMemRelease, fn_release)(h);
      r = CUDA_ERROR_INVALID_HANDLE;
    }
  }
  pthread_mutex_lock(&cui_st.lock);
  cui_st.inflight--;
  if (r == CUDA_SUCCESS) {
    m = mc_by_id(t->creator_pid, t->alloc_id);
    if (m && m->has_real) {   /* a concurrent import won */
      REAL(cuMemRelease, fn_release)(h);
      m->vrefs++;
    } else if ((m = mc_new(t->alloc_id, t->creator_pid)) == NULL) {
      REAL(cuMemRelease, fn_release)(h);
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

/* ---------- INSPECT records (lock held) ---------- */

size_t cui_mc_record_count(void) {
  size_t n = 0;
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    const struct cui_mc *m = &cui_st.mcs[i];
    if (m->live) n += 1 + m->ndevs + m->nbinds + m->nmaps;
  }
  return n;
}

static void mc_head(struct cui_record *r, uint16_t kind, const struct cui_mc *m) {
  r->kind = kind;
  r->role = m->role;
  memcpy(r->alloc_id, m->id, 16);
  r->creator_pid = m->creator_pid;
}

static int cmp_bind(const void *x, const void *y) {
  const struct cui_mcbind *a = x, *b = y;
  if (a->dev != b->dev) return a->dev < b->dev ? -1 : 1;
  return a->mc_off < b->mc_off ? -1 : a->mc_off > b->mc_off;
}
static int cmp_mcmap(const void *x, const void *y) {
  const struct cui_mcmap *a = x, *b = y;
  return a->va < b->va ? -1 : a->va > b->va;
}

/* Objects in creation order; after each: its devices (in add order), bindings (by device,
 * offset), mappings (by VA). */
size_t cui_mc_fill_records(struct cui_record *out) {
  size_t k = 0;
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live) continue;
    struct cui_record *r = &out[k++];
    mc_head(r, CUI_RECORD_MULTICAST, m);
    r->flags = m->flags;
    r->handle_refs = m->vrefs;
    r->size = m->prop.size;
    r->offset = m->extent;
    r->prop_location_id = (int32_t)m->prop.numDevices;
    r->prop_handle_types = (uint32_t)m->prop.handleTypes;
    for (uint32_t d = 0; d < m->ndevs; d++) {
      r = &out[k++];
      mc_head(r, CUI_RECORD_MULTICAST_DEVICE, m);
      r->prop_location_type = CU_MEM_LOCATION_TYPE_DEVICE;
      r->prop_location_id = m->devs[d];
    }
    if (m->nbinds) qsort(m->binds, m->nbinds, sizeof *m->binds, cmp_bind);
    for (uint32_t b = 0; b < m->nbinds; b++) {
      const struct cui_mcbind *x = &m->binds[b];
      r = &out[k++];
      mc_head(r, CUI_RECORD_MULTICAST_BINDING, m);
      r->flags = x->flags;
      r->prop_location_type = CU_MEM_LOCATION_TYPE_DEVICE;
      r->prop_location_id = x->dev;
      r->offset = x->mc_off;
      r->size = x->size;
      r->va = x->memptr;
      if (x->has_member) {
        const struct cui_alloc *a = &cui_st.allocs[x->member];
        memcpy(&r->reserved[0], a->id, 16);
        r->reserved0 = a->creator_pid;
        r->reserved[2] = x->mem_off;
      }
    }
    if (m->nmaps) qsort(m->maps, m->nmaps, sizeof *m->maps, cmp_mcmap);
    for (uint32_t q = 0; q < m->nmaps; q++) {
      const struct cui_mcmap *x = &m->maps[q];
      r = &out[k++];
      mc_head(r, CUI_RECORD_MULTICAST_MAPPING, m);
      r->va = x->va;
      r->size = x->size;
      r->offset = x->offset;
      r->access_count = x->access_count;
      memcpy(r->access, x->access, x->access_count * sizeof x->access[0]);
    }
  }
  return k;
}

/* ---------- phase ops ---------- */

static void mc_fail(struct cui_op_result *res, const char *op, const struct cui_mc *m, const char *what, CUresult r) {
  char hex[33];
  hexid(m->id, hex);
  res->status = CUI_FAILED;
  res->cuda_result = (int32_t)r;
  snprintf(res->message, sizeof res->message, "%s: pid %u multicast object %s: %s failed: %s", op,
           (unsigned)getpid(), hex, what, cui_cu_error_name(r));
}

/* Teardown in driver order across all objects: unmap -> unbind -> close cached FD -> release. */
int cui_PREPARE_MULTICAST(struct cui_op_result *res) {
  const char *op = "PREPARE_MULTICAST";
  cui_st.mc_cycle = 1;
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live) continue;
    for (uint32_t k = 0; k < m->nmaps; k++) {
      struct cui_mcmap *x = &m->maps[k];
      if (!x->mapped) continue;
      CUresult r = REAL(cuMemUnmap, fn_unmap)(x->va, x->size);
      if (r != CUDA_SUCCESS) {
        char what[96];
        snprintf(what, sizeof what, "cuMemUnmap(0x%llx, 0x%llx)", (unsigned long long)x->va, (unsigned long long)x->size);
        mc_fail(res, op, m, what, r);
        return -1;
      }
      x->mapped = 0;
      res->records_changed++;
    }
  }
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live) continue;
    for (uint32_t k = 0; k < m->nbinds; k++) {
      struct cui_mcbind *b = &m->binds[k];
      if (!b->bound) continue;
      CUresult r = REAL(cuMulticastUnbind, fn_mc_unbind)(m->real, b->dev, b->mc_off, b->size);
      if (r != CUDA_SUCCESS) {
        char what[96];
        snprintf(what, sizeof what, "cuMulticastUnbind(device %d, offset 0x%llx, size 0x%llx)", b->dev,
                 (unsigned long long)b->mc_off, (unsigned long long)b->size);
        mc_fail(res, op, m, what, r);
        return -1;
      }
      b->bound = 0;
      res->records_changed++;
    }
  }
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live) continue;
    cui_cache_close(m->id);   /* before the release: an open export FD is a reference */
    if (m->has_real) {
      CUresult r = REAL(cuMemRelease, fn_release)(m->real);
      if (r != CUDA_SUCCESS) {
        mc_fail(res, op, m, "cuMemRelease", r);
        return -1;
      }
      m->has_real = 0;
      res->records_changed++;
    }
  }
  return 0;
}

int cui_RESTORE_MULTICAST_CREATORS(struct cui_op_result *res) {
  const char *op = "RESTORE_MULTICAST_CREATORS";
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live || m->role != CUI_ROLE_CREATOR || m->has_real) continue;
    CUmemGenericAllocationHandle h;
    CUresult r = REAL(cuMulticastCreate, fn_mc_create)(&h, &m->prop);   /* the requested size */
    if (r != CUDA_SUCCESS) {
      mc_fail(res, op, m, "cuMulticastCreate", r);
      return -1;
    }
    m->real = h;
    m->has_real = 1;
    res->records_changed++;
    if (m->flags & CUI_REC_EXPORTED) {
      int fd = -1;
      r = REAL(cuMemExportToShareableHandle, fn_export)(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (r != CUDA_SUCCESS) {
        mc_fail(res, op, m, "cuMemExportToShareableHandle", r);
        return -1;
      }
      if (cui_cache_put(m->id, fd) != 0) {
        close(fd);
        mc_fail(res, op, m, "export cache insert", CUDA_ERROR_OUT_OF_MEMORY);
        return -1;
      }
    }
  }
  return 0;
}

int cui_RESTORE_MULTICAST_IMPORTERS(struct cui_op_result *res) {
  const char *op = "RESTORE_MULTICAST_IMPORTERS";
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live || m->role != CUI_ROLE_IMPORTER || m->has_real) continue;
    char why[256], hex[33];
    hexid(m->id, hex);
    int fd = cui_fetch_fd(m->creator_pid, m->id, why, sizeof why);
    if (fd < 0) {
      res->status = CUI_FAILED;
      snprintf(res->message, sizeof res->message, "%s: pid %u could not import multicast object %s from creator pid "
               "%u: %s", op, (unsigned)getpid(), hex, m->creator_pid, why);
      return -1;
    }
    CUmemGenericAllocationHandle h;
    CUresult r = REAL(cuMemImportFromShareableHandle, fn_import)(&h, (void *)(uintptr_t)fd,
                                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    if (r != CUDA_SUCCESS) {
      mc_fail(res, op, m, "cuMemImportFromShareableHandle", r);
      return -1;
    }
    m->real = h;
    m->has_real = 1;
    res->records_changed++;
  }
  return 0;
}

int cui_RESTORE_MULTICAST_DEVICES(struct cui_op_result *res) {
  const char *op = "RESTORE_MULTICAST_DEVICES";
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live) continue;
    for (uint32_t d = 0; d < m->ndevs; d++) {
      CUresult r = REAL(cuMulticastAddDevice, fn_mc_add)(m->real, m->devs[d]);
      if (r != CUDA_SUCCESS) {
        char what[64];
        snprintf(what, sizeof what, "cuMulticastAddDevice(device %d)", m->devs[d]);
        mc_fail(res, op, m, what, r);
        return -1;
      }
      res->records_changed++;
    }
  }
  return 0;
}

int cui_RESTORE_MULTICAST_BINDINGS(struct cui_op_result *res) {
  const char *op = "RESTORE_MULTICAST_BINDINGS";
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live) continue;
    for (uint32_t k = 0; k < m->nbinds; k++) {
      struct cui_mcbind *b = &m->binds[k];
      if (b->bound) continue;
      int by_addr = (b->flags & CUI_REC_MC_BY_ADDR) != 0, v2 = (b->flags & CUI_REC_MC_V2_ABI) != 0;
      CUresult r = CUDA_SUCCESS;
      if (!v2) r = cui_set_device_context(b->dev);   /* the v1 ABI binds for the current device */
      CUmemGenericAllocationHandle mem = 0;
      int temporary = 0;
      if (r == CUDA_SUCCESS && !by_addr) r = cui_alloc_driver_handle(&cui_st.allocs[b->member], &mem, &temporary);
      if (r == CUDA_SUCCESS) {
        if (by_addr) r = v2 ? REAL(cuMulticastBindAddr_v2, fn_mc_bindaddr2)(m->real, b->dev, b->mc_off, b->memptr, b->size, 0)
                            : REAL(cuMulticastBindAddr, fn_mc_bindaddr)(m->real, b->mc_off, b->memptr, b->size, 0);
        else r = v2 ? REAL(cuMulticastBindMem_v2, fn_mc_bindmem2)(m->real, b->dev, b->mc_off, mem, b->mem_off, b->size, 0)
                    : REAL(cuMulticastBindMem, fn_mc_bindmem)(m->real, b->mc_off, mem, b->mem_off, b->size, 0);
      }
      if (temporary) REAL(cuMemRelease, fn_release)(mem);
      if (r != CUDA_SUCCESS) {
        char what[96];
        snprintf(what, sizeof what, "%s(device %d, offset 0x%llx, size 0x%llx)", bind_api(by_addr, v2), b->dev,
                 (unsigned long long)b->mc_off, (unsigned long long)b->size);
        mc_fail(res, op, m, what, r);
        return -1;
      }
      b->bound = 1;
      res->records_changed++;
    }
    for (uint32_t k = 0; k < m->nmaps; k++) {
      struct cui_mcmap *x = &m->maps[k];
      if (x->mapped) continue;
      CUresult r = REAL(cuMemMap, fn_map)(x->va, x->size, x->offset, m->real, 0);
      if (r != CUDA_SUCCESS) {
        mc_fail(res, op, m, "cuMemMap", r);
        return -1;
      }
      x->mapped = 1;
      res->records_changed++;
      if ((r = cui_access_replay(x->va, x->size, x->access, x->access_count)) != CUDA_SUCCESS) {
        mc_fail(res, op, m, "cuMemSetAccess", r);
        return -1;
      }
    }
  }
  cui_st.mc_cycle = 0;
  return 0;
}
