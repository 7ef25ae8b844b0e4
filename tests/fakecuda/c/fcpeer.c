/* fcpeer: a line-driven CUDA driver-API client for multi-process fakecuda tests.
 *
 * Reads one command per line on stdin and answers one line on stdout: "ok [values]" or
 * "err <CUresult name>". Up to six numeric arguments per command. argv[1] (optional) is a Unix socket fd used by
 * sendfd/recvfd (SCM_RIGHTS) and ipcsend/ipcrecv (the 64-byte CUipcMemHandle as plain bytes). Linked directly
 * against libcuda.so.1 (the ELF names; `lookup` asks cuGetProcAddress_v2).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <errno.h>
#include <unistd.h>

#include "fcline.h"

static int g_sock = -1;
static CUstream g_streams[16];
static int g_nstreams;
static CUcheckpointCustomStorageInfo *g_cs; /* the custom-storage operation in flight */
static CUcheckpointOperationHandle g_cs_handle; /* its handle (kept: the info dies at complete) */
static unsigned char *g_csbuf[16];          /* csload's host bytes, alive until cscomplete */

/* cscheckpoint/csrestore: "N devPtr0 size0 ..." of the CUcheckpointCustomStorageInfo */
static void reply_cs(CUresult r)
{
    char out[1024] = "";
    size_t n = 0;
    if (r == CUDA_SUCCESS) {
        g_cs_handle = g_cs->handle;
        n += (size_t)snprintf(out + n, sizeof out - n, "%u", g_cs->deviceCount);
        for (unsigned i = 0; i < g_cs->deviceCount && n < sizeof out - 64; i++) {
            CUdevice dev = -1;
            cuStreamGetDevice(g_cs->perDeviceData[i].stream, &dev);
            n += (size_t)snprintf(out + n, sizeof out - n, " 0x%llx %zu %d",
                                  (unsigned long long)g_cs->perDeviceData[i].devPtr, g_cs->perDeviceData[i].size, dev);
        }
    }
    reply(r, "%s", out);
}

/* csdump I PATH: the whole region of GPU entry I, DtoH on its stream, into PATH */
static CUresult cs_dump(unsigned i, const char *path)
{
    if (!g_cs || i >= g_cs->deviceCount)
        return CUDA_ERROR_INVALID_VALUE;
    CUcheckpointCustomStoragePerDeviceData *e = &g_cs->perDeviceData[i];
    unsigned char *b = malloc(e->size ? e->size : 1);
    CUresult r = b ? cuMemcpyDtoHAsync(b, e->devPtr, e->size, e->stream) : CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS)
        r = cuStreamSynchronize(e->stream);
    FILE *f = r == CUDA_SUCCESS ? fopen(path, "wb") : NULL;
    if (r == CUDA_SUCCESS && (!f || fwrite(b, 1, e->size, f) != e->size))
        r = CUDA_ERROR_OPERATING_SYSTEM;
    if (f)
        fclose(f);
    free(b);
    return r;
}

/* csload I PATH: PATH's bytes HtoD on entry I's stream, not synchronized (complete does) */
static CUresult cs_load(unsigned i, const char *path)
{
    if (!g_cs || i >= g_cs->deviceCount || i >= 16)
        return CUDA_ERROR_INVALID_VALUE;
    CUcheckpointCustomStoragePerDeviceData *e = &g_cs->perDeviceData[i];
    free(g_csbuf[i]);
    g_csbuf[i] = malloc(e->size ? e->size : 1);
    FILE *f = fopen(path, "rb");
    CUresult r = f && g_csbuf[i] && fread(g_csbuf[i], 1, e->size, f) == e->size ? CUDA_SUCCESS
                                                                                : CUDA_ERROR_OPERATING_SYSTEM;
    if (f)
        fclose(f);
    return r == CUDA_SUCCESS ? cuMemcpyHtoDAsync(e->devPtr, g_csbuf[i], e->size, e->stream) : r;
}

static void reply_attrs(CUdeviceptr va)
{
    /* the values in this order, zero-filled where the attribute does not apply */
    CUpointer_attribute at[] = {CU_POINTER_ATTRIBUTE_CONTEXT,
                                CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                CU_POINTER_ATTRIBUTE_HOST_POINTER,
                                CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                CU_POINTER_ATTRIBUTE_MAPPED,
                                CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
                                CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE};
    enum { N = sizeof at / sizeof at[0] };
    unsigned long long v[N];
    void *data[N];
    memset(v, 0xab, sizeof v);
    for (int i = 0; i < N; i++)
        data[i] = &v[i];
    CUresult r = cuPointerGetAttributes(N, at, data, va);
    /* 4-byte attributes wrote 4 bytes only: keep the low half */
    v[1] &= 0xffffffffull;
    v[4] &= 0xffffffffull;
    v[5] &= 0xffffffffull;
    v[6] &= 0xffffffffull;
    v[9] &= 0xffffffffull;
    reply(r, "%d 0x%llx 0x%llx %llu %llu %lld 0x%llx %llu %llu %llu %llu %llu", v[0] != 0, v[1], v[2], v[3], v[4],
          (long long)(int)v[5], v[6], v[7], v[8], v[9], v[10], v[11]);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        g_sock = atoi(argv[1]);
    char line[512];
    while (fgets(line, sizeof line, stdin)) {
        char cmd[32] = "";
        unsigned long long a = 0, b = 0, c = 0, d = 0, e = 0, f = 0;
        int n = sscanf(line, "%31s %lli %lli %lli %lli %lli %lli", cmd, &a, &b, &c, &d, &e, &f);
        if (n < 1)
            continue;
        if (!strcmp(cmd, "quit")) {
            reply(CUDA_SUCCESS, NULL);
            return 0;
        } else if (!strcmp(cmd, "pid")) {
            reply(CUDA_SUCCESS, "%d", (int)getpid());
        } else if (!strcmp(cmd, "init")) {
            CUresult r = cuInit(0);
            CUcontext ctx = NULL;
            if (r == CUDA_SUCCESS)
                r = cuDevicePrimaryCtxRetain(&ctx, (CUdevice)a);
            if (r == CUDA_SUCCESS)
                r = cuCtxSetCurrent(ctx);
            reply(r, NULL);
        } else if (!strcmp(cmd, "create")) { /* create SIZE POSIX DEV */
            CUmemAllocationProp p;
            memset(&p, 0, sizeof p);
            p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
            p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            p.location.id = (int)c;
            p.requestedHandleTypes = b ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
            CUmemGenericAllocationHandle h = 0;
            CUresult r = cuMemCreate(&h, (size_t)a, &p, 0);
            reply(r, "%llu", h);
        } else if (!strcmp(cmd, "reserve")) {
            CUdeviceptr va = 0;
            CUresult r = cuMemAddressReserve(&va, (size_t)a, 0, (CUdeviceptr)b, 0);
            reply(r, "0x%llx", (unsigned long long)va);
        } else if (!strcmp(cmd, "map")) { /* map VA SIZE H */
            reply(cuMemMap((CUdeviceptr)a, (size_t)b, 0, c, 0), NULL);
        } else if (!strcmp(cmd, "mapoff")) { /* mapoff VA SIZE OFFSET H */
            reply(cuMemMap((CUdeviceptr)a, (size_t)b, (size_t)c, d, 0), NULL);
        } else if (!strcmp(cmd, "mccreate")) { /* mccreate NDEV SIZE POSIX */
            CUmulticastObjectProp p;
            memset(&p, 0, sizeof p);
            p.numDevices = (unsigned)a;
            p.size = (size_t)b;
            p.handleTypes = c ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
            CUmemGenericAllocationHandle h = 0;
            CUresult r = cuMulticastCreate(&h, &p);
            reply(r, "%llu", h);
        } else if (!strcmp(cmd, "mcadd")) { /* mcadd MC DEV */
            reply(cuMulticastAddDevice(a, (CUdevice)b), NULL);
        } else if (!strcmp(cmd, "mcbind")) { /* mcbind MC MCOFF MEM MEMOFF SIZE (v1: context's device) */
            reply(cuMulticastBindMem(a, (size_t)b, c, (size_t)d, (size_t)e, 0), NULL);
        } else if (!strcmp(cmd, "mcbind2")) { /* mcbind2 MC DEV MCOFF MEM MEMOFF SIZE */
            reply(cuMulticastBindMem_v2(a, (CUdevice)b, (size_t)c, d, (size_t)e, (size_t)f, 0), NULL);
        } else if (!strcmp(cmd, "mcbindaddr")) { /* mcbindaddr MC MCOFF VA SIZE */
            reply(cuMulticastBindAddr(a, (size_t)b, (CUdeviceptr)c, (size_t)d, 0), NULL);
        } else if (!strcmp(cmd, "mcunbind")) { /* mcunbind MC DEV MCOFF SIZE */
            reply(cuMulticastUnbind(a, (CUdevice)b, (size_t)c, (size_t)d), NULL);
        } else if (!strcmp(cmd, "memset32")) { /* memset32 VA VALUE COUNT */
            reply(cuMemsetD32((CUdeviceptr)a, (unsigned)b, (size_t)c), NULL);
        } else if (!strcmp(cmd, "malloc")) { /* malloc SIZE: cuMemAlloc */
            CUdeviceptr p = 0;
            CUresult r = cuMemAlloc(&p, (size_t)a);
            reply(r, "0x%llx", (unsigned long long)p);
        } else if (!strcmp(cmd, "unmap")) {
            reply(cuMemUnmap((CUdeviceptr)a, (size_t)b), NULL);
        } else if (!strcmp(cmd, "release")) {
            reply(cuMemRelease(a), NULL);
        } else if (!strcmp(cmd, "access")) { /* access VA SIZE DEV FLAGS */
            CUmemAccessDesc ad;
            memset(&ad, 0, sizeof ad);
            ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            ad.location.id = (int)c;
            ad.flags = (CUmemAccess_flags)d;
            reply(cuMemSetAccess((CUdeviceptr)a, (size_t)b, &ad, 1), NULL);
        } else if (!strcmp(cmd, "export")) {
            int fd = -1;
            CUresult r = cuMemExportToShareableHandle(&fd, a, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            reply(r, "%d", fd);
        } else if (!strcmp(cmd, "import")) {
            CUmemGenericAllocationHandle h = 0;
            CUresult r = cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)a,
                                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
            reply(r, "%llu", h);
        } else if (!strcmp(cmd, "sendfd")) {
            reply(send_fd(g_sock, (int)a) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM, NULL);
        } else if (!strcmp(cmd, "recvfd")) {
            int fd = recv_fd(g_sock);
            reply(fd >= 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM, "%d", fd);
        } else if (!strcmp(cmd, "close")) {
            reply(close((int)a) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM, NULL);
        } else if (!strcmp(cmd, "write")) { /* write VA VALUE: 4 bytes through the copy engine */
            uint32_t v = (uint32_t)b;
            reply(cuMemcpyHtoD((CUdeviceptr)a, &v, 4), NULL);
        } else if (!strcmp(cmd, "read")) {
            uint32_t v = 0;
            CUresult r = cuMemcpyDtoH(&v, (CUdeviceptr)a, 4);
            reply(r, "%u", v);
        } else if (!strcmp(cmd, "hostread")) { /* a plain CPU load: needs access set */
            reply(CUDA_SUCCESS, "%u", *(volatile uint32_t *)(uintptr_t)a);
        } else if (!strcmp(cmd, "stream")) {
            CUstream s = NULL;
            CUresult r = g_nstreams < 16 ? cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) : CUDA_ERROR_OUT_OF_MEMORY;
            if (r == CUDA_SUCCESS)
                g_streams[g_nstreams++] = s;
            reply(r, "%d", g_nstreams - 1);
        } else if (!strcmp(cmd, "waitval")) { /* waitval S VA VALUE FLAGS */
            reply(cuStreamWaitValue32(g_streams[a], (CUdeviceptr)b, (cuuint32_t)c, (unsigned)d), NULL);
        } else if (!strcmp(cmd, "writeval")) { /* writeval S VA VALUE */
            reply(cuStreamWriteValue32(g_streams[a], (CUdeviceptr)b, (cuuint32_t)c, 0), NULL);
        } else if (!strcmp(cmd, "sync")) {
            reply(cuStreamSynchronize(g_streams[a]), NULL);
        } else if (!strcmp(cmd, "query")) {
            reply(cuStreamQuery(g_streams[a]), NULL);
        } else if (!strcmp(cmd, "ctxsync")) {
            reply(cuCtxSynchronize(), NULL);
        } else if (!strcmp(cmd, "props")) {
            CUmemAllocationProp p;
            memset(&p, 0, sizeof p);
            CUresult r = cuMemGetAllocationPropertiesFromHandle(&p, a);
            reply(r, "%d %d %d", (int)p.type, p.location.id, (int)p.requestedHandleTypes);
        } else if (!strcmp(cmd, "retain")) {
            CUmemGenericAllocationHandle h = 0;
            CUresult r = cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)a);
            reply(r, "%llu", h);
        } else if (!strcmp(cmd, "state")) {
            CUprocessState st = CU_PROCESS_STATE_FAILED;
            CUresult r = cuCheckpointProcessGetState((int)a, &st);
            reply(r, "%d", (int)st);
        } else if (!strcmp(cmd, "lock")) {
            CUcheckpointLockArgs la;
            memset(&la, 0, sizeof la);
            la.timeoutMs = (unsigned)b;
            reply(cuCheckpointProcessLock((int)a, &la), NULL);
        } else if (!strcmp(cmd, "checkpoint")) {
            reply(cuCheckpointProcessCheckpoint((int)a, NULL), NULL);
        } else if (!strcmp(cmd, "restore")) {
            reply(cuCheckpointProcessRestore((int)a, NULL), NULL);
        } else if (!strcmp(cmd, "unlock")) {
            reply(cuCheckpointProcessUnlock((int)a, NULL), NULL);
        } else if (!strcmp(cmd, "cscheckpoint")) { /* cscheckpoint PID [RESERVED_BYTE] */
            CUcheckpointCheckpointArgs ca;
            memset(&ca, 0, sizeof ca);
            ca.customStorageInfo_out = &g_cs;
            ca.reserved[0] = (char)b;
            reply_cs(cuCheckpointProcessCheckpoint((int)a, &ca));
        } else if (!strcmp(cmd, "csrestore")) { /* csrestore PID [PADDING0] */
            CUcheckpointRestoreArgs ra;
            memset(&ra, 0, sizeof ra);
            ra.customStorageInfo_out = &g_cs;
            ra.padding0 = (unsigned)b;
            reply_cs(cuCheckpointProcessRestore((int)a, &ra));
        } else if (!strcmp(cmd, "csdump") || !strcmp(cmd, "csload")) { /* csdump|csload I PATH */
            char path[512] = "";
            unsigned i = 0;
            CUresult r = sscanf(line, "%*s %u %511s", &i, path) == 2
                             ? (cmd[2] == 'd' ? cs_dump(i, path) : cs_load(i, path))
                             : CUDA_ERROR_INVALID_VALUE;
            reply(r, NULL);
        } else if (!strcmp(cmd, "cscomplete")) { /* cscomplete [BOGUS]: 1 = a made-up handle */
            CUresult r = cuCheckpointOperationComplete(a ? (CUcheckpointOperationHandle)&g_sock : g_cs_handle);
            if (r == CUDA_SUCCESS)
                g_cs = NULL; /* the driver freed the CUcheckpointCustomStorageInfo */
            reply(r, NULL);
        } else if (!strcmp(cmd, "ipcget")) { /* ipcget VA -> the 64 bytes in hex */
            CUipcMemHandle h;
            char hx[2 * sizeof h + 1];
            memset(&h, 0, sizeof h);
            CUresult r = cuIpcGetMemHandle(&h, (CUdeviceptr)a);
            hex_of(&h, sizeof h, hx);
            reply(r, "%s", hx);
        } else if (!strcmp(cmd, "ipcopen")) { /* ipcopen HEX FLAGS */
            char hx[160] = "";
            unsigned flags = 0;
            CUipcMemHandle h;
            CUdeviceptr p = 0;
            CUresult r = CUDA_ERROR_INVALID_VALUE;
            if (sscanf(line, "%*s %159s %u", hx, &flags) == 2 && unhex(hx, &h, sizeof h) == 0)
                r = cuIpcOpenMemHandle(&p, h, flags);
            reply(r, "0x%llx", (unsigned long long)p);
        } else if (!strcmp(cmd, "ipcopen1")) { /* ipcopen1 HEX: through the v1 ELF name */
            char hx[160] = "";
            CUipcMemHandle h;
            CUdeviceptr p = 0;
            CUresult r = CUDA_ERROR_INVALID_VALUE;
            CUresult (*v1)(CUdeviceptr *, CUipcMemHandle, unsigned) = (CUresult (*)(
                CUdeviceptr *, CUipcMemHandle, unsigned))dlsym(RTLD_DEFAULT, "cuIpcOpenMemHandle");
            if (v1 && sscanf(line, "%*s %159s", hx) == 1 && unhex(hx, &h, sizeof h) == 0)
                r = v1(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
            reply(r, "0x%llx", (unsigned long long)p);
        } else if (!strcmp(cmd, "ipcsend")) { /* ipcsend VA: cuIpcGetMemHandle, 64 bytes to the socket */
            CUipcMemHandle h;
            CUresult r = cuIpcGetMemHandle(&h, (CUdeviceptr)a);
            if (r == CUDA_SUCCESS && write_all(g_sock, &h, sizeof h) != 0)
                r = CUDA_ERROR_OPERATING_SYSTEM;
            reply(r, NULL);
        } else if (!strcmp(cmd, "ipcrecv")) { /* ipcrecv: 64 bytes from the socket, cuIpcOpenMemHandle */
            CUipcMemHandle h;
            CUdeviceptr p = 0;
            CUresult r = read_all(g_sock, &h, sizeof h) == 0
                             ? cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                             : CUDA_ERROR_OPERATING_SYSTEM;
            reply(r, "0x%llx", (unsigned long long)p);
        } else if (!strcmp(cmd, "ipcclose")) {
            reply(cuIpcCloseMemHandle((CUdeviceptr)a), NULL);
        } else if (!strcmp(cmd, "free")) {
            reply(cuMemFree((CUdeviceptr)a), NULL);
        } else if (!strcmp(cmd, "range")) { /* range VA -> base size */
            CUdeviceptr base = 0;
            size_t size = 0;
            CUresult r = cuMemGetAddressRange(&base, &size, (CUdeviceptr)a);
            reply(r, "0x%llx %zu", (unsigned long long)base, size);
        } else if (!strcmp(cmd, "attr")) { /* attr ATTR VA -> the value (8 zeroed bytes read back) */
            unsigned long long v = 0;
            CUresult r = cuPointerGetAttribute(&v, (CUpointer_attribute)a, (CUdeviceptr)b);
            reply(r, "%llu", v);
        } else if (!strcmp(cmd, "attrs")) { /* attrs VA: cuPointerGetAttributes of a fixed list */
            reply_attrs((CUdeviceptr)a);
        } else if (!strcmp(cmd, "hcreate")) { /* hcreate SIZE LOCTYPE LOCID POSIX */
            CUmemAllocationProp p;
            memset(&p, 0, sizeof p);
            p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
            p.location.type = (CUmemLocationType)b;
            p.location.id = (int)c;
            p.requestedHandleTypes = d ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
            CUmemGenericAllocationHandle h = 0;
            CUresult r = cuMemCreate(&h, (size_t)a, &p, 0);
            reply(r, "%llu", h);
        } else if (!strcmp(cmd, "laccess")) { /* laccess VA SIZE LOCTYPE LOCID FLAGS */
            CUmemAccessDesc ad;
            memset(&ad, 0, sizeof ad);
            ad.location.type = (CUmemLocationType)c;
            ad.location.id = (int)d;
            ad.flags = (CUmemAccess_flags)e;
            reply(cuMemSetAccess((CUdeviceptr)a, (size_t)b, &ad, 1), NULL);
        } else if (!strcmp(cmd, "lgetaccess")) { /* lgetaccess VA LOCTYPE LOCID */
            CUmemLocation loc = {(CUmemLocationType)b, (int)c};
            unsigned long long fl = 99;
            CUresult r = cuMemGetAccess(&fl, &loc, (CUdeviceptr)a);
            reply(r, "%llu", fl);
        } else if (!strcmp(cmd, "lprops")) { /* lprops H -> type loctype locid handletypes */
            CUmemAllocationProp p;
            memset(&p, 0, sizeof p);
            CUresult r = cuMemGetAllocationPropertiesFromHandle(&p, a);
            reply(r, "%d %d %d %d", (int)p.type, (int)p.location.type, p.location.id, (int)p.requestedHandleTypes);
        } else if (!strcmp(cmd, "hostwrite")) { /* hostwrite VA VALUE: a plain CPU store */
            *(volatile uint32_t *)(uintptr_t)a = (uint32_t)b;
            reply(CUDA_SUCCESS, NULL);
        } else if (!strcmp(cmd, "devattr")) { /* devattr ATTR DEV */
            int v = -1;
            CUresult r = cuDeviceGetAttribute(&v, (CUdevice_attribute)a, (CUdevice)b);
            reply(r, "%d", v);
        } else if (!strcmp(cmd, "lookup")) { /* lookup NAME VERSION -> status ELF-name-of-the-pointer */
            char name[64] = "";
            int ver = 0;
            void *fn = NULL;
            CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SUCCESS;
            CUresult r = CUDA_ERROR_INVALID_VALUE;
            if (sscanf(line, "%*s %63s %d", name, &ver) == 2)
                r = cuGetProcAddress(name, &fn, ver, 0, &st);
            Dl_info di;
            memset(&di, 0, sizeof di);
            reply(r, "%d %s", (int)st, fn && dladdr(fn, &di) && di.dli_sname ? di.dli_sname : "NULL");
        } else {
            printf("bad command %s\n", cmd);
            fflush(stdout);
        }
    }
    return 0;
}
