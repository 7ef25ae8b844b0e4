/*
 * ops_unicast.c: the unicast phase ops (protocol.h "Phases"; docs/shim.md "Phases"), one
 * function per op, named after it: SAVE_ALLOCATIONS, CANCEL_CAPTURE, PREPARE_UNICAST,
 * LOAD_ALLOCATIONS, RESTORE_UNICAST. They run on the control worker with op_running set
 * (ops.c): app calls on tracked objects return CUDA_ERROR_NOT_READY without touching the
 * state, so an op works on the tables without holding the lock across driver calls, in
 * particular not across the FETCH_FD round trips of RESTORE_UNICAST (a peer may be fetching
 * from us at the same time; our accept thread answers it from the export cache).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "phase_ops.h"

/* "<OP>: pid <pid> allocation <hex>: <what> failed: <CUDA_ERROR_...>" and FAILED status. */
static void fail_driver(struct cui_op_result *res, uint32_t op, const struct cui_alloc *a, const char *what,
                        CUresult r) {
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

/* A temporary full-size staging mapping of `h` with read-write access, so partial or
 * read-only app mappings do not limit the copy. Device memory: access for its own device.
 * Host memory: access for the device of the current context (the copy engine reads it), plus
 * its host location for HOST and HOST_NUMA (the CPU's grant; HOST_NUMA_CURRENT names no
 * location an access descriptor can carry). */
static CUresult staging_map(const struct cui_alloc *a, CUmemGenericAllocationHandle h, CUdeviceptr *va,
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

static CUresult staging_unmap(const struct cui_alloc *a, CUdeviceptr va, const char **what) {
  CUresult r = REAL(cuMemUnmap)(va, a->size);
  if (r != CUDA_SUCCESS) {
    *what = "cuMemUnmap (staging)";
    return r;
  }
  r = REAL(cuMemAddressFree)(va, a->size);
  if (r != CUDA_SUCCESS) *what = "cuMemAddressFree (staging)";
  return r;
}

static int is_carried_role(const struct cui_alloc *a) {
  return a->live && a->role == CUI_ROLE_CREATOR && !(a->flags & CUI_REC_RAW_IMPORT);
}

/* Maps every recorded mapping of `a` at its original VA with handle `h` and replays the
 * merged access list. */
static CUresult remap(struct cui_alloc *a, CUmemGenericAllocationHandle h, uint32_t *changed, const char **what) {
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

/* Forget the host carrier: unmap the arena, clear CUI_REC_CARRIED and the carrier fields of
 * every allocation. Returns how many allocations were carried. Only host memory is touched. */
static uint32_t drop_carriers(void) {
  uint32_t n = 0;
  for (size_t i = 0; i < cui_st.nallocs; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (a->flags & CUI_REC_CARRIED) n++;
    a->flags &= ~CUI_REC_CARRIED;
    a->carrier_bytes = 0;
    a->checksum = 0;
    a->carrier_off = 0;
  }
  if (cui_st.arena) munmap(cui_st.arena, cui_st.arena_size);
  cui_st.arena = NULL;
  cui_st.arena_size = 0;
  cui_st.arena_release_pending = 0;
  return n;
}

/* ---------- SAVE_ALLOCATIONS: MULTICAST_RELEASED (or ACTIVE) -> SAVED ---------- */

/* Only copies (device -> host carrier) through temporary staging mappings: the app's handles,
 * mappings and bytes are never touched. So a failure part-way is not destructive: the carrier
 * is dropped and the shim stays ACTIVE (cui_run_op, ops.c), the reply says CUI_FAILED. */
int cui_op_save_allocations(struct cui_op_result *res) {
  size_t total = 0;
  for (size_t i = 0; i < cui_st.nallocs; i++)
    if (is_carried_role(&cui_st.allocs[i])) total += cui_st.allocs[i].size;
  if (total) {
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) {
      res->status = CUI_REFUSED_STATE;
      snprintf(res->message, sizeof res->message,
               "SAVE_ALLOCATIONS: pid %u: cannot allocate a host carrier arena of %zu bytes", (unsigned)getpid(),
               total);
      return -1;   /* nothing changed */
    }
    cui_st.arena = p;
    cui_st.arena_size = total;
  }
  cui_fn_cuMemHostRegister_v2 reg = REAL(cuMemHostRegister_v2);
  int registered = total && reg && reg(cui_st.arena, total, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS;
  size_t off = 0;
  int rc = 0;
  for (size_t i = 0; i < cui_st.nallocs && rc == 0; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (!is_carried_role(a)) continue;
    cui_ensure_context(&a->prop);
    const char *what = NULL;
    CUmemGenericAllocationHandle h;
    int temporary;
    CUdeviceptr va = 0;
    CUresult r = cui_alloc_driver_handle(a, &h, &temporary);
    int held = r == CUDA_SUCCESS;
    if (r != CUDA_SUCCESS) what = "cuMemRetainAllocationHandle";
    if (r == CUDA_SUCCESS) r = staging_map(a, h, &va, &what);
    if (r == CUDA_SUCCESS) {
      uint64_t t0 = cui_now_ns();
      r = REAL(cuMemcpyDtoH_v2)(cui_st.arena + off, va, a->size);
      res->copy_ns += cui_now_ns() - t0;
      if (r != CUDA_SUCCESS) what = "cuMemcpyDtoH_v2";
      const char *w2 = NULL;
      CUresult r2 = staging_unmap(a, va, &w2);
      if (r == CUDA_SUCCESS && r2 != CUDA_SUCCESS) r = r2, what = w2;
    }
    if (temporary && held) REAL(cuMemRelease)(h);
    if (r != CUDA_SUCCESS) {
      fail_driver(res, CUI_OP_SAVE_ALLOCATIONS, a, what, r);
      rc = -1;
      break;
    }
    a->carrier_off = off;
    a->carrier_bytes = a->size;
    a->checksum = cui_checksum64(cui_st.arena + off, a->size);
    a->flags |= CUI_REC_CARRIED;
    off += a->size;
    res->bytes += a->size;
    res->records_changed++;
  }
  if (registered) REAL(cuMemHostUnregister)(cui_st.arena);
  if (rc != 0) {
    drop_carriers();
    res->bytes = 0;
    res->records_changed = 0;
    if (res->status == CUI_FAILED) {
      size_t len = strlen(res->message);
      snprintf(res->message + len, sizeof res->message - len,
               "; the carrier was freed and pid %u stays ACTIVE (nothing was torn down)", (unsigned)getpid());
    }
  }
  return rc;
}

/* ---------- CANCEL_CAPTURE: SAVED -> MULTICAST_RELEASED (or ACTIVE) ---------- */

/* SAVED differs from ACTIVE only by the host carrier (SAVE_ALLOCATIONS only copied): drop it. */
int cui_op_cancel_capture(struct cui_op_result *res) {
  res->records_changed = drop_carriers();
  return 0;
}

/* ---------- PREPARE_UNICAST: SAVED -> PREPARED ---------- */

int cui_op_prepare_unicast(struct cui_op_result *res) {
  for (size_t i = 0; i < cui_st.nallocs; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (!a->live || !(a->flags & CUI_REC_SHARED)) continue;   /* private: native checkpoint */
    CUI_FOR_MAPS_OF(m, a) {
      if (!m->mapped) continue;
      CUresult r = REAL(cuMemUnmap)(m->va, m->size);
      if (r != CUDA_SUCCESS) {
        fail_driver(res, CUI_OP_PREPARE_UNICAST, a, "cuMemUnmap", r);
        return -1;
      }
      m->mapped = 0;
      res->records_changed++;
    }
    if (a->has_real) {
      CUresult r = REAL(cuMemRelease)(a->real);
      if (r != CUDA_SUCCESS) {
        fail_driver(res, CUI_OP_PREPARE_UNICAST, a, "cuMemRelease", r);
        return -1;
      }
      a->has_real = 0;
      res->records_changed++;
    }
  }
  cui_cache_close_all();   /* an open export FD is a driver reference: native checkpoint fails on it */
  return 0;
}

/* ---------- LOAD_ALLOCATIONS: PREPARED -> LOADED ---------- */

int cui_op_load_allocations(struct cui_op_result *res) {
  cui_fn_cuMemHostRegister_v2 reg = REAL(cuMemHostRegister_v2);
  int registered = cui_st.arena_size && reg &&
                   reg(cui_st.arena, cui_st.arena_size, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS;
  int rc = 0;
  for (size_t i = 0; i < cui_st.nallocs && rc == 0; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (!is_carried_role(a) || !(a->flags & CUI_REC_CARRIED)) continue;
    uint64_t sum = cui_checksum64(cui_st.arena + a->carrier_off, a->carrier_bytes);
    if (sum != a->checksum || a->carrier_bytes != a->size) {
      char hex[33];
      cui_hex_id(a->id, hex);
      res->status = CUI_FAILED;
      snprintf(
          res->message, sizeof res->message,
          "LOAD_ALLOCATIONS: pid %u allocation %s: host carrier checksum mismatch (recorded %016llx, found %016llx)",
          (unsigned)getpid(), hex, (unsigned long long)a->checksum, (unsigned long long)sum);
      rc = -1;
      break;
    }
    cui_ensure_context(&a->prop);
    const char *what = "cuMemCreate";
    CUmemGenericAllocationHandle h;
    CUresult r = REAL(cuMemCreate)(&h, a->size, &a->prop, 0);
    CUdeviceptr va = 0;
    if (r == CUDA_SUCCESS) r = staging_map(a, h, &va, &what);
    if (r == CUDA_SUCCESS) {
      uint64_t t0 = cui_now_ns();
      r = REAL(cuMemcpyHtoD_v2)(va, cui_st.arena + a->carrier_off, a->size);
      res->copy_ns += cui_now_ns() - t0;
      if (r != CUDA_SUCCESS) what = "cuMemcpyHtoD_v2";
      const char *w2 = NULL;
      CUresult r2 = staging_unmap(a, va, &w2);
      if (r == CUDA_SUCCESS && r2 != CUDA_SUCCESS) r = r2, what = w2;
    }
    if (r == CUDA_SUCCESS) r = remap(a, h, &res->records_changed, &what);
    if (r == CUDA_SUCCESS && (a->flags & CUI_REC_EXPORTED)) {
      int fd = -1;
      r = REAL(cuMemExportToShareableHandle)(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (r != CUDA_SUCCESS) what = "cuMemExportToShareableHandle";
      else if (cui_cache_put(a->id, fd) != 0) {
        close(fd);
        r = CUDA_ERROR_OUT_OF_MEMORY;
        what = "export cache insert";
      }
    }
    if (r != CUDA_SUCCESS) {
      fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, a, what, r);   /* FAILED: nothing is rolled back */
      rc = -1;
      break;
    }
    if (a->vrefs > 0) {
      a->real = h;
      a->has_real = 1;
    } else {
      REAL(cuMemRelease)(h);   /* the app only kept mappings */
    }
    res->bytes += a->size;
    res->records_changed++;
    a->flags &= ~CUI_REC_CARRIED;
    a->carrier_bytes = 0;
    a->checksum = 0;
    a->carrier_off = 0;
  }
  if (registered) REAL(cuMemHostUnregister)(cui_st.arena);
  if (rc == 0) cui_st.arena_release_pending = 1;   /* freed after the reply went out */
  return rc;
}

/* ---------- RESTORE_UNICAST: LOADED -> MULTICAST_RELEASED (or ACTIVE) ---------- */

int cui_op_restore_unicast(struct cui_op_result *res) {
  for (size_t i = 0; i < cui_st.nallocs; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (!a->live || a->role != CUI_ROLE_IMPORTER || (a->flags & CUI_REC_RAW_IMPORT)) continue;
    char hex[33], why[256];
    cui_hex_id(a->id, hex);
    int fd = cui_fetch_fd(a->creator_pid, a->id, why, sizeof why);
    if (fd < 0) {
      res->status = CUI_FAILED;
      snprintf(res->message, sizeof res->message,
               "RESTORE_UNICAST: pid %u could not import allocation %s from creator pid %u: %s", (unsigned)getpid(),
               hex, a->creator_pid, why);
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
               "RESTORE_UNICAST: pid %u could not import allocation %s from creator pid %u: %s", (unsigned)getpid(),
               hex, a->creator_pid, cui_cu_error_name(r));
      return -1;
    }
    const char *what = NULL;
    r = remap(a, h, &res->records_changed, &what);
    if (r != CUDA_SUCCESS) {
      fail_driver(res, CUI_OP_RESTORE_UNICAST, a, what, r);
      return -1;
    }
    if (a->vrefs > 0) {
      a->real = h;
      a->has_real = 1;
    } else {
      REAL(cuMemRelease)(h);
    }
    res->records_changed++;
  }
  return 0;
}
