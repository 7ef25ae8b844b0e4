/*
 * checkpoint_controller.c: the controller side of the checkpoint API (CUDA driver API,
 * "Checkpointing"): cuCheckpointProcess{GetState,GetRestoreThreadId,Lock,Checkpoint,Restore,
 * Unlock}(pid) check their arguments and send one request to the target process's control
 * socket (checkpoint_target.c serves it; fc.h has the protocol). It holds no state, and calls
 * device.c (UUIDs) and core.c.
 */
#include "fc.h"

#include <sys/time.h>

/* How long the controller waits for the target's reply: FAKECUDA_CONTROLLER_TIMEOUT_MS
 * (default 60000) plus, for a lock, its own timeout; a lock with timeout 0 (wait forever, as
 * the API says) has no deadline. A target that does not answer in time (a stopped process)
 * is CUDA_ERROR_TIMEOUT, and the controller's caller can go on. */
static uint64_t ck_deadline_ms(uint32_t op, uint32_t timeout_ms)
{
    if (op == CK_LOCK && timeout_ms == 0)
        return 0;
    uint64_t ms = 60000;
    const char *e = getenv("FAKECUDA_CONTROLLER_TIMEOUT_MS");
    if (e && *e) {
        char *end = NULL;
        unsigned long long v = strtoull(e, &end, 10);
        if (end && !*end && v > 0 && v < 86400000ULL)
            ms = v;
    }
    return ms + (op == CK_LOCK ? timeout_ms : 0);
}

/* An unknown pid, or a pid that has no fakecuda control socket (never called cuInit, or no
 * fakecuda), is CUDA_ERROR_INVALID_VALUE. */
static CUresult ck_send(int pid, const struct ck_req *q, size_t qlen, int *value)
{
    uint32_t op = q->op, timeout_ms = q->timeout_ms;
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
    uint64_t dl = ck_deadline_ms(op, timeout_ms);
    if (dl) {
        struct timeval tv = {(time_t)(dl / 1000), (suseconds_t)(dl % 1000) * 1000};
        setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }
    struct ck_rep p;
    CUresult r;
    if (send(s, q, qlen, MSG_NOSIGNAL) != (ssize_t)qlen) {
        r = CUDA_ERROR_OPERATING_SYSTEM;
    } else {
        ssize_t n;
        do
            n = recv(s, &p, sizeof p, 0);
        while (n < 0 && errno == EINTR);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            r = CUDA_ERROR_TIMEOUT;
        else if (n != (ssize_t)sizeof p)
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

static CUresult ck_call(int pid, uint32_t op, uint32_t timeout_ms, int *value)
{
    struct ck_req q = {CK_MAGIC, op, timeout_ms, 0};
    return ck_send(pid, &q, sizeof q, value);
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

/* gpuPairs (cuda.h CUcheckpointRestoreArgs, CUDA 13.0): more than FC_MAX_DEVICES pairs, a
 * repeated old or new UUID, or a new UUID this controller does not see is
 * CUDA_ERROR_INVALID_VALUE here; the target checks the old ones against what it checkpointed
 * (checkpoint_target.c). */
static CUresult ck_restore_call(int pid, CUcheckpointRestoreArgs *args)
{
    static struct ck_restore_req q; /* 3.5 KiB: not on a caller's stack; serialised by g_ck_mu */
    static pthread_mutex_t g_ck_mu = PTHREAD_MUTEX_INITIALIZER;
    unsigned np = args ? args->gpuPairsCount : 0;
    if (args) {
        if (!all_zero(args->reserved, sizeof args->reserved) || args->padding0 || args->customStorageInfo_out)
            return CUDA_ERROR_INVALID_VALUE;
        if (np && !args->gpuPairs)
            return CUDA_ERROR_INVALID_VALUE;
        if (np > FC_MAX_DEVICES)
            return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&g_ck_mu);
    memset(&q, 0, sizeof q);
    q.hdr = (struct ck_req){CK_MAGIC, CK_RESTORE, 0, 0};
    for (int d = 0; d < g_ndev; d++)
        q.present[q.npresent++] = *dev_get(d);
    CUresult r = CUDA_SUCCESS;
    for (unsigned i = 0; i < np && r == CUDA_SUCCESS; i++) {
        const CUcheckpointGpuPair *gp = &args->gpuPairs[i];
        int hit = -1;
        for (unsigned k = 0; k < q.npresent; k++)
            if (!memcmp(q.present[k].uuid.bytes, gp->newUuid.bytes, 16))
                hit = (int)k;
        for (unsigned k = 0; k < i; k++)
            if (!memcmp(args->gpuPairs[k].oldUuid.bytes, gp->oldUuid.bytes, 16) ||
                !memcmp(args->gpuPairs[k].newUuid.bytes, gp->newUuid.bytes, 16))
                hit = -1;
        if (hit < 0) {
            char o[41], n[41];
            uuid_str(&gp->oldUuid, o);
            uuid_str(&gp->newUuid, n);
            fc_logline("fakecuda: restore of pid %d refused: gpuPairs[%u] %s -> %s: the new GPU is not visible to this "
                       "controller, or a UUID repeats -> CUDA_ERROR_INVALID_VALUE",
                       pid, i, o, n);
            r = CUDA_ERROR_INVALID_VALUE;
            break;
        }
        q.pairs[i].old_uuid = gp->oldUuid;
        q.pairs[i].new_dev = q.present[hit];
        q.npairs = i + 1;
    }
    if (r == CUDA_SUCCESS)
        r = ck_send(pid, &q.hdr, sizeof q, NULL);
    pthread_mutex_unlock(&g_ck_mu);
    return r;
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
