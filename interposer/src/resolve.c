/*
 * resolve.c: the resolve layer (resolve.h; docs/shim.md "Interception"): the hooks.def table,
 * the real driver/runtime functions, the dlsym override and the substitution of wrappers into
 * resolver results (the resolver wrappers themselves are in proc_address.c). Lookup paths:
 *   1. ELF names: the wrappers are exported under the driver's ELF names.
 *   2. dlsym (overridden): RTLD_DEFAULT/RTLD_NEXT are forwarded untouched, with the caller's
 *      return address preserved (glibc picks the RTLD_NEXT scope from it); an explicit handle
 *      gets a wrapper only when the real result lies in libcuda (or libcudart for the runtime
 *      rows).
 *   3. cuGetProcAddress (4 args) and cuGetProcAddress_v2: the real resolver runs first, then
 *      the wrapper whose ABI matches the function the driver actually returned (identified by
 *      address, else by dladdr -> ELF name) is swapped in (cui_substitute). A tracked API that
 *      resolves to something unrecognised fails closed: *pfn = NULL, CUDA_ERROR_NOT_SUPPORTED.
 *   4. cudaGetDriverEntryPoint[ByVersion][_ptsz]: forward to the real runtime, then substitute.
 * Real driver functions come from dlopen("libcuda.so.1", RTLD_LAZY|RTLD_NOLOAD) (fallback
 * RTLD_LAZY|RTLD_LOCAL) and the real dlsym on that handle. Nothing here allocates memory or
 * starts a thread. Calls only util.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "resolve.h"

enum cui_lib { CUI_LIB_CUDA, CUI_LIB_CUDART };

struct cui_hook {
  const char *elf;     /* ELF name of the real function and of the exported wrapper */
  const char *base;    /* name a cuGetProcAddress / cudaGetDriverEntryPoint caller asks for */
  void *wrapper;       /* exported wrapper, NULL for real-only rows */
  enum cui_lib lib;
  const char *alt;     /* another name whose lookup may return this ABI (hooks.def) */
};

/* THE table: every name->wrapper pair and versioned alias, indexed by enum cui_row, generated
 * from hooks.def. It takes the wrappers' addresses (they live in the layers above); it never
 * calls them. */
static const struct cui_hook k_hooks[CUI_ROW_COUNT] = {
#define CUI_HOOK(elf, base, alt, lib, ret, params) [CUI_ROW_##elf] = {#elf, #base, (void *)elf, CUI_LIB_##lib, alt},
#define CUI_HOOK_AS(elf, wrapper, base, alt, lib, ret, params) \
  [CUI_ROW_##elf] = {#elf, #base, (void *)wrapper, CUI_LIB_##lib, alt},
#define CUI_REAL(elf, base, lib, ret, params) [CUI_ROW_##elf] = {#elf, #base, NULL, CUI_LIB_##lib, NULL},
#include "hooks.def"
};

/* ---------- real dlsym ---------- */

typedef void *(*cui_dlsym_fn)(void *, const char *);
static cui_dlsym_fn g_real_dlsym;

static void *cui_dlsym_unavailable(void *h, const char *n) { return NULL; }

/* Used by the dlsym entry stub: must not allocate, nor be instrumented (it runs inside a
 * sanitizer runtime's own start-up, e.g. TSan resolving its interceptors through dlsym before
 * its thread state exists). */
CUI_HIDDEN __attribute__((no_sanitize_thread, no_sanitize_address, no_sanitize_undefined)) void *cui_real_dlsym_get(
    void) {
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
__asm__(".text\n"
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

int cui_dlsym_foreign(char *who, size_t cap) {
  void *first = real_dlsym(RTLD_DEFAULT, "dlsym");
  Dl_info mine, theirs;
  if (!first || !dladdr((void *)cui_dlsym_foreign, &mine) || !dladdr(first, &theirs)) return 0;
  if (theirs.dli_fbase == mine.dli_fbase) return 0;
  Dl_info libc;
  if (dladdr((void *)dlvsym, &libc) && libc.dli_fbase == theirs.dli_fbase) return 0;   /* no preload at all */
  if (who && cap) {
    const char *n = theirs.dli_fname ? theirs.dli_fname : "?";
    size_t l = strlen(n) < cap - 1 ? strlen(n) : cap - 1;
    memcpy(who, n, l);
    who[l] = 0;
  }
  return 1;
}

/* ---------- substitution for resolver results ---------- */

int cui_substitute(const char *symbol, void **pfn) {
  if (!symbol || !pfn || !*pfn) return 0;
  int tracked = 0;
  for (int i = 0; i < CUI_ROW_COUNT; i++) {
    const struct cui_hook *hk = &k_hooks[i];
    if (!hk->wrapper || hk->lib != CUI_LIB_CUDA) continue;
    if (strcmp(hk->base, symbol) != 0 && !(hk->alt && strcmp(hk->alt, symbol) == 0)) continue;
    tracked = 1;
    if (*pfn == hk->wrapper) return 0;
    if (*pfn == cui_real((enum cui_row)i)) {
      *pfn = hk->wrapper;
      return 0;
    }
  }
  if (!tracked) return 0;
  Dl_info di;
  if (dladdr(*pfn, &di) && di.dli_saddr == *pfn && di.dli_sname && in_libcuda(*pfn)) {
    const struct cui_hook *hk = hook_by_elf(di.dli_sname, NULL);
    if (hk && hk->lib == CUI_LIB_CUDA && (strcmp(hk->base, symbol) == 0 || (hk->alt && strcmp(hk->alt, symbol) == 0))) {
      *pfn = hk->wrapper;
      return 0;
    }
  }
  return -1;
}

/* ---------- CUresult names ---------- */

const char *cui_cu_error_name(CUresult r) {
  cui_fn_cuGetErrorName real = REAL(cuGetErrorName);
  const char *s = NULL;
  if (real && real(r, &s) == CUDA_SUCCESS && s) return s;
  return cui_cu_error_fallback(r);
}
