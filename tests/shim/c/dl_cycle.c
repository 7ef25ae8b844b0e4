/*
 * Not linked against libcuda: dlopen("libcuda.so.1"), look up cuInit/cuMemCreate/cuMemRelease,
 * create and release, dlclose; three times. The shim's cached real pointers must stay valid
 * across the application's dlclose (the shim keeps its own reference to libcuda). Prints
 *   round <i> <cuMemCreate result> 0x<handle> <cuMemRelease result> <libcuda still loaded 0|1>
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef CUresult (*init_fn)(unsigned);
typedef CUresult (*create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*release_fn)(CUmemGenericAllocationHandle);

int main(void) {
  for (int i = 0; i < 3; i++) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 2;
    init_fn init = (init_fn)dlsym(lib, "cuInit");
    create_fn create = (create_fn)dlsym(lib, "cuMemCreate");
    release_fn release = (release_fn)dlsym(lib, "cuMemRelease");
    if (!init || !create || !release || init(0) != CUDA_SUCCESS) return 3;
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemGenericAllocationHandle h = 0;
    CUresult rc = create(&h, 2 << 20, &p, 0);
    CUresult rr = release(h);
    dlclose(lib);
    void *still = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    printf("round %d %d 0x%llx %d %d\n", i, (int)rc, (unsigned long long)h, (int)rr, still != NULL);
    if (still) dlclose(still);
  }
  return 0;
}
