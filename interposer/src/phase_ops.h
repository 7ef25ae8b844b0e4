/*
 * phase_ops.h: the phase-op layer (above api.h; docs/shim.md "Files and layers"): one
 * function per op of the CUI_OPS table (protocol.h), named after it, and the result they
 * fill. ops_unicast.c holds the unicast ops, ops_multicast.c the multicast ones and their
 * INSPECT records, ops_share.c the unicast ops with IPC events and registered shared host
 * memory around them; ops.c admits and dispatches them. Each runs on the control worker with
 * op_running set and the lock not held (INSPECT: lock held); it returns 0, or -1 with
 * `res` saying why.
 */
#ifndef CUI_PHASE_OPS_H
#define CUI_PHASE_OPS_H

#include "api.h"

/* The chunk files of a SAVE_ALLOCATIONS / LOAD_ALLOCATIONS request (protocol.h "Carriers"),
 * received by control.c after the request; it closes the fds after the op. */
struct cui_carry_in {
  uint64_t chunk_bytes, staging_bytes;
  uint32_t writers, count, flags;     /* flags: CUI_CARRY_* */
  struct cui_stream_entry *entries;   /* count entries */
  int *fds;                           /* one per entry: fds[0..nfd) received so far */
  uint32_t nfd;
  int conn;                           /* CUI_CARRY_STREAMED: where the rest comes from, -1 once every
                                         descriptor came or the stream broke */
  /* CUI_CARRY_STREAMED (set by carry_in.c; the op calls it, control layer -> ops by pointer):
   * receives groups until descriptor j (>= nfd, < count) came and returns it; -1 when it cannot
   * be had: *err = the errno the sender could not open the file with, or *why = what broke on
   * the wire (nothing more is read). NULL: every descriptor came with the entries. */
  int (*recv_fd)(struct cui_carry_in *in, uint32_t j, int *err, const char **why);
  uint32_t nknown;                    /* CUI_CARRY_KNOWN: ascending digests of stored chunks */
  uint8_t (*known)[CUI_DIGEST_BYTES];
  uint32_t nsources, nrefs;           /* CUI_CARRY_SOURCES (protocol.h "Chunk store") */
  struct cui_source_entry *sources;   /* nsources entries, one descriptor each in src_fds */
  int *src_fds;
  struct cui_chunk_ref *refs;         /* nrefs, ascending by (stream, chunk) */
};

struct cui_op_result;
/* carry_in.c: receive what follows the request (0, or -1 with CUI_BAD_REQUEST in res and
 * everything received closed and freed); cui_carry_free closes and frees it (idempotent). */
CUI_HIDDEN int cui_carry_recv(int conn, const struct cui_request *req, struct cui_carry_in *in,
                              struct cui_op_result *res);
CUI_HIDDEN void cui_carry_free(struct cui_carry_in *in);

struct cui_op_result {
  struct cui_carry_in *carry;         /* in: SAVE/LOAD_ALLOCATIONS only */
  uint64_t reply_reserved[6];         /* out: cui_reply.reserved[0..5] */
  unsigned char *payload;             /* out: malloc'd bytes sent after the message (SAVE: the
                                         chunk table), payload_len = reply_reserved[0] */
  int32_t status;                  /* enum cui_status */
  uint64_t bytes, copy_ns;
  int32_t cuda_result;
  uint32_t records_changed;
  char message[512];
  struct cui_record *records;      /* malloc'd, INSPECT only */
  uint32_t record_count;
};

/* ---------- ops_unicast.c ---------- */

CUI_HIDDEN int cui_op_prepare_unicast(struct cui_op_result *res);
CUI_HIDDEN int cui_op_restore_unicast(struct cui_op_result *res);
/* helpers of the byte-moving ops (ops_carriers.c, ops_load.c): "<OP>: pid <pid> allocation <hex>: <what>
 * failed: <CUDA_ERROR_...>" with status FAILED; a temporary full-size read-write staging
 * mapping of `h` (and its removal); the VA of an app mapping record of the whole of `a` whose
 * access grants `need` (CU_MEM_ACCESS_FLAGS_PROT_*) to the allocation's own device, mapped now or
 * not (`mapped`), that SAVE copies from and LOAD into instead (0: none); map every recorded mapping
 * of `a` again with `h`, or unmap every mapped one; is `a` an allocation this process carries (live
 * creator, not a raw import). */
CUI_HIDDEN void cui_fail_driver(struct cui_op_result *res, uint32_t op, const struct cui_alloc *a, const char *what,
                                CUresult r);
CUI_HIDDEN CUresult cui_staging_map(const struct cui_alloc *a, CUmemGenericAllocationHandle h, CUdeviceptr *va,
                                    const char **what);
CUI_HIDDEN CUresult cui_staging_unmap(const struct cui_alloc *a, CUdeviceptr va, const char **what);
CUI_HIDDEN CUdeviceptr cui_whole_mapping(const struct cui_alloc *a, unsigned need, int mapped);
CUI_HIDDEN CUresult cui_remap(struct cui_alloc *a, CUmemGenericAllocationHandle h, uint32_t *changed,
                              const char **what);
CUI_HIDDEN CUresult cui_unmap_all(struct cui_alloc *a, uint32_t *changed, const char **what);
CUI_HIDDEN int cui_is_carried_role(const struct cui_alloc *a);

/* ---------- ops_copies.c ---------- */

/* The device <-> staging copies of SAVE and LOAD, pipelined over streams (ops_copies.c). A copy
 * of chunk `chunk` of stream `s`, `len` bytes, through ring slot `slot`; `done` hands the slot on
 * once the copy finished (r: its CUresult), exactly once per copy put. */
#define CUI_COPY_LANES_MAX 8
struct cui_copy {
  int slot;
  struct cui_cio_stream *s;
  uint32_t chunk;
  size_t len;
};
typedef void (*cui_copy_done_fn)(void *ctx, const struct cui_copy *c, CUresult r);
struct cui_copies;
/* `lanes` copies in flight at most (0: each waited for at once; at most CUI_COPY_LANES_MAX);
 * NULL out of memory. */
CUI_HIDDEN struct cui_copies *cui_copies_start(unsigned lanes, cui_copy_done_fn done, void *ctx);
/* Issue copy `c` on the next lane's stream of the current context: HtoD from `host` to `dptr`
 * (to_device) or DtoH from `dptr` to `host`, after waiting for the copy that used the lane
 * before. A failure (*what names the call) has handed `c` on already. */
CUI_HIDDEN CUresult cui_copies_put(struct cui_copies *p, int to_device, CUdeviceptr dptr, void *host,
                                   const struct cui_copy *c, const char **what);
/* Wait for every copy in flight (drain), or that and destroy the streams and free `p` (finish;
 * adds the time spent issuing and waiting to *ns). The first failure, *what naming the call. */
CUI_HIDDEN CUresult cui_copies_drain(struct cui_copies *p, const char **what);
CUI_HIDDEN CUresult cui_copies_finish(struct cui_copies *p, uint64_t *ns, const char **what);
/* The lanes of a ring of `slots` chunk slots: half of them in flight on the device side, at
 * least one left to the I/O threads (a ring of one slot: 0, copies waited for at once). */
static inline unsigned cui_copy_lanes(size_t slots) {
  size_t n = slots / 2 < CUI_COPY_LANES_MAX ? slots / 2 : CUI_COPY_LANES_MAX;
  return (unsigned)n;
}

/* ---------- ops_carriers.c ---------- */

CUI_HIDDEN int cui_op_save_allocations(struct cui_op_result *res);
CUI_HIDDEN int cui_op_cancel_capture(struct cui_op_result *res);
/* The helpers LOAD shares (ops_load.c): the request's parameters and table against the
 * allocations carried (which[] filled; CUI_BAD_REQUEST, nothing changed); the digest function and
 * name of the request's checksum; the ring page-locked (the ring, or NULL when it stays pageable;
 * reply.reserved[4..5]); every digest table dropped (returns how many were held). */
CUI_HIDDEN int cui_carry_match(const char *op, const struct cui_carry_in *in, int load, struct cui_alloc **which,
                               struct cui_op_result *res);
CUI_HIDDEN cui_digest_fn cui_carry_digest(const struct cui_carry_in *in);
CUI_HIDDEN const char *cui_carry_checksum_name(uint32_t flags);
CUI_HIDDEN void *cui_carry_pin_ring(struct cui_op_result *res, struct cui_cio *io, const struct cui_alloc *first);
CUI_HIDDEN uint32_t cui_carry_drop_tables(void);

/* ---------- ops_load.c ---------- */

CUI_HIDDEN int cui_op_load_allocations(struct cui_op_result *res);

/* ---------- ops_share.c (ops.c's table names these for the three ops) ---------- */

CUI_HIDDEN int cui_share_prepare_unicast(struct cui_op_result *res);
CUI_HIDDEN int cui_share_load_allocations(struct cui_op_result *res);
CUI_HIDDEN int cui_share_restore_unicast(struct cui_op_result *res);

/* ---------- ops_multicast.c ---------- */

CUI_HIDDEN int cui_op_prepare_multicast(struct cui_op_result *res);
CUI_HIDDEN int cui_op_restore_multicast_creators(struct cui_op_result *res);
CUI_HIDDEN int cui_op_restore_multicast_importers(struct cui_op_result *res);
CUI_HIDDEN int cui_op_restore_multicast_devices(struct cui_op_result *res);
CUI_HIDDEN int cui_op_restore_multicast_bindings(struct cui_op_result *res);
/* INSPECT's multicast records (lock held): how many, and fill them (returns the count). */
CUI_HIDDEN size_t cui_mc_record_count(void);
CUI_HIDDEN size_t cui_mc_fill_records(struct cui_record *out);

#endif
