"""What every transfer of a snapshot shares, whichever backend: the bounded worker pool
(:func:`run_jobs`) and the progress meter (:class:`Meter`, rows of ``api.Progress``)."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Callable, Iterable

from cuinterpose.agent.snapshot.backends.api import Progress

#: bytes read (from a file or a response body) per read call while hashing or copying
PIECE = 1 << 20


class Meter:
    """Progress of one transfer: ``total`` bytes to account; :meth:`add` from any thread;
    calls ``callback(Progress)`` at most every 100 ms, and :meth:`finish` once at the end."""

    EVERY_NS = 100_000_000

    def __init__(self, phase: str, location: str, total: int, callback=None):
        self.phase, self.location, self.total, self.callback = phase, location, total, callback
        self.transferred = self.present = 0
        self.t0 = time.monotonic_ns()
        self._last = 0
        self._lock = threading.Lock()

    def row(self, final: bool = False) -> Progress:
        el = max(time.monotonic_ns() - self.t0, 1)
        return Progress(
            self.phase,
            self.location,
            self.transferred + self.present,
            self.total,
            self.transferred,
            self.present,
            self.transferred * 1e9 / el,
            el,
            final,
        )

    def add(self, transferred: int = 0, present: int = 0) -> None:
        with self._lock:
            self.transferred += transferred
            self.present += present
            now = time.monotonic_ns()
            if self.callback is None or (self._last and now - self._last < self.EVERY_NS):
                return
            self._last = now
            row = self.row()
        self.callback(row)

    def finish(self) -> Progress:
        with self._lock:
            row = self.row(final=True)
        if self.callback is not None:
            self.callback(row)
        return row


def run_jobs(jobs: Iterable[Callable[[], None]], threads: int, cancel: threading.Event) -> None:
    """Run every job on ``threads`` workers, at most ``2 * threads`` queued (jobs are made as
    the pool frees up, so memory stays bounded). The first failure sets ``cancel`` (the other
    jobs stop at their next request) and is raised once the running jobs returned; so is a
    KeyboardInterrupt in the caller's thread."""
    first: list[BaseException] = []

    def harvest(done):
        for f in done:
            e = f.exception()
            if e is not None:
                cancel.set()
                # the cause, not a sibling's "cancelled" that it provoked
                if not first or ("cancelled" in str(first[0]) and "cancelled" not in str(e)):
                    first[:1] = [e]

    with cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="s3") as ex:
        pending: set = set()
        try:
            for job in jobs:
                if cancel.is_set():
                    break
                while len(pending) >= 2 * threads:
                    done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                    harvest(done)
                if cancel.is_set():
                    break
                pending.add(ex.submit(job))
            while pending:
                done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                harvest(done)
        except BaseException:
            cancel.set()
            for f in pending:
                f.cancel()
            raise
    if first:
        raise first[0]
