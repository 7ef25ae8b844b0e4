"""The FFN rank: polls its flag array, validates dispatches, writes replies into the attention
windows (docs/afdwin.md "Protocol"), and its part of the quiesce cut and the window checks.
"""

from __future__ import annotations

import struct
import time

from .evidence import PairEvidence, percentile
from .layout import FLAG_REPLY_READY
from .payload import MessageError
from .rank_base import Rank


class FfnRank(Rank):
    """Polls its flag array, validates dispatches, writes replies into attention windows."""

    def setup_role(self) -> None:
        cu, call = self.cu, self.cd.call
        sl = self.win.slot
        nonblocking = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.poll_stream = call(cu.cuStreamCreate, nonblocking)
        self.reply_stream = call(cu.cuStreamCreate, nonblocking)
        self.attn_ranks = list(range(self.A))
        self.flags_buf = self.hbuf(4 * self.win.num_flags)
        self.slot_buf = {
            (a, r): self.hbuf(sl.slot_bytes) for a in self.attn_ranks for r in range(self.D)
        }
        self.reply_buf = {
            (a, r): self.hbuf(self.codec.reply_bytes)
            for a in self.attn_ranks
            for r in range(self.D)
        }
        self.evidence = {a: PairEvidence(src=a, dst=self.rank) for a in self.attn_ranks}
        self.seen = [0] * self.win.num_flags
        self.last = {(a, r): 0 for a in self.attn_ranks for r in range(self.D)}
        self.last_replied = {(a, r): 0 for a in self.attn_ranks for r in range(self.D)}
        self.shutdown_from: dict[int, int] = {}
        self.targets: dict[int, int] = {}
        self.sent = self.received = self.replied = 0
        self.service_us: list[float] = []

    def issued_seq(self) -> int:
        return 0

    def replied_map(self) -> dict:
        """{attention rank: {ring: last seq replied}} (the replies this rank has issued)."""
        return {a: {r: self.last_replied[(a, r)] for r in range(self.D)} for a in self.attn_ranks}

    def pending_at_park(self) -> list[dict]:
        """After the sync: dispatch flags written but not consumed (own flag != last seen)."""
        out = []
        for idx, v in enumerate(self.read_flags(self.rank)):
            if v != self.seen[idx]:
                a, ring = divmod(idx, self.D)
                out.append(
                    {
                        "kind": "dispatch_unconsumed",
                        "src": a,
                        "dst": self.rank,
                        "ring": ring,
                        "seq": v,
                    }
                )
        return out

    def last_seq(self) -> dict:
        return {a: max(self.last[(a, r)] for r in range(self.D)) for a in self.attn_ranks}

    def counters(self) -> dict:
        return {"sent": self.sent, "received": self.received, "replied": self.replied}

    def drained(self, targets: dict[int, int]) -> bool:
        """Every ring of every attention rank in ``targets`` reached its last issued seq."""
        for a, tgt in targets.items():
            for r in range(self.D):
                want = tgt - ((tgt - 1 - r) % self.D) if tgt >= r + 1 else 0
                if self.last[(a, r)] != want:
                    return False
        return True

    def poll(self) -> bool:
        cu, call = self.cu, self.cd.call
        n = self.win.num_flags
        call(cu.cuMemcpyDtoHAsync, self.flags_buf.addr, self.base, 4 * n, self.poll_stream)
        call(cu.cuStreamSynchronize, self.poll_stream)
        vals = struct.unpack_from(f"<{n}i", self.flags_buf.view)
        progressed = False
        for idx, v in enumerate(vals):
            if v != self.seen[idx]:
                self.on_flag(idx, v)
                self.seen[idx] = v
                progressed = True
        return progressed

    def on_flag(self, idx: int, v: int) -> None:
        cu, call = self.cu, self.cd.call
        t0 = time.monotonic()
        region, ring = divmod(idx, self.D)
        if region >= self.A:
            self.errors.append(f"flag {idx} (region {region}) written, no attention rank there")
            return
        a = region
        ev = self.evidence[a]
        prev = self.last[(a, ring)]
        want = prev + self.D if prev else ring + 1
        if v <= 0:
            ev.torn("flag")
            self.errors.append(f"flag from rank {a} ring {ring} went to {v} (last {prev})")
            return
        if v != want:
            ev.out_of_order()
            self.errors.append(f"rank {a} ring {ring}: seq {v}, expected exactly-next {want}")
        self.last[(a, ring)] = v
        buf = self.slot_buf[(a, ring)]
        call(
            cu.cuMemcpyDtoHAsync,
            buf.addr,
            self.slot_va(self.rank, a, ring),
            self.win.slot_bytes,
            self.poll_stream,
        )
        call(cu.cuStreamSynchronize, self.poll_stream)
        data = buf.read()
        try:
            hdr, seq = self.codec.check_dispatch(data, expect_seq=v)
        except MessageError as e:
            ev.torn(e.kind)
            self.errors.append(f"dispatch from rank {a} ring {ring} seq {v}: {e}")
            reply = self.codec.empty_reply(v)
        else:
            if hdr.shutdown:
                self.shutdown_from[a] = v
                return
            ev.add(seq)
            self.received += 1
            reply = self.codec.reply(data, self.role_rank)
        rb = self.reply_buf[(a, ring)]
        rb.write(reply)
        call(
            cu.cuMemcpyHtoDAsync,
            self.slot_va(a, self.role_rank, ring) + self.codec.reply_start,
            rb.addr,
            self.codec.reply_bytes,
            self.reply_stream,
        )
        call(
            cu.cuStreamWriteValue32,
            self.reply_stream,
            self.flag_va(a, self.role_rank, ring),
            FLAG_REPLY_READY,
            0,
        )
        self.last_replied[(a, ring)] = v
        self.sent += 1
        self.replied += 1
        self.service_us.append((time.monotonic() - t0) * 1e6)
        self.rates.record(1, self.win.slot_bytes + self.codec.reply_bytes)

    def loop(self) -> None:
        idle = 0
        while True:
            self.service_control()
            progressed = self.poll()
            if self.state == "draining" and self.drained(self.targets):
                self.park()
            if len(self.shutdown_from) == self.A and self.drained(self.shutdown_from):
                return
            self.progress()
            idle = 0 if progressed else idle + 1
            if idle:
                time.sleep(min(0.002, 0.0001 * idle))

    def sync_all(self) -> None:
        for st in (self.poll_stream, self.reply_stream, self.aux):
            self.cd.call(self.cu.cuStreamSynchronize, st)

    def after_sync(self) -> None:
        pass

    def done_event(self) -> dict:
        ev = super().done_event()
        ev["shutdown_from"] = sorted(self.shutdown_from)
        us = [round(x, 1) for x in self.service_us]
        ev["service_us_p50"] = percentile(us, 50)
        ev["service_us_p99"] = percentile(us, 99)
        return ev

    def check_windows(self) -> None:
        """After a resume: own flags equal last seen and each own dispatch slot holds the last
        consumed message; through each attention peer's mapping, its reply flags are 0 and the
        reply slot holds R(P) of the last replied step."""
        own = self.read_flags(self.rank)
        unconsumed = {}  # written, not consumed at the cut: must be exactly-next
        for idx, v in enumerate(own):
            if v != self.seen[idx] and idx < self.A * self.D:
                a, ring = divmod(idx, self.D)
                prev = self.last[(a, ring)]
                if v == (prev + self.D if prev else ring + 1):
                    unconsumed[(a, ring)] = v
        self.record_check(
            all(v == self.seen[i] or divmod(i, self.D) in unconsumed for i, v in enumerate(own)),
            f"own flags {own} != last seen {self.seen}",
        )
        unread = {
            (p["dst"], p["ring"]): p["seq"]
            for p in self.cut_pending
            if p.get("kind") == "reply_unread" and p.get("src") == self.rank
        }
        for a in self.attn_ranks:
            pflags = self.read_flags(a)
            for ring in range(self.D):
                s = self.last[(a, ring)]
                rflag = pflags[self.win.flag_idx(self.role_rank, ring)]
                want = (
                    (FLAG_REPLY_READY,)
                    if (a, ring) in unread
                    else (0, FLAG_REPLY_READY)
                    if self.cfg.no_drain
                    else (0,)
                )
                self.record_check(
                    rflag in want,
                    f"attention rank {a} reply flag ring {ring} = {rflag}, expected one of {want}",
                )
                if (a, ring) in unconsumed:
                    got = self.read_device(self.slot_va(self.rank, a, ring), self.win.slot_bytes)
                    v = unconsumed[(a, ring)]
                    exp = (
                        self.codec.shutdown(v)
                        if v == self.cfg.steps + 1
                        else self.codec.dispatch(a, self.role_rank, v)
                    )
                    self.record_check(
                        got == exp, f"unconsumed dispatch slot rank {a} ring {ring} != P(step {v})"
                    )
                if not s:
                    continue
                if (a, ring) not in unconsumed:  # else overwritten by the next dispatch
                    got = self.read_device(self.slot_va(self.rank, a, ring), self.win.slot_bytes)
                    exp = (
                        self.codec.shutdown(s)
                        if self.shutdown_from.get(a) == s
                        else self.codec.dispatch(a, self.role_rank, s)
                    )
                    self.record_check(
                        got == exp, f"own dispatch slot rank {a} ring {ring} != P(step {s})"
                    )
                s = self.last_replied[(a, ring)]
                if not s:
                    continue
                got = self.read_device(
                    self.slot_va(a, self.role_rank, ring) + self.codec.reply_start,
                    self.codec.reply_bytes,
                )
                exp = self.codec.reply(self.codec.dispatch(a, self.role_rank, s), self.role_rank)
                self.record_check(
                    got == exp, f"attention rank {a} reply slot ring {ring} != R(P(step {s}))"
                )
