"""The S3 backend against a real ``rclone serve s3``, on synthetic snapshots (tests/s3/s3_kit.py
``make_snapshot``): what push writes into the bucket, what pull rebuilds, chunk sharing
between pushes, list/stat, delete with its collection, and uploads racing collections."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import pytest
from s3_kit import CB, MULTIPART, bucket_files, put_object, sample_snapshot, tree_digest

from cuinterpose.agent.snapshot import backends
from cuinterpose.agent.snapshot.backends import s3gc
from cuinterpose.agent.snapshot.backends.api import StorageError
from cuinterpose.coordinator.protocol import chunk_digest


def _holes(path, cb, zero) -> bool:
    """Whether every zero chunk of ``path`` is a hole (SEEK_DATA finds no data in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for i in zero:
            start, end = i * cb, min((i + 1) * cb, size)
            try:
                nxt = os.lseek(fd, start, os.SEEK_DATA)
            except OSError:  # ENXIO: no data up to the end
                continue
            if nxt < end:
                return False
        return True
    finally:
        os.close(fd)


def test_push_then_pull_rebuilds_the_snapshot_and_the_bucket_holds_what_the_layout_says(
    tmp_path, bucket, opts, rclone
):
    src = tmp_path / "a" / "s1"
    m = sample_snapshot(src, big=MULTIPART)
    rows = []
    res = backends.push(
        src, f"s3://{bucket}/nodeA/s1", dataclasses.replace(opts, progress=rows.append)
    )
    a = m["chunks"]["streams"][0]
    distinct_a = {c for c in a["checksums"] if c}
    gsums = {c for c in m["gpu_storage"]["streams"][0]["checksums"] if c}
    assert (res.chunks, res.chunks_uploaded, res.chunks_present) == (
        len(distinct_a | gsums),
        15 + 4,
        0,
    )
    assert res.zero_chunks == 1 + 3 + 1
    assert (res.images, res.image_bytes) == (3, 3000 + MULTIPART)
    assert not res.manifest_rewritten
    # the bucket: the images under the prefix, one object per distinct chunk, the manifest
    objs = bucket_files(rclone.root, bucket)
    chunk_keys = {s3gc.chunk_key("sha256", c) for c in distinct_a | gsums}
    image_keys = {f"nodeA/s1/{rel}" for rel in m["criu"]["files"]}
    assert set(objs) == chunk_keys | image_keys | {"nodeA/s1/manifest.json"}
    assert objs["nodeA/s1/manifest.json"] == (src / "manifest.json").read_bytes()
    for k in chunk_keys:
        assert chunk_digest("sha256", objs[k]).hex() == k.rsplit("/", 1)[1]
    assert sum(len(objs[k]) for k in chunk_keys) == res.chunk_bytes_uploaded
    assert {rel: objs[f"nodeA/s1/{rel}"] for rel in m["criu"]["files"]} == {
        rel: (src / rel).read_bytes() for rel in m["criu"]["files"]
    }
    # progress: done bytes never go back, the last row is final and complete
    done = [r.done_bytes for r in rows]
    assert done == sorted(done) and rows[-1].final
    assert rows[-1].done_bytes == rows[-1].total_bytes == rows[-1].transferred_bytes
    assert rows[-1].transferred_bytes == res.chunk_bytes_uploaded + res.image_bytes
    assert {r.phase for r in rows} == {"upload"}

    dst = tmp_path / "b" / "s1"
    dst.parent.mkdir()
    got = backends.pull(f"s3://{bucket}/nodeA/s1", dst, opts)
    assert tree_digest(dst).keys() == tree_digest(src).keys()
    assert {k: v[:2] for k, v in tree_digest(dst).items()} == {
        k: v[:2] for k, v in tree_digest(src).items()
    }
    assert (got.chunks, got.chunk_bytes, got.zero_chunks) == (
        res.chunks,
        res.chunk_bytes_uploaded,
        5,
    )
    for s in m["chunks"]["streams"] + m["gpu_storage"]["streams"]:
        assert _holes(dst / s["file"], CB, s["zero"]), s["file"]
    # private to the agent's user (case 016)
    modes = {p.stat().st_mode & 0o777 for p in [dst, *dst.rglob("*")] if p.is_dir()}
    assert modes == {0o700} and {
        p.stat().st_mode & 0o777 for p in dst.rglob("*") if p.is_file()
    } == {0o600}
    assert bucket_files(rclone.root, bucket) == objs  # a pull writes nothing to the bucket


def test_a_second_push_uploads_only_the_chunks_the_bucket_lacks(tmp_path, bucket, opts, rclone):
    sample_snapshot(tmp_path / "s1")
    m2 = sample_snapshot(tmp_path / "s2", seed=5, changed=(0, 7))
    r1 = backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    before = bucket_files(rclone.root, bucket)
    r2 = backends.push(tmp_path / "s2", f"s3://{bucket}/r/s2", opts)
    assert (r2.chunks_uploaded, r2.chunk_bytes_uploaded) == (2, 2 * CB)
    assert (r2.chunks_present, r2.chunk_bytes_present) == (
        r1.chunks - 2,
        r1.chunk_bytes_uploaded - 2 * CB,
    )
    # server side: the new chunk objects are exactly the two changed chunks
    new = {k: v for k, v in bucket_files(rclone.root, bucket).items() if k not in before}
    a2 = m2["chunks"]["streams"][0]["checksums"]
    assert {k for k in new if k.startswith(s3gc.CHUNKS)} == {
        s3gc.chunk_key("sha256", a2[0]),
        s3gc.chunk_key("sha256", a2[7]),
    }
    dst = tmp_path / "pulled"
    backends.pull(f"s3://{bucket}/r/s2", dst, opts)
    assert {k: v[:2] for k, v in tree_digest(dst).items()} == {
        k: v[:2] for k, v in tree_digest(tmp_path / "s2").items()
    }


def test_list_and_stat_see_only_committed_snapshots(tmp_path, bucket, opts, rclone, raw):
    m1 = sample_snapshot(tmp_path / "s1")
    sample_snapshot(tmp_path / "s2", seed=9)
    backends.push(tmp_path / "s1", f"s3://{bucket}/root/s1", opts)
    backends.push(tmp_path / "s2", f"s3://{bucket}/root/s2", opts)
    # an upload that never committed: objects under a prefix, no manifest
    put_object(raw, bucket, "root/half/criu/x.img", b"x")
    infos = backends.list_snapshots(f"s3://{bucket}/root", opts)
    assert [i.location for i in infos] == [f"s3://{bucket}/root/s1", f"s3://{bucket}/root/s2"]
    i1 = infos[0]
    assert (i1.snapshot_id, i1.roots, i1.signed_key_id) == (m1["snapshot_id"], (4242,), None)
    assert i1.image_bytes == sum(v["bytes"] for v in m1["criu"]["files"].values())
    assert i1.chunk_bytes == 16 * CB + 1000 + 3 * CB + 5 * CB
    assert backends.stat(f"s3://{bucket}/root/s2", opts).location == f"s3://{bucket}/root/s2"
    with pytest.raises(StorageError) as e:
        backends.stat(f"s3://{bucket}/root/half", opts)
    assert (e.value.phase, e.value.key) == ("stat", "root/half/manifest.json")
    with pytest.raises(StorageError) as e:
        backends.pull(f"s3://{bucket}/root/half", tmp_path / "t", opts)
    assert "no manifest: not a snapshot" in e.value.reason and not (tmp_path / "t").exists()
    with pytest.raises(StorageError) as e:
        backends.push(tmp_path / "s1", f"s3://{bucket}/root/s2", opts)
    assert "a snapshot is already there" in e.value.reason


def _chunk_objects(rclone, bucket) -> set:
    return {k for k in bucket_files(rclone.root, bucket) if k.startswith(s3gc.CHUNKS)}


def _keys(m) -> set:
    return {
        s3gc.chunk_key(m["chunks"]["checksum"], c)
        for s in m["chunks"]["streams"] + m.get("gpu_storage", {}).get("streams", [])
        for c in s["checksums"]
        if c
    }


def test_delete_removes_the_snapshot_and_exactly_the_chunks_no_other_manifest_names(
    tmp_path, bucket, opts, rclone
):
    m1 = sample_snapshot(tmp_path / "s1")
    m2 = sample_snapshot(tmp_path / "s2", seed=3, changed=(2, 9))
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    backends.push(tmp_path / "s2", f"s3://{bucket}/r/s2", opts)
    assert _chunk_objects(rclone, bucket) == _keys(m1) | _keys(m2)
    res = backends.delete(f"s3://{bucket}/r/s1", opts)
    only1 = _keys(m1) - _keys(m2)
    assert len(only1) == 2
    assert (res.chunks_removed, res.chunks_kept, res.pins) == (2, len(_keys(m2)), ())
    assert res.chunk_bytes_freed == 2 * CB
    assert res.objects_removed == 1 + len(m1["criu"]["files"])
    assert _chunk_objects(rclone, bucket) == _keys(m2)
    assert not [k for k in bucket_files(rclone.root, bucket) if k.startswith("r/s1/")]
    backends.pull(f"s3://{bucket}/r/s2", tmp_path / "p2", opts)  # every chunk of s2 is there
    res = backends.delete(f"s3://{bucket}/r/s2", opts)
    assert (res.chunks_removed, res.chunks_kept) == (len(_keys(m2)), 0)
    assert bucket_files(rclone.root, bucket) == {}
    with pytest.raises(StorageError) as e:
        backends.delete(f"s3://{bucket}/r/s2", opts)
    assert (e.value.phase, e.value.key) == ("delete", "r/s2/manifest.json")
    assert "not a snapshot; nothing removed" in e.value.reason


def test_an_unreadable_manifest_elsewhere_refuses_the_delete_before_anything_is_removed(
    tmp_path, bucket, opts, rclone, raw
):
    sample_snapshot(tmp_path / "s1")
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    put_object(raw, bucket, "other/x/manifest.json", b'{"format": "cuinterpose-snapshot", ')
    before = bucket_files(rclone.root, bucket)
    with pytest.raises(StorageError) as e:
        backends.delete(f"s3://{bucket}/r/s1", opts)
    assert (e.value.phase, e.value.key) == ("delete", "other/x/manifest.json")
    assert "is not valid JSON" in e.value.reason and "none is collected" in e.value.reason
    after = bucket_files(rclone.root, bucket)
    assert {k: v for k, v in after.items() if not k.startswith(s3gc.LOCKS)} == before
    assert not [k for k in after if k.startswith(s3gc.LOCKS)]  # the lock is gone too


@pytest.fixture
def hook(monkeypatch):
    calls = {}

    def set_hook(point, fn):
        calls[point] = fn

    monkeypatch.setattr(s3gc, "TEST_HOOK", lambda p: calls.get(p, lambda: None)())
    return set_hook


def test_a_delete_during_an_upload_keeps_every_chunk_the_upload_pinned(
    tmp_path, bucket, opts, rclone, hook
):
    """push s2 (sharing all but two chunks with s1) has found the shared chunks present and
    sent the others when s1 is deleted: the collection keeps the shared chunks (the pin names
    them), the push commits, and s2 pulls whole."""
    m1 = sample_snapshot(tmp_path / "s1")
    m2 = sample_snapshot(tmp_path / "s2", seed=3, changed=(2, 9))
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    deleted = []
    hook("upload sent", lambda: deleted.append(backends.delete(f"s3://{bucket}/r/s1", opts)))
    r2 = backends.push(tmp_path / "s2", f"s3://{bucket}/r/s2", opts)
    [d] = deleted
    assert [p["location"] for p in d.pins] == [f"s3://{bucket}/r/s2"]
    assert (d.chunks_removed, d.chunks_kept) == (2, len(_keys(m2)))
    assert (r2.chunks_present, r2.chunks_uploaded) == (len(_keys(m1) & _keys(m2)), 2)
    assert _chunk_objects(rclone, bucket) == _keys(m2)
    backends.pull(f"s3://{bucket}/r/s2", tmp_path / "p2", opts)
    assert not [k for k in bucket_files(rclone.root, bucket) if k.startswith(s3gc.PINS)]


def test_without_the_pin_the_same_race_loses_chunks(
    tmp_path, bucket, opts, rclone, hook, monkeypatch
):
    """The scenario above with the pins ignored by the collection: it removes the shared
    chunks the push found present, and the committed s2 cannot be pulled (what the pin is
    for; this proves the test above can fail)."""
    sample_snapshot(tmp_path / "s1")
    sample_snapshot(tmp_path / "s2", seed=3, changed=(2, 9))
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    monkeypatch.setattr(s3gc, "_read_pins", lambda *a: (set(), []))
    hook("upload sent", lambda: backends.delete(f"s3://{bucket}/r/s1", opts))
    backends.push(tmp_path / "s2", f"s3://{bucket}/r/s2", opts)
    with pytest.raises(StorageError) as e:
        backends.pull(f"s3://{bucket}/r/s2", tmp_path / "p2", opts)
    assert "chunk object is missing" in e.value.reason


def _lock(raw, bucket, started_unix, name="feed", lease_s=600.0) -> str:
    """A collection lock of another node, put through the server; returns its key."""
    key = f"{s3gc.LOCKS}{name * 8}.json"
    rec = {
        "node": "other",
        "pid": 1,
        "started_unix": started_unix,
        "lease_s": lease_s,
        "started_at": "then",
    }
    put_object(raw, bucket, key, json.dumps(rec).encode())
    return key


def test_an_upload_waits_for_a_live_collection_and_ignores_a_stale_one(
    tmp_path, bucket, opts, rclone, raw, hook, monkeypatch
):
    sample_snapshot(tmp_path / "s1")
    monkeypatch.setattr(s3gc, "WAIT_POLL_S", 0.01)
    lock = _lock(raw, bucket, time.time())
    seen, checks = [], []
    real = s3gc._live_locks

    def exists(key):
        return (rclone.root / bucket / key).exists()

    def counted(*a):
        live = real(*a)
        checks.append(len(live))
        if len(checks) == 3:
            raw.remove_object(bucket, lock)  # the collection ends
        return live

    monkeypatch.setattr(s3gc, "_live_locks", counted)
    hook("upload pinned", lambda: seen.append(exists(lock)))
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    assert checks == [1, 1, 1, 0] and seen == [False]  # no chunk was checked while it lived

    sample_snapshot(tmp_path / "s2", seed=4)
    stale = _lock(raw, bucket, time.time() - 600 - 120 - 60, name="dead")
    checks.clear()
    hook("upload pinned", lambda: seen.append(exists(stale)))
    backends.push(tmp_path / "s2", f"s3://{bucket}/r/s2", opts)
    assert checks == [0] and seen == [False, True]


def test_an_upload_refuses_when_a_collection_outlives_its_deadline(
    tmp_path, bucket, opts, rclone, raw, monkeypatch
):
    sample_snapshot(tmp_path / "s1")
    before = tree_digest(tmp_path / "s1")
    monkeypatch.setattr(s3gc, "WAIT_POLL_S", 0.05)
    _lock(raw, bucket, time.time())
    o = dataclasses.replace(opts, transfer=dataclasses.replace(opts.transfer, deadline_s=2.0))
    with pytest.raises(StorageError) as e:
        backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", o)
    assert e.value.phase == "upload" and "a chunk collection is running" in e.value.reason
    assert "No manifest was written" in e.value.reason
    assert tree_digest(tmp_path / "s1") == before
    left = bucket_files(rclone.root, bucket)
    assert [k for k in left if not k.startswith(s3gc.LOCKS)] == []  # no pin, no chunk


def test_concurrent_pushes_of_the_same_chunks_both_commit(tmp_path, bucket, opts):
    """Two nodes push snapshots of the same model at once: both commit, both pull."""
    sample_snapshot(tmp_path / "s1")
    sample_snapshot(tmp_path / "s2", seed=11)
    out, errs = {}, []

    def go(name):
        try:
            out[name] = backends.push(tmp_path / name, f"s3://{bucket}/r/{name}", opts)
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    th = [threading.Thread(target=go, args=(n,)) for n in ("s1", "s2")]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert not errs
    assert (
        out["s1"].chunks == out["s2"].chunks == out["s1"].chunks_uploaded + out["s1"].chunks_present
    )
    for n in ("s1", "s2"):
        backends.pull(f"s3://{bucket}/r/{n}", tmp_path / f"p-{n}", opts)
