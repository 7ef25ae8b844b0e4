/* fcshare: a line-driven CUDA driver-API client (fcline.h's protocol) for what PyTorch and NCCL
 * share besides memory (issue 24): events and IPC events, peer context access, memory pools and
 * their IPC, cuMemHostRegister of a shared /dev/shm mapping, and the native checkpoint of another
 * process. Values are numbers (pointers and handles in hex); argv[1] (optional) is a Unix socket
 * fd for evsend/evrecv (the 64-byte CUipcEventHandle), sendfd/recvfd (SCM_RIGHTS) and
 * ptrsend/ptrrecv (the 64-byte CUmemPoolPtrExportData). Linked against libcuda.so.1, or compiled
 * together with fakecuda's sources under ASan/UBSan.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fcline.h"

static int g_sock = -1;
static CUstream g_streams[16];
static int g_nstreams;

typedef unsigned long long u64;

/* One command with up to four numeric arguments and its last word `w` (a path, hex bytes). */
static int run(const char *cmd, u64 a, u64 b, u64 c, u64 d, const char *w)
{
    if (!strcmp(cmd, "init")) { /* init DEV: the device's primary context current */
        CUcontext ctx = NULL;
        CUresult r = cuInit(0);
        if (r == CUDA_SUCCESS)
            r = cuDevicePrimaryCtxRetain(&ctx, (CUdevice)a);
        if (r == CUDA_SUCCESS)
            r = cuCtxSetCurrent(ctx);
        reply(r, "0x%llx", (u64)(uintptr_t)ctx);
    } else if (!strcmp(cmd, "ctx")) { /* ctx DEV: make DEV's primary context current */
        CUcontext ctx = NULL;
        CUresult r = cuDevicePrimaryCtxRetain(&ctx, (CUdevice)a);
        if (r == CUDA_SUCCESS)
            r = cuCtxSetCurrent(ctx);
        reply(r, "0x%llx", (u64)(uintptr_t)ctx);
    } else if (!strcmp(cmd, "noctx")) {
        reply(cuCtxSetCurrent(NULL), NULL);
    } else if (!strcmp(cmd, "pid")) {
        reply(CUDA_SUCCESS, "%d", (int)getpid());
    } else if (!strcmp(cmd, "stream")) { /* stream -> index; stream 0 of a context is NULL: use -1 */
        CUstream s = NULL;
        CUresult r = g_nstreams < 16 ? cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) : CUDA_ERROR_OUT_OF_MEMORY;
        if (r == CUDA_SUCCESS)
            g_streams[g_nstreams++] = s;
        reply(r, "%d", g_nstreams - 1);
    } else if (!strcmp(cmd, "malloc")) {
        CUdeviceptr p = 0;
        CUresult r = cuMemAlloc(&p, (size_t)a);
        reply(r, "0x%llx", (u64)p);
    } else if (!strcmp(cmd, "vmm")) { /* vmm SIZE DEV: cuMemCreate on DEV, mapped, access for DEV only */
        CUmemAllocationProp pr;
        memset(&pr, 0, sizeof pr);
        pr.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        pr.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        pr.location.id = (int)b;
        CUmemGenericAllocationHandle h = 0;
        CUdeviceptr va = 0;
        CUmemAccessDesc ad = {{CU_MEM_LOCATION_TYPE_DEVICE, (int)b}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        CUresult r = cuMemCreate(&h, (size_t)a, &pr, 0);
        if (r == CUDA_SUCCESS)
            r = cuMemAddressReserve(&va, (size_t)a, 0, 0, 0);
        if (r == CUDA_SUCCESS)
            r = cuMemMap(va, (size_t)a, 0, h, 0);
        if (r == CUDA_SUCCESS)
            r = cuMemSetAccess(va, (size_t)a, &ad, 1);
        reply(r, "0x%llx", (u64)va);
    } else if (!strcmp(cmd, "vmmtypes")) { /* vmmtypes SIZE TYPES: cuMemCreate with requestedHandleTypes */
        CUmemAllocationProp pr;
        memset(&pr, 0, sizeof pr);
        pr.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        pr.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        pr.requestedHandleTypes = (CUmemAllocationHandleType)b;
        CUmemGenericAllocationHandle h = 0;
        CUresult r = cuMemCreate(&h, (size_t)a, &pr, 0);
        reply(r, "0x%llx", (u64)h);
    } else if (!strcmp(cmd, "importfabric")) { /* importfabric: a made-up FABRIC handle */
        CUmemFabricHandle fh;
        memset(&fh, 0x5a, sizeof fh);
        CUmemGenericAllocationHandle h = 0;
        reply(cuMemImportFromShareableHandle(&h, &fh, CU_MEM_HANDLE_TYPE_FABRIC), "0x%llx", (u64)h);
    } else if (!strcmp(cmd, "write")) { /* write VA VALUE: 4 bytes, cuMemcpyHtoD */
        uint32_t v = (uint32_t)b;
        reply(cuMemcpyHtoD((CUdeviceptr)a, &v, 4), NULL);
    } else if (!strcmp(cmd, "read")) {
        uint32_t v = 0;
        CUresult r = cuMemcpyDtoH(&v, (CUdeviceptr)a, 4);
        reply(r, "%u", v);
    } else if (!strcmp(cmd, "hostwrite")) { /* hostwrite VA VALUE: a plain CPU store */
        *(volatile uint32_t *)(uintptr_t)a = (uint32_t)b;
        reply(CUDA_SUCCESS, NULL);
    } else if (!strcmp(cmd, "hostread")) {
        reply(CUDA_SUCCESS, "%u", *(volatile uint32_t *)(uintptr_t)a);
    } else if (!strcmp(cmd, "writeval")) { /* writeval S VA VALUE: the device writes (stream memop) */
        reply(cuStreamWriteValue32(g_streams[a], (CUdeviceptr)b, (cuuint32_t)c, 0), NULL);
    } else if (!strcmp(cmd, "waitval")) { /* waitval S VA VALUE: the stream waits for VA >= VALUE */
        reply(cuStreamWaitValue32(g_streams[a], (CUdeviceptr)b, (cuuint32_t)c, CU_STREAM_WAIT_VALUE_GEQ), NULL);
    } else if (!strcmp(cmd, "sync")) {
        reply(cuStreamSynchronize(g_streams[a]), NULL);
    } else if (!strcmp(cmd, "query")) {
        reply(cuStreamQuery(g_streams[a]), NULL);
    } else if (!strcmp(cmd, "memget")) { /* memget VA: cuIpcGetMemHandle -> the 64 bytes in hex */
        CUipcMemHandle h;
        char hex[2 * CU_IPC_HANDLE_SIZE + 1] = "";
        CUresult r = cuIpcGetMemHandle(&h, (CUdeviceptr)a);
        if (r == CUDA_SUCCESS)
            hex_of(&h, sizeof h, hex);
        reply(r, "%s", hex);
    } else if (!strcmp(cmd, "evcreate")) { /* evcreate FLAGS */
        CUevent e = NULL;
        CUresult r = cuEventCreate(&e, (unsigned)a);
        reply(r, "0x%llx", (u64)(uintptr_t)e);
    } else if (!strcmp(cmd, "evrecord")) { /* evrecord E S [FLAGS]: S -1 = the NULL stream */
        CUstream s = (long long)b < 0 ? NULL : g_streams[b];
        reply(
            c ? cuEventRecordWithFlags((CUevent)(uintptr_t)a, s, (unsigned)c) : cuEventRecord((CUevent)(uintptr_t)a, s),
            NULL);
    } else if (!strcmp(cmd, "evrecordf")) { /* evrecordf E S FLAGS: cuEventRecordWithFlags always */
        reply(cuEventRecordWithFlags((CUevent)(uintptr_t)a, g_streams[b], (unsigned)c), NULL);
    } else if (!strcmp(cmd, "evwait")) { /* evwait S E [FLAGS]: cuStreamWaitEvent */
        reply(cuStreamWaitEvent(g_streams[a], (CUevent)(uintptr_t)b, (unsigned)c), NULL);
    } else if (!strcmp(cmd, "evquery")) {
        reply(cuEventQuery((CUevent)(uintptr_t)a), NULL);
    } else if (!strcmp(cmd, "evsync")) {
        reply(cuEventSynchronize((CUevent)(uintptr_t)a), NULL);
    } else if (!strcmp(cmd, "evdestroy")) {
        reply(cuEventDestroy((CUevent)(uintptr_t)a), NULL);
    } else if (!strcmp(cmd, "evget")) { /* evget E -> the 64 handle bytes in hex */
        CUipcEventHandle h;
        char hex[2 * CU_IPC_HANDLE_SIZE + 1] = "";
        CUresult r = cuIpcGetEventHandle(&h, (CUevent)(uintptr_t)a);
        if (r == CUDA_SUCCESS)
            hex_of(&h, sizeof h, hex);
        reply(r, "%s", hex);
    } else if (!strcmp(cmd, "evopen")) { /* evopen HEX */
        CUipcEventHandle h;
        CUevent e = NULL;
        CUresult r = unhex(w, &h, sizeof h) == 0 ? cuIpcOpenEventHandle(&e, h) : CUDA_ERROR_INVALID_VALUE;
        reply(r, "0x%llx", (u64)(uintptr_t)e);
    } else if (!strcmp(cmd, "evsend")) { /* evsend E: the handle to the socket */
        CUipcEventHandle h;
        CUresult r = cuIpcGetEventHandle(&h, (CUevent)(uintptr_t)a);
        if (r == CUDA_SUCCESS && write_all(g_sock, &h, sizeof h) != 0)
            r = CUDA_ERROR_OPERATING_SYSTEM;
        reply(r, NULL);
    } else if (!strcmp(cmd, "evrecv")) { /* evrecv: a handle from the socket, opened */
        CUipcEventHandle h;
        CUevent e = NULL;
        CUresult r = read_all(g_sock, &h, sizeof h) == 0 ? cuIpcOpenEventHandle(&e, h) : CUDA_ERROR_OPERATING_SYSTEM;
        reply(r, "0x%llx", (u64)(uintptr_t)e);
    } else if (!strcmp(cmd, "canpeer")) { /* canpeer DEV PEER */
        int can = -1;
        CUresult r = cuDeviceCanAccessPeer(&can, (CUdevice)a, (CUdevice)b);
        reply(r, "%d", can);
    } else if (!strcmp(cmd, "peeren")) { /* peeren CTX [FLAGS] */
        reply(cuCtxEnablePeerAccess((CUcontext)(uintptr_t)a, (unsigned)b), NULL);
    } else if (!strcmp(cmd, "peerdis")) {
        reply(cuCtxDisablePeerAccess((CUcontext)(uintptr_t)a), NULL);
    } else if (!strcmp(cmd, "poolcreate")) { /* poolcreate DEV POSIX MAXSIZE */
        CUmemPoolProps p;
        memset(&p, 0, sizeof p);
        p.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        p.handleTypes = b ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
        p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        p.location.id = (int)a;
        p.maxSize = (size_t)c;
        CUmemoryPool pool = NULL;
        CUresult r = cuMemPoolCreate(&pool, &p);
        reply(r, "0x%llx", (u64)(uintptr_t)pool);
    } else if (!strcmp(cmd, "pooldestroy")) {
        reply(cuMemPoolDestroy((CUmemoryPool)(uintptr_t)a), NULL);
    } else if (!strcmp(cmd, "poolalloc")) { /* poolalloc POOL SIZE S */
        CUdeviceptr p = 0;
        CUresult r = cuMemAllocFromPoolAsync(&p, (size_t)b, (CUmemoryPool)(uintptr_t)a, g_streams[c]);
        reply(r, "0x%llx", (u64)p);
    } else if (!strcmp(cmd, "poolfree")) { /* poolfree VA S */
        reply(cuMemFreeAsync((CUdeviceptr)a, g_streams[b]), NULL);
    } else if (!strcmp(cmd, "poolexport")) {
        int fd = -1;
        CUresult r = cuMemPoolExportToShareableHandle(&fd, (CUmemoryPool)(uintptr_t)a,
                                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        reply(r, "%d", fd);
    } else if (!strcmp(cmd, "poolimport")) { /* poolimport FD */
        CUmemoryPool pool = NULL;
        CUresult r = cuMemPoolImportFromShareableHandle(&pool, (void *)(uintptr_t)a,
                                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        reply(r, "0x%llx", (u64)(uintptr_t)pool);
    } else if (!strcmp(cmd, "ptrsend")) { /* ptrsend VA: the export data to the socket */
        CUmemPoolPtrExportData x;
        CUresult r = cuMemPoolExportPointer(&x, (CUdeviceptr)a);
        if (r == CUDA_SUCCESS && write_all(g_sock, &x, sizeof x) != 0)
            r = CUDA_ERROR_OPERATING_SYSTEM;
        reply(r, NULL);
    } else if (!strcmp(cmd, "ptrrecv")) { /* ptrrecv POOL: export data from the socket, imported */
        CUmemPoolPtrExportData x;
        CUdeviceptr p = 0;
        CUresult r = read_all(g_sock, &x, sizeof x) == 0 ? cuMemPoolImportPointer(&p, (CUmemoryPool)(uintptr_t)a, &x)
                                                         : CUDA_ERROR_OPERATING_SYSTEM;
        reply(r, "0x%llx", (u64)p);
    } else if (!strcmp(cmd, "sendfd")) {
        reply(send_fd(g_sock, (int)a) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM, NULL);
    } else if (!strcmp(cmd, "recvfd")) {
        int fd = recv_fd(g_sock);
        reply(fd >= 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM, "%d", fd);
    } else if (!strcmp(cmd, "shm")) { /* shm SIZE PATH: create, map shared, unlink (NCCL's SHM) */
        int fd = open(w, O_CREAT | O_RDWR | O_CLOEXEC, 0600);
        void *p = fd >= 0 && ftruncate(fd, (off_t)a) == 0
                      ? mmap(NULL, (size_t)a, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                      : MAP_FAILED;
        if (fd >= 0)
            close(fd);
        unlink(w);
        reply(p == MAP_FAILED ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_SUCCESS, "0x%llx", (u64)(uintptr_t)p);
    } else if (!strcmp(cmd, "hostreg")) { /* hostreg VA SIZE FLAGS */
        reply(cuMemHostRegister((void *)(uintptr_t)a, (size_t)b, (unsigned)c), NULL);
    } else if (!strcmp(cmd, "hostunreg")) {
        reply(cuMemHostUnregister((void *)(uintptr_t)a), NULL);
    } else if (!strcmp(cmd, "lock")) { /* lock PID: native checkpoint of another process */
        CUcheckpointLockArgs la;
        memset(&la, 0, sizeof la);
        reply(cuCheckpointProcessLock((int)a, &la), NULL);
    } else if (!strcmp(cmd, "checkpoint")) {
        reply(cuCheckpointProcessCheckpoint((int)a, NULL), NULL);
    } else if (!strcmp(cmd, "restore")) {
        reply(cuCheckpointProcessRestore((int)a, NULL), NULL);
    } else if (!strcmp(cmd, "unlock")) {
        reply(cuCheckpointProcessUnlock((int)a, NULL), NULL);
    } else if (!strcmp(cmd, "quit")) {
        reply(CUDA_SUCCESS, NULL);
        return 1;
    } else {
        reply(CUDA_ERROR_NOT_SUPPORTED, NULL);
    }
    (void)d;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        g_sock = atoi(argv[1]);
    char line[512];
    while (fgets(line, sizeof line, stdin)) {
        /* the command, up to four numbers (strtoull base 0: decimal or 0x-hex), and the last
         * word in `w` (a path, hex bytes: the commands that take one read only it) */
        char *tok[8] = {0}, *save = NULL;
        int nt = 0;
        for (char *t = strtok_r(line, " \n", &save); t && nt < 8; t = strtok_r(NULL, " \n", &save))
            tok[nt++] = t;
        if (nt < 1)
            continue;
        u64 v[4] = {0, 0, 0, 0};
        for (int i = 1; i < nt && i <= 4; i++)
            v[i - 1] = strtoull(tok[i], NULL, 0);
        if (run(tok[0], v[0], v[1], v[2], v[3], tok[nt - 1]))
            return 0;
    }
    return 0;
}
