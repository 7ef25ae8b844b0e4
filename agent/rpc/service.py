"""The agent's gRPC service (``cuinterpose-agent serve``; docs/service.md).

``Agent`` (proto/cuinterpose/v1/agent.proto) exposes ``Checkpoint``, ``Restore``, ``Inspect``,
``ListSnapshots``, ``DeleteSnapshot`` (its images dir confined to the snapshot roots) and, for
group requests, ``RunPhase`` and ``Renew``. Every RPC but ``Renew``
streams ``Event``s (:class:`Stream`): one ``Progress`` per phase start/end (the
:class:`~cuinterpose.agent.run.report.Reporter` events of the same code the CLI runs,
:mod:`cuinterpose.agent.run.ops`) and finally exactly one ``Result`` (``ok``, ``error`` with
phase/pid/reason/outcome/node, the phases, and ``json``: the object the CLI prints with
``--json``). ``seq`` numbers the events of a stream 1, 2, ...

One checkpoint or restore at a time per node: a single-node ``Checkpoint``/``Restore``, each
group phase a member runs (``RunPhase``) and each request of the pod watcher (agent/kube, run
in the daemon by :meth:`Server.start_watcher`) hold :attr:`AgentService.node_lock` while they
run; one that finds it taken reports a ``note`` row saying what it waits for, then waits. The
pod watcher's requests go through :meth:`AgentService.run_local`, so they count in the
daemon's metrics as a gRPC request does.

A request whose ``members`` is non-empty makes this agent the group leader
(:mod:`cuinterpose.agent.rpc.group`); the member side of group requests (their jobs and
leases) is :class:`~cuinterpose.agent.rpc.member.GroupMember`. What a listener and a request
may do: :mod:`cuinterpose.agent.rpc.security`; the client side: :mod:`cuinterpose.agent.rpc.client`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from concurrent import futures
from typing import Callable, Optional

from cuinterpose.agent import options as options_mod
from cuinterpose.agent import paths, validate
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.mech import native_call
from cuinterpose.agent.rpc import group, unixsock
from cuinterpose.agent.rpc.client import (
    SERVER_KEEPALIVE_OPTIONS,
    SERVICE_NAME,
    TLS,
    normalize_address,
    unix_path,
)
from cuinterpose.agent.rpc.member import (
    DEFAULT_GROUP_LEASE_S,
    GroupMember,
    options_of,
    restore_targets,
)
from cuinterpose.agent.rpc.security import confine_path, listener_security
from cuinterpose.agent.rpc.stream import (  # noqa: F401 (error_dict, progress_dict: re-exported)
    CHECKPOINT_LEFT,
    RESTORE_LEFT,
    Stream,
    error_dict,
    progress_dict,
)
from cuinterpose.agent.run import interrupt, ops
from cuinterpose.agent.run.report import Reporter
from cuinterpose.agent.snapshot import pb

log = logging.getLogger("cuinterpose.service")
#: the daemon's snapshot root when neither ``--snapshot-dir`` nor the config names one
DEFAULT_SNAPSHOT_DIR = paths.DEFAULT_SNAPSHOT_DIR

# -- the servicer ------------------------------------------------------------------------------


@dataclasses.dataclass
class ServeOptions:
    """What ``serve`` was started with. ``node``: name in events and errors (default the
    host name); ``options``: the daemon's own options by request kind ("checkpoint",
    "restore", "inspect": agent/options.py objects, from its environment, config and flags):
    what a request leaves unset takes from these; ``snapshot_dir``: what ``ListSnapshots``
    lists by default and the root relative images dirs are taken from (``snapshot_roots``: all
    the roots requests are confined to); ``tls``: credentials for the listener (TCP) and for
    the channels a leader opens to members; ``group_lease_s``: the lease of a group request's
    job on this member, seconds (> 0). A root may be
    ``s3://BUCKET/PREFIX``: requests under it go through ``storage``, their local copies under
    ``staging_dir`` (agent/run/remote.py)."""

    node: str = ""
    options: dict = dataclasses.field(default_factory=options_mod.for_kinds)
    snapshot_dir: Optional[str] = None
    #: every directory requests may name (images dirs, ListSnapshots); default
    #: [snapshot_dir] or [DEFAULT_SNAPSHOT_DIR]. The first is where relative paths point.
    snapshot_roots: tuple = ()
    tls: Optional[TLS] = None
    #: allow a non-loopback TCP listener without mutual TLS (``serve --insecure-tcp``)
    insecure_tcp: bool = False
    #: a group request's job lives this many seconds past its last RunPhase or Renew
    group_lease_s: float = DEFAULT_GROUP_LEASE_S
    #: where the local copies of ``s3://`` snapshots go (agent/run/remote.py; None: its default)
    staging_dir: Optional[str] = None
    #: how ``s3://`` roots are reached (agent/snapshot/backends/api.py ``StorageOptions``: the
    #: S3 settings ``serve`` resolved once from the AWS variables and files, the node key);
    #: None when every root is a local directory
    storage: Optional[object] = None


def _servicer_base():
    _, agrpc, _ = pb.modules()
    return agrpc.AgentServicer


class AgentService(GroupMember, _servicer_base()):
    """Implements ``cuinterpose.v1.Agent``. ``metrics`` (:class:`~.metrics.Metrics`) may be
    None."""

    def __init__(self, opts: ServeOptions, metrics=None):
        self.opts = opts
        self.metrics = metrics
        self.init_member()
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
        return [r if "://" in str(r) else paths.canonical(r) for r in roots]

    def remote_for(self, images_dir: str, kind: str, opts):
        """The agent/run/remote.py ``Remote`` of a confined images dir for a ``kind`` run
        ("checkpoint", "restore") with the request's options ``opts`` (its ``local_dir``
        confined to the staging dir, its ``keep_local``); None for a local one."""
        from cuinterpose.agent.run import remote

        staging = self.opts.staging_dir or remote.DEFAULT_STAGING_ROOT
        local = opts.local_dir
        if local and "://" not in images_dir:
            raise AgentError(
                "request", f"local_dir {local}: is for an s3:// images dir", outcome="refused"
            )
        if local:
            local = confine_path(local, [staging], what="local dir", phase="images dir")
        return remote.make(
            images_dir,
            self.opts.storage,
            kind=kind,
            local_dir=local,
            staging_root=staging,
            keep_local=opts.keep_local,
        )

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
            rep.note(
                f"waiting for the node: {self.busy_with or 'another request'} is running "
                "(one checkpoint or restore at a time per node)"
            )
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
    def _stream(self, kind: str, work: Callable, count: bool = True, **log) -> Stream:
        """A Stream whose rows feed the metrics under ``kind``; ``count``: the request is
        counted in ``cuinterpose_snapshots_total``/in-flight (not a member's RunPhase: the
        leader counts the group request once); ``log``: Stream's ``what``, ``context`` and
        ``cancel``."""
        m = self.metrics
        if m is None:
            return Stream(work, active=self.active, kind=kind, **log)
        count = count and kind in ("checkpoint", "restore")
        if count:
            m.in_flight.labels(kind).inc()

        def on_done(ok):
            if count:
                m.in_flight.labels(kind).dec()
                m.finished(kind, ok)

        return Stream(
            work,
            on_row=lambda r: m.phase_done(kind, r["phase"], r["elapsed_ns"], r["bytes"]),
            on_done=on_done,
            active=self.active,
            kind=kind,
            **log,
        )

    def request_options(self, kind: str, msg):
        """The options of a ``kind`` request ("checkpoint", "restore", "inspect"): the
        daemon's own (:attr:`ServeOptions.options`) with every field the request's options
        message ``msg`` sets (None: none); built once per request. Raises ``OptionError``
        (refused) naming ``options.FIELD``."""
        return options_mod.BY_KIND[kind].from_proto(msg, self.opts.options[kind])

    def _lead(self, kind: str, request):
        """A request with ``members``: this agent leads the group (rpc/group.py)."""
        return iter(
            self._stream(
                kind,
                lambda rep, emit: group.lead(
                    kind,
                    request,
                    rep,
                    emit,
                    tls=self.opts.tls,
                    leader=self.opts.node,
                    lease_s=self.opts.group_lease_s,
                ),
            )
        )

    # RPCs
    def Checkpoint(self, request, context):
        if request.members:
            return self._lead("checkpoint", request)

        cancel = interrupt.Cancel()
        roots = ", ".join(map(str, request.roots)) or "-"

        def work(rep, emit):
            opts = self.request_options("checkpoint", options_of(request))
            validate.checkpoint_request(roots=list(request.roots), images_dir=request.images_dir)
            images_dir = self.confine(request.images_dir)
            with self.exclusive(rep, f"a gRPC checkpoint of root(s) {roots}"):
                interrupt.refuse_if_stopped("checkpoint", CHECKPOINT_LEFT, cancel)
                where = self.remote_for(images_dir, "checkpoint", opts)
                return ops.checkpoint(
                    rep, list(request.roots), images_dir, opts, where, cancel=cancel
                )

        what = f"of root(s) {roots} -> {request.images_dir}"
        return iter(self._stream("checkpoint", work, what=what, context=context, cancel=cancel))

    def Restore(self, request, context):
        if request.members:
            return self._lead("restore", request)

        cancel = interrupt.Cancel()

        def work(rep, emit):
            opts = self.request_options("restore", options_of(request))
            kw = restore_targets(request)
            validate.restore_request(images_dir=request.images_dir, **kw)
            images_dir = self.confine(request.images_dir)
            with self.exclusive(rep, f"a gRPC restore of {images_dir}"):
                interrupt.refuse_if_stopped("restore", RESTORE_LEFT, cancel)
                where = self.remote_for(images_dir, "restore", opts)
                return ops.restore(rep, images_dir, opts, where, cancel=cancel, **kw), None

        what = f"of {request.images_dir}"
        return iter(self._stream("restore", work, what=what, context=context, cancel=cancel))

    def Inspect(self, request, context):
        def work(rep, emit):
            opts = self.request_options("inspect", options_of(request))
            validate.inspect_request(pid=int(request.pid))
            return ops.inspect(int(request.pid), opts), None

        return iter(self._stream("inspect", work))

    def ListSnapshots(self, request, context):
        d = request.dir or self.opts.snapshot_dir

        def work(rep, emit):
            if not d:
                raise AgentError(
                    "snapshots",
                    "no directory given and the agent has no --snapshot-dir",
                    outcome="usage",
                )
            d2 = self.confine(d, what="snapshot dir", phase="snapshots")
            return ops.list_snapshots(d2, self.opts.storage), None

        return iter(self._stream("list", work))

    def DeleteSnapshot(self, request, context):
        def work(rep, emit):
            if not request.images_dir:
                raise AgentError("chunk store", "no images_dir given", outcome="usage")
            d = self.confine(request.images_dir, what="images dir", phase="chunk store")
            return ops.delete_snapshot(d, self.opts.storage), None

        return iter(self._stream("delete", work))

    def RunPhase(self, request, context):
        peer = context.peer() if context is not None else ""

        def work(rep, emit):
            try:
                with self.exclusive(
                    rep, f"phase {request.phase!r} of group {request.kind} {request.request_id}"
                ):
                    return self.run_phase(request, rep, peer=peer)
            except AgentError as e:
                if not getattr(e, "node", ""):
                    e.node = self.opts.node
                raise

        return iter(self._stream(request.kind, work, count=False))

    def Renew(self, request, context):
        apb, _, _ = pb.modules()
        return apb.RenewResponse(**self.renew(request.request_id, request.node))


# -- server ------------------------------------------------------------------------------------


class Server:
    """A running daemon: the gRPC server with the ``Agent`` and health services, and the
    metrics endpoint. ``address`` is the bound address (a TCP port 0 is resolved). Raises
    ``ValueError`` for a listener :func:`listener_security` refuses."""

    def __init__(
        self,
        listen: str,
        opts: ServeOptions,
        *,
        metrics_port: Optional[int] = None,
        metrics_addr: str = "127.0.0.1",
        max_workers: int = 32,
    ):
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        from cuinterpose.agent.rpc.metrics import Metrics

        _, agrpc, _ = pb.modules()
        self.opts = opts
        self.metrics = Metrics()
        self.service = AgentService(opts, self.metrics)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="cui-grpc"),
            options=SERVER_KEEPALIVE_OPTIONS,
        )
        agrpc.add_AgentServicer_to_server(self.service, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._health_pb2 = health_pb2
        #: listener_security(): {"kind", "insecure", "warning"}; refuses before binding
        self.security = listener_security(listen, opts.tls, opts.insecure_tcp)
        target = normalize_address(listen)
        path = unix_path(target)
        #: the public Unix socket in front of gRPC (bind in a 0700 dir, SO_PEERCRED check)
        self.gate = None
        if path is not None:
            self.gate = unixsock.Gate(path)
            port = self.server.add_insecure_port(self.gate.backend)
            self.address = "unix:" + self.gate.path
        elif opts.tls is not None and opts.tls.cert:
            port = self.server.add_secure_port(target, opts.tls.server_credentials())
            self.address = f"{target.rsplit(':', 1)[0]}:{port}"
        else:
            port = self.server.add_insecure_port(target)
            self.address = f"{target.rsplit(':', 1)[0]}:{port}"
        if not port and path is None:
            raise OSError(f"cannot listen on {listen}")
        self.metrics_port = None
        if metrics_port is not None:  # 0: a free port the OS picks
            self.metrics_port = self.metrics.serve(metrics_port, metrics_addr)
        #: the pod watcher (agent/kube) and its thread, once :meth:`start_watcher` ran
        self.watcher = None
        self.watcher_thread: Optional[threading.Thread] = None

    def start(self) -> "Server":
        from cuinterpose.agent.run import recover

        # case 009: a dead agent's checkpoint in the control dir is rolled back first
        o = self.opts.options["checkpoint"]
        with native_call.using(o):
            self.recovered = recover.recover_dead(o.control_dir)
        self.server.start()
        if self.gate is not None:
            self.gate.start()  # 0600 since its bind, in place now (decisions.md D2)
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
            self.watcher.close()  # waits for a running pod request
            self.watcher_thread.join(10)  # its watch read was cut: it leaves at once
        self.server.stop(grace).wait()
        self.service.close()
        for t in list(self.service.active):
            t.join()
        self.metrics.close()
        if self.gate is not None:
            self.gate.close()  # removes the public socket and the private directory
