/*
 * checkpoint_controller.c: the controller side of the checkpoint API (CUDA driver API,
 * "Checkpointing"): cuCheckpointProcess{GetState,GetRestoreThreadId,Lock,Checkpoint,Restore,
 * Unlock}(pid) check their arguments and send one request to the target process's control
 * socket (checkpoint_target.c serves it; fc.h has the protocol). With custom storage (cuda.h
 * 13.4+, customStorageInfo_out) it maps each GPU's stream as device memory of its own, hands
 * out the CUcheckpointCustomStorageInfo and completes the operation in
 * cuCheckpointOperationComplete; the operations in flight are its only state. It calls stream.c,
 * vmm_table.c, device.c and core.c.
 *
 * Which calls need cuInit in the caller (CUDA driver API, "Checkpointing"): only Restore, and
 * only without persistence mode ("CUDA process restore requires persistence mode to be enabled
 * or cuInit to have been called before execution"); GetState, GetRestoreThreadId, Lock,
 * Checkpoint and Unlock document no such need, and NVIDIA's r570-features sample and CRIU's
 * driver-API cuda plugin call them from a process that never called cuInit. Custom storage
 * needs it (cuda.h: the caller retains the primary contexts). A pid may name any thread of the
 * target: it stands for its process, as /proc does (NVIDIA/cuda-checkpoint #41), and CRIU's
 * CLI plugin asks the state of the restore thread's id.
 */
#include "fc.h"

#include <sys/time.h>
#include <sys/uio.h>

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

/* Connect to pid's control socket with the deadline of op; -1 and *r set when that fails.
 * As the real driver answers (R580 on an H200, docs/gpu-validation.md): a pid with no process
 * is CUDA_ERROR_OPERATING_SYSTEM, a live process without a fakecuda control socket (it never
 * called cuInit, or runs without fakecuda) CUDA_ERROR_NOT_INITIALIZED; pid <= 0 is
 * CUDA_ERROR_INVALID_VALUE. */
/* The process (thread group) a pid names: a thread's id stands for its process, as in /proc. */
static int ck_tgid(int pid)
{
    char path[64], line[128];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    FILE *f = fopen(path, "re");
    int tgid = pid;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "Tgid:", 5)) {
            int t = atoi(line + 5);
            tgid = t > 0 ? t : pid;
            break;
        }
    if (f)
        fclose(f);
    if (tgid != pid)
        fc_logline("fakecuda: pid %d is a thread of process %d: the request goes to %d", pid, tgid, tgid);
    return tgid;
}

static int ck_connect(int pid, uint32_t op, uint32_t timeout_ms, CUresult *r)
{
    *r = g_forked_child ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_INVALID_VALUE; /* no driver after fork */
    if (pid <= 0 || g_forked_child)
        return -1;
    pid = ck_tgid(pid);
    if (kill(pid, 0) != 0 && errno == ESRCH) {
        *r = CUDA_ERROR_OPERATING_SYSTEM;
        return -1;
    }
    *r = CUDA_ERROR_NOT_INITIALIZED;
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0) {
        *r = CUDA_ERROR_OPERATING_SYSTEM;
        return -1;
    }
    struct sockaddr_un a;
    socklen_t len = ck_addr(&a, pid);
    if (connect(s, (struct sockaddr *)&a, len) != 0) {
        close(s);
        return -1;
    }
    uint64_t dl = ck_deadline_ms(op, timeout_ms);
    if (dl) {
        struct timeval tv = {(time_t)(dl / 1000), (suseconds_t)(dl % 1000) * 1000};
        setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }
    *r = CUDA_SUCCESS;
    return s;
}

/* Send q on s and read one ck_rep (CUDA_ERROR_TIMEOUT past the deadline). */
static CUresult ck_exchange(int s, const struct ck_req *q, size_t qlen, int *value)
{
    struct ck_rep p;
    if (send(s, q, qlen, MSG_NOSIGNAL) != (ssize_t)qlen)
        return CUDA_ERROR_OPERATING_SYSTEM;
    ssize_t n;
    do
        n = recv(s, &p, sizeof p, 0);
    while (n < 0 && errno == EINTR);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return CUDA_ERROR_TIMEOUT;
    if (n != (ssize_t)sizeof p)
        return CUDA_ERROR_OPERATING_SYSTEM;
    if (value)
        *value = p.value;
    return (CUresult)p.result;
}

static CUresult ck_send(int pid, const struct ck_req *q, size_t qlen, int *value)
{
    CUresult r;
    int s = ck_connect(pid, q->op, q->timeout_ms, &r);
    if (s < 0)
        return r;
    r = ck_exchange(s, q, qlen, value);
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
    API_NOGATE(0, ck_getstate(pid, state), "pid=%d state=%d", pid, OUTI(state));
}

static CUresult ck_gettid(int pid, int *tid)
{
    if (!tid)
        return CUDA_ERROR_INVALID_VALUE;
    return ck_call(pid, CK_GETTID, 0, tid);
}

FC_EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    API_NOGATE(0, ck_gettid(pid, tid), "pid=%d tid=%d", pid, OUTI(tid));
}

static CUresult ck_lock_call(int pid, CUcheckpointLockArgs *args)
{
    if (args && (args->reserved0 || !all_zero(args->reserved1, sizeof args->reserved1)))
        return CUDA_ERROR_INVALID_VALUE;
    return ck_call(pid, CK_LOCK, args ? args->timeoutMs : 0, NULL);
}

FC_EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    API_NOGATE(0, ck_lock_call(pid, args), "pid=%d timeoutMs=%u", pid, args ? args->timeoutMs : 0);
}

/* ------------------------------------------------------------------ custom storage */

/* One custom-storage checkpoint or restore awaiting cuCheckpointOperationComplete
 * (CUcheckpointOperationHandle points at it): the target's connection, kept open (its closing
 * abandons the operation in the target, checkpoint_target.c), and per GPU the stream mapped
 * here as device memory (a cs_op entry of the cuMemAlloc table) and the stream handed out. The
 * CUcheckpointCustomStorageInfo the caller gets lives in it: valid until the operation ends. */
#define FC_OP_MAGIC 0xfc0b5e7au
struct CUIcheckpointOperation_st {
    uint32_t magic;
    int pid, sock, restore;
    struct CUIcheckpointOperation_st *next;
    CUcheckpointCustomStorageInfo info;
    CUcheckpointCustomStoragePerDeviceData pdd[FC_MAX_DEVICES];
    struct fc_dmem *dm[FC_MAX_DEVICES];
};
static struct CUIcheckpointOperation_st *g_ops;
static pthread_mutex_t g_ops_mu = PTHREAD_MUTEX_INITIALIZER;

static const char *cs_what(int restore) { return restore ? "restore" : "checkpoint"; }

/* Unmap the streams and destroy the streams handed out (the caller's copies are done). */
static void cs_unmap(struct CUIcheckpointOperation_st *op)
{
    for (unsigned i = 0; i < op->info.deviceCount; i++) {
        struct fc_dmem *dm = op->dm[i];
        if (op->pdd[i].stream)
            stream_release(op->pdd[i].stream);
        if (!dm)
            continue;
        pthread_mutex_lock(&g_mu);
        for (struct fc_dmem **pp = &g_dmems; *pp; pp = &(*pp)->next)
            if (*pp == dm) {
                *pp = dm->next;
                break;
            }
        pthread_mutex_unlock(&g_mu);
        munmap((void *)dm->va, dm->mapped);
        free(dm);
        op->dm[i] = NULL;
    }
}

/* Drop the operation: unmap, tell the target (CK_ABORT: it is back to LOCKED, or CHECKPOINTED
 * for a restore, when this returns), free. */
static void cs_abort(struct CUIcheckpointOperation_st *op)
{
    cs_unmap(op);
    struct ck_req q = {CK_MAGIC, CK_ABORT, 0, 0};
    ck_exchange(op->sock, &q, sizeof q, NULL);
    close(op->sock);
    op->magic = 0;
    free(op);
}

/* The reply with the streams' memfds (SCM_RIGHTS); fds[] gets rep->ndev of them. */
static CUresult cs_recv(int s, struct ck_cs_rep *rep, int *fds)
{
    struct iovec iov = {rep, sizeof *rep};
    union {
        char buf[CMSG_SPACE(sizeof(int) * FC_MAX_DEVICES)];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    ssize_t n;
    do
        n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return CUDA_ERROR_TIMEOUT;
    unsigned got = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            unsigned k = (unsigned)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (unsigned i = 0; i < k && got < FC_MAX_DEVICES; i++)
                memcpy(&fds[got++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        }
    if (n != (ssize_t)sizeof *rep || rep->rep.result != CUDA_SUCCESS || got != rep->ndev ||
        rep->ndev > FC_MAX_DEVICES) {
        for (unsigned i = 0; i < got; i++)
            close(fds[i]);
        if (n != (ssize_t)sizeof *rep)
            return CUDA_ERROR_OPERATING_SYSTEM;
        return rep->rep.result != CUDA_SUCCESS ? (CUresult)rep->rep.result : CUDA_ERROR_OPERATING_SYSTEM;
    }
    return CUDA_SUCCESS;
}

/* Map stream i (fd) on this process's ordinal of the same GPU, whose primary context must be
 * retained (cuda.h: else CUDA_ERROR_INVALID_CONTEXT), with a stream of that context. */
static CUresult cs_map(struct CUIcheckpointOperation_st *op, unsigned i, const struct ck_cs_dev *e, int fd)
{
    char u[41];
    uuid_str(&e->uuid, u);
    int k = -1;
    for (int d = 0; d < g_ndev && k < 0; d++) {
        CUuuid mine;
        dev_uuid(d, &mine);
        if (!memcmp(mine.bytes, e->uuid.bytes, 16))
            k = d;
    }
    pthread_mutex_lock(&g_mu);
    int retained = k >= 0 && g_prim[k].prim_refs > 0;
    pthread_mutex_unlock(&g_mu);
    if (!retained) {
        fc_loud("custom-storage %s of pid %d refused: its GPU ordinal %d (%s, %llu bytes) is %s in the calling "
                "process (pid %d): cuDevicePrimaryCtxRetain every GPU the target uses first (nothing was "
                "changed) -> CUDA_ERROR_INVALID_CONTEXT",
                cs_what(op->restore), op->pid, e->ordinal, u, (unsigned long long)e->size,
                k < 0 ? "not visible" : "without a retained primary context", (int)getpid());
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    void *m = mmap(NULL, e->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    struct fc_dmem *dm = m == MAP_FAILED ? NULL : calloc(1, sizeof *dm);
    if (!dm) {
        if (m != MAP_FAILED)
            munmap(m, e->size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    dm->va = (uintptr_t)m;
    dm->size = dm->mapped = e->size;
    dm->dev = k;
    dm->ctx = &g_prim[k];
    dm->fd = -1;
    dm->cs_op = 1;
    pthread_mutex_lock(&g_mu);
    dm->buffer_id = g_next_buffer++;
    dm->next = g_dmems;
    g_dmems = dm;
    pthread_mutex_unlock(&g_mu);
    op->dm[i] = dm;
    op->pdd[i].devPtr = (CUdeviceptr)dm->va;
    op->pdd[i].size = e->size;
    return stream_create_in(&g_prim[k], &op->pdd[i].stream);
}

/* A custom-storage checkpoint or restore: q (qlen bytes, CK_F_CUSTOM set) to pid; on success
 * *out is the driver-allocated CUcheckpointCustomStorageInfo (zero devices: nothing to copy,
 * complete anyway). Checkpointing or restoring the calling process itself, or a driver version
 * below FC_CUSTOM_STORAGE_VERSION (FAKECUDA_DRIVER_VERSION), is CUDA_ERROR_NOT_SUPPORTED. */
static CUresult cs_call(int pid, int restore, struct ck_req *q, size_t qlen, CUcheckpointCustomStorageInfo **out)
{
    if (!atomic_load(&g_inited))
        return CUDA_ERROR_NOT_INITIALIZED; /* its streams belong to this process's primary contexts */
    if (g_driver_version < FC_CUSTOM_STORAGE_VERSION) {
        fc_logline("fakecuda: custom storage needs driver %d, this one is %d -> CUDA_ERROR_NOT_SUPPORTED",
                   FC_CUSTOM_STORAGE_VERSION, g_driver_version);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (pid == (int)getpid()) {
        fc_loud("custom-storage %s of the calling process (pid %d) is not supported (cuda.h) -> "
                "CUDA_ERROR_NOT_SUPPORTED",
                cs_what(restore), pid);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    q->flags = CK_F_CUSTOM;
    CUresult r;
    int s = ck_connect(pid, q->op, 0, &r);
    if (s < 0)
        return r;
    static struct ck_cs_rep rep; /* serialised by g_ops_mu */
    int fds[FC_MAX_DEVICES];
    pthread_mutex_lock(&g_ops_mu);
    memset(&rep, 0, sizeof rep);
    r = send(s, q, qlen, MSG_NOSIGNAL) == (ssize_t)qlen ? cs_recv(s, &rep, fds) : CUDA_ERROR_OPERATING_SYSTEM;
    struct CUIcheckpointOperation_st *op = r == CUDA_SUCCESS ? calloc(1, sizeof *op) : NULL;
    if (r == CUDA_SUCCESS && !op) {
        for (unsigned i = 0; i < rep.ndev; i++)
            close(fds[i]);
        r = CUDA_ERROR_OUT_OF_MEMORY;
        struct ck_req a = {CK_MAGIC, CK_ABORT, 0, 0};
        ck_exchange(s, &a, sizeof a, NULL);
    }
    if (r != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_ops_mu);
        close(s);
        return r;
    }
    *op = (struct CUIcheckpointOperation_st){FC_OP_MAGIC, pid, s, restore, NULL, {op, op->pdd, rep.ndev}, {{0}}, {0}};
    for (unsigned i = 0; i < rep.ndev; i++) {
        if (r == CUDA_SUCCESS)
            r = cs_map(op, i, &rep.dev[i], fds[i]);
        close(fds[i]); /* the mapping holds the memory */
    }
    if (r != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_ops_mu);
        cs_abort(op);
        return r;
    }
    op->next = g_ops;
    g_ops = op;
    pthread_mutex_unlock(&g_ops_mu);
    *out = &op->info;
    return CUDA_SUCCESS;
}

/* cuCheckpointOperationComplete: synchronize every stream handed out (an error there, e.g. a
 * faulting copy, drops the operation: the target is back to LOCKED, or CHECKPOINTED, and the
 * error is returned), unmap, and let the target finish (its result is returned: CHECKPOINTED,
 * or LOCKED after a restore). The fake has no stream capture, so
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED does not arise. A handle that is not an operation in
 * flight (NULL, completed, made up) is CUDA_ERROR_INVALID_VALUE; a target that gave up
 * waiting (FAKECUDA_CUSTOM_STORAGE_TIMEOUT_MS) is CUDA_ERROR_ILLEGAL_STATE. */
static CUresult cs_complete(CUcheckpointOperationHandle h)
{
    pthread_mutex_lock(&g_ops_mu);
    struct CUIcheckpointOperation_st **pp = &g_ops;
    while (*pp && *pp != h)
        pp = &(*pp)->next;
    struct CUIcheckpointOperation_st *op = *pp;
    if (op)
        *pp = op->next;
    pthread_mutex_unlock(&g_ops_mu);
    if (!op || op->magic != FC_OP_MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_SUCCESS;
    for (unsigned i = 0; i < op->info.deviceCount && r == CUDA_SUCCESS; i++)
        r = stream_sync(op->pdd[i].stream, 0);
    if (r != CUDA_SUCCESS) {
        fc_loud("custom-storage %s of pid %d: a copy on its stream failed (%s): the operation is dropped",
                cs_what(op->restore), op->pid, fc_errname(r));
        cs_abort(op);
        return r;
    }
    cs_unmap(op);
    struct ck_req q = {CK_MAGIC, CK_COMPLETE, 0, 0};
    r = ck_exchange(op->sock, &q, sizeof q, NULL);
    if (r == CUDA_ERROR_OPERATING_SYSTEM) {
        fc_loud("custom-storage %s of pid %d: the target no longer waits for it (it abandoned the operation, "
                "FAKECUDA_CUSTOM_STORAGE_TIMEOUT_MS) -> CUDA_ERROR_ILLEGAL_STATE",
                cs_what(op->restore), op->pid);
        r = CUDA_ERROR_ILLEGAL_STATE;
    }
    close(op->sock);
    op->magic = 0;
    free(op);
    return r;
}

FC_EXPORT CUresult cuCheckpointOperationComplete(CUcheckpointOperationHandle handle)
{
    API_NOGATE(1, cs_complete(handle), "handle=%p", (void *)handle);
}

static CUresult ck_checkpoint_call(int pid, CUcheckpointCheckpointArgs *args)
{
    if (!args || !args->customStorageInfo_out)
        return (args && !all_zero(args, sizeof *args)) ? CUDA_ERROR_INVALID_VALUE
                                                       : ck_call(pid, CK_CHECKPOINT, 0, NULL);
    if (!all_zero(args->reserved, sizeof args->reserved))
        return CUDA_ERROR_INVALID_VALUE;
    struct ck_req q = {CK_MAGIC, CK_CHECKPOINT, 0, 0};
    return cs_call(pid, 0, &q, sizeof q, args->customStorageInfo_out);
}

FC_EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
    API_NOGATE(0, ck_checkpoint_call(pid, args), "pid=%d custom=%d", pid, args && args->customStorageInfo_out);
}

/* gpuPairs (cuda.h CUcheckpointRestoreArgs, CUDA 13.0): more than FC_MAX_DEVICES pairs, a
 * repeated old or new UUID, or a new UUID that is no GPU of this node (node_get: the kernel-mode
 * view, which CUDA_VISIBLE_DEVICES does not narrow) is CUDA_ERROR_INVALID_VALUE here; the
 * target checks the old ones against the GPUs it was checkpointed with (checkpoint_checks.c).
 * Without cuInit in this process and without persistence mode (FAKECUDA_PERSISTENCE_MODE=0):
 * CUDA_ERROR_NOT_INITIALIZED (the code is the fake's pick), nothing sent. */
static CUresult ck_restore_call(int pid, CUcheckpointRestoreArgs *args)
{
    static struct ck_restore_req q; /* 3.5 KiB: not on a caller's stack; serialised by g_ck_mu */
    static pthread_mutex_t g_ck_mu = PTHREAD_MUTEX_INITIALIZER;
    unsigned np = args ? args->gpuPairsCount : 0;
    if (args) {
        if (!all_zero(args->reserved, sizeof args->reserved) || args->padding0)
            return CUDA_ERROR_INVALID_VALUE;
        if (np && !args->gpuPairs)
            return CUDA_ERROR_INVALID_VALUE;
        if (np > FC_MAX_DEVICES)
            return CUDA_ERROR_INVALID_VALUE;
    }
    if (!g_persistence && !atomic_load(&g_inited)) {
        fc_logline(
            "fakecuda: restore of pid %d refused: the calling process (pid %d) never called cuInit and persistence mode "
            "is off (FAKECUDA_PERSISTENCE_MODE=0); the driver API requires one of them for a restore "
            "(nothing was sent; the process stays checkpointed) -> CUDA_ERROR_NOT_INITIALIZED",
            pid, (int)getpid());
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    pthread_mutex_lock(&g_ck_mu);
    memset(&q, 0, sizeof q);
    q.hdr = (struct ck_req){CK_MAGIC, CK_RESTORE, 0, 0};
    for (int i = 0; i < node_count() && i < FC_MAX_DEVICES; i++)
        q.present[q.npresent++] = *node_get(i);
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
            fc_logline(
                "fakecuda: restore of pid %d refused: gpuPairs[%u] %s -> %s: the new GPU is no GPU of this node, or a "
                "UUID repeats (nothing was sent; the process stays checkpointed) -> CUDA_ERROR_INVALID_VALUE",
                pid, i, o, n);
            r = CUDA_ERROR_INVALID_VALUE;
            break;
        }
        q.pairs[i].old_uuid = gp->oldUuid;
        q.pairs[i].new_dev = q.present[hit];
        q.npairs = i + 1;
    }
    if (r == CUDA_SUCCESS && args && args->customStorageInfo_out)
        r = cs_call(pid, 1, &q.hdr, sizeof q, args->customStorageInfo_out);
    else if (r == CUDA_SUCCESS)
        r = ck_send(pid, &q.hdr, sizeof q, NULL);
    pthread_mutex_unlock(&g_ck_mu);
    return r;
}

FC_EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
    API_NOGATE(0, ck_restore_call(pid, args), "pid=%d pairs=%u custom=%d", pid, args ? args->gpuPairsCount : 0,
               args && args->customStorageInfo_out);
}

FC_EXPORT CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
    API_NOGATE(0, (args && !all_zero(args, sizeof *args)) ? CUDA_ERROR_INVALID_VALUE : ck_call(pid, CK_UNLOCK, 0, NULL),
               "pid=%d", pid);
}
