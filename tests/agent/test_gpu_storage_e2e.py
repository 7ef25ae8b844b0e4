"""GPU memory through custom storage (issue 12 item 2), end to end: a one-process job holding
64 MiB of ``cuMemAlloc`` memory (half a pattern, half zero) under the shim on fakecuda, the
agent CLI, real CRIU.

- ``--gpu-storage host`` (``$CUINTERPOSE_GPU_STORAGE``): the driver stages the GPU memory in
  the process, CRIU's page images hold it; restore gives the bytes back;
- custom storage (auto, fakecuda 13.5): one stream ``chunks/gpu-<pid>-0.bin`` of the region's
  size, the zero half not written (sparse, null checksums), CRIU's page images smaller than
  the host run's by at least the 64 MiB; restore gives the same bytes back;
- a corrupted chunk refuses the restore naming file, pid, ordinal, chunk and both checksums,
  the snapshot byte for byte unchanged;
- a failed chunk write (ENOSPC: a full tmpfs) rolls back: the job keeps its memory, no file
  under ``chunks/`` is left;
- ``doctor`` has a "gpu storage" row: custom on fakecuda 13.5, host on FAKECUDA_DRIVER_VERSION
  13010 and says why.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from cuinterpose.agent.mech import gpustore
from cuinterpose.agent.run import carriers
from cuinterpose.coordinator import contract
from cuinterpose.coordinator.protocol import ChunkSettings
from cuinterpose.workloads.afdwin import demo

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "criu"))
from criu_helpers import wait_until  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
MIB = 64
N = MIB << 20
CB = ChunkSettings().chunk_bytes


def pages_bytes(snap: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in (snap / "criu").rglob("pages-*.img"))


tree_digest = demo.snapshot_digest


class Job:
    def __init__(self, tmp: pathlib.Path):
        self.ctl = tmp / "ctl"
        self.ctl.mkdir()
        self.out = str(tmp / "job")
        log = open(tmp / "job.log", "ab")  # appended: restorable (workload contract)
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "gpumem_workload.py"), str(self.ctl), self.out, str(MIB)],
            env=demo.workload_env(self.ctl),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        self.up = wait_until(lambda: contract.read_json(self.out + ".up"), "the job's 64 MiB")
        self.pid = self.up["pid"]

    def checkpoint(self, snap: pathlib.Path, mode: str):
        """``checkpoint --gpu-storage MODE`` (the flag; $CUINTERPOSE_GPU_STORAGE unset)."""
        assert "CUINTERPOSE_GPU_STORAGE" not in os.environ
        return demo.run_agent(
            "checkpoint",
            "--pid",
            str(self.pid),
            "--images-dir",
            str(snap),
            "--driver",
            "fake",
            "--control-dir",
            str(self.ctl),
            "--gpu-storage",
            mode,
        )

    def wait_gone(self):
        wait_until(lambda: not demo.pid_alive(self.pid), f"dumped job {self.pid} gone")
        demo.reap_zombies()

    def restore(self, snap: pathlib.Path):
        pathlib.Path(self.out + ".after").unlink(missing_ok=True)
        return demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")

    def after(self) -> dict:
        return wait_until(lambda: contract.read_json(self.out + ".after"), "the job's bytes")

    def kill(self):
        if demo.pid_alive(self.pid):
            os.kill(self.pid, 9)
        demo.reap_zombies()


@pytest.fixture
def job(tmp_path, criu_ok, subreaper):
    jobs = []

    def start():
        j = Job(tmp_path)
        jobs.append(j)
        return j

    yield start
    for j in jobs:
        j.kill()


def test_custom_storage_keeps_gpu_memory_out_of_criu_images(job, tmp_path):
    j = job()
    want = j.up["blake2b"]
    # host staging: the page images carry the GPU memory (as before)
    host = tmp_path / "host"
    rc, out = j.checkpoint(host, "host")
    assert rc == 0 and out["ok"], out
    m = json.loads((host / "manifest.json").read_text())
    [ph] = [p for p in out["phases"] if p["name"] == "native checkpoint"]
    assert ph["detail"] == (
        f"pids {j.pid}; GPU storage --gpu-storage host: GPU memory staged in host memory by the "
        "driver"
    )
    # the manifest says how GPU memory was saved, also without streams
    assert (m["gpu_storage"]["mode"], m["gpu_storage"]["streams"]) == ("host", [])
    assert not (host / "chunks").exists()
    host_pages = pages_bytes(host)
    assert host_pages >= N
    j.wait_gone()
    rc, out = j.restore(host)
    assert rc == 0 and out["ok"], out
    assert j.after() == {"restored": True, "blake2b": want}

    # custom storage: the GPU memory goes to the chunk file, not into CRIU's pages
    snap = tmp_path / "custom"
    rc, out = j.checkpoint(snap, "auto")
    assert rc == 0 and out["ok"], out
    g = json.loads((snap / "manifest.json").read_text())["gpu_storage"]
    # the node's chunk checksum (decisions D36), the same as the shim carriers'
    assert (g["mode"], g["checksum"], g["chunk_bytes"]) == ("custom", carriers.node_checksum(), CB)
    assert "has custom storage (cuCheckpointOperationComplete)" in g["why"]
    [s] = g["streams"]
    assert (s["file"], s["kind"], s["pid"], s["ordinal"]) == (
        f"chunks/gpu-{j.pid}-0.bin",
        "gpu",
        j.pid,
        0,
    )
    assert s["bytes"] >= N and len(s["checksums"]) == -(-s["bytes"] // CB)
    f = snap / s["file"]
    assert f.stat().st_size == s["bytes"]
    # the zero half is neither written nor checksummed
    assert s["zero"] == [i for i, c in enumerate(s["checksums"]) if c is None]
    assert set(range((N // 2) // CB, N // CB)) <= set(s["zero"])
    assert f.stat().st_blocks * 512 <= s["bytes"] - len(s["zero"]) * CB + CB
    data = f.read_bytes()
    for i, c in enumerate(s["checksums"]):
        chunk = data[i * CB : (i + 1) * CB]
        assert c == (None if not any(chunk) else gpustore.checksum(chunk, g["checksum"])), i
    custom_pages = pages_bytes(snap)
    assert host_pages - custom_pages >= N and custom_pages < N // 2, (host_pages, custom_pages)
    j.wait_gone()
    rc, out = j.restore(snap)
    assert rc == 0 and out["ok"], out
    assert j.after() == {"restored": True, "blake2b": want}

    # a corrupted chunk refuses the restore; the snapshot is not modified
    bad = tmp_path / "bad"
    rc, out = j.checkpoint(bad, "custom")
    assert rc == 0 and out["ok"], out
    g = json.loads((bad / "manifest.json").read_text())["gpu_storage"]
    [s] = g["streams"]
    f = bad / s["file"]
    with open(f, "r+b") as fh:
        fh.seek(CB + 5)
        b = fh.read(1)
        fh.seek(CB + 5)
        fh.write(bytes([b[0] ^ 0xFF]))
    have = gpustore.checksum(f.read_bytes()[CB : 2 * CB], g["checksum"])
    before = tree_digest(bad)
    j.wait_gone()
    rc, out = j.restore(bad)
    assert rc != 0 and not out["ok"], out
    msg = out["error"]["message"]
    assert (
        f"GPU ordinal 0: chunk 1 (bytes {CB}..{2 * CB - 1}) of {s['file']} has a bad checksum: "
        "manifest "
        f"{s['checksums'][1]}, file {have}; restore refused, snapshot untouched"
    ) in msg, msg
    assert str(j.pid) in msg
    assert tree_digest(bad) == before


def test_doctor_row(tmp_path):
    rc, out = demo.run_agent("doctor", "--driver", "fake", "--control-dir", str(tmp_path))
    [row] = [c for c in out["checks"] if c["name"] == "gpu storage"]
    assert row["ok"] and row["detail"].startswith("custom (auto): driver 13050 at "), row
    os.environ["FAKECUDA_DRIVER_VERSION"] = "13010"
    try:
        rc, out = demo.run_agent("doctor", "--driver", "fake", "--control-dir", str(tmp_path))
    finally:
        del os.environ["FAKECUDA_DRIVER_VERSION"]
    [row] = [c for c in out["checks"] if c["name"] == "gpu storage"]
    assert row["ok"], row
    assert row["detail"] == (
        "host (auto): driver 13010 predates custom storage (needs 13040); "
        "GPU memory staged in host memory, CRIU dumps it"
    )


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 16 MiB tmpfs (the job's 32 MiB of non-zero chunks do not fit), unmounted at teardown."""
    d = tmp_path / "full"
    d.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(d)], capture_output=True, text=True
    )
    assert res.returncode == 0, f"mount tmpfs (the test needs root, as CRIU does): {res.stderr}"
    yield d
    subprocess.run(["umount", "-l", str(d)], check=True)


def test_a_full_disk_while_streaming_rolls_back_with_the_memory_intact(job, small_tmpfs):
    j = job()
    snap = small_tmpfs / "snap"
    rc, out = j.checkpoint(snap, "custom")
    assert rc != 0 and not out["ok"], out
    err = out["error"]
    assert err["outcome"] == "rolled_back", err
    assert err["phase"] == "native checkpoint" and err["pid"] == j.pid, err
    msg = err["message"]
    assert "GPU ordinal 0: write chunk " in msg and f"of chunks/gpu-{j.pid}-0.bin failed: " in msg
    assert "ENOSPC (No space left on device)" in msg, msg
    # the partial stream is removed; the job resumes with its bytes
    assert not (snap / "chunks").exists() or list((snap / "chunks").iterdir()) == []
    assert j.after() == {"restored": False, "blake2b": j.up["blake2b"]}


def test_a_tampered_stream_record_is_refused_before_criu(job, tmp_path):
    j = job()
    snap = tmp_path / "snap"
    rc, out = j.checkpoint(snap, "custom")
    assert rc == 0 and out["ok"], out
    j.wait_gone()
    mpath = snap / "manifest.json"
    m = json.loads(mpath.read_text())
    m["gpu_storage"]["streams"][0]["file"] = "chunks/../../elsewhere.bin"
    mpath.write_text(json.dumps(m))
    before = tree_digest(snap)
    rc, out = j.restore(snap)
    assert rc != 0 and out["error"]["phase"] == "manifest", out
    assert (
        f"gpu_storage streams[0] file 'chunks/../../elsewhere.bin' is not "
        f"'chunks/gpu-{j.pid}-0.bin'; restore refused"
    ) in out["error"]["message"]
    assert "criu restore" not in [p["name"] for p in out.get("phases", [])]
    assert not demo.pid_alive(j.pid)
    assert tree_digest(snap) == before
