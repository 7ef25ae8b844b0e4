/*
 * peer.c: peer context memory access (CUDA driver API, "Peer Context Memory Access":
 * cuDeviceCanAccessPeer, cuCtxEnablePeerAccess, cuCtxDisablePeerAccess). Access is per
 * (current context -> peer context) pair and unidirectional; once enabled, every legacy
 * allocation of the peer context (cuMemAlloc, memory opened by cuIpcOpenMemHandle there),
 * existing and future, is accessible to the current context's device. VMM memory is not
 * affected: its access is what cuMemSetAccess granted (CUDA driver API, "Virtual Memory
 * Management"). The copy engine asks peer_legacy_check for a stream memory operation (the
 * device's own access, what a kernel does). Every pair of distinct devices can access each
 * other (fakecuda has no topology); a device cannot be its own peer (cuDeviceCanAccessPeer 0,
 * as the driver answers). The table is under g_mu; it calls vmm_table.c, device.c and core.c.
 */
#include "fc.h"

/* The real limit is eight peers per device on systems without NVSwitch (CUDA Programming
 * Guide, "Peer-to-Peer Memory Access"); the fake counts them per context. */
#define FC_MAX_PEERS 8
#define FC_MAX_PEER_PAIRS (FC_MAX_PEERS * 64)

struct fc_peer_pair { struct fc_ctx *from, *to; /* from may access to's legacy memory */ };
static struct fc_peer_pair g_pairs[FC_MAX_PEER_PAIRS];
static int g_npairs;

static int pair_find(struct fc_ctx *from, struct fc_ctx *to)
{
    for (int i = 0; i < g_npairs; i++)
        if (g_pairs[i].from == from && g_pairs[i].to == to)
            return i;
    return -1;
}

static int pair_count(struct fc_ctx *from)
{
    int n = 0;
    for (int i = 0; i < g_npairs; i++)
        n += g_pairs[i].from == from;
    return n;
}

CUresult peer_legacy_check(uintptr_t p, struct fc_ctx *c)
{
    struct fc_dmem *d = dmem_find(p);
    if (!d)
        return CUDA_ERROR_NOT_FOUND;
    if (!c || c->dev == d->dev || (d->ctx && c->dev == d->ctx->dev))
        return CUDA_SUCCESS;
    if (d->ctx && pair_find(c, d->ctx) >= 0)
        return CUDA_SUCCESS;
    fc_loud("device %d (context %p) accessed legacy memory 0x%" PRIxPTR " of device %d (context %p) without peer "
            "access: cuCtxEnablePeerAccess from the accessing context first -> CUDA_ERROR_ILLEGAL_ADDRESS",
            c->dev, (void *)c, p, d->dev, (void *)d->ctx);
    return CUDA_ERROR_ILLEGAL_ADDRESS;
}

/* ------------------------------------------------------------------ API */

/* cuda.h: *canAccessPeer 1 when dev may directly access peerDev's memory; NULL output ->
 * INVALID_VALUE, an invalid ordinal -> INVALID_DEVICE. */
static CUresult can_access(int *can, CUdevice dev, CUdevice peer)
{
    if (!can)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev) || !dev_ok(peer))
        return CUDA_ERROR_INVALID_DEVICE;
    *can = dev != peer;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    API(can_access(canAccessPeer, dev, peerDev), "dev=%d peer=%d can=%d", dev, peerDev, OUTI(canAccessPeer));
}

/* cuda.h: Flags must be 0 (INVALID_VALUE); no current context, an invalid peerContext, or the
 * current context itself -> INVALID_CONTEXT; the devices cannot be peers ->
 * PEER_ACCESS_UNSUPPORTED; already enabled -> PEER_ACCESS_ALREADY_ENABLED; the peer resources
 * are exhausted -> TOO_MANY_PEERS. */
static CUresult enable(CUcontext peer, unsigned flags)
{
    struct fc_ctx *c = cur_ctx(), *p = (struct fc_ctx *)peer;
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult r = CUDA_SUCCESS;
    if (!c || !ctx_valid(c) || !p || !ctx_valid(p) || c == p)
        r = CUDA_ERROR_INVALID_CONTEXT;
    else if (c->dev == p->dev)
        r = CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
    else if (pair_find(c, p) >= 0)
        r = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    else if (pair_count(c) >= FC_MAX_PEERS || g_npairs >= FC_MAX_PEER_PAIRS)
        r = CUDA_ERROR_TOO_MANY_PEERS;
    else
        g_pairs[g_npairs++] = (struct fc_peer_pair){c, p};
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* cuda.h: not enabled from the current context to peerContext -> PEER_ACCESS_NOT_ENABLED; no
 * current context or an invalid peerContext -> INVALID_CONTEXT. */
static CUresult disable(CUcontext peer)
{
    struct fc_ctx *c = cur_ctx(), *p = (struct fc_ctx *)peer;
    pthread_mutex_lock(&g_mu);
    CUresult r = CUDA_SUCCESS;
    int i = -1;
    if (!c || !ctx_valid(c) || !p || !ctx_valid(p))
        r = CUDA_ERROR_INVALID_CONTEXT;
    else if ((i = pair_find(c, p)) < 0)
        r = CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
    else
        g_pairs[i] = g_pairs[--g_npairs];
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)
{
    API(enable(peerContext, Flags), "peer=%p flags=%u", (void *)peerContext, Flags);
}

FC_EXPORT CUresult cuCtxDisablePeerAccess(CUcontext peerContext)
{
    API(disable(peerContext), "peer=%p", (void *)peerContext);
}
