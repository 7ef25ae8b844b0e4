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
 * FAKECUDA_LAUNCH_JOB=1 it passes (each side then keeps a private copy). Call with g_mu held. */
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

/* Where a restore puts this process's devices (cuda.h CUcheckpointRestoreArgs.gpuPairs; the
 * rules of cuda-checkpoint --device-map: every checkpointed GPU listed, the same chip, enough
 * memory). Fills to[d] for every ordinal; nothing changes on a refusal, which leaves the
 * process CHECKPOINTED. The codes are the fake's pick (none is documented): a pair naming no
 * GPU of this process, a checkpointed GPU left out, or another model -> INVALID_VALUE; less
 * memory than the process holds on it -> OUT_OF_MEMORY; without pairs, a checkpointed GPU the
 * controller does not see -> INVALID_DEVICE. Call with g_mu held. */
CUresult ck_place(const struct ck_restore_req *rq, struct fc_dev *to, int *nmoved)
{
    int mapped[FC_MAX_DEVICES] = {0};
    char o[41], n[41];
    *nmoved = 0;
    for (int d = 0; d < g_ndev; d++)
        to[d] = *dev_get(d);
    for (unsigned i = 0; i < rq->npairs && i < FC_MAX_DEVICES; i++) {
        const struct ck_gpu_pair *gp = &rq->pairs[i];
        uuid_str(&gp->old_uuid, o);
        uuid_str(&gp->new_dev.uuid, n);
        int d = 0;
        while (d < g_ndev && memcmp(dev_get(d)->uuid.bytes, gp->old_uuid.bytes, 16))
            d++;
        if (d == g_ndev) {
            fc_loud("restore refused: gpuPairs[%u] old GPU %s is not a GPU of pid %d (nothing was changed; "
                    "the process stays checkpointed) -> CUDA_ERROR_INVALID_VALUE",
                    i, o, (int)getpid());
            return CUDA_ERROR_INVALID_VALUE;
        }
        /* the FAKECUDA_DEVICE_COUNT devices are all one model ("fakecuda GPU N" by index) */
        int named = (dev_get(d)->flags | gp->new_dev.flags) & FC_DEV_NAMED;
        if (named && strcmp(dev_get(d)->name, gp->new_dev.name)) {
            fc_loud("restore refused: gpuPairs[%u] %s (%s) -> %s (%s): another model (nothing was changed; "
                    "the process stays checkpointed) -> CUDA_ERROR_INVALID_VALUE",
                    i, o, dev_get(d)->name, n, gp->new_dev.name);
            return CUDA_ERROR_INVALID_VALUE;
        }
        if (gp->new_dev.mem < g_used[d]) {
            fc_loud("restore refused: gpuPairs[%u] %s -> %s: pid %d holds %llu bytes on it, the new GPU has %llu "
                    "(nothing was changed; the process stays checkpointed) -> CUDA_ERROR_OUT_OF_MEMORY",
                    i, o, n, (int)getpid(), g_used[d], (unsigned long long)gp->new_dev.mem);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        to[d] = gp->new_dev;
        mapped[d] = 1;
    }
    for (int d = 0; d < g_ndev; d++) {
        if (!g_used[d] && !dev_has_ctx(d))
            continue;
        uuid_str(&dev_get(d)->uuid, o);
        if (rq->npairs && !mapped[d]) {
            fc_loud("restore refused: pid %d used GPU %s (ordinal %d) and gpuPairs does not list it: every "
                    "checkpointed GPU must be listed (nothing was changed; the process stays checkpointed) -> "
                    "CUDA_ERROR_INVALID_VALUE",
                    (int)getpid(), o, d);
            return CUDA_ERROR_INVALID_VALUE;
        }
        int seen = 0;
        for (unsigned k = 0; k < rq->npresent && k < FC_MAX_DEVICES; k++)
            seen |= !memcmp(rq->present[k].uuid.bytes, to[d].uuid.bytes, 16);
        if (!seen) {
            uuid_str(&to[d].uuid, n);
            fc_loud("restore refused: pid %d used GPU %s (ordinal %d) and it is missing here; pass gpuPairs "
                    "mapping it onto a GPU present (nothing was changed; the process stays checkpointed) -> "
                    "CUDA_ERROR_INVALID_DEVICE",
                    (int)getpid(), n, d);
            return CUDA_ERROR_INVALID_DEVICE;
        }
        *nmoved += mapped[d] && memcmp(to[d].uuid.bytes, dev_get(d)->uuid.bytes, 16);
    }
    return CUDA_SUCCESS;
}
