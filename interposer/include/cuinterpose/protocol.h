/*
 * cuinterpose control protocol: the wire format between libcuinterpose.so (the shim inside
 * each application process), the coordinator, and peer shims. Defined once, here; the Python
 * mirror (coordinator/protocol.py) is pinned to it by tests/test_protocol.py, which compares
 * every offset and size and round-trips bytes in both directions.
 *
 * Transport
 *   One SOCK_STREAM Unix socket per CUDA process, created by the shim after the first
 *   successful cuInit at  $CUINTERPOSE_CONTROL_DIR/cuinterpose-<pid>.sock  (mode 0600;
 *   CUINTERPOSE_CONTROL_DIR defaults to CUI_DEFAULT_CONTROL_DIR). One request per connection:
 *     client -> shim : struct cui_request (64 bytes)
 *     shim -> client : struct cui_reply (128 bytes), then record_count * record_size bytes of
 *                      struct cui_record, then message_len bytes of UTF-8 text (no NUL).
 *   A CUI_OP_FETCH_FD reply carries exactly one file descriptor as SCM_RIGHTS ancillary data
 *   on the sendmsg() that carries the reply header (status CUI_OK only).
 *   All integers are little-endian, fields naturally aligned, no implicit padding.
 *
 * Phases (per shim; capture runs top to bottom, restore continues from PREPARED)
 *   ACTIVE --SAVE_ALLOCATIONS--> SAVED --PREPARE_UNICAST--> PREPARED
 *     (native checkpoint, CRIU dump/restore, native restore happen here)
 *   PREPARED --LOAD_ALLOCATIONS--> LOADED --RESTORE_UNICAST--> ACTIVE
 *   SAVED --CANCEL_CAPTURE--> ACTIVE   (abandon a capture before anything was torn down)
 *   INSPECT is read-only and accepted in every phase except FAILED.
 *   Multicast ops (PREPARE_MULTICAST, RESTORE_MULTICAST_*) are reserved codes; they will be
 *   inserted before SAVE_ALLOCATIONS and after RESTORE_UNICAST.
 *   SAVE_ALLOCATIONS and CANCEL_CAPTURE only copy or free host memory: a SAVE_ALLOCATIONS that
 *   fails part-way frees its carrier and leaves the shim ACTIVE (status CUI_FAILED, reply phase
 *   ACTIVE, the txn counts as accepted). A destructive op (PREPARE_UNICAST, LOAD_ALLOCATIONS,
 *   RESTORE_UNICAST) that fails part-way moves the shim to FAILED; nothing is rolled back.
 *   Rolling a partial capture back: SAVED -> CANCEL_CAPTURE; PREPARED -> LOAD_ALLOCATIONS ->
 *   RESTORE_UNICAST. A FAILED shim cannot be brought back.
 *
 * Request rules
 *   - expected_phase must equal the shim's current phase, else CUI_REFUSED_PHASE.
 *   - Mutating ops need txn_id > the last txn_id the shim accepted, else CUI_REFUSED_DUPLICATE.
 *   Both refusals change nothing (the phase stays, no driver call is made). A mutating op is
 *   never retried by the coordinator: a lost reply cannot tell whether the mutation happened.
 *   INSPECT and FETCH_FD carry no txn ordering (txn_id is echoed only).
 */
#ifndef CUINTERPOSE_PROTOCOL_H
#define CUINTERPOSE_PROTOCOL_H

#include <stdint.h>

#define CUI_PROTO_MAGIC   0x50495543u /* "CUIP" as little-endian bytes */
#define CUI_PROTO_VERSION 1u
#define CUI_DEFAULT_CONTROL_DIR "/tmp/cuinterpose"
#define CUI_SOCKET_PREFIX "cuinterpose-"   /* + decimal pid + ".sock" */

enum cui_op {
  CUI_OP_INSPECT = 1,                      /* read-only: return every record */
  CUI_OP_PREPARE_MULTICAST = 2,            /* reserved (multicast teardown) */
  CUI_OP_SAVE_ALLOCATIONS = 3,             /* ACTIVE -> SAVED: shared creator bytes -> host carrier;
                                              on failure the carrier is freed and the shim stays
                                              ACTIVE (status CUI_FAILED, phase ACTIVE) */
  CUI_OP_PREPARE_UNICAST = 4,              /* SAVED -> PREPARED: unmap shared mappings, release driver
                                              handles, close cached export FDs */
  CUI_OP_LOAD_ALLOCATIONS = 5,             /* PREPARED -> LOADED: creators re-create at the original VA,
                                              copy bytes back, set access, re-export */
  CUI_OP_RESTORE_UNICAST = 6,              /* LOADED -> ACTIVE: importers fetch, import, map, set access */
  CUI_OP_RESTORE_MULTICAST_CREATORS = 7,   /* reserved */
  CUI_OP_RESTORE_MULTICAST_IMPORTERS = 8,  /* reserved */
  CUI_OP_RESTORE_MULTICAST_DEVICES = 9,    /* reserved */
  CUI_OP_RESTORE_MULTICAST_BINDINGS = 10,  /* reserved */
  CUI_OP_CANCEL_CAPTURE = 11,              /* SAVED -> ACTIVE: free the host carrier arena, clear
                                              CUI_REC_CARRIED and the carrier fields; nothing else
                                              changes (mappings and handles were never touched) */
  CUI_OP_FETCH_FD = 32                     /* peer: send the real export FD of alloc_id (SCM_RIGHTS) */
};

enum cui_phase {
  CUI_PHASE_ACTIVE = 0,
  CUI_PHASE_SAVED = 2,
  CUI_PHASE_PREPARED = 3,
  CUI_PHASE_LOADED = 4,
  CUI_PHASE_FAILED = 255
};

/* cui_reply.status */
enum cui_status {
  CUI_OK = 0,
  CUI_REFUSED_PHASE = 1,      /* expected_phase != current phase; nothing changed */
  CUI_REFUSED_DUPLICATE = 2,  /* txn_id not newer than the last accepted one; nothing changed */
  CUI_REFUSED_STATE = 3,      /* state cannot be captured (raw import, untracked sharing, ...);
                                 nothing changed; message names the object */
  CUI_FAILED = 4,             /* a driver call failed mid-op; phase is now FAILED, except for
                                 SAVE_ALLOCATIONS, which only copies: its failure frees the
                                 carrier and the phase stays ACTIVE (see reply.phase) */
  CUI_BAD_REQUEST = 5,        /* bad magic, version, op or size; nothing changed */
  CUI_NOT_FOUND = 6           /* FETCH_FD: no such allocation, or not exported by this process */
};

enum cui_record_kind {
  CUI_RECORD_ALLOCATION = 1,  /* one per allocation known to this process */
  CUI_RECORD_MAPPING = 2,     /* one per cuMemMap of a tracked allocation */
  CUI_RECORD_RESERVATION = 3  /* one per cuMemAddressReserve */
};

enum cui_role {
  CUI_ROLE_PRIVATE = 0,       /* never exported nor imported: native checkpoint carries it */
  CUI_ROLE_CREATOR = 1,       /* created here and shared: this process carries the bytes */
  CUI_ROLE_IMPORTER = 2       /* imported from creator_pid: re-imported after restore */
};

/* cui_record.flags */
#define CUI_REC_EXPORTED   0x1u  /* a ticket was handed out for this allocation */
#define CUI_REC_SHARED     0x2u  /* sticky: exported or imported at least once */
#define CUI_REC_RAW_IMPORT 0x4u  /* imported from a non-ticket FD: blocks capture */
#define CUI_REC_CARRIED    0x8u  /* creator bytes currently held in the host carrier */

#define CUI_MAX_ACCESS 32

struct cui_request {          /* 64 bytes */
  uint32_t magic;             /*  0 CUI_PROTO_MAGIC */
  uint16_t version;           /*  4 CUI_PROTO_VERSION */
  uint16_t op;                /*  6 enum cui_op */
  uint64_t txn_id;            /*  8 transaction id; mutating ops need it strictly increasing */
  uint32_t expected_phase;    /* 16 enum cui_phase the sender believes the shim is in */
  uint32_t sender_pid;        /* 20 for error messages */
  uint8_t  alloc_id[16];      /* 24 FETCH_FD: the allocation wanted */
  uint64_t reserved[3];       /* 40 zero */
};

struct cui_reply {            /* 128 bytes */
  uint32_t magic;             /*   0 */
  uint16_t version;           /*   4 */
  uint16_t op;                /*   6 echoed */
  uint64_t txn_id;            /*   8 echoed */
  int32_t  status;            /*  16 enum cui_status */
  uint32_t phase;             /*  20 shim phase after the request */
  uint32_t pid;               /*  24 replying process */
  uint32_t record_count;      /*  28 records that follow */
  uint32_t record_size;       /*  32 sizeof(struct cui_record) */
  uint32_t message_len;       /*  36 bytes of UTF-8 text after the records */
  uint64_t bytes;             /*  40 carrier bytes moved by this op */
  uint64_t elapsed_ns;        /*  48 wall time of the op inside the shim, ns */
  uint64_t copy_ns;           /*  56 part of elapsed_ns spent copying bytes, ns */
  int32_t  cuda_result;       /*  64 CUresult of the failing driver call, 0 if none */
  uint32_t records_changed;   /*  68 objects torn down or rebuilt by this op */
  uint64_t reserved[7];       /*  72 zero */
};

struct cui_access {           /* 16 bytes (CUmemAccessDesc is 12; padded here) */
  uint32_t location_type;     /*  0 CUmemLocationType */
  int32_t  location_id;       /*  4 */
  uint32_t flags;             /*  8 CUmemAccess_flags */
  uint32_t reserved;          /* 12 */
};

struct cui_record {           /* 640 bytes */
  uint16_t kind;              /*   0 enum cui_record_kind */
  uint16_t role;              /*   2 enum cui_role (allocations and mappings) */
  uint32_t flags;             /*   4 CUI_REC_* */
  uint8_t  alloc_id[16];      /*   8 128-bit allocation id (creator-assigned, random) */
  uint32_t creator_pid;       /*  24 */
  uint32_t handle_refs;       /*  28 live virtual handles in this process */
  uint64_t size;              /*  32 allocation / mapping / reservation size, bytes */
  uint64_t va;                /*  40 mapping or reservation start; 0 for an allocation */
  uint64_t offset;            /*  48 mapping: offset into the allocation; reservation: alignment */
  uint32_t prop_type;         /*  56 CUmemAllocationType */
  uint32_t prop_location_type;/*  60 CUmemLocationType */
  int32_t  prop_location_id;  /*  64 */
  uint32_t prop_handle_types; /*  68 CUmemAllocationHandleType bitmask */
  uint64_t carrier_checksum;  /*  72 cui_checksum64 of the carried bytes (creator, after SAVE) */
  uint64_t carrier_bytes;     /*  80 bytes held in the carrier */
  uint32_t access_count;      /*  88 entries used in access[] (mappings) */
  uint32_t reserved0;         /*  92 */
  uint64_t reserved[4];       /*  96 zero */
  struct cui_access access[CUI_MAX_ACCESS]; /* 128 merged per location */
};

/* Export ticket: what cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR) hands the app
 * instead of the driver's FD. A memfd holding exactly these 64 bytes, sealed with
 * F_SEAL_WRITE|F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL (a driver FD has no seals). */
#define CUI_TICKET_MAGIC "CUITKT01"
enum cui_ticket_kind { CUI_TICKET_ALLOCATION = 1, CUI_TICKET_MULTICAST = 2 };

struct cui_ticket {           /* 64 bytes */
  char     magic[8];          /*  0 CUI_TICKET_MAGIC, no NUL */
  uint32_t version;           /*  8 CUI_PROTO_VERSION */
  uint32_t kind;              /* 12 enum cui_ticket_kind */
  uint32_t creator_pid;       /* 16 */
  uint32_t reserved0;         /* 20 */
  uint8_t  alloc_id[16];      /* 24 */
  uint64_t size;              /* 40 allocation size, bytes */
  uint64_t reserved[2];       /* 48 zero */
};

/* cui_checksum64: the carrier checksum. Over the bytes as little-endian uint64 words w[i]
 * (a trailing partial word is zero-padded), h0 = 0x9E3779B97F4A7C15 ^ length_in_bytes,
 * h = rotl64(h ^ (w[i] * 0xC2B2AE3D27D4EB4F), 31) * 0x9E3779B97F4A7C15 for each word,
 * then h ^= h >> 33; h *= 0xFF51AFD7ED558CCD; h ^= h >> 33. The Python mirror implements the
 * same function and tests/test_protocol.py pins it on fixed vectors. */

#ifdef __cplusplus
#define CUI_STATIC_ASSERT static_assert
#else
#define CUI_STATIC_ASSERT _Static_assert
#endif
CUI_STATIC_ASSERT(sizeof(struct cui_request) == 64, "cui_request is 64 bytes");
CUI_STATIC_ASSERT(sizeof(struct cui_reply) == 128, "cui_reply is 128 bytes");
CUI_STATIC_ASSERT(sizeof(struct cui_access) == 16, "cui_access is 16 bytes");
CUI_STATIC_ASSERT(sizeof(struct cui_record) == 640, "cui_record is 640 bytes");
CUI_STATIC_ASSERT(sizeof(struct cui_ticket) == 64, "cui_ticket is 64 bytes");

#endif /* CUINTERPOSE_PROTOCOL_H */
