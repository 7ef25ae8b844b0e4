/*
 * The object model and the tracked VMM wrappers (docs/shim.md "Object model").
 *
 * The app only sees virtual allocation handles: 0xC01E in the top 16 bits, a counter below.
 * A driver handle carrying that tag is released and refused (CUDA_ERROR_INVALID_HANDLE).
 * One allocation holds at most one driver reference per process, whatever the number of
 * virtual references (creates, imports of the same allocation, retains); the last
 * cuMemRelease of the virtual handle releases the driver reference. Untagged handles and
 * untracked address ranges are forwarded untouched. While the shim is not ACTIVE (or a phase
 * op owns the state) tracked calls return CUDA_ERROR_NOT_READY without calling the driver.
 *
 * Lookups (docs/shim.md "Data structures"): allocations by virtual handle and by allocation id
 * through hash tables, mappings through a VA-ordered treap (a range query for unmap/access, the
 * containing mapping for retain), reservations by VA through a hash table. A range outside the
 * bounds of every mapping record (map_lo/map_hi, read without the lock) is untracked at once.
 *
 * Locking: cui_st.lock is held across the ordinary VMM driver calls here (none waits on a
 * peer). The one call that waits on a peer, the FETCH_FD round trip of an import, runs with
 * the lock dropped and the call counted in cui_st.inflight.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cui.h"

struct cui_state cui_st = {.lock = PTHREAD_MUTEX_INITIALIZER, .phase = CUI_PHASE_ACTIVE};

/* ---------- real driver functions (types and REAL: cui.h) ---------- */


#define REAL_OR_FAIL(var, row, type) \
  type var = REAL(row, type);         \
  if (!var) return CUDA_ERROR_NOT_INITIALIZED

/* ---------- export cache ---------- */

static pthread_mutex_t g_cache_lock = PTHREAD_MUTEX_INITIALIZER;
static struct cui_tab g_cache;   /* allocation id -> export FD */

int cui_cache_put(const uint8_t id[16], int fd) {
  pthread_mutex_lock(&g_cache_lock);
  uint32_t *old = cui_tab_get(&g_cache, cui_id_key(id, 0));
  int rc = 0;
  if (old) {
    close((int)*old);
    *old = (uint32_t)fd;
  } else {
    rc = cui_tab_put(&g_cache, cui_id_key(id, 0), (uint32_t)fd);
  }
  pthread_mutex_unlock(&g_cache_lock);
  return rc;
}

int cui_cache_dup(const uint8_t id[16]) {
  pthread_mutex_lock(&g_cache_lock);
  uint32_t *v = cui_tab_get(&g_cache, cui_id_key(id, 0));
  int fd = v ? fcntl((int)*v, F_DUPFD_CLOEXEC, 0) : -1;
  pthread_mutex_unlock(&g_cache_lock);
  return fd;
}

int cui_cache_has(const uint8_t id[16]) {
  pthread_mutex_lock(&g_cache_lock);
  int found = cui_tab_get(&g_cache, cui_id_key(id, 0)) != NULL;
  pthread_mutex_unlock(&g_cache_lock);
  return found;
}

void cui_cache_close(const uint8_t id[16]) {
  pthread_mutex_lock(&g_cache_lock);
  uint32_t *v = cui_tab_get(&g_cache, cui_id_key(id, 0));
  if (v) {
    close((int)*v);
    cui_tab_del(&g_cache, cui_id_key(id, 0));
  }
  pthread_mutex_unlock(&g_cache_lock);
}

unsigned cui_cache_close_all(void) {
  pthread_mutex_lock(&g_cache_lock);
  unsigned n = g_cache.n;
  for (uint32_t i = 0; i < g_cache.cap; i++)
    if (g_cache.s[i].used) close((int)g_cache.s[i].val);
  free(g_cache.s);
  memset(&g_cache, 0, sizeof g_cache);
  pthread_mutex_unlock(&g_cache_lock);
  return n;
}

/* ---------- tables (lock held) ---------- */

static int gate_open(void) { return cui_st.phase == CUI_PHASE_ACTIVE && !cui_st.op_running; }
int cui_gate_open(void) { return gate_open(); }

uint64_t cui_new_vhandle(void) {
  return (CUI_VHANDLE_TAG << CUI_VHANDLE_SHIFT) | ++cui_st.last_vhandle;
}

struct cui_alloc *cui_alloc_by_vhandle(uint64_t vh) {
  if (!CUI_IS_VHANDLE(vh)) return NULL;
  uint32_t *at = cui_tab_get(&cui_st.alloc_vh, (struct cui_key){vh, 0, 0});
  return at ? &cui_st.allocs[*at] : NULL;
}

static struct cui_alloc *alloc_by_id(uint32_t creator_pid, const uint8_t id[16]) {
  uint32_t *v = cui_tab_get(&cui_st.alloc_ids, cui_id_key(id, creator_pid));
  return v ? &cui_st.allocs[*v] : NULL;
}

/* A new live allocation with `id` of `creator_pid` (indexed by both and by a new virtual
 * handle). Slots of destroyed allocations are reused; virtual handles never are. */
static struct cui_alloc *alloc_new(const uint8_t id[16], uint32_t creator_pid) {
  uint32_t idx = cui_st.alloc_free;
  if (idx) {
    idx--;
  } else {
    if (cui_st.nallocs == cui_st.cap_allocs) {
      size_t cap = cui_st.cap_allocs ? 2 * cui_st.cap_allocs : 64;
      struct cui_alloc *n = realloc(cui_st.allocs, cap * sizeof *n);
      if (!n) return NULL;
      cui_st.allocs = n;
      cui_st.cap_allocs = cap;
    }
    idx = (uint32_t)cui_st.nallocs;
  }
  uint64_t vh = (CUI_VHANDLE_TAG << CUI_VHANDLE_SHIFT) | (cui_st.last_vhandle + 1);
  if (cui_tab_put(&cui_st.alloc_ids, cui_id_key(id, creator_pid), idx) != 0) return NULL;
  if (cui_tab_put(&cui_st.alloc_vh, (struct cui_key){vh, 0, 0}, idx) != 0) {
    cui_tab_del(&cui_st.alloc_ids, cui_id_key(id, creator_pid));
    return NULL;
  }
  if (idx == cui_st.nallocs) cui_st.nallocs++;
  else cui_st.alloc_free = cui_st.allocs[idx].next_free;
  cui_st.last_vhandle++;
  struct cui_alloc *a = &cui_st.allocs[idx];
  memset(a, 0, sizeof *a);
  memcpy(a->id, id, 16);
  a->creator_pid = creator_pid;
  a->vhandle = vh;
  a->live = 1;
  return a;
}

static inline uint32_t alloc_index(const struct cui_alloc *a) { return (uint32_t)(a - cui_st.allocs); }

void cui_maybe_destroy(struct cui_alloc *a) {
  if (!a->live || a->vrefs || a->nmaps || a->nbinds) return;
  if (a->role == CUI_ROLE_CREATOR || (a->flags & CUI_REC_EXPORTED)) cui_cache_close(a->id);
  cui_tab_del(&cui_st.alloc_ids, cui_id_key(a->id, a->creator_pid));
  cui_tab_del(&cui_st.alloc_vh, (struct cui_key){a->vhandle, 0, 0});
  a->live = 0;   /* the slot is reused, the virtual handle never */
  a->next_free = cui_st.alloc_free;
  cui_st.alloc_free = alloc_index(a) + 1;
}

/* ---------- mapping records: a VA treap over stable slots ---------- */

static uint32_t mkey_less(uint32_t x, uint32_t y) {   /* (va, slot) order: total even for equal VAs */
  return CUI_MAP(x)->va < CUI_MAP(y)->va || (CUI_MAP(x)->va == CUI_MAP(y)->va && x < y);
}

static uint32_t treap_insert(uint32_t t, uint32_t n) {
  if (!t) return n;
  struct cui_mapping *T = CUI_MAP(t);
  if (mkey_less(n, t)) {
    T->left = treap_insert(T->left, n);
    if (CUI_MAP(T->left)->prio > T->prio) {   /* rotate right */
      uint32_t l = T->left;
      T->left = CUI_MAP(l)->right;
      CUI_MAP(l)->right = t;
      return l;
    }
  } else {
    T->right = treap_insert(T->right, n);
    if (CUI_MAP(T->right)->prio > T->prio) {  /* rotate left */
      uint32_t r = T->right;
      T->right = CUI_MAP(r)->left;
      CUI_MAP(r)->left = t;
      return r;
    }
  }
  return t;
}

static uint32_t treap_merge(uint32_t x, uint32_t y) {   /* every key of x before every key of y */
  if (!x || !y) return x ? x : y;
  if (CUI_MAP(x)->prio > CUI_MAP(y)->prio) {
    CUI_MAP(x)->right = treap_merge(CUI_MAP(x)->right, y);
    return x;
  }
  CUI_MAP(y)->left = treap_merge(x, CUI_MAP(y)->left);
  return y;
}

static uint32_t treap_erase(uint32_t t, uint32_t n) {
  if (!t) return 0;
  if (t == n) return treap_merge(CUI_MAP(t)->left, CUI_MAP(t)->right);
  if (mkey_less(n, t)) CUI_MAP(t)->left = treap_erase(CUI_MAP(t)->left, n);
  else CUI_MAP(t)->right = treap_erase(CUI_MAP(t)->right, n);
  return t;
}

/* The record with the greatest VA <= p, or 0. */
static uint32_t map_floor(uint64_t p) {
  uint32_t t = cui_st.map_root, best = 0;
  while (t) {
    if (CUI_MAP(t)->va <= p) best = t, t = CUI_MAP(t)->right;
    else t = CUI_MAP(t)->left;
  }
  return best;
}

/* The record with the smallest VA > p, or 0. */
static uint32_t map_above(uint64_t p) {
  uint32_t t = cui_st.map_root, best = 0;
  while (t) {
    if (CUI_MAP(t)->va > p) best = t, t = CUI_MAP(t)->left;
    else t = CUI_MAP(t)->right;
  }
  return best;
}

static inline uint64_t range_end(uint64_t va, uint64_t size) {   /* saturating */
  return va + size < va ? UINT64_MAX : va + size;
}

/* Records overlapping [va, va+size), in VA order: first, then map_next until NULL. */
static struct cui_mapping *map_first(uint64_t va, uint64_t size) {
  if (size == 0) return NULL;
  uint32_t f = map_floor(va);
  if (f && range_end(CUI_MAP(f)->va, CUI_MAP(f)->size) > va) return CUI_MAP(f);
  f = map_above(va);
  return f && CUI_MAP(f)->va < range_end(va, size) ? CUI_MAP(f) : NULL;
}

static struct cui_mapping *map_next(const struct cui_mapping *m, uint64_t va, uint64_t size) {
  uint32_t f = map_above(m->va);
  return f && CUI_MAP(f)->va < range_end(va, size) ? CUI_MAP(f) : NULL;
}

#define FOR_MAPS_IN(m, va, size) for (struct cui_mapping *m = map_first(va, size); m; m = map_next(m, va, size))

/* The record containing address p, or NULL. */
static struct cui_mapping *map_containing(uint64_t p) {
  uint32_t f = map_floor(p);
  return f && p - CUI_MAP(f)->va < CUI_MAP(f)->size ? CUI_MAP(f) : NULL;
}

struct cui_mapping *cui_map_containing(uint64_t p) { return map_containing(p); }

/* Lock-free pre-check: 0 when no mapping record can overlap [va, va+size). */
static inline int maybe_tracked(uint64_t va, uint64_t size) {
  uint64_t lo = __atomic_load_n(&cui_st.map_lo, __ATOMIC_RELAXED), hi = __atomic_load_n(&cui_st.map_hi, __ATOMIC_RELAXED);
  return lo < hi && va < hi && range_end(va, size) > lo;
}

static struct cui_mapping *map_add(struct cui_alloc *a, uint64_t va, uint64_t size, uint64_t offset) {
  uint32_t ref = cui_st.map_free;
  if (ref) {
    cui_st.map_free = CUI_MAP(ref)->next;
  } else {
    if (cui_st.nslots == cui_st.cap_maps) {
      size_t cap = cui_st.cap_maps ? 2 * cui_st.cap_maps : 64;
      struct cui_mapping *n = realloc(cui_st.maps, cap * sizeof *n);
      if (!n) return NULL;
      cui_st.maps = n;
      cui_st.cap_maps = cap;
    }
    ref = (uint32_t)++cui_st.nslots;
  }
  struct cui_mapping *m = CUI_MAP(ref);
  memset(m, 0, offsetof(struct cui_mapping, access));
  m->va = va;
  m->size = size;
  m->offset = offset;
  m->alloc = alloc_index(a);
  m->mapped = 1;
  m->used = 1;
  uint32_t x = cui_st.map_seed ? cui_st.map_seed : 0x9E3779B9u;   /* xorshift32 priorities */
  x ^= x << 13, x ^= x >> 17, x ^= x << 5;
  m->prio = cui_st.map_seed = x;
  cui_st.map_root = treap_insert(cui_st.map_root, ref);
  m->next = a->maps_head;
  if (a->maps_head) CUI_MAP(a->maps_head)->prev = ref;
  a->maps_head = ref;
  a->nmaps++;
  cui_st.nmaps++;
  uint64_t lo = cui_st.map_lo, hi = cui_st.map_hi;
  if (lo >= hi) lo = UINT64_MAX, hi = 0;
  __atomic_store_n(&cui_st.map_lo, va < lo ? va : lo, __ATOMIC_RELAXED);
  __atomic_store_n(&cui_st.map_hi, range_end(va, size) > hi ? range_end(va, size) : hi, __ATOMIC_RELAXED);
  return m;
}

static void map_remove(struct cui_mapping *m) {
  uint32_t ref = (uint32_t)(m - cui_st.maps) + 1;
  struct cui_alloc *a = &cui_st.allocs[m->alloc];
  cui_st.map_root = treap_erase(cui_st.map_root, ref);
  if (m->prev) CUI_MAP(m->prev)->next = m->next;
  else a->maps_head = m->next;
  if (m->next) CUI_MAP(m->next)->prev = m->prev;
  m->used = 0;
  m->next = cui_st.map_free;
  cui_st.map_free = ref;
  a->nmaps--;
  if (--cui_st.nmaps == 0) {   /* bounds only shrink when the last record goes */
    __atomic_store_n(&cui_st.map_lo, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&cui_st.map_hi, 0, __ATOMIC_RELAXED);
  }
  cui_maybe_destroy(a);
}

/* ---------- tickets ---------- */

int cui_make_ticket(const struct cui_ticket *tk) {
  int fd = memfd_create("cuinterpose-ticket", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  struct cui_ticket t = *tk;
  memcpy(t.magic, CUI_TICKET_MAGIC, 8);
  t.version = CUI_PROTO_VERSION;
  if (pwrite(fd, &t, sizeof t, 0) != (ssize_t)sizeof t ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

static int make_ticket(const struct cui_alloc *a) {
  struct cui_ticket t;
  memset(&t, 0, sizeof t);
  t.kind = CUI_TICKET_ALLOCATION;
  t.creator_pid = a->creator_pid;
  memcpy(t.alloc_id, a->id, 16);
  t.size = a->size;
  return cui_make_ticket(&t);
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
      prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    cui_api_warn("cuMemCreate", "requested handle types 0x%x refused (only 0 or POSIX_FILE_DESCRIPTOR can be "
                 "rebuilt after a checkpoint): CUDA_ERROR_NOT_SUPPORTED", (unsigned)prop->requestedHandleTypes);
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  pthread_mutex_lock(&cui_st.lock);
  if (!gate_open()) {
    pthread_mutex_unlock(&cui_st.lock);
    return CUDA_ERROR_NOT_READY;
  }
  CUmemGenericAllocationHandle h;
  CUresult r = real(&h, size, prop, flags);
  if (r == CUDA_SUCCESS) {
    uint8_t id[16];
    cui_random_id(id);
    struct cui_alloc *a = CUI_IS_VHANDLE(h) ? NULL : alloc_new(id, (uint32_t)getpid());
    if (!a) {
      REAL(cuMemRelease, fn_release)(h);
      r = CUI_IS_VHANDLE(h) ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_OUT_OF_MEMORY;
      if (CUI_IS_VHANDLE(h))
        cui_api_warn("cuMemCreate", "the driver returned handle 0x%llx, which carries the shim's tag 0x%llx; "
                     "released it: CUDA_ERROR_INVALID_HANDLE", (unsigned long long)h, CUI_VHANDLE_TAG);
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
  REAL_OR_FAIL(real, cuMemRelease, fn_release);
  if (!CUI_IS_VHANDLE(handle)) return real(handle);
  if (cui_mc_is_handle(handle)) return cui_mc_release(handle);
  pthread_mutex_lock(&cui_st.lock);
  CUresult r = CUDA_SUCCESS;
  struct cui_alloc *a = cui_alloc_by_vhandle(handle);
  if (!gate_open()) {
    r = CUDA_ERROR_NOT_READY;
  } else if (!a || a->vrefs == 0) {
    /* The driver's behaviour is undefined here (cuda-driver.md §2): refuse, no driver call. */
    cui_api_warn("cuMemRelease", "virtual handle 0x%llx has no references left (released %s); no driver call: "
                 "CUDA_ERROR_INVALID_VALUE", (unsigned long long)handle, a ? "more often than obtained, still mapped"
                 : "already, or never issued");
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
  REAL_OR_FAIL(real, cuMemRetainAllocationHandle, fn_retain);
  uint64_t p = (uint64_t)(uintptr_t)addr;
  CUresult mr;
  if (cui_mc_retain(p, handle, &mr)) return mr;   /* a multicast VA: the object's virtual handle */
  struct cui_mapping *m = NULL;
  if (maybe_tracked(p, 1)) {
    pthread_mutex_lock(&cui_st.lock);
    m = map_containing(p);   /* mapped, or torn down by PREPARE_UNICAST */
    if (!m || (m->mapped == 0 && gate_open())) {
      pthread_mutex_unlock(&cui_st.lock);
      m = NULL;
    }
  }
  if (!m) {   /* untracked: the driver's handle, unless it collides with the virtual tag */
    if (!handle) return real(handle, addr);
    CUmemGenericAllocationHandle h;
    CUresult r = real(&h, addr);
    if (r == CUDA_SUCCESS && CUI_IS_VHANDLE(h)) {
      cui_api_warn("cuMemRetainAllocationHandle", "address 0x%llx: the driver returned handle 0x%llx, which "
                   "carries the shim's tag 0x%llx; released it: CUDA_ERROR_INVALID_HANDLE",
                   (unsigned long long)p, (unsigned long long)h, CUI_VHANDLE_TAG);
      REAL(cuMemRelease, fn_release)(h);
      r = CUDA_ERROR_INVALID_HANDLE;
    } else if (r == CUDA_SUCCESS) {
      *handle = h;
    }
    return r;
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
  if (cui_mc_is_handle(handle)) return cui_mc_map(ptr, size, offset, handle, flags);
  pthread_mutex_lock(&cui_st.lock);
  CUresult r;
  struct cui_alloc *a = cui_alloc_by_vhandle(handle);
  if (!gate_open()) r = CUDA_ERROR_NOT_READY;
  else if (!a || !a->has_real) {
    cui_api_warn("cuMemMap", "virtual handle 0x%llx is not a live allocation handle (released?): "
                 "CUDA_ERROR_INVALID_VALUE", (unsigned long long)handle);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    r = real(ptr, size, offset, a->real, flags);
    if (r == CUDA_SUCCESS && !map_add(a, ptr, size, offset)) {
      REAL(cuMemUnmap, fn_unmap)(ptr, size);   /* an unrecorded mapping could not be restored */
      r = CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

CUI_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  REAL_OR_FAIL(real, cuMemUnmap, fn_unmap);
  if (__atomic_load_n(&cui_st.mc_maps, __ATOMIC_RELAXED) && cui_mc_range(ptr, size)) return cui_mc_unmap(ptr, size);
  if (!maybe_tracked(ptr, size)) return real(ptr, size);
  pthread_mutex_lock(&cui_st.lock);
  struct cui_mapping *first = map_first(ptr, size);
  if (!first) {
    pthread_mutex_unlock(&cui_st.lock);
    return real(ptr, size);
  }
  CUresult r = CUDA_SUCCESS;
  if (!gate_open()) r = CUDA_ERROR_NOT_READY;
  /* Only whole mappings may be unmapped (cuda-driver.md §2); refused before the driver, so a
   * driver that accepted a partial unmap could not leave a record describing a half mapping. */
  FOR_MAPS_IN(m, ptr, size) {
    if (r != CUDA_SUCCESS) break;
    if (m->va < ptr || range_end(m->va, m->size) > range_end(ptr, size)) {
      cui_api_warn("cuMemUnmap", "range 0x%llx+0x%llx covers only part of the mapping 0x%llx+0x%llx (virtual "
                   "handle 0x%llx); no driver call: CUDA_ERROR_INVALID_VALUE", (unsigned long long)ptr,
                   (unsigned long long)size, (unsigned long long)m->va, (unsigned long long)m->size,
                   (unsigned long long)cui_st.allocs[m->alloc].vhandle);
      r = CUDA_ERROR_INVALID_VALUE;
    }
  }
  if (r == CUDA_SUCCESS) r = real(ptr, size);
  if (r == CUDA_SUCCESS) {
    struct cui_mapping *m = map_first(ptr, size);
    while (m) {
      struct cui_mapping *next = map_next(m, ptr, size);
      map_remove(m);
      m = next;
    }
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* ---------- access lists (merged per location; shared by unicast and multicast) ---------- */

static int access_find(const struct cui_access *acc, uint32_t count, uint32_t type, int32_t id) {
  for (uint32_t i = 0; i < count; i++)
    if (acc[i].location_type == type && acc[i].location_id == id) return (int)i;
  return -1;
}

uint32_t cui_access_count_after(const struct cui_access *acc, uint32_t count, const CUmemAccessDesc *desc,
                                size_t n) {
  uint32_t total = count;
  for (size_t k = 0; k < n; k++) {
    int dup = access_find(acc, count, desc[k].location.type, desc[k].location.id) >= 0;
    for (size_t j = 0; j < k && !dup; j++)
      dup = desc[j].location.type == desc[k].location.type && desc[j].location.id == desc[k].location.id;
    if (!dup) total++;
  }
  return total;
}

void cui_access_merge(struct cui_access *acc, uint32_t *count, const CUmemAccessDesc *desc, size_t n) {
  for (size_t k = 0; k < n; k++) {
    int at = access_find(acc, *count, desc[k].location.type, desc[k].location.id);
    if (at < 0) {
      at = (int)(*count)++;
      acc[at].location_type = desc[k].location.type;
      acc[at].location_id = desc[k].location.id;
      acc[at].reserved = 0;
    }
    acc[at].flags = desc[k].flags;
  }
}

CUresult cui_access_replay(CUdeviceptr va, size_t size, const struct cui_access *acc, uint32_t count) {
  CUmemAccessDesc d[CUI_MAX_ACCESS];
  size_t n = 0;
  for (uint32_t k = 0; k < count && k < CUI_MAX_ACCESS; k++) {
    if (acc[k].flags == 0) continue;
    memset(&d[n], 0, sizeof d[n]);
    d[n].location.type = (CUmemLocationType)acc[k].location_type;
    d[n].location.id = acc[k].location_id;
    d[n].flags = (CUmemAccess_flags)acc[k].flags;
    n++;
  }
  return n ? REAL(cuMemSetAccess, fn_setaccess)(va, size, d, n) : CUDA_SUCCESS;
}

CUI_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  REAL_OR_FAIL(real, cuMemSetAccess, fn_setaccess);
  if (desc && count && __atomic_load_n(&cui_st.mc_maps, __ATOMIC_RELAXED) && cui_mc_range(ptr, size))
    return cui_mc_set_access(ptr, size, desc, count);
  if (!desc || count == 0 || !maybe_tracked(ptr, size)) return real(ptr, size, desc, count);
  pthread_mutex_lock(&cui_st.lock);
  if (!map_first(ptr, size)) {
    pthread_mutex_unlock(&cui_st.lock);
    return real(ptr, size, desc, count);
  }
  CUresult r = CUDA_SUCCESS;
  if (!gate_open()) r = CUDA_ERROR_NOT_READY;
  /* Refused before the driver: a range covering only part of a tracked mapping (its access
   * could not be replayed exactly), and more than CUI_MAX_ACCESS locations per mapping. A range
   * spanning several whole mappings is fine: each records the grant. */
  FOR_MAPS_IN(m, ptr, size) {
    if (r != CUDA_SUCCESS) break;
    if (m->va < ptr || range_end(m->va, m->size) > range_end(ptr, size)) {
      cui_api_warn("cuMemSetAccess", "range 0x%llx+0x%llx covers only part of the mapping 0x%llx+0x%llx (virtual "
                   "handle 0x%llx); its access could not be replayed after a restore: CUDA_ERROR_NOT_SUPPORTED",
                   (unsigned long long)ptr, (unsigned long long)size, (unsigned long long)m->va,
                   (unsigned long long)m->size, (unsigned long long)cui_st.allocs[m->alloc].vhandle);
      r = CUDA_ERROR_NOT_SUPPORTED;
      break;
    }
    uint32_t n = cui_access_count_after(m->access, m->access_count, desc, count);
    if (n > CUI_MAX_ACCESS) {
      cui_api_warn("cuMemSetAccess", "mapping 0x%llx+0x%llx (virtual handle 0x%llx) would have %u access "
                   "locations, more than the %d the shim records; no driver call: CUDA_ERROR_NOT_SUPPORTED",
                   (unsigned long long)m->va, (unsigned long long)m->size,
                   (unsigned long long)cui_st.allocs[m->alloc].vhandle, n, CUI_MAX_ACCESS);
      r = CUDA_ERROR_NOT_SUPPORTED;
    }
  }
  if (r == CUDA_SUCCESS) r = real(ptr, size, desc, count);
  if (r == CUDA_SUCCESS) {
    FOR_MAPS_IN(m, ptr, size) cui_access_merge(m->access, &m->access_count, desc, count);
  }
  pthread_mutex_unlock(&cui_st.lock);
  return r;
}

/* ---------- export / import ---------- */

CUI_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType, unsigned long long flags) {
  REAL_OR_FAIL(real, cuMemExportToShareableHandle, fn_export);
  if (!CUI_IS_VHANDLE(handle)) return real(shareableHandle, handle, handleType, flags);
  if (cui_mc_is_handle(handle)) return cui_mc_export(shareableHandle, handle, handleType, flags);
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
    cui_api_warn("cuMemImportFromShareableHandle", "the driver returned handle 0x%llx, which carries the shim's "
                 "tag 0x%llx; released it: CUDA_ERROR_INVALID_HANDLE", (unsigned long long)*out, CUI_VHANDLE_TAG);
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
      CUI_FOR_MAPS_OF(x, a) if (x->mapped && !m) m = x;
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
    cui_api_warn("cuMemImportFromShareableHandle", "cannot import allocation %s from creator pid %u: %s; output "
                 "untouched: CUDA_ERROR_INVALID_VALUE", hex, t->creator_pid, why);
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
    } else if ((a = alloc_new(t->alloc_id, t->creator_pid)) == NULL) {
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
  REAL_OR_FAIL(real, cuMemImportFromShareableHandle, fn_import);
  if (shHandleType == CU_MEM_HANDLE_TYPE_FABRIC) return CUDA_ERROR_NOT_SUPPORTED;   /* untracked sharing */
  if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !handle)
    return real(handle, osHandle, shHandleType);
  int fd = (int)(intptr_t)osHandle;
  struct cui_ticket t;
  if (read_ticket(fd, &t)) {
    if (t.version == CUI_PROTO_VERSION && t.kind == CUI_TICKET_MULTICAST) return cui_mc_import_ticket(handle, &t);
    if (t.version != CUI_PROTO_VERSION || t.kind != CUI_TICKET_ALLOCATION) {
      char hex[33];
      cui_hex_id(t.alloc_id, hex);
      cui_api_warn("cuMemImportFromShareableHandle", "ticket for allocation %s of creator pid %u has version %u kind "
                   "%u (this shim reads version %u kind %u); output untouched: CUDA_ERROR_INVALID_VALUE", hex,
                   t.creator_pid, (unsigned)t.version, (unsigned)t.kind, (unsigned)CUI_PROTO_VERSION,
                   (unsigned)CUI_TICKET_ALLOCATION);
      return CUDA_ERROR_INVALID_VALUE;
    }
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
    uint8_t id[16];
    cui_random_id(id);
    struct cui_alloc *a = alloc_new(id, 0);   /* creator unknown */
    if (!a) {
      REAL(cuMemRelease, fn_release)(h);
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
  if (r == CUDA_SUCCESS && ptr) {
    if (cui_tab_put(&cui_st.resv_va, (struct cui_key){*ptr, 0, 0}, (uint32_t)cui_st.nresv) != 0) {
      REAL(cuMemAddressFree, fn_free)(*ptr, size);   /* unrecorded: could not be kept across a restore */
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      cui_st.resv[cui_st.nresv++] = (struct cui_reservation){*ptr, size, alignment};
    }
  }
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
