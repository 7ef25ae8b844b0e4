"""Case 011 (shared/cases/011-same-uid-peers), the daemon's side. Kind: a peer the daemon
cannot vouch for reaches its Unix socket. The daemon's socket is bound inside a private 0700
directory and chmod-ed 0600 there before it is renamed to its path (no window between bind and
chmod, whatever the umask; a symlink planted at the path is replaced, never followed), and
every connection's SO_PEERCRED uid must be root or the daemon's own: another uid's calls are
answered PERMISSION_DENIED naming its uid and pid. The other uid is a forked child that
``os.setuid(65534)``-s and only connects (no gRPC after fork): it hands the connected socket
to this process over SCM_RIGHTS, which then speaks gRPC through it, so the daemon sees the
child's credentials. Needs root (setuid)."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
import threading

import pytest

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.options import for_kinds
from cuinterpose.agent.rpc import client, service, unixsock
from cuinterpose.agent.snapshot import pb

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to setuid a child")


@pytest.fixture
def shared_dir():
    """A directory uid 65534 can reach (pytest's tmp_path is 0700 root)."""
    d = tempfile.mkdtemp(prefix="cui-011-")
    os.chmod(d, 0o755)
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(shared_dir, tmp_path):
    (tmp_path / "s").mkdir()
    old = os.umask(0)  # the case: umask 000 must not open a window
    try:
        srv = service.Server(
            "unix:" + os.path.join(shared_dir, "agent.sock"),
            service.ServeOptions(
                node="n011",
                options=for_kinds({"driver": "fake"}),
                snapshot_dir=str(tmp_path / "s"),
            ),
        )
    finally:
        os.umask(old)
    yield srv
    srv.stop(0)


def as_nobody(path: str):
    """Fork a child that becomes uid 65534 and connects to ``path``. Returns (child pid, the
    connected socket it handed over, or None, errno of its connect or 0, what
    ``client.socket_access`` said to it)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the child: syscalls only
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            why = client.socket_access("unix:" + path).encode()
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                socket.send_fds(child, [b"0 " + why], [s.fileno()])
            except OSError as e:
                child.sendall(f"{e.errno} ".encode() + why)
            code = 0
        finally:
            os._exit(code)
    child.close()
    msg, fds, _, _ = socket.recv_fds(parent, 4096, 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    err, _, why = msg.decode().partition(" ")
    sock = socket.socket(fileno=fds[0]) if fds else None
    return pid, sock, int(err), why


def via(sock: socket.socket) -> str:
    """A unix address of this process that relays one connection to ``sock``."""
    d = tempfile.mkdtemp(prefix="cui-011r-")
    p = os.path.join(d, "r.sock")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(p)
    lst.listen(1)

    def run():
        conn, _ = lst.accept()
        unixsock._relay(conn, sock)

    threading.Thread(target=run, daemon=True).start()
    return "unix:" + p


def list_snapshots(addr: str):
    apb, _, _ = pb.modules()
    return client.call(addr, "ListSnapshots", apb.ListSnapshotsRequest(dir=""), timeout_s=30)


def test_socket_is_0600_from_its_bind_and_renamed_into_place(daemon, shared_dir):
    path = os.path.join(shared_dir, "agent.sock")
    g = daemon.gate
    assert not os.path.lexists(path)  # not reachable before start()
    assert stat.S_IMODE(os.stat(g.private).st_mode) == 0o700
    assert os.path.dirname(g.private) == shared_dir
    assert stat.S_IMODE(os.stat(g._staged).st_mode) == 0o600
    ino = os.stat(g._staged).st_ino
    victim = os.path.join(shared_dir, "victim")
    with open(victim, "wb") as f:
        f.write(b"untouched")
    os.symlink(victim, path)  # planted at the daemon's path
    daemon.start()
    st = os.lstat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_ino == ino
    assert open(victim, "rb").read() == b"untouched"
    assert list_snapshots(daemon.address).ok is True  # root (our uid) is served
    daemon.stop(0)
    assert not os.path.lexists(path) and not os.path.exists(g.private)


def test_another_uid_cannot_connect_and_is_told_why(daemon, shared_dir):
    daemon.start()
    path = os.path.join(shared_dir, "agent.sock")
    _, sock, err, why = as_nobody(path)
    assert (sock, err) == (None, 13)  # EACCES: the 0600 socket keeps uid 65534 out
    assert why == (
        f"; the socket {path} (owner uid 0, mode 0600) admits only root and uid 0, and this "
        f"process is uid {NOBODY}: run the command as one of them"
    )


def test_another_uid_that_reaches_the_socket_is_refused_by_peer_credentials(daemon, shared_dir):
    daemon.start()
    path = os.path.join(shared_dir, "agent.sock")
    os.chmod(path, 0o666)  # an operator widened it: SO_PEERCRED still keeps uid 65534 out
    pid, sock, err, _ = as_nobody(path)
    assert err == 0 and sock is not None
    addr = via(sock)
    with pytest.raises(AgentError) as e:
        list_snapshots(addr)
    assert e.value.outcome == "refused"
    assert e.value.reason == (
        f"{addr}: ListSnapshots: PERMISSION_DENIED agent daemon at unix:{path}: uid {NOBODY} "
        f"(pid {pid}) may not call it (SO_PEERCRED): only root may; refused, nothing was "
        "done. Run the command as root"
    )
    assert list_snapshots(daemon.address).ok is True  # root still is served
