/*
 * The object model and the tracked VMM wrappers (docs/shim.md "Object model").
 *
 * The app only sees virtual allocation handles: 0xC01E in the top 16 bits, an index below.
 * A driver handle carrying that tag is released and refused (CUDA_ERROR_INVALID_HANDLE).
 * One allocation holds at most one driver reference per process, whatever the number of
 * virtual references (creates, imports of the same allocation, retains); the last
 * cuMemRelease of the virtual handle releases the driver reference. Untagged handles and
 * untracked address ranges are forwarded untouched. While the shim is not ACTIVE (or a phase
 * op owns the state) tracked calls return CUDA_ERROR_NOT_READY without calling the driver.
 *
 * Locking: cui_st.lock is held across the ordinary VMM driver calls here (none waits on a
 * peer). The one call that waits on a peer, the FETCH_FD round trip of an import, runs with
 * the lock dropped and the call counted in cui_st.inflight.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cui.h"

struct cui_state cui_st = {.lock = PTHREAD_MUTEX_INITIALIZER, .phase = CUI_PHASE_ACTIVE};

/* ---------- real driver functions ---------- */

typedef CUresult (*fn_init)(unsigned int);
typedef CUresult (*fn_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*fn_release)(CUmemGenericAllocationHandle);
typedef CUresult (*fn_retain)(CUmemGenericAllocationHandle *, void *);
typedef CUresult (*fn_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*fn_unmap)(CUdeviceptr, size_t);
typedef CUresult (*fn_setaccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*fn_export)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
typedef CUresult (*fn_import)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
typedef CUresult (*fn_getprop)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
typedef CUresult (*fn_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*fn_free)(CUdeviceptr, size_t);

#define REAL(row, type) ((type)cui_real(CUI_ROW_##row))
#define REAL_OR_FAIL(var, row, type) \
  type var = REAL(row, type);         \
  if (!var) return CUDA_ERROR_NOT_INITIALIZED

/* ---------- export cache ---------- */

struct cache_entry { uint8_t id[16]; int fd; };
static pthread_mutex_t g_cache_lock = PTHREAD_MUTEX_INITIALIZER;
static struct cache_entry *g_cache;
static size_t g_ncache, g_cap_cache;

int cui_cache_put(const uint8_t id[16], int fd) {
  pthread_mutex_lock(&g_cache_lock);
  for (size_t i = 0; i < g_ncache; i++)
    if (memcmp(g_cache[i].id, id, 16) == 0) {
      close(g_cache[i].fd);
      g_cache[i].fd = fd;
      pthread_mutex_unlock(&g_cache_lock);
      return 0;
    }
  if (g_ncache == g_cap_cache) {
    size_t cap = g_cap_cache ? 2 * g_cap_cache : 16;
    struct cache_entry *n = realloc(g_cache, cap * sizeof *n);
    if (!n) {
      pthread_mutex_unlock(&g_cache_lock);
      return -1;
    }
    g_cache = n;
    g_cap_cache = cap;
  }
  memcpy(g_cache[g_ncache].id, id, 16);
  g_cache[g_ncache++].fd = fd;
  pthread_mutex_unlock(&g_cache_lock);
  return 0;
}

int cui_cache_dup(const uint8_t id[16]) {
  int fd = -1;
  pthread_mutex_lock(&g_cache_lock);
  for (size_t i = 0; i < g_ncache; i++)
    if (memcmp(g_cache[i].id, id, 16) == 0) {
      fd = fcntl(g_cache[i].fd, F_DUPFD_CLOEXEC, 0);
      break;
    }
  pthread_mutex_unlock(&g_cache_lock);
  return fd;
}

int cui_cache_has(const uint8_t id[16]) {
  int found = 0;
  pthread_mutex_lock(&g_cache_lock);
  for (size_t i = 0; i < g_ncache && !found; i++) found = memcmp(g_cache[i].id, id, 16) == 0;
  pthread_mutex_unlock(&g_cache_lock);
  return found;
}

void cui_cache_close(const uint8_t id[16]) {
  pthread_mutex_lock(&g_cache_lock);
  for (size_t i = 0; i < g_ncache; i++)
    if (memcmp(g_cache[i].id, id, 16) == 0) {
      close(g_cache[i].fd);
      g_cache[i] = g_cache[--g_ncache];
      break;
    }
  pthread_mutex_unlock(&g_cache_lock);
}

unsigned cui_cache_close_all(void) {
  pthread_mutex_lock(&g_cache_lock);
  unsigned n = (unsigned)g_ncache;
  for (size_t i = 0; i < g_ncache; i++) close(g_cache[i].fd);
  g_ncache = 0;
  pthread_mutex_unlock(&g_cache_lock);
  return n;
}

/* ---------- tables (lock held) ---------- */

static int gate_open(void) { return cui_st.phase == CUI_PHASE_ACTIVE && !cui_st.op_running; }

struct cui_alloc *cui_alloc_by_vhandle(uint64_t vh) {
  if (!CUI_IS_VHANDLE(vh)) return NULL;
  uint64_t idx = (vh & ((1ull << CUI_VHANDLE_SHIFT) - 1)) - 1;
  if (idx >= cui_st.nallocs || !cui_st.allocs[idx].live) return NULL;
  return &cui_st.allocs[idx];
}

static struct cui_alloc *alloc_by_id(uint32_t creator_pid, const uint8_t id[16]) {
  for (size_t i = 0; i < cui_st.nallocs; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (a->live && a->creator_pid == creator_pid && memcmp(a->id, id, 16) == 0) return a;
  }
  return NULL;
}

static struct cui_alloc *alloc_new(void) {
  if (cui_st.nallocs == cui_st.cap_allocs) {
    size_t cap = cui_st.cap_allocs ? 2 * cui_st.cap_allocs : 64;
    struct cui_alloc *n = realloc(cui_st.allocs, cap * sizeof *n);
    if (!n) return NULL;
    cui_st.allocs = n;
    cui_st.cap_allocs = cap;
  }
  struct cui_alloc *a = &cui_st.allocs[cui_st.nallocs];
  memset(a, 0, sizeof *a);
  a->vhandle = (CUI_VHANDLE_TAG << CUI_VHANDLE_SHIFT) | (uint64_t)(cui_st.nallocs + 1);
  cui_st.nallocs++;
  a->live = 1;
  return a;
}

static inline uint32_t alloc_index(const struct cui_alloc *a) { return (uint32_t)(a - cui_st.allocs); }

void cui_maybe_destroy(struct cui_alloc *a) {
  if (!a->live || a->vrefs || a->nmaps) return;
  if (a->role == CUI_ROLE_CREATOR || (a->flags & CUI_REC_EXPORTED)) cui_cache_close(a->id);
  a->live = 0;   /* slot kept: virtual handles are never reused */
}

static int ranges_overlap(uint64_t a, uint64_t alen, uint64_t b, uint64_t blen) {
  return a < b + blen && b < a + alen;
}

/* ---------- tickets ---------- */

static int make_ticket(const struct cui_alloc *a) {
  int fd = memfd_create("cuinterpose-ticket", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  struct cui_ticket t;
  memset(&t, 0, sizeof t);
  memcpy(t.magic, CUI_TICKET_MAGIC, 8);
  t.version = CUI_PROTO_VERSION;
  t.kind = CUI_TICKET_ALLOCATION;
  t.creator_pid = a->creator_pid;
  memcpy(t.alloc_id, a->id, 16);
  t.size = a->size;
  if (pwrite(fd, &t, sizeof t, 0) != (ssize_t)sizeof t ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* 1 and the ticket when `fd` is a cuinterpose ticket, 0 otherwise. */
static int read_ticket(int fd, struct cui_ticket *t) {
  int seals = fcntl(fd, F_GET_SEALS);
  const int want = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  if (seals < 0 || (seals & want) != want) return 0;
  if (pread(fd, t, sizeof *t, 0) != (ssize_t)sizeof *t) return 0;
  return memcmp(t->magic, CUI_TICKET_MAGIC, 8) == 0;
}

/* ---------- cuInit ---------- */

CUI_EXPORT CUresult cuInit(unsigned int flags) {
  REAL_OR_FAIL(real, cuInit, fn_init);
  CUresult r = real(flags);
  if (r == CUDA_SUCCESS) cui_control_start();
  return r;
}

/* ---------- cuMemCreate / Release / Retain ---------- */

CUI_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags) {
  REAL_OR_FAIL(real, cuMemCreate, fn_create);
  if (!prop || !handle) return real(handle, size, prop, flags);
  /* Only "no export" and POSIX FDs can be carried across a restore: refuse the rest (FABRIC,
   * combinations) before the driver sees the call, output untouched (prior-art.md §2.5). */
  if (prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE &&
      prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return CUDA_ERROR_NOT_SUPPORTED;
  pthread_mutex_lock(&cui_st.lock);
  if (!gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  CUmemGenericAllocationHandle h;
  CUresult r = real(&h, size, prop, flags);
  if (r == CUDA_SUCCESS) {
    struct cui_alloc *a = CUI_IS_VHANDLE(h) ? NULL : alloc_new();
    if (!a) {
      REAL(cuMemRelease, fn_release)(h);
      r = CUI_IS_VHANDLE(h) ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      cui_random_id(a->id);
      a->creator_pid = (uint32_t)getpid();
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
  REAL_OR_FAIL(real, cuMemRelease, fn_release);
  if (!CUI_IS_VHANDLE(handle)) return real(handle);
  pthread_mutex_lock(&cui_st.lock);
  CUresult r = CUDA_SUCCESS;
  struct cui_alloc *a = cui_alloc_by_vhandle(handle);
  if (!gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!a || a->vrefs == 0) r = CUDA_ERROR_INVALID_VALUE;
  else if (a->vrefs == 1 && a->has_real) {
    r = real(a->real);
    if (r == CUDA_SUCCESS) {
      a->has_real = 0;
      a->vrefs = 0;
      cui_maybe_destroy(a);
    }
  } else {
    a->vrefs--;
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
  REAL_OR_FAIL(real, cuMemRetainAllocationHandle, fn_retain);
  pthread_mutex_lock(&cui_st.lock);
  uint64_t p = (uint64_t)(uintptr_t)addr;
  struct cui_mapping *m = NULL;
  for (size_t i = 0; i < cui_st.nmaps && !m; i++)   /* mapped, or torn down by PREPARE_UNICAST */
    if (p >= cui_st.maps[i].va && p - cui_st.maps[i].va < cui_st.maps[i].size) m = &cui_st.maps[i];
  if (!m || (m->mapped == 0 && gate_open())) {
    pthread_mutex_unlock(&cui_st.lock);
    return real(handle, addr);
  }
  CUresult r = CUDA_SUCCESS;
  struct cui_alloc *a = &cui_st.allocs[m->alloc];
  if (!gate_open()) r = CUDA_ERROR_NOT_READY;
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
  REAL_OR_FAIL(real, cuMemMap, fn_map);
  if (!CUI_IS_VHANDLE(handle)) return real(ptr, size, offset, handle, flags);
  pthread_mutex_lock(&cui_st.lock);
  CUresult r;
  struct cui_alloc *a = cui_alloc_by_vhandle(handle);
  if (!gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!a || !a->has_real) r = CUDA_ERROR_INVALID_VALUE;
  else {
    if (cui_st.nmaps == cui_st.cap_maps) {
      size_t cap = cui_st.cap_maps ? 2 * cui_st.cap_maps : 64;
      struct cui_mapping *n = realloc(cui_st.maps, cap * sizeof *n);
      if (!n) {
        pthread_mutex_unlock(&cui_st.lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
      }
      cui_st.maps = n;
      cui_st.cap_maps = cap;
    }
    r = real(ptr, size, offset, a->real, flags);
    if (r == CUDA_SUCCESS) {
      struct cui_mapping *m = &cui_st.maps[cui_st.nmaps++];
      memset(m, 0, sizeof *m);
      m->va = ptr;
      m->size = size;
      m->offset = offset;
      m->alloc = alloc_index(a);
      m->mapped = 1;
      a->nmaps++;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  REAL_OR_FAIL(real, cuMemUnmap, fn_unmap);
  pthread_mutex_lock(&cui_st.lock);
  int tracked = 0;
  for (size_t i = 0; i < cui_st.nmaps && !tracked; i++)
    tracked = ranges_overlap(cui_st.maps[i].va, cui_st.maps[i].size, ptr, size);
  if (!tracked) {
    pthread_mutex_unlock(&cui_st.lock);
    return real(ptr, size);
  }
  if (!gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  CUresult r = real(ptr, size);
  if (r == CUDA_SUCCESS) {
    for (size_t i = 0; i < cui_st.nmaps;) {
      struct cui_mapping *m = &cui_st.maps[i];
      if (ranges_overlap(m->va, m->size, ptr, size)) {
        struct cui_alloc *a = &cui_st.allocs[m->alloc];
        a->nmaps--;
        cui_st.maps[i] = cui_st.maps[--cui_st.nmaps];
        cui_maybe_destroy(a);
      } else {
        i++;
      }
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

static int access_find(const struct cui_mapping *m, uint32_t type, int32_t id) {
  for (uint32_t i = 0; i < m->access_count; i++)
    if (m->access[i].location_type == type && m->access[i].location_id == id) return (int)i;
  return -1;
}

CUI_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  REAL_OR_FAIL(real, cuMemSetAccess, fn_setaccess);
  pthread_mutex_lock(&cui_st.lock);
  int tracked = 0;
  for (size_t i = 0; i < cui_st.nmaps && !tracked; i++)
    tracked = ranges_overlap(cui_st.maps[i].va, cui_st.maps[i].size, ptr, size);
  if (!tracked || !desc || count == 0) {
    pthread_mutex_unlock(&cui_st.lock);
    return real(ptr, size, desc, count);
  }
  CUresult r = CUDA_SUCCESS;
  if (!gate_open()) r = CUDA_ERROR_NOT_READY;
  /* Refused before the driver: a range covering only part of a tracked mapping (its access
   * could not be replayed exactly), and more than CUI_MAX_ACCESS locations per mapping. */
  for (size_t i = 0; i < cui_st.nmaps && r == CUDA_SUCCESS; i++) {
    struct cui_mapping *m = &cui_st.maps[i];
    if (!ranges_overlap(m->va, m->size, ptr, size)) continue;
    if (m->va < ptr || m->va + m->size > ptr + size) {
      r = CUDA_ERROR_NOT_SUPPORTED;
      break;
    }
    uint32_t n = m->access_count;
    for (size_t k = 0; k < count; k++) {
      int dup = access_find(m, desc[k].location.type, desc[k].location.id) >= 0;
      for (size_t j = 0; j < k && !dup; j++)
        dup = desc[j].location.type == desc[k].location.type && desc[j].location.id == desc[k].location.id;
      if (!dup) n++;
    }
    if (n > CUI_MAX_ACCESS) r = CUDA_ERROR_NOT_SUPPORTED;
  }
  if (r == CUDA_SUCCESS) r = real(ptr, size, desc, count);
  if (r == CUDA_SUCCESS) {
    for (size_t i = 0; i < cui_st.nmaps; i++) {
      struct cui_mapping *m = &cui_st.maps[i];
      if (!ranges_overlap(m->va, m->size, ptr, size)) continue;
      for (size_t k = 0; k < count; k++) {
        int at = access_find(m, desc[k].location.type, desc[k].location.id);
        if (at < 0) {
          at = (int)m->access_count++;
          m->access[at].location_type = desc[k].location.type;
          m->access[at].location_id = desc[k].location.id;
          m->access[at].reserved = 0;
        }
        m->access[at].flags = desc[k].flags;
      }
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* ---------- export / import ---------- */

CUI_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType, unsigned long long flags) {
  REAL_OR_FAIL(real, cuMemExportToShareableHandle, fn_export);
  if (!CUI_IS_VHANDLE(handle)) return real(shareableHandle, handle, handleType, flags);
  pthread_mutex_lock(&cui_st.lock);
  CUresult r = CUDA_SUCCESS;
  struct cui_alloc *a = cui_alloc_by_vhandle(handle);
  if (!gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!a || a->vrefs == 0 || !a->has_real || !shareableHandle) r = CUDA_ERROR_INVALID_VALUE;
  else if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) r = CUDA_ERROR_NOT_SUPPORTED;
  else if (flags != 0) r = CUDA_ERROR_INVALID_VALUE;
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
      int t = make_ticket(a);
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

/* Imports `fd` (a real driver FD) and records or joins the allocation. Lock held. */
static CUresult import_real(int fd, CUmemGenericAllocationHandle *out) {
  fn_import real = REAL(cuMemImportFromShareableHandle, fn_import);
  CUresult r = real(out, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r == CUDA_SUCCESS && CUI_IS_VHANDLE(*out)) {
    REAL(cuMemRelease, fn_release)(*out);
    r = CUDA_ERROR_INVALID_HANDLE;
  }
  return r;
}

static CUresult import_ticket(CUmemGenericAllocationHandle *handle, const struct cui_ticket *t) {
  fn_release rel = REAL(cuMemRelease, fn_release);
  pthread_mutex_lock(&cui_st.lock);
  if (!gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  uint32_t self = (uint32_t)getpid();
  struct cui_alloc *a = alloc_by_id(t->creator_pid, t->alloc_id);
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
      for (size_t i = 0; i < cui_st.nmaps && !m; i++)
        if (cui_st.maps[i].alloc == alloc_index(a) && cui_st.maps[i].mapped) m = &cui_st.maps[i];
      CUmemGenericAllocationHandle h;
      if (m && (r = REAL(cuMemRetainAllocationHandle, fn_retain)(&h, (void *)(uintptr_t)m->va)) == CUDA_SUCCESS) {
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
    cui_warn("import of allocation %s from creator pid %u failed: %s", hex, t->creator_pid, why);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    pthread_mutex_lock(&cui_st.lock);
    r = import_real(fd, &h);
    pthread_mutex_unlock(&cui_st.lock);
    close(fd);
    if (r == CUDA_SUCCESS) {
      r = REAL(cuMemGetAllocationPropertiesFromHandle, fn_getprop)(&prop, h);
      if (r != CUDA_SUCCESS) rel(h);   /* nothing published */
    }
  }

  pthread_mutex_lock(&cui_st.lock);
  cui_st.inflight--;
  if (r == CUDA_SUCCESS) {
    a = alloc_by_id(t->creator_pid, t->alloc_id);
    if (a && a->vrefs > 0) {          /* a concurrent import won: keep one driver reference */
      rel(h);
      a->vrefs++;
    } else if (a) {
      a->real = h;
      a->has_real = 1;
      a->vrefs = 1;
    } else if ((a = alloc_new()) == NULL) {
      rel(h);
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      memcpy(a->id, t->alloc_id, 16);
      a->creator_pid = t->creator_pid;
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
  REAL_OR_FAIL(real, cuMemImportFromShareableHandle, fn_import);
  if (shHandleType == CU_MEM_HANDLE_TYPE_FABRIC) return CUDA_ERROR_NOT_SUPPORTED;   /* untracked sharing */
  if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !handle)
    return real(handle, osHandle, shHandleType);
  int fd = (int)(intptr_t)osHandle;
  struct cui_ticket t;
  if (read_ticket(fd, &t)) {
    if (t.version != CUI_PROTO_VERSION || t.kind != CUI_TICKET_ALLOCATION) return CUDA_ERROR_INVALID_VALUE;
    return import_ticket(handle, &t);
  }
  /* A raw (non-ticket) FD: passes through, recorded; a live one blocks capture. */
  pthread_mutex_lock(&cui_st.lock);
  if (!gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  CUmemGenericAllocationHandle h;
  CUresult r = import_real(fd, &h);
  if (r == CUDA_SUCCESS) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    REAL(cuMemGetAllocationPropertiesFromHandle, fn_getprop)(&prop, h);
    struct cui_alloc *a = alloc_new();
    if (!a) {
      REAL(cuMemRelease, fn_release)(h);
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      cui_random_id(a->id);
      a->creator_pid = 0;   /* unknown */
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

CUI_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle) {
  REAL_OR_FAIL(real, cuMemGetAllocationPropertiesFromHandle, fn_getprop);
  if (!CUI_IS_VHANDLE(handle)) return real(prop, handle);
  pthread_mutex_lock(&cui_st.lock);
  CUresult r;
  struct cui_alloc *a = cui_alloc_by_vhandle(handle);
  if (!gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!a || a->vrefs == 0 || !a->has_real) r = CUDA_ERROR_INVALID_VALUE;
  else r = real(prop, a->real);
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* ---------- reservations ---------- */

CUI_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                        unsigned long long flags) {
  REAL_OR_FAIL(real, cuMemAddressReserve, fn_reserve);
  pthread_mutex_lock(&cui_st.lock);
  if (!gate_open()) {
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
  if (r == CUDA_SUCCESS && ptr) cui_st.resv[cui_st.nresv++] = (struct cui_reservation){*ptr, size, alignment};
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  REAL_OR_FAIL(real, cuMemAddressFree, fn_free);
  pthread_mutex_lock(&cui_st.lock);
  if (!gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  CUresult r = real(ptr, size);
  if (r == CUDA_SUCCESS)
    for (size_t i = 0; i < cui_st.nresv; i++)
      if (cui_st.resv[i].va == ptr && cui_st.resv[i].size == size) {
        cui_st.resv[i] = cui_st.resv[--cui_st.nresv];
        break;
      }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}
