/*
 * util.c: the lowest layer (util.h): CUresult names (fallback table), allocation ids,
 * clocks, warnings, control paths, protocol.h names, socket I/O, the hash table. Calls
 * nothing else of the shim.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

static const struct {
  int code;
  const char *name;
} k_names[] = {
  {0, "CUDA_SUCCESS"},
  {1, "CUDA_ERROR_INVALID_VALUE"},
  {2, "CUDA_ERROR_OUT_OF_MEMORY"},
  {3, "CUDA_ERROR_NOT_INITIALIZED"},
  {4, "CUDA_ERROR_DEINITIALIZED"},
  {101, "CUDA_ERROR_INVALID_DEVICE"},
  {201, "CUDA_ERROR_INVALID_CONTEXT"},
  {208, "CUDA_ERROR_ALREADY_MAPPED"},
  {211, "CUDA_ERROR_NOT_MAPPED"},
  {400, "CUDA_ERROR_INVALID_HANDLE"},
  {401, "CUDA_ERROR_ILLEGAL_STATE"},
  {500, "CUDA_ERROR_NOT_FOUND"},
  {600, "CUDA_ERROR_NOT_READY"},
  {700, "CUDA_ERROR_ILLEGAL_ADDRESS"},
  {800, "CUDA_ERROR_NOT_PERMITTED"},
  {801, "CUDA_ERROR_NOT_SUPPORTED"},
  {802, "CUDA_ERROR_SYSTEM_NOT_READY"},
  {999, "CUDA_ERROR_UNKNOWN"},
};

const char *cui_cu_error_fallback(CUresult r) {
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

/* "cuinterpose[<pid>]: <message>" as one write to stderr. */
__attribute__((format(printf, 1, 2))) static void cui_warn(const char *fmt, ...) {
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

int cui_claim_path(uint32_t pid, char *out, size_t cap) {
  int n = snprintf(out, cap, "%s/" CUI_SOCKET_PREFIX "%u" CUI_CLAIM_SUFFIX, cui_control_dir(), pid);
  return (n < 0 || (size_t)n >= cap) ? -1 : 0;
}

const char *cui_phase_name(uint32_t p) {
  switch (p) {
    case CUI_PHASE_ACTIVE: return "ACTIVE";
    case CUI_PHASE_SAVED: return "SAVED";
    case CUI_PHASE_PREPARED: return "PREPARED";
    case CUI_PHASE_LOADED: return "LOADED";
    case CUI_PHASE_MULTICAST_RELEASED: return "MULTICAST_RELEASED";
    case CUI_PHASE_MULTICAST_CREATED: return "MULTICAST_CREATED";
    case CUI_PHASE_MULTICAST_IMPORTED: return "MULTICAST_IMPORTED";
    case CUI_PHASE_MULTICAST_DEVICES: return "MULTICAST_DEVICES";
    case CUI_PHASE_FAILED: return "FAILED";
  }
  return "UNKNOWN";
}

const char *cui_op_name(uint32_t op) {
  switch (op) {
#define CUI_OP_NAME_CASE(op, needs, leaves, mutating, copies_bytes) \
  case CUI_OP_##op: return #op;
    CUI_OPS(CUI_OP_NAME_CASE)
#undef CUI_OP_NAME_CASE
  }
  return "UNKNOWN";
}

void cui_api_warn_in(uint32_t phase, const char *api, const char *fmt, ...) {
  char buf[640];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  cui_warn("%s: pid %d (phase %s): %s", api, (int)getpid(), cui_phase_name(phase), buf);
}

/* ---------- socket I/O ---------- */

void cui_set_io_timeouts(int fd) {
  struct timeval tv = {CUI_IO_TIMEOUT_S, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

int cui_read_full(int fd, void *buf, size_t n) {
  char *p = buf;
  while (n) {
    ssize_t k = recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

int cui_write_full(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

/* ---------- hash table ---------- */

struct cui_key cui_id_key(const uint8_t id[16], uint32_t pid) {
  struct cui_key k;
  memcpy(&k.a, id, 8);
  memcpy(&k.b, id + 8, 8);
  k.c = pid;
  return k;
}

static uint32_t key_hash(struct cui_key k) {
  uint64_t h = (k.a ^ (k.b * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)k.c << 17)) * 0xBF58476D1CE4E5B9ull;
  return (uint32_t)(h >> 32);
}

static int key_eq(struct cui_key x, struct cui_key y) { return x.a == y.a && x.b == y.b && x.c == y.c; }

uint32_t *cui_tab_get(const struct cui_tab *t, struct cui_key k) {
  if (!t->cap) return NULL;
  for (uint32_t i = key_hash(k) & (t->cap - 1);; i = (i + 1) & (t->cap - 1)) {
    if (!t->s[i].used) return NULL;
    if (key_eq(t->s[i].k, k)) return &t->s[i].val;
  }
}

static void tab_insert(struct cui_tab *t, struct cui_key k, uint32_t val) {
  uint32_t i = key_hash(k) & (t->cap - 1);
  while (t->s[i].used) i = (i + 1) & (t->cap - 1);
  t->s[i].k = k;
  t->s[i].val = val;
  t->s[i].used = 1;
  t->n++;
}

int cui_tab_put(struct cui_tab *t, struct cui_key k, uint32_t val) {
  uint32_t *v = cui_tab_get(t, k);
  if (v) {
    *v = val;
    return 0;
  }
  if (2 * (t->n + 1) > t->cap) {
    uint32_t cap = t->cap ? 2 * t->cap : 64;
    struct cui_tslot *s = calloc(cap, sizeof *s);
    if (!s) return -1;
    struct cui_tab old = *t;
    t->s = s;
    t->cap = cap;
    t->n = 0;
    for (uint32_t i = 0; i < old.cap; i++)
      if (old.s[i].used) tab_insert(t, old.s[i].k, old.s[i].val);
    free(old.s);
  }
  tab_insert(t, k, val);
  return 0;
}

void cui_tab_del(struct cui_tab *t, struct cui_key k) {
  if (!t->cap) return;
  uint32_t mask = t->cap - 1, i = key_hash(k) & mask;
  while (t->s[i].used && !key_eq(t->s[i].k, k)) i = (i + 1) & mask;
  if (!t->s[i].used) return;
  /* backward shift: move later members of the probe run into the hole */
  for (uint32_t j = (i + 1) & mask; t->s[j].used; j = (j + 1) & mask) {
    uint32_t home = key_hash(t->s[j].k) & mask;
    if (((j - home) & mask) >= ((j - i) & mask)) {
      t->s[i] = t->s[j];
      i = j;
    }
  }
  t->s[i].used = 0;
  t->n--;
}
