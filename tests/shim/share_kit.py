"""The kit of the issue-24 shim tests (test_share_events.py, test_share_refusals.py,
test_peer_access.py): ``fcshare`` (tests/fakecuda/c/fcshare.c, a line-driven driver-API client
with events, peer access, pools and cuMemHostRegister) under the shim, plain and built with
ASan/UBSan (shim, fakecuda and fcshare, the builds of test_sanitize.py); a controller process
without the shim for fakecuda's native checkpoint; and the in-place capture and restore through
the coordinator with the native checkpoint of every participant between them (what the agent
does, without CRIU)."""

from __future__ import annotations

import pathlib
import subprocess
import tempfile

import claim_kit
import pytest

from cuinterpose.coordinator.phases import Coordinator, Participant
from cuinterpose.coordinator.protocol import socket_path

from .conftest import link_fakecuda
from .share_helpers import asan_libs
from .test_sanitize import libasan

FCSHARE = pathlib.Path(__file__).resolve().parents[1] / "fakecuda" / "c" / "fcshare.c"

# cuda.h
EV_NO_TIMING, EV_IPC = 2, 4
IPC_EVENT_FLAGS = (
    EV_IPC | EV_NO_TIMING | 1
)  # PyTorch's: Interprocess | DisableTiming | BlockingSync


class CudaError(Exception):
    def __init__(self, name: str, line: str):
        super().__init__(f"{line!r} -> {name}")
        self.name = name


class Proc:
    """One fcshare process: ``cmd`` returns the words after "ok" or raises CudaError."""

    def __init__(self, exe, env, sock_fd=None):
        self.errfile = tempfile.TemporaryFile()
        args, fds = [str(exe)], ()
        if sock_fd is not None:
            args.append(str(sock_fd))
            fds = (sock_fd,)
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errfile,
            env=env,
            text=True,
            pass_fds=fds,
        )
        self.pid = self.proc.pid

    def cmd(self, line: str) -> list[str]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        assert out, (
            f"fcshare {self.pid} exited on {line!r} (rc={self.proc.poll()}): {self.stderr()[-2000:]}"
        )
        words = out.split()
        if words[0] == "err":
            raise CudaError(words[1], line)
        return words[1:]

    def err(self, line: str) -> str:
        try:
            words = self.cmd(line)
        except CudaError as e:
            return e.name
        raise AssertionError(f"{line!r} unexpectedly succeeded: {words}")

    def hex(self, line: str) -> int:
        return int(self.cmd(line)[0], 16)

    def stderr(self) -> str:
        self.errfile.seek(0)
        return self.errfile.read().decode(errors="replace")

    def close(self) -> int:
        if self.proc.poll() is None:
            try:
                self.cmd("quit")
            except (AssertionError, BrokenPipeError, CudaError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def fcshare_shim_exe(build_c, fakecuda_dir):
    return build_c([FCSHARE], "shim_fcshare", libs=link_fakecuda(fakecuda_dir))


@pytest.fixture(params=["plain", "asan"])
def share_procs(request, fcshare_shim_exe, shim_env, fake_env, build_c, cuda_include):
    """start(sock_fd=None, shim=True) -> Proc; both builds. A process started with shim=False
    runs on the same fakecuda without the preload (a creator outside the shim, the controller).
    An asan process must exit 0 with no sanitizer report."""
    exe, env, plain_env = fcshare_shim_exe, shim_env, fake_env
    if request.param == "asan":
        shim, fake_dir = asan_libs(cuda_include)
        exe = build_c([FCSHARE], "shim_fcshare", sanitize=True, libs=link_fakecuda(fake_dir))
        env = dict(shim_env, LD_LIBRARY_PATH=str(fake_dir), LD_PRELOAD=f"{libasan()} {shim}")
        env["ASAN_OPTIONS"] = "abort_on_error=0:halt_on_error=1:detect_leaks=0:exitcode=23"
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
        plain_env = dict(env, LD_PRELOAD=libasan())
    started: list[Proc] = []

    def start(sock_fd=None, shim=True):
        p = Proc(exe, env if shim else plain_env, sock_fd)
        started.append(p)
        return p

    yield start
    reports = []
    for p in started:
        rc = p.close()
        err = p.stderr()
        if rc != 0 or "runtime error" in err or "Sanitizer" in err:
            reports.append(f"pid {p.pid} exit {rc}:\n{err[-4000:]}")
    assert reports == []


def native_cycle(ctl_proc: Proc, procs) -> None:
    """fakecuda's native checkpoint of each process: lock, checkpoint, restore, unlock."""
    for p in procs:
        ctl_proc.cmd(f"lock {p.pid}")
    for p in procs:
        for op in ("checkpoint", "restore"):
            ctl_proc.cmd(f"{op} {p.pid}")
    for p in procs:
        ctl_proc.cmd(f"unlock {p.pid}")


def checkpoint_cycle(shim_env, procs, ctl_proc: Proc):
    """Capture (INSPECT .. PREPARE_UNICAST), native checkpoint and restore of every process,
    restore (LOAD_ALLOCATIONS, RESTORE_UNICAST, INSPECT equal); returns (capture, result)."""
    ctl_dir = shim_env["CUINTERPOSE_CONTROL_DIR"]
    co = Coordinator(
        [Participant(p.pid, socket_path(ctl_dir, p.pid)) for p in procs],
        timeout_s=60,
        claim=claim_kit.take(ctl_dir, [p.pid for p in procs]),
    )
    cap = co.capture()
    native_cycle(ctl_proc, procs)
    return cap, co.restore(cap)
