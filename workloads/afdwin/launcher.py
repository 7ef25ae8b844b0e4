"""The afdwin launcher: process-tree root, rendezvous, quiesce contract, sole stdout writer.

``python -m cuinterpose.workloads.afdwin --ranks N --attention A --steps S --ring-depth D
[--profile ci|gpu] [--step-delay-ms MS] [--seed N] [--host-memory auto|pinned|pageable]
[--stall-timeout-s T]``

The launcher never touches CUDA. It spawns the N rank processes (``subprocess``; they inherit
only stdio, with stdout pointed at stderr), serves a Unix socket in a private temp directory
(removed once every rank connected), validates geometry, relays export FDs (SCM_RIGHTS), runs
barriers, forwards rank events, and watches ``quiesce-<pid>.request`` in the control directory
(docs/workload-contract.md; file names and writes from coordinator/contract.py). Exit status:
0 when every invariant held, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from cuinterpose.coordinator.contract import (
    default_control_dir,
    quiesce_path,
)

from .config import PROFILES, Config
from .cut import QuiesceSide, RunFailed
from .layout import GEOMETRY_FIELDS, GeometryMismatch, check_geometry
from .wire import Channel, ChannelClosed

CONTROL_POLL_S = 0.05
WINDOW_KEYS = (
    "rank",
    "role",
    "base_va",
    "peer_va",
    "stride",
    "slot_bytes",
    "total_bytes",
    "regions",
    "rings",
    "handle_type",
)


class Launcher(QuiesceSide):
    def __init__(
        self, cfg: Config, overrides: dict[int, dict], host_memory: str, stall_timeout_s: float
    ):
        self.cfg = cfg
        self.overrides = overrides
        self.host_memory = host_memory
        self.stall_timeout_s = stall_timeout_s
        #: test-only (--test-no-quiesce-answer): never read a quiesce request, as a workload
        #: that does not honour the contract would (the agent must refuse after its timeout)
        self.ignore_quiesce = False
        self.pid = os.getpid()
        self.t_wall = time.time()  # "t" of events: wall seconds (monotonic jumps at restore)
        self.procs: list[subprocess.Popen] = []
        self.chans: dict[int, Channel] = {}
        self.rank_pid: dict[int, int] = {}
        self.geometry: dict[int, list[int]] = {}
        self.exports: dict[int, int] = {}
        self.barriers: dict[str, set[int]] = {}
        self.windows: dict[int, dict] = {}
        self.windows_after: list[dict] = []
        self.done: dict[int, dict] = {}
        self.errors: list[str] = []
        self.phase = "setup"
        self.q: dict | None = None
        #: quiesce request ids taken already: one answered request is never handled twice
        self.handled: set[str] = set()
        self.quiesces = 0
        self.restores_seen = 0
        self.last_change = time.monotonic()
        self.counters: dict[int, tuple] = {}
        #: --hold-at: attention rank -> its ``replied`` count at its "hold" event, while it
        #: has not moved past the hold (at a hold nothing is in flight: sent == replied)
        self.held: dict[int, int] = {}
        self.exited: set[int] = set()
        self.req_path = str(quiesce_path(None, self.pid, "request"))
        self.ready_path = str(quiesce_path(None, self.pid, "ready"))
        self.resume_path = str(quiesce_path(None, self.pid, "resume"))

    # ---- output ---------------------------------------------------------------------------
    def emit(self, ev: dict) -> None:
        ev = dict(ev)
        ev.setdefault("t", round(time.time() - self.t_wall, 6))
        sys.stdout.write(json.dumps(ev, separators=(",", ":")) + "\n")
        sys.stdout.flush()

    def rank_cfg(self, rank: int) -> Config:
        return dataclasses.replace(self.cfg, **self.overrides.get(rank, {}))

    # ---- startup --------------------------------------------------------------------------
    def spawn(self) -> None:
        N = self.cfg.world
        tmp = tempfile.mkdtemp(prefix="afdwin-")
        path = os.path.join(tmp, "rendezvous.sock")
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lsock.bind(path)
            lsock.listen(N)
            for i in range(N):
                cmd = [
                    sys.executable,
                    "-m",
                    "cuinterpose.workloads.afdwin.rank",
                    "--connect",
                    path,
                    "--rank",
                    str(i),
                ]
                self.procs.append(subprocess.Popen(cmd, stdout=sys.stderr.fileno(), close_fds=True))
            deadline = time.monotonic() + 120
            pending: list[Channel] = []
            while len(self.chans) < N:
                if time.monotonic() > deadline:
                    raise RunFailed("spawn", "ranks did not connect within 120 s")
                for i, p in enumerate(self.procs):
                    if p.poll() is not None:
                        raise RunFailed(
                            "spawn", f"rank {i} exited with {p.returncode} before connecting"
                        )
                r, _, _ = select.select([lsock] + pending, [], [], 0.1)
                for s in r:
                    if s is lsock:
                        conn, _ = lsock.accept()
                        pending.append(Channel(conn))
                        continue
                    got = s.recv(timeout=0)
                    if got is None:
                        continue
                    msg, _ = got
                    if msg.get("type") != "hello":
                        raise RunFailed("spawn", f"first message was {msg.get('type')!r}")
                    pending.remove(s)
                    self.chans[int(msg["rank"])] = s
                    self.rank_pid[int(msg["rank"])] = int(msg["pid"])
        finally:
            lsock.close()
            shutil.rmtree(tmp, ignore_errors=True)
        for i, ch in self.chans.items():
            ch.send(
                {
                    "type": "config",
                    "config": self.rank_cfg(i).to_json(),
                    "host_memory": self.host_memory,
                }
            )

    # ---- message handling -----------------------------------------------------------------
    def broadcast(self, msg: dict, ranks=None) -> None:
        for i in self.chans if ranks is None else ranks:
            if i not in self.exited:
                try:
                    self.chans[i].send(msg)
                except OSError:
                    pass

    def on_message(self, rank: int, msg: dict, fds: list[int]) -> None:
        t = msg["type"]
        N = self.cfg.world
        if t == "event":
            self.on_event(rank, msg["event"])
        elif t == "geometry":
            self.geometry[rank] = msg["values"]
            if len(self.geometry) == N:
                try:
                    check_geometry([self.geometry[i] for i in range(N)])
                except GeometryMismatch as e:
                    for i in range(N):
                        self.chans[i].send(
                            {
                                "type": "fail",
                                "field": e.field,
                                "values": e.values,
                                "message": e.message_for(i),
                            }
                        )
                    raise RunFailed(
                        "geometry",
                        str(e),
                        field=e.field,
                        values=e.values,
                        fields=list(GEOMETRY_FIELDS),
                    ) from None
                self.broadcast({"type": "geometry_ok"})
        elif t == "export":
            self.exports[rank] = fds[0]
            if len(self.exports) == N:
                for i in range(N):
                    peers = [(i + k) % N for k in range(1, N)]
                    self.chans[i].send(
                        {"type": "peers", "ranks": peers}, [self.exports[p] for p in peers]
                    )
                for fd in self.exports.values():
                    os.close(fd)
                self.exports = {}
        elif t == "mc_export":
            # --multicast: rank 0's multicast object, relayed to every other rank
            for i in range(1, N):
                self.chans[i].send({"type": "mc_import", "creator": rank}, fds[:1])
        elif t == "barrier":
            got = self.barriers.setdefault(msg["name"], set())
            got.add(rank)
            if len(got) == N:
                del self.barriers[msg["name"]]
                self.broadcast({"type": "barrier", "name": msg["name"]})
        elif t == "error":
            raise RunFailed("rank", f"rank {rank}: {msg['message']}", rank=rank)
        elif t in ("stopped", "parked", "resumed"):
            self.on_quiesce_reply(rank, msg)
        else:
            raise RunFailed("protocol", f"rank {rank} sent unknown message {t!r}")
        for fd in fds[1:] if t == "export" else fds:
            os.close(fd)

    def on_event(self, rank: int, ev: dict) -> None:
        kind = ev.get("event")
        if kind == "window":
            if ev.get("after_restore"):
                self.windows_after.append(ev)
            else:
                self.windows[rank] = ev
                if len(self.windows) == self.cfg.world and self.phase == "setup":
                    self.phase = "running"
                    self.last_change = time.monotonic()
        elif kind == "progress":
            c = (ev.get("sent"), ev.get("received"), ev.get("replied"))
            if self.counters.get(rank) != c:
                self.counters[rank] = c
                self.last_change = time.monotonic()
            # a progress event sent before the hold may arrive after it: only a step past the
            # hold (a send, or a reply, beyond the count at the hold) ends it
            if rank in self.held and max(c[0] or 0, c[2] or 0) > self.held[rank]:
                del self.held[rank]
        elif kind == "hold":
            self.held[rank] = int(ev.get("replied") or 0)
        elif kind == "done":
            self.done[rank] = ev
            self.held.pop(rank, None)
            self.last_change = time.monotonic()
        self.emit(ev)

    def loop(self) -> None:
        N = self.cfg.world
        while True:
            if len(self.done) == N and self.q is None:
                return
            live = [ch for i, ch in self.chans.items() if i not in self.exited]
            r, _, _ = select.select(live, [], [], CONTROL_POLL_S)
            for ch in r:
                rank = next(i for i, c in self.chans.items() if c is ch)
                try:
                    msgs = ch.pump()
                except ChannelClosed:
                    self.exited.add(rank)
                    try:
                        code = self.procs[rank].wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        code = None
                    raise RunFailed(
                        "rank",
                        f"rank {rank} (pid {self.rank_pid.get(rank)}) exited "
                        f"with status {code} before finishing",
                        rank=rank,
                    ) from None
                for msg, fds in msgs:
                    self.on_message(rank, msg, fds)
            # every iteration (<= CONTROL_POLL_S apart): no deadline that a clock jump could strand
            self.poll_control()
            self.check_stall(time.monotonic())

    def check_stall(self, now: float) -> None:
        """Raise ``RunFailed`` (stage "stall") when no rank's counters moved for
        ``stall_timeout_s`` seconds up to ``now`` (monotonic). The clock does not run while
        the workload is parked (a quiesce) or held (--hold-at: every attention rank still
        running has sent its "hold" event and made no progress since; the FFN ranks wait on
        them): that time is not counted, so a hold of any length is never a stall."""
        parked = self.q is not None and self.q["stage"] in ("parked", "ready")
        senders = {r for r in range(self.cfg.attention) if r not in self.done}
        if senders and senders <= self.held.keys():
            self.last_change = now  # held on purpose: the stall clock starts at the release
            return
        if not parked and now - self.last_change > self.stall_timeout_s:
            stage = (
                "setup"
                if self.phase == "setup"
                else f"quiesce {self.q['stage']}"
                if self.q
                else "running"
            )
            raise RunFailed("stall", f"no progress for {self.stall_timeout_s:g} s ({stage})")

    def finish(self) -> int:
        self.broadcast({"type": "exit"})
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=60))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return self.summary(codes)

    def summary(self, codes: list[int | None]) -> int:
        S, A, F = self.cfg.steps, self.cfg.attention, self.cfg.ffn
        messages = replies = lost = dup = torn = ooo = wfail = 0
        problems = list(self.errors)
        for rank, ev in sorted(self.done.items()):
            for p in ev["pairs"]:
                if ev["role"] == "ffn":
                    messages += p["count"]
                else:
                    replies += p["count"]
                lost += p["lost"]
                dup += p["duplicates"]
                torn += p["torn"]
                ooo += p["out_of_order"]
                exact = (
                    p["count"] == S
                    and p["distinct"] == S
                    and p["lost"] == 0
                    and p["duplicates"] == 0
                    and p["torn"] == 0
                    and p["out_of_order"] == 0
                    and (S == 0 or (p["first"] == 1 and p["last"] == S))
                )
                if not exact:
                    problems.append(f"pair {p['src']}->{p['dst']} not exactly 1..{S}: {p}")
            wfail += ev["window_checks"]["failed"]
            if not ev["ok"]:
                problems.append(f"rank {rank} not ok: {ev.get('errors')}")
            if ev["role"] == "ffn" and ev.get("shutdown_from") != list(range(A)):
                problems.append(f"rank {rank} saw shutdown from {ev.get('shutdown_from')}")
        if len(self.done) != self.cfg.world:
            problems.append(f"only ranks {sorted(self.done)} finished")
        va_same = True
        for ev in self.windows_after:
            before = self.windows.get(ev["rank"], {})
            if any(before.get(k) != ev.get(k) for k in WINDOW_KEYS):
                va_same = False
                problems.append(f"rank {ev['rank']} window changed across restore")
        for i, c in enumerate(codes):
            if c != 0:
                problems.append(f"rank {i} exit status {c}")
        ok = not problems
        self.emit(
            {
                "event": "summary",
                "ok": ok,
                "messages": messages,
                "replies": replies,
                "expected_messages": A * F * S,
                "lost": lost,
                "duplicated": dup,
                "torn": torn,
                "out_of_order": ooo,
                "ranks": self.cfg.world,
                "restores_seen": self.restores_seen,
                "quiesces": self.quiesces,
                "window_checks_failed": wfail,
                "va_tables_identical": va_same,
                "exit_codes": codes,
                "problems": problems[:20],
            }
        )
        return 0 if ok else 1

    def collect_reports(self, wait_s: float = 5.0) -> None:
        """Ask every live rank for its evidence so far (``done`` events with ``partial``)."""
        self.done.clear()
        self.broadcast({"type": "report"})
        deadline = time.monotonic() + wait_s
        while len(self.done) < len(self.chans) - len(self.exited) and time.monotonic() < deadline:
            live = [ch for i, ch in self.chans.items() if i not in self.exited]
            r, _, _ = select.select(live, [], [], 0.1)
            for ch in r:
                rank = next(i for i, c in self.chans.items() if c is ch)
                try:
                    for msg, fds in ch.pump():
                        if msg["type"] == "event":
                            self.on_event(rank, msg["event"])
                        for fd in fds:
                            os.close(fd)
                except ChannelClosed:
                    self.exited.add(rank)

    def kill_all(self) -> list[int | None]:
        self.broadcast({"type": "abort", "message": "launcher aborts the run"})
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=5))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes

    def run(self) -> int:
        self.emit(
            {
                "event": "start",
                "pid": self.pid,
                "ranks": self.cfg.world,
                "attention": self.cfg.attention,
                "ffn": self.cfg.ffn,
                "steps": self.cfg.steps,
                "ring_depth": self.cfg.ring_depth,
                "stages": self.cfg.num_stages,
                "no_drain": bool(self.cfg.no_drain),
                "pending_at_cut": bool(self.cfg.pending_at_cut),
                "no_fence": bool(self.cfg.no_fence),
                "profile": self.cfg.profile,
                "seed": self.cfg.seed,
                "control_dir": default_control_dir(),
                "request_path": self.req_path,
            }
        )
        try:
            self.spawn()
            self.loop()
        except RunFailed as e:
            self.errors.append(str(e))
            self.emit({"event": "error", "stage": e.stage, "message": str(e), **e.extra})
            if e.stage in ("stall", "quiesce"):
                self.collect_reports()
            return self.summary(self.kill_all())
        except BaseException:
            self.kill_all()
            raise
        return self.finish()


def parse_override(text: str) -> tuple[int, str, int]:
    """``RANK:FIELD=VALUE`` (a Config int field) -> (rank, field, value)."""
    try:
        rank, rest = text.split(":", 1)
        field, value = rest.split("=", 1)
        return int(rank), field, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:FIELD=VALUE, got {text!r}") from None


def parse_ring_depth(text: str) -> list[int]:
    """``D`` or ``D0,D1,...`` -> list of ints."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected D or D0,D1,..., got {text!r}") from None


def parse_delay(text: str) -> tuple[int, float]:
    """``RANK:MS`` -> (rank, ms)."""
    try:
        rank, ms = text.split(":", 1)
        return int(rank), float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:MS, got {text!r}") from None


def parse_hold_at(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STEP or STEP,STEP,..., got {text!r}") from None


STALL_TIMEOUT_S = 60.0


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cuinterpose.workloads.afdwin",
        description="afdwin: AFD symmetric-window reference workload",
    )
    ap.add_argument("--ranks", type=int, default=2, help="number of rank processes (N)")
    ap.add_argument("--attention", type=int, default=1, help="attention ranks (world ranks first)")
    ap.add_argument("--steps", type=int, default=100, help="steps per attention rank (S)")
    ap.add_argument(
        "--ring-depth",
        type=parse_ring_depth,
        default=[2],
        help="ring depth D; or one value per rank D0,D1,...  (a rank launched with "
        "a different value fails the geometry check, naming ring_depth)",
    )
    ap.add_argument(
        "--stages",
        type=int,
        default=0,
        help="live stages K per attention rank (default: D); stage k owns the "
        "rings r = k mod K; needs D >= K (and K dividing D)",
    )
    ap.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    ap.add_argument("--step-delay-ms", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--host-memory",
        choices=("auto", "pinned", "pageable"),
        default="auto",
        help="host staging: cuMemAllocHost (pinned) or pageable; auto = pinned when "
        "the driver provides it",
    )
    ap.add_argument(
        "--stall-timeout-s",
        type=float,
        default=STALL_TIMEOUT_S,
        help=f"fail when no rank makes progress for this long (default {STALL_TIMEOUT_S:g} s); "
        "the time the workload is parked (a quiesce) or held (--hold-at: a held rank waits "
        "for a checkpoint) does not count",
    )
    ap.add_argument(
        "--hold-at",
        type=parse_hold_at,
        default=(),
        metavar="STEP[,STEP...]",
        help="an attention rank issues step STEP+1 only after its k-th quiesce (k: the "
        "position of STEP in the list, from 1); it still answers control messages (it "
        "stops and parks when asked), so a checkpoint taken while it holds cuts exactly "
        "at STEP; it says so with a 'hold' event",
    )
    diag = ap.add_argument_group("diagnostic flags (docs/afdwin.md)")
    diag.add_argument(
        "--no-drain",
        action="store_true",
        help="quiesce without the drain: FFN ranks park at once, attention "
        "ranks park with a reply owed (a checkpoint must fail cleanly)",
    )
    diag.add_argument(
        "--pending-at-cut",
        action="store_true",
        help="at a quiesce each attention rank dispatches its next step and "
        "stops before its combine: the cut carries a landed, unread reply "
        "flag per (attention, FFN) pair",
    )
    ap.add_argument(
        "--multicast",
        action="store_true",
        help="also build a multicast region over the ranks (needs the device's "
        "MULTICAST_SUPPORTED attribute): rank 0 writes a value through the "
        "multicast VA, every rank reads it from its own member; repeated "
        "after every resume",
    )
    diag.add_argument(
        "--no-fence",
        action="store_true",
        help="setup without the fence barrier (zero + synchronize only)",
    )
    diag.add_argument(
        "--delay-zero-ms",
        action="append",
        default=[],
        type=parse_delay,
        metavar="RANK:MS",
        help="delay RANK's window zeroing by MS ms",
    )
    ap.add_argument(
        "--test-override", action="append", default=[], type=parse_override, help=argparse.SUPPRESS
    )
    ap.add_argument(
        "--test-no-quiesce-answer", action="store_true", help=argparse.SUPPRESS
    )  # RANK:FIELD=VALUE, tests only
    args = ap.parse_args(argv)
    try:
        depths = args.ring_depth
        if len(depths) not in (1, args.ranks):
            raise ValueError(
                f"--ring-depth needs 1 or {args.ranks} (one per rank) values, got {len(depths)}"
            )
        cfg = Config(
            world=args.ranks,
            attention=args.attention,
            steps=args.steps,
            ring_depth=depths[0],
            profile=args.profile,
            step_delay_ms=args.step_delay_ms,
            seed=args.seed,
            stages=args.stages,
            no_drain=int(args.no_drain),
            pending_at_cut=int(args.pending_at_cut),
            no_fence=int(args.no_fence),
            multicast=int(args.multicast),
            hold_at=args.hold_at,
        )
        cfg.window_layout()
        overrides: dict[int, dict] = {}
        for rank, d in enumerate(depths):
            if d != depths[0]:
                dataclasses.replace(cfg, ring_depth=d)  # validates (stages)
                overrides.setdefault(rank, {})["ring_depth"] = d
        for rank, ms in args.delay_zero_ms:
            if not (0 <= rank < cfg.world):
                raise ValueError(f"--delay-zero-ms names rank {rank}, outside 0..{cfg.world - 1}")
            overrides.setdefault(rank, {})["delay_zero_ms"] = ms
        fields = {f.name for f in dataclasses.fields(Config)}
        for rank, field, value in args.test_override:
            if field not in fields or not (0 <= rank < cfg.world):
                raise ValueError(f"bad --test-override {rank}:{field}")
            overrides.setdefault(rank, {})[field] = value
    except ValueError as e:
        ap.error(str(e))
    launcher = Launcher(cfg, overrides, args.host_memory, args.stall_timeout_s)
    launcher.ignore_quiesce = args.test_no_quiesce_answer
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return launcher.run()
    except KeyboardInterrupt:
        return 130
