/* Chaos kind 6 (tests/chaos/test_fuzz.py): a seeded, bounded fuzz of the shim's control decoder,
 * run as a shim'd fakecuda app under ASan/UBSan (shim, fakecuda and this driver instrumented).
 *
 * usage: fuzz_control SEED N
 * Sets up one exportable allocation (POSIX file descriptor handle type), mapped and filled with
 * a pattern, then sends N requests to its own control socket, one connection each: fully
 * random 64 bytes, a valid INSPECT with one byte flipped, a valid header cut short (then
 * shutdown), a request with up to 256 extra bytes, a wrong version, an unknown op. A request
 * that names a mutating op with the right magic and version carries an impossible expected
 * phase, so the fuzz never moves the shim (protocol.h "Request rules"). Every reply must be a
 * well-formed cui_reply (magic, version, lengths within 32 MiB, the op echoed unless
 * CUI_BAD_REQUEST) or the connection closed. Afterwards INSPECT must answer CUI_OK with the
 * records, and a full cycle SAVE_ALLOCATIONS -> PREPARE_UNICAST -> LOAD_ALLOCATIONS ->
 * RESTORE_UNICAST (the carriers in memfd chunk files, tests/shim/c/carry.h) must succeed with
 * the allocation's bytes equal to the pattern.
 * Prints "fuzz: seed S requests N replies R closed C" and exits 0, or names the failure
 * (exit 1). Every socket wait has a 120 s deadline (SO_RCVTIMEO). */
#define _GNU_SOURCE /* memfd_create (carry.h) */
#include <cuda.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "cuinterpose/protocol.h"

#include "../../shim/c/carry.h" /* SAVE/LOAD carry memfd chunk files (protocol.h "Carriers") */

#define CHECK(cond, ...)                                         \
  do {                                                           \
    if (!(cond)) {                                               \
      fprintf(stderr, "fuzz: FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                              \
      fprintf(stderr, "\n");                                     \
      exit(1);                                                   \
    }                                                            \
  } while (0)
#define CU(call)                                          \
  do {                                                    \
    CUresult r_ = (call);                                 \
    CHECK(r_ == CUDA_SUCCESS, "%s = %d", #call, (int)r_); \
  } while (0)

static struct sockaddr_un g_sa;

static int connect_self(void) {
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  CHECK(s >= 0, "socket: %s", strerror(errno));
  struct timeval tv = {.tv_sec = 120};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  CHECK(connect(s, (struct sockaddr *)&g_sa, sizeof g_sa) == 0, "connect %s: %s", g_sa.sun_path, strerror(errno));
  return s;
}

/* Read exactly n bytes; returns the count read (< n: closed). Fails on a timeout. */
static size_t read_n(int s, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t k = recv(s, (char *)buf + got, n - got, 0);
    if (k == 0 || (k < 0 && (errno == ECONNRESET || errno == EPIPE))) break;
    CHECK(k > 0, "recv: %s (no reply within 120 s?)", strerror(errno));
    got += (size_t)k;
  }
  return got;
}

/* The records of the last INSPECT that request() made (its carriers for SAVE/LOAD) */
static struct cui_record g_recs[64];
static uint32_t g_nrecs;
static int g_keep_records;
static int g_carry_fds[8] = {-1, -1, -1, -1, -1, -1, -1, -1};

/* 1: a well-formed reply read whole; 0: the connection closed before a header. With
 * g_keep_records, its records (up to 64) are kept in g_recs. */
static int check_reply(int s, uint16_t op, struct cui_reply *out) {
  struct cui_reply r;
  size_t got = read_n(s, &r, sizeof r);
  if (got == 0) return 0;
  CHECK(got == sizeof r, "reply header cut at %zu bytes", got);
  CHECK(r.magic == CUI_PROTO_MAGIC && r.version == CUI_PROTO_VERSION, "reply magic %#x version %u", r.magic, r.version);
  CHECK(r.status == CUI_BAD_REQUEST || r.op == op, "reply op %u for op %u (status %d)", r.op, op, r.status);
  uint64_t body = (uint64_t)r.record_count * r.record_size + r.message_len;
  CHECK(body <= (32u << 20), "reply announces %llu bytes", (unsigned long long)body);
  static char sink[1 << 16];
  if (g_keep_records && r.record_size == sizeof(struct cui_record)) {
    g_nrecs = r.record_count < 64 ? r.record_count : 64;
    size_t k = (size_t)g_nrecs * sizeof(struct cui_record);
    CHECK(read_n(s, g_recs, k) == k, "reply records cut");
    body -= k;
  }
  while (body) {
    size_t k = body < sizeof sink ? (size_t)body : sizeof sink;
    CHECK(read_n(s, sink, k) == k, "reply body cut");
    body -= k;
  }
  if (out) *out = r;
  return 1;
}

static struct cui_reply request(uint16_t op, uint64_t txn, uint32_t phase) {
  struct cui_request q;
  memset(&q, 0, sizeof q);
  q.magic = CUI_PROTO_MAGIC;
  q.version = CUI_PROTO_VERSION;
  q.op = op;
  q.txn_id = txn;
  q.expected_phase = phase;
  q.sender_pid = (uint32_t)getpid();
  memcpy(q.claim, CUI_TEST_CLAIM, sizeof q.claim); /* the claim main() took (carry.h) */
  int s = connect_self();
  if (op == CUI_OP_SAVE_ALLOCATIONS || op == CUI_OP_LOAD_ALLOCATIONS)
    CHECK(cui_test_send_carriers(s, &q, g_recs, g_nrecs, g_carry_fds) == 0, "send carriers: %s", strerror(errno));
  else CHECK(send(s, &q, sizeof q, MSG_NOSIGNAL) == (ssize_t)sizeof q, "send: %s", strerror(errno));
  struct cui_reply r;
  g_keep_records = op == CUI_OP_INSPECT;
  CHECK(check_reply(s, op, &r), "op %u: connection closed without a reply", op);
  g_keep_records = 0;
  close(s);
  return r;
}

static unsigned next(unsigned *st) { return (unsigned)rand_r(st); }

int main(int argc, char **argv) {
  CHECK(argc == 3, "usage: fuzz_control SEED N");
  unsigned seed = (unsigned)strtoul(argv[1], NULL, 10), st = seed;
  long n = strtol(argv[2], NULL, 10);
  CUdevice dev;
  CUcontext ctx;
  CU(cuInit(0));
  CU(cuDeviceGet(&dev, 0));
  CU(cuDevicePrimaryCtxRetain(&ctx, dev));
  CU(cuCtxSetCurrent(ctx));
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  size_t gran;
  CU(cuMemGetAllocationGranularity(&gran, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemGenericAllocationHandle h;
  CU(cuMemCreate(&h, gran, &p, 0));
  CUdeviceptr va;
  CU(cuMemAddressReserve(&va, gran, 0, 0, 0));
  CU(cuMemMap(va, gran, 0, h, 0));
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU(cuMemSetAccess(va, gran, &d, 1));
  unsigned char *want = malloc(gran), *got = malloc(gran);
  CHECK(want && got, "malloc");
  for (size_t i = 0; i < gran; i++) want[i] = (unsigned char)(i * 131 + seed);
  CU(cuMemcpyHtoD(va, want, gran));

  g_sa.sun_family = AF_UNIX;
  snprintf(g_sa.sun_path, sizeof g_sa.sun_path, "%s/cuinterpose-%d.sock", getenv("CUINTERPOSE_CONTROL_DIR"),
           (int)getpid());
  CHECK(cui_test_claim((int)getpid()) == 0, "claim: %s", strerror(errno));
  long replies = 0, closed = 0;
  for (long i = 0; i < n; i++) {
    unsigned char buf[64 + 256];
    struct cui_request q;
    memset(&q, 0, sizeof q);
    q.magic = CUI_PROTO_MAGIC;
    q.version = CUI_PROTO_VERSION;
    q.op = CUI_OP_INSPECT;
    q.sender_pid = (uint32_t)getpid();
    size_t len = sizeof q;
    int shape = (int)(next(&st) % 6);
    memcpy(buf, &q, sizeof q);
    if (shape == 0) {
      for (size_t k = 0; k < 64; k++) buf[k] = (unsigned char)next(&st);
    } else if (shape == 1) {
      buf[next(&st) % 64] ^= (unsigned char)(1 + next(&st) % 255);
    } else if (shape == 2) {
      len = next(&st) % 64;
    } else if (shape == 3) {
      len = 64 + 1 + next(&st) % 256;
      for (size_t k = 64; k < len; k++) buf[k] = (unsigned char)next(&st);
    } else if (shape == 4) {
      struct cui_request *w = (struct cui_request *)buf;
      w->version = (uint16_t)(CUI_PROTO_VERSION + 1 + next(&st) % 1000);
    } else {
      ((struct cui_request *)buf)->op = (uint16_t)(1000 + next(&st) % 60000);
    }
    struct cui_request *w = (struct cui_request *)buf;
    if (w->magic == CUI_PROTO_MAGIC && w->version == CUI_PROTO_VERSION && w->op != CUI_OP_INSPECT) {
      if (next(&st) % 2) memcpy(w->claim, CUI_TEST_CLAIM, sizeof w->claim); /* past the claim check */
      w->expected_phase = 0xdead0000u; /* impossible: the fuzz never moves the shim */
      w->txn_id &= 0xffffffffu;
    }
    int s = connect_self();
    ssize_t sent = send(s, buf, len, MSG_NOSIGNAL);
    CHECK(sent == (ssize_t)len || (sent < 0 && (errno == EPIPE || errno == ECONNRESET)), "send %zu bytes: %s", len,
          strerror(errno));
    shutdown(s, SHUT_WR);
    if (check_reply(s, w->op, NULL)) replies++;
    else closed++;
    close(s);
  }

  struct cui_reply r = request(CUI_OP_INSPECT, 0, CUI_PHASE_ACTIVE);
  CHECK(r.status == CUI_OK && r.phase == CUI_PHASE_ACTIVE && r.record_count >= 2,
        "INSPECT after the fuzz: status %d phase %u records %u", r.status, r.phase, r.record_count);
  uint64_t txn = 1ull << 40;
  r = request(CUI_OP_SAVE_ALLOCATIONS, txn++, CUI_PHASE_ACTIVE);
  CHECK(r.status == CUI_OK && r.phase == CUI_PHASE_SAVED, "SAVE: %d phase %u", r.status, r.phase);
  r = request(CUI_OP_PREPARE_UNICAST, txn++, CUI_PHASE_SAVED);
  CHECK(r.status == CUI_OK && r.phase == CUI_PHASE_PREPARED, "PREPARE: %d", r.status);
  r = request(CUI_OP_LOAD_ALLOCATIONS, txn++, CUI_PHASE_PREPARED);
  CHECK(r.status == CUI_OK && r.phase == CUI_PHASE_LOADED, "LOAD: %d", r.status);
  r = request(CUI_OP_RESTORE_UNICAST, txn++, CUI_PHASE_LOADED);
  CHECK(r.status == CUI_OK && r.phase == CUI_PHASE_ACTIVE, "RESTORE: %d phase %u", r.status, r.phase);
  CU(cuMemcpyDtoH(got, va, gran));
  CHECK(memcmp(got, want, gran) == 0, "bytes differ after the cycle");
  free(want);
  free(got);
  printf("fuzz: seed %u requests %ld replies %ld closed %ld\n", seed, n, replies, closed);
  return 0;
}
