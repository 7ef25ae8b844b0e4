/*
 * checkpoint_storage.c: the target side of custom storage (cuda.h 13.4+,
 * CUcheckpointCheckpointArgs/CUcheckpointRestoreArgs::customStorageInfo_out). For each GPU
 * ordinal that holds memory of this process, one memfd (the "stream") holds that GPU's memory
 * laid out contiguously: its VMM allocations (cuMemCreate on the device, in table order), then
 * its cuMemAlloc buffers (whole pages), each at the offset cs_off records. The controller maps
 * the memfd as device memory of its own (checkpoint_controller.c). Host-located VMM allocations
 * are not GPU memory: they stay in this process as with a host checkpoint.
 *
 * A checkpoint fills the streams from the live memory (which stays untouched until
 * cuCheckpointOperationComplete); a restore hands out zeroed streams of the same layout, which
 * the controller fills and the target copies back at complete. checkpoint_target.c drives
 * this; it touches the VMM and cuMemAlloc tables (g_mu held) and calls vmm_table.c, device.c
 * and core.c.
 */
#include "fc.h"

static int g_cs_fd[FC_MAX_DEVICES] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
static unsigned char *g_cs_map[FC_MAX_DEVICES];
static size_t g_cs_size[FC_MAX_DEVICES];
static int g_cs_pending; /* the last checkpoint's GPU bytes are in custom storage only */

_Static_assert(FC_MAX_DEVICES == 16, "g_cs_fd's initialiser lists FC_MAX_DEVICES entries");

int cs_pending(void) { return g_cs_pending; }
void cs_set_pending(int on) { g_cs_pending = on; }

/* Offsets of every piece of GPU memory in its ordinal's stream; sizes[d] = the stream's bytes. */
static void cs_layout(size_t *sizes)
{
    memset(sizes, 0, sizeof(size_t) * FC_MAX_DEVICES);
    for (struct fc_alloc *a = g_allocs; a; a = a->next)
        if (a->kind == FC_KIND_ALLOCATION && a->device >= 0 && a->device < FC_MAX_DEVICES) {
            a->cs_off = sizes[a->device];
            sizes[a->device] += a->size;
        }
    for (struct fc_dmem *d = g_dmems; d; d = d->next)
        if (!d->cs_op && d->dev >= 0 && d->dev < FC_MAX_DEVICES) {
            d->cs_off = sizes[d->dev];
            sizes[d->dev] += d->mapped;
        }
}

void cs_end(void)
{
    for (int d = 0; d < FC_MAX_DEVICES; d++) {
        if (g_cs_map[d])
            munmap(g_cs_map[d], g_cs_size[d]);
        if (g_cs_fd[d] >= 0)
            close(g_cs_fd[d]);
        g_cs_map[d] = NULL;
        g_cs_fd[d] = -1;
        g_cs_size[d] = 0;
    }
}

/* A checkpoint (restore = 0) copies each GPU's memory into its stream; a restore (restore = 1)
 * makes zeroed streams for the controller to fill, reporting to[d] as the GPU (the gpuPairs
 * placement; NULL: the ordinal's own). Fills rep->ndev/dev[] and fds[] (one per entry). On
 * CUDA_ERROR_OUT_OF_MEMORY (no memfd, no mapping) nothing is kept. g_mu held. */
CUresult cs_begin(int restore, const struct fc_dev *to, struct ck_cs_rep *rep, int *fds)
{
    size_t sizes[FC_MAX_DEVICES];
    cs_layout(sizes);
    rep->ndev = 0;
    for (int d = 0; d < g_ndev; d++) {
        if (!sizes[d])
            continue;
        char name[48];
        snprintf(name, sizeof name, "fakecuda-custom-storage-%d", d);
        int fd = memfd_create(name, MFD_CLOEXEC);
        void *m = MAP_FAILED;
        if (fd >= 0 && ftruncate(fd, (off_t)sizes[d]) == 0)
            m = mmap(NULL, sizes[d], PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED) {
            fc_loud("custom storage: no %zu-byte stream for GPU ordinal %d of pid %d: %s (nothing was changed) "
                    "-> CUDA_ERROR_OUT_OF_MEMORY",
                    sizes[d], d, (int)getpid(), strerror(errno));
            if (fd >= 0)
                close(fd);
            cs_end();
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g_cs_fd[d] = fd;
        g_cs_map[d] = m;
        g_cs_size[d] = sizes[d];
        struct ck_cs_dev *e = &rep->dev[rep->ndev];
        e->ordinal = d;
        e->size = sizes[d];
        e->uuid = to ? to[d].uuid : dev_get(d)->uuid;
        fds[rep->ndev++] = fd;
    }
    if (restore)
        return CUDA_SUCCESS;
    for (struct fc_alloc *a = g_allocs; a; a = a->next) {
        if (a->kind != FC_KIND_ALLOCATION || a->device < 0 || a->device >= FC_MAX_DEVICES)
            continue;
        size_t got = 0;
        while (got < a->size) {
            ssize_t n = pread(a->fd, g_cs_map[a->device] + a->cs_off + got, a->size - got, (off_t)got);
            if (n <= 0)
                break;
            got += (size_t)n;
        }
    }
    for (struct fc_dmem *d = g_dmems; d; d = d->next)
        if (!d->cs_op && d->dev >= 0 && d->dev < FC_MAX_DEVICES)
            memcpy(g_cs_map[d->dev] + d->cs_off, (const void *)d->va, d->mapped);
    return CUDA_SUCCESS;
}

/* The n staged bytes at off in GPU dev's stream (a restore's source at complete), or NULL. */
const unsigned char *cs_src(int dev, size_t off, size_t n)
{
    if (dev < 0 || dev >= FC_MAX_DEVICES || !g_cs_map[dev] || off > g_cs_size[dev] || n > g_cs_size[dev] - off)
        return NULL;
    return g_cs_map[dev] + off;
}

/* 1 when the current streams hold any bytes (a checkpoint that moved GPU memory). */
int cs_staged(void)
{
    for (int d = 0; d < FC_MAX_DEVICES; d++)
        if (g_cs_size[d])
            return 1;
    return 0;
}

/* 1 when a host checkpoint saved GPU memory in this process (a custom restore cannot bring it
 * back). g_mu held. */
int cs_host_bytes(void)
{
    for (struct fc_alloc *a = g_allocs; a; a = a->next)
        if (a->saved && a->kind == FC_KIND_ALLOCATION && a->device >= 0)
            return 1;
    for (struct fc_dmem *d = g_dmems; d; d = d->next)
        if (d->saved)
            return 1;
    return 0;
}
