/* fcline.h: the line protocol of the fakecuda test clients (fcpeer.c, fcshare.c): one command a
 * line on stdin, one answer a line on stdout, "ok [values]" or "err <CUresult name>"; and the
 * socket helpers they share (SCM_RIGHTS, whole reads and writes, hex). Static functions: each
 * client includes it once. */
#ifndef FCLINE_H
#define FCLINE_H
#include <cuda.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void reply(CUresult r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
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

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t k = write(fd, c, n);
        if (k <= 0)
            return -1;
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n)
{
    char *c = p;
    while (n) {
        ssize_t k = read(fd, c, n);
        if (k <= 0)
            return -1;
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

static void hex_of(const void *p, size_t n, char *out)
{
    for (size_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", ((const unsigned char *)p)[i]);
}

static int unhex(const char *s, void *p, size_t n)
{
    if (strlen(s) != 2 * n)
        return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(s + 2 * i, "%2x", &v) != 1)
            return -1;
        ((unsigned char *)p)[i] = (unsigned char)v;
    }
    return 0;
}

#endif
