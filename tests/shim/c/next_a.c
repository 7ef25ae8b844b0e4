/* libnext_a.so: defines cui_probe_next (returns 1) and asks for the *next* definition after
 * itself with dlsym(RTLD_NEXT, ...), which must be libnext_b.so's (returns 2), whatever the
 * preloaded shim's place in the search order. */
#define _GNU_SOURCE
#include <dlfcn.h>

int cui_probe_next(void) { return 1; }

int probe_from_a(void) {
  int (*next)(void) = (int (*)(void))dlsym(RTLD_NEXT, "cui_probe_next");
  return next ? next() : -1;
}
