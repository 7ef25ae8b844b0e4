/*
 * pointer.c: cuPointerGetAttribute and cuPointerGetAttributes (CUDA driver API, "Unified
 * Addressing"; cuda.h 13.1 and
 * https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html) for cuMemAlloc
 * buffers, memory opened by cuIpcOpenMemHandle, VMM reservations and mappings (device- or
 * host-located) and page-locked host memory (cuMemAllocHost, cuMemHostRegister); plain host
 * memory is not described (CUDA_ERROR_INVALID_VALUE). It reads the memory tables, and calls
 * memory.c, vmm_table.c, device.c and core.c.
 */
#include "fc.h"

/* ------------------------------------------------------------------ what a pointer is */

enum { PK_NONE, PK_DMEM, PK_IMPORT, PK_MAPPED, PK_RESERVED, PK_HOSTMEM };

struct ptr_info {
    int kind;
    uintptr_t range_va, map_va;  /* RANGE_START_ADDR (reservation or buffer), MAPPING_BASE_ADDR */
    size_t range_size, map_size;
    int dev;                     /* owning device ordinal, -1: host-located VMM */
    struct fc_ctx *ctx;          /* cuMemAlloc / IPC open context; NULL for VMM */
    uint64_t buffer_id, block_id;
    unsigned long long handle_types;
    int rdma;
    int multicast;
    const struct fc_map *m;      /* PK_MAPPED */
};

/* Call with g_mu held. */
static void ptr_classify(uintptr_t p, struct ptr_info *pi)
{
    memset(pi, 0, sizeof *pi);
    struct fc_dmem *d = dmem_find(p);
    if (d) {
        pi->kind = d->ipc_refs ? PK_IMPORT : PK_DMEM;
        pi->range_va = pi->map_va = d->va;
        pi->range_size = pi->map_size = d->size;
        pi->dev = d->dev;
        pi->ctx = d->ctx;
        pi->buffer_id = pi->block_id = d->buffer_id;
        return;
    }
    if (hostmem_find(p, &pi->range_va, &pi->range_size, &pi->ctx, &pi->buffer_id)) {
        pi->kind = PK_HOSTMEM;
        pi->map_va = pi->range_va;
        pi->map_size = pi->range_size;
        pi->block_id = pi->buffer_id;
        pi->dev = pi->ctx ? pi->ctx->dev : -1;
        return;
    }
    struct fc_resv *r = NULL;
    for (struct fc_resv *q = g_resvs; q; q = q->next)
        if (p >= q->va && p - q->va < q->size)
            r = q;
    if (!r)
        return;
    pi->kind = PK_RESERVED;
    pi->range_va = r->va;
    pi->range_size = r->size;
    struct fc_map *m = map_find(p);
    if (!m)
        return;
    pi->kind = PK_MAPPED;
    pi->m = m;
    pi->map_va = m->va;
    pi->map_size = m->size;
    pi->buffer_id = m->buffer_id;
    pi->block_id = m->alloc->block_id;
    pi->multicast = m->alloc->kind == FC_KIND_MULTICAST;
    pi->dev = m->alloc->device;
    pi->handle_types = pi->multicast ? m->alloc->team->handle_types : m->alloc->prop.requestedHandleTypes;
    pi->rdma = !pi->multicast && m->alloc->prop.allocFlags.gpuDirectRDMACapable;
}

/* The bytes each attribute writes (cuda.h types: CUcontext, unsigned int memory type,
 * CUdeviceptr, void *, unsigned long long ids, int booleans and ordinals, size_t sizes,
 * CUmemoryPool); 0: an attribute fakecuda does not answer. */
static size_t attr_size(CUpointer_attribute a)
{
    switch (a) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: return sizeof(CUcontext);
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: return sizeof(unsigned int);
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: return sizeof(CUdeviceptr);
    case CU_POINTER_ATTRIBUTE_HOST_POINTER: return sizeof(void *);
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: return sizeof(int);
    case CU_POINTER_ATTRIBUTE_BUFFER_ID: return sizeof(unsigned long long);
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: return sizeof(int);
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: return sizeof(int);
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: return sizeof(int);
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: return sizeof(CUdeviceptr);
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: return sizeof(size_t);
    case CU_POINTER_ATTRIBUTE_MAPPED: return sizeof(int);
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: return sizeof(unsigned long long);
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: return sizeof(int);
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: return sizeof(int);
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: return sizeof(CUmemoryPool);
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE: return sizeof(size_t);
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: return sizeof(CUdeviceptr);
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID: return sizeof(unsigned long long);
    case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE: return sizeof(int);
    default: return 0; /* P2P_TOKENS (nv-p2p.h kernel tokens) and unknown values */
    }
}

#define PUT(type, v)                  \
    do {                              \
        type v_ = (type)(v);          \
        memcpy(data, &v_, sizeof v_); \
        return CUDA_SUCCESS;          \
    } while (0)

/* One attribute of a classified pointer (cuda.h's text for cuPointerGetAttribute):
 * CONTEXT: the cuMemAlloc/IPC/page-locked memory's context; VMM memory was not allocated by,
 *   mapped by or registered with a context -> INVALID_VALUE.
 * MEMORY_TYPE: DEVICE, or HOST for host-located VMM and page-locked memory.
 * DEVICE_POINTER: p if the current context's device may access it (no context: INVALID_CONTEXT).
 * HOST_POINTER: p for host-located VMM and page-locked memory; device memory -> INVALID_VALUE.
 * DEVICE_ORDINAL: the owning device (an import: the exporter's, which every fake process
 *   numbers alike); host memory -> INVALID_VALUE.
 * RANGE_START_ADDR/RANGE_SIZE: the buffer, or the whole reservation (also unmapped);
 * MAPPING_BASE_ADDR/MAPPING_SIZE: the buffer or the single mapping; MAPPED 1/0.
 * IS_LEGACY_CUDA_IPC_CAPABLE: 1 only for an own cuMemAlloc buffer. ALLOWED_HANDLE_TYPES: the
 * VMM requestedHandleTypes (0 for cuMemAlloc memory). ACCESS_FLAGS: the current context
 * device's CUmemAccess_flags. MEMPOOL_HANDLE NULL (no pools); IS_MANAGED, SYNC_MEMOPS,
 * IS_HW_DECOMPRESS_CAPABLE 0. An unmapped reservation answers only RANGE_* and MAPPED.
 * Call with g_mu held. */
static CUresult attr_get(void *data, CUpointer_attribute a, uintptr_t p, const struct ptr_info *pi)
{
    if (pi->kind == PK_NONE)
        return CUDA_ERROR_INVALID_VALUE;
    if (pi->kind == PK_RESERVED && a != CU_POINTER_ATTRIBUTE_RANGE_START_ADDR && a != CU_POINTER_ATTRIBUTE_RANGE_SIZE &&
        a != CU_POINTER_ATTRIBUTE_MAPPED)
        return CUDA_ERROR_INVALID_VALUE;
    int vmm = pi->kind == PK_MAPPED;
    int host = (vmm && pi->dev < 0 && !pi->multicast) || pi->kind == PK_HOSTMEM;
    struct fc_ctx *c = cur_ctx();
    int cdev = c ? c->dev : -1;
    unsigned char acc = CU_MEM_ACCESS_FLAGS_PROT_READWRITE; /* cuMemAlloc memory: every device */
    if (vmm)
        acc = cdev >= 0 ? pi->m->acc[(p - pi->m->va) / g_gran * FC_ACC_SLOTS + (size_t)cdev] : 0;
    switch (a) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
        if (!pi->ctx)
            return CUDA_ERROR_INVALID_VALUE;
        PUT(CUcontext, pi->ctx);
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: PUT(unsigned int, host ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE);
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        if (!c)
            return CUDA_ERROR_INVALID_CONTEXT;
        if (acc == CU_MEM_ACCESS_FLAGS_PROT_NONE)
            return CUDA_ERROR_INVALID_VALUE;
        PUT(CUdeviceptr, p);
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (!host)
            return CUDA_ERROR_INVALID_VALUE;
        PUT(void *, p);
    case CU_POINTER_ATTRIBUTE_BUFFER_ID: PUT(unsigned long long, pi->buffer_id);
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        if (pi->dev < 0) /* host-located VMM (page-locked memory: its context's device) */
            return CUDA_ERROR_INVALID_VALUE;
        PUT(int, pi->dev);
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: PUT(int, pi->kind == PK_DMEM);
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: PUT(CUdeviceptr, pi->range_va);
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: PUT(size_t, pi->range_size);
    case CU_POINTER_ATTRIBUTE_MAPPED: PUT(int, pi->kind != PK_RESERVED);
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: PUT(unsigned long long, pi->handle_types);
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: PUT(int, pi->rdma);
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
        if (!c)
            return CUDA_ERROR_INVALID_CONTEXT;
        PUT(int, acc);
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: PUT(CUmemoryPool, NULL);
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE: PUT(size_t, pi->map_size);
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: PUT(CUdeviceptr, pi->map_va);
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID: PUT(unsigned long long, pi->block_id);
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
    case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE: PUT(int, 0);
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

/* ------------------------------------------------------------------ cuPointerGetAttribute[s] */

static CUresult ptr_attr(void *data, CUpointer_attribute a, CUdeviceptr p)
{
    if (!data || attr_size(a) == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct ptr_info pi;
    pthread_mutex_lock(&g_mu);
    ptr_classify((uintptr_t)p, &pi);
    CUresult r = attr_get(data, a, (uintptr_t)p, &pi);
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    API(ptr_attr(data, attribute, ptr), "attribute=%d ptr=0x%llx", (int)attribute, (unsigned long long)ptr);
}

/* cuda.h: unlike cuPointerGetAttribute, a pointer that is no CUDA pointer is no error: every
 * attribute gets its NULL value (zero bytes) and CUDA_SUCCESS; so does an attribute that does
 * not apply to this pointer (HOST_POINTER of device memory, ...). numAttributes 0, NULL arrays,
 * a NULL data entry or an attribute outside cuda.h's list (P2P_TOKENS, unknown values) ->
 * INVALID_VALUE with nothing written. */
static CUresult ptr_attrs(unsigned n, CUpointer_attribute *attrs, void **data, CUdeviceptr p)
{
    if (n == 0 || !attrs || !data)
        return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < n; i++)
        if (!data[i] || attr_size(attrs[i]) == 0)
            return CUDA_ERROR_INVALID_VALUE;
    struct ptr_info pi;
    pthread_mutex_lock(&g_mu);
    ptr_classify((uintptr_t)p, &pi);
    for (unsigned i = 0; i < n; i++)
        if (attr_get(data[i], attrs[i], (uintptr_t)p, &pi) != CUDA_SUCCESS)
            memset(data[i], 0, attr_size(attrs[i]));
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                          CUdeviceptr ptr)
{
    API(ptr_attrs(numAttributes, attributes, data, ptr), "count=%u ptr=0x%llx", numAttributes, (unsigned long long)ptr);
}
