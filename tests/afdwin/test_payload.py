"""Messages: dispatch P(src,dst,s), reply R(P), trailer seq + checksum, torn detection."""

import struct

import pytest

from cuinterpose.workloads.afdwin.config import Config
from cuinterpose.workloads.afdwin.layout import SlotLayout, decode_header
from cuinterpose.workloads.afdwin.payload import (
    Codec,
    MessageError,
    checksum,
    max_tokens,
    trailer_off,
)


@pytest.fixture(scope="module")
def codec():
    return Codec(Config())  # ci profile, 1A1F, seed 0


def trailer(codec, buf, base=0):
    return struct.unpack_from("<QQ", buf, codec.toff - base)


def test_trailer_geometry(codec):
    sl = codec.slot
    assert codec.toff == sl.routed_x_off + sl.routed_x_bytes - 16 == 2800
    assert codec.max_tokens == 15  # one 128-byte row reserved for the trailer
    assert (codec.reply_start, codec.reply_bytes) == (768, 4096)
    assert max_tokens(SlotLayout(4, 100, 32, 8, 8, 2)) == 31
    with pytest.raises(ValueError, match="trailer"):
        max_tokens(SlotLayout(1, 1, 1, 0, 4, 2))
    assert trailer_off(SlotLayout(4, 100, 32, 8, 8, 2)) == 1280 + 512 - 16


def test_dispatch_pinned(codec):
    d = codec.dispatch(0, 0, 1)
    assert len(d) == codec.slot.slot_bytes == 4864
    assert trailer(codec, d) == (1, 14239093861530105589)
    hdr, seq = codec.check_dispatch(d, expect_seq=1)
    assert seq == 1
    assert (hdr.layer, hdr.num_tokens, hdr.routed_tokens, hdr.segment_start) == (0, 13, 26, 0)
    assert hdr.expert_counts == (6, 4, 9, 7)
    assert codec.dispatch(0, 0, 1) == d  # deterministic
    assert codec.dispatch(0, 0, 2) != d
    assert trailer(codec, codec.shutdown(101)) == (101, 5861916074958195226)


def test_dispatch_contents(codec):
    sl = codec.slot
    s = 5
    d = codec.dispatch(0, 0, s)
    hdr = decode_header(d, 4)
    n = hdr.num_tokens
    plan = codec.plan(0, s)
    k = len(plan.partials)
    assert k == n * codec.cfg.topk
    idx = struct.unpack_from(f"<{k}i", d, sl.expand_idx_off)
    assert list(idx) == [p[1] for p in plan.partials]
    w = struct.unpack_from(f"<{k}f", d, sl.weights_off)
    per_tok = {}
    for t, x in zip(idx, w):
        per_tok[t] = per_tok.get(t, 0.0) + x
    assert sorted(per_tok) == list(range(n))
    assert all(abs(v - 1.0) < 1e-5 for v in per_tok.values())
    rows = d[sl.routed_x_off : sl.routed_x_off + n * sl.row_bytes]
    assert rows == codec.batch(0, s, n)
    assert max(rows) <= 0x7F + s % 0x7F
    assert d[sl.routed_x_off + n * sl.row_bytes : codec.toff] == bytes(
        codec.toff - sl.routed_x_off - n * sl.row_bytes
    )
    # 1 FFN rank: the shared slice is the whole batch
    assert d[sl.shared_x_off : sl.shared_x_off + n * sl.row_bytes] == rows
    assert d[sl.shared_x_off + n * sl.row_bytes :] == bytes(
        sl.slot_bytes - sl.shared_x_off - n * sl.row_bytes
    )


def test_routing_segments_tile_across_ffn_ranks():
    c = Codec(Config(world=3, attention=1))  # 2 FFN ranks, 8 global experts
    hdrs = [c.check_dispatch(c.dispatch(0, f, 7))[0] for f in range(2)]
    assert [(h.segment_start, h.routed_tokens) for h in hdrs] == [(0, 11), (11, 9)]
    assert hdrs[1].expert_counts == (1, 2, 4, 2)
    assert sum(h.routed_tokens for h in hdrs) == hdrs[0].num_tokens * c.cfg.topk == 20
    assert [c.shared_slice(f, 10) for f in range(2)] == [(0, 5), (5, 10)]


def test_reply(codec):
    sl = codec.slot
    d = codec.dispatch(0, 0, 3)
    r = codec.reply(d, 0)
    hdr = decode_header(d, 4)
    n, rb = hdr.num_tokens, sl.row_bytes
    assert len(r) == codec.reply_bytes
    assert trailer(codec, r, codec.reply_start)[0] == 3
    toks = set(
        struct.unpack_from(f"<{hdr.routed_tokens}i", d, sl.expand_idx_off + 4 * hdr.segment_start)
    )
    src = d[sl.routed_x_off :]
    for t in range(n):
        got = r[t * rb : (t + 1) * rb]
        if t in toks:
            want = struct.pack(
                f"<{rb // 2}H",
                *(v + 1 for v in struct.unpack(f"<{rb // 2}H", src[t * rb : (t + 1) * rb])),
            )
            assert got == want
        else:
            assert got == bytes(rb)
    assert codec.check_reply(r, codec.reply(codec.dispatch(0, 0, 3), 0)) == 3


def test_torn_dispatch_detected(codec):
    d = bytearray(codec.dispatch(0, 0, 9))
    good = bytes(d)
    d[codec.slot.routed_x_off + 1] ^= 1
    with pytest.raises(MessageError) as ei:
        codec.check_dispatch(bytes(d))
    assert ei.value.kind == "checksum"
    d = bytearray(good)
    d[0:4] = bytes(4)
    with pytest.raises(MessageError, match="magic mismatch") as ei:
        codec.check_dispatch(bytes(d))
    assert ei.value.kind == "magic"
    with pytest.raises(MessageError, match="trailer seq 9 != flag value 11") as ei:
        codec.check_dispatch(good, expect_seq=11)
    assert ei.value.kind == "seq"
    # a slot half-overwritten by the next message on its ring is torn, not a valid message
    nxt = codec.dispatch(0, 0, 11)
    half = good[: codec.slot.shared_x_off] + nxt[codec.slot.shared_x_off :]
    with pytest.raises(MessageError) as ei:
        codec.check_dispatch(half)
    assert ei.value.kind in ("checksum", "routing")


def test_torn_reply_detected(codec):
    exp = codec.reply(codec.dispatch(0, 0, 4), 0)
    bad = bytearray(exp)
    bad[0] ^= 0x40
    with pytest.raises(MessageError) as ei:
        codec.check_reply(bytes(bad), exp)
    assert ei.value.kind == "checksum"
    other = codec.reply(codec.dispatch(0, 0, 6), 0)
    with pytest.raises(MessageError, match="echoes seq 6, expected 4"):
        codec.check_reply(other, exp)
    empty = codec.empty_reply(4)
    with pytest.raises(MessageError) as ei:
        codec.check_reply(empty, exp)
    assert ei.value.kind == "payload"


def test_checksum_excludes_only_checksum_word():
    buf = bytearray(64)
    a = checksum(buf, 0, 64, 16)
    buf[24] = 7  # inside the checksum word: ignored
    assert checksum(buf, 0, 64, 16) == a
    buf[16] = 1  # the seq word: covered
    assert checksum(buf, 0, 64, 16) != a


def test_add_elements_no_carry(codec):
    b = bytes([0x7F, 0x7F] * 4)
    assert codec.add_elements(b, 0x7E) == bytes([0xFD, 0x7F] * 4)
    assert codec.add_elements(codec.add_elements(b, 0x7E), 1) == bytes([0xFE, 0x7F] * 4)
