/*
 * Runs against tagcuda.c (a driver whose handles carry the shim's tag). Prints one line per call:
 *   <call> <CUresult> 0x<output handle>     (the output is pre-set to 0x99)
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(void) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemGenericAllocationHandle h = 0x99;
  printf("cuInit %d\n", (int)cuInit(0));
  CUresult r = cuMemCreate(&h, 2 << 20, &p, 0);
  printf("cuMemCreate %d 0x%llx\n", (int)r, (unsigned long long)h);
  h = 0x99;
  r = cuMemRetainAllocationHandle(&h, (void *)0x10000);
  printf("cuMemRetainAllocationHandle %d 0x%llx\n", (int)r, (unsigned long long)h);
  h = 0x99;
  int fds[2];
  if (pipe(fds) != 0) return 1;   /* any FD that is not a ticket: a raw import */
  r = cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fds[0], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  printf("cuMemImportFromShareableHandle %d 0x%llx\n", (int)r, (unsigned long long)h);
  return 0;
}
