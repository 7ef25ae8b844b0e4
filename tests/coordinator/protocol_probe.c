/* Probe for tests/coordinator/test_protocol.py: the C side of the protocol.h pin.
 *
 *   protocol_probe layout          every sizeof/offsetof/field size and constant, one per line
 *   protocol_probe pack            each struct filled with the known test values, as hex
 *   protocol_probe read NAME HEX   parse HEX as struct NAME and print every field
 *   protocol_probe checksum        cui_checksum64 of stdin, written from protocol.h's text
 *   protocol_probe ops             every CUI_OPS row: op NAME value needs leaves mutating copies_bytes
 */
#include <cuinterpose/protocol.h>

#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FSIZE(S, f) sizeof(((struct S *)0)->f)
#define F(S, f) printf("field %s %s %zu %zu\n", #S, #f, offsetof(struct S, f), FSIZE(S, f))
#define K(x) printf("const %s %lld\n", #x, (long long)(x))
#define STR(x) printf("str %s %s\n", #x, x)

static void layout(void) {
  printf("sizeof cui_request %zu\n", sizeof(struct cui_request));
  F(cui_request, magic); F(cui_request, version); F(cui_request, op); F(cui_request, txn_id);
  F(cui_request, expected_phase); F(cui_request, sender_pid); F(cui_request, alloc_id);
  F(cui_request, reserved);
  /* the union's other member: the same bytes as alloc_id (protocol.h "Claims") */
  printf("alias cui_request claim %zu %zu\n", offsetof(struct cui_request, claim), FSIZE(cui_request, claim));
  printf("sizeof cui_reply %zu\n", sizeof(struct cui_reply));
  F(cui_reply, magic); F(cui_reply, version); F(cui_reply, op); F(cui_reply, txn_id);
  F(cui_reply, status); F(cui_reply, phase); F(cui_reply, pid); F(cui_reply, record_count);
  F(cui_reply, record_size); F(cui_reply, message_len); F(cui_reply, bytes);
  F(cui_reply, elapsed_ns); F(cui_reply, copy_ns); F(cui_reply, cuda_result);
  F(cui_reply, records_changed); F(cui_reply, shim_flags); F(cui_reply, reserved);
  printf("sizeof cui_access %zu\n", sizeof(struct cui_access));
  F(cui_access, location_type); F(cui_access, location_id); F(cui_access, flags);
  F(cui_access, reserved);
  printf("sizeof cui_record %zu\n", sizeof(struct cui_record));
  F(cui_record, kind); F(cui_record, role); F(cui_record, flags); F(cui_record, alloc_id);
  F(cui_record, creator_pid); F(cui_record, handle_refs); F(cui_record, size); F(cui_record, va);
  F(cui_record, offset); F(cui_record, prop_type); F(cui_record, prop_location_type);
  F(cui_record, prop_location_id); F(cui_record, prop_handle_types);
  F(cui_record, carrier_checksum); F(cui_record, carrier_bytes); F(cui_record, access_count);
  F(cui_record, reserved0); F(cui_record, reserved); F(cui_record, access);
  printf("sizeof cui_ticket %zu\n", sizeof(struct cui_ticket));
  F(cui_ticket, magic); F(cui_ticket, version); F(cui_ticket, kind); F(cui_ticket, creator_pid);
  F(cui_ticket, reserved0); F(cui_ticket, alloc_id); F(cui_ticket, size); F(cui_ticket, reserved);
  printf("sizeof cui_stream_entry %zu\n", sizeof(struct cui_stream_entry));
  F(cui_stream_entry, alloc_id); F(cui_stream_entry, bytes); F(cui_stream_entry, reserved);
  printf("sizeof cui_stream_head %zu\n", sizeof(struct cui_stream_head));
  F(cui_stream_head, alloc_id); F(cui_stream_head, bytes); F(cui_stream_head, chunk_count);
  F(cui_stream_head, zero_count);
  K(CUI_STREAM_FDS_PER_MSG); K(CUI_CHUNK_MIN); K(CUI_CHUNK_MAX); K(CUI_STAGING_MAX);
  K(CUI_WRITERS_MAX); K(CUI_DIGEST_BYTES);
  K(CUI_DEFAULT_CHUNK_BYTES); K(CUI_DEFAULT_STAGING_BYTES); K(CUI_DEFAULT_WRITERS);
  printf("sizeof cui_fd_group %zu\n", sizeof(struct cui_fd_group));
  F(cui_fd_group, count); F(cui_fd_group, error);
  printf("sizeof cui_table_head %zu\n", sizeof(struct cui_table_head));
  F(cui_table_head, count); F(cui_table_head, sources); F(cui_table_head, reserved);
  printf("sizeof cui_source_entry %zu\n", sizeof(struct cui_source_entry));
  F(cui_source_entry, bytes); F(cui_source_entry, reserved);
  printf("sizeof cui_chunk_ref %zu\n", sizeof(struct cui_chunk_ref));
  F(cui_chunk_ref, stream); F(cui_chunk_ref, chunk); F(cui_chunk_ref, source);
  F(cui_chunk_ref, reserved); F(cui_chunk_ref, offset);
  K(CUI_CARRY_KNOWN); K(CUI_CARRY_SOURCES); K(CUI_CARRY_SHA256); K(CUI_CARRY_STREAMED); K(CUI_KNOWN_MAX); K(CUI_REFS_MAX);

  K(CUI_PROTO_MAGIC); K(CUI_PROTO_VERSION); K(CUI_MAX_ACCESS); K(CUI_TXN_ROOM);
  STR(CUI_DEFAULT_CONTROL_DIR); STR(CUI_SOCKET_PREFIX); STR(CUI_CLAIM_SUFFIX); STR(CUI_TICKET_MAGIC);
  STR(CUI_IPC_MAGIC);
  STR(CUI_IPC_EVENT_MAGIC);
  K(CUI_OP_INSPECT); K(CUI_OP_PREPARE_MULTICAST); K(CUI_OP_SAVE_ALLOCATIONS);
  K(CUI_OP_PREPARE_UNICAST); K(CUI_OP_LOAD_ALLOCATIONS); K(CUI_OP_RESTORE_UNICAST);
  K(CUI_OP_RESTORE_MULTICAST_CREATORS); K(CUI_OP_RESTORE_MULTICAST_IMPORTERS);
  K(CUI_OP_RESTORE_MULTICAST_DEVICES); K(CUI_OP_RESTORE_MULTICAST_BINDINGS); K(CUI_OP_CANCEL_CAPTURE);
  K(CUI_OP_FETCH_FD);
  K(CUI_PHASE_ACTIVE); K(CUI_PHASE_SAVED); K(CUI_PHASE_PREPARED); K(CUI_PHASE_LOADED);
  K(CUI_PHASE_FAILED); K(CUI_PHASE_MULTICAST_RELEASED); K(CUI_PHASE_MULTICAST_CREATED);
  K(CUI_PHASE_MULTICAST_IMPORTED); K(CUI_PHASE_MULTICAST_DEVICES);
  K(CUI_PHASE_RULE_ANY); K(CUI_PHASE_RULE_SAME); K(CUI_PHASE_RULE_MULTICAST_RELEASED_OR_ACTIVE);
  K(CUI_PHASE_RULE_UNCHECKED);
  K(CUI_OK); K(CUI_REFUSED_PHASE); K(CUI_REFUSED_DUPLICATE); K(CUI_REFUSED_STATE);
  K(CUI_FAILED); K(CUI_BAD_REQUEST); K(CUI_NOT_FOUND); K(CUI_BUSY); K(CUI_REFUSED_PEER); K(CUI_SHIM_FOREIGN_DLSYM); K(CUI_SHIM_CARRY_SHA256); K(CUI_SHIM_OP_RUNNING); K(CUI_SHIM_CARRY_STREAMED);
  K(CUI_RECORD_ALLOCATION); K(CUI_RECORD_MAPPING); K(CUI_RECORD_RESERVATION);
  K(CUI_RECORD_MULTICAST); K(CUI_RECORD_MULTICAST_DEVICE); K(CUI_RECORD_MULTICAST_BINDING);
  K(CUI_RECORD_MULTICAST_MAPPING); K(CUI_RECORD_DEVICE);
  K(CUI_ROLE_PRIVATE); K(CUI_ROLE_CREATOR); K(CUI_ROLE_IMPORTER);
  K(CUI_REC_EXPORTED); K(CUI_REC_SHARED); K(CUI_REC_RAW_IMPORT); K(CUI_REC_CARRIED);
  K(CUI_REC_PASSTHROUGH); K(CUI_REC_MC_BY_ADDR); K(CUI_REC_MC_V2_ABI);
  K(CUI_REC_ADAPTER); K(CUI_REC_IPC);
  K(CUI_INSPECT_DEVICES); K(CUI_DEV_USE_CONTEXT); K(CUI_DEV_USE_ALLOCATION); K(CUI_DEV_USE_ACCESS); K(CUI_DEV_USE_MULTICAST);
  K(CUI_TICKET_ALLOCATION); K(CUI_TICKET_MULTICAST);
}

/* The known test values; test_protocol.py's KNOWN_* mirror them. */
static void fill_id(uint8_t *id, uint8_t base) {
  for (int i = 0; i < 16; i++) id[i] = (uint8_t)(base + i);
}

static struct cui_request known_request(void) {
  struct cui_request r;
  memset(&r, 0, sizeof r);
  r.magic = CUI_PROTO_MAGIC; r.version = CUI_PROTO_VERSION; r.op = CUI_OP_FETCH_FD;
  r.txn_id = 0x1122334455667788ull; r.expected_phase = CUI_PHASE_PREPARED;
  r.sender_pid = 4119; fill_id(r.alloc_id, 0xA0);
  r.reserved[0] = 1; r.reserved[1] = 2; r.reserved[2] = 0xFFFFFFFFFFFFFFFFull;
  return r;
}

static struct cui_reply known_reply(void) {
  struct cui_reply r;
  memset(&r, 0, sizeof r);
  r.magic = CUI_PROTO_MAGIC; r.version = CUI_PROTO_VERSION; r.op = CUI_OP_RESTORE_UNICAST;
  r.txn_id = 0x8877665544332211ull; r.status = -7; r.phase = CUI_PHASE_FAILED; r.pid = 4121;
  r.record_count = 3; r.record_size = sizeof(struct cui_record); r.message_len = 77;
  r.bytes = 0x123456789ull; r.elapsed_ns = 987654321ull; r.copy_ns = 123456789ull;
  r.cuda_result = 1; r.records_changed = 42;
  r.shim_flags = CUI_SHIM_FOREIGN_DLSYM;
  for (int i = 0; i < 6; i++) r.reserved[i] = (uint64_t)(i + 1) << 40;
  return r;
}

static struct cui_record known_record(void) {
  struct cui_record r;
  memset(&r, 0, sizeof r);
  r.kind = CUI_RECORD_MAPPING; r.role = CUI_ROLE_IMPORTER;
  r.flags = CUI_REC_SHARED | CUI_REC_CARRIED; fill_id(r.alloc_id, 0x10);
  r.creator_pid = 4119; r.handle_refs = 2; r.size = 0x200000; r.va = 0x7f0000200000ull;
  r.offset = 0x10000; r.prop_type = 1; r.prop_location_type = 1; r.prop_location_id = -1;
  r.prop_handle_types = 1; r.carrier_checksum = 0xDEADBEEFCAFEF00Dull;
  r.carrier_bytes = 0x1FFFFF; r.access_count = 3; r.reserved0 = 5;
  r.reserved[3] = 9;
  for (int i = 0; i < 3; i++) {
    r.access[i].location_type = 1; r.access[i].location_id = i - 1; r.access[i].flags = 3;
    r.access[i].reserved = (uint32_t)i;
  }
  return r;
}

static struct cui_ticket known_ticket(void) {
  struct cui_ticket t;
  memset(&t, 0, sizeof t);
  memcpy(t.magic, CUI_TICKET_MAGIC, 8); t.version = CUI_PROTO_VERSION;
  t.kind = CUI_TICKET_MULTICAST; t.creator_pid = 4119; t.reserved0 = 3;
  fill_id(t.alloc_id, 0xF0); t.size = 0x40000000ull; t.reserved[1] = 8;
  return t;
}

static void hex(const char *name, const void *p, size_t n) {
  printf("%s ", name);
  for (size_t i = 0; i < n; i++) printf("%02x", ((const uint8_t *)p)[i]);
  printf("\n");
}

static void pack(void) {
  struct cui_request q = known_request(); hex("cui_request", &q, sizeof q);
  struct cui_reply y = known_reply(); hex("cui_reply", &y, sizeof y);
  struct cui_record r = known_record(); hex("cui_record", &r, sizeof r);
  struct cui_ticket t = known_ticket(); hex("cui_ticket", &t, sizeof t);
}

static void print_id(const char *name, const uint8_t *id, size_t n) {
  printf("%s ", name);
  for (size_t i = 0; i < n; i++) printf("%02x", id[i]);
  printf("\n");
}

#define U(s, f) printf(#f " %" PRIu64 "\n", (uint64_t)(s).f)
#define I(s, f) printf(#f " %" PRId64 "\n", (int64_t)(s).f)

static int read_struct(const char *name, const char *hx) {
  uint8_t buf[4096];
  size_t n = strlen(hx) / 2;
  if (n > sizeof buf) return 2;
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    if (sscanf(hx + 2 * i, "%2x", &v) != 1) return 2;
    buf[i] = (uint8_t)v;
  }
  if (!strcmp(name, "cui_request")) {
    struct cui_request s;
    if (n != sizeof s) return 3;
    memcpy(&s, buf, n);
    U(s, magic); U(s, version); U(s, op); U(s, txn_id); U(s, expected_phase); U(s, sender_pid);
    print_id("alloc_id", s.alloc_id, 16);
    for (int i = 0; i < 3; i++) printf("reserved[%d] %" PRIu64 "\n", i, s.reserved[i]);
  } else if (!strcmp(name, "cui_reply")) {
    struct cui_reply s;
    if (n != sizeof s) return 3;
    memcpy(&s, buf, n);
    U(s, magic); U(s, version); U(s, op); U(s, txn_id); I(s, status); U(s, phase); U(s, pid);
    U(s, record_count); U(s, record_size); U(s, message_len); U(s, bytes); U(s, elapsed_ns);
    U(s, copy_ns); I(s, cuda_result); U(s, records_changed);
    for (int i = 0; i < 7; i++) printf("reserved[%d] %" PRIu64 "\n", i, s.reserved[i]);
  } else if (!strcmp(name, "cui_record")) {
    struct cui_record s;
    if (n != sizeof s) return 3;
    memcpy(&s, buf, n);
    U(s, kind); U(s, role); U(s, flags); print_id("alloc_id", s.alloc_id, 16);
    U(s, creator_pid); U(s, handle_refs); U(s, size); U(s, va); U(s, offset); U(s, prop_type);
    U(s, prop_location_type); I(s, prop_location_id); U(s, prop_handle_types);
    U(s, carrier_checksum); U(s, carrier_bytes); U(s, access_count); U(s, reserved0);
    for (int i = 0; i < 4; i++) printf("reserved[%d] %" PRIu64 "\n", i, s.reserved[i]);
    for (uint32_t i = 0; i < s.access_count && i < CUI_MAX_ACCESS; i++)
      printf("access[%u] %u %d %u %u\n", i, s.access[i].location_type, s.access[i].location_id,
             s.access[i].flags, s.access[i].reserved);
  } else if (!strcmp(name, "cui_ticket")) {
    struct cui_ticket s;
    if (n != sizeof s) return 3;
    memcpy(&s, buf, n);
    printf("magic %.8s\n", s.magic);
    U(s, version); U(s, kind); U(s, creator_pid); U(s, reserved0);
    print_id("alloc_id", s.alloc_id, 16); U(s, size);
    for (int i = 0; i < 2; i++) printf("reserved[%d] %" PRIu64 "\n", i, s.reserved[i]);
  } else {
    return 4;
  }
  return 0;
}

/* Written from the comment in protocol.h, independently of the Python mirror. */
static uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t checksum64(const uint8_t *p, size_t len) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)len;
  for (size_t i = 0; i < len; i += 8) {
    uint64_t w = 0;
    size_t take = len - i < 8 ? len - i : 8;
    for (size_t b = 0; b < take; b++) w |= (uint64_t)p[i + b] << (8 * b);
    h = rotl64(h ^ (w * 0xC2B2AE3D27D4EB4Full), 31) * 0x9E3779B97F4A7C15ull;
  }
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  return h;
}

static int checksum_stdin(void) {
  size_t cap = 1 << 16, len = 0;
  uint8_t *buf = malloc(cap);
  size_t got;
  while ((got = fread(buf + len, 1, cap - len, stdin)) > 0) {
    len += got;
    if (len == cap) buf = realloc(buf, cap *= 2);
  }
  printf("%zu %016" PRIx64 "\n", len, checksum64(buf, len));
  free(buf);
  return 0;
}

static void ops(void) {
#define OP_ROW(op, needs, leaves, mutating, copies_bytes)                                              \
  printf("op %s %d %d %d %d %d\n", #op, (int)CUI_OP_##op, (int)CUI_PHASE_##needs, (int)CUI_PHASE_##leaves, \
         mutating, copies_bytes);
  CUI_OPS(OP_ROW)
#undef OP_ROW
}

int main(int argc, char **argv) {
  if (argc >= 2 && !strcmp(argv[1], "layout")) { layout(); return 0; }
  if (argc >= 2 && !strcmp(argv[1], "pack")) { pack(); return 0; }
  if (argc >= 4 && !strcmp(argv[1], "read")) return read_struct(argv[2], argv[3]);
  if (argc >= 2 && !strcmp(argv[1], "checksum")) return checksum_stdin();
  if (argc >= 2 && !strcmp(argv[1], "ops")) { ops(); return 0; }
  fprintf(stderr, "usage: %s layout|pack|read NAME HEX|checksum\n", argv[0]);
  return 1;
}
