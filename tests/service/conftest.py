"""Fixtures for the agent daemon: ``daemon(name)`` starts ``cuinterpose-agent serve`` in a
subprocess on a Unix socket (or TCP loopback) and returns its ready line; killed at teardown.
``pki(nodes=..., strangers=...)`` writes test certificates (tests/service/pki.py, made with
the ``cryptography`` package) into a fresh directory; ``fake_job`` is the fake group job of
tests/service/fakejob.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest


def _short_dir() -> str:
    # Unix socket paths must stay under 108 bytes; pytest's tmp_path can be long
    return tempfile.mkdtemp(prefix="cui-agent-")


@pytest.fixture
def daemon(tmp_path_factory):
    """daemon(node, *extra_args, listen=None) -> dict from ``serve --json``'s ready line
    ({"listen", "metrics_port", "node", "pid", "insecure", "snapshot_dirs"}) plus "proc" and
    "stderr" (path). Without ``--snapshot-dir`` or ``--config`` among the args the daemon's
    snapshot root is pytest's base temporary directory (every test's ``tmp_path`` lies under
    it: the daemon confines request paths to its roots)."""
    procs = []
    dirs = []

    def _start(node, *extra, listen="", env=None):
        """``listen=None``: no --listen (the config file's address); ``env``: variables
        added to the daemon's environment."""
        d = _short_dir()
        dirs.append(d)
        if listen == "":
            listen = f"unix:{d}/agent.sock"
        lopt = ["--listen", listen] if listen is not None else []
        if "--snapshot-dir" not in extra and "--config" not in extra:
            extra = (*extra, "--snapshot-dir", str(tmp_path_factory.getbasetemp()))
        env = {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, **(env or {})}
        err = open(os.path.join(d, "stderr"), "wb")
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cuinterpose.agent.cli",
                "serve",
                *lopt,
                "--node",
                node,
                "--json",
                *extra,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            text=True,
        )
        procs.append(p)
        line = p.stdout.readline()
        if not line:
            p.wait(timeout=30)
            raise AssertionError(
                f"serve exited {p.returncode}: " + open(os.path.join(d, "stderr")).read()
            )
        info = json.loads(line)
        info["proc"] = p
        info["stderr"] = os.path.join(d, "stderr")
        return info

    yield _start
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    import shutil

    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _load_helper(name):
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        f"_cui_test_{name}", os.path.join(here, f"{name}.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: tests/service/pki.py and fakejob.py (loaded by path: tests/group uses them through this
#: conftest too)
pki_mod = _load_helper("pki")
fakejob_mod = _load_helper("fakejob")


@pytest.fixture
def fake_job():
    """The class :class:`fakejob.FakeJob` (a member's Checkpoint/Restore stand-in)."""
    return fakejob_mod.FakeJob


@pytest.fixture
def pki(tmp_path_factory):
    """pki(nodes=("server", "client"), strangers=("stranger",)) -> {file name: path}: a CA
    with one certificate per node, and another CA with one per stranger
    (:func:`pki.make_pki`), in a fresh directory."""

    def _make(nodes=("server", "client"), strangers=("stranger",)):
        return pki_mod.make_pki(tmp_path_factory.mktemp("pki"), nodes, strangers)

    return _make


@pytest.fixture
def server(monkeypatch, tmp_path_factory):
    """An in-process ``service.Server`` on a Unix socket in a short private dir, node "n1",
    driver fake, snapshot root pytest's base temporary directory (every test's ``tmp_path``
    lies under it: request paths are confined to the root); stopped at teardown."""
    import shutil

    from cuinterpose.agent.options import for_kinds
    from cuinterpose.agent.rpc import service

    monkeypatch.setenv("CUINTERPOSE_DRIVER", "fake")
    d = tempfile.mkdtemp(prefix="cui-srv-")
    snaps = str(tmp_path_factory.getbasetemp())
    srv = service.Server(
        f"unix:{d}/a.sock",
        service.ServeOptions(node="n1", options=for_kinds({"driver": "fake"}), snapshot_dir=snaps),
        metrics_port=None,
    ).start()
    yield srv
    srv.stop(0)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sleeper():
    """A ``sleep 600`` in its own session (a process that is no cuinterpose job); killed at
    teardown."""
    p = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, start_new_session=True)
    yield p
    p.kill()
    p.wait()
