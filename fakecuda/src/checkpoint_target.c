/*
 * checkpoint_target.c: the target side of the checkpoint API (CUDA driver API,
 * "Checkpointing"). A control thread started at the first successful cuInit serves the
 * abstract socket "\0fakecuda-<pid>" (SOCK_SEQPACKET, one request per connection, fc.h has
 * the protocol); its tid is the restore thread id. Lock closes the entry gate and drains it,
 * Checkpoint copies device memory out and leaves reservations, Restore maps it back at the
 * same VAs (on the GPUs its gpuPairs name), Unlock opens the gate. It owns the process state;
 * it touches the gate and every VMM table, and calls vmm_table.c, device.c and core.c.
 */
#include "fc.h"

#include <poll.h>

/* ------------------------------------------------------------------ checkpoint target */

static int g_ck_state = CU_PROCESS_STATE_RUNNING; /* owned by the control thread */
static pid_t g_ck_tid;

static void deadline_after(struct timespec *ts, unsigned ms)
{
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static CUresult ck_lock(unsigned timeout_ms)
{
    if (g_ck_state != CU_PROCESS_STATE_RUNNING)
        return CUDA_ERROR_ILLEGAL_STATE;
    struct timespec dl;
    deadline_after(&dl, timeout_ms);
    pthread_mutex_lock(&g_gate.mu);
    atomic_store(&g_gate.closed, 1);
    while (atomic_load(&g_gate.inflight) > 0 || g_gate.pending_ops > 0) {
        int e = timeout_ms ? pthread_cond_timedwait(&g_gate.cv, &g_gate.mu, &dl)
                           : pthread_cond_wait(&g_gate.cv, &g_gate.mu);
        if (e == ETIMEDOUT && (atomic_load(&g_gate.inflight) > 0 || g_gate.pending_ops > 0)) {
            long inflight = atomic_load(&g_gate.inflight), pend = g_gate.pending_ops;
            atomic_store(&g_gate.closed, 0);
            pthread_cond_broadcast(&g_gate.cv);
            pthread_mutex_unlock(&g_gate.mu);
            fc_logline("fakecuda: lock timed out after %u ms: %ld calls in flight, %ld stream ops pending", timeout_ms,
                       inflight, pend);
            return CUDA_ERROR_NOT_READY;
        }
    }
    pthread_mutex_unlock(&g_gate.mu);
    g_ck_state = CU_PROCESS_STATE_LOCKED;
    return CUDA_SUCCESS;
}

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

static CUresult ck_checkpoint(void)
{
    if (g_ck_state != CU_PROCESS_STATE_LOCKED)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&g_mu);
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
        int handles = mc1->handles, maps = mc1->maps, binds = mc1->binds;
        uint64_t id = mc1->object_id;
        pthread_mutex_unlock(&g_mu);
        fc_loud("checkpoint refused: the process holds %d multicast object(s) (object %" PRIu64 ": %d handle "
                "refs, %d mappings, %d bindings); the real driver hangs on them -> CUDA_ERROR_NOT_SUPPORTED",
                nmc, id, handles, maps, binds);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    CUresult ipc = ck_ipc_check();
    if (ipc != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_mu);
        return ipc;
    }
    /* An exported fd still open in this process carries the sharing: the real driver cannot
     * dump it. */
    struct fc_export **pp = &g_exports;
    while (*pp) {
        struct fc_export *x = *pp;
        struct stat st;
        if (fstat(x->fd, &st) == 0 && st.st_dev == x->st_dev && st.st_ino == x->st_ino) {
            pthread_mutex_unlock(&g_mu);
            fc_loud("checkpoint refused: exported fd %d of allocation handle %llu (object %" PRIu64
                    ") is still open -> CUDA_ERROR_NOT_SUPPORTED",
                    x->fd, x->handle, x->object_id);
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        *pp = x->next; /* closed (or the number was reused): forget it */
        free(x);
    }
    /* host buffers for every VMM allocation and every cuMemAlloc buffer, or nothing changes */
    int nomem = 0;
    for (struct fc_alloc *a = g_allocs; a; a = a->next)
        nomem |= !(a->saved = malloc(a->size ? a->size : 1));
    for (struct fc_dmem *d = g_dmems; d; d = d->next)
        nomem |= !(d->saved = malloc(d->mapped));
    if (nomem) {
        for (struct fc_alloc *a = g_allocs; a; a = a->next) {
            free(a->saved);
            a->saved = NULL;
        }
        for (struct fc_dmem *d = g_dmems; d; d = d->next) {
            free(d->saved);
            d->saved = NULL;
        }
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* cuMemAlloc memory: copied out, its range becomes a PROT_NONE reservation (CRIU sees no
     * device memory), Restore maps it back at the same VA */
    for (struct fc_dmem *d = g_dmems; d; d = d->next) {
        memcpy(d->saved, (const void *)d->va, d->mapped);
        make_reserved(d->va, d->mapped);
        if (d->fd >= 0)
            close(d->fd);
        d->fd = -1;
        if (d->ipc_page) { /* an import (FAKECUDA_LAUNCH_JOB): a private copy from now on */
            __atomic_store_n(&d->ipc_page->importers[d->ipc_slot], 0, __ATOMIC_SEQ_CST);
            munmap(d->ipc_page, g_page);
            d->ipc_page = NULL;
            d->st_dev = 0; /* no longer the exporter's memfd: a new open maps afresh */
            d->st_ino = 0;
        }
    }
    for (struct fc_alloc *a = g_allocs; a; a = a->next) {
        size_t got = 0;
        while (got < a->size) {
            ssize_t n = pread(a->fd, (char *)a->saved + got, a->size - got, (off_t)got);
            if (n <= 0)
                break;
            got += (size_t)n;
        }
    }
    for (struct fc_map *m = g_maps; m; m = m->next)
        make_reserved(m->va, m->size);
    for (struct fc_alloc *a = g_allocs; a; a = a->next) {
        close(a->fd);
        a->fd = -1;
    }
    pthread_mutex_unlock(&g_mu);
    g_ck_state = CU_PROCESS_STATE_CHECKPOINTED;
    return CUDA_SUCCESS;
}

/* Where a restore puts this process's devices (cuda.h CUcheckpointRestoreArgs.gpuPairs; the
 * rules of cuda-checkpoint --device-map: every checkpointed GPU listed, the same chip, enough
 * memory). Fills to[d] for every ordinal; nothing changes on a refusal, which leaves the
 * process CHECKPOINTED. The codes are the fake's pick (none is documented): a pair naming no
 * GPU of this process, a checkpointed GPU left out, or another model -> INVALID_VALUE; less
 * memory than the process holds on it -> OUT_OF_MEMORY; without pairs, a checkpointed GPU the
 * controller does not see -> INVALID_DEVICE. Call with g_mu held. */
static CUresult ck_place(const struct ck_restore_req *rq, struct fc_dev *to, int *nmoved)
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

static CUresult ck_restore(const struct ck_restore_req *rq)
{
    if (g_ck_state != CU_PROCESS_STATE_CHECKPOINTED)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&g_mu);
    struct fc_dev to[FC_MAX_DEVICES];
    int nmoved = 0;
    CUresult r = ck_place(rq, to, &nmoved);
    if (r != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_mu);
        return r;
    }
    for (struct fc_alloc *a = g_allocs; a && r == CUDA_SUCCESS; a = a->next) {
        int fd = new_memfd(a->size);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        size_t put = 0;
        while (put < a->size) {
            ssize_t n = pwrite(fd, (char *)a->saved + put, a->size - put, (off_t)put);
            if (n <= 0)
                break;
            put += (size_t)n;
        }
        a->fd = fd;
        a->st_dev = st.st_dev;
        a->st_ino = st.st_ino;
        a->creator_pid = (int)getpid(); /* a private copy now */
        write_meta(fd, a);
        free(a->saved);
        a->saved = NULL;
    }
    for (struct fc_map *m = g_maps; m && r == CUDA_SUCCESS; m = m->next) {
        if (mmap((void *)m->va, m->size, PROT_NONE, MAP_SHARED | MAP_FIXED, m->alloc->fd, (off_t)m->offset) ==
            MAP_FAILED)
            r = CUDA_ERROR_OUT_OF_MEMORY;
        else
            map_apply_prot(m);
    }
    for (struct fc_dmem *d = g_dmems; d && r == CUDA_SUCCESS; d = d->next) {
        if (!d->saved)
            continue;
        /* an own buffer gets a fresh memfd (handles from before the checkpoint are stale: a new
         * cuIpcGetMemHandle shares it again); an import comes back as private anonymous memory */
        if (d->ipc_refs ? mmap((void *)d->va, d->mapped, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED
                        : dmem_back(d, d->va) != 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        memcpy((void *)d->va, d->saved, d->mapped);
        free(d->saved);
        d->saved = NULL;
    }
    /* the memory is now on the new GPUs: the same ordinals name them from here on */
    for (int d = 0; d < g_ndev && r == CUDA_SUCCESS && nmoved; d++) {
        if (!memcmp(to[d].uuid.bytes, dev_get(d)->uuid.bytes, 16))
            continue;
        char o[41], n[41];
        uuid_str(&dev_get(d)->uuid, o);
        uuid_str(&to[d].uuid, n);
        fc_logline("fakecuda: restore moved ordinal %d from %s to %s (%llu bytes)", d, o, n, g_used[d]);
        dev_set(d, &to[d]);
    }
    pthread_mutex_unlock(&g_mu);
    if (r != CUDA_SUCCESS) {
        g_ck_state = CU_PROCESS_STATE_FAILED;
        fc_loud("restore failed: %s", fc_errname(r));
        return r;
    }
    g_ck_state = CU_PROCESS_STATE_LOCKED;
    return CUDA_SUCCESS;
}

static CUresult ck_unlock(void)
{
    if (g_ck_state != CU_PROCESS_STATE_LOCKED)
        return CUDA_ERROR_ILLEGAL_STATE;
    g_ck_state = CU_PROCESS_STATE_RUNNING;
    pthread_mutex_lock(&g_gate.mu);
    atomic_store(&g_gate.closed, 0);
    pthread_cond_broadcast(&g_gate.cv);
    pthread_mutex_unlock(&g_gate.mu);
    return CUDA_SUCCESS;
}

static const char *ck_opname(uint32_t op)
{
    static const char *n[] = {"?", "GetState", "Lock", "Checkpoint", "Restore", "Unlock", "GetRestoreThreadId"};
    return op < sizeof n / sizeof n[0] ? n[op] : "?";
}

/* 1 when the controller on `c` has closed its end (it stopped waiting for the reply). */
static int ck_abandoned(int c)
{
    struct pollfd pf = {c, POLLRDHUP, 0};
    return poll(&pf, 1, 0) == 1 && (pf.revents & (POLLHUP | POLLRDHUP | POLLERR));
}

static void *ck_thread(void *arg)
{
    (void)arg;
    g_ck_tid = fc_tid();
    for (;;) {
        int c = accept4(g_ck_listen, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            struct timespec ts = {0, 10000000};
            nanosleep(&ts, NULL);
            continue;
        }
        static struct ck_restore_req rq; /* only this thread uses it */
        struct ck_rep p = {CUDA_ERROR_INVALID_VALUE, 0};
        memset(&rq, 0, sizeof rq);
        ssize_t n = recv(c, &rq, sizeof rq, 0);
        const struct ck_req q = rq.hdr;
        int full = q.op == CK_RESTORE ? n == (ssize_t)sizeof rq : n == (ssize_t)sizeof q;
        if (full && q.magic == CK_MAGIC && q.op != CK_GETSTATE && q.op != CK_GETTID && ck_abandoned(c)) {
            /* the controller gave up waiting (this process was stopped past its deadline): a
             * request nobody waits for any more is not applied, so a late lock cannot park
             * the process after the caller was told CUDA_ERROR_TIMEOUT */
            fc_logline("fakecuda: control %s abandoned by its controller before it was served: not applied",
                       ck_opname(q.op));
            close(c);
            continue;
        }
        if (full && q.magic == CK_MAGIC) {
            switch (q.op) {
            case CK_GETSTATE:
                p.result = CUDA_SUCCESS;
                p.value = g_ck_state;
                break;
            case CK_GETTID:
                p.result = CUDA_SUCCESS;
                p.value = g_ck_tid;
                break;
            case CK_LOCK: p.result = ck_lock(q.timeout_ms); break;
            case CK_CHECKPOINT: p.result = ck_checkpoint(); break;
            case CK_RESTORE: p.result = ck_restore(&rq); break;
            case CK_UNLOCK: p.result = ck_unlock(); break;
            }
            fc_logline("fakecuda: control %s = %s (state %d)", ck_opname(q.op), fc_errname(p.result), g_ck_state);
        }
        ssize_t w = send(c, &p, sizeof p, MSG_NOSIGNAL);
        if (w != (ssize_t)sizeof p && full && q.op == CK_LOCK && p.result == CUDA_SUCCESS) {
            /* the controller left while the lock was being taken: undo it (as above) */
            fc_logline("fakecuda: control Lock abandoned by its controller while it was served: unlocked again (%s)",
                       fc_errname(ck_unlock()));
        }
        close(c);
    }
    return NULL;
}

void ckpt_start(void)
{
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un a;
    socklen_t len = ck_addr(&a, (int)getpid());
    if (s < 0 || bind(s, (struct sockaddr *)&a, len) != 0 || listen(s, 16) != 0) {
        fc_loud("cannot serve the checkpoint control socket: %s", strerror(errno));
        if (s >= 0)
            close(s);
        return;
    }
    g_ck_listen = s;
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&at, 256 * 1024);
    if (pthread_create(&t, &at, ck_thread, NULL) != 0)
        fc_loud("cannot start the checkpoint control thread");
    pthread_attr_destroy(&at);
}
