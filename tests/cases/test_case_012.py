"""Case 012 (shared/cases/012-control-dir-trust), this part: the control directory and the
files root writes in it. Kind: root trusts a directory another user controls. A control dir
not owned by root or the agent's uid, or writable by group or other, is refused with the
reason by checkpoint, inspect, release and doctor (nothing done); ``doctor`` creates a missing
one 0700; every file the agent (and the workload, through the same ``contract.write_atomic``)
writes there is written through a temp file created ``O_CREAT|O_EXCL|O_NOFOLLOW`` with a
random name and renamed into place, so a symlink planted at any name the agent writes never
redirects a write: afdwin is checkpointed ``--leave-running`` (fakecuda, real CRIU) with a
symlink at every such name and every target stays byte for byte as it was."""

from __future__ import annotations

import os
import stat

import pytest

from cuinterpose.coordinator import contract
from cuinterpose.workloads.afdwin import demo

NOBODY = 65534


def reason(d, why):
    return (
        f"control directory {d} {why}: it is not trusted (the agent writes its files and "
        f"believes the sockets in it); refused, nothing was done; make it yours with "
        f"`chown {os.geteuid()} {d} && chmod 0700 {d}` or pass another --control-dir"
    )


@pytest.fixture(params=["owner", "mode"])
def bad_dir(request, tmp_path):
    d = tmp_path / "ctl"
    d.mkdir(mode=0o700)
    if request.param == "owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to chown")
        os.chown(d, NOBODY, NOBODY)
        return d, reason(d, f"is owned by uid {NOBODY}, not root (uid 0)")
    os.chmod(d, 0o777)
    return d, reason(d, "has mode 0777: writable by group or other")


def test_checkpoint_inspect_and_release_refuse_an_untrusted_dir(bad_dir, tmp_path):
    d, why = bad_dir
    pid = os.getpid()
    common = ("--control-dir", str(d))
    rc, cp = demo.run_agent(
        "checkpoint", "--pid", str(pid), "--images-dir", str(tmp_path / "s"), "--driver", "fake",
        *common,
    )  # fmt: skip
    assert rc == 3 and cp["error"]["phase"] == "census" and cp["error"]["reason"] == why
    assert cp["error"]["outcome"] == "refused"
    rc, ins = demo.run_agent("inspect", "--pid", str(pid), *common)
    assert rc == 3 and (ins["error"]["phase"], ins["error"]["reason"]) == ("INSPECT", why)
    rc, rel = demo.run_agent("release", "--pid", str(pid), *common)
    assert rc == 3 and (rel["error"]["phase"], rel["error"]["reason"]) == ("release", why)
    assert os.listdir(d) == []  # nothing was written


def test_doctor_refuses_an_untrusted_dir_and_leaves_a_missing_one_to_its_creators(
    bad_dir, tmp_path
):
    """doctor made a missing dir 0755; it now creates nothing (a diagnostic changes nothing,
    stop 21) and says who will: the shim at cuInit and the agent's restore (ctldir.ensure),
    each making it 0700 whatever the umask."""
    from cuinterpose.agent.mech import ctldir

    d, why = bad_dir
    rc, doc = demo.run_agent("doctor", "--control-dir", str(d))
    ctl = {c["name"]: c for c in doc["checks"]}["control dir"]
    assert (ctl["ok"], ctl["detail"]) == (False, why)
    fresh = tmp_path / "new" / "ctl"
    rc, doc = demo.run_agent("doctor", "--control-dir", str(fresh))
    ctl = {c["name"]: c for c in doc["checks"]}["control dir"]
    assert (ctl["ok"], ctl["detail"]) == (
        True,
        f"{fresh} does not exist: no shim has bound a socket there yet (a shim creates it, "
        f"0700, at its cuInit; so does a restore); {tmp_path} is writable",
    )
    assert not (tmp_path / "new").exists()
    old = os.umask(0)
    try:
        ctldir.ensure(fresh)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    rc, doc = demo.run_agent("doctor", "--control-dir", str(fresh))
    ctl = {c["name"]: c for c in doc["checks"]}["control dir"]
    assert (ctl["ok"], ctl["detail"]) == (True, f"{fresh} writable")


def test_write_atomic_never_follows_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's file")
    target = tmp_path / "quiesce-1.lock"
    os.symlink(victim, str(target) + ".tmp")  # the old, predictable temp name
    contract.write_atomic(target, {"id": "a"})
    os.symlink(victim, tmp_path / "quiesce-1.resume")  # the final name itself
    contract.write_atomic(tmp_path / "quiesce-1.resume", {"id": "b"})
    assert victim.read_bytes() == b"root's file"
    assert contract.read_json(target) == {"id": "a"}
    assert not (tmp_path / "quiesce-1.resume").is_symlink()
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "quiesce-1.lock", "quiesce-1.lock.tmp", "quiesce-1.resume", "victim",
    ]  # fmt: skip


def test_symlinks_at_every_name_never_redirect_a_leave_running_checkpoint(afdwin, tmp_path):
    # held at step 20 until the checkpoint's quiesce: a busy machine must not let the job end
    # before the checkpoint reaches it (case 014)
    a = afdwin(steps=300, step_delay_ms=5, hold_at=(20,))
    a.wait_hold()
    victims = tmp_path / "victims"
    victims.mkdir()
    planted = {}
    for kind in ("lock", "resume", "ready"):
        for name in (f"quiesce-{a.pid}.{kind}", f"quiesce-{a.pid}.{kind}.tmp"):
            planted[name] = f"{name} belongs to root\n".encode()
    planted[f"quiesce-{a.pid}.request.tmp"] = b"request temp\n"
    for name, data in planted.items():
        (victims / name).write_bytes(data)
        os.symlink(victims / name, a.ctl / name)
    rc, cp = a.checkpoint(tmp_path / "snap", "--leave-running")
    assert rc == 0 and cp["ok"], cp
    assert {n: (victims / n).read_bytes() for n in planted} == planted
    assert sorted(p.name for p in victims.iterdir()) == sorted(planted)
    a.wait_for(lambda ev: any(demo.kind(e) == "summary" for e in ev), 300, "the summary")
    assert demo.check_run(a.events(), 300, expect_restore=False) == []
    assert {n: (victims / n).read_bytes() for n in planted} == planted


def test_write_atomic_does_not_fsync(tmp_path, monkeypatch):
    """decisions D33: control-dir files are renamed into place without fsync (an fsync waits
    behind the snapshot's writeback); a reader still sees the whole new object."""
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    target = tmp_path / "quiesce-1.lock"
    contract.write_atomic(target, {"id": "a", "steps": ["capture"]})
    contract.write_atomic(target, {"id": "a", "steps": ["capture", "criu dump"]})
    assert contract.read_json(target) == {"id": "a", "steps": ["capture", "criu dump"]}
    assert synced == []
    assert [p.name for p in tmp_path.iterdir()] == ["quiesce-1.lock"]
