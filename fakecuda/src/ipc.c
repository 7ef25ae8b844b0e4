/*
 * ipc.c: legacy CUDA IPC of cuMemAlloc memory (CUDA driver API, "Memory Management":
 * cuIpcGetMemHandle, cuIpcOpenMemHandle[_v2], cuIpcCloseMemHandle; cuda.h 13.1 and
 * https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html). Every cuMemAlloc buffer
 * is a memfd (memory.c); the 64-byte handle (struct fc_ipc_wire) names the exporter's pid, the
 * memfd's fd number and inode; an importer opens /proc/<pid>/fd/<fd> (same uid, as multicast
 * writes do), maps it shared at an address fakecuda picks and records itself in the memfd's
 * metadata page, so both processes see the same bytes and the exporter's native checkpoint can
 * refuse. It touches the cuMemAlloc table, and calls vmm_table.c, device.c and core.c.
 */
#include "fc.h"

/* ------------------------------------------------------------------ cuIpcGetMemHandle */

/* cuda.h: "Takes a pointer to the base of an existing device memory allocation created with
 * cuMemAlloc"; the handle of a buffer is the same on every call. A pointer inside a buffer but
 * not at its base, VMM memory (cuMemCreate + cuMemMap: shared through
 * cuMemExportToShareableHandle instead), memory opened from another process, or no device
 * memory -> CUDA_ERROR_INVALID_VALUE (the reason goes to the call log). No context ->
 * CUDA_ERROR_INVALID_CONTEXT. */
static CUresult ipc_get(CUipcMemHandle *h, CUdeviceptr p)
{
    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    if (!cur_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_mu);
    struct fc_dmem *d = dmem_find((uintptr_t)p);
    const char *why = NULL;
    if (!d)
        why = map_find((uintptr_t)p) ? "VMM memory (cuMemCreate/cuMemMap) is shared with cuMemExportToShareableHandle"
                                     : "not device memory allocated with cuMemAlloc";
    else if (d->pool)
        why = "memory pool memory is shared with cuMemPoolExportPointer";
    else if (d->ipc_refs)
        why = "memory opened by cuIpcOpenMemHandle cannot be exported again";
    else if (d->va != (uintptr_t)p)
        why = "not the base of its cuMemAlloc allocation (cuda.h: pass the base pointer)";
    else if (d->fd < 0)
        why = "the buffer has no backing (checkpointed)";
    if (!why) {
        struct fc_ipc_wire w;
        memset(&w, 0, sizeof w);
        memcpy(w.magic, FC_IPC_MAGIC, sizeof FC_IPC_MAGIC);
        w.pid = (int32_t)getpid();
        w.fd = d->fd;
        w.st_dev = (uint64_t)d->st_dev;
        w.st_ino = (uint64_t)d->st_ino;
        w.va = (uint64_t)d->va;
        w.size = (uint64_t)d->size;
        w.buffer_id = d->buffer_id;
        w.device = d->dev;
        memcpy(h, &w, sizeof w);
    }
    pthread_mutex_unlock(&g_mu);
    if (why)
        fc_logline("fakecuda: cuIpcGetMemHandle(0x%llx): %s -> CUDA_ERROR_INVALID_VALUE", (unsigned long long)p, why);
    return why ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

FC_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    API(ipc_get(pHandle, dptr), "dptr=0x%llx", (unsigned long long)dptr);
}

/* ------------------------------------------------------------------ cuIpcOpenMemHandle */

static struct fc_dmem *import_find(uint64_t st_dev, uint64_t st_ino)
{
    for (struct fc_dmem *d = g_dmems; d; d = d->next)
        if (d->ipc_refs && (uint64_t)d->st_dev == st_dev && (uint64_t)d->st_ino == st_ino)
            return d;
    return NULL;
}

/* Map the exporter's memfd (already opened as fd, identity checked) and claim a slot in its
 * metadata page. Call with g_mu held. */
static CUresult import_map(int fd, const struct fc_ipc_wire *w, struct fc_ctx *c, CUdeviceptr *out)
{
    size_t mapped = ((size_t)w->size + g_page - 1) & ~(g_page - 1);
    struct stat st;
    struct fc_meta meta;
    if (w->size == 0 || fstat(fd, &st) != 0 || (uint64_t)st.st_size != mapped + g_page ||
        pread(fd, &meta, sizeof meta, (off_t)mapped) != (ssize_t)sizeof meta ||
        memcmp(meta.magic, FC_META_MAGIC, 8) != 0 || meta.kind != FC_KIND_MEMALLOC || meta.size != mapped ||
        meta.object_id != w->buffer_id)
        return CUDA_ERROR_INVALID_HANDLE; /* not the buffer the handle names */
    struct fc_dmem *d = calloc(1, sizeof *d);
    if (!d)
        return CUDA_ERROR_OUT_OF_MEMORY;
    void *va = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    void *pg = va == MAP_FAILED ? MAP_FAILED
                                : mmap(NULL, g_page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)mapped);
    if (pg == MAP_FAILED) {
        if (va != MAP_FAILED)
            munmap(va, mapped);
        free(d);
        return CUDA_ERROR_MAP_FAILED;
    }
    d->ipc_page = pg;
    d->ipc_slot = -1;
    for (int i = 0; i < FC_IPC_SLOTS && d->ipc_slot < 0; i++) {
        int32_t zero = 0;
        if (__atomic_compare_exchange_n(&d->ipc_page->importers[i], &zero, (int32_t)getpid(), 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST))
            d->ipc_slot = i;
    }
    if (d->ipc_slot < 0) {
        munmap(va, mapped);
        munmap(pg, g_page);
        free(d);
        fc_loud("cuIpcOpenMemHandle: buffer %" PRIu64 " of pid %d is already open in %d processes -> "
                "CUDA_ERROR_TOO_MANY_PEERS",
                w->buffer_id, w->pid, FC_IPC_SLOTS);
        return CUDA_ERROR_TOO_MANY_PEERS;
    }
    d->va = (uintptr_t)va;
    d->size = (size_t)w->size;
    d->mapped = mapped;
    d->dev = dev_ok(w->device) ? w->device : c->dev; /* the memory lives on the exporter's device */
    d->ctx = c;
    d->fd = -1; /* the mapping holds the memfd */
    d->st_dev = st.st_dev;
    d->st_ino = st.st_ino;
    d->buffer_id = g_next_buffer++;
    d->ipc_refs = 1;
    d->ipc_pid = w->pid;
    d->next = g_dmems;
    g_dmems = d;
    *out = (CUdeviceptr)d->va;
    return CUDA_SUCCESS;
}

/* cuda.h: Flags "must be specified as CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS" (anything else ->
 * INVALID_VALUE); a handle already open in this process returns the same pointer and counts
 * one more reference. Opening in the exporting process -> CUDA_ERROR_INVALID_CONTEXT (the
 * driver's "invalid device context": openucx/ucx #11603, #11226). A handle that is not
 * fakecuda's, or whose buffer was freed (or checkpointed, or whose process exited) ->
 * CUDA_ERROR_INVALID_HANDLE. */
static CUresult ipc_open(CUdeviceptr *out, CUipcMemHandle h, unsigned flags)
{
    if (!out || flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return CUDA_ERROR_INVALID_VALUE;
    struct fc_ctx *c = cur_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct fc_ipc_wire w;
    memcpy(&w, &h, sizeof w);
    if (memcmp(w.magic, FC_IPC_MAGIC, sizeof FC_IPC_MAGIC) != 0 || w.pid <= 0 || w.fd < 0)
        return CUDA_ERROR_INVALID_HANDLE;
    if (w.pid == (int32_t)getpid()) {
        fc_logline("fakecuda: cuIpcOpenMemHandle: buffer %" PRIu64 " was exported by this process (pid %d); "
                   "use its pointer 0x%llx directly -> CUDA_ERROR_INVALID_CONTEXT",
                   w.buffer_id, w.pid, (unsigned long long)w.va);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    pthread_mutex_lock(&g_mu);
    struct fc_dmem *d = import_find(w.st_dev, w.st_ino);
    if (d) {
        d->ipc_refs++;
        *out = (CUdeviceptr)d->va;
        pthread_mutex_unlock(&g_mu);
        return CUDA_SUCCESS;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)w.pid, (int)w.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    CUresult r = CUDA_ERROR_INVALID_HANDLE;
    if (fd >= 0 && fstat(fd, &st) == 0 && (uint64_t)st.st_dev == w.st_dev && (uint64_t)st.st_ino == w.st_ino)
        r = import_map(fd, &w, c, out);
    else
        fc_logline("fakecuda: cuIpcOpenMemHandle: buffer %" PRIu64 " of pid %d is gone (%s: %s) -> "
                   "CUDA_ERROR_INVALID_HANDLE",
                   w.buffer_id, w.pid, path, fd < 0 ? strerror(errno) : "another file");
    if (fd >= 0)
        close(fd);
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    API(ipc_open(pdptr, handle, Flags), "flags=%u dptr=0x%llx", Flags, OUT64(pdptr));
}

/* The v1 ELF name (PFN_cuIpcOpenMemHandle_v4010): the same ABI. */
FC_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    API(ipc_open(pdptr, handle, Flags), "flags=%u dptr=0x%llx", Flags, OUT64(pdptr));
}

/* ------------------------------------------------------------------ cuIpcCloseMemHandle */

/* cuda.h: drops one reference; at zero unmaps (the exporter and other importers are
 * unaffected). dptr must be a pointer cuIpcOpenMemHandle returned, else INVALID_VALUE; no
 * context -> INVALID_CONTEXT. */
static CUresult ipc_close(CUdeviceptr p)
{
    if (!cur_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_mu);
    struct fc_dmem **pp = &g_dmems;
    while (*pp && !((*pp)->va == (uintptr_t)p && (*pp)->ipc_refs))
        pp = &(*pp)->next;
    struct fc_dmem *d = *pp;
    int found = d != NULL;
    if (d && --d->ipc_refs == 0) {
        *pp = d->next;
        if (d->saved) /* checkpointed under FAKECUDA_LAUNCH_JOB: the range is a reservation */
            free(d->saved);
        munmap((void *)d->va, d->mapped);
        if (d->ipc_page) {
            __atomic_store_n(&d->ipc_page->importers[d->ipc_slot], 0, __ATOMIC_SEQ_CST);
            munmap(d->ipc_page, g_page);
        }
        free(d);
    }
    pthread_mutex_unlock(&g_mu);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    API(ipc_close(dptr), "dptr=0x%llx", (unsigned long long)dptr);
}
