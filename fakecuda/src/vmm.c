/*
 * vmm.c: the VMM API (CUDA driver API, "Virtual Memory Management"):
 * cuMemGetAllocationGranularity, cuMemCreate, cuMemRelease, cuMemAddressReserve/Free,
 * cuMemMap/Unmap, cuMemSetAccess/GetAccess, cuMemExportToShareableHandle,
 * cuMemImportFromShareableHandle, cuMemRetainAllocationHandle,
 * cuMemGetAllocationPropertiesFromHandle; multicast objects go through the same calls. It
 * touches the VMM tables, and calls multicast.c (a map of a multicast object waits for its
 * team), vmm_table.c, device.c and core.c.
 */
#include "fc.h"

/* ------------------------------------------------------------------ VMM API */

/* A host NUMA node id: 0, or a node the kernel lists (/sys/devices/system/node/node<id>). cuda.h:
 * "On systems where NUMA is not available ... id must be set to 0". */
static int numa_node_ok(int id)
{
    if (id == 0)
        return 1;
    char path[64];
    snprintf(path, sizeof path, "/sys/devices/system/node/node%d", id);
    return id > 0 && access(path, F_OK) == 0;
}

/* cuda.h (cuMemCreate): a DEVICE location names a device; HOST ignores the id and is "not IPC
 * capable": requestedHandleTypes must be 0, else INVALID_VALUE; HOST_NUMA names a NUMA node
 * (POSIX FD allowed: NCCL's SHM transport, driver >= 12.6); HOST_NUMA_CURRENT "will result in
 * CUDA_ERROR_INVALID_VALUE". */
static CUresult check_prop(const CUmemAllocationProp *p, int for_create)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    switch (p->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        if (!dev_ok(p->location.id))
            return CUDA_ERROR_INVALID_DEVICE;
        break;
    case CU_MEM_LOCATION_TYPE_HOST:
        if (p->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE)
            return CUDA_ERROR_INVALID_VALUE;
        break;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
        if (!numa_node_ok(p->location.id))
            return CUDA_ERROR_INVALID_VALUE;
        break;
    default: return CUDA_ERROR_INVALID_VALUE; /* HOST_NUMA_CURRENT, NONE, unknown */
    }
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
    int dev = prop_is_host(p) ? -1 : p->location.id; /* host memory does not count against a device */
    pthread_mutex_lock(&g_mu);
    if (dev >= 0 && g_used[dev] + size > dev_get(dev)->mem) { /* the device's own size */
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
    a->block_id = g_next_buffer++;
    a->kind = FC_KIND_ALLOCATION;
    if (write_meta(fd, a) != 0 || handle_new(a, h) != 0) {
        close(fd);
        free(a);
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (dev >= 0)
        g_used[dev] += size;
    alloc_link(a);
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
                "behaviour)",
                h, h < g_nhandles ? "stale (already released)" : "unknown");
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

static CUresult addr_reserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags)
{
    if (!ptr || size == 0 || size % g_page || flags != 0 || addr % g_page || (align & (align - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    if (align < g_gran)
        align = g_gran;
    void *p = MAP_FAILED;
    const int mf = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    if (addr && g_hint_mode == HINT_FAIL)
        return CUDA_ERROR_OUT_OF_MEMORY; /* some drivers refuse hinted reservations (NVIDIA DALI #3128) */
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
    struct fc_map *inside = map_at(map_lower((uintptr_t)ptr)); /* the first mapping at or above ptr */
    if (inside && inside->va - (uintptr_t)ptr < size) {
        pthread_mutex_unlock(&g_mu);
        fc_loud("cuMemAddressFree(0x%llx, %zu): range still has mappings (unmap first)", (unsigned long long)ptr, size);
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

static CUresult mem_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                        unsigned long long flags)
{
    if (offset != 0 && !g_map_offsets) { /* an allocation maps from offset 0 only (cuda.h:
                                          * "currently must be zero"; R580 answers
                                          * CUDA_ERROR_NOT_SUPPORTED, docs/gpu-validation.md) */
        pthread_mutex_lock(&g_mu);
        struct fc_handle *e0 = handle_get(h);
        int allocation = e0 && e0->alloc->kind == FC_KIND_ALLOCATION;
        pthread_mutex_unlock(&g_mu);
        if (allocation)
            return CUDA_ERROR_NOT_SUPPORTED;
    }
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
    if (r == CUDA_SUCCESS && map_overlapping(ptr, size))
        r = CUDA_ERROR_INVALID_VALUE; /* mapping over a mapping */
    if (r == CUDA_SUCCESS && e->alloc->fd < 0)
        r = CUDA_ERROR_ILLEGAL_STATE;
    if (r == CUDA_SUCCESS) {
        m = calloc(1, sizeof *m);
        if (m)
            m->acc = calloc(size / g_gran, FC_ACC_SLOTS);
        if (!m || !m->acc)
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r == CUDA_SUCCESS) {
        m->va = (uintptr_t)ptr;
        m->size = size;
        m->offset = offset;
        m->alloc = e->alloc;
        m->handle = h;
        if (map_link(m) != 0)
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r == CUDA_SUCCESS && e->alloc->kind == FC_KIND_MULTICAST) {
        /* a multicast VA has no memory of its own: it stays a PROT_NONE reservation and the
         * copy engine sends writes to the bound members */
    } else if (r == CUDA_SUCCESS &&
               mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, e->alloc->fd, (off_t)offset) == MAP_FAILED) {
        map_unlink(m);
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r != CUDA_SUCCESS) {
        if (m)
            free(m->acc);
        free(m);
        pthread_mutex_unlock(&g_mu);
        return r;
    }
    m->buffer_id = g_next_buffer++;
    e->alloc->maps++;
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
    CUresult r = resv_find(lo, size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    size_t first = map_lower(lo), end = first;
    struct fc_map *before = first ? map_at(first - 1) : NULL;
    if (before && before->va + before->size > lo)
        r = CUDA_ERROR_INVALID_VALUE; /* would split a mapping */
    for (; r == CUDA_SUCCESS && end < map_count() && map_at(end)->va < hi; end++)
        if (map_at(end)->va + map_at(end)->size > hi)
            r = CUDA_ERROR_INVALID_VALUE; /* would split a mapping */
    if (r == CUDA_SUCCESS && end == first)
        r = CUDA_ERROR_INVALID_VALUE;
    for (size_t n = r == CUDA_SUCCESS ? end - first : 0; n; n--) {
        struct fc_map *m = map_at(first);
        map_unlink(m);
        make_reserved(m->va, m->size);
        struct fc_alloc *a = m->alloc;
        a->maps--;
        free(m->acc);
        free(m);
        alloc_maybe_free(a);
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
    int host_loc = 0;
    for (size_t i = 0; i < count; i++) {
        int t = desc[i].location.type;
        if (t == CU_MEM_LOCATION_TYPE_HOST || t == CU_MEM_LOCATION_TYPE_HOST_NUMA)
            host_loc = 1; /* the id is ignored (cuda.h) */
        else if (t != CU_MEM_LOCATION_TYPE_DEVICE)
            return CUDA_ERROR_INVALID_VALUE;
        else if (!dev_ok(desc[i].location.id))
            return CUDA_ERROR_INVALID_DEVICE;
        unsigned f = (unsigned)desc[i].flags;
        if (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
    }
    uintptr_t lo = (uintptr_t)ptr, hi = lo + size;
    pthread_mutex_lock(&g_mu);
    for (uintptr_t p = lo; p < hi; p += g_gran) {
        struct fc_map *m = map_find(p);
        /* range not fully mapped; or a host location for memory that is not host-located
         * (cuda.h: "Users cannot specify CU_MEM_LOCATION_TYPE_HOST_NUMA accessibility for
         * allocations created on with other location types") */
        if (!m || (host_loc && (m->alloc->kind != FC_KIND_ALLOCATION || !prop_is_host(&m->alloc->prop)))) {
            pthread_mutex_unlock(&g_mu);
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    struct fc_map *m0 = map_overlapping(lo, size);
    for (size_t k = m0 ? map_lower(m0->va) : map_count(); k < map_count() && map_at(k)->va < hi; k++) {
        struct fc_map *m = map_at(k);
        for (size_t g = 0; g < m->size / g_gran; g++) {
            uintptr_t gva = m->va + g * g_gran;
            if (gva < lo || gva >= hi)
                continue;
            for (size_t i = 0; i < count; i++) {
                size_t slot = desc[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE ? (size_t)desc[i].location.id
                                                                                   : FC_ACC_HOST;
                m->acc[g * FC_ACC_SLOTS + slot] = (unsigned char)desc[i].flags;
            }
        }
        map_apply_prot(m);
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    API(set_access(ptr, size, desc, count), "ptr=0x%llx size=%zu count=%zu loc0=%d flags0=%d", (unsigned long long)ptr,
        size, count, desc && count ? desc[0].location.id : -1, desc && count ? (int)desc[0].flags : -1);
}

static CUresult get_access(unsigned long long *flags, const CUmemLocation *loc, CUdeviceptr ptr)
{
    int host = loc && (loc->type == CU_MEM_LOCATION_TYPE_HOST || loc->type == CU_MEM_LOCATION_TYPE_HOST_NUMA);
    if (!flags || !loc || (!host && loc->type != CU_MEM_LOCATION_TYPE_DEVICE))
        return CUDA_ERROR_INVALID_VALUE;
    if (!host && !dev_ok(loc->id))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct fc_map *m = map_find((uintptr_t)ptr);
    if (m)
        *flags = m->acc[((uintptr_t)ptr - m->va) / g_gran * FC_ACC_SLOTS + (host ? FC_ACC_HOST : (size_t)loc->id)];
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
    else if (e->imported && e->alloc->kind == FC_KIND_ALLOCATION)
        r = CUDA_ERROR_INVALID_VALUE; /* R580: an imported allocation cannot be exported again */
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
    if (fd < 0 || fstat(fd, &st) != 0)
        return CUDA_ERROR_UNKNOWN; /* a closed or bad descriptor: the real driver's (R580) answer */
    /* Not a fakecuda allocation or multicast memfd (any other file): the real driver's answer
     * to a descriptor it did not export is CUDA_ERROR_UNKNOWN (R580, a memfd). */
    if (!S_ISREG(st.st_mode) || (size_t)st.st_size < g_page)
        return CUDA_ERROR_UNKNOWN;
    if (pread(fd, &meta, sizeof meta, st.st_size - (off_t)g_page) != (ssize_t)sizeof meta ||
        memcmp(meta.magic, FC_META_MAGIC, 8) != 0 || meta.version != FC_META_VERSION ||
        (meta.kind != FC_KIND_ALLOCATION && meta.kind != FC_KIND_MULTICAST) ||
        meta.size + g_page != (uint64_t)st.st_size || (meta.kind == FC_KIND_MULTICAST && meta.size != team_len()))
        return CUDA_ERROR_UNKNOWN;
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
            a->block_id = g_next_buffer++;
        }
    }
    if (r == CUDA_SUCCESS && handle_new(a, h) != 0)
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS)
        g_handles[*h].imported = 1;
    if (fresh) {
        if (r == CUDA_SUCCESS) {
            alloc_link(a);
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
    if (e) {
        *prop = e->alloc->prop;
        if (e->imported) /* the real driver (R580) reports no requested handle types for an import */
            prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    }
    pthread_mutex_unlock(&g_mu);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                          CUmemGenericAllocationHandle handle)
{
    API(mem_props(prop, handle), "handle=%llu", handle);
}
