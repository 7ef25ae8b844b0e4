"""The chunk store without processes (agent/snapshot/store.py, the store half of
agent/snapshot/chunks.py; decisions D34), on synthetic manifests and packs:
- the known chunks are where the manifests put them (own pack or ref), skipping packs that are
  missing or too short and manifests that cannot be read;
- collect keeps every range a manifest uses byte for byte, reads the rest back as zeros,
  unlinks orphan packs, and refuses to collect when a manifest cannot be read;
- delete refuses a directory that is not a snapshot and removes nothing; a held shared lock
  makes it give up at its deadline with nothing removed;
- restore's check of a store snapshot refuses each bad pack, ref and size, naming it;
- a release gets the refs a checkpoint recorded in the ``.lock``."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from cuinterpose.agent.errors import AgentError, SnapshotError
from cuinterpose.agent.options import CheckpointOptions
from cuinterpose.agent.run import carriers
from cuinterpose.agent.snapshot import chunks, store
from cuinterpose.coordinator.carrierfiles import CarrierFiles
from cuinterpose.coordinator.protocol import cui_checksum64

CB = 64 << 10
AID = "ab" * 16
PID = 4119


def _d(b: bytes) -> str:
    return hashlib.blake2b(b, digest_size=32).hexdigest()


def _pack(prefix: str) -> str:
    return f"{prefix}-shared-{PID}-{AID}.bin"


def _write_snapshot(root, name, pack, data: bytes, refs=(), written=None):
    """A store snapshot ROOT/name of one stream of ``data`` (its chunks in ``pack`` at their
    place, except the chunks in ``refs``)."""
    d = root / name
    d.mkdir(parents=True)
    pd = store.packs_dir(root)
    pd.mkdir(parents=True, exist_ok=True)
    sums = []
    with open(pd / pack, "wb") as f:
        f.truncate(len(data))
        for i in range(-(-len(data) // CB)):
            part = data[i * CB : (i + 1) * CB]
            sums.append(None if part == bytes(len(part)) else _d(part))
            if sums[-1] is not None and i not in dict((r[0], r) for r in refs):
                f.seek(i * CB)
                f.write(part)
    stream = {
        "kind": "shared",
        "pid": PID,
        "alloc_id": AID,
        "bytes": len(data),
        "zero": [i for i, c in enumerate(sums) if c is None],
        "checksums": sums,
        "pack": pack,
        "refs": [list(r) for r in refs],
    }
    m = {
        "chunks": {
            "chunk_bytes": CB,
            "checksum": "blake2b-256",
            "store": store.STORE_REL,
            "streams": [stream],
        }
    }
    (d / "manifest.json").write_text(json.dumps(m))
    digest = b"".join(bytes(32) if c is None else bytes.fromhex(c) for c in sums)
    carrier = {
        "pid": PID,
        "alloc_id": AID,
        "bytes": len(data),
        "checksum": f"{cui_checksum64(digest):016x}",
    }
    return d, m, [carrier]


A = os.urandom(CB) + os.urandom(CB) + bytes(CB) + os.urandom(CB)  # chunk 2 zero
B = A[: 3 * CB] + os.urandom(CB)  # chunk 3 changed


def _two(tmp_path):
    p1, p2 = _pack("1" * 16), _pack("2" * 16)
    s1 = _write_snapshot(tmp_path, "s1", p1, A)
    s2 = _write_snapshot(tmp_path, "s2", p2, B, refs=[(0, p1, 0), (1, p1, CB)])
    return p1, p2, s1, s2


def test_known_chunks_are_where_the_manifests_put_them(tmp_path):
    p1, p2, _, _ = _two(tmp_path)
    known = store.known_chunks(tmp_path)
    assert known == {
        bytes.fromhex(_d(A[:CB])): (p1, 0),
        bytes.fromhex(_d(A[CB : 2 * CB])): (p1, CB),
        bytes.fromhex(_d(A[3 * CB :])): (p1, 3 * CB),
        bytes.fromhex(_d(B[3 * CB :])): (p2, 3 * CB),
    }
    # a pack cut short or gone, or a manifest that cannot be read: those chunks are written again
    os.truncate(store.packs_dir(tmp_path) / p2, 3 * CB)
    (tmp_path / "s3").mkdir()
    (tmp_path / "s3" / "manifest.json").write_text("{not json")
    assert set(store.known_chunks(tmp_path).values()) == {(p1, 0), (p1, CB), (p1, 3 * CB)}


def test_known_chunks_come_only_from_manifests_of_the_same_checksum(tmp_path):
    """A BLAKE2b-256 digest says nothing of a chunk's SHA-256 (decisions D36): a checkpoint
    with one checksum refers only to chunks stored under it; the default is BLAKE2b-256, the
    checksum of every snapshot before D36."""
    p1, p2, (d1, m1, _), _ = _two(tmp_path)
    assert (
        len(store.known_chunks(tmp_path))
        == len(store.known_chunks(tmp_path, checksum="blake2b-256"))
        == 4
    )
    assert store.known_chunks(tmp_path, checksum="sha256") == {}
    m1["chunks"]["checksum"] = "sha256"  # s1 claims SHA-256: its chunks serve only SHA-256
    (d1 / "manifest.json").write_text(json.dumps(m1))
    assert set(store.known_chunks(tmp_path, checksum="sha256").values()) == {
        (p1, 0),
        (p1, CB),
        (p1, 3 * CB),
    }
    # s2 (BLAKE2b-256) still names its own chunk 3 and the two it refers to in p1
    assert set(store.known_chunks(tmp_path).values()) == {(p1, 0), (p1, CB), (p2, 3 * CB)}


def test_collect_keeps_used_ranges_zeroes_the_rest_and_unlinks_orphans(tmp_path):
    p1, p2, (d1, _, _), (d2, m2, c2) = _two(tmp_path)
    pd = store.packs_dir(tmp_path)
    orphan = pd / _pack("3" * 16)  # a checkpoint that died before its manifest
    orphan.write_bytes(os.urandom(CB))
    (d1 / "manifest.json").unlink()  # s1 is no longer a snapshot: only s2's refs keep p1
    out = store.collect(tmp_path)
    assert out["packs_removed"] == 1 and out["packs_kept"] == 2 and out["pack_bytes_freed"] > 0
    assert sorted(os.listdir(pd)) == sorted([p1, p2])
    data = (pd / p1).read_bytes()
    assert data[: 2 * CB] == A[: 2 * CB]  # used by s2's refs
    assert data[2 * CB :] == bytes(2 * CB)  # chunk 3 of s1 was used by nobody: a hole now
    assert (pd / p2).read_bytes()[3 * CB :] == B[3 * CB :]
    chunks.check(d2, m2, c2)  # s2 still whole
    # a manifest that cannot be read stops the collect: nothing changes
    (d1 / "manifest.json").write_text("{")
    before = {p: (pd / p).read_bytes() for p in os.listdir(pd)}
    with pytest.raises(AgentError, match=r"manifest.json cannot be read: .* no pack is collected"):
        store.collect(tmp_path)
    assert {p: (pd / p).read_bytes() for p in os.listdir(pd)} == before


def test_delete_refuses_a_non_snapshot_and_waits_for_the_lock_at_most_its_deadline(tmp_path):
    p1, p2, (d1, _, _), _ = _two(tmp_path)
    with pytest.raises(AgentError) as e:
        store.delete(tmp_path / "nope")
    assert str(e.value) == f"delete: {tmp_path / 'nope'} does not exist; nothing removed"
    (tmp_path / "plain").mkdir()
    with pytest.raises(AgentError) as e:
        store.delete(tmp_path / "plain")
    assert str(e.value) == (
        f"delete: {tmp_path / 'plain'} holds no manifest.json: not a snapshot; nothing removed"
    )
    (tmp_path / "afile").write_text("x")
    with pytest.raises(AgentError, match=r"afile is not a snapshot directory; nothing removed$"):
        store.delete(tmp_path / "afile")
    held = store.Lock(tmp_path, exclusive=False)  # a checkpoint of this root is running
    try:
        with pytest.raises(AgentError, match=r"was not free for an exclusive lock within 0.1 s"):
            with store.Lock(tmp_path, exclusive=True, timeout_s=0.1):
                pass
    finally:
        held.release()
    assert (d1 / "manifest.json").exists()
    out = store.delete(d1)
    assert out["deleted"] == str(d1) and not d1.exists()
    assert (out["packs_removed"], out["packs_kept"]) == (0, 2)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.update(pack="x.bin"), "stream pack 'x.bin' is not <16 hex>-shared-4119-"),
        (lambda s: s.update(file="chunks/x"), "or the stream also names a file"),
        (lambda s: s["refs"].append([2, s["refs"][0][1], 0]), "a ref names an all-zero chunk"),
        (lambda s: s["refs"].reverse(), "field refs must be [[chunk, pack, offset]] strictly"),
        (
            lambda s: s["refs"].append([9, s["refs"][0][1], 0]),
            "a ref names a chunk past its 4 chunks",
        ),
        (
            lambda s: s["refs"][1].__setitem__(2, 4 * CB),
            "a ref of the manifest ends at byte 327680",
        ),
    ],
)
def test_store_snapshot_check_refuses(tmp_path, change, message):
    _, _, _, (d2, m2, c2) = _two(tmp_path)
    chunks.check(d2, m2, c2)
    change(m2["chunks"]["streams"][0])
    with pytest.raises(SnapshotError) as e:
        chunks.check(d2, m2, c2)
    assert message in str(e.value) and "restore refused, snapshot untouched" in str(e.value)


def test_store_snapshot_check_refuses_missing_and_resized_packs(tmp_path):
    p1, p2, _, (d2, m2, c2) = _two(tmp_path)
    pd = store.packs_dir(tmp_path)
    os.truncate(pd / p2, 3 * CB)
    with pytest.raises(
        SnapshotError, match=f"pack {pd / p2} is {3 * CB} bytes, the manifest says {4 * CB}"
    ):
        chunks.check(d2, m2, c2)
    os.truncate(pd / p2, 4 * CB)
    (pd / p1).unlink()
    with pytest.raises(SnapshotError, match=f"chunk store pack {pd / p1} is missing"):
        chunks.check(d2, m2, c2)
    m2["chunks"]["store"] = "../elsewhere"
    with pytest.raises(SnapshotError, match="field chunks.store '../elsewhere' is not"):
        chunks.check(d2, m2, c2)


def test_release_gets_the_refs_the_checkpoint_recorded(tmp_path):
    files = CarrierFiles(
        store.packs_dir(tmp_path),
        chunk_bytes=CB,
        store=store.STORE_REL,
        prefix="f" * 16 + "-",
        known={},
    )
    files.refs[(PID, AID)] = {1: (_pack("1" * 16), CB), 5: (_pack("2" * 16), 0)}
    rec = carriers.store_record(files)
    lock = json.loads(json.dumps({"chunks": {"chunk_bytes": CB}, "store": rec}))  # as in the .lock
    back = carriers.release_files(tmp_path / "s9", lock)
    assert (back.directory, back.prefix, back.store, back.chunk_bytes) == (
        files.directory,
        files.prefix,
        store.STORE_REL,
        CB,
    )
    assert back.refs == files.refs
    assert back.checksum == "blake2b-256"  # a .lock from before D36 names none: BLAKE2b-256
    lock["chunks"]["checksum"] = "sha256"  # recover.chunk_settings records it now
    assert carriers.release_files(tmp_path / "s9", lock).checksum == "sha256"
    assert carriers.store_record(CarrierFiles(tmp_path / "chunks")) is None


def test_the_chunk_checksum_comes_from_the_cpu_the_environment_or_the_snapshot(
    tmp_path, monkeypatch
):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 ssse3 sse4_1 sha_ni avx2\n")
    assert carriers.node_checksum(str(info), "x86_64") == "sha256"
    assert (
        carriers.node_checksum(str(info), "aarch64") == "blake2b-256"
    )  # no accelerated path there
    info.write_text("flags\t\t: fpu sse2 ssse3 sse4_1 avx2\n")
    assert carriers.node_checksum(str(info), "x86_64") == "blake2b-256"
    assert carriers.node_checksum(str(tmp_path / "absent"), "x86_64") == "blake2b-256"
    assert carriers.settings().checksum == carriers.node_checksum()
    for name in ("sha256", "blake2b-256"):  # the option, from its variable
        o = CheckpointOptions.from_environ({"CUINTERPOSE_CHUNK_CHECKSUM": name})
        assert carriers.checkpoint_files(tmp_path / "s1", **o.chunk_settings()).checksum == name
    with pytest.raises(AgentError) as e:
        CheckpointOptions.from_environ({"CUINTERPOSE_CHUNK_CHECKSUM": "md5"})
    assert str(e.value) == (
        "request: $CUINTERPOSE_CHUNK_CHECKSUM='md5': must be one of blake2b-256, sha256"
    )
    # a restore reads with the snapshot's checksum, whatever the node or the environment says
    m = {"chunks": {"chunk_bytes": CB, "checksum": "blake2b-256"}}
    assert carriers.restore_files(tmp_path / "s1", m).checksum == "blake2b-256"
    m["chunks"]["checksum"] = "sha256"
    assert carriers.restore_files(tmp_path / "s1", m).checksum == "sha256"
    m["chunks"]["checksum"] = "crc32"
    with pytest.raises(AgentError, match="the snapshot's chunks.checksum: chunk checksum 'crc32'"):
        carriers.restore_files(tmp_path / "s1", m)


def test_a_symlinked_store_or_packs_dir_is_refused_and_nothing_outside_is_touched(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "passwd").write_text("keep me")
    root = tmp_path / "root"
    (root / "x").mkdir(parents=True)
    (root / "x" / "manifest.json").write_text("{}")
    (root / store.STORE_DIR).mkdir()
    (root / store.STORE_DIR / store.PACKS_DIR).symlink_to(victim)
    with pytest.raises(AgentError, match=r"packs is not a directory owned by uid 0 \(a symlink"):
        store.delete(root / "x")
    assert (root / "x" / "manifest.json").exists() and (victim / "passwd").read_text() == "keep me"
    (root / store.STORE_DIR / store.PACKS_DIR).unlink()
    (root / store.STORE_DIR).rmdir()
    (root / store.STORE_DIR).symlink_to(victim)
    with pytest.raises(AgentError, match=r"\.cuinterpose-store is not a directory owned by uid"):
        store.delete(root / "x")
    assert sorted(os.listdir(victim)) == ["passwd"]


def test_collect_touches_only_regular_files_named_like_packs(tmp_path):
    _two(tmp_path)
    pd = store.packs_dir(tmp_path)
    (pd / "notes.txt").write_text("mine")
    (pd / _pack("4" * 16)).symlink_to(tmp_path / "s1" / "manifest.json")
    store.collect(tmp_path)
    assert (pd / "notes.txt").read_text() == "mine"
    assert (pd / _pack("4" * 16)).is_symlink() and (tmp_path / "s1" / "manifest.json").exists()


def test_known_chunks_come_only_from_trusted_manifests(tmp_path, monkeypatch):
    p1, p2, (d1, m1, _), (d2, _, _) = _two(tmp_path)
    assert {p for p, _ in store.known_chunks(tmp_path).values()} == {p1, p2}
    os.chmod(d2 / "manifest.json", 0o666)  # writable by anyone: not used
    assert {p for p, _ in store.known_chunks(tmp_path).values()} == {p1}
    os.chmod(d2 / "manifest.json", 0o644)
    # with a node key, a manifest without a valid MAC is not used (a forged one in the root)
    from cuinterpose.agent.snapshot import trust

    key = tmp_path / "node.key"
    key.write_bytes(os.urandom(32))
    monkeypatch.setattr(trust, "key_file", lambda: str(key))
    assert store.known_chunks(tmp_path, trust.check_mac) == {}
    (d1 / "manifest.json").write_text(json.dumps(trust.sign(m1)))
    assert {p for p, _ in store.known_chunks(tmp_path, trust.check_mac).values()} == {p1}


@pytest.mark.parametrize("bad", [{"chunks": [1]}, {"chunks": "x"}, {"chunks": None}, [], 7])
def test_a_manifest_whose_chunks_are_not_an_object_is_not_a_store_manifest(tmp_path, bad):
    p1, p2, (d1, _, _), _ = _two(tmp_path)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "manifest.json").write_text(json.dumps(bad))
    assert {p for p, _ in store.known_chunks(tmp_path).values()} == {p1, p2}
    assert store.delete(d1)["packs_removed"] == 0  # s2 refers to p1


def test_a_store_manifest_with_bad_streams_stops_the_delete_before_anything_is_removed(tmp_path):
    p1, p2, (d1, _, _), _ = _two(tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text(
        json.dumps({"chunks": {"store": store.STORE_REL, "chunk_bytes": CB, "streams": [1]}})
    )
    assert {p for p, _ in store.known_chunks(tmp_path).values()} == {p1, p2}
    with pytest.raises(
        AgentError, match=r"bad/manifest.json: bad chunks object .*no pack is collected"
    ):
        store.delete(d1)
    assert (d1 / "manifest.json").exists() and sorted(
        os.listdir(store.packs_dir(tmp_path))
    ) == sorted([p1, p2])
    # the broken snapshot itself can be deleted
    assert store.delete(tmp_path / "bad")["deleted"] == str(tmp_path / "bad")
