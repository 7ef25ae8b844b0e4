"""``cuinterpose-agent checkpoint/restore/snapshots/delete`` with ``s3://BUCKET/PREFIX``
against a real ``rclone serve s3`` (fakecuda, real CRIU): the commands as an operator runs them,
the endpoint and keys from the standard AWS variables (tests/s3/s3_kit.py ``aws_env``).

- afdwin checkpointed on "node" A (snapshot root A) into the bucket, restored on "node" B (an
  empty root B) from it: every message once, every window at its VA; each local copy removed
  once its work is done.
- the two-process job of bench/datapath_job.py checkpointed twice into the bucket: the second
  upload sends exactly the chunks the job changed, the restore on B finds the second cut's
  bytes; ``snapshots`` lists both; ``delete`` of the first frees exactly the chunks only it had.
- failures, each with its exact outcome: wrong keys (403: refused before anything changed, the
  job untouched), the server stopped in the middle of the upload (rolled back: the job
  resumed with its memory intact and runs to its end, the local snapshot complete and kept, no
  snapshot in the bucket), a chunk object damaged in the bucket (the restore refused at the
  download, the bucket unchanged, nothing restored, the local copy removed).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
from s3_kit import FaultProxy, Rclone, aws_env, bucket_files, put_object, raw_client, wait_json

from cuinterpose.agent.snapshot.backends import s3gc
from cuinterpose.workloads.afdwin import demo

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")

STEPS, HOLD = 120, 20
CB, SIZE, CHANGED = 64 << 10, 4 << 20, 128 << 10
JOB = pathlib.Path(__file__).resolve().parents[2] / "bench" / "datapath_job.py"


def _agent(env: dict, *args: str) -> tuple[int, dict]:
    return demo.run_agent(*args, env=env)


def _distinct(m: dict) -> set:
    recs = [m.get("chunks") or {}, m.get("gpu_storage") or {}]
    return {
        (r["checksum"], c) for r in recs for s in r.get("streams", []) for c in s["checksums"] if c
    }


def test_afdwin_checkpointed_into_the_bucket_on_root_a_restores_on_an_empty_root_b(
    afdwin, tmp_path, bucket, rclone
):
    env = aws_env(rclone.endpoint, tmp_path)
    loc = f"s3://{bucket}/nodeA/s1"
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    local_a = tmp_path / "rootA" / "s1"
    rc, cp = _agent(env, *a.checkpoint_args(loc), "--local-dir", str(local_a))
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -9
    before = demo.va_table(a.events(), False)
    objs = bucket_files(rclone.root, bucket)
    m = json.loads(objs["nodeA/s1/manifest.json"])
    distinct = _distinct(m)
    assert (cp["images_dir"], cp["local_dir"], cp["local_kept"]) == (loc, str(local_a), False)
    up = cp["upload"]
    assert (up["chunks"], up["chunks_uploaded"], up["chunks_present"]) == (
        len(distinct),
        len(distinct),
        0,
    )
    assert up["chunk_bytes_uploaded"] == sum(
        len(objs[s3gc.chunk_key(alg, h)]) for alg, h in distinct
    )
    assert (up["images"], up["image_bytes"]) == (
        len(m["criu"]["files"]),
        m["totals"]["image_bytes"],
    )
    # the bucket: the images under the prefix, the chunks, the manifest; no pin left
    assert {k for k in objs if not k.startswith(s3gc.CHUNKS)} == {
        f"nodeA/s1/{rel}" for rel in m["criu"]["files"]
    } | {"nodeA/s1/manifest.json"}
    rows = {p["name"]: p for p in cp["phases"]}
    assert rows["upload"]["status"] == "ok" and loc in rows["upload"]["detail"]
    names = [p["name"] for p in cp["phases"]]
    assert names.index("sync") < names.index("manifest") < names.index("upload")
    assert names.index("upload") < names.index("kill dumped")
    assert not local_a.exists()  # removed once the upload committed

    local_b = tmp_path / "rootB" / "s1"
    rc, rs = _agent(env, "restore", "--images-dir", loc, "--local-dir", str(local_b))
    assert rc == 0 and rs["ok"], rs
    assert rs["images_dir"] == loc and rs["roots"] == [a.pid]
    dl = rs["download"]
    assert (dl["chunks"], dl["chunk_bytes"], dl["images"], dl["image_bytes"]) == (
        len(distinct),
        up["chunk_bytes_uploaded"],
        up["images"],
        up["image_bytes"],
    )
    assert [p["name"] for p in rs["phases"]][0] == "download"
    carried = sum(s["bytes"] for s in m["chunks"]["streams"])
    assert [p["bytes"] for p in rs["phases"] if p["name"] == "LOAD_ALLOCATIONS"] == [carried]
    assert not local_b.exists() and not local_b.parent.exists()
    assert a.wait_restored_exit(300) in (0, None)
    evs = a.events()
    assert demo.check_run(evs, STEPS, attention=1, ffn=1) == []
    assert demo.va_table(evs, True) == before
    summary = [e for e in evs if demo.kind(e) == "summary"][-1]
    assert (summary["restores_seen"], summary["lost"], summary["duplicated"]) == (1, 0, 0)
    assert bucket_files(rclone.root, bucket) == objs  # the restore wrote nothing there


def test_a_second_checkpoint_uploads_only_the_changed_chunks_and_delete_frees_the_first_ones(
    tmp_path, bucket, rclone
):
    env = aws_env(rclone.endpoint, tmp_path)
    root_a, run = tmp_path / "rootA", tmp_path / "run"
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
    opt = ["--pid", str(job.pid), "--driver", "fake", "--control-dir", str(ctl)]
    opt += ["--chunk-bytes", str(CB)]
    locs = [f"s3://{bucket}/nodeA/s1", f"s3://{bucket}/nodeA/s2"]
    try:
        wait_json(run / "ready.json", "ready.json", job)
        rc, cp1 = _agent(
            env, "checkpoint", "--images-dir", locs[0], *opt, "--leave-running",
            "--local-dir", str(root_a / "s1"), "--keep-local",
        )  # fmt: skip
        assert rc == 0 and cp1["ok"], cp1
        after1 = bucket_files(rclone.root, bucket)
        changed = wait_json(run / "changed-1.json", "the change after the first cut", job)
        rc, cp2 = _agent(
            env, "checkpoint", "--images-dir", locs[1], *opt, "--local-dir", str(root_a / "s2")
        )
        assert rc == 0 and cp2["ok"], cp2
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    objs = bucket_files(rclone.root, bucket)
    m1 = json.loads(objs["nodeA/s1/manifest.json"])
    m2 = json.loads(objs["nodeA/s2/manifest.json"])
    # the first copy was kept (--keep-local), the second removed after its upload
    assert cp1["local_kept"] and (root_a / "s1" / "manifest.json").is_file()
    assert not cp2["local_kept"] and not (root_a / "s2").exists()
    [s1], [s2] = m1["chunks"]["streams"], m2["chunks"]["streams"]
    # the job's fill repeats blocks: a chunk that occurs twice is stored once
    u1, u2 = cp1["upload"], cp2["upload"]
    d1, d2 = _distinct(m1), _distinct(m2)
    assert (u1["chunks_uploaded"], u1["chunk_bytes_uploaded"]) == (len(d1), len(d1) * CB)
    # the second upload: exactly the two chunks the job rewrote, every other one was there
    assert (u2["chunks_uploaded"], u2["chunk_bytes_uploaded"]) == (2, CHANGED)
    assert (u2["chunks_present"], u2["chunk_bytes_present"]) == (len(d2) - 2, (len(d2) - 2) * CB)
    assert u2["images"] == len(m2["criu"]["files"])  # CRIU images: objects of each snapshot
    new = {k for k in objs if k not in after1}
    assert {k for k in new if k.startswith(s3gc.CHUNKS)} == {
        s3gc.chunk_key(m2["chunks"]["checksum"], c) for c in s2["checksums"][:2]
    }
    assert {k for k in new if not k.startswith(s3gc.CHUNKS)} == {
        f"nodeA/s2/{rel}" for rel in m2["criu"]["files"]
    } | {"nodeA/s2/manifest.json"}

    rc, ls = _agent(env, "snapshots", f"s3://{bucket}/nodeA")
    assert rc == 0, ls
    assert [(r["images_dir"], r["snapshot_id"]) for r in ls["snapshots"]] == [
        (locs[0], cp1["snapshot_id"]),
        (locs[1], cp2["snapshot_id"]),
    ]
    assert {r["carrier_bytes"] for r in ls["snapshots"]} == {SIZE}
    rc, one = _agent(env, "snapshots", locs[1])  # the location itself is a snapshot
    assert [r["snapshot_id"] for r in one["snapshots"]] == [cp2["snapshot_id"]]

    local_b = tmp_path / "rootB" / "s2"
    rc, rs = _agent(
        env, "restore", "--images-dir", locs[1], "--driver", "fake", "--local-dir", str(local_b)
    )
    assert rc == 0 and rs["ok"], json.dumps(rs.get("error"), indent=1)
    assert rs["local_dir"] == str(local_b) and not rs["local_kept"] and not local_b.exists()
    res = wait_json(run / "result.json", "the restored job's result", None)
    assert (res["restored"], res["verified"], res["bytes_compared"]) == (True, True, 2 * SIZE)
    assert res["creator_sha256"] == res["importer_sha256"] == changed["sha256"]

    rc, gone = _agent(env, "delete", locs[0])
    assert rc == 0, gone
    only1 = {c for c in s1["checksums"] if c} - {c for c in s2["checksums"] if c}
    assert (gone["deleted"], gone["chunks_removed"], gone["chunk_bytes_freed"]) == (
        locs[0],
        len(only1),
        len(only1) * CB,
    )
    assert gone["objects_removed"] == 1 + len(m1["criu"]["files"])
    left = bucket_files(rclone.root, bucket)
    assert not [k for k in left if k.startswith("nodeA/s1/")]
    assert {k for k in left if k.startswith(s3gc.CHUNKS)} == {
        s3gc.chunk_key(m2["chunks"]["checksum"], c) for c in s2["checksums"] if c
    }
    rc, ls = _agent(env, "snapshots", f"s3://{bucket}/nodeA")
    assert [r["images_dir"] for r in ls["snapshots"]] == [locs[1]]


def test_wrong_keys_refuse_the_checkpoint_before_anything_changed(afdwin, tmp_path, bucket, rclone):
    env = aws_env(rclone.endpoint, tmp_path, secret="not-the-secret")
    loc = f"s3://{bucket}/nodeA/s1"
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    local = tmp_path / "rootA" / "s1"
    rc, out = _agent(env, *a.checkpoint_args(loc), "--local-dir", str(local))
    assert rc == 3 and not out["ok"], out
    err = out["error"]
    assert (err["phase"], err["outcome"]) == ("upload", "refused")
    assert f"s3://{bucket}/nodeA/s1/manifest.json: HEAD refused: HTTP 403" in err["reason"]
    assert "checkpoint refused before anything was changed" in err["reason"]
    assert [p["name"] for p in out["phases"]] == []  # not even the driver was loaded
    assert not local.exists() and not local.parent.exists()
    assert bucket_files(rclone.root, bucket) == {}
    # the job was never asked anything: its hold ends and it runs to its end
    assert a.release_hold()
    assert a.proc.wait(timeout=300) == 0
    evs = a.events()
    assert demo.check_run(evs, STEPS, attention=1, ffn=1, expect_restore=False) == []
    assert not [e for e in evs if demo.kind(e) == "quiesce_requested"]


@pytest.mark.parametrize("mode", ["stopped", "leave-running"])
def test_a_server_stopped_in_the_middle_of_the_upload_rolls_the_checkpoint_back(
    afdwin, tmp_path, mode
):
    """The chunks go while the sync runs; at the first PUT of a CRIU image (the upload step,
    the trees still stopped) the server is stopped: every later request is refused. The
    checkpoint fails after the retries, rolled back, whether the job was to be killed or left
    running: it is resumed with its memory intact and runs to its end; the local snapshot,
    complete, is kept; the bucket holds no manifest."""
    srv = Rclone(tmp_path / "srv", tmp_path / "srv.log").start()
    proxy = FaultProxy(srv.endpoint)
    try:
        raw_client(srv.endpoint).make_bucket("bkt")
        rule = proxy.add("PUT", r"^/bkt/nodeA/s1/criu/", "stop", 1, fn=srv.stop)
        env = aws_env(proxy.endpoint, tmp_path)
        a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
        a.wait_hold()
        local = tmp_path / "rootA" / "s1"
        extra = ["--leave-running"] if mode == "leave-running" else []
        rc, out = _agent(
            env, *a.checkpoint_args("s3://bkt/nodeA/s1"), "--local-dir", str(local), *extra
        )
        assert rule["hits"] == 1
        assert rc == 4 and not out["ok"], out
        err = out["error"]
        assert (err["phase"], err["outcome"]) == ("upload", "rolled_back")
        assert err["reason"].startswith("s3://bkt/nodeA/s1/criu/")
        assert "No manifest was written (no snapshot at s3://bkt/nodeA/s1)" in err["reason"]
        assert f"the local snapshot {local} is unchanged" in err["reason"]
        assert "the workload continues with its memory intact" in err["reason"]
        names = [p["name"] for p in out["phases"]]
        assert names.index("manifest") < names.index("upload") < names.index("rollback native")
        assert "kill dumped" not in names and "resume" not in names
        # the local snapshot is complete: its manifest and every image it lists
        m = json.loads((local / "manifest.json").read_text())
        for rel, meta in m["criu"]["files"].items():
            assert (local / rel).stat().st_size == meta["bytes"]
        # the chunks went while the sync ran (before the image PUT), nothing else did
        stored = bucket_files(srv.root, "bkt")
        assert not [k for k in stored if k.endswith("manifest.json")]
        assert {k for k in stored if k.startswith(s3gc.CHUNKS)} == {
            s3gc.chunk_key(alg, h) for alg, h in _distinct(m)
        }
        # the job was resumed (restored=false) and finishes every message exactly once
        assert a.proc.wait(timeout=300) == 0
        evs = a.events()
        assert demo.check_run(evs, STEPS, attention=1, ffn=1, expect_restore=False) == []
    finally:
        proxy.close()
        srv.stop()


def test_a_damaged_chunk_object_refuses_the_restore_and_leaves_the_bucket_as_it_was(
    afdwin, tmp_path, bucket, rclone, raw
):
    env = aws_env(rclone.endpoint, tmp_path)
    loc = f"s3://{bucket}/nodeA/s1"
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    rc, cp = _agent(env, *a.checkpoint_args(loc), "--local-dir", str(tmp_path / "rootA" / "s1"))
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -9
    objs = bucket_files(rclone.root, bucket)
    m = json.loads(objs["nodeA/s1/manifest.json"])
    alg, h = sorted(_distinct(m))[0]
    key = s3gc.chunk_key(alg, h)
    good = objs[key]
    put_object(raw, bucket, key, bytes([good[0] ^ 0xFF]) + good[1:])  # same length, one byte
    damaged = bucket_files(rclone.root, bucket)

    local_b = tmp_path / "rootB" / "s1"
    rc, rs = _agent(env, "restore", "--images-dir", loc, "--local-dir", str(local_b))
    assert rc == 3 and not rs["ok"], rs
    err = rs["error"]
    assert (err["phase"], err["outcome"]) == ("download", "refused")
    assert err["reason"].startswith(f"s3://{bucket}/{key}: GET failed (chunk object has {alg} ")
    assert f"not the {h} its key names; 4 attempts)" in err["reason"]
    assert "was removed, the bucket is untouched" in err["reason"]
    assert [p["name"] for p in rs["phases"]] == ["download"]
    assert not local_b.exists() and not local_b.parent.exists()
    assert bucket_files(rclone.root, bucket) == damaged
    assert not demo.pid_alive(a.pid)  # nothing was restored
    # the chunk repaired, the same restore succeeds
    put_object(raw, bucket, key, good)
    rc, rs = _agent(env, "restore", "--images-dir", loc, "--local-dir", str(local_b))
    assert rc == 0 and rs["ok"], rs
    assert a.wait_restored_exit(300) in (0, None)
    assert demo.check_run(a.events(), STEPS, attention=1, ffn=1) == []


def test_a_signal_during_the_upload_cancels_it_and_rolls_the_checkpoint_back(
    afdwin, tmp_path, bucket, rclone
):
    """SIGTERM arriving at the upload step (the test trigger, agent/mech/signal_at.py): the
    upload is cancelled at once and the checkpoint rolled back, naming the signal; of it the
    bucket keeps only chunks sent during the sync (no manifest, no image, no pin), and the
    kept local copy is deleted like any snapshot."""
    env = aws_env(rclone.endpoint, tmp_path)
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    local = tmp_path / "rootA" / "s1"
    rc, out = _agent(
        env | {"CUINTERPOSE_TEST_SIGNAL_AT": "before:upload=SIGTERM"},
        *a.checkpoint_args(f"s3://{bucket}/nodeA/s1"),
        "--local-dir",
        str(local),
    )
    assert rc == 4 and not out["ok"], out
    err = out["error"]
    assert (err["phase"], err["outcome"]) == ("upload", "rolled_back")
    assert "cancelled" in err["reason"] and "(interrupted by SIGTERM)" in err["reason"]
    assert a.proc.wait(timeout=300) == 0
    assert demo.check_run(a.events(), STEPS, attention=1, ffn=1, expect_restore=False) == []
    m = json.loads((local / "manifest.json").read_text())
    objs = bucket_files(rclone.root, bucket)
    assert set(objs) <= {s3gc.chunk_key(alg, h) for alg, h in _distinct(m)}
    rc, got = _agent(env, "delete", str(local))
    assert rc == 0 and got["deleted"] == str(local)
