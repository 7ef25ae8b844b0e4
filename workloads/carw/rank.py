"""One carw rank: legacy CUDA IPC setup, then the all-reduce loop (docs/carw.md).

Started by the launcher as ``python -m cuinterpose.workloads.carw.rank --fd FD --rank R``
(FD: its end of an ``AF_UNIX`` socketpair, framed as :mod:`cuinterpose.workloads.afdwin.wire`);
the ``config`` message brings the rest. It never writes stdout: events go to the launcher.
Exit status 0 when every check it made held, 1 on a failed check or error, 2 when the launcher
went away.

Driver calls (cuda-python, the same on fakecuda and on a real GPU): the data and signal ranges
come from the share (``share.py``, ``--share``: by default ``cuMemAlloc`` and 64-byte
``cuIpcGetMemHandle`` handles sent to the launcher, which hands every rank its peers' to open
with ``cuIpcOpenMemHandle`` at VAs the driver picks); the table of peer VAs is a ``cuMemAlloc``
range written with ``cuMemcpyHtoD``. Every step reads the table back with ``cuMemcpyDtoH`` and
reaches the peers' signal and data only through the VAs read from it, as a kernel reading
vLLM's rank data would.

Single-threaded: control messages are read between driver calls, so a parked rank is not
inside CUDA (docs/workload-contract.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback

from cuda.bindings import driver as cu

from .. import stacks
from ..afdwin.cudrv import call
from ..afdwin.wire import Channel, ChannelClosed
from . import layout as L
from . import share
from .evidence import StepLog

POLL_S = 0.002  # how long a waiting rank sleeps in select() on its channel between polls


class Abort(RuntimeError):
    """A wait ran past its deadline (reported to the launcher), or the launcher told this rank
    to stop (``from_launcher``: not reported back)."""

    from_launcher = False


class Deadline:
    """A deadline that counts only time spent waiting, at most ``POLL_S * 50`` per poll, so a
    CLOCK_MONOTONIC jump across a checkpoint/restore does not expire it."""

    def __init__(self, seconds: float):
        self.left = seconds
        self.last = time.monotonic()

    def tick(self) -> bool:
        now = time.monotonic()
        self.left -= min(now - self.last, POLL_S * 50)
        self.last = now
        return self.left > 0


def stopped(msg: dict) -> Abort:
    """The launcher's ``abort``: the run stops (another rank failed or died)."""
    e = Abort(f"stopped by the launcher: {msg.get('message', 'no reason given')}")
    e.from_launcher = True
    return e


def hexrows(rows) -> str:
    return "[" + ", ".join(f"({d:#x}, {g:#x})" for d, g in rows) + "]"


def dptr(va: int) -> cu.CUdeviceptr:
    return cu.CUdeviceptr(va)


class CarwRank:
    """State of one rank. ``cfg``: the launcher's config (world, steps, elems, step_delay_ms,
    hold_at, peer_timeout_s, share, test_corrupt_table_at; launcher.py ``config``)."""

    def __init__(self, chan: Channel, rank: int, cfg: dict):
        self.chan = chan
        self.rank = rank
        self.world = int(cfg["world"])
        self.steps = int(cfg["steps"])
        self.elems = int(cfg["elems"])
        self.delay_s = float(cfg.get("step_delay_ms", 0)) / 1000.0
        self.hold_at = sorted(int(h) for h in cfg.get("hold_at", ()))
        self.corrupt_at = int(cfg.get("test_corrupt_table_at", 0))
        self.peer_timeout_s = float(cfg.get("peer_timeout_s", 300))
        self.share_name = cfg.get("share", "ipc")
        self.pid = os.getpid()
        self.log = StepLog(rank)
        self.started = 0  # last step whose signal this rank wrote
        self.limit: int | None = None  # during a quiesce: start no step above this
        self.park_at: int | None = None
        self.quiesce_id: str | None = None
        self.held: set[int] = set()  # --hold-at steps a quiesce released
        self.hold_sent: set[int] = set()
        self.restores_seen = 0
        self.resumes = 0

    # ---- messages -------------------------------------------------------------------------
    def send(self, msg: dict) -> None:
        self.chan.send(msg)

    def service(self, timeout: float = 0) -> None:
        """Handle pending launcher messages, waiting up to ``timeout`` s for the first."""
        got = self.chan.recv(timeout=timeout)
        while got is not None:
            self.on_control(got[0])
            got = self.chan.recv(timeout=0)

    def on_control(self, msg: dict) -> None:
        t = msg["type"]
        if t == "abort":
            raise stopped(msg)
        if t == "quiesce":  # start no new step; say where we are
            self.quiesce_id = msg["id"]
            self.limit = self.started
            self.held.update(h for h in self.hold_at if h <= self.started)
            self.send({"type": "at", "id": msg["id"], "rank": self.rank, "step": self.started})
        elif t == "park":  # finish steps up to msg["step"], then park
            self.park_at = int(msg["step"])
            self.limit = self.park_at
        else:
            raise RuntimeError(f"unexpected message {t!r} (step {self.started})")

    # ---- setup ----------------------------------------------------------------------------
    def setup(self) -> None:
        call(cu.cuInit, 0)
        ndev = call(cu.cuDeviceGetCount)
        self.device_ordinal = self.rank % ndev
        dev = call(cu.cuDeviceGet, self.device_ordinal)
        self.ctx = call(cu.cuDevicePrimaryCtxRetain, dev)
        call(cu.cuCtxSetCurrent, self.ctx)
        self.share = share.make(self.share_name, self.device_ordinal)
        nbytes = L.data_bytes(self.elems)
        self.data_va = self.share.alloc(nbytes, "data")
        self.signal_va = self.share.alloc(L.SIGNAL_BYTES, "signal")
        tbytes = L.ROW_BYTES * self.world
        self.table_va = int(call(cu.cuMemAlloc, tbytes, detail=f"table, {tbytes} bytes"))
        self.share.write(self.signal_va, L.encode_signal(0))
        data, data_fds = self.share.export(self.data_va)
        signal, signal_fds = self.share.export(self.signal_va)
        fds = data_fds + signal_fds
        try:
            msg = {"type": "handles", "rank": self.rank, "pid": self.pid}
            self.chan.send(dict(msg, data=data, signal=signal), fds)
        finally:
            for fd in fds:
                os.close(fd)  # sent (SCM_RIGHTS): the receiver has its own
        msg, fds = self.expect("peers")
        got = dict(zip([(r, w) for r in msg["fd_ranks"] for w in ("data", "signal")], fds))
        rows = []
        self.opened: list[int] = []
        try:
            for r in range(self.world):
                if r == self.rank:
                    rows.append((self.data_va, self.signal_va))
                    continue
                h = msg["handles"][str(r)]
                rows.append(
                    (
                        self.open(h["data"], got.pop((r, "data"), None), r, "data"),
                        self.open(h["signal"], got.pop((r, "signal"), None), r, "signal"),
                    )
                )
        finally:
            for fd in got.values():  # our own, relayed back; or left by a failed open
                os.close(fd)
        self.rows = rows
        self.table_bytes = L.encode_table(rows)
        self.htod(self.table_va, self.table_bytes)
        self.emit_vas(after_restore=False)
        self.send({"type": "ready", "rank": self.rank})
        self.expect("start")
        self.share.after_start()

    def open(self, info: dict, fd: int | None, peer: int, what: str) -> int:
        va = self.share.open(info, fd, peer, what)
        self.opened.append(va)
        return va

    def expect(self, mtype: str) -> tuple[dict, list[int]]:
        """The next launcher message, which must be ``mtype`` (``abort`` raises), and its fds."""
        deadline = Deadline(self.peer_timeout_s)
        while True:
            got = self.chan.recv(timeout=POLL_S * 50)
            if got is not None:
                msg = got[0]
                if msg["type"] == "abort":
                    raise stopped(msg)
                if msg["type"] != mtype:
                    raise RuntimeError(f"expected {mtype!r}, got {msg['type']!r}")
                return msg, got[1]
            if not deadline.tick():
                raise Abort(f"no {mtype!r} from the launcher in time")

    def emit_vas(self, after_restore: bool) -> None:
        table = L.decode_table(self.dtoh(self.table_va, len(self.table_bytes)))
        self.send(
            {
                "type": "event",
                "event": {
                    "event": "vas",
                    "rank": self.rank,
                    "pid": self.pid,
                    "after_restore": after_restore,
                    "device": self.device_ordinal,
                    "share": self.share.name,
                    "data_va": self.data_va,
                    "signal_va": self.signal_va,
                    "table_va": self.table_va,
                    "table": [list(row) for row in table],
                    "step": self.started,
                },
            }
        )

    # ---- memory ---------------------------------------------------------------------------
    def htod(self, va: int, data: bytes) -> None:
        call(cu.cuMemcpyHtoD, dptr(va), data, len(data), detail=f"{len(data)} bytes to {va:#x}")

    def dtoh(self, va: int, n: int) -> bytes:
        buf = bytearray(n)
        call(cu.cuMemcpyDtoH, buf, dptr(va), n, detail=f"{n} bytes from {va:#x}")
        return bytes(buf)

    # ---- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        """Steps 1..steps; parks at the cut a quiesce names (between steps)."""
        s = 1
        while s <= self.steps:
            self.service()
            if self.park_at is not None and s > self.park_at:
                self.park()
                continue
            if (self.limit is not None and s > self.limit) or self.holding(s):
                self.service(timeout=POLL_S * 10)
                continue
            self.one_step(s)
            s += 1
            if self.delay_s:
                self.service(timeout=self.delay_s)

    def holding(self, s: int) -> bool:
        """--hold-at h: after step h, start h + 1 only once a quiesce came (the cut is then h).
        Sends one ``hold`` event per h."""
        for h in self.hold_at:
            if s == h + 1 and h not in self.held:
                if h not in self.hold_sent:
                    self.hold_sent.add(h)
                    ev = {"event": "hold", "rank": self.rank, "pid": self.pid, "step": h}
                    self.send({"type": "event", "event": ev})
                return True
        return False

    def one_step(self, s: int) -> None:
        if s == self.corrupt_at and self.rank == 0:  # test only: what a moved VA looks like
            rows = list(self.rows)
            rows[1] = (rows[0][0], rows[1][1])  # rank 1's data VA -> ours; its signal kept
            self.htod(self.table_va, L.encode_table(rows))
        off = L.slot_offset(s, self.elems)
        n = L.slot_bytes(self.elems)
        self.share.write(self.data_va + off, L.encode_slot(self.rank, s, self.elems))
        self.share.write(self.signal_va, L.encode_u64(s))  # the step word only, not the probe
        self.started = s
        raw = self.dtoh(self.table_va, len(self.table_bytes))
        if raw != self.table_bytes:
            self.log.table(
                False, f"step {s}: {hexrows(L.decode_table(raw))}, set up {hexrows(self.rows)}"
            )
        else:
            self.log.table(True)
        rows = L.decode_table(raw)
        total = None
        for r in range(self.world):
            data_va, signal_va = rows[r]
            if r != self.rank:
                self.wait_signal(r, signal_va, s)
            seq, check, vals = L.decode_slot(self.share.read(data_va + off, n), self.elems)
            want = L.checksum(vals, s, r)
            if seq != s or check != want:
                self.log.fail(
                    f"step {s}: rank {r}'s slot at {data_va + off:#x} holds seq {seq}, check "
                    f"{check:#018x} (expected seq {s}, check {want:#018x})"
                )
            if total is None:
                total = vals
            else:
                for i in range(self.elems):
                    total[i] += vals[i]
        exact = total == L.expected_sum(self.world, s, self.elems)
        if not exact:
            self.log.fail(f"step {s}: all-reduce sum differs from the expected one")
        self.log.step(s, exact)

    def wait_signal(self, peer: int, signal_va: int, s: int) -> None:
        deadline = Deadline(self.peer_timeout_s)
        while True:
            got = L.decode_signal(self.share.read(signal_va, 8))
            if got >= s:
                return
            self.service(timeout=POLL_S)
            if not deadline.tick():
                raise Abort(
                    f"step {s}: rank {peer}'s signal at {signal_va:#x} stayed at "
                    f"{got} for {self.peer_timeout_s:g} s (peer dead or stuck?); stopping"
                )

    # ---- quiesce --------------------------------------------------------------------------
    def park(self) -> None:
        """Every step up to the cut is complete and synchronous: ack, then wait (no CUDA) for
        the launcher's resume."""
        call(cu.cuCtxSynchronize)
        cut = self.park_at
        self.send(
            {
                "type": "parked",
                "id": self.quiesce_id,
                "rank": self.rank,
                "pid": self.pid,
                "step": cut,
            }
        )
        while True:
            got = self.chan.recv(timeout=None)
            msg = got[0]
            if msg["type"] == "abort":
                raise stopped(msg)
            if msg["type"] != "resume":
                raise RuntimeError(f"unexpected {msg['type']!r} while parked")
            break
        if msg.get("restored"):
            self.restores_seen += 1
            self.emit_vas(after_restore=True)
        self.resumes += 1
        lost = self.probe()
        self.park_at = self.limit = self.quiesce_id = None
        self.send({"type": "resumed", "rank": self.rank, "lost": lost})

    def probe(self) -> list[str]:
        """After a resume, before any step: is the memory still shared? Each rank writes
        ``layout.probe_value(resumes, rank)`` into its signal range's probe word, the launcher
        barriers (``probed`` -> ``probe``), and each reads every peer's word through its table.
        Returns the mismatches (each also a failed check): a restore that gave the peers
        private copies (what the driver's own checkpoint does to IPC memory) shows here, before
        a step waits forever on a signal that cannot arrive."""
        self.share.write(
            self.signal_va + L.PROBE_OFFSET, L.encode_u64(L.probe_value(self.resumes, self.rank))
        )
        # a cuMemcpyHtoD from pageable memory may return before the bytes reach the device
        # (driver API, "API synchronization behavior"): the peers read it only after this
        call(cu.cuCtxSynchronize)
        self.send({"type": "probed", "rank": self.rank})
        self.expect("probe")
        lost = []
        for r, (_data_va, signal_va) in enumerate(self.rows):
            if r == self.rank:
                continue
            va = signal_va + L.PROBE_OFFSET
            got = L.decode_u64(self.share.read(va, 8))
            want = L.probe_value(self.resumes, r)
            if got != want:
                lost.append(f"rank {r}'s probe word at {va:#x} reads {got:#x}, expected {want:#x}")
                self.log.fail(f"after resume {self.resumes}: {lost[-1]}")
        return lost

    def finish(self) -> None:
        """Report, then serve the launcher until ``exit`` (a quiesce now cuts after the last
        step); close the peers' ranges and free ours."""
        self.log.table(
            self.dtoh(self.table_va, len(self.table_bytes)) == self.table_bytes, "at the end"
        )
        self.send({"type": "done", "rank": self.rank, "report": self.log.report()})
        deadline = Deadline(self.peer_timeout_s)
        while True:
            got = self.chan.recv(timeout=POLL_S * 50)
            if got is None:
                if not deadline.tick():
                    raise Abort("no 'exit' from the launcher in time")
                continue
            if got[0]["type"] == "exit":
                break
            self.on_control(got[0])
            if self.park_at is not None:
                self.park()
                deadline = Deadline(self.peer_timeout_s)
        for va in self.opened:
            self.share.close_peer(va)
        call(cu.cuMemFree, dptr(self.table_va))
        for va in (self.signal_va, self.data_va):
            self.share.free(va)

    def ok(self) -> bool:
        return self.log.failed == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cuinterpose.workloads.carw.rank")
    ap.add_argument("--fd", type=int, required=True, help="this rank's socketpair end")
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    stacks.on_signal()
    chan = Channel(socket.socket(fileno=args.fd))
    try:
        msg, _ = chan.recv()
        if msg["type"] != "config":
            raise RuntimeError(f"expected config, got {msg['type']!r}")
        r = CarwRank(chan, args.rank, msg["config"])
        r.setup()
        r.run()
        r.finish()
        return 0 if r.ok() else 1
    except ChannelClosed:
        print(f"carw rank {args.rank}: launcher went away", file=sys.stderr)
        return 2
    except Abort as e:
        print(f"carw rank {args.rank} (pid {os.getpid()}): {e}", file=sys.stderr)
        if not e.from_launcher:
            try:
                chan.send({"type": "error", "rank": args.rank, "message": str(e)})
            except OSError:
                pass
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
