"""The daemon's Unix socket: bound where no other uid can reach it, and its peers checked
(docs/service.md "Security").

gRPC binds its own socket and never shows the server a connection's peer, so the daemon does
not let gRPC listen on the public path. :class:`Gate` does:

- a private directory (``mkdtemp``: mode 0700, an unpredictable name, beside the public path)
  holds gRPC's backend socket and, while it is bound and ``chmod``-ed 0600, the public one;
  the public socket is then ``rename``-d to its path, so no other uid can connect between
  bind and chmod (whatever the umask), and a symlink or stale socket at the path is replaced,
  never followed; a socket a live process listens on (another daemon) is refused naming its
  pid (:func:`live_listener`);
- every accepted connection's ``SO_PEERCRED`` uid must be root or the daemon's own uid: such a
  connection is relayed to the backend; any other gets its calls answered
  ``PERMISSION_DENIED`` naming its uid and pid and who may call (by a small gRPC server of its
  own in the private directory), and the daemon logs the refusal.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import socket
import struct
import tempfile
import threading

log = logging.getLogger("cuinterpose.agent")

#: the sun_path limit of a Unix socket address (bytes, without the NUL)
SUN_PATH_MAX = 107
#: distinct refused uids given a message naming them (more get one without the uid)
MAX_REFUSERS = 8


def peer_cred(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix stream socket."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def allowed_uids() -> tuple[int, ...]:
    """Who may call the daemon: root and the daemon's own effective uid."""
    return tuple(dict.fromkeys((0, os.geteuid())))


def refusal(path: str, uid, pid) -> str:
    """The ``PERMISSION_DENIED`` details a refused caller reads."""
    who = f"uid {uid} (pid {pid})" if uid is not None else "this caller's uid"
    ok = " or ".join("root" if u == 0 else f"uid {u}" for u in allowed_uids())
    return (
        f"agent daemon at unix:{path}: {who} may not call it (SO_PEERCRED): only {ok} may; "
        f"refused, nothing was done. Run the command as {ok}"
    )


class _Refuse:
    """A generic gRPC handler answering every method with PERMISSION_DENIED."""

    def __init__(self, message: str):
        self.message = message

    def service(self, handler_call_details):
        import grpc

        def deny(request_iterator, context):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, self.message)

        return grpc.stream_stream_rpc_method_handler(deny)


class Gate:
    """The public socket at ``path`` in front of a gRPC server listening on :attr:`backend`
    (``unix:`` target to pass to ``add_insecure_port``). :meth:`start` puts the public socket
    in place and starts accepting; :meth:`close` stops, removes the public socket (if it is
    still ours) and the private directory."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        parent = os.path.dirname(self.path)
        os.makedirs(parent, exist_ok=True)
        if os.path.lexists(self.path) and not (os.path.islink(self.path) or _is_socket(self.path)):
            raise OSError(17, "exists and is neither a socket nor a symlink", self.path)
        other = live_listener(self.path)
        if other is not None:
            raise RuntimeError(
                f"{self.path} is already served by pid {other} (it answered a connection); "
                "stop that daemon first, or --listen elsewhere; a stale socket (nobody "
                "listening) is replaced"
            )
        base = parent if len(parent) + 24 <= SUN_PATH_MAX else tempfile.gettempdir()
        self.private = tempfile.mkdtemp(prefix=".cui-agent-", dir=base)  # 0700
        self.backend_path = os.path.join(self.private, "g.sock")
        self.backend = "unix:" + self.backend_path
        staged = os.path.join(self.private, "p.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.bind(staged)
        os.chmod(staged, 0o600)  # only root and our uid may connect(), whoever set the umask
        self.listener.listen(128)
        self._staged = staged
        self._ino = os.stat(staged).st_ino
        self._refusers: dict = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = None

    def start(self) -> None:
        os.rename(self._staged, self.path)  # replaces a stale socket or a symlink, never follows
        self._thread = threading.Thread(target=self._accept, name="cui-gate", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            pid, uid, _ = peer_cred(conn)
            if uid in allowed_uids():
                target = self.backend_path
            else:
                log.warning(
                    "refused a call from uid %d (pid %d): not root or uid %d",
                    uid,
                    pid,
                    os.geteuid(),
                )
                target = self._refuser(uid, pid)
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            up.connect(target)
        except OSError:
            conn.close()
            return
        _relay(conn, up)

    def _refuser(self, uid: int, pid: int) -> str:
        """The socket of the gRPC server refusing ``uid`` (one per uid, at most
        :data:`MAX_REFUSERS`; later uids share one whose message does not name them)."""
        from concurrent import futures

        import grpc

        key = uid if len(self._refusers) < MAX_REFUSERS or uid in self._refusers else None
        with self._lock:
            if key not in self._refusers:
                p = os.path.join(self.private, f"r{len(self._refusers)}.sock")
                srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
                msg = refusal(self.path, key, pid if key is not None else None)
                srv.add_generic_rpc_handlers((_Refuse(msg),))
                srv.add_insecure_port("unix:" + p)
                srv.start()
                self._refusers[key] = (srv, p)
            return self._refusers[key][1]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self.listener.close()
        if self._thread is not None:
            self._thread.join(5)
        for srv, _ in self._refusers.values():
            srv.stop(0)
        try:
            if os.lstat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass
        shutil.rmtree(self.private, ignore_errors=True)


def live_listener(path: str, timeout_s: float = 5.0):
    """The pid of the process listening on the Unix socket ``path`` (``SO_PEERCRED`` of a
    connection to it: the process that bound it), "?" when a connection is not accepted within
    ``timeout_s`` seconds (its backlog is full: alive), or None when nothing listens there (no
    socket, or a stale one: ``ECONNREFUSED``)."""
    if not _is_socket(path):
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout_s)
        s.connect(path)
        return peer_cred(s)[0]
    except socket.timeout:
        return "?"
    except OSError:
        return None
    finally:
        s.close()


def _is_socket(p: str) -> bool:
    import stat

    try:
        return stat.S_ISSOCK(os.lstat(p).st_mode)
    except OSError:
        return False


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes; then close both."""
    try:
        poller = select.poll()  # not select(): a daemon may hold more than 1024 fds
        for s in (a, b):
            poller.register(s, select.POLLIN)
        by_fd = {a.fileno(): a, b.fileno(): b}
        while True:
            for fd, _ in poller.poll():
                s = by_fd[fd]
                data = s.recv(65536)
                if not data:
                    return
                (b if s is a else a).sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.close()
            except OSError:
                pass
