/*
 * fc.h: fakecuda's private header (see docs/fakecuda.md, "Source layout"). It holds what more
 * than one file needs: the build constants, the configuration and the call log, the entry
 * gate and its API macros, the shared types (contexts, the VMM tables, the multicast team,
 * copy-engine ops, the checkpoint control protocol) and the helpers other files call.
 * Everything declared here is hidden: the library exports only the cu* names that
 * proc_address.def lists.
 *
 * Files, lowest layer first (a file calls only files listed before it):
 *   core.c                  configuration, call log, entry gate, fork handling
 *   device.c                devices and contexts (cuDevice*, cuDevicePrimaryCtx*, cuCtx*)
 *   vmm_table.c             the tables every kind of device memory lives in
 *   peer.c                  peer context access (cuDeviceCanAccessPeer, cuCtx{En,Dis}ablePeerAccess)
 *   copy.c                  the copy engine (runs one op; multicast writes reach the members)
 *   stream.c                streams and stream memory operations
 *   event.c                 events and IPC events (cuEvent*, cuStreamWaitEvent, cuIpc*EventHandle)
 *   memory.c                cuMemAlloc memory, page-locked host memory, copies and sets
 *   pool.c                  stream-ordered memory pools and their IPC (cuMemPool*, cuMem*Async)
 *   ipc.c                   legacy CUDA IPC of cuMemAlloc memory (cuIpc*MemHandle)
 *   multicast.c             multicast objects (cuMulticast*)
 *   vmm.c                   the VMM API (cuMemCreate, cuMemMap, cuMemSetAccess, export, ...)
 *   pointer.c               cuPointerGetAttribute[s] (device and page-locked host memory)
 *   checkpoint_checks.c     what a checkpoint refuses; where a restore puts the devices (gpuPairs)
 *   checkpoint_storage.c    the target's custom-storage staging (one memfd per GPU, cuda.h 13.4+)
 *   checkpoint_target.c     the control thread serving this process's checkpoint requests
 *   checkpoint_controller.c cuCheckpointProcess* (the client of another process's target)
 *   init.c                  cuInit, cuDriverGetVersion, cuGetErrorName/String
 *   proc_address.c          cuGetProcAddress[_v2] over the table in proc_address.def
 */
#ifndef FAKECUDA_FC_H
#define FAKECUDA_FC_H

#define _GNU_SOURCE
#define __CUDA_API_VERSION_INTERNAL 1 /* declare every ELF spelling (v1, _v2, _ptds, _ptsz) */
#pragma GCC visibility push(default)
#include <cuda.h>
#pragma GCC visibility pop

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define FC_EXPORT __attribute__((visibility("default")))
#define FC_DRIVER_VERSION 13050          /* default of FAKECUDA_DRIVER_VERSION */
#define FC_CUSTOM_STORAGE_VERSION 13040  /* customStorageInfo_out, cuCheckpointOperationComplete */
#define FC_MAX_DEVICES 16
#define FC_META_MAGIC "FAKECUDA"
#define FC_META_VERSION 1u
#define FC_KIND_ALLOCATION 1u
#define FC_KIND_MULTICAST 2u
#define FC_KIND_MEMALLOC 3u /* a cuMemAlloc buffer's memfd: shared by CUDA IPC, never a VMM import */
#define FC_SHIM_TAG 0xC01Eull

#pragma GCC visibility push(hidden)

/* ------------------------------------------------------------------ configuration (core.c) */

extern atomic_int g_inited;
extern int g_ndev;              /* FAKECUDA_DEVICE_COUNT; after cuInit the visible devices */
extern size_t g_gran;           /* FAKECUDA_GRANULARITY */
extern size_t g_page;
extern unsigned long long g_totalmem; /* FAKECUDA_TOTAL_MEM */
enum { HINT_HONOR, HINT_IGNORE, HINT_FAIL };
extern int g_hint_mode;         /* FAKECUDA_RESERVE_HINT */
extern unsigned long long g_mc_watchdog_ms; /* FAKECUDA_MULTICAST_WATCHDOG_MS (0: wait forever) */
extern unsigned long long g_mc_rounding;    /* FAKECUDA_MULTICAST_CAPACITY_ROUNDING (0: none) */
extern unsigned long long g_map_offsets;    /* FAKECUDA_MAP_OFFSETS (0: offset 0 only, as R580) */
extern int g_launch_job;        /* a job of cuda-checkpoint --launch-job (CUDA_CHECKPOINT_JOB_FILE at
                                 * cuInit, or FAKECUDA_LAUNCH_JOB): native checkpoint carries CUDA IPC */
extern int g_persistence;       /* FAKECUDA_PERSISTENCE_MODE: a restore needs no cuInit in the caller */
extern int g_forked_child;      /* a child forked after cuInit (the driver is unusable there) */
extern int g_ck_listen;         /* the checkpoint control socket (checkpoint_target.c) */
extern int g_driver_version;    /* FAKECUDA_DRIVER_VERSION (cuDriverGetVersion; lookups above it fail) */
extern unsigned long long g_cs_timeout_ms; /* FAKECUDA_CUSTOM_STORAGE_TIMEOUT_MS (0: wait forever) */
extern const char *g_hold_fn;   /* FAKECUDA_HOLD=FN:DIR (test only): the function that may hold */
void fc_hold(const char *fn);   /* FN while DIR/hold exists: creates DIR/held, waits for hold to go */

/* ------------------------------------------------------------------ call log (core.c) */

pid_t fc_tid(void);
const char *fc_errname(CUresult r);
void fc_logline(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void fc_loud(const char *fmt, ...) __attribute__((format(printf, 1, 2))); /* stderr and the call log */
void fc_log_call(const char *fn, CUresult r, const char *fmt, ...);

/* ------------------------------------------------------------------ entry gate (state in core.c) */
/* Inline: every API call passes it. Every gated API increments `inflight` while it runs. cuCheckpointProcessLock closes
 * the gate (new calls block), then waits for inflight == 0 and pending stream ops == 0. */

struct fc_gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int closed;       /* set by Lock; new calls park */
    atomic_long inflight;    /* gated calls running now */
    long pending_ops;        /* queued stream ops (under mu) */
};
extern struct fc_gate g_gate;

/* Fast path: one atomic increment and one load (seq_cst on both sides: the locker stores
 * `closed` then reads `inflight`, an entrant increments `inflight` then reads `closed`, so at
 * least one sees the other). Slow path, only while locked: park on the condition variable. */
static inline CUresult api_enter(void)
{
    if (!atomic_load_explicit(&g_inited, memory_order_acquire))
        return CUDA_ERROR_NOT_INITIALIZED;
    atomic_fetch_add(&g_gate.inflight, 1);
    if (!atomic_load(&g_gate.closed))
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_gate.mu);
    atomic_fetch_sub(&g_gate.inflight, 1);
    pthread_cond_broadcast(&g_gate.cv);
    while (atomic_load(&g_gate.closed))
        pthread_cond_wait(&g_gate.cv, &g_gate.mu);
    atomic_fetch_add(&g_gate.inflight, 1);
    pthread_mutex_unlock(&g_gate.mu);
    return CUDA_SUCCESS;
}

static inline void api_leave(void)
{
    if (atomic_fetch_sub(&g_gate.inflight, 1) == 1 && atomic_load(&g_gate.closed)) {
        pthread_mutex_lock(&g_gate.mu);
        pthread_cond_broadcast(&g_gate.cv);
        pthread_mutex_unlock(&g_gate.mu);
    }
}

static inline CUresult api_initonly(void)
{
    return atomic_load_explicit(&g_inited, memory_order_acquire) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

/* Gated API body: run `call` inside the gate, log, return. */
#define API(call, fmt, ...)                            \
    do {                                               \
        if (g_hold_fn)                                 \
            fc_hold(__func__);                         \
        CUresult r_ = api_enter();                     \
        if (r_ == CUDA_SUCCESS) {                      \
            r_ = (call);                               \
            api_leave();                               \
        }                                              \
        fc_log_call(__func__, r_, fmt, ##__VA_ARGS__); \
        return r_;                                     \
    } while (0)

/* Ungated API (needs cuInit only unless `needinit` is 0). */
#define API_NOGATE(needinit, call, fmt, ...)                      \
    do {                                                          \
        CUresult r_ = (needinit) ? api_initonly() : CUDA_SUCCESS; \
        if (r_ == CUDA_SUCCESS)                                   \
            r_ = (call);                                          \
        fc_log_call(__func__, r_, fmt, ##__VA_ARGS__);            \
        return r_;                                                \
    } while (0)

/* Output arguments are logged only when the call succeeded (r_ is the API macro's result). */
#define OUT64(p) ((r_ == CUDA_SUCCESS && (p)) ? (unsigned long long)*(p) : 0ull)
#define OUTI(p) ((r_ == CUDA_SUCCESS && (p)) ? (int)*(p) : -1)

/* One mutex for every table (contexts, streams, reservations, allocations, mappings). */
extern pthread_mutex_t g_mu;

/* ------------------------------------------------------------------ devices, contexts (device.c) */

#define FC_CTX_MAGIC 0xfc0c7e47u

struct fc_stream;
struct fc_ctx {
    unsigned magic;
    int dev;
    int primary;
    int prim_refs;
    struct fc_stream *dflt;   /* the NULL/legacy/per-thread stream of this context */
    atomic_int sticky;        /* first asynchronous error, returned by every later sync */
    pthread_mutex_t mu;       /* guards pending */
    pthread_cond_t cv;
    long pending;             /* queued ops across this context's streams */
    struct fc_ctx *next;
};

extern struct fc_ctx g_prim[FC_MAX_DEVICES];

/* One GPU: its physical index on the node, UUID, name (cuDeviceGetName: its model; two GPUs
 * of one model have one name) and total memory in bytes (cuDeviceTotalMem). Also the wire form
 * of a device in the restore request. */
struct fc_dev {
    int32_t phys;
    uint32_t flags;           /* 0 (reserved) */
    CUuuid uuid;
    char name[64];
    uint64_t mem;
};

int dev_ok(CUdevice d);
void dev_uuid(int d, CUuuid *u);               /* ordinal d's UUID as this process sees it */
const struct fc_dev *dev_get(int d);           /* ordinal d's entry, or NULL */
void dev_set(int d, const struct fc_dev *nd);  /* ordinal d now names GPU nd (a gpuPairs restore) */
int node_count(void);                          /* the node's GPUs (the kernel-mode view: whatever
                                                * CUDA_VISIBLE_DEVICES says); needs no cuInit */
const struct fc_dev *node_get(int i);          /* node GPU i, or NULL */
void node_set(int i, const struct fc_dev *nd); /* node GPU i is now nd (a gpuPairs restore) */
void uuid_str(const CUuuid *u, char out[41]);  /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
void dev_config(void);                         /* FAKECUDA_DEVICES, CUDA_VISIBLE_DEVICES (cuInit) */
int dev_has_ctx(int d);                        /* a context on ordinal d (g_mu held) */
struct fc_ctx *cur_ctx(void);
void ctx_init(struct fc_ctx *c, int dev, int primary);
int ctx_valid(struct fc_ctx *c);
CUresult ctx_sync(struct fc_ctx *c);

/* ------------------------------------------------------------------ VMM tables (vmm_table.c) */

struct fc_meta {                 /* the trailing metadata page of every allocation memfd */
    char magic[8];
    uint32_t version;
    uint32_t kind;               /* FC_KIND_ALLOCATION or FC_KIND_MULTICAST */
    uint64_t size;
    CUmemAllocationProp prop;
    int32_t device;
    int32_t creator_pid;
    uint64_t object_id;
};

/* A multicast object's team, shared by every process that holds the object: it lives at the
 * start of the object's memfd (metadata page after it), mapped MAP_SHARED, guarded by a
 * process-shared robust mutex. A member is a (pid, device) pair (see docs/fakecuda.md). */
#define FC_MC_MAX_MEMBERS 64
#define FC_MC_MAX_BINDS 512
#define FC_TEAM_MAGIC 0xfc7ea3c1u

struct fc_team_member {
    int32_t pid;
    int32_t dev;
};

struct fc_team_bind {
    int32_t pid, dev;            /* the binding member */
    int32_t fd;                  /* the bound allocation's memfd number in that process */
    uint32_t used;
    uint64_t st_dev, st_ino;     /* ... and its identity (checked before every access) */
    uint64_t mc_off, mem_off, size;
    uint64_t object_id;
};

struct fc_team {
    pthread_mutex_t mu;
    uint32_t magic, num_devices;
    uint64_t size, capacity, handle_types;
    int32_t creator_pid;
    uint32_t nmembers;
    struct fc_team_member members[FC_MC_MAX_MEMBERS];
    struct fc_team_bind binds[FC_MC_MAX_BINDS];
};

struct fc_alloc {
    struct fc_alloc *next, *prev; /* g_allocs (alloc_link) */
    uint64_t block_id;           /* CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID (unique in this process) */
    int fd;                      /* memfd (-1 while checkpointed) */
    dev_t st_dev;
    ino_t st_ino;
    size_t size;
    CUmemAllocationProp prop;
    int device;
    int creator_pid;
    uint64_t object_id;
    int handles;                 /* live handle values referring to it */
    int maps;                    /* mappings of it */
    int binds;                   /* multicast bindings of (or, for a multicast object, into) it */
    int pins;                    /* calls blocked on it (a multicast bind/map waiting for the team) */
    int created_here;            /* counts against device capacity */
    void *saved;                 /* bytes while checkpointed */
    uint32_t kind;               /* FC_KIND_ALLOCATION or FC_KIND_MULTICAST */
    struct fc_team *team;        /* multicast: the shared team state (mapped from the memfd) */
    size_t cs_off;               /* custom storage: offset in its GPU's stream (checkpoint_storage.c) */
};

struct fc_handle {               /* indexed by handle value */
    struct fc_alloc *alloc;
    int refs;                    /* 0: released (stale) */
    int imported;                /* from cuMemImportFromShareableHandle: its properties report
                                  * requestedHandleTypes 0, as the real driver's do (R580,
                                  * docs/gpu-validation.md) */
};

struct fc_map {
    struct fc_map *next, *prev;  /* g_maps, and the VA index (map_link) */
    uintptr_t va;
    size_t size, offset;
    struct fc_alloc *alloc;
    unsigned long long handle;   /* the value passed to cuMemMap */
    uint64_t buffer_id;          /* CU_POINTER_ATTRIBUTE_BUFFER_ID */
    unsigned char *acc;          /* [granule][FC_ACC_SLOTS] CUmemAccess_flags: devices, then the host */
};

/* The access table has one slot per device and one for the host (a HOST or HOST_NUMA location,
 * only for host-located allocations: cuda.h, cuMemSetAccess). */
#define FC_ACC_SLOTS (FC_MAX_DEVICES + 1)
#define FC_ACC_HOST FC_MAX_DEVICES
/* A host-located allocation (cuMemCreate with CU_MEM_LOCATION_TYPE_HOST or _HOST_NUMA) has
 * device -1. */
static inline int prop_is_host(const CUmemAllocationProp *p)
{
    return p->location.type == CU_MEM_LOCATION_TYPE_HOST || p->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA;
}

struct fc_resv {
    struct fc_resv *next;
    uintptr_t va;
    size_t size;
};

struct fc_ipc_page;
struct fc_dmem {                 /* cuMemAlloc memory, and memory opened by cuIpcOpenMemHandle */
    struct fc_dmem *next;
    uintptr_t va;
    size_t size, mapped;         /* bytes asked for; bytes mapped (whole pages) */
    int dev;
    struct fc_ctx *ctx;          /* the context it was allocated (opened) in */
    void *saved;                 /* bytes while checkpointed (the range is then a reservation) */
    int fd;                      /* own buffer: its memfd (mapped + one metadata page); -1 for an
                                  * import and while checkpointed */
    dev_t st_dev;
    ino_t st_ino;                /* the memfd's identity (an import: the exporter's memfd) */
    uint64_t buffer_id;          /* CU_POINTER_ATTRIBUTE_BUFFER_ID */
    int ipc_refs;                /* an import: cuIpcOpenMemHandle count (0: an own buffer) */
    int ipc_pid;                 /* an import: the exporter's pid */
    int ipc_slot;                /* an import: this process's slot in ipc_page->importers */
    struct fc_ipc_page *ipc_page; /* an import: the exporter's metadata page, mapped shared */
    size_t cs_off;               /* custom storage: offset in its GPU's stream (checkpoint_storage.c) */
    int cs_op;                   /* a controller's custom-storage mapping of another process's GPU
                                  * memory (checkpoint_controller.c): cuMemFree refuses it */
    int pool;                    /* a memory pool's arena (pool.c): 1 own, 2 imported; cuMemFree
                                  * and cuIpcGetMemHandle refuse it */
};

/* The trailing page of a cuMemAlloc memfd: the usual metadata (kind FC_KIND_MEMALLOC, size =
 * the mapped bytes, object_id = the exporter's buffer id), then the pids of the processes that
 * hold it open through cuIpcOpenMemHandle (0 = a free slot; each importer claims and clears its
 * own with atomic operations), so that the exporter's native checkpoint can refuse. */
#define FC_IPC_SLOTS 128
struct fc_ipc_page {
    struct fc_meta meta;
    int32_t importers[FC_IPC_SLOTS];
};

/* CUipcMemHandle (64 bytes, CU_IPC_HANDLE_SIZE in cuda.h) as fakecuda fills it: which memfd of
 * which process backs the buffer (the importer opens /proc/<pid>/fd/<fd> and checks the inode). */
#define FC_IPC_MAGIC "FCIPCMH"
struct fc_ipc_wire {
    char magic[8];               /* FC_IPC_MAGIC, NUL-terminated */
    int32_t pid, fd;             /* the exporter and its memfd's number */
    uint64_t st_dev, st_ino;     /* the memfd's identity */
    uint64_t va;                 /* the exporter's base address (informative) */
    uint64_t size;               /* the cuMemAlloc bytesize */
    uint64_t buffer_id;          /* the exporter's CU_POINTER_ATTRIBUTE_BUFFER_ID */
    int32_t device, pad;         /* the exporter's device ordinal */
};
_Static_assert(sizeof(struct fc_ipc_wire) == CU_IPC_HANDLE_SIZE, "CUipcMemHandle is 64 bytes");

struct fc_export {               /* fds handed out by cuMemExportToShareableHandle */
    struct fc_export *next;
    int fd;
    dev_t st_dev;
    ino_t st_ino;
    unsigned long long handle;
    uint64_t object_id;
};

extern struct fc_handle *g_handles;
extern unsigned long long g_nhandles;
extern struct fc_alloc *g_allocs;
extern struct fc_map *g_maps;
extern struct fc_resv *g_resvs;
extern struct fc_dmem *g_dmems;
extern struct fc_export *g_exports;
extern uint64_t g_next_object;
extern uint64_t g_next_buffer;   /* buffer and memory block ids (never reused) */
extern unsigned long long g_used[FC_MAX_DEVICES];

size_t team_len(void);
struct fc_handle *handle_get(unsigned long long h);
int handle_new(struct fc_alloc *a, unsigned long long *out);
struct fc_resv *resv_find(uintptr_t va, size_t size);
struct fc_map *map_find(uintptr_t va);
/* Mappings by VA: g_maps (newest first, for whole-table walks) and a sorted index of the same
 * records for lookups in O(log n) (mappings never overlap, so their start VAs are distinct).
 * map_link adds a new mapping to both (-1: out of memory, nothing added), map_unlink takes it out;
 * map_lower: the index position of the first mapping starting at or above va, map_count and
 * map_at walk the index; map_overlapping: the lowest mapping overlapping [va, va+len), or NULL;
 * map_touches: whether one of `kind` (FC_KIND_*) does. alloc_link adds to g_allocs (the unlink is
 * alloc_maybe_free's, O(1)). */
int map_link(struct fc_map *m);
void map_unlink(struct fc_map *m);
size_t map_lower(uintptr_t va);
size_t map_count(void);
struct fc_map *map_at(size_t i);
struct fc_map *map_overlapping(uintptr_t va, size_t len);
int map_touches(uintptr_t va, size_t len, uint32_t kind);
void alloc_link(struct fc_alloc *a);
struct fc_dmem *dmem_find(uintptr_t va);
void alloc_maybe_free(struct fc_alloc *a);
uint64_t alloc_extent(const struct fc_alloc *a);
int write_meta(int fd, const struct fc_alloc *a);
int new_memfd(size_t size);
void map_apply_prot(const struct fc_map *m);
int make_reserved(uintptr_t va, size_t size);
CUresult dev_check(uintptr_t va, size_t len, int dev, int write);
int dmem_back(struct fc_dmem *d, uintptr_t fixed);
int dmem_importers(const struct fc_dmem *d, int *first_pid);
void team_lock(struct fc_team *t);
void team_unlock(struct fc_team *t);

/* ------------------------------------------------------------------ copy engine (copy.c) */

enum { PTR_HOST = 0, PTR_DEVICE = 1, PTR_UNIFIED = 2 };
/* OP_HOSTFN: the stream worker calls fn(arg, ctx) in stream order (event records and waits,
 * event.c; pool frees, pool.c); fn owns arg and returns the op's CUresult. */
enum { OP_COPY, OP_SET8, OP_SET16, OP_SET32, OP_WAIT32, OP_WRITE32, OP_WAIT64, OP_WRITE64, OP_HOSTFN };

struct fc_op {
    struct fc_op *next;
    int kind;
    uintptr_t dst, src;
    int dkind, skind;
    size_t n;
    uint64_t val;
    unsigned flags;
    CUresult (*fn)(void *arg, struct fc_ctx *c); /* OP_HOSTFN */
    void *arg;
};

/* At enqueue: is a pointer passed as device memory device memory at all? */
CUresult precheck(uintptr_t p, int kind);
CUresult precheck_copy(uintptr_t p, int kind);
CUresult op_exec(const struct fc_op *op, struct fc_ctx *c); /* run by (the device of) context c */

/* ------------------------------------------------------------------ streams (stream.c) */

CUresult stream_enqueue(CUstream hs, const struct fc_op *tmpl);
CUresult stream_create_in(struct fc_ctx *c, CUstream *out); /* a stream of context c (g_mu not held) */
CUresult stream_release(CUstream hs);                       /* cuStreamDestroy's body */
CUresult stream_sync(CUstream hs, int query);
CUresult sync_op(const struct fc_op *op);
CUresult stream_ctx(CUstream hs, struct fc_ctx **out);      /* the stream's context (g_mu not held) */

/* ------------------------------------------------------------------ peer access (peer.c) */

/* Legacy (cuMemAlloc, IPC-opened) memory at p accessed on the device by context c: its own
 * device, the device it was opened on, or a context c enabled peer access to (g_mu held).
 * CUDA_SUCCESS or CUDA_ERROR_ILLEGAL_ADDRESS; NOT_FOUND when p is no legacy memory. */
CUresult peer_legacy_check(uintptr_t p, struct fc_ctx *c);

/* ------------------------------------------------------------------ events (event.c) */

CUresult event_ck_refusal(void);  /* checkpoint: IPC events held (g_mu held); CUDA_SUCCESS when none */

/* ------------------------------------------------------------------ host memory (memory.c) */

int hostmem_find(uintptr_t p, uintptr_t *va, size_t *size, struct fc_ctx **ctx, uint64_t *buffer_id);
CUresult hostmem_ck_refusal(void); /* checkpoint: a registration over a shared file mapping (g_mu held) */

/* ------------------------------------------------------------------ pools (pool.c) */

CUresult pool_ck_refusal(void);   /* checkpoint: a pool shared by IPC (g_mu held); CUDA_SUCCESS when none */

/* ------------------------------------------------------------------ multicast (multicast.c) */

CUresult mc_wait_handle(CUmemGenericAllocationHandle h, uintptr_t va, uint64_t off, uint64_t size, const char *what);

/* ------------------------------------------------------------------ checkpoint control protocol */
/* The target (checkpoint_target.c) serves the abstract socket "\0fakecuda-<pid>" (ck_addr)
 * (SOCK_SEQPACKET, one request per connection); the controller (checkpoint_controller.c)
 * connects to it. */

enum { CK_GETSTATE = 1, CK_LOCK, CK_CHECKPOINT, CK_RESTORE, CK_UNLOCK, CK_GETTID, CK_COMPLETE, CK_ABORT };

struct ck_req {
    uint32_t magic;
    uint32_t op;
    uint32_t timeout_ms;
    uint32_t flags;              /* CK_F_CUSTOM on CK_CHECKPOINT / CK_RESTORE */
};
#define CK_F_CUSTOM 1u
struct ck_rep {
    int32_t result;
    int32_t value;
};
#define CK_MAGIC 0xfcc4ec01u

/* CK_RESTORE carries more: the gpuPairs (each old UUID with the controller's entry for the new
 * one) and the node's GPUs as the controller's driver knows them (its FAKECUDA_DEVICES, not
 * narrowed by its CUDA_VISIBLE_DEVICES: the kernel-mode driver's view). */
struct ck_gpu_pair {
    CUuuid old_uuid;
    struct fc_dev new_dev;
};
struct ck_restore_req {
    struct ck_req hdr;
    uint32_t npairs, npresent;
    struct ck_gpu_pair pairs[FC_MAX_DEVICES];
    struct fc_dev present[FC_MAX_DEVICES];
};

/* Custom storage (cuda.h 13.4+: customStorageInfo_out). A CK_CHECKPOINT or CK_RESTORE with
 * CK_F_CUSTOM is answered with ck_cs_rep and, in one SCM_RIGHTS message, one memfd per GPU
 * holding data (dev[i] <-> fd i): the GPU's memory laid out contiguously (checkpoint), or a
 * zeroed region of the same layout for the controller to fill (restore). The connection stays
 * open: the controller sends CK_COMPLETE (or CK_ABORT) on it and reads one ck_rep. Its closing
 * before that (the controller died) abandons the operation (checkpoint_storage.c). */
struct ck_cs_dev {
    int32_t ordinal;             /* the target's ordinal */
    uint32_t pad;
    CUuuid uuid;                 /* the GPU (a restore: the one it is restored onto) */
    uint64_t size;               /* bytes of the stream */
};
struct ck_cs_rep {
    struct ck_rep rep;
    uint32_t ndev, pad;
    struct ck_cs_dev dev[FC_MAX_DEVICES];
};

/* Where a restore puts the process: ord[d] the GPU of each ordinal, node[i] of each node entry
 * (node_get), nmoved the ordinals that move onto another GPU. */
struct ck_placement {
    struct fc_dev ord[FC_MAX_DEVICES];
    struct fc_dev node[FC_MAX_DEVICES];
    int nmoved;
};

/* Target side (checkpoint_checks.c, g_mu held): refusals; restore placement. */
CUresult ck_refusals(void);
CUresult ck_place(const struct ck_restore_req *rq, struct ck_placement *pl);

/* Target side (checkpoint_storage.c; g_mu held for begin/complete). */
CUresult cs_begin(int restore, const struct fc_dev *to, struct ck_cs_rep *rep, int *fds); /* the streams */
const unsigned char *cs_src(int dev, size_t off, size_t n);        /* restore: bytes staged for dev */
void cs_end(void);                                                 /* close and unmap the staging */
int cs_pending(void);                                              /* 1 while a checkpoint's bytes
                                                                    * are only in custom storage */
void cs_set_pending(int on);
int cs_staged(void);                                               /* the streams hold bytes */
int cs_host_bytes(void);                                           /* a host checkpoint saved GPU
                                                                    * memory here */

static inline socklen_t ck_addr(struct sockaddr_un *a, int pid)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "fakecuda-%d", pid);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* Bind the control socket and start the control thread (cuInit, once). */
void ckpt_start(void);

#pragma GCC visibility pop

#endif /* FAKECUDA_FC_H */
