"""Case 004 (shared/cases/004-socket-path-reclaim), kind: the shim removes whatever is at its
control path at cuInit.

At cuInit the path is reclaimed only when it is a socket that refuses connections
(ECONNREFUSED: a stale socket of an earlier process with this pid). A live socket (another pid
namespace's process with the same pid) or any other file is left alone; the process then runs
without an endpoint (CUDA keeps working) and stderr says why and what to do.
"""

from __future__ import annotations

import pathlib
import socket
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from shim.conftest import apps, ctl, shim_env, vmm_app  # noqa: E402, F401 (fixtures)

from cuinterpose.coordinator.protocol import Op, Phase, Status  # noqa: E402

GRAN = 2 << 20
NO_ENDPOINT = "; no control endpoint: CUDA keeps working, but this process cannot be inspected or checkpointed"


def _path(env, pid):
    return pathlib.Path(env["CUINTERPOSE_CONTROL_DIR"]) / f"cuinterpose-{pid}.sock"


def test_regular_file_is_left_alone(apps, shim_env):  # noqa: F811
    a = apps()
    p = _path(shim_env, a.pid)
    p.write_bytes(b"not a socket")
    p.chmod(0o644)
    a.ok("init")
    assert p.read_bytes() == b"not a socket"
    err = a.stderr()
    want = (
        f"cuinterpose[{a.pid}]: cuInit: pid {a.pid} (phase ACTIVE): {p} exists and is not a socket "
        f"(mode 0100644, uid {p.stat().st_uid}); left alone{NO_ENDPOINT}. Remove it if it is not "
        "needed, or set CUINTERPOSE_CONTROL_DIR to a directory of this job"
    )
    assert want in err, err
    a.ok(f"create {GRAN} 0")  # CUDA keeps working


def test_live_socket_of_another_process_is_left_alone(apps, shim_env):  # noqa: F811
    a = apps()
    p = _path(shim_env, a.pid)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(p))
    other.listen(8)
    try:
        ino = p.stat().st_ino
        a.ok("init")
        assert p.stat().st_ino == ino  # still the other listener's socket
        err = a.stderr()
        want = (
            f"{p} is a live socket of another process (a process with pid {a.pid} in another pid "
            f"namespace sharing control directory {shim_env['CUINTERPOSE_CONTROL_DIR']}?); left "
            f"alone{NO_ENDPOINT}. Give each container its own CUINTERPOSE_CONTROL_DIR"
        )
        assert want in err, err
        a.ok(f"create {GRAN} 0")
    finally:
        other.close()


def test_stale_socket_is_reclaimed(apps, shim_env, ctl):  # noqa: F811
    a = apps()
    p = _path(shim_env, a.pid)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(p))
    stale.close()  # nobody listens: connect answers ECONNREFUSED
    a.ok("init")
    r = ctl(a).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.pid) == (Status.OK, a.pid)
    assert "no control endpoint" not in a.stderr()
