"""fakecuda fixtures.

- ``peer``: factory starting ``fcpeer`` (tests/fakecuda/c/fcpeer.c, linked against fakecuda's
  libcuda.so.1) as a line-driven child; ``p.cmd("write 0x... 7")`` returns the reply words
  after "ok", or raises ``CudaError`` carrying the CUresult name.
- ``asan_peer``: the same, with ``fcpeer`` compiled together with fakecuda's sources under
  ASan/UBSan (fakecuda's C runs sanitized in a multi-process test).
- ``controller``: runs tests/fakecuda/controller.py (cuda.bindings) on fakecuda; returns
  the CUresult name per requested operation.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import pytest
from fakecuda_helpers import Peer

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def fcpeer_exe(build_c, fakecuda_dir):
    return build_c(
        [HERE / "c" / "fcpeer.c"],
        "fcpeer",
        libs=(f"-L{fakecuda_dir}", "-l:libcuda.so.1", "-ldl", "-lpthread"),
    )


@pytest.fixture
def peer(fcpeer_exe, fake_env):
    peers = []

    def start(sock_fd=None, env=None):
        p = Peer(fcpeer_exe, env or fake_env, sock_fd)
        peers.append(p)
        return p

    yield start
    for p in peers:
        p.close()


FAKECUDA_SRC = sorted((HERE.parent.parent / "fakecuda" / "src").glob("*.c"))


@pytest.fixture(scope="session")
def fcpeer_asan_exe(build_c):
    """-rdynamic: dlsym and dladdr find the cu* names in the executable."""
    return build_c(
        [*FAKECUDA_SRC, HERE / "c" / "fcpeer.c"],
        "fcpeer-static",
        sanitize=True,
        extra=("-rdynamic",),
    )


@pytest.fixture
def asan_peer(fcpeer_asan_exe, fake_env):
    env = dict(
        fake_env,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    env.pop("LD_LIBRARY_PATH")  # fakecuda is compiled in
    peers = []

    def start(sock_fd=None):
        p = Peer(fcpeer_asan_exe, env, sock_fd)
        peers.append(p)
        return p

    yield start
    for p in peers:
        p.close()


@pytest.fixture(params=["libcuda", "asan"])
def any_peer(request):
    """``peer`` or ``asan_peer``: a test taking it runs both ways."""
    return request.getfixturevalue("peer" if request.param == "libcuda" else "asan_peer")


@pytest.fixture
def peer_pair(peer):
    """Two initialised peers joined by a Unix socketpair for SCM_RIGHTS."""
    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a = peer(sa.fileno())
    b = peer(sb.fileno())
    sa.close()
    sb.close()
    a.cmd("init 0")
    b.cmd("init 0")
    return a, b


@pytest.fixture
def controller(fake_env):
    """controller(["lock:PID:TIMEOUT", "checkpoint:PID", ...]) -> list of CUresult names (and
    for state: "CUDA_SUCCESS/<state int>")."""

    def run(ops):
        res = subprocess.run(
            [sys.executable, str(HERE / "controller.py"), *ops],
            env=fake_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    return run
