/*
 * device.c: devices and contexts. The device table (ordinals, UUIDs, attributes), the
 * contexts (primary and created, the per-thread context stack) and their API: cuDevice*,
 * cuDevicePrimaryCtx*, cuCtx*. The node's devices come from FAKECUDA_DEVICES (or
 * FAKECUDA_DEVICE_COUNT alike ones), this process's ordinals from CUDA_VISIBLE_DEVICES (see
 * dev_config and docs/fakecuda.md "Devices"). It touches the device tables, the context list
 * and the calling thread's stack, and calls only core.c.
 */
#include "fc.h"

/* ------------------------------------------------------------------ devices */

struct fc_ctx g_prim[FC_MAX_DEVICES];
static struct fc_ctx *g_ctxs; /* every context, primary or created (never freed) */

int dev_ok(CUdevice d) { return d >= 0 && d < g_ndev; }

/* The node's devices (FAKECUDA_DEVICES, else FAKECUDA_DEVICE_COUNT alike ones) by physical index:
 * what the kernel-mode driver sees, whatever CUDA_VISIBLE_DEVICES says; and this process's view of
 * them by ordinal (CUDA_VISIBLE_DEVICES). A native restore with gpuPairs rewrites both (every node
 * entry and every ordinal, checkpoint_target.c), so the same ordinal then names the new GPU. */
static struct fc_dev g_phys[FC_MAX_DEVICES];
static int g_nphys;
static pthread_once_t g_node_once = PTHREAD_ONCE_INIT;
struct fc_dev g_dev[FC_MAX_DEVICES];

static void id_uuid(unsigned id, CUuuid *u)
{
    static const char base[16] = "fakecudaGPU-uuid";
    memcpy(u->bytes, base, 16);
    u->bytes[15] = (char)id;
    u->bytes[14] = (char)(id >> 8);
}

void dev_uuid(int d, CUuuid *u)
{
    if (dev_ok(d))
        *u = g_dev[d].uuid;
    else
        id_uuid((unsigned)d, u);
}

const struct fc_dev *dev_get(int d) { return dev_ok(d) ? &g_dev[d] : NULL; }

static void node_build(void);

int node_count(void)
{
    pthread_once(&g_node_once, node_build);
    return g_nphys;
}

const struct fc_dev *node_get(int i) { return i >= 0 && i < node_count() ? &g_phys[i] : NULL; }

void node_set(int i, const struct fc_dev *nd)
{
    if (i >= 0 && i < node_count())
        g_phys[i] = *nd;
}

/* The PCI location of a GPU (CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID / _BUS_ID / _DEVICE_ID): from its
 * UUID id (uuid bytes 14-15), so each GPU of a node has its own bus, never bus 0:
 * domain id / 255, bus 1 + id % 255, device 0. */
static int pci_of(const struct fc_dev *d, CUdevice_attribute a)
{
    unsigned id = ((unsigned)(unsigned char)d->uuid.bytes[14] << 8) | (unsigned char)d->uuid.bytes[15];
    if (a == CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)
        return (int)(id / 255);
    return a == CU_DEVICE_ATTRIBUTE_PCI_BUS_ID ? (int)(1 + id % 255) : 0;
}

void dev_set(int d, const struct fc_dev *nd)
{
    if (dev_ok(d))
        g_dev[d] = *nd;
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L and CUDA_VISIBLE_DEVICES write it. */
void uuid_str(const CUuuid *u, char out[41])
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, 41, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* "123", "80G", "512M", "4K", "1T" (binary units) -> bytes; 0 on a malformed value. */
static unsigned long long parse_mem(const char *s, const char *end)
{
    char *e = NULL;
    unsigned long long v = strtoull(s, &e, 10);
    if (e == s)
        return 0;
    int shift = 0;
    if (e < end) {
        switch (*e) {
        case 'K': shift = 10; break;
        case 'M': shift = 20; break;
        case 'G': shift = 30; break;
        case 'T': shift = 40; break;
        default: return 0;
        }
        e++;
    }
    return e == end ? v << shift : 0;
}

/* FAKECUDA_DEVICES="name:mem[:id],...": one entry per physical device; id (0-65535, default the
 * entry's position) seeds its UUID, so two "nodes" can hold distinct GPUs. Returns the count,
 * or -1 (with a loud line naming the entry) when malformed. */
static int parse_devices(const char *spec)
{
    int n = 0;
    const char *p = spec;
    while (*p) {
        const char *end = strchr(p, ',');
        if (!end)
            end = p + strlen(p);
        const char *c1 = memchr(p, ':', (size_t)(end - p));
        const char *c2 = c1 ? memchr(c1 + 1, ':', (size_t)(end - c1 - 1)) : NULL;
        unsigned long long mem = c1 ? parse_mem(c1 + 1, c2 ? c2 : end) : 0;
        unsigned long long id = (unsigned long long)n;
        if (c2) {
            char *e = NULL;
            id = strtoull(c2 + 1, &e, 10);
            if (e != end || e == c2 + 1 || id > 65535)
                mem = 0;
        }
        size_t nl = c1 ? (size_t)(c1 - p) : 0;
        if (n >= FC_MAX_DEVICES || !c1 || nl == 0 || nl >= sizeof g_phys[0].name || !mem) {
            fc_loud("FAKECUDA_DEVICES entry %d (\"%.*s\") is not name:bytes[K|M|G|T][:id] "
                    "(at most %d entries, id 0-65535): no devices",
                    n, (int)(end - p), p, FC_MAX_DEVICES);
            return -1;
        }
        struct fc_dev *d = &g_phys[n];
        memset(d, 0, sizeof *d);
        memcpy(d->name, p, nl);
        d->mem = mem;
        d->phys = n;
        id_uuid((unsigned)id, &d->uuid);
        n++;
        p = *end ? end + 1 : end;
    }
    return n;
}

/* One CUDA_VISIBLE_DEVICES entry: an ordinal of the node's devices, or a UUID ("GPU-..." as
 * uuid_str writes it, or a unique prefix of it). The physical index, or -1. */
static int visible_entry(const char *s, size_t n)
{
    while (n && (*s == ' ' || *s == '\t'))
        s++, n--;
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t'))
        n--;
    if (n == 0)
        return -1;
    if (n >= 4 && !strncmp(s, "GPU-", 4)) {
        int hit = -1;
        for (int i = 0; i < g_nphys; i++) {
            char u[41];
            uuid_str(&g_phys[i].uuid, u);
            if (n <= 40 && !strncmp(u, s, n)) {
                if (hit >= 0)
                    return -1; /* an ambiguous prefix */
                hit = i;
            }
        }
        return hit;
    }
    int v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9' || v > 1000)
            return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v < g_nphys ? v : -1;
}

/* The node's devices (once, at the first cuInit or checkpoint call, whichever comes first):
 * FAKECUDA_DEVICES, else FAKECUDA_DEVICE_COUNT devices of one model, all named "fakecuda GPU"
 * (devices of one model have one name, as cuDeviceGetName answers on the driver). */
static void node_build(void)
{
    const char *spec = getenv("FAKECUDA_DEVICES");
    if (spec && *spec) {
        g_nphys = parse_devices(spec);
        if (g_nphys < 0)
            g_nphys = 0;
        return;
    }
    g_nphys = g_ndev;
    for (int i = 0; i < g_nphys; i++) {
        memset(&g_phys[i], 0, sizeof g_phys[i]);
        snprintf(g_phys[i].name, sizeof g_phys[i].name, "fakecuda GPU");
        g_phys[i].mem = g_totalmem;
        g_phys[i].phys = i;
        id_uuid((unsigned)i, &g_phys[i].uuid);
    }
}

/* Build this process's ordinals (cuInit, once). As the driver documents for
 * CUDA_VISIBLE_DEVICES (CUDA C++ Programming Guide, "CUDA Environment Variables"): the listed
 * devices in that order; an invalid, unknown or repeated entry hides it and every entry after
 * it; set but empty hides all. */
void dev_config(void)
{
    static int done;
    if (done)
        return;
    done = 1;
    node_count();
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    int n = 0;
    if (!vis) {
        for (; n < g_nphys; n++)
            g_dev[n] = g_phys[n];
    } else {
        const char *p = vis;
        while (*p && n < FC_MAX_DEVICES) {
            const char *end = strchr(p, ',');
            if (!end)
                end = p + strlen(p);
            int i = visible_entry(p, (size_t)(end - p));
            for (int k = 0; k < n && i >= 0; k++)
                if (g_dev[k].phys == i)
                    i = -1;
            if (i < 0)
                break;
            g_dev[n++] = g_phys[i];
            p = *end ? end + 1 : end;
        }
    }
    g_ndev = n;
}

/* Has this process a context on device d (a retained primary context or a created one)? */
int dev_has_ctx(int d)
{
    if (!dev_ok(d))
        return 0;
    if (g_prim[d].prim_refs > 0)
        return 1;
    for (struct fc_ctx *c = g_ctxs; c; c = c->next)
        if (c->dev == d && !c->primary && c->magic == FC_CTX_MAGIC)
            return 1;
    return 0;
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
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: return 1; /* pool.c */
    case CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES: return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    case CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED: return 1; /* event.c */
    default: return 0;
    }
}

/* ------------------------------------------------------------------ contexts */

static __thread struct fc_ctx *tls_ctxstack[32];
static __thread int tls_ctxdepth;

struct fc_ctx *cur_ctx(void) { return tls_ctxdepth ? tls_ctxstack[tls_ctxdepth - 1] : NULL; }

static void set_cur_ctx(struct fc_ctx *c)
{
    if (tls_ctxdepth == 0)
        tls_ctxdepth = 1;
    tls_ctxstack[tls_ctxdepth - 1] = c;
}

void ctx_init(struct fc_ctx *c, int dev, int primary)
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

int ctx_valid(struct fc_ctx *c)
{
    for (struct fc_ctx *p = g_ctxs; p; p = p->next)
        if (p == c)
            return p->magic == FC_CTX_MAGIC;
    return 0;
}

/* Wait until every op queued on the context's streams ran; its sticky error, if any. */
CUresult ctx_sync(struct fc_ctx *c)
{
    pthread_mutex_lock(&c->mu);
    while (c->pending)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    return (CUresult)atomic_load(&c->sticky);
}

/* ------------------------------------------------------------------ devices API */

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
    snprintf(name, (size_t)len, "%s", g_dev[d].name);
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
    *u = g_dev[d].uuid;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { API(device_uuid(uuid, dev), "dev=%d", dev); }

FC_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { API(device_uuid(uuid, dev), "dev=%d", dev); }

static CUresult device_totalmem(size_t *b, CUdevice d)
{
    if (!b)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    *b = (size_t)g_dev[d].mem;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) { API(device_totalmem(bytes, dev), "dev=%d", dev); }

static CUresult device_attr(int *pi, CUdevice_attribute a, CUdevice d)
{
    if (!pi || (int)a < 1 || (int)a >= (int)CU_DEVICE_ATTRIBUTE_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    if (a == CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID || a == CU_DEVICE_ATTRIBUTE_PCI_BUS_ID ||
        a == CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)
        *pi = pci_of(&g_dev[d], a);
    else
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

FC_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { API(prim_release(dev), "dev=%d", dev); }

FC_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { API(prim_release(dev), "dev=%d", dev); }

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

FC_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) { API(ctx_set_current(ctx), "ctx=%p", (void *)ctx); }

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

FC_EXPORT CUresult cuCtxGetDevice(CUdevice *device) { API(ctx_get_device(device), ""); }

static CUresult ctx_synchronize(void)
{
    struct fc_ctx *c = cur_ctx();
    return c ? ctx_sync(c) : CUDA_ERROR_INVALID_CONTEXT;
}

FC_EXPORT CUresult cuCtxSynchronize(void) { API(ctx_synchronize(), ""); }

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

FC_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags, CUdevice dev)
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
