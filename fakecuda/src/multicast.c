/*
 * multicast.c: multicast objects (CUDA driver API, "Multicast Object Management"):
 * cuMulticastCreate, cuMulticastAddDevice, cuMulticastBind{Mem,Addr}[_v2], cuMulticastUnbind,
 * cuMulticastGetGranularity, and the wait of a bind or map until the team is complete
 * (mc_wait_handle, called by cuMemMap). Writes through a multicast VA are the copy engine's
 * (copy.c). It touches the team state in the object's memfd, this process's bindings and the
 * VMM tables, and calls vmm_table.c, device.c and core.c.
 */
#include "fc.h"

/* ------------------------------------------------------------------ multicast objects */
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
            fc_logline("fakecuda: %s blocks until every device was added to multicast object %" PRIu64 " (%u of %u)",
                       what, mc->object_id, have, need);
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
CUresult mc_wait_handle(CUmemGenericAllocationHandle h, uintptr_t va, uint64_t off, uint64_t size, const char *what)
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
    if (g_mc_rounding && cap % g_mc_rounding) /* the r615 driver rounds the capacity up */
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
    alloc_link(a);
    pthread_mutex_unlock(&g_mu);
    if (cap != p->size)
        fc_logline("fakecuda: multicast object %" PRIu64 ": capacity %" PRIu64 " for a requested %zu "
                   "(FAKECUDA_MULTICAST_CAPACITY_ROUNDING)",
                   a->object_id, cap, p->size);
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
    API(mc_bind(mcHandle, dev < 0 ? FC_MAX_DEVICES : dev, mcOffset, 0, memHandle, 0, memOffset, size, flags), BIND_FMT,
        mcHandle, dev, mcOffset, memHandle, memOffset, size, flags);
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
    API(mc_bind(mcHandle, dev < 0 ? FC_MAX_DEVICES : dev, mcOffset, 1, 0, memptr, 0, size, flags), BINDA_FMT, mcHandle,
        dev, mcOffset, (unsigned long long)memptr, size, flags);
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
