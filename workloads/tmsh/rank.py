"""What the producer and the consumers share: CUDA set-up, JSON events on stdout, and the rank
side of the quiesce contract over the launcher's pipe (docs/tmsh.md "The cut").

``serve()`` answers a ``quiesce`` between two storages: the rank synchronizes its context (no
work left on any stream), answers ``parked`` (what it sent or received, its segment VAs) and
blocks on the pipe, making no CUDA call, until ``resume``; it then answers ``resumed`` with its
VAs again. ``hold(at)`` stops at a fixed point until one quiesce came (a cut at an exact step).
"""

from __future__ import annotations

import json
import os
import sys
import time

from cuda.bindings import driver as cu

from .. import stacks
from ..afdwin.cudrv import call

POLL_S = 0.002


class Rank:
    def __init__(self, cfg: dict, role: str, conn):
        self.cfg, self.role, self.conn = cfg, role, conn
        self.pid = os.getpid()
        self.quiesces = 0
        self.sent = self.received = 0
        self.vas_fn = dict
        self.held_at = None
        self.waited_s = 0.0

    def emit(self, event: str, **kw) -> None:
        print(json.dumps({"event": event, "role": self.role, "pid": self.pid, **kw}), flush=True)

    def main(self, body) -> None:
        stacks.on_signal()
        try:
            call(cu.cuInit, 0)
            self.device = self.cfg["device"]
            ctx = call(cu.cuDevicePrimaryCtxRetain, call(cu.cuDeviceGet, self.device))
            call(cu.cuCtxSetCurrent, ctx)
            self.stream = call(cu.cuStreamCreate, 0)
            out = body(self)
        except Exception as e:  # the rank's failure is its report
            msg = f"{self.role} pid {self.pid}: {type(e).__name__}: {e}"
            self.emit("failed", message=msg)
            try:
                self.conn.send({"failed": msg})
            except OSError:
                pass
            sys.exit(1)
        self.conn.send({"done": out})
        self.emit(
            "done",
            **{k: v for k, v in out.items() if k != "received"},
            received=len(out.get("received", [])),
        )

    def serve(self) -> None:
        while self.conn.poll():
            msg = self.conn.recv()
            if msg.get("op") == "quiesce":
                self.park()

    def park(self) -> None:
        call(cu.cuCtxSynchronize)  # nothing left on a stream: every recorded event is complete
        self.conn.send(
            {"parked": True, "sent": self.sent, "received": self.received, "vas": self.vas_fn()}
        )
        while True:
            msg = (
                self.conn.recv()
            )  # blocks: no CUDA call while parked (the launcher owns the deadline)
            if msg.get("op") == "resume":
                break
        self.quiesces += 1
        vas = self.vas_fn()
        self.conn.send({"resumed": True, "vas": vas})
        self.emit("vas", after_restore=bool(msg.get("restored")), vas=vas)

    def hold(self, at: int) -> None:
        if self.held_at is None:
            self.held_at = at
            self.emit("hold", at=at)
        time.sleep(POLL_S)

    def progressed(self) -> None:
        """Something moved: the wait deadline starts over."""
        self.waited_s = 0.0

    def wait_a_little(self, what: str) -> None:
        """One short sleep while waiting for `what`; past the peer timeout (the sleeps summed, so
        time spent dumped does not count) the rank fails naming it."""
        time.sleep(POLL_S)
        self.waited_s += POLL_S
        if self.waited_s > self.cfg["peer_timeout_s"]:
            raise TimeoutError(f"waited {self.cfg['peer_timeout_s']} s for {what}")
