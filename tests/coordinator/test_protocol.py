"""Pins coordinator/protocol.py to interposer/include/cuinterpose/protocol.h.

A C probe (protocol_probe.c, compiled against the header) prints every sizeof/offsetof and
constant, packs known values, parses bytes packed by Python, and computes cui_checksum64
from its own implementation of the header's definition.
"""

from __future__ import annotations

import pathlib
import re
import struct
import subprocess

import pytest

from cuinterpose.coordinator import protocol as P
from cuinterpose.coordinator.protocol import (
    Access,
    DeviceUse,
    Op,
    Phase,
    PhaseRule,
    Record,
    RecordFlag,
    RecordKind,
    Reply,
    Request,
    Role,
    ShimFlag,
    Status,
    Ticket,
    TicketKind,
)

HERE = pathlib.Path(__file__).resolve().parent
HEADER = HERE.parent.parent / "interposer" / "include" / "cuinterpose" / "protocol.h"


@pytest.fixture(scope="module")
def probe(build_c):
    exe = build_c([HERE / "protocol_probe.c"], "coordinator_protocol_probe")

    def run(*args, stdin: bytes = b"") -> str:
        res = subprocess.run([str(exe), *args], input=stdin, capture_output=True, check=True)
        return res.stdout.decode()

    return run


@pytest.fixture(scope="module")
def layout(probe):
    sizes, fields, consts, strs = {}, {}, {}, {}
    for line in probe("layout").splitlines():
        parts = line.split(" ", 3)
        if parts[0] == "sizeof":
            sizes[parts[1]] = int(parts[2])
        elif parts[0] == "field":
            name, field_, rest = parts[1], parts[2], parts[3].split()
            fields.setdefault(name, {})[field_] = (int(rest[0]), int(rest[1]))
        elif parts[0] == "const":
            consts[parts[1]] = int(parts[2])
        elif parts[0] == "str":
            strs[parts[1]] = line.split(" ", 2)[2]
    return sizes, fields, consts, strs


def _field_size(code: str) -> int:
    return struct.calcsize("<" + code)


def test_sizes_match_header(layout):
    sizes, _, _, _ = layout
    assert sizes == {
        "cui_request": 64,
        "cui_reply": 128,
        "cui_access": 16,
        "cui_record": 640,
        "cui_ticket": 64,
        "cui_stream_entry": 32,
        "cui_stream_head": 32,
        "cui_fd_group": 8,
        "cui_table_head": 16,
        "cui_source_entry": 16,
        "cui_chunk_ref": 24,
    }
    assert P.SIZES == sizes
    assert (P.REQUEST_SIZE, P.REPLY_SIZE, P.ACCESS_SIZE, P.RECORD_SIZE, P.TICKET_SIZE) == (
        64,
        128,
        16,
        640,
        64,
    )


def test_every_field_offset_and_size_matches_header(layout):
    _, fields, _, _ = layout
    for name, c_fields in fields.items():
        py_layout = dict(P._LAYOUTS[name])
        assert list(P.OFFSETS[name]) == list(c_fields), f"{name}: field list/order differs"
        for field_, (off, size) in c_fields.items():
            assert P.OFFSETS[name][field_] == off, f"{name}.{field_} offset"
            assert _field_size(py_layout[field_]) == size, f"{name}.{field_} size"


def test_request_claim_is_the_alloc_id_bytes(probe, layout):
    """protocol.h's union: ``cui_request.claim`` (a mutating op's claim token) is the same 16
    bytes at the same offset as ``alloc_id``; the mirror's ``Request.claim`` packs there."""
    (alias,) = [ln.split() for ln in probe("layout").splitlines() if ln.startswith("alias ")]
    _, fields, _, _ = layout
    assert alias == ["alias", "cui_request", "claim", "24", "16"]
    assert fields["cui_request"]["alloc_id"] == (24, 16)
    token = bytes(range(0x40, 0x50))
    req = Request(op=Op.SAVE_ALLOCATIONS, txn_id=7)
    req.claim = token
    raw = req.pack()
    assert raw[24:40] == token and Request.unpack(raw).claim == token
    assert P.claim_path("/c", 41) == "/c/cuinterpose-41.claim"


def _header_names():
    """Every CUI_* enum member and #define in protocol.h (so the probe cannot miss one)."""
    text = HEADER.read_text()
    enum_names = set(re.findall(r"^\s*(CUI_[A-Z0-9_]+)\s*=", text, re.M))
    enum_names |= set(re.findall(r"\{\s*(CUI_[A-Z0-9_]+)\s*=", text))
    enum_names |= set(re.findall(r",\s*(CUI_[A-Z0-9_]+)\s*=\s*\d+\s*\}", text))
    defines = set(re.findall(r"^#define\s+(CUI_[A-Z0-9_]+)\s+\S", text, re.M))
    defines -= {"CUI_STATIC_ASSERT"}
    return enum_names | defines


PY_CONSTANTS = {
    "CUI_PROTO_MAGIC": P.CUI_PROTO_MAGIC,
    "CUI_PROTO_VERSION": P.CUI_PROTO_VERSION,
    "CUI_MAX_ACCESS": P.CUI_MAX_ACCESS,
    "CUI_TXN_ROOM": P.CUI_TXN_ROOM,
    "CUI_INSPECT_DEVICES": P.CUI_INSPECT_DEVICES,
    "CUI_STREAM_FDS_PER_MSG": P.CUI_STREAM_FDS_PER_MSG,
    "CUI_CHUNK_MIN": P.CUI_CHUNK_MIN,
    "CUI_CHUNK_MAX": P.CUI_CHUNK_MAX,
    "CUI_STAGING_MAX": P.CUI_STAGING_MAX,
    "CUI_WRITERS_MAX": P.CUI_WRITERS_MAX,
    "CUI_DIGEST_BYTES": P.CUI_DIGEST_BYTES,
    # the one set of chunk settings (ChunkSettings' defaults, both writers' of the chunk format)
    "CUI_DEFAULT_CHUNK_BYTES": P.ChunkSettings().chunk_bytes,
    "CUI_DEFAULT_STAGING_BYTES": P.ChunkSettings().staging_bytes,
    "CUI_DEFAULT_WRITERS": P.ChunkSettings().writers,
    "CUI_KNOWN_MAX": P.CUI_KNOWN_MAX,
    "CUI_REFS_MAX": P.CUI_REFS_MAX,
    **{f"CUI_CARRY_{m.name}": m.value for m in P.CarryFlag},
    **{f"CUI_OP_{m.name}": m.value for m in Op},
    **{f"CUI_PHASE_{m.name}": m.value for m in Phase},
    **{f"CUI_PHASE_RULE_{m.name}": m.value for m in PhaseRule},
    **{("CUI_OK" if m is Status.OK else f"CUI_{m.name}"): m.value for m in Status},
    **{f"CUI_RECORD_{m.name}": m.value for m in RecordKind},
    **{f"CUI_ROLE_{m.name}": m.value for m in Role},
    **{f"CUI_REC_{m.name}": m.value for m in RecordFlag},
    **{f"CUI_DEV_USE_{m.name}": m.value for m in DeviceUse},
    **{f"CUI_TICKET_{m.name}": m.value for m in TicketKind},
    **{f"CUI_SHIM_{m.name}": m.value for m in ShimFlag},
}
PY_STRINGS = {
    "CUI_DEFAULT_CONTROL_DIR": P.CUI_DEFAULT_CONTROL_DIR,
    "CUI_SOCKET_PREFIX": P.CUI_SOCKET_PREFIX,
    "CUI_CLAIM_SUFFIX": P.CUI_CLAIM_SUFFIX,
    "CUI_TICKET_MAGIC": P.CUI_TICKET_MAGIC.decode(),
    "CUI_IPC_MAGIC": P.CUI_IPC_MAGIC.decode(),
    "CUI_IPC_EVENT_MAGIC": P.CUI_IPC_EVENT_MAGIC.decode(),
}


def test_every_constant_matches_header(layout):
    _, _, consts, strs = layout
    assert consts == PY_CONSTANTS
    assert strs == PY_STRINGS
    # the probe and the Python mirror cover every name the header defines
    assert _header_names() == set(consts) | set(strs)
    assert P.CUI_SOCKET_PREFIX == "cuinterpose-" and P.CUI_DEFAULT_CONTROL_DIR == "/tmp/cuinterpose"


def test_ops_table_matches_header(probe):
    """Every CUI_OPS row of protocol.h, in order, equals protocol.OPS."""
    c_rows = []
    for line in probe("ops").splitlines():
        _, name, value, needs, leaves, mutating, copies = line.split()
        c_rows.append(
            (name, int(value), int(needs), int(leaves), bool(int(mutating)), bool(int(copies)))
        )
    py_rows = [
        (r.op.name, int(r.op), int(r.needs), int(r.leaves), r.mutating, r.copies_bytes)
        for r in P.OPS
    ]
    assert py_rows == c_rows
    assert sorted(r.op for r in P.OPS) == sorted(Op), "every op has exactly one row"
    for r in P.OPS:
        assert isinstance(r.needs, (Phase, PhaseRule)) and isinstance(r.leaves, (Phase, PhaseRule))


def test_op_sets_derived_from_the_table():
    assert P.MUTATING_OPS == set(Op) - {Op.INSPECT, Op.FETCH_FD}
    assert P.CARRIER_OPS == {Op.SAVE_ALLOCATIONS, Op.LOAD_ALLOCATIONS}
    assert P.MULTICAST_RESTORE_OPS == (
        (Op.RESTORE_MULTICAST_CREATORS, Phase.MULTICAST_RELEASED),
        (Op.RESTORE_MULTICAST_IMPORTERS, Phase.MULTICAST_CREATED),
        (Op.RESTORE_MULTICAST_DEVICES, Phase.MULTICAST_IMPORTED),
        (Op.RESTORE_MULTICAST_BINDINGS, Phase.MULTICAST_DEVICES),
    )


# --- known values (mirror known_* in protocol_probe.c) --------------------------------------
def _id(base):
    return bytes(base + i for i in range(16))


KNOWN_REQUEST = Request(
    op=Op.FETCH_FD,
    txn_id=0x1122334455667788,
    expected_phase=Phase.PREPARED,
    sender_pid=4119,
    alloc_id=_id(0xA0),
    reserved=(1, 2, 0xFFFFFFFFFFFFFFFF),
)
KNOWN_REPLY = Reply(
    op=Op.RESTORE_UNICAST,
    txn_id=0x8877665544332211,
    status=-7,
    phase=Phase.FAILED,
    pid=4121,
    record_count=3,
    record_size=640,
    message_len=77,
    bytes=0x123456789,
    elapsed_ns=987654321,
    copy_ns=123456789,
    cuda_result=1,
    records_changed=42,
    shim_flags=ShimFlag.FOREIGN_DLSYM,
    reserved=tuple((i + 1) << 40 for i in range(6)),
)
KNOWN_RECORD = Record(
    kind=RecordKind.MAPPING,
    role=Role.IMPORTER,
    flags=RecordFlag.SHARED | RecordFlag.CARRIED,
    alloc_id=_id(0x10),
    creator_pid=4119,
    handle_refs=2,
    size=0x200000,
    va=0x7F0000200000,
    offset=0x10000,
    prop_type=1,
    prop_location_type=1,
    prop_location_id=-1,
    prop_handle_types=1,
    carrier_checksum=0xDEADBEEFCAFEF00D,
    carrier_bytes=0x1FFFFF,
    reserved0=5,
    reserved=(0, 0, 0, 9),
    access=tuple(Access(1, i - 1, 3, i) for i in range(3)),
)
KNOWN_TICKET = Ticket(
    creator_pid=4119,
    alloc_id=_id(0xF0),
    size=0x40000000,
    kind=TicketKind.MULTICAST,
    reserved0=3,
    reserved=(0, 8),
)
KNOWN = {
    "cui_request": KNOWN_REQUEST,
    "cui_reply": KNOWN_REPLY,
    "cui_record": KNOWN_RECORD,
    "cui_ticket": KNOWN_TICKET,
}
CLASSES = {"cui_request": Request, "cui_reply": Reply, "cui_record": Record, "cui_ticket": Ticket}


@pytest.fixture(scope="module")
def c_packed(probe):
    return {
        name: bytes.fromhex(hx)
        for name, hx in (line.split() for line in probe("pack").splitlines())
    }


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_c_packs_python_unpacks(c_packed, name):
    got = CLASSES[name].unpack(c_packed[name])
    want = KNOWN[name]
    for f in got.__dataclass_fields__:
        assert getattr(got, f) == getattr(want, f), f"{name}.{f}"
    assert got == want


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_python_packs_c_reads(probe, c_packed, name):
    py_bytes = KNOWN[name].pack()
    assert py_bytes == c_packed[name]
    # C parses the Python bytes and prints every field: identical to parsing its own bytes
    from_py = probe("read", name, py_bytes.hex())
    from_c = probe("read", name, c_packed[name].hex())
    assert from_py == from_c
    fields = dict(line.split(" ", 1) for line in from_py.splitlines())
    if name == "cui_record":
        assert fields["va"] == str(0x7F0000200000)
        assert fields["prop_location_id"] == "-1"
        assert fields["access_count"] == "3"
        assert fields["access[0]"] == "1 -1 3 0"
        assert fields["access[2]"] == "1 1 3 2"
        assert fields["alloc_id"] == _id(0x10).hex()
    if name == "cui_reply":
        assert fields["status"] == "-7"
        assert fields["elapsed_ns"] == "987654321"
    if name == "cui_request":
        assert fields["txn_id"] == str(0x1122334455667788)
        assert fields["expected_phase"] == str(int(Phase.PREPARED))
    if name == "cui_ticket":
        assert fields["magic"] == "CUITKT01"
        assert fields["size"] == str(0x40000000)


def test_record_dict_round_trip():
    d = KNOWN_RECORD.to_dict()
    assert d["alloc_id"] == "101112131415161718191a1b1c1d1e1f"
    assert d["kind"] == "MAPPING" and d["role"] == "IMPORTER"
    assert d["access"][1] == {"location_type": 1, "location_id": 0, "flags": 3}
    back = Record.from_dict(d)
    # Access.reserved is not part of the manifest form
    assert back == KNOWN_RECORD.replace(access=tuple(Access(1, i - 1, 3) for i in range(3)))
    import json

    assert Record.from_dict(json.loads(json.dumps(d))) == back


def test_unpack_rejects_bad_input():
    with pytest.raises(P.ProtocolError, match="640 bytes, got 639"):
        Record.unpack(bytes(639))
    bad = bytearray(KNOWN_RECORD.pack())
    bad[88] = 33  # access_count
    with pytest.raises(P.ProtocolError, match="access_count 33"):
        Record.unpack(bytes(bad))
    with pytest.raises(P.ProtocolError, match="ticket magic"):
        Ticket.unpack(bytes(64))
    with pytest.raises(P.ProtocolError, match="CUI_MAX_ACCESS"):
        Record(kind=1, access=[Access(1, 0, 3)] * 33).pack()


# --- checksum --------------------------------------------------------------------------------
def _vector(n: int) -> bytes:
    return bytes((i * 131 + 7) & 0xFF for i in range(n))


# Golden values from the C implementation in protocol_probe.c (regression pins: a change to
# both implementations at once still fails here).
CHECKSUM_PINS = {
    0: 0x9341CA263702A9E6,
    1: 0xA1EB988F5B393ABC,
    7: 0x1FE8898CF72FA18A,
    8: 0x08FBF58DCEC0414A,
    9: 0xFB0C7230B4876734,
    4099: 0x8E0D253C392A9A01,
}


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 4096 + 3, 1 << 16])
def test_checksum_matches_c(probe, n):
    data = _vector(n)
    length, hx = probe("checksum", stdin=data).split()
    assert int(length) == n
    assert P.cui_checksum64(data) == int(hx, 16)
    assert P.cui_checksum64(memoryview(bytearray(data))) == int(hx, 16)


def test_checksum_pinned_values():
    assert P.cui_checksum64(b"") == CHECKSUM_PINS[0]
    for n, value in CHECKSUM_PINS.items():
        assert P.cui_checksum64(_vector(n)) == value, n


def test_socket_path():
    assert P.socket_path("/run/ctl", 4121) == "/run/ctl/cuinterpose-4121.sock"
    assert P.pid_from_socket_path("/run/ctl/cuinterpose-4121.sock") == 4121
    assert P.pid_from_socket_path("/run/ctl/other.sock") is None
