/*
 * ops_multicast.c: the multicast phase ops and the multicast INSPECT records (docs/shim.md
 * "Multicast"; protocol.h "Phases"). They run on the control worker with op_running set and
 * the lock not held (ops.c).
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

#include "phase_ops.h"

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
  cui_hex_id(m->id, hex);
  res->status = CUI_FAILED;
  res->cuda_result = (int32_t)r;
  snprintf(res->message, sizeof res->message, "%s: pid %u multicast object %s: %s failed: %s", op, (unsigned)getpid(),
           hex, what, cui_cu_error_name(r));
}

/* Teardown in driver order across all objects: unmap -> unbind -> close cached FD -> release. */
int cui_op_prepare_multicast(struct cui_op_result *res) {
  const char *op = "PREPARE_MULTICAST";
  cui_st.mc_cycle = 1;
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live) continue;
    for (uint32_t k = 0; k < m->nmaps; k++) {
      struct cui_mcmap *x = &m->maps[k];
      if (!x->mapped) continue;
      CUresult r = REAL(cuMemUnmap)(x->va, x->size);
      if (r != CUDA_SUCCESS) {
        char what[96];
        snprintf(what, sizeof what, "cuMemUnmap(0x%llx, 0x%llx)", (unsigned long long)x->va,
                 (unsigned long long)x->size);
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
      CUresult r = REAL(cuMulticastUnbind)(m->real, b->dev, b->mc_off, b->size);
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
      CUresult r = REAL(cuMemRelease)(m->real);
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

int cui_op_restore_multicast_creators(struct cui_op_result *res) {
  const char *op = "RESTORE_MULTICAST_CREATORS";
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live || m->role != CUI_ROLE_CREATOR || m->has_real) continue;
    CUmemGenericAllocationHandle h;
    CUresult r = REAL(cuMulticastCreate)(&h, &m->prop);   /* the requested size */
    if (r != CUDA_SUCCESS) {
      mc_fail(res, op, m, "cuMulticastCreate", r);
      return -1;
    }
    m->real = h;
    m->has_real = 1;
    res->records_changed++;
    if (m->flags & CUI_REC_EXPORTED) {
      int fd = -1;
      r = REAL(cuMemExportToShareableHandle)(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
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

int cui_op_restore_multicast_importers(struct cui_op_result *res) {
  const char *op = "RESTORE_MULTICAST_IMPORTERS";
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live || m->role != CUI_ROLE_IMPORTER || m->has_real) continue;
    char why[256], hex[33];
    cui_hex_id(m->id, hex);
    int fd = cui_fetch_fd(m->creator_pid, m->id, why, sizeof why);
    if (fd < 0) {
      res->status = CUI_FAILED;
      snprintf(res->message, sizeof res->message,
               "%s: pid %u could not import multicast object %s from creator pid "
               "%u: %s",
               op, (unsigned)getpid(), hex, m->creator_pid, why);
      return -1;
    }
    CUmemGenericAllocationHandle h;
    CUresult r = REAL(cuMemImportFromShareableHandle)(&h, (void *)(uintptr_t)fd,
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

int cui_op_restore_multicast_devices(struct cui_op_result *res) {
  const char *op = "RESTORE_MULTICAST_DEVICES";
  for (size_t i = 0; i < cui_st.nmcs; i++) {
    struct cui_mc *m = &cui_st.mcs[i];
    if (!m->live) continue;
    for (uint32_t d = 0; d < m->ndevs; d++) {
      CUresult r = REAL(cuMulticastAddDevice)(m->real, m->devs[d]);
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

int cui_op_restore_multicast_bindings(struct cui_op_result *res) {
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
        if (by_addr)
          r = v2 ? REAL(cuMulticastBindAddr_v2)(m->real, b->dev, b->mc_off, b->memptr, b->size, 0)
                 : REAL(cuMulticastBindAddr)(m->real, b->mc_off, b->memptr, b->size, 0);
        else
          r = v2 ? REAL(cuMulticastBindMem_v2)(m->real, b->dev, b->mc_off, mem, b->mem_off, b->size, 0)
                 : REAL(cuMulticastBindMem)(m->real, b->mc_off, mem, b->mem_off, b->size, 0);
      }
      if (temporary) REAL(cuMemRelease)(mem);
      if (r != CUDA_SUCCESS) {
        char what[96];
        snprintf(what, sizeof what, "%s(device %d, offset 0x%llx, size 0x%llx)", cui_mc_bind_api(by_addr, v2), b->dev,
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
      CUresult r = REAL(cuMemMap)(x->va, x->size, x->offset, m->real, 0);
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
