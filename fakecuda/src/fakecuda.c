/*
 * fakecuda: a CPU-backed libcuda.so.1 (see docs/fakecuda.md).
 *
 * Device memory is host memory. cuMemCreate = memfd (+ trailing metadata page),
 * cuMemAddressReserve = PROT_NONE reservation, cuMemMap = MAP_SHARED|MAP_FIXED of the
 * memfd, cuMemSetAccess = mprotect. Streams are worker threads. cuCheckpointProcess*
 * talk to a control thread in the target process over an abstract Unix socket.
 *
 * Multicast objects are memfds too: their team state (members, bindings) lives in the
 * memfd, shared by every importer; writes through a multicast VA are broadcast by the copy
 * engine to every bound member's memfd (opened through /proc/<pid>/fd/<fd>).
 *
 * Sections: globals/config/log, entry gate, devices, contexts, VMM tables, copy engine
 * (with multicast broadcast), streams, memory API, VMM API, multicast API, stream memops,
 * checkpoint (target + controller), cuGetProcAddress table.
 */
#define _GNU_SOURCE
#define __CUDA_API_VERSION_INTERNAL 1 /* declare every ELF spelling (v1, _v2, _ptds, _ptsz) */
#pragma GCC visibility push(default)
#include <cuda.h>
#pragma GCC visibility pop

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
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
#define FC_DRIVER_VERSION 13010
#define FC_MAX_DEVICES 16
#define FC_META_MAGIC "FAKECUDA"
#define FC_META_VERSION 1u
#define FC_KIND_ALLOCATION 1u
#define FC_KIND_MULTICAST 2u
#define FC_SHIM_TAG 0xC01Eull

/* ------------------------------------------------------------------ globals, config, log */

static atomic_int g_inited;
static pthread_mutex_t g_init_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_ndev = 2;
static size_t g_gran = 2u << 20;
static size_t g_page = 4096;
static unsigned long long g_totalmem = 16ull << 30;
static int g_logfd = -1;
enum { HINT_HONOR, HINT_IGNORE, HINT_FAIL };
static int g_hint_mode = HINT_HONOR; /* FAKECUDA_RESERVE_HINT */
static unsigned long long g_mc_watchdog_ms = 10000; /* FAKECUDA_MULTICAST_WATCHDOG_MS (0: wait forever) */
static unsigned long long g_mc_rounding;           /* FAKECUDA_MULTICAST_CAPACITY_ROUNDING (0: none) */

static pid_t fc_tid(void) { return (pid_t)syscall(SYS_gettid); }

static const char *fc_errname(CUresult r)
{
    switch ((int)r) {
#define X(n) case n: return #n;
#include "fc_errors.inc"
#undef X
    default: return NULL;
    }
}

static void fc_logline(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fc_logline(const char *fmt, ...)
{
    if (g_logfd < 0)
        return;
    char buf[1024];
    int n = snprintf(buf, sizeof buf, "%d %d ", (int)getpid(), (int)fc_tid());
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0)
        return;
    n += m;
    if (n > (int)sizeof buf - 2)
        n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(g_logfd, buf, (size_t)n);
    (void)w;
}

/* A loud line: stderr and the call log. */
static void fc_loud(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fc_loud(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fakecuda[%d]: %s\n", (int)getpid(), buf);
    fc_logline("fakecuda: %s", buf);
}

static void fc_log_call(const char *fn, CUresult r, const char *fmt, ...)
{
    if (g_logfd < 0)
        return;
    char args[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    const char *name = fc_errname(r);
    if (name)
        fc_logline("%s(%s) = %s", fn, args, name);
    else
        fc_logline("%s(%s) = %d", fn, args, (int)r);
}

static unsigned long long env_ull(const char *name, unsigned long long dflt)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return dflt;
    char *end;
    unsigned long long v = strtoull(s, &end, 0);
    return *end ? dflt : v;
}

/* A child forked after cuInit cannot use the driver (as on the real driver): every call,
 * cuInit included, returns CUDA_ERROR_NOT_INITIALIZED there. */
static int g_forked_child;
static int g_ck_listen = -1; /* the checkpoint control socket (see Checkpoint) */
static void fc_atfork_child(void)
{
    if (atomic_load(&g_inited)) {
        g_forked_child = 1;
        atomic_store(&g_inited, 0);
    }
    if (g_ck_listen >= 0) { /* the parent's control socket is not the child's to hold */
        close(g_ck_listen);
        g_ck_listen = -1;
    }
}

/* Read before cuInit so that lookups and pre-init errors are logged too. */
__attribute__((constructor)) static void fc_load(void)
{
    pthread_atfork(NULL, NULL, fc_atfork_child);
    const char *log = getenv("FAKECUDA_LOG");
    if (log && *log)
        g_logfd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    long pg = sysconf(_SC_PAGESIZE);
    if (pg > 0)
        g_page = (size_t)pg;
    g_ndev = (int)env_ull("FAKECUDA_DEVICE_COUNT", 2);
    if (g_ndev < 0)
        g_ndev = 0;
    if (g_ndev > FC_MAX_DEVICES)
        g_ndev = FC_MAX_DEVICES;
    g_gran = (size_t)env_ull("FAKECUDA_GRANULARITY", 2u << 20);
    if (g_gran < g_page || (g_gran & (g_gran - 1)))
        g_gran = 2u << 20;
    g_totalmem = env_ull("FAKECUDA_TOTAL_MEM", 16ull << 30);
    g_mc_watchdog_ms = env_ull("FAKECUDA_MULTICAST_WATCHDOG_MS", 10000);
    g_mc_rounding = env_ull("FAKECUDA_MULTICAST_CAPACITY_ROUNDING", 0);
    if (g_mc_rounding % g_gran) /* a capacity is always a multiple of the granularity */
        g_mc_rounding += g_gran - g_mc_rounding % g_gran;
    const char *hint = getenv("FAKECUDA_RESERVE_HINT");
    if (hint && !strcmp(hint, "ignore"))
        g_hint_mode = HINT_IGNORE;
    else if (hint && !strcmp(hint, "fail"))
        g_hint_mode = HINT_FAIL;
}

/* ------------------------------------------------------------------ entry gate */
/* Every gated API increments `inflight` while it runs. cuCheckpointProcessLock closes the
 * gate (new calls block), then waits for inflight == 0 and pending stream ops == 0. */

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int closed;       /* set by Lock; new calls park */
    atomic_long inflight;    /* gated calls running now */
    long pending_ops;        /* queued stream ops (under mu) */
} g_gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0};

/* Fast path: one atomic increment and one load (seq_cst on both sides: the locker stores
 * `closed` then reads `inflight`, an entrant increments `inflight` then reads `closed`, so at
 * least one sees the other). Slow path, only while locked: park on the condition variable. */
static CUresult api_enter(void)
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

static void api_leave(void)
{
    if (atomic_fetch_sub(&g_gate.inflight, 1) == 1 && atomic_load(&g_gate.closed)) {
        pthread_mutex_lock(&g_gate.mu);
        pthread_cond_broadcast(&g_gate.cv);
        pthread_mutex_unlock(&g_gate.mu);
    }
}

static CUresult api_initonly(void)
{
    return atomic_load_explicit(&g_inited, memory_order_acquire) ? CUDA_SUCCESS
                                                                 : CUDA_ERROR_NOT_INITIALIZED;
}

/* Gated API body: run `call` inside the gate, log, return. */
#define API(call, fmt, ...)                                                  \
    do {                                                                     \
        CUresult r_ = api_enter();                                           \
        if (r_ == CUDA_SUCCESS) {                                            \
            r_ = (call);                                                     \
            api_leave();                                                     \
        }                                                                    \
        fc_log_call(__func__, r_, fmt, ##__VA_ARGS__);                       \
        return r_;                                                           \
    } while (0)

/* Ungated API (needs cuInit only unless `needinit` is 0). */
#define API_NOGATE(needinit, call, fmt, ...)                                 \
    do {                                                                     \
        CUresult r_ = (needinit) ? api_initonly() : CUDA_SUCCESS;            \
        if (r_ == CUDA_SUCCESS)                                              \
            r_ = (call);                                                     \
        fc_log_call(__func__, r_, fmt, ##__VA_ARGS__);                       \
        return r_;                                                           \
    } while (0)

/* Output arguments are logged only when the call succeeded (r_ is the API macro's result). */
#define OUT64(p) ((r_ == CUDA_SUCCESS && (p)) ? (unsigned long long)*(p) : 0ull)
#define OUTI(p) ((r_ == CUDA_SUCCESS && (p)) ? (int)*(p) : -1)

/* One mutex for every table (contexts, streams, reservations, allocations, mappings). */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

/* ------------------------------------------------------------------ devices */

static int dev_ok(CUdevice d) { return d >= 0 && d < g_ndev; }

static void dev_uuid(int d, CUuuid *u)
{
    static const char base[16] = "fakecudaGPU-uuid";
    memcpy(u->bytes, base, 16);
    u->bytes[15] = (char)d;
    u->bytes[14] = (char)(d >> 8);
}

static int dev_attr(CUdevice_attribute a)
{
    switch ((int)a) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: return 64;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: return 2147483647;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: return 65535;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: return 65535;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: return 32;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return 132;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return 9;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return 0;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: return 1;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: return 0;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: return 0;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1: return 1;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1: return 1;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1: return 1;
    case CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES: return 0;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS: return 1;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR: return 1;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: return 0;
    case CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: return 0;
    case CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: return 0;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: return 0;
    default: return 0;
    }
}

/* ------------------------------------------------------------------ contexts */

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

static struct fc_ctx g_prim[FC_MAX_DEVICES];
static struct fc_ctx *g_ctxs;           /* every context, primary or created (never freed) */

static __thread struct fc_ctx *tls_ctxstack[32];
static __thread int tls_ctxdepth;

static struct fc_ctx *cur_ctx(void) { return tls_ctxdepth ? tls_ctxstack[tls_ctxdepth - 1] : NULL; }

static void set_cur_ctx(struct fc_ctx *c)
{
    if (tls_ctxdepth == 0)
        tls_ctxdepth = 1;
    tls_ctxstack[tls_ctxdepth - 1] = c;
}

static void ctx_init(struct fc_ctx *c, int dev, int primary)
{
    c->magic = FC_CTX_MAGIC;
    c->dev = dev;
    c->primary = primary;
    c->prim_refs = 0;
    c->dflt = NULL;
    atomic_init(&c->sticky, 0);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->pending = 0;
    c->next = g_ctxs;
    g_ctxs = c;
}

static int ctx_valid(struct fc_ctx *c)
{
    for (struct fc_ctx *p = g_ctxs; p; p = p->next)
        if (p == c)
            return p->magic == FC_CTX_MAGIC;
    return 0;
}

/* ------------------------------------------------------------------ VMM tables */

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

static size_t team_len(void) { return (sizeof(struct fc_team) + g_page - 1) & ~(g_page - 1); }

struct fc_alloc {
    struct fc_alloc *next;
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
};

struct fc_handle {               /* indexed by handle value */
    struct fc_alloc *alloc;
    int refs;                    /* 0: released (stale) */
};

struct fc_map {
    struct fc_map *next;
    uintptr_t va;
    size_t size, offset;
    struct fc_alloc *alloc;
    unsigned long long handle;   /* the value passed to cuMemMap */
    unsigned char *acc;          /* [granule][device] CUmemAccess_flags */
};

struct fc_resv {
    struct fc_resv *next;
    uintptr_t va;
    size_t size;
};

struct fc_dmem {                 /* cuMemAlloc memory */
    struct fc_dmem *next;
    uintptr_t va;
    size_t size, mapped;
    int dev;
    void *saved;                 /* bytes while checkpointed (the range is then a reservation) */
};

struct fc_export {               /* fds handed out by cuMemExportToShareableHandle */
    struct fc_export *next;
    int fd;
    dev_t st_dev;
    ino_t st_ino;
    unsigned long long handle;
    uint64_t object_id;
};

static struct fc_handle *g_handles;
static unsigned long long g_nhandles, g_caphandles;
static struct fc_alloc *g_allocs;
static struct fc_map *g_maps;
static struct fc_resv *g_resvs;
static struct fc_dmem *g_dmems;
static struct fc_export *g_exports;
static uint64_t g_next_object = 1;
static unsigned long long g_used[FC_MAX_DEVICES];

static struct fc_handle *handle_get(unsigned long long h)
{
    if (h >= g_nhandles || g_handles[h].refs <= 0)
        return NULL;
    return &g_handles[h];
}

static int handle_new(struct fc_alloc *a, unsigned long long *out)
{
    unsigned long long v = g_nhandles;
    if ((v >> 48) == FC_SHIM_TAG)
        return -1; /* never hand out the shim's virtual tag (2^62 values away) */
    if (g_nhandles == g_caphandles) {
        unsigned long long cap = g_caphandles ? g_caphandles * 2 : 64;
        struct fc_handle *n = realloc(g_handles, cap * sizeof *n);
        if (!n)
            return -1;
        g_handles = n;
        g_caphandles = cap;
    }
    g_handles[v].alloc = a;
    g_handles[v].refs = 1;
    g_nhandles++;
    a->handles++;
    *out = v;
    return 0;
}

static struct fc_resv *resv_find(uintptr_t va, size_t size)
{
    for (struct fc_resv *r = g_resvs; r; r = r->next)
        if (va >= r->va && va - r->va < r->size)
            return (size <= r->size - (va - r->va)) ? r : NULL;
    return NULL;
}

static struct fc_map *map_find(uintptr_t va)
{
    for (struct fc_map *m = g_maps; m; m = m->next)
        if (va >= m->va && va - m->va < m->size)
            return m;
    return NULL;
}

static struct fc_dmem *dmem_find(uintptr_t va)
{
    for (struct fc_dmem *d = g_dmems; d; d = d->next)
        if (va >= d->va && va - d->va < d->size)
            return d;
    return NULL;
}

static void alloc_maybe_free(struct fc_alloc *a)
{
    if (a->handles > 0 || a->maps > 0 || a->binds > 0 || a->pins > 0)
        return;
    struct fc_alloc **pp = &g_allocs;
    while (*pp && *pp != a)
        pp = &(*pp)->next;
    if (*pp)
        *pp = a->next;
    if (a->created_here && a->device >= 0 && a->device < FC_MAX_DEVICES)
        g_used[a->device] -= a->size;
    if (a->fd >= 0)
        close(a->fd);
    if (a->team)
        munmap(a->team, team_len());
    free(a->saved);
    free(a);
}

static int write_meta(int fd, const struct fc_alloc *a)
{
    struct fc_meta m;
    memset(&m, 0, sizeof m);
    memcpy(m.magic, FC_META_MAGIC, 8);
    m.version = FC_META_VERSION;
    m.kind = a->kind;
    m.size = a->size;
    m.prop = a->prop;
    m.device = a->device;
    m.creator_pid = a->creator_pid;
    m.object_id = a->object_id;
    return pwrite(fd, &m, sizeof m, (off_t)a->size) == (ssize_t)sizeof m ? 0 : -1;
}

/* New memfd of `size` bytes plus the metadata page. */
static int new_memfd(size_t size)
{
    int fd = memfd_create("fakecuda-allocation", MFD_CLOEXEC);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)(size + g_page)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int prot_of(const struct fc_map *m, size_t g)
{
    int prot = PROT_NONE;
    for (int d = 0; d < g_ndev; d++) {
        unsigned char f = m->acc[g * FC_MAX_DEVICES + (size_t)d];
        if (f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return PROT_READ | PROT_WRITE;
        if (f == CU_MEM_ACCESS_FLAGS_PROT_READ)
            prot = PROT_READ;
    }
    return prot;
}

static void map_apply_prot(const struct fc_map *m)
{
    if (m->alloc->kind == FC_KIND_MULTICAST)
        return; /* a multicast VA stays PROT_NONE: a host store there would reach no member */
    for (size_t g = 0; g < m->size / g_gran; g++)
        mprotect((void *)(m->va + g * g_gran), g_gran, prot_of(m, g));
}

/* Turn [va, va+size) back into a PROT_NONE reservation (never plain munmap). */
static int make_reserved(uintptr_t va, size_t size)
{
    void *p = mmap((void *)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                   -1, 0);
    return p == MAP_FAILED ? -1 : 0;
}

/* Device access check for [va, va+len) from device `dev`. Returns CUDA_SUCCESS,
 * CUDA_ERROR_ILLEGAL_ADDRESS, or CUDA_ERROR_NOT_FOUND when va is not device memory. Call
 * with g_mu held. */
static CUresult dev_check(uintptr_t va, size_t len, int dev, int write)
{
    if (len == 0)
        len = 1;
    struct fc_dmem *d = dmem_find(va);
    if (d)
        return len <= d->size - (va - d->va) ? CUDA_SUCCESS : CUDA_ERROR_ILLEGAL_ADDRESS;
    struct fc_resv *r = NULL;
    for (struct fc_resv *p = g_resvs; p; p = p->next)
        if (va >= p->va && va - p->va < p->size)
            r = p;
    if (!r)
        return CUDA_ERROR_NOT_FOUND;
    if (len > r->size - (va - r->va))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    uintptr_t end = va + len;
    for (uintptr_t p = va; p < end;) {
        struct fc_map *m = map_find(p);
        if (!m)
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        size_t g = (p - m->va) / g_gran;
        unsigned char f = (dev >= 0 && dev < g_ndev) ? m->acc[g * FC_MAX_DEVICES + (size_t)dev] : 0;
        if (write ? f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE : f == CU_MEM_ACCESS_FLAGS_PROT_NONE)
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        p = m->va + (g + 1) * g_gran;
    }
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ copy engine */

enum { PTR_HOST = 0, PTR_DEVICE = 1, PTR_UNIFIED = 2 };
enum { OP_COPY, OP_SET8, OP_SET16, OP_SET32, OP_WAIT32, OP_WRITE32, OP_WAIT64, OP_WRITE64 };

struct fc_op {
    struct fc_op *next;
    int kind;
    uintptr_t dst, src;
    int dkind, skind;
    size_t n;
    uint64_t val;
    unsigned flags;
};

/* Classify one side; CUDA_SUCCESS means OK to touch. */
static CUresult side_check(uintptr_t p, size_t n, int kind, int dev, int write)
{
    if (kind == PTR_HOST)
        return CUDA_SUCCESS;
    CUresult r = dev_check(p, n, dev, write);
    if (r == CUDA_ERROR_NOT_FOUND)
        return kind == PTR_UNIFIED ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    return r;
}

/* At enqueue: a pointer passed as device memory must lie in device memory at all
 * (CUDA_ERROR_INVALID_VALUE now); access is checked when the op runs. */
static CUresult precheck(uintptr_t p, int kind)
{
    if (kind != PTR_DEVICE)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    CUresult r = dev_check(p, 1, -1, 0);
    pthread_mutex_unlock(&g_mu);
    return r == CUDA_ERROR_NOT_FOUND ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

static int wait_done(uint64_t cur, uint64_t ref, unsigned flags, int is64)
{
    switch (flags & ~(unsigned)CU_STREAM_WAIT_VALUE_FLUSH) {
    case CU_STREAM_WAIT_VALUE_GEQ:
        return is64 ? (int64_t)(cur - ref) >= 0 : (int32_t)((uint32_t)cur - (uint32_t)ref) >= 0;
    case CU_STREAM_WAIT_VALUE_EQ: return cur == ref;
    case CU_STREAM_WAIT_VALUE_AND: return (cur & ref) != 0;
    case CU_STREAM_WAIT_VALUE_NOR: return is64 ? ~(cur | ref) != 0 : (uint32_t)~(cur | ref) != 0;
    }
    return 1;
}

/* ---- multicast in the copy engine: writes through a multicast VA go to every bound member
 * (in every process); reads through one are refused (see docs/fakecuda.md). */

static void team_lock(struct fc_team *t)
{
    if (pthread_mutex_lock(&t->mu) == EOWNERDEAD) /* a holder died: the table itself is consistent */
        pthread_mutex_consistent(&t->mu);
}

static void team_unlock(struct fc_team *t) { pthread_mutex_unlock(&t->mu); }

/* Does [va, va+len) touch a multicast mapping? (g_mu held) */
static int mc_overlaps(uintptr_t va, size_t len)
{
    for (struct fc_map *m = g_maps; m; m = m->next)
        if (m->alloc->kind == FC_KIND_MULTICAST && m->va < va + len && va < m->va + m->size)
            return 1;
    return 0;
}

static CUresult mc_read_refused(uintptr_t va, size_t len)
{
    fc_loud("read of %zu bytes through multicast VA 0x%" PRIxPTR " refused -> CUDA_ERROR_ILLEGAL_ADDRESS "
            "(plain loads of a multicast address are undefined on the real driver; read a member)",
            len, va);
    return CUDA_ERROR_ILLEGAL_ADDRESS;
}

/* Write bytes [opoff, opoff+n) of what `op` writes at its destination to `t`. */
static void op_apply(const struct fc_op *op, unsigned char *t, size_t opoff, size_t n)
{
    switch (op->kind) {
    case OP_COPY: memmove(t, (const unsigned char *)op->src + opoff, n); break;
    case OP_SET8: memset(t, (int)(op->val & 0xff), n); break;
    case OP_SET16:
        for (size_t i = 0; i < n / 2; i++) ((uint16_t *)(void *)t)[i] = (uint16_t)op->val;
        break;
    case OP_SET32:
        for (size_t i = 0; i < n / 4; i++) ((uint32_t *)(void *)t)[i] = (uint32_t)op->val;
        break;
    case OP_WRITE32: __atomic_store_n((uint32_t *)(void *)t, (uint32_t)op->val, __ATOMIC_SEQ_CST); break;
    case OP_WRITE64: __atomic_store_n((uint64_t *)(void *)t, (uint64_t)op->val, __ATOMIC_SEQ_CST); break;
    }
}

/* Write [mc_off, mc_off+n) of multicast object `mc`: every member whose binding covers a byte
 * receives it, through its memfd (opened from /proc/<pid>/fd/<fd> and checked by inode; a
 * binding whose process exited is dropped first). Every granule must have at least one member
 * bound, else nothing is written and the write is an illegal address. (g_mu held; takes the
 * team lock.) */
static CUresult mc_broadcast(struct fc_alloc *mc, uint64_t mc_off, const struct fc_op *op, size_t opoff, size_t n)
{
    struct fc_team *t = mc->team;
    CUresult r = CUDA_SUCCESS;
    int fds[FC_MC_MAX_BINDS];
    team_lock(t);
    for (int i = 0; i < FC_MC_MAX_BINDS; i++) {
        struct fc_team_bind *b = &t->binds[i];
        fds[i] = -1;
        if (!b->used || b->mc_off >= mc_off + n || mc_off >= b->mc_off + b->size)
            continue;
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)b->pid, (int)b->fd);
        int fd = open(path, O_RDWR | O_CLOEXEC);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0 || (uint64_t)st.st_dev != b->st_dev || (uint64_t)st.st_ino != b->st_ino) {
            /* the binder exited (a live binder keeps the bound memfd open): its binding went
             * with it, as on the real driver */
            fc_logline("fakecuda: multicast object %" PRIu64 ": member (pid %d, device %d) is gone; "
                       "its binding is dropped", mc->object_id, (int)b->pid, (int)b->dev);
            if (fd >= 0)
                close(fd);
            memset(b, 0, sizeof *b);
            continue;
        }
        fds[i] = fd;
    }
    for (uint64_t g = mc_off & ~(uint64_t)(g_gran - 1); g < mc_off + n && r == CUDA_SUCCESS; g += g_gran) {
        int covered = 0;
        for (int i = 0; i < FC_MC_MAX_BINDS && !covered; i++)
            covered = fds[i] >= 0 && g >= t->binds[i].mc_off && g - t->binds[i].mc_off < t->binds[i].size;
        if (!covered) {
            fc_loud("write through multicast object %" PRIu64 " at offset 0x%" PRIx64
                    " where no member is bound -> CUDA_ERROR_ILLEGAL_ADDRESS", mc->object_id, g);
            r = CUDA_ERROR_ILLEGAL_ADDRESS;
        }
    }
    for (int i = 0; i < FC_MC_MAX_BINDS; i++) {
        if (fds[i] < 0)
            continue;
        const struct fc_team_bind *b = &t->binds[i];
        uint64_t lo = mc_off > b->mc_off ? mc_off : b->mc_off;
        uint64_t hi = mc_off + n < b->mc_off + b->size ? mc_off + n : b->mc_off + b->size;
        uint64_t moff = b->mem_off + (lo - b->mc_off);
        uint64_t pgoff = moff & ~(uint64_t)(g_page - 1);
        size_t len = (size_t)(moff - pgoff + (hi - lo));
        void *w = r == CUDA_SUCCESS ? mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fds[i], (off_t)pgoff)
                                    : MAP_FAILED;
        close(fds[i]);
        if (w == MAP_FAILED) {
            if (r == CUDA_SUCCESS)
                r = CUDA_ERROR_OUT_OF_MEMORY;
            continue;
        }
        op_apply(op, (unsigned char *)w + (moff - pgoff), opoff + (size_t)(lo - mc_off), (size_t)(hi - lo));
        munmap(w, len);
    }
    team_unlock(t);
    return r;
}

/* The destination write of `op` ([dst, dst+dlen) passed the access check) when it touches a
 * multicast mapping: unicast pieces are written in place, multicast pieces broadcast. */
static CUresult mc_write(const struct fc_op *op, size_t dlen)
{
    uintptr_t p = op->dst, end = op->dst + dlen;
    while (p < end) {
        struct fc_map *m = map_find(p);
        if (!m)
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        uintptr_t seg_end = m->va + m->size < end ? m->va + m->size : end;
        if (m->alloc->kind == FC_KIND_MULTICAST) {
            CUresult r = mc_broadcast(m->alloc, m->offset + (p - m->va), op, p - op->dst, seg_end - p);
            if (r != CUDA_SUCCESS)
                return r;
        } else {
            op_apply(op, (unsigned char *)p, p - op->dst, seg_end - p);
        }
        p = seg_end;
    }
    return CUDA_SUCCESS;
}

/* Execute one op (stream worker or synchronous caller) from device `dev`. */
static CUresult op_exec(const struct fc_op *op, int dev)
{
    CUresult r;
    if (op->kind == OP_WAIT32 || op->kind == OP_WAIT64) {
        int is64 = op->kind == OP_WAIT64;
        unsigned sleep_ns = 20000;
        for (;;) {
            pthread_mutex_lock(&g_mu);
            r = side_check(op->dst, is64 ? 8 : 4, PTR_DEVICE, dev, 0);
            if (r == CUDA_SUCCESS && mc_overlaps(op->dst, is64 ? 8 : 4))
                r = mc_read_refused(op->dst, is64 ? 8 : 4);
            uint64_t cur = 0;
            if (r == CUDA_SUCCESS)
                cur = is64 ? __atomic_load_n((uint64_t *)op->dst, __ATOMIC_ACQUIRE)
                           : __atomic_load_n((uint32_t *)op->dst, __ATOMIC_ACQUIRE);
            pthread_mutex_unlock(&g_mu);
            if (r != CUDA_SUCCESS)
                return r == CUDA_ERROR_INVALID_VALUE ? CUDA_ERROR_ILLEGAL_ADDRESS : r;
            if (wait_done(cur, op->val, op->flags, is64))
                return CUDA_SUCCESS;
            struct timespec ts = {0, (long)sleep_ns};
            nanosleep(&ts, NULL);
            if (sleep_ns < 1000000)
                sleep_ns *= 2;
        }
    }
    pthread_mutex_lock(&g_mu);
    size_t dlen = op->n;
    if (op->kind == OP_SET16) dlen = op->n * 2;
    if (op->kind == OP_SET32) dlen = op->n * 4;
    if (op->kind == OP_WRITE32) dlen = 4;
    if (op->kind == OP_WRITE64) dlen = 8;
    r = side_check(op->dst, dlen, op->dkind, dev, 1);
    if (r == CUDA_SUCCESS && op->kind == OP_COPY)
        r = side_check(op->src, op->n, op->skind, dev, 0);
    if (r == CUDA_SUCCESS && op->kind == OP_COPY && op->skind != PTR_HOST && mc_overlaps(op->src, op->n))
        r = mc_read_refused(op->src, op->n);
    if (r == CUDA_SUCCESS && op->dkind != PTR_HOST && mc_overlaps(op->dst, dlen)) {
        r = mc_write(op, dlen);
    } else if (r == CUDA_SUCCESS) {
        switch (op->kind) {
        case OP_COPY: memmove((void *)op->dst, (const void *)op->src, op->n); break;
        case OP_SET8: memset((void *)op->dst, (int)(op->val & 0xff), op->n); break;
        case OP_SET16:
            for (size_t i = 0; i < op->n; i++) ((uint16_t *)op->dst)[i] = (uint16_t)op->val;
            break;
        case OP_SET32:
            for (size_t i = 0; i < op->n; i++) ((uint32_t *)op->dst)[i] = (uint32_t)op->val;
            break;
        case OP_WRITE32:
            __atomic_store_n((uint32_t *)op->dst, (uint32_t)op->val, __ATOMIC_SEQ_CST);
            break;
        case OP_WRITE64:
            __atomic_store_n((uint64_t *)op->dst, (uint64_t)op->val, __ATOMIC_SEQ_CST);
            break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* ------------------------------------------------------------------ streams */

#define FC_STREAM_MAGIC 0xfc57eau

struct fc_stream {
    unsigned magic;
    struct fc_ctx *ctx;
    unsigned flags;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct fc_op *head, *tail;
    long pending;
    int dying;
    pthread_t thr;
    struct fc_stream *next;       /* g_streams */
};

static struct fc_stream *g_streams;

static void pending_done(struct fc_ctx *c)
{
    pthread_mutex_lock(&c->mu);
    if (--c->pending == 0)
        pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_lock(&g_gate.mu);
    if (--g_gate.pending_ops == 0)
        pthread_cond_broadcast(&g_gate.cv);
    pthread_mutex_unlock(&g_gate.mu);
}

static void *stream_worker(void *arg)
{
    struct fc_stream *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->head && !s->dying)
            pthread_cond_wait(&s->cv, &s->mu);
        if (!s->head) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        struct fc_op *op = s->head;
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        pthread_mutex_unlock(&s->mu);

        CUresult r = atomic_load(&s->ctx->sticky) ? (CUresult)atomic_load(&s->ctx->sticky)
                                                   : op_exec(op, s->ctx->dev);
        if (r == CUDA_ERROR_INVALID_VALUE)
            r = CUDA_ERROR_ILLEGAL_ADDRESS; /* device memory vanished after the op was queued */
        if (r != CUDA_SUCCESS) {
            int zero = 0;
            if (atomic_compare_exchange_strong(&s->ctx->sticky, &zero, (int)r))
                fc_loud("asynchronous error on stream %p: %s (sticky for the context)", (void *)s,
                        fc_errname(r));
        }
        free(op);
        pthread_mutex_lock(&s->mu);
        s->pending--;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pending_done(s->ctx);
    }
    /* destroyed and drained */
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    s->magic = 0;
    free(s);
    return NULL;
}

static struct fc_stream *stream_new(struct fc_ctx *c, unsigned flags)
{
    struct fc_stream *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->magic = FC_STREAM_MAGIC;
    s->ctx = c;
    s->flags = flags;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&at, 256 * 1024);
    if (pthread_create(&s->thr, &at, stream_worker, s) != 0) {
        pthread_attr_destroy(&at);
        free(s);
        return NULL;
    }
    pthread_attr_destroy(&at);
    return s;
}

/* Resolve a CUstream argument (g_mu held). NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD
 * map to the current context's default stream. */
static CUresult stream_resolve(CUstream hs, struct fc_stream **out)
{
    if (hs == NULL || hs == CU_STREAM_LEGACY || hs == CU_STREAM_PER_THREAD) {
        struct fc_ctx *c = cur_ctx();
        if (!c || !ctx_valid(c))
            return CUDA_ERROR_INVALID_CONTEXT;
        if (!c->dflt) {
            c->dflt = stream_new(c, 0);
            if (!c->dflt)
                return CUDA_ERROR_OUT_OF_MEMORY;
        }
        *out = c->dflt;
        return CUDA_SUCCESS;
    }
    for (struct fc_stream *s = g_streams; s; s = s->next)
        if (s == (struct fc_stream *)hs) {
            *out = s;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_HANDLE;
}

static CUresult stream_enqueue(CUstream hs, const struct fc_op *tmpl)
{
    pthread_mutex_lock(&g_mu);
    struct fc_stream *s;
    CUresult r = stream_resolve(hs, &s);
    if (r == CUDA_SUCCESS && atomic_load(&s->ctx->sticky))
        r = (CUresult)atomic_load(&s->ctx->sticky);
    struct fc_op *op = NULL;
    if (r == CUDA_SUCCESS && !(op = malloc(sizeof *op)))
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_mu);
        return r;
    }
    *op = *tmpl;
    op->next = NULL;
    pthread_mutex_lock(&g_gate.mu);
    g_gate.pending_ops++;
    pthread_mutex_unlock(&g_gate.mu);
    pthread_mutex_lock(&s->ctx->mu);
    s->ctx->pending++;
    pthread_mutex_unlock(&s->ctx->mu);
    pthread_mutex_lock(&s->mu);
    s->pending++;
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

static CUresult stream_sync(CUstream hs, int query)
{
    pthread_mutex_lock(&g_mu);
    struct fc_stream *s;
    CUresult r = stream_resolve(hs, &s);
    if (r != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_mu);
        return r;
    }
    pthread_mutex_lock(&s->mu);
    pthread_mutex_unlock(&g_mu);
    if (query && s->pending) {
        pthread_mutex_unlock(&s->mu);
        return CUDA_ERROR_NOT_READY;
    }
    while (s->pending)
        pthread_cond_wait(&s->cv, &s->mu);
    struct fc_ctx *c = s->ctx;
    pthread_mutex_unlock(&s->mu);
    return (CUresult)atomic_load(&c->sticky);
}

static CUresult ctx_sync(struct fc_ctx *c)
{
    pthread_mutex_lock(&c->mu);
    while (c->pending)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    return (CUresult)atomic_load(&c->sticky);
}

/* A synchronous copy/set: ordered after the context's default stream, runs in the caller;
 * an access fault is returned (not sticky). */
static CUresult sync_op(const struct fc_op *op)
{
    CUresult r = stream_sync(NULL, 0);
    if (r != CUDA_SUCCESS)
        return r;
    return op_exec(op, cur_ctx()->dev);
}

/* ------------------------------------------------------------------ init, errors, devices API */

static void ckpt_start(void);

FC_EXPORT CUresult cuInit(unsigned int Flags)
{
    CUresult r = CUDA_SUCCESS;
    if (Flags != 0)
        r = CUDA_ERROR_INVALID_VALUE;
    else if (g_forked_child)
        r = CUDA_ERROR_NOT_INITIALIZED;
    else if (g_ndev == 0)
        r = CUDA_ERROR_NO_DEVICE;
    else {
        pthread_mutex_lock(&g_init_mu);
        if (!atomic_load(&g_inited)) {
            pthread_mutex_lock(&g_mu);
            for (int d = 0; d < g_ndev; d++)
                ctx_init(&g_prim[d], d, 1);
            pthread_mutex_unlock(&g_mu);
            ckpt_start();
            atomic_store_explicit(&g_inited, 1, memory_order_release);
        }
        pthread_mutex_unlock(&g_init_mu);
    }
    fc_log_call(__func__, r, "flags=%u", Flags);
    return r;
}

FC_EXPORT CUresult cuDriverGetVersion(int *v)
{
    API_NOGATE(0, v ? (*v = FC_DRIVER_VERSION, CUDA_SUCCESS) : CUDA_ERROR_INVALID_VALUE, "");
}

static CUresult get_error_name(CUresult e, const char **s)
{
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    *s = fc_errname(e);
    return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult get_error_string(CUresult e, const char **s)
{
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    switch ((int)e) {
    case CUDA_SUCCESS: *s = "no error"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; return CUDA_SUCCESS;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_INITIALIZED: *s = "initialization error"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_DEVICE: *s = "invalid device ordinal"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "invalid device context"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_HANDLE: *s = "invalid resource handle"; return CUDA_SUCCESS;
    case CUDA_ERROR_ILLEGAL_STATE: *s = "the operation cannot be performed in the present state"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_FOUND: *s = "named symbol not found"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_READY: *s = "device not ready"; return CUDA_SUCCESS;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_PERMITTED: *s = "operation not permitted"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "operation not supported"; return CUDA_SUCCESS;
    }
    *s = fc_errname(e);
    return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    API_NOGATE(0, get_error_name(error, pStr), "error=%d", (int)error);
}

FC_EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    API_NOGATE(0, get_error_string(error, pStr), "error=%d", (int)error);
}

static CUresult device_get(CUdevice *d, int ordinal)
{
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    API(device_get(device, ordinal), "ordinal=%d", ordinal);
}

FC_EXPORT CUresult cuDeviceGetCount(int *count)
{
    API(count ? (*count = g_ndev, CUDA_SUCCESS) : CUDA_ERROR_INVALID_VALUE, "");
}

static CUresult device_name(char *name, int len, CUdevice d)
{
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "fakecuda GPU %d", d);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    API(device_name(name, len, dev), "dev=%d", dev);
}

static CUresult device_uuid(CUuuid *u, CUdevice d)
{
    if (!u)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    dev_uuid(d, u);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    API(device_uuid(uuid, dev), "dev=%d", dev);
}

FC_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    API(device_uuid(uuid, dev), "dev=%d", dev);
}

static CUresult device_totalmem(size_t *b, CUdevice d)
{
    if (!b)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    *b = (size_t)g_totalmem;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    API(device_totalmem(bytes, dev), "dev=%d", dev);
}

static CUresult device_attr(int *pi, CUdevice_attribute a, CUdevice d)
{
    if (!pi || (int)a < 1 || (int)a >= (int)CU_DEVICE_ATTRIBUTE_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    *pi = dev_attr(a);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    API(device_attr(pi, attrib, dev), "attrib=%d dev=%d", (int)attrib, dev);
}

/* ------------------------------------------------------------------ contexts API */

static CUresult prim_retain(CUcontext *pctx, CUdevice d)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    g_prim[d].prim_refs++;
    pthread_mutex_unlock(&g_mu);
    *pctx = (CUcontext)&g_prim[d];
    return CUDA_SUCCESS;
}

static CUresult prim_release(CUdevice d)
{
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    if (g_prim[d].prim_refs <= 0)
        r = CUDA_ERROR_INVALID_CONTEXT;
    else
        g_prim[d].prim_refs--;
    pthread_mutex_unlock(&g_mu);
    return r;
}

static CUresult prim_state(CUdevice d, unsigned *flags, int *active)
{
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    *flags = 0;
    *active = g_prim[d].prim_refs > 0;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    API(prim_retain(pctx, dev), "dev=%d", dev);
}

FC_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    API(prim_release(dev), "dev=%d", dev);
}

FC_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    API(prim_release(dev), "dev=%d", dev);
}

FC_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    API(prim_state(dev, flags, active), "dev=%d", dev);
}

static CUresult ctx_set_current(CUcontext c)
{
    if (c) {
        pthread_mutex_lock(&g_mu);
        int ok = ctx_valid((struct fc_ctx *)c);
        pthread_mutex_unlock(&g_mu);
        if (!ok)
            return CUDA_ERROR_INVALID_CONTEXT;
    }
    set_cur_ctx((struct fc_ctx *)c);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    API(ctx_set_current(ctx), "ctx=%p", (void *)ctx);
}

FC_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    API(pctx ? (*pctx = (CUcontext)cur_ctx(), CUDA_SUCCESS) : CUDA_ERROR_INVALID_VALUE, "");
}

static CUresult ctx_get_device(CUdevice *d)
{
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    struct fc_ctx *c = cur_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    *d = c->dev;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    API(ctx_get_device(device), "");
}

static CUresult ctx_synchronize(void)
{
    struct fc_ctx *c = cur_ctx();
    return c ? ctx_sync(c) : CUDA_ERROR_INVALID_CONTEXT;
}

FC_EXPORT CUresult cuCtxSynchronize(void)
{
    API(ctx_synchronize(), "");
}

static CUresult ctx_create(CUcontext *pctx, unsigned flags, CUdevice d)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    struct fc_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_mu);
    ctx_init(c, d, 0);
    pthread_mutex_unlock(&g_mu);
    if (tls_ctxdepth < 32)
        tls_ctxstack[tls_ctxdepth++] = c;
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    API(ctx_create(pctx, flags, dev), "flags=%u dev=%d", flags, dev);
}

FC_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    API(ctx_create(pctx, flags, dev), "flags=%u dev=%d", flags, dev);
}

static CUresult ctx_create4(CUcontext *pctx, CUctxCreateParams *p, unsigned flags, CUdevice d)
{
    if (p && (p->execAffinityParams || p->numExecAffinityParams || p->cigParams))
        return CUDA_ERROR_NOT_SUPPORTED;
    return ctx_create(pctx, flags, d);
}

FC_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                  CUdevice dev)
{
    API(ctx_create4(pctx, ctxCreateParams, flags, dev), "flags=%u dev=%d", flags, dev);
}

static CUresult ctx_destroy(CUcontext ctx)
{
    struct fc_ctx *c = (struct fc_ctx *)ctx;
    pthread_mutex_lock(&g_mu);
    int ok = c && ctx_valid(c) && !c->primary;
    pthread_mutex_unlock(&g_mu);
    if (!ok)
        return CUDA_ERROR_INVALID_CONTEXT;
    ctx_sync(c);
    pthread_mutex_lock(&g_mu);
    c->magic = 0; /* stays allocated: a stale CUcontext must not crash a later call */
    pthread_mutex_unlock(&g_mu);
    for (int i = 0; i < tls_ctxdepth; i++)
        if (tls_ctxstack[i] == c)
            tls_ctxstack[i] = NULL;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuCtxDestroy(CUcontext ctx) { API(ctx_destroy(ctx), "ctx=%p", (void *)ctx); }
FC_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) { API(ctx_destroy(ctx), "ctx=%p", (void *)ctx); }

static CUresult ctx_push(CUcontext ctx)
{
    pthread_mutex_lock(&g_mu);
    int ok = ctx && ctx_valid((struct fc_ctx *)ctx);
    pthread_mutex_unlock(&g_mu);
    if (!ok)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_ctxdepth >= 32)
        return CUDA_ERROR_OUT_OF_MEMORY;
    tls_ctxstack[tls_ctxdepth++] = (struct fc_ctx *)ctx;
    return CUDA_SUCCESS;
}

static CUresult ctx_pop(CUcontext *pctx)
{
    if (tls_ctxdepth == 0 || !tls_ctxstack[tls_ctxdepth - 1])
        return CUDA_ERROR_INVALID_CONTEXT;
    if (pctx)
        *pctx = (CUcontext)tls_ctxstack[tls_ctxdepth - 1];
    tls_ctxdepth--;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) { API(ctx_push(ctx), "ctx=%p", (void *)ctx); }
FC_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx) { API(ctx_pop(pctx), ""); }

/* ------------------------------------------------------------------ streams API */

static CUresult stream_create(CUstream *ph, unsigned flags)
{
    if (!ph || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE;
    struct fc_ctx *c = cur_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_mu);
    CUresult r = CUDA_SUCCESS;
    if (!ctx_valid(c))
        r = CUDA_ERROR_INVALID_CONTEXT;
    struct fc_stream *s = r == CUDA_SUCCESS ? stream_new(c, flags) : NULL;
    if (r == CUDA_SUCCESS && !s)
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (s) {
        s->next = g_streams;
        g_streams = s;
        *ph = (CUstream)s;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    API(stream_create(phStream, Flags), "flags=%u", Flags);
}

static CUresult stream_destroy(CUstream hs)
{
    pthread_mutex_lock(&g_mu);
    struct fc_stream **pp = &g_streams;
    while (*pp && *pp != (struct fc_stream *)hs)
        pp = &(*pp)->next;
    if (!*pp || !hs) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct fc_stream *s = *pp;
    *pp = s->next;
    pthread_mutex_lock(&s->mu);
    s->dying = 1; /* queued work still completes; the worker frees the stream */
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuStreamDestroy(CUstream hStream) { API(stream_destroy(hStream), "stream=%p", (void *)hStream); }
FC_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream) { API(stream_destroy(hStream), "stream=%p", (void *)hStream); }

FC_EXPORT CUresult cuStreamSynchronize(CUstream hStream) { API(stream_sync(hStream, 0), "stream=%p", (void *)hStream); }
FC_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream hStream) { API(stream_sync(hStream, 0), "stream=%p", (void *)hStream); }
FC_EXPORT CUresult cuStreamQuery(CUstream hStream) { API(stream_sync(hStream, 1), "stream=%p", (void *)hStream); }
FC_EXPORT CUresult cuStreamQuery_ptsz(CUstream hStream) { API(stream_sync(hStream, 1), "stream=%p", (void *)hStream); }

/* ------------------------------------------------------------------ memory API */

static CUresult mem_alloc(CUdeviceptr *dp, size_t size)
{
    if (!dp || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct fc_ctx *c = cur_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    size_t mapped = (size + g_page - 1) & ~(g_page - 1);
    pthread_mutex_lock(&g_mu);
    CUresult r = CUDA_SUCCESS;
    if (g_used[c->dev] + mapped > g_totalmem)
        r = CUDA_ERROR_OUT_OF_MEMORY;
    void *p = MAP_FAILED;
    if (r == CUDA_SUCCESS) {
        p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED)
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct fc_dmem *d = NULL;
    if (r == CUDA_SUCCESS && !(d = calloc(1, sizeof *d))) {
        munmap(p, mapped);
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r == CUDA_SUCCESS) {
        d->va = (uintptr_t)p;
        d->size = size;
        d->mapped = mapped;
        d->dev = c->dev;
        d->next = g_dmems;
        g_dmems = d;
        g_used[c->dev] += mapped;
        *dp = (CUdeviceptr)d->va;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    API(mem_alloc(dptr, bytesize), "bytesize=%zu dptr=0x%llx", bytesize, OUT64(dptr));
}

static CUresult mem_free(CUdeviceptr p)
{
    if (p == 0)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    struct fc_dmem **pp = &g_dmems;
    while (*pp && (*pp)->va != (uintptr_t)p)
        pp = &(*pp)->next;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (*pp) {
        struct fc_dmem *d = *pp;
        *pp = d->next;
        g_used[d->dev] -= d->mapped;
        munmap((void *)d->va, d->mapped);
        free(d);
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    struct fc_ctx *c;
    API(((c = cur_ctx()) ? ctx_sync(c) : CUDA_SUCCESS, mem_free(dptr)), "dptr=0x%llx", (unsigned long long)dptr);
}

static CUresult mem_getinfo(size_t *fr, size_t *tot)
{
    struct fc_ctx *c = cur_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!fr || !tot)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    *tot = (size_t)g_totalmem;
    *fr = (size_t)(g_totalmem - g_used[c->dev]);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) { API(mem_getinfo(free_, total), ""); }

static CUresult addr_range(CUdeviceptr *pbase, size_t *psize, CUdeviceptr p)
{
    CUresult r = CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&g_mu);
    struct fc_map *m = map_find((uintptr_t)p);
    struct fc_dmem *d = m ? NULL : dmem_find((uintptr_t)p);
    if (m || d) {
        if (pbase)
            *pbase = (CUdeviceptr)(m ? m->va : d->va);
        if (psize)
            *psize = m ? m->size : d->size;
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    API(addr_range(pbase, psize, dptr), "dptr=0x%llx", (unsigned long long)dptr);
}

/* v1 ABI (32-bit sizes and pointers): only low-address ranges can be described. */
static CUresult addr_range_v1(CUdeviceptr_v1 *pbase, unsigned int *psize, CUdeviceptr_v1 p)
{
    CUdeviceptr b;
    size_t s;
    CUresult r = addr_range(&b, &s, (CUdeviceptr)p);
    if (r != CUDA_SUCCESS)
        return r;
    if (b > 0xffffffffull || s > 0xffffffffull)
        return CUDA_ERROR_INVALID_VALUE;
    if (pbase)
        *pbase = (CUdeviceptr_v1)b;
    if (psize)
        *psize = (unsigned int)s;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemGetAddressRange(CUdeviceptr_v1 *pbase, unsigned int *psize, CUdeviceptr_v1 dptr)
{
    API(addr_range_v1(pbase, psize, dptr), "dptr=0x%x", dptr);
}

/* Page-locked host memory: cuMemHostRegister ranges and cuMemAllocHost buffers. Host memory
 * is host memory; the table only enforces the API's rules. */
struct fc_hostmem {
    struct fc_hostmem *next;
    uintptr_t va;
    size_t size;
    int allocated;               /* cuMemAllocHost (1) or cuMemHostRegister (0) */
};
static struct fc_hostmem *g_hostmem;

static CUresult host_register(void *p, size_t size, unsigned flags)
{
    if (!cur_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!p || size == 0 || (flags & ~(unsigned)(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
                                                CU_MEMHOSTREGISTER_IOMEMORY | CU_MEMHOSTREGISTER_READ_ONLY)))
        return CUDA_ERROR_INVALID_VALUE;
    uintptr_t lo = (uintptr_t)p, hi = lo + size;
    pthread_mutex_lock(&g_mu);
    CUresult r = dev_check(lo, 1, -1, 0) == CUDA_ERROR_NOT_FOUND ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    for (struct fc_hostmem *h = g_hostmem; r == CUDA_SUCCESS && h; h = h->next)
        if (h->va < hi && lo < h->va + h->size)
            r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    struct fc_hostmem *h = NULL;
    if (r == CUDA_SUCCESS && !(h = calloc(1, sizeof *h)))
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (h) {
        h->va = lo;
        h->size = size;
        h->next = g_hostmem;
        g_hostmem = h;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

static CUresult host_release(void *p, int allocated)
{
    pthread_mutex_lock(&g_mu);
    struct fc_hostmem **pp = &g_hostmem;
    while (*pp && !((*pp)->va == (uintptr_t)p && (*pp)->allocated == allocated))
        pp = &(*pp)->next;
    struct fc_hostmem *h = *pp;
    if (h)
        *pp = h->next;
    pthread_mutex_unlock(&g_mu);
    if (!h)
        return allocated ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    if (allocated)
        munmap((void *)h->va, h->size);
    free(h);
    return CUDA_SUCCESS;
}

static CUresult host_alloc(void **pp, size_t size)
{
    if (!cur_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!pp || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    struct fc_hostmem *h = p == MAP_FAILED ? NULL : calloc(1, sizeof *h);
    if (!h) {
        if (p != MAP_FAILED)
            munmap(p, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->va = (uintptr_t)p;
    h->size = size;
    h->allocated = 1;
    pthread_mutex_lock(&g_mu);
    h->next = g_hostmem;
    g_hostmem = h;
    pthread_mutex_unlock(&g_mu);
    *pp = p;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags)
{ API(host_register(p, bytesize, Flags), "p=%p bytesize=%zu flags=%u", p, bytesize, Flags); }
FC_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{ API(host_register(p, bytesize, Flags), "p=%p bytesize=%zu flags=%u", p, bytesize, Flags); }
FC_EXPORT CUresult cuMemHostUnregister(void *p) { API(host_release(p, 0), "p=%p", p); }
FC_EXPORT CUresult cuMemAllocHost(void **pp, unsigned int bytesize)
{ API(host_alloc(pp, bytesize), "bytesize=%u p=%p", bytesize, (r_ == CUDA_SUCCESS && pp) ? *pp : NULL); }
FC_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{ API(host_alloc(pp, bytesize), "bytesize=%zu p=%p", bytesize, (r_ == CUDA_SUCCESS && pp) ? *pp : NULL); }
FC_EXPORT CUresult cuMemFreeHost(void *p) { API(host_release(p, 1), "p=%p", p); }

/* Copies and sets: synchronous forms run in the caller after the default stream drains;
 * asynchronous forms are queued on the stream. */
static CUresult do_copy(uintptr_t dst, int dk, uintptr_t src, int sk, size_t n, CUstream hs, int async)
{
    if (!cur_ctx() && (!async || hs == NULL || hs == CU_STREAM_LEGACY || hs == CU_STREAM_PER_THREAD))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!async && cur_ctx() && atomic_load(&cur_ctx()->sticky))
        return (CUresult)atomic_load(&cur_ctx()->sticky);
    struct fc_op op = {.kind = OP_COPY, .dst = dst, .src = src, .dkind = dk, .skind = sk, .n = n};
    if (n == 0)
        return CUDA_SUCCESS;
    CUresult r = precheck(dst, dk);
    if (r == CUDA_SUCCESS)
        r = precheck(src, sk);
    if (r != CUDA_SUCCESS)
        return r;
    return async ? stream_enqueue(hs, &op) : sync_op(&op);
}

static CUresult do_set(uintptr_t dst, int kind, uint32_t v, size_t n, CUstream hs, int async)
{
    if (!cur_ctx() && (!async || hs == NULL || hs == CU_STREAM_LEGACY || hs == CU_STREAM_PER_THREAD))
        return CUDA_ERROR_INVALID_CONTEXT;
    size_t align = kind == OP_SET32 ? 4 : kind == OP_SET16 ? 2 : 1;
    if (dst % align)
        return CUDA_ERROR_INVALID_VALUE;
    if (!async && atomic_load(&cur_ctx()->sticky))
        return (CUresult)atomic_load(&cur_ctx()->sticky);
    struct fc_op op = {.kind = kind, .dst = dst, .dkind = PTR_DEVICE, .n = n, .val = v};
    if (n == 0)
        return CUDA_SUCCESS;
    CUresult r = precheck(dst, PTR_DEVICE);
    if (r != CUDA_SUCCESS)
        return r;
    return async ? stream_enqueue(hs, &op) : sync_op(&op);
}

#define H(x) ((uintptr_t)(x))
#define COPY_FMT "dst=0x%llx src=0x%llx bytes=%zu"
#define COPY_ARGS(d, s, n) (unsigned long long)H(d), (unsigned long long)H(s), (size_t)(n)

FC_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n)
{ API(do_copy(H(d), PTR_DEVICE, H(s), PTR_HOST, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n)); }
FC_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void *s, size_t n)
{ API(do_copy(H(d), PTR_DEVICE, H(s), PTR_HOST, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n)); }
FC_EXPORT CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n)
{ API(do_copy(H(d), PTR_HOST, H(s), PTR_DEVICE, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n)); }
FC_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *d, CUdeviceptr s, size_t n)
{ API(do_copy(H(d), PTR_HOST, H(s), PTR_DEVICE, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n)); }
FC_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n)
{ API(do_copy(H(d), PTR_DEVICE, H(s), PTR_DEVICE, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n)); }
FC_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr d, CUdeviceptr s, size_t n)
{ API(do_copy(H(d), PTR_DEVICE, H(s), PTR_DEVICE, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n)); }
FC_EXPORT CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n)
{ API(do_copy(H(d), PTR_UNIFIED, H(s), PTR_UNIFIED, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n)); }
FC_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr d, CUdeviceptr s, size_t n)
{ API(do_copy(H(d), PTR_UNIFIED, H(s), PTR_UNIFIED, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n)); }

#define ACOPY_FMT COPY_FMT " stream=%p"
FC_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, CUstream st)
{ API(do_copy(H(d), PTR_DEVICE, H(s), PTR_HOST, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st); }
FC_EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void *s, size_t n, CUstream st)
{ API(do_copy(H(d), PTR_DEVICE, H(s), PTR_HOST, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st); }
FC_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, CUstream st)
{ API(do_copy(H(d), PTR_HOST, H(s), PTR_DEVICE, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st); }
FC_EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *d, CUdeviceptr s, size_t n, CUstream st)
{ API(do_copy(H(d), PTR_HOST, H(s), PTR_DEVICE, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st); }
FC_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{ API(do_copy(H(d), PTR_DEVICE, H(s), PTR_DEVICE, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st); }
FC_EXPORT CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{ API(do_copy(H(d), PTR_DEVICE, H(s), PTR_DEVICE, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st); }
FC_EXPORT CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{ API(do_copy(H(d), PTR_UNIFIED, H(s), PTR_UNIFIED, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st); }
FC_EXPORT CUresult cuMemcpyAsync_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{ API(do_copy(H(d), PTR_UNIFIED, H(s), PTR_UNIFIED, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st); }

#define SET_FMT "dst=0x%llx value=%u count=%zu"
FC_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n)
{ API(do_set(H(d), OP_SET8, v, n, NULL, 0), SET_FMT, (unsigned long long)d, (unsigned)v, n); }
FC_EXPORT CUresult cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char v, size_t n)
{ API(do_set(H(d), OP_SET8, v, n, NULL, 0), SET_FMT, (unsigned long long)d, (unsigned)v, n); }
FC_EXPORT CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n)
{ API(do_set(H(d), OP_SET16, v, n, NULL, 0), SET_FMT, (unsigned long long)d, (unsigned)v, n); }
FC_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n)
{ API(do_set(H(d), OP_SET32, v, n, NULL, 0), SET_FMT, (unsigned long long)d, v, n); }
FC_EXPORT CUresult cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int v, size_t n)
{ API(do_set(H(d), OP_SET32, v, n, NULL, 0), SET_FMT, (unsigned long long)d, v, n); }
FC_EXPORT CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream st)
{ API(do_set(H(d), OP_SET8, v, n, st, 1), SET_FMT " stream=%p", (unsigned long long)d, (unsigned)v, n, (void *)st); }
FC_EXPORT CUresult cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char v, size_t n, CUstream st)
{ API(do_set(H(d), OP_SET8, v, n, st, 1), SET_FMT " stream=%p", (unsigned long long)d, (unsigned)v, n, (void *)st); }
FC_EXPORT CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream st)
{ API(do_set(H(d), OP_SET32, v, n, st, 1), SET_FMT " stream=%p", (unsigned long long)d, v, n, (void *)st); }
FC_EXPORT CUresult cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int v, size_t n, CUstream st)
{ API(do_set(H(d), OP_SET32, v, n, st, 1), SET_FMT " stream=%p", (unsigned long long)d, v, n, (void *)st); }

/* ------------------------------------------------------------------ VMM API (ref §2) */

static CUresult check_prop(const CUmemAllocationProp *p, int for_create)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return p->location.type == CU_MEM_LOCATION_TYPE_HOST || p->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA
                   ? CUDA_ERROR_NOT_SUPPORTED
                   : CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(p->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    if (p->requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (p->requestedHandleTypes & ~(unsigned)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE; /* WIN32 types on Linux, unknown bits */
    if (for_create && p->win32HandleMetaData)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

static CUresult mem_granularity(size_t *g, const CUmemAllocationProp *p, CUmemAllocationGranularity_flags o)
{
    if (!g || (o != CU_MEM_ALLOC_GRANULARITY_MINIMUM && o != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_prop(p, 0);
    if (r == CUDA_SUCCESS)
        *g = g_gran;
    return r;
}

FC_EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                 CUmemAllocationGranularity_flags option)
{
    API(mem_granularity(granularity, prop, option), "option=%d granularity=%zu", (int)option,
        (size_t)OUT64(granularity));
}

static CUresult mem_create(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p,
                           unsigned long long flags)
{
    if (!h || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_prop(p, 1);
    if (r != CUDA_SUCCESS)
        return r;
    if (size == 0 || size % g_gran)
        return CUDA_ERROR_INVALID_VALUE;
    int dev = p->location.id;
    pthread_mutex_lock(&g_mu);
    if (g_used[dev] + size > g_totalmem) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct fc_alloc *a = calloc(1, sizeof *a);
    int fd = a ? new_memfd(size) : -1;
    struct stat st;
    if (!a || fd < 0 || fstat(fd, &st) != 0) {
        if (fd >= 0)
            close(fd);
        free(a);
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->fd = fd;
    a->st_dev = st.st_dev;
    a->st_ino = st.st_ino;
    a->size = size;
    a->prop = *p;
    a->device = dev;
    a->creator_pid = (int)getpid();
    a->object_id = g_next_object++;
    a->created_here = 1;
    a->kind = FC_KIND_ALLOCATION;
    if (write_meta(fd, a) != 0 || handle_new(a, h) != 0) {
        close(fd);
        free(a);
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g_used[dev] += size;
    a->next = g_allocs;
    g_allocs = a;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                               unsigned long long flags)
{
    API(mem_create(handle, size, prop, flags), "size=%zu types=%d dev=%d handle=%llu", size,
        prop ? (int)prop->requestedHandleTypes : -1, prop ? prop->location.id : -1, OUT64(handle));
}

static CUresult mem_release(CUmemGenericAllocationHandle h)
{
    pthread_mutex_lock(&g_mu);
    struct fc_handle *e = handle_get(h);
    if (!e) {
        pthread_mutex_unlock(&g_mu);
        fc_loud("cuMemRelease(%llu): %s handle -> CUDA_ERROR_INVALID_VALUE (real driver: undefined "
                "behaviour)", h, h < g_nhandles ? "stale (already released)" : "unknown");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (--e->refs == 0) {
        struct fc_alloc *a = e->alloc;
        a->handles--;
        alloc_maybe_free(a);
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    API(mem_release(handle), "handle=%llu", handle);
}

static CUresult addr_reserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags)
{
    if (!ptr || size == 0 || size % g_page || flags != 0 || addr % g_page || (align & (align - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    if (align < g_gran)
        align = g_gran;
    void *p = MAP_FAILED;
    const int mf = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    if (addr && g_hint_mode == HINT_FAIL)
        return CUDA_ERROR_OUT_OF_MEMORY; /* some drivers refuse hinted reservations (ref §2) */
    if (addr && addr % align == 0 && g_hint_mode == HINT_HONOR) {
        p = mmap((void *)addr, size, PROT_NONE, mf | MAP_FIXED_NOREPLACE, -1, 0);
        if (p != MAP_FAILED && (uintptr_t)p != addr) { /* old kernels ignore the flag */
            munmap(p, size);
            p = MAP_FAILED;
        }
    }
    if (p == MAP_FAILED) {
        if (size + align < size)
            return CUDA_ERROR_OUT_OF_MEMORY;
        void *q = mmap(NULL, size + align, PROT_NONE, mf, -1, 0);
        if (q == MAP_FAILED)
            return CUDA_ERROR_OUT_OF_MEMORY;
        uintptr_t start = ((uintptr_t)q + align - 1) & ~(uintptr_t)(align - 1);
        if (start > (uintptr_t)q)
            munmap(q, start - (uintptr_t)q);
        uintptr_t end = (uintptr_t)q + size + align;
        if (end > start + size)
            munmap((void *)(start + size), end - (start + size));
        p = (void *)start;
    }
    struct fc_resv *r = calloc(1, sizeof *r);
    if (!r) {
        munmap(p, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r->va = (uintptr_t)p;
    r->size = size;
    pthread_mutex_lock(&g_mu);
    r->next = g_resvs;
    g_resvs = r;
    pthread_mutex_unlock(&g_mu);
    *ptr = (CUdeviceptr)r->va;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                       unsigned long long flags)
{
    API(addr_reserve(ptr, size, alignment, addr, flags), "size=%zu alignment=%zu addr=0x%llx ptr=0x%llx", size,
        alignment, (unsigned long long)addr, OUT64(ptr));
}

static CUresult addr_free(CUdeviceptr ptr, size_t size)
{
    pthread_mutex_lock(&g_mu);
    struct fc_resv **pp = &g_resvs;
    while (*pp && !((*pp)->va == (uintptr_t)ptr && (*pp)->size == size))
        pp = &(*pp)->next;
    if (!*pp) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (struct fc_map *m = g_maps; m; m = m->next)
        if (m->va >= (uintptr_t)ptr && m->va - (uintptr_t)ptr < size) {
            pthread_mutex_unlock(&g_mu);
            fc_loud("cuMemAddressFree(0x%llx, %zu): range still has mappings (unmap first)",
                    (unsigned long long)ptr, size);
            return CUDA_ERROR_INVALID_VALUE;
        }
    struct fc_resv *r = *pp;
    *pp = r->next;
    munmap((void *)r->va, r->size);
    free(r);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    API(addr_free(ptr, size), "ptr=0x%llx size=%zu", (unsigned long long)ptr, size);
}

static CUresult mc_wait_handle(CUmemGenericAllocationHandle h, uintptr_t va, uint64_t off, uint64_t size,
                               const char *what);
static uint64_t alloc_extent(const struct fc_alloc *a);

static CUresult mem_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                        unsigned long long flags)
{
    if (flags != 0 || size == 0 || ptr % g_gran || size % g_gran || offset % g_gran)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = mc_wait_handle(h, (uintptr_t)ptr, offset, size, "cuMemMap"); /* multicast: team complete */
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&g_mu);
    struct fc_handle *e = handle_get(h);
    struct fc_map *m = NULL;
    if (!e || offset > alloc_extent(e->alloc) || size > alloc_extent(e->alloc) - offset || !resv_find(ptr, size))
        r = CUDA_ERROR_INVALID_VALUE;
    for (struct fc_map *o = g_maps; r == CUDA_SUCCESS && o; o = o->next)
        if (o->va < ptr + size && ptr < o->va + o->size)
            r = CUDA_ERROR_INVALID_VALUE; /* mapping over a mapping */
    if (r == CUDA_SUCCESS && e->alloc->fd < 0)
        r = CUDA_ERROR_ILLEGAL_STATE;
    if (r == CUDA_SUCCESS) {
        m = calloc(1, sizeof *m);
        if (m)
            m->acc = calloc(size / g_gran, FC_MAX_DEVICES);
        if (!m || !m->acc)
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r == CUDA_SUCCESS && e->alloc->kind == FC_KIND_MULTICAST) {
        /* a multicast VA has no memory of its own: it stays a PROT_NONE reservation and the
         * copy engine sends writes to the bound members */
    } else if (r == CUDA_SUCCESS &&
               mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, e->alloc->fd, (off_t)offset) == MAP_FAILED) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r != CUDA_SUCCESS) {
        if (m)
            free(m->acc);
        free(m);
        pthread_mutex_unlock(&g_mu);
        return r;
    }
    m->va = (uintptr_t)ptr;
    m->size = size;
    m->offset = offset;
    m->alloc = e->alloc;
    m->handle = h;
    e->alloc->maps++;
    m->next = g_maps;
    g_maps = m;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                            unsigned long long flags)
{
    API(mem_map(ptr, size, offset, handle, flags), "ptr=0x%llx size=%zu offset=%zu handle=%llu flags=%llu",
        (unsigned long long)ptr, size, offset, handle, flags);
}

static CUresult mem_unmap(CUdeviceptr ptr, size_t size)
{
    if (size == 0 || ptr % g_gran || size % g_gran)
        return CUDA_ERROR_INVALID_VALUE;
    uintptr_t lo = (uintptr_t)ptr, hi = lo + size;
    pthread_mutex_lock(&g_mu);
    int n = 0;
    CUresult r = resv_find(lo, size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    for (struct fc_map *m = g_maps; r == CUDA_SUCCESS && m; m = m->next) {
        if (m->va < hi && lo < m->va + m->size) {
            if (m->va < lo || m->va + m->size > hi)
                r = CUDA_ERROR_INVALID_VALUE; /* would split a mapping */
            n++;
        }
    }
    if (r == CUDA_SUCCESS && n == 0)
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        struct fc_map **pp = &g_maps;
        while (*pp) {
            struct fc_map *m = *pp;
            if (m->va >= lo && m->va + m->size <= hi) {
                *pp = m->next;
                make_reserved(m->va, m->size);
                struct fc_alloc *a = m->alloc;
                a->maps--;
                free(m->acc);
                free(m);
                alloc_maybe_free(a);
            } else {
                pp = &m->next;
            }
        }
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    API(mem_unmap(ptr, size), "ptr=0x%llx size=%zu", (unsigned long long)ptr, size);
}

static CUresult set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    if (!desc || count == 0 || size == 0 || ptr % g_gran || size % g_gran)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
            return CUDA_ERROR_INVALID_VALUE;
        if (!dev_ok(desc[i].location.id))
            return CUDA_ERROR_INVALID_DEVICE;
        unsigned f = (unsigned)desc[i].flags;
        if (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
    }
    uintptr_t lo = (uintptr_t)ptr, hi = lo + size;
    pthread_mutex_lock(&g_mu);
    for (uintptr_t p = lo; p < hi; p += g_gran)
        if (!map_find(p)) {
            pthread_mutex_unlock(&g_mu);
            return CUDA_ERROR_INVALID_VALUE; /* range not fully mapped */
        }
    for (struct fc_map *m = g_maps; m; m = m->next) {
        if (!(m->va < hi && lo < m->va + m->size))
            continue;
        for (size_t g = 0; g < m->size / g_gran; g++) {
            uintptr_t gva = m->va + g * g_gran;
            if (gva < lo || gva >= hi)
                continue;
            for (size_t i = 0; i < count; i++)
                m->acc[g * FC_MAX_DEVICES + (size_t)desc[i].location.id] = (unsigned char)desc[i].flags;
        }
        map_apply_prot(m);
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    API(set_access(ptr, size, desc, count), "ptr=0x%llx size=%zu count=%zu loc0=%d flags0=%d",
        (unsigned long long)ptr, size, count, desc && count ? desc[0].location.id : -1,
        desc && count ? (int)desc[0].flags : -1);
}

static CUresult get_access(unsigned long long *flags, const CUmemLocation *loc, CUdeviceptr ptr)
{
    if (!flags || !loc || loc->type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(loc->id))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct fc_map *m = map_find((uintptr_t)ptr);
    if (m)
        *flags = m->acc[((uintptr_t)ptr - m->va) / g_gran * FC_MAX_DEVICES + (size_t)loc->id];
    pthread_mutex_unlock(&g_mu);
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_EXPORT CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr)
{
    API(get_access(flags, location, ptr), "ptr=0x%llx loc=%d flags=%llu", (unsigned long long)ptr,
        location ? location->id : -1, OUT64(flags));
}

static CUresult mem_export(void *out, CUmemGenericAllocationHandle h, CUmemAllocationHandleType type,
                           unsigned long long flags)
{
    if (!out || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct fc_handle *e = handle_get(h);
    CUresult r = CUDA_SUCCESS;
    if (!e || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
        !(e->alloc->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        r = CUDA_ERROR_INVALID_VALUE;
    else if (e->alloc->fd < 0)
        r = CUDA_ERROR_ILLEGAL_STATE;
    struct fc_export *x = NULL;
    int fd = -1;
    if (r == CUDA_SUCCESS) {
        x = calloc(1, sizeof *x);
        fd = x ? dup(e->alloc->fd) : -1;
        if (fd < 0) {
            free(x);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (r == CUDA_SUCCESS) {
        x->fd = fd;
        x->st_dev = e->alloc->st_dev;
        x->st_ino = e->alloc->st_ino;
        x->handle = h;
        x->object_id = e->alloc->object_id;
        x->next = g_exports;
        g_exports = x;
        *(int *)out = fd;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                CUmemAllocationHandleType handleType, unsigned long long flags)
{
    API(mem_export(shareableHandle, handle, handleType, flags), "handle=%llu type=%d flags=%llu fd=%d", handle,
        (int)handleType, flags, OUTI((int *)shareableHandle));
}

static CUresult mem_import(CUmemGenericAllocationHandle *h, void *os, CUmemAllocationHandleType type)
{
    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return type == CU_MEM_HANDLE_TYPE_FABRIC ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE;
    int fd = (int)(intptr_t)os;
    struct stat st;
    struct fc_meta meta;
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (size_t)st.st_size < g_page)
        return CUDA_ERROR_INVALID_VALUE;
    if (pread(fd, &meta, sizeof meta, st.st_size - (off_t)g_page) != (ssize_t)sizeof meta ||
        memcmp(meta.magic, FC_META_MAGIC, 8) != 0 || meta.version != FC_META_VERSION ||
        (meta.kind != FC_KIND_ALLOCATION && meta.kind != FC_KIND_MULTICAST) ||
        meta.size + g_page != (uint64_t)st.st_size ||
        (meta.kind == FC_KIND_MULTICAST && meta.size != team_len()))
        return CUDA_ERROR_INVALID_VALUE; /* not a fakecuda allocation or multicast memfd */
    if (!(meta.prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct fc_alloc *a = NULL;
    for (struct fc_alloc *p = g_allocs; p; p = p->next)
        if (p->fd >= 0 && p->st_dev == st.st_dev && p->st_ino == st.st_ino)
            a = p;
    CUresult r = CUDA_SUCCESS;
    int fresh = 0;
    if (!a) {
        a = calloc(1, sizeof *a);
        int nfd = a ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
        if (nfd < 0) {
            free(a);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            fresh = 1;
            a->kind = meta.kind;
            if (a->kind == FC_KIND_MULTICAST) {
                void *t = mmap(NULL, team_len(), PROT_READ | PROT_WRITE, MAP_SHARED, nfd, 0);
                if (t == MAP_FAILED || ((struct fc_team *)t)->magic != FC_TEAM_MAGIC) {
                    if (t != MAP_FAILED)
                        munmap(t, team_len());
                    close(nfd);
                    free(a);
                    pthread_mutex_unlock(&g_mu);
                    return CUDA_ERROR_INVALID_VALUE;
                }
                a->team = t;
            }
            a->fd = nfd;
            a->st_dev = st.st_dev;
            a->st_ino = st.st_ino;
            a->size = meta.size;
            a->prop = meta.prop;
            a->device = meta.device;
            a->creator_pid = meta.creator_pid;
            a->object_id = meta.object_id;
        }
    }
    if (r == CUDA_SUCCESS && handle_new(a, h) != 0)
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (fresh) {
        if (r == CUDA_SUCCESS) {
            a->next = g_allocs;
            g_allocs = a;
        } else {
            close(a->fd);
            if (a->team)
                munmap(a->team, team_len());
            free(a);
        }
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                  CUmemAllocationHandleType shHandleType)
{
    API(mem_import(handle, osHandle, shHandleType), "fd=%d type=%d handle=%llu", (int)(intptr_t)osHandle,
        (int)shHandleType, OUT64(handle));
}

static CUresult mem_retain(CUmemGenericAllocationHandle *h, void *addr)
{
    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct fc_map *m = map_find((uintptr_t)addr);
    if (m) {
        struct fc_handle *e = &g_handles[m->handle];
        if (e->refs++ == 0) /* the mapped handle was released: it comes back to life */
            m->alloc->handles++;
        *h = m->handle;
    }
    pthread_mutex_unlock(&g_mu);
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    API(mem_retain(handle, addr), "addr=%p handle=%llu", addr, OUT64(handle));
}

static CUresult mem_props(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct fc_handle *e = handle_get(h);
    if (e && e->alloc->kind != FC_KIND_ALLOCATION)
        e = NULL; /* a multicast object has no allocation properties */
    if (e)
        *prop = e->alloc->prop;
    pthread_mutex_unlock(&g_mu);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                          CUmemGenericAllocationHandle handle)
{
    API(mem_props(prop, handle), "handle=%llu", handle);
}

/* ------------------------------------------------------------------ multicast (ref §3) */
/* An object = a memfd "fakecuda-multicast" holding the team (struct fc_team) and the metadata
 * page, so every importing process sees one team. Its handle values share the VMM handle
 * space (cuMemRelease, cuMemMap, export/import). Bind and map block until the team is
 * complete, with a watchdog. */

struct fc_mcbind {               /* this process's bindings (each holds the object and the memory) */
    struct fc_mcbind *next;
    struct fc_alloc *mc, *mem;
    int dev;
    uint64_t mc_off, size;
};
static struct fc_mcbind *g_mcbinds;

static uint64_t alloc_extent(const struct fc_alloc *a)
{
    return a->kind == FC_KIND_MULTICAST ? a->team->capacity : a->size;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Block until every device was added (the driver blocks forever; the watchdog fails loudly
 * with CUDA_ERROR_TIMEOUT instead). Called without g_mu. */
static CUresult mc_wait_complete(struct fc_alloc *mc, const char *what)
{
    struct fc_team *t = mc->team;
    uint64_t start = now_ms();
    unsigned sleep_ns = 20000;
    int logged = 0;
    for (;;) {
        team_lock(t);
        uint32_t have = t->nmembers, need = t->num_devices;
        team_unlock(t);
        if (have >= need)
            return CUDA_SUCCESS;
        if (!logged) {
            fc_logline("fakecuda: %s blocks until every device was added to multicast object %" PRIu64
                       " (%u of %u)", what, mc->object_id, have, need);
            logged = 1;
        }
        if (g_mc_watchdog_ms && now_ms() - start >= g_mc_watchdog_ms) {
            fc_loud("multicast watchdog: %s waited %llu ms, but only %u of %u devices were added to "
                    "multicast object %" PRIu64 " -> CUDA_ERROR_TIMEOUT (the real driver blocks forever: "
                    "every process must cuMulticastAddDevice, behind a barrier, before any bind or map)",
                    what, g_mc_watchdog_ms, have, need, mc->object_id);
            return CUDA_ERROR_TIMEOUT;
        }
        struct timespec ts = {0, (long)sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < 1000000)
            sleep_ns *= 2;
    }
}

/* Pin `mc` (g_mu held by the caller, who passes it), wait with g_mu released, unpin. */
static CUresult mc_wait_pinned(struct fc_alloc *mc, const char *what)
{
    mc->pins++;
    pthread_mutex_unlock(&g_mu);
    CUresult r = mc_wait_complete(mc, what);
    pthread_mutex_lock(&g_mu);
    mc->pins--;
    return r;
}

/* cuMemMap of a multicast handle: capacity and reservation checks, then block until the team
 * is complete (cuMemMap checks everything again afterwards). Any other handle: nothing to do. */
static CUresult mc_wait_handle(CUmemGenericAllocationHandle h, uintptr_t va, uint64_t off, uint64_t size,
                               const char *what)
{
    pthread_mutex_lock(&g_mu);
    struct fc_handle *e = handle_get(h);
    CUresult r = CUDA_SUCCESS;
    if (e && e->alloc->kind == FC_KIND_MULTICAST) {
        struct fc_alloc *mc = e->alloc;
        if (off > mc->team->capacity || size > mc->team->capacity - off || !resv_find(va, size))
            r = CUDA_ERROR_INVALID_VALUE;
        else
            r = mc_wait_pinned(mc, what);
        alloc_maybe_free(mc);
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

static struct fc_alloc *mc_get(CUmemGenericAllocationHandle h)
{
    struct fc_handle *e = handle_get(h);
    return e && e->alloc->kind == FC_KIND_MULTICAST ? e->alloc : NULL;
}

static CUresult mc_check_prop(const CUmulticastObjectProp *p)
{
    if (!p || p->numDevices == 0 || p->flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->numDevices > FC_MC_MAX_MEMBERS)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->handleTypes & CU_MEM_HANDLE_TYPE_FABRIC)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (p->handleTypes & ~(unsigned long long)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

static CUresult mc_granularity(size_t *g, const CUmulticastObjectProp *p, CUmulticastGranularity_flags o)
{
    if (!g || (o != CU_MULTICAST_GRANULARITY_MINIMUM && o != CU_MULTICAST_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = mc_check_prop(p);
    if (r == CUDA_SUCCESS)
        *g = g_gran;
    return r;
}

FC_EXPORT CUresult cuMulticastGetGranularity(size_t *granularity, const CUmulticastObjectProp *prop,
                                             CUmulticastGranularity_flags option)
{
    API(mc_granularity(granularity, prop, option), "option=%d granularity=%zu", (int)option,
        (size_t)OUT64(granularity));
}

static CUresult mc_create(CUmemGenericAllocationHandle *h, const CUmulticastObjectProp *p)
{
    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = mc_check_prop(p);
    if (r != CUDA_SUCCESS)
        return r;
    if (p->size == 0 || p->size % g_gran)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t cap = p->size;
    if (g_mc_rounding && cap % g_mc_rounding) /* r615 rounds the capacity up (ref §3) */
        cap += g_mc_rounding - cap % g_mc_rounding;
    size_t tl = team_len();
    int fd = memfd_create("fakecuda-multicast", MFD_CLOEXEC);
    struct stat st;
    struct fc_alloc *a = calloc(1, sizeof *a);
    void *tm = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, (off_t)(tl + g_page)) == 0 && fstat(fd, &st) == 0)
        tm = mmap(NULL, tl, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    pthread_mutexattr_t ma;
    int ok = a && tm != MAP_FAILED && pthread_mutexattr_init(&ma) == 0;
    if (ok) {
        pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
        struct fc_team *t = tm;
        ok = pthread_mutex_init(&t->mu, &ma) == 0;
        pthread_mutexattr_destroy(&ma);
        t->magic = FC_TEAM_MAGIC;
        t->num_devices = p->numDevices;
        t->size = p->size;
        t->capacity = cap;
        t->handle_types = p->handleTypes;
        t->creator_pid = (int)getpid();
    }
    pthread_mutex_lock(&g_mu);
    if (ok) {
        a->fd = fd;
        a->st_dev = st.st_dev;
        a->st_ino = st.st_ino;
        a->size = tl;
        a->prop.requestedHandleTypes = (CUmemAllocationHandleType)p->handleTypes; /* export check */
        a->device = -1;
        a->creator_pid = (int)getpid();
        a->object_id = g_next_object++;
        a->kind = FC_KIND_MULTICAST;
        a->team = tm;
        ok = write_meta(fd, a) == 0 && handle_new(a, h) == 0;
    }
    if (!ok) {
        pthread_mutex_unlock(&g_mu);
        if (tm != MAP_FAILED)
            munmap(tm, tl);
        if (fd >= 0)
            close(fd);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->next = g_allocs;
    g_allocs = a;
    pthread_mutex_unlock(&g_mu);
    if (cap != p->size)
        fc_logline("fakecuda: multicast object %" PRIu64 ": capacity %" PRIu64 " for a requested %zu "
                   "(FAKECUDA_MULTICAST_CAPACITY_ROUNDING)", a->object_id, cap, p->size);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMulticastCreate(CUmemGenericAllocationHandle *mcHandle, const CUmulticastObjectProp *prop)
{
    API(mc_create(mcHandle, prop), "numDevices=%u size=%zu types=%llu handle=%llu", prop ? prop->numDevices : 0,
        prop ? prop->size : 0, prop ? prop->handleTypes : 0ull, OUT64(mcHandle));
}

static CUresult mc_add_device(CUmemGenericAllocationHandle h, CUdevice dev)
{
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct fc_alloc *mc = mc_get(h);
    CUresult r = mc ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (mc) {
        struct fc_team *t = mc->team;
        int me = (int)getpid();
        team_lock(t);
        for (uint32_t i = 0; i < t->nmembers && r == CUDA_SUCCESS; i++)
            if (t->members[i].pid == me && t->members[i].dev == dev)
                r = CUDA_ERROR_INVALID_VALUE;
        if (r != CUDA_SUCCESS)
            fc_logline("fakecuda: multicast object %" PRIu64 ": device %d was already added by this process",
                       mc->object_id, dev);
        else if (t->nmembers >= t->num_devices) {
            fc_logline("fakecuda: multicast object %" PRIu64 ": team already has its %u devices", mc->object_id,
                       t->num_devices);
            r = CUDA_ERROR_INVALID_VALUE;
        } else {
            t->members[t->nmembers].pid = me;
            t->members[t->nmembers].dev = dev;
            t->nmembers++;
        }
        team_unlock(t);
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMulticastAddDevice(CUmemGenericAllocationHandle mcHandle, CUdevice dev)
{
    API(mc_add_device(mcHandle, dev), "handle=%llu dev=%d", mcHandle, dev);
}

/* Every bind form. dev < 0: the v1 ABI, on behalf of the current context's device. by_addr:
 * the memory is the mapping containing memptr (mem_off derived). */
static CUresult mc_bind(CUmemGenericAllocationHandle mch, int dev, uint64_t mc_off, int by_addr,
                        CUmemGenericAllocationHandle memh, CUdeviceptr memptr, uint64_t mem_off, uint64_t size,
                        unsigned long long flags)
{
    if (dev < 0) {
        struct fc_ctx *c = cur_ctx();
        if (!c)
            return CUDA_ERROR_INVALID_CONTEXT;
        dev = c->dev;
    }
    if (flags != 0 || size == 0 || mc_off % g_gran || size % g_gran || (by_addr ? memptr % g_gran : mem_off % g_gran))
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct fc_alloc *mc = mc_get(mch), *mem = NULL;
    CUresult r = mc ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS && by_addr) {
        struct fc_map *m = map_find((uintptr_t)memptr);
        if (!m || m->alloc->kind != FC_KIND_ALLOCATION || size > m->va + m->size - (uintptr_t)memptr)
            r = CUDA_ERROR_INVALID_VALUE; /* not cuMemCreate memory mapped here (cuMemAlloc included) */
        else {
            mem = m->alloc;
            mem_off = m->offset + ((uintptr_t)memptr - m->va);
        }
    } else if (r == CUDA_SUCCESS) {
        struct fc_handle *e = handle_get(memh);
        if (!e || e->alloc->kind != FC_KIND_ALLOCATION)
            r = CUDA_ERROR_INVALID_VALUE;
        else
            mem = e->alloc;
    }
    if (r == CUDA_SUCCESS && (mem_off > mem->size || size > mem->size - mem_off))
        r = CUDA_ERROR_INVALID_VALUE; /* beyond the allocation */
    if (r == CUDA_SUCCESS && (mc_off > mc->team->capacity || size > mc->team->capacity - mc_off))
        r = CUDA_ERROR_INVALID_VALUE; /* beyond the object's capacity */
    if (r == CUDA_SUCCESS && mc->team->handle_types &&
        !(mem->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        r = CUDA_ERROR_INVALID_VALUE; /* a shareable (or imported) object takes shareable memory only */
    if (r == CUDA_SUCCESS && mem->device != dev)
        r = CUDA_ERROR_INVALID_DEVICE; /* the memory must live on the binding device */
    if (r == CUDA_SUCCESS && mem->fd < 0)
        r = CUDA_ERROR_ILLEGAL_STATE;
    if (r == CUDA_SUCCESS) {
        mem->pins++;
        r = mc_wait_pinned(mc, by_addr ? "cuMulticastBindAddr" : "cuMulticastBindMem");
        mem->pins--;
    }
    struct fc_mcbind *lb = NULL;
    if (r == CUDA_SUCCESS && !(lb = calloc(1, sizeof *lb)))
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS) {
        struct fc_team *t = mc->team;
        int me = (int)getpid(), member = 0, slot = -1;
        team_lock(t);
        for (uint32_t i = 0; i < t->nmembers; i++)
            member |= t->members[i].pid == me && t->members[i].dev == dev;
        if (!member)
            r = CUDA_ERROR_INVALID_DEVICE; /* the device is not in the team */
        for (int i = 0; i < FC_MC_MAX_BINDS && r == CUDA_SUCCESS; i++) {
            const struct fc_team_bind *b = &t->binds[i];
            if (!b->used) {
                if (slot < 0)
                    slot = i;
            } else if (b->pid == me && b->dev == dev && b->mc_off < mc_off + size && mc_off < b->mc_off + b->size) {
                r = CUDA_ERROR_INVALID_VALUE; /* overlaps this member's own binding */
            }
        }
        if (r == CUDA_SUCCESS && slot < 0)
            r = CUDA_ERROR_OUT_OF_MEMORY;
        if (r == CUDA_SUCCESS) {
            struct fc_team_bind *b = &t->binds[slot];
            b->pid = me;
            b->dev = dev;
            b->fd = mem->fd;
            b->st_dev = (uint64_t)mem->st_dev;
            b->st_ino = (uint64_t)mem->st_ino;
            b->mc_off = mc_off;
            b->mem_off = mem_off;
            b->size = size;
            b->object_id = mem->object_id;
            b->used = 1;
        }
        team_unlock(t);
    }
    if (r == CUDA_SUCCESS) {
        lb->mc = mc;
        lb->mem = mem;
        lb->dev = dev;
        lb->mc_off = mc_off;
        lb->size = size;
        lb->next = g_mcbinds;
        g_mcbinds = lb;
        mc->binds++;
        mem->binds++;
    } else {
        free(lb);
    }
    if (mc)
        alloc_maybe_free(mc);
    if (mem)
        alloc_maybe_free(mem);
    pthread_mutex_unlock(&g_mu);
    return r;
}

#define BIND_FMT "mc=%llu dev=%d mcOffset=%zu mem=%llu memOffset=%zu size=%zu flags=%llu"
FC_EXPORT CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                      CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size,
                                      unsigned long long flags)
{
    API(mc_bind(mcHandle, -1, mcOffset, 0, memHandle, 0, memOffset, size, flags), BIND_FMT, mcHandle, -1, mcOffset,
        memHandle, memOffset, size, flags);
}

FC_EXPORT CUresult cuMulticastBindMem_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,
                                         CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size,
                                         unsigned long long flags)
{
    API(mc_bind(mcHandle, dev < 0 ? FC_MAX_DEVICES : dev, mcOffset, 0, memHandle, 0, memOffset, size, flags),
        BIND_FMT, mcHandle, dev, mcOffset, memHandle, memOffset, size, flags);
}

#define BINDA_FMT "mc=%llu dev=%d mcOffset=%zu memptr=0x%llx size=%zu flags=%llu"
FC_EXPORT CUresult cuMulticastBindAddr(CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUdeviceptr memptr,
                                       size_t size, unsigned long long flags)
{
    API(mc_bind(mcHandle, -1, mcOffset, 1, 0, memptr, 0, size, flags), BINDA_FMT, mcHandle, -1, mcOffset,
        (unsigned long long)memptr, size, flags);
}

FC_EXPORT CUresult cuMulticastBindAddr_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,
                                          CUdeviceptr memptr, size_t size, unsigned long long flags)
{
    API(mc_bind(mcHandle, dev < 0 ? FC_MAX_DEVICES : dev, mcOffset, 1, 0, memptr, 0, size, flags), BINDA_FMT,
        mcHandle, dev, mcOffset, (unsigned long long)memptr, size, flags);
}

static CUresult mc_unbind(CUmemGenericAllocationHandle mch, CUdevice dev, uint64_t mc_off, uint64_t size)
{
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if (size == 0 || mc_off % g_gran || size % g_gran)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct fc_alloc *mc = mc_get(mch);
    CUresult r = mc && mc_off <= mc->team->capacity && size <= mc->team->capacity - mc_off ? CUDA_SUCCESS
                                                                                          : CUDA_ERROR_INVALID_VALUE;
    struct fc_mcbind **pp = &g_mcbinds;
    while (r == CUDA_SUCCESS && *pp &&
           !((*pp)->mc == mc && (*pp)->dev == dev && (*pp)->mc_off == mc_off && (*pp)->size == size))
        pp = &(*pp)->next;
    if (r == CUDA_SUCCESS && !*pp) {
        pthread_mutex_unlock(&g_mu);
        fc_loud("cuMulticastUnbind(%llu, dev %d, offset 0x%" PRIx64 ", size 0x%" PRIx64 "): no binding of this "
                "process matches exactly -> CUDA_ERROR_INVALID_VALUE (real driver: undefined behaviour)",
                mch, dev, mc_off, size);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        struct fc_mcbind *lb = *pp;
        struct fc_team *t = mc->team;
        int me = (int)getpid();
        team_lock(t);
        for (int i = 0; i < FC_MC_MAX_BINDS; i++) {
            struct fc_team_bind *b = &t->binds[i];
            if (b->used && b->pid == me && b->dev == dev && b->mc_off == mc_off && b->size == size) {
                memset(b, 0, sizeof *b);
                break;
            }
        }
        team_unlock(t);
        *pp = lb->next;
        lb->mc->binds--;
        lb->mem->binds--;
        alloc_maybe_free(lb->mem);
        alloc_maybe_free(lb->mc);
        free(lb);
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMulticastUnbind(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset, size_t size)
{
    API(mc_unbind(mcHandle, dev, mcOffset, size), "mc=%llu dev=%d mcOffset=%zu size=%zu", mcHandle, dev, mcOffset,
        size);
}

/* ------------------------------------------------------------------ stream memory operations (ref §4) */

static CUresult memop(CUstream hs, CUdeviceptr addr, uint64_t v, unsigned flags, int kind, int v1)
{
    int is64 = kind == OP_WAIT64 || kind == OP_WRITE64;
    if (addr % (is64 ? 8 : 4))
        return CUDA_ERROR_INVALID_VALUE;
    if (kind == OP_WAIT32 || kind == OP_WAIT64) {
        unsigned base = flags & ~(unsigned)CU_STREAM_WAIT_VALUE_FLUSH;
        if (base > CU_STREAM_WAIT_VALUE_NOR)
            return CUDA_ERROR_INVALID_VALUE;
    } else if (flags & ~(unsigned)(v1 ? CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER : 0)) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct fc_op op = {.kind = kind, .dst = (uintptr_t)addr, .dkind = PTR_DEVICE, .val = v, .flags = flags};
    CUresult r = precheck(op.dst, PTR_DEVICE);
    return r != CUDA_SUCCESS ? r : stream_enqueue(hs, &op);
}

#define MEMOP_FMT "stream=%p addr=0x%llx value=%llu flags=%u"
#define MEMOP32(name, kind, v1)                                                                     \
    FC_EXPORT CUresult name(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f)                \
    { API(memop(s, a, v, f, kind, v1), MEMOP_FMT, (void *)s, (unsigned long long)a, (unsigned long long)v, f); }
#define MEMOP64(name, kind, v1)                                                                     \
    FC_EXPORT CUresult name(CUstream s, CUdeviceptr a, cuuint64_t v, unsigned int f)                \
    { API(memop(s, a, v, f, kind, v1), MEMOP_FMT, (void *)s, (unsigned long long)a, (unsigned long long)v, f); }

MEMOP32(cuStreamWaitValue32_v2, OP_WAIT32, 0)
MEMOP32(cuStreamWaitValue32_v2_ptsz, OP_WAIT32, 0)
MEMOP32(cuStreamWaitValue32, OP_WAIT32, 1)
MEMOP32(cuStreamWaitValue32_ptsz, OP_WAIT32, 1)
MEMOP32(cuStreamWriteValue32_v2, OP_WRITE32, 0)
MEMOP32(cuStreamWriteValue32_v2_ptsz, OP_WRITE32, 0)
MEMOP32(cuStreamWriteValue32, OP_WRITE32, 1)
MEMOP32(cuStreamWriteValue32_ptsz, OP_WRITE32, 1)
MEMOP64(cuStreamWaitValue64_v2, OP_WAIT64, 0)
MEMOP64(cuStreamWaitValue64_v2_ptsz, OP_WAIT64, 0)
MEMOP64(cuStreamWriteValue64_v2, OP_WRITE64, 0)
MEMOP64(cuStreamWriteValue64_v2_ptsz, OP_WRITE64, 0)

/* ------------------------------------------------------------------ checkpoint (ref §5) */
/* Target side: a control thread started at the first successful cuInit serves the abstract
 * socket "\0fakecuda-<pid>" (SOCK_SEQPACKET, one request per connection). Its tid is the
 * restore thread id. Controller side: cuCheckpointProcess*(pid) connect to it. */

enum { CK_GETSTATE = 1, CK_LOCK, CK_CHECKPOINT, CK_RESTORE, CK_UNLOCK, CK_GETTID };

struct ck_req {
    uint32_t magic;
    uint32_t op;
    uint32_t timeout_ms;
    uint32_t pad;
};
struct ck_rep {
    int32_t result;
    int32_t value;
};
#define CK_MAGIC 0xfcc4ec01u

static int g_ck_state = CU_PROCESS_STATE_RUNNING; /* owned by the control thread */
static pid_t g_ck_tid;

static socklen_t ck_addr(struct sockaddr_un *a, int pid)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "fakecuda-%d", pid);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static void deadline_after(struct timespec *ts, unsigned ms)
{
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static CUresult ck_lock(unsigned timeout_ms)
{
    if (g_ck_state != CU_PROCESS_STATE_RUNNING)
        return CUDA_ERROR_ILLEGAL_STATE;
    struct timespec dl;
    deadline_after(&dl, timeout_ms);
    pthread_mutex_lock(&g_gate.mu);
    atomic_store(&g_gate.closed, 1);
    while (atomic_load(&g_gate.inflight) > 0 || g_gate.pending_ops > 0) {
        int e = timeout_ms ? pthread_cond_timedwait(&g_gate.cv, &g_gate.mu, &dl)
                           : pthread_cond_wait(&g_gate.cv, &g_gate.mu);
        if (e == ETIMEDOUT && (atomic_load(&g_gate.inflight) > 0 || g_gate.pending_ops > 0)) {
            long inflight = atomic_load(&g_gate.inflight), pend = g_gate.pending_ops;
            atomic_store(&g_gate.closed, 0);
            pthread_cond_broadcast(&g_gate.cv);
            pthread_mutex_unlock(&g_gate.mu);
            fc_logline("fakecuda: lock timed out after %u ms: %ld calls in flight, %ld stream ops pending",
                       timeout_ms, inflight, pend);
            return CUDA_ERROR_NOT_READY;
        }
    }
    pthread_mutex_unlock(&g_gate.mu);
    g_ck_state = CU_PROCESS_STATE_LOCKED;
    return CUDA_SUCCESS;
}

static CUresult ck_checkpoint(void)
{
    if (g_ck_state != CU_PROCESS_STATE_LOCKED)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&g_mu);
    /* A multicast object held in any way (handle, mapping, binding): the real driver hangs
     * (nccl PR #2340); the fake refuses instead. */
    int nmc = 0;
    struct fc_alloc *mc1 = NULL;
    for (struct fc_alloc *a = g_allocs; a; a = a->next)
        if (a->kind == FC_KIND_MULTICAST) {
            nmc++;
            mc1 = a;
        }
    if (nmc) {
        int handles = mc1->handles, maps = mc1->maps, binds = mc1->binds;
        uint64_t id = mc1->object_id;
        pthread_mutex_unlock(&g_mu);
        fc_loud("checkpoint refused: the process holds %d multicast object(s) (object %" PRIu64 ": %d handle "
                "refs, %d mappings, %d bindings); the real driver hangs on them -> CUDA_ERROR_NOT_SUPPORTED",
                nmc, id, handles, maps, binds);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    /* An exported fd still open in this process carries the sharing: the real driver cannot
     * dump it. */
    struct fc_export **pp = &g_exports;
    while (*pp) {
        struct fc_export *x = *pp;
        struct stat st;
        if (fstat(x->fd, &st) == 0 && st.st_dev == x->st_dev && st.st_ino == x->st_ino) {
            pthread_mutex_unlock(&g_mu);
            fc_loud("checkpoint refused: exported fd %d of allocation handle %llu (object %" PRIu64
                    ") is still open -> CUDA_ERROR_NOT_SUPPORTED",
                    x->fd, x->handle, x->object_id);
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        *pp = x->next; /* closed (or the number was reused): forget it */
        free(x);
    }
    /* host buffers for every VMM allocation and every cuMemAlloc buffer, or nothing changes */
    int nomem = 0;
    for (struct fc_alloc *a = g_allocs; a; a = a->next)
        nomem |= !(a->saved = malloc(a->size ? a->size : 1));
    for (struct fc_dmem *d = g_dmems; d; d = d->next)
        nomem |= !(d->saved = malloc(d->mapped));
    if (nomem) {
        for (struct fc_alloc *a = g_allocs; a; a = a->next) {
            free(a->saved);
            a->saved = NULL;
        }
        for (struct fc_dmem *d = g_dmems; d; d = d->next) {
            free(d->saved);
            d->saved = NULL;
        }
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* cuMemAlloc memory: copied out, its range becomes a PROT_NONE reservation (CRIU sees no
     * device memory), Restore maps it back at the same VA */
    for (struct fc_dmem *d = g_dmems; d; d = d->next) {
        memcpy(d->saved, (const void *)d->va, d->mapped);
        make_reserved(d->va, d->mapped);
    }
    for (struct fc_alloc *a = g_allocs; a; a = a->next) {
        size_t got = 0;
        while (got < a->size) {
            ssize_t n = pread(a->fd, (char *)a->saved + got, a->size - got, (off_t)got);
            if (n <= 0)
                break;
            got += (size_t)n;
        }
    }
    for (struct fc_map *m = g_maps; m; m = m->next)
        make_reserved(m->va, m->size);
    for (struct fc_alloc *a = g_allocs; a; a = a->next) {
        close(a->fd);
        a->fd = -1;
    }
    pthread_mutex_unlock(&g_mu);
    g_ck_state = CU_PROCESS_STATE_CHECKPOINTED;
    return CUDA_SUCCESS;
}

static CUresult ck_restore(void)
{
    if (g_ck_state != CU_PROCESS_STATE_CHECKPOINTED)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&g_mu);
    CUresult r = CUDA_SUCCESS;
    for (struct fc_alloc *a = g_allocs; a && r == CUDA_SUCCESS; a = a->next) {
        int fd = new_memfd(a->size);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        size_t put = 0;
        while (put < a->size) {
            ssize_t n = pwrite(fd, (char *)a->saved + put, a->size - put, (off_t)put);
            if (n <= 0)
                break;
            put += (size_t)n;
        }
        a->fd = fd;
        a->st_dev = st.st_dev;
        a->st_ino = st.st_ino;
        a->creator_pid = (int)getpid(); /* a private copy now */
        write_meta(fd, a);
        free(a->saved);
        a->saved = NULL;
    }
    for (struct fc_map *m = g_maps; m && r == CUDA_SUCCESS; m = m->next) {
        if (mmap((void *)m->va, m->size, PROT_NONE, MAP_SHARED | MAP_FIXED, m->alloc->fd, (off_t)m->offset) ==
            MAP_FAILED)
            r = CUDA_ERROR_OUT_OF_MEMORY;
        else
            map_apply_prot(m);
    }
    for (struct fc_dmem *d = g_dmems; d && r == CUDA_SUCCESS; d = d->next) {
        if (!d->saved)
            continue;
        if (mmap((void *)d->va, d->mapped, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        memcpy((void *)d->va, d->saved, d->mapped);
        free(d->saved);
        d->saved = NULL;
    }
    pthread_mutex_unlock(&g_mu);
    if (r != CUDA_SUCCESS) {
        g_ck_state = CU_PROCESS_STATE_FAILED;
        fc_loud("restore failed: %s", fc_errname(r));
        return r;
    }
    g_ck_state = CU_PROCESS_STATE_LOCKED;
    return CUDA_SUCCESS;
}

static CUresult ck_unlock(void)
{
    if (g_ck_state != CU_PROCESS_STATE_LOCKED)
        return CUDA_ERROR_ILLEGAL_STATE;
    g_ck_state = CU_PROCESS_STATE_RUNNING;
    pthread_mutex_lock(&g_gate.mu);
    atomic_store(&g_gate.closed, 0);
    pthread_cond_broadcast(&g_gate.cv);
    pthread_mutex_unlock(&g_gate.mu);
    return CUDA_SUCCESS;
}

static const char *ck_opname(uint32_t op)
{
    static const char *n[] = {"?", "GetState", "Lock", "Checkpoint", "Restore", "Unlock", "GetRestoreThreadId"};
    return op < sizeof n / sizeof n[0] ? n[op] : "?";
}

static void *ck_thread(void *arg)
{
    (void)arg;
    g_ck_tid = fc_tid();
    for (;;) {
        int c = accept4(g_ck_listen, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            struct timespec ts = {0, 10000000};
            nanosleep(&ts, NULL);
            continue;
        }
        struct ck_req q;
        struct ck_rep p = {CUDA_ERROR_INVALID_VALUE, 0};
        ssize_t n = recv(c, &q, sizeof q, 0);
        if (n == (ssize_t)sizeof q && q.magic == CK_MAGIC) {
            switch (q.op) {
            case CK_GETSTATE: p.result = CUDA_SUCCESS; p.value = g_ck_state; break;
            case CK_GETTID: p.result = CUDA_SUCCESS; p.value = g_ck_tid; break;
            case CK_LOCK: p.result = ck_lock(q.timeout_ms); break;
            case CK_CHECKPOINT: p.result = ck_checkpoint(); break;
            case CK_RESTORE: p.result = ck_restore(); break;
            case CK_UNLOCK: p.result = ck_unlock(); break;
            }
            fc_logline("fakecuda: control %s = %s (state %d)", ck_opname(q.op), fc_errname(p.result), g_ck_state);
        }
        ssize_t w = send(c, &p, sizeof p, MSG_NOSIGNAL);
        (void)w;
        close(c);
    }
    return NULL;
}

static void ckpt_start(void)
{
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un a;
    socklen_t len = ck_addr(&a, (int)getpid());
    if (s < 0 || bind(s, (struct sockaddr *)&a, len) != 0 || listen(s, 16) != 0) {
        fc_loud("cannot serve the checkpoint control socket: %s", strerror(errno));
        if (s >= 0)
            close(s);
        return;
    }
    g_ck_listen = s;
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&at, 256 * 1024);
    if (pthread_create(&t, &at, ck_thread, NULL) != 0)
        fc_loud("cannot start the checkpoint control thread");
    pthread_attr_destroy(&at);
}

/* Controller side. An unknown pid, or a pid that has no fakecuda control socket (never
 * called cuInit, or no fakecuda), is CUDA_ERROR_INVALID_VALUE. */
static CUresult ck_call(int pid, uint32_t op, uint32_t timeout_ms, int *value)
{
    if (pid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    struct sockaddr_un a;
    socklen_t len = ck_addr(&a, pid);
    if (connect(s, (struct sockaddr *)&a, len) != 0) {
        close(s);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct ck_req q = {CK_MAGIC, op, timeout_ms, 0};
    struct ck_rep p;
    CUresult r;
    if (send(s, &q, sizeof q, MSG_NOSIGNAL) != (ssize_t)sizeof q) {
        r = CUDA_ERROR_OPERATING_SYSTEM;
    } else {
        ssize_t n;
        do
            n = recv(s, &p, sizeof p, 0);
        while (n < 0 && errno == EINTR);
        if (n != (ssize_t)sizeof p)
            r = CUDA_ERROR_OPERATING_SYSTEM;
        else {
            r = (CUresult)p.result;
            if (value)
                *value = p.value;
        }
    }
    close(s);
    return r;
}

static int all_zero(const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i])
            return 0;
    return 1;
}

static CUresult ck_getstate(int pid, CUprocessState *st)
{
    if (!st)
        return CUDA_ERROR_INVALID_VALUE;
    int v = 0;
    CUresult r = ck_call(pid, CK_GETSTATE, 0, &v);
    if (r == CUDA_SUCCESS)
        *st = (CUprocessState)v;
    return r;
}

FC_EXPORT CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
    API_NOGATE(1, ck_getstate(pid, state), "pid=%d state=%d", pid, OUTI(state));
}

static CUresult ck_gettid(int pid, int *tid)
{
    if (!tid)
        return CUDA_ERROR_INVALID_VALUE;
    return ck_call(pid, CK_GETTID, 0, tid);
}

FC_EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    API_NOGATE(1, ck_gettid(pid, tid), "pid=%d tid=%d", pid, OUTI(tid));
}

static CUresult ck_lock_call(int pid, CUcheckpointLockArgs *args)
{
    if (args && (args->reserved0 || !all_zero(args->reserved1, sizeof args->reserved1)))
        return CUDA_ERROR_INVALID_VALUE;
    return ck_call(pid, CK_LOCK, args ? args->timeoutMs : 0, NULL);
}

FC_EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    API_NOGATE(1, ck_lock_call(pid, args), "pid=%d timeoutMs=%u", pid, args ? args->timeoutMs : 0);
}

FC_EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
    API_NOGATE(1, (args && !all_zero(args, sizeof *args)) ? CUDA_ERROR_INVALID_VALUE
                                                        : ck_call(pid, CK_CHECKPOINT, 0, NULL),
               "pid=%d", pid);
}

static CUresult ck_restore_call(int pid, CUcheckpointRestoreArgs *args)
{
    if (args) {
        if (!all_zero(args->reserved, sizeof args->reserved) || args->reserved1)
            return CUDA_ERROR_INVALID_VALUE;
        if (args->gpuPairsCount && !args->gpuPairs)
            return CUDA_ERROR_INVALID_VALUE;
        for (unsigned i = 0; i < args->gpuPairsCount; i++) {
            int okold = 0, oknew = 0;
            for (int d = 0; d < g_ndev; d++) {
                CUuuid u;
                dev_uuid(d, &u);
                okold |= !memcmp(u.bytes, args->gpuPairs[i].oldUuid.bytes, 16);
                oknew |= !memcmp(u.bytes, args->gpuPairs[i].newUuid.bytes, 16);
            }
            if (!okold || !oknew)
                return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return ck_call(pid, CK_RESTORE, 0, NULL);
}

FC_EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
    API_NOGATE(1, ck_restore_call(pid, args), "pid=%d pairs=%u", pid, args ? args->gpuPairsCount : 0);
}

FC_EXPORT CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
    API_NOGATE(1, (args && !all_zero(args, sizeof *args)) ? CUDA_ERROR_INVALID_VALUE
                                                        : ck_call(pid, CK_UNLOCK, 0, NULL),
               "pid=%d", pid);
}

/* ------------------------------------------------------------------ cuGetProcAddress (ref §1.2, §6) */

FC_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
FC_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus);

/* One table: (base name, first driver version of this ABI) -> ELF name + function, and the
 * per-thread-default-stream twin (_ptds/_ptsz) where one exists. */
struct proc_entry {
    const char *name;
    int version;
    const char *elf;
    void *fn;
    const char *pt_elf;
    void *pt_fn;
};

#define E(name, ver, fn) {name, ver, #fn, (void *)fn, NULL, NULL}
#define EP(name, ver, fn, ptfn) {name, ver, #fn, (void *)fn, #ptfn, (void *)ptfn}

static const struct proc_entry g_procs[] = {
    E("cuInit", 2000, cuInit),
    E("cuDriverGetVersion", 2020, cuDriverGetVersion),
    E("cuGetErrorString", 6000, cuGetErrorString),
    E("cuGetErrorName", 6000, cuGetErrorName),
    E("cuGetProcAddress", 11030, cuGetProcAddress),
    E("cuGetProcAddress", 12000, cuGetProcAddress_v2),
    E("cuDeviceGet", 2000, cuDeviceGet),
    E("cuDeviceGetCount", 2000, cuDeviceGetCount),
    E("cuDeviceGetName", 2000, cuDeviceGetName),
    E("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
    E("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
    E("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
    E("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    E("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    E("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease),
    E("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    E("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState),
    E("cuCtxCreate", 2000, cuCtxCreate),
    E("cuCtxCreate", 3020, cuCtxCreate_v2),
    E("cuCtxCreate", 12050, cuCtxCreate_v4),
    E("cuCtxDestroy", 2000, cuCtxDestroy),
    E("cuCtxDestroy", 4000, cuCtxDestroy_v2),
    E("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2),
    E("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2),
    E("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    E("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    E("cuCtxGetDevice", 2000, cuCtxGetDevice),
    E("cuCtxSynchronize", 2000, cuCtxSynchronize),
    E("cuStreamCreate", 2000, cuStreamCreate),
    E("cuStreamDestroy", 2000, cuStreamDestroy),
    E("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    EP("cuStreamSynchronize", 2000, cuStreamSynchronize, cuStreamSynchronize_ptsz),
    EP("cuStreamQuery", 2000, cuStreamQuery, cuStreamQuery_ptsz),
    E("cuMemGetInfo", 3020, cuMemGetInfo_v2),
    E("cuMemAlloc", 3020, cuMemAlloc_v2),
    E("cuMemFree", 3020, cuMemFree_v2),
    E("cuMemAllocHost", 2000, cuMemAllocHost),
    E("cuMemAllocHost", 3020, cuMemAllocHost_v2),
    E("cuMemFreeHost", 2000, cuMemFreeHost),
    E("cuMemHostRegister", 4000, cuMemHostRegister),
    E("cuMemHostRegister", 6050, cuMemHostRegister_v2),
    E("cuMemHostUnregister", 4000, cuMemHostUnregister),
    E("cuMemGetAddressRange", 2000, cuMemGetAddressRange),
    E("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2),
    EP("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds),
    EP("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds),
    EP("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds),
    EP("cuMemcpy", 4000, cuMemcpy, cuMemcpy_ptds),
    EP("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz),
    EP("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz),
    EP("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz),
    EP("cuMemcpyAsync", 4000, cuMemcpyAsync, cuMemcpyAsync_ptsz),
    EP("cuMemsetD8", 3020, cuMemsetD8_v2, cuMemsetD8_v2_ptds),
    E("cuMemsetD16", 3020, cuMemsetD16_v2),
    EP("cuMemsetD32", 3020, cuMemsetD32_v2, cuMemsetD32_v2_ptds),
    EP("cuMemsetD8Async", 3020, cuMemsetD8Async, cuMemsetD8Async_ptsz),
    EP("cuMemsetD32Async", 3020, cuMemsetD32Async, cuMemsetD32Async_ptsz),
    E("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity),
    E("cuMemCreate", 10020, cuMemCreate),
    E("cuMemRelease", 10020, cuMemRelease),
    E("cuMemAddressReserve", 10020, cuMemAddressReserve),
    E("cuMemAddressFree", 10020, cuMemAddressFree),
    E("cuMemMap", 10020, cuMemMap),
    E("cuMemUnmap", 10020, cuMemUnmap),
    E("cuMemSetAccess", 10020, cuMemSetAccess),
    E("cuMemGetAccess", 10020, cuMemGetAccess),
    E("cuMemExportToShareableHandle", 10020, cuMemExportToShareableHandle),
    E("cuMemImportFromShareableHandle", 10020, cuMemImportFromShareableHandle),
    E("cuMemGetAllocationPropertiesFromHandle", 10020, cuMemGetAllocationPropertiesFromHandle),
    E("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle),
    E("cuMulticastCreate", 12010, cuMulticastCreate),
    E("cuMulticastAddDevice", 12010, cuMulticastAddDevice),
    E("cuMulticastBindMem", 12010, cuMulticastBindMem),
    E("cuMulticastBindAddr", 12010, cuMulticastBindAddr),
    E("cuMulticastUnbind", 12010, cuMulticastUnbind),
    E("cuMulticastGetGranularity", 12010, cuMulticastGetGranularity),
    E("cuMulticastBindMem_v2", 13010, cuMulticastBindMem_v2), /* CUDA 13.1: separate names */
    E("cuMulticastBindAddr_v2", 13010, cuMulticastBindAddr_v2),
    EP("cuStreamWaitValue32", 8000, cuStreamWaitValue32, cuStreamWaitValue32_ptsz),
    EP("cuStreamWaitValue32", 11070, cuStreamWaitValue32_v2, cuStreamWaitValue32_v2_ptsz),
    EP("cuStreamWriteValue32", 8000, cuStreamWriteValue32, cuStreamWriteValue32_ptsz),
    EP("cuStreamWriteValue32", 11070, cuStreamWriteValue32_v2, cuStreamWriteValue32_v2_ptsz),
    EP("cuStreamWaitValue64", 11070, cuStreamWaitValue64_v2, cuStreamWaitValue64_v2_ptsz),
    EP("cuStreamWriteValue64", 11070, cuStreamWriteValue64_v2, cuStreamWriteValue64_v2_ptsz),
    E("cuCheckpointProcessGetRestoreThreadId", 12080, cuCheckpointProcessGetRestoreThreadId),
    E("cuCheckpointProcessGetState", 12080, cuCheckpointProcessGetState),
    E("cuCheckpointProcessLock", 12080, cuCheckpointProcessLock),
    E("cuCheckpointProcessCheckpoint", 12080, cuCheckpointProcessCheckpoint),
    E("cuCheckpointProcessRestore", 12080, cuCheckpointProcessRestore),
    E("cuCheckpointProcessUnlock", 12080, cuCheckpointProcessUnlock),
};

/* Returns CU_GET_PROC_ADDRESS_* status; *elf names what was returned. */
static CUdriverProcAddressQueryResult proc_lookup(const char *sym, int ver, cuuint64_t flags, void **pfn,
                                                  const char **elf)
{
    const struct proc_entry *best = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++) {
        const struct proc_entry *e = &g_procs[i];
        if (strcmp(e->name, sym) != 0)
            continue;
        known = 1;
        if (e->version <= ver && (!best || e->version > best->version))
            best = e;
    }
    *pfn = NULL;
    *elf = NULL;
    if (!best)
        return known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best->pt_fn) {
        *pfn = best->pt_fn;
        *elf = best->pt_elf;
    } else {
        *pfn = best->fn;
        *elf = best->elf;
    }
    return CU_GET_PROC_ADDRESS_SUCCESS;
}

static CUresult get_proc(const char *resolver, const char *sym, void **pfn, int ver, cuuint64_t flags,
                         CUdriverProcAddressQueryResult *status, int legacy)
{
    const char *elf = NULL;
    CUresult r = CUDA_SUCCESS;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if (!sym || !pfn || ver > FC_DRIVER_VERSION || ver < 0 ||
        (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)))
        r = CUDA_ERROR_INVALID_VALUE;
    else {
        st = proc_lookup(sym, ver, flags, pfn, &elf);
        if (legacy && st != CU_GET_PROC_ADDRESS_SUCCESS)
            r = CUDA_ERROR_NOT_FOUND; /* the legacy resolver has no status output */
    }
    if (status)
        *status = st;
    fc_logline("lookup %s %s %d %llu -> %s", resolver, sym ? (*sym ? sym : "\"\"") : "(null)", ver,
               (unsigned long long)flags, elf ? elf : "NULL");
    return r;
}

FC_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus)
{
    return get_proc("cuGetProcAddress_v2", symbol, pfn, cudaVersion, flags, symbolStatus, 0);
}

FC_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return get_proc("cuGetProcAddress", symbol, pfn, cudaVersion, flags, NULL, 1);
}
