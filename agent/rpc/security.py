"""What the agent daemon lets in: which listener it may open, and which paths a request may
name (docs/service.md "Security").

:func:`listener_security` says whether a listener is safe to open (``serve`` refuses a
non-loopback TCP listener without mutual TLS unless ``--insecure-tcp``). Path confinement:
every images dir of a ``Checkpoint``/``Restore`` request (and of a group member's
``RunPhase``) and every ``ListSnapshots`` dir is resolved against the daemon's snapshot roots
(:func:`confine_path`, ``AgentService.confine``): a relative path is taken relative to the
first root; a path that resolves (symlinks, ``..``) outside every root is refused before
anything happens. A root may be an object-store prefix ``s3://BUCKET/PREFIX`` (the daemon's
``--snapshot-dir``): a request's ``s3://`` location must then be one of those prefixes or lie
under one, part by part (``..`` and empty parts are refused by the location's parser).
"""

from __future__ import annotations

import os
from typing import Optional

from cuinterpose.agent import paths
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.rpc.client import TLS, tcp_host


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


def listener_security(addr: str, tls: Optional[TLS], insecure_tcp: bool = False) -> dict:
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
    what = (
        "TLS without client certificates (--tls-client-ca): the server is authenticated, "
        "the caller is not"
        if has_tls
        else "plaintext without TLS or authentication"
    )
    if not insecure_tcp:
        raise ValueError(
            f"refusing to listen on {addr}: a non-loopback TCP address with {what}; every RPC "
            "is a root action (a checkpoint kills the job's process tree, a restore runs CRIU "
            "images as root) and anyone who reaches the address could call it. Use mutual TLS "
            "(--tls-cert, --tls-key and --tls-client-ca), a unix: socket or a loopback "
            "address, or pass --insecure-tcp to accept the risk"
        )
    return {
        "kind": "tls" if has_tls else "plaintext",
        "insecure": True,
        "warning": f"WARNING: INSECURE: listening on {addr} with {what} (--insecure-tcp): "
        "anyone who reaches this address can checkpoint (kill) any opted-in "
        "job and restore images as root on this node",
    }


def confine_path(
    path: str, roots: list, *, what: str = "images dir", phase: str = "images dir"
) -> str:
    """``path`` resolved against the snapshot ``roots`` (absolute directories): a relative
    path is taken relative to ``roots[0]``; the result (symlinks and ``..`` resolved) must be
    one of the roots or lie under one. Returns the resolved path; raises ``AgentError``
    (outcome refused, nothing was done) naming the path and the allowed root(s)."""
    if not roots:
        raise AgentError(
            phase, f"{what} {path!r}: the agent has no snapshot directory", outcome="refused"
        )
    if not path:
        raise AgentError(phase, f"no {what} given", outcome="usage")
    if "\0" in path:
        raise AgentError(phase, f"{what} {path!r}: contains a NUL byte", outcome="refused")
    if _remote(path) or (not os.path.isabs(path) and _remote(roots[0])):
        return _confine_location(path, roots, what, phase)
    real_roots = [paths.canonical(r) for r in roots if not _remote(r)]
    joined = path if os.path.isabs(path) else os.path.join(roots[0], path)
    real = paths.canonical(joined)
    for r in real_roots:
        if real == r or real.startswith(r.rstrip("/") + "/"):
            return real
    allowed = " or ".join(real_roots) or "(none: its roots are object-store prefixes)"
    raise AgentError(
        phase,
        f"{what} {path} resolves to {real}, outside the agent's snapshot "
        f"directory {allowed}; refused, nothing was done (the agent only reads "
        "and writes under its --snapshot-dir)",
        outcome="refused",
    )


def _remote(p: str) -> bool:
    return "://" in str(p)


def _confine_location(path: str, roots: list, what: str, phase: str) -> str:
    """:func:`confine_path` of an ``s3://`` location (or a relative path under a first root
    that is one): the normalized location, refused unless it is a root or under one."""
    from cuinterpose.agent.snapshot.backends.api import StorageError, parse_location

    joined = path if _remote(path) else f"{str(roots[0]).rstrip('/')}/{path}"
    try:
        loc = parse_location(joined, root=True)
    except StorageError as e:
        raise AgentError(phase, f"{what} {path}: {e.reason}", outcome="refused") from None
    want = f"{loc.bucket}/{loc.key}".rstrip("/").split("/")
    ok = []
    for r in roots:
        if not _remote(r):
            continue
        rl = parse_location(str(r), root=True)
        ok.append(str(rl).rstrip("/"))
        have = f"{rl.bucket}/{rl.key}".rstrip("/").split("/")
        if want[: len(have)] == have:
            return str(loc).rstrip("/")
    raise AgentError(
        phase,
        f"{what} {path} lies outside the agent's snapshot prefix(es) "
        f"{' or '.join(ok) or '(none: its roots are local directories)'}; refused, nothing was "
        "done (the agent only reads and writes under its --snapshot-dir)",
        outcome="refused",
    )
