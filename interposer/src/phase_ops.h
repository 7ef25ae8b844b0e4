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
  int *fds;                           /* one per entry */
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
  const struct cui_carry_in *carry;   /* in: SAVE/LOAD_ALLOCATIONS only */
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
/* helpers of the byte-moving ops (ops_carriers.c): "<OP>: pid <pid> allocation <hex>: <what>
 * failed: <CUDA_ERROR_...>" with status FAILED; a temporary full-size read-write staging
 * mapping of `h` (and its removal); the VA of an app mapping of the whole of `a` that SAVE
 * may copy from instead; map every recorded mapping of `a` again with `h`; is `a`
 * an allocation this process carries (live creator, not a raw import). */
CUI_HIDDEN void cui_fail_driver(struct cui_op_result *res, uint32_t op, const struct cui_alloc *a, const char *what,
                                CUresult r);
CUI_HIDDEN CUresult cui_staging_map(const struct cui_alloc *a, CUmemGenericAllocationHandle h, CUdeviceptr *va,
                                    const char **what);
CUI_HIDDEN CUresult cui_staging_unmap(const struct cui_alloc *a, CUdeviceptr va, const char **what);
CUI_HIDDEN CUdeviceptr cui_whole_mapping(const struct cui_alloc *a);
CUI_HIDDEN CUresult cui_remap(struct cui_alloc *a, CUmemGenericAllocationHandle h, uint32_t *changed,
                              const char **what);
CUI_HIDDEN int cui_is_carried_role(const struct cui_alloc *a);

/* ---------- ops_carriers.c ---------- */

CUI_HIDDEN int cui_op_save_allocations(struct cui_op_result *res);
CUI_HIDDEN int cui_op_load_allocations(struct cui_op_result *res);
CUI_HIDDEN int cui_op_cancel_capture(struct cui_op_result *res);

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
