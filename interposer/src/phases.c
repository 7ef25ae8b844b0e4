/*
 * INSPECT and the unicast phase ops (protocol.h header comment; DESIGN.md §3;
 * prior-art.md §3.2 and §4). One function per phase, named after it. They run on the control
 * worker thread. A mutating op first closes the gate (op_running) under the state lock; from
 * then on app calls on tracked objects return CUDA_ERROR_NOT_READY without touching the state,
 * so the op works on the tables without holding the lock across driver calls, in particular
 * not across the FETCH_FD round trips of RESTORE_UNICAST (a peer may be fetching from us at the
 * same time; our accept thread answers it from the export cache).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cui.h"



static const char *op_name(uint16_t op) {
  switch (op) {
    case CUI_OP_INSPECT: return "INSPECT";
    case CUI_OP_PREPARE_MULTICAST: return "PREPARE_MULTICAST";
    case CUI_OP_SAVE_ALLOCATIONS: return "SAVE_ALLOCATIONS";
    case CUI_OP_PREPARE_UNICAST: return "PREPARE_UNICAST";
    case CUI_OP_LOAD_ALLOCATIONS: return "LOAD_ALLOCATIONS";
    case CUI_OP_RESTORE_UNICAST: return "RESTORE_UNICAST";
    case CUI_OP_RESTORE_MULTICAST_CREATORS: return "RESTORE_MULTICAST_CREATORS";
    case CUI_OP_RESTORE_MULTICAST_IMPORTERS: return "RESTORE_MULTICAST_IMPORTERS";
    case CUI_OP_RESTORE_MULTICAST_DEVICES: return "RESTORE_MULTICAST_DEVICES";
    case CUI_OP_RESTORE_MULTICAST_BINDINGS: return "RESTORE_MULTICAST_BINDINGS";
    case CUI_OP_CANCEL_CAPTURE: return "CANCEL_CAPTURE";
    case CUI_OP_FETCH_FD: return "FETCH_FD";
  }
  return "UNKNOWN";
}

/* "<OP>: pid <pid> allocation <hex>: <what> failed: <CUDA_ERROR_...>" and FAILED status. */
static void fail_driver(struct cui_op_result *res, uint16_t op, const struct cui_alloc *a, const char *what, CUresult r) {
  char hex[33];
  cui_hex_id(a->id, hex);
  res->status = CUI_FAILED;
  res->cuda_result = (int32_t)r;
  snprintf(res->message, sizeof res->message, "%s: pid %u allocation %s: %s failed: %s", op_name(op),
           (unsigned)getpid(), hex, what, cui_cu_error_name(r));
}

/* ---------- INSPECT ---------- */

static void fill_alloc_fields(struct cui_record *rec, const struct cui_alloc *a) {
  rec->role = a->role;
  rec->flags = a->flags;
  memcpy(rec->alloc_id, a->id, 16);
  rec->creator_pid = a->creator_pid;
  rec->handle_refs = a->vrefs;
  rec->prop_type = (uint32_t)a->prop.type;
  rec->prop_location_type = (uint32_t)a->prop.location.type;
  rec->prop_location_id = a->prop.location.id;
  rec->prop_handle_types = (uint32_t)a->prop.requestedHandleTypes;
}

static int cmp_va_map(const void *x, const void *y) {
  const struct cui_mapping *a = *(const struct cui_mapping *const *)x, *b = *(const struct cui_mapping *const *)y;
  return a->va < b->va ? -1 : a->va > b->va;
}
static int cmp_vhandle(const void *x, const void *y) {
  const struct cui_alloc *a = *(const struct cui_alloc *const *)x, *b = *(const struct cui_alloc *const *)y;
  return a->vhandle < b->vhandle ? -1 : a->vhandle > b->vhandle;
}
static int cmp_va_resv(const void *x, const void *y) {
  const struct cui_reservation *a = x, *b = y;
  return a->va < b->va ? -1 : a->va > b->va;
}

/* Records: allocations in creation order, then mappings by VA, then reservations by VA, then
 * the multicast records (multicast.c). Lock held. */
static int build_records(struct cui_op_result *res) {
  size_t n = cui_st.nmaps + cui_st.nresv + cui_mc_record_count();
  for (size_t i = 0; i < cui_st.nallocs; i++) n += cui_st.allocs[i].live;
  struct cui_record *recs = calloc(n ? n : 1, sizeof *recs);
  const struct cui_mapping **maps = calloc(cui_st.nmaps ? cui_st.nmaps : 1, sizeof *maps);
  struct cui_reservation *resv = malloc((cui_st.nresv ? cui_st.nresv : 1) * sizeof *resv);
  if (!recs || !maps || !resv) {
    free(recs), free(maps), free(resv);
    return -1;
  }
  size_t k = 0, na = 0;
  const struct cui_alloc **allocs = calloc(cui_st.nallocs ? cui_st.nallocs : 1, sizeof *allocs);
  if (!allocs) {
    free(recs), free(maps), free(resv);
    return -1;
  }
  for (size_t i = 0; i < cui_st.nallocs; i++)
    if (cui_st.allocs[i].live) allocs[na++] = &cui_st.allocs[i];
  qsort(allocs, na, sizeof *allocs, cmp_vhandle);   /* creation order (slots are reused) */
  for (size_t i = 0; i < na; i++) {
    const struct cui_alloc *a = allocs[i];
    struct cui_record *r = &recs[k++];
    r->kind = CUI_RECORD_ALLOCATION;
    fill_alloc_fields(r, a);
    r->size = a->size;
    r->carrier_checksum = a->checksum;
    r->carrier_bytes = a->carrier_bytes;
  }
  size_t nm = 0;
  for (size_t i = 0; i < cui_st.nslots; i++)
    if (cui_st.maps[i].used) maps[nm++] = &cui_st.maps[i];
  qsort(maps, nm, sizeof *maps, cmp_va_map);
  for (size_t i = 0; i < cui_st.nmaps; i++) {
    const struct cui_mapping *m = maps[i];
    struct cui_record *r = &recs[k++];
    r->kind = CUI_RECORD_MAPPING;
    fill_alloc_fields(r, &cui_st.allocs[m->alloc]);
    r->size = m->size;
    r->va = m->va;
    r->offset = m->offset;
    r->access_count = m->access_count;
    memcpy(r->access, m->access, m->access_count * sizeof m->access[0]);
  }
  if (cui_st.nresv) memcpy(resv, cui_st.resv, cui_st.nresv * sizeof *resv);   /* resv is NULL before the first */
  qsort(resv, cui_st.nresv, sizeof *resv, cmp_va_resv);
  for (size_t i = 0; i < cui_st.nresv; i++) {
    struct cui_record *r = &recs[k++];
    r->kind = CUI_RECORD_RESERVATION;
    r->size = resv[i].size;
    r->va = resv[i].va;
    r->offset = resv[i].align;
  }
  k += cui_mc_fill_records(&recs[k]);
  free(allocs);
  free(maps);
  free(resv);
  res->records = recs;
  res->record_count = (uint32_t)k;
  return 0;
}

static void INSPECT(struct cui_op_result *res) {
  if (build_records(res) != 0) {
    res->status = CUI_BAD_REQUEST;
    snprintf(res->message, sizeof res->message, "INSPECT: pid %u: out of memory", (unsigned)getpid());
  }
}

/* ---------- helpers for the byte-moving phases ---------- */

/* Best effort: make a context current on the worker thread for the allocation's device (the
 * real driver needs one for cuMemcpy*). Failures surface at the copy itself. */
static void ensure_context(const CUmemAllocationProp *prop) {
  fn_ctxget get = REAL(cuCtxGetCurrent, fn_ctxget);
  CUcontext cur = NULL;
  if (!get || get(&cur) != CUDA_SUCCESS || cur) return;
  fn_devget devget = REAL(cuDeviceGet, fn_devget);
  fn_pretain pretain = REAL(cuDevicePrimaryCtxRetain, fn_pretain);
  fn_ctxset set = REAL(cuCtxSetCurrent, fn_ctxset);
  if (!devget || !pretain || !set) return;
  int ordinal = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id : 0;
  CUdevice dev;
  CUcontext ctx;
  if (devget(&dev, ordinal) == CUDA_SUCCESS && pretain(&ctx, dev) == CUDA_SUCCESS) set(ctx);
}

CUresult cui_set_device_context(int ordinal) {
  fn_devget devget = REAL(cuDeviceGet, fn_devget);
  fn_pretain pretain = REAL(cuDevicePrimaryCtxRetain, fn_pretain);
  fn_ctxset set = REAL(cuCtxSetCurrent, fn_ctxset);
  if (!devget || !pretain || !set) return CUDA_ERROR_NOT_INITIALIZED;
  CUdevice dev;
  CUcontext ctx;
  CUresult r = devget(&dev, ordinal);
  if (r == CUDA_SUCCESS) r = pretain(&ctx, dev);   /* kept: the worker reuses it */
  if (r == CUDA_SUCCESS) r = set(ctx);
  return r;
}

/* A temporary full-size staging mapping of `h` with read-write access, so partial or
 * read-only app mappings do not limit the copy. */
static CUresult staging_map(const struct cui_alloc *a, CUmemGenericAllocationHandle h, CUdeviceptr *va,
                            const char **what) {
  *va = 0;
  CUresult r = REAL(cuMemAddressReserve, fn_reserve)(va, a->size, 0, 0, 0);
  if (r != CUDA_SUCCESS) {
    *what = "cuMemAddressReserve (staging)";
    *va = 0;
    return r;
  }
  r = REAL(cuMemMap, fn_map)(*va, a->size, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    *what = "cuMemMap (staging)";
    REAL(cuMemAddressFree, fn_free)(*va, a->size);
    *va = 0;
    return r;
  }
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location = a->prop.location;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = REAL(cuMemSetAccess, fn_setaccess)(*va, a->size, &d, 1);
  if (r != CUDA_SUCCESS) {
    *what = "cuMemSetAccess (staging)";
    REAL(cuMemUnmap, fn_unmap)(*va, a->size);
    REAL(cuMemAddressFree, fn_free)(*va, a->size);
    *va = 0;
  }
  return r;
}

static CUresult staging_unmap(const struct cui_alloc *a, CUdeviceptr va, const char **what) {
  CUresult r = REAL(cuMemUnmap, fn_unmap)(va, a->size);
  if (r != CUDA_SUCCESS) {
    *what = "cuMemUnmap (staging)";
    return r;
  }
  r = REAL(cuMemAddressFree, fn_free)(va, a->size);
  if (r != CUDA_SUCCESS) *what = "cuMemAddressFree (staging)";
  return r;
}

/* The driver handle of `a`: the one held, else a temporary retain through one of its mappings
 * (*temporary = 1: the caller releases it). CUDA_ERROR_INVALID_VALUE when neither exists. */
CUresult cui_alloc_driver_handle(struct cui_alloc *a, CUmemGenericAllocationHandle *h, int *temporary) {
  *temporary = 0;
  if (a->has_real) {
    *h = a->real;
    return CUDA_SUCCESS;
  }
  CUI_FOR_MAPS_OF(m, a)
    if (m->mapped) {
      *temporary = 1;
      return REAL(cuMemRetainAllocationHandle, fn_retain)(h, (void *)(uintptr_t)m->va);
    }
  return CUDA_ERROR_INVALID_VALUE;
}

static int is_carried_role(const struct cui_alloc *a) {
  return a->live && a->role == CUI_ROLE_CREATOR && !(a->flags & CUI_REC_RAW_IMPORT);
}

/* Maps every recorded mapping of `a` at its original VA with handle `h` and replays the
 * merged access list. */
static CUresult remap(struct cui_alloc *a, CUmemGenericAllocationHandle h, uint32_t *changed, const char **what) {
  CUI_FOR_MAPS_OF(m, a) {
    if (m->mapped) continue;
    CUresult r = REAL(cuMemMap, fn_map)(m->va, m->size, m->offset, h, 0);
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

/* ---------- SAVE_ALLOCATIONS: ACTIVE -> SAVED ---------- */

/* Only copies (device -> host carrier) through temporary staging mappings: the app's handles,
 * mappings and bytes are never touched. So a failure part-way is not destructive: the carrier
 * is dropped and the shim stays ACTIVE (cui_run_op), the reply says CUI_FAILED. */
static int SAVE_ALLOCATIONS(struct cui_op_result *res) {
  size_t total = 0;
  for (size_t i = 0; i < cui_st.nallocs; i++)
    if (is_carried_role(&cui_st.allocs[i])) total += cui_st.allocs[i].size;
  if (total) {
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) {
      res->status = CUI_REFUSED_STATE;
      snprintf(res->message, sizeof res->message,
               "SAVE_ALLOCATIONS: pid %u: cannot allocate a host carrier arena of %zu bytes", (unsigned)getpid(), total);
      return -1;   /* nothing changed */
    }
    cui_st.arena = p;
    cui_st.arena_size = total;
  }
  fn_hostreg reg = REAL(cuMemHostRegister_v2, fn_hostreg);
  int registered = total && reg && reg(cui_st.arena, total, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS;
  size_t off = 0;
  int rc = 0;
  for (size_t i = 0; i < cui_st.nallocs && rc == 0; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (!is_carried_role(a)) continue;
    ensure_context(&a->prop);
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
      r = REAL(cuMemcpyDtoH_v2, fn_dtoh)(cui_st.arena + off, va, a->size);
      res->copy_ns += cui_now_ns() - t0;
      if (r != CUDA_SUCCESS) what = "cuMemcpyDtoH_v2";
      const char *w2 = NULL;
      CUresult r2 = staging_unmap(a, va, &w2);
      if (r == CUDA_SUCCESS && r2 != CUDA_SUCCESS) r = r2, what = w2;
    }
    if (temporary && held) REAL(cuMemRelease, fn_release)(h);
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
  if (registered) REAL(cuMemHostUnregister, fn_hostunreg)(cui_st.arena);
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

/* ---------- CANCEL_CAPTURE: SAVED -> ACTIVE ---------- */

/* SAVED differs from ACTIVE only by the host carrier (SAVE_ALLOCATIONS only copied): drop it. */
static int CANCEL_CAPTURE(struct cui_op_result *res) {
  res->records_changed = drop_carriers();
  return 0;
}

/* ---------- PREPARE_UNICAST: SAVED -> PREPARED ---------- */

static int PREPARE_UNICAST(struct cui_op_result *res) {
  for (size_t i = 0; i < cui_st.nallocs; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (!a->live || !(a->flags & CUI_REC_SHARED)) continue;   /* private: native checkpoint */
    CUI_FOR_MAPS_OF(m, a) {
      if (!m->mapped) continue;
      CUresult r = REAL(cuMemUnmap, fn_unmap)(m->va, m->size);
      if (r != CUDA_SUCCESS) {
        fail_driver(res, CUI_OP_PREPARE_UNICAST, a, "cuMemUnmap", r);
        return -1;
      }
      m->mapped = 0;
      res->records_changed++;
    }
    if (a->has_real) {
      CUresult r = REAL(cuMemRelease, fn_release)(a->real);
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

static int LOAD_ALLOCATIONS(struct cui_op_result *res) {
  fn_hostreg reg = REAL(cuMemHostRegister_v2, fn_hostreg);
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
      snprintf(res->message, sizeof res->message,
               "LOAD_ALLOCATIONS: pid %u allocation %s: host carrier checksum mismatch (recorded %016llx, found %016llx)",
               (unsigned)getpid(), hex, (unsigned long long)a->checksum, (unsigned long long)sum);
      rc = -1;
      break;
    }
    ensure_context(&a->prop);
    const char *what = "cuMemCreate";
    CUmemGenericAllocationHandle h;
    CUresult r = REAL(cuMemCreate, fn_create)(&h, a->size, &a->prop, 0);
    CUdeviceptr va = 0;
    int created = r == CUDA_SUCCESS;
    if (r == CUDA_SUCCESS) r = staging_map(a, h, &va, &what);
    if (r == CUDA_SUCCESS) {
      uint64_t t0 = cui_now_ns();
      r = REAL(cuMemcpyHtoD_v2, fn_htod)(va, cui_st.arena + a->carrier_off, a->size);
      res->copy_ns += cui_now_ns() - t0;
      if (r != CUDA_SUCCESS) what = "cuMemcpyHtoD_v2";
      const char *w2 = NULL;
      CUresult r2 = staging_unmap(a, va, &w2);
      if (r == CUDA_SUCCESS && r2 != CUDA_SUCCESS) r = r2, what = w2;
    }
    if (r == CUDA_SUCCESS) r = remap(a, h, &res->records_changed, &what);
    if (r == CUDA_SUCCESS && (a->flags & CUI_REC_EXPORTED)) {
      int fd = -1;
      r = REAL(cuMemExportToShareableHandle, fn_export)(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (r != CUDA_SUCCESS) what = "cuMemExportToShareableHandle";
      else if (cui_cache_put(a->id, fd) != 0) {
        close(fd);
        r = CUDA_ERROR_OUT_OF_MEMORY;
        what = "export cache insert";
      }
    }
    if (r != CUDA_SUCCESS) {
      fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, a, what, r);
      rc = -1;
      (void)created;   /* FAILED: nothing is rolled back */
      break;
    }
    if (a->vrefs > 0) {
      a->real = h;
      a->has_real = 1;
    } else {
      REAL(cuMemRelease, fn_release)(h);   /* the app only kept mappings */
    }
    res->bytes += a->size;
    res->records_changed++;
    a->flags &= ~CUI_REC_CARRIED;
    a->carrier_bytes = 0;
    a->checksum = 0;
    a->carrier_off = 0;
  }
  if (registered) REAL(cuMemHostUnregister, fn_hostunreg)(cui_st.arena);
  if (rc == 0) cui_st.arena_release_pending = 1;   /* freed after the reply went out */
  return rc;
}

/* ---------- RESTORE_UNICAST: LOADED -> ACTIVE ---------- */

static int RESTORE_UNICAST(struct cui_op_result *res) {
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
    CUresult r = REAL(cuMemImportFromShareableHandle, fn_import)(&h, (void *)(uintptr_t)fd,
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
      REAL(cuMemRelease, fn_release)(h);
    }
    res->records_changed++;
  }
  return 0;
}

/* ---------- dispatch ---------- */

/* Where an op leads. The capture's mc_cycle (PREPARE_MULTICAST ran) sends RESTORE_UNICAST and
 * CANCEL_CAPTURE to MULTICAST_RELEASED, from where the four rebuild ops lead to ACTIVE. */
static uint32_t next_phase(uint16_t op) {
  uint32_t after_unicast = cui_st.mc_cycle ? CUI_PHASE_MULTICAST_RELEASED : CUI_PHASE_ACTIVE;
  switch (op) {
    case CUI_OP_PREPARE_MULTICAST: return CUI_PHASE_MULTICAST_RELEASED;
    case CUI_OP_SAVE_ALLOCATIONS: return CUI_PHASE_SAVED;
    case CUI_OP_PREPARE_UNICAST: return CUI_PHASE_PREPARED;
    case CUI_OP_LOAD_ALLOCATIONS: return CUI_PHASE_LOADED;
    case CUI_OP_RESTORE_UNICAST: return after_unicast;
    case CUI_OP_CANCEL_CAPTURE: return after_unicast;
    case CUI_OP_RESTORE_MULTICAST_CREATORS: return CUI_PHASE_MULTICAST_CREATED;
    case CUI_OP_RESTORE_MULTICAST_IMPORTERS: return CUI_PHASE_MULTICAST_IMPORTED;
    case CUI_OP_RESTORE_MULTICAST_DEVICES: return CUI_PHASE_MULTICAST_DEVICES;
    case CUI_OP_RESTORE_MULTICAST_BINDINGS: return CUI_PHASE_ACTIVE;
  }
  return CUI_PHASE_FAILED;
}

/* The phase an op needs (SAVE_ALLOCATIONS: MULTICAST_RELEASED, or ACTIVE when the capture
 * skips PREPARE_MULTICAST; see protocol.h "Phases"). */
static uint32_t source_phase(uint16_t op) {
  switch (op) {
    case CUI_OP_PREPARE_MULTICAST: return CUI_PHASE_ACTIVE;
    case CUI_OP_SAVE_ALLOCATIONS: return cui_st.phase == CUI_PHASE_MULTICAST_RELEASED ? CUI_PHASE_MULTICAST_RELEASED
                                                                                       : CUI_PHASE_ACTIVE;
    case CUI_OP_PREPARE_UNICAST: return CUI_PHASE_SAVED;
    case CUI_OP_LOAD_ALLOCATIONS: return CUI_PHASE_PREPARED;
    case CUI_OP_RESTORE_UNICAST: return CUI_PHASE_LOADED;
    case CUI_OP_CANCEL_CAPTURE: return CUI_PHASE_SAVED;
    case CUI_OP_RESTORE_MULTICAST_CREATORS: return CUI_PHASE_MULTICAST_RELEASED;
    case CUI_OP_RESTORE_MULTICAST_IMPORTERS: return CUI_PHASE_MULTICAST_CREATED;
    case CUI_OP_RESTORE_MULTICAST_DEVICES: return CUI_PHASE_MULTICAST_IMPORTED;
    case CUI_OP_RESTORE_MULTICAST_BINDINGS: return CUI_PHASE_MULTICAST_DEVICES;
  }
  return CUI_PHASE_FAILED;
}

/* Refusals that change nothing. Lock held. Returns 0 when the op may run. */
static int admit(const struct cui_request *req, struct cui_op_result *res) {
  const char *op = op_name(req->op);
  unsigned pid = (unsigned)getpid();
  if (cui_st.phase == CUI_PHASE_FAILED) {
    res->status = CUI_REFUSED_PHASE;
    snprintf(res->message, sizeof res->message, "%s: pid %u is FAILED; no request is accepted", op, pid);
    return -1;
  }
  if (req->op != CUI_OP_INSPECT && req->txn_id <= cui_st.last_txn) {
    res->status = CUI_REFUSED_DUPLICATE;
    snprintf(res->message, sizeof res->message, "%s: pid %u: txn %llu is not newer than the last accepted txn %llu",
             op, pid, (unsigned long long)req->txn_id, (unsigned long long)cui_st.last_txn);
    return -1;
  }
  /* INSPECT is read-only and answers in every phase but FAILED; the reply carries the phase. */
  if (req->op == CUI_OP_INSPECT) return 0;
  if (req->expected_phase != cui_st.phase || source_phase(req->op) != cui_st.phase) {
    res->status = CUI_REFUSED_PHASE;
    snprintf(res->message, sizeof res->message, "%s: pid %u is in phase %s (request expected %s; %s needs %s)", op,
             pid, cui_phase_name(cui_st.phase), cui_phase_name(req->expected_phase), op, cui_phase_name(source_phase(req->op)));
    return -1;
  }
  if (cui_st.inflight) {
    res->status = CUI_REFUSED_STATE;
    snprintf(res->message, sizeof res->message, "%s: pid %u has %u tracked driver calls in flight; quiesce first", op,
             pid, cui_st.inflight);
    return -1;
  }
  if (req->op == CUI_OP_PREPARE_MULTICAST) {
    const struct cui_mc *m = cui_mc_passthrough();
    if (m) {
      char hex[33];
      cui_hex_id(m->id, hex);
      res->status = CUI_REFUSED_STATE;
      snprintf(res->message, sizeof res->message,
               "PREPARE_MULTICAST: pid %u multicast object %s has handle types 0x%llx (only exactly "
               "POSIX_FILE_DESCRIPTOR can be rebuilt); nothing was changed", pid, hex,
               (unsigned long long)m->prop.handleTypes);
      return -1;
    }
  }
  if (req->op == CUI_OP_SAVE_ALLOCATIONS && cui_st.phase == CUI_PHASE_ACTIVE && cui_mc_live_count()) {
    for (size_t i = 0; i < cui_st.nmcs; i++) {
      if (!cui_st.mcs[i].live) continue;
      char hex[33];
      cui_hex_id(cui_st.mcs[i].id, hex);
      res->status = CUI_REFUSED_STATE;
      snprintf(res->message, sizeof res->message,
               "SAVE_ALLOCATIONS: pid %u holds multicast object %s; PREPARE_MULTICAST must run first (ACTIVE -> "
               "MULTICAST_RELEASED); nothing was changed", pid, hex);
      return -1;
    }
  }
  if (req->op == CUI_OP_SAVE_ALLOCATIONS) {
    for (size_t i = 0; i < cui_st.nallocs; i++) {
      const struct cui_alloc *a = &cui_st.allocs[i];
      if (!a->live || !(a->flags & CUI_REC_RAW_IMPORT)) continue;
      char hex[33];
      cui_hex_id(a->id, hex);
      res->status = CUI_REFUSED_STATE;
      snprintf(res->message, sizeof res->message,
               "SAVE_ALLOCATIONS: pid %u allocation %s: imported from a raw file descriptor (not a cuinterpose "
               "ticket); its creator is unknown, so the sharing cannot be restored. Release it before checkpointing",
               pid, hex);
      return -1;
    }
  }
  return 0;
}

void cui_run_op(const struct cui_request *req, struct cui_op_result *res) {
  switch (req->op) {
    case CUI_OP_INSPECT:
    case CUI_OP_SAVE_ALLOCATIONS:
    case CUI_OP_PREPARE_UNICAST:
    case CUI_OP_LOAD_ALLOCATIONS:
    case CUI_OP_RESTORE_UNICAST:
    case CUI_OP_CANCEL_CAPTURE:
    case CUI_OP_PREPARE_MULTICAST:
    case CUI_OP_RESTORE_MULTICAST_CREATORS:
    case CUI_OP_RESTORE_MULTICAST_IMPORTERS:
    case CUI_OP_RESTORE_MULTICAST_DEVICES:
    case CUI_OP_RESTORE_MULTICAST_BINDINGS:
      break;
    default:
      res->status = CUI_BAD_REQUEST;
      snprintf(res->message, sizeof res->message, "%s: pid %u: op %u is not implemented by this shim",
               op_name(req->op), (unsigned)getpid(), (unsigned)req->op);
      return;
  }
  pthread_mutex_lock(&cui_st.lock);
  if (admit(req, res) != 0) {
    pthread_mutex_unlock(&cui_st.lock);
    return;
  }
  if (req->op == CUI_OP_INSPECT) {
    INSPECT(res);
    pthread_mutex_unlock(&cui_st.lock);
    res->records_changed = 0;
    return;
  }
  cui_st.op_running = 1;
  pthread_mutex_unlock(&cui_st.lock);

  int rc;
  uint32_t from = cui_st.phase;   /* stable: op_running holds off every other writer */
  switch (req->op) {
    case CUI_OP_PREPARE_MULTICAST: rc = cui_PREPARE_MULTICAST(res); break;
    case CUI_OP_RESTORE_MULTICAST_CREATORS: rc = cui_RESTORE_MULTICAST_CREATORS(res); break;
    case CUI_OP_RESTORE_MULTICAST_IMPORTERS: rc = cui_RESTORE_MULTICAST_IMPORTERS(res); break;
    case CUI_OP_RESTORE_MULTICAST_DEVICES: rc = cui_RESTORE_MULTICAST_DEVICES(res); break;
    case CUI_OP_RESTORE_MULTICAST_BINDINGS: rc = cui_RESTORE_MULTICAST_BINDINGS(res); break;
    case CUI_OP_SAVE_ALLOCATIONS: rc = SAVE_ALLOCATIONS(res); break;
    case CUI_OP_PREPARE_UNICAST: rc = PREPARE_UNICAST(res); break;
    case CUI_OP_LOAD_ALLOCATIONS: rc = LOAD_ALLOCATIONS(res); break;
    case CUI_OP_CANCEL_CAPTURE: rc = CANCEL_CAPTURE(res); break;
    default: rc = RESTORE_UNICAST(res); break;
  }

  pthread_mutex_lock(&cui_st.lock);
  if (rc == 0) {
    cui_st.last_txn = req->txn_id;
    cui_st.phase = next_phase(req->op);
  } else if (res->status == CUI_FAILED) {
    cui_st.last_txn = req->txn_id;
    /* SAVE_ALLOCATIONS only copied and dropped its carrier on failure: still where it was. */
    cui_st.phase = req->op == CUI_OP_SAVE_ALLOCATIONS ? from : CUI_PHASE_FAILED;
  }
  cui_st.op_running = 0;
  pthread_mutex_unlock(&cui_st.lock);
}

void cui_after_reply(void) {
  pthread_mutex_lock(&cui_st.lock);
  if (cui_st.arena_release_pending) {
    munmap(cui_st.arena, cui_st.arena_size);
    cui_st.arena = NULL;
    cui_st.arena_size = 0;
    cui_st.arena_release_pending = 0;
  }
  pthread_mutex_unlock(&cui_st.lock);
}
