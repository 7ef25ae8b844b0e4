/*
 * copy.c: the copy engine. op_exec runs one op (copy, set, stream memory operation) from a
 * device, after checking the device's access to both sides; a write through a multicast VA
 * is sent to every bound member's memfd, a read through one is refused; a copy from host
 * memory into a VMM allocation goes through its memfd (copy_by_memfd). Stream workers and
 * synchronous callers (stream.c) run it. It reads the VMM tables and the multicast team
 * (under g_mu and the team lock) and calls only peer.c, vmm_table.c and core.c. A stream memory
 * operation is the device's own access (what a kernel does): on legacy memory (cuMemAlloc, IPC
 * opened) of another device it needs peer access (peer.c); a copy of legacy memory works from
 * any context (unified addressing: the driver stages it), VMM memory only with access.
 */
#include "fc.h"

/* ------------------------------------------------------------------ copy engine */

/* Classify one side; CUDA_SUCCESS means OK to touch. */
static CUresult side_check(uintptr_t p, size_t n, int kind, int dev, int write)
{
    if (kind == PTR_HOST)
        return CUDA_SUCCESS;
    CUresult r = dev_check(p, n, dev, write);
    if (r == CUDA_ERROR_NOT_FOUND)
        return kind == PTR_UNIFIED ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    return r;
}

/* At enqueue: a pointer passed as device memory must lie in device memory at all
 * (CUDA_ERROR_INVALID_VALUE now); access is checked when the op runs. */
CUresult precheck(uintptr_t p, int kind)
{
    if (kind != PTR_DEVICE)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    CUresult r = dev_check(p, 1, -1, 0);
    pthread_mutex_unlock(&g_mu);
    return r == CUDA_ERROR_NOT_FOUND ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

/* precheck for a copy or a memset: a reserved VA must also have a mapping where the range
 * starts (CUDA_ERROR_INVALID_VALUE now: R580 answers a cuMemcpyDtoH or cuMemsetD8 at
 * reserved, unmapped VA so, docs/gpu-validation.md). Stream memops keep precheck: what the
 * driver does with one there was not measured. */
CUresult precheck_copy(uintptr_t p, int kind)
{
    CUresult r = precheck(p, kind);
    if (r != CUDA_SUCCESS || kind != PTR_DEVICE)
        return r;
    pthread_mutex_lock(&g_mu);
    int unmapped = !dmem_find(p) && !map_find(p);
    pthread_mutex_unlock(&g_mu);
    return unmapped ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

static int wait_done(uint64_t cur, uint64_t ref, unsigned flags, int is64)
{
    switch (flags & ~(unsigned)CU_STREAM_WAIT_VALUE_FLUSH) {
    case CU_STREAM_WAIT_VALUE_GEQ:
        return is64 ? (int64_t)(cur - ref) >= 0 : (int32_t)((uint32_t)cur - (uint32_t)ref) >= 0;
    case CU_STREAM_WAIT_VALUE_EQ: return cur == ref;
    case CU_STREAM_WAIT_VALUE_AND: return (cur & ref) != 0;
    case CU_STREAM_WAIT_VALUE_NOR: return is64 ? ~(cur | ref) != 0 : (uint32_t)~(cur | ref) != 0;
    }
    return 1;
}

/* ---- multicast in the copy engine: writes through a multicast VA go to every bound member
 * (in every process); reads through one are refused (see docs/fakecuda.md). */

/* Does [va, va+len) touch a multicast mapping? (g_mu held) */
static int mc_overlaps(uintptr_t va, size_t len) { return map_touches(va, len, FC_KIND_MULTICAST); }

static CUresult mc_read_refused(uintptr_t va, size_t len)
{
    fc_loud("read of %zu bytes through multicast VA 0x%" PRIxPTR " refused -> CUDA_ERROR_ILLEGAL_ADDRESS "
            "(plain loads of a multicast address are undefined on the real driver; read a member)",
            len, va);
    return CUDA_ERROR_ILLEGAL_ADDRESS;
}

/* Write bytes [opoff, opoff+n) of what `op` writes at its destination to `t`. */
static void op_apply(const struct fc_op *op, unsigned char *t, size_t opoff, size_t n)
{
    switch (op->kind) {
    case OP_COPY: memmove(t, (const unsigned char *)op->src + opoff, n); break;
    case OP_SET8: memset(t, (int)(op->val & 0xff), n); break;
    case OP_SET16:
        for (size_t i = 0; i < n / 2; i++)
            ((uint16_t *)(void *)t)[i] = (uint16_t)op->val;
        break;
    case OP_SET32:
        for (size_t i = 0; i < n / 4; i++)
            ((uint32_t *)(void *)t)[i] = (uint32_t)op->val;
        break;
    case OP_WRITE32: __atomic_store_n((uint32_t *)(void *)t, (uint32_t)op->val, __ATOMIC_SEQ_CST); break;
    case OP_WRITE64: __atomic_store_n((uint64_t *)(void *)t, (uint64_t)op->val, __ATOMIC_SEQ_CST); break;
    }
}

/* Write [mc_off, mc_off+n) of multicast object `mc`: every member whose binding covers a byte
 * receives it, through its memfd (opened from /proc/<pid>/fd/<fd> and checked by inode; a
 * binding whose process exited is dropped first). Every granule must have at least one member
 * bound, else nothing is written and the write is an illegal address. (g_mu held; takes the
 * team lock.) */
static CUresult mc_broadcast(struct fc_alloc *mc, uint64_t mc_off, const struct fc_op *op, size_t opoff, size_t n)
{
    struct fc_team *t = mc->team;
    CUresult r = CUDA_SUCCESS;
    int fds[FC_MC_MAX_BINDS];
    team_lock(t);
    for (int i = 0; i < FC_MC_MAX_BINDS; i++) {
        struct fc_team_bind *b = &t->binds[i];
        fds[i] = -1;
        if (!b->used || b->mc_off >= mc_off + n || mc_off >= b->mc_off + b->size)
            continue;
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)b->pid, (int)b->fd);
        int fd = open(path, O_RDWR | O_CLOEXEC);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0 || (uint64_t)st.st_dev != b->st_dev || (uint64_t)st.st_ino != b->st_ino) {
            /* the binder exited (a live binder keeps the bound memfd open): its binding went
             * with it, as on the real driver */
            fc_logline("fakecuda: multicast object %" PRIu64 ": member (pid %d, device %d) is gone; "
                       "its binding is dropped",
                       mc->object_id, (int)b->pid, (int)b->dev);
            if (fd >= 0)
                close(fd);
            memset(b, 0, sizeof *b);
            continue;
        }
        fds[i] = fd;
    }
    for (uint64_t g = mc_off & ~(uint64_t)(g_gran - 1); g < mc_off + n && r == CUDA_SUCCESS; g += g_gran) {
        int covered = 0;
        for (int i = 0; i < FC_MC_MAX_BINDS && !covered; i++)
            covered = fds[i] >= 0 && g >= t->binds[i].mc_off && g - t->binds[i].mc_off < t->binds[i].size;
        if (!covered) {
            fc_loud("write through multicast object %" PRIu64 " at offset 0x%" PRIx64
                    " where no member is bound -> CUDA_ERROR_ILLEGAL_ADDRESS",
                    mc->object_id, g);
            r = CUDA_ERROR_ILLEGAL_ADDRESS;
        }
    }
    for (int i = 0; i < FC_MC_MAX_BINDS; i++) {
        if (fds[i] < 0)
            continue;
        const struct fc_team_bind *b = &t->binds[i];
        uint64_t lo = mc_off > b->mc_off ? mc_off : b->mc_off;
        uint64_t hi = mc_off + n < b->mc_off + b->size ? mc_off + n : b->mc_off + b->size;
        uint64_t moff = b->mem_off + (lo - b->mc_off);
        uint64_t pgoff = moff & ~(uint64_t)(g_page - 1);
        size_t len = (size_t)(moff - pgoff + (hi - lo));
        void *w = r == CUDA_SUCCESS ? mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fds[i], (off_t)pgoff)
                                    : MAP_FAILED;
        close(fds[i]);
        if (w == MAP_FAILED) {
            if (r == CUDA_SUCCESS)
                r = CUDA_ERROR_OUT_OF_MEMORY;
            continue;
        }
        op_apply(op, (unsigned char *)w + (moff - pgoff), opoff + (size_t)(lo - mc_off), (size_t)(hi - lo));
        munmap(w, len);
    }
    team_unlock(t);
    return r;
}

/* The destination write of `op` ([dst, dst+dlen) passed the access check) when it touches a
 * multicast mapping: unicast pieces are written in place, multicast pieces broadcast. */
static CUresult mc_write(const struct fc_op *op, size_t dlen)
{
    uintptr_t p = op->dst, end = op->dst + dlen;
    while (p < end) {
        struct fc_map *m = map_find(p);
        if (!m)
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        uintptr_t seg_end = m->va + m->size < end ? m->va + m->size : end;
        if (m->alloc->kind == FC_KIND_MULTICAST) {
            CUresult r = mc_broadcast(m->alloc, m->offset + (p - m->va), op, p - op->dst, seg_end - p);
            if (r != CUDA_SUCCESS)
                return r;
        } else {
            op_apply(op, (unsigned char *)p, p - op->dst, seg_end - p);
        }
        p = seg_end;
    }
    return CUDA_SUCCESS;
}

/* A copy engine writes device memory by DMA, not through the process's CPU page tables: a copy
 * from host memory into one VMM mapping goes through that allocation's memfd (pwrite at the
 * mapping's offset). A memmove through the mapping would fault every page it first touches into
 * the process's page tables and have the kernel zero it before the copy overwrites it (3 to 4 us
 * per 4 KiB page on the project's VM; a fresh allocation's pages are all untouched), a cost the
 * driver's copy does not have (decisions D71). Reads (device to host) stay a memmove through the
 * mapping: the pages of memory a process wrote are in its page tables already, where a memmove
 * costs what the transfer does. A copy of less than a page, device to device, or over more than
 * one mapping still goes through the VA. Returns 1 when the copy is done. (g_mu held; the access
 * checks passed.) */
static int copy_by_memfd(const struct fc_op *op)
{
    if (op->n < g_page || op->skind != PTR_HOST || op->dkind == PTR_HOST)
        return 0;
    struct fc_map *m = map_find(op->dst);
    if (!m || m->alloc->kind != FC_KIND_ALLOCATION || m->alloc->fd < 0 || op->n > m->va + m->size - op->dst)
        return 0;
    off_t off = (off_t)(m->offset + (op->dst - m->va));
    /* else (EFAULT: a source without host access, which the memmove reports as it always did) */
    return pwrite(m->alloc->fd, (const void *)op->src, op->n, off) == (ssize_t)op->n;
}

/* A stream memory operation on legacy memory needs the device's access (peer.c); other memory
 * passes (its own checks follow). g_mu held. */
static CUresult memop_check(uintptr_t p, struct fc_ctx *c)
{
    CUresult r = peer_legacy_check(p, c);
    return r == CUDA_ERROR_NOT_FOUND ? CUDA_SUCCESS : r;
}

/* Execute one op (stream worker or synchronous caller) from context c's device. */
CUresult op_exec(const struct fc_op *op, struct fc_ctx *c)
{
    CUresult r;
    int dev = c->dev;
    if (op->kind == OP_HOSTFN)
        return op->fn(op->arg, c);
    if (op->kind == OP_WAIT32 || op->kind == OP_WAIT64) {
        int is64 = op->kind == OP_WAIT64;
        unsigned sleep_ns = 20000;
        for (;;) {
            pthread_mutex_lock(&g_mu);
            r = side_check(op->dst, is64 ? 8 : 4, PTR_DEVICE, dev, 0);
            if (r == CUDA_SUCCESS)
                r = memop_check(op->dst, c);
            if (r == CUDA_SUCCESS && mc_overlaps(op->dst, is64 ? 8 : 4))
                r = mc_read_refused(op->dst, is64 ? 8 : 4);
            uint64_t cur = 0;
            if (r == CUDA_SUCCESS)
                cur = is64 ? __atomic_load_n((uint64_t *)op->dst, __ATOMIC_ACQUIRE)
                           : __atomic_load_n((uint32_t *)op->dst, __ATOMIC_ACQUIRE);
            pthread_mutex_unlock(&g_mu);
            if (r != CUDA_SUCCESS)
                return r == CUDA_ERROR_INVALID_VALUE ? CUDA_ERROR_ILLEGAL_ADDRESS : r;
            if (wait_done(cur, op->val, op->flags, is64))
                return CUDA_SUCCESS;
            struct timespec ts = {0, (long)sleep_ns};
            nanosleep(&ts, NULL);
            if (sleep_ns < 1000000)
                sleep_ns *= 2;
        }
    }
    pthread_mutex_lock(&g_mu);
    size_t dlen = op->n;
    if (op->kind == OP_SET16)
        dlen = op->n * 2;
    if (op->kind == OP_SET32)
        dlen = op->n * 4;
    if (op->kind == OP_WRITE32)
        dlen = 4;
    if (op->kind == OP_WRITE64)
        dlen = 8;
    r = side_check(op->dst, dlen, op->dkind, dev, 1);
    if (r == CUDA_SUCCESS && (op->kind == OP_WRITE32 || op->kind == OP_WRITE64))
        r = memop_check(op->dst, c);
    if (r == CUDA_SUCCESS && op->kind == OP_COPY)
        r = side_check(op->src, op->n, op->skind, dev, 0);
    if (r == CUDA_SUCCESS && op->kind == OP_COPY && op->skind != PTR_HOST && mc_overlaps(op->src, op->n))
        r = mc_read_refused(op->src, op->n);
    if (r == CUDA_SUCCESS && op->dkind != PTR_HOST && mc_overlaps(op->dst, dlen)) {
        r = mc_write(op, dlen);
    } else if (r == CUDA_SUCCESS) {
        switch (op->kind) {
        case OP_COPY:
            if (!copy_by_memfd(op))
                memmove((void *)op->dst, (const void *)op->src, op->n);
            break;
        case OP_SET8: memset((void *)op->dst, (int)(op->val & 0xff), op->n); break;
        case OP_SET16:
            for (size_t i = 0; i < op->n; i++)
                ((uint16_t *)op->dst)[i] = (uint16_t)op->val;
            break;
        case OP_SET32:
            for (size_t i = 0; i < op->n; i++)
                ((uint32_t *)op->dst)[i] = (uint32_t)op->val;
            break;
        case OP_WRITE32: __atomic_store_n((uint32_t *)op->dst, (uint32_t)op->val, __ATOMIC_SEQ_CST); break;
        case OP_WRITE64: __atomic_store_n((uint64_t *)op->dst, (uint64_t)op->val, __ATOMIC_SEQ_CST); break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}
