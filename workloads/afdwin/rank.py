"""One afdwin rank process: window setup on driver VMM, then the attention or FFN loop.

Started by the launcher as ``python -m cuinterpose.workloads.afdwin.rank --connect SOCK
--rank I``; everything else arrives in the launcher's ``config`` message. The rank never
writes stdout: events go to the launcher over the socket. Exit status 0 when every invariant
this rank can see held, 1 on a failed invariant or error, 2 when the launcher went away.

Single-threaded on purpose: control messages are read between driver calls, so a parked rank
is provably not inside CUDA.
"""
from __future__ import annotations

import argparse
import os
import socket
import struct
import sys
import time
import traceback

from .config import Config
from .evidence import PairEvidence, Rates
from .layout import FLAG_REPLY_READY
from .payload import Codec, MessageError
from .wire import Channel, ChannelClosed

PROGRESS_INTERVAL_S = 0.25


class GeometryError(ValueError):
    """The launcher found a geometry field that differs across ranks (message names it)."""


class Abort(RuntimeError):
    """The launcher told this rank to stop (geometry mismatch, another rank failed)."""


class Rank:
    """State of one rank. ``rank``: world rank; ``cfg``: the run config (after test overrides)."""

    def __init__(self, chan: Channel, rank: int, cfg: Config, host_memory: str):
        self.chan = chan
        self.rank = rank
        self.cfg = cfg
        self.role = cfg.role(rank)
        self.role_rank = cfg.role_rank(rank)
        self.host_memory = host_memory
        self.win = cfg.window_layout()
        self.codec = Codec(cfg)
        self.pid = os.getpid()
        self.state = "setup"            # setup, running, stopping, draining, parked, finished
        self.quiesce_id = None
        self.restores_seen = 0
        self.quiesces = 0
        self.rates = Rates()
        self.window_checks = {"checked": 0, "failed": 0, "failures": []}
        self.errors: list[str] = []
        self._last_progress = 0.0
        self.A, self.F, self.D = cfg.attention, cfg.ffn, cfg.ring_depth
        self.fence_erased: list[dict] = []
        self.cut_pending: list[dict] = []     # the launcher's union of every rank's "pending"
        self.stop_pending = False
        self.ffn_replied: dict = {}

    # ---- messaging ------------------------------------------------------------------------
    def send(self, msg: dict, fds=()) -> None:
        self.chan.send(msg, fds)

    def emit(self, event: dict) -> None:
        self.send({"type": "event", "event": event})

    def expect(self, mtype: str) -> tuple[dict, list[int]]:
        """Block for the next message; it must be ``mtype`` (or abort/fail, which raise)."""
        msg, fds = self.chan.recv()
        if msg["type"] in ("fail", "abort"):
            raise Abort(msg.get("message", msg["type"]))
        if msg["type"] != mtype:
            raise RuntimeError(f"rank {self.rank}: expected {mtype!r}, got {msg['type']!r}")
        return msg, fds

    def barrier(self, name: str) -> None:
        self.send({"type": "barrier", "name": name})
        self.expect("barrier")

    # ---- setup (afd-window.md §3, §5.3): one method per step ---------------------------------
    def setup(self) -> None:
        from cuda.bindings import driver as cu

        from . import cudrv
        self.cu, self.cd = cu, cudrv
        self.init_context()
        self.validate_geometry()
        self.create_window()
        self.map_peers()
        self.aux = cudrv.call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.pinned = self._host_memory_choice()
        self.fence()
        if self.cfg.multicast:
            self.setup_multicast()
            self.multicast_check()
        if self.role == "attention":
            self._setup_attention()
        else:
            self._setup_ffn()
        self.emit(self.window_event(after_restore=False))
        self.state = "running"

    def init_context(self) -> None:
        """cuInit, device ``rank mod device count``, its primary context made current."""
        cu, call = self.cu, self.cd.call
        call(cu.cuInit, 0)
        ndev = call(cu.cuDeviceGetCount)
        self.device_ordinal = self.rank % ndev
        self.device = call(cu.cuDeviceGet, self.device_ordinal)
        self.ctx = call(cu.cuDevicePrimaryCtxRetain, self.device)
        call(cu.cuCtxSetCurrent, self.ctx)

    def validate_geometry(self) -> None:
        """Send the §3 tuple; raises ``GeometryError`` when the launcher reports a mismatch."""
        self.send({"type": "geometry", "values": list(self.win.geometry())})
        msg, _ = self.chan.recv()
        if msg["type"] == "fail":
            if "field" in msg:                  # named by the launcher: field, values, message
                raise GeometryError(msg["message"])
            raise Abort(msg["message"])
        if msg["type"] != "geometry_ok":
            raise RuntimeError(f"expected geometry_ok, got {msg['type']!r}")

    def create_window(self) -> None:
        """One reservation of N x stride; own allocation (stride bytes) mapped at its base."""
        cu, call = self.cu, self.cd.call
        self.prop = self.cd.alloc_prop(self.device_ordinal)
        gran_opt = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        self.granularity = int(call(cu.cuMemGetAllocationGranularity, self.prop, gran_opt))
        total = self.win.total_bytes
        self.stride = -(-total // self.granularity) * self.granularity
        self.base = int(call(cu.cuMemAddressReserve, self.cfg.world * self.stride,
                             self.granularity, 0, 0))
        self.alloc_handle = call(cu.cuMemCreate, self.stride, self.prop, 0)
        call(cu.cuMemMap, self.base, self.stride, 0, self.alloc_handle, 0)
        self.access = [self.cd.rw_access(self.device_ordinal)]
        call(cu.cuMemSetAccess, self.base, self.stride, self.access, 1)
        self.probe_off = self.stride - 8 if self.stride - total >= 8 else None
        self.probe_epoch = 0

    def map_peers(self) -> None:
        """Export own handle (FD closed once sent), import every peer's FD (closed once
        mapped), map peer p at base + stride * ((p - rank) mod N), release the import."""
        cu, call = self.cu, self.cd.call
        N = self.cfg.world
        htype = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        fd = int(call(cu.cuMemExportToShareableHandle, self.alloc_handle, htype, 0))
        try:
            self.send({"type": "export", "rank": self.rank}, [fd])
        finally:
            os.close(fd)          # a held exported FD makes native checkpoint fail
        msg, fds = self.expect("peers")
        self.peer_va = [0] * N
        self.peer_va[self.rank] = self.base
        try:
            for peer, pfd in zip(msg["ranks"], fds):
                va = self.base + self.stride * ((peer - self.rank) % N)   # ring order
                imp = call(cu.cuMemImportFromShareableHandle, pfd, htype,
                           detail=f"fd from rank {peer}")
                call(cu.cuMemMap, va, self.stride, 0, imp, 0, detail=f"peer rank {peer}")
                call(cu.cuMemRelease, imp)
                call(cu.cuMemSetAccess, va, self.stride, self.access, 1)
                self.peer_va[peer] = va
        finally:
            for pfd in fds:
                os.close(pfd)

    def fence(self) -> None:
        """Zero the window -> synchronize -> launcher barrier -> synchronize (§3), then check
        through every peer mapping that it aliases the peer's memory (probe word).

        Diagnostics: ``delay_zero_ms`` delays this rank's zeroing; ``no_fence`` drops the
        barrier and the second synchronize (zero + sync only, the pre-review constructor), so a
        peer that returns first can land its first dispatch before a delayed zero erases it.
        """
        cu, call = self.cu, self.cd.call
        if self.cfg.delay_zero_ms:
            time.sleep(self.cfg.delay_zero_ms / 1000.0)
        if self.cfg.no_fence:
            # what the zero is about to erase (a peer wrote before this rank zeroed)
            flags = self.read_flags(self.rank)
            for idx, v in enumerate(flags):
                if v:
                    region, ring = divmod(idx, self.D)
                    self.fence_erased.append({"region": region, "ring": ring, "value": v})
        zeros = self.cd.HostBuffer(self.stride, pinned=False)
        call(cu.cuMemcpyHtoDAsync, self.base, zeros.addr, self.stride, self.aux)
        call(cu.cuStreamSynchronize, self.aux)
        del zeros
        self.write_probe()
        if self.cfg.no_fence:
            if self.fence_erased:
                self.errors.append(f"unfenced zero erased flags written by peers: "
                                   f"{self.fence_erased}")
            return
        self.barrier("fence")
        call(cu.cuCtxSynchronize)
        bad = [err for err in self.read_probes().values() if err]
        if bad:
            raise RuntimeError("peer mappings do not alias the peers' windows: " + "; ".join(bad))

    # ---- --multicast (docs/afdwin.md "--multicast") ----------------------------------------
    MC_WORDS = 64              # uint32 words written through the multicast VA per check

    def setup_multicast(self) -> None:
        """Rank 0 creates and exports a multicast object (one multicast granule, numDevices =
        ranks); the launcher relays the FD; every rank imports it, adds its device, waits at a
        launcher barrier (bind blocks until the team is complete), binds a separate member
        allocation of its own at offset 0, maps that member at ``mc_member_va`` (for reading)
        and the object at a separate ``mc_va`` (for writing), with read-write access; a second
        barrier, since a write through the multicast VA reaches only the members bound then."""
        cu, call = self.cu, self.cd.call
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
        if not call(cu.cuDeviceGetAttribute, attr, self.device):
            raise RuntimeError(f"--multicast: device {self.device_ordinal} reports "
                               "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0")
        htype = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop = cu.CUmulticastObjectProp()
        prop.numDevices = self.cfg.world
        prop.handleTypes = int(htype)
        prop.flags = 0
        prop.size = self.granularity
        gran = int(call(cu.cuMulticastGetGranularity, prop,
                        cu.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED))
        size = -(-max(self.MC_WORDS * 4, gran) // gran) * gran
        size = -(-size // self.granularity) * self.granularity
        prop.size = size
        self.mc_size = size
        if self.rank == 0:
            self.mc_handle = call(cu.cuMulticastCreate, prop)
            fd = int(call(cu.cuMemExportToShareableHandle, self.mc_handle, htype, 0))
            try:
                self.send({"type": "mc_export", "rank": self.rank}, [fd])
            finally:
                os.close(fd)
        else:
            _, fds = self.expect("mc_import")
            try:
                self.mc_handle = call(cu.cuMemImportFromShareableHandle, fds[0], htype,
                                      detail="multicast object from rank 0")
            finally:
                for fd in fds:
                    os.close(fd)
        call(cu.cuMulticastAddDevice, self.mc_handle, self.device)
        self.barrier("mc-devices")            # every device added before any bind or map
        self.mc_member = call(cu.cuMemCreate, size, self.prop, 0)
        call(cu.cuMulticastBindMem, self.mc_handle, 0, self.mc_member, 0, size, 0)
        self.mc_member_va = int(call(cu.cuMemAddressReserve, size, self.granularity, 0, 0))
        call(cu.cuMemMap, self.mc_member_va, size, 0, self.mc_member, 0)
        call(cu.cuMemSetAccess, self.mc_member_va, size, self.access, 1)
        self.mc_va = int(call(cu.cuMemAddressReserve, size, self.granularity, 0, 0))
        call(cu.cuMemMap, self.mc_va, size, 0, self.mc_handle, 0)
        call(cu.cuMemSetAccess, self.mc_va, size, self.access, 1)
        self.barrier("mc-bound")              # a write reaches only the members bound by then
        self.mc_epoch = 0

    def multicast_value(self) -> int:
        return 0x4D430000 | (self.mc_epoch & 0xFFFF)       # "MC" | epoch

    def multicast_check(self) -> None:
        """Rank 0 writes the epoch's value through the multicast VA (cuMemsetD32, reaching
        every member); after a barrier every rank reads its own member (never through the
        multicast VA) and checks every word; emits a ``multicast`` event."""
        cu, call = self.cu, self.cd.call
        value = self.multicast_value()
        if self.rank == 0:
            call(cu.cuMemsetD32, self.mc_va, value, self.MC_WORDS)
        self.barrier(f"mc-written-{self.mc_epoch}")
        words = struct.unpack(f"<{self.MC_WORDS}I", self.read_device(self.mc_member_va,
                                                                    4 * self.MC_WORDS))
        bad = [i for i, w in enumerate(words) if w != value]
        ok = not bad
        self.record_check(ok, "" if ok else (
            f"multicast epoch {self.mc_epoch}: member at {self.mc_member_va:#x} word {bad[0]} "
            f"reads {words[bad[0]]:#010x}, expected {value:#010x}"))
        self.emit({"event": "multicast", "rank": self.rank, "epoch": self.mc_epoch,
                   "value": value, "ok": ok, "mc_va": self.mc_va,
                   "member_va": self.mc_member_va, "writer": 0})
        self.barrier(f"mc-read-{self.mc_epoch}")      # nobody rewrites before all have read
        self.mc_epoch += 1

    def _host_memory_choice(self) -> bool:
        if self.host_memory == "pageable":
            return False
        if self.host_memory == "pinned":
            return True
        try:                                    # auto: pinned when the driver has it
            probe = self.cd.HostBuffer(4096, pinned=True)
            self.cd.call(self.cu.cuMemFreeHost, probe.addr)
            return True
        except Exception:
            return False

    def hbuf(self, size: int):
        return self.cd.HostBuffer(size, pinned=self.pinned)

    # ---- sharing probe: a word in the stride padding past total_bytes ------------------------
    def probe_value(self, rank: int) -> int:
        return 0xA5000000 | (rank & 0xFF) << 16 | (self.probe_epoch & 0xFFFF)

    def write_probe(self) -> None:
        """Write this rank's probe word into its own window (stride padding) and synchronize."""
        if self.probe_off is None:
            return
        buf = self.cd.HostBuffer(4, pinned=False)
        buf.write(struct.pack("<I", self.probe_value(self.rank)))
        self.cd.call(self.cu.cuMemcpyHtoDAsync, self.base + self.probe_off, buf.addr, 4, self.aux)
        self.cd.call(self.cu.cuStreamSynchronize, self.aux)

    def read_probes(self) -> dict[int, str | None]:
        """Read every peer's probe word through this rank's mapping of the peer's window:
        ``{peer: None}`` when it holds the value that peer wrote, else an error text (the
        mapping no longer aliases the peer's memory: sharing lost). Empty without padding."""
        if self.probe_off is None:
            return {}
        out = {}
        for peer, va in enumerate(self.peer_va):
            if peer == self.rank:
                continue
            (got,) = struct.unpack("<I", self.read_device(va + self.probe_off, 4))
            want = self.probe_value(peer)
            out[peer] = None if got == want else (
                f"rank {peer} probe at VA {va + self.probe_off:#x} reads {got:#010x}, "
                f"expected {want:#010x} (sharing lost)")
        return out

    def window_event(self, after_restore: bool) -> dict:
        return {"event": "window", "rank": self.rank, "pid": self.pid, "role": self.role,
                "device": self.device_ordinal, "base_va": self.base,
                "peer_va": list(self.peer_va), "stride": self.stride,
                "slot_bytes": self.win.slot_bytes, "total_bytes": self.win.total_bytes,
                "regions": self.win.num_regions, "rings": self.win.ring_depth,
                "handle_type": "POSIX_FILE_DESCRIPTOR", "granularity": self.granularity,
                "stages": self.cfg.num_stages,
                "host_memory": "pinned" if self.pinned else "pageable",
                "after_restore": after_restore,
                **({"mc_va": self.mc_va, "mc_member_va": self.mc_member_va,
                    "mc_size": self.mc_size} if self.cfg.multicast else {})}

    # ---- addresses ------------------------------------------------------------------------
    def flag_va(self, owner: int, region: int, ring: int) -> int:
        return self.peer_va[owner] + self.win.flag_off(region, ring)

    def slot_va(self, owner: int, region: int, ring: int) -> int:
        return self.peer_va[owner] + self.win.slot_off(region, ring)

    # ---- control --------------------------------------------------------------------------
    def service_control(self) -> None:
        """Handle every pending launcher message without blocking (except when parking)."""
        while True:
            got = self.chan.recv(timeout=0)
            if got is None:
                return
            self.on_control(got[0])

    def on_control(self, msg: dict) -> None:
        t = msg["type"]
        if t in ("abort", "fail"):
            raise Abort(msg.get("message", t))
        if t == "quiesce":                                  # attention: stop issuing
            self.quiesce_id = msg["id"]
            self.quiesces += 1
            self.ffn_replied = {int(f): {int(a): {int(r): int(v) for r, v in rings.items()}
                                         for a, rings in by_a.items()}
                                for f, by_a in (msg.get("replied") or {}).items()}
            if self.state != "finished":
                self.state = "stopping"
                self.stop_pending = True
                self.try_stop()
            else:
                self.send_stopped()
        elif t == "drain":                                  # ffn: drain to targets, then park
            self.quiesce_id = msg["id"]
            self.quiesces += 1
            self.targets = {int(k): int(v) for k, v in (msg.get("targets") or {}).items()}
            if self.state != "finished" and not msg.get("no_drain"):
                self.state = "draining"
            else:
                self.park()                 # --no-drain: park at once, owed replies unissued
        elif t == "park":                                   # attention: replies are owed now
            self.park()
        elif t == "report":                                 # launcher gives up: evidence
            ev = self.done_event()
            ev["partial"] = True
            self.emit(ev)
        elif t == "exit":
            raise SystemExit(0 if self.ok() else 1)
        else:
            raise RuntimeError(f"rank {self.rank}: unexpected message {t!r} in state "
                               f"{self.state}")

    def send_stopped(self) -> None:
        self.stop_pending = False
        self.send({"type": "stopped", "id": self.quiesce_id, "rank": self.rank,
                   "issued": self.issued_seq()})

    def try_stop(self) -> None:
        self.send_stopped()

    def pending_at_park(self) -> list[dict]:
        """Protocol messages in flight at the cut (read from the device after the sync)."""
        return []

    def park(self) -> None:
        """Synchronize every stream, ack, then wait (no CUDA) for resume + continue."""
        was = self.state
        self.sync_all()
        self.after_sync()
        pending = self.pending_at_park()
        self.rates.close()
        self.state = "parked"
        self.send({"type": "parked", "id": self.quiesce_id, "rank": self.rank, "pid": self.pid,
                   "role": self.role, "last_seq": self.last_seq(), "pending": pending,
                   "replied": self.replied_map()})
        restored = None
        while True:
            got = self.chan.recv(timeout=PROGRESS_INTERVAL_S)
            if got is None:
                self.progress(force=True)
                continue
            msg = got[0]
            if msg["type"] in ("abort", "fail"):
                raise Abort(msg.get("message", msg["type"]))
            if msg["type"] == "report":
                self.on_control(msg)
            elif msg["type"] == "resume":
                restored = bool(msg.get("restored"))
                self.cut_pending = msg.get("pending") or []
                if restored:
                    self.restores_seen += 1
                    self.emit(self.window_event(after_restore=True))
                self.check_windows()
                self.probe_epoch += 1
                self.write_probe()
                self.barrier(f"probe-{self.probe_epoch}")
                for peer, err in self.read_probes().items():
                    self.record_check(err is None, err or "")
                if self.cfg.multicast:
                    self.multicast_check()
                self.send({"type": "resumed", "id": self.quiesce_id, "rank": self.rank,
                           "window_checks": {k: v for k, v in self.window_checks.items()
                                             if k != "failures"}})
            elif msg["type"] == "continue" and restored is not None:
                break
            else:
                raise RuntimeError(f"rank {self.rank}: unexpected {msg['type']!r} while parked")
        self.rates.open(restored=bool(restored))
        self.after_resume()
        self.resume_protocol()
        self.state = "finished" if was == "finished" else "running"

    def after_resume(self) -> None:
        """Forget deadlines taken from CLOCK_MONOTONIC, which may jump across a restore."""
        self._last_progress = 0.0
        if hasattr(self, "next_issue_at"):
            self.next_issue_at = 0.0

    def resume_protocol(self) -> None:
        """First CUDA work after a resume (attention: enqueue a combine held across the cut)."""

    def replied_map(self) -> dict:
        return {}

    def progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress < PROGRESS_INTERVAL_S:
            return
        self._last_progress = now
        ev = {"event": "progress", "rank": self.rank, "role": self.role, "state": self.state,
              "parked": self.state == "parked"}
        ev.update(self.counters())
        ev["last_seq"] = {str(k): v for k, v in self.last_seq().items()}
        self.emit(ev)

    def ok(self) -> bool:
        return not self.errors and self.window_checks["failed"] == 0

    def record_check(self, ok: bool, what: str) -> None:
        self.window_checks["checked"] += 1
        if not ok:
            self.window_checks["failed"] += 1
            if len(self.window_checks["failures"]) < 8:
                self.window_checks["failures"].append(what)

    def read_device(self, va: int, n: int) -> bytes:
        buf = self.cd.HostBuffer(n, pinned=False)
        self.cd.call(self.cu.cuMemcpyDtoHAsync, buf.addr, va, n, self.aux)
        self.cd.call(self.cu.cuStreamSynchronize, self.aux)
        return buf.read()

    def read_flags(self, owner: int) -> list[int]:
        raw = self.read_device(self.peer_va[owner], 4 * self.win.num_flags)
        return list(struct.unpack(f"<{self.win.num_flags}i", raw))

    def done_event(self) -> dict:
        exact = all(e.exact(self.cfg.steps) for e in self.evidence.values())
        ev = {"event": "done", "rank": self.rank, "pid": self.pid, "role": self.role,
              "ok": self.ok() and exact, "steps": self.cfg.steps,
              "pairs": [dict(e.summary(), lost=e.lost(self.cfg.steps))
                        for e in self.evidence.values()],
              "rates": self.rates.report(), "restores_seen": self.restores_seen,
              "quiesces": self.quiesces, "window_checks": self.window_checks,
              "fence": {"fenced": not self.cfg.no_fence, "delay_zero_ms": self.cfg.delay_zero_ms,
                        "erased": self.fence_erased},
              "errors": self.errors[:8]}
        ev.update(self.counters())
        return ev

    def finish(self) -> None:
        self.sync_all()
        self.state = "finished"
        self.emit(self.done_event())
        while True:
            msg, _ = self.chan.recv()
            self.on_control(msg)

    def main(self) -> None:
        self.setup()
        self.loop()
        self.finish()


class AttentionRank(Rank):
    """Writes dispatches into every FFN peer, waits for replies on its own flags."""

    def _setup_attention(self) -> None:
        cu, call = self.cu, self.cd.call
        sl = self.win.slot
        self.ffn_ranks = list(range(self.A, self.cfg.world))
        self.streams = [call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
                        for _ in range(self.D)]
        self.send_buf = {(f, r): self.hbuf(sl.slot_bytes) for f in self.ffn_ranks
                         for r in range(self.D)}
        self.recv_buf = {(f, r): self.hbuf(self.codec.reply_bytes) for f in self.ffn_ranks
                         for r in range(self.D)}
        self.evidence = {f: PairEvidence(src=f, dst=self.rank) for f in self.ffn_ranks}
        self.inflight: dict[int, dict] = {}
        self.next_step = 1
        self.issued = 0                       # last seq stamped (steps, then the shutdown)
        self.ring_last_issued = [0] * self.D
        self.ring_last_replied = [0] * self.D     # last completed non-shutdown step per ring
        self.sent = self.received = self.replied = 0
        self.shutdown_seq = None
        self.next_issue_at = 0.0
        self.held: list[dict] = []            # pending_at_cut: replies landed, unread at a cut

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
        if ring not in self.cfg.stage_rings(stage):       # stages own disjoint rings
            raise RuntimeError(f"step {s}: ring {ring} is not owned by stage {stage}")
        stream = self.streams[ring]
        sl = self.win.slot
        region = self.role_rank
        st = {"s": s, "t0": time.monotonic(), "shutdown": shutdown, "dispatch": {},
              "split": not shutdown and not combine, "ring": ring}
        for f in self.ffn_ranks:
            msg = self.codec.shutdown(s) if shutdown else \
                self.codec.dispatch(self.rank, f - self.A, s)
            st["dispatch"][f] = msg                             # what R(P) is checked against
            if s == self.cfg.corrupt_step:                      # test-only: magic 0 on the wire
                msg = bytes(4) + msg[4:]
            buf = self.send_buf[(f, ring)]
            buf.write(msg)
            call(cu.cuMemcpyHtoDAsync, self.slot_va(f, region, ring), buf.addr, sl.slot_bytes,
                 stream)
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
            call(cu.cuMemcpyDtoHAsync, self.recv_buf[(f, ring)].addr,
                 self.slot_va(self.rank, fr, ring) + self.codec.reply_start,
                 self.codec.reply_bytes, stream)
            call(cu.cuStreamWriteValue32, stream, own_flag, 0, 0)   # in-band reset
        st["split"] = False

    def try_stop(self) -> None:
        """Stop issuing. ``pending_at_cut``: first dispatch the next step and stop before its
        combine (the FFN drains it; its reply lands unread). ``no_drain`` (the FFN ranks are
        already parked): make sure a reply is owed at the cut by issuing the next step."""
        cfg = self.cfg
        s = self.next_step
        if (cfg.pending_at_cut or cfg.no_drain) and s <= cfg.steps and \
                self.shutdown_seq is None:
            ring = (s - 1) % self.D
            if ring in self.inflight:
                st = self.inflight[ring]
                if cfg.pending_at_cut or self.replied_by_all(st):
                    return                  # that step completes (its replies are issued)
            else:
                self.issue(s, combine=not cfg.pending_at_cut)
                self.next_step += 1
        self.send_stopped()

    def replied_by_all(self, st: dict) -> bool:
        """(--no-drain) every FFN rank issued its reply to in-flight step ``st`` before it
        parked, so the step's stream completes."""
        return all(self.ffn_replied.get(f, {}).get(self.rank, {}).get(st["ring"], 0) >= st["s"]
                   for f in self.ffn_ranks)

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
            self.rates.record(len(self.ffn_ranks),
                              len(self.ffn_ranks) * (self.win.slot_bytes + self.codec.reply_bytes),
                              rtt)
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
                if ring not in self.inflight and now >= self.next_issue_at:
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

    def sync_all(self) -> None:
        for ring, st in enumerate(self.streams):
            if self.state != "finished" and self.cfg.no_drain and ring in self.inflight and \
                    not self.replied_by_all(self.inflight[ring]):
                continue                    # --no-drain: this stream waits on an owed reply
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
                        out.append({"kind": "reply_owed", "src": f, "dst": self.rank,
                                    "ring": ring, "seq": st["s"]})
        flags = self.read_flags(self.rank)
        for ring, st in sorted(self.inflight.items()):
            if st["split"]:
                for f in self.ffn_ranks:
                    v = flags[self.win.flag_idx(f - self.A, ring)]
                    if v == FLAG_REPLY_READY:
                        out.append({"kind": "reply_unread", "src": f, "dst": self.rank,
                                    "ring": ring, "seq": st["s"]})
                    self.held.append({"quiesce": self.quiesces, "ffn": f, "ring": ring,
                                      "seq": st["s"], "flag_at_cut": v,
                                      "flag_at_resume": None, "consumed": 0})
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
                    held[(f, ring)]["flag_at_resume"] = \
                        own[self.win.flag_idx(f - self.A, ring)]
                    want.append((FLAG_REPLY_READY,))
                elif ring in owed_rings:
                    want.append((0, FLAG_REPLY_READY))     # one FFN may have replied already
                else:
                    want.append((0,))
        got = [own[self.win.flag_idx(f - self.A, ring)] for f in self.ffn_ranks
               for ring in range(self.D)]
        self.record_check(all(g in w for g, w in zip(got, want)),
                          f"own flags {got}, expected {want}")
        for f in self.ffn_ranks:
            fr = f - self.A
            pflags = self.read_flags(f)
            for ring in range(self.D):
                s_done = self.ring_last_replied[ring]
                if (f, ring) in held:
                    s_done = held[(f, ring)]["seq"]     # the reply that landed before the cut
                if s_done and ring not in owed_rings:
                    got = self.read_device(self.slot_va(self.rank, fr, ring)
                                           + self.codec.reply_start, self.codec.reply_bytes)
                    exp = self.codec.reply(self.codec.dispatch(self.rank, fr, s_done), fr)
                    self.record_check(got == exp, f"own reply slot rank {f} ring {ring} "
                                                  f"!= R(P(step {s_done}))")
                s_iss = self.ring_last_issued[ring]
                self.record_check(pflags[self.win.flag_idx(self.role_rank, ring)] == s_iss,
                                  f"peer rank {f} flag ring {ring} = "
                                  f"{pflags[self.win.flag_idx(self.role_rank, ring)]}, "
                                  f"expected {s_iss}")
                if s_iss:
                    got = self.read_device(self.slot_va(f, self.role_rank, ring),
                                           self.win.slot_bytes)
                    exp = self.codec.shutdown(s_iss) if s_iss == self.shutdown_seq else \
                        self.codec.dispatch(self.rank, fr, s_iss)
                    self.record_check(got == exp, f"peer rank {f} dispatch slot ring {ring} "
                                                  f"!= P(step {s_iss})")


class FfnRank(Rank):
    """Polls its flag array, validates dispatches, writes replies into attention windows."""

    def _setup_ffn(self) -> None:
        cu, call = self.cu, self.cd.call
        sl = self.win.slot
        nonblocking = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.poll_stream = call(cu.cuStreamCreate, nonblocking)
        self.reply_stream = call(cu.cuStreamCreate, nonblocking)
        self.attn_ranks = list(range(self.A))
        self.flags_buf = self.hbuf(4 * self.win.num_flags)
        self.slot_buf = {(a, r): self.hbuf(sl.slot_bytes) for a in self.attn_ranks
                         for r in range(self.D)}
        self.reply_buf = {(a, r): self.hbuf(self.codec.reply_bytes) for a in self.attn_ranks
                          for r in range(self.D)}
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
                out.append({"kind": "dispatch_unconsumed", "src": a, "dst": self.rank,
                            "ring": ring, "seq": v})
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
        call(cu.cuMemcpyDtoHAsync, buf.addr, self.slot_va(self.rank, a, ring),
             self.win.slot_bytes, self.poll_stream)
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
        call(cu.cuMemcpyHtoDAsync, self.slot_va(a, self.role_rank, ring) + self.codec.reply_start,
             rb.addr, self.codec.reply_bytes, self.reply_stream)
        call(cu.cuStreamWriteValue32, self.reply_stream, self.flag_va(a, self.role_rank, ring),
             FLAG_REPLY_READY, 0)
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
        from .evidence import percentile
        us = [round(x, 1) for x in self.service_us]
        ev["service_us_p50"] = percentile(us, 50)
        ev["service_us_p99"] = percentile(us, 99)
        return ev

    def check_windows(self) -> None:
        """After a resume: own flags equal last seen and each own dispatch slot holds the last
        consumed message; through each attention peer's mapping, its reply flags are 0 and the
        reply slot holds R(P) of the last replied step."""
        own = self.read_flags(self.rank)
        unconsumed = {}                 # written, not consumed at the cut: must be exactly-next
        for idx, v in enumerate(own):
            if v != self.seen[idx] and idx < self.A * self.D:
                a, ring = divmod(idx, self.D)
                prev = self.last[(a, ring)]
                if v == (prev + self.D if prev else ring + 1):
                    unconsumed[(a, ring)] = v
        self.record_check(all(v == self.seen[i] or divmod(i, self.D) in unconsumed
                              for i, v in enumerate(own)),
                          f"own flags {own} != last seen {self.seen}")
        unread = {(p["dst"], p["ring"]): p["seq"] for p in self.cut_pending
                  if p.get("kind") == "reply_unread" and p.get("src") == self.rank}
        for a in self.attn_ranks:
            pflags = self.read_flags(a)
            for ring in range(self.D):
                s = self.last[(a, ring)]
                rflag = pflags[self.win.flag_idx(self.role_rank, ring)]
                want = (FLAG_REPLY_READY,) if (a, ring) in unread else \
                    (0, FLAG_REPLY_READY) if self.cfg.no_drain else (0,)
                self.record_check(rflag in want, f"attention rank {a} reply flag ring {ring} = "
                                                 f"{rflag}, expected one of {want}")
                if (a, ring) in unconsumed:
                    got = self.read_device(self.slot_va(self.rank, a, ring), self.win.slot_bytes)
                    v = unconsumed[(a, ring)]
                    exp = self.codec.shutdown(v) if v == self.cfg.steps + 1 else \
                        self.codec.dispatch(a, self.role_rank, v)
                    self.record_check(got == exp,
                                      f"unconsumed dispatch slot rank {a} ring {ring} "
                                      f"!= P(step {v})")
                if not s:
                    continue
                if (a, ring) not in unconsumed:     # else overwritten by the next dispatch
                    got = self.read_device(self.slot_va(self.rank, a, ring),
                                           self.win.slot_bytes)
                    exp = self.codec.shutdown(s) if self.shutdown_from.get(a) == s else \
                        self.codec.dispatch(a, self.role_rank, s)
                    self.record_check(got == exp, f"own dispatch slot rank {a} ring {ring} "
                                                  f"!= P(step {s})")
                s = self.last_replied[(a, ring)]
                if not s:
                    continue
                got = self.read_device(self.slot_va(a, self.role_rank, ring)
                                       + self.codec.reply_start, self.codec.reply_bytes)
                exp = self.codec.reply(self.codec.dispatch(a, self.role_rank, s), self.role_rank)
                self.record_check(got == exp, f"attention rank {a} reply slot ring {ring} "
                                              f"!= R(P(step {s}))")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cuinterpose.workloads.afdwin.rank")
    ap.add_argument("--connect", required=True, help="launcher's rendezvous socket path")
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.connect)
    chan = Channel(sock)
    chan.send({"type": "hello", "rank": args.rank, "pid": os.getpid()})
    r = None
    try:
        msg, _ = chan.recv()
        if msg["type"] != "config":
            raise RuntimeError(f"expected config, got {msg['type']!r}")
        cfg = Config(**msg["config"])
        cls = AttentionRank if cfg.role(args.rank) == "attention" else FfnRank
        r = cls(chan, args.rank, cfg, msg.get("host_memory", "auto"))
        r.main()
        return 0
    except SystemExit as e:
        return int(e.code or 0)
    except ChannelClosed:
        print(f"afdwin rank {args.rank}: launcher went away", file=sys.stderr)
        return 2
    except (Abort, GeometryError) as e:
        print(f"afdwin rank {args.rank}: {e}", file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - report every failure to the launcher
        traceback.print_exc()
        try:
            chan.send({"type": "error", "rank": args.rank, "message": f"{type(e).__name__}: {e}"})
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
