"""CRIU install and agent/criu.py: check, dump/kill/restore of a workload-shaped tree, refusals."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import socket
import stat
import subprocess

import criu_workload as workload
import pytest
from criu_helpers import REPO, alive, kill_tree, wait_until

from cuinterpose.agent.mech import criu


def ask(address: str, command: str) -> dict:
    """One request to a child-0 server (``address``: a path, or "\\0name" for abstract)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(address)
        s.sendall(command.encode() + b"\n")
        return json.loads(s.makefile("rb").readline())


def dir_digest(path: pathlib.Path) -> dict[str, tuple[int, str, int]]:
    """name -> (mode, sha256, mtime_ns) of every entry, to prove a directory was untouched."""
    out = {}
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        h = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        out[str(p.relative_to(path))] = (st.st_mode, h, st.st_mtime_ns)
    return out


def vma_at(pid: int, addr: int) -> dict:
    """The /proc/<pid>/smaps entry of the mapping containing ``addr``."""
    cur = None
    for line in pathlib.Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            cur = {"lo": lo, "hi": hi, "perms": head[1]} if lo <= addr < hi else None
        elif cur is not None and ":" in head[0]:
            key = head[0].rstrip(":")
            cur[key] = head[1:] if key == "VmFlags" else int(head[1])
            if key == "VmFlags":
                return cur
    raise AssertionError(f"no mapping at {addr:#x} in process {pid}")


def memfd_state(pid: int, fd: int) -> tuple[str, bytes, int]:
    link = os.readlink(f"/proc/{pid}/fd/{fd}")
    mfd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    try:
        return (
            link,
            os.pread(mfd, workload.MEMFD_BYTES + 100, 0),
            fcntl.fcntl(mfd, fcntl.F_GET_SEALS),
        )
    finally:
        os.close(mfd)


def consecutive(lines: list[str]) -> bool:
    return lines == [str(i) for i in range(len(lines))]


# ----------------------------------------------------------------------------------- check


def test_check_ok(criu_ok):
    ok, out = criu.check()
    assert ok, out
    assert "Looks good" in out
    ver = criu.version()
    assert ver[0].isdigit(), ver
    if criu_ok[0].endswith(".cache/criu/bin/criu"):
        assert int(ver.split(".")[0]) >= 4, ver


def test_install_is_idempotent_and_wrapper_drops_preload(criu_ok):
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-criu.sh")], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert "nothing to" in res.stderr, res.stderr  # fast path, no re-download
    env = dict(os.environ, LD_PRELOAD="/nonexistent/libpreload-test.so")
    res = subprocess.run([*criu_ok, "--version"], env=env, capture_output=True, text=True)
    if criu_ok[0].endswith(".cache/criu/bin/criu"):
        # /bin/sh running the wrapper is loaded before it can drop LD_PRELOAD (one complaint);
        # CRIU itself, exec'd through the cache's ld.so, must not see it (no second one).
        assert res.returncode == 0 and res.stderr.count("LD_PRELOAD") <= 1, res.stderr
    # and the module strips it for any CRIU it runs
    os.environ["LD_PRELOAD"] = "/nonexistent/libpreload-test.so"
    try:
        ok, out = criu.check()
    finally:
        del os.environ["LD_PRELOAD"]
    assert ok and "preload" not in out.lower(), out


# --------------------------------------------------------------------- dump / kill / restore


def test_dump_kill_restore_tree(spawn_tree, tmp_path):
    tree = spawn_tree()
    c0 = tree.meta["child-0"]
    path, abstract = c0["socket_path"], "\0" + c0["abstract"]
    assert abstract == f"\0fakecuda-{tree.children[0]}"
    before = ask(path, "ping")
    assert ask(abstract, "relay before")["answer"] == f"ack:before:{tree.children[1]}"
    link0, data0, seals0 = memfd_state(tree.children[0], c0["memfd_fd"])
    assert seals0 == workload.MEMFD_SEALS and data0 == workload.pattern(workload.MEMFD_BYTES, 7)
    tids0 = {pid: sorted(os.listdir(f"/proc/{pid}/task")) for pid in tree.pids}

    images = tmp_path / "images"
    criu.dump(tree.launcher, images)
    # CRIU killed the whole tree; reap the launcher (our child), as the agent must.
    tree.popen.wait()
    assert not any(alive(p) for p in tree.pids)
    at_dump = [tree.counter(i) for i in (0, 1)]
    assert all(len(c) > 20 and consecutive(c) for c in at_dump)
    img_bytes = sum(p.stat().st_size for p in images.iterdir())
    assert img_bytes < 256 << 20, f"images are {img_bytes} bytes: the reservation was dumped?"
    # The agent deletes stale socket files before restore.
    os.unlink(path)

    root = criu.restore(images, work_dir=tmp_path / "restore-work")
    spawn_tree.track(tree.pids)
    assert root == tree.launcher
    assert all(alive(p) for p in tree.pids)
    assert int(_status(root)["PPid"]) != os.getpid()  # not our child (detached)
    assert {pid: sorted(os.listdir(f"/proc/{pid}/task")) for pid in tree.pids} == tids0

    # counters continue exactly where they stopped: no gap, no repeat
    n = [len(c) for c in at_dump]
    wait_until(
        lambda: all(len(tree.counter(i)) > n[i] + 100 for i in (0, 1)),
        "the restored counters to advance",
    )
    for i in (0, 1):
        lines = tree.counter(i)
        assert lines[: n[i]] == at_dump[i]
        assert consecutive(lines), f"counter-{i}.log has a gap or a repeat after restore"

    # sockets: the socketpair between the children, fresh connects to both listeners
    assert ask(path, "relay after-path")["answer"] == f"ack:after-path:{tree.children[1]}"
    assert (
        ask(abstract, "relay after-abstract")["answer"] == f"ack:after-abstract:{tree.children[1]}"
    )
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600

    # memfd: same fd, contents and seals
    link1, data1, seals1 = memfd_state(tree.children[0], c0["memfd_fd"])
    assert (link1, data1, seals1) == (link0, data0, seals0)
    after = ask(path, "ping")
    for key in (
        "pid",
        "threads",
        "memfd_fd",
        "memfd_sha256",
        "memfd_seals",
        "memfd_size",
        "reservation",
    ):
        assert after[key] == before[key], key
    assert after["private_ok"]
    # anonymous shared memory is still shared: child 0 sees child 1's counter move
    later = wait_until(
        lambda: (lambda r: r if r["shared"][1] > after["shared"][1] else None)(ask(path, "ping")),
        "child 1's shared counter to move",
    )
    assert later["shared"][1] > after["shared"][1] >= n[1] - 1

    # the 1 GiB PROT_NONE reservation is back, unpopulated
    vma = vma_at(tree.children[0], c0["reservation"])
    assert vma["perms"] == "---p" and "nr" in vma["VmFlags"]  # PROT_NONE, MAP_NORESERVE
    assert (
        vma["lo"] <= c0["reservation"] and c0["reservation"] + workload.RESERVE_BYTES <= vma["hi"]
    )
    assert vma["Rss"] == 0


def _status(pid: int) -> dict[str, str]:
    text = pathlib.Path(f"/proc/{pid}/status").read_text()
    return {k: v.strip() for k, v in (ln.split(":", 1) for ln in text.splitlines() if ":" in ln)}


@pytest.mark.parametrize("logs", ["append", "mixed"])
def test_restore_same_images_twice(spawn_tree, tmp_path, logs):
    """Images are reusable, but CRIU checks the size of every regular file the tree holds
    open unless it was opened O_WRONLY|O_APPEND: a plain-written log that grew after the dump
    makes the restore fail (counter-1.log in the "mixed" tree)."""
    tree = spawn_tree(CRIU_TEST_LOGS=logs)
    images = tmp_path / "images"
    criu.dump(tree.launcher, images)
    tree.popen.wait()
    n = len(tree.counter(1))
    assert criu.restore(images) == tree.launcher
    spawn_tree.track(tree.pids)
    wait_until(lambda: len(tree.counter(1)) > n + 20, "the restored counter to advance")
    kill_tree(tree.pids)
    m = len(tree.counter(1))  # the first restored run's last line is final
    if logs == "append":
        assert criu.restore(images) == tree.launcher
        wait_until(lambda: len(tree.counter(1)) > m + 20, "the second restore to run")
        lines = tree.counter(1)
        # the second run repeats from the dump point, appended after the first run's lines
        assert lines[m : m + 20] == [str(i) for i in range(n, n + 20)]
    else:
        import tempfile

        assert list(pathlib.Path(tempfile.gettempdir()).glob("cuinterpose-criu-restore-*")) == []
        with pytest.raises(criu.CriuError) as e:
            criu.restore(images)
        assert "counter-1.log has bad size" in str(e.value)
        assert [b["path"] for b in e.value.bad_size] == [str(tree.run_dir / "counter-1.log")]
        # the failed restore's work dir (its log) is kept and named; the successful ones went
        kept = list(pathlib.Path(tempfile.gettempdir()).glob("cuinterpose-criu-restore-*"))
        assert [pathlib.Path(e.value.log_path).parent] == kept
        wait_until(lambda: not any(alive(p) for p in tree.pids), "the failed restore to clean up")


def test_dump_leave_stopped_then_kill_and_restore(spawn_tree, tmp_path):
    """What agent/checkpoint.py does: dump with --leave-stopped (the tree stays SIGSTOPped so a
    later failure can still resume it), SIGKILL it once the snapshot is complete, restore."""
    tree = spawn_tree()
    images = tmp_path / "images"
    criu.dump(tree.launcher, images, extra_args=("--leave-stopped",))
    # CRIU sends SIGSTOP and then detaches: each task stops before it runs user code again,
    # but only once it is next scheduled, which on a busy machine is after criu exits
    wait_until(
        lambda: all(_status(p)["State"].startswith("T") for p in tree.pids),
        "every dumped process to show state T",
    )
    at_dump = [tree.counter(i) for i in (0, 1)]
    kill_tree(tree.pids)
    tree.popen.wait()
    assert [tree.counter(i) for i in (0, 1)] == at_dump  # nothing ran while stopped
    assert criu.restore(images) == tree.launcher
    spawn_tree.track(tree.pids)
    assert not any(_status(p)["State"].startswith("T") for p in tree.pids)
    wait_until(
        lambda: all(len(tree.counter(i)) > len(at_dump[i]) + 20 for i in (0, 1)),
        "the restored counters to advance",
    )
    assert consecutive(tree.counter(0)) and consecutive(tree.counter(1))


def test_dump_leave_running(spawn_tree, tmp_path):
    tree = spawn_tree()
    criu.dump(tree.launcher, tmp_path / "images", leave_running=True)
    assert all(alive(p) for p in tree.pids)
    n = len(tree.counter(1))
    wait_until(lambda: len(tree.counter(1)) > n + 20, "the counter to keep running")
    assert consecutive(tree.counter(1))
    assert (tmp_path / "images" / "pstree.img").is_file()
    assert sorted(criu.image_pids(tmp_path / "images"))[:3] == sorted(tree.pids)


def test_dump_fails_on_outside_peer_and_tree_keeps_running(spawn_tree, tmp_path):
    """A Unix connection from outside the tree (e.g. a coordinator still connected to a
    control socket) makes CRIU refuse the dump; the tree is left running, untouched."""
    tree = spawn_tree()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(tree.meta["child-0"]["socket_path"])
        with pytest.raises(criu.CriuError) as e:
            criu.dump(tree.launcher, tmp_path / "images")
        assert "exit code" in str(e.value) and str(tmp_path / "images") in str(e.value)
        assert all(alive(p) for p in tree.pids)
        n = len(tree.counter(1))
        wait_until(lambda: len(tree.counter(1)) > n + 20, "the tree to keep running")
        s.sendall(b"ping\n")
        assert json.loads(s.makefile("rb").readline())["pid"] == tree.children[0]
    assert consecutive(tree.counter(0)) and consecutive(tree.counter(1))


def test_dump_refusals(spawn_tree, tmp_path):
    with pytest.raises(criu.CriuError, match="no process"):
        criu.dump(2**22 + 7, tmp_path / "x")
    tree = spawn_tree()
    images = tmp_path / "images"
    images.mkdir()
    (images / "pstree.img").write_bytes(b"old")
    with pytest.raises(criu.CriuError, match="already holds CRIU images"):
        criu.dump(tree.launcher, images)
    assert all(alive(p) for p in tree.pids)


# ----------------------------------------------------------------------------- refusals


def test_restore_refuses_missing_images(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(criu.CriuError) as e:
        criu.restore(missing)
    assert str(missing) in str(e.value)
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "note.txt").write_text("not images")
    before = dir_digest(empty)
    with pytest.raises(criu.CriuError) as e:
        criu.restore(empty)
    assert str(empty) in str(e.value) and "inventory.img" in str(e.value)
    assert dir_digest(empty) == before


def test_restore_refuses_corrupt_images(spawn_tree, tmp_path):
    tree = spawn_tree()
    images = tmp_path / "images"
    criu.dump(tree.launcher, images)
    tree.popen.wait()

    # 1. garbage pstree.img: refused before CRIU runs
    bad = tmp_path / "bad-pstree"
    bad.mkdir()
    for p in images.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    (bad / "pstree.img").write_bytes(b"\x19\x43\x56\x54garbage!")
    before = dir_digest(bad)
    with pytest.raises(criu.CriuError) as e:
        criu.restore(bad)
    assert str(bad) in str(e.value) and "pstree.img" in str(e.value)
    assert dir_digest(bad) == before

    # 2. a truncated core image: CRIU itself fails; the error carries its log
    core = images / f"core-{tree.children[0]}.img"
    core.write_bytes(core.read_bytes()[: core.stat().st_size // 2])
    before = dir_digest(images)
    with pytest.raises(criu.CriuError) as e:
        criu.restore(images, work_dir=tmp_path / "work")
    err = e.value
    assert str(images) in str(err)
    assert err.returncode not in (None, 0) and "exit code" in str(err)
    assert err.cmd and "restore" in err.cmd and err.log_tail
    assert dir_digest(images) == before
    # nothing of the half-restored tree keeps running
    wait_until(lambda: not any(alive(p) for p in tree.pids), "a failed restore to clean up")


def _flock_held_by_other(path) -> bool:
    """True if another process holds an exclusive flock on ``path``."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_tree_holding_a_file_lock_dumps_and_restores_with_the_lock(spawn_tree, tmp_path):
    """A job holding a flock (a cache or database lock) is dumped with --file-locks and gets
    its lock back on restore: without the option CRIU refuses the dump."""
    assert "--file-locks" in criu.DUMP_OPTS and "--file-locks" in criu.RESTORE_OPTS
    lock = tmp_path / "job.lock"
    tree = spawn_tree(CRIU_TEST_FLOCK=str(lock))
    assert _flock_held_by_other(lock)
    images = tmp_path / "images"
    criu.dump(tree.launcher, images)
    tree.popen.wait()
    kill_tree(tree.pids)
    assert not _flock_held_by_other(lock)  # the dumped tree is gone, so is its lock
    assert criu.restore(images) == tree.launcher
    spawn_tree.track(tree.pids)
    assert _flock_held_by_other(lock)  # the restored launcher holds it again
    n = len(tree.counter(0))
    wait_until(lambda: len(tree.counter(0)) > n + 20, "the restored counter to advance")
    assert consecutive(tree.counter(0))
