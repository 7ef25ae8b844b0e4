/*
 * ops_unicast.c: the unicast phase ops (protocol.h "Phases"; docs/shim.md "Phases"), one
 * function per op, named after it: PREPARE_UNICAST, RESTORE_UNICAST, and the helpers of the
 * byte-moving ops SAVE_ALLOCATIONS, CANCEL_CAPTURE (ops_carriers.c) and LOAD_ALLOCATIONS (ops_load.c). They run on the
 * control worker with op_running set (ops.c): app calls on tracked objects return CUDA_ERROR_NOT_READY without touching
 * the state, so an op works on the tables without holding the lock across driver calls, in particular not across the
 * FETCH_FD round trips of RESTORE_UNICAST (a peer may be fetching from us at the same time; our accept thread answers
 * it from the export cache).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "phase_ops.h"

/* "<OP>: pid <pid> allocation <hex>: <what> failed: <CUDA_ERROR_...>" and FAILED status. */
void cui_fail_driver(struct cui_op_result *res, uint32_t op, const struct cui_alloc *a, const char *what, CUresult r) {
  char hex[33];
  cui_hex_id(a->id, hex);
  res->status = CUI_FAILED;
  res->cuda_result = (int32_t)r;
  snprintf(res->message, sizeof res->message, "%s: pid %u allocation %s: %s failed: %s", cui_op_name(op),
           (unsigned)getpid(), hex, what, cui_cu_error_name(r));
}

/* ---------- helpers for the byte-moving phases ---------- */

/* Is the allocation's memory on the host (CUDA driver API cuMemCreate: location HOST,
 * HOST_NUMA or HOST_NUMA_CURRENT; NCCL's SHM transport uses HOST_NUMA with POSIX FDs)? */
static int host_located(const CUmemAllocationProp *p) {
  return p->location.type == CU_MEM_LOCATION_TYPE_HOST || p->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA ||
         p->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT;
}

/* The VA of a mapping record of the whole of device allocation `a` in this process whose access
 * grants `need` (CU_MEM_ACCESS_FLAGS_PROT_READ or _READWRITE) to the allocation's own device, mapped
 * now (`mapped` 1) or to be mapped again (0), or 0. SAVE_ALLOCATIONS copies from it (the workload
 * is quiesced) and LOAD_ALLOCATIONS into it, instead of mapping the allocation a second time: no
 * second VA range, and on fakecuda, whose device memory is a host memfd, no second fault of every
 * page (VmRSS would count the allocation twice). Host-located memory always takes the staging
 * mapping. */
CUdeviceptr cui_whole_mapping(const struct cui_alloc *a, unsigned need, int mapped) {
  if (host_located(&a->prop) || a->prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) return 0;
  for (uint32_t ref = a->maps_head; ref; ref = CUI_MAP(ref)->next) {
    const struct cui_mapping *m = CUI_MAP(ref);
    if (!m->mapped != !mapped || m->offset != 0 || m->size != a->size) continue;
    for (uint32_t k = 0; k < m->access_count && k < CUI_MAX_ACCESS; k++)
      if (m->access[k].location_type == CU_MEM_LOCATION_TYPE_DEVICE &&
          m->access[k].location_id == a->prop.location.id && (m->access[k].flags & need) == need)
        return (CUdeviceptr)m->va;
  }
  return 0;
}

/* A temporary full-size staging mapping of `h` with read-write access, so partial or
 * read-only app mappings do not limit the copy. Device memory: access for its own device.
 * Host memory: access for the device of the current context (the copy engine reads it), plus
 * its host location for HOST and HOST_NUMA (the CPU's grant; HOST_NUMA_CURRENT names no
 * location an access descriptor can carry). */
CUresult cui_staging_map(const struct cui_alloc *a, CUmemGenericAllocationHandle h, CUdeviceptr *va,
                         const char **what) {
  *va = 0;
  CUresult r = REAL(cuMemAddressReserve)(va, a->size, 0, 0, 0);
  if (r != CUDA_SUCCESS) {
    *what = "cuMemAddressReserve (staging)";
    *va = 0;
    return r;
  }
  r = REAL(cuMemMap)(*va, a->size, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    *what = "cuMemMap (staging)";
    REAL(cuMemAddressFree)(*va, a->size);
    *va = 0;
    return r;
  }
  CUmemAccessDesc d[2];
  memset(d, 0, sizeof d);
  size_t n = 1;
  d[0].location = a->prop.location;
  d[0].flags = d[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (host_located(&a->prop)) {
    CUdevice dev = 0;
    cui_fn_cuCtxGetDevice getdev = REAL(cuCtxGetDevice);
    if (!getdev || getdev(&dev) != CUDA_SUCCESS) dev = 0;
    d[1] = d[0];
    d[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d[0].location.id = (int)dev;
    n = a->prop.location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT ? 1 : 2;
  }
  r = REAL(cuMemSetAccess)(*va, a->size, d, n);
  if (r != CUDA_SUCCESS) {
    *what = "cuMemSetAccess (staging)";
    REAL(cuMemUnmap)(*va, a->size);
    REAL(cuMemAddressFree)(*va, a->size);
    *va = 0;
  }
  return r;
}

CUresult cui_staging_unmap(const struct cui_alloc *a, CUdeviceptr va, const char **what) {
  CUresult r = REAL(cuMemUnmap)(va, a->size);
  if (r != CUDA_SUCCESS) {
    *what = "cuMemUnmap (staging)";
    return r;
  }
  r = REAL(cuMemAddressFree)(va, a->size);
  if (r != CUDA_SUCCESS) *what = "cuMemAddressFree (staging)";
  return r;
}

int cui_is_carried_role(const struct cui_alloc *a) {
  return a->live && a->role == CUI_ROLE_CREATOR && !(a->flags & CUI_REC_RAW_IMPORT);
}

/* Maps every recorded mapping of `a` at its original VA with handle `h` and replays the
 * merged access list. */
CUresult cui_remap(struct cui_alloc *a, CUmemGenericAllocationHandle h, uint32_t *changed, const char **what) {
  CUI_FOR_MAPS_OF(m, a) {
    if (m->mapped) continue;
    CUresult r = REAL(cuMemMap)(m->va, m->size, m->offset, h, 0);
    if (r != CUDA_SUCCESS) {
      *what = "cuMemMap";
      return r;
    }
    m->mapped = 1;
    (*changed)++;
    r = cui_access_replay(m->va, m->size, m->access, m->access_count);
    if (r != CUDA_SUCCESS) {
      *what = "cuMemSetAccess";
      return r;
    }
  }
  return CUDA_SUCCESS;
}

/* Unmaps every mapped record of `a` (PREPARE_UNICAST; a refused LOAD_ALLOCATIONS undoing its
 * mappings). */
CUresult cui_unmap_all(struct cui_alloc *a, uint32_t *changed, const char **what) {
  CUI_FOR_MAPS_OF(m, a) {
    if (!m->mapped) continue;
    CUresult r = REAL(cuMemUnmap)(m->va, m->size);
    if (r != CUDA_SUCCESS) {
      *what = "cuMemUnmap";
      return r;
    }
    m->mapped = 0;
    (*changed)++;
  }
  return CUDA_SUCCESS;
}

/* ---------- PREPARE_UNICAST: SAVED -> PREPARED ---------- */

int cui_op_prepare_unicast(struct cui_op_result *res) {
  for (size_t i = 0; i < cui_st.nallocs; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (!a->live || !(a->flags & CUI_REC_SHARED)) continue;   /* private: native checkpoint */
    const char *what = NULL;
    CUresult r = cui_unmap_all(a, &res->records_changed, &what);
    if (r != CUDA_SUCCESS) {
      cui_fail_driver(res, CUI_OP_PREPARE_UNICAST, a, what, r);
      return -1;
    }
    if (a->has_real) {
      r = REAL(cuMemRelease)(a->real);
      if (r != CUDA_SUCCESS) {
        cui_fail_driver(res, CUI_OP_PREPARE_UNICAST, a, "cuMemRelease", r);
        return -1;
      }
      a->has_real = 0;
      res->records_changed++;
    }
  }
  cui_cache_close_all();   /* an open export FD is a driver reference: native checkpoint fails on it */
  return 0;
}

/* ---------- RESTORE_UNICAST: LOADED -> MULTICAST_RELEASED (or ACTIVE) ---------- */

/* FETCH_FD requests RESTORE_UNICAST keeps in flight: each its own connection (protocol.h: one
 * request per connection), sent ahead of the replies so that the creator's accept thread serves
 * them back to back instead of one round trip, and two wake-ups, per allocation; well under the
 * control socket's listen backlog (64). */
#define CUI_FETCH_WINDOW 16

static int restore_one(struct cui_op_result *res, struct cui_alloc *a, int fd, const char *why) {
  char hex[33];
  cui_hex_id(a->id, hex);
  if (fd < 0) {
    res->status = CUI_FAILED;
    snprintf(res->message, sizeof res->message,
             "RESTORE_UNICAST: pid %u could not import allocation %s from creator pid %u: %s", (unsigned)getpid(), hex,
             a->creator_pid, why);
    return -1;
  }
  CUmemGenericAllocationHandle h;
  CUresult r = REAL(cuMemImportFromShareableHandle)(&h, (void *)(uintptr_t)fd,
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(fd);
  if (r != CUDA_SUCCESS) {
    res->status = CUI_FAILED;
    res->cuda_result = (int32_t)r;
    snprintf(res->message, sizeof res->message,
             "RESTORE_UNICAST: pid %u could not import allocation %s from creator pid %u: %s", (unsigned)getpid(), hex,
             a->creator_pid, cui_cu_error_name(r));
    return -1;
  }
  const char *what = NULL;
  r = cui_remap(a, h, &res->records_changed, &what);
  if (r != CUDA_SUCCESS) {
    cui_fail_driver(res, CUI_OP_RESTORE_UNICAST, a, what, r);
    return -1;
  }
  if (a->vrefs > 0) {
    a->real = h;
    a->has_real = 1;
  } else {
    REAL(cuMemRelease)(h);
  }
  res->records_changed++;
  return 0;
}

static int imported_again(const struct cui_alloc *a) {
  return a->live && a->role == CUI_ROLE_IMPORTER && !(a->flags & CUI_REC_RAW_IMPORT);
}

int cui_op_restore_unicast(struct cui_op_result *res) {
  int socks[CUI_FETCH_WINDOW];
  char why[CUI_FETCH_WINDOW][256];
  size_t sent = 0, done = 0, next = 0;   /* requests sent, allocations restored; the next to send */
  int rc = 0;
  for (size_t i = 0; i < cui_st.nallocs && rc == 0; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (!imported_again(a)) continue;
    for (; next < cui_st.nallocs && sent < done + CUI_FETCH_WINDOW; next++) {   /* keep the window full */
      const struct cui_alloc *b = &cui_st.allocs[next];
      if (next < i || !imported_again(b)) continue;
      size_t w = sent++ % CUI_FETCH_WINDOW;
      socks[w] = cui_fetch_send(b->creator_pid, b->id, why[w], sizeof why[w]);
    }
    size_t w = done++ % CUI_FETCH_WINDOW;
    int32_t status;
    int fd = socks[w] < 0 ? -1 : cui_fetch_recv(socks[w], a->creator_pid, why[w], sizeof why[w], &status);
    rc = restore_one(res, a, fd, why[w]);
  }
  for (; done < sent; done++)   /* a failure: the requests still in flight are dropped */
    if (socks[done % CUI_FETCH_WINDOW] >= 0) close(socks[done % CUI_FETCH_WINDOW]);
  return rc;
}
