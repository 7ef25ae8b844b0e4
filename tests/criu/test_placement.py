"""Restoring a CRIU tree into a placement (agent/placement.py) with real CRIU: the restored
processes join the placeholder's namespaces (net, uts, ipc) and cgroups, and their stdout pipe,
whose reader was outside the dumped tree, is handed the placeholder's stdout.

A placeholder (tests/conftest.py ``placeholder``) is ``unshare --net --uts --ipc`` (hostname set
in its uts namespace) in a fresh test cgroup (``cgroup_dir``: v1 ``pids`` or v2), its stdout a
new pipe to a new reader. Cgroups and processes are removed at teardown.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from cuinterpose.agent import checkpoint, criu
from cuinterpose.agent.placement import Placement, PlacementError, restore_options

from criu_helpers import HERE, alive, kill_tree, wait_until
from placement_kit import cgroups_of, comm_of

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
            root = subprocess.Popen([sys.executable, str(PIPE_TREE), str(info)], stdout=w,
                                    stdin=subprocess.DEVNULL, stderr=err, env=env,
                                    start_new_session=True)
        os.close(w)
        started.append((root, reader))
        wait_until(info.exists, "the pipe tree to start", 30)
        pids = json.loads(info.read_text())
        wait_until(lambda: min(len(lines(out, "root")), len(lines(out, "child"))) > 20,
                   "20 lines of each writer", 30)
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
    return subprocess.run(["nsenter", f"--uts=/proc/{pid}/ns/uts", "hostname"],
                          capture_output=True, text=True, check=True).stdout.strip()


def wait_gone(pids, timeout=30):
    assert criu.wait_pids_free(pids, timeout) == [], f"pids {pids} still in use"


def test_restore_into_placeholder_namespaces_cgroups_and_stdout(
        tmp_path, pipe_tree, cgroup_dir, placeholder):
    root, pids, reader, before_out = pipe_tree()
    tree = [pids["root"], pids["child"]]
    ext = checkpoint.external_pipes(root.pid, tree)
    ino = os.stat(f"/proc/{root.pid}/fd/1").st_ino
    assert ext == [{"root": root.pid, "pid": p, "fd": 1, "inode": ino, "direction": "write"}
                   for p in sorted(tree)]
    imgs = tmp_path / "imgs"
    ns = criu.dump(root.pid, imgs)
    assert ns["external_net"] == "" and ns["enter"] == []   # the tree shared our namespaces
    assert root.wait() == -signal.SIGKILL
    reader.wait(timeout=30)                          # EOF: every writer of its pipe is dead
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
            (k, f"/proc/{ph.pid}/ns/{k}") for k in ("net", "ipc", "uts")]
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
    assert os.path.basename(cg) not in cgroups_of(os.getpid())             # we stayed out
    wait_until(lambda: min(len(lines(ph.out, "root")), len(lines(ph.out, "child"))) > 20,
               "20 lines of each restored writer at the new reader", 30)
    kill_tree(tree)
    ph.stop()
    assert ph.reader.returncode == 0                  # EOF: it copied all there was
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
    p = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: comm_of(p.pid) == "sleep", "sleep", 30)
        pl = Placement.of_pid(p.pid)
        ext = [{"root": 5, "pid": 5, "fd": 1, "inode": 77, "direction": "write"},
               {"root": 5, "pid": 6, "fd": 0, "inode": 78, "direction": "read"}]
        opts = restore_options(pl, ext, root=5)
        try:
            assert [r for _, r in opts.inherit_fds] == ["pipe:[77]", "pipe:[78]"]
            assert [(e["fd"], e["placement_fd"]) for e in opts.inherited] == [(1, 1), (0, 0)]
        finally:
            opts.close()
        # stdout closed: a write pipe falls back to stderr; stderr closed too: refused
        bare = Placement(pl.pid, pl.start_time, pl.cgroups, pl.namespaces,
                         tuple(s for s in pl.stdio if s.fd == 0), pl.proc_root)
        with pytest.raises(PlacementError) as ei:
            restore_options(bare, ext, root=5)
        assert ei.value.pid == p.pid
        assert ("tree 5: pid 5 fd 1 writes pipe:[77], whose other end was outside the tree, "
                "but the placement has no stdio fd open for writing") in ei.value.reason
    finally:
        p.kill()
        p.wait()


def test_tree_in_its_own_namespaces_dumps_them_as_external_and_restores_into_ours(
        tmp_path, placeholder, criu_ok):
    """A tree in another net/uts/ipc namespace: CRIU runs in its uts and ipc namespaces (not
    imaged) and marks its network namespace external; without a placement the restore hands
    CRIU the agent's own (--inherit-fd fd[N]:cuinterpose-net)."""
    holder = placeholder("cuinterpose-src")
    p = subprocess.Popen(["nsenter", *(f"--{k}=/proc/{holder.pid}/ns/{k}" for k in
                                       ("net", "uts", "ipc")),
                          sys.executable, "-c", "import time; time.sleep(600)"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: ns_inodes(p.pid) == ns_inodes(holder.pid) and
                   comm_of(p.pid).startswith("python"), "the tree to start in the namespaces", 30)
        imgs = tmp_path / "imgs"
        ns = criu.dump(p.pid, imgs)
        assert (ns["external_net"], ns["enter"]) == ("cuinterpose-net", ["uts", "ipc"])
        assert ns["net"] == ns_inodes(holder.pid)["net"]
        assert not list(imgs.glob("utsns-*.img")) and not list(imgs.glob("ipcns-*.img"))
        assert p.wait() == -signal.SIGKILL
        wait_gone([p.pid])
        with pytest.raises(criu.CriuError) as ei:       # such images need the inherited netns
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
