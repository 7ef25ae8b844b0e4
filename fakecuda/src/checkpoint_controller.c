/*
 * checkpoint_controller.c: the controller side of the checkpoint API (CUDA driver API,
 * "Checkpointing"): cuCheckpointProcess{GetState,GetRestoreThreadId,Lock,Checkpoint,Restore,
 * Unlock}(pid) check their arguments and send one request to the target process's control
 * socket (checkpoint_target.c serves it; fc.h has the protocol). It holds no state, and calls
 * device.c (UUIDs) and core.c.
 */
#include "fc.h"

/* An unknown pid, or a pid that has no fakecuda control socket (never called cuInit, or no
 * fakecuda), is CUDA_ERROR_INVALID_VALUE. */
static CUresult ck_call(int pid, uint32_t op, uint32_t timeout_ms, int *value)
{
    if (pid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    struct sockaddr_un a;
    socklen_t len = ck_addr(&a, pid);
    if (connect(s, (struct sockaddr *)&a, len) != 0) {
        close(s);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct ck_req q = {CK_MAGIC, op, timeout_ms, 0};
    struct ck_rep p;
    CUresult r;
    if (send(s, &q, sizeof q, MSG_NOSIGNAL) != (ssize_t)sizeof q) {
        r = CUDA_ERROR_OPERATING_SYSTEM;
    } else {
        ssize_t n;
        do
            n = recv(s, &p, sizeof p, 0);
        while (n < 0 && errno == EINTR);
        if (n != (ssize_t)sizeof p)
            r = CUDA_ERROR_OPERATING_SYSTEM;
        else {
            r = (CUresult)p.result;
            if (value)
                *value = p.value;
        }
    }
    close(s);
    return r;
}

static int all_zero(const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i])
            return 0;
    return 1;
}

static CUresult ck_getstate(int pid, CUprocessState *st)
{
    if (!st)
        return CUDA_ERROR_INVALID_VALUE;
    int v = 0;
    CUresult r = ck_call(pid, CK_GETSTATE, 0, &v);
    if (r == CUDA_SUCCESS)
        *st = (CUprocessState)v;
    return r;
}

FC_EXPORT CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
    API_NOGATE(1, ck_getstate(pid, state), "pid=%d state=%d", pid, OUTI(state));
}

static CUresult ck_gettid(int pid, int *tid)
{
    if (!tid)
        return CUDA_ERROR_INVALID_VALUE;
    return ck_call(pid, CK_GETTID, 0, tid);
}

FC_EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    API_NOGATE(1, ck_gettid(pid, tid), "pid=%d tid=%d", pid, OUTI(tid));
}

static CUresult ck_lock_call(int pid, CUcheckpointLockArgs *args)
{
    if (args && (args->reserved0 || !all_zero(args->reserved1, sizeof args->reserved1)))
        return CUDA_ERROR_INVALID_VALUE;
    return ck_call(pid, CK_LOCK, args ? args->timeoutMs : 0, NULL);
}

FC_EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    API_NOGATE(1, ck_lock_call(pid, args), "pid=%d timeoutMs=%u", pid, args ? args->timeoutMs : 0);
}

FC_EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
    API_NOGATE(
        1, (args && !all_zero(args, sizeof *args)) ? CUDA_ERROR_INVALID_VALUE : ck_call(pid, CK_CHECKPOINT, 0, NULL),
        "pid=%d", pid);
}

static CUresult ck_restore_call(int pid, CUcheckpointRestoreArgs *args)
{
    if (args) {
        if (!all_zero(args->reserved, sizeof args->reserved) || args->reserved1)
            return CUDA_ERROR_INVALID_VALUE;
        if (args->gpuPairsCount && !args->gpuPairs)
            return CUDA_ERROR_INVALID_VALUE;
        for (unsigned i = 0; i < args->gpuPairsCount; i++) {
            int okold = 0, oknew = 0;
            for (int d = 0; d < g_ndev; d++) {
                CUuuid u;
                dev_uuid(d, &u);
                okold |= !memcmp(u.bytes, args->gpuPairs[i].oldUuid.bytes, 16);
                oknew |= !memcmp(u.bytes, args->gpuPairs[i].newUuid.bytes, 16);
            }
            if (!okold || !oknew)
                return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return ck_call(pid, CK_RESTORE, 0, NULL);
}

FC_EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
    API_NOGATE(1, ck_restore_call(pid, args), "pid=%d pairs=%u", pid, args ? args->gpuPairsCount : 0);
}

FC_EXPORT CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
    API_NOGATE(1, (args && !all_zero(args, sizeof *args)) ? CUDA_ERROR_INVALID_VALUE : ck_call(pid, CK_UNLOCK, 0, NULL),
               "pid=%d", pid);
}
