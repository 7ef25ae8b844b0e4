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

/* Host buffers for what stays in this process, or nothing changes: every VMM allocation and
 * cuMemAlloc buffer (a host checkpoint), only host-located allocations (custom storage holds
 * the GPU memory). Call with g_mu held. */
static CUresult ck_save(int custom)
{
    int nomem = 0;
    for (struct fc_alloc *a = g_allocs; a; a = a->next)
        if (!custom || a->kind != FC_KIND_ALLOCATION || a->device < 0)
            nomem |= !(a->saved = malloc(a->size ? a->size : 1));
    for (struct fc_dmem *d = g_dmems; d && !custom; d = d->next)
        nomem |= !(d->saved = malloc(d->mapped));
    if (!nomem)
        return CUDA_SUCCESS;
    for (struct fc_alloc *a = g_allocs; a; a = a->next) {
        free(a->saved);
        a->saved = NULL;
    }
    for (struct fc_dmem *d = g_dmems; d; d = d->next) {
        free(d->saved);
        d->saved = NULL;
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Copy into the saved buffers (where there are some), then release the device memory: every
 * mapping and cuMemAlloc range becomes a PROT_NONE reservation (CRIU sees no device memory),
 * every allocation memfd is closed. Call with g_mu held. */
static void ck_release(void)
{
    for (struct fc_dmem *d = g_dmems; d; d = d->next) {
        if (d->cs_op)
            continue;
        if (d->saved)
            memcpy(d->saved, (const void *)d->va, d->mapped);
        make_reserved(d->va, d->mapped);
        if (d->fd >= 0)
            close(d->fd);
        d->fd = -1;
        if (d->ipc_page) { /* an import (a launch job): a private copy from now on */
            __atomic_store_n(&d->ipc_page->importers[d->ipc_slot], 0, __ATOMIC_SEQ_CST);
            munmap(d->ipc_page, g_page);
            d->ipc_page = NULL;
            d->st_dev = 0; /* no longer the exporter's memfd: a new open maps afresh */
            d->st_ino = 0;
        }
    }
    for (struct fc_alloc *a = g_allocs; a; a = a->next) {
        size_t got = 0;
        while (a->saved && got < a->size) {
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
}

/* A host checkpoint (LOCKED -> CHECKPOINTED), or with custom storage (rep/fds non-NULL) the
 * streams for the controller (LOCKED -> CHECKPOINTING; the memory is released at complete). */
static CUresult ck_checkpoint(struct ck_cs_rep *rep, int *fds)
{
    if (g_ck_state != CU_PROCESS_STATE_LOCKED)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&g_mu);
    CUresult r = ck_refusals();
    if (r == CUDA_SUCCESS && rep)
        r = cs_begin(0, NULL, rep, fds);
    else if (r == CUDA_SUCCESS && (r = ck_save(0)) == CUDA_SUCCESS)
        ck_release();
    pthread_mutex_unlock(&g_mu);
    if (r == CUDA_SUCCESS)
        g_ck_state = rep ? CU_PROCESS_STATE_CHECKPOINTING : CU_PROCESS_STATE_CHECKPOINTED;
    return r;
}

/* Put the memory back at the same VAs from the saved buffers (a host checkpoint) or the
 * staged streams (custom storage), then rename the ordinals that moved. Call with g_mu held. */
static CUresult ck_apply_restore(const struct ck_placement *pl)
{
    CUresult r = CUDA_SUCCESS;
    for (struct fc_alloc *a = g_allocs; a && r == CUDA_SUCCESS; a = a->next) {
        const unsigned char *src = a->saved ? a->saved : cs_src(a->device, a->cs_off, a->size);
        int fd = src ? new_memfd(a->size) : -1;
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        size_t put = 0;
        while (put < a->size) {
            ssize_t n = pwrite(fd, src + put, a->size - put, (off_t)put);
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
        const void *src = d->saved ? d->saved : (d->cs_op ? NULL : cs_src(d->dev, d->cs_off, d->mapped));
        if (!src)
            continue;
        /* an own buffer gets a fresh memfd (handles from before the checkpoint are stale: a new
         * cuIpcGetMemHandle shares it again); an import comes back as private anonymous memory */
        if (d->ipc_refs ? mmap((void *)d->va, d->mapped, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED
                        : dmem_back(d, d->va) != 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        memcpy((void *)d->va, src, d->mapped);
        free(d->saved);
        d->saved = NULL;
    }
    /* the memory is now on the new GPUs: the same ordinals name them from here on, and the
     * node this process knows is the new one */
    for (int d = 0; d < g_ndev && r == CUDA_SUCCESS && pl->nmoved; d++) {
        if (!memcmp(pl->ord[d].uuid.bytes, dev_get(d)->uuid.bytes, 16))
            continue;
        char o[41], n[41];
        uuid_str(&dev_get(d)->uuid, o);
        uuid_str(&pl->ord[d].uuid, n);
        fc_logline("fakecuda: restore moved ordinal %d from %s to %s (%llu bytes)", d, o, n, g_used[d]);
        dev_set(d, &pl->ord[d]);
    }
    for (int k = 0; k < node_count() && r == CUDA_SUCCESS; k++)
        node_set(k, &pl->node[k]);
    return r;
}

static struct ck_placement g_rs; /* a restore's placement (kept for a custom-storage complete) */

static CUresult ck_restored(CUresult r)
{
    if (r != CUDA_SUCCESS) {
        g_ck_state = CU_PROCESS_STATE_FAILED;
        fc_loud("restore failed: %s", fc_errname(r));
        return r;
    }
    g_ck_state = CU_PROCESS_STATE_LOCKED;
    return CUDA_SUCCESS;
}

/* A host restore (CHECKPOINTED -> LOCKED), or with custom storage (rep/fds non-NULL) zeroed
 * streams for the controller to fill (CHECKPOINTED -> RESTORING; copied back at complete). The
 * mode must be the checkpoint's where GPU bytes are involved: GPU bytes checkpointed to custom
 * storage are not in this process, and a host checkpoint's are not in the controller's storage
 * (ILLEGAL_STATE, the fake's pick: nothing is changed). A process that had no GPU memory
 * restores either way. */
static CUresult ck_restore(const struct ck_restore_req *rq, struct ck_cs_rep *rep, int *fds)
{
    if (g_ck_state != CU_PROCESS_STATE_CHECKPOINTED)
        return CUDA_ERROR_ILLEGAL_STATE;
    if (rep ? cs_host_bytes() : cs_pending()) {
        fc_loud("restore refused: pid %d was checkpointed %s, and this restore is %s: restore the way it was "
                "checkpointed (nothing was changed; the process stays checkpointed) -> CUDA_ERROR_ILLEGAL_STATE",
                (int)getpid(), cs_pending() ? "to custom storage" : "to host memory",
                rep ? "from custom storage" : "from host memory");
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    pthread_mutex_lock(&g_mu);
    CUresult r = ck_place(rq, &g_rs);
    if (r == CUDA_SUCCESS && rep) {
        r = cs_begin(1, g_rs.ord, rep, fds);
        pthread_mutex_unlock(&g_mu);
        if (r == CUDA_SUCCESS)
            g_ck_state = CU_PROCESS_STATE_RESTORING;
        return r;
    }
    if (r == CUDA_SUCCESS)
        r = ck_apply_restore(&g_rs);
    else {
        pthread_mutex_unlock(&g_mu);
        return r;
    }
    pthread_mutex_unlock(&g_mu);
    return ck_restored(r);
}

/* cuCheckpointOperationComplete, served: a checkpoint releases the memory (host-located
 * allocations saved as usual) -> CHECKPOINTED; a restore copies the streams back -> LOCKED
 * (FAILED if that fails). Out of host memory for a checkpoint: the operation is dropped, the
 * process LOCKED with its memory intact, CUDA_ERROR_OUT_OF_MEMORY. */
static CUresult ck_complete(void)
{
    pthread_mutex_lock(&g_mu);
    CUresult r;
    if (g_ck_state == CU_PROCESS_STATE_CHECKPOINTING) {
        r = ck_save(1);
        if (r == CUDA_SUCCESS)
            ck_release();
        cs_set_pending(r == CUDA_SUCCESS && cs_staged());
        cs_end();
        pthread_mutex_unlock(&g_mu);
        g_ck_state = r == CUDA_SUCCESS ? CU_PROCESS_STATE_CHECKPOINTED : CU_PROCESS_STATE_LOCKED;
        return r;
    }
    r = ck_apply_restore(&g_rs);
    cs_end();
    if (r == CUDA_SUCCESS)
        cs_set_pending(0);
    pthread_mutex_unlock(&g_mu);
    return ck_restored(r);
}

/* An operation not completed (CK_ABORT, the controller's connection closed, or the deadline):
 * a checkpoint is dropped (LOCKED, memory intact: unlock resumes, or checkpoint again); a
 * restore returns to CHECKPOINTED (restore again). */
static void ck_abort(const char *why)
{
    int ck = g_ck_state == CU_PROCESS_STATE_CHECKPOINTING;
    pthread_mutex_lock(&g_mu);
    cs_end();
    pthread_mutex_unlock(&g_mu);
    g_ck_state = ck ? CU_PROCESS_STATE_LOCKED : CU_PROCESS_STATE_CHECKPOINTED;
    fc_loud("custom-storage %s of pid %d abandoned (%s): %s", ck ? "checkpoint" : "restore", (int)getpid(), why,
            ck ? "the process is LOCKED with its GPU memory intact (unlock resumes it)"
               : "the process stays CHECKPOINTED (restore again)");
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
    static const char *n[] = {"?",      "GetState",           "Lock",     "Checkpoint", "Restore",
                              "Unlock", "GetRestoreThreadId", "Complete", "Abort"};
    return op < sizeof n / sizeof n[0] ? n[op] : "?";
}

/* 1 when the controller on `c` has closed its end (it stopped waiting for the reply). */
static int ck_abandoned(int c)
{
    struct pollfd pf = {c, POLLRDHUP, 0};
    return poll(&pf, 1, 0) == 1 && (pf.revents & (POLLHUP | POLLRDHUP | POLLERR));
}

/* The custom-storage operation in progress: its controller's connection (-1: none) and when it
 * must be completed by (CLOCK_MONOTONIC ms; 0: no deadline). */
static int g_op_conn = -1;
static uint64_t g_op_deadline_ms;

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void op_close(void)
{
    close(g_op_conn);
    g_op_conn = -1;
}

/* One message on the operation's connection: CK_COMPLETE or CK_ABORT, answered; anything else
 * (EOF: the controller died) abandons the operation. */
static void op_serve(void)
{
    struct ck_req q;
    ssize_t n = recv(g_op_conn, &q, sizeof q, 0);
    struct ck_rep p = {CUDA_ERROR_INVALID_VALUE, 0};
    if (n != (ssize_t)sizeof q || q.magic != CK_MAGIC || (q.op != CK_COMPLETE && q.op != CK_ABORT)) {
        ck_abort(n == 0 ? "its controller closed the connection before cuCheckpointOperationComplete"
                        : "a malformed message from its controller");
        op_close();
        return;
    }
    if (q.op == CK_COMPLETE) {
        p.result = ck_complete();
    } else {
        ck_abort("the controller aborted it");
        p.result = CUDA_SUCCESS;
    }
    fc_logline("fakecuda: control %s = %s (state %d)", ck_opname(q.op), fc_errname(p.result), g_ck_state);
    send(g_op_conn, &p, sizeof p, MSG_NOSIGNAL);
    op_close();
}

/* The reply to a custom-storage checkpoint/restore: the streams' memfds ride along
 * (SCM_RIGHTS). If the controller is gone the operation is abandoned at once. */
static void cs_reply(int c, struct ck_cs_rep *rep, int *fds)
{
    struct iovec iov = {rep, sizeof *rep};
    union {
        char buf[CMSG_SPACE(sizeof(int) * FC_MAX_DEVICES)];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    int ok = rep->rep.result == CUDA_SUCCESS;
    if (ok && rep->ndev) {
        memset(&u, 0, sizeof u);
        mh.msg_control = u.buf;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * rep->ndev);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * rep->ndev);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * rep->ndev);
    }
    if (sendmsg(c, &mh, MSG_NOSIGNAL) != (ssize_t)sizeof *rep) {
        if (ok)
            ck_abort("its controller left before the reply");
        close(c);
        return;
    }
    if (!ok) {
        close(c);
        return;
    }
    g_op_conn = c;
    g_op_deadline_ms = g_cs_timeout_ms ? mono_ms() + g_cs_timeout_ms : 0;
}

/* One request on a fresh connection `c` (closed here, or kept as the operation's). */
static void ck_serve(int c)
{
    static struct ck_restore_req rq; /* only this thread uses it */
    static struct ck_cs_rep cs;
    int fds[FC_MAX_DEVICES];
    struct ck_rep p = {CUDA_ERROR_INVALID_VALUE, 0};
    memset(&rq, 0, sizeof rq);
    ssize_t n = recv(c, &rq, sizeof rq, 0);
    const struct ck_req q = rq.hdr;
    int full = q.op == CK_RESTORE ? n == (ssize_t)sizeof rq : n == (ssize_t)sizeof q;
    int custom = full && (q.op == CK_CHECKPOINT || q.op == CK_RESTORE) && (q.flags & CK_F_CUSTOM);
    if (full && q.magic == CK_MAGIC && q.op != CK_GETSTATE && q.op != CK_GETTID && ck_abandoned(c)) {
        /* the controller gave up waiting (this process was stopped past its deadline): a
         * request nobody waits for any more is not applied, so a late lock cannot park
         * the process after the caller was told CUDA_ERROR_TIMEOUT */
        fc_logline("fakecuda: control %s abandoned by its controller before it was served: not applied",
                   ck_opname(q.op));
        close(c);
        return;
    }
    memset(&cs, 0, sizeof cs);
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
        case CK_CHECKPOINT: p.result = ck_checkpoint(custom ? &cs : NULL, fds); break;
        case CK_RESTORE: p.result = ck_restore(&rq, custom ? &cs : NULL, fds); break;
        case CK_UNLOCK: p.result = ck_unlock(); break;
        default: p.result = CUDA_ERROR_ILLEGAL_STATE; break; /* Complete/Abort: no operation here */
        }
        fc_logline("fakecuda: control %s%s = %s (state %d)", ck_opname(q.op), custom ? " (custom storage)" : "",
                   fc_errname(p.result), g_ck_state);
    }
    if (custom) {
        cs.rep = p;
        cs_reply(c, &cs, fds);
        return;
    }
    ssize_t w = send(c, &p, sizeof p, MSG_NOSIGNAL);
    if (w != (ssize_t)sizeof p && full && q.op == CK_LOCK && p.result == CUDA_SUCCESS) {
        /* the controller left while the lock was being taken: undo it (as above) */
        fc_logline("fakecuda: control Lock abandoned by its controller while it was served: unlocked again (%s)",
                   fc_errname(ck_unlock()));
    }
    close(c);
}

static void *ck_thread(void *arg)
{
    (void)arg;
    g_ck_tid = fc_tid();
    for (;;) {
        struct pollfd pf[2] = {{g_ck_listen, POLLIN, 0}, {g_op_conn, POLLIN, 0}};
        int timeout = -1;
        if (g_op_conn >= 0 && g_op_deadline_ms) {
            uint64_t now = mono_ms();
            timeout = now >= g_op_deadline_ms
                          ? 0
                          : (int)(g_op_deadline_ms - now > 3600000 ? 3600000 : g_op_deadline_ms - now);
        }
        int k = poll(pf, g_op_conn >= 0 ? 2 : 1, timeout);
        if (k < 0) {
            struct timespec ts = {0, 10000000};
            nanosleep(&ts, NULL);
            continue;
        }
        if (g_op_conn >= 0 && g_op_deadline_ms && mono_ms() >= g_op_deadline_ms && !(pf[1].revents & POLLIN)) {
            char why[96];
            snprintf(why, sizeof why, "not completed within FAKECUDA_CUSTOM_STORAGE_TIMEOUT_MS=%llu", g_cs_timeout_ms);
            ck_abort(why);
            op_close();
            continue;
        }
        if (g_op_conn >= 0 && pf[1].revents)
            op_serve();
        if (!(pf[0].revents & POLLIN))
            continue;
        int c = accept4(g_ck_listen, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0)
            continue;
        ck_serve(c);
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
