"""procfs: the /proc parsers of the agent, on this process and on texts laid out here."""

from __future__ import annotations

import os
import sys

import pytest

from cuinterpose.agent.mech import procfs


def test_stat_fields_of_this_process_and_a_comm_with_parentheses():
    comm, fields = procfs.stat_fields(os.getpid())
    assert comm and fields[procfs.STAT_STATE] in "RS"
    assert int(fields[procfs.STAT_PPID]) == os.getppid()
    assert procfs.starttime(os.getpid()) == int(fields[procfs.STAT_STARTTIME])
    comm, fields = procfs.parse_stat("42 (a) b (c)) S 7 42 42 0 -1 4194560 " + "0 " * 12 + "99")
    assert comm == "a) b (c)" and fields[procfs.STAT_STATE] == "S"
    assert fields[procfs.STAT_PPID] == "7" and fields[procfs.STAT_STARTTIME] == "99"
    with pytest.raises(ValueError):
        procfs.parse_stat("no parentheses")


def test_starttime_is_none_for_a_gone_process(tmp_path):
    assert procfs.starttime(1 << 30) is None
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "stat").write_text("5 (z) Z 1 " + "0 " * 16 + "123\n")
    assert procfs.starttime(5, str(tmp_path)) is None  # a zombie


def test_fd_flags_targets_and_maps_of_this_process(tmp_path):
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        flags = procfs.fd_flags(os.getpid(), fd)
        assert flags & os.O_ACCMODE == os.O_WRONLY and flags & os.O_APPEND
        assert (fd, str(path)) in list(procfs.fd_targets(os.getpid()))
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="has no flags line"):
        procfs.fdinfo_flags({"pos": "0"}, "/proc/1/fdinfo/0")
    exe = os.stat(os.path.realpath(sys.executable))
    assert (os.path.realpath(sys.executable), exe.st_dev, exe.st_ino) in set(procfs.maps("self"))


def test_status_nspid_environ_and_ns_inode_of_this_process(monkeypatch):
    st = procfs.status(os.getpid())
    assert int(st["Tgid"]) == os.getpid() and int(st["PPid"]) == os.getppid()
    assert procfs.nspid(os.getpid())[-1] == os.getpid()
    assert procfs.environ_value(os.getpid(), "PATH") is not None
    assert procfs.environ_value(os.getpid(), "CUINTERPOSE_NO_SUCH_VARIABLE") is None
    assert procfs.ns_inode("self", "mnt") == os.stat("/proc/self/ns/mnt").st_ino
    assert os.getpid() in procfs.pids()


def test_cgroup_and_mountinfo_texts():
    text = "12:cpu,cpuacct:/a/b\n1:name=systemd:/\n0::/x y\n"
    assert procfs.parse_cgroup(text) == [
        (12, ("cpu", "cpuacct"), "/a/b"),
        (1, ("name=systemd",), "/"),
        (0, (), "/x y"),
    ]
    assert procfs.cgroup_paths(text + "odd line\n") == ["/a/b", "/", "/x y", "odd line"]
    assert procfs.cgroup("self") == procfs.parse_cgroup(open("/proc/self/cgroup").read())
    mi = (
        "30 25 0:26 / /sys/fs/cgroup/my\\040dir rw - cgroup2 cgroup2 rw,nsdelegate\n"
        "31 25 0:27 /kube /host/pids rw - cgroup cgroup rw,pids\n"
        "32 25 0:28 / /proc rw - proc proc rw\n"
    )
    assert procfs.cgroup_mounts(mi) == [
        ("cgroup2", "/sys/fs/cgroup/my dir", "/", frozenset({"rw", "nsdelegate"})),
        ("cgroup", "/host/pids", "/kube", frozenset({"rw", "pids"})),
    ]
    assert procfs.mount_ids(os.getpid())
