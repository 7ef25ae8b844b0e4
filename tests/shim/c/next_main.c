/* Linked -lnext_a -lnext_b: prints what libnext_a's dlsym(RTLD_NEXT, "cui_probe_next") found. */
#include <stdio.h>
int probe_from_a(void);
int main(void) {
  printf("%d\n", probe_from_a());
  return 0;
}
