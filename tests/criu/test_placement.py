"""Restoring a CRIU tree into a placement (agent/placement.py) with real CRIU: the restored
processes join the placeholder's namespaces (net, uts, ipc) and cgroups, and their stdout pipe,
whose reader was outside the dumped tree, is handed the placeholder's stdout.

A placeholder (tests/conftest.py ``placeholder``) is ``unshare --net --uts --ipc`` (hostname set
in its uts namespace) in a fresh test cgroup (``cgroup_dir``: v1 ``pids`` or v2), its stdout a
new pipe to a new reader. Cgroups and processes are removed at teardown.

Also: a placeholder in a mount namespace without the agent's Python (cgroups probed without
entering it); a tree in a mount namespace of its own holding /dev/null and a log file opened
outside it (dumped as external files, restored from the placeholder's fds or the paths); a
placeholder whose stdout is a regular file (its bytes kept, the restored output appended);
placements in another user namespace, pid 1 and kernel threads refused.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import pytest
from criu_helpers import HERE, alive, kill_tree, stop_job, wait_until
from placement_kit import cgroups_of, comm_of, hidden_python_dirs, mount_id_of

from cuinterpose.agent.mech import criu, fds
from cuinterpose.agent.mech.inherit import external_file_key, restore_options
from cuinterpose.agent.mech.placement import Namespace, Placement, PlacementError

PIPE_TREE = HERE / "pipe_tree.py"


@pytest.fixture
def pipe_tree(tmp_path, criu_ok):
    """pipe_tree() -> (Popen of the root, {"root", "child"}, reader Popen, reader's output):
    tests/criu/pipe_tree.py with stdout a pipe to a ``cat`` outside the tree. Killed at
    teardown, and every pid registered with ``.track``."""
    started = []
    extra: list[list[int]] = []

    def start():
        info = tmp_path / "tree.json"
        out = tmp_path / "before.out"
        r, w = os.pipe()
        with open(out, "wb") as o:
            reader = subprocess.Popen(["cat"], stdin=r, stdout=o)
        os.close(r)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LD_")}
        with open(tmp_path / "tree.err", "ab") as err:
            root = subprocess.Popen(
                [sys.executable, str(PIPE_TREE), str(info)],
                stdout=w,
                stdin=subprocess.DEVNULL,
                stderr=err,
                env=env,
                start_new_session=True,
            )
        os.close(w)
        started.append((root, reader))
        wait_until(info.exists, "the pipe tree to start", 30)
        pids = json.loads(info.read_text())
        wait_until(
            lambda: min(len(lines(out, "root")), len(lines(out, "child"))) > 20,
            "20 lines of each writer",
            30,
        )
        return root, pids, reader, out

    start.track = extra.append
    yield start
    for root, reader in started:
        if root.poll() is None:
            try:
                os.killpg(root.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        root.wait()
        reader.kill()
        reader.wait()
    for pids in extra:
        kill_tree(pids)


def lines(path, who: str) -> list[int]:
    """Sequence numbers ``who`` wrote to the file ``path`` (complete lines only)."""
    out = []
    for ln in path.read_bytes().decode(errors="replace").split("\n")[:-1]:
        w, _, n = ln.partition(" ")
        if w == who:
            out.append(int(n))
    return out


def ns_inodes(pid: int) -> dict[str, int]:
    return {k: os.stat(f"/proc/{pid}/ns/{k}").st_ino for k in ("net", "uts", "ipc")}


def hostname_of(pid: int) -> str:
    return subprocess.run(
        ["nsenter", f"--uts=/proc/{pid}/ns/uts", "hostname"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def wait_gone(pids, timeout=30):
    assert criu.wait_pids_free(pids, timeout) == [], f"pids {pids} still in use"


def test_restore_into_placeholder_namespaces_cgroups_and_stdout(
    tmp_path, pipe_tree, cgroup_dir, placeholder
):
    root, pids, reader, before_out = pipe_tree()
    tree = [pids["root"], pids["child"]]
    ext = fds.external_pipes(root.pid, tree)
    ino = os.stat(f"/proc/{root.pid}/fd/1").st_ino
    assert ext == [
        {"root": root.pid, "pid": p, "fd": 1, "inode": ino, "direction": "write"}
        for p in sorted(tree)
    ]
    imgs = tmp_path / "imgs"
    ns = criu.dump(root.pid, imgs)
    assert ns["external_net"] == "" and ns["enter"] == []  # the tree shared our namespaces
    assert root.wait() == -signal.SIGKILL
    reader.wait(timeout=30)  # EOF: every writer of its pipe is dead
    before = {w: lines(before_out, w) for w in ("root", "child")}
    for w, seq in before.items():
        assert seq == list(range(len(seq))), f"{w} before the dump: {seq[:5]}..."
    wait_gone(tree)

    # without a placement (today's behaviour): the pipe comes back with no reader, the
    # writers die at their next write (EPIPE)
    r0 = criu.restore(imgs)
    assert r0 == root.pid
    pipe_tree.track(tree)
    wait_until(lambda: not any(alive(p) for p in tree), "the reader-less tree to die", 30)
    assert "BrokenPipeError" in (tmp_path / "tree.err").read_text()
    wait_gone(tree)

    cg = cgroup_dir()
    ph = placeholder("cuinterpose-ph", cgroup=cg)
    pl = Placement.of_pid(ph.pid)
    assert pl.namespace("net").inode == ns_inodes(ph.pid)["net"]
    assert [s.fd for s in pl.stdio] == [0, 1, 2] and pl.stdio[1].mode == "w"
    assert pl.stdio[1].target.startswith("pipe:[")
    assert [c.procs_file for c in pl.cgroups_to_join()] == [os.path.join(cg, "cgroup.procs")]
    opts = restore_options(pl, ext, ns["external_net"], root=root.pid)
    try:
        assert [(k, p) for k, p in opts.join_ns] == [
            (k, f"/proc/{ph.pid}/ns/{k}") for k in ("net", "ipc", "uts")
        ]
        assert [r for _, r in opts.inherit_fds] == [f"pipe:[{ino}]"]
        assert [p["placement_fd"] for p in opts.inherited] == [1, 1]
        assert criu.restore(imgs, **opts.kwargs()) == root.pid
    finally:
        opts.close()
    pipe_tree.track(tree)
    for p in tree:
        assert alive(p), f"restored pid {p} died"
        assert ns_inodes(p) == ns_inodes(ph.pid), p
        assert cgroups_of(p) == cgroups_of(ph.pid), p
        assert pl.mismatches(p) == []
    assert hostname_of(root.pid) == "cuinterpose-ph" == hostname_of(ph.pid)
    assert f"/{os.path.basename(cg)}\n" in cgroups_of(ph.pid)
    assert os.path.basename(cg) not in cgroups_of(os.getpid())  # we stayed out
    wait_until(
        lambda: min(len(lines(ph.out, "root")), len(lines(ph.out, "child"))) > 20,
        "20 lines of each restored writer at the new reader",
        30,
    )
    kill_tree(tree)
    ph.stop()
    assert ph.reader.returncode == 0  # EOF: it copied all there was
    for w in ("root", "child"):
        after = lines(ph.out, w)
        seq = before[w] + after
        assert after[0] == before[w][-1] + 1, (w, before[w][-3:], after[:3])
        assert seq == list(range(len(seq))), f"{w}: gap or duplicate across the restore"


def test_placement_refusals(tmp_path, placeholder):
    ph = placeholder("cuinterpose-gone")
    pl = Placement.of_pid(ph.pid)
    with pytest.raises(PlacementError) as ei:
        Placement.of_pid(ph.pid, namespaces=("net", "mnt"))
    assert (ei.value.phase, ei.value.pid) == ("placement", ph.pid)
    assert "cannot join its mnt namespace" in ei.value.reason
    ph.stop()
    with pytest.raises(PlacementError) as ei:
        pl.verify()
    assert ei.value.pid == ph.pid and "gone" in ei.value.reason
    with pytest.raises(PlacementError) as ei:
        Placement.of_pid(ph.pid)
    assert ei.value.pid == ph.pid
    assert str(ei.value).startswith(f"placement: pid {ph.pid} ")
    assert "the placement process is gone" in ei.value.reason


def test_stdio_mapping_refuses_a_placeholder_without_a_writable_stdout(tmp_path):
    p = subprocess.Popen(
        ["sleep", "600"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: comm_of(p.pid) == "sleep", "sleep", 30)
        pl = Placement.of_pid(p.pid)
        ext = [
            {"root": 5, "pid": 5, "fd": 1, "inode": 77, "direction": "write"},
            {"root": 5, "pid": 6, "fd": 0, "inode": 78, "direction": "read"},
        ]
        opts = restore_options(pl, ext, root=5)
        try:
            assert [r for _, r in opts.inherit_fds] == ["pipe:[77]", "pipe:[78]"]
            assert [(e["fd"], e["placement_fd"]) for e in opts.inherited] == [(1, 1), (0, 0)]
        finally:
            opts.close()
        # stdout closed: a write pipe falls back to stderr; stderr closed too: refused
        bare = Placement(
            pl.pid,
            pl.start_time,
            pl.cgroups,
            pl.namespaces,
            tuple(s for s in pl.stdio if s.fd == 0),
            pl.proc_root,
        )
        with pytest.raises(PlacementError) as ei:
            restore_options(bare, ext, root=5)
        assert ei.value.pid == p.pid
        assert (
            "tree 5: pid 5 fd 1 writes pipe:[77], whose other end was outside the tree, "
            "but the placement has no stdio fd open for writing"
        ) in ei.value.reason
    finally:
        p.kill()
        p.wait()


def test_tree_in_its_own_namespaces_dumps_them_as_external_and_restores_into_ours(
    tmp_path, placeholder, criu_ok
):
    """A tree in another net/uts/ipc namespace: CRIU runs in its uts and ipc namespaces (not
    imaged) and marks its network namespace external; without a placement the restore hands
    CRIU the agent's own (--inherit-fd fd[N]:cuinterpose-net)."""
    holder = placeholder("cuinterpose-src")
    p = subprocess.Popen(
        [
            "nsenter",
            *(f"--{k}=/proc/{holder.pid}/ns/{k}" for k in ("net", "uts", "ipc")),
            sys.executable,
            "-c",
            "import time; time.sleep(600)",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(
            lambda: (
                ns_inodes(p.pid) == ns_inodes(holder.pid) and comm_of(p.pid).startswith("python")
            ),
            "the tree to start in the namespaces",
            30,
        )
        imgs = tmp_path / "imgs"
        ns = criu.dump(p.pid, imgs)
        assert (ns["external_net"], ns["enter"]) == ("cuinterpose-net", ["uts", "ipc"])
        assert ns["net"] == ns_inodes(holder.pid)["net"]
        assert not list(imgs.glob("utsns-*.img")) and not list(imgs.glob("ipcns-*.img"))
        assert p.wait() == -signal.SIGKILL
        wait_gone([p.pid])
        with pytest.raises(criu.CriuError) as ei:  # such images need the inherited netns
            criu.restore(imgs)
        assert "Unable to find an external netns: cuinterpose-net" in ei.value.log_tail
        wait_gone([p.pid])
        opts = restore_options(None, (), ns["external_net"], root=p.pid)
        try:
            assert [r for _, r in opts.inherit_fds] == ["cuinterpose-net"] and not opts.join_ns
            assert criu.restore(imgs, **opts.kwargs()) == p.pid
        finally:
            opts.close()
        assert alive(p.pid) and ns_inodes(p.pid) == ns_inodes(os.getpid())
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        kill_tree([p.pid])


# --------------------------------------------------------------------------- probe, mount ns

COUNTER = "cd / && exec 4>>{log} && i=0; while :; do i=$((i+1)); echo $i >&4; sleep 0.02; done"


def _numbers(path) -> list[int]:
    try:
        text = pathlib.Path(path).read_text()
    except FileNotFoundError:
        return []
    return [int(x) for x in text.split("\n")[:-1]]  # the last one may be half written


def test_probe_and_restore_into_a_placeholder_without_the_agents_python(
    tmp_path, placeholder, cgroup_dir, criu_ok
):
    """The cgroup probe enters no namespace: a placeholder whose mount namespace has a tmpfs
    over this Python's directories (a container's root filesystem lacks the agent's
    interpreter) and a test cgroup is probed and restored into."""
    hide = hidden_python_dirs()
    assert hide, f"no directory of {sys.executable} can be hidden"
    log = tmp_path / "log"
    job = subprocess.Popen(
        ["sh", "-c", COUNTER.format(log=log)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    restored = None
    try:
        wait_until(lambda: len(_numbers(log)) >= 10, "10 numbers", 30)
        imgs = tmp_path / "imgs"
        ns = criu.dump(job.pid, imgs)
        assert ns["enter"] == [] and ns["foreign_mnt"] is False
        assert job.wait(30) == -signal.SIGKILL
        dumped = _numbers(log)
        wait_gone([job.pid])

        cg = cgroup_dir()
        ph = placeholder(
            "cui-nopy",
            mount=True,
            cgroup=cg,
            stdout=False,
            prepare=" && ".join(f"mount -t tmpfs none {d}" for d in hide),
        )
        for d in hide:  # hidden there, present here
            assert os.listdir(f"/proc/{ph.pid}/root{d}") == [] and os.listdir(d)
        assert not os.path.exists(f"/proc/{ph.pid}/root{sys.executable}")
        pl = Placement.of_pid(ph.pid)
        assert pl.mnt is not None and pl.user.inode == os.stat("/proc/self/ns/user").st_ino
        # the probe joins the cgroup only (the old probe entered the mount namespace and
        # exec'd this Python there: FileNotFoundError)
        assert pl.probe_cgroups() == [os.path.join(cg, "cgroup.procs")]
        with pytest.raises(ValueError, match="cannot run in another mount namespace"):
            criu.run_setup_probe(pl.child_setup())
        opts = restore_options(pl, root=job.pid)
        try:
            restored = criu.restore(imgs, **opts.kwargs())
        finally:
            opts.close()
        assert restored == job.pid
        assert os.stat(f"/proc/{restored}/ns/mnt").st_ino == pl.mnt.inode
        assert cgroups_of(restored) == cgroups_of(ph.pid) and pl.mismatches(restored) == []
        wait_until(lambda: len(_numbers(log)) >= len(dumped) + 10, "10 more numbers", 30)
        after = _numbers(log)
        assert after == list(range(1, len(after) + 1)) and after[: len(dumped)] == dumped
    finally:
        stop_job(job, restored)


def _mount_id(mountpoint: str, pid="self") -> int:
    with open(f"/proc/{pid}/mountinfo") as f:
        ids = [int(ln.split()[0]) for ln in f if ln.split()[4] == mountpoint]
    return ids[-1]  # the top one


def _fdinfo_flags(pid: int, fd: int) -> int:
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        return next(int(ln.split()[1], 8) for ln in f if ln.startswith("flags:"))


#: in a mount namespace of its own, with stdin /dev/null and stderr a log file opened outside it
#: (as a container runtime hands them); writes 1, 2, 3 ... to stderr and to DATA/log (opened
#: inside, on the bind-mounted volume)
INSIDE = (
    "mount --bind {vol} {mnt} && cd / && exec 4>>{mnt}/log && i=0; while :; do "
    "i=$((i+1)); echo $i >&2; echo $i >&4; sleep 0.02; done"
)


@pytest.mark.parametrize("stderr_of_placeholder", ["same-file", "pipe"])
def test_files_opened_outside_the_mount_namespace_are_external(
    tmp_path, placeholder, criu_ok, stderr_of_placeholder
):
    vol, mnt = tmp_path / "volume", tmp_path / "mnt"
    vol.mkdir()
    mnt.mkdir()
    err_log = tmp_path / "stderr.log"
    with open(err_log, "ab") as err:
        job = subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                INSIDE.format(vol=vol, mnt=mnt),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    restored = None
    try:
        wait_until(lambda: len(_numbers(vol / "log")) >= 10, "10 numbers", 30)
        tree = [job.pid]
        devnull = os.stat("/dev/null")
        ext = fds.external_files(job.pid, tree)
        assert [(e["fd"], e["path"]) for e in ext] == [
            (0, "/dev/null"),
            (1, "/dev/null"),
            (2, str(err_log)),
        ]
        dev_id = _mount_id("/dev")
        assert [e["mnt_id"] for e in ext[:2]] == [dev_id, dev_id]
        assert ext[0]["mnt_id"] != _mount_id("/dev", job.pid)  # its own /dev mount
        assert (ext[0]["inode"], ext[0]["rdev"], ext[0]["st_mode"]) == (
            devnull.st_ino,
            devnull.st_rdev,
            devnull.st_mode,
        )
        assert ext[2]["inode"] == err_log.stat().st_ino and ext[2]["access"] == "w"
        assert ext[2]["flags"] & (os.O_ACCMODE | os.O_APPEND) == os.O_WRONLY | os.O_APPEND
        keys = [external_file_key(e) for e in ext]
        assert keys[0] == f"file[{dev_id:x}:{devnull.st_ino:x}]"

        # not marked external, CRIU (inside the tree's mount namespace) cannot dump them
        with pytest.raises(criu.CriuError) as ei:
            criu.dump(job.pid, tmp_path / "plain", leave_running=True)
        assert f"Can't lookup mount={dev_id} for fd=0 path=/dev/null" in str(ei.value)
        assert alive(job.pid)

        imgs = tmp_path / "imgs"
        ns = criu.dump(job.pid, imgs, external_files=keys)
        assert ns["enter"] == ["mnt"] and ns["foreign_mnt"] is True
        assert job.wait(30) == -signal.SIGKILL
        dumped = {"err": _numbers(err_log), "vol": _numbers(vol / "log")}
        wait_gone(tree)

        # without an fd for them, CRIU refuses to restore such images
        err_fd = os.open(tmp_path / "ph-stderr.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        if stderr_of_placeholder == "same-file":
            os.close(err_fd)
            err_fd = os.open(err_log, os.O_WRONLY | os.O_APPEND)
        else:
            r, err_fd2 = os.pipe()
            os.close(r)
            os.close(err_fd)
            err_fd = err_fd2
        holder = placeholder(
            "cui-ext",
            mount=True,
            stdout=False,
            stderr_fd=err_fd,
            prepare=f"mount --bind {vol} {mnt} && cd /",
        )
        os.close(err_fd)
        pl = Placement.of_pid(holder.pid, namespaces=())
        opts = restore_options(pl, root=job.pid, external_files=ext)
        try:
            got = {(f["fd"], f["placement_fd"]) for f in opts.files}
            if stderr_of_placeholder == "same-file":
                assert got == {(0, 0), (1, 0), (2, 2)}
                assert opts.files[2]["handed"] == f"placement fd 2 ({err_log})"
            else:
                # its stderr is a pipe: not the same kind of file, so the path is reopened
                assert got == {(0, 0), (1, 0), (2, None)}
                assert opts.files[2]["handed"] == (
                    f"{err_log} reopened in the agent's mount namespace (O_WRONLY|O_APPEND)"
                )
            assert opts.files[0]["handed"] == "placement fd 0 (/dev/null)"
            assert sorted(r for _, r in opts.inherit_fds) == sorted(set(keys))
            restored = criu.restore(imgs, **opts.kwargs())
        finally:
            opts.close()
        assert restored == job.pid
        assert os.stat(f"/proc/{restored}/ns/mnt").st_ino == pl.mnt.inode
        for fd in (0, 1):
            assert os.stat(f"/proc/{restored}/fd/{fd}").st_rdev == devnull.st_rdev
        assert os.stat(f"/proc/{restored}/fd/2").st_ino == err_log.stat().st_ino
        assert _fdinfo_flags(restored, 2) & os.O_APPEND
        n = len(dumped["vol"])
        wait_until(
            lambda: len(_numbers(vol / "log")) >= n + 10 and len(_numbers(err_log)) >= n + 10,
            "10 more numbers in both logs",
            30,
        )
        for name, path in (("err", err_log), ("vol", vol / "log")):
            after = _numbers(path)
            assert after[: len(dumped[name])] == dumped[name], name
            assert after == list(range(1, len(after) + 1)), f"{name}: gap or duplicate"
    finally:
        stop_job(job, restored)


def test_external_file_refusals_name_pid_fd_and_path(tmp_path):
    rec = {
        "root": 5,
        "pid": 6,
        "fd": 7,
        "path": str(tmp_path / "gone.log"),
        "mnt_id": 999,
        "inode": 12,
        "flags": os.O_WRONLY | os.O_APPEND,
        "access": "w",
        "st_mode": 0o100644,
        "rdev": 0,
    }
    with pytest.raises(PlacementError) as ei:
        restore_options(None, root=5, external_files=[rec])
    assert ei.value.reason == (
        f"tree 5: pid 6 fd 7 holds {tmp_path}/gone.log (opened outside the tree's mount "
        "namespace, mount 999, inode 12), which cannot be reopened here: No such file or "
        "directory"
    )
    # a path that is there but another kind of file than the tree's
    with pytest.raises(PlacementError) as ei:
        restore_options(None, root=5, external_files=[dict(rec, path="/dev/null")])
    assert ei.value.reason.startswith(
        "tree 5: pid 6 fd 7 holds /dev/null ("
    ) and ei.value.reason.endswith(
        "but /dev/null here is a character device of mode 20666, "
        "the tree's was a regular file of mode 100644"
    )
    # without a placement a file that is there is reopened, with O_APPEND
    (tmp_path / "there.log").write_bytes(b"x")
    there = dict(rec, path=str(tmp_path / "there.log"))
    opts = restore_options(None, root=5, external_files=[there])
    try:
        ((fd, key),) = opts.inherit_fds
        assert key == "file[3e7:c]"
        assert os.fstat(fd).st_ino == (tmp_path / "there.log").stat().st_ino
        assert (
            fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_ACCMODE | os.O_APPEND)
            == os.O_WRONLY | os.O_APPEND
        )
        assert opts.files[0]["placement_fd"] is None
    finally:
        opts.close()


# --------------------------------------------------------------------------- stdout to a file

HEADER = b"".join(b"PLACEHOLDER HEADER %03d\n" % i for i in range(100))


@pytest.mark.parametrize("how", ["append", "offset"])
def test_placeholder_stdout_a_regular_file_keeps_its_bytes(tmp_path, pipe_tree, placeholder, how):
    """CRIU reopens an inherited pipe's fd through /proc/self/fd/N at offset 0 without
    O_APPEND: the restore leaves the tree stopped, sets O_APPEND on the restored fds and only
    then lets it run, so the placeholder's log keeps its 100 header lines and the restored
    lines follow them."""
    root, pids, reader, before_out = pipe_tree()
    tree = [pids["root"], pids["child"]]
    ext = fds.external_pipes(root.pid, tree)
    imgs = tmp_path / "imgs"
    criu.dump(root.pid, imgs)
    assert root.wait() == -signal.SIGKILL
    reader.wait(timeout=30)
    before = {w: lines(before_out, w) for w in ("root", "child")}
    wait_gone(tree)

    log = tmp_path / "ph.log"
    log.write_bytes(HEADER)
    if how == "append":  # a runtime appending: O_APPEND
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    else:  # written with `>`: no O_APPEND, offset at the end
        fd = os.open(log, os.O_WRONLY)
        os.lseek(fd, len(HEADER), os.SEEK_SET)
    ph = placeholder("cui-file", stdout_fd=fd)
    os.close(fd)
    pl = Placement.of_pid(ph.pid)
    assert pl.stdio[1].target == str(log)
    opts = restore_options(pl, ext, root=root.pid)
    try:
        assert [(f["pid"], f["fd"]) for f in opts.fixups] == [(p, 1) for p in sorted(tree)]
        assert opts.kwargs()["leave_stopped"] is True
        assert criu.restore(imgs, **opts.kwargs()) == root.pid
        pipe_tree.track(tree)
        # stopped until the fds are fixed (CRIU's SIGSTOP takes effect when the task is
        # next scheduled, which may be after criu exits)
        wait_until(
            lambda: all(
                open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] == "T" for p in tree
            ),
            "every restored process to show state T",
        )
        done = opts.after_restore(criu.image_pids(imgs))
    finally:
        opts.close()
    assert [(d["pid"], d["fd"]) for d in done] == [(p, 1) for p in sorted(tree)]
    for p in tree:
        assert _fdinfo_flags(p, 1) & os.O_APPEND, p
        assert os.stat(f"/proc/{p}/fd/1").st_ino == log.stat().st_ino
    wait_until(
        lambda: min(len(lines(log, "root")), len(lines(log, "child"))) > 20,
        "20 lines of each restored writer in the placeholder's log",
        30,
    )
    kill_tree(tree)
    data = log.read_bytes()
    assert data[: len(HEADER)] == HEADER  # not one byte overwritten
    rest = data[len(HEADER) :]
    assert rest and rest.split(b" ", 1)[0] in (b"root", b"child")
    for w in ("root", "child"):
        after = lines(log, w)
        assert after[0] == before[w][-1] + 1, (w, before[w][-3:], after[:3])
        seq = before[w] + after
        assert seq == list(range(len(seq))), f"{w}: gap or duplicate across the restore"


# --------------------------------------------------------------------------- refusals


def test_other_user_namespace_pid_1_and_kernel_threads_are_refused(placeholder):
    ph = placeholder("cui-userns", user=True, stdout=False)
    other = os.stat(f"/proc/{ph.pid}/ns/user").st_ino
    mine = os.stat("/proc/self/ns/user").st_ino
    assert other != mine
    with pytest.raises(PlacementError) as ei:
        Placement.of_pid(ph.pid)
    assert ei.value.pid == ph.pid
    assert ei.value.reason.startswith(
        f"is in another user namespace [{other}] than the agent's [{mine}]"
    )
    with pytest.raises(PlacementError) as ei:
        Placement.of_pid(1)
    assert (ei.value.pid, ei.value.reason.split(":")[0]) == (
        1,
        "is the init of the agent's pid namespace (the node's, or the agent container's)",
    )
    kthreadd = 2
    assert comm_of(kthreadd) == "kthreadd"
    with pytest.raises(PlacementError) as ei:
        Placement.of_pid(kthreadd)
    assert ei.value.pid == 2 and ei.value.reason.startswith("is a kernel thread (PF_KTHREAD)")
    # a restored process in another user namespace than the placement's is not placed
    ok = placeholder("cui-user-ok", stdout=False)
    pl = Placement.of_pid(ok.pid)
    assert pl.user == Namespace("user", f"/proc/{ok.pid}/ns/user", mine)
    assert pl.mismatches(ok.pid) == []
    wrong = dataclasses.replace(pl, user=Namespace("user", pl.user.path, other))
    assert wrong.mismatches(ok.pid) == [f"user namespace [{mine}], not the placement's [{other}]"]


# --------------------------------------------------------------------------- several uses

#: a tree process (run in ``unshare --mount``); argv: actions on fds it inherited from outside
#: its mount namespace. ``rw:N``: write "R%06d\n" through fd N each tick (besides "%d\n" to
#: fd 1); ``fchdir:N`` / ``chroot:N``: make the directory fd N its cwd (and root), close it;
#: ``mmap:N``: map fd N (libc mmap: Python's mmap keeps a dup of the fd) and close it;
#: ``mmap-open:N``: the same, keeping fd N open.
OUTSIDE_TREE = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
rw = []
for a in sys.argv[1:]:
    kind, _, n = a.partition(":")
    fd = int(n)
    if kind == "rw":
        rw.append(fd)
    elif kind in ("fchdir", "chroot"):
        os.fchdir(fd)
        os.close(fd)
        if kind == "chroot":
            os.chroot(".")
    elif kind in ("mmap", "mmap-open"):
        assert libc.mmap(None, 4096, 1, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)
        if kind == "mmap":
            os.close(fd)
i = 0
while True:
    i += 1
    os.write(1, b"%d\n" % i)
    for fd in rw:
        os.write(fd, b"R%06d\n" % i)
    time.sleep(0.02)
"""


def _start_outside(tmp_path, redirects: str, *acts: str) -> subprocess.Popen:
    """OUTSIDE_TREE in ``unshare --mount``, after ``sh`` opened ``redirects`` (e.g.
    ``1>>LOG 5<>LOG``) here, outside that namespace; stdin /dev/null, stderr ``tree.err``."""
    script = tmp_path / "outside_tree.py"
    script.write_text(OUTSIDE_TREE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LD_")}
    cmd = (
        f"exec {redirects} && exec unshare --mount --propagation private "
        f"{sys.executable} {script} {' '.join(acts)}"
    )
    with open(tmp_path / "tree.err", "ab") as err:
        return subprocess.Popen(
            ["sh", "-c", cmd], stdin=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True
        )


def _records(data: bytes) -> list[int]:
    """The "R%06d\n" records at the start of ``data``."""
    out = []
    while data[8 * len(out) : 8 * len(out) + 1] == b"R":
        rec = data[8 * len(out) : 8 * len(out) + 8]
        assert len(rec) == 8 and rec.endswith(b"\n"), rec
        out.append(int(rec[1:7]))
    return out


PAD = 40000  # bytes of "." the tree's log starts with (fd 5 overwrites them)


def test_an_external_file_also_held_rdwr_is_reopened_not_the_placeholders_log(
    tmp_path, placeholder, criu_ok
):
    """A tree holds one outside log twice: fd 1 O_WRONLY|O_APPEND and fd 5 O_RDWR from
    offset 0 (one key file[MNT:INODE]). CRIU reopens both on the one fd handed, so the
    placeholder's log (its stdout, O_WRONLY|O_APPEND) must not be handed: fd 5 would
    overwrite it from offset 0 (or, its size differing, "bad size"). The path is reopened;
    the placeholder's log keeps its bytes, the tree's log continues both sequences. A second
    restore of the same images (the log grew) fails "bad size" on fd/N, and the reason names
    the external file and what was handed, without the workload-O_APPEND advice."""
    from cuinterpose.agent.mech import criu_bad_size

    log = tmp_path / "tree.log"
    log.write_bytes(b"." * PAD)
    job = _start_outside(tmp_path, f"1>>{log} 5<>{log}", "rw:5")
    restored = None
    try:
        wait_until(lambda: len(_records(log.read_bytes())) >= 10, "10 records", 30)
        ext = fds.external_files(job.pid, [job.pid])
        mine = [e for e in ext if e["path"] == str(log)]
        assert [(e["fd"], e["flags"] & (os.O_ACCMODE | os.O_APPEND)) for e in mine] == [
            (1, os.O_WRONLY | os.O_APPEND),
            (5, os.O_RDWR),
        ]
        key = external_file_key(mine[0])
        assert (
            external_file_key(mine[1]) == key == f"file[{mount_id_of(log):x}:{log.stat().st_ino:x}]"
        )
        imgs = tmp_path / "imgs"
        criu.dump(
            job.pid, imgs, external_files=list(dict.fromkeys(external_file_key(e) for e in ext))
        )
        assert job.wait(30) == -signal.SIGKILL
        dumped = log.read_bytes()
        n_rec = len(_records(dumped))
        n_app = len(_numbers_in(dumped[PAD:]))
        assert _records(dumped) == list(range(1, n_rec + 1))
        wait_gone([job.pid])

        ph_header = b"".join(b"PH HEADER %03d\n" % i for i in range(100))
        ph_log = tmp_path / "ph.log"
        ph_log.write_bytes(ph_header)
        out_fd = os.open(ph_log, os.O_WRONLY | os.O_APPEND)
        err_fd = os.open(tmp_path / "tree.err", os.O_WRONLY | os.O_APPEND)
        ph = placeholder("cui-multi", mount=True, stdout_fd=out_fd, stderr_fd=err_fd)
        os.close(out_fd)
        os.close(err_fd)
        pl = Placement.of_pid(ph.pid, namespaces=())
        opts = restore_options(pl, root=job.pid, external_files=ext)
        try:
            got = {f["fd"]: (f["placement_fd"], f["handed"]) for f in opts.files}
            reopened = f"{log} reopened in the agent's mount namespace (O_WRONLY|O_APPEND)"
            assert got == {
                0: (0, "placement fd 0 (/dev/null)"),
                1: (None, reopened),
                2: (2, f"placement fd 2 ({tmp_path / 'tree.err'})"),
                5: (None, reopened),
            }
            (fd,) = [fd for fd, k in opts.inherit_fds if k == key]
            assert os.fstat(fd).st_ino == log.stat().st_ino
            restored = criu.restore(imgs, leave_stopped=True, **opts.kwargs())
        finally:
            opts.close()
        assert restored == job.pid
        with open(f"/proc/{restored}/fdinfo/5") as f:  # at the dumped offset, stopped
            assert f.readline() == f"pos:\t{8 * n_rec}\n"
        assert os.stat(f"/proc/{restored}/fd/5").st_ino == log.stat().st_ino
        os.kill(restored, signal.SIGCONT)
        wait_until(lambda: len(_records(log.read_bytes())) >= n_rec + 10, "10 more records", 30)
        kill_tree([restored])
        assert ph_log.read_bytes() == ph_header  # not one byte written
        data = log.read_bytes()
        recs = _records(data)
        assert recs == list(range(1, len(recs) + 1)) and len(recs) >= n_rec + 10
        assert data[8 * len(recs) : PAD] == b"." * (PAD - 8 * len(recs))
        apps = _numbers_in(data[PAD:])
        assert apps == list(range(1, len(apps) + 1)) and len(apps) > n_app
        wait_gone([job.pid])

        # the restored run appended: the O_RDWR fd's size check now fails
        opts = restore_options(pl, root=job.pid, external_files=ext)
        try:
            with pytest.raises(criu.CriuError) as ei:
                criu.restore(imgs, **opts.kwargs())
            size = log.stat().st_size
            (row,) = ei.value.bad_size
            # CRIU names it by the copy of the handed fd it reopened, which its log ties to
            # the key right before
            assert (row["size"], row["expected"]) == (size, len(dumped))
            assert row["path"].startswith("/fd/") and row["path"][4:].isdigit()
            assert criu_bad_size.inherited_bad_size_keys(
                pathlib.Path(ei.value.log_path).read_text()
            ) == {(int(row["path"][4:]), size, len(dumped)): key}
            reason = criu_bad_size.reason(
                job.pid, imgs, ei.value.bad_size, ei.value, files=criu_bad_size.handed_files(opts)
            )
        finally:
            opts.close()
        assert reason == (
            f"tree {job.pid} from {imgs}: CRIU refuses a file opened outside the tree's mount "
            "namespace whose size is not its size at the dump (CRIU reopens every fd of such "
            "a file on the one fd handed for it, and checks the size of each fd the tree did "
            f"not hold O_WRONLY|O_APPEND): {log} (opened outside the tree's mount namespace; "
            f"held by pid {job.pid} fd 5 O_RDWR) was handed {reopened}, which is {size} bytes, "
            f"the snapshot expects {len(dumped)}: {log} here is not the size it had at the "
            "dump (a restored run of the tree wrote to it, or it is another file): this "
            f"snapshot restores only while it has {len(dumped)} bytes (truncate it back to "
            "that size to restore it again, losing what was written after the checkpoint) "
            f"(CRIU log: {ei.value.log_path})"
        )
        assert "O_APPEND / `>>`" not in reason
        wait_gone([job.pid])
    finally:
        stop_job(job, restored)


def _numbers_in(data: bytes) -> list[int]:
    return [int(x) for x in data.split(b"\n")[:-1]]


def test_a_placeholders_regular_file_is_not_handed_when_one_use_is_not_append(
    tmp_path, placeholder
):
    """The refusal when the path cannot be reopened either names the use that kept the
    placeholder's regular file from being handed."""
    ph_log = tmp_path / "ph.log"
    ph_log.write_bytes(b"header\n")
    fd = os.open(ph_log, os.O_WRONLY | os.O_APPEND)
    ph = placeholder("cui-nouse", stdout_fd=fd)
    os.close(fd)
    pl = Placement.of_pid(ph.pid, namespaces=())
    gone = tmp_path / "gone.log"
    rec = {
        "root": 5,
        "pid": 6,
        "fd": 1,
        "path": str(gone),
        "mnt_id": 999,
        "inode": 12,
        "flags": os.O_WRONLY | os.O_APPEND,
        "access": "w",
        "st_mode": ph_log.stat().st_mode,
        "rdev": 0,
    }
    rdwr = dict(rec, fd=5, flags=os.O_RDWR, access="rw")
    with pytest.raises(PlacementError) as ei:
        restore_options(pl, root=5, external_files=[rec, rdwr])
    assert ei.value.pid == ph.pid
    assert ei.value.reason == (
        f"tree 5: pid 6 fd 1 holds {gone} (opened outside the tree's mount namespace, mount "
        "999, inode 12), which cannot be reopened here: No such file or directory and the "
        f"placement's fds do not fit (its fd 1 ({ph_log}) is a regular file, and the tree's "
        "pid 6 fd 5 on the file is O_RDWR, not O_WRONLY|O_APPEND: CRIU would reopen that fd "
        "on this file too, at its offset, and check its size)"
    )
    # every use O_WRONLY|O_APPEND: the placeholder's file is handed
    opts = restore_options(pl, root=5, external_files=[rec, dict(rec, fd=7)])
    try:
        assert [(f["fd"], f["placement_fd"]) for f in opts.files] == [(1, 1), (7, 1)]
    finally:
        opts.close()
    assert ph_log.read_bytes() == b"header\n"


# --------------------------------------------------------------------------- socket stdout


def test_a_placeholder_whose_stdout_is_a_socket_is_refused(tmp_path, pipe_tree, placeholder):
    """CRIU reopens the fd handed for an external pipe through /proc/self/fd/N: a socket
    (journald's stdout) fails that ("No such device or address"). The placement refuses it
    first, naming its fd and the tree's, with every fd it opened closed again."""
    root, pids, reader, _ = pipe_tree()
    tree = [pids["root"], pids["child"]]
    ext = fds.external_pipes(root.pid, tree)
    ino = ext[0]["inode"]
    imgs = tmp_path / "imgs"
    criu.dump(root.pid, imgs)
    assert root.wait() == -signal.SIGKILL
    reader.wait(timeout=30)
    wait_gone(tree)
    a, b = socket.socketpair()
    ph = placeholder("cui-sock", stdout_fd=a.fileno())
    a.close()
    sock = os.readlink(f"/proc/{ph.pid}/fd/1")
    assert sock.startswith("socket:[")
    pl = Placement.of_pid(ph.pid)
    fds_before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(PlacementError) as ei:
        restore_options(pl, ext, root=root.pid)
    assert sorted(os.listdir("/proc/self/fd")) == fds_before
    assert (ei.value.phase, ei.value.pid) == ("placement", ph.pid)
    first = min(tree)
    assert ei.value.reason == (
        f"tree {root.pid}: pid {first} fd 1 writes pipe:[{ino}], whose other end was outside "
        f"the tree, but the placement pid {ph.pid} fd 1 ({sock}) is a socket: CRIU reopens "
        "the fd handed for such a pipe through /proc/self/fd/N (criu/pipes.c reopen_pipe), "
        'which fails for it ("No such device or address"); give the placeholder a pipe, a '
        "regular file or /dev/null as its fd 1"
    )
    # what CRIU does with it when handed anyway
    fd = pl.open_stdio(pl.stdio[1], "write")
    try:
        with pytest.raises(criu.CriuError) as ei:
            criu.restore(imgs, inherit_fds=[(fd, f"pipe:[{ino}]")])
    finally:
        os.close(fd)
    assert re.search(
        r"Unable to reopen the pipe /proc/self/fd/\d+: No such device or address",
        pathlib.Path(ei.value.log_path).read_text(),
    )
    wait_gone(tree)
    b.close()


# --------------------------------------------------------------------------- cwd, root, maps


@pytest.mark.parametrize("case", ["cwd", "root", "mapping", "mapping-open"])
def test_cwd_root_and_mappings_outside_the_mount_namespace(tmp_path, criu_ok, case):
    """``fds.outside_mounts`` finds what CRIU cannot dump ("Can't lookup mount=N for
    fd=-3"): a cwd, a root, a file only mapped, all from outside the tree's mount namespace.
    A mapping whose file the tree also holds open is an external file, which CRIU dumps."""
    d = tmp_path / "outside-dir"
    d.mkdir()
    f = tmp_path / "mapped.dat"
    f.write_bytes(b"m" * 8192)
    redirect, act = {
        "cwd": (f"6<{d}", "fchdir:6"),
        "root": ("6</", "chroot:6"),
        "mapping": (f"6<{f}", "mmap:6"),
        "mapping-open": (f"6<{f}", "mmap-open:6"),
    }[case]
    log = tmp_path / "tree.log"
    job = _start_outside(tmp_path, f"1>>{log} {redirect}", act)
    try:
        wait_until(lambda: len(_numbers(log)) >= 5, "5 numbers", 30)
        pid = job.pid
        found = fds.outside_mounts(pid, [pid])
        ext = fds.external_files(pid, [pid])
        keys = list(dict.fromkeys(external_file_key(e) for e in ext))
        if case == "mapping-open":
            assert found == []
            assert [e["fd"] for e in ext if e["path"] == str(f)] == [6]
            criu.dump(pid, tmp_path / "imgs", leave_running=True, external_files=keys)
            assert alive(pid)
            return
        if case == "cwd":
            mid = mount_id_of(d)
            assert found == [
                {
                    "root": pid,
                    "pid": pid,
                    "kind": "cwd",
                    "path": str(d),
                    "mnt_id": mid,
                    "what": f"has its working directory {d} on mount {mid}",
                }
            ]
            path = str(d)
        elif case == "root":
            mid = mount_id_of("/")
            assert [(r["kind"], r["path"], r["mnt_id"], r["what"]) for r in found[:2]] == [
                ("cwd", "/", mid, f"has its working directory / on mount {mid}"),
                ("root", "/", mid, f"has its root directory / on mount {mid}"),
            ]
            # its mountinfo shows only the mounts below its root: none of its namespace's, so
            # its interpreter and libraries (mapped before the chroot) are named too
            assert {r["kind"] for r in found[2:]} == {"mapping"}
            assert str(pathlib.Path(sys.executable).resolve()) in {r["path"] for r in found}
            path = "/"
        else:
            mid = mount_id_of(f)
            (rng,) = [
                r
                for r in os.listdir(f"/proc/{pid}/map_files")
                if os.readlink(f"/proc/{pid}/map_files/{r}") == str(f)
            ]
            assert found == [
                {
                    "root": pid,
                    "pid": pid,
                    "kind": "mapping",
                    "path": str(f),
                    "mnt_id": mid,
                    "what": f"has a mapping of {f} ({rng}) on mount {mid}, with no fd open on it",
                }
            ]
            assert not [e for e in ext if e["path"] == str(f)]
            path = str(f)
        # what CRIU says (its other outside files are external): the tree keeps running
        with pytest.raises(criu.CriuError) as ei:
            criu.dump(pid, tmp_path / "imgs", leave_running=True, external_files=keys)
        assert f"Can't lookup mount={mid} for fd=-3 path={path}" in str(ei.value)
        assert alive(pid)
    finally:
        stop_job(job, None)
