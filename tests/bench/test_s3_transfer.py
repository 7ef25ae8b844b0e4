"""bench/s3_transfer.py at a tiny size (two 8 MiB chunks and a 4 MiB image, every chunk of the
second snapshot changed): one JSON object with the times, the ratios against the local copy of
the same run, and the bytes the second push uploaded. No thresholds."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_s3_transfer_prints_push_pull_and_the_second_push_against_a_local_copy(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "s3_transfer.py"),
            "--bytes",
            str(16 << 20),
            "--changed",
            "1",
            "--threads",
            "2",
            "--dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["bytes"], out["image_bytes"], out["chunk_bytes"]) == (16 << 20, 4 << 20, 8 << 20)
    assert (out["first_uploaded_bytes"], out["second_uploaded_bytes"]) == (20 << 20, 16 << 20)
    assert out["second_chunks_uploaded"] == 2
    for k in (
        "local_copy_s",
        "push_s",
        "pull_s",
        "second_push_s",
        "push_over_local_copy",
        "pull_over_local_copy",
        "second_over_first_push",
    ):
        assert out[k] > 0, k
    assert list(tmp_path.iterdir()) == []  # the bench removed its work directory
