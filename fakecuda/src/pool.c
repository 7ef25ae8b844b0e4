/*
 * pool.c: stream-ordered memory pools and their IPC (CUDA driver API, "Stream Ordered Memory
 * Allocator": cuMemPoolCreate, cuMemPoolDestroy, cuMemAllocFromPoolAsync, cuMemFreeAsync,
 * cuMemPoolExportToShareableHandle, cuMemPoolImportFromShareableHandle, cuMemPoolExportPointer,
 * cuMemPoolImportPointer; cuda.h 13.5), the part a process sharing a pool with another uses.
 *
 * A pool is one arena: a memfd of maxSize bytes (0: FC_POOL_DEFAULT_BYTES; sparse, so unused
 * capacity costs nothing) plus a metadata page (kind FC_KIND_POOL), mapped shared and recorded
 * as device memory (a struct fc_dmem with `pool` set), so copies, sets and the checkpoint treat
 * it like cuMemAlloc memory; allocations are first-fit blocks of it, 512-byte aligned. A pool
 * created with handle type POSIX_FILE_DESCRIPTOR exports a dup of its memfd; an importer maps
 * the same memfd (its pool holds no blocks of its own: "imported pools ... can only be used to
 * import pointers", CUDA Programming Guide, "Stream Ordered Memory Allocator", IPC), and
 * cuMemPoolImportPointer returns its mapping plus the offset the export data names. Access is
 * that of legacy memory (cuMemPoolSetAccess is not modeled).
 *
 * Native checkpoint of a process whose pool was exported or imported is refused: the driver
 * documentation does not say what it does with one (fail closed; scripts/gpu_check_probe.py,
 * "pool_ipc_checkpoint"). A pool never shared is carried like cuMemAlloc memory.
 * Touches the pool list (under g_mu); calls stream.c, vmm_table.c, device.c and core.c.
 */
#include "fc.h"

#define FC_KIND_POOL 4u /* the metadata page kind of a pool's memfd (fc.h: FC_KIND_*) */
#define FC_POOL_MAGIC 0xfc9001e5u
#define FC_POOL_DEFAULT_BYTES (256ull << 20)
#define FC_POOL_ALIGN 512u
#define FC_POOL_PTR_MAGIC "FCPOOLP"

struct fc_blk {
    size_t off, size;
    int used;
};

struct fc_pool {
    unsigned magic;
    struct fc_pool *next;
    CUmemPoolProps props;
    uint64_t id;                 /* the creator's pool id */
    int creator_pid;
    struct fc_dmem *arena;       /* the mapping (own: its memfd in arena->fd) */
    int imported;                /* from cuMemPoolImportFromShareableHandle */
    int exported;                /* cuMemPoolExportToShareableHandle was called */
    int nimports;                /* imported pointers not yet freed */
    struct fc_blk *blk;          /* own pools: the blocks, by offset */
    size_t nblk, capblk;
};

/* CUmemPoolPtrExportData (64 bytes) as fakecuda fills it. */
struct fc_pool_ptr_wire {
    char magic[8];               /* FC_POOL_PTR_MAGIC */
    int32_t pid, pad;
    uint64_t pool_id, off, size;
    uint8_t zero[24];
};
_Static_assert(sizeof(struct fc_pool_ptr_wire) == sizeof(CUmemPoolPtrExportData), "export data is 64 bytes");

static struct fc_pool *g_pools;
static uint64_t g_next_pool = 1;

static struct fc_pool *pool_get(CUmemoryPool h)
{
    for (struct fc_pool *p = g_pools; p; p = p->next)
        if (p == (struct fc_pool *)h)
            return p;
    return NULL;
}

/* The own pool and block holding the allocation that starts at va (g_mu held). */
static struct fc_pool *pool_of(uintptr_t va, struct fc_blk **b)
{
    for (struct fc_pool *p = g_pools; p; p = p->next)
        for (size_t i = 0; !p->imported && i < p->nblk; i++)
            if (p->blk[i].used && p->arena->va + p->blk[i].off == va) {
                *b = &p->blk[i];
                return p;
            }
    return NULL;
}

static int write_pool_meta(const struct fc_pool *p)
{
    struct fc_meta m;
    memset(&m, 0, sizeof m);
    memcpy(m.magic, FC_META_MAGIC, 8);
    m.version = FC_META_VERSION;
    m.kind = FC_KIND_POOL;
    m.size = p->arena->mapped;
    m.device = p->arena->dev;
    m.creator_pid = (int32_t)getpid();
    m.object_id = p->id;
    return pwrite(p->arena->fd, &m, sizeof m, (off_t)p->arena->mapped) == (ssize_t)sizeof m ? 0 : -1;
}

/* ------------------------------------------------------------------ create, destroy */

/* cuda.h: allocType PINNED; handleTypes NONE or POSIX_FILE_DESCRIPTOR here (FABRIC ->
 * NOT_SUPPORTED, as for cuMemCreate; others -> INVALID_VALUE); a DEVICE location with a valid
 * ordinal (else INVALID_VALUE / INVALID_DEVICE); reserved bytes and win32SecurityAttributes 0. */
static CUresult pool_create(CUmemoryPool *out, const CUmemPoolProps *pp)
{
    if (!out || !pp || pp->allocType != CU_MEM_ALLOCATION_TYPE_PINNED || pp->win32SecurityAttributes ||
        pp->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof pp->reserved; i++)
        if (pp->reserved[i])
            return CUDA_ERROR_INVALID_VALUE;
    if (pp->handleTypes == CU_MEM_HANDLE_TYPE_FABRIC)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (pp->handleTypes != CU_MEM_HANDLE_TYPE_NONE && pp->handleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(pp->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    struct fc_pool *p = calloc(1, sizeof *p);
    struct fc_dmem *d = calloc(1, sizeof *d);
    if (!p || !d) {
        free(p);
        free(d);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t cap = pp->maxSize ? pp->maxSize : FC_POOL_DEFAULT_BYTES;
    d->size = d->mapped = (cap + g_page - 1) & ~(g_page - 1);
    d->dev = pp->location.id;
    d->ctx = cur_ctx();
    d->pool = 1;
    pthread_mutex_lock(&g_mu);
    d->buffer_id = g_next_buffer++;
    CUresult r = dmem_back(d, 0) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS) {
        p->magic = FC_POOL_MAGIC;
        p->props = *pp;
        p->id = g_next_pool++;
        p->creator_pid = (int)getpid();
        p->arena = d;
        write_pool_meta(p);
        d->next = g_dmems;
        g_dmems = d;
        p->next = g_pools;
        g_pools = p;
        *out = (CUmemoryPool)p;
    }
    pthread_mutex_unlock(&g_mu);
    if (r != CUDA_SUCCESS) {
        free(p);
        free(d);
    }
    return r;
}

FC_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    API(pool_create(pool, poolProps), "pool=0x%llx", OUT64((unsigned long long *)(void *)pool));
}

/* cuMemPoolDestroy: the pool and its arena go (allocations still live are the application's
 * error; the fake frees them with it). Not a pool -> INVALID_VALUE. */
static CUresult pool_destroy(CUmemoryPool h)
{
    pthread_mutex_lock(&g_mu);
    struct fc_pool **pp = &g_pools;
    while (*pp && *pp != (struct fc_pool *)h)
        pp = &(*pp)->next;
    struct fc_pool *p = *pp;
    if (p) {
        *pp = p->next;
        struct fc_dmem **dp = &g_dmems;
        while (*dp && *dp != p->arena)
            dp = &(*dp)->next;
        if (*dp)
            *dp = p->arena->next;
        munmap((void *)p->arena->va, p->arena->mapped);
        if (p->arena->fd >= 0)
            close(p->arena->fd);
        free(p->arena->saved);
        free(p->arena);
        free(p->blk);
        free(p);
    }
    pthread_mutex_unlock(&g_mu);
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) { API(pool_destroy(pool), "pool=%p", (void *)pool); }

/* ------------------------------------------------------------------ allocate, free */

/* First fit among free blocks and the unused tail (g_mu held); 0 or -1 (out of memory). */
static int blk_alloc(struct fc_pool *p, size_t size, size_t *off)
{
    size = (size + FC_POOL_ALIGN - 1) & ~(size_t)(FC_POOL_ALIGN - 1);
    for (size_t i = 0; i < p->nblk; i++)
        if (!p->blk[i].used && p->blk[i].size == size) {
            p->blk[i].used = 1;
            *off = p->blk[i].off;
            return 0;
        }
    size_t end = p->nblk ? p->blk[p->nblk - 1].off + p->blk[p->nblk - 1].size : 0;
    if (size > p->arena->mapped - end)
        return -1;
    if (p->nblk == p->capblk) {
        size_t ncap = p->capblk ? p->capblk * 2 : 16;
        struct fc_blk *nb = realloc(p->blk, ncap * sizeof *nb);
        if (!nb)
            return -1;
        p->blk = nb;
        p->capblk = ncap;
    }
    p->blk[p->nblk++] = (struct fc_blk){end, size, 1};
    *off = end;
    return 0;
}

/* cuda.h: bytesize 0 -> INVALID_VALUE; an imported pool cannot allocate (INVALID_VALUE, the
 * fake's pick); the stream must be valid. The memory is usable in stream order from the call
 * (the fake allocates at once). */
static CUresult alloc_from_pool(CUdeviceptr *dp, size_t size, CUmemoryPool h, CUstream hs)
{
    if (!dp || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct fc_ctx *sc;
    CUresult r = stream_ctx(hs, &sc);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&g_mu);
    struct fc_pool *p = pool_get(h);
    size_t off = 0;
    r = !p || p->imported ? CUDA_ERROR_INVALID_VALUE : blk_alloc(p, size, &off) ? CUDA_ERROR_OUT_OF_MEMORY : r;
    if (r == CUDA_SUCCESS)
        *dp = (CUdeviceptr)(p->arena->va + off);
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    API(alloc_from_pool(dptr, bytesize, pool, hStream), "bytesize=%zu pool=%p stream=%p dptr=0x%llx", bytesize,
        (void *)pool, (void *)hStream, OUT64(dptr));
}
FC_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    API(alloc_from_pool(dptr, bytesize, pool, hStream), "bytesize=%zu pool=%p stream=%p dptr=0x%llx", bytesize,
        (void *)pool, (void *)hStream, OUT64(dptr));
}

/* The block goes back to its pool when the stream reaches the free (c NULL: dropped, same). */
static CUresult free_run(void *arg, struct fc_ctx *c)
{
    (void)c;
    uintptr_t va = (uintptr_t)arg;
    pthread_mutex_lock(&g_mu);
    struct fc_blk *b = NULL;
    if (pool_of(va, &b))
        b->used = 0;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* cuMemFreeAsync: an own pool allocation returns to its pool in stream order; an imported
 * pointer is let go at once (the exporter must not free before, cuda.h). Anything else ->
 * INVALID_VALUE. */
static CUresult free_async(CUdeviceptr dp, CUstream hs)
{
    pthread_mutex_lock(&g_mu);
    struct fc_blk *b = NULL;
    struct fc_pool *own = pool_of((uintptr_t)dp, &b), *imp = NULL;
    for (struct fc_pool *p = g_pools; !own && p; p = p->next)
        if (p->imported && p->nimports && dp >= p->arena->va && dp < p->arena->va + p->arena->mapped)
            imp = p;
    if (imp)
        imp->nimports--;
    pthread_mutex_unlock(&g_mu);
    if (!own)
        return imp ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    struct fc_op op = {.kind = OP_HOSTFN, .fn = free_run, .arg = (void *)(uintptr_t)dp};
    return stream_enqueue(hs, &op);
}

FC_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    API(free_async(dptr, hStream), "dptr=0x%llx stream=%p", (unsigned long long)dptr, (void *)hStream);
}
FC_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    API(free_async(dptr, hStream), "dptr=0x%llx stream=%p", (unsigned long long)dptr, (void *)hStream);
}

/* ------------------------------------------------------------------ IPC */

/* cuda.h: only a handle type the pool was created with (POSIX_FILE_DESCRIPTOR: a new fd in
 * *(int *)handle_out), flags 0, else INVALID_VALUE; an imported pool cannot be exported again. */
static CUresult pool_export(void *out, CUmemoryPool h, CUmemAllocationHandleType type, unsigned long long flags)
{
    if (!out || flags)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct fc_pool *p = pool_get(h);
    CUresult r = !p || p->imported || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
                         p->props.handleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || p->arena->fd < 0
                     ? CUDA_ERROR_INVALID_VALUE
                     : CUDA_SUCCESS;
    int fd = r == CUDA_SUCCESS && write_pool_meta(p) == 0 ? dup(p->arena->fd) : -1;
    if (r == CUDA_SUCCESS && fd < 0)
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS) {
        p->exported = 1;
        *(int *)out = fd;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool,
                                                    CUmemAllocationHandleType handleType, unsigned long long flags)
{
    API(pool_export(handle_out, pool, handleType, flags), "pool=%p type=%d flags=%llu fd=%d", (void *)pool,
        (int)handleType, flags, OUTI((int *)handle_out));
}

/* cuda.h: the fd is passed by value; a fakecuda pool's memfd only (else INVALID_VALUE), flags 0.
 * The importer maps the whole pool; its pointers come from cuMemPoolImportPointer. */
static CUresult pool_import(CUmemoryPool *out, void *handle, CUmemAllocationHandleType type, unsigned long long flags)
{
    if (!out || flags || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = (int)(intptr_t)handle;
    struct stat st;
    struct fc_meta m;
    if (fstat(fd, &st) != 0 || st.st_size < (off_t)g_page ||
        pread(fd, &m, sizeof m, st.st_size - (off_t)g_page) != (ssize_t)sizeof m ||
        memcmp(m.magic, FC_META_MAGIC, 8) != 0 || m.kind != FC_KIND_POOL || m.size + g_page != (uint64_t)st.st_size)
        return CUDA_ERROR_INVALID_VALUE;
    struct fc_pool *p = calloc(1, sizeof *p);
    struct fc_dmem *d = calloc(1, sizeof *d);
    void *va = p && d ? mmap(NULL, m.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (va == MAP_FAILED) {
        free(p);
        free(d);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    d->va = (uintptr_t)va;
    d->size = d->mapped = m.size;
    d->dev = dev_ok(m.device) ? m.device : 0;
    d->ctx = cur_ctx();
    d->fd = -1; /* the mapping holds the memfd */
    d->st_dev = st.st_dev;
    d->st_ino = st.st_ino;
    d->pool = 2;
    p->magic = FC_POOL_MAGIC;
    p->props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p->props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p->props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p->props.location.id = d->dev;
    p->id = m.object_id;
    p->creator_pid = m.creator_pid;
    p->arena = d;
    p->imported = 1;
    pthread_mutex_lock(&g_mu);
    d->buffer_id = g_next_buffer++;
    d->next = g_dmems;
    g_dmems = d;
    p->next = g_pools;
    g_pools = p;
    pthread_mutex_unlock(&g_mu);
    *out = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle,
                                                      CUmemAllocationHandleType handleType, unsigned long long flags)
{
    API(pool_import(pool_out, handle, handleType, flags), "fd=%d type=%d flags=%llu pool=0x%llx", (int)(intptr_t)handle,
        (int)handleType, flags, OUT64((unsigned long long *)(void *)pool_out));
}

/* cuda.h: ptr must be an allocation of an exportable pool (its start), else INVALID_VALUE. */
static CUresult export_pointer(CUmemPoolPtrExportData *out, CUdeviceptr dp)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct fc_blk *b = NULL;
    struct fc_pool *p = pool_of((uintptr_t)dp, &b);
    CUresult r = p && p->props.handleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ? CUDA_SUCCESS
                                                                                       : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        struct fc_pool_ptr_wire w;
        memset(&w, 0, sizeof w);
        memcpy(w.magic, FC_POOL_PTR_MAGIC, sizeof FC_POOL_PTR_MAGIC);
        w.pid = (int32_t)getpid();
        w.pool_id = p->id;
        w.off = b->off;
        w.size = b->size;
        memcpy(out, &w, sizeof w);
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *shareData_out, CUdeviceptr ptr)
{
    API(export_pointer(shareData_out, ptr), "ptr=0x%llx", (unsigned long long)ptr);
}

/* cuda.h: the pool must be the importer's pool of the exporting pool, else INVALID_VALUE. */
static CUresult import_pointer(CUdeviceptr *out, CUmemoryPool h, CUmemPoolPtrExportData *data)
{
    if (!out || !data)
        return CUDA_ERROR_INVALID_VALUE;
    struct fc_pool_ptr_wire w;
    memcpy(&w, data, sizeof w);
    pthread_mutex_lock(&g_mu);
    struct fc_pool *p = pool_get(h);
    CUresult r = p && p->imported && !memcmp(w.magic, FC_POOL_PTR_MAGIC, sizeof FC_POOL_PTR_MAGIC) &&
                         w.pid == p->creator_pid && w.pool_id == p->id && w.off + w.size <= p->arena->mapped
                     ? CUDA_SUCCESS
                     : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        p->nimports++;
        *out = (CUdeviceptr)(p->arena->va + w.off);
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool, CUmemPoolPtrExportData *shareData)
{
    API(import_pointer(ptr_out, pool, shareData), "pool=%p ptr=0x%llx", (void *)pool, OUT64(ptr_out));
}

/* ------------------------------------------------------------------ checkpoint */

/* A pool shared by IPC (exported, or imported here): the driver documentation is silent on
 * native checkpoint with one, so the fake refuses (fail closed) naming the pool. g_mu held. */
CUresult pool_ck_refusal(void)
{
    for (struct fc_pool *p = g_pools; p; p = p->next) {
        if (!p->exported && !p->imported)
            continue;
        fc_loud("checkpoint refused: pid %d holds memory pool %" PRIu64 " of pid %d %s by IPC (0x%" PRIxPTR
                ", %zu bytes); what native checkpoint does with a pool shared between processes is undocumented, the "
                "fake refuses it (scripts/gpu_check_probe.py pool_ipc_checkpoint) -> CUDA_ERROR_NOT_SUPPORTED",
                (int)getpid(), p->id, p->creator_pid, p->imported ? "imported" : "exported", p->arena->va,
                p->arena->mapped);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return CUDA_SUCCESS;
}
