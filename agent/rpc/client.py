"""The client side of the agent's gRPC service: addresses, TLS, channels and the calls.

Addresses: ``unix:/path`` (or ``unix:///path``) for a Unix socket, ``HOST:PORT`` for TCP
(TLS when a certificate and key are given; mutual TLS with a client CA). :func:`call` runs one
streaming RPC of ``cuinterpose.v1.Agent`` (proto/cuinterpose/v1/agent.proto), :func:`renew`
the unary ``Renew`` of a group member's lease, :func:`health` the gRPC health check. The CLI's
``--agent``, a group leader talking to its members (:mod:`cuinterpose.agent.rpc.group`) and
the tests use these; the daemon side is :mod:`cuinterpose.agent.rpc.service`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Callable, Optional

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.snapshot import pb

DEFAULT_ADDRESS_ENV = "CUINTERPOSE_AGENT_ADDR"
SERVICE_NAME = "cuinterpose.v1.Agent"

#: the deadline of one streaming call (Checkpoint, Restore, RunPhase, ...) when the caller
#: gives none, in seconds: ``$CUINTERPOSE_RPC_TIMEOUT_S``, default 7200 (the daemon enforces
#: each step's own deadlines; this one bounds a daemon that stopped answering altogether)
RPC_TIMEOUT_ENV = "CUINTERPOSE_RPC_TIMEOUT_S"
RPC_TIMEOUT_S = 7200.0
#: HTTP/2 keepalive pings on every channel, so a dead daemon or a cut connection ends a call
#: with UNAVAILABLE within ``keepalive_time_ms + keepalive_timeout_ms`` instead of waiting out
#: the whole deadline (gRPC core channel arguments, grpc/grpc doc/keepalive.md)
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]
#: the daemon's side: accept those pings during a long call (by default a gRPC server
#: answers pings more frequent than every 5 min without data with GOAWAY too_many_pings)
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def rpc_timeout_s() -> float:
    """``$CUINTERPOSE_RPC_TIMEOUT_S`` (a finite number of seconds above 0) or
    :data:`RPC_TIMEOUT_S`. Raises ``AgentError`` (phase "agent", refused) naming the variable."""
    raw = os.environ.get(RPC_TIMEOUT_ENV, "")
    if not raw:
        return RPC_TIMEOUT_S
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not (0 < v < float("inf")):
        raise AgentError(
            "agent",
            f"{RPC_TIMEOUT_ENV}={raw!r}: must be a finite number of seconds above 0",
            outcome="refused",
        )
    return v


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
        return addr[len("unix://") :]
    if addr.startswith("unix:"):
        return addr[len("unix:") :]
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
        return grpc.ssl_server_credentials(
            [(self._read(self.key), self._read(self.cert))],
            root_certificates=self._read(self.ca),
            require_client_auth=bool(self.ca),
        )

    def channel_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca),
            private_key=self._read(self.key),
            certificate_chain=self._read(self.cert),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)


def socket_access(addr: str) -> str:
    """Why this process may not connect to the agent's Unix socket at ``addr`` (its owner and
    mode keep other uids out), or "" when it may, or it is no Unix socket or absent."""
    path = unix_path(normalize_address(addr))
    if path is None or os.access(path, os.W_OK) or not os.path.exists(path):
        return ""
    st = os.stat(path)
    return (
        f"; the socket {path} (owner uid {st.st_uid}, mode {st.st_mode & 0o777:04o}) admits "
        f"only root and uid {st.st_uid}, and this process is uid {os.geteuid()}: run the "
        "command as one of them"
    )


def rpc_error(addr: str, method: str, e) -> AgentError:
    """The ``AgentError`` (phase "agent") of a failed call: outcome "refused" when the daemon
    refused the caller (``PERMISSION_DENIED``: nothing was done), else "unreachable"."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    refused = code is not None and code.name == "PERMISSION_DENIED"
    return AgentError(
        "agent",
        f"{addr}: {method}: {code.name if code else ''} {details}".strip()
        + ("" if refused else socket_access(addr)),
        outcome="refused" if refused else "unreachable",
    )


def channel(addr: str, tls: Optional[TLS] = None):
    """A gRPC channel to an agent (TLS for TCP when ``tls`` is enabled)."""
    import grpc

    target = normalize_address(addr)
    opts = [("grpc.max_receive_message_length", 64 << 20), *KEEPALIVE_OPTIONS]
    if tls is not None and tls.enabled and unix_path(target) is None:
        return grpc.secure_channel(target, tls.channel_credentials(), options=opts)
    return grpc.insecure_channel(target, options=opts)


def call(
    addr: str,
    method: str,
    request,
    *,
    tls: Optional[TLS] = None,
    on_progress: Optional[Callable[[dict], None]] = None,
    timeout_s: Optional[float] = None,
    on_call: Optional[Callable[[object], None]] = None,
):
    """Call streaming RPC ``method`` of the agent at ``addr``; ``on_progress(row_dict)`` for
    each Progress. Returns the final ``Result`` message. Raises ``AgentError`` (phase "agent",
    outcome "unreachable") when the agent cannot be reached or the stream ends without a
    result; the workload state is then unknown only if the request had started.
    ``timeout_s``: the call's deadline in seconds, default :func:`rpc_timeout_s` (past it:
    DEADLINE_EXCEEDED, outcome "unreachable"). ``on_call(call)``: the ``grpc.Call`` once it
    started (whose ``cancel()`` ends it with CANCELLED here and cancels it at the daemon)."""
    import grpc

    if timeout_s is None:
        timeout_s = rpc_timeout_s()
    _, agrpc, _ = pb.modules()
    ch = channel(addr, tls)
    try:
        stub = agrpc.AgentStub(ch)
        result = None
        try:
            rpc = getattr(stub, method)(request, timeout=timeout_s)
            if on_call is not None:
                on_call(rpc)
            for ev in rpc:
                which = ev.WhichOneof("kind")
                if which == "progress" and on_progress is not None:
                    on_progress(pb.message_to_dict(ev.progress))
                elif which == "result":
                    result = ev.result
        except grpc.RpcError as e:
            raise rpc_error(addr, method, e) from None
        if result is None:
            raise AgentError(
                "agent",
                f"{addr}: {method}: the stream ended without a result",
                outcome="unreachable",
            )
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
        raise rpc_error(addr, "Renew", e) from None
    finally:
        ch.close()


def health(
    addr: str, service: str = "", *, tls: Optional[TLS] = None, timeout_s: float = 5.0
) -> str:
    """The health status name of ``service`` at ``addr`` (``SERVING``, ``NOT_SERVING``,
    ``SERVICE_UNKNOWN``). Raises ``grpc.RpcError`` when unreachable."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ch = channel(addr, tls)
    try:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    finally:
        ch.close()
