"""Window layout, header codec and geometry check pins (docs/afdwin.md "Window layout", "Setup")."""

import struct

import pytest

from cuinterpose.workloads.afdwin.config import Config
from cuinterpose.workloads.afdwin.layout import (
    GEOMETRY_FIELDS,
    HEADER_HOST_WORDS,
    MAGIC,
    VERSION,
    GeometryMismatch,
    Header,
    HeaderError,
    SlotLayout,
    WindowLayout,
    check_geometry,
    decode_header,
    encode_header,
)

# upstream fixture: experts_per_rank 4, partial 100, token 32, shared 8, hidden 8, 2-byte items
FIX = dict(
    experts_per_rank=4,
    partial_cap=100,
    token_cap=32,
    shared_cap=8,
    hidden_size=8,
    payload_itemsize=2,
)


@pytest.fixture
def slot():
    return SlotLayout(**FIX)


def test_fixture_offsets(slot):
    assert slot.header_words == 11
    assert (slot.expand_idx_off, slot.weights_off, slot.routed_x_off, slot.shared_x_off) == (
        256,
        768,
        1280,
        1792,
    )
    assert slot.slot_bytes == 2048
    win = WindowLayout(slot=slot, num_regions=2, ring_depth=2)
    assert win.num_flags == 4
    assert win.flag_bytes == 256
    assert win.total_bytes == 8448
    assert [win.slot_off(r, d) for r in range(2) for d in range(2)] == [256, 2304, 4352, 6400]
    assert [win.flag_off(r, d) for r in range(2) for d in range(2)] == [0, 4, 8, 12]
    assert win.geometry() == (2, 2, 11, 100, 32, 8, 8, 2, 2048, 8448)


def test_fields_disjoint_and_inside_slot(slot):
    fields = sorted(slot.fields().values())
    for (off, n), (noff, _) in zip(fields, fields[1:]):
        assert off + n <= noff
    last_off, last_n = fields[-1]
    assert last_off + last_n <= slot.slot_bytes
    # shared_x is sized by shared_cap, not token_cap
    assert slot.slot_bytes < slot.shared_x_off + slot.token_cap * slot.hidden_size * 2


def test_offsets_aligned(slot):
    for name, (off, _) in slot.fields().items():
        assert off % 4 == 0, name
        assert off % slot.payload_itemsize == 0, name
        assert off % 256 == 0, name


def test_slots_do_not_overlap_flags_or_each_other(slot):
    win = WindowLayout(slot=slot, num_regions=3, ring_depth=2)
    offs = sorted(win.slot_off(r, d) for r in range(3) for d in range(2))
    assert offs[0] >= win.num_flags * 4
    assert all(b - a == slot.slot_bytes for a, b in zip(offs, offs[1:]))
    assert offs[-1] + slot.slot_bytes == win.total_bytes
    with pytest.raises(IndexError):
        win.slot_off(3, 0)
    with pytest.raises(IndexError):
        win.flag_idx(0, 2)


def test_header_round_trip():
    h = Header(
        layer=11, num_tokens=32, routed_tokens=90, segment_start=25, expert_counts=(10, 20, 30, 30)
    )
    raw = encode_header(h, 4)
    assert len(raw) == 4 * (7 + 4)
    assert struct.unpack("<11i", raw) == (MAGIC, VERSION, 11, 32, 0, 90, 25, 10, 20, 30, 30)
    d = decode_header(raw, 4)
    assert d == h
    assert sum(d.expert_counts) == d.routed_tokens == 90
    assert d.shutdown is False
    for gone in ("seq", "src_role_rank", "stage_idx", "shared_tokens", "topk"):
        assert not hasattr(d, gone)
    assert HEADER_HOST_WORDS == 5


def test_shutdown_bit_round_trip():
    raw = encode_header(Header(0, 0, 0, 0, (0, 0, 0, 0), shutdown=True), 4)
    assert struct.unpack_from("<5i", raw)[4] == 2
    assert decode_header(raw, 4).shutdown is True


def test_magic_mismatch():
    raw = bytearray(encode_header(Header(1, 2, 0, 0, (0, 0, 0, 0)), 4))
    raw[0:4] = b"\0\0\0\0"
    with pytest.raises(HeaderError, match="magic mismatch"):
        decode_header(bytes(raw), 4)


def test_version_mismatch():
    raw = bytearray(encode_header(Header(1, 2, 0, 0, (0, 0, 0, 0)), 4))
    struct.pack_into("<i", raw, 4, 3)
    with pytest.raises(HeaderError, match="version mismatch: got 3, expected 4"):
        decode_header(bytes(raw), 4)


def test_counts_must_sum_to_routed():
    raw = bytearray(encode_header(Header(1, 2, 3, 0, (1, 1, 1, 0)), 4))
    struct.pack_into("<i", raw, 4 * 7, 5)
    with pytest.raises(HeaderError, match="expert_counts sum 7 != routed_tokens 3"):
        decode_header(bytes(raw), 4)
    with pytest.raises(ValueError, match="expert_counts sum"):
        encode_header(Header(1, 2, 4, 0, (1, 1, 1, 0)), 4)


def test_wrong_length_counts():
    with pytest.raises(ValueError, match="expert_counts"):
        encode_header(Header(1, 2, 3, 0, (1, 1, 1)), 4)


def test_geometry_check_names_first_differing_field():
    a = Config(ring_depth=2).window_layout().geometry()
    b = Config(ring_depth=3).window_layout().geometry()
    check_geometry([a, a])
    with pytest.raises(GeometryMismatch) as ei:
        check_geometry([a, b])
    e = ei.value
    assert e.field == "ring_depth"  # before slot_bytes/total_bytes, which differ too
    assert e.values == [2, 3]
    assert "ring_depth" in str(e) and "[2, 3]" in str(e)
    assert "rank 1 has ring_depth=3" in e.message_for(1)
    assert GEOMETRY_FIELDS.index("ring_depth") == 1
    with pytest.raises(ValueError, match="rank 0 sent 3 geometry values"):
        check_geometry([(1, 2, 3), a])


@pytest.mark.parametrize("field", GEOMETRY_FIELDS)
def test_geometry_check_each_field(field):
    base = list(Config().window_layout().geometry())
    other = list(base)
    other[GEOMETRY_FIELDS.index(field)] += 1
    with pytest.raises(GeometryMismatch, match=field):
        check_geometry([base, base, other])


def test_profiles():
    ci = Config(profile="ci").window_layout()
    assert ci.geometry() == (1, 2, 11, 32, 16, 16, 64, 2, 4864, 9984)
    gpu = Config(profile="gpu").window_layout()
    assert gpu.slot.header_words == 71
    assert gpu.slot_bytes == 4_219_392
    # 2A2F: num_regions = max(a, f) = 2, 2 rings -> 4 slots
    g22 = Config(world=4, attention=2, profile="gpu").window_layout()
    assert (g22.num_regions, g22.num_flags) == (2, 4)
    assert Config(world=3, attention=1).window_layout().num_regions == 2
    with pytest.raises(ValueError, match="attention"):
        Config(world=2, attention=2)
