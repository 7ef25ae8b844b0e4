/*
 * checkpoint_checks.c: what the target's checkpoint refuses before anything changes
 * (multicast objects, legacy CUDA IPC, exported fds still open) and where a restore puts the
 * process's devices (CUcheckpointRestoreArgs.gpuPairs). checkpoint_target.c calls these with
 * g_mu held; they read the VMM and cuMemAlloc tables and call pool.c, memory.c, event.c, vmm_table.c,
 * device.c and core.c.
 */
#include "fc.h"

/* Legacy CUDA IPC: the driver before r610 cannot checkpoint a process that uses IPC memory
 * (cuda-checkpoint README restrictions, "no IPC memory"; from r610 only under
 * `cuda-checkpoint --launch-job`: NVIDIA/cuda-checkpoint #56). The code is not documented; the
 * fake returns CUDA_ERROR_NOT_SUPPORTED (as for its other refusals) when this process holds a
 * live import, or another live process holds one of its cuMemAlloc buffers open. Under
 * a launch job (g_launch_job: CUDA_CHECKPOINT_JOB_FILE at cuInit, init.c) it passes (each side
 * then keeps a private copy). Call with g_mu held. */
static CUresult ck_ipc_check(void)
{
    if (g_launch_job)
        return CUDA_SUCCESS;
    int nimp = 0, nexp = 0, pid = 0;
    struct fc_dmem *imp = NULL, *exp = NULL;
    for (struct fc_dmem *d = g_dmems; d; d = d->next) {
        if (d->ipc_refs) {
            if (nimp++ == 0)
                imp = d;
        } else if (!exp && dmem_importers(d, &pid)) {
            exp = d;
            nexp++;
        } else if (exp && dmem_importers(d, NULL)) {
            nexp++;
        }
    }
    if (imp) {
        fc_loud("checkpoint refused: pid %d holds %d live CUDA IPC import(s) (0x%llx, %zu bytes, buffer of pid %d, "
                "%d reference(s)); the driver before r610 cannot checkpoint CUDA IPC memory: cuIpcCloseMemHandle "
                "every import first (nothing was changed; unlock resumes) -> CUDA_ERROR_NOT_SUPPORTED",
                (int)getpid(), nimp, (unsigned long long)imp->va, imp->size, imp->ipc_pid, imp->ipc_refs);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (exp) {
        fc_loud("checkpoint refused: %d cuMemAlloc buffer(s) of pid %d are open in other processes through CUDA "
                "IPC (0x%llx, %zu bytes, opened by pid %d); the driver before r610 cannot checkpoint CUDA IPC "
                "memory: the importers must cuIpcCloseMemHandle first (nothing was changed; unlock resumes) -> "
                "CUDA_ERROR_NOT_SUPPORTED",
                nexp, (int)getpid(), (unsigned long long)exp->va, exp->size, pid);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return CUDA_SUCCESS;
}

/* What a checkpoint refuses (nothing is changed): multicast objects, CUDA IPC, exported fds
 * still open. Call with g_mu held. */
CUresult ck_refusals(void)
{
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
        fc_loud("checkpoint refused: the process holds %d multicast object(s) (object %" PRIu64 ": %d handle "
                "refs, %d mappings, %d bindings); the real driver hangs on them -> CUDA_ERROR_NOT_SUPPORTED",
                nmc, mc1->object_id, mc1->handles, mc1->maps, mc1->binds);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    CUresult ipc = ck_ipc_check();
    if (ipc == CUDA_SUCCESS)
        ipc = event_ck_refusal(); /* interprocess events, pools shared by IPC, registered shared memory */
    if (ipc == CUDA_SUCCESS)
        ipc = pool_ck_refusal();
    if (ipc == CUDA_SUCCESS)
        ipc = hostmem_ck_refusal();
    if (ipc != CUDA_SUCCESS)
        return ipc;
    /* An exported fd still open in this process carries the sharing: the real driver cannot
     * dump it. */
    struct fc_export **pp = &g_exports;
    while (*pp) {
        struct fc_export *x = *pp;
        struct stat st;
        if (fstat(x->fd, &st) == 0 && st.st_dev == x->st_dev && st.st_ino == x->st_ino) {
            fc_loud("checkpoint refused: exported fd %d of allocation handle %llu (object %" PRIu64
                    ") is still open -> CUDA_ERROR_NOT_SUPPORTED",
                    x->fd, x->handle, x->object_id);
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        *pp = x->next; /* closed (or the number was reused): forget it */
        free(x);
    }
    return CUDA_SUCCESS;
}

/* Index of the node entry (node_get) with this UUID, or -1. */
static int node_index(const CUuuid *u)
{
    for (int i = 0; i < node_count(); i++)
        if (!memcmp(node_get(i)->uuid.bytes, u->bytes, 16))
            return i;
    return -1;
}

/* gpuPairs given: every GPU of the node this process was checkpointed on listed once (the
 * kernel-mode driver's view: cuda.core's Process.restore says "provide mappings for every GPU
 * visible to the kernel-mode driver. User-space masking such as CUDA_VISIBLE_DEVICES does not
 * reduce this mapping requirement"; the driver API: "it must contain every checkpointed GPU"),
 * each onto a GPU "of the same chip type" (name) with "enough memory" (what the process holds
 * on it). So the map is a permutation of whole GPUs, and no two ordinals ever name one GPU. */
static CUresult place_pairs(const struct ck_restore_req *rq, struct ck_placement *pl)
{
    int listed[FC_MAX_DEVICES] = {0};
    char o[41], n[41];
    for (unsigned i = 0; i < rq->npairs && i < FC_MAX_DEVICES; i++) {
        const struct ck_gpu_pair *gp = &rq->pairs[i];
        uuid_str(&gp->old_uuid, o);
        uuid_str(&gp->new_dev.uuid, n);
        int k = node_index(&gp->old_uuid);
        if (k < 0) {
            fc_loud("restore refused: gpuPairs[%u] old GPU %s is no GPU of the node pid %d was checkpointed on "
                    "(nothing was changed; the process stays checkpointed) -> CUDA_ERROR_INVALID_VALUE",
                    i, o, (int)getpid());
            return CUDA_ERROR_INVALID_VALUE;
        }
        if (strcmp(node_get(k)->name, gp->new_dev.name)) {
            fc_loud("restore refused: gpuPairs[%u] %s (%s) -> %s (%s): another chip type (nothing was changed; "
                    "the process stays checkpointed) -> CUDA_ERROR_INVALID_VALUE",
                    i, o, node_get(k)->name, n, gp->new_dev.name);
            return CUDA_ERROR_INVALID_VALUE;
        }
        pl->node[k] = gp->new_dev;
        listed[k] = 1;
    }
    for (int k = 0; k < node_count(); k++)
        if (!listed[k]) {
            uuid_str(&node_get(k)->uuid, o);
            fc_loud("restore refused: gpuPairs lists %u GPU(s) but not %s, a GPU of the node pid %d was checkpointed "
                    "on: map every GPU the kernel-mode driver saw, whatever CUDA_VISIBLE_DEVICES hid (nothing was "
                    "changed; the process stays checkpointed) -> CUDA_ERROR_INVALID_VALUE",
                    rq->npairs, o, (int)getpid());
            return CUDA_ERROR_INVALID_VALUE;
        }
    for (int d = 0; d < g_ndev; d++) {
        int k = node_index(&dev_get(d)->uuid);
        pl->ord[d] = k < 0 ? *dev_get(d) : pl->node[k];
        if (pl->ord[d].mem < g_used[d]) {
            uuid_str(&dev_get(d)->uuid, o);
            uuid_str(&pl->ord[d].uuid, n);
            fc_loud("restore refused: %s -> %s: pid %d holds %llu bytes on it, the new GPU has %llu (nothing was "
                    "changed; the process stays checkpointed) -> CUDA_ERROR_OUT_OF_MEMORY",
                    o, n, (int)getpid(), g_used[d], (unsigned long long)pl->ord[d].mem);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        pl->nmoved += memcmp(pl->ord[d].uuid.bytes, dev_get(d)->uuid.bytes, 16) != 0;
    }
    return CUDA_SUCCESS;
}

/* Where a restore puts this process's devices (cuda.h CUcheckpointRestoreArgs.gpuPairs; the
 * driver API's cuCheckpointProcessRestore). Fills *pl; nothing changes on a refusal, which
 * leaves the process CHECKPOINTED. The codes are the fake's pick (none is documented): with
 * gpuPairs see place_pairs (INVALID_VALUE, OUT_OF_MEMORY); without, a GPU the process used that
 * is not on this node -> INVALID_DEVICE. Call with g_mu held. */
CUresult ck_place(const struct ck_restore_req *rq, struct ck_placement *pl)
{
    memset(pl, 0, sizeof *pl);
    for (int d = 0; d < g_ndev; d++)
        pl->ord[d] = *dev_get(d);
    for (int k = 0; k < node_count(); k++)
        pl->node[k] = *node_get(k);
    if (rq->npairs)
        return place_pairs(rq, pl);
    for (int d = 0; d < g_ndev; d++) {
        if (!g_used[d] && !dev_has_ctx(d))
            continue;
        int seen = 0;
        for (unsigned k = 0; k < rq->npresent && k < FC_MAX_DEVICES; k++)
            seen |= !memcmp(rq->present[k].uuid.bytes, pl->ord[d].uuid.bytes, 16);
        if (!seen) {
            char n[41];
            uuid_str(&pl->ord[d].uuid, n);
            fc_loud("restore refused: pid %d used GPU %s (ordinal %d) and it is missing here; pass gpuPairs "
                    "mapping every GPU of its node onto GPUs present (nothing was changed; the process stays "
                    "checkpointed) -> CUDA_ERROR_INVALID_DEVICE",
                    (int)getpid(), n, d);
            return CUDA_ERROR_INVALID_DEVICE;
        }
    }
    return CUDA_SUCCESS;
}
