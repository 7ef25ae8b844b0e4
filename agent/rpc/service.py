"""The agent's gRPC service (``cuinterpose-agent serve``; docs/service.md).

``Agent`` (proto/cuinterpose/v1/agent.proto) exposes ``Checkpoint``, ``Restore``, ``Inspect``,
``ListSnapshots`` and, for group requests, ``RunPhase``. Every RPC streams ``Event``s: one
``Progress`` per phase start/end (the :class:`~cuinterpose.agent.run.report.Reporter` events of
the same code the CLI runs, :mod:`cuinterpose.agent.run.ops`) and finally exactly one ``Result``
(``ok``, ``error`` with phase/pid/reason/outcome/node, the phases, and ``json``: the object the
CLI prints with ``--json``). ``seq`` numbers the events of a stream 1, 2, ...

One checkpoint or restore at a time per node: a single-node ``Checkpoint``/``Restore``, each
group phase a member runs (``RunPhase``) and each request of the pod watcher (agent/kube, run
in the daemon by :meth:`Server.start_watcher`) hold :attr:`AgentService.node_lock` while they
run; one that finds it taken reports a ``note`` row saying what it waits for, then waits. The
pod watcher's requests go through :meth:`AgentService.run_local`, so they count in the
daemon's metrics as a gRPC request does.

A request whose ``members`` is non-empty makes this agent the group leader
(:mod:`cuinterpose.agent.rpc.group`). A member keeps the state of a group request between
``RunPhase`` calls in :attr:`AgentService.jobs`, keyed by the leader's request id, for as
long as its lease lasts (:attr:`ServeOptions.group_lease_s`): every RunPhase and every
``Renew`` (which takes no node lock) extends it; when it runs out with no phase running, the
member undoes the job itself (:meth:`AgentService.expire_due`) and refuses every later
RunPhase of the request (docs/service.md "Leases").

Addresses: ``unix:/path`` (or ``unix:///path``) for a Unix socket, ``HOST:PORT`` for TCP
(TLS when a certificate and key are given; mutual TLS with a client CA).
:func:`listener_security` says whether a listener is safe to open (``serve`` refuses a
non-loopback TCP listener without mutual TLS unless ``--insecure-tcp``).

Path confinement: every images dir of a ``Checkpoint``/``Restore`` request (and of a group
member's ``RunPhase``) and every ``ListSnapshots`` dir is resolved against the daemon's
snapshot roots (:meth:`AgentService.confine`, :func:`confine_path`): a relative path is taken
relative to the first root; a path that resolves (symlinks, ``..``) outside every root is
refused before anything happens.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import queue
import threading
import time
from concurrent import futures
from typing import Callable, Iterator, Optional

from cuinterpose.agent.run import ops
from cuinterpose.agent.snapshot import pb
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.run.report import Phase, Reporter

log = logging.getLogger("cuinterpose.service")

DEFAULT_ADDRESS_ENV = "CUINTERPOSE_AGENT_ADDR"
SERVICE_NAME = "cuinterpose.v1.Agent"
#: the daemon's snapshot root when neither ``--snapshot-dir`` nor the config names one
DEFAULT_SNAPSHOT_DIR = "/var/lib/cuinterpose/snapshots"
#: seconds a member keeps a group request's job without a RunPhase or Renew from its leader
#: (``serve --group-lease-s``, config ``groupLeaseS``)
DEFAULT_GROUP_LEASE_S = 30.0
#: expired group requests a member remembers (to refuse their late RunPhase calls by name)
EXPIRED_KEPT = 256


def default_address() -> str:
    """``$CUINTERPOSE_AGENT_ADDR`` or ``unix:/tmp/cuinterpose-agent.sock``."""
    return os.environ.get(DEFAULT_ADDRESS_ENV, "unix:/tmp/cuinterpose-agent.sock")


def normalize_address(addr: str) -> str:
    """gRPC target for ``addr``: a bare absolute path becomes ``unix:PATH``; ``unix:``
    and ``HOST:PORT`` pass through. Raises ``ValueError`` on an empty address."""
    addr = (addr or "").strip()
    if not addr:
        raise ValueError("empty agent address")
    if addr.startswith("/"):
        return "unix:" + addr
    return addr


def unix_path(addr: str) -> Optional[str]:
    """The socket path of a ``unix:`` address, else None."""
    if addr.startswith("unix://"):
        return addr[len("unix://"):]
    if addr.startswith("unix:"):
        return addr[len("unix:"):]
    return None


def tcp_host(addr: str) -> Optional[str]:
    """The host part of a TCP address (``HOST:PORT``, ``[V6]:PORT``), brackets removed; None
    for a Unix socket address."""
    target = normalize_address(addr)
    if unix_path(target) is not None:
        return None
    host = target.rsplit(":", 1)[0] if ":" in target else target
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 (and the name ``localhost``). An empty host, ``0.0.0.0``, ``[::]``
    and any other name are not loopback."""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listener_security(addr: str, tls: Optional["TLS"], insecure_tcp: bool = False) -> dict:
    """Whether a daemon may listen on ``addr`` with ``tls``. Returns {"kind": "unix" |
    "loopback" | "mtls" | "tls" | "plaintext", "insecure": bool, "warning": str}; raises
    ``ValueError`` (the refusal, in words) for a non-loopback TCP listener without mutual TLS
    unless ``insecure_tcp``: every RPC is a root action (a checkpoint kills a process tree, a
    restore runs CRIU images as root), so the caller must be authenticated."""
    host = tcp_host(addr)
    if host is None:
        return {"kind": "unix", "insecure": False, "warning": ""}
    has_tls = tls is not None and bool(tls.cert)
    mtls = has_tls and bool(tls.ca)
    if mtls:
        return {"kind": "mtls", "insecure": False, "warning": ""}
    if is_loopback_host(host):
        return {"kind": "loopback", "insecure": False, "warning": ""}
    what = ("TLS without client certificates (--tls-client-ca): the server is authenticated, "
            "the caller is not" if has_tls else "plaintext without TLS or authentication")
    if not insecure_tcp:
        raise ValueError(
            f"refusing to listen on {addr}: a non-loopback TCP address with {what}; every RPC "
            "is a root action (a checkpoint kills the job's process tree, a restore runs CRIU "
            "images as root) and anyone who reaches the address could call it. Use mutual TLS "
            "(--tls-cert, --tls-key and --tls-client-ca), a unix: socket or a loopback "
            "address, or pass --insecure-tcp to accept the risk")
    return {"kind": "tls" if has_tls else "plaintext", "insecure": True,
            "warning": f"WARNING: INSECURE: listening on {addr} with {what} (--insecure-tcp): "
                       "anyone who reaches this address can checkpoint (kill) any opted-in "
                       "job and restore images as root on this node"}


def confine_path(path: str, roots: list, *, what: str = "images dir",
                 phase: str = "images dir") -> str:
    """``path`` resolved against the snapshot ``roots`` (absolute directories): a relative
    path is taken relative to ``roots[0]``; the result (symlinks and ``..`` resolved) must be
    one of the roots or lie under one. Returns the resolved path; raises ``AgentError``
    (outcome refused, nothing was done) naming the path and the allowed root(s)."""
    if not roots:
        raise AgentError(phase, f"{what} {path!r}: the agent has no snapshot directory",
                         outcome="refused")
    real_roots = [os.path.realpath(r) for r in roots]
    if not path:
        raise AgentError(phase, f"no {what} given", outcome="usage")
    if "\0" in path:
        raise AgentError(phase, f"{what} {path!r}: contains a NUL byte", outcome="refused")
    joined = path if os.path.isabs(path) else os.path.join(roots[0], path)
    real = os.path.realpath(joined)
    for r in real_roots:
        if real == r or real.startswith(r.rstrip("/") + "/"):
            return real
    allowed = " or ".join(real_roots)
    raise AgentError(phase, f"{what} {path} resolves to {real}, outside the agent's snapshot "
                     f"directory {allowed}; refused, nothing was done (the agent only reads "
                     "and writes under its --snapshot-dir)", outcome="refused")


@dataclasses.dataclass
class TLS:
    """PEM file paths. Server: ``cert`` + ``key`` (+ ``ca`` to require client certificates).
    Client: ``ca`` to verify the server (+ ``cert`` + ``key`` for mutual TLS)."""

    cert: Optional[str] = None
    key: Optional[str] = None
    ca: Optional[str] = None

    def _read(self, p):
        return pathlib.Path(p).read_bytes() if p else None

    def server_credentials(self):
        import grpc
        if not (self.cert and self.key):
            raise ValueError("TLS needs both a certificate and a key")
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))],
                                           root_certificates=self._read(self.ca),
                                           require_client_auth=bool(self.ca))

    def channel_credentials(self):
        import grpc
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca),
                                            private_key=self._read(self.key),
                                            certificate_chain=self._read(self.cert))

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)


def channel(addr: str, tls: Optional[TLS] = None):
    """A gRPC channel to an agent (TLS for TCP when ``tls`` is enabled)."""
    import grpc
    target = normalize_address(addr)
    opts = [("grpc.max_receive_message_length", 64 << 20)]
    if tls is not None and tls.enabled and unix_path(target) is None:
        return grpc.secure_channel(target, tls.channel_credentials(), options=opts)
    return grpc.insecure_channel(target, options=opts)


# -- events ------------------------------------------------------------------------------------

def progress_dict(event: str, ph: Optional[Phase] = None, text: str = "", **extra) -> dict:
    """A Progress row as a dict (the fields of ``cuinterpose.v1.Progress``)."""
    d = {"event": event, "phase": "", "status": "", "node": "", "pid": 0, "bytes": 0,
         "elapsed_ns": 0, "detail": "", "group_phase": "", "text": text}
    if ph is not None:
        d.update(phase=ph.name, status=ph.status, bytes=int(ph.bytes),
                 elapsed_ns=int(ph.elapsed_ns), detail=ph.detail)
    d.update({k: v for k, v in extra.items() if v is not None})
    return d


def error_dict(e: AgentError) -> dict:
    d = e.to_dict()
    d["node"] = getattr(e, "node", "") or ""
    return d


class Stream:
    """Runs ``work(reporter, emit)`` in a thread and turns what it reports into ``Event``s.

    ``work`` returns ``(json_object, manifest_or_None)``; an ``AgentError`` becomes a failed
    Result. ``emit(progress_dict)`` lets group code forward rows from other agents. Rows also
    feed ``on_row`` (metrics). Iterating yields ``agent_pb2.Event`` messages."""

    def __init__(self, work: Callable, on_row: Optional[Callable[[dict], None]] = None,
                 on_done: Optional[Callable[[bool], None]] = None,
                 active: Optional[set] = None):
        self.active = active       # the service's set of running work threads
        self.q: queue.Queue = queue.Queue()
        self.work = work
        self.on_row = on_row
        self.on_done = on_done
        self.rep = Reporter([self._sink])

    def _sink(self, event, obj):
        if event == "note":
            self.emit(progress_dict("note", text=str(obj)))
        else:
            self.emit(progress_dict(event, obj))

    def emit(self, row: dict) -> None:
        # rows forwarded from group members (node set) are counted by those members' agents
        if self.on_row is not None and row.get("event") == "end" and not row.get("node"):
            try:
                self.on_row(row)
            except Exception:
                pass
        self.q.put(("progress", row))

    def _run(self):
        try:
            self._work()
        finally:
            if self.active is not None:
                self.active.discard(threading.current_thread())

    def _work(self):
        try:
            obj, manifest = self.work(self.rep, self.emit)
            self.q.put(("result", {"ok": True, "json": obj, "manifest": manifest}))
        except AgentError as e:
            self.q.put(("result", {"ok": False, "error": error_dict(e)}))
        except BaseException as e:  # a bug in the service: still end the stream with a result
            phase = self.rep.phases[-1].name if self.rep.phases else "agent"
            err = AgentError(phase, f"unexpected {type(e).__name__}: {e}", outcome="failed")
            self.q.put(("result", {"ok": False, "error": error_dict(err)}))

    def __iter__(self) -> Iterator:
        apb, _, _ = pb.modules()
        # the work runs to its end even if the client goes away (a phase never stops
        # half-way); the daemon waits for it before exiting
        t = threading.Thread(target=self._run, name="cuinterpose-request", daemon=True)
        if self.active is not None:
            self.active.add(t)
        t.start()
        seq = 0
        while True:
            kind, obj = self.q.get()
            seq += 1
            if kind == "progress":
                yield apb.Event(seq=seq, progress=apb.Progress(**obj))
                continue
            yield apb.Event(seq=seq, result=self._result(obj))
            if self.on_done is not None:
                try:
                    self.on_done(obj["ok"])
                except Exception:
                    pass
            t.join()
            return

    def _result(self, obj: dict):
        apb, _, mpb = pb.modules()
        res = apb.Result(ok=obj["ok"])
        res.phases.extend(mpb.PhaseTiming(**p) for p in self.rep.to_list())
        if obj["ok"]:
            out = dict(obj["json"])
            res.json = json.dumps(out, sort_keys=True, default=str)
            if obj.get("manifest"):
                try:
                    res.manifest.CopyFrom(pb.manifest_to_proto(obj["manifest"]))
                except Exception as e:   # the snapshot is on disk; say why the copy is absent
                    self.rep.note(f"manifest not carried in the result: {e}")
        else:
            e = obj["error"]
            res.error.CopyFrom(apb.Error(phase=e["phase"] or "", pid=int(e["pid"] or 0),
                                         has_pid=e["pid"] is not None, reason=e["reason"] or "",
                                         outcome=e["outcome"] or "", message=e["message"] or "",
                                         node=e.get("node") or ""))
            res.json = json.dumps({"ok": False, "error": e, "phases": self.rep.to_list()},
                                  sort_keys=True, default=str)
        return res


# -- the servicer ------------------------------------------------------------------------------

@dataclasses.dataclass
class ServeOptions:
    """What ``serve`` was started with. ``node``: name in events and errors (default the
    host name); ``control_dir``/``driver``: defaults for requests that name none;
    ``snapshot_dir``: what ``ListSnapshots`` lists by default and the root relative images
    dirs are taken from (``snapshot_roots``: all the roots requests are confined to);
    ``tls``: credentials for the listener (TCP) and for the channels a leader opens to
    members; ``group_lease_s``: the lease of a group request's job on this member, seconds
    (> 0)."""

    node: str = ""
    control_dir: Optional[str] = None
    driver: Optional[str] = None
    snapshot_dir: Optional[str] = None
    #: every directory requests may name (images dirs, ListSnapshots); default
    #: [snapshot_dir] or [DEFAULT_SNAPSHOT_DIR]. The first is where relative paths point.
    snapshot_roots: tuple = ()
    tls: Optional[TLS] = None
    #: allow a non-loopback TCP listener without mutual TLS (``serve --insecure-tcp``)
    insecure_tcp: bool = False
    #: defaults for a CheckpointRequest/RestoreRequest that leaves them unset (0)
    quiesce_timeout_ms: int = 10_000
    lock_timeout_ms: int = 10_000
    phase_timeout_s: float = 60.0
    carrier_timeout_s: float = 3600.0
    #: a group request's job lives this many seconds past its last RunPhase or Renew
    group_lease_s: float = DEFAULT_GROUP_LEASE_S


class Job:
    """One group request on this member: the ``Checkpoint`` or ``Restore`` object whose
    phases the leader calls, the index of the next regular phase, a lock (one phase at a
    time) and the lease: ``deadline`` (``time.monotonic()`` seconds) is ``lease_s`` past the
    end of the last phase or the last ``Renew``, whichever is later."""

    def __init__(self, kind: str, obj, *, rid: str = "", lease_s: float = DEFAULT_GROUP_LEASE_S,
                 leader: str = ""):
        self.kind = kind
        self.obj = obj
        self.rid = rid
        self.next = 0
        self.undoing = False
        self.failed = False
        self.lock = threading.Lock()
        self.lease_s = float(lease_s)
        self.leader = leader or "(unnamed)"
        self.deadline = time.monotonic() + self.lease_s
        #: the phase running now ("" when none), the last phase run and whether it succeeded
        self.running = ""
        self.last = ""
        self.last_ok = True
        #: index in GROUP_PHASES of the furthest regular phase started (-1: none)
        self.reached = -1
        #: undo phases that succeeded
        self.undone: list = []
        #: the lease ran out and the member is undoing (or has undone) the job
        self.expiring = False
        self.expired = False

    def renew(self, now: Optional[float] = None) -> None:
        """Extend the lease to ``lease_s`` seconds from ``now`` (never shortens it)."""
        now = time.monotonic() if now is None else now
        self.deadline = max(self.deadline, now + self.lease_s)

    def reached_phase(self) -> str:
        """The last phase, in words for messages: ``'lock'`` or ``'dump' (which failed)``."""
        if not self.last:
            return "none"
        return repr(self.last) + ("" if self.last_ok else " (which failed)")


def _servicer_base():
    _, agrpc, _ = pb.modules()
    return agrpc.AgentServicer


class AgentService(_servicer_base()):
    """Implements ``cuinterpose.v1.Agent``. ``metrics`` (:class:`~.metrics.Metrics`) may be
    None."""

    def __init__(self, opts: ServeOptions, metrics=None):
        self.opts = opts
        self.metrics = metrics
        self.jobs: dict[str, Job] = {}
        self.jobs_lock = threading.Lock()
        #: request id -> what happened when its lease expired ({"kind", "leader", "phase",
        #: "lease_s", "result", "undo"}), the last EXPIRED_KEPT of them
        self.expired: "collections.OrderedDict[str, dict]" = collections.OrderedDict()
        self._closing = threading.Event()
        self._reaper: Optional[threading.Thread] = None
        #: threads running a request's work (joined before the daemon exits)
        self.active: set = set()
        #: held by whatever checkpoints or restores on this node (see the module docstring)
        self.node_lock = threading.Lock()
        #: what holds ``node_lock`` now, in words ("" when free)
        self.busy_with = ""

    def roots(self) -> list:
        """The snapshot roots requests are confined to (absolute, the first one first)."""
        o = self.opts
        roots = list(o.snapshot_roots) or [o.snapshot_dir or DEFAULT_SNAPSHOT_DIR]
        if o.snapshot_dir and o.snapshot_dir not in roots:
            roots.insert(0, o.snapshot_dir)
        return [os.path.abspath(r) for r in roots]

    def confine(self, path: str, *, what: str = "images dir", phase: str = "images dir") -> str:
        """:func:`confine_path` against :meth:`roots`; logs a refusal."""
        try:
            return confine_path(path, self.roots(), what=what, phase=phase)
        except AgentError as e:
            log.warning("refused: %s", e)
            raise

    @contextlib.contextmanager
    def exclusive(self, rep: Reporter, what: str):
        """Hold :attr:`node_lock` for ``what`` (words for the note another request shows
        while it waits). When the lock is taken, ``rep`` gets a note naming the holder first."""
        if not self.node_lock.acquire(blocking=False):
            rep.note(f"waiting for the node: {self.busy_with or 'another request'} is running "
                     "(one checkpoint or restore at a time per node)")
            self.node_lock.acquire()
        self.busy_with = what
        try:
            yield
        finally:
            self.busy_with = ""
            self.node_lock.release()

    def run_local(self, kind: str, what: str, work: Callable[[Reporter], dict]) -> dict:
        """Run ``work(reporter)`` (a ``kind`` = checkpoint/restore on this node that did not
        come over gRPC: the pod watcher's) under :attr:`node_lock`, counted in the metrics as a
        gRPC request is (in flight while it waits and runs, its phases, the finished request
        succeeded/failed). Returns what ``work`` returns; its exceptions propagate."""
        m = self.metrics

        def sink(event, obj):
            if event == "end" and m is not None:
                m.phase_done(kind, obj.name, obj.elapsed_ns, obj.bytes)
            elif event == "note":
                log.info("%s: %s", what, obj)
        rep = Reporter([sink])
        if m is not None:
            m.in_flight.labels(kind).inc()
        ok = False
        try:
            with self.exclusive(rep, what):
                result = work(rep)
            ok = True
            return result
        finally:
            if m is not None:
                m.in_flight.labels(kind).dec()
                m.finished(kind, ok)

    # helpers
    def _stream(self, kind: str, work: Callable, count: bool = True) -> Stream:
        """A Stream whose rows feed the metrics under ``kind``; ``count``: the request is
        counted in ``cuinterpose_snapshots_total``/in-flight (not a member's RunPhase: the
        leader counts the group request once)."""
        m = self.metrics
        if m is None:
            return Stream(work, active=self.active)
        count = count and kind in ("checkpoint", "restore")
        if count:
            m.in_flight.labels(kind).inc()

        def on_done(ok):
            if count:
                m.in_flight.labels(kind).dec()
                m.finished(kind, ok)
        return Stream(work, on_row=lambda r: m.phase_done(kind, r["phase"], r["elapsed_ns"],
                                                          r["bytes"]), on_done=on_done,
                      active=self.active)

    def checkpoint_kwargs(self, req) -> dict:
        o = req.options
        driver = o.driver or self.opts.driver
        d = self.opts
        return {"control_dir": o.control_dir or d.control_dir,
                "quiesce_timeout_ms": o.quiesce_timeout_ms or d.quiesce_timeout_ms,
                "lock_timeout_ms": (o.lock_timeout_ms if o.HasField("lock_timeout_ms")
                                    else d.lock_timeout_ms),
                "phase_timeout_s": o.phase_timeout_s or d.phase_timeout_s,
                "carrier_timeout_s": o.carrier_timeout_s or d.carrier_timeout_s,
                "driver": driver or None, "leave_running": o.leave_running}

    def restore_kwargs(self, req) -> dict:
        return {"driver": req.driver or self.opts.driver or None,
                "phase_timeout_s": req.phase_timeout_s or self.opts.phase_timeout_s,
                "carrier_timeout_s": req.carrier_timeout_s or self.opts.carrier_timeout_s,
                # a pid: read and checked in the restore's "placement" phase
                "placement": req.into_pid or None}

    def _env(self, driver: Optional[str]):
        # native.load reads $CUINTERPOSE_DRIVER when no kind is given (as the CLI sets it)
        if driver:
            os.environ["CUINTERPOSE_DRIVER"] = driver

    # RPCs
    def Checkpoint(self, request, context):
        if request.members:
            from cuinterpose.agent.rpc import group
            return iter(self._stream("checkpoint", lambda rep, emit: group.lead(
                "checkpoint", request, rep, emit, tls=self.opts.tls, leader=self.opts.node,
                lease_s=self.opts.group_lease_s)))
        kw = self.checkpoint_kwargs(request)
        self._env(kw["driver"])

        def work(rep, emit):
            images_dir = self.confine(request.images_dir)
            with self.exclusive(rep, f"a gRPC checkpoint of root(s) "
                                     f"{', '.join(map(str, request.roots)) or '-'}"):
                return ops.checkpoint(rep, list(request.roots), images_dir, **kw)
        return iter(self._stream("checkpoint", work))

    def Restore(self, request, context):
        if request.members:
            from cuinterpose.agent.rpc import group
            return iter(self._stream("restore", lambda rep, emit: group.lead(
                "restore", request, rep, emit, tls=self.opts.tls, leader=self.opts.node,
                lease_s=self.opts.group_lease_s)))
        kw = self.restore_kwargs(request)
        self._env(kw["driver"])

        def work(rep, emit):
            images_dir = self.confine(request.images_dir)
            with self.exclusive(rep, f"a gRPC restore of {images_dir}"):
                return ops.restore(rep, images_dir, **kw), None
        return iter(self._stream("restore", work))

    def Inspect(self, request, context):
        cd = request.control_dir or self.opts.control_dir
        return iter(self._stream("inspect", lambda rep, emit: (ops.inspect(
            int(request.pid), control_dir=cd, timeout_s=request.timeout_s or 10.0), None)))

    def ListSnapshots(self, request, context):
        d = request.dir or self.opts.snapshot_dir

        def work(rep, emit):
            if not d:
                raise AgentError("snapshots", "no directory given and the agent has no "
                                 "--snapshot-dir", outcome="usage")
            return ops.list_snapshots(self.confine(d, what="snapshot dir",
                                                   phase="snapshots")), None
        return iter(self._stream("list", work))

    def RunPhase(self, request, context):
        peer = context.peer() if context is not None else ""

        def work(rep, emit):
            try:
                with self.exclusive(rep, f"phase {request.phase!r} of group {request.kind} "
                                         f"{request.request_id}"):
                    return self.run_phase(request, rep, peer=peer)
            except AgentError as e:
                if not getattr(e, "node", ""):
                    e.node = self.opts.node
                raise
        return iter(self._stream(request.kind, work, count=False))

    def Renew(self, request, context):
        apb, _, _ = pb.modules()
        return apb.RenewResponse(**self.renew(request.request_id))

    # group member: leases
    def renew(self, rid: str) -> dict:
        """Extend the lease of group request ``rid`` to ``lease_s`` seconds from now. Takes no
        node lock (a long phase of this or another request does not delay it) and changes
        nothing else. Returns the ``RenewResponse`` fields: {"ok", "node", "lease_s", "phase",
        "running"} or, when this member holds no live job for ``rid``, ok false with
        ``expired`` and ``reason`` (naming the request and the node)."""
        node = self.opts.node
        with self.jobs_lock:
            job = self.jobs.get(rid)
            if job is not None and not job.expired:
                job.renew()
                return {"ok": True, "node": node, "lease_s": job.lease_s, "phase": job.last,
                        "running": bool(job.running)}
            rec = self.expired.get(rid)
        if rec is not None:
            reason = (f"request {rid}: its lease of {rec['lease_s']:g} s expired on node {node} "
                      f"after phase {rec['phase']} with no Renew or RunPhase from leader "
                      f"{rec['leader']}; this member {rec['undo']}")
        else:
            reason = (f"request {rid}: no such group request on node {node} (it finished, or "
                      "never started here)")
        return {"ok": False, "node": node, "lease_s": float(self.opts.group_lease_s),
                "expired": rec is not None, "reason": reason}

    def _start_reaper(self) -> None:
        """Start the thread that checks the group leases (once; stops at :meth:`close`)."""
        if self._reaper is not None and self._reaper.is_alive():
            return
        self._reaper = threading.Thread(target=self._reap, name="cui-group-lease", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        tick = max(0.05, min(1.0, float(self.opts.group_lease_s) / 4))
        while not self._closing.wait(tick):
            try:
                self.expire_due()
            except Exception:      # never let the lease check die
                log.exception("group lease check failed")

    def close(self) -> None:
        """Stop the lease checks (the daemon is stopping)."""
        self._closing.set()

    def expire_due(self, now: Optional[float] = None) -> list:
        """Start undoing every group job whose lease ran out (``now`` past its deadline, in
        ``time.monotonic()`` seconds) while no phase of it runs: each in a thread of its own
        (:meth:`_expire`, counted in :attr:`active`). Returns the request ids."""
        now = time.monotonic() if now is None else now
        due = []
        with self.jobs_lock:
            for rid, job in self.jobs.items():
                if not job.expiring and not job.running and now >= job.deadline:
                    job.expiring = True
                    due.append((rid, job))
        for rid, job in due:
            t = threading.Thread(target=self._expire, args=(rid, job), daemon=True,
                                 name=f"cui-lease-{rid[:8]}")
            self.active.add(t)
            t.start()
        return [rid for rid, _ in due]

    def _expire(self, rid: str, job: Job) -> None:
        try:
            self._expire_job(rid, job)
        except Exception:
            log.exception("group request %s: undoing it after its lease expired failed", rid)
        finally:
            self.active.discard(threading.current_thread())

    def _expire_job(self, rid: str, job: Job) -> None:
        """Undo ``job`` as its leader would have, under the node lock and the job's lock (so
        never while one of its phases runs), unless it was renewed or finished meanwhile."""
        m = self.metrics

        def sink(event, obj):
            if event == "end" and m is not None:
                m.phase_done(job.kind, obj.name, obj.elapsed_ns, obj.bytes)
            elif event == "note":
                log.warning("group %s request %s: %s", job.kind, rid, obj)
        rep = Reporter([sink])
        node = self.opts.node
        with self.exclusive(rep, f"undoing group {job.kind} {rid} (its lease expired)"):
            with job.lock:
                with self.jobs_lock:
                    if self.jobs.get(rid) is not job or time.monotonic() < job.deadline:
                        job.expiring = False       # finished, or renewed while we waited
                        return
                    job.expired = True
                    del self.jobs[rid]
                    rec = {"kind": job.kind, "leader": job.leader, "phase": job.reached_phase(),
                           "lease_s": job.lease_s, "result": "undoing",
                           "undo": "is undoing it now"}
                    self.expired[rid] = rec
                    while len(self.expired) > EXPIRED_KEPT:
                        self.expired.popitem(last=False)
                log.warning("node %s: group %s request %s from leader %s: its lease of %g s "
                            "expired after phase %s with no Renew or RunPhase; undoing it as the "
                            "leader would have", node, job.kind, rid, job.leader, job.lease_s,
                            rec["phase"])
                result, undo = self._undo_expired(job, rep)
                with self.jobs_lock:
                    rec.update(result=result, undo=undo)
        (log.warning if result != "undo_failed" else log.error)(
            "node %s: group %s request %s (lease expired after phase %s): this member %s",
            node, job.kind, rid, rec["phase"], undo)
        if m is not None:
            m.lease_expired(job.kind, result)

    def _undo_expired(self, job: Job, rep: Reporter) -> tuple:
        """What the leader would have run for ``job``: checkpoint past ``finish`` (every
        member's snapshot complete): ``resume``; otherwise the undo phases not run yet
        (``rollback``, then ``release``); restore: ``abort`` once ``criu restore`` was
        started, else nothing. Returns (result, words): result ``undone``, ``completed``,
        ``dropped`` or ``undo_failed``."""
        from cuinterpose.agent.run.checkpoint import Checkpoint
        from cuinterpose.agent.run.restore import Restore
        obj = job.obj
        obj.r.sinks = list(rep.sinks)
        try:
            if job.kind == "checkpoint":
                phases = Checkpoint.GROUP_PHASES
                if job.next > phases.index("finish") and not job.failed:
                    obj.run_phase("resume")
                    return "completed", ("ran 'resume': every member's snapshot was complete "
                                         "('finish' had run here)")
                for name in Checkpoint.GROUP_UNDO:
                    if name not in job.undone:
                        obj.run_phase(name)
                        job.undone.append(name)
                if getattr(obj, "torn_down", False):
                    return "undone", ("rolled it back and released it (the workload continues "
                                      "with its memory intact)")
                return "undone", "released it (nothing had been torn down)"
            if job.reached >= Restore.GROUP_PHASES.index("criu restore"):
                obj.run_phase("abort")
                return "undone", ("aborted it (its restored trees were killed; the snapshot is "
                                  "untouched)")
            return "dropped", "dropped it (it had not reached 'criu restore': nothing to undo)"
        except AgentError as e:
            return "undo_failed", f"could not undo it: {e}"
        except Exception as e:
            return "undo_failed", f"could not undo it: unexpected {type(e).__name__}: {e}"
        finally:
            obj.r.sinks = []

    def _expired_refusal(self, rid: str, name: str, rec: dict) -> AgentError:
        ok = rec["result"] in ("undone", "completed", "dropped")
        outcome = ("lease_expired" if ok else
                   "rollback_failed" if rec["kind"] == "checkpoint" else "restore_failed")
        return AgentError("group", f"request {rid}: phase {name!r} refused: the request's lease "
                          f"of {rec['lease_s']:g} s expired on node {self.opts.node} after phase "
                          f"{rec['phase']} with no Renew or RunPhase from leader "
                          f"{rec['leader']}; this member {rec['undo']}; this call changed "
                          "nothing", outcome=outcome)

    # group member
    def run_phase(self, req, rep: Reporter, peer: str = "") -> tuple[dict, None]:
        """One group phase for request ``req.request_id``. The first regular phase creates
        the job from ``req.checkpoint``/``req.restore``; phases must come in the order of
        ``GROUP_PHASES`` (an out-of-order or repeated phase, or any regular phase after one
        failed, is refused and changes nothing: a mutating phase is never retried); undo
        phases may come at any time after the job exists. The job is dropped after the
        last phase, the last undo phase, or a failed undo phase. Every call renews the job's
        lease when the phase ends; a request whose lease expired is refused (outcome
        ``lease_expired``, or ``rollback_failed``/``restore_failed`` when this member's own
        undo failed). ``peer``: the caller's address, naming the leader when ``req.leader``
        is empty. Returns ({"ok", "node", "phase", "state", "lease_s"}, None)."""
        from cuinterpose.agent.run.checkpoint import Checkpoint
        from cuinterpose.agent.run.restore import Restore
        rid, name, kind = req.request_id, req.phase, req.kind
        if kind not in ("checkpoint", "restore") or not rid:
            raise AgentError("group", f"bad RunPhase: kind {kind!r}, request id {rid!r}")
        cls = Checkpoint if kind == "checkpoint" else Restore
        with self.jobs_lock:
            job = self.jobs.get(rid)
            if job is None:
                rec = self.expired.get(rid)
                if rec is not None:
                    raise self._expired_refusal(rid, name, rec)
                if name != cls.GROUP_PHASES[0]:
                    raise AgentError("group", f"request {rid}: phase {name!r} for an unknown "
                                     "request (nothing was changed)")
                try:
                    obj = self._make(kind, req)
                except AgentError as e:    # a confinement refusal: the leader's undo phases
                    obj = _Refused(kind, req, e)   # still find the job (and do nothing)
                job = Job(kind, obj, rid=rid, lease_s=self.opts.group_lease_s,
                          leader=req.leader or (f"at {peer}" if peer else ""))
                self.jobs[rid] = job
                self._start_reaper()
        with job.lock:
            if job.expired:     # expired while this call waited (the expiry holds the lock)
                with self.jobs_lock:
                    rec = dict(self.expired.get(rid) or {
                        "kind": job.kind, "leader": job.leader, "phase": job.reached_phase(),
                        "lease_s": job.lease_s, "result": "undoing", "undo": "undid it"})
                raise self._expired_refusal(rid, name, rec)
            if job.kind != kind:
                raise AgentError("group", f"request {rid} is a {job.kind}, not a {kind}")
            undo = name in cls.GROUP_UNDO
            if not undo:
                want = (cls.GROUP_UNDO[0] if job.failed or job.undoing else
                        cls.GROUP_PHASES[job.next] if job.next < len(cls.GROUP_PHASES) else None)
                if job.failed or job.undoing or name != want:
                    raise AgentError("group", f"request {rid}: phase {name!r} out of order "
                                     f"(expected {want!r}); refused, nothing was changed")
            else:
                job.undoing = True
            # the job keeps one Reporter (its phases go into the manifest); this call's
            # stream gets the rows of this phase
            job.obj.r.sinks = list(rep.sinks)
            before = len(job.obj.r.phases)
            done = False
            job.running, job.last, job.last_ok = name, name, False
            if not undo:
                job.reached = max(job.reached, cls.GROUP_PHASES.index(name))
            try:
                state = job.obj.run_phase(name)
                job.last_ok = True
                if not undo:
                    job.next += 1
                    done = job.next == len(cls.GROUP_PHASES)
                else:
                    job.undone.append(name)
                    done = name == cls.GROUP_UNDO[-1]
            except AgentError as e:
                e.node = self.opts.node
                done = undo
                job.failed = True      # a mutating phase is never retried: undo only
                raise
            finally:
                rep.phases.extend(job.obj.r.phases[before:])
                job.obj.r.sinks = []
                with self.jobs_lock:
                    job.running = ""
                    job.deadline = time.monotonic() + job.lease_s
                    if done:
                        self.jobs.pop(rid, None)
        return {"ok": True, "node": self.opts.node, "phase": name, "state": state,
                "lease_s": job.lease_s}, None

    def _make(self, kind, req):
        """The member's Checkpoint/Restore for the first phase of a group request; its images
        dir confined to the snapshot roots (``AgentError`` when outside)."""
        from cuinterpose.agent.run.checkpoint import Checkpoint
        from cuinterpose.agent.run.restore import Restore
        if kind == "checkpoint":
            c = req.checkpoint
            images_dir = self.confine(c.images_dir)
            kw = self.checkpoint_kwargs(c)
            self._env(kw["driver"])
            obj = Checkpoint(list(c.roots), images_dir, reporter=Reporter(), **kw)
            if req.HasField("group"):
                obj.group = pb.message_to_dict(req.group)
            return obj
        images_dir = self.confine(req.restore.images_dir)
        kw = self.restore_kwargs(req.restore)
        self._env(kw["driver"])
        return Restore(images_dir, reporter=Reporter(), **kw)


class _Refused:
    """A group member's job whose request was refused before anything happened (its images
    dir is outside the snapshot roots): the first phase raises the refusal, the undo phases
    the leader then sends do nothing."""

    def __init__(self, kind: str, req, error: AgentError):
        self.kind = kind
        self.error = error
        self.r = Reporter()
        sub = req.checkpoint if kind == "checkpoint" else req.restore
        self.images_dir = sub.images_dir

    def run_phase(self, name: str) -> dict:
        from cuinterpose.agent.run.checkpoint import Checkpoint
        from cuinterpose.agent.run.restore import Restore
        cls = Checkpoint if self.kind == "checkpoint" else Restore
        if name not in cls.GROUP_UNDO:
            raise self.error
        if self.kind == "checkpoint":
            return {"torn_down": False, "snapshot_id": None, "images_dir": self.images_dir,
                    "manifest_written": False}
        return {}


# -- server ------------------------------------------------------------------------------------

class Server:
    """A running daemon: the gRPC server with the ``Agent`` and health services, and the
    metrics endpoint. ``address`` is the bound address (a TCP port 0 is resolved). Raises
    ``ValueError`` for a listener :func:`listener_security` refuses."""

    def __init__(self, listen: str, opts: ServeOptions, *, metrics_port: Optional[int] = None,
                 metrics_addr: str = "127.0.0.1", max_workers: int = 32):
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from cuinterpose.agent.rpc.metrics import Metrics
        _, agrpc, _ = pb.modules()
        self.opts = opts
        self.metrics = Metrics()
        self.service = AgentService(opts, self.metrics)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                             thread_name_prefix="cui-grpc"))
        agrpc.add_AgentServicer_to_server(self.service, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._health_pb2 = health_pb2
        #: listener_security(): {"kind", "insecure", "warning"}; refuses before binding
        self.security = listener_security(listen, opts.tls, opts.insecure_tcp)
        target = normalize_address(listen)
        path = unix_path(target)
        if path is not None:
            p = pathlib.Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            if p.is_socket():
                p.unlink()     # a stale socket of an agent that died
            port = self.server.add_insecure_port(target)
            self.address = "unix:" + path
        elif opts.tls is not None and opts.tls.cert:
            port = self.server.add_secure_port(target, opts.tls.server_credentials())
            self.address = f"{target.rsplit(':', 1)[0]}:{port}"
        else:
            port = self.server.add_insecure_port(target)
            self.address = f"{target.rsplit(':', 1)[0]}:{port}"
        if not port and path is None:
            raise OSError(f"cannot listen on {listen}")
        self.metrics_port = None
        if metrics_port is not None:     # 0: a free port the OS picks
            self.metrics_port = self.metrics.serve(metrics_port, metrics_addr)
        #: the pod watcher (agent/kube) and its thread, once :meth:`start_watcher` ran
        self.watcher = None
        self.watcher_thread: Optional[threading.Thread] = None

    def start(self) -> "Server":
        self.server.start()
        p = unix_path(self.address)
        if p:
            os.chmod(p, 0o600)   # same-UID trust domain, like the shim's sockets (D2)
        for name in ("", SERVICE_NAME):
            self.health.set(name, self._health_pb2.HealthCheckResponse.SERVING)
        return self

    def start_watcher(self, config, stop_event: threading.Event):
        """Start the pod watcher of ``config.kubernetes`` (``kube.build_watcher``) in a daemon
        thread. Its requests run through this daemon (``AgentService.run_local``: the node
        lock, the metrics). Returns (watcher, thread); raises ``ValueError`` on a bad
        Kubernetes setting. :meth:`stop` closes it."""
        from cuinterpose.agent.kube.actions import AgentActions
        from cuinterpose.agent.kube.watcher import build_watcher
        w = build_watcher(config, AgentActions(config, service=self.service))
        t = threading.Thread(target=w.run, args=(stop_event,), name="pod-watcher", daemon=True)
        self.watcher, self.watcher_thread = w, t
        t.start()
        return w, t

    def stop(self, grace: float = 5.0) -> None:
        """Health NOT_SERVING; the pod watcher starts no new request and a running one
        finishes; no new RPCs, streams cancelled after ``grace`` seconds; then wait for every
        running request's work to end (each phase has its own deadline: a checkpoint is never
        abandoned half-way), and remove the Unix socket."""
        for name in ("", SERVICE_NAME):
            self.health.set(name, self._health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.watcher is not None:
            self.watcher.close()          # waits for a running pod request
            self.watcher_thread.join(10)  # its watch read was cut: it leaves at once
        self.server.stop(grace).wait()
        self.service.close()
        for t in list(self.service.active):
            t.join()
        self.metrics.close()
        p = unix_path(self.address)
        if p:
            try:
                os.unlink(p)
            except OSError:
                pass

    def wait(self) -> None:
        self.server.wait_for_termination()


# -- client ------------------------------------------------------------------------------------

def call(addr: str, method: str, request, *, tls: Optional[TLS] = None,
         on_progress: Optional[Callable[[dict], None]] = None, timeout_s: Optional[float] = None):
    """Call streaming RPC ``method`` of the agent at ``addr``; ``on_progress(row_dict)`` for
    each Progress. Returns the final ``Result`` message. Raises ``AgentError`` (phase "agent",
    outcome "unreachable") when the agent cannot be reached or the stream ends without a
    result; the workload state is then unknown only if the request had started."""
    import grpc
    _, agrpc, _ = pb.modules()
    ch = channel(addr, tls)
    try:
        stub = agrpc.AgentStub(ch)
        result = None
        try:
            for ev in getattr(stub, method)(request, timeout=timeout_s):
                which = ev.WhichOneof("kind")
                if which == "progress" and on_progress is not None:
                    on_progress(pb.message_to_dict(ev.progress))
                elif which == "result":
                    result = ev.result
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            raise AgentError("agent", f"{addr}: {method}: {code.name if code else ''} "
                             f"{e.details() if hasattr(e, 'details') else e}".strip(),
                             outcome="unreachable") from None
        if result is None:
            raise AgentError("agent", f"{addr}: {method}: the stream ended without a result",
                             outcome="unreachable")
        return result
    finally:
        ch.close()


def renew(addr: str, request, *, tls: Optional[TLS] = None, timeout_s: float = 10.0):
    """Call ``Renew`` (a ``RenewRequest``) on the agent at ``addr``; returns the
    ``RenewResponse``. Raises ``AgentError`` (phase "agent", outcome "unreachable") when the
    agent cannot be reached within ``timeout_s`` seconds."""
    import grpc
    _, agrpc, _ = pb.modules()
    ch = channel(addr, tls)
    try:
        return agrpc.AgentStub(ch).Renew(request, timeout=timeout_s)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        raise AgentError("agent", f"{addr}: Renew: {code.name if code else ''} "
                         f"{e.details() if hasattr(e, 'details') else e}".strip(),
                         outcome="unreachable") from None
    finally:
        ch.close()


def health(addr: str, service: str = "", *, tls: Optional[TLS] = None,
           timeout_s: float = 5.0) -> str:
    """The health status name of ``service`` at ``addr`` (``SERVING``, ``NOT_SERVING``,
    ``SERVICE_UNKNOWN``). Raises ``grpc.RpcError`` when unreachable."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    ch = channel(addr, tls)
    try:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    finally:
        ch.close()
