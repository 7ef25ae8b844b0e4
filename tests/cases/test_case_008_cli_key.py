"""Case 008, the one-shot commands' node key: ``checkpoint --manifest-key FILE`` signs the
manifest (HMAC-SHA256, ``mac``) and ``restore --manifest-key FILE`` refuses a snapshot whose
manifest was edited (or signed with another key) by name, every byte of the snapshot kept; the
snapshot as taken restores with the key and the workload completes with exact evidence. The
key goes only by the option here (no ``CUINTERPOSE_MANIFEST_KEY_FILE`` in the environment)."""

from __future__ import annotations

import hashlib
import json
import pathlib
import signal

import pytest

from cuinterpose.agent.snapshot import trust
from cuinterpose.workloads.afdwin import demo

STEPS, HOLD = 80, 20


def digest(d: pathlib.Path) -> dict:
    return {
        str(p.relative_to(d)): (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir",
            p.lstat().st_mtime_ns,
        )
        for p in sorted(d.rglob("*"))
    }


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch, private_tmp):
    monkeypatch.delenv(trust.KEY_ENV, raising=False)


def restore(snap, *extra):
    return demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake", *extra)


def test_checkpoint_signs_and_restore_verifies_with_the_key_option(afdwin, tmp_path):
    key, other = tmp_path / "node.key", tmp_path / "other.key"
    key.write_bytes(b"node key\n")
    other.write_bytes(b"another node")
    a = afdwin(steps=STEPS, step_delay_ms=0, hold_at=(HOLD,))
    assert a.wait_hold(1) == HOLD
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(
        snap, "--manifest-key", str(key), "--quiesce-timeout-ms", str(int(demo.HANG_S * 1000))
    )
    assert (rc, cp["ok"]) == (0, True), cp
    assert a.wait_dumped(demo.HANG_S) == -signal.SIGKILL
    original = (snap / "manifest.json").read_bytes()
    m = json.loads(original)
    kid = hashlib.sha256(b"node key").hexdigest()[:16]
    assert (m["mac"]["alg"], m["mac"]["key_id"]) == ("hmac-sha256", kid)

    m["control_dir"] = str(tmp_path / "elsewhere")  # an edited manifest
    (snap / "manifest.json").write_text(json.dumps(m))
    for keyfile, kid_shown in (
        (key, kid),
        (other, hashlib.sha256(b"another node").hexdigest()[:16]),
    ):
        before = digest(snap)
        rc, rs = restore(snap, "--manifest-key", str(keyfile))
        assert rc == 3, rs
        assert rs["error"] == {
            "phase": "manifest",
            "pid": None,
            "outcome": "refused",
            "reason": (
                f"manifest of {snap} was modified or not signed with this node's key "
                f"({keyfile}, key id {kid_shown}); restore refused, snapshot untouched"
            ),
            "message": (
                f"manifest: manifest of {snap} was modified or not signed with this node's key "
                f"({keyfile}, key id {kid_shown}); restore refused, snapshot untouched"
            ),
        }
        assert digest(snap) == before
        if keyfile is key:
            (snap / "manifest.json").write_bytes(original)  # as taken, for the other key

    rc, rs = restore(snap, "--manifest-key", str(key))
    assert (rc, rs["ok"]) == (0, True), rs
    assert a.wait_restored_exit(demo.HANG_S) in (0, None)
    assert demo.check_run(a.events(), STEPS) == []


def test_the_key_option_is_refused_with_agent_and_an_empty_key(tmp_path):
    key = tmp_path / "node.key"
    key.write_bytes(b"k")
    rc, out = demo.run_agent(
        "restore", "--images-dir", str(tmp_path), "--manifest-key", str(key), "--agent", "unix:/x"
    )
    assert (rc, out["error"]["outcome"], out["error"]["reason"]) == (
        2,
        "usage",
        "--manifest-key signs and checks in this process; with --agent or --group each daemon "
        "uses its own `serve --manifest-key`: do not pass it here",
    )
    empty = tmp_path / "empty.key"
    empty.write_bytes(b"  \n")
    rc, out = demo.run_agent(
        "checkpoint",
        "--pid",
        "1",
        "--images-dir",
        str(tmp_path / "s"),
        "--manifest-key",
        str(empty),
    )
    assert (rc, out["error"]["outcome"], out["error"]["reason"]) == (
        2,
        "usage",
        f"--manifest-key: node key file {empty} is empty",
    )
    assert not (tmp_path / "s").exists()
