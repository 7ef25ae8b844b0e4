/* Small helpers: CUresult names, allocation ids, clocks, paths, warnings. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "cui.h"

static const struct { int code; const char *name; } k_names[] = {
  {0, "CUDA_SUCCESS"}, {1, "CUDA_ERROR_INVALID_VALUE"}, {2, "CUDA_ERROR_OUT_OF_MEMORY"},
  {3, "CUDA_ERROR_NOT_INITIALIZED"}, {4, "CUDA_ERROR_DEINITIALIZED"},
  {101, "CUDA_ERROR_INVALID_DEVICE"}, {201, "CUDA_ERROR_INVALID_CONTEXT"},
  {208, "CUDA_ERROR_ALREADY_MAPPED"}, {211, "CUDA_ERROR_NOT_MAPPED"},
  {400, "CUDA_ERROR_INVALID_HANDLE"}, {401, "CUDA_ERROR_ILLEGAL_STATE"},
  {500, "CUDA_ERROR_NOT_FOUND"}, {600, "CUDA_ERROR_NOT_READY"},
  {700, "CUDA_ERROR_ILLEGAL_ADDRESS"}, {800, "CUDA_ERROR_NOT_PERMITTED"},
  {801, "CUDA_ERROR_NOT_SUPPORTED"}, {802, "CUDA_ERROR_SYSTEM_NOT_READY"},
  {999, "CUDA_ERROR_UNKNOWN"},
};

const char *cui_cu_error_name(CUresult r) {
  CUresult (*real)(CUresult, const char **) = (CUresult (*)(CUresult, const char **))cui_real(CUI_ROW_cuGetErrorName);
  const char *s = NULL;
  if (real && real(r, &s) == CUDA_SUCCESS && s) return s;
  for (size_t i = 0; i < sizeof k_names / sizeof k_names[0]; i++)
    if (k_names[i].code == (int)r) return k_names[i].name;
  return "CUDA_ERROR_UNKNOWN";
}

void cui_random_id(uint8_t id[16]) {
  size_t got = 0;
  while (got < 16) {
    ssize_t n = getrandom(id + got, 16 - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      /* no entropy source: fall back to time and a counter (ids only need uniqueness) */
      static uint64_t ctr;
      uint64_t a = cui_now_ns(), b = __atomic_add_fetch(&ctr, 1, __ATOMIC_RELAXED) ^ ((uint64_t)getpid() << 32);
      memcpy(id, &a, 8);
      memcpy(id + 8, &b, 8);
      return;
    }
    got += (size_t)n;
  }
}

void cui_hex_id(const uint8_t id[16], char out[33]) {
  static const char hx[] = "0123456789abcdef";
  for (int i = 0; i < 16; i++) {
    out[2 * i] = hx[id[i] >> 4];
    out[2 * i + 1] = hx[id[i] & 15];
  }
  out[32] = 0;
}

uint64_t cui_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void cui_warn(const char *fmt, ...) {
  char buf[768];
  int n = snprintf(buf, sizeof buf, "cuinterpose[%d]: ", (int)getpid());
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
  va_end(ap);
  size_t len = strlen(buf);
  buf[len++] = '\n';
  ssize_t w = write(2, buf, len);
  (void)w;
}

const char *cui_control_dir(void) {
  const char *d = getenv("CUINTERPOSE_CONTROL_DIR");
  return (d && *d) ? d : CUI_DEFAULT_CONTROL_DIR;
}

int cui_socket_path(uint32_t pid, char *out, size_t cap) {
  size_t lim = sizeof(((struct sockaddr_un *)0)->sun_path);
  if (cap < lim) lim = cap;
  int n = snprintf(out, lim, "%s/" CUI_SOCKET_PREFIX "%u.sock", cui_control_dir(), pid);
  return (n < 0 || (size_t)n >= lim) ? -1 : 0;
}
