/* libother_dlsym.so (case 005): another dlsym interposer, as profilers write one: it overrides
 * dlsym and forwards every lookup to glibc's through dlvsym(RTLD_NEXT, "dlsym", ...). */
#define _GNU_SOURCE
#include <dlfcn.h>

typedef void *(*dlsym_fn)(void *, const char *);

void *dlsym(void *handle, const char *name) {
  static dlsym_fn real;
  if (!real) real = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
  if (!real) real = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  return real ? real(handle, name) : 0;
}
