"""bench/datapath.py at a tiny size: one JSON object per case with the issue's fields, the
bytes verified after the restore, the job's phases summed per name. No thresholds."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
B = 4 << 20
FIELDS = {
    "bytes",
    "zero_fraction",
    "checkpoint_s",
    "restore_s",
    "dd_s",
    "dd_direct_s",
    "read_s",
    "criu_only_s",
    "criu_only_restore_s",
    "creator_peak_rss_bytes",
    "creator_rss_at_ready_bytes",
    "snapshot_disk_bytes",
    "image_bytes",
    "direct_bytes",
    "checkpoint_outside_rows_s",
    "restore_outside_rows_s",
    "verified",
    "bytes_compared",
    "allocated_bytes",
    "zero_bytes",
    "checkpoint_phases",
    "restore_phases",
    "ratios",
}


def _datapath(tmp_path, *args) -> list[dict]:
    """bench/datapath.py ARGS --json (no LD_PRELOAD): its cases."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "datapath.py"), *args]
        + ["--json", "--dir", str(tmp_path), "--timeout-s", "600"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_datapath_json_at_4_mib_dense_and_sparse(criu_ok, tmp_path):
    cases = _datapath(tmp_path, "--bytes", str(B), "--zero-fraction", "0", "--zero-fraction", "0.9")
    assert [(c["bytes"], c["zero_fraction"]) for c in cases] == [(B, 0.0), (B, 0.9)]
    for c in cases:
        assert set(c) == FIELDS
        assert c["verified"] is True and c["bytes_compared"] == 2 * B  # creator and importer
        assert c["allocated_bytes"] == B  # a multiple of fakecuda's 2 MiB granularity
        for k in ("checkpoint_s", "restore_s", "dd_s", "dd_direct_s", "read_s", "criu_only_s"):
            assert isinstance(c[k], float) and c[k] > 0, k
        # fakecuda backs the allocation in host memory; the high-water mark covers the ready RSS
        assert c["creator_peak_rss_bytes"] >= c["creator_rss_at_ready_bytes"] >= B
        assert c["snapshot_disk_bytes"] > 0 and c["image_bytes"] > 0
        # B is one 4 MiB chunk, not all zero in either case: written with O_DIRECT
        assert c["direct_bytes"] == B
        # the agent's named phases, summed per name: the carrier and the sync/verify passes
        cp, rs = c["checkpoint_phases"], c["restore_phases"]
        assert cp["SAVE_ALLOCATIONS"]["bytes"] == B and rs["LOAD_ALLOCATIONS"]["bytes"] == B
        assert cp["sync"]["bytes"] >= c["image_bytes"]  # the images, hashed as they were synced
        assert rs["verify"]["bytes"] == c["image_bytes"]
        assert set(c["ratios"]) >= {
            "checkpoint_over_dd",
            "checkpoint_over_dd_direct",
            "restore_over_read_plus_criu",
        }
        # the rows tile the agent's run inside the command's wall time
        for what in ("checkpoint", "restore"):
            rows = sum(v["seconds"] for v in c[f"{what}_phases"].values())
            assert c[f"{what}_outside_rows_s"] == round(c[f"{what}_s"] - rows, 6)
            assert c[f"{what}_outside_rows_s"] > 0
    # the 90 %-zero job: nine fill units of ten are zero (unit 384 KiB at 4 MiB: 9 of 11 zero)
    assert cases[0]["zero_bytes"] == 0 and cases[1]["zero_bytes"] == 9 * 393216
    assert "checkpoint_over_dense" in cases[1]["ratios"]


def test_datapath_incremental_case_writes_only_the_changed_chunk(criu_ok, tmp_path):
    """16 MiB dense (two 8 MiB chunks), the job rewrites its first 4 MiB between the two
    incremental checkpoints: the second writes exactly the first chunk, the restored job
    compares every byte of the second cut."""
    big = 16 << 20
    plain, incr = _datapath(
        tmp_path, "--bytes", str(big), "--zero-fraction", "0", "--incremental", "0.25"
    )
    assert set(plain) == FIELDS
    assert set(incr) == FIELDS | {"change_fraction", "first_checkpoint_s", "written_bytes"}
    assert (incr["bytes"], incr["zero_fraction"], incr["change_fraction"]) == (big, 0.0, 0.25)
    assert incr["verified"] is True and incr["bytes_compared"] == 2 * big
    assert incr["written_bytes"] == 8 << 20  # chunk 0 changed, chunk 1 refers to the first pack
    assert (plain["direct_bytes"], incr["direct_bytes"]) == (big, 8 << 20)
    # the second snapshot holds its images and one 8 MiB chunk, not the 16 MiB
    assert (
        incr["image_bytes"] + (8 << 20)
        <= incr["snapshot_disk_bytes"]
        < plain["snapshot_disk_bytes"]
    )
    assert incr["checkpoint_phases"]["SAVE_ALLOCATIONS"]["bytes"] == big
    assert {"second_over_first", "written_over_bytes", "checkpoint_over_dense"} <= set(
        incr["ratios"]
    )
    assert incr["ratios"]["written_over_bytes"] == 0.5
