"""Restore into a placement (agent/placement.py, ``restore --into-pid``).

- unit: /proc/PID/cgroup and mountinfo parsing, ``Placement.of_pid`` on a laid-out proc
  root, the manifest fields ``external_pipes`` / ``namespaces`` (schema, older manifests),
  ``native.in_netns`` reaching an abstract socket in another network namespace;
- end to end, with real CRIU and afdwin on fakecuda under the agent CLI: a job running in its
  own network/uts/ipc namespaces with stdout a pipe is checkpointed and restored into a
  placeholder in another network namespace and a fresh test cgroup (the agent still reaches
  fakecuda's abstract native socket; lost=0 duplicated=0 torn=0); bad placements (the process
  gone, a cgroup that refuses the write) are refused before CRIU runs, the snapshot byte for
  byte unchanged and nothing running; a placeholder that dies after the placement phase is
  named as the cause of the failed CRIU restore; a job in a mount namespace of its own with
  stdin /dev/null and stderr a log file from outside it is checkpointed (external files) and
  restored into a placeholder in a test cgroup whose mount namespace lacks the agent's Python;
- the restore's notes (no placement: external pipes, files reopened in the agent's mount
  namespace) are in its result;
- a placeholder whose stdout is a socket is refused in the placement phase; a checkpoint of a
  job whose cwd is outside its mount namespace is refused by the census, the job untouched; a
  "bad size" of an external file names the file and what was handed.
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
from placement_kit import cgroups_of, comm_of, hidden_python_dirs, mount_id_of

from cuinterpose.agent.mech import native
from cuinterpose.agent.mech.census import CensusError, pid_alive, walk_tree
from cuinterpose.agent.mech.placement import Cgroup, Placement, PlacementError
from cuinterpose.agent.mech.procfs import cgroup_mounts, parse_cgroup
from cuinterpose.agent.snapshot import manifest, pb
from cuinterpose.workloads.afdwin import demo

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "criu"))
from criu_helpers import kill_tree, wait_until  # noqa: E402

STEPS = 400
#: the job holds at this step until its checkpoint's quiesce (or a release) lets it pass, so a
#: checkpoint always finds it running however loaded the machine is (case 014)
HOLD = 30
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
        (12, ("cpu", "cpuacct"), "/a/b"),
        (1, ("name=systemd",), "/"),
        (0, (), "/x y"),
    ]
    mounts = cgroup_mounts(MOUNTINFO)
    assert [(t, p, r) for t, p, r, _ in mounts] == [
        ("cgroup", "/sys/fs/cgroup/cpu,cpuacct", "/"),
        ("cgroup", "/host/pids", "/kubepods"),
        ("cgroup", "/sys/fs/cgroup/systemd", "/"),
        ("cgroup2", "/sys/fs/cgroup/unified", "/"),
    ]
    from cuinterpose.agent.mech.placement import _mount_of

    assert _mount_of(3, ("cpu", "cpuacct"), "/k/p", mounts) == ("/sys/fs/cgroup/cpu,cpuacct", "/")
    assert _mount_of(1, ("name=systemd",), "/s", mounts) == ("/sys/fs/cgroup/systemd", "/")
    assert _mount_of(0, (), "/pod/c", mounts) == ("/sys/fs/cgroup/unified", "/")
    assert _mount_of(8, ("pids",), "/kubepods/pod1/c", mounts) == ("/host/pids", "/kubepods")
    assert _mount_of(8, ("pids",), "/other", mounts) == (None, "/")  # outside the mount's root
    assert _mount_of(9, ("rdma",), "/x", mounts) == (None, "/")
    cg = Cgroup(8, ("pids",), "/kubepods/pod1/c", "/host/pids", "/kubepods")
    assert cg.procs_file == "/host/pids/pod1/c/cgroup.procs"
    assert Cgroup(0, (), "/", "/sys/fs/cgroup/unified").directory == "/sys/fs/cgroup/unified"
    assert (cg.name, Cgroup(0, (), "/", None).name, cg.line()) == (
        "pids",
        "cgroup2",
        "8:pids:/kubepods/pod1/c",
    )


def _fake_proc(tmp_path, pid=4242, cgroup="9:rdma:/pod/c\n0::/\n"):
    base = tmp_path / "proc" / str(pid)
    (base / "ns").mkdir(parents=True)
    (base / "fd").mkdir()
    (base / "fdinfo").mkdir()
    (base / "stat").write_text(
        f"{pid} (pause (x)) S 1 {pid} {pid} 0 -1 4194560 0 0 0 0 0 0 0 0 "
        "20 0 1 0 987654 1000 10 18446744073709551615\n"
    )
    (base / "cgroup").write_text(cgroup)
    for k in ("net", "uts", "ipc", "mnt"):
        (base / "ns" / k).write_text(k)
    os.symlink("/proc/self/ns/user", base / "ns" / "user")  # the agent's user namespace
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
        (k, f"{root}/4242/ns/{k}") for k in ("net", "ipc", "uts")
    ]
    assert [(s.fd, s.target, s.mode) for s in pl.stdio] == [
        (0, "/dev/null", "r"),
        (1, "pipe:[555]", "w"),
    ]
    assert [(c.hierarchy, c.controllers, c.path) for c in pl.cgroups] == [
        (9, ("rdma",), "/pod/c"),
        (0, (), "/"),
    ]
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
        assert (
            "its cgroup '9:rdma:/pod/c' cannot be joined: that hierarchy is not mounted "
            "here" in ei.value.reason
        )
    # namespaces CRIU cannot join are refused with the reason
    for k, why in (
        ("mnt", "--join-ns does not take a mount namespace"),
        ("pid", "refuses pid namespaces"),
        ("user", "uid and gid"),
    ):
        with pytest.raises(PlacementError, match=why):
            Placement.of_pid(4242, proc_root=root, namespaces=("net", k))
    # a kernel thread (PF_KTHREAD in field 9), pid 1 and another user namespace are refused
    stat_file = tmp_path / "proc" / "4242" / "stat"
    good_stat = stat_file.read_text()
    stat_file.write_text(good_stat.replace(" 4194560 ", f" {4194560 | 0x200000} "))
    with pytest.raises(PlacementError) as ei:
        Placement.of_pid(4242, proc_root=root)
    assert (ei.value.pid, ei.value.reason) == (
        4242,
        "is a kernel thread (PF_KTHREAD): it has "
        "no cgroups, namespaces or stdio of a container "
        "to restore into",
    )
    stat_file.write_text(good_stat)
    with pytest.raises(PlacementError, match="is the init of the agent's pid namespace"):
        Placement.of_pid(1, proc_root=root)
    os.remove(f"{root}/4242/ns/user")
    (tmp_path / "proc" / "4242" / "ns" / "user").write_text("user")  # another inode
    with pytest.raises(
        PlacementError,
        match=r"is in another user namespace \[\d+\] than "
        r"the agent's \[\d+\]",
    ):
        Placement.of_pid(4242, proc_root=root)
    os.remove(f"{root}/4242/ns/user")
    os.symlink("/proc/self/ns/user", f"{root}/4242/ns/user")
    assert Placement.of_pid(4242, proc_root=root).user.inode == os.stat("/proc/self/ns/user").st_ino
    # missing files name the pid and the file
    os.remove(f"{root}/4242/ns/uts")
    with pytest.raises(PlacementError) as ei:
        Placement.of_pid(4242, proc_root=root)
    assert ei.value.pid == 4242 and f"{root}/4242/ns/uts" in ei.value.reason
    with pytest.raises(PlacementError) as ei:
        Placement.of_pid(999999, proc_root=root)
    assert str(ei.value) == (
        f"placement: pid 999999 no such process (reading {root}/999999/"
        "stat): the placement process is gone"
    )


def test_manifest_placement_fields_are_optional_and_checked(tmp_path):
    from test_agent_manifest import sample

    m = sample(tmp_path)
    assert manifest._shape_problem(m) is None  # an older manifest
    assert manifest.external_pipes(m, 100) == [] and manifest.tree_namespaces(m, 100) == {}
    m["external_pipes"] = [
        {"root": 100, "pid": 101, "fd": 1, "inode": 9, "direction": "write"},
        {"root": 7, "pid": 7, "fd": 2, "inode": 9, "direction": "read"},
    ]
    m["namespaces"] = [
        {"root": 100, "net": 1, "uts": 2, "ipc": 3, "external_net": "cuinterpose-net"}
    ]
    assert manifest._shape_problem(m) is None  # without mnt/foreign_mnt
    back = pb.manifest_from_proto(pb.manifest_to_proto(m))
    assert back["namespaces"] == m["namespaces"]  # absent stays absent
    m["namespaces"][0].update(mnt=4026532177, foreign_mnt=True)
    m["external_files"] = [
        {
            "root": 100,
            "pid": 101,
            "fd": 0,
            "path": "/dev/null",
            "mnt_id": 24,
            "inode": 3,
            "flags": 0o100002,
            "access": "rw",
            "st_mode": 0o20666,
            "rdev": 259,
        }
    ]
    assert manifest._shape_problem(m) is None
    assert [p["pid"] for p in manifest.external_pipes(m, 100)] == [101]
    assert manifest.tree_namespaces(m, 100)["external_net"] == "cuinterpose-net"
    assert manifest.external_files(m, 100) == m["external_files"]
    assert manifest.external_files(m, 7) == []
    back = pb.manifest_from_proto(pb.manifest_to_proto(m))
    assert (back["external_pipes"], back["namespaces"], back["external_files"]) == (
        m["external_pipes"],
        m["namespaces"],
        m["external_files"],
    )
    for bad_f in ({"access": "x"}, {"mnt_id": -1}, {"path": 5}, {"st_mode": True}):
        bad = dict(m, external_files=[{**m["external_files"][0], **bad_f}])
        assert "external_files" in manifest._shape_problem(bad), bad_f
    bad = dict(m, namespaces=[{**m["namespaces"][0], "foreign_mnt": "yes"}])
    assert "namespaces" in manifest._shape_problem(bad)
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
        [
            "nsenter",
            f"--net=/proc/{holder}/ns/net",
            sys.executable,
            "-c",
            "import socket,sys; s=socket.socket(socket.AF_UNIX);"
            " s.bind(b'\\0' + sys.argv[1].encode()); s.listen(1); print('up', flush=True);"
            " c,_=s.accept(); c.send(b'hello'); c.close()",
            name,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline() == "up\n"

        def connect():
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(b"\0" + name.encode())
                return s.recv(16), os.stat("/proc/thread-self/ns/net").st_ino

        with pytest.raises(ConnectionRefusedError):  # not in ours
            connect()
        got, ino = native.in_netns(holder, connect)
        assert got == b"hello" and ino == os.stat(f"/proc/{holder}/ns/net").st_ino
        assert os.stat("/proc/thread-self/ns/net").st_ino != ino  # we never moved
        assert native.in_netns(os.getpid(), lambda: 5) == 5
        with pytest.raises(ZeroDivisionError):
            native.in_netns(holder, lambda: 1 / 0)
    finally:
        server.kill()
        server.wait()


# --------------------------------------------------------------------------- end to end


class Job:
    """afdwin on fakecuda under the shim, started by the test (optionally inside the net/uts/ipc
    namespaces of ``ns_pid``, or under ``prefix``, e.g. ``unshare --mount``), its stdout a pipe
    to ``cat >> afdwin.log`` outside its tree, its stdin /dev/null and stderr ``afdwin.err``
    opened by the test."""

    def __init__(self, run_dir: pathlib.Path, ns_pid=None, prefix=(), **kw):
        kw.setdefault("hold_at", (HOLD,))
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
            cmd = [
                "nsenter",
                *(f"--{k}=/proc/{ns_pid}/ns/{k}" for k in ("net", "uts", "ipc")),
                "--",
                *cmd,
            ]
        cmd = [*prefix, *cmd]
        with open(a.err, "ab") as err:
            a.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=w,
                stderr=err,
                cwd=a.run_dir,
                env=env,
                start_new_session=True,
            )
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
            except CensusError:  # gone meanwhile
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


def _checkpoint(j, snap):
    a = j.a
    a.wait_hold()
    rc, cp = a.checkpoint(snap)
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -signal.SIGKILL
    for r in j.readers:
        r.wait(timeout=30)  # EOF: every writer of the job's stdout pipe is dead
    return json.loads((snap / "manifest.json").read_text())


def _digest(d: pathlib.Path) -> dict:
    return {
        str(p.relative_to(d)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def _ns(pid):
    return {k: os.stat(f"/proc/{pid}/ns/{k}").st_ino for k in ("net", "uts", "ipc")}


def test_job_in_its_own_netns_checkpointed_and_restored_into_a_placeholder(
    cgroup_dir, placeholder, job, tmp_path
):
    src = placeholder("cui-src", stdout=False).pid
    j = job(ns_pid=src)
    # (before nsenter's setns the forked child still looks like python: wait for the ns)
    wait_until(lambda: _ns(j.a.pid) == _ns(src), "afdwin to start in the namespaces (nsenter)")
    snap = tmp_path / "snap"
    m = _checkpoint(j, snap)  # native lock/checkpoint reached \0fakecuda-<pid>
    evs = j.a.events()
    rank_pids = sorted(w["pid"] for w in evs if demo.kind(w) == "window")
    assert m["namespaces"] == [
        {
            "root": j.a.pid,
            **_ns_at_dump(m),
            "external_net": "cuinterpose-net",
            "mnt": os.stat("/proc/self/ns/mnt").st_ino,
            "foreign_mnt": False,
        }
    ]
    assert m["external_files"] == []  # every file opened in our mount ns
    assert m["namespaces"][0]["net"] == os.stat(f"/proc/{src}/ns/net").st_ino
    assert not list((snap / "criu" / str(j.a.pid)).glob("utsns-*.img"))  # CRIU was in its uts
    # the launcher's stdout (the ranks write to its stderr, a file)
    assert [(p["pid"], p["fd"], p["direction"]) for p in m["external_pipes"]] == [
        (j.a.pid, 1, "write")
    ]
    # ... and a warning says what a restore without a placement does with it
    ino = m["external_pipes"][0]["inode"]
    (w,) = [w for w in m["warnings"] if w["path"] == f"pipe:[{ino}]"]
    assert (w["pid"], w["fd"]) == (j.a.pid, 1)
    assert (
        "a restore without a placement brings it back with nothing at the other end" in w["message"]
    )

    cg = cgroup_dir()
    # the placeholder's stdout: a new pipe to a new reader appending to the same log
    ph = placeholder("cui-dst", cgroup=cg, out=j.a.log).pid
    assert _ns(ph)["net"] != _ns(src)["net"]
    rc, rs = demo.run_agent(
        "restore", "--images-dir", str(snap), "--driver", "fake", "--into-pid", str(ph)
    )
    assert rc == 0 and rs["ok"], rs
    assert [(p["name"], p["status"]) for p in rs["phases"]][:5] == [
        ("manifest", "ok"),
        ("verify", "ok"),
        ("driver", "ok"),
        ("placement", "ok"),
        ("stale sockets", "ok"),
    ]
    assert rs["placement"]["pid"] == ph and rs["placement"]["namespaces"] == {
        k: v for k, v in _ns(ph).items()
    }
    assert [(p["pid"], p["fd"], p["placement_fd"]) for p in rs["placement"]["stdio"]] == [
        (j.a.pid, 1, 1)
    ]
    assert isinstance(rs["notes"], list) and "external_files" not in rs
    placed = [p for p in [j.a.pid, *rank_pids] if pid_alive(p)]
    assert j.a.pid in placed, "the restored job ended before it could be inspected"
    for p in placed:
        assert _ns(p) == _ns(ph), p
        assert cgroups_of(p) == cgroups_of(ph), p
    assert f"/{os.path.basename(cg)}\n" in cgroups_of(ph)
    assert j.a.wait_restored_exit(300) in (0, None)
    j.a.wait_for(
        lambda ev: any(demo.kind(e) == "summary" for e in ev),
        60,
        "the summary through the placeholder's stdout",
    )
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
    res = subprocess.run(
        ["chrt", "-f", "1", sys.executable, "-m", "cuinterpose.agent.cli", *args, "--json"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    try:
        return res.returncode, json.loads(res.stdout)
    except ValueError:
        return res.returncode, {"raw": res.stdout + res.stderr}


def test_bad_placements_are_refused_before_criu_and_leave_the_snapshot(
    cgroup_dir, placeholder, job, tmp_path
):
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
            ("manifest", "ok"),
            ("verify", "ok"),
            ("driver", "ok"),
            ("placement", "failed"),
        ]
        assert _digest(snap) == before
        assert not [p for p in pids if pid_alive(p)], "something was restored"

    # the placement process is gone
    gone = placeholder("cui-gone", stdout=False)
    gone.stop()
    gone = gone.pid
    assert not pid_alive(gone)
    rc, out = demo.run_agent(
        "restore", "--images-dir", str(snap), "--driver", "fake", "--into-pid", str(gone)
    )
    refused(rc, out, gone, "the placement process is gone")

    # its stdout is a socket (journald's): CRIU could not reopen it for the external pipe
    a, b = socket.socketpair()
    sock_ph = placeholder("cui-sock", stdout_fd=a.fileno()).pid
    a.close()
    sock = os.readlink(f"/proc/{sock_ph}/fd/1")
    rc, out = demo.run_agent(
        "restore", "--images-dir", str(snap), "--driver", "fake", "--into-pid", str(sock_ph)
    )
    refused(rc, out, sock_ph)
    (p,) = m["external_pipes"]
    assert out["error"]["reason"] == (
        f"tree {j.a.pid}: pid {p['pid']} fd 1 writes pipe:[{p['inode']}], whose other end was "
        f"outside the tree, but the placement pid {sock_ph} fd 1 ({sock}) is a socket: CRIU "
        "reopens the fd handed for such a pipe through /proc/self/fd/N (criu/pipes.c "
        'reopen_pipe), which fails for it ("No such device or address"); give the '
        "placeholder a pipe, a regular file or /dev/null as its fd 1"
    )
    b.close()

    # the placeholder dies between the placement phase and CRIU: the failure names it, and
    # the snapshot is untouched (in-process, to kill it right after the placement phase)
    from cuinterpose.agent.errors import RestoreFailed
    from cuinterpose.agent.run import restore as restore_mod

    dying = placeholder("cui-dying", stdout=False)
    rs = restore_mod.Restore(snap, driver="fake", placement=dying.pid)
    stale = rs.remove_stale

    def die_then_remove_stale():
        dying.stop()
        stale()

    rs.remove_stale = die_then_remove_stale
    with pytest.raises(RestoreFailed) as ei:
        rs.run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("criu restore", dying.pid, "restore_failed"), e
    assert (
        f"into placement pid {dying.pid}: the placement process {dying.pid} is gone "
        "(exited, or its pid was reused) since the placement phase, so CRIU could not "
        "restore into it (CRIU: " in e.reason
    ), e.reason
    assert [(p.name, p.status) for p in rs.r.phases][3:] == [
        ("placement", "ok"),
        ("stale sockets", "ok"),
        ("criu restore", "failed"),
    ]
    assert _digest(snap) == before
    assert not [p for p in pids if pid_alive(p)], "something was restored"

    # the snapshot is intact: restored into a good placeholder (stdout a new pipe to the
    # log; a dump in the agent's namespaces joined into another) the job finishes
    good = placeholder("cui-good", out=j.a.log).pid
    rc, rs = demo.run_agent(
        "restore", "--images-dir", str(snap), "--driver", "fake", "--into-pid", str(good)
    )
    assert rc == 0 and rs["ok"], rs
    assert j.a.wait_restored_exit(300) in (0, None)
    j.a.wait_for(lambda ev: any(demo.kind(e) == "summary" for e in ev), 60, "the summary")
    assert demo.check_run(j.a.events(), STEPS) == []


def test_a_cgroup_the_kernel_refuses_is_refused_before_criu(cgroup_dir, placeholder, job, tmp_path):
    """The placeholder's cgroup refuses the CRIU child (a real-time task into a v1 cpu cgroup
    without RT time): refused in the placement phase by the probe child, the snapshot
    untouched, nothing restored, the placeholder left where it was."""
    if not os.path.exists("/sys/fs/cgroup/cpu/cpu.rt_runtime_us"):
        pytest.skip(
            "no cgroup v1 cpu hierarchy with RT group scheduling: no refused cgroup "
            "write to provoke"
        )
    j = job()
    snap = tmp_path / "snap"
    m = _checkpoint(j, snap)
    pids = [p["pid"] for p in m["processes"]]
    before = _digest(snap)
    cpu = cgroup_dir(hierarchy="cpu")
    assert pathlib.Path(cpu, "cpu.rt_runtime_us").read_text().strip() == "0"
    ph = placeholder("cui-rt", cgroup=cpu, stdout=False).pid
    rc, out = _chrt_agent(
        "restore", "--images-dir", str(snap), "--driver", "fake", "--into-pid", str(ph)
    )
    assert rc == 3 and not out["ok"], out
    err = out["error"]
    assert (err["phase"], err["pid"], err["outcome"]) == ("placement", ph, "refused"), err
    assert f"cannot join cgroup {cpu}: write of pid" in err["reason"], err
    assert f"to {cpu}/cgroup.procs refused: Invalid argument" in err["reason"], err
    assert [(p["name"], p["status"]) for p in out["phases"]] == [
        ("manifest", "ok"),
        ("verify", "ok"),
        ("driver", "ok"),
        ("placement", "failed"),
    ]
    assert _digest(snap) == before
    assert not [p for p in pids if pid_alive(p)], "something was restored"
    assert pathlib.Path(cpu, "cgroup.procs").read_text().split() == [str(ph)]


def test_restore_notes_without_a_placement_are_in_the_result(tmp_path):
    """The notes of a restore (here: no placement for a snapshot with an external pipe and
    files, taken in another mount namespace) are in its result dict, which ``--json``, the
    gRPC Result and the pod's message carry."""
    from cuinterpose.agent.run.restore import Restore

    dn = os.stat("/dev/null")
    r = Restore(tmp_path)
    r.m = {
        "snapshot_id": "s",
        "roots": [10],
        "cuda_pids": [],
        "external_pipes": [{"root": 10, "pid": 11, "fd": 1, "inode": 77, "direction": "write"}],
        "external_files": [
            {
                "root": 10,
                "pid": 11,
                "fd": 0,
                "path": "/dev/null",
                "mnt_id": 24,
                "inode": dn.st_ino,
                "flags": os.O_RDONLY,
                "access": "r",
                "st_mode": dn.st_mode,
                "rdev": dn.st_rdev,
            }
        ],
        "namespaces": [
            {
                "root": 10,
                "net": 1,
                "uts": 2,
                "ipc": 3,
                "external_net": "",
                "mnt": 4,
                "foreign_mnt": True,
            }
        ],
    }
    try:
        r.place()
        assert [k for _, k in r.opts[10].inherit_fds] == [f"file[18:{dn.st_ino:x}]"]
        assert os.fstat(r.opts[10].inherit_fds[0][0]).st_rdev == dn.st_rdev
    finally:
        r.close_fds()
    res = r.result()
    notes = res["notes"]
    assert notes[0] == (
        "without a placement (--into-pid) these pipe fds come back with no "
        "process at their other end (a writer gets EPIPE): pid 11 fd 1 "
        "(writes pipe:[77])"
    )
    assert notes[1].startswith(
        "tree(s) 10 were checkpointed in a mount namespace other than "
        "the agent's (a container's); without a placement (--into-pid) "
        "CRIU runs in the agent's mount namespace and reopens"
    )
    assert notes[2] == (
        "tree 10: pid 11 fd 0 (/dev/null, opened outside its mount namespace) "
        "gets /dev/null reopened in the agent's mount namespace (O_RDONLY)"
    )
    assert res["external_files"] == [
        {
            "root": 10,
            "pid": 11,
            "fd": 0,
            "path": "/dev/null",
            "mnt_id": 24,
            "inode": dn.st_ino,
            "handed": ("/dev/null reopened in the agent's mount namespace (O_RDONLY)"),
            "placement_fd": None,
        }
    ]
    assert [p.name for p in r.r.phases] == ["placement"]
    assert "placement" not in res


def test_job_in_its_own_mount_namespace_with_stdio_from_outside_into_a_placeholder(
    cgroup_dir, placeholder, job, tmp_path
):
    """A container's shape: the job runs in a mount namespace of its own, its stdin /dev/null
    and stderr (the ranks' events) a log file the "runtime" opened outside that namespace, its
    stdout a pipe. The checkpoint records those files as external (CRIU inside the job's mount
    namespace cannot look their mounts up); the restore goes into a placeholder in a test
    cgroup whose mount namespace hides the agent's Python (the cgroup probe must not need it),
    whose stdin is /dev/null and stderr the same log: both are handed the placeholder's fds,
    and the job finishes with nothing lost."""
    # the restored Python maps its interpreter by its real path: hide only the directory of the
    # agent's sys.executable (a virtualenv's bin), when that is another one
    real = os.path.dirname(os.path.realpath(sys.executable))
    hide = [d for d in hidden_python_dirs() if d != real]
    j = job(prefix=["unshare", "--mount", "--propagation", "private", "--"])
    wait_until(
        lambda: (
            os.stat(f"/proc/{j.a.pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
            and comm_of(j.a.pid).startswith("python")
        ),
        "afdwin to start in its mount namespace",
    )
    job_mnt = os.stat(f"/proc/{j.a.pid}/ns/mnt").st_ino
    snap = tmp_path / "snap"
    m = _checkpoint(j, snap)
    dn = os.stat("/dev/null")
    err = os.stat(j.a.err)
    assert m["namespaces"] == [
        {"root": j.a.pid, **_ns_at_dump(m), "external_net": "", "mnt": job_mnt, "foreign_mnt": True}
    ]
    files = m["external_files"]
    dev_id = _mount_id("/dev")
    root_files = [
        (f["fd"], f["path"], f["mnt_id"], f["inode"]) for f in files if f["pid"] == j.a.pid
    ]
    assert root_files == [
        (0, "/dev/null", dev_id, dn.st_ino),
        (2, str(j.a.err), mount_id_of(j.a.err), err.st_ino),
    ]
    assert {f["path"] for f in files} == {"/dev/null", str(j.a.err)}
    assert {f["pid"] for f in files} == {p["pid"] for p in m["processes"]}
    warned = {
        (w["pid"], w["fd"])
        for w in m["warnings"]
        if "opened outside the tree's mount namespace" in w["message"]
    }
    assert warned == {(f["pid"], f["fd"]) for f in files}

    cg = cgroup_dir()
    err_fd = os.open(j.a.err, os.O_WRONLY | os.O_APPEND)
    ph = placeholder(
        "cui-mnt-dst",
        mount=True,
        cgroup=cg,
        out=j.a.log,
        stderr_fd=err_fd,
        prepare=" && ".join(f"mount -t tmpfs none {d}" for d in hide),
    ).pid
    os.close(err_fd)
    assert os.path.exists(f"/proc/{ph}/root{sys.executable}") == (not hide)
    rc, rs = demo.run_agent(
        "restore", "--images-dir", str(snap), "--driver", "fake", "--into-pid", str(ph)
    )
    assert rc == 0 and rs["ok"], (rs.get("error") or {}).get("reason", rs)
    handed = {(f["pid"], f["fd"]): (f["placement_fd"], f["handed"]) for f in rs["external_files"]}
    assert handed[(j.a.pid, 0)] == (0, "placement fd 0 (/dev/null)")
    assert handed[(j.a.pid, 2)] == (2, f"placement fd 2 ({j.a.err})")
    assert set(handed) == {(f["pid"], f["fd"]) for f in files}
    assert any(
        n.startswith(
            f"tree {j.a.pid}: pid {j.a.pid} fd 0 (/dev/null, opened outside "
            "its mount namespace) gets placement fd 0"
        )
        for n in rs["notes"]
    )
    assert os.stat(f"/proc/{j.a.pid}/ns/mnt").st_ino == os.stat(f"/proc/{ph}/ns/mnt").st_ino
    assert cgroups_of(j.a.pid) == cgroups_of(ph)
    assert os.stat(f"/proc/{j.a.pid}/fd/0").st_rdev == dn.st_rdev
    assert os.stat(f"/proc/{j.a.pid}/fd/2").st_ino == err.st_ino
    assert j.a.wait_restored_exit(300) in (0, None)
    j.a.wait_for(lambda ev: any(demo.kind(e) == "summary" for e in ev), 60, "the summary")
    evs = j.a.events()
    assert demo.check_run(evs, STEPS) == []
    s = [e for e in evs if demo.kind(e) == "summary"][-1]
    assert (s["lost"], s["duplicated"], s["torn"], s["restores_seen"]) == (0, 0, 0, 1)


def _mount_id(mountpoint: str) -> int:
    with open("/proc/self/mountinfo") as f:
        return [int(ln.split()[0]) for ln in f if ln.split()[4] == mountpoint][-1]


def test_cgroup_paths_outside_the_agents_cgroup_namespace_are_refused(tmp_path):
    root = _fake_proc(tmp_path, cgroup="0::/../../kubepods.slice/pod1/cri-containerd-ab.scope\n")
    with pytest.raises(PlacementError) as e:
        Placement.of_pid(4242, proc_root=root)
    assert (e.value.phase, e.value.pid) == ("placement", 4242)
    assert str(e.value).endswith(
        "its cgroup 0::/../../kubepods.slice/pod1/cri-containerd-ab.scope lies outside this "
        "agent's cgroup namespace: the agent does not run in the node's cgroup namespace "
        "(serve with kubernetes enabled, and the standalone pod watcher, join pid 1's when "
        "they can; docs/kubernetes.md)"
    )


def _refused_at_census_and_untouched(a, out: dict, snap: pathlib.Path) -> None:
    """A checkpoint refused at the census changed nothing: no phase after it ran, no snapshot
    dir, and the job (never asked to quiesce) finishes with nothing lost."""
    assert [(p["name"], p["status"]) for p in out["phases"]] == [
        ("driver", "ok"),
        ("census", "failed"),
    ]
    assert not snap.exists()
    a.release_hold()
    a.wait_ok(300)
    evs = a.events()
    assert demo.check_run(evs, STEPS, expect_restore=False) == []
    s = [e for e in evs if demo.kind(e) == "summary"][-1]
    assert (s["lost"], s["duplicated"], s["torn"], s["restores_seen"]) == (0, 0, 0, 0)


def test_checkpoint_of_a_job_whose_cwd_is_outside_its_mount_namespace_is_refused(job, tmp_path):
    """CRIU cannot dump a cwd (or root, or a file only mapped) on a mount outside the tree's
    mount namespace ("Can't lookup mount=N for fd=-3"): the census refuses it before the
    quiesce, naming each process, the directory and the mount; the job runs on untouched."""
    run_dir = tmp_path / "run0"
    j = job(
        prefix=[
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            f'cd /proc/{os.getpid()}/root{run_dir} && exec "$@"',
            "sh",
        ]
    )
    assert j.a.run_dir == run_dir
    a = j.a
    a.wait_hold()
    assert os.stat(f"/proc/{a.pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
    snap = tmp_path / "snap"
    rc, out = a.checkpoint(snap)
    assert rc == 3 and not out["ok"], out
    err = out["error"]
    tree = sorted(p for p, _, _ in walk_tree([a.pid]))
    mid = mount_id_of(run_dir)
    comm = {p: comm_of(p) for p in tree}
    what = f"has its working directory {run_dir} on mount {mid}"
    assert (err["phase"], err["pid"], err["outcome"]) == ("census", tree[0], "refused"), err
    assert err["reason"] == (
        f"({comm[tree[0]]}) of tree {a.pid} {what}, which is not a mount of the tree's mount "
        "namespace (reached from outside it, e.g. through an inherited fd or another "
        "process's /proc/PID/root): CRIU, run in that namespace, cannot dump it (\"Can't "
        f'lookup mount={mid} for fd=-3"), and only open fds can be recorded as external files'
        + "".join(f"; also pid {p} ({comm[p]}) {what}" for p in tree[1:6])
        + "; checkpoint refused, nothing was torn down, the workload keeps running"
    )
    _refused_at_census_and_untouched(a, out, snap)


#: a prefix that opens a TCP connection to itself, records its two ends, and execs the job with
#: both ends inherited (the listening socket closes at exec)
TCP_PREFIX = """
import json, os, socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
c = socket.create_connection(s.getsockname()); a, _ = s.accept()
for x in (c, a):
    os.set_inheritable(x.fileno(), True)
with open("tcp.json", "w") as f:
    json.dump({"port": s.getsockname()[1], "client_port": c.getsockname()[1],
               "client_fd": c.fileno(), "accepted_fd": a.fileno()}, f)
os.execvp(sys.argv[1], sys.argv[1:])
"""


def test_checkpoint_of_a_job_holding_a_tcp_connection_is_refused_at_the_census(job, tmp_path):
    """The agent runs CRIU without --tcp-established, so a tree holding a TCP connection (as
    torch.distributed's NCCL bootstrap and gloo do) cannot be dumped: the census refuses it
    before the quiesce, naming each end (pid, fd, addresses, state); the job runs on."""
    j = job(prefix=[sys.executable, "-c", TCP_PREFIX])
    a = j.a
    a.wait_hold()
    t = json.loads((a.run_dir / "tcp.json").read_text())
    snap = tmp_path / "snap"
    rc, out = a.checkpoint(snap)
    assert rc == 3 and not out["ok"], out
    err = out["error"]
    c = comm_of(a.pid)
    lo, cl = f"127.0.0.1:{t['port']}", f"127.0.0.1:{t['client_port']}"
    ends = sorted([(t["client_fd"], f"{cl} -> {lo}"), (t["accepted_fd"], f"{lo} -> {cl}")])  # by fd
    assert (err["phase"], err["pid"], err["outcome"]) == ("census", a.pid, "refused"), err
    assert err["reason"] == (
        f"({c}) of tree {a.pid} holds 2 TCP connection(s): "
        + "; ".join(f"pid {a.pid} ({c}) fd {fd} {e} (ESTABLISHED)" for fd, e in ends)
        + ". The agent runs CRIU without --tcp-established (docs/criu.md), so the dump would "
        "fail; a workload must close its TCP connections before it parks (torch.distributed: "
        "NCCL's bootstrap and gloo keep theirs for the process group's life); checkpoint "
        "refused, nothing was torn down, the workload keeps running"
    )
    _refused_at_census_and_untouched(a, out, snap)


def test_a_bad_size_of_an_external_file_names_what_was_handed(tmp_path, monkeypatch):
    """CRIU names an external file reopened from a handed fd "fd/N" (a copy of that fd, tied
    to its key by the log line before): the restore's reason names the file, the tree's fds
    and what was handed, not the workload's O_APPEND."""
    from cuinterpose.agent.errors import AgentError
    from cuinterpose.agent.mech import criu
    from cuinterpose.agent.mech.inherit import RestoreOptions
    from cuinterpose.agent.run import restore as rs_mod

    log = tmp_path / "restore.log"
    log.write_text(
        "(00.040346)   9695: Found id file[1b:210413] (fd 1) in inherit fd list\n"
        "(00.040371)   9695: Found id file[1b:210413] (fd 3) in inherit fd list\n"
        "(00.040377)   9695: Error (criu/files-reg.c:2175): File fd/3 has bad size "
        "70 (expect 4111)\n"
        "(00.040377)   9695: Error (criu/files-reg.c:2175): File run/app.log has "
        "bad size 9 (expect 8)\n"
    )
    e = criu.CriuError("criu restore failed", log_path=log)
    e.bad_size = criu.bad_size_files(log)
    assert e.bad_size == [
        {"path": "/fd/3", "size": 70, "expected": 4111},
        {"path": "/run/app.log", "size": 9, "expected": 8},
    ]

    def boom(d, **kw):
        raise e

    monkeypatch.setattr(criu, "restore", boom)
    rec = {
        "root": 7,
        "pid": 8,
        "fd": 1,
        "path": "/var/log/x.log",
        "mnt_id": 0x1B,
        "inode": 0x210413,
        "flags": os.O_WRONLY | os.O_APPEND,
        "access": "w",
        "st_mode": 0o100644,
        "rdev": 0,
    }
    handed = {"handed": "placement fd 1 (/var/log/ph.log)", "placement_fd": 1}
    rs = rs_mod.Restore(tmp_path)
    rs.m = {"roots": [7]}
    rs.opts[7] = RestoreOptions(
        inherit_fds=[(12, "file[1b:210413]")],
        files=[{**rec, **handed}, {**rec, "fd": 5, "flags": os.O_RDWR, "access": "rw", **handed}],
    )
    with pytest.raises(AgentError) as ei:
        rs.criu_restore()
    assert ei.value.reason == (
        f"tree 7 from {tmp_path / 'criu' / '7'}: CRIU refuses a file opened outside the tree's "
        "mount namespace whose size is not its size at the dump (CRIU reopens every fd of such "
        "a file on the one fd handed for it, and checks the size of each fd the tree did not "
        "hold O_WRONLY|O_APPEND): /var/log/x.log (opened outside the tree's mount namespace; "
        "held by pid 8 fd 5 O_RDWR) was handed placement fd 1 (/var/log/ph.log), which is 70 "
        "bytes, the snapshot expects 4111: the placement's fd 1 is another file than the "
        "tree's: restore into a placeholder whose fd 1 is not a regular file, so that "
        "/var/log/x.log is reopened. It also refuses a regular file whose size changed since "
        "the dump: /run/app.log is 9 bytes, the snapshot expects 8. The workload (or a "
        "restored run of it) wrote to it through a descriptor opened without O_APPEND, so this "
        "snapshot is restorable only while the file keeps its dumped size (truncate it back to "
        "that size to restore it again, losing what was written after the checkpoint); open it "
        "with O_APPEND / `>>` so that later snapshots restore any number of times "
        f"(CRIU log: {log})"
    )
