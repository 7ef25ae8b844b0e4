"""End-to-end fixtures: a rogue exporter and a job with a socket to outside its tree. CRIU
availability (``criu_ok``), the child subreaper and afdwin runs are shared fixtures of
tests/conftest.py; every test here gets a private temporary directory."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from cuinterpose.workloads.afdwin import demo

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def rogue(tmp_path, subreaper):
    """rogue(control_dir) -> (Popen, log path): tests/e2e/rogue_export.py under the shim on
    fakecuda, holding an exported FD the shim does not know about. Killed at teardown."""
    procs = []

    def _start(ctl):
        log = tmp_path / f"rogue{len(procs)}.log"
        env = demo.workload_env(ctl)
        env["ROGUE_LIFETIME_S"] = "120"
        with open(log, "wb") as out, open(str(log) + ".err", "wb") as err:
            p = subprocess.Popen(
                [sys.executable, os.path.join(HERE, "rogue_export.py")],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
            )
        procs.append(p)
        return p, log

    yield _start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture
def ext_socket(subreaper):
    """ext_socket(control_dir) -> (Popen, log path, accepted connection): tests/e2e/ext_socket.py
    under the shim on fakecuda, holding a Unix socket connected to a listener in this (test)
    process, i.e. outside its tree. Killed at teardown."""
    import shutil
    import socket
    import tempfile

    procs, socks = [], []
    d = tempfile.mkdtemp(prefix="cui-ext-")

    def _start(ctl):
        path = os.path.join(d, f"l{len(procs)}.sock")
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(path)
        lsock.listen(1)
        socks.append(lsock)
        log = pathlib.Path(d) / f"ext{len(procs)}.log"
        env = demo.workload_env(ctl)
        env["EXT_SOCKET"] = path
        with open(log, "wb") as out, open(str(log) + ".err", "wb") as err:
            p = subprocess.Popen(
                [sys.executable, os.path.join(HERE, "ext_socket.py")],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
            )
        procs.append(p)
        lsock.settimeout(60)
        conn, _ = lsock.accept()
        socks.append(conn)
        return p, log, conn

    yield _start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for s in socks:
        s.close()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    """Every test here: temporary files under pytest's tree (tests/conftest.py)."""
    return private_tmp
