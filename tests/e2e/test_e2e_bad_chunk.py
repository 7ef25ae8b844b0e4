"""A damaged chunk file at restore, end to end (fakecuda, real CRIU, the creator + importer job
of test_e2e_chunk_store.py): the shims verify every chunk in LOAD_ALLOCATIONS before its bytes
reach the device (issue 12: checksums computed once, no second pass over the files), so the
restore fails there (``restore_failed``: the restored tree is killed), naming the allocation,
the chunk and where it lies in the snapshot directory; no file of the snapshot changes; with
the byte put back the same snapshot restores and the job's bytes equal the cut's."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import pytest
import test_e2e_chunk_store as cs  # its job, waits and stream checks (tests/e2e is on sys.path)

from cuinterpose.workloads.afdwin import demo

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")

BAD = 5  # the chunk damaged


def _listing(snap: pathlib.Path) -> dict:
    return {
        str(p.relative_to(snap)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(snap.rglob("*"))
        if p.is_file()
    }


def test_a_damaged_chunk_fails_the_restore_naming_its_file_and_leaves_the_snapshot(tmp_path):
    root, run = tmp_path / "snapshots", tmp_path / "run"
    root.mkdir()
    run.mkdir()
    snap = root / "s1"
    job, ctl = cs._start(run, cuts=1)
    try:
        ready = cs._wait(run / "ready.json", "ready.json", job)
        rc, cp = demo.run_agent(
            "checkpoint",
            "--images-dir",
            str(snap),
            "--pid",
            str(job.pid),
            "--driver",
            "fake",
            "--control-dir",
            str(ctl),
            "--chunk-bytes",
            "64KiB",
        )
        assert rc == 0 and cp["ok"], cp
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    m = json.loads((snap / "manifest.json").read_text())
    [s] = m["chunks"]["streams"]
    assert (s["pid"], m["chunks"]["chunk_bytes"]) == (ready["creator"], cs.CB)
    path = snap / s["file"]
    good = path.read_bytes()
    bad = bytearray(good)
    bad[BAD * cs.CB + 100] ^= 0x01
    path.write_bytes(bytes(bad))
    before = _listing(snap)

    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert rc == 5 and not rs["ok"], rs
    err = rs["error"]
    assert (err["phase"], err["outcome"]) == ("LOAD_ALLOCATIONS", "restore_failed"), err
    assert (
        f"allocation {s['alloc_id']}: chunk {BAD} of its chunk file has checksum" in err["reason"]
    )
    assert (
        f"; the chunk is bytes {BAD * cs.CB}..{(BAD + 1) * cs.CB - 1} of {snap / s['file']}; "
    ) in err["reason"], err["reason"]
    assert _listing(snap) == before  # nothing of the snapshot changed

    path.write_bytes(good)
    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert rc == 0 and rs["ok"], rs
    res = cs._wait_file(run / "result.json")
    assert (res["restored"], res["verified"]) == (True, True)
    assert res["creator_sha256"] == res["importer_sha256"] == ready["sha256"]
