"""The attention rank: dispatches into every FFN peer's window, combines the replies on its
own flags (docs/afdwin.md "Protocol"), and its part of the quiesce cut and the window checks.
"""

from __future__ import annotations

import signal
import time

from .evidence import PairEvidence
from .layout import FLAG_REPLY_READY
from .payload import MessageError
from .rank_base import Rank


class AttentionRank(Rank):
    """Writes dispatches into every FFN peer, waits for replies on its own flags."""

    def setup_role(self) -> None:
        cu, call = self.cu, self.cd.call
        sl = self.win.slot
        self.ffn_ranks = list(range(self.A, self.cfg.world))
        self.streams = [
            call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_NON_BLOCKING) for _ in range(self.D)
        ]
        self.send_buf = {
            (f, r): self.hbuf(sl.slot_bytes) for f in self.ffn_ranks for r in range(self.D)
        }
        self.recv_buf = {
            (f, r): self.hbuf(self.codec.reply_bytes) for f in self.ffn_ranks for r in range(self.D)
        }
        self.evidence = {f: PairEvidence(src=f, dst=self.rank) for f in self.ffn_ranks}
        self.inflight: dict[int, dict] = {}
        self.next_step = 1
        self.issued = 0  # last seq stamped (steps, then the shutdown)
        self.ring_last_issued = [0] * self.D
        self.ring_last_replied = [0] * self.D  # last completed non-shutdown step per ring
        self.sent = self.received = self.replied = 0
        self.shutdown_seq = None
        self.next_issue_at = 0.0
        self.held: list[dict] = []  # pending_at_cut: replies landed, unread at a cut
        self.holds_announced: set[int] = set()  # --hold-at steps whose "hold" event was sent
        self.hold_releases = 0  # SIGUSR1s: each ends one hold without a quiesce
        if self.cfg.hold_at:
            signal.signal(signal.SIGUSR1, self._release_hold)

    def _release_hold(self, signum, frame) -> None:
        self.hold_releases += 1

    def issued_seq(self) -> int:
        return self.issued

    def last_seq(self) -> dict:
        return {f: self.issued for f in self.ffn_ranks}

    def counters(self) -> dict:
        return {"sent": self.sent, "received": self.received, "replied": self.replied}

    def issue(self, s: int, shutdown: bool = False, combine: bool = True) -> None:
        """Dispatch step ``s`` to every FFN rank on its ring's stream, then (``combine``)
        enqueue the reply waits, reads and in-band resets behind it."""
        cu, call = self.cu, self.cd.call
        ring = (s - 1) % self.D
        stage = self.cfg.stage_of(s)
        if ring not in self.cfg.stage_rings(stage):  # stages own disjoint rings
            raise RuntimeError(f"step {s}: ring {ring} is not owned by stage {stage}")
        stream = self.streams[ring]
        sl = self.win.slot
        region = self.role_rank
        st = {
            "s": s,
            "t0": time.monotonic(),
            "shutdown": shutdown,
            "dispatch": {},
            "split": not shutdown and not combine,
            "ring": ring,
        }
        for f in self.ffn_ranks:
            msg = (
                self.codec.shutdown(s)
                if shutdown
                else self.codec.dispatch(self.rank, f - self.A, s)
            )
            st["dispatch"][f] = msg  # what R(P) is checked against
            if s == self.cfg.corrupt_step:  # test-only: magic 0 on the wire
                msg = bytes(4) + msg[4:]
            buf = self.send_buf[(f, ring)]
            buf.write(msg)
            call(
                cu.cuMemcpyHtoDAsync, self.slot_va(f, region, ring), buf.addr, sl.slot_bytes, stream
            )
            # the flag is stamped last, on the same stream: visible flag => complete payload
            call(cu.cuStreamWriteValue32, stream, self.flag_va(f, region, ring), s, 0)
        if not shutdown:
            if combine:
                self.enqueue_combine(st)
            self.sent += len(self.ffn_ranks)
        self.issued = s
        self.ring_last_issued[ring] = s
        self.inflight[ring] = st
        self.rates.start_clock()

    def enqueue_combine(self, st: dict) -> None:
        """Per FFN rank, on the step's ring stream: cuStreamWaitValue32(own flag >= 1) ->
        DtoH of the reply -> reset of the own flag to 0 (before the ring can be reused)."""
        cu, call = self.cu, self.cd.call
        ring = st["ring"]
        stream = self.streams[ring]
        geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        for f in self.ffn_ranks:
            fr = f - self.A
            own_flag = self.flag_va(self.rank, fr, ring)
            call(cu.cuStreamWaitValue32, stream, own_flag, FLAG_REPLY_READY, geq)
            call(
                cu.cuMemcpyDtoHAsync,
                self.recv_buf[(f, ring)].addr,
                self.slot_va(self.rank, fr, ring) + self.codec.reply_start,
                self.codec.reply_bytes,
                stream,
            )
            call(cu.cuStreamWriteValue32, stream, own_flag, 0, 0)  # in-band reset
        st["split"] = False

    def try_stop(self) -> None:
        """Stop issuing. ``pending_at_cut``: first dispatch the next step and stop before its
        combine (the FFN drains it; its reply lands unread). ``no_drain`` (the FFN ranks are
        already parked): make sure a reply is owed at the cut by issuing the next step."""
        cfg = self.cfg
        s = self.next_step
        if (cfg.pending_at_cut or cfg.no_drain) and s <= cfg.steps and self.shutdown_seq is None:
            ring = (s - 1) % self.D
            if ring in self.inflight:
                st = self.inflight[ring]
                if cfg.pending_at_cut or self.replied_by_all(st):
                    return  # that step completes (its replies are issued)
            else:
                self.issue(s, combine=not cfg.pending_at_cut)
                self.next_step += 1
        self.send_stopped()

    def replied_by_all(self, st: dict) -> bool:
        """(--no-drain) every FFN rank issued its reply to in-flight step ``st`` before it
        parked, so the step's stream completes."""
        return all(
            self.ffn_replied.get(f, {}).get(self.rank, {}).get(st["ring"], 0) >= st["s"]
            for f in self.ffn_ranks
        )

    def reap(self) -> bool:
        progressed = False
        for ring in list(self.inflight):
            if self.inflight[ring]["split"] or not self.cd.stream_done(self.streams[ring]):
                continue
            st = self.inflight.pop(ring)
            progressed = True
            if st["shutdown"]:
                continue
            self.ring_last_replied[ring] = st["s"]
            rtt = time.monotonic() - st["t0"]
            for f in self.ffn_ranks:
                got = self.recv_buf[(f, ring)].read()
                expected = self.codec.reply(st["dispatch"][f], f - self.A)
                self.received += 1
                try:
                    seq = self.codec.check_reply(got, expected)
                except MessageError as e:
                    self.evidence[f].torn(e.kind)
                    self.errors.append(f"reply from rank {f} step {st['s']}: {e}")
                    continue
                self.evidence[f].add(seq)
                self.replied += 1
                for h in self.held:
                    if (h["ffn"], h["seq"]) == (f, seq):
                        h["consumed"] += 1
            self.rates.record(
                len(self.ffn_ranks),
                len(self.ffn_ranks) * (self.win.slot_bytes + self.codec.reply_bytes),
                rtt,
            )
        return progressed

    def loop(self) -> None:
        S = self.cfg.steps
        delay = self.cfg.step_delay_ms / 1000.0
        idle = 0
        while True:
            self.service_control()
            progressed = self.reap()
            if self.stop_pending:
                self.try_stop()
            if self.state == "running":
                s = self.next_step
                ring = (s - 1) % self.D
                now = time.monotonic()
                if self.holding(s):
                    pass
                elif ring not in self.inflight and now >= self.next_issue_at:
                    if s <= S:
                        self.issue(s)
                        self.next_step += 1
                        self.next_issue_at = now + delay
                        progressed = True
                    elif self.shutdown_seq is None:
                        self.shutdown_seq = s
                        self.issue(s, shutdown=True)
                        progressed = True
            if self.shutdown_seq is not None and not self.inflight:
                return
            self.progress()
            idle = 0 if progressed else idle + 1
            if idle:
                time.sleep(min(0.002, 0.0001 * idle))

    def holding(self, s: int) -> bool:
        """--hold-at: step ``s`` waits for the next quiesce or SIGUSR1 (control is still
        serviced, so the rank stops and parks when asked). The first time at a hold: a "hold" event, once every
        step up to the hold is complete (the stream is idle at the hold)."""
        h = self.cfg.hold_before(s, self.quiesces + self.hold_releases)
        if h is None:
            return False
        if h not in self.holds_announced and not self.inflight:
            self.holds_announced.add(h)
            self.emit(
                {
                    "event": "hold",
                    "rank": self.rank,
                    "step": h,
                    "quiesce": self.cfg.hold_at.index(h) + 1,
                    "replied": self.replied,
                }
            )
        return True

    def sync_all(self) -> None:
        for ring, st in enumerate(self.streams):
            if (
                self.state != "finished"
                and self.cfg.no_drain
                and ring in self.inflight
                and not self.replied_by_all(self.inflight[ring])
            ):
                continue  # --no-drain: this stream waits on an owed reply
            self.cd.call(self.cu.cuStreamSynchronize, st)
        self.cd.call(self.cu.cuStreamSynchronize, self.aux)

    def pending_at_park(self) -> list[dict]:
        """After the sync: replies owed (a stream still waits: --no-drain) and reply flags that
        landed but were not read yet (own flag = 1 with no wait enqueued: --pending-at-cut)."""
        out = []
        for ring, st in sorted(self.inflight.items()):
            if not st["split"] and not st["shutdown"]:
                for f in self.ffn_ranks:
                    if self.ffn_replied.get(f, {}).get(self.rank, {}).get(ring, 0) < st["s"]:
                        out.append(
                            {
                                "kind": "reply_owed",
                                "src": f,
                                "dst": self.rank,
                                "ring": ring,
                                "seq": st["s"],
                            }
                        )
        flags = self.read_flags(self.rank)
        for ring, st in sorted(self.inflight.items()):
            if st["split"]:
                for f in self.ffn_ranks:
                    v = flags[self.win.flag_idx(f - self.A, ring)]
                    if v == FLAG_REPLY_READY:
                        out.append(
                            {
                                "kind": "reply_unread",
                                "src": f,
                                "dst": self.rank,
                                "ring": ring,
                                "seq": st["s"],
                            }
                        )
                    self.held.append(
                        {
                            "quiesce": self.quiesces,
                            "ffn": f,
                            "ring": ring,
                            "seq": st["s"],
                            "flag_at_cut": v,
                            "flag_at_resume": None,
                            "consumed": 0,
                        }
                    )
        return out

    def resume_protocol(self) -> None:
        """Enqueue the combine of a step dispatched before the cut (--pending-at-cut): its
        wait finds the reply flag already set, reads the reply and resets the flag."""
        for st in self.inflight.values():
            if st["split"]:
                st["t0"] = time.monotonic()
                self.enqueue_combine(st)

    def done_event(self) -> dict:
        ev = super().done_event()
        ev["cut_pending"] = self.held
        ev["final_flags"] = getattr(self, "final_flags", None)
        return ev

    def finish(self) -> None:
        """No reply flag is left at 1 after its consumer finished."""
        self.sync_all()
        own = self.read_flags(self.rank)
        self.final_flags = own
        if any(own):
            self.errors.append(f"reply flags left set after the last combine: {own}")
        super().finish()

    def after_sync(self) -> None:
        self.reap()

    def check_windows(self) -> None:
        """After a resume: own reply slots hold R(P) of the last completed step per ring and
        own flags are 0; through each peer mapping, the FFN's dispatch slot and flag hold the
        last dispatch issued on that ring."""
        own = self.read_flags(self.rank)
        held = {(h["ffn"], h["ring"]): h for h in self.held if h["quiesce"] == self.quiesces}
        owed_rings = set(self.inflight) if self.cfg.no_drain else set()
        want = []
        for f in self.ffn_ranks:
            for ring in range(self.D):
                if (f, ring) in held:
                    held[(f, ring)]["flag_at_resume"] = own[self.win.flag_idx(f - self.A, ring)]
                    want.append((FLAG_REPLY_READY,))
                elif ring in owed_rings:
                    want.append((0, FLAG_REPLY_READY))  # one FFN may have replied already
                else:
                    want.append((0,))
        got = [
            own[self.win.flag_idx(f - self.A, ring)]
            for f in self.ffn_ranks
            for ring in range(self.D)
        ]
        self.record_check(
            all(g in w for g, w in zip(got, want)), f"own flags {got}, expected {want}"
        )
        for f in self.ffn_ranks:
            fr = f - self.A
            pflags = self.read_flags(f)
            for ring in range(self.D):
                s_done = self.ring_last_replied[ring]
                if (f, ring) in held:
                    s_done = held[(f, ring)]["seq"]  # the reply that landed before the cut
                if s_done and ring not in owed_rings:
                    got = self.read_device(
                        self.slot_va(self.rank, fr, ring) + self.codec.reply_start,
                        self.codec.reply_bytes,
                    )
                    exp = self.codec.reply(self.codec.dispatch(self.rank, fr, s_done), fr)
                    self.record_check(
                        got == exp, f"own reply slot rank {f} ring {ring} != R(P(step {s_done}))"
                    )
                s_iss = self.ring_last_issued[ring]
                self.record_check(
                    pflags[self.win.flag_idx(self.role_rank, ring)] == s_iss,
                    f"peer rank {f} flag ring {ring} = "
                    f"{pflags[self.win.flag_idx(self.role_rank, ring)]}, "
                    f"expected {s_iss}",
                )
                if s_iss:
                    got = self.read_device(
                        self.slot_va(f, self.role_rank, ring), self.win.slot_bytes
                    )
                    exp = (
                        self.codec.shutdown(s_iss)
                        if s_iss == self.shutdown_seq
                        else self.codec.dispatch(self.rank, fr, s_iss)
                    )
                    self.record_check(
                        got == exp, f"peer rank {f} dispatch slot ring {ring} != P(step {s_iss})"
                    )
