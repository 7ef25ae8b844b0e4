/*
 * cuinterpose control protocol: the wire format between libcuinterpose.so (the shim inside
 * each application process), the coordinator, and peer shims. Defined once, here; the Python
 * mirror (coordinator/protocol.py) is pinned to it by tests/coordinator/test_protocol.py,
 * which compares every offset, size, constant and CUI_OPS row and round-trips bytes in both
 * directions.
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
 *   ACTIVE --PREPARE_MULTICAST--> MULTICAST_RELEASED --SAVE_ALLOCATIONS--> SAVED
 *     --PREPARE_UNICAST--> PREPARED
 *     (native checkpoint, CRIU dump/restore, native restore happen here)
 *   PREPARED --LOAD_ALLOCATIONS--> LOADED --RESTORE_UNICAST--> MULTICAST_RELEASED
 *     --RESTORE_MULTICAST_CREATORS--> MULTICAST_CREATED --RESTORE_MULTICAST_IMPORTERS-->
 *     MULTICAST_IMPORTED --RESTORE_MULTICAST_DEVICES--> MULTICAST_DEVICES
 *     --RESTORE_MULTICAST_BINDINGS--> ACTIVE
 *   SAVED --CANCEL_CAPTURE--> MULTICAST_RELEASED (abandon a capture before unicast teardown;
 *     the multicast rebuild ops then bring the shim back to ACTIVE)
 *   PREPARE_MULTICAST is optional for a whole capture: a coordinator that sees no multicast
 *   record in any participant skips it (and the four rebuild ops), and then SAVE_ALLOCATIONS
 *   is accepted from ACTIVE, CANCEL_CAPTURE and RESTORE_UNICAST lead straight to ACTIVE. The
 *   shim remembers whether the current capture ran PREPARE_MULTICAST (the coordinator sends
 *   it to every participant or to none). SAVE_ALLOCATIONS from ACTIVE is refused
 *   (CUI_REFUSED_STATE) while the process holds a multicast object. A process without
 *   multicast state answers every multicast op with CUI_OK and records_changed 0.
 *   INSPECT is read-only and accepted in every phase except FAILED.
 *   SAVE_ALLOCATIONS and CANCEL_CAPTURE only copy or free host memory: a SAVE_ALLOCATIONS that
 *   fails part-way frees its chunk table and leaves the shim ACTIVE (status CUI_FAILED, reply phase
 *   ACTIVE, the txn counts as accepted). A destructive op (PREPARE_UNICAST, LOAD_ALLOCATIONS,
 *   RESTORE_UNICAST, PREPARE_MULTICAST, RESTORE_MULTICAST_*) that fails part-way moves the
 *   shim to FAILED; nothing is rolled back. A failed SAVE_ALLOCATIONS leaves the shim in the
 *   phase it was in (ACTIVE or MULTICAST_RELEASED).
 *   Rolling a partial capture back: SAVED -> CANCEL_CAPTURE; PREPARED -> LOAD_ALLOCATIONS ->
 *   RESTORE_UNICAST; then, if the capture ran PREPARE_MULTICAST, the four RESTORE_MULTICAST_*
 *   ops from wherever each shim is. A FAILED shim cannot be brought back.
 *
 * Request rules
 *   - expected_phase must equal the shim's current phase, else CUI_REFUSED_PHASE.
 *   - Mutating ops need txn_id > the last txn_id the shim accepted, else CUI_REFUSED_DUPLICATE.
 *   Both refusals change nothing (the phase stays, no driver call is made). A mutating op is
 *   never retried by the coordinator: a lost reply cannot tell whether the mutation happened.
 *   INSPECT and FETCH_FD carry no txn ordering (txn_id is echoed only).
 *   - Mutating ops need the claim token of the checkpoint that holds the process (Claims below),
 *     else CUI_REFUSED_PEER; INSPECT stays open to the same uid.
 */
#ifndef CUINTERPOSE_PROTOCOL_H
#define CUINTERPOSE_PROTOCOL_H

#include <stdint.h>

#define CUI_PROTO_MAGIC         0x50495543u /* "CUIP" as little-endian bytes */
#define CUI_PROTO_VERSION       2u  /* 2: SAVE/LOAD_ALLOCATIONS carry chunk files (Carriers) */
#define CUI_DEFAULT_CONTROL_DIR "/tmp/cuinterpose"
#define CUI_SOCKET_PREFIX       "cuinterpose-"   /* + decimal pid + ".sock" */
#define CUI_CLAIM_SUFFIX        ".claim"         /* CUI_SOCKET_PREFIX + pid + this: Claims below */

enum cui_op {
  CUI_OP_INSPECT = 1,                      /* read-only: return every record */
  CUI_OP_PREPARE_MULTICAST = 2,            /* ACTIVE -> MULTICAST_RELEASED: unmap multicast VAs
                                              (reservations kept), unbind, close cached export
                                              FDs, release objects; refused (CUI_REFUSED_STATE,
                                              nothing changed) while a pass-through object lives */
  CUI_OP_SAVE_ALLOCATIONS = 3,             /* MULTICAST_RELEASED (or ACTIVE, see Phases) -> SAVED:
                                              shared creator bytes -> chunk files (Carriers);
                                              on failure the table is freed and the shim stays
                                              where it was (status CUI_FAILED) */
  CUI_OP_PREPARE_UNICAST = 4,              /* SAVED -> PREPARED: unmap shared mappings, release driver
                                              handles, close cached export FDs */
  CUI_OP_LOAD_ALLOCATIONS = 5,             /* PREPARED -> LOADED: creators re-create at the original VA,
                                              copy bytes back, set access, re-export */
  CUI_OP_RESTORE_UNICAST = 6,              /* LOADED -> MULTICAST_RELEASED (ACTIVE when the capture
                                              skipped PREPARE_MULTICAST): importers fetch, import,
                                              map, set access */
  CUI_OP_RESTORE_MULTICAST_CREATORS = 7,   /* MULTICAST_RELEASED -> MULTICAST_CREATED: creators
                                              cuMulticastCreate with the requested properties and
                                              re-export (export cache) */
  CUI_OP_RESTORE_MULTICAST_IMPORTERS = 8,  /* MULTICAST_CREATED -> MULTICAST_IMPORTED: importers
                                              fetch the creator's FD (FETCH_FD) and import */
  CUI_OP_RESTORE_MULTICAST_DEVICES = 9,    /* MULTICAST_IMPORTED -> MULTICAST_DEVICES: every
                                              recorded cuMulticastAddDevice again */
  CUI_OP_RESTORE_MULTICAST_BINDINGS = 10,  /* MULTICAST_DEVICES -> ACTIVE: bind (same ABI form),
                                              map at the original VAs, set access */
  CUI_OP_CANCEL_CAPTURE = 11,              /* SAVED -> MULTICAST_RELEASED (ACTIVE when the capture
                                              skipped PREPARE_MULTICAST): drop the chunk table, clear
                                              CUI_REC_CARRIED and the carrier fields; nothing else
                                              changes (mappings and handles were never touched) */
  CUI_OP_FETCH_FD = 32                     /* peer: send the real export FD of alloc_id (SCM_RIGHTS);
                                              needs the allocation's secret (Secrets) */
};

enum cui_phase {
  CUI_PHASE_ACTIVE = 0,
  CUI_PHASE_MULTICAST_RELEASED = 1,   /* multicast torn down, unicast intact */
  CUI_PHASE_SAVED = 2,
  CUI_PHASE_PREPARED = 3,
  CUI_PHASE_LOADED = 4,
  CUI_PHASE_MULTICAST_CREATED = 5,    /* restore: creators re-created their objects */
  CUI_PHASE_MULTICAST_IMPORTED = 6,   /* restore: importers imported them */
  CUI_PHASE_MULTICAST_DEVICES = 7,    /* restore: every device added again */
  CUI_PHASE_FAILED = 255
};

/* Pseudo phases of the CUI_OPS table below (never a shim's phase, never on the wire). */
enum cui_phase_rule {
  CUI_PHASE_RULE_ANY = 256,       /* needs: every phase but FAILED (INSPECT) */
  CUI_PHASE_RULE_SAME = 257,      /* leaves: the phase does not change */
  CUI_PHASE_RULE_MULTICAST_RELEASED_OR_ACTIVE = 258,
  /* needs: either; leaves: MULTICAST_RELEASED when this capture
     ran PREPARE_MULTICAST, ACTIVE when it skipped it (Phases) */
  CUI_PHASE_RULE_UNCHECKED = 259  /* needs: no expected_phase check (FETCH_FD, served by the
                                     accept thread from the export cache; it refuses SAVED,
                                     PREPARED and FAILED itself: Secrets below) */
};

/* The ops table, one row per enum cui_op member in capture/restore order:
 *   X(op, needs, leaves, mutating, copies_bytes)
 * needs: the phase a request must find (CUI_PHASE_<needs>: a phase or a CUI_PHASE_RULE_*);
 * leaves: the phase a success leaves (a failure: Phases above); mutating: needs a txn_id newer
 * than the last accepted one and is never retried; copies_bytes: moves carrier bytes (the
 * coordinator gives it the long carrier timeout). It drives the shim's admission, phase
 * transitions and op names; coordinator/protocol.py mirrors it (pinned by
 * tests/coordinator/test_protocol.py). */
#define CUI_OPS(X)                                                            \
  X(INSPECT, RULE_ANY, RULE_SAME, 0, 0)                                       \
  X(PREPARE_MULTICAST, ACTIVE, MULTICAST_RELEASED, 1, 0)                      \
  X(SAVE_ALLOCATIONS, RULE_MULTICAST_RELEASED_OR_ACTIVE, SAVED, 1, 1)         \
  X(PREPARE_UNICAST, SAVED, PREPARED, 1, 0)                                   \
  X(LOAD_ALLOCATIONS, PREPARED, LOADED, 1, 1)                                 \
  X(RESTORE_UNICAST, LOADED, RULE_MULTICAST_RELEASED_OR_ACTIVE, 1, 0)         \
  X(RESTORE_MULTICAST_CREATORS, MULTICAST_RELEASED, MULTICAST_CREATED, 1, 0)  \
  X(RESTORE_MULTICAST_IMPORTERS, MULTICAST_CREATED, MULTICAST_IMPORTED, 1, 0) \
  X(RESTORE_MULTICAST_DEVICES, MULTICAST_IMPORTED, MULTICAST_DEVICES, 1, 0)   \
  X(RESTORE_MULTICAST_BINDINGS, MULTICAST_DEVICES, ACTIVE, 1, 0)              \
  X(CANCEL_CAPTURE, SAVED, RULE_MULTICAST_RELEASED_OR_ACTIVE, 1, 0)           \
  X(FETCH_FD, RULE_UNCHECKED, RULE_SAME, 0, 0)

/* cui_reply.status */
enum cui_status {
  CUI_OK = 0,
  CUI_REFUSED_PHASE = 1,      /* expected_phase != current phase; nothing changed */
  CUI_REFUSED_DUPLICATE = 2,  /* txn_id not newer than the last accepted one; nothing changed */
  CUI_REFUSED_STATE = 3,      /* state cannot be captured (raw import, untracked sharing, ...);
                                 nothing changed; message names the object */
  CUI_FAILED = 4,             /* a driver call failed mid-op; phase is now FAILED, except for
                                 SAVE_ALLOCATIONS, which only copies: its failure frees the
                                 chunk table and the phase stays (see reply.phase) */
  CUI_BAD_REQUEST = 5,        /* bad magic, version, op or size; nothing changed */
  CUI_NOT_FOUND = 6,          /* FETCH_FD: no such allocation, or not exported by this process */
  CUI_BUSY = 7,               /* another mutating request is running; nothing changed and the
                                 txn was not consumed: retry the same request */
  CUI_REFUSED_PEER = 8        /* the connecting process may not send this op (SO_PEERCRED: a
                                 mutating op from neither root nor the shim's uid; a mutating op
                                 without the claim token of the checkpoint that holds the
                                 process, Claims; FETCH_FD without the allocation's secret,
                                 Secrets); nothing changed */
};

/* cui_reply.shim_flags: conditions of the replying process every reply carries */
#define CUI_SHIM_FOREIGN_DLSYM                                     \
  1u /* the dlsym this process resolves is not the shim's (another \
        dlsym interposer preloaded first): lookups through it are  \
        untracked (docs/shim.md "Preload order") */
#define CUI_SHIM_CARRY_SHA256                                      \
  2u /* this shim takes CUI_CARRY_SHA256 ("Carriers"; decisions    \
        D36): a sender that does not see it in the INSPECT replies \
        of a capture (a shim loaded before D36) uses BLAKE2b-256 */
#define CUI_SHIM_CARRY_STREAMED                                    \
  8u /* this shim takes CUI_CARRY_STREAMED ("Carriers"; decisions  \
        D70): a sender streams a SAVE's descriptors only to a shim \
        whose INSPECT reply has it (one loaded before D70 refuses  \
        the flag) */
#define CUI_SHIM_OP_RUNNING                                         \
  4u /* a mutating op of this process is queued or running (its     \
        reply is not sent yet): another one gets CUI_BUSY. A sender \
        whose reply was lost waits for this bit to clear before it  \
        reads the phase (docs/coordinator.md "Rollback") */

enum cui_record_kind {
  CUI_RECORD_ALLOCATION = 1,  /* one per allocation known to this process */
  CUI_RECORD_MAPPING = 2,     /* one per cuMemMap of a tracked allocation */
  CUI_RECORD_RESERVATION = 3, /* one per cuMemAddressReserve */
  /* Multicast records (field use below). alloc_id/creator_pid/role name the object. */
  CUI_RECORD_MULTICAST = 4,         /* one per multicast object: size = requested size,
                                       offset = effective extent (largest mcOffset + size this
                                       process bound or mapped), prop_location_id = numDevices,
                                       prop_handle_types = handleTypes, handle_refs */
  CUI_RECORD_MULTICAST_DEVICE = 5,  /* one per cuMulticastAddDevice: prop_location_type =
                                       CU_MEM_LOCATION_TYPE_DEVICE, prop_location_id = ordinal */
  CUI_RECORD_MULTICAST_BINDING = 6, /* one per live bind: prop_location_id = device, offset =
                                       mcOffset, size, va = memptr (BindAddr) else 0, flags
                                       CUI_REC_MC_BY_ADDR / CUI_REC_MC_V2_ABI; the member:
                                       reserved[0..1] = its alloc_id (16 bytes), reserved0 = its
                                       creator pid, reserved[2] = memOffset; all zero when the
                                       memory is not a tracked allocation */
  CUI_RECORD_MULTICAST_MAPPING = 7, /* one per cuMemMap of a multicast object: va, size,
                                       offset, access (merged per location) */
  CUI_RECORD_DEVICE = 8             /* one per device ordinal the process uses, when the
                                       INSPECT asked (CUI_INSPECT_DEVICES; after every other
                                       record, ordinal order): prop_location_type =
                                       CU_MEM_LOCATION_TYPE_DEVICE, prop_location_id = ordinal,
                                       alloc_id = the 16 bytes of CUuuid the driver gives for
                                       it now (cuDeviceGetUuid_v2, else cuDeviceGetUuid; zero
                                       when both fail), size = cuDeviceTotalMem_v2 bytes (0 if
                                       it fails), reserved[0] = cui_checksum64 of the
                                       cuDeviceGetName string (0 if it fails), reserved0 =
                                       CUI_DEV_USE_* bits; flags 0. Asked at each INSPECT,
                                       never cached: after a native restore with gpuPairs an
                                       ordinal names another GPU (docs/protocol.md) */
};

/* cui_request.reserved[0] of an INSPECT: CUI_INSPECT_DEVICES asks for the CUI_RECORD_DEVICE
 * records (without it none are sent: an older sender sees the records it knows). The device
 * queries are driver calls: while a native checkpoint lock holds the process they wait for the
 * unlock, as every driver call does, so only an INSPECT outside a lock should ask. */
#define CUI_INSPECT_DEVICES 0x1u

/* cui_record.reserved0 of a CUI_RECORD_DEVICE: why the process uses the ordinal */
#define CUI_DEV_USE_CONTEXT    0x1u /* its primary context is active (cuDevicePrimaryCtxGetState) */
#define CUI_DEV_USE_ALLOCATION 0x2u /* an allocation's location (or the IPC adapter's device) */
#define CUI_DEV_USE_ACCESS     0x4u /* named by an access descriptor of a mapping */
#define CUI_DEV_USE_MULTICAST  0x8u /* added to a multicast object, or a binding's device */

enum cui_role {
  CUI_ROLE_PRIVATE = 0,       /* never exported nor imported: native checkpoint carries it */
  CUI_ROLE_CREATOR = 1,       /* created here and shared: this process carries the bytes */
  CUI_ROLE_IMPORTER = 2       /* imported from creator_pid: re-imported after restore */
};

/* cui_record.flags */
#define CUI_REC_EXPORTED   0x1u  /* a ticket was handed out for this allocation */
#define CUI_REC_SHARED     0x2u  /* sticky: exported or imported at least once */
#define CUI_REC_RAW_IMPORT 0x4u  /* imported from a non-ticket FD: blocks capture */
#define CUI_REC_CARRIED    0x8u  /* creator bytes saved to a chunk file (table held) */
#define CUI_REC_PASSTHROUGH                                      \
  0x10u /* multicast object with handle types other than exactly \
           POSIX_FILE_DESCRIPTOR (0, FABRIC): works, blocks capture */
#define CUI_REC_MC_BY_ADDR 0x20u  /* binding made by cuMulticastBindAddr[_v2] */
#define CUI_REC_MC_V2_ABI  0x40u  /* binding made through the device-explicit _v2 ABI (13.1) */
#define CUI_REC_ADAPTER                                               \
  0x80u  /* allocation of the IPC adapter (a cuMemAlloc_v2 backed by  \
            cuMemCreate): reserved[0] = bytes requested, size = bytes \
            created and mapped (rounded up to the granularity) */
#define CUI_REC_IPC                                                     \
  0x100u /* creator: a virtual IPC handle was handed out                \
            (cuIpcGetMemHandle); importer: opened by cuIpcOpenMemHandle \
            (reserved[1] = its open count in this process) */

#define CUI_MAX_ACCESS 32

/* txn ids kept free after a capture op (PREPARE_MULTICAST, SAVE_ALLOCATIONS, PREPARE_UNICAST)
 * for the ops that undo or restore it (at most 6 follow): a capture op with txn_id above
 * UINT64_MAX - CUI_TXN_ROOM is refused (CUI_BAD_REQUEST, nothing changed). */
#define CUI_TXN_ROOM 16

struct cui_request {          /* 64 bytes */
  uint32_t magic;             /*  0 CUI_PROTO_MAGIC */
  uint16_t version;           /*  4 CUI_PROTO_VERSION */
  uint16_t op;                /*  6 enum cui_op */
  uint64_t txn_id;            /*  8 transaction id; mutating ops need it strictly increasing */
  uint32_t expected_phase;    /* 16 enum cui_phase the sender believes the shim is in */
  uint32_t sender_pid;        /* 20 for error messages */
  union {                     /* 24 16 bytes, by op: */
    uint8_t alloc_id[16];     /*    FETCH_FD: the allocation wanted */
    uint8_t claim[16];        /*    a mutating op: the claim token of the checkpoint that holds
                                    this process (Claims below); INSPECT: zero */
  };
  uint64_t reserved[3];       /* 40 zero; FETCH_FD: reserved[0] = the allocation's secret, from
                                 its ticket or virtual IPC handle (Secrets below);
                                 SAVE_ALLOCATIONS / LOAD_ALLOCATIONS: reserved[0] = chunk_bytes,
                                 reserved[1] = staging_bytes, reserved[2] = writers (bits 0-15)
                                 | CUI_CARRY_* flags (bits 16-31) | stream count (bits 32-63)
                                 (Carriers below) */
};

struct cui_reply {            /* 128 bytes */
  uint32_t magic;             /*   0 */
  uint16_t version;           /*   4 */
  uint16_t op;                /*   6 echoed */
  uint64_t txn_id;            /*   8 echoed */
  int32_t status;            /*  16 enum cui_status */
  uint32_t phase;             /*  20 shim phase after the request */
  uint32_t pid;               /*  24 replying process */
  uint32_t record_count;      /*  28 records that follow */
  uint32_t record_size;       /*  32 sizeof(struct cui_record) */
  uint32_t message_len;       /*  36 bytes of UTF-8 text after the records */
  uint64_t bytes;             /*  40 carrier bytes moved by this op */
  uint64_t elapsed_ns;        /*  48 wall time of the op inside the shim, ns */
  uint64_t copy_ns;           /*  56 part of elapsed_ns spent copying bytes, ns */
  int32_t cuda_result;       /*  64 CUresult of the failing driver call, 0 if none */
  uint32_t records_changed;   /*  68 objects torn down or rebuilt by this op */
  uint64_t shim_flags;        /*  72 CUI_SHIM_* */
  uint64_t reserved[6];       /*  80 zero */
};

struct cui_access {           /* 16 bytes (CUmemAccessDesc is 12; padded here) */
  uint32_t location_type;     /*  0 CUmemLocationType */
  int32_t location_id;       /*  4 */
  uint32_t flags;             /*  8 CUmemAccess_flags */
  uint32_t reserved;          /* 12 */
};

struct cui_record {           /* 640 bytes */
  uint16_t kind;              /*   0 enum cui_record_kind */
  uint16_t role;              /*   2 enum cui_role (allocations and mappings) */
  uint32_t flags;             /*   4 CUI_REC_* */
  uint8_t alloc_id[16];      /*   8 128-bit allocation id (creator-assigned, random) */
  uint32_t creator_pid;       /*  24 */
  uint32_t handle_refs;       /*  28 live virtual handles in this process */
  uint64_t size;              /*  32 allocation / mapping / reservation size, bytes */
  uint64_t va;                /*  40 mapping or reservation start; 0 for an allocation */
  uint64_t offset;            /*  48 mapping: offset into the allocation; reservation: alignment */
  uint32_t prop_type;         /*  56 CUmemAllocationType */
  uint32_t prop_location_type;/*  60 CUmemLocationType */
  int32_t prop_location_id;  /*  64 */
  uint32_t prop_handle_types; /*  68 CUmemAllocationHandleType bitmask */
  uint64_t carrier_checksum;  /*  72 cui_checksum64 of the stream's digest table (creator, after
                                 SAVE; Carriers) */
  uint64_t carrier_bytes;     /*  80 bytes of the carried stream (the allocation's size) */
  uint32_t access_count;      /*  88 entries used in access[] (mappings) */
  uint32_t reserved0;         /*  92 zero (MULTICAST_BINDING: the member's creator pid) */
  uint64_t reserved[4];       /*  96 zero (MULTICAST_BINDING: the member, see above) */
  struct cui_access access[CUI_MAX_ACCESS]; /* 128 merged per location */
};

/* Carriers (decisions D31, chunk files; docs/protocol.md "Carriers"). SAVE_ALLOCATIONS writes
 * every creator allocation the shim carries (live, role CREATOR, not a raw import) into one
 * file, LOAD_ALLOCATIONS reads it back. The sender opens the files (SAVE: writable, LOAD:
 * read-only) and passes them after the 64-byte request:
 *   stream count * struct cui_stream_entry, sent in groups of at most CUI_STREAM_FDS_PER_MSG
 *   entries, each group on one sendmsg() whose SCM_RIGHTS carry one descriptor per entry of
 *   the group, in entry order.
 * The entries name every carried allocation exactly once (else CUI_BAD_REQUEST, nothing
 * changed); the shim closes every received descriptor before it replies. chunk_bytes: a power
 * of two in [CUI_CHUNK_MIN, CUI_CHUNK_MAX]; staging_bytes >= chunk_bytes (the ring: staging_bytes
 * / chunk_bytes slots, at most CUI_STAGING_MAX bytes); writers in [1, CUI_WRITERS_MAX].
 * File layout: size = the allocation's size (the shim ftruncates it); chunk i at offset
 * i * chunk_bytes, the last chunk may be short; an all-zero chunk is not written (sparse).
 * Checksum of each non-zero chunk's bytes, 32 bytes: BLAKE2b-256, no key (RFC 7693), or SHA-256
 * (FIPS 180-4) when cui_request.reserved[2] has the flag CUI_CARRY_SHA256 (decisions D36; the
 * LOAD must name the SAVE's algorithm; the known digests of CUI_CARRY_KNOWN are of it too).
 * SAVE writes chunks with O_DIRECT where a file allows it (open(2); the shim sets the flag on
 * the received descriptors for the op and puts their flags back before it replies) and through
 * the page cache elsewhere; reply.reserved[3] of an OK SAVE_ALLOCATIONS counts the chunk bytes
 * written direct (0: none were). LOAD reads through the page cache and drops each chunk's
 * pages once it is in the ring (POSIX_FADV_DONTNEED). The ring is page-locked for the op
 * (cuMemHostRegister PORTABLE, in a context of the first allocation's device); reply.reserved[4]
 * of a SAVE or LOAD counts its bytes page-locked (0: pageable, or nothing was carried) and
 * reserved[5] holds the register's CUresult when it failed (0 otherwise).
 * A SAVE_ALLOCATIONS reply with status CUI_OK is followed (after the message) by the chunk
 * table, reply.reserved[0] bytes: per stream in request order one struct cui_stream_head,
 * then chunk_count digests of 32 bytes (32 zero bytes for an all-zero chunk). The shim keeps
 * the table (it rides in the CRIU image); the allocation record's carrier_checksum is then
 * cui_checksum64 of the stream's chunk_count * 32 digest bytes, carrier_bytes its size.
 * LOAD_ALLOCATIONS needs the chunk_bytes of the SAVE; each non-zero chunk is read into a
 * staging slot and its digest compared before it is copied to the device (zero chunks:
 * cuMemsetD8). A read error, short file or digest mismatch refuses (CUI_REFUSED_STATE): every
 * allocation created so far is released and the shim stays PREPARED. A SAVE_ALLOCATIONS write
 * error (ENOSPC, EIO, short write) fails (CUI_FAILED) naming pid, allocation, chunk, errno;
 * the shim stays where it was, as any failed SAVE_ALLOCATIONS. CANCEL_CAPTURE drops the table.
 * CUI_CARRY_STREAMED (SAVE_ALLOCATIONS; decisions D70): the descriptors come after the table, as
 * the sender opens the files, so that their creation overlaps the copies and writes. Then the
 * request is followed by count * struct cui_stream_entry without descriptors, then the known-digest
 * table when CUI_CARRY_KNOWN says so (Chunk store below), then the descriptors in entry order in
 * groups: each group one struct cui_fd_group on one sendmsg() whose SCM_RIGHTS carry its count
 * descriptors (1..CUI_STREAM_FDS_PER_MSG). The shim checks the whole table first (CUI_BAD_REQUEST,
 * nothing changed), then reads each group when it reaches its first stream, within its socket
 * timeout (10 s per receive): a sender sends a group at least that often. A group with count 0
 * and error E (an errno) says the sender could not open the next entry's file and ends the
 * request: the op fails (CUI_FAILED, naming that allocation and E) as after a write error; so do
 * a group that breaks these rules and a connection that ends or stays silent before the last
 * descriptor. The descriptors received are closed before the reply, as without the flag. */
/* Chunk store (decisions D34, incremental snapshots; docs/protocol.md "Chunk store"): two flags
 * of cui_request.reserved[2] (bits 16-31) add a table after the stream groups.
 * CUI_CARRY_KNOWN (SAVE_ALLOCATIONS): one struct cui_table_head (count = digests, sources 0),
 *   then count digests of 32 bytes, strictly ascending in memcmp order, none all-zero: chunks
 *   the store already holds. A chunk whose digest is in the table is hashed but not written
 *   (its range of the file stays a hole); the reply's chunk table lists its digest as any
 *   other; reply.reserved[2] counts only the bytes written.
 * CUI_CARRY_SOURCES (LOAD_ALLOCATIONS): one struct cui_table_head (count = refs, sources =
 *   source files), then sources * struct cui_source_entry in groups of at most
 *   CUI_STREAM_FDS_PER_MSG with one descriptor each (as the streams), then count struct
 *   cui_chunk_ref, strictly ascending by (stream, chunk): that chunk is read from that source at
 *   that offset (length: the chunk's own) instead of from its stream's file. The digest check
 *   is the same wherever the bytes come from.
 * A table that breaks these rules (order, an index or range outside its file, a source whose
 * size is not its entry's, more than CUI_KNOWN_MAX digests or CUI_REFS_MAX refs) is
 * CUI_BAD_REQUEST (SAVE) or CUI_REFUSED_STATE (LOAD, a source's size), nothing changed. */
#define CUI_CARRY_KNOWN        0x1u
#define CUI_CARRY_SOURCES      0x2u
#define CUI_CARRY_SHA256       0x4u   /* SAVE and LOAD: the chunk checksum is SHA-256 ("Carriers") */
#define CUI_CARRY_STREAMED     0x8u   /* SAVE: the descriptors follow the table in groups ("Carriers") */
#define CUI_KNOWN_MAX          (1u << 22)
#define CUI_REFS_MAX           (1u << 22)
#define CUI_STREAM_FDS_PER_MSG 64
#define CUI_CHUNK_MIN          (64ull << 10)
#define CUI_CHUNK_MAX          (1ull << 30)
#define CUI_STAGING_MAX        (64ull << 30)
#define CUI_WRITERS_MAX        64u
#define CUI_DIGEST_BYTES       32u
/* The defaults of the values above (a sender's choice; the shim takes each request's own):
 * the one set of chunk settings the agent's two writers share, the shim's carriers and the
 * agent's GPU custom storage (coordinator/protocol/carriers.py ChunkSettings, pinned to these
 * by tests/coordinator/test_protocol.py). A request without CUI_CARRY_SHA256 is BLAKE2b-256. */
#define CUI_DEFAULT_CHUNK_BYTES   (8ull << 20)
#define CUI_DEFAULT_STAGING_BYTES (64ull << 20)
#define CUI_DEFAULT_WRITERS       4u

struct cui_stream_entry {     /* 32 bytes */
  uint8_t alloc_id[16];       /*  0 the carried allocation */
  uint64_t bytes;             /* 16 its size, bytes (must equal the shim's) */
  uint64_t reserved;          /* 24 zero */
};

struct cui_stream_head {      /* 32 bytes */
  uint8_t alloc_id[16];       /*  0 */
  uint64_t bytes;             /* 16 the stream's size, bytes */
  uint32_t chunk_count;       /* 24 ceil(bytes / chunk_bytes) */
  uint32_t zero_count;        /* 28 chunks not written (all zero) */
};

struct cui_fd_group {          /* 8 bytes: CUI_CARRY_STREAMED ("Carriers") */
  uint32_t count;             /*  0 descriptors this group carries, for the next entries in order */
  int32_t error;              /*  4 0, or (count 0) the errno of the next entry's file: the last group */
};

struct cui_table_head {        /* 16 bytes */
  uint32_t count;             /*  0 digests (KNOWN) or refs (SOURCES) that follow */
  uint32_t sources;           /*  4 source files (SOURCES; 0 for KNOWN) */
  uint64_t reserved;          /*  8 zero */
};

struct cui_source_entry {     /* 16 bytes */
  uint64_t bytes;             /*  0 the source file's size, bytes (the shim checks it) */
  uint64_t reserved;          /*  8 zero */
};

struct cui_chunk_ref {        /* 24 bytes */
  uint32_t stream;            /*  0 index of the stream entry */
  uint32_t chunk;             /*  4 chunk index in that stream */
  uint32_t source;            /*  8 index of the source entry */
  uint32_t reserved;          /* 12 zero */
  uint64_t offset;            /* 16 where the chunk's bytes start in the source, bytes */
};

/* Export ticket: what cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR) hands the app
 * instead of the driver's FD. A memfd holding exactly these 64 bytes, sealed with
 * F_SEAL_WRITE|F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL (a driver FD has no seals). */
#define CUI_TICKET_MAGIC "CUITKT01"
enum cui_ticket_kind { CUI_TICKET_ALLOCATION = 1, CUI_TICKET_MULTICAST = 2 };

struct cui_ticket {           /* 64 bytes */
  char magic[8];          /*  0 CUI_TICKET_MAGIC, no NUL */
  uint32_t version;           /*  8 CUI_PROTO_VERSION */
  uint32_t kind;              /* 12 enum cui_ticket_kind */
  uint32_t creator_pid;       /* 16 */
  uint32_t reserved0;         /* 20 zero (multicast: numDevices) */
  uint8_t alloc_id[16];      /* 24 */
  uint64_t size;              /* 40 allocation size (multicast: requested size), bytes */
  uint64_t reserved[2];       /* 48 reserved[1] = the object's secret (Secrets below);
                                 reserved[0] zero (multicast: handleTypes; reserved0 numDevices) */
};

/* Secrets (case 011: FETCH_FD only for those the creator handed a ticket to). Each allocation a
 * creator exports (ticket or virtual IPC handle) gets a 64-bit secret from getrandom(2), never
 * 0, kept in the creator and in every ticket and virtual IPC handle of the allocation (the
 * tickets are sealed memfds: only a process holding one can read it). FETCH_FD sends it in
 * cui_request.reserved[0]; the creator serves the FD only when it equals the allocation's secret,
 * else CUI_REFUSED_PEER (message: pid, allocation, requesting pid; never the secret). FETCH_FD is
 * served in ACTIVE (imports), LOADED and the restore phases after it (a peer's RESTORE_UNICAST,
 * RESTORE_MULTICAST_IMPORTERS), MULTICAST_RELEASED; refused with CUI_REFUSED_PHASE in SAVED,
 * PREPARED and FAILED (nothing to import then: the bytes are being carried). Multicast tickets
 * carry their object's secret the same way. */

/* Claims (a mutating op only from the agent that holds the job's checkpoint; decisions D48).
 * The agent that starts a capture (or a restore's shared phases, or the release of a dead
 * agent's checkpoint) draws a 16-byte token from a CSPRNG, writes it into
 *   <control dir>/CUI_SOCKET_PREFIX<pid>CUI_CLAIM_SUFFIX   (one file per participant pid)
 * as one line "<32 lowercase hex digits of the token> <holder pid> <holder kind>\n" (a regular
 * file, owned by the process's uid or root, not writable by group or other; written atomically)
 * and puts the token in cui_request.claim of every mutating request. The shim reads the file at
 * each mutating request, before the request is queued: a missing, unsafe or unreadable file,
 * or a request whose claim differs, is refused with CUI_REFUSED_PEER (message: the op, this
 * pid, the peer's pid from SO_PEERCRED, the file and why; the token is never echoed), nothing
 * changed. INSPECT and FETCH_FD take no claim. The file is removed when the holder is done;
 * one left by a holder that died is taken over by `cuinterpose-agent release`, which finds the
 * token again in the checkpoint's .lock record. This guards against a stray or buggy caller
 * of the same uid (a script running Coordinator.capture() against a running job), not a
 * hostile one: any process of that uid can read the file, or ptrace the job. */

/* Virtual IPC handle: what cuIpcGetMemHandle of an adapter allocation returns in the 64 bytes of
 * CUipcMemHandle (CUDA driver API: CU_IPC_HANDLE_SIZE 64, opaque). cuIpcOpenMemHandle[_v2] of
 * these bytes fetches the creator's FD (FETCH_FD with the secret) and maps it at a VA the shim
 * picks; any other 64 bytes are a driver handle and pass through. */
#define CUI_IPC_MAGIC "CUIIPC01"

struct cui_ipc_handle {       /* 64 bytes */
  char magic[8];          /*  0 CUI_IPC_MAGIC, no NUL */
  uint32_t version;           /*  8 CUI_PROTO_VERSION */
  uint32_t creator_pid;       /* 12 */
  uint8_t alloc_id[16];      /* 16 */
  uint64_t size;              /* 32 bytes the creator asked cuMemAlloc_v2 for */
  uint64_t offset;            /* 40 offset of the handle's pointer in the allocation, bytes */
  uint64_t secret;            /* 48 the allocation's secret (Secrets above) */
  uint64_t mapped;            /* 56 bytes created and mapped (size rounded up to the granularity) */
};

/* ---------- Virtual IPC event handles (issue 24; docs/shim.md "IPC events") ----------
 * CUipcEventHandle (CUDA driver API: 64 bytes, opaque). cuIpcGetEventHandle of an event created
 * with CU_EVENT_INTERPROCESS under the shim returns these bytes; cuIpcOpenEventHandle of them
 * fetches the creator's current driver handle (FETCH_FD of event_id with the secret: the FD is
 * a sealed memfd holding the driver's 64 bytes) and opens it. The handle stays valid across a
 * checkpoint: the creator re-creates the event and re-exports it at LOAD_ALLOCATIONS. Any other
 * 64 bytes are a driver handle and pass through (INSPECT then refuses). */
#define CUI_IPC_EVENT_MAGIC "CUIIPCEV"

struct cui_ipc_event_handle { /* 64 bytes */
  char magic[8];              /*  0 CUI_IPC_EVENT_MAGIC, no NUL */
  uint32_t version;           /*  8 CUI_PROTO_VERSION */
  uint32_t creator_pid;       /* 12 */
  uint8_t event_id[16];       /* 16 creator-assigned, random (a FETCH_FD key, like an allocation id) */
  uint64_t secret;            /* 32 the event's secret (Secrets above) */
  uint32_t flags;             /* 40 CU_EVENT_* the event was created with */
  uint32_t reserved0;         /* 44 0 */
  uint64_t reserved[2];       /* 48 0 */
};

/* cui_checksum64: the carrier checksum. Over the bytes as little-endian uint64 words w[i]
 * (a trailing partial word is zero-padded), h0 = 0x9E3779B97F4A7C15 ^ length_in_bytes,
 * h = rotl64(h ^ (w[i] * 0xC2B2AE3D27D4EB4F), 31) * 0x9E3779B97F4A7C15 for each word,
 * then h ^= h >> 33; h *= 0xFF51AFD7ED558CCD; h ^= h >> 33. The Python mirror implements the
 * same function and tests/coordinator/test_protocol.py pins it on fixed vectors. */

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
CUI_STATIC_ASSERT(sizeof(struct cui_ipc_handle) == 64, "cui_ipc_handle is 64 bytes");
CUI_STATIC_ASSERT(sizeof(struct cui_ipc_event_handle) == 64, "cui_ipc_event_handle is 64 bytes");
CUI_STATIC_ASSERT(sizeof(struct cui_stream_entry) == 32, "cui_stream_entry is 32 bytes");
CUI_STATIC_ASSERT(sizeof(struct cui_stream_head) == 32, "cui_stream_head is 32 bytes");
CUI_STATIC_ASSERT(sizeof(struct cui_fd_group) == 8, "cui_fd_group is 8 bytes");
CUI_STATIC_ASSERT(sizeof(struct cui_table_head) == 16, "cui_table_head is 16 bytes");
CUI_STATIC_ASSERT(sizeof(struct cui_source_entry) == 16, "cui_source_entry is 16 bytes");
CUI_STATIC_ASSERT(sizeof(struct cui_chunk_ref) == 24, "cui_chunk_ref is 24 bytes");

#endif /* CUINTERPOSE_PROTOCOL_H */
