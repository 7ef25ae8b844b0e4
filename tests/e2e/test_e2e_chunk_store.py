"""Incremental snapshots through the chunk store (issue 12 item 3; decisions D34), fakecuda
and real CRIU, 64 KiB chunks, the two-process job of bench/datapath_job.py (4 MiB shared by a
creator and an importer):
- the first ``checkpoint --incremental --leave-running`` writes every chunk into a pack of
  ROOT/.cuinterpose-store; the job then rewrites its first 128 KiB; the second checkpoint
  writes exactly those two chunks and refers to the other 62, each to a chunk of the first
  pack with its digest (the pack's st_blocks hold 128 KiB); every stream reassembled from
  its pack and refs hashes to its checksums;
- ``delete`` of the first snapshot removes its directory and frees exactly the chunks of its
  pack the second does not refer to (they read back as zeros); the pack stays;
- a pack chunk that no longer matches its digest refuses the restore naming the allocation,
  the chunk, the pack file and its byte range (a ref's, and the snapshot's own pack's), the
  snapshot untouched; repaired, the second snapshot restores and both
  processes find the bytes of the second cut (SHA-256 of the whole mapping compared)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import pytest

from cuinterpose.agent.snapshot import store
from cuinterpose.coordinator.contract import read_json
from cuinterpose.coordinator.protocol import chunk_digest
from cuinterpose.workloads.afdwin import demo

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")

CB = 64 << 10
SIZE = 4 << 20
CHANGED = 2 * CB
JOB = pathlib.Path(__file__).resolve().parents[2] / "bench" / "datapath_job.py"


def _start(run, cuts=2):
    """The job (``cuts`` quiesces, the first 128 KiB rewritten after each left-running one)
    and its control dir."""
    ctl = pathlib.Path(tempfile.mkdtemp(prefix="cui-cs-"))  # short: socket paths
    job = subprocess.Popen(
        [sys.executable, str(JOB), "creator", "--bytes", str(SIZE), "--out", str(run)]
        + ["--ctl", str(ctl), "--cuts", str(cuts), "--change-bytes", str(CHANGED)]
        + ["--timeout-s", "600"],
        stdin=subprocess.DEVNULL,
        env=demo.workload_env(ctl),
        cwd=run,
        start_new_session=True,
    )
    return job, ctl


def _opts(job, ctl) -> list[str]:
    return ["--pid", str(job.pid), "--driver", "fake", "--control-dir", str(ctl)] + [
        "--incremental",
        "--chunk-bytes",
        str(CB),
    ]


def _first_cut(tmp_path):
    """(job, ctl, root, run, the first snapshot's manifest, its pack's bytes): the job
    checkpointed once (left running) and changed."""
    root, run = tmp_path / "snapshots", tmp_path / "run"
    root.mkdir()
    run.mkdir()
    job, ctl = _start(run)
    _wait(run / "ready.json", "ready.json", job)
    rc, cp1 = demo.run_agent(
        "checkpoint", "--images-dir", str(root / "s1"), *_opts(job, ctl), "--leave-running"
    )
    assert rc == 0 and cp1["ok"], cp1
    _wait(run / "changed-1.json", "the change after the first cut", job)
    m1 = json.loads((root / "s1" / "manifest.json").read_text())
    [s1] = m1["chunks"]["streams"]
    return job, ctl, root, run, m1, (store.packs_dir(root) / s1["pack"]).read_bytes()


def _store_listing(root) -> dict:
    top = root / store.STORE_DIR
    return {d: sorted(os.listdir(top / d)) for d in (store.PACKS_DIR, store.PINS_DIR)}


def test_a_failed_incremental_checkpoint_removes_only_its_own_packs(tmp_path):
    """Rolled back (SIGINT before the dump): its packs and pin go, the first snapshot's pack
    is byte for byte what it was, and the rebuilt job holds the bytes of the second cut."""
    job, ctl, root, run, m1, pack1 = _first_cut(tmp_path)
    try:
        env = {"CUINTERPOSE_TEST_SIGNAL_AT": "before:criu dump=SIGINT"}
        rc, cp2 = demo.run_agent(
            "checkpoint", "--images-dir", str(root / "s2"), *_opts(job, ctl), env=env
        )
        assert rc != 0 and cp2["error"]["outcome"] == "rolled_back", cp2
        res = _wait(run / "result.json", "the rebuilt job's result", job)
    finally:
        if job.poll() is None:
            job.kill()
    [s1] = m1["chunks"]["streams"]
    assert _store_listing(root) == {store.PACKS_DIR: [s1["pack"]], store.PINS_DIR: []}
    assert (store.packs_dir(root) / s1["pack"]).read_bytes() == pack1
    changed = read_json(run / "changed-1.json")
    assert (res["restored"], res["verified"]) == (False, True)
    assert res["creator_sha256"] == res["importer_sha256"] == changed["sha256"]


def test_a_dead_agents_packs_stay_pinned_through_a_delete_until_release(tmp_path):
    """The agent is SIGKILLed after the dump of the second (incremental) checkpoint: no
    manifest names its packs, yet a delete of the first snapshot (whose pack the second's refs
    use) frees nothing of either; ``release`` then loads the shims back through those packs,
    the job holds the bytes of the second cut, and the pin and the second's packs are gone."""
    job, ctl, root, run, m1, pack1 = _first_cut(tmp_path)
    [s1] = m1["chunks"]["streams"]
    try:
        env = {"CUINTERPOSE_TEST_SIGNAL_AT": "after:criu dump"}
        rc, _ = demo.run_agent(
            "checkpoint", "--images-dir", str(root / "s2"), *_opts(job, ctl), env=env
        )
        assert rc == -9
        listing = _store_listing(root)
        assert len(listing[store.PACKS_DIR]) == 2 and len(listing[store.PINS_DIR]) == 1
        rc, out = demo.run_agent("delete", str(root / "s1"))
        assert rc == 0 and out["ok"], out
        assert (out["packs_removed"], out["pack_bytes_freed"]) == (0, 0)
        assert out["pinned"] == [str(root / "s2")]
        assert (store.packs_dir(root) / s1["pack"]).read_bytes() == pack1
        rc, rel = demo.run_agent("release", "--pid", str(job.pid), "--control-dir", str(ctl))
        assert rc == 0 and rel["ok"] and rel["outcome"] == "rolled_back", rel
        res = _wait(run / "result.json", "the released job's result", job)
    finally:
        if job.poll() is None:
            job.kill()
    changed = read_json(run / "changed-1.json")
    assert (res["restored"], res["verified"]) == (False, True)
    assert res["creator_sha256"] == res["importer_sha256"] == changed["sha256"]
    # s1 is deleted and s2 never completed: the next collect may free s1's pack
    assert _store_listing(root) == {store.PACKS_DIR: [s1["pack"]], store.PINS_DIR: []}
    assert store.collect(root)["packs_removed"] == 1
    assert _store_listing(root)[store.PACKS_DIR] == []


def _wait(path, what, proc, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while (obj := read_json(path)) is None:
        assert proc.poll() is None, f"the job exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.01)
    return obj


def _stream_bytes(packs, s) -> bytes:
    """A stream's bytes from its own pack and its refs (zero chunks as zeros)."""
    refs = {i: (n, o) for i, n, o in s["refs"]}
    own = (packs / s["pack"]).read_bytes()
    out = bytearray()
    for i, c in enumerate(s["checksums"]):
        n = min(CB, s["bytes"] - i * CB)
        if c is None:
            out += bytes(n)
            continue
        name, off = refs.get(i, (s["pack"], i * CB))
        data = own if name == s["pack"] else (packs / name).read_bytes()
        out += data[off : off + n]
    return bytes(out)


def _check_streams(packs, m) -> None:
    def _digest(b: bytes) -> str:
        return chunk_digest(m["chunks"]["checksum"], b).hex()

    for s in m["chunks"]["streams"]:
        data = _stream_bytes(packs, s)
        assert len(data) == s["bytes"]
        for i, c in enumerate(s["checksums"]):
            part = data[i * CB : (i + 1) * CB]
            assert c == (None if part == bytes(len(part)) else _digest(part)), (s["pack"], i)


def _allocated(p) -> int:
    return os.stat(p).st_blocks * 512


def test_second_checkpoint_writes_only_changed_chunks_delete_frees_only_unshared(tmp_path):
    root, run = tmp_path / "snapshots", tmp_path / "run"
    root.mkdir()
    run.mkdir()
    packs = store.packs_dir(root)
    job, ctl = _start(run)
    try:
        ready = _wait(run / "ready.json", "ready.json", job)
        opts = _opts(job, ctl)
        rc, cp1 = demo.run_agent(
            "checkpoint", "--images-dir", str(root / "s1"), *opts, "--leave-running"
        )
        assert rc == 0 and cp1["ok"], cp1
        changed = _wait(run / "changed-1.json", "the change after the first cut", job)
        rc, cp2 = demo.run_agent("checkpoint", "--images-dir", str(root / "s2"), *opts)
        assert rc == 0 and cp2["ok"], cp2
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    m1 = json.loads((root / "s1" / "manifest.json").read_text())
    m2 = json.loads((root / "s2" / "manifest.json").read_text())
    ch1, ch2 = m1["chunks"], m2["chunks"]
    assert (ch1["store"], ch1["chunk_bytes"]) == (store.STORE_REL, CB)
    assert not (root / "s1" / "chunks").exists()
    [s1] = ch1["streams"]  # the creator's one allocation
    [s2] = ch2["streams"]
    assert s1["pid"] == s2["pid"] == ready["creator"] and s1["alloc_id"] == s2["alloc_id"]
    assert (s1["refs"], ch1["written_bytes"], s1["bytes"]) == ([], SIZE, SIZE)
    n = SIZE // CB
    # the two rewritten chunks are new, the other 62 are the first pack's at their own place
    assert [i for i in range(n) if s1["checksums"][i] != s2["checksums"][i]] == [0, 1]
    # every other chunk refers to a chunk of the first pack with the same digest (the job's
    # fill repeats a block, so that is not always the chunk at the same place)
    assert [r[0] for r in s2["refs"]] == list(range(2, n))
    for i, pack, off in s2["refs"]:
        assert (pack, off % CB) == (s1["pack"], 0)
        assert s1["checksums"][off // CB] == s2["checksums"][i]
    used = {off // CB for _, _, off in s2["refs"]}
    unused = [k for k in range(n) if k not in used]
    assert unused  # the delete below frees these
    assert ch2["written_bytes"] == CHANGED
    assert (ch1["direct_bytes"], ch2["direct_bytes"]) == (SIZE, CHANGED)  # O_DIRECT, all of it
    assert [p["bytes"] for p in m2["phases"] if p["name"] == "SAVE_ALLOCATIONS"] == [SIZE]
    assert _allocated(packs / s2["pack"]) == CHANGED
    assert sorted(os.listdir(packs)) == sorted([s1["pack"], s2["pack"]])
    _check_streams(packs, m1)
    _check_streams(packs, m2)

    # delete s1: its pack stays (s2 refers to chunks of it), the chunks nobody uses are freed
    before = _allocated(packs / s1["pack"])
    rc, out = demo.run_agent("delete", str(root / "s1"))
    assert rc == 0 and out["ok"], out
    assert not (root / "s1").exists()
    assert (out["packs_removed"], out["packs_kept"]) == (0, 2)
    freed = before - _allocated(packs / s1["pack"])
    assert out["pack_bytes_freed"] == freed
    # st_blocks also counts the filesystem's extent blocks: within 16 KiB of the chunks
    assert len(unused) * CB - (16 << 10) <= freed <= len(unused) * CB
    data = (packs / s1["pack"]).read_bytes()
    for k in range(n):  # freed chunks read as zeros (holes), the used ones are intact
        part = data[k * CB : (k + 1) * CB]
        assert (
            part == bytes(CB)
            if k in unused
            else chunk_digest(ch1["checksum"], part).hex() == s1["checksums"][k]
        )
    _check_streams(packs, m2)  # every byte of s2 is still there

    # a chunk that no longer matches refuses the restore; the snapshot stays as it was
    victim = packs / s1["pack"]
    saved = victim.read_bytes()
    _, _, off = s2["refs"][3]
    with open(victim, "r+b") as f:
        f.seek(off + 3)
        f.write(bytes([saved[off + 3] ^ 0xFF]))
    rc, bad = demo.run_agent("restore", "--images-dir", str(root / "s2"), "--driver", "fake")
    assert rc != 0 and not bad["ok"], bad
    msg = bad["error"]["message"]
    # every chunk whose ref points at the damaged bytes fails; the readers report the first
    found = re.search(
        rf"allocation {s2['alloc_id']}: chunk (\d+) of chunk store source 0 at offset {off} has checksum",
        msg,
    )
    assert found and [int(found[1]), s1["pack"], off] in s2["refs"], msg
    # the refusal names the pack file and the byte range (issue 23)
    assert f"; the chunk is bytes {off}..{off + CB - 1} of {victim}; " in msg, msg
    assert json.loads((root / "s2" / "manifest.json").read_text()) == m2
    victim.write_bytes(saved)
    # a damaged chunk of the snapshot's own pack (chunk 1: rewritten after the first cut)
    own = packs / s2["pack"]
    with open(own, "r+b") as f:
        f.seek(CB + 7)
        byte = f.read(1)
        f.seek(CB + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    rc, bad = demo.run_agent("restore", "--images-dir", str(root / "s2"), "--driver", "fake")
    assert rc != 0 and not bad["ok"], bad
    msg = bad["error"]["message"]
    assert f"allocation {s2['alloc_id']}: chunk 1 of its chunk file has checksum" in msg, msg
    assert f"; the chunk is bytes {CB}..{2 * CB - 1} of {own}; " in msg, msg
    with open(own, "r+b") as f:
        f.seek(CB + 7)
        f.write(byte)

    rc, rs = demo.run_agent("restore", "--images-dir", str(root / "s2"), "--driver", "fake")
    assert rc == 0 and rs["ok"], rs
    res = _wait_file(run / "result.json")
    assert (res["restored"], res["verified"], res["bytes_compared"]) == (True, True, 2 * SIZE)
    assert res["creator_sha256"] == res["importer_sha256"] == changed["sha256"]


def _wait_file(path, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while (obj := read_json(path)) is None:
        assert time.monotonic() < deadline, f"no {path} within {timeout_s} s"
        time.sleep(0.01)
    return obj
