/*
 * event.c: events and interprocess events (CUDA driver API, "Event Management": cuEventCreate,
 * cuEventRecord[WithFlags][_ptsz], cuEventQuery, cuEventSynchronize, cuEventDestroy[_v2],
 * cuStreamWaitEvent[_ptsz]; "Inter-Process Communication": cuIpcGetEventHandle,
 * cuIpcOpenEventHandle; cuda.h 13.5).
 *
 * An event is two counters: `recorded`, the sequence of its latest record (0: never recorded),
 * and `completed`, the highest sequence whose stream reached its record (the stream worker
 * runs a host function in order, stream.c OP_HOSTFN). Complete means completed >= recorded.
 * A wait captures `recorded` at the call and blocks its stream (not the caller) until
 * `completed` reaches it; an event never recorded is complete, and waiting on it does nothing.
 * An event created with CU_EVENT_INTERPROCESS keeps its counters in a memfd page (the fd stays
 * open, as a cuMemAlloc buffer's does, so that another process can open it); its 64-byte
 * CUipcEventHandle names the creator's pid, the fd number and inode (struct fc_ipc_event_wire),
 * and cuIpcOpenEventHandle in another process maps the same page: a record in either process
 * is seen by a query, synchronize or stream wait in the other. Two records in flight on
 * different streams complete as the highest sequence reached (an approximation: the real
 * event is the latest record's completion).
 *
 * The CUevent value is the address of a struct fc_event, checked against the live list. A
 * destroyed event's queued records and waits still complete (cuda.h: "resources will
 * automatically be released asynchronously at completion").
 *
 * Native checkpoint with an interprocess event (created so, or opened) is refused: the driver
 * documentation does not say what it does with one (scripts/gpu_check_probe.py, experiment
 * "ipc_event_checkpoint"); event_ck_refusal, called by checkpoint_checks.c.
 * Touches the event list (under g_mu); calls stream.c, device.c and core.c.
 */
#include "fc.h"

#define FC_EVENT_MAGIC 0xfcefe701u
#define FC_EVSH_MAGIC "FCEVENT"
#define FC_IPC_EVENT_MAGIC "FCIPCEV"
#define FC_EVENT_FLAGS (CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)

struct fc_evshared {             /* an event's state; a memfd page for an interprocess event */
    char magic[8];               /* FC_EVSH_MAGIC */
    uint32_t version, flags;     /* FC_META_VERSION; the creator's CU_EVENT_* */
    int32_t creator_pid;
    uint32_t pad;
    uint64_t id;                 /* the creator's event id */
    uint64_t recorded;           /* atomic: the latest record's sequence (0: never recorded) */
    uint64_t completed;          /* atomic: the highest sequence a stream reached */
};

struct fc_event {
    unsigned magic;
    struct fc_event *next;
    struct fc_ctx *ctx;          /* the context it was created (opened) in */
    unsigned flags;              /* CU_EVENT_* (an opened event: DISABLE_TIMING, cuda.h) */
    int fd;                      /* interprocess, created here: the memfd (-1 otherwise) */
    dev_t st_dev;
    ino_t st_ino;
    struct fc_evshared *sh;      /* the counters: a shared page, or calloc'd */
    int opened_from;             /* cuIpcOpenEventHandle: the exporter's pid (0: created here) */
    int live;                    /* not yet destroyed by the application */
    int refs;                    /* the application's handle + queued records and waits */
};

/* CUipcEventHandle (64 bytes, CU_IPC_HANDLE_SIZE) as fakecuda fills it. */
struct fc_ipc_event_wire {
    char magic[8];               /* FC_IPC_EVENT_MAGIC, NUL-terminated */
    int32_t pid, fd;             /* the creator and its memfd's number */
    uint64_t st_dev, st_ino;     /* the memfd's identity */
    uint64_t id;                 /* the creator's event id */
    uint32_t flags, pad;
    uint8_t zero[16];
};
_Static_assert(sizeof(struct fc_ipc_event_wire) == CU_IPC_HANDLE_SIZE, "CUipcEventHandle is 64 bytes");

static struct fc_event *g_events;
static uint64_t g_next_event = 1;

/* A live event by its CUevent value (g_mu held). */
static struct fc_event *event_get(CUevent h)
{
    for (struct fc_event *e = g_events; e; e = e->next)
        if (e == (struct fc_event *)h && e->live)
            return e;
    return NULL;
}

/* Drops one reference; the last frees the event (g_mu held). */
static void event_unref(struct fc_event *e)
{
    if (--e->refs > 0)
        return;
    struct fc_event **pp = &g_events;
    while (*pp && *pp != e)
        pp = &(*pp)->next;
    if (*pp)
        *pp = e->next;
    if (e->fd >= 0 || e->opened_from)
        munmap(e->sh, g_page);
    else
        free(e->sh);
    if (e->fd >= 0)
        close(e->fd);
    e->magic = 0;
    free(e);
}

/* The live event h with one more reference (NULL if none). */
static struct fc_event *event_hold(CUevent h)
{
    pthread_mutex_lock(&g_mu);
    struct fc_event *e = event_get(h);
    if (e)
        e->refs++;
    pthread_mutex_unlock(&g_mu);
    return e;
}

static void event_drop(struct fc_event *e)
{
    pthread_mutex_lock(&g_mu);
    event_unref(e);
    pthread_mutex_unlock(&g_mu);
}

static int event_done(const struct fc_evshared *sh, uint64_t target)
{
    return target == 0 || __atomic_load_n(&sh->completed, __ATOMIC_ACQUIRE) >= target;
}

/* Poll until sh->completed reaches target: 20 us doubling to 1 ms, as a stream wait does. */
static void event_wait_for(const struct fc_evshared *sh, uint64_t target)
{
    unsigned sleep_ns = 20000;
    while (!event_done(sh, target)) {
        struct timespec ts = {0, (long)sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < 1000000)
            sleep_ns *= 2;
    }
}

/* ------------------------------------------------------------------ create, destroy */

/* A memfd page holding the counters (interprocess events), mapped shared. */
static struct fc_evshared *evshared_map(int fd)
{
    void *p = mmap(NULL, g_page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* cuda.h: Flags are CU_EVENT_DEFAULT, _BLOCKING_SYNC, _DISABLE_TIMING, _INTERPROCESS ("must be
 * specified along with CU_EVENT_DISABLE_TIMING"); anything else -> INVALID_VALUE. */
static CUresult event_create(CUevent *ph, unsigned flags)
{
    if (!ph || (flags & ~(unsigned)FC_EVENT_FLAGS) ||
        ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING)))
        return CUDA_ERROR_INVALID_VALUE;
    struct fc_ctx *c = cur_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct fc_event *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = FC_EVENT_MAGIC;
    e->ctx = c;
    e->flags = flags;
    e->fd = -1;
    struct stat st;
    if (flags & CU_EVENT_INTERPROCESS) {
        e->fd = memfd_create("fakecuda-event", MFD_CLOEXEC);
        if (e->fd < 0 || ftruncate(e->fd, (off_t)g_page) != 0 || fstat(e->fd, &st) != 0 ||
            !(e->sh = evshared_map(e->fd))) {
            if (e->fd >= 0)
                close(e->fd);
            free(e);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        e->st_dev = st.st_dev;
        e->st_ino = st.st_ino;
    } else if (!(e->sh = calloc(1, sizeof *e->sh))) {
        free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&g_mu);
    memcpy(e->sh->magic, FC_EVSH_MAGIC, sizeof FC_EVSH_MAGIC);
    e->sh->version = FC_META_VERSION;
    e->sh->flags = flags;
    e->sh->creator_pid = (int32_t)getpid();
    e->sh->id = g_next_event++;
    e->live = 1;
    e->refs = 1;
    e->next = g_events;
    g_events = e;
    pthread_mutex_unlock(&g_mu);
    *ph = (CUevent)e;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    API(event_create(phEvent, Flags), "flags=%u event=0x%llx", Flags, OUT64((unsigned long long *)(void *)phEvent));
}

/* cuda.h: may be destroyed before it completes; queued work still completes, then the resources
 * are released. Not a live event -> INVALID_HANDLE. */
static CUresult event_destroy(CUevent h)
{
    pthread_mutex_lock(&g_mu);
    struct fc_event *e = event_get(h);
    if (e) {
        e->live = 0;
        event_unref(e);
    }
    pthread_mutex_unlock(&g_mu);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

FC_EXPORT CUresult cuEventDestroy(CUevent hEvent) { API(event_destroy(hEvent), "event=%p", (void *)hEvent); }
FC_EXPORT CUresult cuEventDestroy_v2(CUevent hEvent) { API(event_destroy(hEvent), "event=%p", (void *)hEvent); }

/* ------------------------------------------------------------------ record, wait, query */

struct ev_op {
    struct fc_event *e;
    uint64_t seq;                /* record: its sequence; wait: the record waited for */
};

/* Stream order reached the record (c NULL: the context's work was dropped: only let go). */
static CUresult record_run(void *arg, struct fc_ctx *c)
{
    struct ev_op *o = arg;
    struct fc_evshared *sh = o->e->sh;
    uint64_t cur = __atomic_load_n(&sh->completed, __ATOMIC_ACQUIRE);
    while (c && cur < o->seq &&
           !__atomic_compare_exchange_n(&sh->completed, &cur, o->seq, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        ;
    event_drop(o->e);
    free(o);
    return CUDA_SUCCESS;
}

/* Stream order reached the wait: block this stream until the record completes. */
static CUresult wait_run(void *arg, struct fc_ctx *c)
{
    struct ev_op *o = arg;
    if (c)
        event_wait_for(o->e->sh, o->seq);
    event_drop(o->e);
    free(o);
    return CUDA_SUCCESS;
}

/* Queue fn on stream hs; takes over the caller's reference to e. For a record, seq is taken
 * here; when the queue refuses (a sticky error), the record counts as reached so that no wait
 * blocks forever. */
static CUresult event_enqueue(CUstream hs, struct fc_event *e, int record, CUresult (*fn)(void *, struct fc_ctx *))
{
    struct ev_op *o = malloc(sizeof *o);
    if (o) {
        o->e = e;
        o->seq = record ? __atomic_add_fetch(&e->sh->recorded, 1, __ATOMIC_ACQ_REL)
                        : __atomic_load_n(&e->sh->recorded, __ATOMIC_ACQUIRE);
    }
    if (!o || (!record && event_done(e->sh, o->seq))) { /* out of memory, or nothing to wait for */
        free(o);
        pthread_mutex_lock(&g_mu);
        event_unref(e);
        pthread_mutex_unlock(&g_mu);
        return o ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct fc_op op = {.kind = OP_HOSTFN, .fn = fn, .arg = o};
    CUresult r = stream_enqueue(hs, &op);
    if (r != CUDA_SUCCESS)
        fn(o, record ? cur_ctx() : NULL);
    return r;
}

/* A record (cuda.h: hEvent and hStream must be of the same context, else INVALID_HANDLE; flags
 * CU_EVENT_RECORD_DEFAULT or _EXTERNAL, the latter mattering only under stream capture, which
 * the fake does not have) or a stream wait (cuda.h: "The event may be from a different context
 * or device than the stream"; flags CU_EVENT_WAIT_DEFAULT or _EXTERNAL). Other flag bits ->
 * INVALID_VALUE. */
static CUresult event_on_stream(CUevent h, CUstream hs, unsigned flags, unsigned allowed, int record)
{
    if (flags & ~allowed)
        return CUDA_ERROR_INVALID_VALUE;
    struct fc_ctx *sc = NULL;
    CUresult r = stream_ctx(hs, &sc);
    if (r != CUDA_SUCCESS)
        return r;
    struct fc_event *e = event_hold(h);
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    if (record && e->ctx != sc) {
        event_drop(e);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    return event_enqueue(hs, e, record, record ? record_run : wait_run);
}

static CUresult event_record(CUevent h, CUstream hs, unsigned flags)
{
    return event_on_stream(h, hs, flags, CU_EVENT_RECORD_EXTERNAL, 1);
}

#define RECORD_FMT "event=%p stream=%p flags=%u"
FC_EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
    API(event_record(hEvent, hStream, 0), RECORD_FMT, (void *)hEvent, (void *)hStream, 0u);
}
FC_EXPORT CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream)
{
    API(event_record(hEvent, hStream, 0), RECORD_FMT, (void *)hEvent, (void *)hStream, 0u);
}
FC_EXPORT CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    API(event_record(hEvent, hStream, flags), RECORD_FMT, (void *)hEvent, (void *)hStream, flags);
}
FC_EXPORT CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    API(event_record(hEvent, hStream, flags), RECORD_FMT, (void *)hEvent, (void *)hStream, flags);
}

static CUresult stream_wait_event(CUstream hs, CUevent h, unsigned flags)
{
    return event_on_stream(h, hs, flags, CU_EVENT_WAIT_EXTERNAL, 0);
}

#define WAIT_FMT "stream=%p event=%p flags=%u"
FC_EXPORT CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    API(stream_wait_event(hStream, hEvent, Flags), WAIT_FMT, (void *)hStream, (void *)hEvent, Flags);
}
FC_EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    API(stream_wait_event(hStream, hEvent, Flags), WAIT_FMT, (void *)hStream, (void *)hEvent, Flags);
}

/* cuda.h: SUCCESS when the work before the latest record completed or it was never recorded,
 * NOT_READY otherwise; synchronize waits for that (the caller, unlike a stream wait). */
static CUresult event_query(CUevent h, int wait)
{
    struct fc_event *e = event_hold(h);
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t target = __atomic_load_n(&e->sh->recorded, __ATOMIC_ACQUIRE);
    int done = event_done(e->sh, target);
    if (!done && wait)
        event_wait_for(e->sh, target);
    event_drop(e);
    return done || wait ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FC_EXPORT CUresult cuEventQuery(CUevent hEvent) { API(event_query(hEvent, 0), "event=%p", (void *)hEvent); }
FC_EXPORT CUresult cuEventSynchronize(CUevent hEvent) { API(event_query(hEvent, 1), "event=%p", (void *)hEvent); }

/* ------------------------------------------------------------------ IPC */

/* cuda.h: the event "must have been created with the CU_EVENT_INTERPROCESS and
 * CU_EVENT_DISABLE_TIMING flags set". Any other event (an opened one included, which behaves
 * as a DISABLE_TIMING event) -> INVALID_HANDLE: the header names no code; the runtime reports
 * an invalid resource handle (the fake's pick, scripts/gpu_check_probe.py). */
static CUresult ipc_get_event(CUipcEventHandle *ph, CUevent h)
{
    if (!ph)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct fc_event *e = event_get(h);
    CUresult r = !e || e->fd < 0 ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS) {
        struct fc_ipc_event_wire w;
        memset(&w, 0, sizeof w);
        memcpy(w.magic, FC_IPC_EVENT_MAGIC, sizeof FC_IPC_EVENT_MAGIC);
        w.pid = (int32_t)getpid();
        w.fd = e->fd;
        w.st_dev = (uint64_t)e->st_dev;
        w.st_ino = (uint64_t)e->st_ino;
        w.id = e->sh->id;
        w.flags = e->flags;
        memcpy(ph, &w, sizeof w);
    }
    pthread_mutex_unlock(&g_mu);
    if (e && r != CUDA_SUCCESS)
        fc_logline("fakecuda: cuIpcGetEventHandle(%p): not created with CU_EVENT_INTERPROCESS | "
                   "CU_EVENT_DISABLE_TIMING -> CUDA_ERROR_INVALID_HANDLE",
                   (void *)h);
    return r;
}

FC_EXPORT CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event)
{
    API(ipc_get_event(pHandle, event), "event=%p", (void *)event);
}

/* Opens the creator's page named by w (same uid: /proc/<pid>/fd/<fd>, inode checked). */
static struct fc_evshared *ipc_event_map(const struct fc_ipc_event_wire *w)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)w->pid, (int)w->fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    struct fc_evshared *sh = NULL;
    if (fd >= 0 && fstat(fd, &st) == 0 && (uint64_t)st.st_dev == w->st_dev && (uint64_t)st.st_ino == w->st_ino)
        sh = evshared_map(fd);
    if (sh && (memcmp(sh->magic, FC_EVSH_MAGIC, sizeof FC_EVSH_MAGIC) != 0 || sh->id != w->id)) {
        munmap(sh, g_page);
        sh = NULL;
    }
    if (!sh)
        fc_logline("fakecuda: cuIpcOpenEventHandle: event %" PRIu64 " of pid %d is gone (%s: %s) -> "
                   "CUDA_ERROR_INVALID_HANDLE",
                   w->id, (int)w->pid, path, fd < 0 ? strerror(errno) : "another file");
    if (fd >= 0)
        close(fd);
    return sh;
}

/* cuda.h: opens a handle "exported from another process"; the event behaves like a local one
 * created with CU_EVENT_DISABLE_TIMING and is freed with cuEventDestroy. No context ->
 * INVALID_CONTEXT; not a fakecuda event handle, or its event gone -> INVALID_HANDLE; a handle of
 * this very process -> INVALID_CONTEXT (the header does not say; the fake's pick, as for
 * memory). Every open returns a new CUevent. */
static CUresult ipc_open_event(CUevent *ph, CUipcEventHandle h)
{
    if (!ph)
        return CUDA_ERROR_INVALID_VALUE;
    struct fc_ctx *c = cur_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct fc_ipc_event_wire w;
    memcpy(&w, &h, sizeof w);
    if (memcmp(w.magic, FC_IPC_EVENT_MAGIC, sizeof FC_IPC_EVENT_MAGIC) != 0 || w.pid <= 0 || w.fd < 0)
        return CUDA_ERROR_INVALID_HANDLE;
    if (w.pid == (int32_t)getpid()) {
        fc_logline("fakecuda: cuIpcOpenEventHandle: event %" PRIu64 " was created by this process (pid %d); use it "
                   "directly -> CUDA_ERROR_INVALID_CONTEXT",
                   w.id, w.pid);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    struct fc_event *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (!(e->sh = ipc_event_map(&w))) {
        free(e);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    e->magic = FC_EVENT_MAGIC;
    e->ctx = c;
    e->flags = CU_EVENT_DISABLE_TIMING;
    e->fd = -1;
    e->opened_from = w.pid;
    e->live = 1;
    e->refs = 1;
    pthread_mutex_lock(&g_mu);
    e->next = g_events;
    g_events = e;
    pthread_mutex_unlock(&g_mu);
    *ph = (CUevent)e;
    return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle)
{
    API(ipc_open_event(phEvent, handle), "event=0x%llx", OUT64((unsigned long long *)(void *)phEvent));
}

/* ------------------------------------------------------------------ checkpoint */

/* Native checkpoint of a process holding an interprocess event (created or opened): the driver
 * documentation is silent, so the fake refuses (fail closed) and names the first one. */
CUresult event_ck_refusal(void)
{
    int n = 0;
    struct fc_event *first = NULL;
    for (struct fc_event *e = g_events; e; e = e->next)
        if (e->live && (e->fd >= 0 || e->opened_from) && n++ == 0)
            first = e;
    if (!first)
        return CUDA_SUCCESS;
    char who[64];
    if (first->opened_from)
        snprintf(who, sizeof who, "opened from pid %d", first->opened_from);
    else
        snprintf(who, sizeof who, "created with CU_EVENT_INTERPROCESS");
    fc_loud("checkpoint refused: pid %d holds %d interprocess event(s) (event %" PRIu64 " %s); what native "
            "checkpoint does with an IPC event is undocumented, the fake refuses it (scripts/gpu_check_probe.py "
            "ipc_event_checkpoint): cuEventDestroy them first (nothing was changed; unlock resumes) -> "
            "CUDA_ERROR_NOT_SUPPORTED",
            (int)getpid(), n, first->sh->id, who);
    return CUDA_ERROR_NOT_SUPPORTED;
}
