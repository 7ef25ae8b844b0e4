"""Case 018 (shared/cases/018-tests-assume-free-pid): three manifest tests named pid 100,
a live thread (``tokio-rt-worker``) on the machine that ran them, and failed there.

Kind: tests that depend on what else runs on the machine. A test that needs a pid, a port or
a path no one uses takes one it showed free (tests/free_kit.py: ``free_pids``, ``free_port``;
paths under its own temporary directory). Checked here: the helper's pids have no ``/proc``
entry (a thread's id counts as taken), lie in [300, pid_max) and avoid what is asked; the
manifest tests' sample names only such pids.
"""

from __future__ import annotations

import os
import pathlib
import socket
import sys
import threading

import free_kit

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "agent"))

import test_agent_manifest  # noqa: E402


def test_free_pids_have_no_proc_entry_and_lie_below_pid_max():
    pid_max = int(pathlib.Path("/proc/sys/kernel/pid_max").read_text())
    got = free_kit.free_pids(3)
    assert len(set(got)) == 3
    for p in got:
        assert free_kit.RESERVED_PIDS <= p < pid_max and not os.path.exists(f"/proc/{p}")
    again = free_kit.free_pids(1, avoid=got)
    assert again[0] not in got and not os.path.exists(f"/proc/{again[0]}")


def test_a_thread_id_counts_as_taken():
    ready, done = threading.Event(), threading.Event()
    tid = []

    def run():
        tid.append(threading.get_native_id())
        ready.set()
        done.wait(60)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert ready.wait(60)
        assert tid[0] != os.getpid() and free_kit.pid_in_use(tid[0])
        assert tid[0] not in free_kit.free_pids(50)
    finally:
        done.set()
        t.join()


def test_a_free_port_can_be_bound():
    port = free_kit.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_manifest_sample_names_only_free_pids(tmp_path):
    m = test_agent_manifest.sample(tmp_path)
    pids = [*m["roots"], *m["cuda_pids"], *(p["pid"] for p in m["participants"])]
    assert pids and not [p for p in pids if os.path.exists(f"/proc/{p}")]
