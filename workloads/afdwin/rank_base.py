"""The state and lifecycle shared by both afdwin rank roles (setup, evidence, finish).

:class:`Rank` combines the window (window.py) and the launcher control (control.py); the roles
are attention.py and ffn.py, started by rank.py.
"""

from __future__ import annotations

import os

from .config import Config
from .control import Control
from .evidence import Rates
from .payload import Codec
from .window import Window
from .wire import Channel


class Rank(Window, Control):
    """State of one rank. ``rank``: world rank; ``cfg``: the run config (after test overrides).

    A role subclass provides ``setup_role``, ``loop``, ``sync_all``, ``after_sync``,
    ``check_windows``, ``issued_seq``, ``last_seq`` and ``counters``.
    """

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
        self.state = "setup"  # setup, running, stopping, draining, parked, finished
        self.quiesce_id = None
        self.restores_seen = 0
        self.quiesces = 0
        self.rates = Rates()
        self.window_checks = {"checked": 0, "failed": 0, "failures": []}
        self.errors: list[str] = []
        self._last_progress = 0.0
        self.A, self.F, self.D = cfg.attention, cfg.ffn, cfg.ring_depth
        self.fence_erased: list[dict] = []
        self.cut_pending: list[dict] = []  # the launcher's union of every rank's "pending"
        self.stop_pending = False
        self.ffn_replied: dict = {}

    # ---- setup (docs/afdwin.md "Setup"): one method per step --------------------------------
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
        self.setup_role()
        self.emit(self.window_event(after_restore=False))
        self.state = "running"

    def ok(self) -> bool:
        return not self.errors and self.window_checks["failed"] == 0

    def record_check(self, ok: bool, what: str) -> None:
        self.window_checks["checked"] += 1
        if not ok:
            self.window_checks["failed"] += 1
            if len(self.window_checks["failures"]) < 8:
                self.window_checks["failures"].append(what)

    def done_event(self) -> dict:
        exact = all(e.exact(self.cfg.steps) for e in self.evidence.values())
        ev = {
            "event": "done",
            "rank": self.rank,
            "pid": self.pid,
            "role": self.role,
            "ok": self.ok() and exact,
            "steps": self.cfg.steps,
            "pairs": [
                dict(e.summary(), lost=e.lost(self.cfg.steps)) for e in self.evidence.values()
            ],
            "rates": self.rates.report(),
            "restores_seen": self.restores_seen,
            "quiesces": self.quiesces,
            "window_checks": self.window_checks,
            "fence": {
                "fenced": not self.cfg.no_fence,
                "delay_zero_ms": self.cfg.delay_zero_ms,
                "erased": self.fence_erased,
            },
            "errors": self.errors[:8],
        }
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
