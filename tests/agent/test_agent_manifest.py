"""Manifest: atomic write, and refusals that leave the snapshot directory untouched."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal

import free_kit
import pytest

from cuinterpose.agent.errors import SnapshotError
from cuinterpose.agent.run.restore import Restore
from cuinterpose.agent.snapshot import manifest
from cuinterpose.agent.snapshot.snapdir import SnapshotDir


def tree_digest(d: pathlib.Path) -> dict:
    """{relative path: (sha256, mode, mtime_ns)} for every file and dir under ``d``."""
    out = {}
    for p in sorted(d.rglob("*")):
        st = p.lstat()
        h = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(d))] = (h, st.st_mode, st.st_mtime_ns)
    return out


def sample(
    snapshot: pathlib.Path,
    shim_sha: str = "ab" * 32,
    shim_path: str = "/x/libcuinterpose.so",
    pids: tuple | None = None,
) -> dict:
    """A manifest of tree ``pids[0]`` with participant ``pids[1]``, and its images; ``pids``
    default: two pids shown free (case 018: a restore refuses a pid in use, and pid 100 may be
    a live thread on the machine that runs the suite)."""
    root, rank = pids or free_kit.free_pids(2)
    img = SnapshotDir(snapshot).criu_dir(root)
    img.mkdir(parents=True)
    (img / f"core-{root}.img").write_bytes(b"core" * 100)
    # the file table binds participant rank's shim socket in the control dir (trust.py)
    (img / "files.img").write_bytes(f"\x00unixsk/tmp/ctl/cuinterpose-{rank}.sock\x00".encode())
    (img / "pages-1.img").write_bytes(bytes(range(256)) * 16)
    return {
        "format": manifest.FORMAT,
        "format_version": manifest.FORMAT_VERSION,
        "snapshot_id": "s1",
        "created_at": manifest.utc_now(),
        "shim": {"path": shim_path, "sha256": shim_sha, "size": 1},
        "driver": {"kind": "fake", "version": 13000, "library": "/x/libcuda.so.1"},
        "criu": {
            "version": "4.1",
            "trees": {str(root): f"criu/{root}"},
            "files": manifest.image_files(snapshot),
        },
        "roots": [root],
        "control_dir": "/tmp/ctl",
        "cuda_pids": [rank],
        "participants": [{"pid": rank, "socket_path": f"/tmp/ctl/cuinterpose-{rank}.sock"}],
        "capture": {},
        "carriers": [],
        "phases": [],
        "quiesce": {"id": "q"},
        "totals": {"carrier_bytes": 0, "image_bytes": 0},
    }


def test_write_is_atomic_and_round_trips(tmp_path):
    m = sample(tmp_path, pids=(100, 101))  # no restore: any pid will do
    path = manifest.write(tmp_path, m)
    assert path == tmp_path / "manifest.json"
    assert not (tmp_path / "manifest.json.tmp").exists()
    assert manifest.load(tmp_path) == json.loads(json.dumps(m))
    assert m["criu"]["files"] == {
        "criu/100/core-100.img": {
            "sha256": hashlib.sha256(b"core" * 100).hexdigest(),
            "bytes": 400,
        },
        "criu/100/pages-1.img": {
            "sha256": hashlib.sha256(bytes(range(256)) * 16).hexdigest(),
            "bytes": 4096,
        },
        "criu/100/files.img": {
            "sha256": hashlib.sha256(b"\x00unixsk/tmp/ctl/cuinterpose-101.sock\x00").hexdigest(),
            "bytes": 37,
        },
    }
    assert manifest.verify_images(tmp_path, m) == 4533


def test_interrupted_write_leaves_no_manifest(tmp_path, monkeypatch):
    m = sample(tmp_path)

    def boom(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", boom)
    with pytest.raises(OSError):
        manifest.write(tmp_path, m)
    assert not (tmp_path / "manifest.json").exists()
    with pytest.raises(SnapshotError, match="not a snapshot: no manifest.json"):
        manifest.load(tmp_path)


def test_write_refuses_missing_fields(tmp_path):
    m = sample(tmp_path)
    del m["capture"]
    with pytest.raises(SnapshotError, match="manifest lacks capture"):
        manifest.write(tmp_path, m)
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda m: m.update(format="other"), "format is 'other'"),
        (lambda m: m.update(format_version=2), "format_version 2 is not supported"),
        (lambda m: m.pop("participants"), "missing field(s) participants"),
    ],
)
def test_load_refuses_bad_manifest(tmp_path, mutate, msg):
    m = sample(tmp_path)
    mutate(m)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    before = tree_digest(tmp_path)
    with pytest.raises(SnapshotError) as ei:
        manifest.load(tmp_path)
    assert msg in str(ei.value)
    assert tree_digest(tmp_path) == before


def test_load_refuses_bad_json(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(SnapshotError, match="is not valid JSON"):
        manifest.load(tmp_path)


@pytest.fixture
def installed_shim(tmp_path):
    p = tmp_path / "installed" / "libcuinterpose.so"
    p.parent.mkdir()
    p.write_bytes(b"shim v2")
    return p


def test_restore_refuses_other_shim_hash_and_leaves_snapshot_untouched(tmp_path, installed_shim):
    snap = tmp_path / "snap"
    snap.mkdir()
    m = sample(snap, shim_sha="0" * 64, shim_path=str(installed_shim))
    manifest.write(snap, m)
    before = tree_digest(snap)
    with pytest.raises(SnapshotError) as ei:
        Restore(snap, shim_path=installed_shim).read_manifest()
    want = hashlib.sha256(b"shim v2").hexdigest()
    msg = str(ei.value)
    assert "0" * 64 in msg and want in msg and str(installed_shim) in msg
    assert tree_digest(snap) == before


def test_restore_refuses_bad_image_checksum_and_leaves_snapshot_untouched(tmp_path, installed_shim):
    snap = tmp_path / "snap"
    snap.mkdir()
    sha = hashlib.sha256(b"shim v2").hexdigest()
    m = sample(snap, shim_sha=sha, shim_path=str(installed_shim))
    manifest.write(snap, m)
    img = SnapshotDir(snap).criu_dir(m["roots"][0]) / "pages-1.img"
    data = bytearray(img.read_bytes())
    data[7] ^= 0xFF
    img.write_bytes(bytes(data))
    before = tree_digest(snap)
    rs = Restore(snap, shim_path=installed_shim, driver="fake")
    rs.read_manifest()  # the manifest itself is fine: the images are the verify phase's
    with pytest.raises(SnapshotError) as ei:
        rs.verify_images()
    assert ei.value.phase == "verify"
    assert str(img) in str(ei.value) and "bad checksum" in str(ei.value)
    assert [(p.name, p.status) for p in rs.r.phases] == [("manifest", "ok"), ("verify", "failed")]
    assert tree_digest(snap) == before


def test_restore_refuses_format_version_and_leaves_snapshot_untouched(tmp_path, installed_shim):
    snap = tmp_path / "snap"
    snap.mkdir()
    m = sample(snap, shim_sha=hashlib.sha256(b"shim v2").hexdigest(), shim_path=str(installed_shim))
    m["format_version"] = 99
    (snap / "manifest.json").write_text(json.dumps(m))
    before = tree_digest(snap)
    with pytest.raises(SnapshotError, match="format_version 99"):
        Restore(snap, shim_path=installed_shim).read_manifest()
    assert tree_digest(snap) == before


def test_restore_refuses_pid_in_use(tmp_path, installed_shim):
    snap = tmp_path / "snap"
    snap.mkdir()
    m = sample(snap, shim_sha=hashlib.sha256(b"shim v2").hexdigest(), shim_path=str(installed_shim))
    m["processes"] = [{"pid": os.getpid(), "ppid": 1, "comm": "pytest"}]  # a pid in use
    manifest.write(snap, m)
    before = tree_digest(snap)
    with pytest.raises(SnapshotError) as ei:
        Restore(snap, shim_path=installed_shim, driver="fake").read_manifest()
    assert ei.value.pid == os.getpid() and "CRIU restores the original pids" in ei.value.reason
    assert tree_digest(snap) == before


def test_carriers_and_roles_from_capture():
    cap = {
        "participants": [
            {
                "pid": 11,
                "records": [
                    {
                        "kind": "ALLOCATION",
                        "role": "CREATOR",
                        "alloc_id": "aa" * 16,
                        "carrier_bytes": 4096,
                        "carrier_checksum": 0x1234,
                    },
                    {
                        "kind": "MAPPING",
                        "role": "CREATOR",
                        "alloc_id": "aa" * 16,
                        "carrier_bytes": 0,
                    },
                    {
                        "kind": "ALLOCATION",
                        "role": "PRIVATE",
                        "alloc_id": "bb" * 16,
                        "carrier_bytes": 0,
                    },
                ],
            },
            {
                "pid": 12,
                "records": [
                    {
                        "kind": "ALLOCATION",
                        "role": "IMPORTER",
                        "alloc_id": "aa" * 16,
                        "carrier_bytes": 0,
                    }
                ],
            },
        ]
    }
    assert manifest.carriers_from_capture(cap) == [
        {"pid": 11, "alloc_id": "aa" * 16, "bytes": 4096, "checksum": "0000000000001234"}
    ]
    assert manifest.role_counts(cap["participants"][0]["records"]) == {
        "private": 1,
        "creator": 1,
        "importer": 0,
    }


def test_restore_refusals_name_the_manifest_phase(tmp_path, installed_shim):
    """Every read-only refusal is reported under the phase that ran ("manifest"), as the
    progress table shows it, not a generic "restore"."""
    snap = tmp_path / "snap"
    snap.mkdir()
    m = sample(snap, shim_sha="0" * 64, shim_path=str(installed_shim))
    manifest.write(snap, m)
    with pytest.raises(SnapshotError) as ei:
        Restore(snap, shim_path=installed_shim).run()
    e = ei.value
    want = hashlib.sha256(b"shim v2").hexdigest()
    assert (e.phase, e.pid, e.outcome) == ("manifest", None, "refused")
    assert e.reason == (
        f"snapshot was taken with shim sha256 {'0' * 64} ({installed_shim}), but "
        f"the installed shim {installed_shim} has sha256 {want}; restore refused, "
        "snapshot untouched"
    )
    m["shim"]["sha256"] = want
    m["processes"] = [{"pid": os.getpid(), "ppid": 1, "comm": "pytest"}]  # a pid in use
    manifest.write(snap, m)
    with pytest.raises(SnapshotError) as ei:
        Restore(snap, shim_path=installed_shim, driver="fake").run()
    assert (ei.value.phase, ei.value.pid) == ("manifest", os.getpid())


def _restore_world(tmp_path, monkeypatch, calls, interrupt_after):
    root, rank = free_kit.free_pids(2)  # every step is a stand-in; no pid is signalled
    from cuinterpose.agent.run import restore as rs_mod

    def step(name, fn=None):
        def run(self):
            calls.append(name)
            if fn:
                fn(self)
            if name == interrupt_after:
                os.kill(os.getpid(), signal.SIGINT)

        return run

    monkeypatch.setattr(
        rs_mod.Restore,
        "read_manifest",
        step(
            "manifest",
            lambda s: setattr(s, "m", {"roots": [root], "snapshot_id": "s1", "cuda_pids": [rank]}),
        ),
    )
    monkeypatch.setattr(rs_mod.Restore, "verify_images", step("verify"))
    monkeypatch.setattr(rs_mod.Restore, "load_driver", step("driver"))
    monkeypatch.setattr(rs_mod.Restore, "remove_stale", step("stale sockets"))
    monkeypatch.setattr(
        rs_mod.Restore,
        "criu_restore",
        step("criu restore", lambda s: s.restored_roots.append(root)),
    )
    monkeypatch.setattr(rs_mod.Restore, "native_restore", step("native restore"))
    monkeypatch.setattr(rs_mod.Restore, "restore_shared", step("restore shared"))
    monkeypatch.setattr(rs_mod.Restore, "resume", step("resume"))
    monkeypatch.setattr(rs_mod.Restore, "kill_restored", step("kill restored"))
    return rs_mod.Restore(tmp_path)


def test_sigint_during_restore_checks_refuses_and_changes_nothing(tmp_path, monkeypatch):
    calls = []
    rs = _restore_world(tmp_path, monkeypatch, calls, "manifest")
    with pytest.raises(SnapshotError) as ei:
        rs.run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("manifest", None, "refused")
    assert e.reason == (
        "interrupted by SIGINT after manifest; restore cancelled, nothing was "
        "changed, the snapshot is untouched"
    )
    assert calls == ["manifest"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigint_after_criu_restore_kills_the_restored_tree(tmp_path, monkeypatch):
    from cuinterpose.agent.errors import RestoreFailed

    calls = []
    rs = _restore_world(tmp_path, monkeypatch, calls, "criu restore")
    with pytest.raises(RestoreFailed) as ei:
        rs.run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("criu restore", None, "restore_failed")
    assert e.reason == (
        "interrupted by SIGINT after criu restore; the restored tree was killed, "
        "the snapshot is untouched"
    )
    assert calls == [
        "manifest",
        "verify",
        "driver",
        "stale sockets",
        "criu restore",
        "kill restored",
    ]


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (
            lambda m: m.update(shim="x"),
            "field shim must be an object with path and sha256 (strings)",
        ),
        (lambda m: m.update(roots=["abc"]), "field roots must be a non-empty list of pids"),
        (lambda m: m.update(roots=[]), "field roots must be a non-empty list of pids"),
        (
            lambda m: m.update(participants=[{"pid": "x"}]),
            "field participants must be a list of objects with pid (int) and socket_path (string)",
        ),
        (
            lambda m: m.update(processes=None),
            "field processes must be a list of objects with pid (int)",
        ),
        (lambda m: m.update(cuda_pids=[1.5]), "field cuda_pids must be a list of pids"),
        (
            lambda m: m["criu"]["files"][f"criu/{m['roots'][0]}/pages-1.img"].pop("sha256"),
            "field criu.files must map each image path to {sha256 (string), bytes (int)}",
        ),
        (
            lambda m: m["criu"].update(files={}),
            "field criu.files lists no CRIU image of tree {root}",
        ),
        (lambda m: m.update(quiesce={}), "field quiesce must be an object with id (string)"),
        (lambda m: m.update(driver=[]), "field driver must be an object with kind (string)"),
        (lambda m: m.update(control_dir=3), "field control_dir must be a string"),
        (lambda m: m.update(capture=None), "field capture must be an object"),
    ],
)
def test_restore_refuses_a_corrupted_manifest_by_field(tmp_path, installed_shim, mutate, reason):
    snap = tmp_path / "snap"
    snap.mkdir()
    m = sample(snap, shim_sha=hashlib.sha256(b"shim v2").hexdigest(), shim_path=str(installed_shim))
    root = m["roots"][0]
    m["processes"] = [{"pid": root, "ppid": 1, "comm": "x"}]
    mutate(m)
    (snap / "manifest.json").write_text(json.dumps(m))
    before = tree_digest(snap)
    with pytest.raises(SnapshotError) as ei:
        Restore(snap, shim_path=installed_shim, driver="fake").run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("manifest", None, "refused")
    reason = reason.replace("{root}", str(root))
    assert e.reason == f"{snap / 'manifest.json'}: {reason}; restore refused, snapshot untouched"
    assert tree_digest(snap) == before
