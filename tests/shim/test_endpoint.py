"""The control endpoint exists only after a successful cuInit, with the documented path and
modes, and is removed when the process exits."""

from __future__ import annotations

import os
import socket
import stat

from cuinterpose.coordinator.client import ShimClient
from cuinterpose.coordinator.protocol import Op, Phase, Status


def test_socket_lifecycle(apps, shim_env, tmp_path):
    env = dict(shim_env)
    ctl_dir = tmp_path / "fresh-ctl"
    env["CUINTERPOSE_CONTROL_DIR"] = str(ctl_dir)
    a = apps(env=env)
    assert int(a.ok("pid")[0]) == a.pid
    assert not ctl_dir.exists()  # nothing before cuInit
    a.ok("init")
    sock = ctl_dir / f"cuinterpose-{a.pid}.sock"
    assert stat.S_IMODE(ctl_dir.stat().st_mode) == 0o700
    st = sock.stat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    # the shim's descriptors are close-on-exec
    fds = os.listdir(f"/proc/{a.pid}/fd")
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{a.pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            flags = int(open(f"/proc/{a.pid}/fdinfo/{fd}").read().split("flags:")[1].split()[0], 8)
            assert flags & 0o2000000, f"fd {fd} lacks O_CLOEXEC"
    # a bad magic is answered with BAD_REQUEST, the endpoint keeps serving
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(str(sock))
        c.sendall(b"\0" * 64)
        head = c.recv(128)
        assert int.from_bytes(head[16:20], "little") == Status.BAD_REQUEST
    r = ShimClient(str(sock)).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.pid, r.records) == (Status.OK, a.pid, [])
    a.close()
    assert not sock.exists()
