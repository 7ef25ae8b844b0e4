/*
 * ops.c: the op layer (docs/shim.md "Phases"; protocol.h "Phases" and CUI_OPS): admission,
 * the phase transitions and dispatch, all from the CUI_OPS table, and INSPECT. A request is
 * admitted when the table lets its op run in the current phase (and its txn is newer, for a
 * mutating op); a read-only op (INSPECT) runs under the state lock, a mutating one first closes
 * the gate (op_running) under the lock and runs without it, then takes the phase the table
 * says it leaves. Runs on the control worker thread (control.c).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ops.h"

/* ---------- INSPECT ---------- */

static void fill_alloc_fields(struct cui_record *rec, const struct cui_alloc *a) {
  rec->role = a->role;
  rec->flags = a->flags;
  memcpy(rec->alloc_id, a->id, 16);
  rec->creator_pid = a->creator_pid;
  rec->handle_refs = a->vrefs;
  rec->prop_type = (uint32_t)a->prop.type;
  rec->prop_location_type = (uint32_t)a->prop.location.type;
  rec->prop_location_id = a->prop.location.id;
  rec->prop_handle_types = (uint32_t)a->prop.requestedHandleTypes;
}

static int cmp_va_map(const void *x, const void *y) {
  const struct cui_mapping *a = *(const struct cui_mapping *const *)x, *b = *(const struct cui_mapping *const *)y;
  return a->va < b->va ? -1 : a->va > b->va;
}
static int cmp_vhandle(const void *x, const void *y) {
  const struct cui_alloc *a = *(const struct cui_alloc *const *)x, *b = *(const struct cui_alloc *const *)y;
  return a->vhandle < b->vhandle ? -1 : a->vhandle > b->vhandle;
}
static int cmp_va_resv(const void *x, const void *y) {
  const struct cui_reservation *a = x, *b = y;
  return a->va < b->va ? -1 : a->va > b->va;
}

/* ---------- INSPECT device records (protocol.h CUI_RECORD_DEVICE) ---------- */

#define CUI_INSPECT_MAX_DEVICES 64

/* The request's CUI_INSPECT_DEVICES bit, for the INSPECT running now (set and read under the
 * state lock: INSPECT runs under it). */
static int g_inspect_devices;

static void device_use(uint32_t *uses, uint32_t location_type, int32_t ordinal, uint32_t use) {
  if (location_type == CU_MEM_LOCATION_TYPE_DEVICE && ordinal >= 0 && ordinal < CUI_INSPECT_MAX_DEVICES)
    uses[ordinal] |= use;
}

/* One CUI_RECORD_DEVICE per ordinal the records before it name (allocation locations, access
 * grants, multicast devices and bindings, the adapter's device) or whose primary context is
 * active, ordinal order. The GPU is asked of the driver now (never cached: after a native
 * restore with gpuPairs the ordinal may be another GPU). Lock held. Returns records written. */
static size_t fill_device_records(const struct cui_record *recs, size_t n, struct cui_record *out) {
  uint32_t uses[CUI_INSPECT_MAX_DEVICES] = {0};
  for (size_t i = 0; i < n; i++) {
    const struct cui_record *r = &recs[i];
    if (r->kind == CUI_RECORD_ALLOCATION)
      device_use(uses, r->prop_location_type, r->prop_location_id, CUI_DEV_USE_ALLOCATION);
    else if (r->kind == CUI_RECORD_MULTICAST_DEVICE || r->kind == CUI_RECORD_MULTICAST_BINDING)
      device_use(uses, r->prop_location_type, r->prop_location_id, CUI_DEV_USE_MULTICAST);
    for (uint32_t a = 0; a < r->access_count && a < CUI_MAX_ACCESS; a++)
      device_use(uses, r->access[a].location_type, r->access[a].location_id, CUI_DEV_USE_ACCESS);
  }
  for (size_t i = 0; i < cui_st.nallocs; i++)
    if (cui_st.allocs[i].live && (cui_st.allocs[i].flags & CUI_REC_ADAPTER))
      device_use(uses, CU_MEM_LOCATION_TYPE_DEVICE, cui_st.allocs[i].adapter_dev, CUI_DEV_USE_ALLOCATION);
  int count = 0;
  if (REAL(cuDeviceGetCount) && REAL(cuDeviceGetCount)(&count) != CUDA_SUCCESS) count = 0;
  for (int d = 0; d < count && d < CUI_INSPECT_MAX_DEVICES; d++) {
    unsigned flags = 0;
    int active = 0;
    if (REAL(cuDevicePrimaryCtxGetState) && REAL(cuDevicePrimaryCtxGetState)(d, &flags, &active) == CUDA_SUCCESS &&
        active)
      uses[d] |= CUI_DEV_USE_CONTEXT;
  }
  size_t k = 0;
  for (int d = 0; d < CUI_INSPECT_MAX_DEVICES; d++) {
    if (!uses[d]) continue;
    struct cui_record *r = &out[k++];
    r->kind = CUI_RECORD_DEVICE;
    r->prop_location_type = CU_MEM_LOCATION_TYPE_DEVICE;
    r->prop_location_id = d;
    r->reserved0 = uses[d];
    CUuuid uuid;
    memset(&uuid, 0, sizeof uuid);
    CUresult rc = CUDA_ERROR_NOT_SUPPORTED;
    if (REAL(cuDeviceGetUuid_v2)) rc = REAL(cuDeviceGetUuid_v2)(&uuid, d);
    if (rc != CUDA_SUCCESS && REAL(cuDeviceGetUuid)) rc = REAL(cuDeviceGetUuid)(&uuid, d);
    if (rc == CUDA_SUCCESS) memcpy(r->alloc_id, uuid.bytes, 16);
    size_t total = 0;
    if (REAL(cuDeviceTotalMem_v2) && REAL(cuDeviceTotalMem_v2)(&total, d) == CUDA_SUCCESS) r->size = total;
    char name[256];
    memset(name, 0, sizeof name);
    if (REAL(cuDeviceGetName) && REAL(cuDeviceGetName)(name, (int)sizeof name - 1, d) == CUDA_SUCCESS)
      r->reserved[0] = cui_checksum64(name, strlen(name));
  }
  return k;
}

/* Records: allocations in creation order, then mappings by VA, then reservations by VA, then
 * the multicast records (ops_multicast.c), then (when the request asked, CUI_INSPECT_DEVICES)
 * one device record per ordinal used. Lock held. */
static int build_records(struct cui_op_result *res) {
  size_t n = cui_st.nmaps + cui_st.nresv + cui_mc_record_count() + (g_inspect_devices ? CUI_INSPECT_MAX_DEVICES : 0);
  for (size_t i = 0; i < cui_st.nallocs; i++) n += cui_st.allocs[i].live;
  struct cui_record *recs = calloc(n ? n : 1, sizeof *recs);
  const struct cui_mapping **maps = calloc(cui_st.nmaps ? cui_st.nmaps : 1, sizeof *maps);
  struct cui_reservation *resv = malloc((cui_st.nresv ? cui_st.nresv : 1) * sizeof *resv);
  if (!recs || !maps || !resv) {
    free(recs), free(maps), free(resv);
    return -1;
  }
  size_t k = 0, na = 0;
  const struct cui_alloc **allocs = calloc(cui_st.nallocs ? cui_st.nallocs : 1, sizeof *allocs);
  if (!allocs) {
    free(recs), free(maps), free(resv);
    return -1;
  }
  for (size_t i = 0; i < cui_st.nallocs; i++)
    if (cui_st.allocs[i].live) allocs[na++] = &cui_st.allocs[i];
  qsort(allocs, na, sizeof *allocs, cmp_vhandle);   /* creation order (slots are reused) */
  for (size_t i = 0; i < na; i++) {
    const struct cui_alloc *a = allocs[i];
    struct cui_record *r = &recs[k++];
    r->kind = CUI_RECORD_ALLOCATION;
    fill_alloc_fields(r, a);
    r->size = a->size;
    r->carrier_checksum = a->checksum;
    r->carrier_bytes = a->carrier_bytes;
  }
  size_t nm = 0;
  for (size_t i = 0; i < cui_st.nslots; i++)
    if (cui_st.maps[i].used) maps[nm++] = &cui_st.maps[i];
  qsort(maps, nm, sizeof *maps, cmp_va_map);
  for (size_t i = 0; i < cui_st.nmaps; i++) {
    const struct cui_mapping *m = maps[i];
    struct cui_record *r = &recs[k++];
    r->kind = CUI_RECORD_MAPPING;
    fill_alloc_fields(r, &cui_st.allocs[m->alloc]);
    r->size = m->size;
    r->va = m->va;
    r->offset = m->offset;
    r->access_count = m->access_count;
    memcpy(r->access, m->access, m->access_count * sizeof m->access[0]);
  }
  if (cui_st.nresv) memcpy(resv, cui_st.resv, cui_st.nresv * sizeof *resv);   /* resv is NULL before the first */
  qsort(resv, cui_st.nresv, sizeof *resv, cmp_va_resv);
  for (size_t i = 0; i < cui_st.nresv; i++) {
    struct cui_record *r = &recs[k++];
    r->kind = CUI_RECORD_RESERVATION;
    r->size = resv[i].size;
    r->va = resv[i].va;
    r->offset = resv[i].align;
  }
  k += cui_mc_fill_records(&recs[k]);
  if (g_inspect_devices) k += fill_device_records(recs, k, &recs[k]);
  free(allocs);
  free(maps);
  free(resv);
  res->records = recs;
  res->record_count = (uint32_t)k;
  return 0;
}

static int cui_op_inspect(struct cui_op_result *res) {
  if (build_records(res) != 0) {
    res->status = CUI_BAD_REQUEST;
    snprintf(res->message, sizeof res->message, "INSPECT: pid %u: out of memory", (unsigned)getpid());
    return -1;
  }
  return 0;
}

/* ---------- the table ---------- */

typedef int (*cui_op_fn)(struct cui_op_result *res);

struct cui_op_rule {
  int known;                       /* a CUI_OPS row */
  uint32_t needs, leaves;          /* CUI_PHASE_* or CUI_PHASE_RULE_* */
  int mutating, copies_bytes;
};

#define CUI_OP_RULE(op, needs, leaves, mutating, copies_bytes) \
  [CUI_OP_##op] = {1, CUI_PHASE_##needs, CUI_PHASE_##leaves, mutating, copies_bytes},
static const struct cui_op_rule k_rules[CUI_OP_FETCH_FD + 1] = {CUI_OPS(CUI_OP_RULE)};
#undef CUI_OP_RULE

/* The op functions, named after their op. FETCH_FD is served by the accept thread (control.c). */
static const cui_op_fn k_run[CUI_OP_FETCH_FD + 1] = {
  [CUI_OP_INSPECT] = cui_op_inspect,
  [CUI_OP_PREPARE_MULTICAST] = cui_op_prepare_multicast,
  [CUI_OP_SAVE_ALLOCATIONS] = cui_op_save_allocations,
  [CUI_OP_PREPARE_UNICAST] = cui_share_prepare_unicast,   /* ops_share.c: events, host registrations */
  [CUI_OP_LOAD_ALLOCATIONS] = cui_share_load_allocations,
  [CUI_OP_RESTORE_UNICAST] = cui_share_restore_unicast,
  [CUI_OP_RESTORE_MULTICAST_CREATORS] = cui_op_restore_multicast_creators,
  [CUI_OP_RESTORE_MULTICAST_IMPORTERS] = cui_op_restore_multicast_importers,
  [CUI_OP_RESTORE_MULTICAST_DEVICES] = cui_op_restore_multicast_devices,
  [CUI_OP_RESTORE_MULTICAST_BINDINGS] = cui_op_restore_multicast_bindings,
  [CUI_OP_CANCEL_CAPTURE] = cui_op_cancel_capture,
};

/* The phase an op needs now (lock held). MULTICAST_RELEASED_OR_ACTIVE (SAVE_ALLOCATIONS):
 * MULTICAST_RELEASED after PREPARE_MULTICAST, ACTIVE when the capture skips it. */
static uint32_t needed_phase(const struct cui_op_rule *rule) {
  if (rule->needs == CUI_PHASE_RULE_MULTICAST_RELEASED_OR_ACTIVE)
    return cui_st.phase == CUI_PHASE_MULTICAST_RELEASED ? CUI_PHASE_MULTICAST_RELEASED : CUI_PHASE_ACTIVE;
  return rule->needs;
}

/* The phase a success leads to (lock held). The capture's mc_cycle (PREPARE_MULTICAST ran)
 * sends RESTORE_UNICAST and CANCEL_CAPTURE to MULTICAST_RELEASED, from where the four rebuild
 * ops lead to ACTIVE. */
static uint32_t left_phase(const struct cui_op_rule *rule, uint32_t from) {
  if (rule->leaves == CUI_PHASE_RULE_SAME) return from;
  if (rule->leaves == CUI_PHASE_RULE_MULTICAST_RELEASED_OR_ACTIVE)
    return cui_st.mc_cycle ? CUI_PHASE_MULTICAST_RELEASED : CUI_PHASE_ACTIVE;
  return rule->leaves;
}

/* Refusals that change nothing. Lock held. Returns 0 when the op may run. */
static int admit(const struct cui_request *req, const struct cui_op_rule *rule, struct cui_op_result *res) {
  const char *op = cui_op_name(req->op);
  unsigned pid = (unsigned)getpid();
  if (cui_st.phase == CUI_PHASE_FAILED) {
    res->status = CUI_REFUSED_PHASE;
    snprintf(res->message, sizeof res->message, "%s: pid %u is FAILED; no request is accepted", op, pid);
    return -1;
  }
  /* case 011: a capture op must leave txn ids for the ops that undo or restore it */
  int capture = req->op == CUI_OP_PREPARE_MULTICAST || req->op == CUI_OP_SAVE_ALLOCATIONS ||
                req->op == CUI_OP_PREPARE_UNICAST;
  if (capture && req->txn_id > UINT64_MAX - CUI_TXN_ROOM) {
    res->status = CUI_BAD_REQUEST;
    snprintf(res->message, sizeof res->message,
             "%s: pid %u: txn %llu leaves no room for the txns of the ops that undo it (a capture op's "
             "txn must be <= %llu); nothing was changed",
             op, pid, (unsigned long long)req->txn_id, (unsigned long long)(UINT64_MAX - CUI_TXN_ROOM));
    return -1;
  }
  if (rule->mutating && req->txn_id <= cui_st.last_txn) {
    res->status = CUI_REFUSED_DUPLICATE;
    snprintf(res->message, sizeof res->message, "%s: pid %u: txn %llu is not newer than the last accepted txn %llu", op,
             pid, (unsigned long long)req->txn_id, (unsigned long long)cui_st.last_txn);
    return -1;
  }
  /* INSPECT is read-only and answers in every phase but FAILED; the reply carries the phase. */
  if (rule->needs == CUI_PHASE_RULE_ANY) return 0;
  uint32_t needs = needed_phase(rule);
  if (req->expected_phase != cui_st.phase || needs != cui_st.phase) {
    res->status = CUI_REFUSED_PHASE;
    snprintf(res->message, sizeof res->message, "%s: pid %u is in phase %s (request expected %s; %s needs %s)", op, pid,
             cui_phase_name(cui_st.phase), cui_phase_name(req->expected_phase), op, cui_phase_name(needs));
    return -1;
  }
  if (cui_st.inflight) {
    res->status = CUI_REFUSED_STATE;
    snprintf(res->message, sizeof res->message, "%s: pid %u has %u tracked driver calls in flight; quiesce first", op,
             pid, cui_st.inflight);
    return -1;
  }
  if (req->op == CUI_OP_PREPARE_MULTICAST) {
    const struct cui_mc *m = cui_mc_passthrough();
    if (m) {
      char hex[33];
      cui_hex_id(m->id, hex);
      res->status = CUI_REFUSED_STATE;
      snprintf(res->message, sizeof res->message,
               "PREPARE_MULTICAST: pid %u multicast object %s has handle types 0x%llx (only exactly "
               "POSIX_FILE_DESCRIPTOR can be rebuilt); nothing was changed",
               pid, hex, (unsigned long long)m->prop.handleTypes);
      return -1;
    }
  }
  if (req->op == CUI_OP_SAVE_ALLOCATIONS && cui_st.phase == CUI_PHASE_ACTIVE && cui_mc_live_count()) {
    for (size_t i = 0; i < cui_st.nmcs; i++) {
      if (!cui_st.mcs[i].live) continue;
      char hex[33];
      cui_hex_id(cui_st.mcs[i].id, hex);
      res->status = CUI_REFUSED_STATE;
      snprintf(res->message, sizeof res->message,
               "SAVE_ALLOCATIONS: pid %u holds multicast object %s; PREPARE_MULTICAST must run first (ACTIVE -> "
               "MULTICAST_RELEASED); nothing was changed",
               pid, hex);
      return -1;
    }
  }
  if (req->op == CUI_OP_SAVE_ALLOCATIONS) {
    for (size_t i = 0; i < cui_st.nallocs; i++) {
      const struct cui_alloc *a = &cui_st.allocs[i];
      if (!a->live || !(a->flags & CUI_REC_RAW_IMPORT)) continue;
      char hex[33];
      cui_hex_id(a->id, hex);
      res->status = CUI_REFUSED_STATE;
      snprintf(res->message, sizeof res->message,
               "SAVE_ALLOCATIONS: pid %u allocation %s: imported from a raw file descriptor (not a cuinterpose "
               "ticket); its creator is unknown, so the sharing cannot be restored. Release it before checkpointing",
               pid, hex);
      return -1;
    }
  }
  return 0;
}

void cui_run_op(const struct cui_request *req, struct cui_op_result *res) {
  const struct cui_op_rule *rule = req->op < sizeof k_rules / sizeof k_rules[0] ? &k_rules[req->op] : NULL;
  cui_op_fn run = rule && rule->known ? k_run[req->op] : NULL;
  if (!run) {
    res->status = CUI_BAD_REQUEST;
    snprintf(res->message, sizeof res->message, "%s: pid %u: op %u is not implemented by this shim",
             cui_op_name(req->op), (unsigned)getpid(), (unsigned)req->op);
    return;
  }
  pthread_mutex_lock(&cui_st.lock);
  if (admit(req, rule, res) != 0) {
    pthread_mutex_unlock(&cui_st.lock);
    return;
  }
  if (!rule->mutating) {   /* read-only (INSPECT): under the lock, nothing changes */
    g_inspect_devices = req->op == CUI_OP_INSPECT && (req->reserved[0] & CUI_INSPECT_DEVICES);
    run(res);
    pthread_mutex_unlock(&cui_st.lock);
    res->records_changed = 0;
    return;
  }
  cui_st.op_running = 1;
  pthread_mutex_unlock(&cui_st.lock);

  uint32_t from = cui_st.phase;   /* stable: op_running holds off every other writer */
  int rc = run(res);

  pthread_mutex_lock(&cui_st.lock);
  if (rc == 0) {
    cui_st.last_txn = req->txn_id;
    cui_st.phase = left_phase(rule, from);
  } else if (res->status == CUI_FAILED) {
    cui_st.last_txn = req->txn_id;
    /* SAVE_ALLOCATIONS only copied and dropped its chunk table on failure: still where it was. */
    cui_st.phase = req->op == CUI_OP_SAVE_ALLOCATIONS ? from : CUI_PHASE_FAILED;
  }
  cui_st.op_running = 0;
  pthread_mutex_unlock(&cui_st.lock);
}
