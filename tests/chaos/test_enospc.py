"""Chaos kind 3: ENOSPC at every write of a checkpoint.

A test-only LD_PRELOAD library (tests/chaos/c/enospc.c, built here with ``build_c``) makes the
k-th write to the snapshot directory, and every later one, fail with ENOSPC, as a full
filesystem would. It is loaded into the agent (``LD_PRELOAD``) and into its CRIU child (a
wrapper named by ``CUINTERPOSE_CRIU`` that loads it with ld.so's ``--preload``: the agent strips
``LD_PRELOAD`` from CRIU's environment). Counted: every create under the directory and each
descriptor's first write, splice, fsync and fallocate (``CHAOS_ENOSPC_FIRST=1``: every write
site once; the thousands of dump.log lines count once). A first run counts them (N); then for
every k in 1..N the checkpoint must end rolled back with the job's evidence exact and no file
left in the snapshot directory, or with exit 0 and a complete snapshot; never exit 0 without
one.
"""

from __future__ import annotations

import pathlib
import struct

import kit
import pytest
import tally

from cuinterpose.agent.snapshot import manifest as manifest_mod

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    return private_tmp


def _n(path: pathlib.Path) -> int:
    return struct.unpack("<Q", path.read_bytes())[0] if path.exists() else 0


def _checkpoint(afdwin, tmp_path, enospc, who: str, k: int):
    """A job and a checkpoint of it whose ``who`` ("agent" or "criu") fails its k-th write
    (0: none). Returns (job, snapshot dir, exit code, JSON, writes counted of ``who``)."""
    lib, wrapper = enospc
    a = kit.job(afdwin)
    name = f"{who}-{k}"
    snap, count = tmp_path / f"snap-{name}", {w: tmp_path / f"count-{name}-{w}" for w in WHO}
    env = {
        "LD_PRELOAD": str(lib),
        "CUINTERPOSE_CRIU": str(wrapper),
        "CHAOS_ENOSPC_PREFIX": str(snap),
        "CHAOS_ENOSPC_FIRST": "1",
        "CHAOS_ENOSPC_COUNT": str(count["agent"]),
        "CHAOS_ENOSPC_AT": str(k if who == "agent" else 0),
        "CHAOS_ENOSPC_CRIU_COUNT": str(count["criu"]),
        "CHAOS_ENOSPC_CRIU_AT": str(k if who == "criu" else 0),
        "CHAOS_ENOSPC_LOG": str(tmp_path / f"log-{name}-agent"),
        "CHAOS_ENOSPC_CRIU_LOG": str(tmp_path / f"log-{name}-criu"),
    }
    rc, out, _ = kit.checkpoint(a, snap, env=env)
    return a, snap, rc, out, {w: _n(c) for w, c in count.items()}


WHO = ("agent", "criu")


def _count(afdwin, tmp_path, enospc) -> dict:
    """Count the writes of one checkpoint ({"agent": n, "criu": n, "dir_fsync": [k of the
    agent's fsyncs of the snapshot directory]}); none fails: a snapshot."""
    a, snap, rc, out, total = _checkpoint(afdwin, tmp_path, enospc, "none", 0)
    ops = [ln.split()[1] for ln in (tmp_path / "log-none-0-agent").read_text().splitlines()]
    assert len(ops) == total["agent"], ops
    # the agent's writes: manifest.json.tmp created, written, fsynced, renamed, then the
    # directory fsynced (agent/snapshot/manifest.py write()): the fsync after an fsync
    total["dir_fsync"] = [i + 1 for i in range(1, len(ops)) if ops[i - 1 : i + 1] == ["fsync"] * 2]
    assert total["dir_fsync"], ops
    assert kit.judge("ENOSPC none", a, snap, rc, out) == "snapshot", out
    # creates and first writes of the CRIU images; manifest.json's create, write, 2 fsyncs
    assert total["criu"] >= 2 * len(manifest_mod.load(snap)["criu"]["files"]), total
    assert total["agent"] >= 4, total
    return total


def _left(snap: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(snap)) for p in snap.rglob("*")) if snap.exists() else []


def _one(afdwin, tmp_path, enospc, who: str, k: int, total: int) -> None:
    a, snap, rc, out, n = _checkpoint(afdwin, tmp_path, enospc, who, k)
    if who == "agent":  # CRIU's count varies by a few between runs; the agent's does not
        assert n[who] >= k, f"ENOSPC {who} {k}: only {n} writes counted"
    if kit.judge(f"ENOSPC {who} write {k}/{total}", a, snap, rc, out) == "rolled_back":
        left = _left(snap)
        if left:
            tally.record(f"ENOSPC leftovers {who} {k}", "false_success")
            pytest.fail(f"ENOSPC at {who} write {k}/{total}: rolled back, left {left} in {snap}")
        assert "No space left on device" in str(out["error"]), out


def test_enospc_at_every_write(afdwin, tmp_path, enospc):
    """Every write of CRIU's, every write of the agent's but the first fsync of the snapshot
    directory (the test below)."""
    total = _count(afdwin, tmp_path, enospc)
    for k in range(1, total["criu"] + 1):
        _one(afdwin, tmp_path, enospc, "criu", k, total["criu"])
    for k in range(1, total["agent"] + 1):
        if k != total["dir_fsync"][0]:
            _one(afdwin, tmp_path, enospc, "agent", k, total["agent"])


def test_enospc_at_the_fsync_of_the_snapshot_directory(afdwin, tmp_path, enospc):
    """The fsync of the snapshot directory after manifest.json was renamed into place fails:
    the checkpoint rolls back and no manifest.json is left (manifest.write removes it), so no
    snapshot looks complete of a job that continued."""
    total = _count(afdwin, tmp_path, enospc)
    _one(afdwin, tmp_path, enospc, "agent", total["dir_fsync"][0], total["agent"])
