/*
 * ops_carriers.c: the byte-moving phase ops (protocol.h "Carriers"; docs/shim.md "Chunk
 * files"): SAVE_ALLOCATIONS writes every carried allocation into its chunk file through the
 * staging ring (chunkio.c), its copies pipelined over streams (ops_copies.c), CANCEL_CAPTURE
 * drops the digest tables; and the helpers LOAD_ALLOCATIONS (ops_load.c), which reads them back,
 * shares. The descriptors come with the request (control.c receives and closes them); no host
 * copy of the bytes outlives the op (the ring is unmapped before the reply). Runs on the control
 * worker with op_running set.
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

static uint32_t chunks_of(uint64_t bytes, uint64_t cb) { return (uint32_t)((bytes + cb - 1) / cb); }

/* The request's chunk checksum (protocol.h "Carriers"): SHA-256 with CUI_CARRY_SHA256, else BLAKE2b-256. */
cui_digest_fn cui_carry_digest(const struct cui_carry_in *in) {
  return (in->flags & CUI_CARRY_SHA256) ? cui_sha256 : cui_blake2b_256;
}

/* Its name, as the manifest's chunks.checksum spells it. */
const char *cui_carry_checksum_name(uint32_t flags) { return (flags & CUI_CARRY_SHA256) ? "sha256" : "blake2b-256"; }

/* Forget every digest table: clear CUI_REC_CARRIED and the carrier fields. Returns how many
 * allocations were carried. Only host memory is touched. */
uint32_t cui_carry_drop_tables(void) {
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
int cui_carry_match(const char *op, const struct cui_carry_in *in, int load, struct cui_alloc **which,
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
             pid, cui_carry_checksum_name(in->flags),
             cui_carry_checksum_name(cui_st.chunk_sha256 ? CUI_CARRY_SHA256 : 0));
    return -1;
  }
  size_t carried = 0;
  for (size_t i = 0; i < cui_st.nallocs; i++) {
    const struct cui_alloc *a = &cui_st.allocs[i];
    carried += cui_is_carried_role(a) && (!load || (a->flags & CUI_REC_CARRIED));
  }
  /* each entry found through the id table, a duplicate through a mark per slot: O(entries) */
  unsigned char *named = calloc(cui_st.nallocs ? cui_st.nallocs : 1, 1);
  if (!named) {
    snprintf(res->message, sizeof res->message, "%s: pid %u: out of memory; nothing was changed", op, pid);
    return -1;
  }
  for (uint32_t j = 0; j < in->count; j++) {
    const struct cui_stream_entry *e = &in->entries[j];
    cui_hex_id(e->alloc_id, hex);
    struct cui_alloc *a = cui_alloc_by_id(pid, e->alloc_id);
    which[j] = a && cui_is_carried_role(a) && (!load || (a->flags & CUI_REC_CARRIED)) ? a : NULL;
    if (which[j] && named[cui_alloc_index(a)]++) {
      snprintf(res->message, sizeof res->message,
               "%s: pid %u: allocation %s is named twice in the chunk file table; nothing was changed", op, pid, hex);
      free(named);
      return -1;
    }
    if (!which[j] || e->bytes != which[j]->size) {
      snprintf(res->message, sizeof res->message,
               "%s: pid %u: the chunk file table names allocation %s (%llu bytes), which this process does not "
               "carry%s; nothing was changed",
               op, pid, hex, (unsigned long long)e->bytes, which[j] ? " with that size" : "");
      free(named);
      return -1;
    }
  }
  free(named);
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
void *cui_carry_pin_ring(struct cui_op_result *res, struct cui_cio *io, const struct cui_alloc *first) {
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

/* The hand-off of SAVE's copies (ops_copies.c): a copied slot goes to the writers (an empty
 * chunk when the copy failed); the first failed copy's stream names the allocation at fault. */
struct save_copies {
  struct cui_cio *io;
  struct cui_cio_stream *failed;
};

static void saved_copy(void *ctx, const struct cui_copy *c, CUresult r) {
  struct save_copies *sc = ctx;
  cui_cio_submit(sc->io, c->slot, c->s, c->chunk, r == CUDA_SUCCESS ? c->len : 0);
  if (r != CUDA_SUCCESS && !sc->failed) sc->failed = c->s;
}

/* Puts the copies of one allocation, chunk by chunk into ring slots, on the pipeline (each slot
 * goes to the writers once its copy is done). Returns the CUresult (*what names the call); a
 * writer's failure stops the ring (*stopped; cui_cio_finish reports it). */
static CUresult save_one(struct cui_alloc *a, struct cui_cio_stream *s, struct cui_cio *io, struct cui_copies *cp,
                         uint64_t cb, const char **what, int *stopped) {
  cui_ensure_context(&a->prop);
  CUmemGenericAllocationHandle h;
  int temporary;
  CUdeviceptr va = 0;
  CUresult r = cui_alloc_driver_handle(a, &h, &temporary);
  int held = r == CUDA_SUCCESS;
  if (r != CUDA_SUCCESS) *what = "cuMemRetainAllocationHandle";
  int staged = 0;   /* copy from the app's own mapping where one covers the allocation */
  if (r == CUDA_SUCCESS && !(va = cui_whole_mapping(a, CU_MEM_ACCESS_FLAGS_PROT_READ, 1))) {
    r = cui_staging_map(a, h, &va, what);
    staged = r == CUDA_SUCCESS;
  }
  for (uint32_t i = 0; r == CUDA_SUCCESS && i < s->nchunks; i++) {
    unsigned char *buf;
    int slot = cui_cio_slot(io, &buf);
    if (slot < 0) {
      *stopped = 1;
      break;
    }
    uint64_t off = (uint64_t)i * cb, len = s->bytes - off < cb ? s->bytes - off : cb;
    struct cui_copy c = {slot, s, i, len};
    r = cui_copies_put(cp, 0, va + off, buf, &c, what);
  }
  if (staged) {   /* its copies read the staging mapping: done before it goes */
    const char *w2 = NULL;
    CUresult r2 = cui_copies_drain(cp, &w2);
    if (r2 == CUDA_SUCCESS) r2 = cui_staging_unmap(a, va, &w2);
    if (r == CUDA_SUCCESS && r2 != CUDA_SUCCESS) r = r2, *what = w2;
  }
  if (temporary && held) REAL(cuMemRelease)(h);
  return r;
}

/* Stream j's chunk file, before its first copy: its descriptor (with CUI_CARRY_STREAMED received
 * now, as the sender opens the files), a regular file sized to the allocation (its zero chunks stay
 * holes) and switched to O_DIRECT for the op. 0, or -1 with CUI_FAILED in res naming the
 * allocation. */
static int open_stream(struct cui_op_result *res, struct cui_carry_in *in, struct cui_cio *io,
                       const struct cui_alloc *a, struct cui_cio_stream *s, uint32_t j) {
  const char *why = NULL;
  int e = 0;
  struct stat sb;
  char hex[33];
  s->fd = j < in->nfd ? in->fds[j] : in->recv_fd ? in->recv_fd(in, j, &e, &why) : -1;
  if (s->fd < 0 && !e && !why) why = "no descriptor came for this entry";
  if (s->fd >= 0) {
    e = fstat(s->fd, &sb) != 0 ? errno : S_ISREG(sb.st_mode) && ftruncate(s->fd, (off_t)s->bytes) != 0 ? errno : 0;
    if (!e) (void)cui_cio_direct(io, s->fd);
  }
  if (s->fd >= 0 && !e) return 0;
  cui_hex_id(a->id, hex);
  unsigned pid = (unsigned)getpid();
  res->status = CUI_FAILED;
  if (s->fd >= 0)
    snprintf(res->message, sizeof res->message,
             "SAVE_ALLOCATIONS: pid %u allocation %s: cannot size its chunk file to %llu bytes: %s (errno %d)", pid,
             hex, (unsigned long long)s->bytes, strerror(e), e);
  else if (e)
    snprintf(res->message, sizeof res->message,
             "SAVE_ALLOCATIONS: pid %u allocation %s: the sender could not open its chunk file: %s (errno %d)", pid,
             hex, strerror(e), e);
  else
    snprintf(res->message, sizeof res->message,
             "SAVE_ALLOCATIONS: pid %u allocation %s: no descriptor for its chunk file (stream %u of %u): %s", pid, hex,
             j, in->count, why);
  return -1;
}

int cui_op_save_allocations(struct cui_op_result *res) {
  struct cui_carry_in *in = res->carry;
  static struct cui_carry_in none = {.conn = -1};
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
  if (cui_carry_match("SAVE_ALLOCATIONS", in, 0, which, res) != 0) goto out;
  uint64_t cb = in->chunk_bytes;
  for (uint32_t j = 0; j < n; j++) {   /* each file is opened and sized when its stream comes (open_stream) */
    st[j].fd = -1;
    st[j].bytes = which[j]->size;
    st[j].nchunks = chunks_of(st[j].bytes, cb);
    st[j].digests = calloc(st[j].nchunks ? st[j].nchunks : 1, CUI_DIGEST_BYTES);
    if (!st[j].digests) {
      res->status = CUI_FAILED;
      snprintf(res->message, sizeof res->message, "SAVE_ALLOCATIONS: pid %u: out of memory for the digest tables", pid);
      goto out;
    }
  }
  struct cui_cio *io = n ? cui_cio_start(cb, in->staging_bytes, in->writers, 0, cui_carry_digest(in)) : NULL;
  if (n && !io) {
    res->status = CUI_FAILED;
    snprintf(res->message, sizeof res->message,
             "SAVE_ALLOCATIONS: pid %u: cannot start the staging ring (%llu bytes, %u writers): %s", pid,
             (unsigned long long)in->staging_bytes, in->writers, strerror(errno));
    goto out;
  }
  void *ring = cui_carry_pin_ring(res, io, which[0]);
  if (io && in->nknown) cui_cio_set_known(io, (const uint8_t (*)[CUI_DIGEST_BYTES])in->known, in->nknown);
  size_t ring_bytes = 0;
  struct save_copies sc = {io, NULL};
  struct cui_copies *cp = io ? cui_copies_start(cui_copy_lanes(cui_cio_ring(io, &ring_bytes) ? ring_bytes / cb : 1),
                                                saved_copy, &sc)
                             : NULL;
  int failed = 0, stopped = 0, unopened = 0;   /* unopened: a chunk file could not be had (res says why) */
  uint32_t at = 0;   /* the allocation being copied when something failed */
  const char *what = "copy pipeline (out of memory)";
  CUresult r = io && !cp ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
  for (; cp && at < n && r == CUDA_SUCCESS && !stopped; at++) {
    if (open_stream(res, in, io, which[at], &st[at], at) != 0) {
      unopened = 1;
      cui_cio_abort(io);
      break;
    }
    r = save_one(which[at], &st[at], io, cp, cb, &what, &stopped);
  }
  const char *w2 = NULL;
  CUresult r2 = cui_copies_finish(cp, &res->copy_ns, &w2);   /* every copy done before the ring goes */
  if (r == CUDA_SUCCESS && r2 != CUDA_SUCCESS) r = r2, what = w2;
  if (r != CUDA_SUCCESS) {
    cui_cio_abort(io);
    uint32_t j = sc.failed ? (uint32_t)(sc.failed - st) : (at ? at - 1 : 0);
    cui_fail_driver(res, CUI_OP_SAVE_ALLOCATIONS, which[j], what, r);
  }
  failed = r != CUDA_SUCCESS || stopped || unopened;
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
      cui_carry_drop_tables();
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
  res->records_changed = cui_carry_drop_tables();
  return 0;
}
