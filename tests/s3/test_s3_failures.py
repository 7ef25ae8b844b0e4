"""Failures of the S3 backend, each against a real ``rclone serve s3``: an endpoint that is
down, wrong keys (403), 5xx answers, truncated bodies (tests/s3/s3_kit.py ``FaultProxy``),
objects damaged at rest, and the server killed mid-upload and mid-download. Each checks what
the failure left: the local snapshot unchanged and no manifest in the bucket (upload); the
bucket unchanged and the local target removed (download)."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest
from s3_kit import (
    MULTIPART,
    TRANSFER,
    Rclone,
    bucket_files,
    make_snapshot,
    raw_client,
    sample_snapshot,
    settings_for,
    tree_digest,
)

from cuinterpose.agent.snapshot import backends
from cuinterpose.agent.snapshot.backends import s3gc
from cuinterpose.agent.snapshot.backends.api import StorageError, StorageOptions


def _via(endpoint: str, **kw) -> StorageOptions:
    return StorageOptions(s3=settings_for(endpoint, **kw), transfer=TRANSFER)


def test_an_endpoint_that_is_down_refuses_push_and_pull_and_names_the_key(tmp_path):
    sample_snapshot(tmp_path / "s1")
    before = tree_digest(tmp_path / "s1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound and never listening: every connection is refused
        o = dataclasses.replace(
            _via(f"http://127.0.0.1:{s.getsockname()[1]}"),
            transfer=dataclasses.replace(TRANSFER, attempts=2),
        )
        with pytest.raises(StorageError) as e:
            backends.push(tmp_path / "s1", "s3://bkt/r/s1", o)
        assert (e.value.phase, e.value.bucket, e.value.key) == (
            "upload",
            "bkt",
            "r/s1/manifest.json",
        )
        assert "HEAD failed (cannot connect" in e.value.reason and "2 attempts" in e.value.reason
        assert "Connection refused" in e.value.reason
        with pytest.raises(StorageError) as e:
            backends.pull("s3://bkt/r/s1", tmp_path / "t", o)
        assert (e.value.phase, e.value.key) == ("download", "r/s1/manifest.json")
    assert tree_digest(tmp_path / "s1") == before
    assert not (tmp_path / "t").exists()


def test_wrong_keys_are_refused_at_the_first_request_without_a_retry(tmp_path, bucket, opts, proxy):
    sample_snapshot(tmp_path / "s1")
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    bad = _via(proxy.endpoint, secret="not-the-secret")
    for what, call in [
        ("upload", lambda: backends.push(tmp_path / "s1", f"s3://{bucket}/r/s2", bad)),
        ("download", lambda: backends.pull(f"s3://{bucket}/r/s1", tmp_path / "t", bad)),
        ("delete", lambda: backends.delete(f"s3://{bucket}/r/s1", bad)),
        ("list", lambda: backends.list_snapshots(f"s3://{bucket}/r", bad)),
    ]:
        proxy.requests.clear()
        with pytest.raises(StorageError) as e:
            call()
        assert e.value.phase == what and e.value.bucket == bucket
        assert "refused: HTTP 403" in e.value.reason and "access denied" in e.value.reason
        assert len(proxy.requests) == 1, proxy.requests  # 4xx: never retried
    assert not (tmp_path / "t").exists()
    backends.pull(f"s3://{bucket}/r/s1", tmp_path / "t", opts)  # the snapshot is intact


def test_5xx_answers_are_retried_and_a_lasting_one_refuses_the_commit(
    tmp_path, bucket, opts, proxy, rclone
):
    sample_snapshot(tmp_path / "s1")
    o = _via(proxy.endpoint)
    first = proxy.add("PUT", r"/\.cuinterpose/chunks/", "503", times=2)
    r = backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", o)
    assert first["hits"] == 2 and r.chunks_uploaded == r.chunks
    backends.pull(f"s3://{bucket}/r/s1", tmp_path / "p1", o)

    m2 = sample_snapshot(tmp_path / "s2", seed=3, changed=(4,))
    before = tree_digest(tmp_path / "s2")
    always = proxy.add("PUT", r"/r/s2/manifest\.json", "503", times=100)
    with pytest.raises(StorageError) as e:
        backends.push(tmp_path / "s2", f"s3://{bucket}/r/s2", o)
    assert (e.value.phase, e.value.key) == ("upload", "r/s2/manifest.json")
    assert "HTTP 503 SlowDown; 4 attempts" in e.value.reason
    assert (
        "No manifest was written" in e.value.reason and "its objects were removed" in e.value.reason
    )
    assert always["hits"] == 4
    assert tree_digest(tmp_path / "s2") == before
    objs = bucket_files(rclone.root, bucket)
    assert not [k for k in objs if k.startswith(("r/s2/", s3gc.PINS))]
    # the chunk s2 sent is nobody's: the next collection removes exactly it
    new = s3gc.chunk_key("sha256", m2["chunks"]["streams"][0]["checksums"][4])
    assert new in objs
    res = backends.collect(f"s3://{bucket}", opts)
    assert (res.chunks_removed, res.chunk_bytes_freed) == (1, 64 << 10)
    assert new not in bucket_files(rclone.root, bucket)


def test_truncated_bodies_are_retried_and_a_lasting_one_refuses_the_pull(
    tmp_path, bucket, opts, proxy, rclone
):
    m = sample_snapshot(tmp_path / "s1", big=MULTIPART)  # two ranged GETs
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    o = _via(proxy.endpoint)
    chunk = proxy.add("GET", r"/\.cuinterpose/chunks/", "truncate", times=1)
    ranged = proxy.add("GET", r"/r/s1/criu/4242/pages-1\.img", "truncate", times=1)
    backends.pull(f"s3://{bucket}/r/s1", tmp_path / "p1", o)
    assert (chunk["hits"], ranged["hits"]) == (1, 1)
    assert {k: v[:2] for k, v in tree_digest(tmp_path / "p1").items()} == {
        k: v[:2] for k, v in tree_digest(tmp_path / "s1").items()
    }
    objs = bucket_files(rclone.root, bucket)
    victim = s3gc.chunk_key("sha256", m["chunks"]["streams"][0]["checksums"][6])
    always = proxy.add("GET", victim, "truncate", times=100)
    with pytest.raises(StorageError) as e:
        backends.pull(f"s3://{bucket}/r/s1", tmp_path / "p2", o)
    assert (e.value.phase, e.value.key) == ("download", victim)
    assert (
        "4 attempts" in e.value.reason and "was removed, the bucket is untouched" in e.value.reason
    )
    assert always["hits"] == 4
    assert not (tmp_path / "p2").exists()
    assert bucket_files(rclone.root, bucket) == objs


def _flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("what", ["chunk", "small image", "large image"])
def test_an_object_damaged_at_rest_refuses_the_pull_and_leaves_no_target(
    tmp_path, bucket, opts, rclone, what
):
    m = sample_snapshot(tmp_path / "s1", big=MULTIPART)
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    key = {
        "chunk": s3gc.chunk_key("sha256", m["chunks"]["streams"][0]["checksums"][9]),
        "small image": "r/s1/criu/4242/core-1.img",
        "large image": "r/s1/criu/4242/pages-1.img",
    }[what]
    _flip(rclone.root / bucket / key, 777)
    objs = bucket_files(rclone.root, bucket)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StorageError) as e:
        backends.pull(f"s3://{bucket}/r/s1", tmp_path / "empty", opts)
    assert (e.value.phase, e.value.bucket, e.value.key) == ("download", bucket, key)
    assert {
        "chunk": "chunk object has sha256",
        "small image": "image object has sha256",
        "large image": "CRIU image criu/4242/pages-1.img has sha256",
    }[what] in e.value.reason
    assert list((tmp_path / "empty").iterdir()) == []  # emptied again (it existed before)
    assert bucket_files(rclone.root, bucket) == objs


def test_the_server_killed_mid_upload_and_mid_download(tmp_path):
    """Killed after the first bytes of a push: the push refuses, the local snapshot is
    unchanged and the bucket holds no manifest; on a server restarted over the same directory
    a collection (dropping the dead upload's pin) removes the chunks it sent, and a new push to
    the same location claims the prefix. Killed mid-pull: the target is removed."""
    root = tmp_path / "bucketdir"
    srv = Rclone(root, tmp_path / "rclone1.log").start()
    try:
        raw_client(srv.endpoint).make_bucket("bkt")
        sample_snapshot(tmp_path / "s1", big=MULTIPART)
        before = tree_digest(tmp_path / "s1")
        o = dataclasses.replace(
            _via(srv.endpoint), transfer=dataclasses.replace(TRANSFER, attempts=2)
        )
        kill = dataclasses.replace(o, progress=lambda row: row.transferred_bytes and srv.stop())
        with pytest.raises(StorageError) as e:
            backends.push(tmp_path / "s1", "s3://bkt/r/s1", kill)
        assert e.value.phase == "upload" and "No manifest was written" in e.value.reason
        assert tree_digest(tmp_path / "s1") == before
        assert not (root / "bkt" / "r" / "s1" / "manifest.json").exists()
        sent = {k for k in bucket_files(root, "bkt") if s3gc.parse_chunk_key(k)}
        assert sent  # the kill came after the first bytes
    finally:
        srv.stop()
    srv = Rclone(root, tmp_path / "rclone2.log").start()
    try:
        o = dataclasses.replace(o, s3=settings_for(srv.endpoint))
        res = s3gc.collect("s3://bkt", o, drop_pins_older_than_s=0)
        assert (res.chunks_removed, res.pins) == (len(sent), ())
        r = backends.push(tmp_path / "s1", "s3://bkt/r/s1", o)
        m = (tmp_path / "s1" / "manifest.json").read_bytes()
        objs = bucket_files(root, "bkt")
        assert {k for k in objs if not k.startswith(s3gc.CHUNKS)} == {"r/s1/manifest.json"} | {
            f"r/s1/{rel}" for rel in json.loads(m)["criu"]["files"]
        }
        assert r.chunks_uploaded == r.chunks
        kill = dataclasses.replace(o, progress=lambda row: row.transferred_bytes and srv.stop())
        with pytest.raises(StorageError) as e:
            backends.pull("s3://bkt/r/s1", tmp_path / "t", kill)
        assert e.value.phase == "download" and "was removed" in e.value.reason
        assert not (tmp_path / "t").exists()
    finally:
        srv.stop()
    assert bucket_files(root, "bkt") == objs


def test_a_push_refuses_a_damaged_local_chunk_before_it_reaches_the_bucket(
    tmp_path, bucket, opts, rclone
):
    """A chunk whose bytes no longer match its digest would poison every snapshot that shares
    it: the push refuses it, naming the file and offset, and sends nothing under its key."""
    m = make_snapshot(
        tmp_path / "s1",
        images={"core-1.img": b"core"},
        streams=[(4100, "ab" * 16, bytes(range(256)) * 1024)],
    )
    s = m["chunks"]["streams"][0]
    _flip(tmp_path / "s1" / s["file"], 5)
    with pytest.raises(StorageError) as e:
        backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    assert e.value.phase == "upload"
    assert (
        f"chunk 0 of {s['file']}" in e.value.reason
        and "the local snapshot is damaged" in e.value.reason
    )
    assert s3gc.chunk_key("sha256", s["checksums"][0]) not in bucket_files(rclone.root, bucket)
    assert not [k for k in bucket_files(rclone.root, bucket) if k.startswith(("r/", s3gc.PINS))]
