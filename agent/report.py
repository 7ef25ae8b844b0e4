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
        return {"name": self.name, "elapsed_ns": self.elapsed_ns, "bytes": self.bytes,
                "status": self.status, "detail": self.detail}


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

    def record(self, name: str, elapsed_ns: int, nbytes: int = 0, status: str = "ok",
               detail: str = "") -> Phase:
        """Add a phase that was timed elsewhere (e.g. a coordinator phase)."""
        ph = Phase(name=name, elapsed_ns=int(elapsed_ns), bytes=int(nbytes), status=status,
                   detail=detail)
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
        self.record(pr.phase, pr.wall_ns, pr.bytes, "ok" if ev.ok else "failed",
                    f"{len(pr.participants)} pids, slowest shim {fmt_ns(pr.max_elapsed_ns)}"
                    + (f", copy {fmt_ns(pr.max_copy_ns)}" if pr.max_copy_ns else ""))

    def note(self, text: str) -> None:
        self.notes.append(text)
        self._emit("note", text)

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
    """Live table on stderr: one row per phase with status, time and bytes."""

    def __init__(self, title: str):
        from rich.console import Console
        from rich.live import Live
        self.title = title
        self.console = Console(stderr=True)
        if not self.console.is_terminal:  # logs: do not wrap at 80 columns
            self.console = Console(stderr=True, width=120)
        self.rows: list = []
        self.notes: list[str] = []
        self.live = Live(self._render(), console=self.console, refresh_per_second=10, transient=False)

    def _render(self):
        from rich.table import Table
        t = Table(title=self.title, title_justify="left", expand=False)
        t.add_column("phase")
        t.add_column("status")
        t.add_column("time", justify="right")
        t.add_column("bytes", justify="right")
        t.add_column("detail", overflow="fold")
        marks = {"running": "[yellow]…[/]", "ok": "[green]ok[/]", "failed": "[red]FAILED[/]"}
        for p in self.rows:
            t.add_row(p.name, marks.get(p.status, p.status),
                      fmt_ns(p.elapsed_ns) if p.status != "running" else "",
                      fmt_bytes(p.bytes) if p.bytes else "", p.detail)
        return t

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
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
        self.live.update(self._render())
