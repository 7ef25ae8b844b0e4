"""Case 012 at restore: the control dir the snapshot records is missing (a new node, a cleaned
/tmp): restore creates it as the agent does (``ctldir.ensure``: mode 0700, owned by the agent)
and the workload completes; a planted or unsafe one (writable by group or other, a symlink of
another uid) is refused (exit 3, phase "stale sockets", the snapshot untouched, the planted
directory as it was), and the restore can then be run again. A real checkpoint (afdwin on
fakecuda, CRIU)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import signal
import stat

import pytest

from cuinterpose.workloads.afdwin import demo

STEPS, HOLD = 80, 20
OTHER_UID = 4242


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    return private_tmp


def digest(d: pathlib.Path) -> dict:
    return {
        str(p.relative_to(d)): (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir",
            p.lstat().st_mtime_ns,
        )
        for p in sorted(d.rglob("*"))
    }


def refusal(ctl: pathlib.Path, why: str) -> str:
    u = os.geteuid()
    return (
        f"control directory {ctl} {why}: it is not trusted (the agent writes its files and "
        f"believes the sockets in it); refused, nothing was done; make it yours with "
        f"`chown {u} {ctl} && chmod 0700 {ctl}` (the restored shims bind their sockets in it) "
        "and run restore again; the snapshot is untouched"
    )


def test_restore_creates_a_missing_control_dir_and_refuses_an_unsafe_one(afdwin, tmp_path):
    a = afdwin(steps=STEPS, step_delay_ms=0, hold_at=(HOLD,))
    assert a.wait_hold(1) == HOLD
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap, "--quiesce-timeout-ms", str(int(demo.HANG_S * 1000)))
    assert (rc, cp["ok"]) == (0, True), cp
    assert a.wait_dumped(demo.HANG_S) == -signal.SIGKILL
    ctl = a.ctl
    shutil.rmtree(ctl)

    def restore():
        return demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")

    # planted: a directory anyone may write into
    ctl.mkdir()
    os.chmod(ctl, 0o777)
    (ctl / "planted").write_bytes(b"x")
    before = digest(snap)
    rc, rs = restore()
    assert rc == 3, rs
    assert (rs["error"]["phase"], rs["error"]["outcome"], rs["error"]["reason"]) == (
        "stale sockets",
        "refused",
        refusal(ctl, "has mode 0777: writable by group or other"),
    )
    assert digest(snap) == before
    assert sorted(os.listdir(ctl)) == ["planted"] and stat.S_IMODE(ctl.stat().st_mode) == 0o777
    shutil.rmtree(ctl)

    # planted: a symlink of another uid to a directory of ours
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    ctl.symlink_to(target)
    os.lchown(ctl, OTHER_UID, OTHER_UID)
    rc, rs = restore()
    assert rc == 3, rs
    owners = " or ".join("root (uid 0)" if u == 0 else f"uid {u}" for u in {0: 0, os.geteuid(): 0})
    assert rs["error"]["reason"] == refusal(
        ctl, f"is a symlink owned by uid {OTHER_UID}, not {owners}"
    )
    assert digest(snap) == before and os.listdir(target) == []
    ctl.unlink()

    # missing: created 0700, owned by the agent; the restore runs and the workload completes
    rc, rs = restore()
    assert (rc, rs["ok"]) == (0, True), rs
    st = ctl.lstat()
    assert (stat.S_ISDIR(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid) == (
        True,
        0o700,
        os.geteuid(),
    )
    assert f"created control dir {ctl} (mode 0700): the snapshot's was missing" in rs["notes"]
    assert a.wait_restored_exit(demo.HANG_S) in (0, None)
    assert demo.check_run(a.events(), STEPS) == []
