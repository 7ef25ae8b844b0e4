/*
 * Test fixture: a tiny libcudart.so.13 that serves cudaGetDriverEntryPoint[ByVersion][_ptsz]
 * the way the real runtime does (docs/shim.md section 1): dlopen("libcuda.so.1", RTLD_NOW)
 * into a local scope, dlsym(h, "cuGetProcAddress_v2") once, then forward every entry-point
 * query to that pointer. cudaError_t and the query-result enum are plain ints here.
 */
#include <dlfcn.h>
#include <stddef.h>

typedef int (*gpa2_fn)(const char *, void **, int, unsigned long long, int *);

#define CUDART_VERSION 13010
#define EXPORT         __attribute__((visibility("default")))

static gpa2_fn resolver(void) {
  static gpa2_fn gpa;
  if (!gpa) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (h) gpa = (gpa2_fn)dlsym(h, "cuGetProcAddress_v2");
  }
  return gpa;
}

static int query(const char *sym, void **fp, int version, unsigned long long flags, int *status) {
  gpa2_fn gpa = resolver();
  if (!gpa) return 35; /* cudaErrorInsufficientDriver */
  int st = 1;
  int r = gpa(sym, fp, version, flags, &st);
  if (status) *status = st;
  return r == 0 ? 0 : 1; /* cudaErrorInvalidValue */
}

EXPORT int cudaGetDriverEntryPoint(const char *s, void **fp, unsigned long long flags, int *st) {
  return query(s, fp, CUDART_VERSION, flags, st);
}
EXPORT int cudaGetDriverEntryPoint_ptsz(const char *s, void **fp, unsigned long long flags, int *st) {
  return query(s, fp, CUDART_VERSION, flags ? flags : 2, st);
}
EXPORT int cudaGetDriverEntryPointByVersion(const char *s, void **fp, unsigned v, unsigned long long flags, int *st) {
  return query(s, fp, (int)v, flags, st);
}
EXPORT int cudaGetDriverEntryPointByVersion_ptsz(const char *s, void **fp, unsigned v, unsigned long long flags,
                                                 int *st) {
  return query(s, fp, (int)v, flags ? flags : 2, st);
}
EXPORT int cudaRuntimeGetVersion(int *v) {
  *v = CUDART_VERSION;
  return 0;
}
