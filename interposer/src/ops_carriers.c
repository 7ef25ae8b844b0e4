/*
 * ops_carriers.c: the byte-moving phase ops (protocol.h "Carriers"; docs/shim.md "Chunk
 * files"): SAVE_ALLOCATIONS writes every carried allocation into its chunk file through the
 * staging ring (chunkio.c), LOAD_ALLOCATIONS reads it back and verifies each chunk before its
 * bytes reach the device, CANCEL_CAPTURE drops the digest tables. The descriptors come with
 * the request (control.c receives and closes them); no host copy of the bytes outlives the op
 * (the ring is unmapped before the reply). Runs on the control worker with op_running set.
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

static uint32_t chunks_of(uint64_t bytes, uint64_t cb) { return (uint32_t)((bytes + cb - 1) / cb); }

/* The request's chunk checksum (protocol.h "Carriers"): SHA-256 with CUI_CARRY_SHA256, else BLAKE2b-256. */
static cui_digest_fn digest_of(const struct cui_carry_in *in) {
  return (in->flags & CUI_CARRY_SHA256) ? cui_sha256 : cui_blake2b_256;
}

/* Its name, as the manifest's chunks.checksum spells it. */
static const char *checksum_name(uint32_t flags) { return (flags & CUI_CARRY_SHA256) ? "sha256" : "blake2b-256"; }

/* Forget every digest table: clear CUI_REC_CARRIED and the carrier fields. Returns how many
 * allocations were carried. Only host memory is touched. */
static uint32_t drop_tables(void) {
  uint32_t n = 0;
  for (size_t i = 0; i < cui_st.nallocs; i++) {
    struct cui_alloc *a = &cui_st.allocs[i];
    if (a->flags & CUI_REC_CARRIED) n++;
    a->flags &= ~CUI_REC_CARRIED;
    free(a->digests);
    a->digests = NULL;
    a->nchunks = 0;
    a->carrier_bytes = 0;
    a->checksum = 0;
  }
  cui_st.chunk_bytes = 0;
  cui_st.chunk_sha256 = 0;
  return n;
}

/* The request's parameters and its table against the allocations this process carries (SAVE:
 * cui_is_carried_role; LOAD: those with CUI_REC_CARRIED). Fills which[] (entry -> allocation).
 * CUI_BAD_REQUEST naming what is wrong; nothing changed. */
static int match_entries(const char *op, const struct cui_carry_in *in, int load, struct cui_alloc **which,
                         struct cui_op_result *res) {
  unsigned pid = (unsigned)getpid();
  char hex[33];
  res->status = CUI_BAD_REQUEST;
  uint64_t cb = in->chunk_bytes;
  if (cb < CUI_CHUNK_MIN || cb > CUI_CHUNK_MAX || (cb & (cb - 1)) || in->staging_bytes < cb ||
      in->staging_bytes > CUI_STAGING_MAX || in->writers < 1 || in->writers > CUI_WRITERS_MAX) {
    snprintf(res->message, sizeof res->message,
             "%s: pid %u: chunk_bytes %llu (a power of two in [%llu, %llu]), staging_bytes %llu (>= chunk_bytes, <= "
             "%llu) or writers %u (1..%u) out of range; nothing was changed",
             op, pid, (unsigned long long)cb, CUI_CHUNK_MIN, CUI_CHUNK_MAX, (unsigned long long)in->staging_bytes,
             CUI_STAGING_MAX, in->writers, CUI_WRITERS_MAX);
    return -1;
  }
  if (load && cui_st.chunk_bytes && cb != cui_st.chunk_bytes) {
    snprintf(res->message, sizeof res->message,
             "%s: pid %u: chunk_bytes %llu differs from the %llu the chunk files were saved with; nothing was changed",
             op, pid, (unsigned long long)cb, (unsigned long long)cui_st.chunk_bytes);
    return -1;
  }
  if (load && cui_st.chunk_bytes && !(in->flags & CUI_CARRY_SHA256) != !cui_st.chunk_sha256) {
    snprintf(res->message, sizeof res->message,
             "%s: pid %u: checksum %s differs from the %s the chunk files were saved with; nothing was changed", op,
             pid, checksum_name(in->flags), checksum_name(cui_st.chunk_sha256 ? CUI_CARRY_SHA256 : 0));
    return -1;
  }
  size_t carried = 0;
  for (size_t i = 0; i < cui_st.nallocs; i++) {
    const struct cui_alloc *a = &cui_st.allocs[i];
    carried += cui_is_carried_role(a) && (!load || (a->flags & CUI_REC_CARRIED));
  }
  for (uint32_t j = 0; j < in->count; j++) {
    const struct cui_stream_entry *e = &in->entries[j];
    cui_hex_id(e->alloc_id, hex);
    which[j] = NULL;
    for (size_t i = 0; i < cui_st.nallocs && !which[j]; i++) {
      struct cui_alloc *a = &cui_st.allocs[i];
      if (cui_is_carried_role(a) && (!load || (a->flags & CUI_REC_CARRIED)) && !memcmp(a->id, e->alloc_id, 16))
        which[j] = a;
    }
    for (uint32_t k = 0; k < j && which[j]; k++)
      if (which[k] == which[j]) {
        snprintf(res->message, sizeof res->message,
                 "%s: pid %u: allocation %s is named twice in the chunk file table; nothing was changed", op, pid, hex);
        return -1;
      }
    if (!which[j] || e->bytes != which[j]->size) {
      snprintf(res->message, sizeof res->message,
               "%s: pid %u: the chunk file table names allocation %s (%llu bytes), which this process does not "
               "carry%s; nothing was changed",
               op, pid, hex, (unsigned long long)e->bytes, which[j] ? " with that size" : "");
      return -1;
    }
  }
  if (in->count != carried) {
    snprintf(res->message, sizeof res->message,
             "%s: pid %u carries %zu allocations but the request brings %u chunk files (one per carried "
             "allocation, protocol.h \"Carriers\"); nothing was changed",
             op, pid, carried, in->count);
    return -1;
  }
  res->status = CUI_OK;
  return 0;
}

/* ---------- SAVE_ALLOCATIONS: MULTICAST_RELEASED (or ACTIVE) -> SAVED ---------- */

/* The chunk table of the reply (protocol.h "Carriers"). */
static int build_table(struct cui_op_result *res, struct cui_alloc **which, const struct cui_cio_stream *st,
                       uint32_t n) {
  size_t len = 0;
  for (uint32_t j = 0; j < n; j++) len += sizeof(struct cui_stream_head) + (size_t)st[j].nchunks * CUI_DIGEST_BYTES;
  unsigned char *p = malloc(len ? len : 1);
  if (!p) return -1;
  size_t off = 0;
  for (uint32_t j = 0; j < n; j++) {
    struct cui_stream_head h;
    memset(&h, 0, sizeof h);
    memcpy(h.alloc_id, which[j]->id, 16);
    h.bytes = st[j].bytes;
    h.chunk_count = st[j].nchunks;
    for (uint32_t i = 0; i < st[j].nchunks; i++) h.zero_count += !memcmp(st[j].digests[i], k_zero_digest, 32);
    memcpy(p + off, &h, sizeof h);
    off += sizeof h;
    memcpy(p + off, st[j].digests, (size_t)st[j].nchunks * CUI_DIGEST_BYTES);
    off += (size_t)st[j].nchunks * CUI_DIGEST_BYTES;
  }
  res->payload = p;
  res->reply_reserved[0] = len;
  return 0;
}

/* Page-locks the staging ring of `io` (cuMemHostRegister, PORTABLE: pinned for every context)
 * so that the driver copies it by DMA; a pageable ring still works, at pageable speed (on an
 * H200, R580: 14.4 GB/s against 55.2 GB/s pinned, docs/gpu-validation.md). The register needs
 * a current context (CUDA_ERROR_INVALID_CONTEXT otherwise, cuda.h), and the control worker has
 * none before its first op: `first`'s device's primary context is made current. Reports
 * reply.reserved[4] = the bytes page-locked (0: the ring is pageable) and reserved[5] = the
 * register's CUresult when it failed (protocol.h "Carriers"). Returns the ring when it was
 * page-locked (the caller unregisters it), else NULL. */
static void *pin_ring(struct cui_op_result *res, struct cui_cio *io, const struct cui_alloc *first) {
  if (!io) return NULL;
  size_t ring_bytes = 0;
  void *ring = cui_cio_ring(io, &ring_bytes);
  cui_fn_cuMemHostRegister_v2 reg = REAL(cuMemHostRegister_v2);
  cui_ensure_context(&first->prop);
  CUresult r = reg ? reg(ring, ring_bytes, CU_MEMHOSTREGISTER_PORTABLE) : CUDA_ERROR_NOT_SUPPORTED;
  res->reply_reserved[4] = r == CUDA_SUCCESS ? ring_bytes : 0;
  res->reply_reserved[5] = r == CUDA_SUCCESS ? 0 : (uint64_t)(uint32_t)r;
  return r == CUDA_SUCCESS ? ring : NULL;
}

/* Copies one allocation chunk by chunk into ring slots and hands each to the writers. */
static int save_one(struct cui_op_result *res, struct cui_alloc *a, struct cui_cio_stream *s, struct cui_cio *io,
                    uint64_t cb) {
  cui_ensure_context(&a->prop);
  const char *what = NULL;
  CUmemGenericAllocationHandle h;
  int temporary;
  CUdeviceptr va = 0;
  CUresult r = cui_alloc_driver_handle(a, &h, &temporary);
  int held = r == CUDA_SUCCESS, stopped = 0;
  if (r != CUDA_SUCCESS) what = "cuMemRetainAllocationHandle";
  int staged = 0;   /* copy from the app's own mapping where one covers the allocation */
  if (r == CUDA_SUCCESS && !(va = cui_whole_mapping(a))) {
    r = cui_staging_map(a, h, &va, &what);
    staged = r == CUDA_SUCCESS;
  }
  if (r == CUDA_SUCCESS) {
    for (uint32_t i = 0; i < s->nchunks && r == CUDA_SUCCESS; i++) {
      unsigned char *buf;
      int slot = cui_cio_slot(io, &buf);
      if (slot < 0) {
        stopped = 1;   /* a writer failed: cui_cio_finish reports it */
        break;
      }
      uint64_t off = (uint64_t)i * cb, len = s->bytes - off < cb ? s->bytes - off : cb;
      uint64_t t0 = cui_now_ns();
      r = REAL(cuMemcpyDtoH_v2)(buf, va + off, len);
      res->copy_ns += cui_now_ns() - t0;
      if (r != CUDA_SUCCESS) {
        what = "cuMemcpyDtoH_v2";
        cui_cio_submit(io, slot, s, i, 0);   /* give the slot back (an empty chunk) */
        break;
      }
      cui_cio_submit(io, slot, s, i, len);
    }
    const char *w2 = NULL;
    CUresult r2 = staged ? cui_staging_unmap(a, va, &w2) : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS && r2 != CUDA_SUCCESS) r = r2, what = w2;
  }
  if (temporary && held) REAL(cuMemRelease)(h);
  if (r != CUDA_SUCCESS) {
    cui_cio_abort(io);
    cui_fail_driver(res, CUI_OP_SAVE_ALLOCATIONS, a, what, r);
    return -1;
  }
  return stopped ? -1 : 0;
}

int cui_op_save_allocations(struct cui_op_result *res) {
  const struct cui_carry_in *in = res->carry;
  static const struct cui_carry_in none;
  if (!in) in = &none;
  unsigned pid = (unsigned)getpid();
  uint32_t n = in->count;
  struct cui_alloc **which = calloc(n ? n : 1, sizeof *which);
  struct cui_cio_stream *st = calloc(n ? n : 1, sizeof *st);
  int rc = -1;
  char hex[33];
  if (!which || !st) {
    res->status = CUI_REFUSED_STATE;
    snprintf(res->message, sizeof res->message, "SAVE_ALLOCATIONS: pid %u: out of memory; nothing was changed", pid);
    goto out;
  }
  if (match_entries("SAVE_ALLOCATIONS", in, 0, which, res) != 0) goto out;
  uint64_t cb = in->chunk_bytes;
  for (uint32_t j = 0; j < n; j++) {
    st[j].fd = in->fds[j];
    st[j].bytes = which[j]->size;
    st[j].nchunks = chunks_of(st[j].bytes, cb);
    st[j].digests = calloc(st[j].nchunks ? st[j].nchunks : 1, CUI_DIGEST_BYTES);
    struct stat sb;   /* a regular file is sized first (its zero chunks stay holes) */
    int e = !st[j].digests                                 ? ENOMEM
            : fstat(st[j].fd, &sb) != 0                    ? errno
            : !S_ISREG(sb.st_mode)                         ? 0
            : ftruncate(st[j].fd, (off_t)st[j].bytes) != 0 ? errno
                                                           : 0;
    if (e) {
      cui_hex_id(which[j]->id, hex);
      res->status = CUI_FAILED;
      snprintf(res->message, sizeof res->message,
               "SAVE_ALLOCATIONS: pid %u allocation %s: cannot size its chunk file to %llu bytes: %s (errno %d)", pid,
               hex, (unsigned long long)st[j].bytes, strerror(e), e);
      goto out;
    }
  }
  struct cui_cio *io = n ? cui_cio_start(cb, in->staging_bytes, in->writers, 0, digest_of(in)) : NULL;
  if (n && !io) {
    res->status = CUI_FAILED;
    snprintf(res->message, sizeof res->message,
             "SAVE_ALLOCATIONS: pid %u: cannot start the staging ring (%llu bytes, %u writers): %s", pid,
             (unsigned long long)in->staging_bytes, in->writers, strerror(errno));
    goto out;
  }
  void *ring = pin_ring(res, io, which[0]);
  if (io && in->nknown) cui_cio_set_known(io, (const uint8_t (*)[CUI_DIGEST_BYTES])in->known, in->nknown);
  for (uint32_t j = 0; io && j < n; j++) (void)cui_cio_direct(io, st[j].fd);
  int failed = 0;
  for (uint32_t j = 0; j < n && !failed; j++) failed = save_one(res, which[j], &st[j], io, cb) != 0;
  if (ring) REAL(cuMemHostUnregister)(ring);
  struct cui_cio_error e;
  struct cui_cio_counts counts = {0};
  if (io && cui_cio_finish(io, &e, &counts) != CUI_CIO_OK && res->status != CUI_FAILED) {
    uint32_t j = (uint32_t)(e.stream - st);
    cui_hex_id(which[j]->id, hex);
    res->status = CUI_FAILED;
    snprintf(res->message, sizeof res->message,
             "SAVE_ALLOCATIONS: pid %u allocation %s: writing chunk %u of %u (offset %llu) to its chunk file failed: "
             "%s (errno %d)",
             pid, hex, e.chunk, st[j].nchunks, (unsigned long long)e.chunk * cb, strerror(e.err), e.err);
    failed = 1;
  }
  if (failed || build_table(res, which, st, n) != 0) {
    if (!failed) {
      res->status = CUI_FAILED;
      snprintf(res->message, sizeof res->message, "SAVE_ALLOCATIONS: pid %u: out of memory for the chunk table", pid);
    }
    goto out;
  }
  for (uint32_t j = 0; j < n; j++) {
    struct cui_alloc *a = which[j];
    free(a->digests);
    a->digests = st[j].digests;
    st[j].digests = NULL;
    a->nchunks = st[j].nchunks;
    a->carrier_bytes = st[j].bytes;
    a->checksum = cui_checksum64(a->digests, (size_t)a->nchunks * CUI_DIGEST_BYTES);
    a->flags |= CUI_REC_CARRIED;
    res->bytes += a->size;
    res->records_changed++;
  }
  cui_st.chunk_bytes = cb;
  cui_st.chunk_sha256 = (in->flags & CUI_CARRY_SHA256) != 0;
  res->reply_reserved[1] = cb;
  res->reply_reserved[2] = counts.written;
  res->reply_reserved[3] = counts.direct;
  rc = 0;
out:
  for (uint32_t j = 0; st && j < n; j++) free(st[j].digests);
  free(st);
  free(which);
  if (rc != 0) {
    res->bytes = 0;
    res->records_changed = 0;
    free(res->payload);
    res->payload = NULL;
    res->reply_reserved[0] = 0;
    if (res->status == CUI_FAILED) {
      drop_tables();
      size_t len = strlen(res->message);
      snprintf(res->message + len, sizeof res->message - len,
               "; the chunk table was dropped and pid %u stays %s (nothing was torn down)", pid,
               cui_phase_name(cui_st.phase));
    }
  }
  return rc;
}

/* ---------- CANCEL_CAPTURE: SAVED -> MULTICAST_RELEASED (or ACTIVE) ---------- */

/* SAVED differs from ACTIVE only by the digest tables (SAVE_ALLOCATIONS only copied): drop them. */
int cui_op_cancel_capture(struct cui_op_result *res) {
  res->records_changed = drop_tables();
  return 0;
}

/* ---------- LOAD_ALLOCATIONS: PREPARED -> LOADED ---------- */

/* LOAD_ALLOCATIONS runs in three steps so that the disk, the readers' checksums and the
 * driver work at the same time across allocations (one allocation at a time left the disk at
 * queue depth one: 5.9 ms per 2 MiB allocation at K = 1000 on an H200, docs/gpu-validation.md):
 * queue_reads queues every non-zero chunk of every stream at once (the readers start at once,
 * bounded by the ring), the caller then creates and staging-maps each allocation and zeroes
 * its zero chunks (zero_chunks), and drain_reads copies each chunk to its allocation as the
 * readers verify it, in whatever order they finish. */

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

/* Zeroes the zero chunks of the fresh allocation behind staging mapping `va` (a fresh
 * allocation is not zeroed), one cuMemsetD8 per run of consecutive zero chunks. Returns 0, or
 * -1 with the driver failure in res. */
static int zero_chunks(struct cui_op_result *res, struct cui_alloc *a, const struct cui_cio_stream *s, CUdeviceptr va,
                       uint64_t cb) {
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
    i = k;
  }
  return 0;
}

/* Copies the `queued` verified chunks to their allocations (vas[j]: stream j's staging
 * mapping) as the readers deliver them. Returns 0; -1 with a driver failure in res (naming the
 * chunk's allocation) or 1 when the ring stopped (the caller reads why). */
static int drain_reads(struct cui_op_result *res, struct cui_alloc **which, struct cui_cio_stream *st,
                       const CUdeviceptr *vas, struct cui_cio *io, uint64_t cb, int64_t queued) {
  for (int64_t k = 0; k < queued; k++) {
    unsigned char *buf;
    struct cui_cio_stream *got;
    uint32_t chunk;
    size_t len;
    int slot = cui_cio_next_ready(io, &buf, &got, &chunk, &len);
    if (slot < 0) return 1;
    uint32_t j = (uint32_t)(got - st);
    cui_ensure_context(&which[j]->prop);   /* its device's context: the chunks of several GPUs interleave */
    uint64_t t0 = cui_now_ns();
    CUresult r = REAL(cuMemcpyHtoD_v2)(vas[j] + (uint64_t)chunk * cb, buf, len);
    res->copy_ns += cui_now_ns() - t0;
    cui_cio_release(io, slot);
    if (r != CUDA_SUCCESS) {
      cui_fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, which[j], "cuMemcpyHtoD_v2", r);
      return -1;
    }
  }
  return 0;
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
                 e->chunk, where, checksum_name(in ? in->flags : 0), got, want);
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
  uint32_t made = 0;   /* allocations created (and staging-mapped) so far */
  int rc = -1;
  if (!which || !st || !hs || !vas) {
    res->status = CUI_REFUSED_STATE;
    snprintf(res->message, sizeof res->message, "LOAD_ALLOCATIONS: pid %u: out of memory; nothing was changed", pid);
    goto out;
  }
  if (match_entries("LOAD_ALLOCATIONS", in, 1, which, res) != 0) goto out;
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
  struct cui_cio *io = n ? cui_cio_start(cb, in->staging_bytes, in->writers, 1, digest_of(in)) : NULL;
  if (n && !io) {
    res->status = CUI_REFUSED_STATE;
    snprintf(res->message, sizeof res->message,
             "LOAD_ALLOCATIONS: pid %u: cannot start the staging ring (%llu bytes, %u readers): %s; nothing was "
             "changed",
             pid, (unsigned long long)in->staging_bytes, in->writers, strerror(errno));
    goto out;
  }
  void *ring = pin_ring(res, io, which[0]);
  int got = 0;   /* 0 ok, -1 driver failure (res filled), 1 the ring stopped */
  int64_t queued = io ? queue_reads(in, st, n, io, cb) : 0;
  if (queued < 0) {
    cui_fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, which[0], "queueing the chunk reads (out of memory)",
                    CUDA_ERROR_OUT_OF_MEMORY);
    got = -1;
  }
  for (uint32_t j = 0; j < n && got == 0; j++) {   /* while the readers read and verify */
    struct cui_alloc *a = which[j];
    cui_ensure_context(&a->prop);
    const char *what = "cuMemCreate";
    CUresult r = REAL(cuMemCreate)(&hs[j], a->size, &a->prop, 0);
    if (r == CUDA_SUCCESS) {
      r = cui_staging_map(a, hs[j], &vas[j], &what);
      if (r != CUDA_SUCCESS) REAL(cuMemRelease)(hs[j]);
    }
    if (r != CUDA_SUCCESS) {
      cui_fail_driver(res, CUI_OP_LOAD_ALLOCATIONS, a, what, r);
      got = -1;
      break;
    }
    made++;
    got = zero_chunks(res, a, &st[j], vas[j], cb);
  }
  if (got == 0) got = drain_reads(res, which, st, vas, io, cb, queued);
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
    for (uint32_t j = 0; j < made; j++) {
      const char *w = NULL;
      cui_staging_unmap(which[j], vas[j], &w);
      REAL(cuMemRelease)(hs[j]);
    }
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
  /* every byte is on the device and verified: map, export, keep the handles (destructive from
   * here: a failure moves the shim to FAILED) */
  for (uint32_t j = 0; j < n; j++) {
    struct cui_alloc *a = which[j];
    const char *what = NULL;
    CUresult r = cui_staging_unmap(a, vas[j], &what);
    vas[j] = 0;
    if (r == CUDA_SUCCESS) r = cui_remap(a, hs[j], &res->records_changed, &what);
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
      for (uint32_t k = j + 1; k < n; k++) {
        cui_staging_unmap(which[k], vas[k], &what);
        REAL(cuMemRelease)(hs[k]);
      }
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
  drop_tables();
  rc = 0;
out:
  free(which);
  free(st);
  free(hs);
  free(vas);
  return rc;
}
