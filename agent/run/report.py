"""Progress reporting for checkpoint/restore: per-phase timings (ns) and byte counts.

:class:`Reporter` records every phase in ``phases`` (what goes into the manifest and the
``--json`` output) and forwards events to optional sinks. :class:`RichSink` renders a live
table on stderr for humans; the ``--json`` mode uses no sink.

Tiling (docs/agent.md "Every second in a phase"): once a run called :meth:`Reporter.begin`,
each row starts where the previous row ended (``Phase.start_ns``, monotonic ns), so the rows
cover the run without a gap and the run's wall time is their sum (:meth:`Reporter.covered_ns`).
Time a step spends before its first row (a step with no row of its own: ``images dir``,
``coordinator``) is the next row's. A row that moves bytes may report ``progress`` events
while it runs: bytes done of ``total_bytes``, the rate (bytes/s) and the ETA (ns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Callable, Optional


@dataclasses.dataclass
class Phase:
    """One timed step: ``name``, ``elapsed_ns``, ``bytes`` moved, ``status`` ("running", "ok",
    "failed"), ``detail`` (free text, e.g. the pids involved)."""

    name: str
    elapsed_ns: int = 0
    bytes: int = 0
    status: str = "running"
    detail: str = ""
    #: monotonic ns at which the row starts (the previous row's end once the run began)
    start_ns: int = 0
    #: for a row that reports progress: the bytes it will have moved when done (0: unknown),
    #: the rate so far (bytes/s) and the estimated time left (ns; -1 while the rate is 0)
    total_bytes: int = 0
    rate_bps: float = 0.0
    eta_ns: int = -1

    def progress_text(self) -> str:
        """``"12.0 MiB of 48.0 MiB (25%), 96.0 MiB/s, ETA 375.0 ms"`` (no ETA while 0 B/s)."""
        pct = f" ({100 * self.bytes // self.total_bytes}%)" if self.total_bytes else ""
        eta = f", ETA {fmt_ns(self.eta_ns)}" if self.eta_ns >= 0 else ""
        return (
            f"{fmt_bytes(self.bytes)} of {fmt_bytes(self.total_bytes)}{pct}, "
            f"{fmt_bytes(int(self.rate_bps))}/s{eta}"
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "elapsed_ns": self.elapsed_ns,
            "bytes": self.bytes,
            "status": self.status,
            "detail": self.detail,
        }


class Reporter:
    """Collects phases; ``sinks`` are callables ``sink(event: str, phase_or_text)`` with event
    in ("start", "progress", "end", "note", "total")."""

    #: at most one ``progress`` event per row per this many ns (the last one always goes out)
    PROGRESS_EVERY_NS = 100_000_000

    def __init__(self, sinks: Optional[list[Callable]] = None):
        self.phases: list[Phase] = []
        self.notes: list[str] = []
        self.sinks = list(sinks or [])
        #: where the next row starts (monotonic ns); None until :meth:`begin` (rows then start
        #: when their block starts, as before)
        self.cursor_ns: Optional[int] = None
        self.begun_ns: Optional[int] = None
        self._lock = threading.Lock()

    def begin(self, t0_ns: Optional[int] = None) -> int:
        """Start tiling at ``t0_ns`` (monotonic ns; default now): the next row starts there.
        A group member calls it at each of its phases (the wait between two is the leader's).
        Returns the start."""
        self.cursor_ns = time.monotonic_ns() if t0_ns is None else int(t0_ns)
        if self.begun_ns is None:
            self.begun_ns = self.cursor_ns
        return self.cursor_ns

    def wall_ns(self) -> int:
        """From the first :meth:`begin` to the end of the last row (ns): the rows' sum for a
        one-shot run (a group member's also holds the waits between its phases)."""
        now = time.monotonic_ns()
        return (self.cursor_ns or now) - (self.begun_ns or now)

    def covered_ns(self) -> int:
        """The sum of every row's ``elapsed_ns``: the run's wall time once it began (ns)."""
        return sum(p.elapsed_ns for p in self.phases)

    def _start(self, now: int) -> int:
        return now if self.cursor_ns is None else min(self.cursor_ns, now)

    def progress(self, ph: Phase, done: int, total: int, *, final: bool = False) -> None:
        """Row ``ph`` has moved ``done`` of ``total`` bytes: set its ``bytes``,
        ``total_bytes``, ``rate_bps`` and ``eta_ns`` and emit a ``progress`` event (at most
        one per :data:`PROGRESS_EVERY_NS`, except ``final`` and the first). Thread-safe;
        ``done`` never goes backwards."""
        now = time.monotonic_ns()
        with self._lock:
            done = max(int(done), ph.bytes)
            ph.bytes, ph.total_bytes = done, max(int(total), done)
            ran = max(now - ph.start_ns, 1)
            ph.rate_bps = done * 1e9 / ran
            left = ph.total_bytes - done
            ph.eta_ns = (
                int(left * 1e9 / ph.rate_bps) if ph.rate_bps > 0 else (0 if not left else -1)
            )
            last = getattr(ph, "_last_progress_ns", None)
            if not final and last is not None and now - last < self.PROGRESS_EVERY_NS:
                return
            ph._last_progress_ns = now
            self._emit("progress", ph)

    def _emit(self, event: str, obj) -> None:
        for s in self.sinks:
            try:
                s(event, obj)
            except Exception:  # a broken display must never break a checkpoint
                pass

    @contextlib.contextmanager
    def phase(self, name: str, detail: str = ""):
        """Time a block; yields the :class:`Phase` so the block can set ``bytes``/``detail``."""
        t0 = self._start(time.monotonic_ns())
        ph = Phase(name=name, detail=detail, start_ns=t0)
        self.phases.append(ph)
        self._emit("start", ph)
        try:
            yield ph
        except BaseException:
            self._end(ph, "failed")
            raise
        self._end(ph, "ok")

    def _end(self, ph: Phase, status: str) -> None:
        now = time.monotonic_ns()
        ph.elapsed_ns = now - ph.start_ns
        ph.status = status
        if self.cursor_ns is not None:
            self.cursor_ns = now
        self._emit("end", ph)

    def record(
        self, name: str, elapsed_ns: int, nbytes: int = 0, status: str = "ok", detail: str = ""
    ) -> Phase:
        """Add a phase that was timed elsewhere (e.g. a coordinator phase) and ended now. Once
        the run began (:meth:`begin`) the row starts where the previous one ended and lasts
        until now (at least ``elapsed_ns``)."""
        now = time.monotonic_ns()
        start = now - int(elapsed_ns) if self.cursor_ns is None else self._start(now)
        ph = Phase(
            name=name,
            elapsed_ns=now - start,
            bytes=int(nbytes),
            status=status,
            detail=detail,
            start_ns=start,
        )
        if self.cursor_ns is not None:
            self.cursor_ns = now
        self.phases.append(ph)
        self._emit("start", ph)
        self._emit("end", ph)
        return ph

    def coordinator_event(self, ev) -> None:
        """``on_event`` for the coordinator: one phase row per completed coordinator phase
        (barrier wall time, carrier bytes, the slowest shim's own time), and one per piece of
        the coordinator's own work between them (``validate``, ``check carriers``,
        ``compare``: a PhaseResult without participants, its ``detail`` as it is)."""
        if getattr(ev, "kind", None) != "phase" or ev.phase_result is None:
            return
        pr = ev.phase_result
        detail = (
            f"{len(pr.participants)} pids, slowest shim {fmt_ns(pr.max_elapsed_ns)}"
            + (f", copy {fmt_ns(pr.max_copy_ns)}" if pr.max_copy_ns else "")
            if pr.participants
            else f"coordinator: {getattr(pr, 'detail', '')}"
        )
        self.record(pr.phase, pr.wall_ns, pr.bytes, "ok" if ev.ok else "failed", detail)
        for pid, why in pr.pageable_staging.items():
            self.note(
                f"{pr.phase}: pid {pid}: its staging ring could not be page-locked "
                f"(cuMemHostRegister: {why}); its copies ran at pageable speed"
            )

    def note(self, text: str) -> None:
        self.notes.append(text)
        self._emit("note", text)

    def total(self, elapsed_ns: int, detail: str = "") -> Phase:
        """The run's wall time (the "total" row of the table; not one of ``phases``)."""
        ph = Phase(name="total", elapsed_ns=int(elapsed_ns), status="ok", detail=detail)
        self._emit("total", ph)
        return ph

    def to_list(self) -> list[dict]:
        return [p.to_dict() for p in self.phases]


def fmt_ns(ns: int) -> str:
    """Human duration: ``"812 us"``, ``"41.3 ms"``, ``"2.05 s"``."""
    if ns < 1_000_000:
        return f"{ns / 1000:.0f} us"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e9:.2f} s"


def fmt_bytes(n: int) -> str:
    """Human size: ``"0 B"``, ``"64.0 KiB"``, ``"2.00 GiB"``."""
    if n < 1024:
        return f"{n} B"
    for unit, div in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)):
        if n < div * 1024 or unit == "GiB":
            return f"{n / div:.1f} {unit}" if unit != "GiB" else f"{n / div:.2f} {unit}"
    return f"{n} B"


class RichSink:
    """Live table on stderr: one row per phase with status, time and bytes, and a last
    "total" row: the run's wall time as the run reported it (``Reporter.total``), else the time
    this table was shown."""

    def __init__(self, title: str):
        from rich.console import Console
        from rich.live import Live

        self.title = title
        self.console = Console(stderr=True)
        if not self.console.is_terminal:  # logs: do not wrap at 80 columns
            self.console = Console(stderr=True, width=120)
        self.rows: list = []
        self.notes: list[str] = []
        self.total_row = None
        self.t0 = time.monotonic_ns()
        self.live = Live(
            self._render(), console=self.console, refresh_per_second=10, transient=False
        )

    def _render(self):
        from rich.table import Table

        t = Table(title=self.title, title_justify="left", expand=False)
        t.add_column("phase")
        t.add_column("status")
        t.add_column("time", justify="right")
        t.add_column("bytes", justify="right")
        t.add_column("detail", overflow="fold")
        marks = {"running": "[yellow]…[/]", "ok": "[green]ok[/]", "failed": "[red]FAILED[/]"}
        for i, p in enumerate(self.rows):
            t.add_row(
                p.name,
                marks.get(p.status, p.status),
                fmt_ns(p.elapsed_ns) if p.status != "running" else "",
                fmt_bytes(p.bytes) if p.bytes else "",
                p.progress_text() if p.status == "running" and p.total_bytes else p.detail,
                end_section=(i == len(self.rows) - 1 and self.total_row is not None),
            )
        if self.total_row is not None:
            p = self.total_row
            t.add_row(f"[bold]{p.name}[/]", "", f"[bold]{fmt_ns(p.elapsed_ns)}[/]", "", p.detail)
        return t

    def __enter__(self):
        self.t0 = time.monotonic_ns()
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.total_row is None:
            self.total_row = Phase(
                name="total", elapsed_ns=time.monotonic_ns() - self.t0, status="ok"
            )
        self.live.update(self._render())
        self.live.__exit__(*exc)
        if not self.console.is_terminal:
            self.console.print("")
        for n in self.notes:
            self.console.print(n)

    def __call__(self, event: str, obj) -> None:
        if event == "start":
            # a poller's transient row of the same name (agent/run/durable.py) gives way
            same = [i for i, r in enumerate(self.rows) if r.name == obj.name and _transient(r)]
            if same:
                self.rows[same[-1]] = obj
            else:
                self.rows.append(obj)
        elif event == "progress" and not any(r is obj for r in self.rows):
            self.rows.append(obj)
        elif event == "note":
            self.notes.append(obj)
        elif event == "total":
            self.total_row = obj
        self.live.update(self._render())


def _transient(ph: Phase) -> bool:
    return bool(getattr(ph, "transient", False))


SNAPSHOT_COLUMNS = (
    "name",
    "created",
    "roots",
    "processes",
    "carrier bytes",
    "image bytes",
    "leave-running",
    "native",
)


def snapshot_rows(res: dict) -> list[tuple[str, ...]]:
    """One row of :data:`SNAPSHOT_COLUMNS` per snapshot of a ``list_snapshots`` result. The
    process count and leave-running come from the manifest when it is readable from here
    ("-" otherwise, e.g. a remote agent's); a snapshot whose manifest is broken shows its
    error in the created column."""
    import json
    import pathlib

    from cuinterpose.agent.snapshot.snapdir import SnapshotDir

    rows = []
    for s in res["snapshots"]:
        procs, leave = "-", "-"
        try:
            m = json.loads(SnapshotDir(s["images_dir"]).read_manifest())
            procs = str(len(m["processes"]))
            leave = "yes" if m["criu"]["leave_running"] else "no"
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if s.get("error"):
            rows.append(
                (
                    pathlib.Path(s["images_dir"]).name,
                    f"ERROR {s['error']}",
                    "-",
                    procs,
                    "-",
                    "-",
                    leave,
                    "-",
                )
            )
            continue
        rows.append(
            (
                pathlib.Path(s["images_dir"]).name,
                s["created_at"] or "-",
                ",".join(map(str, s["roots"])) or "-",
                procs,
                str(s["carrier_bytes"]),
                str(s["image_bytes"]),
                leave,
                s.get("native") or "-",
            )
        )
    return rows


def render_snapshots(res: dict) -> None:
    """Print a ``list_snapshots`` result as a table on stdout: where, then a header and one
    row per snapshot (:func:`snapshot_rows`); byte counts are exact."""
    rows = snapshot_rows(res)
    print(f"{len(rows)} snapshot{'s' if len(rows) != 1 else ''} in {res['dir']}")
    table = [SNAPSHOT_COLUMNS, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(SNAPSHOT_COLUMNS))]
    right = {3, 4, 5}
    for r in table:
        print(
            "  ".join(
                (c.rjust(w) if i in right else c.ljust(w))
                for i, (c, w) in enumerate(zip(r, widths))
            ).rstrip()
        )
