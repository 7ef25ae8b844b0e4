/*
 * api.h: the API layer (above state.h; docs/shim.md "Files and layers"): what the wrapper
 * files export to each other and to the phase ops.
 *   vmm_api.c       the tracked VMM wrappers (cuMemCreate ... cuMemAddressFree)
 *   multicast_api.c the cuMulticast* wrappers, the multicast branches of the VMM wrappers and
 *                   the multicast object tables
 *   peer.c          the FETCH_FD client (importers ask a creator's control socket)
 *   proc_address.c  cuGetProcAddress[_v2] and cudaGetDriverEntryPoint* (resolver wrappers)
 * Arrows inside the layer: vmm_api -> multicast_api -> peer, vmm_api -> peer.
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

#endif
