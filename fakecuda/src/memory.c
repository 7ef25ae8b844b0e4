/*
 * memory.c: memory that is not VMM. cuMemAlloc buffers (cuMemAlloc, cuMemFree, cuMemGetInfo,
 * cuMemGetAddressRange), page-locked host memory (cuMemHostRegister/Unregister,
 * cuMemAllocHost, cuMemFreeHost), and the copies and sets (cuMemcpy*, cuMemset*), queued on a
 * stream or run in the caller. It touches the cuMemAlloc and host-memory tables, and calls
 * stream.c, copy.c, vmm_table.c, device.c and core.c.
 */
#include "fc.h"

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
    struct fc_dmem *d = NULL;
    if (g_used[c->dev] + mapped > dev_get(c->dev)->mem || !(d = calloc(1, sizeof *d)))
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS) {
        d->size = size;
        d->mapped = mapped;
        d->dev = c->dev;
        d->ctx = c;
        d->buffer_id = g_next_buffer++;
        if (dmem_back(d, 0) != 0) /* a memfd, so that cuIpcGetMemHandle can share it */
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r == CUDA_SUCCESS) {
        d->next = g_dmems;
        g_dmems = d;
        g_used[c->dev] += mapped;
        *dp = (CUdeviceptr)d->va;
    } else {
        free(d);
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    API(mem_alloc(dptr, bytesize), "bytesize=%zu dptr=0x%llx", bytesize, OUT64(dptr));
}

/* cuMemFree of an own buffer. A pointer from cuIpcOpenMemHandle is refused (INVALID_VALUE: it
 * is released by cuIpcCloseMemHandle, cuda.h). Freeing a buffer another process has open keeps
 * the bytes for that importer until it closes (its mapping holds the memfd; cuda.h calls this
 * undefined behaviour); new opens of the old handle fail. */
static CUresult mem_free(CUdeviceptr p)
{
    if (p == 0)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    struct fc_dmem **pp = &g_dmems;
    while (*pp && (*pp)->va != (uintptr_t)p)
        pp = &(*pp)->next;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (*pp && (*pp)->cs_op) {
        fc_logline("fakecuda: cuMemFree(0x%llx): a custom-storage mapping of another process's GPU memory; "
                   "cuCheckpointOperationComplete unmaps it -> CUDA_ERROR_INVALID_VALUE",
                   (unsigned long long)p);
    } else if (*pp && (*pp)->pool) {
        fc_logline("fakecuda: cuMemFree(0x%llx): a memory pool's memory; free its allocations with cuMemFreeAsync "
                   "-> CUDA_ERROR_INVALID_VALUE",
                   (unsigned long long)p);
    } else if (*pp && (*pp)->ipc_refs) {
        fc_logline("fakecuda: cuMemFree(0x%llx): memory opened by cuIpcOpenMemHandle; close it with "
                   "cuIpcCloseMemHandle -> CUDA_ERROR_INVALID_VALUE",
                   (unsigned long long)p);
    } else if (*pp) {
        struct fc_dmem *d = *pp;
        *pp = d->next;
        g_used[d->dev] -= d->mapped;
        munmap((void *)d->va, d->mapped);
        if (d->fd >= 0)
            close(d->fd);
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
    *tot = (size_t)dev_get(c->dev)->mem;
    *fr = (size_t)(dev_get(c->dev)->mem - g_used[c->dev]);
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
    struct fc_ctx *ctx;          /* the context it was allocated or registered in */
    uint64_t buffer_id;          /* CU_POINTER_ATTRIBUTE_BUFFER_ID */
};
static struct fc_hostmem *g_hostmem;

/* Page-locked host memory containing p: 1 with its range, context and buffer id, else 0.
 * Call with g_mu held. */
int hostmem_find(uintptr_t p, uintptr_t *va, size_t *size, struct fc_ctx **ctx, uint64_t *buffer_id)
{
    for (struct fc_hostmem *h = g_hostmem; h; h = h->next)
        if (p >= h->va && p - h->va < h->size) {
            *va = h->va;
            *size = h->size;
            *ctx = h->ctx;
            *buffer_id = h->buffer_id;
            return 1;
        }
    return 0;
}

static CUresult host_register(void *p, size_t size, unsigned flags)
{
    if (!cur_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!p || size == 0 ||
        (flags & ~(unsigned)(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY |
                             CU_MEMHOSTREGISTER_READ_ONLY)))
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
        h->ctx = cur_ctx();
        h->buffer_id = g_next_buffer++;
        h->next = g_hostmem;
        g_hostmem = h;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* The first shared mapping (MAP_SHARED: a file, /dev/shm or memfd) overlapping [lo, hi) in
 * /proc/self/maps: 1 with its line's path, else 0. */
static int shared_mapping_in(uintptr_t lo, uintptr_t hi, char *path, size_t cap)
{
    FILE *f = fopen("/proc/self/maps", "re");
    char line[512];
    int found = 0;
    while (f && !found && fgets(line, sizeof line, f)) {
        unsigned long a, b;
        char perms[8] = "";
        int off = 0;
        if (sscanf(line, "%lx-%lx %7s %*s %*s %*s%n", &a, &b, perms, &off) < 3 || perms[3] != 's' || b <= lo || a >= hi)
            continue;
        const char *q = line + off;
        while (*q == ' ')
            q++;
        snprintf(path, cap, "%s", q);
        path[strcspn(path, "\n")] = 0;
        found = 1;
    }
    if (f)
        fclose(f);
    return found;
}

/* Native checkpoint of a process with cuMemHostRegister over shared memory (NCCL's SHM
 * transport registers its /dev/shm/nccl-* mappings PORTABLE|MAPPED, src/misc/shmutils.cc): the
 * driver documentation does not say whether a restore pins the pages the mapping then holds (a
 * file CRIU recreated) or keeps another process's view, so the fake refuses (fail closed;
 * scripts/gpu_check_probe.py "hostregister_shared_checkpoint"). g_mu held. */
CUresult hostmem_ck_refusal(void)
{
    for (struct fc_hostmem *h = g_hostmem; h; h = h->next) {
        char path[256] = "";
        if (h->allocated || !shared_mapping_in(h->va, h->va + h->size, path, sizeof path))
            continue;
        fc_loud("checkpoint refused: pid %d registered 0x%" PRIxPTR " (%zu bytes) with cuMemHostRegister over a shared "
                "mapping (%s); what native checkpoint does with a registration of shared memory is undocumented, the "
                "fake refuses it (scripts/gpu_check_probe.py hostregister_shared_checkpoint): cuMemHostUnregister it "
                "first (nothing was changed; unlock resumes) -> CUDA_ERROR_NOT_SUPPORTED",
                (int)getpid(), h->va, h->size, path[0] ? path : "anonymous");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return CUDA_SUCCESS;
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
    h->ctx = cur_ctx();
    pthread_mutex_lock(&g_mu);
    h->buffer_id = g_next_buffer++;
    h->next = g_hostmem;
    g_hostmem = h;
    pthread_mutex_unlock(&g_mu);
    *pp = p;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags)
{
    API(host_register(p, bytesize, Flags), "p=%p bytesize=%zu flags=%u", p, bytesize, Flags);
}
FC_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    API(host_register(p, bytesize, Flags), "p=%p bytesize=%zu flags=%u", p, bytesize, Flags);
}
/* cuda.h, cuMemHostGetDevicePointer: the device pointer of page-locked host memory (fakecuda:
 * the host pointer, as the driver gives on devices with
 * CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM); Flags must be 0 and p inside memory that
 * cuMemHostRegister or cuMemAllocHost made, else INVALID_VALUE. NCCL's SHM transport asks it
 * for its registered /dev/shm buffers (src/misc/shmutils.cc). */
static CUresult host_device_pointer(CUdeviceptr *out, void *p, unsigned flags)
{
    if (!out || flags)
        return CUDA_ERROR_INVALID_VALUE;
    uintptr_t va;
    size_t size;
    struct fc_ctx *ctx;
    uint64_t id;
    pthread_mutex_lock(&g_mu);
    int found = hostmem_find((uintptr_t)p, &va, &size, &ctx, &id);
    pthread_mutex_unlock(&g_mu);
    if (found)
        *out = (CUdeviceptr)(uintptr_t)p;
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags)
{
    API(host_device_pointer(pdptr, p, Flags), "p=%p flags=%u dptr=0x%llx", p, Flags, OUT64(pdptr));
}
FC_EXPORT CUresult cuMemHostUnregister(void *p) { API(host_release(p, 0), "p=%p", p); }
FC_EXPORT CUresult cuMemAllocHost(void **pp, unsigned int bytesize)
{
    API(host_alloc(pp, bytesize), "bytesize=%u p=%p", bytesize, (r_ == CUDA_SUCCESS && pp) ? *pp : NULL);
}
FC_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    API(host_alloc(pp, bytesize), "bytesize=%zu p=%p", bytesize, (r_ == CUDA_SUCCESS && pp) ? *pp : NULL);
}
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
    CUresult r = precheck_copy(dst, dk);
    if (r == CUDA_SUCCESS)
        r = precheck_copy(src, sk);
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
    CUresult r = precheck_copy(dst, PTR_DEVICE);
    if (r != CUDA_SUCCESS)
        return r;
    return async ? stream_enqueue(hs, &op) : sync_op(&op);
}

#define H(x) ((uintptr_t)(x))
#define COPY_FMT "dst=0x%llx src=0x%llx bytes=%zu"
#define COPY_ARGS(d, s, n) (unsigned long long)H(d), (unsigned long long)H(s), (size_t)(n)

FC_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n)
{
    API(do_copy(H(d), PTR_DEVICE, H(s), PTR_HOST, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n));
}
FC_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void *s, size_t n)
{
    API(do_copy(H(d), PTR_DEVICE, H(s), PTR_HOST, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n));
}
FC_EXPORT CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n)
{
    API(do_copy(H(d), PTR_HOST, H(s), PTR_DEVICE, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n));
}
FC_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *d, CUdeviceptr s, size_t n)
{
    API(do_copy(H(d), PTR_HOST, H(s), PTR_DEVICE, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n));
}
FC_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n)
{
    API(do_copy(H(d), PTR_DEVICE, H(s), PTR_DEVICE, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n));
}
FC_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr d, CUdeviceptr s, size_t n)
{
    API(do_copy(H(d), PTR_DEVICE, H(s), PTR_DEVICE, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n));
}
FC_EXPORT CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n)
{
    API(do_copy(H(d), PTR_UNIFIED, H(s), PTR_UNIFIED, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n));
}
FC_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr d, CUdeviceptr s, size_t n)
{
    API(do_copy(H(d), PTR_UNIFIED, H(s), PTR_UNIFIED, n, NULL, 0), COPY_FMT, COPY_ARGS(d, s, n));
}

#define ACOPY_FMT COPY_FMT " stream=%p"
FC_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, CUstream st)
{
    API(do_copy(H(d), PTR_DEVICE, H(s), PTR_HOST, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st);
}
FC_EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void *s, size_t n, CUstream st)
{
    API(do_copy(H(d), PTR_DEVICE, H(s), PTR_HOST, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st);
}
FC_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, CUstream st)
{
    API(do_copy(H(d), PTR_HOST, H(s), PTR_DEVICE, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st);
}
FC_EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *d, CUdeviceptr s, size_t n, CUstream st)
{
    API(do_copy(H(d), PTR_HOST, H(s), PTR_DEVICE, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st);
}
FC_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{
    API(do_copy(H(d), PTR_DEVICE, H(s), PTR_DEVICE, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st);
}
FC_EXPORT CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{
    API(do_copy(H(d), PTR_DEVICE, H(s), PTR_DEVICE, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st);
}
FC_EXPORT CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{
    API(do_copy(H(d), PTR_UNIFIED, H(s), PTR_UNIFIED, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st);
}
FC_EXPORT CUresult cuMemcpyAsync_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{
    API(do_copy(H(d), PTR_UNIFIED, H(s), PTR_UNIFIED, n, st, 1), ACOPY_FMT, COPY_ARGS(d, s, n), (void *)st);
}

#define SET_FMT "dst=0x%llx value=%u count=%zu"
FC_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n)
{
    API(do_set(H(d), OP_SET8, v, n, NULL, 0), SET_FMT, (unsigned long long)d, (unsigned)v, n);
}
FC_EXPORT CUresult cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char v, size_t n)
{
    API(do_set(H(d), OP_SET8, v, n, NULL, 0), SET_FMT, (unsigned long long)d, (unsigned)v, n);
}
FC_EXPORT CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n)
{
    API(do_set(H(d), OP_SET16, v, n, NULL, 0), SET_FMT, (unsigned long long)d, (unsigned)v, n);
}
FC_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n)
{
    API(do_set(H(d), OP_SET32, v, n, NULL, 0), SET_FMT, (unsigned long long)d, v, n);
}
FC_EXPORT CUresult cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int v, size_t n)
{
    API(do_set(H(d), OP_SET32, v, n, NULL, 0), SET_FMT, (unsigned long long)d, v, n);
}
FC_EXPORT CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream st)
{
    API(do_set(H(d), OP_SET8, v, n, st, 1), SET_FMT " stream=%p", (unsigned long long)d, (unsigned)v, n, (void *)st);
}
FC_EXPORT CUresult cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char v, size_t n, CUstream st)
{
    API(do_set(H(d), OP_SET8, v, n, st, 1), SET_FMT " stream=%p", (unsigned long long)d, (unsigned)v, n, (void *)st);
}
FC_EXPORT CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream st)
{
    API(do_set(H(d), OP_SET32, v, n, st, 1), SET_FMT " stream=%p", (unsigned long long)d, v, n, (void *)st);
}
FC_EXPORT CUresult cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int v, size_t n, CUstream st)
{
    API(do_set(H(d), OP_SET32, v, n, st, 1), SET_FMT " stream=%p", (unsigned long long)d, v, n, (void *)st);
}
