"""The checkpoint's upload steps on their own (agent/run/upload.py), with a recording push:
the chunk streams start before the sync runs and exactly as the manifest will hold them; a
local checkpoint has no upload at all; a failed upload of a single node rebuilds and resumes
the workload (rolled back), a group member's leaves that to the leader."""

from __future__ import annotations

import threading
import types

import pytest

from cuinterpose.agent.errors import AgentError, CheckpointFailed
from cuinterpose.agent.run import durable, upload
from cuinterpose.agent.run.report import Reporter
from cuinterpose.agent.snapshot.backends.api import PushResult, StorageError

CHUNKS = {
    "chunk_bytes": 65536,
    "checksum": "sha256",
    "streams": [{"kind": "shared", "pid": 7, "alloc_id": "ab" * 16, "bytes": 10}],
}
GPU = {"mode": "custom", "chunk_bytes": 65536, "checksum": "sha256", "streams": []}


class Push:
    def __init__(self, log, fail=None):
        self.log, self.fail = log, fail

    def begin(self, d, streams):
        self.log.append(("begin", d, streams))

    def commit(self, d):
        self.log.append(("commit", d))
        if self.fail:
            raise self.fail
        return PushResult("s3://b/p", "p/manifest.json", 1, 1, 10, 0, 0, 0, 2, 20, False, 5)

    def cancel(self):
        self.log.append(("cancel",))


def _cp(log, fail=None, group=None):
    up = types.SimpleNamespace(
        push=Push(log, fail),
        started=False,
        last=None,
        row=None,
        base=0,
        committed=None,
        interrupted=None,
        lock=threading.Lock(),
    )
    cp = types.SimpleNamespace(
        upload=up,
        images_dir="/snap",
        capture={"chunks": {**CHUNKS, "directory": "/snap/chunks"}},
        gpu_storage=GPU,
        r=Reporter(),
        group=group,
        roots=[42],
        guard=types.SimpleNamespace(pending=lambda: None),
    )
    cp.rebuild = lambda restored: log.append(("rebuild", restored))
    cp.lost_text = lambda *a: ""
    return cp


def test_the_chunks_start_before_the_sync_and_the_commit_comes_in_the_upload_step(monkeypatch):
    log = []
    monkeypatch.setattr(durable, "sync_step", lambda cp: log.append(("sync",)))
    cp = _cp(log)
    upload.sync_step(cp)
    # the capture's chunks record without the coordinator's local keys, and the GPU streams
    assert log == [("begin", "/snap", {"chunks": CHUNKS, "gpu_storage": GPU}), ("sync",)]
    upload.upload_step(cp)
    assert log[2:] == [("commit", "/snap")]
    assert cp.upload.committed.chunk_bytes_uploaded == 10
    [row] = cp.r.phases
    assert (row.name, row.status) == ("upload", "ok")
    assert row.detail.startswith("s3://b/p: 1 chunks (10 B) uploaded")


def test_a_local_checkpoint_has_no_upload(monkeypatch):
    log = []
    monkeypatch.setattr(durable, "sync_step", lambda cp: log.append(("sync",)))
    cp = _cp(log)
    cp.upload = None
    upload.sync_step(cp)
    upload.upload_step(cp)
    assert log == [("sync",)] and cp.r.phases == []


def test_a_failed_upload_rebuilds_a_single_node_and_leaves_a_group_to_its_leader():
    err = StorageError("upload", "PUT failed", bucket="b", key="p/criu/1/core.img")
    log = []
    with pytest.raises(CheckpointFailed) as e:
        upload.upload_step(_cp(log, fail=err))
    assert log[-1] == ("rebuild", False)
    assert (e.value.phase, e.value.outcome) == ("upload", "rolled_back")
    assert e.value.reason.startswith("s3://b/p/criu/1/core.img: PUT failed (rolled back")
    log = []
    with pytest.raises(AgentError) as e:
        upload.upload_step(_cp(log, fail=err, group={"request_id": "g"}))
    assert e.value.reason == err.reason and ("rebuild", False) not in log
