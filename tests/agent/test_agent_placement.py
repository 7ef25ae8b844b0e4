"""Restore into a placement (agent/placement.py, ``restore --into-pid``).

- unit: /proc/PID/cgroup and mountinfo parsing, ``Placement.of_pid`` on a laid-out proc
  root, the manifest fields ``external_pipes`` / ``namespaces`` (schema, older manifests),
  ``native.in_netns`` reaching an abstract socket in another network namespace;
- end to end, with real CRIU and afdwin on fakecuda under the agent CLI: a job running in its
  own network/uts/ipc namespaces with stdout a pipe is checkpointed and restored into a
  placeholder in another network namespace and a fresh test cgroup (the agent still reaches
  fakecuda's abstract native socket; lost=0 duplicated=0 torn=0); bad placements (the process
  gone, a cgroup that refuses the write) are refused before CRIU runs, the snapshot byte for
  byte unchanged and nothing running.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import uuid

import pytest

from cuinterpose.agent import demo, manifest, native, pb
from cuinterpose.agent.census import CensusError, pid_alive, walk_tree
from cuinterpose.agent.placement import (Cgroup, Placement, PlacementError, cgroup_mounts,
                                         parse_cgroup)

from placement_kit import cgroups_of

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "criu"))
from criu_helpers import kill_tree, wait_until  # noqa: E402

STEPS = 400
MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
39 31 0:36 /kubepods /host/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


# --------------------------------------------------------------------------- unit

def test_parse_cgroup_and_mounts():
    assert parse_cgroup("12:cpu,cpuacct:/a/b\n1:name=systemd:/\n0::/x y\n") == [
        (12, ("cpu", "cpuacct"), "/a/b"), (1, ("name=systemd",), "/"), (0, (), "/x y")]
    mounts = cgroup_mounts(MOUNTINFO)
    assert [(t, p, r) for t, p, r, _ in mounts] == [
        ("cgroup", "/sys/fs/cgroup/cpu,cpuacct", "/"), ("cgroup", "/host/pids", "/kubepods"),
        ("cgroup", "/sys/fs/cgroup/systemd", "/"), ("cgroup2", "/sys/fs/cgroup/unified", "/")]
    from cuinterpose.agent.placement import _mount_of
    assert _mount_of(3, ("cpu", "cpuacct"), "/k/p", mounts) == ("/sys/fs/cgroup/cpu,cpuacct", "/")
    assert _mount_of(1, ("name=systemd",), "/s", mounts) == ("/sys/fs/cgroup/systemd", "/")
    assert _mount_of(0, (), "/pod/c", mounts) == ("/sys/fs/cgroup/unified", "/")
    assert _mount_of(8, ("pids",), "/kubepods/pod1/c", mounts) == ("/host/pids", "/kubepods")
    assert _mount_of(8, ("pids",), "/other", mounts) == (None, "/")   # outside the mount's root
    assert _mount_of(9, ("rdma",), "/x", mounts) == (None, "/")
    cg = Cgroup(8, ("pids",), "/kubepods/pod1/c", "/host/pids", "/kubepods")
    assert cg.procs_file == "/host/pids/pod1/c/cgroup.procs"
    assert Cgroup(0, (), "/", "/sys/fs/cgroup/unified").directory == "/sys/fs/cgroup/unified"
    assert (cg.name, Cgroup(0, (), "/", None).name, cg.line()) == \
        ("pids", "cgroup2", "8:pids:/kubepods/pod1/c")


def _fake_proc(tmp_path, pid=4242, cgroup="9:rdma:/pod/c\n0::/\n"):
    base = tmp_path / "proc" / str(pid)
    (base / "ns").mkdir(parents=True)
    (base / "fd").mkdir()
    (base / "fdinfo").mkdir()
    (base / "stat").write_text(f"{pid} (pause (x)) S 1 {pid} {pid} 0 -1 4194560 0 0 0 0 0 0 0 0 "
                               "20 0 1 0 987654 1000 10 18446744073709551615\n")
    (base / "cgroup").write_text(cgroup)
    for k in ("net", "uts", "ipc", "mnt"):
        (base / "ns" / k).write_text(k)
    os.symlink("pipe:[555]", base / "fd" / "1")
    os.symlink("/dev/null", base / "fd" / "0")
    (base / "fdinfo" / "1").write_text("pos:\t0\nflags:\t01000001\nmnt_id:\t15\n")
    (base / "fdinfo" / "0").write_text("pos:\t0\nflags:\t0100000\nmnt_id:\t15\n")
    return str(tmp_path / "proc")


def test_of_pid_reads_a_laid_out_proc(tmp_path):
    root = _fake_proc(tmp_path)
    pl = Placement.of_pid(4242, proc_root=root)
    assert pl.start_time == 987654 and pl.pid == 4242
    assert [(n.kind, n.path) for n in pl.namespaces] == [
        (k, f"{root}/4242/ns/{k}") for k in ("net", "ipc", "uts")]
    assert [(s.fd, s.target, s.mode) for s in pl.stdio] == [(0, "/dev/null", "r"),
                                                            (1, "pipe:[555]", "w")]
    assert [(c.hierarchy, c.controllers, c.path) for c in pl.cgroups] == [
        (9, ("rdma",), "/pod/c"), (0, (), "/")]
    assert pl.stdio_for(1, "write").fd == 1
    assert pl.stdio_for(5, "write").fd == 1 and pl.stdio_for(0, "read").fd == 0
    no_stdin = Placement(pl.pid, pl.start_time, pl.cgroups, pl.namespaces, pl.stdio[1:])
    with pytest.raises(PlacementError, match="no stdio fd open for reading"):
        no_stdin.stdio_for(0, "read")
    # a v1 hierarchy this process has not mounted cannot be joined: named, refused
    if not any("rdma" in o for *_, o in cgroup_mounts(open("/proc/self/mountinfo").read())):
        with pytest.raises(PlacementError) as ei:
            pl.cgroups_to_join()
        assert ei.value.pid == 4242
        assert "its cgroup '9:rdma:/pod/c' cannot be joined: that hierarchy is not mounted " \
               "here" in ei.value.reason
    # namespaces CRIU cannot join are refused with the reason
    for k, why in (("mnt", "--join-ns does not take a mount namespace"),
                   ("pid", "refuses pid namespaces"), ("user", "uid and gid")):
        with pytest.raises(PlacementError, match=why):
            Placement.of_pid(4242, proc_root=root, namespaces=("net", k))
    # missing files name the pid and the file
    os.remove(f"{root}/4242/ns/uts")
    with pytest.raises(PlacementError) as ei:
        Placement.of_pid(4242, proc_root=root)
    assert ei.value.pid == 4242 and f"{root}/4242/ns/uts" in ei.value.reason
    with pytest.raises(PlacementError) as ei:
        Placement.of_pid(999999, proc_root=root)
    assert str(ei.value) == (f"placement: pid 999999 no such process (reading {root}/999999/"
                             "stat): the placement process is gone")


def test_manifest_placement_fields_are_optional_and_checked(tmp_path):
    from test_agent_manifest import sample
    m = sample(tmp_path)
    assert manifest._shape_problem(m) is None                     # an older manifest
    assert manifest.external_pipes(m, 100) == [] and manifest.tree_namespaces(m, 100) == {}
    m["external_pipes"] = [{"root": 100, "pid": 101, "fd": 1, "inode": 9, "direction": "write"},
                           {"root": 7, "pid": 7, "fd": 2, "inode": 9, "direction": "read"}]
    m["namespaces"] = [{"root": 100, "net": 1, "uts": 2, "ipc": 3,
                        "external_net": "cuinterpose-net"}]
    assert manifest._shape_problem(m) is None
    assert [p["pid"] for p in manifest.external_pipes(m, 100)] == [101]
    assert manifest.tree_namespaces(m, 100)["external_net"] == "cuinterpose-net"
    back = pb.manifest_from_proto(pb.manifest_to_proto(m))
    assert (back["external_pipes"], back["namespaces"]) == (m["external_pipes"], m["namespaces"])
    bad = dict(m, external_pipes=[{**m["external_pipes"][0], "direction": "both"}])
    assert "external_pipes" in manifest._shape_problem(bad)
    bad = dict(m, namespaces=[{"root": 100, "net": "x", "uts": 2, "ipc": 3}])
    assert "namespaces" in manifest._shape_problem(bad)
    apb, _, _ = pb.modules()
    assert apb.RestoreRequest(into_pid=77).into_pid == 77


def test_in_netns_reaches_an_abstract_socket_in_another_network_namespace(placeholder):
    holder = placeholder("cui-holder", stdout=False).pid
    name = f"cuinterpose-test-{uuid.uuid4().hex[:8]}"
    server = subprocess.Popen(
        ["nsenter", f"--net=/proc/{holder}/ns/net", sys.executable, "-c",
         "import socket,sys; s=socket.socket(socket.AF_UNIX);"
         " s.bind(b'\\0' + sys.argv[1].encode()); s.listen(1); print('up', flush=True);"
         " c,_=s.accept(); c.send(b'hello'); c.close()", name],
        stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "up\n"

        def connect():
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(b"\0" + name.encode())
                return s.recv(16), os.stat("/proc/thread-self/ns/net").st_ino
        with pytest.raises(ConnectionRefusedError):      # not in ours
            connect()
        got, ino = native.in_netns(holder, connect)
        assert got == b"hello" and ino == os.stat(f"/proc/{holder}/ns/net").st_ino
        assert os.stat("/proc/thread-self/ns/net").st_ino != ino     # we never moved
        assert native.in_netns(os.getpid(), lambda: 5) == 5
        with pytest.raises(ZeroDivisionError):
            native.in_netns(holder, lambda: 1 / 0)
    finally:
        server.kill()
        server.wait()


# --------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def criu_ok():
    from cuinterpose.agent import criu
    ok, out = criu.check()
    if not ok:
        pytest.skip(f"CRIU is not usable on this machine (`make criu`): {out.strip()}")


class Job:
    """afdwin on fakecuda under the shim, started by the test (optionally inside the net/uts/ipc
    namespaces of ``ns_pid``), its stdout a pipe to ``cat >> afdwin.log`` outside its tree."""

    def __init__(self, run_dir: pathlib.Path, ns_pid=None, **kw):
        self.a = demo.Afdwin(run_dir, steps=STEPS, step_delay_ms=5, **kw)
        a = self.a
        a.run_dir.mkdir(parents=True, exist_ok=True)
        a.ctl.mkdir(exist_ok=True)
        self.readers = []
        w = self.reader()
        env = demo.workload_env(a.ctl)
        pre = [f"{k}={env.pop(k)}" for k in ("LD_PRELOAD", "LD_LIBRARY_PATH")]
        cmd = ["env", *pre, sys.executable, "-m", "cuinterpose.workloads.afdwin", *a.args]
        if ns_pid:
            cmd = ["nsenter", *(f"--{k}=/proc/{ns_pid}/ns/{k}" for k in ("net", "uts", "ipc")),
                   "--", *cmd]
        with open(a.err, "ab") as err:
            a.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=w, stderr=err,
                                      cwd=a.run_dir, env=env, start_new_session=True)
        os.close(w)

    def reader(self) -> int:
        """A new ``cat >> afdwin.log``; returns the write end of its stdin pipe."""
        r, w = os.pipe()
        with open(self.a.log, "ab") as out:
            self.readers.append(subprocess.Popen(["cat"], stdin=r, stdout=out))
        os.close(r)
        return w

    def stop(self):
        if pid_alive(self.a.pid):
            try:
                kill_tree([p for p, _, _ in walk_tree([self.a.pid])])
            except CensusError:                   # gone meanwhile
                pass
        self.a.kill()
        for r in self.readers:
            try:
                r.wait(timeout=10)
            except subprocess.TimeoutExpired:
                r.kill()
                r.wait()


@pytest.fixture
def job(tmp_path, criu_ok, subreaper):
    jobs = []

    def start(**kw):
        j = Job(tmp_path / f"run{len(jobs)}", **kw)
        jobs.append(j)
        return j
    yield start
    for j in jobs:
        j.stop()


@pytest.fixture(autouse=True)
def _private_tmp(tmp_path_factory, monkeypatch):
    import tempfile
    d = tmp_path_factory.mktemp("tmp")
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    monkeypatch.setenv("TMPDIR", str(d))


def _checkpoint(j, snap):
    a = j.a
    a.wait_for(lambda ev: demo.received(ev) >= 30, 120, "30 messages")
    rc, cp = demo.run_agent("checkpoint", "--pid", str(a.pid), "--images-dir", str(snap),
                            "--driver", "fake", "--control-dir", str(a.ctl))
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -signal.SIGKILL
    for r in j.readers:
        r.wait(timeout=30)            # EOF: every writer of the job's stdout pipe is dead
    return json.loads((snap / "manifest.json").read_text())


def _digest(d: pathlib.Path) -> dict:
    return {str(p.relative_to(d)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                    p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file()}


def _ns(pid):
    return {k: os.stat(f"/proc/{pid}/ns/{k}").st_ino for k in ("net", "uts", "ipc")}


def test_job_in_its_own_netns_checkpointed_and_restored_into_a_placeholder(
        cgroup_dir, placeholder, job, tmp_path):
    src = placeholder("cui-src", stdout=False).pid
    j = job(ns_pid=src)
    # (before nsenter's setns the forked child still looks like python: wait for the ns)
    wait_until(lambda: _ns(j.a.pid) == _ns(src), "afdwin to start in the namespaces (nsenter)")
    snap = tmp_path / "snap"
    m = _checkpoint(j, snap)                 # native lock/checkpoint reached \0fakecuda-<pid>
    evs = j.a.events()
    rank_pids = sorted(w["pid"] for w in evs if demo.kind(w) == "window")
    assert m["namespaces"] == [{"root": j.a.pid, **_ns_at_dump(m),
                                "external_net": "cuinterpose-net"}]
    assert m["namespaces"][0]["net"] == os.stat(f"/proc/{src}/ns/net").st_ino
    assert not list((snap / "criu" / str(j.a.pid)).glob("utsns-*.img"))     # CRIU was in its uts
    # the launcher's stdout (the ranks write to its stderr, a file)
    assert [(p["pid"], p["fd"], p["direction"]) for p in m["external_pipes"]] == [
        (j.a.pid, 1, "write")]

    cg = cgroup_dir()
    # the placeholder's stdout: a new pipe to a new reader appending to the same log
    ph = placeholder("cui-dst", cgroup=cg, out=j.a.log).pid
    assert _ns(ph)["net"] != _ns(src)["net"]
    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake",
                            "--into-pid", str(ph))
    assert rc == 0 and rs["ok"], rs
    assert [(p["name"], p["status"]) for p in rs["phases"]][:4] == [
        ("manifest", "ok"), ("driver", "ok"), ("placement", "ok"), ("stale sockets", "ok")]
    assert rs["placement"]["pid"] == ph and rs["placement"]["namespaces"] == {
        k: v for k, v in _ns(ph).items()}
    assert [(p["pid"], p["fd"], p["placement_fd"]) for p in rs["placement"]["stdio"]] == [
        (j.a.pid, 1, 1)]
    placed = [p for p in [j.a.pid, *rank_pids] if pid_alive(p)]
    assert j.a.pid in placed, "the restored job ended before it could be inspected"
    for p in placed:
        assert _ns(p) == _ns(ph), p
        assert cgroups_of(p) == cgroups_of(ph), p
    assert f"/{os.path.basename(cg)}\n" in cgroups_of(ph)
    assert j.a.wait_restored_exit(300) in (0, None)
    j.a.wait_for(lambda ev: any(demo.kind(e) == "summary" for e in ev), 60,
                 "the summary through the placeholder's stdout")
    evs = j.a.events()
    assert demo.check_run(evs, STEPS) == []
    s = [e for e in evs if demo.kind(e) == "summary"][-1]
    assert (s["lost"], s["duplicated"], s["torn"], s["restores_seen"]) == (0, 0, 0, 1)


def _ns_at_dump(m):
    n = m["namespaces"][0]
    return {k: n[k] for k in ("net", "uts", "ipc")}


def _chrt_agent(*args):
    """The agent CLI under SCHED_FIFO 1 (so are its children: a cgroup whose cpu.rt_runtime_us
    is 0 refuses them)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    res = subprocess.run(["chrt", "-f", "1", sys.executable, "-m", "cuinterpose.agent.cli",
                          *args, "--json"], stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, env=env, timeout=300)
    try:
        return res.returncode, json.loads(res.stdout)
    except ValueError:
        return res.returncode, {"raw": res.stdout + res.stderr}


def test_bad_placements_are_refused_before_criu_and_leave_the_snapshot(
        cgroup_dir, placeholder, job, tmp_path):
    j = job()
    snap = tmp_path / "snap"
    m = _checkpoint(j, snap)
    assert m["namespaces"][0]["external_net"] == ""
    pids = [p["pid"] for p in m["processes"]]
    before = _digest(snap)

    def refused(rc, out, pid, *reason):
        assert rc == 3 and not out["ok"], out
        err = out["error"]
        assert (err["phase"], err["pid"], err["outcome"]) == ("placement", pid, "refused"), err
        for r in reason:
            assert r in err["reason"], err
        assert [(p["name"], p["status"]) for p in out["phases"]] == [
            ("manifest", "ok"), ("driver", "ok"), ("placement", "failed")]
        assert _digest(snap) == before
        assert not [p for p in pids if pid_alive(p)], "something was restored"

    # the placement process is gone
    gone = placeholder("cui-gone", stdout=False)
    gone.stop()
    gone = gone.pid
    assert not pid_alive(gone)
    rc, out = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake",
                             "--into-pid", str(gone))
    refused(rc, out, gone, "the placement process is gone")

    # its cgroup refuses the CRIU child: a real-time task into a cpu cgroup without RT time
    if not os.path.exists("/sys/fs/cgroup/cpu/cpu.rt_runtime_us"):
        pytest.skip("no cgroup v1 cpu hierarchy with RT group scheduling: no refused cgroup "
                    "write to provoke")
    cpu = cgroup_dir(hierarchy="cpu")
    assert pathlib.Path(cpu, "cpu.rt_runtime_us").read_text().strip() == "0"
    ph = placeholder("cui-rt", cgroup=cpu, stdout=False).pid
    rc, out = _chrt_agent("restore", "--images-dir", str(snap), "--driver", "fake",
                          "--into-pid", str(ph))
    refused(rc, out, ph, f"cannot join cgroup {cpu}: write of pid",
            f"to {cpu}/cgroup.procs refused: Invalid argument")
    assert pathlib.Path(cpu, "cgroup.procs").read_text().split() == [str(ph)]

    # the snapshot is intact: restored into a good placeholder (stdout a new pipe to the
    # log; a dump in the agent's namespaces joined into another) the job finishes
    good = placeholder("cui-good", out=j.a.log).pid
    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake",
                            "--into-pid", str(good))
    assert rc == 0 and rs["ok"], rs
    assert j.a.wait_restored_exit(300) in (0, None)
    j.a.wait_for(lambda ev: any(demo.kind(e) == "summary" for e in ev), 60, "the summary")
    assert demo.check_run(j.a.events(), STEPS) == []
