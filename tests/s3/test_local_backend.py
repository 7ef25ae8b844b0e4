"""The backend table and its local-directory row: a location without ``scheme://`` (or
``file://``) is a directory; push and pull copy a snapshot into the plain form, verifying
every chunk and image; list, stat and delete work on a snapshot root."""

from __future__ import annotations

import dataclasses
import os

import pytest
from s3_kit import make_snapshot, sample_snapshot, tree_digest

from cuinterpose.agent.snapshot import backends
from cuinterpose.agent.snapshot.backends.api import StorageError, StorageOptions

OPTS = StorageOptions()


def test_the_table_has_one_row_per_scheme_and_refuses_others(tmp_path):
    assert sorted(backends.BACKENDS) == ["file", "s3"]
    assert backends.backend(str(tmp_path)).scheme == "file"
    assert backends.backend(f"file://{tmp_path}").scheme == "file"
    assert backends.backend("s3://bucket/p").scheme == "s3"
    for bad, msg in [
        ("gs://bucket/p", "no storage backend for gs://"),
        ("s3://bucket", "names no snapshot"),
        ("s3://Bad_Bucket/p", "is not an S3 bucket name"),
        ("s3://bucket/a/../b", "has an empty, '.' or '..' part"),
        ("s3://bucket/.cuinterpose/x", "starts with the reserved .cuinterpose/"),
    ]:
        with pytest.raises(StorageError) as e:
            backends.backend(bad)
        assert e.value.phase == "stat" and msg in e.value.reason


def test_a_local_push_and_pull_copy_the_snapshot_with_its_holes(tmp_path):
    m = sample_snapshot(tmp_path / "root" / "s1")
    rows = []
    (tmp_path / "other").mkdir()
    r = backends.push(
        tmp_path / "root" / "s1",
        f"file://{tmp_path}/other/s1",
        dataclasses.replace(OPTS, progress=rows.append),
    )
    assert (r.chunks, r.zero_chunks, r.images) == (19, 5, 3)
    assert rows[-1].final and rows[-1].done_bytes == rows[-1].total_bytes
    p = backends.pull(str(tmp_path / "other" / "s1"), tmp_path / "back", OPTS)
    src = tree_digest(tmp_path / "root" / "s1")
    assert {k: v[:2] for k, v in tree_digest(tmp_path / "back").items()} == {
        k: v[:2] for k, v in src.items()
    }
    assert p.chunk_bytes == r.chunk_bytes_uploaded
    zero_stream = m["chunks"]["streams"][1]["file"]  # three zero chunks: all hole
    assert os.stat(tmp_path / "back" / zero_stream).st_blocks == 0
    with pytest.raises(StorageError) as e:
        backends.push(tmp_path / "root" / "s1", str(tmp_path / "back"), OPTS)
    assert e.value.phase == "upload" and "is not an empty directory" in e.value.reason


def test_list_stat_and_delete_of_a_snapshot_root(tmp_path):
    root = tmp_path / "root"
    m1 = sample_snapshot(root / "s1")
    sample_snapshot(root / "s2", seed=2)
    (root / "half" / "criu").mkdir(parents=True)  # an interrupted checkpoint: no manifest
    infos = backends.list_snapshots(str(root), OPTS)
    assert [i.location for i in infos] == [str(root / "s1"), str(root / "s2")]
    assert backends.stat(str(root / "s1"), OPTS).snapshot_id == m1["snapshot_id"]
    d = backends.delete(str(root / "s1"), OPTS)
    assert (d.location, d.objects_removed, d.chunks_removed) == (str(root / "s1"), 1, 0)
    assert sorted(p.name for p in root.iterdir()) == ["half", "s2"]
    # a root without a chunk store: nothing to collect, and no store is created
    c = backends.collect(str(root), OPTS)
    assert (c.chunks_removed, c.chunks_kept) == (0, 0)
    assert sorted(p.name for p in root.iterdir()) == ["half", "s2"]


def test_a_damaged_chunk_refuses_the_copy_and_removes_what_it_wrote(tmp_path):
    m = make_snapshot(
        tmp_path / "s1",
        images={"core-1.img": b"core"},
        streams=[(4100, "ab" * 16, os.urandom(3 << 16))],
    )
    f = tmp_path / "s1" / m["chunks"]["streams"][0]["file"]
    data = bytearray(f.read_bytes())
    data[(2 << 16) + 9] ^= 1
    f.write_bytes(data)
    before = tree_digest(tmp_path / "s1")
    with pytest.raises(StorageError) as e:
        backends.push(tmp_path / "s1", str(tmp_path / "copy"), OPTS)
    assert e.value.phase == "upload" and "chunk 2 of chunks/shared-4100-" in e.value.reason
    assert not (tmp_path / "copy").exists() and tree_digest(tmp_path / "s1") == before
