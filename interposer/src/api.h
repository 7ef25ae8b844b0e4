/*
 * api.h: the API layer (above state.h; docs/shim.md "Files and layers"): what the wrapper
 * files export to each other and to the phase ops.
 *   vmm_api.c       the tracked VMM wrappers (cuMemCreate ... cuMemAddressFree)
 *   multicast_api.c the cuMulticast* wrappers, the multicast branches of the VMM wrappers and
 *                   the multicast object tables
 *   peer.c          the FETCH_FD client (importers ask a creator's control socket)
 *   proc_address.c  cuGetProcAddress[_v2] and cudaGetDriverEntryPoint* (resolver wrappers)
 *   alloc_api.c     the IPC adapter: cuMemAlloc_v2, cuMemFree_v2, address range, attributes
 *   ipc_api.c       the IPC adapter: cuIpcGetMemHandle, cuIpcOpenMemHandle[_v2], cuIpcCloseMemHandle
 *   event_api.c     IPC events: virtual CUevent values and IPC event handles (cuEvent*, cuIpc*EventHandle)
 *   peer_access.c   cuCtxEnablePeerAccess / cuCtxDisablePeerAccess under the IPC adapter
 *   share_api.c     what is refused or carried besides memory: pool IPC, FABRIC, registrations of
 *                   shared host memory (cuMemHostRegister), INSPECT's refusals for them
 * Arrows inside the layer: vmm_api -> multicast_api -> peer, vmm_api -> peer, vmm_api ->
 * share_api; alloc_api -> vmm_api, alloc_api -> peer_access; ipc_api -> alloc_api, vmm_api,
 * peer_access; peer_access -> vmm_api; event_api -> peer.
 */
#ifndef CUI_API_H
#define CUI_API_H

#include "state.h"

/* ---------- multicast_api.c ---------- */

/* The VMM wrappers' multicast branches (called with the lock NOT held). */
CUI_HIDDEN int cui_mc_is_handle(uint64_t vh);   /* a live multicast virtual handle */
CUI_HIDDEN CUresult cui_mc_release(uint64_t vh);
CUI_HIDDEN CUresult cui_mc_map(CUdeviceptr ptr, size_t size, size_t offset, uint64_t vh, unsigned long long flags);
CUI_HIDDEN int cui_mc_range(uint64_t va, uint64_t size);   /* overlaps a multicast mapping record */
CUI_HIDDEN int cui_mc_retain(uint64_t p, CUmemGenericAllocationHandle *handle, CUresult *r);
CUI_HIDDEN CUresult cui_mc_unmap(CUdeviceptr ptr, size_t size);
CUI_HIDDEN CUresult cui_mc_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUI_HIDDEN CUresult cui_mc_export(void *shareableHandle, uint64_t vh, CUmemAllocationHandleType type,
                                  unsigned long long flags);
CUI_HIDDEN CUresult cui_mc_import_ticket(CUmemGenericAllocationHandle *handle, const struct cui_ticket *t);
/* For the phase ops (lock held or op_running). */
CUI_HIDDEN int cui_mc_live_count(void);
CUI_HIDDEN const struct cui_mc *cui_mc_passthrough(void);   /* a live pass-through object */
/* "cuMulticastBindMem", "cuMulticastBindAddr_v2", ...: the API a binding was made with. */
CUI_HIDDEN const char *cui_mc_bind_api(int by_addr, int v2);

/* ---------- peer.c ---------- */

/* Asks the creator's control socket for the real export FD of `id`. Returns the FD (CLOEXEC)
 * or -1 with a reason in `why`. Never touches the state lock. */
CUI_HIDDEN int cui_fetch_fd(uint32_t creator_pid, const uint8_t id[16], char *why, size_t cap);
/* The same, with the creator's reply status in *status (enum cui_status; -1 when no reply came). */
CUI_HIDDEN int cui_fetch_fd_status(uint32_t creator_pid, const uint8_t id[16], char *why, size_t cap, int32_t *status);
/* The same in two halves: cui_fetch_send connects and sends the request (the socket, or -1 with
 * `why`); cui_fetch_recv reads the reply and closes the socket (the FD, or -1 with `why`; the
 * reply's status in *status). */
CUI_HIDDEN int cui_fetch_send(uint32_t creator_pid, const uint8_t id[16], char *why, size_t cap);
CUI_HIDDEN int cui_fetch_recv(int s, uint32_t creator_pid, char *why, size_t cap, int32_t *status);

/* ---------- alloc_api.c (the IPC adapter) ---------- */

/* An adapter allocation's mapping (creator) or an IPC importer's mapping, by any address in it. */
struct cui_adapter_range {
  uint64_t va, mapped, requested;  /* start; bytes mapped; bytes requested (cuMemAlloc_v2) */
  uint64_t vhandle;
  void *ctx;                       /* CUcontext current at cuMemAlloc_v2 / cuIpcOpenMemHandle */
  int device;                      /* the allocation's device ordinal (an import: the exporter's) */
  int importer;                    /* opened by cuIpcOpenMemHandle (not this process's memory) */
};
/* 1 and the range when `p` lies in one; 0 otherwise. Takes the state lock. */
CUI_HIDDEN int cui_adapter_find(uint64_t p, struct cui_adapter_range *out);
/* The current context's device ordinal: a CUresult (CUDA_ERROR_INVALID_CONTEXT without one). */
CUI_HIDDEN int cui_current_device(int *dev);
/* Marks the allocation of virtual handle `vh` as adapter memory (and IPC importer memory when
 * `ipc_va` is not 0): flags, bytes requested, the current context, and `dev` (an import: the
 * allocation's own device, the exporter's). Takes the lock. */
CUI_HIDDEN void cui_adapter_mark(uint64_t vh, uint64_t requested, int dev, uint64_t ipc_va);
/* Reserve `size` bytes (alignment `align`, 0 = default), map virtual handle `vh` there, grant
 * read-write access to `dev`, through the tracked wrappers; undone on failure. */
CUI_HIDDEN CUresult cui_adapter_map(uint64_t vh, size_t size, size_t align, int dev, CUdeviceptr *va);
/* Driver IPC handles that passed through: an export of `ptr` (import = 0) or an import at VA
 * `ptr` with the handle's first 8 bytes `head` (import = 1); dropped when freed or closed. */
CUI_HIDDEN void cui_ipc_foreign_add(uint64_t ptr, const uint8_t *head, int import);
CUI_HIDDEN void cui_ipc_foreign_drop(uint64_t ptr, int import);
/* After INSPECT built its records (control.c): allocation records of adapter and IPC
 * allocations get reserved[0] = bytes requested and reserved[1] = IPC opens; while a driver IPC
 * handle is live, an OK status becomes CUI_REFUSED_STATE with `msg` naming pid, pointer or
 * handle bytes and why. Takes the state lock, then the foreign handles' own. */
CUI_HIDDEN void cui_ipc_inspect_fixup(struct cui_record *recs, uint32_t n, int32_t *status, char *msg, size_t cap);

/* ---------- event_api.c (IPC events; the phase ops call these with op_running set) ---------- */

/* PREPARE_UNICAST: drain (cuEventSynchronize) and destroy every driver event behind a virtual
 * one; LOAD_ALLOCATIONS: re-create the created ones with their flags and re-export them;
 * RESTORE_UNICAST: re-open the opened ones from their creators. 0, or -1 with `msg` naming the
 * op, pid, event id and driver call; `changed` counts the events touched. */
CUI_HIDDEN int cui_events_teardown(char *msg, size_t cap, uint32_t *changed);
CUI_HIDDEN int cui_events_recreate(char *msg, size_t cap, uint32_t *changed);
CUI_HIDDEN int cui_events_reopen(char *msg, size_t cap, uint32_t *changed);
/* INSPECT: virtual events live and opened; an OK status becomes CUI_REFUSED_STATE with `msg`
 * while a driver IPC event handle (not the shim's) is live. */
CUI_HIDDEN void cui_events_inspect(int32_t *status, char *msg, size_t cap, uint32_t *live, uint32_t *opened);

/* ---------- peer_access.c ---------- */

/* A new adapter mapping [va, va+size) of context `ctx` (cuMemAlloc_v2, cuIpcOpenMemHandle):
 * grant read-write access to the device of every context that enabled peer access to `ctx`. */
CUI_HIDDEN CUresult cui_peer_grant_new(CUdeviceptr va, size_t size, void *ctx);

/* ---------- share_api.c ---------- */

/* A FABRIC request refused with CUDA_ERROR_NOT_SUPPORTED: one line on stderr naming pid, call
 * and the fallback, at the 1st, 10th, 100th, ... refusal of that call (rate-limited). */
CUI_HIDDEN void cui_fabric_refused(const char *api, const char *what);
/* PREPARE_UNICAST: cuMemHostUnregister every registration over shared host memory;
 * LOAD_ALLOCATIONS: register them again with their flags. 0, or -1 with `msg`. */
CUI_HIDDEN int cui_hostreg_teardown(char *msg, size_t cap, uint32_t *changed);
CUI_HIDDEN int cui_hostreg_restore(char *msg, size_t cap, uint32_t *changed);
/* INSPECT (control.c): refusals for what cannot be carried (pool IPC, driver IPC events, a
 * lookup path that bypasses the shim); an OK status becomes CUI_REFUSED_STATE with `msg`. */
CUI_HIDDEN void cui_share_inspect_fixup(int32_t *status, char *msg, size_t cap);

#endif
