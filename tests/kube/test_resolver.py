"""Containers -> process trees through /proc/PID/cgroup, on a laid-out proc directory."""

from __future__ import annotations

import pytest
from fakeapi import make_pod

from cuinterpose.agent.kube.resolver import CgroupResolver, ContainerTree, ResolveError

CID_A = "a1" * 32
CID_B = "b2" * 32
V2 = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-{}.scope\n"
V1 = "12:memory:/kubepods/burstable/pod1234/{}\n11:cpu,cpuacct:/kubepods/burstable/pod1234/{}\n"


def lay(proc, pid, ppid, cgroup, comm="app", start=None, nspid=None):
    """``start``: stat field 22 (start time, ticks since boot); ``nspid``: the NSpid line's pids
    (a status file is written only when given)."""
    d = proc / str(pid)
    d.mkdir()
    (d / "cgroup").write_text(cgroup)
    # comm with a space and a parenthesis, as /proc allows; fields 4..22 (19 of them)
    rest = [
        ppid,
        pid,
        pid,
        0,
        -1,
        4194560,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        20,
        0,
        1,
        0,
        start if start is not None else 100 + pid,
    ]
    (d / "stat").write_text(f"{pid} ({comm} (x)) S {' '.join(map(str, rest))} 0 0\n")
    if nspid is not None:
        (d / "status").write_text(f"Name:\t{comm}\nNSpid:\t{' '.join(map(str, nspid))}\n")


@pytest.fixture
def proc(tmp_path):
    p = tmp_path / "proc"
    p.mkdir()
    (p / "self").mkdir()  # non-numeric entries are ignored
    lay(p, 1, 0, "0::/init.scope\n", "systemd")
    lay(p, 900, 1, "0::/system.slice/containerd.service\n", "containerd-shim")
    # container A (cgroup v2): init 1000 -> ranks 1001, 1002; an exec'd shell 1100
    lay(p, 1000, 900, V2.format(CID_A), "launcher")
    lay(p, 1001, 1000, V2.format(CID_A), "rank0")
    lay(p, 1002, 1000, V2.format(CID_A), "rank1")
    lay(p, 1100, 900, V2.format(CID_A), "sh")
    # container B (cgroup v1 layout)
    lay(p, 2000, 900, V1.format(CID_B, CID_B), "sidecar")
    return p


def pod(*containers, **kw):
    return make_pod("p1", containers=[(n, f"containerd://{c}") for n, c in containers], **kw)


def test_roots_are_processes_whose_parent_is_outside(proc):
    trees = CgroupResolver(proc).resolve(pod(("main", CID_A), ("side", CID_B)))
    assert trees == [
        ContainerTree("main", CID_A, (1000, 1001, 1002, 1100), (1000, 1100)),
        ContainerTree("side", CID_B, (2000,), (2000,)),
    ]


def test_container_without_processes_is_left_out(proc):
    trees = CgroupResolver(proc).resolve(pod(("main", CID_A), ("gone", "c3" * 32)))
    assert [t.name for t in trees] == ["main"]


def test_not_running_containers_are_ignored(proc):
    p = pod(("main", CID_A))
    p["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    with pytest.raises(ResolveError) as e:
        CgroupResolver(proc).resolve(p)
    assert str(e.value) == "pod default/p1 has no running container with a containerID"


def test_no_process_found_names_containers(proc):
    with pytest.raises(ResolveError) as e:
        CgroupResolver(proc).resolve(pod(("main", "d4" * 32)))
    assert str(e.value) == (
        f"no process of pod default/p1 found in the cgroups of its "
        f"containers main (d4d4d4d4d4d4) under {proc}"
    )


def test_short_container_id_is_refused(proc):
    with pytest.raises(ResolveError) as e:
        CgroupResolver(proc).pids_of("abc")
    assert str(e.value) == "container id 'abc' is too short to match cgroups"


def test_placeholder_is_the_first_containers_oldest_root(tmp_path):
    p = tmp_path / "proc"
    p.mkdir()
    lay(p, 900, 1, "0::/system.slice/containerd.service\n", "containerd-shim")
    # an exec'd shell with a lower pid but started later than the container's init
    lay(p, 3005, 900, V2.format(CID_A), "pause", start=5000, nspid=[3005])
    lay(p, 2990, 900, V2.format(CID_A), "sh", start=9000, nspid=[2990])
    lay(p, 3006, 3005, V2.format(CID_A), "child", start=5001)
    lay(p, 4000, 900, V2.format(CID_B), "second", start=1)
    tree, pid, started = CgroupResolver(p).placeholder(pod(("main", CID_A), ("side", CID_B)))
    assert (tree.name, tree.roots, pid, started) == ("main", (2990, 3005), 3005, 5000)


def test_placeholder_container_is_the_first_in_spec_order_not_status_order(tmp_path):
    p = tmp_path / "proc"
    p.mkdir()
    lay(p, 900, 1, "0::/system.slice/containerd.service\n", "containerd-shim")
    lay(p, 3000, 900, V2.format(CID_A), "envoy", start=10)
    lay(p, 4000, 900, V2.format(CID_B), "app", start=20)
    # the kubelet sorts containerStatuses by name: "envoy" before "main"
    pd = pod(("envoy", CID_A), ("main", CID_B))
    pd["spec"]["containers"].reverse()  # spec: main first, then the envoy sidecar
    tree, pid, started = CgroupResolver(p).placeholder(pd)
    assert (tree.name, pid, started) == ("main", 4000, 20)


def test_a_process_in_its_own_pid_namespace_is_refused(tmp_path):
    p = tmp_path / "proc"
    p.mkdir()
    lay(p, 900, 1, "0::/system.slice/containerd.service\n", "containerd-shim")
    lay(p, 5000, 900, V2.format(CID_A), "app", nspid=[5000, 1])
    with pytest.raises(ResolveError) as e:
        CgroupResolver(p).resolve(pod(("main", CID_A)))
    assert str(e.value) == (
        "pod default/p1 container main: pid 5000 runs in its own PID "
        "namespace (NSpid 5000 1); the pod needs spec.hostPID: true"
    )
