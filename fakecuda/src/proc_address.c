/*
 * proc_address.c: the resolvers cuGetProcAddress (legacy 4-argument) and cuGetProcAddress_v2
 * (CUDA driver API, "Driver Entry Point Access") over one table, proc_address.def, which is
 * also the list of every name the library exports. The top of fakecuda: it refers to every
 * exported function, touches no state and calls core.c (the lookup log).
 */
#include "fc.h"

/* ------------------------------------------------------------------ cuGetProcAddress */

FC_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
FC_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus);

/* One table: (base name, first driver version of this ABI) -> ELF name + function, and the
 * per-thread-default-stream twin (_ptds/_ptsz) where one exists. */
struct proc_entry {
    const char *name;
    int version;
    const char *elf;
    void *fn;
    const char *pt_elf;
    void *pt_fn;
};

/* Every exported function is declared by cuda.h (cuGetProcAddress under its ELF names below). */
#define FC_PROC(name, ver, fn) {#name, ver, #fn, (void *)fn, NULL, NULL},
#define FC_PROC_PT(name, ver, fn, ptfn) {#name, ver, #fn, (void *)fn, #ptfn, (void *)ptfn},

static const struct proc_entry g_procs[] = {
#include "proc_address.def"
};

#undef FC_PROC
#undef FC_PROC_PT

/* Returns CU_GET_PROC_ADDRESS_* status; *elf names what was returned. */
static CUdriverProcAddressQueryResult proc_lookup(const char *sym, int ver, cuuint64_t flags, void **pfn,
                                                  const char **elf)
{
    const struct proc_entry *best = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++) {
        const struct proc_entry *e = &g_procs[i];
        if (strcmp(e->name, sym) != 0)
            continue;
        known = 1;
        if (e->version <= ver && e->version <= g_driver_version && (!best || e->version > best->version))
            best = e;
    }
    *pfn = NULL;
    *elf = NULL;
    if (!best)
        return known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best->pt_fn) {
        *pfn = best->pt_fn;
        *elf = best->pt_elf;
    } else {
        *pfn = best->fn;
        *elf = best->elf;
    }
    return CU_GET_PROC_ADDRESS_SUCCESS;
}

static CUresult get_proc(const char *resolver, const char *sym, void **pfn, int ver, cuuint64_t flags,
                         CUdriverProcAddressQueryResult *status, int legacy)
{
    const char *elf = NULL;
    CUresult r = CUDA_SUCCESS;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if (!sym || !pfn || ver > FC_DRIVER_VERSION || ver < 0 ||
        (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)))
        r = CUDA_ERROR_INVALID_VALUE;
    else {
        st = proc_lookup(sym, ver, flags, pfn, &elf);
        if (legacy && st != CU_GET_PROC_ADDRESS_SUCCESS)
            r = CUDA_ERROR_NOT_FOUND; /* the legacy resolver has no status output */
    }
    if (status)
        *status = st;
    fc_logline("lookup %s %s %d %llu -> %s", resolver, sym ? (*sym ? sym : "\"\"") : "(null)", ver,
               (unsigned long long)flags, elf ? elf : "NULL");
    return r;
}

FC_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus)
{
    return get_proc("cuGetProcAddress_v2", symbol, pfn, cudaVersion, flags, symbolStatus, 0);
}

FC_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return get_proc("cuGetProcAddress", symbol, pfn, cudaVersion, flags, NULL, 1);
}
