/*
 * vmm_table.c: the tables every kind of device memory lives in (fc.h has the types):
 * allocation handles, allocations and multicast objects (struct fc_alloc), mappings,
 * reservations, cuMemAlloc buffers, exported fds, the per-device usage; the memfd metadata
 * page, the access check a device op passes, the multicast team lock. Callers hold g_mu. It
 * touches these tables only, and calls only core.c.
 */
#include "fc.h"

/* ------------------------------------------------------------------ VMM tables */

size_t team_len(void) { return (sizeof(struct fc_team) + g_page - 1) & ~(g_page - 1); }

struct fc_handle *g_handles;
unsigned long long g_nhandles;
static unsigned long long g_caphandles;
struct fc_alloc *g_allocs;
struct fc_map *g_maps;
struct fc_resv *g_resvs;
struct fc_dmem *g_dmems;
struct fc_export *g_exports;
uint64_t g_next_object = 1;
uint64_t g_next_buffer = 1;
unsigned long long g_used[FC_MAX_DEVICES];

struct fc_handle *handle_get(unsigned long long h)
{
    if (h >= g_nhandles || g_handles[h].refs <= 0)
        return NULL;
    return &g_handles[h];
}

int handle_new(struct fc_alloc *a, unsigned long long *out)
{
    unsigned long long v = g_nhandles;
    if ((v >> 48) == FC_SHIM_TAG)
        return -1; /* never hand out the shim's virtual tag (2^62 values away) */
    if (g_nhandles == g_caphandles) {
        unsigned long long cap = g_caphandles ? g_caphandles * 2 : 64;
        struct fc_handle *n = realloc(g_handles, cap * sizeof *n);
        if (!n)
            return -1;
        g_handles = n;
        g_caphandles = cap;
    }
    g_handles[v].alloc = a;
    g_handles[v].refs = 1;
    g_handles[v].imported = 0;
    g_nhandles++;
    a->handles++;
    *out = v;
    return 0;
}

struct fc_resv *resv_find(uintptr_t va, size_t size)
{
    for (struct fc_resv *r = g_resvs; r; r = r->next)
        if (va >= r->va && va - r->va < r->size)
            return (size <= r->size - (va - r->va)) ? r : NULL;
    return NULL;
}

/* The VA index of the mappings (fc.h "Mappings by VA"). */
static struct fc_map **g_ix;
static size_t g_nix, g_capix;

size_t map_lower(uintptr_t va)
{
    size_t lo = 0, hi = g_nix;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (g_ix[mid]->va < va)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

size_t map_count(void) { return g_nix; }

struct fc_map *map_at(size_t i) { return i < g_nix ? g_ix[i] : NULL; }

struct fc_map *map_find(uintptr_t va)
{
    size_t i = map_lower(va);
    if (i < g_nix && g_ix[i]->va == va)
        return g_ix[i];
    return i && va - g_ix[i - 1]->va < g_ix[i - 1]->size ? g_ix[i - 1] : NULL;
}

struct fc_map *map_overlapping(uintptr_t va, size_t len)
{
    size_t i = map_lower(va);
    if (i && va - g_ix[i - 1]->va < g_ix[i - 1]->size)
        return g_ix[i - 1];
    return i < g_nix && g_ix[i]->va - va < len ? g_ix[i] : NULL;
}

int map_touches(uintptr_t va, size_t len, uint32_t kind)
{
    size_t i = map_lower(va);
    for (i = i ? i - 1 : 0; i < g_nix && g_ix[i]->va < va + len; i++)
        if (g_ix[i]->alloc->kind == kind && g_ix[i]->va + g_ix[i]->size > va)
            return 1;
    return 0;
}

int map_link(struct fc_map *m)
{
    if (g_nix == g_capix) {
        size_t cap = g_capix ? 2 * g_capix : 64;
        struct fc_map **n = realloc(g_ix, cap * sizeof *n);
        if (!n)
            return -1;
        g_ix = n;
        g_capix = cap;
    }
    size_t i = map_lower(m->va);
    memmove(&g_ix[i + 1], &g_ix[i], (g_nix - i) * sizeof *g_ix);
    g_ix[i] = m;
    g_nix++;
    m->prev = NULL;
    m->next = g_maps;
    if (g_maps)
        g_maps->prev = m;
    g_maps = m;
    return 0;
}

void map_unlink(struct fc_map *m)
{
    size_t i = map_lower(m->va);
    if (i < g_nix && g_ix[i] == m) {
        memmove(&g_ix[i], &g_ix[i + 1], (g_nix - i - 1) * sizeof *g_ix);
        g_nix--;
    }
    if (m->prev)
        m->prev->next = m->next;
    else
        g_maps = m->next;
    if (m->next)
        m->next->prev = m->prev;
    m->next = m->prev = NULL;
}

void alloc_link(struct fc_alloc *a)
{
    a->prev = NULL;
    a->next = g_allocs;
    if (g_allocs)
        g_allocs->prev = a;
    g_allocs = a;
}

struct fc_dmem *dmem_find(uintptr_t va)
{
    for (struct fc_dmem *d = g_dmems; d; d = d->next)
        if (va >= d->va && va - d->va < d->size)
            return d;
    return NULL;
}

void alloc_maybe_free(struct fc_alloc *a)
{
    if (a->handles > 0 || a->maps > 0 || a->binds > 0 || a->pins > 0)
        return;
    if (a->prev)
        a->prev->next = a->next;
    else if (g_allocs == a)
        g_allocs = a->next;
    if (a->next)
        a->next->prev = a->prev;
    if (a->created_here && a->device >= 0 && a->device < FC_MAX_DEVICES)
        g_used[a->device] -= a->size;
    if (a->fd >= 0)
        close(a->fd);
    if (a->team)
        munmap(a->team, team_len());
    free(a->saved);
    free(a);
}

int write_meta(int fd, const struct fc_alloc *a)
{
    struct fc_meta m;
    memset(&m, 0, sizeof m);
    memcpy(m.magic, FC_META_MAGIC, 8);
    m.version = FC_META_VERSION;
    m.kind = a->kind;
    m.size = a->size;
    m.prop = a->prop;
    m.device = a->device;
    m.creator_pid = a->creator_pid;
    m.object_id = a->object_id;
    return pwrite(fd, &m, sizeof m, (off_t)a->size) == (ssize_t)sizeof m ? 0 : -1;
}

/* New memfd of `size` bytes plus the metadata page. */
int new_memfd(size_t size)
{
    int fd = memfd_create("fakecuda-allocation", MFD_CLOEXEC);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)(size + g_page)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int prot_of(const struct fc_map *m, size_t g)
{
    int prot = PROT_NONE;
    for (int d = 0; d <= FC_ACC_HOST; d++) {
        if (d >= g_ndev && d != FC_ACC_HOST)
            continue;
        unsigned char f = m->acc[g * FC_ACC_SLOTS + (size_t)d];
        if (f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return PROT_READ | PROT_WRITE;
        if (f == CU_MEM_ACCESS_FLAGS_PROT_READ)
            prot = PROT_READ;
    }
    return prot;
}

void map_apply_prot(const struct fc_map *m)
{
    if (m->alloc->kind == FC_KIND_MULTICAST)
        return; /* a multicast VA stays PROT_NONE: a host store there would reach no member */
    for (size_t g = 0; g < m->size / g_gran; g++)
        mprotect((void *)(m->va + g * g_gran), g_gran, prot_of(m, g));
}

/* Turn [va, va+size) back into a PROT_NONE reservation (never plain munmap). */
int make_reserved(uintptr_t va, size_t size)
{
    void *p = mmap((void *)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    return p == MAP_FAILED ? -1 : 0;
}

/* Device access check for [va, va+len) from device `dev`. Returns CUDA_SUCCESS,
 * CUDA_ERROR_ILLEGAL_ADDRESS, or CUDA_ERROR_NOT_FOUND when va is not device memory. Call
 * with g_mu held. */
CUresult dev_check(uintptr_t va, size_t len, int dev, int write)
{
    if (len == 0)
        len = 1;
    struct fc_dmem *d = dmem_find(va);
    if (d)
        return len <= d->size - (va - d->va) ? CUDA_SUCCESS : CUDA_ERROR_ILLEGAL_ADDRESS;
    struct fc_resv *r = NULL;
    for (struct fc_resv *p = g_resvs; p; p = p->next)
        if (va >= p->va && va - p->va < p->size)
            r = p;
    if (!r)
        return CUDA_ERROR_NOT_FOUND;
    if (len > r->size - (va - r->va))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    uintptr_t end = va + len;
    for (uintptr_t p = va; p < end;) {
        struct fc_map *m = map_find(p);
        if (!m)
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        size_t g = (p - m->va) / g_gran;
        unsigned char f = (dev >= 0 && dev < g_ndev) ? m->acc[g * FC_ACC_SLOTS + (size_t)dev] : 0;
        if (write ? f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE : f == CU_MEM_ACCESS_FLAGS_PROT_NONE)
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        p = m->va + (g + 1) * g_gran;
    }
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ cuMemAlloc backing */

/* Back cuMemAlloc buffer d (d->mapped bytes) with a fresh memfd plus its metadata page
 * (struct fc_ipc_page, no importers), mapped MAP_SHARED read-write at `fixed` (0: anywhere; the
 * address goes to d->va). A memfd, not anonymous memory, so that cuIpcOpenMemHandle in another
 * process maps the same bytes. Returns 0, or -1 (nothing changed, errno set). */
int dmem_back(struct fc_dmem *d, uintptr_t fixed)
{
    int fd = memfd_create("fakecuda-memalloc", MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, (off_t)(d->mapped + g_page)) != 0) {
        close(fd);
        fd = -1;
    }
    struct stat st;
    struct fc_ipc_page pg;
    memset(&pg, 0, sizeof pg);
    memcpy(pg.meta.magic, FC_META_MAGIC, 8);
    pg.meta.version = FC_META_VERSION;
    pg.meta.kind = FC_KIND_MEMALLOC;
    pg.meta.size = d->mapped;
    pg.meta.device = d->dev;
    pg.meta.creator_pid = (int32_t)getpid();
    pg.meta.object_id = d->buffer_id;
    if (fd < 0 || fstat(fd, &st) != 0 || pwrite(fd, &pg, sizeof pg, (off_t)d->mapped) != (ssize_t)sizeof pg) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    void *p = mmap((void *)fixed, d->mapped, PROT_READ | PROT_WRITE, MAP_SHARED | (fixed ? MAP_FIXED : 0), fd, 0);
    if (p == MAP_FAILED) {
        close(fd);
        return -1;
    }
    d->va = (uintptr_t)p;
    d->fd = fd;
    d->st_dev = st.st_dev;
    d->st_ino = st.st_ino;
    return 0;
}

/* How many live processes (other than this one) hold own buffer d open through
 * cuIpcOpenMemHandle, read from its memfd's metadata page; *first_pid names one. A slot whose
 * process has exited (kill(pid, 0) fails with ESRCH) does not count. */
int dmem_importers(const struct fc_dmem *d, int *first_pid)
{
    struct fc_ipc_page pg;
    if (d->ipc_refs || d->fd < 0 || pread(d->fd, &pg, sizeof pg, (off_t)d->mapped) != (ssize_t)sizeof pg)
        return 0;
    int n = 0;
    for (int i = 0; i < FC_IPC_SLOTS; i++) {
        int pid = __atomic_load_n(&pg.importers[i], __ATOMIC_RELAXED);
        if (pid <= 0 || pid == (int)getpid() || (kill(pid, 0) != 0 && errno == ESRCH))
            continue;
        if (n++ == 0 && first_pid)
            *first_pid = pid;
    }
    return n;
}

/* ------------------------------------------------------------------ multicast team, extent */

void team_lock(struct fc_team *t)
{
    if (pthread_mutex_lock(&t->mu) == EOWNERDEAD) /* a holder died: the table itself is consistent */
        pthread_mutex_consistent(&t->mu);
}

void team_unlock(struct fc_team *t) { pthread_mutex_unlock(&t->mu); }

/* The bytes a handle can map: an allocation's size, a multicast object's capacity. */
uint64_t alloc_extent(const struct fc_alloc *a) { return a->kind == FC_KIND_MULTICAST ? a->team->capacity : a->size; }
