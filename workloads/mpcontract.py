"""The workload contract (docs/workload-contract.md) for a process tree built with
``multiprocessing``: a root process (the launcher) that answers the agent's quiesce request for
the whole tree, and ranks that park between two units of work. No CUDA here: tmsh's ranks
(cuda-python, workloads/tmsh/rank.py) and torchmp's (PyTorch, workloads/torchmp/rank.py) bring
their own set-up and synchronize, and may release before a park what a dump cannot take (a
process group's TCP connections) and take it back after the resume.

Launcher side: :class:`Ranks` (the processes and the launcher's ends of their pipes),
:func:`quiesce` (one request: park every rank, write ``.ready``, wait for ``.resume``, resume),
:func:`serve` (the launcher's loop until every rank ended). Rank side: :class:`Rank`
(``serve()`` between two units, ``hold()`` at a fixed point, JSON events on stdout).

Pipe messages, launcher to rank: ``{"op": "quiesce"}``, ``{"op": "resume", "restored": bool}``;
rank to launcher: ``{"parked": True, "sent", "received", "vas"}``, ``{"resumed": True, "vas"}``,
``{"done": summary}``, ``{"failed": message}``.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from typing import Callable, Optional

from ..coordinator import contract
from . import stacks

POLL_S = 0.002  # a holding rank's sleep between two looks at its pipe
GET_S = 0.05  # a rank's wait on a queue between two looks at its pipe (counted as waited)


def emit(role: str, event: str, **kw) -> None:
    """One JSON line on stdout: {"event", "role", "pid", **kw}, in one ``write(2)``: every
    process of the tree shares the one log file (O_APPEND), and ``print`` writes the text and
    its newline separately, so two ranks' lines could interleave into one unparsable line (CI
    stop 31: a tmsh run lost two ``hold`` events that way and its harness waited forever)."""
    line = json.dumps({"event": event, "role": role, "pid": os.getpid(), **kw}) + "\n"
    sys.stdout.flush()  # anything print() left in the buffer goes first
    data = line.encode()
    while data:
        data = data[os.write(sys.stdout.fileno(), data) :]


class Ranks:
    """The ranks of one tree. ``specs``: (role, make) pairs in start order, ``make(conn)`` the
    ``multiprocessing`` Process of that role given its end of a new pipe. ``cfg`` needs
    ``answer_timeout_s`` (seconds a rank has to answer quiesce or resume)."""

    def __init__(self, cfg: dict, ctx, specs: list[tuple[str, Callable]]):
        self.cfg = cfg
        self.conns, self.procs, self.roles = [], [], []
        for role, make in specs:
            here, there = ctx.Pipe()
            self.procs.append(make(there))
            self.conns.append(here)
            self.roles.append(role)
        for p in self.procs:
            p.start()
        self.done: dict[str, dict] = {}
        self.failed: list[str] = []

    def active(self):
        return [
            (r, c, p) for r, c, p in zip(self.roles, self.conns, self.procs) if r not in self.done
        ]

    def take(self, role: str, msg: dict) -> Optional[dict]:
        """A rank's message about its end (done or failed): recorded; anything else returned."""
        if "done" in msg:
            self.done[role] = msg["done"]
        elif "failed" in msg:
            self.done[role] = {}
            self.failed.append(msg["failed"])
        else:
            return msg
        return None

    def poll(self) -> None:
        for role, conn, proc in self.active():
            try:
                while role not in self.done and conn.poll():
                    self.take(role, conn.recv())
            except (EOFError, OSError):  # its end of the pipe closed: the rank is gone
                proc.join(5)
                self.done[role] = {}
            if role not in self.done and not proc.is_alive() and not conn.poll():
                self.done[role] = {}  # died without a word (killed): the summary names its exit

    def ask(self, role, conn, proc, msg: dict, want: str) -> Optional[dict]:
        """Send ``msg``, wait (answer timeout) for the answer carrying ``want``; None when the
        rank ended instead. Raises RuntimeError when it exited without answering, TimeoutError
        past the answer timeout."""
        try:
            conn.send(msg)
        except OSError:
            raise RuntimeError(f"{role} pid {proc.pid} is gone (its pipe is closed)") from None
        deadline = time.monotonic() + self.cfg["answer_timeout_s"]
        while time.monotonic() < deadline:
            if conn.poll(0.05):
                try:
                    got = self.take(role, conn.recv())
                except (EOFError, OSError):
                    proc.join(5)
                    raise RuntimeError(
                        f"{role} pid {proc.pid} exited (status {proc.exitcode}) before answering {want}"
                    ) from None
                if got is None:
                    return None
                if want in got:
                    return got
            elif not proc.is_alive() and not conn.poll():
                raise RuntimeError(
                    f"{role} pid {proc.pid} exited (status {proc.exitcode}) before answering {want}"
                )
        raise TimeoutError(
            f"{role} pid {proc.pid} did not answer {msg['op']} within {self.cfg['answer_timeout_s']} s"
        )

    def exits(self) -> dict[str, Optional[int]]:
        return {r: p.exitcode for r, p in zip(self.roles, self.procs)}


def quiesce(ranks: Ranks, ctl: str, root: int, req: dict) -> dict:
    """One quiesce of the contract: park every rank, answer ``.ready`` (``sent``: what the
    ranks sent so far, summed), wait for ``.resume`` (``park_timeout_s`` of polling: time spent
    dumped does not count), resume every rank. Returns {"id", "restored", "cancelled",
    "vas_identical"} and emits ``quiesced`` and ``resumed``."""
    parked = {}
    for role, conn, proc in ranks.active():
        got = ranks.ask(role, conn, proc, {"op": "quiesce"}, "parked")
        if got is not None:
            parked[role] = (conn, proc, got)
    sent = sum(p[2]["sent"] for p in parked.values())
    received = sum(p[2]["received"] for p in parked.values())
    ready = {
        "id": req["id"],
        "ranks": [{"pid": p[1].pid, "role": r} for r, p in parked.items()],
        "sent": sent,
    }
    contract.write_atomic(contract.quiesce_path(ctl, root, "ready"), ready)
    emit(
        "launcher",
        "quiesced",
        id=req["id"],
        sent=sent,
        received=received,
        in_flight=sent - received,
        ranks=ready["ranks"],
    )
    resume_path = contract.quiesce_path(ctl, root, "resume")
    waited = 0.0
    while True:
        res = contract.read_json(resume_path)
        if res and res.get("id") == req["id"]:
            break
        time.sleep(0.05)
        waited += 0.05  # time spent dumped does not count
        if waited > ranks.cfg["park_timeout_s"]:
            raise TimeoutError(
                f"quiesce {req['id']}: no {resume_path} within {ranks.cfg['park_timeout_s']} s"
            )
    for k in ("request", "ready", "resume"):
        try:
            os.unlink(contract.quiesce_path(ctl, root, k))
        except FileNotFoundError:
            pass
    same = True
    for role, (conn, proc, p) in parked.items():
        got = ranks.ask(
            role, conn, proc, {"op": "resume", "restored": bool(res.get("restored"))}, "resumed"
        )
        same &= got is not None and got["vas"] == p["vas"]
    out = {
        "id": req["id"],
        "restored": bool(res.get("restored")),
        "cancelled": bool(res.get("cancelled")),
    }
    emit("launcher", "resumed", **out, vas_identical=same)
    return {**out, "vas_identical": same}


def serve(ranks: Ranks) -> list[dict]:
    """The launcher's loop: take the ranks' messages and answer every new quiesce request of
    this tree (root: this process; control directory: ``CUINTERPOSE_CONTROL_DIR`` or the
    default) until every rank ended. A timeout, a rank gone while parked, a rank that reported
    ``failed`` or one that died with a nonzero status kills the rest (the others would wait for
    it until their peer timeout) and is recorded in ``ranks.failed``. Returns the quiesces'
    results."""
    root = os.getpid()
    ctl = os.environ.get("CUINTERPOSE_CONTROL_DIR") or contract.default_control_dir()
    quiesces, last_id = [], None
    try:
        while ranks.active():
            ranks.poll()
            dead = [
                f"{r} pid {p.pid} exited {p.exitcode}"
                for r, p in zip(ranks.roles, ranks.procs)
                if p.exitcode not in (None, 0)
            ]
            if ranks.failed or dead:
                raise RuntimeError(f"{'; '.join(ranks.failed + dead)}: the other ranks are stopped")
            req = contract.read_json(contract.quiesce_path(ctl, root, "request"))
            if req and req.get("id") and req["id"] != last_id and ranks.active():
                last_id = req["id"]
                quiesces.append(quiesce(ranks, ctl, root, req))
            time.sleep(0.05)
    except (TimeoutError, RuntimeError) as e:
        emit("launcher", "failed", message=str(e))
        for p in ranks.procs:
            if p.exitcode is None:
                p.kill()
        if str(e) not in ranks.failed:
            ranks.failed.append(str(e))
    for p in ranks.procs:
        p.join()
    return quiesces


class Rank:
    """The rank side. Subclasses set the device up in :meth:`start` and drain it in
    :meth:`synchronize`; ``body(rank)`` is the rank's work, its return value the ``done``
    summary. ``vas_fn()`` names the memory that must keep its address across a quiesce."""

    def __init__(self, cfg: dict, role: str, conn):
        self.cfg, self.role, self.conn = cfg, role, conn
        self.pid = os.getpid()
        self.quiesces = 0
        self.sent = self.received = 0
        self.vas_fn = dict
        self.held_at = None
        self.waited_s = 0.0
        self.restored = False  # the last resume came from a restore

    def emit(self, event: str, **kw) -> None:
        emit(self.role, event, **kw)

    def start(self) -> None:
        """Set the device up (before ``body``)."""

    def synchronize(self) -> None:
        """Wait until no work of this process is left on the device."""

    def before_park(self) -> None:
        """Release what a dump cannot take (after :meth:`synchronize`), e.g. TCP connections."""

    def after_resume(self) -> None:
        """Take back what :meth:`before_park` released (``self.restored`` is set)."""

    def main(self, body) -> None:
        stacks.on_signal()
        try:
            self.start()
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
        self.synchronize()  # nothing left on a stream: every recorded event is complete
        self.before_park()
        self.conn.send(
            {"parked": True, "sent": self.sent, "received": self.received, "vas": self.vas_fn()}
        )
        while True:
            msg = self.conn.recv()  # blocks: no device call while parked (the launcher times it)
            if msg.get("op") == "resume":
                break
        self.quiesces += 1
        self.restored = bool(msg.get("restored"))
        self.after_resume()
        vas = self.vas_fn()
        self.conn.send({"resumed": True, "vas": vas})
        self.emit("vas", after_restore=self.restored, vas=vas)

    def ready(self, count: int, hold_at: int) -> bool:
        """One turn of a rank's loop: serve a quiesce request if one came, then True to go on,
        or False (after a short sleep) while holding at ``count == hold_at`` until the first
        quiesce (``hold_at`` 0: never)."""
        self.serve()
        if hold_at and count == hold_at and self.quiesces == 0:
            self.hold(count)
            return False
        return True

    def next_item(self, q, count: int = 0, hold_at: int = 0, what: str = "the next item"):
        """The next item of the queue ``q`` (None is a producer's end-of-stream), taken between
        turns of :meth:`ready` (serving quiesces, holding at ``count == hold_at``); past the
        peer timeout without one (:meth:`wait_a_little`; a hold does not count) the rank fails
        naming ``what``."""
        while True:
            if not self.ready(count, hold_at):
                continue
            try:
                item = q.get(timeout=GET_S)
            except queue.Empty:
                self.waited_s += GET_S
                self.wait_a_little(what)
                continue
            self.progressed()
            return item

    def await_ends(self, acks, n: int, what: str) -> None:
        """Until ``n`` ranks put their end on the queue ``acks`` (serving quiesces meanwhile;
        past the peer timeout, counted as in :meth:`wait_a_little`, the rank fails naming
        ``what``): a producer of CUDA tensors must outlive its consumers' use of them."""
        ended = 0
        while ended < n:
            self.serve()
            try:
                acks.get(timeout=GET_S)
                ended += 1
                self.progressed()
            except queue.Empty:
                self.waited_s += GET_S
                self.wait_a_little(what)

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
