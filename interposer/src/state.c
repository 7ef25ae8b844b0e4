/*
 * state.c: the state layer (state.h; docs/shim.md "Object model" and "Data structures").
 *
 * The app only sees virtual allocation handles: 0xC01E in the top 16 bits, a counter below.
 * One allocation holds at most one driver reference per process, whatever the number of
 * virtual references (creates, imports of the same allocation, retains). Allocations are
 * found by virtual handle and by allocation id through hash tables, mappings through a
 * VA-ordered treap (the lookups are inline in state.h), reservations by VA through a hash
 * table. Also here: the export cache (its own mutex), tickets, access lists, and the
 * device-context and driver-handle helpers of the phase ops. Calls only util and resolve.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "state.h"

struct cui_state cui_st = {.lock = PTHREAD_MUTEX_INITIALIZER, .phase = CUI_PHASE_ACTIVE};

/* ---------- fork after cuInit ---------- */

int cui_forked;
static int g_fork_warned;

void cui_fork_child(void) { __atomic_store_n(&cui_forked, 1, __ATOMIC_RELAXED); }

void cui_fork_warn(const char *api) {
  if (__atomic_exchange_n(&g_fork_warned, 1, __ATOMIC_RELAXED)) return;
  cui_api_warn_in(CUI_PHASE_ACTIVE, api,
                  "this process was forked after cuInit in pid %u; fork after cuInit is unsupported: "
                  "every CUDA call is forwarded to the driver untracked (use exec or the spawn start "
                  "method)",
                  (unsigned)cui_st.pid);
}

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

/* ---------- secrets (protocol.h "Secrets"; own mutex) ---------- */

static pthread_mutex_t g_secret_lock = PTHREAD_MUTEX_INITIALIZER;
static struct cui_tab g_secret_ix;   /* (id, creator pid) -> index into g_secrets */
static uint64_t *g_secrets;          /* values; a free slot holds the next free index + 1 */
static uint32_t g_nsecrets, g_cap_secrets, g_secret_free;

uint64_t cui_secret_of(const uint8_t id[16], uint32_t creator_pid) {
  pthread_mutex_lock(&g_secret_lock);
  uint32_t *at = cui_tab_get(&g_secret_ix, cui_id_key(id, creator_pid));
  uint64_t v = at ? g_secrets[*at] : 0;
  pthread_mutex_unlock(&g_secret_lock);
  return v;
}

/* Lock held. 0 when out of memory. */
static int secret_put(const uint8_t id[16], uint32_t creator_pid, uint64_t secret) {
  uint32_t *at = cui_tab_get(&g_secret_ix, cui_id_key(id, creator_pid));
  if (at) {
    g_secrets[*at] = secret;
    return 1;
  }
  uint32_t i;
  if (g_secret_free) {
    i = g_secret_free - 1;
    g_secret_free = (uint32_t)g_secrets[i];
  } else {
    if (g_nsecrets == g_cap_secrets) {
      uint32_t cap = g_cap_secrets ? 2 * g_cap_secrets : 64;
      uint64_t *n = realloc(g_secrets, cap * sizeof *n);
      if (!n) return 0;
      g_secrets = n;
      g_cap_secrets = cap;
    }
    i = g_nsecrets++;
  }
  if (cui_tab_put(&g_secret_ix, cui_id_key(id, creator_pid), i) != 0) {
    g_secrets[i] = g_secret_free;
    g_secret_free = i + 1;
    return 0;
  }
  g_secrets[i] = secret;
  return 1;
}

uint64_t cui_secret_make(const uint8_t id[16]) {
  uint32_t self = (uint32_t)getpid();
  pthread_mutex_lock(&g_secret_lock);
  uint32_t *at = cui_tab_get(&g_secret_ix, cui_id_key(id, self));
  uint64_t v = at ? g_secrets[*at] : 0;
  while (!v) {   /* getrandom(2) through cui_random_id; 0 means "none" */
    uint8_t r[16];
    cui_random_id(r);
    memcpy(&v, r, sizeof v);
  }
  if (!at && !secret_put(id, self, v)) v = 0;
  pthread_mutex_unlock(&g_secret_lock);
  return v;
}

void cui_secret_learn(const uint8_t id[16], uint32_t creator_pid, uint64_t secret) {
  if (!secret) return;
  pthread_mutex_lock(&g_secret_lock);
  secret_put(id, creator_pid, secret);
  pthread_mutex_unlock(&g_secret_lock);
}

void cui_secret_forget(const uint8_t id[16], uint32_t creator_pid) {
  pthread_mutex_lock(&g_secret_lock);
  uint32_t *at = cui_tab_get(&g_secret_ix, cui_id_key(id, creator_pid));
  if (at) {
    uint32_t i = *at;
    cui_tab_del(&g_secret_ix, cui_id_key(id, creator_pid));
    g_secrets[i] = g_secret_free;
    g_secret_free = i + 1;
  }
  pthread_mutex_unlock(&g_secret_lock);
}

/* ---------- tables (lock held) ---------- */

uint64_t cui_new_vhandle(void) { return (CUI_VHANDLE_TAG << CUI_VHANDLE_SHIFT) | ++cui_st.last_vhandle; }

struct cui_alloc *cui_alloc_by_id(uint32_t creator_pid, const uint8_t id[16]) {
  uint32_t *v = cui_tab_get(&cui_st.alloc_ids, cui_id_key(id, creator_pid));
  return v ? &cui_st.allocs[*v] : NULL;
}

/* Slots of destroyed allocations are reused; virtual handles never are. */
struct cui_alloc *cui_alloc_new(const uint8_t id[16], uint32_t creator_pid) {
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

void cui_maybe_destroy(struct cui_alloc *a) {
  if (!a->live || a->vrefs || a->nmaps || a->nbinds) return;
  if (a->role == CUI_ROLE_CREATOR || (a->flags & CUI_REC_EXPORTED)) cui_cache_close(a->id);
  cui_secret_forget(a->id, a->creator_pid);
  cui_tab_del(&cui_st.alloc_ids, cui_id_key(a->id, a->creator_pid));
  cui_tab_del(&cui_st.alloc_vh, (struct cui_key){a->vhandle, 0, 0});
  a->live = 0;   /* the slot is reused, the virtual handle never */
  a->next_free = cui_st.alloc_free;
  cui_st.alloc_free = cui_alloc_index(a) + 1;
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

struct cui_mapping *cui_map_add(struct cui_alloc *a, uint64_t va, uint64_t size, uint64_t offset) {
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
  m->alloc = cui_alloc_index(a);
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
  __atomic_store_n(&cui_st.map_hi, cui_range_end(va, size) > hi ? cui_range_end(va, size) : hi, __ATOMIC_RELAXED);
  return m;
}

void cui_map_remove(struct cui_mapping *m) {
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

int cui_alloc_ticket(const struct cui_alloc *a) {
  struct cui_ticket t;
  memset(&t, 0, sizeof t);
  t.kind = CUI_TICKET_ALLOCATION;
  t.creator_pid = a->creator_pid;
  memcpy(t.alloc_id, a->id, 16);
  t.size = a->size;
  /* the creator's secret (0 only when out of memory: no ticket); an importer re-exporting passes
   * on the one it learnt (0 when its own ticket had none: the creator then refuses the fetch) */
  int own = a->creator_pid == (uint32_t)getpid();
  t.reserved[1] = own ? cui_secret_make(a->id) : cui_secret_of(a->id, a->creator_pid);
  if (own && !t.reserved[1]) return -1;
  return cui_make_ticket(&t);
}

/* 1 and the ticket when `fd` is a cuinterpose ticket, 0 otherwise. */
int cui_read_ticket(int fd, struct cui_ticket *t) {
  int seals = fcntl(fd, F_GET_SEALS);
  const int want = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  if (seals < 0 || (seals & want) != want) return 0;
  if (pread(fd, t, sizeof *t, 0) != (ssize_t)sizeof *t) return 0;
  if (memcmp(t->magic, CUI_TICKET_MAGIC, 8) != 0) return 0;
  if (t->version == CUI_PROTO_VERSION && t->kind == CUI_TICKET_ALLOCATION)
    cui_secret_learn(t->alloc_id, t->creator_pid, t->reserved[1]);
  return 1;
}

/* ---------- access lists (merged per location; unicast and multicast records) ---------- */

static int access_find(const struct cui_access *acc, uint32_t count, uint32_t type, int32_t id) {
  for (uint32_t i = 0; i < count; i++)
    if (acc[i].location_type == type && acc[i].location_id == id) return (int)i;
  return -1;
}

uint32_t cui_access_count_after(const struct cui_access *acc, uint32_t count, const CUmemAccessDesc *desc, size_t n) {
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
  return n ? REAL(cuMemSetAccess)(va, size, d, n) : CUDA_SUCCESS;
}

/* ---------- device contexts and driver handles (the phase ops) ---------- */

/* state.h. Failures surface at the copy itself (the driver's error names the call). */
void cui_ensure_context(const CUmemAllocationProp *prop) {
  cui_fn_cuCtxGetCurrent get = REAL(cuCtxGetCurrent);
  cui_fn_cuCtxGetDevice getdev = REAL(cuCtxGetDevice);
  cui_fn_cuDeviceGet devget = REAL(cuDeviceGet);
  CUcontext cur = NULL;
  if (!get || get(&cur) != CUDA_SUCCESS) return;
  int on_device = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE;
  if (cur && !on_device) return;   /* host memory: any context copies it */
  int ordinal = on_device ? prop->location.id : 0;
  CUdevice want, have;
  if (cur && getdev && devget && getdev(&have) == CUDA_SUCCESS && devget(&want, ordinal) == CUDA_SUCCESS &&
      have == want)
    return;
  (void)cui_set_device_context(ordinal);
}

/* The primary context the shim retained for each device ordinal, retained once per process and
 * kept (a retain per op, or per chunk when the copies alternate between GPUs, would raise the
 * context's reference count without end; cuDevicePrimaryCtxRetain, driver API docs). Only the
 * control worker sets contexts; the atomics keep a stray caller from reading a torn pointer. */
static CUcontext g_primary[CUI_MC_MAX_DEVICES];

CUresult cui_set_device_context(int ordinal) {
  cui_fn_cuDeviceGet devget = REAL(cuDeviceGet);
  cui_fn_cuDevicePrimaryCtxRetain pretain = REAL(cuDevicePrimaryCtxRetain);
  cui_fn_cuCtxSetCurrent set = REAL(cuCtxSetCurrent);
  if (!devget || !pretain || !set) return CUDA_ERROR_NOT_INITIALIZED;
  int cached = ordinal >= 0 && ordinal < CUI_MC_MAX_DEVICES;
  CUcontext ctx = cached ? __atomic_load_n(&g_primary[ordinal], __ATOMIC_ACQUIRE) : NULL;
  if (ctx && set(ctx) == CUDA_SUCCESS) return CUDA_SUCCESS;
  CUdevice dev;   /* none yet, or the kept one no longer works: retain (again) */
  CUresult r = devget(&dev, ordinal);
  if (r == CUDA_SUCCESS) r = pretain(&ctx, dev);
  if (r == CUDA_SUCCESS && cached) __atomic_store_n(&g_primary[ordinal], ctx, __ATOMIC_RELEASE);
  if (r == CUDA_SUCCESS) r = set(ctx);
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
    return REAL(cuMemRetainAllocationHandle)(h, (void *)(uintptr_t)m->va);
  }
  return CUDA_ERROR_INVALID_VALUE;
}
