"""The two halves of an S3 push (agent/snapshot/backends/s3push.py ``Push``): the chunk
streams sent before the manifest exists (what a checkpoint does while it syncs), the images and
the manifest at the commit; an abort before the commit leaves no snapshot, no image and no pin."""

from __future__ import annotations

import dataclasses
import json

import pytest
from s3_kit import bucket_files, sample_snapshot, tree_digest

from cuinterpose.agent.snapshot import backends
from cuinterpose.agent.snapshot.backends import s3gc
from cuinterpose.agent.snapshot.backends.api import StorageError


def _streams(m: dict) -> dict:
    return {k: m[k] for k in ("chunks", "gpu_storage") if k in m}


def test_the_chunks_go_first_and_the_commit_adds_only_images_and_the_manifest(
    tmp_path, bucket, opts, rclone
):
    m = sample_snapshot(tmp_path / "s1")
    rows = []
    push = backends.begin_push(
        f"s3://{bucket}/r/s1", dataclasses.replace(opts, progress=rows.append)
    )
    push.check_free()
    push.begin(tmp_path / "s1", _streams(m))
    push.wait()
    early = bucket_files(rclone.root, bucket)
    chunks = {k for k in early if k.startswith(s3gc.CHUNKS)}
    distinct = {
        c for s in m["chunks"]["streams"] + m["gpu_storage"]["streams"] for c in s["checksums"] if c
    }
    assert chunks == {s3gc.chunk_key("sha256", c) for c in distinct}
    # before the commit: the chunks and this push's pin, nothing under the prefix
    assert not [k for k in early if k.startswith("r/")]
    assert len([k for k in early if k.startswith(s3gc.PINS)]) == 1
    assert push.early == (sum(len(early[k]) for k in chunks), len(distinct))

    res = push.commit(tmp_path / "s1")
    assert (res.chunks_uploaded, res.chunk_bytes_uploaded) == (len(distinct), push.early[0])
    assert (res.images, res.image_bytes) == (
        3,
        sum(f["bytes"] for f in m["criu"]["files"].values()),
    )
    objs = bucket_files(rclone.root, bucket)
    assert not [k for k in objs if k.startswith(s3gc.PINS)]
    assert json.loads(objs["r/s1/manifest.json"]) == m
    assert rows[-1].final and rows[-1].done_bytes == rows[-1].total_bytes
    assert rows[-1].transferred_bytes == res.chunk_bytes_uploaded + res.image_bytes
    dst = tmp_path / "pulled"
    backends.pull(f"s3://{bucket}/r/s1", dst, opts)
    assert {k: v[:2] for k, v in tree_digest(dst).items()} == {
        k: v[:2] for k, v in tree_digest(tmp_path / "s1").items()
    }


def test_an_abort_after_the_first_half_leaves_no_snapshot_and_no_pin(
    tmp_path, bucket, opts, rclone
):
    m = sample_snapshot(tmp_path / "s1")
    push = backends.begin_push(f"s3://{bucket}/r/s1", opts)
    push.begin(tmp_path / "s1", _streams(m))
    push.wait()
    assert push.abort() == []
    objs = bucket_files(rclone.root, bucket)
    assert not [k for k in objs if not k.startswith(s3gc.CHUNKS)]
    with pytest.raises(StorageError) as e:
        backends.stat(f"s3://{bucket}/r/s1", opts)
    assert e.value.key == "r/s1/manifest.json"
    # the chunks it sent belong to nothing: a collection frees exactly them
    got = backends.collect(f"s3://{bucket}", opts)
    assert got.chunks_removed == len([k for k in objs if k.startswith(s3gc.CHUNKS)]) > 0


def test_a_first_half_against_a_location_that_holds_a_snapshot_fails_the_commit(
    tmp_path, bucket, opts, rclone
):
    m = sample_snapshot(tmp_path / "s1")
    backends.push(tmp_path / "s1", f"s3://{bucket}/r/s1", opts)
    before = bucket_files(rclone.root, bucket)
    push = backends.begin_push(f"s3://{bucket}/r/s1", opts)
    with pytest.raises(StorageError) as e:
        push.check_free()
    assert (e.value.phase, e.value.key) == ("upload", "r/s1/manifest.json")
    push.begin(tmp_path / "s1", _streams(m))
    with pytest.raises(StorageError) as e:
        push.commit(tmp_path / "s1")
    assert "a snapshot is already there" in e.value.reason
    assert "No manifest was written" in e.value.reason
    assert bucket_files(rclone.root, bucket) == before
