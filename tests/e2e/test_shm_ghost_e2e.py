"""NCCL's SHM fallback across a checkpoint (issue 24; docs/criu.md "Deleted files"): a process
maps an 8 MiB unlinked /dev/shm file registered with cuMemHostRegister. The agent sizes CRIU's
--ghost-limit from what the tree holds (CRIU's default, 1 MiB, fails the dump: "Can't dump ghost
file"), the shim unregisters the memory before the native checkpoint and registers it again
after (fakecuda's native checkpoint refuses the registration), and the restored process finds
the same bytes and its registration back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from cuinterpose.workloads.afdwin import demo

HERE = os.path.dirname(os.path.abspath(__file__))
BYTES = (8 << 20) + 4  # NCCL's realShmSize: the buffer plus its int refcount


HANG_S = 600.0  # a deadline only against a hang


def events(log) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]


def wait_event(log, kind: str) -> dict:
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        got = [e for e in events(log) if e["event"] in (kind, "error")]
        if got:
            assert got[0]["event"] == kind, got
            return got[0]
        time.sleep(0.05)
    raise AssertionError(f"no {kind} event in {log}")


def test_unlinked_shm_registered_survives_a_checkpoint(tmp_path, criu_ok, subreaper):
    ctl = tmp_path / "ctl"
    ctl.mkdir(mode=0o700)
    log = tmp_path / "ghost.log"
    with open(log, "ab") as out, open(tmp_path / "ghost.err", "ab") as err:
        p = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "shm_ghost.py"), str(BYTES)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=demo.workload_env(ctl),
            start_new_session=True,
        )
    try:
        ready = wait_event(log, "ready")
        assert not os.path.exists(ready["path"])  # unlinked
        snap = tmp_path / "snap"
        rc, cp = demo.run_agent(
            "checkpoint",
            "--pid",
            str(p.pid),
            "--images-dir",
            str(snap),
            "--driver",
            "fake",
            "--control-dir",
            str(ctl),
        )
        assert rc == 0 and cp["ok"], cp
        assert p.wait(timeout=120) == -signal.SIGKILL
        # CRIU carried the file's bytes in its images (a ghost file)
        ghosts = [
            f for f in (snap / "criu" / str(p.pid)).iterdir() if f.name.startswith("ghost-file-")
        ]
        assert ghosts and max(f.stat().st_size for f in ghosts) >= BYTES
        rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
        assert rc == 0 and rs["ok"], rs
        done = wait_event(log, "done")
        assert done == {
            "event": "done",
            "ok": True,
            "checksum": ready["checksum"],
            "device_pointer": "CUDA_SUCCESS",
        }
        assert [e for e in events(log) if e["event"] == "resumed"] == [
            {"event": "resumed", "restored": True, "cancelled": False}
        ]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
