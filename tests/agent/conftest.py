"""Fixtures for agent unit tests: synthetic process trees made of real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from agent_world import world  # noqa: F401 (the fixture, defined with its fakes)

# A process that optionally maps a file (as a loaded shim would be) and binds a control socket,
# starts its children (same program), prints {"pid", "children"} and sleeps until killed.
CHILD = r"""
import json, mmap, os, socket, subprocess, sys, time
spec = json.loads(sys.argv[1])
keep = []
if spec.get("map"):
    f = open(spec["map"], "rb")
    keep.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
if spec.get("sock"):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(os.path.join(spec["sock"], "cuinterpose-%d.sock" % os.getpid()))
    s.listen(1)
    keep.append(s)
kids = [subprocess.Popen([sys.executable, __file__, json.dumps(c)], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, **c.get("env", {})))
        for c in spec.get("children", [])]
infos = [json.loads(k.stdout.readline()) for k in kids]
print(json.dumps({"pid": os.getpid(), "name": spec.get("name"), "children": infos}), flush=True)
time.sleep(600)
"""


@pytest.fixture
def spawn_tree(tmp_path):
    """spawn_tree(spec) -> {name: pid}. ``spec`` = {"name", "map": file to mmap, "sock": control
    dir to bind cuinterpose-<pid>.sock in, "env": extra environment, "children": [spec, ...]}.
    Killed at teardown."""
    prog = tmp_path / "child.py"
    prog.write_text(CHILD)
    procs = []

    def _spawn(spec):
        p = subprocess.Popen(
            [sys.executable, str(prog), json.dumps(spec)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=dict(os.environ, **spec.get("env", {})),
        )
        procs.append(p)
        info = json.loads(p.stdout.readline())
        names = {}

        def walk(i):
            names[i["name"]] = i["pid"]
            for c in i["children"]:
                walk(c)

        walk(info)
        return names

    yield _spawn
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    """Every test here: temporary files under pytest's tree (tests/conftest.py)."""
    return private_tmp


@pytest.fixture
def shim(tmp_path):
    """A stand-in shim file: any bytes, named libcuinterpose.so."""
    d = tmp_path / "lib"
    d.mkdir()
    p = d / "libcuinterpose.so"
    p.write_bytes(b"\x7fELF-not-really" * 512)
    return p
