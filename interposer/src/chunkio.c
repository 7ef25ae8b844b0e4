/*
 * chunkio.c: the staging ring and its writer / reader threads of the chunk files (util layer;
 * protocol.h "Carriers", docs/shim.md "Chunk files"). No driver call here: ops_unicast.c fills
 * and drains the slots (cuMemcpyDtoH / cuMemcpyHtoD) and pins the ring. A chunk is hashed
 * once, while it sits in its slot (writers: before pwrite; readers: after pread, before the
 * caller may use it); a written chunk's writeback is started at once (sync_file_range). A
 * writer does not write a chunk whose digest is in the known set (protocol.h "Chunk store");
 * a reader reads each chunk from the descriptor and offset it was queued with.
 * Direct I/O (docs/shim.md "Chunk files"): a SAVE descriptor given to cui_cio_direct gets
 * O_DIRECT (open(2) "O_DIRECT") for the op, so that a chunk goes from its slot to the disk
 * without a second copy in the page cache; its flags are put back by cui_cio_finish. Readers
 * read through the page cache (its readahead keeps the disk busy while chunks are hashed; on
 * this project's bench direct reads were not faster) and drop each chunk's pages once it is
 * in its slot (POSIX_FADV_DONTNEED). Slots are page aligned (mmap), chunks sit at multiples
 * of chunk_bytes (a power of two >= 64 KiB) and streams are whole multiples of the allocation
 * granularity, so every write is aligned. A descriptor that is not a regular file or refuses
 * O_DIRECT (EINVAL: tmpfs before Linux 6.6, /dev/full), a write with an unaligned offset or
 * length, or a direct one that fails with EINVAL (a device wanting a larger alignment) falls
 * back to the page cache for the rest of the op.
 * Memory: the ring only (staging_bytes rounded down to whole chunks, at least one chunk),
 * unmapped by cui_cio_finish. All threads have every signal blocked and are
 * joined before cui_cio_finish returns.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util.h"

/* open(2) "O_DIRECT": buffer, offset and length multiples of the logical block size;
 * 4096 covers every common block device (statx STATX_DIOALIGN gives the exact value). */
#define CIO_DIRECT_ALIGN 4096u

struct cio_item {
  struct cui_cio_stream *s;
  uint32_t chunk;
  int slot;
  size_t len;
  int fd;       /* readers: the file and offset the chunk is read from */
  off_t off;
};

struct cui_cio {
  size_t chunk_bytes, nslots, ring_bytes;
  unsigned char *ring;
  int reading;
  unsigned nthreads;
  pthread_t *threads;
  pthread_mutex_t mu;
  pthread_cond_t cv_io, cv_caller; /* the I/O threads wait on the one, the op's caller on the other */
  int *free_slots;
  size_t nfree;
  struct cio_item *q;   /* writers: submitted slots; readers: verified slots (both FIFO, <= nslots) */
  size_t qhead, qlen;
  struct cio_item *tasks;   /* readers: queued reads */
  size_t ntasks, cap_tasks, next_task, consumed;
  int stop, finishing;
  uint64_t written, reused;
  cui_digest_fn digest;
  const uint8_t (*known)[CUI_DIGEST_BYTES];   /* writers: digests not to write, ascending */
  size_t nknown;
  struct cio_direct { int fd, flags; } *direct;   /* switched to O_DIRECT, and their old flags */
  size_t ndirect, cap_direct;
  uint64_t direct_bytes;   /* writers: bytes written with O_DIRECT */
  struct cui_cio_error err;
};

static void set_error(struct cui_cio *io, enum cui_cio_err kind, int e, const struct cio_item *it,
                      const uint8_t *found) {   /* lock held */
  if (io->err.kind == CUI_CIO_OK) {
    io->err.kind = kind;
    io->err.err = e;
    io->err.stream = it->s;
    io->err.chunk = it->chunk;
    if (found) memcpy(io->err.found, found, CUI_DIGEST_BYTES);
  }
  io->stop = 1;
  pthread_cond_broadcast(&io->cv_io);
  pthread_cond_broadcast(&io->cv_caller);
}

static int cmp_digest(const void *a, const void *b) { return memcmp(a, b, CUI_DIGEST_BYTES); }

static int all_zero(const unsigned char *p, size_t n) { return n == 0 || (p[0] == 0 && memcmp(p, p + 1, n - 1) == 0); }

/* pwrite/pread the whole range; returns 0, or the errno (EIO for a write that wrote nothing;
 * -1 for a read that hit the end of the file). */
static int pwrite_full(int fd, const unsigned char *p, size_t n, off_t off) {
  while (n) {
    ssize_t k = pwrite(fd, p, n, off);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return errno;
    if (k == 0) return EIO;
    p += k, n -= (size_t)k, off += k;
  }
  return 0;
}

static int pread_full(int fd, unsigned char *p, size_t n, off_t off) {
  while (n) {
    ssize_t k = pread(fd, p, n, off);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return errno;
    if (k == 0) return -1;
    p += k, n -= (size_t)k, off += k;
  }
  return 0;
}

/* Whether a write of `len` bytes at `off` of `fd` goes direct: the descriptor has O_DIRECT
 * and both are aligned (the slot always is). Anything else turns O_DIRECT off for the
 * descriptor (our own streams are whole multiples of the allocation granularity; a short last
 * chunk would fall back). */
static int use_direct(int fd, size_t len, off_t off) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || !(fl & O_DIRECT)) return 0;
  if (off % CIO_DIRECT_ALIGN == 0 && len % CIO_DIRECT_ALIGN == 0) return 1;
  (void)fcntl(fd, F_SETFL, fl & ~O_DIRECT);
  return 0;
}

/* Writes one chunk at `off` of `fd`, direct where it can (a direct write that fails with
 * EINVAL, the device wanting a larger alignment, is redone through the page cache and the
 * descriptor stays there). Returns 0 or the errno; *direct: the descriptor had O_DIRECT
 * before and after the write. Another writer may turn the flag off in between (it is never
 * turned on again during the op), so a write it overlapped counts as buffered: the count
 * never claims a buffered write, at worst it misses a direct one. */
static int write_chunk(int fd, const unsigned char *buf, size_t len, off_t off, int *direct) {
  *direct = use_direct(fd, len, off);
  int e = pwrite_full(fd, buf, len, off);
  if (*direct && e == EINVAL) {
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) (void)fcntl(fd, F_SETFL, fl & ~O_DIRECT);
    *direct = 0;
    e = pwrite_full(fd, buf, len, off);
  }
  if (*direct) {
    int fl = fcntl(fd, F_GETFL);
    *direct = fl >= 0 && (fl & O_DIRECT);
  }
  return e;
}

static void *writer_main(void *arg) {
  struct cui_cio *io = arg;
  pthread_mutex_lock(&io->mu);
  for (;;) {
    while (!io->qlen && !io->finishing && !io->stop) pthread_cond_wait(&io->cv_io, &io->mu);
    if (io->stop || !io->qlen) break;
    struct cio_item it = io->q[io->qhead];
    io->qhead = (io->qhead + 1) % io->nslots;
    io->qlen--;
    pthread_mutex_unlock(&io->mu);
    unsigned char *buf = io->ring + (size_t)it.slot * io->chunk_bytes;
    int e = 0, zero = all_zero(buf, it.len), known = 0, direct = 0;
    if (zero) memset(it.s->digests[it.chunk], 0, CUI_DIGEST_BYTES);
    else {
      io->digest(buf, it.len, it.s->digests[it.chunk]);
      known = io->nknown && bsearch(it.s->digests[it.chunk], io->known, io->nknown, CUI_DIGEST_BYTES, cmp_digest);
    }
    if (!zero && !known) {
      off_t off = (off_t)((uint64_t)it.chunk * io->chunk_bytes);
      e = write_chunk(it.s->fd, buf, it.len, off, &direct);
      /* through the page cache: start the writeback of this chunk now (it does not wait), so
       * that the disk works while later chunks are copied and hashed and the agent's sync step
       * (agent/run/durable.py) finds little left to write; not a regular file (a pipe,
       * /dev/full): the call fails and that is fine */
      if (!e && !direct) (void)sync_file_range(it.s->fd, off, (off_t)it.len, SYNC_FILE_RANGE_WRITE);
    }
    pthread_mutex_lock(&io->mu);
    if (e) set_error(io, CUI_CIO_WRITE, e, &it, NULL);
    else if (known) io->reused += it.len;
    else if (!zero) io->written += it.len;
    if (!e && direct) io->direct_bytes += it.len;
    io->free_slots[io->nfree++] = it.slot;
    pthread_cond_signal(&io->cv_caller); /* a slot is free */
  }
  pthread_mutex_unlock(&io->mu);
  return NULL;
}

static void *reader_main(void *arg) {
  struct cui_cio *io = arg;
  pthread_mutex_lock(&io->mu);
  for (;;) {
    while ((io->next_task == io->ntasks || !io->nfree) && !io->finishing && !io->stop)
      pthread_cond_wait(&io->cv_io, &io->mu);
    if (io->stop || io->next_task == io->ntasks || !io->nfree) break;
    struct cio_item it = io->tasks[io->next_task++];
    it.slot = io->free_slots[--io->nfree];
    pthread_mutex_unlock(&io->mu);
    unsigned char *buf = io->ring + (size_t)it.slot * io->chunk_bytes;
    uint8_t got[CUI_DIGEST_BYTES];
    int e = pread_full(it.fd, buf, it.len, it.off);
    /* the bytes are in the slot: their clean pages leave the page cache (no second host copy
     * stays behind; a failure of the advice changes nothing) */
    if (e == 0) (void)posix_fadvise(it.fd, it.off, (off_t)it.len, POSIX_FADV_DONTNEED);
    if (e == 0) io->digest(buf, it.len, got);
    pthread_mutex_lock(&io->mu);
    if (e == 0 && memcmp(got, it.s->digests[it.chunk], CUI_DIGEST_BYTES) != 0)
      set_error(io, CUI_CIO_CHECKSUM, 0, &it, got);
    else if (e) set_error(io, e < 0 ? CUI_CIO_SHORT : CUI_CIO_READ, e < 0 ? 0 : e, &it, NULL);
    if (e || io->stop) {
      io->free_slots[io->nfree++] = it.slot;
    } else {
      io->q[(io->qhead + io->qlen) % io->nslots] = it;
      io->qlen++;
    }
    pthread_cond_signal(&io->cv_caller); /* a chunk is ready */
    if (e || io->stop) pthread_cond_signal(&io->cv_io); /* its slot is free again */
  }
  pthread_mutex_unlock(&io->mu);
  return NULL;
}

static void cio_free(struct cui_cio *io) {
  if (io->ring) munmap(io->ring, io->ring_bytes);
  free(io->threads);
  free(io->free_slots);
  free(io->q);
  free(io->tasks);
  free(io->direct);
  pthread_cond_destroy(&io->cv_io);
  pthread_cond_destroy(&io->cv_caller);
  pthread_mutex_destroy(&io->mu);
  free(io);
}

struct cui_cio *cui_cio_start(size_t chunk_bytes, size_t staging_bytes, unsigned threads, int reading,
                              cui_digest_fn digest) {
  struct cui_cio *io = calloc(1, sizeof *io);
  if (!io) return NULL;
  io->digest = digest;
  pthread_mutex_init(&io->mu, NULL);
  pthread_cond_init(&io->cv_io, NULL);
  pthread_cond_init(&io->cv_caller, NULL);
  io->chunk_bytes = chunk_bytes;
  io->nslots = staging_bytes / chunk_bytes ? staging_bytes / chunk_bytes : 1;
  io->ring_bytes = io->nslots * chunk_bytes;
  io->reading = reading;
  io->threads = calloc(threads, sizeof *io->threads);
  io->free_slots = calloc(io->nslots, sizeof *io->free_slots);
  io->q = calloc(io->nslots, sizeof *io->q);
  void *ring = mmap(NULL, io->ring_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  io->ring = ring == MAP_FAILED ? NULL : ring;
  if (!io->threads || !io->free_slots || !io->q || !io->ring) {
    cio_free(io);
    errno = ENOMEM;
    return NULL;
  }
  for (size_t i = 0; i < io->nslots; i++) io->free_slots[io->nfree++] = (int)(io->nslots - 1 - i);
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int e = 0;
  for (unsigned i = 0; i < threads && !e; i++) {
    e = pthread_create(&io->threads[i], NULL, reading ? reader_main : writer_main, io);
    if (!e) io->nthreads++;
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (e) {
    cui_cio_finish(io, NULL, NULL);
    errno = e;
    return NULL;
  }
  return io;
}

void *cui_cio_ring(struct cui_cio *io, size_t *bytes) {
  *bytes = io->ring_bytes;
  return io->ring;
}

int cui_cio_slot(struct cui_cio *io, unsigned char **buf) {
  pthread_mutex_lock(&io->mu);
  while (!io->nfree && !io->stop) pthread_cond_wait(&io->cv_caller, &io->mu);
  int slot = io->stop ? -1 : io->free_slots[--io->nfree];
  pthread_mutex_unlock(&io->mu);
  if (slot >= 0) *buf = io->ring + (size_t)slot * io->chunk_bytes;
  return slot;
}

void cui_cio_submit(struct cui_cio *io, int slot, struct cui_cio_stream *s, uint32_t chunk, size_t len) {
  pthread_mutex_lock(&io->mu);
  io->q[(io->qhead + io->qlen) % io->nslots] = (struct cio_item){s, chunk, slot, len, s ? s->fd : -1, 0};
  io->qlen++;
  pthread_cond_signal(&io->cv_io); /* one writer takes it */
  pthread_mutex_unlock(&io->mu);
}

int cui_cio_direct(struct cui_cio *io, int fd) {
  for (size_t i = 0; i < io->ndirect; i++)
    if (io->direct[i].fd == fd) return 1;
  struct stat sb;   /* regular files only: O_DIRECT on a pipe means packet mode */
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) return 0;
  if (fl & O_DIRECT) return 1;   /* the sender's choice: left as it is */
  if (io->ndirect == io->cap_direct) {
    size_t cap = io->cap_direct ? 2 * io->cap_direct : 16;
    struct cio_direct *d = realloc(io->direct, cap * sizeof *d);
    if (!d) return 0;   /* out of memory: this file stays buffered */
    io->direct = d;
    io->cap_direct = cap;
  }
  if (fcntl(fd, F_SETFL, fl | O_DIRECT) != 0) return 0;
  io->direct[io->ndirect++] = (struct cio_direct){fd, fl};
  return 1;
}

void cui_cio_set_known(struct cui_cio *io, const uint8_t (*known)[CUI_DIGEST_BYTES], size_t n) {
  pthread_mutex_lock(&io->mu);
  io->known = known;
  io->nknown = n;
  pthread_mutex_unlock(&io->mu);
}

int cui_cio_queue_read(struct cui_cio *io, struct cui_cio_stream *s, uint32_t chunk, size_t len, int fd, uint64_t off) {
  pthread_mutex_lock(&io->mu);
  if (io->ntasks == io->cap_tasks) {
    size_t cap = io->cap_tasks ? 2 * io->cap_tasks : 64;
    struct cio_item *t = realloc(io->tasks, cap * sizeof *t);
    if (!t) {
      pthread_mutex_unlock(&io->mu);
      return -1;
    }
    io->tasks = t;
    io->cap_tasks = cap;
  }
  io->tasks[io->ntasks++] = (struct cio_item){s, chunk, -1, len, fd, (off_t)off};
  pthread_cond_signal(&io->cv_io); /* one reader takes it */
  pthread_mutex_unlock(&io->mu);
  return 0;
}

int cui_cio_take_ready(struct cui_cio *io, const struct cui_cio_stream *below, unsigned char **buf,
                       struct cui_cio_stream **s, uint32_t *chunk, size_t *len) {
  pthread_mutex_lock(&io->mu);
  while (!below && !io->qlen && !io->stop && io->consumed < io->ntasks) pthread_cond_wait(&io->cv_caller, &io->mu);
  int slot = -1;
  if (!io->stop && io->qlen && (!below || io->q[io->qhead].s < below)) {
    struct cio_item it = io->q[io->qhead];
    io->qhead = (io->qhead + 1) % io->nslots;
    io->qlen--;
    io->consumed++;
    slot = it.slot;
    *buf = io->ring + (size_t)slot * io->chunk_bytes;
    *s = it.s;
    *chunk = it.chunk;
    *len = it.len;
  }
  pthread_mutex_unlock(&io->mu);
  return slot;
}

int cui_cio_next_ready(struct cui_cio *io, unsigned char **buf, struct cui_cio_stream **s, uint32_t *chunk,
                       size_t *len) {
  return cui_cio_take_ready(io, NULL, buf, s, chunk, len);
}

void cui_cio_release(struct cui_cio *io, int slot) {
  pthread_mutex_lock(&io->mu);
  io->free_slots[io->nfree++] = slot;
  pthread_cond_signal(&io->cv_io); /* a reader waiting for a slot */
  pthread_mutex_unlock(&io->mu);
}

void cui_cio_abort(struct cui_cio *io) {
  pthread_mutex_lock(&io->mu);
  io->stop = 1;
  pthread_cond_broadcast(&io->cv_io);
  pthread_cond_broadcast(&io->cv_caller);
  pthread_mutex_unlock(&io->mu);
}

enum cui_cio_err cui_cio_finish(struct cui_cio *io, struct cui_cio_error *e, struct cui_cio_counts *counts) {
  pthread_mutex_lock(&io->mu);
  io->finishing = 1;
  pthread_cond_broadcast(&io->cv_io);
  pthread_cond_broadcast(&io->cv_caller);
  pthread_mutex_unlock(&io->mu);
  for (unsigned i = 0; i < io->nthreads; i++) pthread_join(io->threads[i], NULL);
  for (size_t i = 0; i < io->ndirect; i++) (void)fcntl(io->direct[i].fd, F_SETFL, io->direct[i].flags);
  enum cui_cio_err kind = io->err.kind;
  if (e) *e = io->err;
  if (counts) *counts = (struct cui_cio_counts){io->written, io->reused, io->direct_bytes};
  cio_free(io);
  return kind;
}
