"""Shared pieces of test_pidfd.py, test_creator_release.py and test_host_mem.py: the
``sapps`` fixture (processes of ``c/share_app.c``, driven like ``conftest.App``), INSPECT and
the in-place checkpoint cycle through the coordinator (``Coordinator.capture()`` then
``restore()``: every shim op of docs/shim.md section 3 in order, with the coordinator's
validation).

``sapps`` runs every test twice: ``plain`` (the installed shim and fakecuda) and ``asan``
(shim, fakecuda and share_app built with ASan/UBSan, as in test_sanitize.py, with the same
flags so the builds are shared; the processes never exec). An ``asan`` process must exit 0
with no sanitizer report on stderr."""

from __future__ import annotations

import claim_kit
import pytest

from cuinterpose.coordinator.phases import Coordinator, Participant
from cuinterpose.coordinator.protocol import Op, Phase, Status, socket_path

from .conftest import (
    C_DIR,
    App,
    link_fakecuda,
)
from .sanitize_build import SAN, build_libs
from .test_sanitize import libasan


@pytest.fixture(scope="session")
def share_app(build_c, fakecuda_dir):
    return build_c([C_DIR / "share_app.c"], "shim_share_app", libs=link_fakecuda(fakecuda_dir))


def asan_libs(cuda_include):
    """(shim, fakecuda dir) built with ASan/UBSan exactly as test_sanitize.asan_build does."""
    return build_libs(SAN, "shim-asan", cuda_include)


@pytest.fixture(params=["plain", "asan"])
def sapps(request, share_app, shim_env, build_c, cuda_include):
    exe, env = share_app, shim_env
    if request.param == "asan":
        shim, fake_dir = asan_libs(cuda_include)
        exe = build_c(
            [C_DIR / "share_app.c"], "shim_share_app", sanitize=True, libs=link_fakecuda(fake_dir)
        )
        env = dict(shim_env)
        env["LD_LIBRARY_PATH"] = str(fake_dir)
        env["LD_PRELOAD"] = f"{libasan()} {shim}"
        env["ASAN_OPTIONS"] = "abort_on_error=0:halt_on_error=1:detect_leaks=1:exitcode=23"
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    started: list[App] = []

    def start():
        a = App(exe, env)
        started.append(a)
        return a

    yield start
    reports = []
    for a in started:
        if request.param == "asan" and a.proc.poll() is None:
            a.cmd("quit")  # exit first: LeakSanitizer reports at exit
            a.proc.wait(timeout=120)
            err = a.stderr()
            if a.proc.returncode != 0 or "runtime error" in err or "Sanitizer" in err:
                reports.append(f"pid {a.pid} exit {a.proc.returncode}:\n{err[-6000:]}")
        a.close()
    assert reports == []


def inspect(ctl, app, phase=Phase.ACTIVE):
    """INSPECT records of ``app``; asserts the reply is OK and in ``phase``."""
    resp = ctl(app).request(Op.INSPECT, txn_id=0, expected_phase=phase)
    assert resp.reply.status == Status.OK, resp.message
    assert resp.reply.phase == phase
    return resp.records


def cycle(shim_env, procs):
    """One in-place capture and restore of ``procs``; returns (capture, restore result)."""
    ctl_dir = shim_env["CUINTERPOSE_CONTROL_DIR"]
    co = Coordinator(
        [Participant(p.pid, socket_path(ctl_dir, p.pid)) for p in procs],
        timeout_s=30,
        claim=claim_kit.take(ctl_dir, [p.pid for p in procs]),
    )
    cap = co.capture()
    return cap, co.restore(cap)


def changed(result, phase):
    """{pid: records_changed} of the restore phase named ``phase``."""
    for x in result.phases:
        if x.phase == phase:
            return {p: y.records_changed for p, y in x.participants.items()}
    raise AssertionError(f"no phase {phase} in {[x.phase for x in result.phases]}")
