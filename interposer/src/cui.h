/*
 * libcuinterpose internal interface (not installed). See docs/shim.md.
 *
 * Files:
 *   resolve.c  the name->wrapper table, real driver/runtime functions, the dlsym override,
 *              cuGetProcAddress[_v2] and cudaGetDriverEntryPoint* wrappers.
 *   vmm.c      the object model (virtual allocation handles, mappings, reservations, export
 *              cache, tickets) and the tracked VMM wrappers.
 *   phases.c   INSPECT and the unicast phase ops (SAVE_ALLOCATIONS ... RESTORE_UNICAST), the
 *              phase machine and dispatch.
 *   multicast.c the multicast object model, its wrappers (cuMulticast*, and the multicast
 *              branches of map/unmap/access/release/export/import) and the multicast phase ops
 *              (PREPARE_MULTICAST, RESTORE_MULTICAST_*).
 *   control.c  the control endpoint: socket, accept thread (FETCH_FD), control worker thread,
 *              and the FETCH_FD client used by importers.
 *   util.c     error names, random allocation ids, messages, clocks.
 *   checksum.c cui_checksum64 (protocol.h).
 * Everything here has hidden visibility; only the hooked names are exported
 * (libcuinterpose.map).
 */
#ifndef CUI_INTERNAL_H
#define CUI_INTERNAL_H

#include <cuda.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "cuinterpose/protocol.h"

#define CUI_EXPORT __attribute__((visibility("default")))
#define CUI_HIDDEN __attribute__((visibility("hidden")))

/* ---------- resolve.c ---------- */

/* Rows of the one name->wrapper table. A row is one ELF name; `base` is the name a
 * cuGetProcAddress caller asks for. Rows without a wrapper are real-only (the shim calls
 * them, never hands them out). */
enum cui_row {
  CUI_ROW_cuInit,
  CUI_ROW_cuMemCreate,
  CUI_ROW_cuMemRelease,
  CUI_ROW_cuMemRetainAllocationHandle,
  CUI_ROW_cuMemMap,
  CUI_ROW_cuMemUnmap,
  CUI_ROW_cuMemSetAccess,
  CUI_ROW_cuMemExportToShareableHandle,
  CUI_ROW_cuMemImportFromShareableHandle,
  CUI_ROW_cuMemGetAllocationPropertiesFromHandle,
  CUI_ROW_cuMemAddressReserve,
  CUI_ROW_cuMemAddressFree,
  CUI_ROW_cuMulticastCreate,
  CUI_ROW_cuMulticastAddDevice,
  CUI_ROW_cuMulticastBindMem,
  CUI_ROW_cuMulticastBindAddr,
  CUI_ROW_cuMulticastBindMem_v2,     /* CUDA 13.1 device-explicit ABI, looked up by full name */
  CUI_ROW_cuMulticastBindAddr_v2,
  CUI_ROW_cuMulticastUnbind,
  CUI_ROW_cuGetProcAddress,          /* legacy 4-argument ABI (PFN _v11030) */
  CUI_ROW_cuGetProcAddress_v2,       /* 5-argument ABI (PFN _v12000) */
  CUI_ROW_cudaGetDriverEntryPoint,
  CUI_ROW_cudaGetDriverEntryPoint_ptsz,
  CUI_ROW_cudaGetDriverEntryPointByVersion,
  CUI_ROW_cudaGetDriverEntryPointByVersion_ptsz,
  /* real-only rows */
  CUI_ROW_cuGetErrorName,
  CUI_ROW_cuMemcpyDtoH_v2,
  CUI_ROW_cuMemcpyHtoD_v2,
  CUI_ROW_cuCtxGetCurrent,
  CUI_ROW_cuCtxSetCurrent,
  CUI_ROW_cuDeviceGet,
  CUI_ROW_cuDevicePrimaryCtxRetain,
  CUI_ROW_cuMemHostRegister_v2,
  CUI_ROW_cuMemHostUnregister,
  CUI_ROW_cuCtxGetDevice,
  CUI_ROW_COUNT
};

/* The real function of a row (libcuda.so.1 for driver rows, libcudart for runtime rows),
 * or NULL when that library does not define it. Never returns one of the shim's wrappers. */
CUI_HIDDEN void *cui_real(enum cui_row row);

/* Signatures of the real driver functions the wrappers and phases call (cuda.h), and
 * REAL(row, fn_x): the real function of a row cast to its type. */
typedef CUresult (*fn_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*fn_ctxdev)(CUdevice *);
typedef CUresult (*fn_ctxget)(CUcontext *);
typedef CUresult (*fn_ctxset)(CUcontext);
typedef CUresult (*fn_devget)(CUdevice *, int);
typedef CUresult (*fn_dtoh)(void *, CUdeviceptr, size_t);
typedef CUresult (*fn_export)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
typedef CUresult (*fn_free)(CUdeviceptr, size_t);
typedef CUresult (*fn_getprop)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
typedef CUresult (*fn_hostreg)(void *, size_t, unsigned int);
typedef CUresult (*fn_hostunreg)(void *);
typedef CUresult (*fn_htod)(CUdeviceptr, const void *, size_t);
typedef CUresult (*fn_import)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
typedef CUresult (*fn_init)(unsigned int);
typedef CUresult (*fn_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*fn_mc_add)(CUmemGenericAllocationHandle, CUdevice);
typedef CUresult (*fn_mc_bindaddr)(CUmemGenericAllocationHandle, size_t, CUdeviceptr, size_t, unsigned long long);
typedef CUresult (*fn_mc_bindaddr2)(CUmemGenericAllocationHandle, CUdevice, size_t, CUdeviceptr, size_t,
                                    unsigned long long);
typedef CUresult (*fn_mc_bindmem)(CUmemGenericAllocationHandle, size_t, CUmemGenericAllocationHandle, size_t, size_t,
                                  unsigned long long);
typedef CUresult (*fn_mc_bindmem2)(CUmemGenericAllocationHandle, CUdevice, size_t, CUmemGenericAllocationHandle, size_t,
                                   size_t, unsigned long long);
typedef CUresult (*fn_mc_create)(CUmemGenericAllocationHandle *, const CUmulticastObjectProp *);
typedef CUresult (*fn_mc_unbind)(CUmemGenericAllocationHandle, CUdevice, size_t, size_t);
typedef CUresult (*fn_pretain)(CUcontext *, CUdevice);
typedef CUresult (*fn_release)(CUmemGenericAllocationHandle);
typedef CUresult (*fn_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*fn_retain)(CUmemGenericAllocationHandle *, void *);
typedef CUresult (*fn_setaccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*fn_unmap)(CUdeviceptr, size_t);
#define REAL(row, type) ((type)cui_real(CUI_ROW_##row))

/* ---------- util.c ---------- */

CUI_HIDDEN const char *cui_cu_error_name(CUresult r);   /* "CUDA_ERROR_INVALID_VALUE" */
CUI_HIDDEN void cui_random_id(uint8_t id[16]);
CUI_HIDDEN void cui_hex_id(const uint8_t id[16], char out[33]);
CUI_HIDDEN uint64_t cui_now_ns(void);                   /* CLOCK_MONOTONIC, ns */
CUI_HIDDEN void cui_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The control directory ($CUINTERPOSE_CONTROL_DIR or CUI_DEFAULT_CONTROL_DIR) and the socket
 * path of `pid` in it. Returns -1 when the path does not fit sockaddr_un.sun_path. */
CUI_HIDDEN const char *cui_control_dir(void);
CUI_HIDDEN int cui_socket_path(uint32_t pid, char *out, size_t cap);

/* ---------- checksum.c ---------- */

CUI_HIDDEN uint64_t cui_checksum64(const void *data, size_t length);

/* ---------- vmm.c : object model ---------- */

#define CUI_VHANDLE_TAG      0xC01EULL
#define CUI_VHANDLE_SHIFT    48
#define CUI_IS_VHANDLE(h)    (((uint64_t)(h) >> CUI_VHANDLE_SHIFT) == CUI_VHANDLE_TAG)

/* Small open-addressing hash table (util.c), linear probing, backward-shift deletion, grown at
 * half load. Keys are three words: an allocation id (a, b = its two halves, c = creator pid),
 * or a VA (a = va, b = c = 0). Values are 32 bits. The caller provides the locking. */
struct cui_key { uint64_t a, b; uint32_t c; };
struct cui_tab {
  struct cui_tslot { struct cui_key k; uint32_t val; uint32_t used; } *s;
  uint32_t cap, n;
};
CUI_HIDDEN struct cui_key cui_id_key(const uint8_t id[16], uint32_t pid);
CUI_HIDDEN uint32_t *cui_tab_get(const struct cui_tab *t, struct cui_key k);   /* value or NULL */
CUI_HIDDEN int cui_tab_put(struct cui_tab *t, struct cui_key k, uint32_t val); /* 0, -1 out of memory */
CUI_HIDDEN void cui_tab_del(struct cui_tab *t, struct cui_key k);

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
  uint64_t carrier_off, carrier_bytes, checksum;
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
  struct cui_alloc *allocs; size_t nallocs, cap_allocs;   /* nallocs: slots ever used */
  uint32_t alloc_free;             /* first free slot (index + 1), 0 = none */
  uint64_t last_vhandle;           /* low bits of the newest virtual handle (never reused) */
  struct cui_tab alloc_vh;         /* virtual handle -> slot of the live allocation */
  struct cui_tab alloc_ids;        /* (id, creator pid) -> slot of the live allocation */
  struct cui_mapping *maps; size_t nmaps, nslots, cap_maps;   /* nmaps: live records */
  uint32_t map_root, map_free, map_seed;
  /* Bounds of every mapping record, read without the lock: a range outside [map_lo, map_hi)
   * is untracked and passes through without taking the lock. */
  uint64_t map_lo, map_hi;
  struct cui_reservation *resv; size_t nresv, cap_resv;
  struct cui_tab resv_va;          /* va -> index into resv */
  unsigned char *arena; size_t arena_size;   /* host carrier arena (creators, SAVED..LOADED) */
  int arena_release_pending;
  /* multicast (multicast.c) */
  struct cui_mc *mcs; size_t nmcs, cap_mcs;  /* objects; slots are never reused */
  uint32_t mc_maps;                /* live multicast mapping records (read without the lock) */
  int mc_cycle;                    /* this capture ran PREPARE_MULTICAST: rebuild ops follow */
};

/* ---------- multicast.c : object model ---------- */

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
  struct cui_mcbind *binds; uint32_t nbinds, cap_binds;
  struct cui_mcmap *maps; uint32_t nmaps, cap_maps;
};

/* Wrappers' multicast branches (called with the lock NOT held). */
CUI_HIDDEN int cui_mc_is_handle(uint64_t vh);   /* a live multicast virtual handle */
CUI_HIDDEN CUresult cui_mc_release(uint64_t vh);
CUI_HIDDEN CUresult cui_mc_map(CUdeviceptr ptr, size_t size, size_t offset, uint64_t vh, unsigned long long flags);
CUI_HIDDEN int cui_mc_range(uint64_t va, uint64_t size);   /* overlaps a multicast mapping record */
CUI_HIDDEN int cui_mc_retain(uint64_t p, CUmemGenericAllocationHandle *handle, CUresult *r);
CUI_HIDDEN CUresult cui_mc_unmap(CUdeviceptr ptr, size_t size);
CUI_HIDDEN CUresult cui_mc_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUI_HIDDEN CUresult cui_mc_export(void *shareableHandle, uint64_t vh, CUmemAllocationHandleType type,
                                  unsigned long long flags);
CUI_HIDDEN CUresult cui_mc_import_ticket(CUmemGenericAllocationHandle *handle, const struct cui_ticket *t);
/* Phase ops (phases.c dispatch; op_running set, lock not held). */
CUI_HIDDEN int cui_mc_live_count(void);                 /* lock held */
CUI_HIDDEN const struct cui_mc *cui_mc_passthrough(void);   /* a live pass-through object, lock held */
CUI_HIDDEN size_t cui_mc_record_count(void);            /* lock held */
CUI_HIDDEN size_t cui_mc_fill_records(struct cui_record *out);   /* lock held; returns count */
struct cui_op_result;
CUI_HIDDEN int cui_PREPARE_MULTICAST(struct cui_op_result *res);
CUI_HIDDEN int cui_RESTORE_MULTICAST_CREATORS(struct cui_op_result *res);
CUI_HIDDEN int cui_RESTORE_MULTICAST_IMPORTERS(struct cui_op_result *res);
CUI_HIDDEN int cui_RESTORE_MULTICAST_DEVICES(struct cui_op_result *res);
CUI_HIDDEN int cui_RESTORE_MULTICAST_BINDINGS(struct cui_op_result *res);

/* vmm.c helpers shared with multicast.c (lock held unless noted) */
CUI_HIDDEN int cui_gate_open(void);
CUI_HIDDEN struct cui_mapping *cui_map_containing(uint64_t p);
CUI_HIDDEN uint64_t cui_new_vhandle(void);              /* never reused */
CUI_HIDDEN int cui_make_ticket(const struct cui_ticket *t);   /* sealed memfd, or -1 */
/* phases.c helper: make the primary context of device `ordinal` current on this thread. */
CUI_HIDDEN CUresult cui_set_device_context(int ordinal);

CUI_HIDDEN extern struct cui_state cui_st;

/* Export cache: real driver export FDs by allocation id, under its own mutex so FETCH_FD is
 * answered while the state is busy. cui_cache_dup returns a new FD (CLOEXEC) or -1. */
CUI_HIDDEN int cui_cache_put(const uint8_t id[16], int fd);   /* takes ownership; 0 or -1 */
CUI_HIDDEN int cui_cache_dup(const uint8_t id[16]);
CUI_HIDDEN int cui_cache_has(const uint8_t id[16]);
CUI_HIDDEN void cui_cache_close(const uint8_t id[16]);
CUI_HIDDEN unsigned cui_cache_close_all(void);

/* Access lists, merged per location (PyTorch grants one GPU per cuMemSetAccess call).
 * cui_access_count_after: locations the list would hold after merging `desc[0..n)`.
 * cui_access_merge: merge them (the caller checked the count against CUI_MAX_ACCESS).
 * cui_access_replay: re-issue the recorded grants on [va, va+size) after a remap with the real
 * cuMemSetAccess; CUDA_SUCCESS without a call when nothing was granted. */
CUI_HIDDEN uint32_t cui_access_count_after(const struct cui_access *acc, uint32_t count,
                                           const CUmemAccessDesc *desc, size_t n);
CUI_HIDDEN void cui_access_merge(struct cui_access *acc, uint32_t *count, const CUmemAccessDesc *desc,
                                 size_t n);
CUI_HIDDEN CUresult cui_access_replay(CUdeviceptr va, size_t size, const struct cui_access *acc,
                                      uint32_t count);

CUI_HIDDEN struct cui_alloc *cui_alloc_by_vhandle(uint64_t vh);     /* live, or NULL */
CUI_HIDDEN void cui_maybe_destroy(struct cui_alloc *a);             /* lock held */
/* The driver handle of `a`: the held one, else a temporary retain through one of its mappings
 * (*temporary = 1: the caller releases it). CUDA_ERROR_INVALID_VALUE if neither exists. */
CUI_HIDDEN CUresult cui_alloc_driver_handle(struct cui_alloc *a, CUmemGenericAllocationHandle *h,
                                            int *temporary);             /* lock held */
#define CUI_MAP(ref) (&cui_st.maps[(ref) - 1])
/* Iterates the mapping records of allocation `a` (lock held). */
#define CUI_FOR_MAPS_OF(m, a) \
  for (struct cui_mapping *m = (a)->maps_head ? CUI_MAP((a)->maps_head) : NULL; m; m = m->next ? CUI_MAP(m->next) : NULL)
/* The phase name ("ACTIVE") and "<api>: pid <pid> (phase <P>): <message>" on stderr. */
CUI_HIDDEN const char *cui_phase_name(uint32_t phase);
CUI_HIDDEN void cui_api_warn(const char *api, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---------- phases.c ---------- */

struct cui_op_result {
  int32_t status;                  /* enum cui_status */
  uint64_t bytes, copy_ns;
  int32_t cuda_result;
  uint32_t records_changed;
  char message[512];
  struct cui_record *records;      /* malloc'd, INSPECT only */
  uint32_t record_count;
};

/* Runs one request on the control worker. Fills `res`; the caller sends the reply. */
CUI_HIDDEN void cui_run_op(const struct cui_request *req, struct cui_op_result *res);
/* Work deferred until after the reply was sent (carrier arena release). */
CUI_HIDDEN void cui_after_reply(void);

/* ---------- control.c ---------- */

CUI_HIDDEN void cui_control_start(void);    /* once, after the first successful real cuInit */
/* Asks the creator's control socket for the real export FD of `id`. Returns the FD (CLOEXEC)
 * or -1 with a reason in `why`. Never touches the state lock. */
CUI_HIDDEN int cui_fetch_fd(uint32_t creator_pid, const uint8_t id[16], char *why, size_t cap);

#endif
