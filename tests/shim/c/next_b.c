/* libnext_b.so: the next definition of cui_probe_next after libnext_a.so. */
int cui_probe_next(void) { return 2; }
