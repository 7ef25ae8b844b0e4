/*
 * ops_share.c: the unicast ops with what is shared besides memory (docs/shim.md "IPC events",
 * "What real stacks share"), on the phase-op layer: each runs the memory op of ops_unicast.c
 * or ops_carriers.c and, around it, the steps for IPC events (event_api.c) and registrations of
 * shared host memory (share_api.c). ops.c's table names these for the three ops.
 *   PREPARE_UNICAST   drain and destroy the driver events behind virtual IPC events, unregister
 *                     shared host memory, then the memory teardown: native checkpoint sees none
 *                     of them.
 *   LOAD_ALLOCATIONS  the carriers, then register shared host memory again (CRIU restored the
 *                     mapping at the same address) and re-create the created IPC events with
 *                     their flags (re-exported for the openers).
 *   RESTORE_UNICAST   the importers' memory, then re-open the opened IPC events from their
 *                     creators (every creator re-created its events in LOAD_ALLOCATIONS).
 * A failure sets CUI_FAILED with the message of the step that failed (ops.c then leaves the
 * shim FAILED, as for any destructive op).
 */
#define _GNU_SOURCE
#include "phase_ops.h"

static int failed(struct cui_op_result *res) {
  res->status = CUI_FAILED;
  return -1;
}

int cui_share_prepare_unicast(struct cui_op_result *res) {
  if (cui_events_teardown(res->message, sizeof res->message, &res->records_changed) != 0 ||
      cui_hostreg_teardown(res->message, sizeof res->message, &res->records_changed) != 0)
    return failed(res);
  return cui_op_prepare_unicast(res);
}

int cui_share_load_allocations(struct cui_op_result *res) {
  if (cui_op_load_allocations(res) != 0) return -1;
  if (cui_hostreg_restore(res->message, sizeof res->message, &res->records_changed) != 0 ||
      cui_events_recreate(res->message, sizeof res->message, &res->records_changed) != 0)
    return failed(res);
  return 0;
}

int cui_share_restore_unicast(struct cui_op_result *res) {
  if (cui_op_restore_unicast(res) != 0) return -1;
  if (cui_events_reopen(res->message, sizeof res->message, &res->records_changed) != 0) return failed(res);
  return 0;
}
