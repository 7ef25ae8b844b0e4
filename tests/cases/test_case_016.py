"""Case 016 (shared/cases/016-snapshot-readable-by-others): a snapshot's process memory was
readable by every user (images dir and ``criu/`` 0755; ``pages-*.img``, ``core-*.img`` and
``manifest.json`` 0644).

Kind: a snapshot's files open to other users. Everything a snapshot holds is private to the
agent's user: directories 0700 (created so, and an existing images dir open to others made
0700, said in a warning), CRIU's images and log 0600 (CRIU's dump runs under umask 077, and
the sync pass fchmods every file), the manifest 0600, chunk files and the chunk store's packs
0600 in 0700 directories. One afdwin job is checkpointed ``--leave-running`` four ways (plain,
``--incremental``, into an images dir left 0755, and through a daemon started with umask 000
into its ``--snapshot-dir``, incremental); then a user the test creates (``useradd``) tries to
list every directory and read every file of them, and is refused each time. Needs root.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

from cuinterpose.workloads.afdwin import demo

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to add a user")


@pytest.fixture
def outsider():
    """(uid, gid) of a system user created for this test (a name shown free), deleted after."""
    while True:
        name = "cui016" + secrets.token_hex(3)
        try:
            pwd.getpwnam(name)
        except KeyError:
            break
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
    )
    try:
        pw = pwd.getpwnam(name)
        yield pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["userdel", name], check=False)


@pytest.fixture
def base():
    """A directory every user may traverse (pytest's tmp_path is 0700 root), as
    /var/lib/cuinterpose is."""
    d = tempfile.mkdtemp(prefix="cui-016-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _tree(d: str) -> tuple[list[str], list[str]]:
    dirs, files = [], []
    for top, _, fs in os.walk(d):
        dirs.append(top)
        files += [os.path.join(top, f) for f in fs]
    return dirs, files


def _as(uid: int, gid: int, dirs: list[str], files: list[str]) -> list[str]:
    """What user ``uid`` could do in a forked child: "list DIR" / "read FILE" for each success,
    "ERR path errno" for a failure other than EACCES."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        got = []
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            for d in dirs:
                try:
                    os.listdir(d)
                    got.append(f"list {d}")
                except OSError as e:
                    if e.errno != errno.EACCES:
                        got.append(f"ERR {d} {e.errno}")
            for f in files:
                try:
                    with open(f, "rb") as fh:
                        fh.read(1)
                    got.append(f"read {f}")
                except OSError as e:
                    if e.errno != errno.EACCES:
                        got.append(f"ERR {f} {e.errno}")
        finally:
            os.write(w, json.dumps(got).encode())
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def _serve(sd: str, sock_dir: str) -> tuple[subprocess.Popen, str]:
    """``cuinterpose-agent serve`` with umask 000, snapshot dir ``sd``: (process, address)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "cuinterpose.agent.cli", "serve", "--listen",
         f"unix:{sock_dir}/agent.sock", "--node", "n016", "--driver", "fake",
         "--snapshot-dir", sd, "--json"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
        preexec_fn=lambda: os.umask(0),
    )  # fmt: skip
    return p, json.loads(p.stdout.readline())["listen"]


def test_no_file_of_a_snapshot_is_readable_by_another_user(afdwin, base, outsider, tmp_path):
    a = afdwin(steps=40, step_delay_ms=2, hold_at=(5, 6, 7, 8))
    a.wait_hold()
    open_dir = os.path.join(base, "open")
    os.mkdir(open_dir)
    os.chmod(open_dir, 0o755)
    runs = {
        "plain": (os.path.join(base, "plain"), ()),
        "incremental": (os.path.join(base, "store-root", "inc"), ("--incremental",)),
        "open dir": (open_dir, ()),
    }
    for what, (d, extra) in runs.items():
        rc, cp = a.checkpoint(d, "--leave-running", *extra)
        assert rc == 0, (what, cp)
        if what == "open dir":
            assert cp["warnings"] == [
                {
                    "path": open_dir,
                    "message": f"images dir {open_dir} had mode 0755: made 0700 (a snapshot "
                    "holds the memory of the processes: it is private to the agent's user)",
                }
            ]
    sd = os.path.join(base, "daemon-sd")
    sock_dir = tempfile.mkdtemp(prefix="cui-016s-")
    srv, addr = _serve(sd, sock_dir)
    try:
        rc, cp = demo.run_agent(
            "checkpoint", "--agent", addr, "--pid", str(a.pid), "--images-dir",
            os.path.join(sd, "job1"), "--driver", "fake", "--control-dir", str(a.ctl),
            "--leave-running", "--incremental",
        )  # fmt: skip
        assert rc == 0, cp
    finally:
        srv.terminate()
        srv.wait(timeout=60)
        shutil.rmtree(sock_dir, ignore_errors=True)
    snaps = [d for d, _ in runs.values()] + [os.path.join(sd, "job1")]
    stores = [os.path.join(base, "store-root", ".cuinterpose-store"), sd + "/.cuinterpose-store"]
    dirs, files = [], []
    for d in snaps + stores:
        ds, fs = _tree(d)
        dirs += ds
        files += fs
    assert len(files) > 50 and any("pages-" in f for f in files)
    assert any("/packs/" in f for f in files) and any("/chunks/" in f for f in files)
    modes = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in dirs + files}
    assert {p: m for p, m in modes.items() if m != (0o700 if p in dirs else 0o600)} == {}
    uid, gid = outsider
    assert _as(uid, gid, dirs, files) == []
    # each of the four checkpoints ended one hold: the job runs to its end
    evs = a.wait_for(lambda ev: any(demo.kind(e) == "summary" for e in ev), 300, "summary")
    assert demo.check_run(evs, 40, expect_restore=False) == [], a.explain()
