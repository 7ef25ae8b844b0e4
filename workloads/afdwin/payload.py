"""Deterministic messages: dispatch P(src, dst, s), reply R(P), trailer and checksum.

Every message ends with a 16-byte trailer (``uint64 seq``, ``uint64 checksum``: BLAKE2b-64 of
the message without the checksum word) at ``trailer_off``, the last 16 bytes of routed_x. The
dispatch is the whole slot, written at capacity; the reply is slot bytes ``[routed_x_off,
slot_bytes)``, each payload element + 1. Formats: docs/afdwin.md "Window layout" (Trailer,
Messages).

Offsets in this module are relative to the slot start unless a name says otherwise.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import random
import struct
from dataclasses import dataclass

from .config import Config
from .layout import Header, HeaderError, SlotLayout, decode_header, encode_header

TRAILER_BYTES = 16
NUM_LAYERS = 61  # layer index cycles through this many layers
_MASK7F = bytes(b & 0x7F for b in range(256))


class MessageError(ValueError):
    """A message failed validation; ``kind`` is "magic", "version", "routing", "seq" or
    "checksum"."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(message)


def trailer_off(slot: SlotLayout) -> int:
    return slot.routed_x_off + slot.routed_x_bytes - TRAILER_BYTES


def max_tokens(slot: SlotLayout) -> int:
    """Most batch rows a message may carry; raises ``ValueError`` when the trailer leaves none."""
    n = slot.token_cap - (-(-TRAILER_BYTES // slot.row_bytes))
    if n < 1:
        raise ValueError(
            f"token_cap {slot.token_cap} x row {slot.row_bytes} B leaves no room "
            f"for the {TRAILER_BYTES}-byte trailer"
        )
    return n


def checksum(buf: bytes | bytearray | memoryview, start: int, end: int, toff: int) -> int:
    """BLAKE2b-64 of ``buf[start:end]`` without the checksum word at ``toff + 8``."""
    h = hashlib.blake2b(digest_size=8)
    mv = memoryview(buf)
    h.update(mv[start : toff + 8])
    h.update(mv[toff + TRAILER_BYTES : end])
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class Plan:
    """The routing of one attention step. ``partials``: (global_expert, token, weight) sorted
    by (expert, token); ``num_tokens``: batch rows."""

    num_tokens: int
    partials: tuple[tuple[int, int, float], ...]


class Codec:
    """Builds and checks messages for one run ``cfg`` (geometry from ``cfg.window_layout()``)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.slot = cfg.window_layout().slot
        self.E = cfg.experts_per_rank
        self.toff = trailer_off(self.slot)
        self.max_tokens = max_tokens(self.slot)
        self.reply_start = self.slot.routed_x_off
        self.reply_bytes = self.slot.slot_bytes - self.reply_start
        isz = self.slot.payload_itemsize
        self._one = (1).to_bytes(isz, "little")
        full = self.max_tokens * self.slot.row_bytes
        self._ones_full_len = full
        self._ones_full = int.from_bytes(self._one * (full // isz), "little")

    # ---- elementwise helpers -------------------------------------------------------------
    def _ones(self, nbytes: int) -> int:
        return self._ones_full >> (8 * (self._ones_full_len - nbytes))

    def add_elements(self, b: bytes, k: int) -> bytes:
        """Each payload element of ``b`` + ``k`` (0 <= k, no element byte may exceed 0xFF)."""
        if not b or k == 0:
            return bytes(b)
        return (int.from_bytes(b, "little") + k * self._ones(len(b))).to_bytes(len(b), "little")

    def _pattern(self, src: int) -> bytes:
        return _pattern(self.cfg.seed, src, self._ones_full_len)

    def batch(self, src: int, s: int, n: int) -> bytes:
        """Attention rank ``src``'s step-``s`` batch: ``n`` rows of routed_x (bytes)."""
        return self.add_elements(self._pattern(src)[: n * self.slot.row_bytes], s % 0x7F)

    def plan(self, src: int, s: int) -> Plan:
        """Deterministic routing of step ``s`` of attention rank ``src``."""
        rng = random.Random(f"afdwin-plan:{self.cfg.seed}:{src}:{s}")
        n = rng.randint(1, self.max_tokens)
        total = self.E * self.cfg.ffn
        parts = []
        for t in range(n):
            experts = rng.sample(range(total), self.cfg.topk)
            w = [rng.random() + 0.05 for _ in experts]
            tot = sum(w)
            parts.extend((e, t, x / tot) for e, x in zip(experts, w))
        parts.sort(key=lambda p: (p[0], p[1]))
        return Plan(num_tokens=n, partials=tuple(parts))

    def shared_slice(self, f: int, n: int) -> tuple[int, int]:
        """FFN role rank ``f``'s shared rows [lo, hi) of an ``n``-row batch."""
        F = self.cfg.ffn
        return f * n // F, (f + 1) * n // F

    # ---- dispatch ------------------------------------------------------------------------
    def dispatch(self, src: int, f: int, s: int) -> bytes:
        """P(src, f, s): the full slot (``slot_bytes``) attention rank ``src`` writes into FFN
        role rank ``f``'s window for step ``s`` (>= 1)."""
        sl = self.slot
        plan = self.plan(src, s)
        n = plan.num_tokens
        experts = [p[0] for p in plan.partials]
        lo_e, hi_e = f * self.E, (f + 1) * self.E
        seg = bisect.bisect_left(experts, lo_e)
        seg_end = bisect.bisect_left(experts, hi_e)
        counts = [0] * self.E
        for e in experts[seg:seg_end]:
            counts[e - lo_e] += 1
        hdr = Header(
            layer=(s - 1) % NUM_LAYERS,
            num_tokens=n,
            routed_tokens=seg_end - seg,
            segment_start=seg,
            expert_counts=tuple(counts),
        )
        buf = bytearray(sl.slot_bytes)
        h = encode_header(hdr, self.E)
        buf[0 : len(h)] = h
        k = len(plan.partials)
        struct.pack_into(f"<{k}i", buf, sl.expand_idx_off, *(p[1] for p in plan.partials))
        struct.pack_into(f"<{k}f", buf, sl.weights_off, *(p[2] for p in plan.partials))
        rows = self.batch(src, s, n)
        buf[sl.routed_x_off : sl.routed_x_off + len(rows)] = rows
        lo, hi = self.shared_slice(f, n)
        rb = sl.row_bytes
        buf[sl.shared_x_off : sl.shared_x_off + (hi - lo) * rb] = rows[lo * rb : hi * rb]
        self._seal(buf, 0, s)
        return bytes(buf)

    def shutdown(self, s: int) -> bytes:
        """The shutdown announcement (full slot, header flags bit 1, no rows) with seq ``s``."""
        buf = bytearray(self.slot.slot_bytes)
        h = encode_header(
            Header(
                layer=0,
                num_tokens=0,
                routed_tokens=0,
                segment_start=0,
                expert_counts=(0,) * self.E,
                shutdown=True,
            ),
            self.E,
        )
        buf[0 : len(h)] = h
        self._seal(buf, 0, s)
        return bytes(buf)

    def _seal(self, buf: bytearray, base: int, seq: int) -> None:
        """Write the trailer of a message that starts at slot offset ``base`` in ``buf``."""
        t = self.toff - base
        struct.pack_into("<Q", buf, t, seq)
        struct.pack_into("<Q", buf, t + 8, checksum(buf, 0, len(buf), t))

    def check_dispatch(self, buf: bytes, expect_seq: int | None = None) -> tuple[Header, int]:
        """Validate a dispatch slot image (``slot_bytes``). Returns (header, seq).

        Raises ``MessageError`` (kind magic/version/routing/checksum/seq) on any defect.
        """
        try:
            hdr = decode_header(buf, self.E)
        except HeaderError as e:
            kind = "magic" if "magic" in str(e) else "version" if "version" in str(e) else "routing"
            raise MessageError(kind, str(e)) from None
        seq, ck = struct.unpack_from("<QQ", buf, self.toff)
        if ck != checksum(buf, 0, len(buf), self.toff):
            raise MessageError("checksum", f"dispatch checksum mismatch (trailer seq {seq})")
        if expect_seq is not None and seq != expect_seq:
            raise MessageError("seq", f"dispatch trailer seq {seq} != flag value {expect_seq}")
        if not hdr.shutdown:
            if (
                hdr.num_tokens > self.max_tokens
                or hdr.segment_start + hdr.routed_tokens > hdr.num_tokens * self.cfg.topk
            ):
                raise MessageError("routing", f"header exceeds capacity: {hdr}")
        return hdr, seq

    # ---- reply ---------------------------------------------------------------------------
    def reply(self, dispatch_buf: bytes, f: int) -> bytes:
        """R(P): the reply region (``reply_bytes``, starting at ``routed_x_off``) FFN role rank
        ``f`` writes for a validated dispatch image. Raises ``MessageError`` via
        ``check_dispatch``."""
        sl = self.slot
        hdr, seq = self.check_dispatch(dispatch_buf)
        n = hdr.num_tokens
        rb = sl.row_bytes
        k = hdr.routed_tokens
        toks = (
            set(
                struct.unpack_from(
                    f"<{k}i", dispatch_buf, sl.expand_idx_off + 4 * hdr.segment_start
                )
            )
            if k
            else set()
        )
        out = bytearray(self.reply_bytes)
        src_rows = bytes(dispatch_buf[sl.routed_x_off : sl.routed_x_off + n * rb])
        plus = self.add_elements(src_rows, 1)
        for t in sorted(toks):
            if 0 <= t < n:
                out[t * rb : (t + 1) * rb] = plus[t * rb : (t + 1) * rb]
        lo, hi = self.shared_slice(f, n)
        sh = bytes(dispatch_buf[sl.shared_x_off : sl.shared_x_off + (hi - lo) * rb])
        so = sl.shared_x_off - self.reply_start
        out[so : so + len(sh)] = self.add_elements(sh, 1)
        self._seal(out, self.reply_start, seq)
        return bytes(out)

    def empty_reply(self, seq: int) -> bytes:
        """A zero reply region sealed with ``seq``: what an FFN rank sends for a torn dispatch
        so the waiting attention stream is released (and the attention host flags it)."""
        out = bytearray(self.reply_bytes)
        self._seal(out, self.reply_start, seq)
        return bytes(out)

    def check_reply(self, buf: bytes, expected: bytes) -> int:
        """Validate a reply image against the expected one. Returns the echoed seq.

        Raises ``MessageError`` kind "checksum" (bad trailer checksum) or "seq"/"payload"
        (content differs from R(P))."""
        t = self.toff - self.reply_start
        seq, ck = struct.unpack_from("<QQ", buf, t)
        if ck != checksum(buf, 0, len(buf), t):
            raise MessageError("checksum", f"reply checksum mismatch (echoed seq {seq})")
        if bytes(buf) != expected:
            eseq = struct.unpack_from("<Q", expected, t)[0]
            if seq != eseq:
                raise MessageError("seq", f"reply echoes seq {seq}, expected {eseq}")
            raise MessageError("payload", f"reply for seq {seq} differs from R(P)")
        return seq


@functools.lru_cache(maxsize=64)
def _pattern(seed: int, src: int, nbytes: int) -> bytes:
    """Attention rank ``src``'s fixed pseudo-random payload bytes (each <= 0x7F), ``nbytes`` long."""
    d = hashlib.shake_128(f"afdwin:{seed}:{src}".encode()).digest(nbytes)
    return d.translate(_MASK7F)
