"""What the S3 backend trusts: a manifest in the bucket is untrusted input (case 008). With a
node key, push and pull refuse a manifest without a valid MAC; pull writes only paths it
derives or checks; a bucket manifest that names a chunk store is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
from s3_kit import bucket_files, put_object, sample_snapshot

from cuinterpose.agent.snapshot import backends, trust
from cuinterpose.agent.snapshot.backends import layout, s3gc
from cuinterpose.agent.snapshot.backends.api import StorageError

KEY, OTHER = b"node key of the cluster", b"another key"


def _sign(d, key) -> dict:
    m = json.loads((d / "manifest.json").read_text())
    m = layout.signed(m, key)
    (d / "manifest.json").write_bytes(layout.dumps(m))
    return m


def test_with_a_node_key_push_and_pull_accept_only_manifests_signed_with_it(
    tmp_path, bucket, opts, rclone, raw
):
    sample_snapshot(tmp_path / "s1")
    m = _sign(tmp_path / "s1", KEY)
    keyed = dataclasses.replace(opts, node_key=KEY)
    with pytest.raises(StorageError) as e:
        backends.push(
            tmp_path / "s1", f"s3://{bucket}/r/s1", dataclasses.replace(opts, node_key=OTHER)
        )
    assert e.value.phase == "upload"
    assert f"not signed with this node's key (key id {trust.key_id(OTHER)})" in e.value.reason
    assert bucket_files(rclone.root, bucket) == {}
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", keyed)
    backends.pull(f"s3://{bucket}/r/s1", tmp_path / "p1", keyed)
    assert json.loads((tmp_path / "p1" / "manifest.json").read_text()) == m

    # the manifest edited in the bucket (its MAC kept): refused with the key, before any chunk
    bad = {**m, "control_dir": "/somewhere/else"}
    put_object(raw, bucket, "r/s1/manifest.json", layout.dumps(bad))
    with pytest.raises(StorageError) as e:
        backends.pull(f"s3://{bucket}/r/s1", tmp_path / "p2", keyed)
    assert (e.value.phase, e.value.key) == ("download", "r/s1/manifest.json")
    assert "was modified or not signed with this node's key" in e.value.reason
    assert not (tmp_path / "p2").exists()
    # without a key nothing is required (as restore): the bytes arrive as they are
    backends.pull(f"s3://{bucket}/r/s1", tmp_path / "p3", opts)
    assert (tmp_path / "p3" / "manifest.json").read_bytes() == layout.dumps(bad)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda m: m["criu"]["files"].update(
                {"criu/../../escape": {"sha256": "0" * 64, "bytes": 1}}
            ),
            "field criu.files names 'criu/../../escape'",
        ),
        (
            lambda m: m["criu"]["files"].update({"/etc/escape": {"sha256": "0" * 64, "bytes": 1}}),
            "field criu.files names '/etc/escape'",
        ),
        (lambda m: m["chunks"]["streams"][0].update(pid="../1"), "chunks.streams[0]: bad pid"),
        (lambda m: m["chunks"]["streams"][0].update(alloc_id="x/y"), "bad pid or alloc_id"),
        (lambda m: m["chunks"].update(store="../.cuinterpose-store/packs"), "chunk-store manifest"),
        (lambda m: m["chunks"]["streams"][0]["checksums"].pop(), "17 checksums expected"),
        (lambda m: m["gpu_storage"]["streams"][0].update(ordinal=-1), "is not a gpu stream record"),
    ],
    ids=["dotdot", "absolute", "pid", "alloc_id", "store", "checksums", "gpu"],
)
def test_a_malformed_bucket_manifest_is_refused_before_anything_is_written(
    tmp_path, bucket, opts, raw, change, message
):
    m = sample_snapshot(tmp_path / "s1")
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    change(m)
    put_object(raw, bucket, "r/s1/manifest.json", layout.dumps(m))
    (tmp_path / "deep").mkdir()
    with pytest.raises(StorageError) as e:
        backends.pull(f"s3://{bucket}/r/s1", tmp_path / "deep" / "t", opts)
    assert e.value.phase == "download" and message in e.value.reason, e.value.reason
    assert list((tmp_path / "deep").iterdir()) == []
    assert not (tmp_path / "escape").exists()


def test_a_pull_whose_result_fails_restores_checks_is_refused(tmp_path, bucket, opts, raw):
    """The capture's carrier record disagrees with the stream: the files all verify against
    their digests, but restore's chunk check would refuse the snapshot, so the pull does."""
    m = sample_snapshot(tmp_path / "s1")
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    m["capture"]["participants"][0]["records"][0]["carrier_checksum"] = "0" * 16
    put_object(raw, bucket, "r/s1/manifest.json", layout.dumps(m))
    with pytest.raises(StorageError) as e:
        backends.pull(f"s3://{bucket}/r/s1", tmp_path / "t", opts)
    assert e.value.phase == "download" and "disagrees with the carrier record" in e.value.reason
    assert not (tmp_path / "t").exists()


def test_a_chunk_object_under_another_digest_is_refused(tmp_path, bucket, opts, rclone, raw):
    """Someone with write access to the bucket replaces a shared chunk object: every pull of a
    snapshot that uses it refuses (the key is the digest), naming the key."""
    m = sample_snapshot(tmp_path / "s1")
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    key = s3gc.chunk_key("sha256", m["chunks"]["streams"][0]["checksums"][0])
    put_object(raw, bucket, key, bytes(64 << 10))
    with pytest.raises(StorageError) as e:
        backends.pull(f"s3://{bucket}/r/s1", tmp_path / "t", opts)
    assert (e.value.phase, e.value.key) == ("download", key)
    assert "chunk object has sha256" in e.value.reason
