/*
 * phase_ops.h: the phase-op layer (above api.h; docs/shim.md "Files and layers"): one
 * function per op of the CUI_OPS table (protocol.h), named after it, and the result they
 * fill. ops_unicast.c holds the unicast ops, ops_multicast.c the multicast ones and their
 * INSPECT records; ops.c admits and dispatches them. Each runs on the control worker with
 * op_running set and the lock not held (INSPECT: lock held); it returns 0, or -1 with
 * `res` saying why.
 */
#ifndef CUI_PHASE_OPS_H
#define CUI_PHASE_OPS_H

#include "api.h"

struct cui_op_result {
  int32_t status;                  /* enum cui_status */
  uint64_t bytes, copy_ns;
  int32_t cuda_result;
  uint32_t records_changed;
  char message[512];
  struct cui_record *records;      /* malloc'd, INSPECT only */
  uint32_t record_count;
};

/* ---------- ops_unicast.c ---------- */

CUI_HIDDEN int cui_op_save_allocations(struct cui_op_result *res);
CUI_HIDDEN int cui_op_prepare_unicast(struct cui_op_result *res);
CUI_HIDDEN int cui_op_load_allocations(struct cui_op_result *res);
CUI_HIDDEN int cui_op_restore_unicast(struct cui_op_result *res);
CUI_HIDDEN int cui_op_cancel_capture(struct cui_op_result *res);

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
