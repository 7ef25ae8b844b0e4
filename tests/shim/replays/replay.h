/*
 * replay.h: shared by the lookup replays (tests/shim/test_replays.py). Each replay makes one
 * stack's exact lookup sequence and prints, per resolved name, one line
 *   fn <name> <library basename of the pointer> <ELF symbol at it> <same>
 * where <same> is 1 when the pointer equals dlsym(RTLD_DEFAULT, <expect>), the function the
 * process binds by ELF name (the shim's export when it is preloaded first), else 0; and per call
 * through a resolved pointer one line
 *   call <name> <CUresult> [values...]
 * The exit status is 0 unless a lookup or a call failed.
 */
#ifndef REPLAY_H
#define REPLAY_H

#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

static int g_failed;

/* Reports where `p` (resolved for `name`) lies and whether it is dlsym(RTLD_DEFAULT, expect). */
static void where(const char *name, const char *expect, void *p) {
  Dl_info di;
  const char *lib = "NULL", *sym = "?";
  if (p && dladdr(p, &di)) {
    lib = di.dli_fname ? (strrchr(di.dli_fname, '/') ? strrchr(di.dli_fname, '/') + 1 : di.dli_fname) : "?";
    if (di.dli_sname && di.dli_saddr == p) sym = di.dli_sname;
  }
  void *want = dlsym(RTLD_DEFAULT, expect);
  printf("fn %s %s %s %d\n", name, lib, sym, p && p == want);
  if (!p) g_failed = 1;
}

static void called(const char *name, CUresult r) {
  printf("call %s %d\n", name, (int)r);
  if (r != CUDA_SUCCESS) g_failed = 1;
}

/* A POSIX-exportable PINNED allocation property on device 0. */
__attribute__((unused)) static CUmemAllocationProp device_prop(void) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  return p;
}

#endif
