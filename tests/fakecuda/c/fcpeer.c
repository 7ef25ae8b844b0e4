/* fcpeer: a line-driven CUDA driver-API client for multi-process fakecuda tests.
 *
 * Reads one command per line on stdin and answers one line on stdout: "ok [values]" or
 * "err <CUresult name>". Up to six numeric arguments per command. argv[1] (optional) is a Unix socket fd used by
 * sendfd/recvfd (SCM_RIGHTS). Linked directly against libcuda.so.1 (the ELF names, no resolver).
 */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int g_sock = -1;
static CUstream g_streams[16];
static int g_nstreams;

static void reply(CUresult r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#include <stdarg.h>
static void reply(CUresult r, const char *fmt, ...)
{
    if (r != CUDA_SUCCESS) {
        const char *n = NULL;
        cuGetErrorName(r, &n);
        printf("err %s\n", n ? n : "?");
    } else {
        printf("ok");
        if (fmt && *fmt) {
            va_list ap;
            va_start(ap, fmt);
            putchar(' ');
            vprintf(fmt, ap);
            va_end(ap);
        }
        putchar('\n');
    }
    fflush(stdout);
}

static int send_fd(int sock, int fd)
{
    char c = 'F';
    struct iovec iov = {&c, 1};
    char cbuf[CMSG_SPACE(sizeof(int))];
    memset(cbuf, 0, sizeof cbuf);
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    return sendmsg(sock, &m, 0) == 1 ? 0 : -1;
}

static int recv_fd(int sock)
{
    char c;
    struct iovec iov = {&c, 1};
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    if (recvmsg(sock, &m, 0) != 1)
        return -1;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    if (!cm || cm->cmsg_type != SCM_RIGHTS)
        return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(cm), sizeof fd);
    return fd;
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
        } else {
            printf("bad command %s\n", cmd);
            fflush(stdout);
        }
    }
    return 0;
}
