/*
 * stream.c: streams and stream memory operations. A stream is a worker thread running its
 * queued ops through the copy engine; the context's default stream stands for NULL,
 * CU_STREAM_LEGACY and CU_STREAM_PER_THREAD. API: cuStreamCreate/Destroy/Synchronize/Query,
 * cuStreamGetDevice, cuStream{Wait,Write}Value{32,64}. It touches the stream list and the queues, the context's
 * pending count and the gate's pending-op count, and calls copy.c, device.c and core.c.
 */
#include "fc.h"

/* ------------------------------------------------------------------ streams */

#define FC_STREAM_MAGIC 0xfc57eau

struct fc_stream {
    unsigned magic;
    struct fc_ctx *ctx;
    unsigned flags;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct fc_op *head, *tail;
    long pending;
    int dying;
    pthread_t thr;
    struct fc_stream *next;       /* g_streams */
};

static struct fc_stream *g_streams;

static void pending_done(struct fc_ctx *c)
{
    pthread_mutex_lock(&c->mu);
    if (--c->pending == 0)
        pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_lock(&g_gate.mu);
    if (--g_gate.pending_ops == 0)
        pthread_cond_broadcast(&g_gate.cv);
    pthread_mutex_unlock(&g_gate.mu);
}

static void *stream_worker(void *arg)
{
    struct fc_stream *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->head && !s->dying)
            pthread_cond_wait(&s->cv, &s->mu);
        if (!s->head) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        struct fc_op *op = s->head;
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        pthread_mutex_unlock(&s->mu);

        CUresult r = (CUresult)atomic_load(&s->ctx->sticky);
        if (r == CUDA_SUCCESS)
            r = op_exec(op, s->ctx);
        else if (op->kind == OP_HOSTFN)
            op->fn(op->arg, NULL); /* dropped with the context's work: the function only lets go of arg */
        if (r == CUDA_ERROR_INVALID_VALUE)
            r = CUDA_ERROR_ILLEGAL_ADDRESS; /* device memory vanished after the op was queued */
        if (r != CUDA_SUCCESS) {
            int zero = 0;
            if (atomic_compare_exchange_strong(&s->ctx->sticky, &zero, (int)r))
                fc_loud("asynchronous error on stream %p: %s (sticky for the context)", (void *)s, fc_errname(r));
        }
        free(op);
        pthread_mutex_lock(&s->mu);
        s->pending--;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pending_done(s->ctx);
    }
    /* destroyed and drained */
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    s->magic = 0;
    free(s);
    return NULL;
}

static struct fc_stream *stream_new(struct fc_ctx *c, unsigned flags)
{
    struct fc_stream *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->magic = FC_STREAM_MAGIC;
    s->ctx = c;
    s->flags = flags;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&at, 256 * 1024);
    if (pthread_create(&s->thr, &at, stream_worker, s) != 0) {
        pthread_attr_destroy(&at);
        free(s);
        return NULL;
    }
    pthread_attr_destroy(&at);
    return s;
}

/* Resolve a CUstream argument (g_mu held). NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD
 * map to the current context's default stream. */
static CUresult stream_resolve(CUstream hs, struct fc_stream **out)
{
    if (hs == NULL || hs == CU_STREAM_LEGACY || hs == CU_STREAM_PER_THREAD) {
        struct fc_ctx *c = cur_ctx();
        if (!c || !ctx_valid(c))
            return CUDA_ERROR_INVALID_CONTEXT;
        if (!c->dflt) {
            c->dflt = stream_new(c, 0);
            if (!c->dflt)
                return CUDA_ERROR_OUT_OF_MEMORY;
        }
        *out = c->dflt;
        return CUDA_SUCCESS;
    }
    for (struct fc_stream *s = g_streams; s; s = s->next)
        if (s == (struct fc_stream *)hs) {
            *out = s;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_HANDLE;
}

CUresult stream_enqueue(CUstream hs, const struct fc_op *tmpl)
{
    pthread_mutex_lock(&g_mu);
    struct fc_stream *s;
    CUresult r = stream_resolve(hs, &s);
    if (r == CUDA_SUCCESS && atomic_load(&s->ctx->sticky))
        r = (CUresult)atomic_load(&s->ctx->sticky);
    struct fc_op *op = NULL;
    if (r == CUDA_SUCCESS && !(op = malloc(sizeof *op)))
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_mu);
        return r;
    }
    *op = *tmpl;
    op->next = NULL;
    pthread_mutex_lock(&g_gate.mu);
    g_gate.pending_ops++;
    pthread_mutex_unlock(&g_gate.mu);
    pthread_mutex_lock(&s->ctx->mu);
    s->ctx->pending++;
    pthread_mutex_unlock(&s->ctx->mu);
    pthread_mutex_lock(&s->mu);
    s->pending++;
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

CUresult stream_sync(CUstream hs, int query)
{
    pthread_mutex_lock(&g_mu);
    struct fc_stream *s;
    CUresult r = stream_resolve(hs, &s);
    if (r != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_mu);
        return r;
    }
    pthread_mutex_lock(&s->mu);
    pthread_mutex_unlock(&g_mu);
    if (query && s->pending) {
        pthread_mutex_unlock(&s->mu);
        return CUDA_ERROR_NOT_READY;
    }
    while (s->pending)
        pthread_cond_wait(&s->cv, &s->mu);
    struct fc_ctx *c = s->ctx;
    pthread_mutex_unlock(&s->mu);
    return (CUresult)atomic_load(&c->sticky);
}

/* A synchronous copy/set: ordered after the context's default stream, runs in the caller;
 * an access fault is returned (not sticky). A context whose default stream was never used has
 * nothing to wait for: the op does not create it (its worker thread would outlive the op, a
 * thread the process never asked for: the shim's LOAD_ALLOCATIONS copies this way, and a
 * rolled-back process must keep exactly the threads it had, issue 23). */
CUresult sync_op(const struct fc_op *op)
{
    pthread_mutex_lock(&g_mu);
    struct fc_ctx *c = cur_ctx();
    int unused = c && ctx_valid(c) && !c->dflt;
    pthread_mutex_unlock(&g_mu);
    CUresult r = unused ? (CUresult)atomic_load(&c->sticky) : stream_sync(NULL, 0);
    if (r != CUDA_SUCCESS)
        return r;
    return op_exec(op, cur_ctx());
}

/* The context of a CUstream (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD: the current one). */
CUresult stream_ctx(CUstream hs, struct fc_ctx **out)
{
    pthread_mutex_lock(&g_mu);
    struct fc_stream *s;
    CUresult r = stream_resolve(hs, &s);
    if (r == CUDA_SUCCESS)
        *out = s->ctx;
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* ------------------------------------------------------------------ streams API */

static CUresult stream_create(CUstream *ph, unsigned flags)
{
    if (!ph || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE;
    struct fc_ctx *c = cur_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_mu);
    CUresult r = CUDA_SUCCESS;
    if (!ctx_valid(c))
        r = CUDA_ERROR_INVALID_CONTEXT;
    struct fc_stream *s = r == CUDA_SUCCESS ? stream_new(c, flags) : NULL;
    if (r == CUDA_SUCCESS && !s)
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (s) {
        s->next = g_streams;
        g_streams = s;
        *ph = (CUstream)s;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

FC_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    API(stream_create(phStream, Flags), "flags=%u", Flags);
}

/* A non-blocking stream of context c, for a driver-made stream (the custom-storage stream of
 * cuCheckpointProcessCheckpoint/Restore, cuda.h 13.4+). */
CUresult stream_create_in(struct fc_ctx *c, CUstream *out)
{
    pthread_mutex_lock(&g_mu);
    struct fc_stream *s = ctx_valid(c) ? stream_new(c, CU_STREAM_NON_BLOCKING) : NULL;
    if (s) {
        s->next = g_streams;
        g_streams = s;
        *out = (CUstream)s;
    }
    pthread_mutex_unlock(&g_mu);
    return s ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult stream_destroy(CUstream hs)
{
    pthread_mutex_lock(&g_mu);
    struct fc_stream **pp = &g_streams;
    while (*pp && *pp != (struct fc_stream *)hs)
        pp = &(*pp)->next;
    if (!*pp || !hs) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct fc_stream *s = *pp;
    *pp = s->next;
    pthread_mutex_lock(&s->mu);
    s->dying = 1; /* queued work still completes; the worker frees the stream */
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

CUresult stream_release(CUstream hs) { return stream_destroy(hs); }

/* cuStreamGetDevice (CUDA 12.8): the device of the stream's context. */
static CUresult stream_device(CUstream hs, CUdevice *dev)
{
    struct fc_ctx *c = NULL;
    CUresult r = dev ? stream_ctx(hs, &c) : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS)
        *dev = c->dev;
    return r;
}

FC_EXPORT CUresult cuStreamGetDevice(CUstream hStream, CUdevice *device)
{
    API(stream_device(hStream, device), "stream=%p dev=%d", (void *)hStream, OUTI(device));
}
FC_EXPORT CUresult cuStreamGetDevice_ptsz(CUstream hStream, CUdevice *device)
{
    API(stream_device(hStream, device), "stream=%p dev=%d", (void *)hStream, OUTI(device));
}

FC_EXPORT CUresult cuStreamDestroy(CUstream hStream) { API(stream_destroy(hStream), "stream=%p", (void *)hStream); }
FC_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream) { API(stream_destroy(hStream), "stream=%p", (void *)hStream); }

FC_EXPORT CUresult cuStreamSynchronize(CUstream hStream) { API(stream_sync(hStream, 0), "stream=%p", (void *)hStream); }
FC_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    API(stream_sync(hStream, 0), "stream=%p", (void *)hStream);
}
FC_EXPORT CUresult cuStreamQuery(CUstream hStream) { API(stream_sync(hStream, 1), "stream=%p", (void *)hStream); }
FC_EXPORT CUresult cuStreamQuery_ptsz(CUstream hStream) { API(stream_sync(hStream, 1), "stream=%p", (void *)hStream); }

/* ------------------------------------------------------------------ stream memory operations */

static CUresult memop(CUstream hs, CUdeviceptr addr, uint64_t v, unsigned flags, int kind, int v1)
{
    int is64 = kind == OP_WAIT64 || kind == OP_WRITE64;
    if (addr % (is64 ? 8 : 4))
        return CUDA_ERROR_INVALID_VALUE;
    if (kind == OP_WAIT32 || kind == OP_WAIT64) {
        unsigned base = flags & ~(unsigned)CU_STREAM_WAIT_VALUE_FLUSH;
        if (base > CU_STREAM_WAIT_VALUE_NOR)
            return CUDA_ERROR_INVALID_VALUE;
    } else if (flags & ~(unsigned)(v1 ? CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER : 0)) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct fc_op op = {.kind = kind, .dst = (uintptr_t)addr, .dkind = PTR_DEVICE, .val = v, .flags = flags};
    CUresult r = precheck(op.dst, PTR_DEVICE);
    return r != CUDA_SUCCESS ? r : stream_enqueue(hs, &op);
}

#define MEMOP_FMT "stream=%p addr=0x%llx value=%llu flags=%u"
#define MEMOP32(name, kind, v1)                                                                                  \
    FC_EXPORT CUresult name(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f)                             \
    {                                                                                                            \
        API(memop(s, a, v, f, kind, v1), MEMOP_FMT, (void *)s, (unsigned long long)a, (unsigned long long)v, f); \
    }
#define MEMOP64(name, kind, v1)                                                                                  \
    FC_EXPORT CUresult name(CUstream s, CUdeviceptr a, cuuint64_t v, unsigned int f)                             \
    {                                                                                                            \
        API(memop(s, a, v, f, kind, v1), MEMOP_FMT, (void *)s, (unsigned long long)a, (unsigned long long)v, f); \
    }

MEMOP32(cuStreamWaitValue32_v2, OP_WAIT32, 0)
MEMOP32(cuStreamWaitValue32_v2_ptsz, OP_WAIT32, 0)
MEMOP32(cuStreamWaitValue32, OP_WAIT32, 1)
MEMOP32(cuStreamWaitValue32_ptsz, OP_WAIT32, 1)
MEMOP32(cuStreamWriteValue32_v2, OP_WRITE32, 0)
MEMOP32(cuStreamWriteValue32_v2_ptsz, OP_WRITE32, 0)
MEMOP32(cuStreamWriteValue32, OP_WRITE32, 1)
MEMOP32(cuStreamWriteValue32_ptsz, OP_WRITE32, 1)
MEMOP64(cuStreamWaitValue64_v2, OP_WAIT64, 0)
MEMOP64(cuStreamWaitValue64_v2_ptsz, OP_WAIT64, 0)
MEMOP64(cuStreamWriteValue64_v2, OP_WRITE64, 0)
MEMOP64(cuStreamWriteValue64_v2_ptsz, OP_WRITE64, 0)
