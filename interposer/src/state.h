/*
 * state.h: the state layer (above resolve.h; docs/shim.md "Object model" and "Files and
 * layers"): the object tables (allocations, mapping records, reservations, multicast objects)
 * in cui_st, virtual handles, access lists, the export cache, tickets, and the device-context
 * and driver-handle helpers the phase ops share. state.c holds them; the lookups on the
 * wrappers' hot path are inline here (no extra call per intercepted call).
 * Everything here runs with cui_st.lock held unless noted.
 */
#ifndef CUI_STATE_H
#define CUI_STATE_H

#include "resolve.h"

#define CUI_VHANDLE_TAG   0xC01EULL
#define CUI_VHANDLE_SHIFT 48
#define CUI_IS_VHANDLE(h) (((uint64_t)(h) >> CUI_VHANDLE_SHIFT) == CUI_VHANDLE_TAG)

struct cui_alloc {
  int live;                        /* slot in use (handle refs or mappings remain); reused after */
  uint64_t vhandle;                /* the virtual handle the app sees; never reused */
  uint8_t id[16];                  /* creator-assigned allocation id */
  uint32_t creator_pid;
  uint16_t role;                   /* enum cui_role */
  uint32_t flags;                  /* CUI_REC_* */
  CUmemAllocationProp prop;
  uint64_t size;                   /* bytes (0 for a raw import: unknown) */
  CUmemGenericAllocationHandle real;
  int has_real;                    /* one driver reference held for all virtual refs */
  uint32_t vrefs;                  /* live virtual handle references */
  uint32_t nmaps;                  /* mapping records referring to this allocation */
  uint32_t nbinds;                 /* multicast bindings of this allocation (keep it live) */
  uint32_t maps_head;              /* its mapping records: a list through cui_mapping.next (ref) */
  uint32_t next_free;              /* free-slot list (index + 1) while not live */
  /* chunk files (ops_carriers.c; protocol.h "Carriers"), SAVED..LOADED: the stream's digest
   * table (nchunks * 32 bytes, malloc'd: it rides in the CRIU image), its size and the
   * cui_checksum64 of the table */
  uint8_t (*digests)[CUI_DIGEST_BYTES];
  uint32_t nchunks;
  uint64_t carrier_bytes, checksum;
  /* IPC adapter (alloc_api.c, ipc_api.c): flags CUI_REC_ADAPTER / CUI_REC_IPC */
  uint64_t req_size;               /* adapter: bytes the app asked cuMemAlloc_v2 for */
  uint64_t ipc_va;                 /* IPC importer: the VA cuIpcOpenMemHandle returned */
  uint32_t ipc_opens;              /* IPC importer: opens not yet closed */
  void *adapter_ctx;               /* the CUcontext current at cuMemAlloc_v2 / cuIpcOpenMemHandle */
  int adapter_dev;                 /* its device ordinal */
};

/* Mapping records live in stable slots of cui_st.maps; a "ref" is slot index + 1 (0 = none).
 * Live records sit in a treap ordered by VA (left/right/prio) and in their allocation's list
 * (next/prev); free slots are chained through `next`. */
struct cui_mapping {
  uint64_t va, size, offset;
  uint32_t alloc;                  /* index into state.allocs */
  int mapped;                      /* 0 between PREPARE_UNICAST and its rebuild */
  int used;                        /* slot holds a live record */
  uint32_t left, right, prio;      /* VA treap */
  uint32_t next, prev;             /* allocation list (or free list) */
  uint32_t access_count;
  struct cui_access access[CUI_MAX_ACCESS];
};

struct cui_reservation { uint64_t va, size, align; };

struct cui_state {
  pthread_mutex_t lock;            /* guards everything below; never held across a peer wait */
  uint32_t pid;
  uint32_t phase;                  /* enum cui_phase */
  int op_running;                  /* a phase op owns the state: app calls get NOT_READY */
  uint32_t inflight;               /* tracked app calls running with the lock dropped */
  uint64_t last_txn;
  uint64_t shim_flags;             /* CUI_SHIM_* (protocol.h), set at cuInit, in every reply */
  struct cui_alloc *allocs;
  size_t nallocs, cap_allocs;   /* nallocs: slots ever used */
  uint32_t alloc_free;             /* first free slot (index + 1), 0 = none */
  uint64_t last_vhandle;           /* low bits of the newest virtual handle (never reused) */
  struct cui_tab alloc_vh;         /* virtual handle -> slot of the live allocation */
  struct cui_tab alloc_ids;        /* (id, creator pid) -> slot of the live allocation */
  struct cui_mapping *maps;
  size_t nmaps, nslots, cap_maps;   /* nmaps: live records */
  uint32_t map_root, map_free, map_seed;
  /* Bounds of every mapping record, read without the lock: a range outside [map_lo, map_hi)
   * is untracked and passes through without taking the lock. */
  uint64_t map_lo, map_hi;
  struct cui_reservation *resv;
  size_t nresv, cap_resv;
  struct cui_tab resv_va;          /* va -> index into resv */
  uint64_t chunk_bytes;             /* the chunk size of the saved digest tables (SAVED..LOADED) */
  uint32_t chunk_sha256;            /* 1: those digests are SHA-256 (CUI_CARRY_SHA256), 0: BLAKE2b-256 */
  /* multicast (multicast_api.c) */
  struct cui_mc *mcs;
  size_t nmcs, cap_mcs;  /* objects; slots are never reused */
  uint32_t mc_maps;                /* live multicast mapping records (read without the lock) */
  int mc_cycle;                    /* this capture ran PREPARE_MULTICAST: rebuild ops follow */
};

/* Multicast objects (multicast_api.c; rebuilt by ops_multicast.c). */
#define CUI_MC_MAX_DEVICES 64

struct cui_mcbind {
  int dev;                         /* the device the binding was made for */
  uint32_t flags;                  /* CUI_REC_MC_BY_ADDR | CUI_REC_MC_V2_ABI */
  uint64_t mc_off, size;
  uint64_t mem_off;                /* offset into the member allocation */
  uint64_t memptr;                 /* BindAddr: the address bound */
  int has_member;                  /* member is a tracked allocation (always, for tracked objects) */
  uint32_t member;                 /* index into cui_st.allocs */
  int bound;                       /* 0 between PREPARE_MULTICAST and RESTORE_MULTICAST_BINDINGS */
};

struct cui_mcmap {
  uint64_t va, size, offset;
  int mapped;                      /* 0 between PREPARE_MULTICAST and RESTORE_MULTICAST_BINDINGS */
  uint32_t access_count;
  struct cui_access access[CUI_MAX_ACCESS];
};

struct cui_mc {
  int live;
  uint64_t vhandle;
  uint8_t id[16];
  uint32_t creator_pid;
  uint16_t role;                   /* CUI_ROLE_CREATOR or CUI_ROLE_IMPORTER */
  uint32_t flags;                  /* CUI_REC_EXPORTED | CUI_REC_SHARED | CUI_REC_PASSTHROUGH */
  CUmulticastObjectProp prop;      /* as requested (imports: from the ticket) */
  uint64_t extent;                 /* largest mcOffset + size bound or mapped here (sticky) */
  CUmemGenericAllocationHandle real;
  int has_real;                    /* one driver reference while vrefs, bindings or mappings */
  uint32_t vrefs;
  uint32_t ndevs;
  int devs[CUI_MC_MAX_DEVICES];
  struct cui_mcbind *binds;
  uint32_t nbinds, cap_binds;
  struct cui_mcmap *maps;
  uint32_t nmaps, cap_maps;
};

CUI_HIDDEN extern struct cui_state cui_st;

/* "<api>: pid <pid> (phase <P>): <message>" on stderr, with the current phase. */
#define cui_api_warn(api, ...) cui_api_warn_in(__atomic_load_n(&cui_st.phase, __ATOMIC_RELAXED), api, __VA_ARGS__)

/* Fork after cuInit (docs/shim.md "Fork"): set in the child by the pthread_atfork handler that
 * cuInit registers. In such a child every tracked wrapper forwards to the driver untouched (it
 * answers CUDA_ERROR_NOT_INITIALIZED there) and uses none of the inherited records; the first
 * such call says once on stderr that fork after cuInit is unsupported. */
CUI_HIDDEN extern int cui_forked;
CUI_HIDDEN void cui_fork_child(void);          /* the atfork child handler */
CUI_HIDDEN void cui_fork_warn(const char *api); /* once per process */
#define CUI_FORK_FORWARD(api, call)                                            \
  do {                                                                         \
    if (__builtin_expect(__atomic_load_n(&cui_forked, __ATOMIC_RELAXED), 0)) { \
      cui_fork_warn(api);                                                      \
      return call;                                                             \
    }                                                                          \
  } while (0)

/* Tracked app calls run only while the gate is open: ACTIVE and no phase op owns the state. */
static inline int cui_gate_open(void) { return cui_st.phase == CUI_PHASE_ACTIVE && !cui_st.op_running; }
CUI_HIDDEN uint64_t cui_new_vhandle(void);              /* never reused */

/* Export cache: real driver export FDs by allocation id, under its own mutex so FETCH_FD is
 * answered while the state is busy. cui_cache_dup returns a new FD (CLOEXEC) or -1. */
CUI_HIDDEN int cui_cache_put(const uint8_t id[16], int fd);   /* takes ownership; 0 or -1 */
CUI_HIDDEN int cui_cache_dup(const uint8_t id[16]);
CUI_HIDDEN int cui_cache_has(const uint8_t id[16]);
CUI_HIDDEN void cui_cache_close(const uint8_t id[16]);
CUI_HIDDEN unsigned cui_cache_close_all(void);

/* Tickets: cui_make_ticket seals `t` into a memfd (or -1); cui_alloc_ticket is the ticket of
 * an allocation (carrying its secret: reserved[1]); cui_read_ticket returns 1 and the ticket
 * when `fd` is a cuinterpose ticket (and learns an allocation ticket's secret). */
CUI_HIDDEN int cui_make_ticket(const struct cui_ticket *t);
CUI_HIDDEN int cui_alloc_ticket(const struct cui_alloc *a);
CUI_HIDDEN int cui_read_ticket(int fd, struct cui_ticket *t);

/* Secrets (protocol.h "Secrets"): 64 bits, never 0, by (allocation id, creator pid), under
 * their own mutex (FETCH_FD is served without the state lock). cui_secret_of: the secret known
 * for the allocation, 0 when none. cui_secret_make: this process's own allocation's secret (an
 * existing one, else a new one from getrandom(2)); 0 when out of memory. cui_secret_learn:
 * remember a secret read from a ticket or virtual IPC handle. cui_secret_forget: drop it (the
 * allocation is destroyed). */
CUI_HIDDEN uint64_t cui_secret_of(const uint8_t id[16], uint32_t creator_pid);
CUI_HIDDEN uint64_t cui_secret_make(const uint8_t id[16]);
CUI_HIDDEN void cui_secret_learn(const uint8_t id[16], uint32_t creator_pid, uint64_t secret);
CUI_HIDDEN void cui_secret_forget(const uint8_t id[16], uint32_t creator_pid);

/* Access lists, merged per location (PyTorch grants one GPU per cuMemSetAccess call).
 * cui_access_count_after: locations the list would hold after merging `desc[0..n)`.
 * cui_access_merge: merge them (the caller checked the count against CUI_MAX_ACCESS).
 * cui_access_replay: re-issue the recorded grants on [va, va+size) after a remap with the real
 * cuMemSetAccess; CUDA_SUCCESS without a call when nothing was granted. */
CUI_HIDDEN uint32_t cui_access_count_after(const struct cui_access *acc, uint32_t count, const CUmemAccessDesc *desc,
                                           size_t n);
CUI_HIDDEN void cui_access_merge(struct cui_access *acc, uint32_t *count, const CUmemAccessDesc *desc, size_t n);
CUI_HIDDEN CUresult cui_access_replay(CUdeviceptr va, size_t size, const struct cui_access *acc, uint32_t count);

/* Allocations: by virtual handle (live, or NULL), by (creator pid, id); cui_alloc_new makes a
 * live one indexed by both and by a new virtual handle (slots are reused, virtual handles
 * never); cui_maybe_destroy retires it once nothing refers to it. */
static inline struct cui_alloc *cui_alloc_by_vhandle(uint64_t vh) {
  if (!CUI_IS_VHANDLE(vh)) return NULL;
  uint32_t *at = cui_tab_get(&cui_st.alloc_vh, (struct cui_key){vh, 0, 0});
  return at ? &cui_st.allocs[*at] : NULL;
}
CUI_HIDDEN struct cui_alloc *cui_alloc_by_id(uint32_t creator_pid, const uint8_t id[16]);
CUI_HIDDEN struct cui_alloc *cui_alloc_new(const uint8_t id[16], uint32_t creator_pid);
CUI_HIDDEN void cui_maybe_destroy(struct cui_alloc *a);
static inline uint32_t cui_alloc_index(const struct cui_alloc *a) { return (uint32_t)(a - cui_st.allocs); }

/* The driver handle of `a`: the held one, else a temporary retain through one of its mappings
 * (*temporary = 1: the caller releases it). CUDA_ERROR_INVALID_VALUE if neither exists. */
CUI_HIDDEN CUresult cui_alloc_driver_handle(struct cui_alloc *a, CUmemGenericAllocationHandle *h, int *temporary);
/* Make a context current on this thread. cui_ensure_context (best effort): for a
 * device-located allocation, its device's primary context unless a context of that device is
 * current already (a copy to or from VMM memory runs on the current context's device, which
 * needs access to the mapping: a process may own allocations on several GPUs); for a
 * host-located one, device 0's when none is current. cui_set_device_context: the primary
 * context of `ordinal`, retained once per process and kept (state.c g_primary). */
CUI_HIDDEN void cui_ensure_context(const CUmemAllocationProp *prop);
CUI_HIDDEN CUresult cui_set_device_context(int ordinal);

/* ---------- mapping records: a VA treap over stable slots of cui_st.maps ---------- */

#define CUI_MAP(ref) (&cui_st.maps[(ref) - 1])
/* Iterates the mapping records of allocation `a`. */
#define CUI_FOR_MAPS_OF(m, a)                                                      \
  for (struct cui_mapping *m = (a)->maps_head ? CUI_MAP((a)->maps_head) : NULL; m; \
       m = m->next ? CUI_MAP(m->next) : NULL)

/* A new record of `a` (NULL: out of memory) and its removal (which may retire `a`). */
CUI_HIDDEN struct cui_mapping *cui_map_add(struct cui_alloc *a, uint64_t va, uint64_t size, uint64_t offset);
CUI_HIDDEN void cui_map_remove(struct cui_mapping *m);

static inline uint64_t cui_range_end(uint64_t va, uint64_t size) {   /* saturating */
  return va + size < va ? UINT64_MAX : va + size;
}

/* The record with the greatest VA <= p, or 0. */
static inline uint32_t cui_map_floor(uint64_t p) {
  uint32_t t = cui_st.map_root, best = 0;
  while (t) {
    if (CUI_MAP(t)->va <= p) best = t, t = CUI_MAP(t)->right;
    else t = CUI_MAP(t)->left;
  }
  return best;
}

/* The record with the smallest VA > p, or 0. */
static inline uint32_t cui_map_above(uint64_t p) {
  uint32_t t = cui_st.map_root, best = 0;
  while (t) {
    if (CUI_MAP(t)->va > p) best = t, t = CUI_MAP(t)->left;
    else t = CUI_MAP(t)->right;
  }
  return best;
}

/* Records overlapping [va, va+size), in VA order: first, then cui_map_next until NULL. */
static inline struct cui_mapping *cui_map_first(uint64_t va, uint64_t size) {
  if (size == 0) return NULL;
  uint32_t f = cui_map_floor(va);
  if (f && cui_range_end(CUI_MAP(f)->va, CUI_MAP(f)->size) > va) return CUI_MAP(f);
  f = cui_map_above(va);
  return f && CUI_MAP(f)->va < cui_range_end(va, size) ? CUI_MAP(f) : NULL;
}

static inline struct cui_mapping *cui_map_next(const struct cui_mapping *m, uint64_t va, uint64_t size) {
  uint32_t f = cui_map_above(m->va);
  return f && CUI_MAP(f)->va < cui_range_end(va, size) ? CUI_MAP(f) : NULL;
}

#define CUI_FOR_MAPS_IN(m, va, size) \
  for (struct cui_mapping *m = cui_map_first(va, size); m; m = cui_map_next(m, va, size))

/* The record containing address p, or NULL. */
static inline struct cui_mapping *cui_map_containing(uint64_t p) {
  uint32_t f = cui_map_floor(p);
  return f && p - CUI_MAP(f)->va < CUI_MAP(f)->size ? CUI_MAP(f) : NULL;
}

/* Lock-free pre-check: 0 when no mapping record can overlap [va, va+size). */
static inline int cui_maybe_tracked(uint64_t va, uint64_t size) {
  uint64_t lo = __atomic_load_n(&cui_st.map_lo, __ATOMIC_RELAXED),
           hi = __atomic_load_n(&cui_st.map_hi, __ATOMIC_RELAXED);
  return lo < hi && va < hi && cui_range_end(va, size) > lo;
}

#endif
