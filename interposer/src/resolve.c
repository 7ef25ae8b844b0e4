/*
 * Interception through every lookup path (docs/shim.md "Interception";
 * cuda-driver.md §1.3-§1.4):
 *   1. ELF names: the wrappers in vmm.c are exported under the driver's ELF names.
 *   2. dlsym (overridden): RTLD_DEFAULT/RTLD_NEXT are forwarded untouched, with the caller's
 *      return address preserved (glibc picks the RTLD_NEXT scope from it); an explicit handle
 *      gets a wrapper only when the real result lies in libcuda (or libcudart for the runtime
 *      rows).
 *   3. cuGetProcAddress (4 args) and cuGetProcAddress_v2: the real resolver runs first, then
 *      the wrapper whose ABI matches the function the driver actually returned (identified by
 *      address, else by dladdr -> ELF name) is swapped in. A tracked API that resolves to
 *      something unrecognised fails closed: *pfn = NULL, CUDA_ERROR_NOT_SUPPORTED.
 *   4. cudaGetDriverEntryPoint[ByVersion][_ptsz]: forward to the real runtime, then substitute.
 * Real driver functions come from dlopen("libcuda.so.1", RTLD_LAZY|RTLD_NOLOAD) (fallback
 * RTLD_LAZY|RTLD_LOCAL) and the real dlsym on that handle. Nothing here allocates memory or
 * starts a thread.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "cui.h"

enum cui_lib { CUI_LIB_CUDA, CUI_LIB_CUDART };

struct cui_hook {
  const char *elf;     /* ELF name of the real function and of the exported wrapper */
  const char *base;    /* name a cuGetProcAddress / cudaGetDriverEntryPoint caller asks for */
  void *wrapper;       /* exported wrapper, NULL for real-only rows */
  enum cui_lib lib;
  const char *alt;     /* another name whose lookup may return this ABI (the _v2 bind rows:
                          a driver may answer "cuMulticastBindMem" with the 13.1 function);
                          the wrapper is chosen from the function the driver returned */
};

/* Exported wrappers (vmm.c and below). Declared here with the names of their ELF symbols. */
CUresult cuInit(unsigned int);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *, void *);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult cuMemExportToShareableHandle(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *, CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMulticastCreate(CUmemGenericAllocationHandle *, const CUmulticastObjectProp *);
CUresult cuMulticastAddDevice(CUmemGenericAllocationHandle, CUdevice);
CUresult cuMulticastBindMem(CUmemGenericAllocationHandle, size_t, CUmemGenericAllocationHandle, size_t, size_t,
                            unsigned long long);
CUresult cuMulticastBindAddr(CUmemGenericAllocationHandle, size_t, CUdeviceptr, size_t, unsigned long long);
CUresult cuMulticastBindMem_v2(CUmemGenericAllocationHandle, CUdevice, size_t, CUmemGenericAllocationHandle, size_t,
                               size_t, unsigned long long);
CUresult cuMulticastBindAddr_v2(CUmemGenericAllocationHandle, CUdevice, size_t, CUdeviceptr, size_t,
                                unsigned long long);
CUresult cuMulticastUnbind(CUmemGenericAllocationHandle, CUdevice, size_t, size_t);

/* cuda.h maps cuGetProcAddress to _v2 by macro; the legacy 4-argument ELF symbol is defined
 * under its own spelling with an asm label. */
typedef CUresult (*cui_gpa_v1_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*cui_gpa_v2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
CUI_EXPORT CUresult cui_cuGetProcAddress_v1(const char *, void **, int, cuuint64_t) __asm__("cuGetProcAddress");
CUI_EXPORT CUresult cui_cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) __asm__("cuGetProcAddress_v2");

/* Runtime entry points (cuda_runtime_api.h types spelled as plain ints: cudaError_t,
 * enum cudaDriverEntryPointQueryResult). */
typedef int (*cui_gdep_fn)(const char *, void **, unsigned long long, int *);
typedef int (*cui_gdepv_fn)(const char *, void **, unsigned int, unsigned long long, int *);
CUI_EXPORT int cudaGetDriverEntryPoint(const char *, void **, unsigned long long, int *);
CUI_EXPORT int cudaGetDriverEntryPoint_ptsz(const char *, void **, unsigned long long, int *);
CUI_EXPORT int cudaGetDriverEntryPointByVersion(const char *, void **, unsigned int, unsigned long long, int *);
CUI_EXPORT int cudaGetDriverEntryPointByVersion_ptsz(const char *, void **, unsigned int, unsigned long long, int *);

#define W(fn) ((void *)(fn))
/* THE table: every name->wrapper pair and versioned alias, indexed by enum cui_row. */
static const struct cui_hook k_hooks[CUI_ROW_COUNT] = {
  [CUI_ROW_cuInit] = {"cuInit", "cuInit", W(cuInit), CUI_LIB_CUDA},
  [CUI_ROW_cuMemCreate] = {"cuMemCreate", "cuMemCreate", W(cuMemCreate), CUI_LIB_CUDA},
  [CUI_ROW_cuMemRelease] = {"cuMemRelease", "cuMemRelease", W(cuMemRelease), CUI_LIB_CUDA},
  [CUI_ROW_cuMemRetainAllocationHandle] = {"cuMemRetainAllocationHandle", "cuMemRetainAllocationHandle",
                                           W(cuMemRetainAllocationHandle), CUI_LIB_CUDA},
  [CUI_ROW_cuMemMap] = {"cuMemMap", "cuMemMap", W(cuMemMap), CUI_LIB_CUDA},
  [CUI_ROW_cuMemUnmap] = {"cuMemUnmap", "cuMemUnmap", W(cuMemUnmap), CUI_LIB_CUDA},
  [CUI_ROW_cuMemSetAccess] = {"cuMemSetAccess", "cuMemSetAccess", W(cuMemSetAccess), CUI_LIB_CUDA},
  [CUI_ROW_cuMemExportToShareableHandle] = {"cuMemExportToShareableHandle", "cuMemExportToShareableHandle",
                                            W(cuMemExportToShareableHandle), CUI_LIB_CUDA},
  [CUI_ROW_cuMemImportFromShareableHandle] = {"cuMemImportFromShareableHandle", "cuMemImportFromShareableHandle",
                                              W(cuMemImportFromShareableHandle), CUI_LIB_CUDA},
  [CUI_ROW_cuMemGetAllocationPropertiesFromHandle] = {"cuMemGetAllocationPropertiesFromHandle",
                                                      "cuMemGetAllocationPropertiesFromHandle",
                                                      W(cuMemGetAllocationPropertiesFromHandle), CUI_LIB_CUDA},
  [CUI_ROW_cuMemAddressReserve] = {"cuMemAddressReserve", "cuMemAddressReserve", W(cuMemAddressReserve), CUI_LIB_CUDA},
  [CUI_ROW_cuMemAddressFree] = {"cuMemAddressFree", "cuMemAddressFree", W(cuMemAddressFree), CUI_LIB_CUDA},
  [CUI_ROW_cuMulticastCreate] = {"cuMulticastCreate", "cuMulticastCreate", W(cuMulticastCreate), CUI_LIB_CUDA},
  [CUI_ROW_cuMulticastAddDevice] = {"cuMulticastAddDevice", "cuMulticastAddDevice", W(cuMulticastAddDevice),
                                    CUI_LIB_CUDA},
  [CUI_ROW_cuMulticastBindMem] = {"cuMulticastBindMem", "cuMulticastBindMem", W(cuMulticastBindMem), CUI_LIB_CUDA},
  [CUI_ROW_cuMulticastBindAddr] = {"cuMulticastBindAddr", "cuMulticastBindAddr", W(cuMulticastBindAddr),
                                   CUI_LIB_CUDA},
  [CUI_ROW_cuMulticastBindMem_v2] = {"cuMulticastBindMem_v2", "cuMulticastBindMem_v2", W(cuMulticastBindMem_v2),
                                     CUI_LIB_CUDA, "cuMulticastBindMem"},
  [CUI_ROW_cuMulticastBindAddr_v2] = {"cuMulticastBindAddr_v2", "cuMulticastBindAddr_v2", W(cuMulticastBindAddr_v2),
                                      CUI_LIB_CUDA, "cuMulticastBindAddr"},
  [CUI_ROW_cuMulticastUnbind] = {"cuMulticastUnbind", "cuMulticastUnbind", W(cuMulticastUnbind), CUI_LIB_CUDA},
  [CUI_ROW_cuGetProcAddress] = {"cuGetProcAddress", "cuGetProcAddress", W(cui_cuGetProcAddress_v1), CUI_LIB_CUDA},
  [CUI_ROW_cuGetProcAddress_v2] = {"cuGetProcAddress_v2", "cuGetProcAddress", W(cui_cuGetProcAddress_v2), CUI_LIB_CUDA},
  [CUI_ROW_cudaGetDriverEntryPoint] = {"cudaGetDriverEntryPoint", "cudaGetDriverEntryPoint",
                                       W(cudaGetDriverEntryPoint), CUI_LIB_CUDART},
  [CUI_ROW_cudaGetDriverEntryPoint_ptsz] = {"cudaGetDriverEntryPoint_ptsz", "cudaGetDriverEntryPoint_ptsz",
                                            W(cudaGetDriverEntryPoint_ptsz), CUI_LIB_CUDART},
  [CUI_ROW_cudaGetDriverEntryPointByVersion] = {"cudaGetDriverEntryPointByVersion", "cudaGetDriverEntryPointByVersion",
                                                W(cudaGetDriverEntryPointByVersion), CUI_LIB_CUDART},
  [CUI_ROW_cudaGetDriverEntryPointByVersion_ptsz] = {"cudaGetDriverEntryPointByVersion_ptsz",
                                                     "cudaGetDriverEntryPointByVersion_ptsz",
                                                     W(cudaGetDriverEntryPointByVersion_ptsz), CUI_LIB_CUDART},
  [CUI_ROW_cuGetErrorName] = {"cuGetErrorName", "cuGetErrorName", NULL, CUI_LIB_CUDA},
  [CUI_ROW_cuMemcpyDtoH_v2] = {"cuMemcpyDtoH_v2", "cuMemcpyDtoH", NULL, CUI_LIB_CUDA},
  [CUI_ROW_cuMemcpyHtoD_v2] = {"cuMemcpyHtoD_v2", "cuMemcpyHtoD", NULL, CUI_LIB_CUDA},
  [CUI_ROW_cuCtxGetCurrent] = {"cuCtxGetCurrent", "cuCtxGetCurrent", NULL, CUI_LIB_CUDA},
  [CUI_ROW_cuCtxSetCurrent] = {"cuCtxSetCurrent", "cuCtxSetCurrent", NULL, CUI_LIB_CUDA},
  [CUI_ROW_cuDeviceGet] = {"cuDeviceGet", "cuDeviceGet", NULL, CUI_LIB_CUDA},
  [CUI_ROW_cuDevicePrimaryCtxRetain] = {"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", NULL, CUI_LIB_CUDA},
  [CUI_ROW_cuMemHostRegister_v2] = {"cuMemHostRegister_v2", "cuMemHostRegister", NULL, CUI_LIB_CUDA},
  [CUI_ROW_cuMemHostUnregister] = {"cuMemHostUnregister", "cuMemHostUnregister", NULL, CUI_LIB_CUDA},
  [CUI_ROW_cuCtxGetDevice] = {"cuCtxGetDevice", "cuCtxGetDevice", NULL, CUI_LIB_CUDA},
};

/* ---------- real dlsym ---------- */

typedef void *(*cui_dlsym_fn)(void *, const char *);
static cui_dlsym_fn g_real_dlsym;

static void *cui_dlsym_unavailable(void *h, const char *n) { return NULL; }

/* Used by the dlsym entry stub: must not allocate, nor be instrumented (it runs inside a
 * sanitizer runtime's own start-up, e.g. TSan resolving its interceptors through dlsym before
 * its thread state exists). */
CUI_HIDDEN __attribute__((no_sanitize_thread, no_sanitize_address, no_sanitize_undefined))
void *cui_real_dlsym_get(void) {
  cui_dlsym_fn p = __atomic_load_n(&g_real_dlsym, __ATOMIC_ACQUIRE);
  if (!p) {
    p = (cui_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!p) p = (cui_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    if (!p) p = (cui_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.17");
    if (!p) p = cui_dlsym_unavailable;
    __atomic_store_n(&g_real_dlsym, p, __ATOMIC_RELEASE);
  }
  return (void *)p;
}

static inline void *real_dlsym(void *h, const char *n) { return ((cui_dlsym_fn)cui_real_dlsym_get())(h, n); }

/* ---------- real libraries ---------- */

static void *g_libcuda, *g_libcudart;
static void *g_real[CUI_ROW_COUNT];     /* resolved real functions (atomic pointers) */
static void *g_libcuda_base;

static void *libcuda_handle(void) {
  void *h = __atomic_load_n(&g_libcuda, __ATOMIC_ACQUIRE);
  if (!h) {
    h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!h) h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (h) {
      void *old = NULL;
      /* keep exactly one reference: an app dlclose cannot unmap pointers we cached */
      if (!__atomic_compare_exchange_n(&g_libcuda, &old, h, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        dlclose(h);
        h = old;
      }
    }
  }
  return h;
}

static void *libcudart_handle(void) {
  void *h = __atomic_load_n(&g_libcudart, __ATOMIC_ACQUIRE);
  if (!h) {
    h = dlopen("libcudart.so.13", RTLD_LAZY | RTLD_NOLOAD);
    if (!h) h = dlopen("libcudart.so.12", RTLD_LAZY | RTLD_NOLOAD);
    if (h) {
      void *old = NULL;
      if (!__atomic_compare_exchange_n(&g_libcudart, &old, h, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        dlclose(h);
        h = old;
      }
    }
  }
  return h;
}

static int is_own_wrapper(const void *p) {
  for (int i = 0; i < CUI_ROW_COUNT; i++)
    if (k_hooks[i].wrapper && k_hooks[i].wrapper == p) return 1;
  return 0;
}

void *cui_real(enum cui_row row) {
  void *p = __atomic_load_n(&g_real[row], __ATOMIC_ACQUIRE);
  if (p) return p;
  const struct cui_hook *hk = &k_hooks[row];
  if (hk->lib == CUI_LIB_CUDA) {
    void *h = libcuda_handle();
    if (h) p = real_dlsym(h, hk->elf);
  } else {
    p = real_dlsym(RTLD_NEXT, hk->elf);
    if (!p || is_own_wrapper(p)) {
      void *h = libcudart_handle();
      p = h ? real_dlsym(h, hk->elf) : NULL;
    }
  }
  if (p && is_own_wrapper(p)) p = NULL;
  if (p) __atomic_store_n(&g_real[row], p, __ATOMIC_RELEASE);
  return p;
}

static void *libcuda_base(void) {
  void *b = __atomic_load_n(&g_libcuda_base, __ATOMIC_ACQUIRE);
  if (!b) {
    void *f = cui_real(CUI_ROW_cuInit);
    Dl_info di;
    if (f && dladdr(f, &di) && di.dli_fbase) {
      b = di.dli_fbase;
      __atomic_store_n(&g_libcuda_base, b, __ATOMIC_RELEASE);
    }
  }
  return b;
}

static int in_libcuda(const void *p) {
  Dl_info di;
  void *base = libcuda_base();
  return base && dladdr(p, &di) && di.dli_fbase == base;
}

static int in_libcudart(const void *p) {
  Dl_info di;
  if (!dladdr(p, &di) || !di.dli_fname) return 0;
  const char *s = strrchr(di.dli_fname, '/');
  s = s ? s + 1 : di.dli_fname;
  return strncmp(s, "libcudart.so", 12) == 0;
}

static const struct cui_hook *hook_by_elf(const char *name, int *row) {
  if (!name || name[0] != 'c' || name[1] != 'u') return NULL;   /* fast path for non-CUDA names */
  for (int i = 0; i < CUI_ROW_COUNT; i++)
    if (k_hooks[i].wrapper && strcmp(k_hooks[i].elf, name) == 0) {
      if (row) *row = i;
      return &k_hooks[i];
    }
  return NULL;
}

/* ---------- dlsym ---------- */

/* Explicit-handle lookups: the real result, or our wrapper when it is a tracked function of
 * libcuda (libcudart for the runtime rows). */
CUI_HIDDEN void *cui_dlsym_explicit(void *handle, const char *name) {
  void *r = real_dlsym(handle, name);
  if (!r) return r;
  int row;
  const struct cui_hook *hk = hook_by_elf(name, &row);
  if (!hk) return r;
  if (r == hk->wrapper) return r;
  if (hk->lib == CUI_LIB_CUDA) return in_libcuda(r) ? hk->wrapper : r;
  if (!in_libcudart(r)) return r;
  void *old = NULL;
  __atomic_compare_exchange_n(&g_real[row], &old, r, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return hk->wrapper;
}

#if defined(__x86_64__)
/* dlsym(handle, name): RTLD_DEFAULT (0) and RTLD_NEXT (-1) jump straight into glibc's dlsym so
 * that its return address is the caller's; anything else goes to cui_dlsym_explicit. */
__asm__(
    ".text\n"
    ".globl dlsym\n"
    ".type dlsym,@function\n"
    ".p2align 4\n"
    "dlsym:\n"
    "  .cfi_startproc\n"
    "  endbr64\n"
    "  testq %rdi, %rdi\n"
    "  je 1f\n"
    "  cmpq $-1, %rdi\n"
    "  je 1f\n"
    "  jmp cui_dlsym_explicit\n"
    "1:\n"
    "  pushq %rdi\n"
    "  .cfi_adjust_cfa_offset 8\n"
    "  pushq %rsi\n"
    "  .cfi_adjust_cfa_offset 8\n"
    "  subq $8, %rsp\n"
    "  .cfi_adjust_cfa_offset 8\n"
    "  call cui_real_dlsym_get\n"
    "  addq $8, %rsp\n"
    "  .cfi_adjust_cfa_offset -8\n"
    "  popq %rsi\n"
    "  .cfi_adjust_cfa_offset -8\n"
    "  popq %rdi\n"
    "  .cfi_adjust_cfa_offset -8\n"
    "  jmp *%rax\n"
    "  .cfi_endproc\n"
    ".size dlsym, .-dlsym\n");
#else
CUI_EXPORT void *dlsym(void *handle, const char *name) {
  if (handle == RTLD_DEFAULT || handle == RTLD_NEXT) return real_dlsym(handle, name); /* scope shifts: see docs */
  return cui_dlsym_explicit(handle, name);
}
#endif

/* ---------- substitution for resolver results ---------- */

/* After a successful real lookup of `symbol` into *pfn: swap in the wrapper matching the ABI
 * the driver returned. Returns CUDA_SUCCESS, or CUDA_ERROR_NOT_SUPPORTED with *pfn = NULL when
 * a tracked API resolved to something unrecognised (fail closed). */
static CUresult substitute(const char *symbol, void **pfn) {
  if (!symbol || !pfn || !*pfn) return CUDA_SUCCESS;
  int tracked = 0;
  for (int i = 0; i < CUI_ROW_COUNT; i++) {
    const struct cui_hook *hk = &k_hooks[i];
    if (!hk->wrapper || hk->lib != CUI_LIB_CUDA) continue;
    if (strcmp(hk->base, symbol) != 0 && !(hk->alt && strcmp(hk->alt, symbol) == 0)) continue;
    tracked = 1;
    if (*pfn == hk->wrapper) return CUDA_SUCCESS;
    if (*pfn == cui_real((enum cui_row)i)) {
      *pfn = hk->wrapper;
      return CUDA_SUCCESS;
    }
  }
  if (!tracked) return CUDA_SUCCESS;
  Dl_info di;
  if (dladdr(*pfn, &di) && di.dli_saddr == *pfn && di.dli_sname && in_libcuda(*pfn)) {
    const struct cui_hook *hk = hook_by_elf(di.dli_sname, NULL);
    if (hk && hk->lib == CUI_LIB_CUDA && (strcmp(hk->base, symbol) == 0 || (hk->alt && strcmp(hk->alt, symbol) == 0))) {
      *pfn = hk->wrapper;
      return CUDA_SUCCESS;
    }
  }
  cui_api_warn("driver entry point lookup", "%s resolved to %p, which is not a known libcuda function; refused "
               "(NULL, CUDA_ERROR_NOT_SUPPORTED)", symbol, *pfn);
  *pfn = NULL;
  return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cui_cuGetProcAddress_v1(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
  cui_gpa_v1_fn real = (cui_gpa_v1_fn)cui_real(CUI_ROW_cuGetProcAddress);
  if (!real) return CUDA_ERROR_NOT_FOUND;
  CUresult r = real(symbol, pfn, cudaVersion, flags);
  if (r != CUDA_SUCCESS || !pfn) return r;
  return substitute(symbol, pfn);
}

CUresult cui_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                 CUdriverProcAddressQueryResult *status) {
  cui_gpa_v2_fn real = (cui_gpa_v2_fn)cui_real(CUI_ROW_cuGetProcAddress_v2);
  if (!real) return CUDA_ERROR_NOT_FOUND;
  CUresult r = real(symbol, pfn, cudaVersion, flags, status);
  if (r != CUDA_SUCCESS || !pfn) return r;
  r = substitute(symbol, pfn);
  if (r != CUDA_SUCCESS && status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return r;
}

/* ---------- runtime entry points ---------- */

enum { CUI_cudaErrorInitializationError = 3, CUI_cudaDriverEntryPointSymbolNotFound = 1 };

static int runtime_substitute(int r, const char *symbol, void **funcPtr, int *status) {
  if (r != 0 || !funcPtr) return r;
  if (substitute(symbol, funcPtr) != CUDA_SUCCESS && status) *status = CUI_cudaDriverEntryPointSymbolNotFound;
  return r;
}

int cudaGetDriverEntryPoint(const char *symbol, void **funcPtr, unsigned long long flags, int *status) {
  cui_gdep_fn real = (cui_gdep_fn)cui_real(CUI_ROW_cudaGetDriverEntryPoint);
  if (!real) return CUI_cudaErrorInitializationError;
  return runtime_substitute(real(symbol, funcPtr, flags, status), symbol, funcPtr, status);
}

int cudaGetDriverEntryPoint_ptsz(const char *symbol, void **funcPtr, unsigned long long flags, int *status) {
  cui_gdep_fn real = (cui_gdep_fn)cui_real(CUI_ROW_cudaGetDriverEntryPoint_ptsz);
  if (!real) return CUI_cudaErrorInitializationError;
  return runtime_substitute(real(symbol, funcPtr, flags, status), symbol, funcPtr, status);
}

int cudaGetDriverEntryPointByVersion(const char *symbol, void **funcPtr, unsigned int cudaVersion,
                                     unsigned long long flags, int *status) {
  cui_gdepv_fn real = (cui_gdepv_fn)cui_real(CUI_ROW_cudaGetDriverEntryPointByVersion);
  if (!real) return CUI_cudaErrorInitializationError;
  return runtime_substitute(real(symbol, funcPtr, cudaVersion, flags, status), symbol, funcPtr, status);
}

int cudaGetDriverEntryPointByVersion_ptsz(const char *symbol, void **funcPtr, unsigned int cudaVersion,
                                          unsigned long long flags, int *status) {
  cui_gdepv_fn real = (cui_gdepv_fn)cui_real(CUI_ROW_cudaGetDriverEntryPointByVersion_ptsz);
  if (!real) return CUI_cudaErrorInitializationError;
  return runtime_substitute(real(symbol, funcPtr, cudaVersion, flags, status), symbol, funcPtr, status);
}
