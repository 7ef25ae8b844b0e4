/* fc_unit: single-process strictness checks for fakecuda, with exact CUresult codes.
 *
 * Built twice by tests/fakecuda/test_fakecuda_unit.py: linked against the installed libcuda.so.1, and
 * compiled together with fakecuda's sources under ASan/UBSan. usage: fc_unit GRANULARITY NDEV
 * Prints "FAIL <line>: ..." per failed check and "fc_unit: <checks> checks, <fails> failures".
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Other ELF spellings, bound by symbol name (cuda.h macros map the source names to _v2). */
CUresult v1_cuMemGetAddressRange(unsigned int *pbase, unsigned int *psize,
                                 unsigned int dptr) __asm__("cuMemGetAddressRange");
CUresult v1_cuStreamWaitValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                                unsigned int flags) __asm__("cuStreamWaitValue32");
CUresult ptsz_cuStreamWaitValue32_v2(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                                     unsigned int flags) __asm__("cuStreamWaitValue32_v2_ptsz");
CUresult ptds_cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost,
                              size_t ByteCount) __asm__("cuMemcpyHtoD_v2_ptds");
CUresult legacy_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                 cuuint64_t flags) __asm__("cuGetProcAddress");

static int g_checks, g_fails;

static const char *nm(CUresult r)
{
    const char *s = NULL;
    if (cuGetErrorName(r, &s) != CUDA_SUCCESS || !s)
        return "?";
    return s;
}

#define EXPECT(call, code)                                                                \
    do {                                                                                  \
        CUresult r_ = (call);                                                             \
        g_checks++;                                                                       \
        if (r_ != (code)) {                                                               \
            g_fails++;                                                                    \
            printf("FAIL %d: %s = %s, expected %s\n", __LINE__, #call, nm(r_), nm(code)); \
        }                                                                                 \
    } while (0)

#define CHECK(cond)                                   \
    do {                                              \
        g_checks++;                                   \
        if (!(cond)) {                                \
            g_fails++;                                \
            printf("FAIL %d: %s\n", __LINE__, #cond); \
        }                                             \
    } while (0)

static size_t G;
static int NDEV;

static CUmemAllocationProp prop(int dev, int types)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    p.requestedHandleTypes = (CUmemAllocationHandleType)types;
    return p;
}

static CUmemAccessDesc acc(int dev, int flags)
{
    CUmemAccessDesc d;
    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = dev;
    d.flags = (CUmemAccess_flags)flags;
    return d;
}

static int count_fakecuda_memfds(void)
{
    int n = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f))
        if (strstr(line, "memfd:fakecuda-"))
            n++;
    if (f)
        fclose(f);
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char p[64], t[256];
        snprintf(p, sizeof p, "/proc/self/fd/%s", e->d_name);
        ssize_t k = readlink(p, t, sizeof t - 1);
        if (k > 0) {
            t[k] = 0;
            if (strstr(t, "memfd:fakecuda-"))
                n++;
        }
    }
    if (d)
        closedir(d);
    return n;
}

/* the permissions column of the /proc/self/maps line that contains va ("" if none) */
static void maps_perms(uintptr_t va, char out[5])
{
    out[0] = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char perms[5];
        if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) == 3 && va >= lo && va < hi) {
            memcpy(out, perms, 5);
            break;
        }
    }
    if (f)
        fclose(f);
}

static void before_init(void)
{
    int n = -1, v = 0;
    CUmemGenericAllocationHandle h;
    CUmemAllocationProp p = prop(0, 1);
    CUprocessState st;
    EXPECT(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    EXPECT(cuMemCreate(&h, G, &p, 0), CUDA_ERROR_NOT_INITIALIZED);
    EXPECT(cuCheckpointProcessGetState(getpid(), &st), CUDA_ERROR_NOT_INITIALIZED);
    EXPECT(cuStreamSynchronize(NULL), CUDA_ERROR_NOT_INITIALIZED);
    EXPECT(cuDriverGetVersion(&v), CUDA_SUCCESS);
    CHECK(v == 13050);
    EXPECT(cuInit(1), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuInit(0), CUDA_SUCCESS);
    EXPECT(cuInit(0), CUDA_SUCCESS);
}

static void devices(void)
{
    int n = 0, v = -1;
    CUdevice d;
    char name[64];
    CUuuid u0, u1;
    size_t mem = 0;
    EXPECT(cuDeviceGetCount(&n), CUDA_SUCCESS);
    CHECK(n == NDEV);
    EXPECT(cuDeviceGet(&d, NDEV), CUDA_ERROR_INVALID_DEVICE);
    EXPECT(cuDeviceGet(&d, 1), CUDA_SUCCESS);
    CHECK(d == 1);
    EXPECT(cuDeviceGetName(name, sizeof name, 0), CUDA_SUCCESS);
    CHECK(strcmp(name, "fakecuda GPU") == 0); /* one model, one name */
    EXPECT(cuDeviceGetUuid(&u0, 0), CUDA_SUCCESS);
    EXPECT(cuDeviceGetUuid(&u1, 1), CUDA_SUCCESS);
    CHECK(memcmp(&u0, &u1, sizeof u0) != 0);
    EXPECT(cuDeviceTotalMem(&mem, 0), CUDA_SUCCESS);
    CHECK(mem == (16ull << 30));
    static const struct {
        int attr, val;
    } want[] = {{102, 1}, {103, 1}, {110, 1}, {128, 0}, {132, 1}, {122, 1}, {123, 1}, {98, 0}, {75, 9}, {76, 0}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        EXPECT(cuDeviceGetAttribute(&v, (CUdevice_attribute)want[i].attr, 0), CUDA_SUCCESS);
        CHECK(v == want[i].val);
    }
    /* each GPU on its own PCI bus (1 + its UUID id), domain 0, device 0; GPUDirect RDMA 1 */
    for (int k = 0; k < 2; k++) {
        EXPECT(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, k), CUDA_SUCCESS);
        CHECK(v == 1 + k);
        EXPECT(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, k), CUDA_SUCCESS);
        CHECK(v == 0);
        EXPECT(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, k), CUDA_SUCCESS);
        CHECK(v == 0);
        EXPECT(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, k), CUDA_SUCCESS);
        CHECK(v == 1);
    }
    EXPECT(cuDeviceGetAttribute(&v, (CUdevice_attribute)0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_WARP_SIZE, NDEV), CUDA_ERROR_INVALID_DEVICE);
}

static CUcontext g_ctx;

static void contexts(void)
{
    CUcontext c = (CUcontext)1, c2;
    CUdevice d;
    EXPECT(cuCtxGetCurrent(&c), CUDA_SUCCESS);
    CHECK(c == NULL);
    EXPECT(cuCtxGetDevice(&d), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT(cuCtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT);
    CUdeviceptr p;
    EXPECT(cuMemAlloc(&p, 64), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT(cuDevicePrimaryCtxRelease(0), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT(cuDevicePrimaryCtxRetain(&g_ctx, 0), CUDA_SUCCESS);
    EXPECT(cuDevicePrimaryCtxRetain(&c2, 0), CUDA_SUCCESS);
    CHECK(c2 == g_ctx);
    EXPECT(cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);
    EXPECT(cuCtxSetCurrent((CUcontext)&p), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT(cuCtxSetCurrent(g_ctx), CUDA_SUCCESS);
    EXPECT(cuCtxGetDevice(&d), CUDA_SUCCESS);
    CHECK(d == 0);
    EXPECT(cuCtxSynchronize(), CUDA_SUCCESS);
}

static void vmm_create_reserve(void)
{
    size_t g = 0;
    CUmemAllocationProp p = prop(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    EXPECT(cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_SUCCESS);
    CHECK(g == G);
    EXPECT(cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), CUDA_SUCCESS);
    CHECK(g == G);
    EXPECT(cuMemGetAllocationGranularity(&g, &p, (CUmemAllocationGranularity_flags)2), CUDA_ERROR_INVALID_VALUE);

    CUmemGenericAllocationHandle h = 77;
    EXPECT(cuMemCreate(&h, G / 2, &p, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemCreate(&h, G + G / 2, &p, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemCreate(&h, 0, &p, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemCreate(&h, G, &p, 1), CUDA_ERROR_INVALID_VALUE);
    CUmemAllocationProp pf = prop(0, CU_MEM_HANDLE_TYPE_FABRIC);
    EXPECT(cuMemCreate(&h, G, &pf, 0), CUDA_ERROR_NOT_SUPPORTED);
    CUmemAllocationProp pbad = prop(NDEV, 0);
    EXPECT(cuMemCreate(&h, G, &pbad, 0), CUDA_ERROR_INVALID_DEVICE);
    CHECK(h == 77); /* outputs untouched on failure */

    CUdeviceptr va = 0, va2 = 0, hint;
    EXPECT(cuMemAddressReserve(&va, 4 * G, 0, 0, 0), CUDA_SUCCESS);
    CHECK(va != 0 && va % G == 0);
    EXPECT(cuMemAddressReserve(&va2, 4096 + 1, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAddressReserve(&va2, G, 3 * G, 0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAddressReserve(&va2, G, 0, 0, 1), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAddressReserve(&va2, G, 16 * G, 0, 0), CUDA_SUCCESS);
    CHECK(va2 % (16 * G) == 0);
    EXPECT(cuMemAddressFree(va2, G), CUDA_SUCCESS);
    /* a free hint is honoured; a hint over an existing reservation is placed elsewhere */
    hint = va2;
    EXPECT(cuMemAddressReserve(&va2, G, 0, hint, 0), CUDA_SUCCESS);
    CHECK(va2 == hint);
    CUdeviceptr va3 = 0;
    EXPECT(cuMemAddressReserve(&va3, G, 0, hint, 0), CUDA_SUCCESS);
    CHECK(va3 != hint && va3 != 0);
    EXPECT(cuMemAddressFree(va3, G), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(va2, 2 * G), CUDA_ERROR_INVALID_VALUE); /* not the original range */
    EXPECT(cuMemAddressFree(va2 + G / 2, G / 2), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAddressFree(va2, G), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(va2, G), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAddressFree(va, 4 * G), CUDA_SUCCESS);
}

/* Handles are numbered from 0 in each process: the first successful cuMemCreate gets 0. */
static void vmm_map_access_release(void)
{
    CUmemAllocationProp p = prop(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h0 = 99, h1 = 99, r = 99;
    EXPECT(cuMemCreate(&h0, 2 * G, &p, 0), CUDA_SUCCESS);
    CHECK(h0 == 0);
    EXPECT(cuMemCreate(&h1, G, &p, 0), CUDA_SUCCESS);
    CHECK(h1 == 1);
    CUdeviceptr va = 0;
    EXPECT(cuMemAddressReserve(&va, 4 * G, 0, 0, 0), CUDA_SUCCESS);

    /* cuMemMap strictness */
    EXPECT(cuMemMap(va + 4096, G, 0, h0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemMap(va, G + 4096, 0, h0, 0), CUDA_ERROR_INVALID_VALUE);
    /* an allocation maps from offset 0 only, aligned or not (R580: NOT_SUPPORTED) */
    EXPECT(cuMemMap(va, G, 4096, h0, 0), CUDA_ERROR_NOT_SUPPORTED);
    EXPECT(cuMemMap(va, 2 * G, G, h0, 0), CUDA_ERROR_NOT_SUPPORTED);
    EXPECT(cuMemMap(va + 3 * G, 2 * G, 0, h0, 0), CUDA_ERROR_INVALID_VALUE); /* past the reservation */
    EXPECT(cuMemMap(va, G, 0, h0, 1), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemMap(va, G, 0, 12345, 0), CUDA_ERROR_INVALID_VALUE);
    void *host = mmap(NULL, 2 * G, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uintptr_t outside = ((uintptr_t)host + G - 1) & ~(uintptr_t)(G - 1);
    EXPECT(cuMemMap((CUdeviceptr)outside, G, 0, h1, 0), CUDA_ERROR_INVALID_VALUE); /* not reserved */
    EXPECT(cuMemMap(va, 2 * G, 0, h0, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(va + G, G, 0, h1, 0), CUDA_ERROR_INVALID_VALUE); /* over a mapping */
    EXPECT(cuMemMap(va + 2 * G, G, 0, h1, 0), CUDA_SUCCESS);

    /* no access yet: copies fault, GetAccess says PROT_NONE */
    uint32_t w = 0xdeadbeef, rd = 0;
    unsigned long long fl = 9;
    CUmemLocation loc0 = {CU_MEM_LOCATION_TYPE_DEVICE, 0}, loc1 = {CU_MEM_LOCATION_TYPE_DEVICE, 1};
    EXPECT(cuMemGetAccess(&fl, &loc0, va), CUDA_SUCCESS);
    CHECK(fl == 0);
    EXPECT(cuMemcpyHtoD(va, &w, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT(cuMemcpyDtoH(&rd, va, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT(cuMemsetD32(va, 1, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
    CUmemAccessDesc a0rw = acc(0, 3), a1rw = acc(1, 3), a0r = acc(0, 1);
    EXPECT(cuMemSetAccess(va, 4 * G, &a0rw, 1), CUDA_ERROR_INVALID_VALUE); /* va+3G unmapped */
    EXPECT(cuMemSetAccess(va + 4096, G, &a0rw, 1), CUDA_ERROR_INVALID_VALUE);
    CUmemAccessDesc bad = acc(0, 2);
    EXPECT(cuMemSetAccess(va, G, &bad, 1), CUDA_ERROR_INVALID_VALUE);
    /* access for device 1 only: a copy from a device-0 context still faults */
    EXPECT(cuMemSetAccess(va, 3 * G, &a1rw, 1), CUDA_SUCCESS);
    EXPECT(cuMemcpyHtoD(va, &w, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
    /* read-only for device 0: reads work, writes fault */
    EXPECT(cuMemSetAccess(va, 3 * G, &a0r, 1), CUDA_SUCCESS);
    EXPECT(cuMemcpyDtoH(&rd, va, 4), CUDA_SUCCESS);
    CHECK(rd == 0);
    EXPECT(cuMemcpyHtoD(va, &w, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT(cuMemSetAccess(va, 3 * G, &a0rw, 1), CUDA_SUCCESS);
    EXPECT(cuMemGetAccess(&fl, &loc0, va + G), CUDA_SUCCESS);
    CHECK(fl == 3);
    EXPECT(cuMemGetAccess(&fl, &loc1, va + 2 * G), CUDA_SUCCESS); /* union across calls */
    CHECK(fl == 3);
    EXPECT(cuMemGetAccess(&fl, &loc0, va + 3 * G), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemcpyHtoD(va + 2 * G - 4, &w, 4), CUDA_SUCCESS);
    EXPECT(cuMemcpyHtoD(va + 3 * G - 2, &w, 4), CUDA_ERROR_ILLEGAL_ADDRESS); /* runs into unmapped VA */
    EXPECT(cuMemcpyDtoH(&rd, va + 2 * G - 4, 4), CUDA_SUCCESS);
    CHECK(rd == 0xdeadbeef);
    CHECK(*(volatile uint32_t *)(uintptr_t)(va + 2 * G - 4) == 0xdeadbeef); /* host view */
    EXPECT(cuMemsetD8(va + 16, 0xab, 4), CUDA_SUCCESS);
    EXPECT(cuMemcpyDtoD(va + 2 * G, va + 16, 4), CUDA_SUCCESS);
    EXPECT(cuMemcpy((CUdeviceptr)(uintptr_t)&rd, va + 2 * G, 4), CUDA_SUCCESS);
    CHECK(rd == 0xabababab);
    EXPECT(cuMemcpyHtoD((CUdeviceptr)outside, &w, 4), CUDA_ERROR_INVALID_VALUE); /* not device memory */

    /* address range = the single mapping; retain = the mapped handle value */
    CUdeviceptr base = 0;
    size_t size = 0;
    EXPECT(cuMemGetAddressRange(&base, &size, va + G + 100), CUDA_SUCCESS);
    CHECK(base == va && size == 2 * G);
    EXPECT(cuMemGetAddressRange(&base, &size, va + 2 * G + 1), CUDA_SUCCESS);
    CHECK(base == va + 2 * G && size == G);
    EXPECT(cuMemGetAddressRange(&base, &size, va + 3 * G), CUDA_ERROR_NOT_FOUND);
    EXPECT(cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)(va + G + 5)), CUDA_SUCCESS);
    CHECK(r == h0);
    EXPECT(cuMemRelease(r), CUDA_SUCCESS);
    EXPECT(cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)(va + 3 * G)), CUDA_ERROR_INVALID_VALUE);

    /* unmap strictness */
    EXPECT(cuMemUnmap(va, G), CUDA_ERROR_INVALID_VALUE);           /* half of a mapping */
    EXPECT(cuMemUnmap(va + 3 * G, G), CUDA_ERROR_INVALID_VALUE);   /* nothing mapped */
    EXPECT(cuMemUnmap(va + 4096, G), CUDA_ERROR_INVALID_VALUE);

    /* release while mapped keeps the bytes alive until the last unmap */
    EXPECT(cuMemRelease(h0), CUDA_SUCCESS);
    EXPECT(cuMemRelease(h0), CUDA_ERROR_INVALID_VALUE); /* double release */
    EXPECT(cuMemRelease(424242), CUDA_ERROR_INVALID_VALUE); /* never issued */
    EXPECT(cuMemMap(va + 3 * G, G, 0, h0, 0), CUDA_ERROR_INVALID_VALUE); /* stale handle */
    rd = 0;
    EXPECT(cuMemcpyDtoH(&rd, va + 2 * G - 4, 4), CUDA_SUCCESS);
    CHECK(rd == 0xdeadbeef);
    CHECK(*(volatile uint32_t *)(uintptr_t)(va + 16) == 0xabababab);
    /* retain through the mapping brings the released value back */
    EXPECT(cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)va), CUDA_SUCCESS);
    CHECK(r == h0);
    CUmemAllocationProp got;
    EXPECT(cuMemGetAllocationPropertiesFromHandle(&got, h0), CUDA_SUCCESS);
    CHECK(got.requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && got.location.id == 0);
    EXPECT(cuMemRelease(h0), CUDA_SUCCESS);
    EXPECT(cuMemUnmap(va, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemcpyDtoH(&rd, va, 4), CUDA_ERROR_INVALID_VALUE); /* reserved, unmapped (R580) */
    EXPECT(cuMemGetAllocationPropertiesFromHandle(&got, h0), CUDA_ERROR_INVALID_VALUE);
    /* re-map at the same VA: access must be set again */
    CUmemGenericAllocationHandle h2 = 0;
    EXPECT(cuMemCreate(&h2, 2 * G, &p, 0), CUDA_SUCCESS);
    CHECK(h2 == 2);
    EXPECT(cuMemMap(va, 2 * G, 0, h2, 0), CUDA_SUCCESS);
    EXPECT(cuMemGetAccess(&fl, &loc0, va), CUDA_SUCCESS);
    CHECK(fl == 0);
    EXPECT(cuMemcpyDtoH(&rd, va, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT(cuMemAddressFree(va, 4 * G), CUDA_ERROR_INVALID_VALUE); /* still mapped */
    EXPECT(cuMemUnmap(va, 4 * G), CUDA_SUCCESS); /* both mappings, whole */
    EXPECT(cuMemRelease(h2), CUDA_SUCCESS);
    EXPECT(cuMemRelease(h1), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(va, 4 * G), CUDA_SUCCESS);
    munmap(host, 2 * G);
}

static void vmm_export_import(void)
{
    CUmemAllocationProp pn = prop(0, 0), pp = prop(1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle hn, hp, i1 = 0, i2 = 0;
    int fd = -7, fd2 = -7;
    EXPECT(cuMemCreate(&hn, G, &pn, 0), CUDA_SUCCESS);
    EXPECT(cuMemExportToShareableHandle(&fd, hn, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
           CUDA_ERROR_INVALID_VALUE);
    CHECK(fd == -7);
    EXPECT(cuMemCreate(&hp, G, &pp, 0), CUDA_SUCCESS);
    EXPECT(cuMemExportToShareableHandle(&fd, hp, CU_MEM_HANDLE_TYPE_FABRIC, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemExportToShareableHandle(&fd, hp, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1),
           CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemExportToShareableHandle(&fd, hp, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_SUCCESS);
    EXPECT(cuMemExportToShareableHandle(&fd2, hp, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_SUCCESS);
    struct stat s1, s2;
    CHECK(fd >= 0 && fd2 >= 0 && fd != fd2);
    CHECK(fstat(fd, &s1) == 0 && fstat(fd2, &s2) == 0 && s1.st_ino == s2.st_ino);
    /* every import is a new handle value with its own reference */
    EXPECT(cuMemImportFromShareableHandle(&i1, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           CUDA_SUCCESS);
    EXPECT(cuMemImportFromShareableHandle(&i2, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           CUDA_SUCCESS);
    CHECK(i1 != hp && i2 != hp && i1 != i2);
    CUmemAllocationProp got;
    memset(&got, 0, sizeof got);
    EXPECT(cuMemGetAllocationPropertiesFromHandle(&got, i2), CUDA_SUCCESS);
    /* an import reports no requested handle types, as the real driver does (R580) */
    CHECK(got.location.id == 1 && got.requestedHandleTypes == CU_MEM_HANDLE_TYPE_NONE &&
          got.type == CU_MEM_ALLOCATION_TYPE_PINNED);
    EXPECT(cuMemImportFromShareableHandle(&i1, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_FABRIC),
           CUDA_ERROR_NOT_SUPPORTED);
    int plain = memfd_create("not-fakecuda", 0);
    CHECK(ftruncate(plain, 3 * 4096) == 0);
    CUmemGenericAllocationHandle keep = i1;
    EXPECT(cuMemImportFromShareableHandle(&i1, (void *)(uintptr_t)plain, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           CUDA_ERROR_UNKNOWN); /* not a driver FD: the real driver's answer (R580) */
    EXPECT(cuMemImportFromShareableHandle(&i1, (void *)(uintptr_t)-1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           CUDA_ERROR_UNKNOWN); /* a bad descriptor: the real driver's answer (R580) */
    CHECK(i1 == keep);
    close(plain);
    /* the imported handle maps the same bytes as the creator's, through another VA */
    CUdeviceptr va = 0;
    CUmemAccessDesc a = acc(0, 3);
    EXPECT(cuMemAddressReserve(&va, 2 * G, 0, 0, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(va, G, 0, hp, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(va + G, G, 0, i1, 0), CUDA_SUCCESS);
    EXPECT(cuMemSetAccess(va, 2 * G, &a, 1), CUDA_SUCCESS);
    uint32_t w = 0x5151, rd = 0;
    EXPECT(cuMemcpyHtoD(va + 40, &w, 4), CUDA_SUCCESS);
    EXPECT(cuMemcpyDtoH(&rd, va + G + 40, 4), CUDA_SUCCESS);
    CHECK(rd == 0x5151);
    CUmemGenericAllocationHandle r;
    EXPECT(cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)(va + G)), CUDA_SUCCESS);
    CHECK(r == i1);
    EXPECT(cuMemRelease(r), CUDA_SUCCESS);
    EXPECT(cuMemUnmap(va, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(va, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(i1), CUDA_SUCCESS);
    EXPECT(cuMemRelease(i2), CUDA_SUCCESS);
    EXPECT(cuMemRelease(i2), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemRelease(hp), CUDA_SUCCESS);
    EXPECT(cuMemRelease(hn), CUDA_SUCCESS);
    close(fd);
    close(fd2);
}

struct waiter {
    CUstream s;
    volatile int done;
    CUresult r;
};

static void *sync_thread(void *arg)
{
    struct waiter *w = arg;
    w->r = cuStreamSynchronize(w->s);
    w->done = 1;
    return NULL;
}

static void streams_and_memops(void)
{
    CUmemAllocationProp p = prop(0, 0);
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    CUmemAccessDesc a = acc(0, 3);
    EXPECT(cuMemCreate(&h, G, &p, 0), CUDA_SUCCESS);
    EXPECT(cuMemAddressReserve(&va, 2 * G, 0, 0, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(va, G, 0, h, 0), CUDA_SUCCESS);
    EXPECT(cuMemSetAccess(va, G, &a, 1), CUDA_SUCCESS);
    EXPECT(cuMemsetD32(va, 0, G / 4), CUDA_SUCCESS);

    CUstream s1, s2;
    EXPECT(cuStreamCreate(&s1, 2), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    EXPECT(cuStreamCreate(&s2, CU_STREAM_DEFAULT), CUDA_SUCCESS);
    EXPECT(cuStreamWaitValue32(s1, va + 2, 1, 0), CUDA_ERROR_INVALID_VALUE); /* misaligned */
    EXPECT(cuStreamWaitValue32(s1, va, 1, 7), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWriteValue32(s1, va, 1, 1), CUDA_ERROR_INVALID_VALUE); /* NO_MEMORY_BARRIER: v1 only */

    /* the wait blocks the stream, not the caller; ops behind it stay queued */
    uint32_t out = 0;
    EXPECT(cuStreamWaitValue32(s1, va, 5, CU_STREAM_WAIT_VALUE_GEQ), CUDA_SUCCESS);
    EXPECT(cuMemcpyDtoHAsync(&out, va + 4, 4, s1), CUDA_SUCCESS);
    EXPECT(cuStreamQuery(s1), CUDA_ERROR_NOT_READY);
    struct waiter w = {s1, 0, CUDA_ERROR_UNKNOWN};
    pthread_t t;
    pthread_create(&t, NULL, sync_thread, &w);
    EXPECT(cuStreamWriteValue32(s2, va + 4, 0x77, 0), CUDA_SUCCESS);
    EXPECT(cuStreamWriteValue32(s2, va, 4, 0), CUDA_SUCCESS); /* 4 < 5: still waiting */
    EXPECT(cuStreamSynchronize(s2), CUDA_SUCCESS);
    CHECK(w.done == 0);
    EXPECT(cuStreamQuery(s1), CUDA_ERROR_NOT_READY);
    EXPECT(cuStreamWriteValue32(s2, va, 6, 0), CUDA_SUCCESS);
    pthread_join(t, NULL);
    CHECK(w.done == 1 && w.r == CUDA_SUCCESS);
    CHECK(out == 0x77);
    EXPECT(cuStreamQuery(s1), CUDA_SUCCESS);

    /* GEQ is cyclic: 5 >= 0xfffffffe (wrapped) */
    EXPECT(cuStreamWaitValue32(s1, va, 0xfffffffeu, CU_STREAM_WAIT_VALUE_GEQ), CUDA_SUCCESS);
    uint32_t five = 5;
    EXPECT(cuMemcpyHtoD(va, &five, 4), CUDA_SUCCESS);
    EXPECT(cuStreamSynchronize(s1), CUDA_SUCCESS);
    /* EQ, AND, NOR; the v1 ABI and the _ptsz twin behave the same */
    EXPECT(cuStreamWaitValue32(s1, va, 5, CU_STREAM_WAIT_VALUE_EQ), CUDA_SUCCESS);
    EXPECT(ptsz_cuStreamWaitValue32_v2(s1, va, 4, CU_STREAM_WAIT_VALUE_AND), CUDA_SUCCESS);
    EXPECT(cuStreamSynchronize(s1), CUDA_SUCCESS);
    EXPECT(v1_cuStreamWaitValue32(s1, va, ~5u, CU_STREAM_WAIT_VALUE_NOR), CUDA_SUCCESS); /* ~(5|~5)=0: blocks */
    EXPECT(cuStreamQuery(s1), CUDA_ERROR_NOT_READY);
    EXPECT(cuStreamWriteValue32(s2, va, 1, 0), CUDA_SUCCESS); /* ~(1|~5) = 4: done */
    EXPECT(cuStreamSynchronize(s1), CUDA_SUCCESS);
    uint64_t v64 = 0;
    EXPECT(cuStreamWriteValue64(s2, va + 8, 0x1122334455667788ull, 0), CUDA_SUCCESS);
    EXPECT(cuStreamWaitValue64(s1, va + 8, 0x1122334455667788ull, CU_STREAM_WAIT_VALUE_EQ), CUDA_SUCCESS);
    EXPECT(cuMemcpyDtoHAsync(&v64, va + 8, 8, s1), CUDA_SUCCESS);
    EXPECT(cuCtxSynchronize(), CUDA_SUCCESS);
    CHECK(v64 == 0x1122334455667788ull);
    EXPECT(cuMemsetD8Async(va + 64, 0x3c, 8, NULL), CUDA_SUCCESS); /* NULL stream = context default */
    EXPECT(cuMemcpyAsync((CUdeviceptr)(uintptr_t)&v64, va + 64, 8, CU_STREAM_PER_THREAD), CUDA_SUCCESS);
    EXPECT(cuStreamSynchronize(CU_STREAM_LEGACY), CUDA_SUCCESS);
    CHECK(v64 == 0x3c3c3c3c3c3c3c3cull);
    EXPECT(cuStreamDestroy(s2), CUDA_SUCCESS);
    EXPECT(cuStreamSynchronize(s2), CUDA_ERROR_INVALID_HANDLE);

    /* an asynchronous fault is sticky for its context (a separate one, on device 1) */
    CUcontext c1, prev;
    CUstream s3;
    EXPECT(cuCtxCreate(&c1, NULL, 0, 1), CUDA_SUCCESS);
    EXPECT(cuStreamCreate(&s3, 0), CUDA_SUCCESS);
    EXPECT(cuMemcpyHtoDAsync(va, &five, 4, s3), CUDA_SUCCESS); /* device 1 has no access */
    EXPECT(cuStreamSynchronize(s3), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT(cuCtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT(cuStreamWaitValue32(s3, va, 0, 0), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT(cuMemcpyHtoD(va, &five, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT(cuCtxPopCurrent(&prev), CUDA_SUCCESS);
    CHECK(prev == c1);
    CUcontext cur;
    EXPECT(cuCtxGetCurrent(&cur), CUDA_SUCCESS);
    CHECK(cur == g_ctx);
    EXPECT(cuCtxSynchronize(), CUDA_SUCCESS); /* the primary context is unaffected */
    EXPECT(cuCtxDestroy(c1), CUDA_SUCCESS);
    EXPECT(cuStreamWriteValue32(s1, va + 2 * G, 1, 0), CUDA_ERROR_INVALID_VALUE); /* not device memory */
    /* a memop on an unmapped VA inside a reservation faults when it runs (fresh context) */
    CUcontext c2;
    CUstream s4;
    EXPECT(cuCtxCreate(&c2, NULL, 0, 0), CUDA_SUCCESS);
    EXPECT(cuStreamCreate(&s4, 0), CUDA_SUCCESS);
    EXPECT(cuStreamWriteValue32(s4, va + G + 8, 1, 0), CUDA_SUCCESS);
    EXPECT(cuStreamSynchronize(s4), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT(cuCtxDestroy(c2), CUDA_SUCCESS);
    EXPECT(cuCtxSetCurrent(g_ctx), CUDA_SUCCESS);
    EXPECT(cuCtxSynchronize(), CUDA_SUCCESS);

    EXPECT(cuMemUnmap(va, G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(h), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(va, 2 * G), CUDA_SUCCESS);
}

static void procaddr(void)
{
    void *fn = (void *)1;
    CUdriverProcAddressQueryResult st = (CUdriverProcAddressQueryResult)9;
    struct {
        const char *sym;
        int ver;
        unsigned long long flags;
        void *want;
        int status;
    } cases[] = {
        {"cuMemGetAddressRange", 3000, 0, (void *)v1_cuMemGetAddressRange, 0},
        {"cuMemGetAddressRange", 3020, 0, (void *)cuMemGetAddressRange_v2, 0},
        {"cuMemGetAddressRange", 13010, 0, (void *)cuMemGetAddressRange_v2, 0},
        {"cuStreamWaitValue32", 11070, 0, (void *)cuStreamWaitValue32_v2, 0},
        {"cuStreamWaitValue32", 8000, 0, (void *)v1_cuStreamWaitValue32, 0},
        {"cuStreamWaitValue32", 7000, 0, NULL, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
        {"cuStreamWaitValue32", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
         (void *)ptsz_cuStreamWaitValue32_v2, 0},
        {"cuMemAlloc", 3020, 0, (void *)cuMemAlloc_v2, 0},
        {"cuMemAlloc", 3010, 0, NULL, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
        {"cuMemcpyHtoD", 7000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, (void *)ptds_cuMemcpyHtoD_v2, 0},
        {"cuMemcpyHtoD", 7000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, (void *)cuMemcpyHtoD_v2, 0},
        {"cuMemCreate", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, (void *)cuMemCreate, 0},
        {"cuMemCreate", 10010, 0, NULL, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
        {"cuGetProcAddress", 11030, 0, (void *)legacy_cuGetProcAddress, 0},
        {"cuGetProcAddress", 12000, 0, (void *)cuGetProcAddress_v2, 0},
        {"cuCheckpointProcessLock", 12080, 0, (void *)cuCheckpointProcessLock, 0},
        {"cuMulticastCreate", 12010, 0, (void *)cuMulticastCreate, 0},
        {"cuMulticastCreate", 12000, 0, NULL, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
        {"cuMulticastBindMem", 13010, 0, (void *)cuMulticastBindMem, 0},
        {"cuMulticastBindAddr", 12010, 0, (void *)cuMulticastBindAddr, 0},
        {"cuMulticastUnbind", 12010, 0, (void *)cuMulticastUnbind, 0},
        {"cuMulticastAddDevice", 12010, 0, (void *)cuMulticastAddDevice, 0},
        {"cuMulticastGetGranularity", 12010, 0, (void *)cuMulticastGetGranularity, 0},
        {"cuMulticastBindMem_v2", 13010, 0, (void *)cuMulticastBindMem_v2, 0},
        {"cuMulticastBindMem_v2", 13000, 0, NULL, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
        {"cuMulticastBindAddr_v2", 13010, 0, (void *)cuMulticastBindAddr_v2, 0},
        {"cuNoSuchFunction", 12000, 0, NULL, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND},
        {"cuMemCreate_v2", 12000, 0, NULL, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND},
        {"", 0, 0, NULL, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fn = (void *)1;
        st = (CUdriverProcAddressQueryResult)9;
        EXPECT(cuGetProcAddress_v2(cases[i].sym, &fn, cases[i].ver, cases[i].flags, &st), CUDA_SUCCESS);
        if (fn != cases[i].want || (int)st != cases[i].status) {
            g_fails++;
            printf("FAIL %d: lookup %s %d %llu -> %p status %d, expected %p status %d\n", __LINE__, cases[i].sym,
                   cases[i].ver, cases[i].flags, fn, (int)st, cases[i].want, cases[i].status);
        }
    }
    EXPECT(cuGetProcAddress_v2("cuMemCreate", &fn, 13060, 0, &st), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuGetProcAddress_v2("cuMemCreate", &fn, 12000, 4, &st), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuGetProcAddress_v2(NULL, &fn, 12000, 0, &st), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuGetProcAddress_v2("cuMemCreate", &fn, 12000, 0, NULL), CUDA_SUCCESS);
    CHECK(fn == (void *)cuMemCreate);
    EXPECT(legacy_cuGetProcAddress("cuMemMap", &fn, 11030, 0), CUDA_SUCCESS);
    CHECK(fn == (void *)cuMemMap);
    EXPECT(legacy_cuGetProcAddress("cuNoSuchFunction", &fn, 11030, 0), CUDA_ERROR_NOT_FOUND);
    CHECK(fn == NULL);
    EXPECT(legacy_cuGetProcAddress("cuMemMap", &fn, 13060, 0), CUDA_ERROR_INVALID_VALUE);
}

static volatile int g_blocked_done;
static void *blocked_call(void *arg)
{
    (void)arg;
    CUcontext c = g_ctx;
    cuCtxSetCurrent(c);
    cuCtxSynchronize();
    g_blocked_done = 1;
    return NULL;
}

/* Self-controlled native checkpoint: the control thread does the work, so the calling thread
 * may drive its own process (it must not make gated calls while locked). */
static void checkpoint_self(void)
{
    int me = getpid();
    CUprocessState st = (CUprocessState)9;
    int tid = 0;
    EXPECT(cuCheckpointProcessGetState(me, &st), CUDA_SUCCESS);
    CHECK(st == CU_PROCESS_STATE_RUNNING);
    EXPECT(cuCheckpointProcessGetRestoreThreadId(me, &tid), CUDA_SUCCESS);
    CHECK(tid > 0 && tid != me);
    EXPECT(cuCheckpointProcessGetState(0x7ffffff0, &st), CUDA_ERROR_OPERATING_SYSTEM); /* no such process */
    EXPECT(cuCheckpointProcessCheckpoint(me, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT(cuCheckpointProcessRestore(me, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT(cuCheckpointProcessUnlock(me, NULL), CUDA_ERROR_ILLEGAL_STATE);
    CUcheckpointLockArgs la;
    memset(&la, 0, sizeof la);
    la.reserved0 = 1;
    EXPECT(cuCheckpointProcessLock(me, &la), CUDA_ERROR_INVALID_VALUE);

    /* state to carry: a shared-capable allocation mapped twice (creator + own import),
     * a private one, and an unmapped one */
    CUmemAllocationProp pp = prop(0, 1), pn = prop(1, 0);
    CUmemGenericAllocationHandle hs, hi, hn, hu;
    CUdeviceptr va;
    CUmemAccessDesc a[2] = {acc(0, 3), acc(1, 1)};
    int fd = -1;
    EXPECT(cuMemCreate(&hs, G, &pp, 0), CUDA_SUCCESS);
    EXPECT(cuMemCreate(&hn, 2 * G, &pn, 0), CUDA_SUCCESS);
    EXPECT(cuMemCreate(&hu, G, &pn, 0), CUDA_SUCCESS);
    EXPECT(cuMemExportToShareableHandle(&fd, hs, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_SUCCESS);
    EXPECT(cuMemImportFromShareableHandle(&hi, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           CUDA_SUCCESS);
    EXPECT(cuMemAddressReserve(&va, 5 * G, 0, 0, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(va, G, 0, hs, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(va + G, G, 0, hi, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(va + 2 * G, 2 * G, 0, hn, 0), CUDA_SUCCESS);
    EXPECT(cuMemSetAccess(va, 4 * G, a, 2), CUDA_SUCCESS);
    EXPECT(cuMemsetD32(va, 0x11111111, 16), CUDA_SUCCESS);
    EXPECT(cuMemsetD32(va + 3 * G, 0x33333333, 16), CUDA_SUCCESS);
    CHECK(*(volatile uint32_t *)(uintptr_t)(va + G) == 0x11111111); /* the import sees it */
    /* private cuMemAlloc memory: 3 pages and a bit, a pattern in every byte */
    CUdeviceptr dm = 0;
    size_t dmsize = 3 * 4096 + 100;
    unsigned char *pat = malloc(dmsize), *back = malloc(dmsize);
    for (size_t i = 0; i < dmsize; i++)
        pat[i] = (unsigned char)(i * 7 + 3);
    EXPECT(cuMemAlloc(&dm, dmsize), CUDA_SUCCESS);
    EXPECT(cuMemcpyHtoD(dm, pat, dmsize), CUDA_SUCCESS);

    /* lock with a stream waiting on a value nobody writes: NOT_READY, still RUNNING */
    CUstream s;
    EXPECT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    EXPECT(cuStreamWaitValue32(s, va + 64, 1, CU_STREAM_WAIT_VALUE_EQ), CUDA_SUCCESS);
    la.reserved0 = 0;
    la.timeoutMs = 50;
    EXPECT(cuCheckpointProcessLock(me, &la), CUDA_ERROR_NOT_READY);
    EXPECT(cuCheckpointProcessGetState(me, &st), CUDA_SUCCESS);
    CHECK(st == CU_PROCESS_STATE_RUNNING);
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    EXPECT(cuStreamWriteValue32(NULL, va + 64, 1, 0), CUDA_SUCCESS);
    EXPECT(cuStreamSynchronize(s), CUDA_SUCCESS);

    la.timeoutMs = 0;
    EXPECT(cuCheckpointProcessLock(me, &la), CUDA_SUCCESS);
    EXPECT(cuCheckpointProcessGetState(me, &st), CUDA_SUCCESS);
    CHECK(st == CU_PROCESS_STATE_LOCKED);
    pthread_t t;
    pthread_create(&t, NULL, blocked_call, NULL); /* parks at the entry gate */
    EXPECT(cuCheckpointProcessLock(me, &la), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT(cuCheckpointProcessRestore(me, NULL), CUDA_ERROR_ILLEGAL_STATE);
    /* the exported fd is still open: refused, nothing changes */
    EXPECT(cuCheckpointProcessCheckpoint(me, NULL), CUDA_ERROR_NOT_SUPPORTED);
    EXPECT(cuCheckpointProcessGetState(me, &st), CUDA_SUCCESS);
    CHECK(st == CU_PROCESS_STATE_LOCKED);
    CHECK(*(volatile uint32_t *)(uintptr_t)(va + G) == 0x11111111);
    close(fd);
    CUcheckpointCheckpointArgs ca;
    memset(&ca, 0, sizeof ca);
    ca.reserved[3] = 1;
    EXPECT(cuCheckpointProcessCheckpoint(me, &ca), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuCheckpointProcessCheckpoint(me, NULL), CUDA_SUCCESS);
    EXPECT(cuCheckpointProcessGetState(me, &st), CUDA_SUCCESS);
    CHECK(st == CU_PROCESS_STATE_CHECKPOINTED);
    CHECK(count_fakecuda_memfds() == 0); /* nothing CRIU could carry as sharing */
    char perms[5];
    maps_perms(dm, perms); /* the cuMemAlloc range is a bare reservation now: its bytes are host buffers */
    CHECK(!strcmp(perms, "---p"));
    maps_perms(dm + dmsize - 1, perms);
    CHECK(!strcmp(perms, "---p"));
    EXPECT(cuCheckpointProcessCheckpoint(me, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT(cuCheckpointProcessUnlock(me, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT(cuCheckpointProcessLock(me, &la), CUDA_ERROR_ILLEGAL_STATE);
    CHECK(g_blocked_done == 0);
    EXPECT(cuCheckpointProcessRestore(me, NULL), CUDA_SUCCESS);
    EXPECT(cuCheckpointProcessGetState(me, &st), CUDA_SUCCESS);
    CHECK(st == CU_PROCESS_STATE_LOCKED);
    /* same VAs, same bytes, same access. The import of this process's own export is the same
     * allocation (one object per process), so it stays aliased after restore. */
    CHECK(*(volatile uint32_t *)(uintptr_t)(va) == 0x11111111);
    CHECK(*(volatile uint32_t *)(uintptr_t)(va + G) == 0x11111111);
    CHECK(*(volatile uint32_t *)(uintptr_t)(va + 3 * G + 60) == 0x33333333);
    *(volatile uint32_t *)(uintptr_t)va = 0x22;
    CHECK(*(volatile uint32_t *)(uintptr_t)(va + G) == 0x22);
    maps_perms(dm, perms); /* a fresh shared memfd again (cuIpcGetMemHandle can share it) */
    CHECK(!strcmp(perms, "rw-s"));
    CHECK(memcmp((const void *)(uintptr_t)dm, pat, dmsize) == 0); /* same VA, same bytes */
    CHECK(g_blocked_done == 0);
    EXPECT(cuCheckpointProcessUnlock(me, NULL), CUDA_SUCCESS);
    pthread_join(t, NULL);
    CHECK(g_blocked_done == 1);
    EXPECT(cuCheckpointProcessGetState(me, &st), CUDA_SUCCESS);
    CHECK(st == CU_PROCESS_STATE_RUNNING);

    unsigned long long fl = 0;
    CUmemLocation l1 = {CU_MEM_LOCATION_TYPE_DEVICE, 1};
    EXPECT(cuMemGetAccess(&fl, &l1, va + 3 * G), CUDA_SUCCESS);
    CHECK(fl == 1);
    CUmemGenericAllocationHandle r;
    EXPECT(cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)(va + G)), CUDA_SUCCESS);
    CHECK(r == hi);
    EXPECT(cuMemRelease(r), CUDA_SUCCESS);
    /* the unmapped allocation came back too and maps fine */
    EXPECT(cuMemMap(va + 4 * G, G, 0, hu, 0), CUDA_SUCCESS);
    CUmemAllocationProp got;
    EXPECT(cuMemGetAllocationPropertiesFromHandle(&got, hi), CUDA_SUCCESS);
    CHECK(got.requestedHandleTypes == CU_MEM_HANDLE_TYPE_NONE); /* hi is an import */
    EXPECT(cuMemUnmap(va, 5 * G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(hs), CUDA_SUCCESS);
    EXPECT(cuMemRelease(hi), CUDA_SUCCESS);
    EXPECT(cuMemRelease(hn), CUDA_SUCCESS);
    EXPECT(cuMemRelease(hu), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(va, 5 * G), CUDA_SUCCESS);
    EXPECT(cuStreamDestroy(s), CUDA_SUCCESS);
    CHECK(count_fakecuda_memfds() == 2); /* the cuMemAlloc buffer dm: its memfd, mapped */
    EXPECT(cuMemcpyDtoH(back, dm, dmsize), CUDA_SUCCESS);
    CHECK(memcmp(back, pat, dmsize) == 0);
    EXPECT(cuMemFree(dm), CUDA_SUCCESS);
    free(pat);
    free(back);
}

static void private_memory(void)
{
    CUdeviceptr p = 0, base = 0;
    size_t size = 0;
    EXPECT(cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAlloc(&p, 1000), CUDA_SUCCESS);
    EXPECT(cuMemsetD8(p, 7, 1000), CUDA_SUCCESS);
    EXPECT(cuMemGetAddressRange(&base, &size, p + 999), CUDA_SUCCESS);
    CHECK(base == p && size == 1000);
    unsigned char b[4] = {0};
    EXPECT(cuMemcpyDtoH(b, p + 996, 4), CUDA_SUCCESS);
    CHECK(b[0] == 7 && b[3] == 7);
    EXPECT(cuMemFree(p), CUDA_SUCCESS);
    EXPECT(cuMemFree(p), CUDA_ERROR_INVALID_VALUE);
}

static void host_memory(void)
{
    char *buf = aligned_alloc(4096, 65536);
    void *ph = NULL;
    EXPECT(cuMemHostRegister(buf, 65536, CU_MEMHOSTREGISTER_PORTABLE), CUDA_SUCCESS);
    EXPECT(cuMemHostRegister(buf + 4096, 4096, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    EXPECT(cuMemHostRegister(buf + 65536, 0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemHostUnregister(buf + 4096), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    EXPECT(cuMemHostUnregister(buf), CUDA_SUCCESS);
    EXPECT(cuMemHostUnregister(buf), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    EXPECT(cuMemAllocHost(&ph, 8192), CUDA_SUCCESS);
    memset(ph, 1, 8192);
    EXPECT(cuMemFreeHost(buf), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemHostUnregister(ph), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    EXPECT(cuMemFreeHost(ph), CUDA_SUCCESS);
    free(buf);
}

/* a child forked after cuInit cannot use the driver */
static void forked_child(void)
{
    pid_t p = fork();
    if (p == 0) {
        int n = 0;
        CUprocessState st;
        int ok = cuInit(0) == CUDA_ERROR_NOT_INITIALIZED && cuDeviceGetCount(&n) == CUDA_ERROR_NOT_INITIALIZED &&
                 cuCheckpointProcessGetState(getppid(), &st) == CUDA_ERROR_NOT_INITIALIZED;
        _exit(ok ? 0 : 1);
    }
    int status = -1;
    CHECK(waitpid(p, &status, 0) == p && WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* Lock/checkpoint/restore/unlock cycles while worker threads hammer the API: no deadlock, no
 * call completes inside a locked window (a thread may finish the call it had returned from),
 * and the bytes every thread writes survive each cycle. */
#define STRESS_THREADS 4
static CUdeviceptr g_stress_va;
static atomic_int g_stress_stop;
static atomic_long g_stress_calls[STRESS_THREADS];
static atomic_int g_stress_bad;

static void *stress_thread(void *arg)
{
    int id = (int)(intptr_t)arg;
    cuCtxSetCurrent(g_ctx);
    CUstream s;
    if (cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
        atomic_fetch_add(&g_stress_bad, 1);
    for (uint32_t i = 1; !atomic_load(&g_stress_stop); i++) {
        uint32_t v = i, back = 0;
        CUdeviceptr slot = g_stress_va + 64 * (CUdeviceptr)id;
        if (cuMemcpyHtoDAsync(slot, &v, 4, s) != CUDA_SUCCESS || cuMemcpyDtoHAsync(&back, slot, 4, s) != CUDA_SUCCESS ||
            cuStreamSynchronize(s) != CUDA_SUCCESS || back != i)
            atomic_fetch_add(&g_stress_bad, 1);
        atomic_fetch_add(&g_stress_calls[id], 1);
    }
    cuStreamDestroy(s);
    return NULL;
}

static void gate_stress(void)
{
    int me = getpid();
    CUmemAllocationProp p = prop(0, 0);
    CUmemGenericAllocationHandle h;
    CUmemAccessDesc a = acc(0, 3);
    EXPECT(cuMemCreate(&h, G, &p, 0), CUDA_SUCCESS);
    EXPECT(cuMemAddressReserve(&g_stress_va, G, 0, 0, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(g_stress_va, G, 0, h, 0), CUDA_SUCCESS);
    EXPECT(cuMemSetAccess(g_stress_va, G, &a, 1), CUDA_SUCCESS);
    pthread_t t[STRESS_THREADS];
    for (int i = 0; i < STRESS_THREADS; i++)
        pthread_create(&t[i], NULL, stress_thread, (void *)(intptr_t)i);
    for (int cycle = 0; cycle < 20; cycle++) {
        for (int i = 0; i < STRESS_THREADS; i++) /* every thread made progress since the last cycle */
            while (atomic_load(&g_stress_calls[i]) < cycle + 1)
                sched_yield();
        EXPECT(cuCheckpointProcessLock(me, NULL), CUDA_SUCCESS);
        long before = 0, after = 0;
        for (int i = 0; i < STRESS_THREADS; i++)
            before += atomic_load(&g_stress_calls[i]);
        if (cycle % 4 == 0) {
            EXPECT(cuCheckpointProcessCheckpoint(me, NULL), CUDA_SUCCESS);
            EXPECT(cuCheckpointProcessRestore(me, NULL), CUDA_SUCCESS);
        }
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
        for (int i = 0; i < STRESS_THREADS; i++)
            after += atomic_load(&g_stress_calls[i]);
        CHECK(after - before <= STRESS_THREADS);
        EXPECT(cuCheckpointProcessUnlock(me, NULL), CUDA_SUCCESS);
    }
    atomic_store(&g_stress_stop, 1);
    for (int i = 0; i < STRESS_THREADS; i++)
        pthread_join(t[i], NULL);
    CHECK(atomic_load(&g_stress_bad) == 0);
    EXPECT(cuMemUnmap(g_stress_va, G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(h), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(g_stress_va, G), CUDA_SUCCESS);
}

/* ---- multicast (driver API "Multicast Object Management"): team, blocking bind, broadcast, refusals ---- */

static CUmulticastObjectProp mcprop(unsigned ndev, size_t size, unsigned long long types)
{
    CUmulticastObjectProp p;
    memset(&p, 0, sizeof p);
    p.numDevices = ndev;
    p.size = size;
    p.handleTypes = types;
    return p;
}

struct adder {
    CUmemGenericAllocationHandle mc;
    int dev;
    int seen;                    /* "blocks until" lines in the call log before the bind */
    atomic_int added;
};

#define BLOCK_LINE "cuMulticastBindMem blocks until every device was added"

static int count_in_file(const char *path, const char *needle)
{
    int n = 0;
    FILE *f = path ? fopen(path, "r") : NULL;
    char line[1024];
    while (f && fgets(line, sizeof line, f))
        n += strstr(line, needle) != NULL;
    if (f)
        fclose(f);
    return n;
}

/* Adds the last device once the main thread's bind is blocked: it waits for fakecuda's "blocks
 * until" line in the call log (no timing involved); without a log, after a short sleep. */
static void *late_adder(void *arg)
{
    struct adder *ad = arg;
    const char *log = getenv("FAKECUDA_LOG");
    struct timespec ts = {0, 1000000L};
    if (log && *log)
        while (count_in_file(log, BLOCK_LINE) <= ad->seen)
            nanosleep(&ts, NULL);
    else {
        ts.tv_nsec = 30 * 1000000L;
        nanosleep(&ts, NULL);
    }
    atomic_store(&ad->added, 1);
    if (cuMulticastAddDevice(ad->mc, ad->dev) != CUDA_SUCCESS)
        atomic_store(&ad->added, -1);
    return NULL;
}

static void multicast(void)
{
    int me = getpid();
    size_t g = 0;
    CUmulticastObjectProp p = mcprop(2, 4 * G, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmulticastObjectProp bad;
    CUmemGenericAllocationHandle mc, mc1, h0, h1, hn, himp;

    /* granularity and create argument rules */
    EXPECT(cuMulticastGetGranularity(NULL, &p, CU_MULTICAST_GRANULARITY_MINIMUM), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMulticastGetGranularity(&g, &p, (CUmulticastGranularity_flags)2), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMulticastGetGranularity(&g, NULL, CU_MULTICAST_GRANULARITY_MINIMUM), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMulticastGetGranularity(&g, &p, CU_MULTICAST_GRANULARITY_RECOMMENDED), CUDA_SUCCESS);
    CHECK(g == G);
    EXPECT(cuMulticastCreate(NULL, &p), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMulticastCreate(&mc, NULL), CUDA_ERROR_INVALID_VALUE);
    bad = mcprop(0, G, 0);
    EXPECT(cuMulticastCreate(&mc, &bad), CUDA_ERROR_INVALID_VALUE);
    bad = mcprop(2, 0, 0);
    EXPECT(cuMulticastCreate(&mc, &bad), CUDA_ERROR_INVALID_VALUE);
    bad = mcprop(2, G + G / 2, 0);
    EXPECT(cuMulticastCreate(&mc, &bad), CUDA_ERROR_INVALID_VALUE);
    bad = mcprop(2, G, 0);
    bad.flags = 1;
    EXPECT(cuMulticastCreate(&mc, &bad), CUDA_ERROR_INVALID_VALUE);
    bad = mcprop(2, G, CU_MEM_HANDLE_TYPE_FABRIC);
    EXPECT(cuMulticastCreate(&mc, &bad), CUDA_ERROR_NOT_SUPPORTED);
    bad = mcprop(2, G, CU_MEM_HANDLE_TYPE_WIN32);
    EXPECT(cuMulticastCreate(&mc, &bad), CUDA_ERROR_INVALID_VALUE);
    bad = mcprop(65, G, 0);
    EXPECT(cuMulticastCreate(&mc, &bad), CUDA_ERROR_INVALID_VALUE);

    /* a shareable team of two: (this process, device 0) and (this process, device 1) */
    EXPECT(cuMulticastCreate(&mc, &p), CUDA_SUCCESS);
    CUmemAllocationProp p0 = prop(0, 1), p1 = prop(1, 1), pn = prop(0, 0);
    EXPECT(cuMemCreate(&h0, 2 * G, &p0, 0), CUDA_SUCCESS);
    EXPECT(cuMemCreate(&h1, 2 * G, &p1, 0), CUDA_SUCCESS);
    EXPECT(cuMemCreate(&hn, 2 * G, &pn, 0), CUDA_SUCCESS);
    EXPECT(cuMulticastAddDevice(mc, NDEV), CUDA_ERROR_INVALID_DEVICE);
    EXPECT(cuMulticastAddDevice(h0, 0), CUDA_ERROR_INVALID_VALUE); /* not a multicast handle */
    EXPECT(cuMulticastAddDevice(mc, 0), CUDA_SUCCESS);
    EXPECT(cuMulticastAddDevice(mc, 0), CUDA_ERROR_INVALID_VALUE); /* duplicate */
    CUmemAllocationProp got;
    EXPECT(cuMemGetAllocationPropertiesFromHandle(&got, mc), CUDA_ERROR_INVALID_VALUE);

    /* argument rules answer at once, before the team is complete (no blocking) */
    EXPECT(cuMulticastBindMem(mc, G / 2, h0, 0, G, 0), CUDA_ERROR_INVALID_VALUE);       /* mcOffset */
    EXPECT(cuMulticastBindMem(mc, 0, h0, G / 2, G, 0), CUDA_ERROR_INVALID_VALUE);       /* memOffset */
    EXPECT(cuMulticastBindMem(mc, 0, h0, 0, G / 2, 0), CUDA_ERROR_INVALID_VALUE);       /* size */
    EXPECT(cuMulticastBindMem(mc, 0, h0, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMulticastBindMem(mc, 0, h0, 0, G, 1), CUDA_ERROR_INVALID_VALUE);           /* flags */
    EXPECT(cuMulticastBindMem(mc, 3 * G, h0, 0, 2 * G, 0), CUDA_ERROR_INVALID_VALUE);   /* beyond capacity */
    EXPECT(cuMulticastBindMem(mc, 4 * G, h0, 0, G, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMulticastBindMem(mc, 0, h0, G, 2 * G, 0), CUDA_ERROR_INVALID_VALUE);       /* beyond the memory */
    EXPECT(cuMulticastBindMem(mc, 0, hn, 0, G, 0), CUDA_ERROR_INVALID_VALUE);           /* not shareable */
    EXPECT(cuMulticastBindMem(mc, 0, mc, 0, G, 0), CUDA_ERROR_INVALID_VALUE);           /* not memory */
    EXPECT(cuMulticastBindMem(h0, 0, h0, 0, G, 0), CUDA_ERROR_INVALID_VALUE);           /* not multicast */
    EXPECT(cuMulticastBindMem(mc, 0, h1, 0, G, 0), CUDA_ERROR_INVALID_DEVICE);          /* v1: context is device 0 */
    EXPECT(cuMulticastBindMem_v2(mc, 0, 0, h1, 0, G, 0), CUDA_ERROR_INVALID_DEVICE);    /* memory on device 1 */
    EXPECT(cuMulticastBindMem_v2(mc, NDEV, 0, h1, 0, G, 0), CUDA_ERROR_INVALID_DEVICE);
    EXPECT(cuMulticastBindMem_v2(mc, -1, 0, h1, 0, G, 0), CUDA_ERROR_INVALID_DEVICE);
    CUdeviceptr va;
    EXPECT(cuMemAddressReserve(&va, 8 * G, 0, 0, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(va, G, G / 2, mc, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemMap(va, 8 * G, 0, mc, 0), CUDA_ERROR_INVALID_VALUE);                     /* beyond capacity */
    EXPECT(cuMemMap(va, 2 * G, 3 * G, mc, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemMap((CUdeviceptr)G, G, 0, mc, 0), CUDA_ERROR_INVALID_VALUE);              /* no reservation */

    /* bind blocks until the last device is added (by another thread here) */
    struct adder ad;
    ad.mc = mc;
    ad.dev = 1;
    ad.seen = count_in_file(getenv("FAKECUDA_LOG"), BLOCK_LINE);
    atomic_init(&ad.added, 0);
    pthread_t t;
    pthread_create(&t, NULL, late_adder, &ad);
    EXPECT(cuMulticastBindMem(mc, 0, h0, 0, 2 * G, 0), CUDA_SUCCESS); /* v1: context device 0 */
    CHECK(atomic_load(&ad.added) == 1); /* it could only return after the add */
    pthread_join(t, NULL);
    CHECK(atomic_load(&ad.added) == 1);
    EXPECT(cuMulticastAddDevice(mc, 1), CUDA_ERROR_INVALID_VALUE); /* full (and a duplicate) */
    if (NDEV > 2)
        EXPECT(cuMulticastAddDevice(mc, 2), CUDA_ERROR_INVALID_VALUE); /* full */
    EXPECT(cuMulticastBindMem(mc, G, h0, 0, G, 0), CUDA_ERROR_INVALID_VALUE);           /* overlaps device 0's */
    /* device 1 binds the same multicast range through the address of a mapping */
    CUdeviceptr m1;
    CUmemAccessDesc rw0 = acc(0, 3), rw1 = acc(1, 3);
    EXPECT(cuMemAddressReserve(&m1, 2 * G, 0, 0, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(m1, 2 * G, 0, h1, 0), CUDA_SUCCESS);
    EXPECT(cuMemSetAccess(m1, 2 * G, &rw0, 1), CUDA_SUCCESS);
    EXPECT(cuMulticastBindAddr_v2(mc, 1, 0, m1 + G / 2, G, 0), CUDA_ERROR_INVALID_VALUE); /* misaligned */
    EXPECT(cuMulticastBindAddr_v2(mc, 1, 0, m1 + G, 2 * G, 0), CUDA_ERROR_INVALID_VALUE); /* past the mapping */
    CUdeviceptr dm = 0;
    EXPECT(cuMemAlloc(&dm, G), CUDA_SUCCESS);
    EXPECT(cuMulticastBindAddr_v2(mc, 1, 0, (dm + G - 1) & ~(CUdeviceptr)(G - 1), G, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemFree(dm), CUDA_SUCCESS);
    EXPECT(cuMulticastBindAddr(mc, 0, m1, 2 * G, 0), CUDA_ERROR_INVALID_DEVICE);        /* v1: device 0 context */
    EXPECT(cuMulticastBindAddr_v2(mc, 1, 0, m1, 2 * G, 0), CUDA_SUCCESS);

    /* map the multicast VA (the team is complete: no blocking), writes reach both members */
    EXPECT(cuMemMap(va, 4 * G, 0, mc, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(va + 4 * G, 2 * G, 0, mc, 0), CUDA_SUCCESS); /* a second view of offset 0 */
    EXPECT(cuMemSetAccess(va, 6 * G, &rw0, 1), CUDA_SUCCESS);
    char perms[5];
    maps_perms(va, perms);
    CHECK(!strcmp(perms, "---p")); /* host stores through a multicast VA fault */
    CUdeviceptr d0;
    EXPECT(cuMemAddressReserve(&d0, 2 * G, 0, 0, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(d0, 2 * G, 0, h0, 0), CUDA_SUCCESS);
    EXPECT(cuMemSetAccess(d0, 2 * G, &rw0, 1), CUDA_SUCCESS);
    uint32_t v = 0xC0FFEE, back = 0;
    EXPECT(cuMemcpyHtoD(va + G + 12, &v, 4), CUDA_SUCCESS);
    CHECK(*(volatile uint32_t *)(uintptr_t)(d0 + G + 12) == 0xC0FFEE);
    CHECK(*(volatile uint32_t *)(uintptr_t)(m1 + G + 12) == 0xC0FFEE);
    EXPECT(cuMemsetD32(va + 4 * G + 64, 0x5A5A5A5A, 8), CUDA_SUCCESS);
    CHECK(*(volatile uint32_t *)(uintptr_t)(d0 + 64 + 28) == 0x5A5A5A5A);
    CHECK(*(volatile uint32_t *)(uintptr_t)(m1 + 64 + 28) == 0x5A5A5A5A);
    CHECK(*(volatile uint32_t *)(uintptr_t)(m1 + 64 + 32) == 0);
    EXPECT(cuStreamWriteValue32(NULL, va + 256, 77, 0), CUDA_SUCCESS);
    EXPECT(cuStreamSynchronize(NULL), CUDA_SUCCESS);
    CHECK(*(volatile uint32_t *)(uintptr_t)(d0 + 256) == 77 && *(volatile uint32_t *)(uintptr_t)(m1 + 256) == 77);
    EXPECT(cuMemcpyDtoD(va + 512, d0 + G + 12, 4), CUDA_SUCCESS); /* unicast source, multicast destination */
    CHECK(*(volatile uint32_t *)(uintptr_t)(m1 + 512) == 0xC0FFEE);
    /* reads through the multicast VA are refused */
    EXPECT(cuMemcpyDtoH(&back, va + G + 12, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT(cuMemcpyDtoD(d0, va, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
    /* device 1 has no access to the multicast mapping yet; the range past the bindings has no member */
    CUcontext c1;
    EXPECT(cuDevicePrimaryCtxRetain(&c1, 1), CUDA_SUCCESS);
    EXPECT(cuCtxPushCurrent(c1), CUDA_SUCCESS);
    EXPECT(cuMemcpyHtoD(va, &v, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT(cuCtxPopCurrent(NULL), CUDA_SUCCESS);
    EXPECT(cuMemSetAccess(va, 2 * G, &rw1, 1), CUDA_SUCCESS);
    EXPECT(cuMemcpyHtoD(va + 2 * G, &v, 4), CUDA_ERROR_ILLEGAL_ADDRESS); /* offset 2G: nothing bound */
    EXPECT(cuMemUnmap(va + 4 * G, 2 * G), CUDA_SUCCESS);

    /* unbind must match a bind exactly */
    EXPECT(cuMulticastUnbind(mc, 0, 0, G), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMulticastUnbind(mc, 0, G, G), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMulticastUnbind(mc, 0, 0, 4 * G), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMulticastUnbind(mc, NDEV, 0, 2 * G), CUDA_ERROR_INVALID_DEVICE);
    EXPECT(cuMulticastUnbind(mc, 0, G / 2, G), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMulticastUnbind(h0, 0, 0, 2 * G), CUDA_ERROR_INVALID_VALUE);

    /* export/import of the object; a non-shareable object cannot be exported */
    int fd = -1;
    EXPECT(cuMemExportToShareableHandle(&fd, mc, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_SUCCESS);
    EXPECT(cuMemImportFromShareableHandle(&himp, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           CUDA_SUCCESS);
    close(fd);
    CHECK(himp != mc);
    EXPECT(cuMulticastAddDevice(himp, 0), CUDA_ERROR_INVALID_VALUE); /* the same team */
    CUmulticastObjectProp p1prop = mcprop(1, 2 * G, 0);
    EXPECT(cuMulticastCreate(&mc1, &p1prop), CUDA_SUCCESS);
    EXPECT(cuMemExportToShareableHandle(&fd, mc1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
           CUDA_ERROR_INVALID_VALUE);
    /* a team of one: the second device overflows it; memory on a non-team device is refused;
     * a non-shareable object takes non-shareable memory */
    EXPECT(cuMulticastAddDevice(mc1, 0), CUDA_SUCCESS);
    EXPECT(cuMulticastAddDevice(mc1, 1), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMulticastBindMem_v2(mc1, 1, 0, h1, 0, G, 0), CUDA_ERROR_INVALID_DEVICE);
    EXPECT(cuMulticastBindAddr_v2(mc1, 1, 0, m1, G, 0), CUDA_ERROR_INVALID_DEVICE);
    EXPECT(cuMulticastBindMem(mc1, 0, hn, 0, 2 * G, 0), CUDA_SUCCESS);

    /* native checkpoint is refused while any multicast object is held; unlock runs on */
    CUprocessState st;
    EXPECT(cuCheckpointProcessLock(me, NULL), CUDA_SUCCESS);
    EXPECT(cuCheckpointProcessCheckpoint(me, NULL), CUDA_ERROR_NOT_SUPPORTED);
    EXPECT(cuCheckpointProcessGetState(me, &st), CUDA_SUCCESS);
    CHECK(st == CU_PROCESS_STATE_LOCKED);
    EXPECT(cuCheckpointProcessUnlock(me, NULL), CUDA_SUCCESS);
    EXPECT(cuCheckpointProcessGetState(me, &st), CUDA_SUCCESS);
    CHECK(st == CU_PROCESS_STATE_RUNNING);
    EXPECT(cuMemcpyHtoD(va + 4, &v, 4), CUDA_SUCCESS);
    CHECK(*(volatile uint32_t *)(uintptr_t)(m1 + 4) == 0xC0FFEE);

    /* released while mapped and bound: the object lives on through the import's handle */
    EXPECT(cuMemRelease(mc), CUDA_SUCCESS);
    EXPECT(cuMemcpyHtoD(va + 8, &v, 4), CUDA_SUCCESS);
    CHECK(*(volatile uint32_t *)(uintptr_t)(d0 + 8) == 0xC0FFEE);
    EXPECT(cuMulticastUnbind(mc, 0, 0, 2 * G), CUDA_ERROR_INVALID_VALUE); /* stale handle */
    EXPECT(cuMemUnmap(va, 4 * G), CUDA_SUCCESS);
    EXPECT(cuMulticastUnbind(mc1, 0, 0, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(mc1), CUDA_SUCCESS);
    EXPECT(cuCheckpointProcessLock(me, NULL), CUDA_SUCCESS);
    EXPECT(cuCheckpointProcessCheckpoint(me, NULL), CUDA_ERROR_NOT_SUPPORTED); /* himp, bindings */
    EXPECT(cuCheckpointProcessUnlock(me, NULL), CUDA_SUCCESS);
    EXPECT(cuMulticastUnbind(himp, 0, 0, 2 * G), CUDA_SUCCESS); /* another handle of the same object */
    EXPECT(cuMulticastUnbind(himp, 1, 0, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(himp), CUDA_SUCCESS);
    EXPECT(cuMemRelease(himp), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAddressFree(va, 8 * G), CUDA_SUCCESS);
    EXPECT(cuMemUnmap(d0, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemUnmap(m1, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(d0, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(m1, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(h0), CUDA_SUCCESS);
    EXPECT(cuMemRelease(h1), CUDA_SUCCESS);
    EXPECT(cuMemRelease(hn), CUDA_SUCCESS);
    /* nothing multicast is held any more: native checkpoint goes through */
    EXPECT(cuCheckpointProcessLock(me, NULL), CUDA_SUCCESS);
    EXPECT(cuCheckpointProcessCheckpoint(me, NULL), CUDA_SUCCESS);
    EXPECT(cuCheckpointProcessRestore(me, NULL), CUDA_SUCCESS);
    EXPECT(cuCheckpointProcessUnlock(me, NULL), CUDA_SUCCESS);
}

/* The documented teardown order (unmap, unbind, release); the member keeps the bytes. */
static void multicast_teardown(void)
{
    int me = getpid();
    CUmulticastObjectProp p = mcprop(1, 2 * G, 0);
    CUmemAllocationProp p0 = prop(0, 0);
    CUmemGenericAllocationHandle mc, h;
    CUdeviceptr va;
    CUmemAccessDesc rw0 = acc(0, 3);
    EXPECT(cuMulticastCreate(&mc, &p), CUDA_SUCCESS);
    EXPECT(cuMemCreate(&h, 2 * G, &p0, 0), CUDA_SUCCESS);
    EXPECT(cuMulticastAddDevice(mc, 0), CUDA_SUCCESS);
    EXPECT(cuMulticastBindMem(mc, 0, h, 0, 2 * G, 0), CUDA_SUCCESS);
    EXPECT(cuMemAddressReserve(&va, 2 * G, 0, 0, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(va, 2 * G, 0, mc, 0), CUDA_SUCCESS);
    EXPECT(cuMemSetAccess(va, 2 * G, &rw0, 1), CUDA_SUCCESS);
    EXPECT(cuMemsetD8(va, 0x42, 16), CUDA_SUCCESS);
    EXPECT(cuMemUnmap(va, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMulticastUnbind(mc, 0, 0, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMulticastUnbind(mc, 0, 0, 2 * G), CUDA_ERROR_INVALID_VALUE); /* already unbound */
    EXPECT(cuMemRelease(mc), CUDA_SUCCESS);
    /* the memory kept the broadcast bytes */
    EXPECT(cuMemMap(va, 2 * G, 0, h, 0), CUDA_SUCCESS);
    EXPECT(cuMemSetAccess(va, 2 * G, &rw0, 1), CUDA_SUCCESS);
    CHECK(*(volatile unsigned char *)(uintptr_t)(va + 15) == 0x42);
    EXPECT(cuMemUnmap(va, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(h), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(va, 2 * G), CUDA_SUCCESS);
    (void)me;
}

/* fc_unit G NDEV mcknobs: run with FAKECUDA_MULTICAST_WATCHDOG_MS (short) and
 * FAKECUDA_MULTICAST_CAPACITY_ROUNDING = 8 * G. */
static int mc_knobs(void)
{
    CUcontext c;
    EXPECT(cuInit(0), CUDA_SUCCESS);
    EXPECT(cuDevicePrimaryCtxRetain(&c, 0), CUDA_SUCCESS);
    EXPECT(cuCtxSetCurrent(c), CUDA_SUCCESS);
    CUmulticastObjectProp p = mcprop(2, G, 0);
    CUmemAllocationProp p0 = prop(0, 0);
    CUmemGenericAllocationHandle mc, h;
    CUdeviceptr va;
    EXPECT(cuMulticastCreate(&mc, &p), CUDA_SUCCESS);
    EXPECT(cuMemCreate(&h, 2 * G, &p0, 0), CUDA_SUCCESS);
    EXPECT(cuMemAddressReserve(&va, 16 * G, 0, 0, 0), CUDA_SUCCESS);
    EXPECT(cuMulticastAddDevice(mc, 0), CUDA_SUCCESS);
    /* device 1 is never added: the watchdog fails bind and map instead of hanging */
    EXPECT(cuMulticastBindMem(mc, 0, h, 0, G, 0), CUDA_ERROR_TIMEOUT);
    EXPECT(cuMemMap(va, G, 0, mc, 0), CUDA_ERROR_TIMEOUT);
    EXPECT(cuMemUnmap(va, G), CUDA_ERROR_INVALID_VALUE); /* nothing was mapped */
    EXPECT(cuMulticastAddDevice(mc, 1), CUDA_SUCCESS);
    /* capacity rounded up to 8 G: binds and maps beyond the requested G fit */
    EXPECT(cuMulticastBindMem(mc, 6 * G, h, 0, 2 * G, 0), CUDA_SUCCESS);
    EXPECT(cuMulticastBindMem(mc, 7 * G, h, 0, 2 * G, 0), CUDA_ERROR_INVALID_VALUE); /* past 8 G */
    EXPECT(cuMulticastBindMem(mc, 8 * G, h, 0, G, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemMap(va, 8 * G, 0, mc, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(va + 8 * G, 2 * G, 7 * G, mc, 0), CUDA_ERROR_INVALID_VALUE);
    CUmemAccessDesc rw0 = acc(0, 3);
    EXPECT(cuMemSetAccess(va, 8 * G, &rw0, 1), CUDA_SUCCESS);
    EXPECT(cuMemsetD32(va + 7 * G, 0xABCD, 4), CUDA_SUCCESS);
    EXPECT(cuMemsetD32(va, 0xABCD, 4), CUDA_ERROR_ILLEGAL_ADDRESS); /* nothing bound at 0 */
    EXPECT(cuMemUnmap(va, 8 * G), CUDA_SUCCESS);
    EXPECT(cuMulticastUnbind(mc, 0, 6 * G, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(mc), CUDA_SUCCESS);
    EXPECT(cuMemMap(va, 2 * G, 0, h, 0), CUDA_SUCCESS);
    EXPECT(cuMemSetAccess(va, 2 * G, &rw0, 1), CUDA_SUCCESS);
    CHECK(*(volatile uint32_t *)(uintptr_t)(va + G + 12) == 0xABCD);
    EXPECT(cuMemUnmap(va, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(h), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(va, 16 * G), CUDA_SUCCESS);
    printf("fc_unit: %d checks, %d failures\n", g_checks, g_fails);
    return g_fails ? 1 : 0;
}

/* Legacy CUDA IPC as far as one process can go, pointer attributes, host-located VMM
 * (tests/fakecuda/test_fakecuda_ipc.py and _hostvmm.py do the two-process half). */
static void ipc_pointer_host(void)
{
    CUdeviceptr dm = 0, vv = 0, got = 0;
    const size_t n = 2 * 4096 + 8;
    EXPECT(cuMemAlloc(&dm, n), CUDA_SUCCESS);
    CUipcMemHandle h, h2, zero;
    memset(&zero, 0, sizeof zero);
    EXPECT(cuIpcGetMemHandle(NULL, dm), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuIpcGetMemHandle(&h, dm + 4096), CUDA_ERROR_INVALID_VALUE); /* not the base */
    EXPECT(cuIpcGetMemHandle(&h, 4096), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuIpcGetMemHandle(&h, dm), CUDA_SUCCESS);
    EXPECT(cuIpcGetMemHandle(&h2, dm), CUDA_SUCCESS);
    CHECK(memcmp(&h, &h2, sizeof h) == 0);
    EXPECT(cuIpcOpenMemHandle(&got, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT(cuIpcOpenMemHandle(&got, h, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuIpcOpenMemHandle(NULL, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuIpcOpenMemHandle(&got, zero, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CUDA_ERROR_INVALID_HANDLE);
    CHECK(got == 0);
    EXPECT(cuIpcCloseMemHandle(dm), CUDA_ERROR_INVALID_VALUE); /* not opened by cuIpcOpenMemHandle */
    /* cuMemAlloc memory */
    unsigned int mt = 0;
    int iv = -1;
    unsigned long long ull = 7;
    size_t sz = 0;
    CUdeviceptr p = 0;
    CUcontext cx = NULL, cur = NULL;
    EXPECT(cuCtxGetCurrent(&cur), CUDA_SUCCESS);
    EXPECT(cuPointerGetAttribute(&cx, CU_POINTER_ATTRIBUTE_CONTEXT, dm + 5), CUDA_SUCCESS);
    CHECK(cx == cur);
    EXPECT(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dm + 5), CUDA_SUCCESS);
    CHECK(mt == CU_MEMORYTYPE_DEVICE);
    EXPECT(cuPointerGetAttribute(&iv, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, dm + 5), CUDA_SUCCESS);
    CHECK(iv == 1);
    EXPECT(cuPointerGetAttribute(&p, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, dm + n - 1), CUDA_SUCCESS);
    CHECK(p == dm);
    EXPECT(cuPointerGetAttribute(&sz, CU_POINTER_ATTRIBUTE_RANGE_SIZE, dm), CUDA_SUCCESS);
    CHECK(sz == n);
    EXPECT(cuPointerGetAttribute(&ull, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, dm), CUDA_SUCCESS);
    CHECK(ull == 0);
    void *hp = (void *)1;
    EXPECT(cuPointerGetAttribute(&hp, CU_POINTER_ATTRIBUTE_HOST_POINTER, dm), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuPointerGetAttribute(&hp, CU_POINTER_ATTRIBUTE_P2P_TOKENS, dm), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuPointerGetAttribute(&hp, (CUpointer_attribute)0, dm), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuPointerGetAttribute(NULL, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dm), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, 4096), CUDA_ERROR_INVALID_VALUE);
    /* cuPointerGetAttributes: inapplicable ones are zero, not an error */
    CUpointer_attribute at[3] = {CU_POINTER_ATTRIBUTE_HOST_POINTER, CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                 CU_POINTER_ATTRIBUTE_MAPPED};
    void *hv = (void *)1;
    CUdeviceptr dv = 0;
    int mapped = 5;
    void *data[3] = {&hv, &dv, &mapped};
    EXPECT(cuPointerGetAttributes(3, at, data, dm + 8), CUDA_SUCCESS);
    CHECK(hv == NULL && dv == dm + 8 && mapped == 1);
    EXPECT(cuPointerGetAttributes(0, at, data, dm), CUDA_ERROR_INVALID_VALUE);
    CUpointer_attribute bad[1] = {CU_POINTER_ATTRIBUTE_P2P_TOKENS};
    EXPECT(cuPointerGetAttributes(1, bad, data, dm), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuPointerGetAttributes(3, at, data, 4096), CUDA_SUCCESS); /* no CUDA pointer: NULL values */
    CHECK(hv == NULL && dv == 0 && mapped == 0);
    /* VMM: refused by cuIpcGetMemHandle, the reservation is the range */
    CUmemAllocationProp pr = prop(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle hv1;
    EXPECT(cuMemCreate(&hv1, G, &pr, 0), CUDA_SUCCESS);
    EXPECT(cuMemAddressReserve(&vv, 2 * G, 0, 0, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(vv, G, 0, hv1, 0), CUDA_SUCCESS);
    EXPECT(cuIpcGetMemHandle(&h, vv), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuPointerGetAttribute(&iv, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, vv), CUDA_SUCCESS);
    CHECK(iv == 0);
    EXPECT(cuPointerGetAttribute(&sz, CU_POINTER_ATTRIBUTE_RANGE_SIZE, vv + G), CUDA_SUCCESS);
    CHECK(sz == 2 * G);
    EXPECT(cuPointerGetAttribute(&iv, CU_POINTER_ATTRIBUTE_MAPPED, vv + G), CUDA_SUCCESS);
    CHECK(iv == 0);
    EXPECT(cuPointerGetAttribute(&sz, CU_POINTER_ATTRIBUTE_MAPPING_SIZE, vv + 4), CUDA_SUCCESS);
    CHECK(sz == G);
    EXPECT(cuPointerGetAttribute(&cx, CU_POINTER_ATTRIBUTE_CONTEXT, vv), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemUnmap(vv, G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(hv1), CUDA_SUCCESS);
    /* host-located VMM: creation rules, host access, CPU through the mapping */
    CUmemAllocationProp ph = prop(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    ph.location.type = CU_MEM_LOCATION_TYPE_HOST;
    CUmemGenericAllocationHandle hh = 77;
    EXPECT(cuMemCreate(&hh, G, &ph, 0), CUDA_ERROR_INVALID_VALUE); /* HOST: handle types must be 0 */
    ph.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT;
    EXPECT(cuMemCreate(&hh, G, &ph, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(hh == 77);
    ph.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    size_t g = 0;
    EXPECT(cuMemGetAllocationGranularity(&g, &ph, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_SUCCESS);
    CHECK(g == G);
    EXPECT(cuMemCreate(&hh, G, &ph, 0), CUDA_SUCCESS);
    EXPECT(cuMemMap(vv, G, 0, hh, 0), CUDA_SUCCESS);
    CUmemAccessDesc ad = acc(0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    ad.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    ad.location.id = 3; /* ignored */
    EXPECT(cuMemSetAccess(vv, G, &ad, 1), CUDA_SUCCESS);
    *(volatile uint32_t *)(uintptr_t)(vv + 12) = 0xabcd;
    CHECK(*(volatile uint32_t *)(uintptr_t)(vv + 12) == 0xabcd);
    CUmemLocation lh = {CU_MEM_LOCATION_TYPE_HOST, 0}, l0 = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    EXPECT(cuMemGetAccess(&ull, &lh, vv), CUDA_SUCCESS);
    CHECK(ull == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    EXPECT(cuMemGetAccess(&ull, &l0, vv), CUDA_SUCCESS);
    CHECK(ull == 0);
    EXPECT(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, vv + 12), CUDA_SUCCESS);
    CHECK(mt == CU_MEMORYTYPE_HOST);
    EXPECT(cuPointerGetAttribute(&hp, CU_POINTER_ATTRIBUTE_HOST_POINTER, vv + 12), CUDA_SUCCESS);
    CHECK(hp == (void *)(uintptr_t)(vv + 12));
    CUmemAllocationProp back;
    EXPECT(cuMemGetAllocationPropertiesFromHandle(&back, hh), CUDA_SUCCESS);
    CHECK(back.location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA && back.location.id == 0);
    EXPECT(cuMemUnmap(vv, G), CUDA_SUCCESS);
    EXPECT(cuMemRelease(hh), CUDA_SUCCESS);
    EXPECT(cuMemAddressFree(vv, 2 * G), CUDA_SUCCESS);
    EXPECT(cuMemFree(dm), CUDA_SUCCESS);
    EXPECT(cuIpcGetMemHandle(&h, dm), CUDA_ERROR_INVALID_VALUE); /* freed */
    /* page-locked host memory: host memory of its context, host pointer = device pointer */
    void *ph2 = NULL;
    EXPECT(cuMemAllocHost(&ph2, 3 * 4096), CUDA_SUCCESS);
    CUdeviceptr hptr = (CUdeviceptr)(uintptr_t)ph2;
    EXPECT(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, hptr + 9), CUDA_SUCCESS);
    CHECK(mt == CU_MEMORYTYPE_HOST);
    EXPECT(cuPointerGetAttribute(&hp, CU_POINTER_ATTRIBUTE_HOST_POINTER, hptr + 9), CUDA_SUCCESS);
    CHECK(hp == (char *)ph2 + 9);
    EXPECT(cuPointerGetAttribute(&p, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, hptr + 4096), CUDA_SUCCESS);
    CHECK(p == hptr);
    EXPECT(cuPointerGetAttribute(&cx, CU_POINTER_ATTRIBUTE_CONTEXT, hptr), CUDA_SUCCESS);
    CHECK(cx == cur);
    EXPECT(cuPointerGetAttribute(&iv, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, hptr), CUDA_SUCCESS);
    CHECK(iv == 0);
    EXPECT(cuIpcGetMemHandle(&h, hptr), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemFreeHost(ph2), CUDA_SUCCESS);
    EXPECT(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, hptr), CUDA_ERROR_INVALID_VALUE);
    static char reg[2 * 4096] __attribute__((aligned(4096)));
    EXPECT(cuMemHostRegister(reg, sizeof reg, 0), CUDA_SUCCESS);
    EXPECT(cuPointerGetAttribute(&sz, CU_POINTER_ATTRIBUTE_RANGE_SIZE, (CUdeviceptr)(uintptr_t)(reg + 5)),
           CUDA_SUCCESS);
    CHECK(sz == sizeof reg);
    EXPECT(cuMemHostUnregister(reg), CUDA_SUCCESS);
}

int main(int argc, char **argv)
{
    G = argc > 1 ? strtoull(argv[1], NULL, 0) : (2u << 20);
    NDEV = argc > 2 ? atoi(argv[2]) : 2;
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc > 3 && !strcmp(argv[3], "mcknobs"))
        return mc_knobs();
    before_init();
    devices();
    vmm_create_reserve(); /* before any context: VMM needs none */
    contexts();
    vmm_map_access_release();
    vmm_export_import();
    streams_and_memops();
    procaddr();
    private_memory();
    host_memory();
    ipc_pointer_host();
    forked_child();
    multicast();
    multicast_teardown();
    checkpoint_self();
    gate_stress();
    printf("fc_unit: %d checks, %d failures\n", g_checks, g_fails);
    return g_fails ? 1 : 0;
}
