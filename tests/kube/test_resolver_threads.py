"""The resolver's pids go through the census's process-id check (case 002): a thread id whose
cgroup puts it in a container is refused by name, as the census refuses it. The check reads the
agent's own /proc, so the laid-out proc here holds this test's real process and one of its real
threads (``host_pids=True``)."""

from __future__ import annotations

import os
import pathlib
import threading

import pytest
from fakeapi import make_pod

from cuinterpose.agent.kube.resolver import CgroupResolver, ContainerTree, ResolveError

CID = "c3" * 32


def lay_real(proc: pathlib.Path, pid: int) -> None:
    """``pid`` (a real process or thread) in container CID, its ``stat`` the real one."""
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(f"0::/kubepods.slice/cri-containerd-{CID}.scope\n")
    (d / "stat").write_text(pathlib.Path(f"/proc/{pid}/stat").read_text())


@pytest.fixture
def thread_id():
    """The kernel tid of a live thread of this process (not its pid)."""
    started, stop = threading.Event(), threading.Event()
    tid = []

    def body():
        tid.append(threading.get_native_id())
        started.set()
        stop.wait()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    assert started.wait(600)
    yield tid[0]
    stop.set()
    t.join()


def test_a_thread_id_in_a_container_is_refused_by_name(tmp_path, thread_id):
    proc = tmp_path / "proc"
    lay_real(proc, os.getpid())
    lay_real(proc, thread_id)
    assert thread_id != os.getpid()
    name = dict(
        line.split(":\t", 1) for line in pathlib.Path("/proc/self/status").read_text().splitlines()
    )["Name"]
    pod = make_pod("p1", containers=[("main", f"containerd://{CID}")])
    with pytest.raises(ResolveError) as e:
        CgroupResolver(proc, host_pids=True).resolve(pod)
    assert str(e.value) == (
        f"pod default/p1 container main: pid {thread_id} is a thread of process "
        f"{os.getpid()} ({name}); pass a process id (the job's root)"
    )


def test_a_process_id_passes_the_check(tmp_path):
    proc = tmp_path / "proc"
    lay_real(proc, os.getpid())
    pod = make_pod("p1", containers=[("main", f"containerd://{CID}")])
    trees = CgroupResolver(proc, host_pids=True).resolve(pod)
    assert trees == [ContainerTree("main", CID, (os.getpid(),), (os.getpid(),))]


def test_the_check_applies_by_default_only_to_the_agents_own_proc(tmp_path):
    assert CgroupResolver().host_pids is True
    assert CgroupResolver("/proc").host_pids is True
    assert CgroupResolver(tmp_path).host_pids is False
