/*
 * resolve.h: the resolve layer (above util.h): the rows of hooks.def, the real driver and
 * runtime functions behind them, and the substitution of wrappers into resolver results.
 * resolve.c holds the table (k_hooks) and the dlsym override; the exported wrappers it names
 * live in the layers above (the table takes their addresses, it never calls them).
 */
#ifndef CUI_RESOLVE_H
#define CUI_RESOLVE_H

#include "util.h"

/* One row per hooks.def line, in its order: hooked rows, then the real-only rows. */
enum cui_row {
#define CUI_HOOK(elf, base, alt, lib, ret, params)             CUI_ROW_##elf,
#define CUI_HOOK_AS(elf, wrapper, base, alt, lib, ret, params) CUI_ROW_##elf,
#define CUI_REAL(elf, base, lib, ret, params)                  CUI_ROW_##elf,
#include "hooks.def"
  CUI_ROW_COUNT
};

/* cui_fn_<elf>: the signature of each row's real function (cuda.h). */
#define CUI_HOOK(elf, base, alt, lib, ret, params)             typedef ret(*cui_fn_##elf) params;
#define CUI_HOOK_AS(elf, wrapper, base, alt, lib, ret, params) typedef ret(*cui_fn_##elf) params;
#define CUI_REAL(elf, base, lib, ret, params)                  typedef ret(*cui_fn_##elf) params;
#include "hooks.def"

/* The exported wrappers, under their C names (the ELF name by asm label where it differs). */
#define CUI_HOOK(elf, base, alt, lib, ret, params)             CUI_EXPORT ret elf params;
#define CUI_HOOK_AS(elf, wrapper, base, alt, lib, ret, params) CUI_EXPORT ret wrapper params __asm__(#elf);
#define CUI_REAL(elf, base, lib, ret, params)
#include "hooks.def"

/* The real function of a row (libcuda.so.1 for driver rows, libcudart for runtime rows),
 * or NULL when that library does not define it. Never returns one of the shim's wrappers.
 * REAL(row): the real function of a row cast to its type. */
CUI_HIDDEN void *cui_real(enum cui_row row);
#define REAL(row) ((cui_fn_##row)cui_real(CUI_ROW_##row))

/* The driver's name of a CUresult (cuGetErrorName), else the fallback table of util.c. */
CUI_HIDDEN const char *cui_cu_error_name(CUresult r);   /* "CUDA_ERROR_INVALID_VALUE" */

/* After a successful real lookup of `symbol` into *pfn (cuGetProcAddress,
 * cudaGetDriverEntryPoint): swap in the wrapper matching the ABI the driver returned.
 * Returns 0, or -1 when a tracked API resolved to something unrecognised (*pfn untouched:
 * the caller refuses it, fail closed). */
CUI_HIDDEN int cui_substitute(const char *symbol, void **pfn);

/* Case 005: 1 when the dlsym the process resolves (RTLD_DEFAULT) is not the shim's own (another
 * dlsym interposer was preloaded first); `who` gets that library's path. */
CUI_HIDDEN int cui_dlsym_foreign(char *who, size_t cap);

#endif
