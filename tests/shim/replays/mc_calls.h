/*
 * mc_calls.h: the multicast sequence the NCCL and PyTorch replays run through the pointers they
 * resolved (v1 bind ABI: the current context's device, CUDA driver API "Multicast Object
 * Management"): cuInit, primary context of device 0, a one-device object, add device 0, a 2 MiB
 * POSIX allocation, cuMulticastBindMem(mc, 0, mem, 0, 2 MiB, 0), cuMulticastUnbind, releases.
 * Prints "call" lines (replay.h) and "handle <name> 0x<hex>".
 */
#ifndef MC_CALLS_H
#define MC_CALLS_H

#include "replay.h"

enum { F_INIT, F_CREATE, F_RELEASE, F_MC_CREATE, F_MC_ADD, F_MC_BIND, F_MC_UNBIND, F_N };

static void mc_sequence(void *const fn[F_N]) {
  typedef CUresult (*create_t)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
  typedef CUresult (*bind_t)(CUmemGenericAllocationHandle, size_t, CUmemGenericAllocationHandle, size_t, size_t,
                             unsigned long long);
  const size_t size = 2 << 20;
  called("cuInit", ((CUresult (*)(unsigned))fn[F_INIT])(0));
  CUdevice dev;
  CUcontext ctx;
  if (cuDeviceGet(&dev, 0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
      cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
    g_failed = 1;
  CUmulticastObjectProp mp;
  memset(&mp, 0, sizeof mp);
  mp.numDevices = 1;
  mp.size = size;
  mp.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle mc = 0, mem = 0;
  called("cuMulticastCreate",
         ((CUresult (*)(CUmemGenericAllocationHandle *, const CUmulticastObjectProp *))fn[F_MC_CREATE])(&mc, &mp));
  printf("handle cuMulticastCreate 0x%llx\n", (unsigned long long)mc);
  called("cuMulticastAddDevice", ((CUresult (*)(CUmemGenericAllocationHandle, CUdevice))fn[F_MC_ADD])(mc, dev));
  CUmemAllocationProp p = device_prop();
  called("cuMemCreate", ((create_t)fn[F_CREATE])(&mem, size, &p, 0));
  printf("handle cuMemCreate 0x%llx\n", (unsigned long long)mem);
  called("cuMulticastBindMem", ((bind_t)fn[F_MC_BIND])(mc, 0, mem, 0, size, 0));
  called("cuMulticastUnbind",
         ((CUresult (*)(CUmemGenericAllocationHandle, CUdevice, size_t, size_t))fn[F_MC_UNBIND])(mc, dev, 0, size));
  called("cuMemRelease", ((CUresult (*)(CUmemGenericAllocationHandle))fn[F_RELEASE])(mem));
  called("cuMemRelease", ((CUresult (*)(CUmemGenericAllocationHandle))fn[F_RELEASE])(mc));
}

#endif
