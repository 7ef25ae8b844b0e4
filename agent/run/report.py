"""Progress reporting for checkpoint/restore: per-phase timings (ns) and byte counts.

:class:`Reporter` records every phase in ``phases`` (what goes into the manifest and the
``--json`` output) and forwards events to optional sinks. :class:`RichSink` renders a live
table on stderr for humans; the ``--json`` mode uses no sink.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    in ("start", "end", "note")."""

    def __init__(self, sinks: Optional[list[Callable]] = None):
        self.phases: list[Phase] = []
        self.notes: list[str] = []
        self.sinks = list(sinks or [])

    def _emit(self, event: str, obj) -> None:
        for s in self.sinks:
            try:
                s(event, obj)
            except Exception:  # a broken display must never break a checkpoint
                pass

    @contextlib.contextmanager
    def phase(self, name: str, detail: str = ""):
        """Time a block; yields the :class:`Phase` so the block can set ``bytes``/``detail``."""
        ph = Phase(name=name, detail=detail)
        self.phases.append(ph)
        self._emit("start", ph)
        t0 = time.monotonic_ns()
        try:
            yield ph
        except BaseException:
            ph.elapsed_ns = time.monotonic_ns() - t0
            ph.status = "failed"
            self._emit("end", ph)
            raise
        ph.elapsed_ns = time.monotonic_ns() - t0
        ph.status = "ok"
        self._emit("end", ph)

    def record(
        self, name: str, elapsed_ns: int, nbytes: int = 0, status: str = "ok", detail: str = ""
    ) -> Phase:
        """Add a phase that was timed elsewhere (e.g. a coordinator phase)."""
        ph = Phase(
            name=name, elapsed_ns=int(elapsed_ns), bytes=int(nbytes), status=status, detail=detail
        )
        self.phases.append(ph)
        self._emit("start", ph)
        self._emit("end", ph)
        return ph

    def coordinator_event(self, ev) -> None:
        """``on_event`` for the coordinator: one phase row per completed coordinator phase
        (barrier wall time, carrier bytes, the slowest shim's own time)."""
        if getattr(ev, "kind", None) != "phase" or ev.phase_result is None:
            return
        pr = ev.phase_result
        self.record(
            pr.phase,
            pr.wall_ns,
            pr.bytes,
            "ok" if ev.ok else "failed",
            f"{len(pr.participants)} pids, slowest shim {fmt_ns(pr.max_elapsed_ns)}"
            + (f", copy {fmt_ns(pr.max_copy_ns)}" if pr.max_copy_ns else ""),
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
                p.detail,
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
            self.rows.append(obj)
        elif event == "note":
            self.notes.append(obj)
        elif event == "total":
            self.total_row = obj
        self.live.update(self._render())


SNAPSHOT_COLUMNS = (
    "name",
    "created",
    "roots",
    "processes",
    "carrier bytes",
    "image bytes",
    "leave-running",
)


def snapshot_rows(res: dict) -> list[tuple[str, ...]]:
    """One row of :data:`SNAPSHOT_COLUMNS` per snapshot of a ``list_snapshots`` result. The
    process count and leave-running come from the manifest when it is readable from here
    ("-" otherwise, e.g. a remote agent's); a snapshot whose manifest is broken shows its
    error in the created column."""
    import json
    import pathlib

    rows = []
    for s in res["snapshots"]:
        procs, leave = "-", "-"
        try:
            m = json.loads((pathlib.Path(s["images_dir"]) / "manifest.json").read_text())
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
