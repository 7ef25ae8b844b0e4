/* fcsleeper: a fakecuda process for the CRIU round trip (tests/fakecuda/test_fakecuda_criu.py).
 *
 * usage: fcsleeper OUTDIR. Sets up a POSIX-exportable VMM allocation (exported once, fd
 * closed), a private one, a cuMemAlloc buffer and a stream, fills them with patterns, writes
 * OUTDIR/ready ("<va> <dptr>"), then waits for signals: on SIGUSR1 it re-reads everything
 * through the driver and the host view and writes OUTDIR/check<N> ("ok ..." or "bad ...");
 * SIGTERM exits. stdio must not be a tty (CRIU).
 */
#include <cuda.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char g_dir[512];

static void put(const char *name, const char *text)
{
    char tmp[600], dst[600];
    snprintf(tmp, sizeof tmp, "%s/.%s.tmp", g_dir, name);
    snprintf(dst, sizeof dst, "%s/%s", g_dir, name);
    FILE *f = fopen(tmp, "w");
    if (!f)
        exit(3);
    fputs(text, f);
    fclose(f);
    rename(tmp, dst);
}

#define TRY(call)                                                   \
    do {                                                            \
        CUresult r_ = (call);                                       \
        if (r_ != CUDA_SUCCESS) {                                   \
            char m[256];                                            \
            snprintf(m, sizeof m, "bad %s = %d\n", #call, (int)r_); \
            put("error", m);                                        \
            exit(2);                                                \
        }                                                           \
    } while (0)

int main(int argc, char **argv)
{
    if (argc < 2)
        return 1;
    snprintf(g_dir, sizeof g_dir, "%s", argv[1]);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* before cuInit: driver threads inherit it */

    const size_t G = 2u << 20;
    CUcontext ctx;
    TRY(cuInit(0));
    TRY(cuDevicePrimaryCtxRetain(&ctx, 0));
    TRY(cuCtxSetCurrent(ctx));
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemGenericAllocationHandle hs, hp;
    TRY(cuMemCreate(&hs, G, &p, 0));
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    TRY(cuMemCreate(&hp, 2 * G, &p, 0));
    int fd = -1;
    TRY(cuMemExportToShareableHandle(&fd, hs, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    close(fd);
    CUdeviceptr va, dp;
    TRY(cuMemAddressReserve(&va, 4 * G, 0, 0, 0));
    TRY(cuMemMap(va, G, 0, hs, 0));
    TRY(cuMemMap(va + 2 * G, 2 * G, 0, hp, 0));
    CUmemAccessDesc a;
    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    TRY(cuMemSetAccess(va, G, &a, 1));
    TRY(cuMemSetAccess(va + 2 * G, 2 * G, &a, 1));
    TRY(cuMemsetD32(va, 0xC0FFEE01u, G / 4));
    TRY(cuMemsetD32(va + 2 * G, 0xC0FFEE02u, G / 2));
    TRY(cuMemAlloc(&dp, 4096));
    TRY(cuMemsetD32(dp, 0xC0FFEE03u, 1024));
    CUstream s;
    TRY(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    TRY(cuStreamWriteValue32(s, va + 4 * 100, 7, 0));
    TRY(cuStreamSynchronize(s));
    char buf[256];
    snprintf(buf, sizeof buf, "%llu %llu\n", (unsigned long long)va, (unsigned long long)dp);
    put("ready", buf);

    for (int n = 0;; n++) {
        int sig = 0;
        sigwait(&set, &sig);
        if (sig == SIGTERM)
            return 0;
        uint32_t v[4] = {0};
        CUresult r1 = cuMemcpyDtoH(&v[0], va + G - 4, 4);
        CUresult r2 = cuMemcpyDtoH(&v[1], va + 4 * G - 4, 4);
        CUresult r3 = cuMemcpyDtoH(&v[2], dp + 4092, 4);
        CUresult r4 = cuStreamWaitValue32(s, va + 4 * 100, 7, CU_STREAM_WAIT_VALUE_EQ);
        CUresult r5 = cuStreamSynchronize(s);
        v[3] = *(volatile uint32_t *)(uintptr_t)(va + 4 * 100);
        CUmemGenericAllocationHandle h = 99;
        CUresult r6 = cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)(va + 2 * G));
        int good = !r1 && !r2 && !r3 && !r4 && !r5 && !r6 && v[0] == 0xC0FFEE01u && v[1] == 0xC0FFEE02u &&
                   v[2] == 0xC0FFEE03u && v[3] == 7 && h == hp;
        snprintf(buf, sizeof buf, "%s %d %d %d %d %d %d %x %x %x %u %llu\n", good ? "ok" : "bad", r1, r2, r3, r4, r5,
                 r6, v[0], v[1], v[2], v[3], (unsigned long long)h);
        if (!r6)
            cuMemRelease(h);
        char name[32];
        snprintf(name, sizeof name, "check%d", n);
        put(name, buf);
    }
}
