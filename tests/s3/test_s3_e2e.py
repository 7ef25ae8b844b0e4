"""Real checkpoints through the bucket of a real ``rclone serve s3`` (fakecuda, real CRIU, the
agent CLI): a snapshot taken under snapshot root A restored from the bucket under an empty
root B.

- afdwin (two ranks sharing windows, checkpointed at a hold and killed by the dump): pushed
  from A, pulled into B and restored there with ``cuinterpose-agent restore``; every message
  arrives exactly once and every window is at the VA it had.
- the two-process job of bench/datapath_job.py, checkpointed twice with ``--incremental``
  (chunk store; 64 KiB chunks; the first 128 KiB rewritten between the cuts) and a node key:
  the second push uploads exactly the two changed chunks; the bucket holds its manifest in the
  file-stream form, signed again with the key; deleting the first snapshot from the bucket
  removes exactly the two chunks only it had; the second, pulled into B, restores with the
  key and both processes find the bytes of the second cut.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
from s3_kit import bucket_files, tree_digest, wait_json

from cuinterpose.agent.snapshot import backends, store
from cuinterpose.agent.snapshot.backends import layout, s3gc
from cuinterpose.workloads.afdwin import demo

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")

STEPS, HOLD = 120, 20
CB, SIZE, CHANGED = 64 << 10, 4 << 20, 128 << 10
JOB = pathlib.Path(__file__).resolve().parents[2] / "bench" / "datapath_job.py"


def _same_files(a: pathlib.Path, b: pathlib.Path) -> None:
    """Same relative paths, bytes and sizes (the allocation may differ: holes)."""
    assert {k: v[:2] for k, v in tree_digest(a).items()} == {
        k: v[:2] for k, v in tree_digest(b).items()
    }


def test_afdwin_checkpointed_on_root_a_restores_from_the_bucket_on_root_b(
    afdwin, tmp_path, bucket, opts
):
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    src = tmp_path / "rootA" / "s1"
    src.parent.mkdir()
    rc, cp = a.checkpoint(src)
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -9
    before = demo.va_table(a.events(), False)
    m = json.loads((src / "manifest.json").read_text())
    pushed = backends.push(src, f"s3://{bucket}/nodeA/s1", opts)
    assert pushed.chunks == len({c for s in m["chunks"]["streams"] for c in s["checksums"] if c})
    assert pushed.image_bytes == m["totals"]["image_bytes"]

    dst = tmp_path / "rootB" / "s1"
    dst.parent.mkdir()
    pulled = backends.pull(f"s3://{bucket}/nodeA/s1", dst, opts)
    assert pulled.chunk_bytes == pushed.chunk_bytes_uploaded
    _same_files(src, dst)
    rc, rs = demo.run_agent("restore", "--images-dir", str(dst), "--driver", "fake")
    assert rc == 0 and rs["ok"], rs
    assert rs["roots"] == [a.pid]
    carried = sum(s["bytes"] for s in m["chunks"]["streams"])
    assert [p["bytes"] for p in rs["phases"] if p["name"] == "LOAD_ALLOCATIONS"] == [carried]
    assert a.wait_restored_exit(300) in (0, None)
    evs = a.events()
    assert demo.check_run(evs, STEPS, attention=1, ffn=1) == []
    assert demo.va_table(evs, True) == before
    summary = [e for e in evs if demo.kind(e) == "summary"][-1]
    assert (summary["restores_seen"], summary["lost"], summary["duplicated"]) == (1, 0, 0)


def test_incremental_checkpoints_share_chunks_in_the_bucket_and_restore_signed_on_root_b(
    tmp_path, bucket, opts, rclone
):
    key_file = tmp_path / "node.key"
    key_file.write_bytes(os.urandom(32).hex().encode())
    env = {"CUINTERPOSE_MANIFEST_KEY_FILE": str(key_file)}
    o = dataclasses.replace(opts, node_key=key_file.read_bytes().strip())
    root, run = tmp_path / "rootA", tmp_path / "run"
    root.mkdir()
    run.mkdir()
    ctl = pathlib.Path(tempfile.mkdtemp(prefix="cui-s3-"))  # short: socket paths
    job = subprocess.Popen(
        [sys.executable, str(JOB), "creator", "--bytes", str(SIZE), "--out", str(run)]
        + ["--ctl", str(ctl), "--cuts", "2", "--change-bytes", str(CHANGED), "--timeout-s", "600"],
        stdin=subprocess.DEVNULL,
        env=demo.workload_env(ctl),
        cwd=run,
        start_new_session=True,
    )
    opt = ["--pid", str(job.pid), "--driver", "fake", "--control-dir", str(ctl), "--incremental"]
    opt += ["--chunk-bytes", str(CB)]
    try:
        wait_json(run / "ready.json", "ready.json", job)
        rc, cp1 = demo.run_agent(
            "checkpoint", "--images-dir", str(root / "s1"), *opt, "--leave-running", env=env
        )
        assert rc == 0 and cp1["ok"], cp1
        changed = wait_json(run / "changed-1.json", "the change after the first cut", job)
        rc, cp2 = demo.run_agent("checkpoint", "--images-dir", str(root / "s2"), *opt, env=env)
        assert rc == 0 and cp2["ok"], cp2
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    m1 = json.loads((root / "s1" / "manifest.json").read_text())
    m2 = json.loads((root / "s2" / "manifest.json").read_text())
    assert m2["chunks"]["store"] == store.STORE_REL and m2["chunks"]["written_bytes"] == CHANGED

    r1 = backends.push(root / "s1", f"s3://{bucket}/nodeA/s1", o)
    before = bucket_files(rclone.root, bucket)
    r2 = backends.push(root / "s2", f"s3://{bucket}/nodeA/s2", o)
    [s1], [s2] = m1["chunks"]["streams"], m2["chunks"]["streams"]
    # the job's fill repeats blocks: a chunk that occurs twice is stored once
    distinct1 = {c for c in s1["checksums"] if c}
    assert len(distinct1) < SIZE // CB
    assert (r1.chunks, r1.chunks_uploaded, r1.chunk_bytes_uploaded) == (
        len(distinct1),
        len(distinct1),
        len(distinct1) * CB,
    )
    assert (r2.chunks_uploaded, r2.chunk_bytes_uploaded) == (2, CHANGED)
    assert r2.chunks_present == r2.chunks - 2 and r2.manifest_rewritten
    objs = bucket_files(rclone.root, bucket)
    new = {k for k in objs if k not in before and k.startswith(s3gc.CHUNKS)}
    assert new == {s3gc.chunk_key(m2["chunks"]["checksum"], c) for c in s2["checksums"][:2]}
    # the bucket's manifest: the file-stream form, signed with the node key
    mb = json.loads(objs["nodeA/s2/manifest.json"])
    assert layout.mac_ok(mb, o.node_key)
    for ch in (mb["chunks"], mb["capture"]["chunks"]):
        assert "store" not in ch
        [sb] = ch["streams"]
        assert sb["file"] == f"chunks/shared-{s2['pid']}-{s2['alloc_id']}.bin"
        assert "pack" not in sb and "refs" not in sb and sb["checksums"] == s2["checksums"]

    d = backends.delete(f"s3://{bucket}/nodeA/s1", o)
    only1 = {c for c in s1["checksums"] if c} - {c for c in s2["checksums"] if c}
    assert (d.chunks_removed, d.chunk_bytes_freed) == (len(only1), len(only1) * CB)

    dst = tmp_path / "rootB" / "s2"
    dst.parent.mkdir()
    backends.pull(f"s3://{bucket}/nodeA/s2", dst, o)
    assert not (dst.parent / store.STORE_DIR).exists()
    # the allocation's bytes of the second cut, from the chunks of both pushes
    data = (dst / sb["file"]).read_bytes()
    assert (len(data), hashlib.sha256(data).hexdigest()) == (SIZE, changed["sha256"])
    rc, rs = demo.run_agent("restore", "--images-dir", str(dst), "--driver", "fake", env=env)
    assert rc == 0 and rs["ok"], json.dumps(rs["error"], indent=1)
    res = wait_json(run / "result.json", "the restored job's result", None)
    assert (res["restored"], res["verified"], res["bytes_compared"]) == (True, True, 2 * SIZE)
    assert res["creator_sha256"] == res["importer_sha256"] == changed["sha256"]
