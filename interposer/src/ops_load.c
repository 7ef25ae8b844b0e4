/*
 * ops_load.c: LOAD_ALLOCATIONS (PREPARED -> LOADED; protocol.h "Carriers", docs/shim.md "Chunk
 * files"): every carried allocation is created again, its chunks read back through the staging
 * ring (chunkio.c), each verified against its digest before its bytes reach the device, and
 * copied in by the copy pipeline (ops_copies.c); then mapped, exported and its digest table
 * dropped. A refused or failed load releases what it created and leaves the process PREPARED.
 * Runs on the control worker with op_running set; shares ops_carriers.c's helpers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "phase_ops.h"

static const uint8_t k_zero_digest[CUI_DIGEST_BYTES];

static void hex_digest(const uint8_t d[CUI_DIGEST_BYTES], char out[2 * CUI_DIGEST_BYTES + 1]) {
  for (unsigned i = 0; i < CUI_DIGEST_BYTES; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
}

/* LOAD_ALLOCATIONS runs in three steps so that the disk, the readers' checksums and the
 * driver work at the same time across allocations (one allocation at a time left the disk at
 * queue depth one: 5.9 ms per 2 MiB allocation at K = 1000 on an H200, docs/gpu-validation.md):
 * queue_reads queues every non-zero chunk of every stream at once (the readers start at once,
 * bounded by the ring), the caller then creates each allocation, maps it where the app maps it
 * (place: as SAVE copies from the app's mapping, no staging mapping to make, unmap and remap
 * after, where a mapping of the whole allocation grants the allocation's device read-write
 * access) or on a staging mapping, and zeroes its zero chunks (zero_chunks), and drain_reads
 * puts each chunk's copy on the pipeline as the readers verify it, in whatever order they
 * finish. */

/* Queues the reads of every non-zero chunk of the n streams, from the stream's file or, for a
 * chunk with a ref (protocol.h "Chunk store"; the refs ascend by (stream, chunk)), from its
 * source. Returns how many were queued, or -1 out of memory. */
static int64_t queue_reads(const struct cui_carry_in *in, struct cui_cio_stream *st, uint32_t n, struct cui_cio *io,
                           uint64_t cb) {
  int64_t queued = 0;
  uint32_t ref = 0;
  for (uint32_t j = 0; j < n; j++) {
    struct cui_cio_stream *s = &st[j];
    for (uint32_t i = 0; i < s->nchunks; i++) {
      uint64_t off = (uint64_t)i * cb, len = s->bytes - off < cb ? s->bytes - off : cb, from = off;
      int fd = s->fd;
      if (in && ref < in->nrefs && in->refs[ref].stream == j && in->refs[ref].chunk == i) {
        fd = in->src_fds[in->refs[ref].source];
        from = in->refs[ref++].offset;
      }
      if (!memcmp(s->digests[i], k_zero_digest, CUI_DIGEST_BYTES)) continue;
      if (cui_cio_queue_read(io, s, i, len, fd, from) != 0) return -1;
      queued++;
    }
  }
  return queued;
}

/* Zeroes the zero chunks of the fresh allocation mapped at `va` (a fresh allocation is not
 * zeroed), one cuMemsetD8 per run of consecutive zero chunks, and waits for them (a memset of
 * device memory may still run after the call returns: driver API "API synchronization behavior";
 * the copies of the other chunks run on streams of their own). Returns 0, or -1 with the driver
 * failure in res. */
static int zero_chunks(struct cui_op_result *res, struct cui_alloc *a, const struct cui_cio_stream *s, CUdeviceptr va,
                       uint64_t cb) {
  int set = 0;
  for (uint32_t i = 0; i < s->nchunks;) {
    if (memcmp(s->digests[i], k_zero_digest, CUI_DIGEST_BYTES)) {
      i++;
      continue;
    }
    uint32_t k = i;
    while (k < s->nchunks && !memcmp(s->digests[k], k_zero_digest, CUI_DIGEST_BYTES)) k++;
    uint64_t off = (uint64_t)i * cb, end = (uint64_t)k * cb < s->bytes ? (uint64_t)k * cb : s->bytes;
    CUresult r = REAL(cuMemsetD8_v2)(va + off, 0, end - off);
    if (r != CUDA_SUCCESS) {
      cui_fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, a, "cuMemsetD8_v2", r);
      return -1;
    }
    set = 1;
    i = k;
  }
  CUresult r = set ? REAL(cuStreamSynchronize)(NULL) : CUDA_SUCCESS;
  if (r != CUDA_SUCCESS) {
    cui_fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, a, "cuStreamSynchronize", r);
    return -1;
  }
  return 0;
}

/* The hand-off of LOAD's copies (ops_copies.c): a copied slot goes back to the readers; the
 * first failed copy's stream names the allocation at fault. */
struct load_copies {
  struct cui_cio *io;
  struct cui_cio_stream *failed;
};

static void loaded_copy(void *ctx, const struct cui_copy *c, CUresult r) {
  struct load_copies *lc = ctx;
  cui_cio_release(lc->io, c->slot);
  if (r != CUDA_SUCCESS && !lc->failed) lc->failed = c->s;
}

/* Puts the copies of verified chunks to their allocations (vas[j]: where stream j's allocation is
 * mapped) on the pipeline as the readers deliver them: `n` of them, waiting for each; or, with
 * `below`, those of the streams before it that are verified already, without waiting (while the
 * later allocations are still being created, so that the readers never stall on a full ring).
 * *taken counts them; *last: the allocation whose device's context is current. Returns 0; -1
 * with a driver failure in res (naming the chunk's allocation) or 1 when the ring stopped (the
 * caller reads why). */
static int drain_reads(struct cui_op_result *res, struct cui_alloc **which, struct cui_cio_stream *st,
                       const CUdeviceptr *vas, struct load_copies *lc, struct cui_copies *cp, uint64_t cb,
                       const struct cui_cio_stream *below, int64_t n, int64_t *taken, const struct cui_alloc **last) {
  for (int64_t k = 0; below || k < n; k++) {
    unsigned char *buf;
    struct cui_cio_stream *got;
    uint32_t chunk;
    size_t len;
    int slot = cui_cio_take_ready(lc->io, below, &buf, &got, &chunk, &len);
    if (slot < 0) return below ? 0 : 1;
    ++*taken;
    uint32_t j = (uint32_t)(got - st);
    if (!*last || (*last)->prop.location.type != which[j]->prop.location.type ||
        (*last)->prop.location.id != which[j]->prop.location.id) {
      cui_ensure_context(&which[j]->prop);   /* its device's context: the chunks of several GPUs interleave */
    }
    *last = which[j];
    const char *what = NULL;
    struct cui_copy c = {slot, got, chunk, len};
    CUresult r = cui_copies_put(cp, 1, vas[j] + (uint64_t)chunk * cb, buf, &c, &what);
    if (r != CUDA_SUCCESS) {
      cui_fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, which[lc->failed ? lc->failed - st : j], what, r);
      return -1;
    }
  }
  return 0;
}

/* Undoes what LOAD made of allocation j: its mappings (placed at the app's VAs) or its staging
 * mapping, and its handle. */
static void unmake(struct cui_alloc *a, CUmemGenericAllocationHandle h, CUdeviceptr va, int placed) {
  const char *w = NULL;
  uint32_t n = 0;
  if (placed) cui_unmap_all(a, &n, &w);
  else if (va) cui_staging_unmap(a, va, &w);
  REAL(cuMemRelease)(h);
}

/* A refused load: why (the ring's error, or a file of the wrong size), naming pid, allocation,
 * chunk, both checksums. */
static void refuse_load(struct cui_op_result *res, const struct cui_alloc *a, const struct cui_cio_error *e,
                        const struct cui_cio_stream *s, uint32_t j) {
  char hex[33], want[65], got[65], where[64] = "its chunk file";
  const struct cui_carry_in *in = res->carry;
  for (uint32_t k = 0; in && k < in->nrefs; k++)
    if (in->refs[k].stream == j && in->refs[k].chunk == e->chunk)
      snprintf(where, sizeof where, "chunk store source %u at offset %llu", in->refs[k].source,
               (unsigned long long)in->refs[k].offset);
  cui_hex_id(a->id, hex);
  unsigned pid = (unsigned)getpid();
  int n = 0;
  res->status = CUI_REFUSED_STATE;
  if (e->kind == CUI_CIO_CHECKSUM) {
    hex_digest(s->digests[e->chunk], want);
    hex_digest(e->found, got);
    n = snprintf(res->message, sizeof res->message,
                 "LOAD_ALLOCATIONS: pid %u allocation %s: chunk %u of %s has checksum %s %s, recorded %s", pid, hex,
                 e->chunk, where, cui_carry_checksum_name(in ? in->flags : 0), got, want);
  } else if (e->kind == CUI_CIO_SHORT) {
    n = snprintf(res->message, sizeof res->message,
                 "LOAD_ALLOCATIONS: pid %u allocation %s: %s ends inside chunk %u (shorter than the %llu "
                 "bytes saved)",
                 pid, hex, where, e->chunk, (unsigned long long)s->bytes);
  } else {
    n = snprintf(res->message, sizeof res->message,
                 "LOAD_ALLOCATIONS: pid %u allocation %s: reading chunk %u of %s failed: %s (errno %d)", pid, hex,
                 e->chunk, where, strerror(e->err), e->err);
  }
  if (n > 0 && (size_t)n < sizeof res->message)
    snprintf(res->message + n, sizeof res->message - (size_t)n,
             "; nothing was loaded (the allocations created were released) and pid %u stays PREPARED", pid);
}

/* The chunk store's sources and refs against the files and the digest tables (protocol.h
 * "Chunk store"): each source a regular file of its entry's size, each ref inside its stream
 * and its source. CUI_REFUSED_STATE naming the source or ref; nothing changed. */
static int check_sources(struct cui_op_result *res, const struct cui_carry_in *in, struct cui_alloc **which,
                         const struct cui_cio_stream *st) {
  unsigned pid = (unsigned)getpid();
  char hex[33];
  for (uint32_t k = 0; k < in->nsources; k++) {
    struct stat sb;
    if (fstat(in->src_fds[k], &sb) != 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size != in->sources[k].bytes) {
      res->status = CUI_REFUSED_STATE;
      snprintf(res->message, sizeof res->message,
               "LOAD_ALLOCATIONS: pid %u: chunk store source %u is not a regular file of %llu bytes (found %lld "
               "bytes); nothing was changed and pid %u stays PREPARED",
               pid, k, (unsigned long long)in->sources[k].bytes, (long long)sb.st_size, pid);
      return -1;
    }
  }
  uint64_t cb = in->chunk_bytes;
  for (uint32_t k = 0; k < in->nrefs; k++) {
    const struct cui_chunk_ref *r = &in->refs[k];
    const struct cui_cio_stream *s = &st[r->stream];
    uint64_t off = (uint64_t)r->chunk * cb, len = off < s->bytes ? (s->bytes - off < cb ? s->bytes - off : cb) : 0;
    if (r->chunk >= s->nchunks || r->offset > in->sources[r->source].bytes ||
        len > in->sources[r->source].bytes - r->offset) {
      cui_hex_id(which[r->stream]->id, hex);
      res->status = CUI_REFUSED_STATE;
      snprintf(res->message, sizeof res->message,
               "LOAD_ALLOCATIONS: pid %u allocation %s: the ref of chunk %u (source %u, offset %llu) lies outside "
               "the allocation (%u chunks) or its source (%llu bytes); nothing was changed and pid %u stays PREPARED",
               pid, hex, r->chunk, r->source, (unsigned long long)r->offset, s->nchunks,
               (unsigned long long)in->sources[r->source].bytes, pid);
      return -1;
    }
  }
  return 0;
}

/* Creates allocation j again and maps it: where the app maps the whole of it with read-write
 * access for its device (placed[j]: every mapping record made again now, counted in *remapped),
 * else on a staging mapping. vas[j]: where its bytes go. 0, or -1 with the failure in res
 * (nothing of j left). */
static int make(struct cui_op_result *res, struct cui_alloc *a, CUmemGenericAllocationHandle *h, CUdeviceptr *va,
                unsigned char *placed, uint32_t *remapped) {
  cui_ensure_context(&a->prop);
  const char *what = "cuMemCreate";
  CUresult r = REAL(cuMemCreate)(h, a->size, &a->prop, 0);
  if (r == CUDA_SUCCESS) {
    *va = cui_whole_mapping(a, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, 0);
    *placed = *va != 0;
    r = *placed ? cui_remap(a, *h, remapped, &what) : cui_staging_map(a, *h, va, &what);
    if (r != CUDA_SUCCESS) unmake(a, *h, 0, *placed), *va = 0;
  }
  if (r != CUDA_SUCCESS) cui_fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, a, what, r);
  return r == CUDA_SUCCESS ? 0 : -1;
}

int cui_op_load_allocations(struct cui_op_result *res) {
  const struct cui_carry_in *in = res->carry;
  static const struct cui_carry_in none = {.chunk_bytes = CUI_CHUNK_MIN, .staging_bytes = CUI_CHUNK_MIN, .writers = 1};
  if (!in) in = &none;
  unsigned pid = (unsigned)getpid();
  uint32_t n = in->count;
  struct cui_alloc **which = calloc(n ? n : 1, sizeof *which);
  struct cui_cio_stream *st = calloc(n ? n : 1, sizeof *st);
  CUmemGenericAllocationHandle *hs = calloc(n ? n : 1, sizeof *hs);
  CUdeviceptr *vas = calloc(n ? n : 1, sizeof *vas);
  unsigned char *placed = calloc(n ? n : 1, 1);
  uint32_t made = 0, remapped = 0;   /* allocations created (and mapped) so far; mapping records made */
  int rc = -1;
  if (!which || !st || !hs || !vas || !placed) {
    res->status = CUI_REFUSED_STATE;
    snprintf(res->message, sizeof res->message, "LOAD_ALLOCATIONS: pid %u: out of memory; nothing was changed", pid);
    goto out;
  }
  if (cui_carry_match("LOAD_ALLOCATIONS", in, 1, which, res) != 0) goto out;
  uint64_t cb = in->chunk_bytes;
  for (uint32_t j = 0; j < n; j++) {
    struct stat sb;
    st[j] = (struct cui_cio_stream){in->fds[j], which[j]->carrier_bytes, which[j]->nchunks, which[j]->digests};
    if (fstat(st[j].fd, &sb) != 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size != st[j].bytes) {
      char hex[33];
      cui_hex_id(which[j]->id, hex);
      res->status = CUI_REFUSED_STATE;
      snprintf(res->message, sizeof res->message,
               "LOAD_ALLOCATIONS: pid %u allocation %s: its chunk file is not a regular file of %llu bytes (found "
               "%lld bytes); nothing was changed and pid %u stays PREPARED",
               pid, hex, (unsigned long long)st[j].bytes, (long long)sb.st_size, pid);
      goto out;
    }
  }
  if (check_sources(res, in, which, st) != 0) goto out;
  struct cui_cio *io = n ? cui_cio_start(cb, in->staging_bytes, in->writers, 1, cui_carry_digest(in)) : NULL;
  if (n && !io) {
    res->status = CUI_REFUSED_STATE;
    snprintf(res->message, sizeof res->message,
             "LOAD_ALLOCATIONS: pid %u: cannot start the staging ring (%llu bytes, %u readers): %s; nothing was "
             "changed",
             pid, (unsigned long long)in->staging_bytes, in->writers, strerror(errno));
    goto out;
  }
  void *ring = cui_carry_pin_ring(res, io, which[0]);
  size_t ring_bytes = 0;
  struct load_copies lc = {io, NULL};
  struct cui_copies *cp = io ? cui_copies_start(cui_copy_lanes((cui_cio_ring(io, &ring_bytes), ring_bytes / cb)),
                                                loaded_copy, &lc)
                             : NULL;
  int got = 0;   /* 0 ok, -1 driver failure (res filled), 1 the ring stopped */
  int64_t queued = io && cp ? queue_reads(in, st, n, io, cb) : 0;
  if ((io && !cp) || queued < 0) {
    cui_fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, which[0], "queueing the chunk reads (out of memory)",
                    CUDA_ERROR_OUT_OF_MEMORY);
    got = -1;
  }
  int64_t taken = 0;   /* verified chunks put on the pipeline */
  const struct cui_alloc *last = NULL;
  for (uint32_t j = 0; j < n && got == 0; j++) {   /* while the readers read and verify */
    got = make(res, which[j], &hs[j], &vas[j], &placed[j], &remapped);
    made += got == 0;
    last = which[j];   /* make() made its device's context current */
    if (got == 0) got = zero_chunks(res, which[j], &st[j], vas[j], cb);
    if (got == 0) got = drain_reads(res, which, st, vas, &lc, cp, cb, &st[j + 1], 0, &taken, &last);
  }
  if (got == 0) got = drain_reads(res, which, st, vas, &lc, cp, cb, NULL, queued - taken, &taken, &last);
  const char *what = NULL;   /* every copy done before the ring or a mapping goes */
  CUresult r = cui_copies_finish(cp, &res->copy_ns, &what);
  if (got == 0 && r != CUDA_SUCCESS) {
    cui_fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, which[lc.failed ? lc.failed - st : 0], what, r);
    got = -1;
  }
  for (uint32_t j = 0; j < n && got == 0; j++) res->bytes += which[j]->size;
  if (got != 0 && io) cui_cio_abort(io);
  if (ring) REAL(cuMemHostUnregister)(ring);
  struct cui_cio_error e;
  enum cui_cio_err kind = io ? cui_cio_finish(io, &e, NULL) : CUI_CIO_OK;
  if (got == 1 || (got == 0 && kind != CUI_CIO_OK)) {
    uint32_t j = (uint32_t)(e.stream - st);
    refuse_load(res, which[j], &e, &st[j], j);
    got = 1;
  }
  if (got != 0) {   /* refused or failed: release what was created; the app's state is untouched */
    for (uint32_t j = 0; j < made; j++) unmake(which[j], hs[j], vas[j], placed[j]);
    made = 0;
    res->bytes = 0;
    if (got == -1) {   /* a driver call failed: the tables stay, the phase stays (nothing was torn down) */
      res->status = CUI_REFUSED_STATE;
      size_t len = strlen(res->message);
      snprintf(res->message + len, sizeof res->message - len,
               "; the allocations created were released and pid %u stays PREPARED", pid);
    }
    goto out;
  }
  /* every byte is on the device and verified: map (those on a staging mapping), export, keep the
   * handles (destructive from here: a failure moves the shim to FAILED) */
  res->records_changed += remapped;
  for (uint32_t j = 0; j < n; j++) {
    struct cui_alloc *a = which[j];
    r = CUDA_SUCCESS;
    if (!placed[j]) {
      r = cui_staging_unmap(a, vas[j], &what);
      vas[j] = 0;
      if (r == CUDA_SUCCESS) r = cui_remap(a, hs[j], &res->records_changed, &what);
    }
    if (r == CUDA_SUCCESS && (a->flags & CUI_REC_EXPORTED)) {
      int fd = -1;
      r = REAL(cuMemExportToShareableHandle)(&fd, hs[j], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (r != CUDA_SUCCESS) what = "cuMemExportToShareableHandle";
      else if (cui_cache_put(a->id, fd) != 0) {
        close(fd);
        r = CUDA_ERROR_OUT_OF_MEMORY;
        what = "export cache insert";
      }
    }
    if (r != CUDA_SUCCESS) {
      cui_fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, a, what, r);   /* FAILED: nothing is rolled back */
      for (uint32_t k = j + 1; k < n; k++) unmake(which[k], hs[k], vas[k], placed[k]);
      made = 0;
      goto out;
    }
    if (a->vrefs > 0) {
      a->real = hs[j];
      a->has_real = 1;
    } else {
      REAL(cuMemRelease)(hs[j]);   /* the app only kept mappings */
    }
    res->records_changed++;
  }
  made = 0;
  cui_carry_drop_tables();
  rc = 0;
out:
  free(which);
  free(st);
  free(hs);
  free(vas);
  free(placed);
  return rc;
}
