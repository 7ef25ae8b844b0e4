"""Case 008 (shared/cases/008-*): a tampered manifest made restore delete any file it named.

Kind: a manifest is untrusted input. Every path it names is derived or checked (the socket
is ``<control_dir>/cuinterpose-<pid>.sock``, unlinked only if it is a socket; the control dir
is the one the images bind the shim sockets in and is never created; images stay under
``criu/``), types are exact, every copy of a checksum agrees, the entries under ``criu/``
equal the manifest's list, and with a node key an edited or unsigned manifest is refused by
name. A refused restore leaves every byte of the snapshot and the node as they were. The
refusals all come before CRIU, so the snapshots here are built by hand (no CRIU needed).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import socket

import pytest

from cuinterpose.agent.errors import RestoreFailed, SnapshotError
from cuinterpose.agent.run.restore import Restore
from cuinterpose.agent.snapshot import manifest, trust
from cuinterpose.agent.snapshot.snapdir import SnapshotDir

ROOT, RANK = 4190001, 4190002  # pids nothing runs with (a restore refuses pids in use)


def digest(d: pathlib.Path) -> dict:
    out = {}
    for p in sorted(d.rglob("*")):
        st = p.lstat()
        h = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(d))] = (h, st.st_mode, st.st_mtime_ns)
    return out


@pytest.fixture
def world(tmp_path, monkeypatch):
    """(snapshot dir, manifest dict, shim path, control dir) of a hand-made snapshot."""
    monkeypatch.delenv(trust.KEY_ENV, raising=False)
    trust.set_key_file(None)
    shim = tmp_path / "lib" / "libcuinterpose.so"
    shim.parent.mkdir()
    shim.write_bytes(b"shim")
    ctl = tmp_path / "ctl"
    ctl.mkdir(mode=0o700)
    snap = tmp_path / "snap"
    img = SnapshotDir(snap).criu_dir(ROOT)
    img.mkdir(parents=True)
    sock = trust.socket_path(str(ctl), RANK)
    (img / "files.img").write_bytes(b"\x00unixsk" + sock.encode() + b"\x00")
    (img / "pages-1.img").write_bytes(bytes(range(256)) * 4)
    m = {
        "format": manifest.FORMAT,
        "format_version": 1,
        "snapshot_id": "s8",
        "created_at": manifest.utc_now(),
        "shim": {"path": str(shim), "sha256": hashlib.sha256(b"shim").hexdigest()},
        "driver": {"kind": "fake"},
        "criu": {"trees": {str(ROOT): f"criu/{ROOT}"}, "files": manifest.image_files(snap)},
        "roots": [ROOT],
        "control_dir": str(ctl),
        "cuda_pids": [RANK],
        "participants": [{"pid": RANK, "socket_path": sock}],
        "capture": {},
        "carriers": [],
        "phases": [],
        "quiesce": {"id": "q"},
    }
    yield snap, m, shim, ctl
    trust.set_key_file(None)


def refused(snap, shim, tmp_path) -> SnapshotError:
    """Run the restore; it must refuse with every byte of the snapshot and of tmp_path kept."""
    before = digest(tmp_path)
    with pytest.raises(SnapshotError) as ei:
        Restore(snap, shim_path=shim, driver="fake").run()
    assert digest(tmp_path) == before
    assert ei.value.outcome == "refused"
    return ei.value


def test_socket_path_naming_a_regular_file_is_refused_and_the_file_kept(world, tmp_path):
    snap, m, shim, ctl = world
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"keep me")
    m["participants"][0]["socket_path"] = str(victim)
    manifest.write(snap, m)
    e = refused(snap, shim, tmp_path)
    assert e.phase == "manifest"
    assert e.reason == (
        f"{snap / 'manifest.json'}: participant {RANK}: socket_path {str(victim)!r} is not "
        f"{str(ctl / f'cuinterpose-{RANK}.sock')!r} (<control_dir>/cuinterpose-<pid>.sock); "
        "restore refused, snapshot untouched"
    )
    assert victim.read_bytes() == b"keep me"


def test_only_a_socket_is_unlinked_at_the_derived_path(world, tmp_path):
    snap, m, shim, ctl = world
    manifest.write(snap, m)
    sp = ctl / f"cuinterpose-{RANK}.sock"
    sp.write_bytes(b"not a socket")
    e = refused(snap, shim, tmp_path)
    assert (e.phase, e.pid) == ("stale sockets", RANK)
    assert e.reason == (
        f"{sp} is not a socket; restore refuses to remove it (CRIU binds participant {RANK}'s "
        "control socket there): move it away and run restore again; nothing was changed"
    )
    sp.unlink()
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sp))
    s.close()
    r = Restore(snap, shim_path=shim, driver="fake")
    r.read_manifest_checked()
    r.remove_stale()
    assert not sp.exists()


def test_edited_control_dir_is_refused_and_never_created(world, tmp_path):
    snap, m, shim, ctl = world
    other = tmp_path / "elsewhere" / "ctl"
    m["control_dir"] = str(other)
    m["participants"][0]["socket_path"] = trust.socket_path(str(other), RANK)
    manifest.write(snap, m)
    e = refused(snap, shim, tmp_path)
    assert (e.phase, e.pid) == ("manifest", RANK)
    assert e.reason == (
        f"{snap}: field control_dir {other} is not the control dir of participant {RANK} "
        f"(its CRIU images bind no socket at {other}/cuinterpose-{RANK}.sock); restore "
        "refused, snapshot untouched"
    )
    assert not other.parent.exists()


def test_missing_control_dir_is_created_then_removed_when_the_restore_fails(world, tmp_path):
    """A missing control dir is created as the checkpoint creates it (0700), not refused; here
    the snapshot's images are not a real dump, so CRIU restore fails and the dir the restore
    created is removed again: nothing of it is left, the snapshot untouched."""
    snap, m, shim, ctl = world
    manifest.write(snap, m)
    ctl.rmdir()
    before = digest(snap)
    with pytest.raises(RestoreFailed) as ei:
        Restore(snap, shim_path=shim, driver="fake").run()
    assert ei.value.phase == "criu restore"
    assert not ctl.exists()
    assert digest(snap) == before


@pytest.mark.parametrize("v, shown", [(True, "True (bool"), (1.0, "1.0 (float"), ("1", "'1' (str")])
def test_format_version_must_be_the_int(world, tmp_path, v, shown):
    snap, m, shim, _ = world
    m["format_version"] = v
    manifest.write(snap, m)
    e = refused(snap, shim, tmp_path)
    assert e.reason == (
        f"{snap / 'manifest.json'}: format_version {shown}, not an integer) is not supported "
        "(this agent reads version 1)"
    )


def test_image_bytes_must_be_an_int_not_a_bool(world, tmp_path):
    snap, m, shim, _ = world
    m["criu"]["files"][f"criu/{ROOT}/pages-1.img"]["bytes"] = True
    manifest.write(snap, m)
    assert "criu.files must map" in refused(snap, shim, tmp_path).reason


def test_top_level_carriers_must_agree_with_the_capture(world, tmp_path):
    snap, m, shim, _ = world
    m["carriers"] = [{"pid": RANK, "alloc_id": "00" * 8, "bytes": 4096, "checksum": "0" * 16}]
    manifest.write(snap, m)
    e = refused(snap, shim, tmp_path)
    assert e.reason == (
        f"{snap}: the carrier checksums in field carriers and in the records of capture "
        f"differ (first: pid {RANK} alloc {'00' * 8}); restore refused, snapshot untouched"
    )


def test_unlisted_image_is_refused(world, tmp_path):
    snap, m, shim, _ = world
    manifest.write(snap, m)
    extra = SnapshotDir(snap).criu_dir(ROOT) / "inventory.img"
    extra.write_bytes(b"planted")
    e = refused(snap, shim, tmp_path)
    assert e.reason == (
        f"{extra} is not listed in the manifest's criu.files (1 unlisted entry under criu/); "
        "restore refused, snapshot untouched"
    )


def test_symlinked_image_is_refused(world, tmp_path):
    snap, m, shim, _ = world
    outside = tmp_path / "outside.img"
    outside.write_bytes(bytes(range(256)) * 4)
    pages = SnapshotDir(snap).criu_dir(ROOT) / "pages-1.img"
    pages.unlink()
    pages.symlink_to(outside)
    manifest.write(snap, m)
    e = refused(snap, shim, tmp_path)
    assert e.reason == (
        f"{pages} is not a regular file or directory (a symlink or special file in the CRIU "
        "images); restore refused, snapshot untouched"
    )


@pytest.mark.parametrize("rel", ["criu/../../etc/passwd", "/etc/passwd", "criu/9/x.img"])
def test_image_paths_stay_under_criu_root(world, tmp_path, rel):
    snap, m, shim, _ = world
    m["criu"]["files"][rel] = {"sha256": "0" * 64, "bytes": 1}
    manifest.write(snap, m)
    e = refused(snap, shim, tmp_path)
    assert e.reason == (
        f"{snap / 'manifest.json'}: field criu.files names {rel!r}, not a file under "
        "criu/<root>/ (no '..', no absolute path); restore refused, snapshot untouched"
    )


def test_mac_with_a_node_key(world, tmp_path):
    snap, m, shim, _ = world
    key = tmp_path / "node.key"
    key.write_bytes(b"s3cret\n")
    trust.set_key_file(str(key))
    manifest.write(snap, m)
    written = json.loads((snap / "manifest.json").read_bytes())
    kid = hashlib.sha256(b"s3cret").hexdigest()[:16]
    assert written["mac"]["alg"] == "hmac-sha256"
    assert written["mac"]["key_id"] == kid
    assert manifest.load(snap)["snapshot_id"] == "s8"
    written["snapshot_id"] = "edited"
    (snap / "manifest.json").write_text(json.dumps(written))
    want = (
        f"manifest of {snap} was modified or not signed with this node's key ({key}, key id "
        f"{kid}); restore refused, snapshot untouched"
    )
    assert refused(snap, shim, tmp_path).reason == want
    del written["mac"]  # unsigned
    (snap / "manifest.json").write_text(json.dumps(written))
    assert refused(snap, shim, tmp_path).reason == want
    trust.set_key_file(None)  # without a key nothing changes: the unsigned manifest loads
    assert manifest.load(snap)["snapshot_id"] == "edited"


def test_key_from_the_environment(world, tmp_path, monkeypatch):
    snap, m, _, _ = world
    key = tmp_path / "k"
    key.write_bytes(b"k2")
    monkeypatch.setenv(trust.KEY_ENV, str(key))
    manifest.write(snap, m)
    assert "mac" in manifest.load(snap)
    key.write_bytes(b"another node")
    with pytest.raises(SnapshotError, match="not signed with this node's key"):
        manifest.load(snap)
    monkeypatch.delenv(trust.KEY_ENV)


def test_config_key_and_serve_option(tmp_path):
    from click.testing import CliRunner

    from cuinterpose.agent.cli.daemon import serve
    from cuinterpose.agent.config import ConfigError, parse_config

    assert parse_config({"manifestKeyFile": "/etc/cuinterpose/key"}).manifest_key_file == (
        "/etc/cuinterpose/key"
    )
    with pytest.raises(ConfigError, match="manifestKeyFile"):
        parse_config({"manifestKeyFile": "relative/key"})
    empty = tmp_path / "empty.key"
    empty.write_bytes(b"\n")
    res = CliRunner().invoke(serve, ["--manifest-key", str(empty), "--listen", "127.0.0.1:1"])
    assert res.exit_code == 2
    assert f"--manifest-key: node key file {empty} is empty" in res.output
    trust.set_key_file(None)
    os.environ.pop(trust.KEY_ENV, None)


def test_real_snapshot_tampered_then_restored_as_taken(afdwin, tmp_path, private_tmp, monkeypatch):
    """A snapshot made by a real checkpoint (CRIU) and signed with a node key: an edited
    socket_path is refused by the MAC, and without the key by the path check, the named file
    and every byte of the snapshot kept; the snapshot as taken then restores, and the workload
    completes with exact evidence."""
    from cuinterpose.workloads.afdwin import demo

    key = tmp_path / "node.key"
    key.write_bytes(b"node key")
    monkeypatch.setenv(trust.KEY_ENV, str(key))
    # held at step 20 until the checkpoint's quiesce: it finds the job running however loaded
    # the machine is (case 014)
    a = afdwin(steps=300, step_delay_ms=5, ranks=2, attention=1, hold_at=(20,))
    a.wait_hold()
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap)
    assert (rc, cp["ok"]) == (0, True), cp
    m0 = json.loads((snap / "manifest.json").read_bytes())
    pids = {q["pid"] for q in m0["processes"]}
    while any(os.path.exists(f"/proc/{p}") for p in pids):  # the dump killed them: reap
        demo.reap_zombies()
    original = (snap / "manifest.json").read_bytes()
    m = json.loads(original)
    assert m["mac"]["key_id"] == hashlib.sha256(b"node key").hexdigest()[:16]
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"keep me")
    m["participants"][0]["socket_path"] = str(victim)
    (snap / "manifest.json").write_text(json.dumps(m))
    for with_key, want in (
        (True, f"manifest of {snap} was modified or not signed with this node's key"),
        (False, f"socket_path {str(victim)!r} is not"),
    ):
        if not with_key:
            monkeypatch.delenv(trust.KEY_ENV)
        before = digest(snap)
        rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
        err = rs["error"]
        assert (rs["ok"], err["phase"], err["outcome"]) == (False, "manifest", "refused"), rs
        assert rc != 0 and want in err["reason"]
        assert digest(snap) == before and victim.read_bytes() == b"keep me"
    monkeypatch.setenv(trust.KEY_ENV, str(key))
    (snap / "manifest.json").write_bytes(original)
    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert (rc, rs["ok"]) == (0, True), rs["error"]["reason"]
    assert a.wait_restored_exit(300) in (0, None)
    (s,) = [e for e in a.events() if demo.kind(e) == "summary"]
    assert (s["ok"], s["restores_seen"]) == (True, 1), s
