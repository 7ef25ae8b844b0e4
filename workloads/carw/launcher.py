"""The carw launcher: process-tree root, IPC-handle exchange, quiesce contract, stdout writer.

``python -m cuinterpose.workloads.carw [--ranks N] [--steps S] [--elems E] [--step-delay-ms MS]
[--share ipc|pidfd|host] [--hold-at H[,H...]] [--peer-timeout-s S] [--setup-timeout-s S]
[--answer-timeout-s S] [--park-timeout-s S]`` (docs/carw.md, "Command line")

Starts N rank processes (``rank.py``), each on its end of an ``AF_UNIX`` socketpair; relays the
ranks' share info (``ipc``: 64-byte IPC handles as hex; ``pidfd``: pid and FD numbers;
``host``: the FDs, SCM_RIGHTS) so that each opens its peers'; starts the loop;
watches ``quiesce-<pid>.request`` in ``$CUINTERPOSE_CONTROL_DIR`` every 50 ms
(docs/workload-contract.md, through ``cuinterpose.coordinator.contract``). On a request it asks
every rank where it is, picks the cut T (the highest step any rank has started), lets every
rank complete step T and park, then writes ``.ready``; on ``.resume`` it removes the three files
and resumes the ranks. It never calls CUDA.

stdout: one JSON object per line (``event`` key): ``setup``, ``vas`` (per rank, at start and
after each restored resume), ``hold``, ``quiesce``, ``quiesced``, ``resumed``, ``done`` (per
rank), ``summary`` (:func:`cuinterpose.workloads.carw.evidence.summarize`), ``failed``.
Exit status 0 when the summary is ok and every rank exited 0, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import time

from cuinterpose.coordinator.contract import quiesce_path, read_json, remove_if_id, write_atomic

from .. import stacks
from ..afdwin.wire import Channel, ChannelClosed
from .evidence import summarize
from .layout import SHARES

REQUEST_POLL_S = 0.05


class RunFailed(RuntimeError):
    """The run cannot go on: a rank failed, died or a wait ran past its deadline."""


class Launcher:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.world = args.ranks
        self.pid = os.getpid()
        self.t0 = time.time()
        self.procs: list[subprocess.Popen] = []
        self.chans: list[Channel] = []
        self.inbox: list[list[dict]] = []
        self.done: dict[int, dict] = {}
        self.vas: list[dict] = []
        self.handled: set[str] = set()
        self.quiesces = 0
        self.paths = {
            k: str(quiesce_path(None, self.pid, k)) for k in ("request", "ready", "resume")
        }

    def emit(self, ev: dict) -> None:
        ev = dict(ev)
        ev.setdefault("t", round(time.time() - self.t0, 6))
        sys.stdout.write(json.dumps(ev, separators=(",", ":")) + "\n")
        sys.stdout.flush()

    def config(self) -> dict:
        a = self.args
        return {
            "world": self.world,
            "steps": a.steps,
            "elems": a.elems,
            "step_delay_ms": a.step_delay_ms,
            "hold_at": a.hold_at,
            "peer_timeout_s": a.peer_timeout_s,
            "share": a.share,
            "test_corrupt_table_at": a.test_corrupt_table_at,
        }

    # ---- ranks ----------------------------------------------------------------------------
    def spawn(self) -> None:
        for i in range(self.world):
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            cmd = [
                sys.executable,
                "-m",
                "cuinterpose.workloads.carw.rank",
                "--fd",
                str(theirs.fileno()),
                "--rank",
                str(i),
            ]
            p = subprocess.Popen(cmd, stdout=sys.stderr.fileno(), pass_fds=(theirs.fileno(),))
            theirs.close()
            self.procs.append(p)
            self.chans.append(Channel(mine))
            self.inbox.append([])
        for c in self.chans:
            c.send({"type": "config", "config": self.config()})

    def rank_gone(self, i: int) -> RunFailed:
        p = self.procs[i]
        try:
            status = p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = "unknown (still running)"
        return RunFailed(f"rank {i} (pid {p.pid}) exited with status {status} before finishing")

    def pump(self, timeout: float) -> None:
        """Read every rank's messages for up to ``timeout`` s: events are written out, ``done``
        recorded, errors raise ``RunFailed``; the rest queue in ``inbox``."""
        ready, _, _ = select.select(self.chans, [], [], timeout)
        for c in ready:
            i = self.chans.index(c)
            try:
                msgs = c.pump()
            except ChannelClosed:
                raise self.rank_gone(i) from None
            for msg, fds in msgs:
                t = msg["type"]
                if fds:  # only ``handles`` carries fds (--share host): relayed in setup()
                    msg["_fds"] = fds
                if t == "event":
                    ev = msg["event"]
                    if ev.get("event") == "vas":
                        self.vas.append(ev)
                    self.emit(ev)
                elif t == "error":
                    raise RunFailed(f"rank {i} (pid {self.procs[i].pid}): {msg['message']}")
                elif t == "done":
                    self.done[i] = msg["report"]
                    self.emit({"event": "done", "pid": self.procs[i].pid, **msg["report"]})
                else:
                    self.inbox[i].append(msg)

    def gather(self, mtype: str, what: str, timeout_s: float | None = None) -> list[dict]:
        """One ``mtype`` message from every rank (serving the request file meanwhile is not
        needed: this runs inside setup or a quiesce). Deadline: --peer-timeout-s of waiting."""
        limit = self.args.answer_timeout_s if timeout_s is None else timeout_s
        left = limit
        while True:
            for i, box in enumerate(self.inbox):
                bad = [m for m in box if m["type"] != mtype]
                if bad:
                    raise RunFailed(f"rank {i}: expected {mtype!r}, got {bad[0]['type']!r}")
            if all(self.inbox):
                out = [box.pop(0) for box in self.inbox]
                return out
            t = time.monotonic()
            self.pump(REQUEST_POLL_S)
            left -= min(time.monotonic() - t, 10 * REQUEST_POLL_S)
            if left <= 0:
                missing = [i for i, b in enumerate(self.inbox) if not b]
                raise RunFailed(f"ranks {missing} sent no {what} in {limit:g} s")

    def broadcast(self, msg: dict) -> None:
        for c in self.chans:
            c.send(msg)

    # ---- phases ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Relay every rank's share info (IPC handles, pid + FD numbers, or FDs) to all ranks:
        each gets its peers' FDs (SCM_RIGHTS) in rank order, named by ``fd_ranks``; the
        launcher closes its copies once sent."""
        got = self.gather("handles", "IPC handles", self.args.setup_timeout_s)
        handles = {str(m["rank"]): {"data": m["data"], "signal": m["signal"]} for m in got}
        try:
            for i, c in enumerate(self.chans):
                peers = [m for m in got if m["rank"] != i and m.get("_fds")]
                fds = [fd for m in peers for fd in m["_fds"]]
                c.send(
                    {"type": "peers", "handles": handles, "fd_ranks": [m["rank"] for m in peers]},
                    fds,
                )
        finally:
            for m in got:
                for fd in m.pop("_fds", ()):
                    os.close(fd)
        self.gather("ready", "ready (peers opened)", self.args.setup_timeout_s)
        self.emit(
            {
                "event": "setup",
                "pid": self.pid,
                "world": self.world,
                "ranks": [{"rank": m["rank"], "pid": m["pid"]} for m in got],
                "share": self.args.share,
                "shared": {str(m["rank"]): {"data": m["data"], "signal": m["signal"]} for m in got},
                "config": self.config(),
            }
        )
        self.broadcast({"type": "start"})

    def request(self) -> dict | None:
        req = read_json(self.paths["request"])
        if req is None or not isinstance(req.get("id"), str) or req["id"] in self.handled:
            return None
        return req

    def quiesce(self, req: dict) -> None:
        qid = req["id"]
        self.handled.add(qid)
        self.quiesces += 1
        self.emit({"event": "quiesce", "id": qid})
        self.broadcast({"type": "quiesce", "id": qid})
        at = self.gather("at", "its step at the quiesce")
        cut = max(m["step"] for m in at)
        self.broadcast({"type": "park", "step": cut})
        parked = self.gather("parked", "parked")
        ranks = [{"rank": m["rank"], "pid": m["pid"], "step": m["step"]} for m in parked]
        write_atomic(self.paths["ready"], {"id": qid, "step": cut, "ranks": ranks})
        self.emit({"event": "quiesced", "id": qid, "step": cut, "ranks": ranks})
        resume = self.wait_resume(qid)
        # this request's files only, .request last: the agent's next request waits for it
        for k in ("ready", "resume", "request"):
            remove_if_id(self.paths[k], qid)
        restored = bool(resume.get("restored"))
        self.broadcast({"type": "resume", "restored": restored})
        self.gather("probed", "its probe word")
        self.broadcast({"type": "probe"})
        lost = [(m["rank"], m["lost"]) for m in self.gather("resumed", "resumed") if m["lost"]]
        if lost:
            raise RunFailed(
                f"quiesce {qid}: after the {'restore' if restored else 'resume'} at step {cut} "
                "the ranks no longer share their memory (private copies?): "
                + "; ".join(f"rank {r}: {', '.join(why)}" for r, why in lost)
            )
        self.emit(
            {
                "event": "resumed",
                "id": qid,
                "step": cut,
                "restored": restored,
                "cancelled": bool(resume.get("cancelled")),
            }
        )

    def wait_resume(self, qid: str) -> dict:
        """The agent's ``.resume`` for ``qid``. Deadline: --park-timeout-s of waiting (time
        spent dumped by CRIU does not count: each poll counts at most 10 intervals)."""
        left = self.args.park_timeout_s
        while True:
            res = read_json(self.paths["resume"])
            if res is not None and res.get("id") == qid:
                return res
            t = time.monotonic()
            self.pump(REQUEST_POLL_S)
            left -= min(time.monotonic() - t, 10 * REQUEST_POLL_S)
            if left <= 0:
                raise RunFailed(
                    f"quiesce {qid}: parked for {self.args.park_timeout_s:g} s with no "
                    f"{self.paths['resume']} (the agent died, or its checkpoint takes longer "
                    "than --park-timeout-s); stopping the run"
                )

    def run(self) -> dict:
        self.spawn()
        self.setup()
        while len(self.done) < self.world:
            req = self.request()
            if req is not None:
                self.quiesce(req)
                continue
            self.pump(REQUEST_POLL_S)
        summary = summarize(self.world, self.args.steps, list(self.done.values()), self.vas)
        summary["quiesces"] = self.quiesces
        self.broadcast({"type": "exit"})
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=self.args.answer_timeout_s))
            except subprocess.TimeoutExpired:
                codes.append(None)
        summary["rank_exit"] = codes
        if any(c != 0 for c in codes):
            summary["ok"] = False
            summary["problems"].append(f"rank exit statuses {codes}")
        return summary

    def stop(self, reason: str) -> None:
        for c in self.chans:
            try:
                c.send({"type": "abort", "message": reason})
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m cuinterpose.workloads.carw")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--elems", type=int, default=256, help="u64 values per contribution")
    ap.add_argument("--step-delay-ms", type=float, default=2.0)
    ap.add_argument(
        "--hold-at",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="after these steps, wait for a quiesce before going on (a deterministic cut)",
    )
    ap.add_argument(
        "--share",
        choices=SHARES,
        default="ipc",
        help="how ranks share memory: legacy CUDA IPC, cuMem FDs taken with pidfd_getfd, "
        "or host (HOST_NUMA) cuMem FDs sent over the socket (docs/carw.md)",
    )
    ap.add_argument(
        "--test-corrupt-table-at",
        type=int,
        default=0,
        metavar="STEP",
        help="test only: at STEP, rank 0 points its table's row 1 data VA at its own data (a "
        "wrong peer VA), which every later step must report",
    )
    ap.add_argument("--peer-timeout-s", type=float, default=300.0)
    ap.add_argument("--setup-timeout-s", type=float, default=300.0)
    ap.add_argument("--answer-timeout-s", type=float, default=300.0)
    ap.add_argument("--park-timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    if args.ranks < 2 or args.steps < 1 or args.elems < 1:
        ap.error("--ranks must be >= 2, --steps and --elems >= 1")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    stacks.on_signal()
    la = Launcher(args)
    try:
        summary = la.run()
    except RunFailed as e:
        la.emit({"event": "failed", "message": str(e)})
        la.stop(str(e))
        return 1
    la.emit({"event": "summary", **summary})
    return 0 if summary["ok"] else 1
