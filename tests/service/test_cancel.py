"""Ctrl-C of ``checkpoint --agent`` cancels the request (finding 5 of the new-user trial, D73):
the client cancels its gRPC call (exit 7, outcome ``cancelled``), the daemon's handler sees the
cancellation and stops the run as a signal stops a one-shot run, and its log has one line per
request (start, cancellation, outcome). An in-process ``Server``; the test holds the node lock
so the request is known to wait before its first step (no sleeping): the stop is then a
refusal before the run, and the process is untouched."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

DEADLINE_S = 120.0  # catches a hang only


def wait_log(caplog, text: str) -> str:
    """The first daemon log message containing ``text`` (waits for it; a deadline catches a
    hang)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        for r in list(caplog.records):
            if r.name == "cuinterpose.service" and text in r.getMessage():
                return r.getMessage()
        if time.monotonic() > deadline:
            msgs = [r.getMessage() for r in caplog.records]
            raise AssertionError(f"no daemon log line with {text!r}: {msgs}")
        time.sleep(0.01)


def test_ctrl_c_of_the_client_cancels_the_request_at_the_daemon(server, sleeper, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="cuinterpose.service")
    snap = tmp_path / "snap"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    args = ["--pid", str(sleeper.pid), "--images-dir", str(snap), "--control-dir", str(tmp_path)]
    assert server.service.node_lock.acquire(timeout=DEADLINE_S)  # the request waits for it
    held = True
    client = subprocess.Popen(
        [sys.executable, "-m", "cuinterpose.agent.cli", "checkpoint", "--agent"]
        + [server.address, *args, "--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        started = wait_log(caplog, ": started (client ")
        rid = started.split(":")[0]  # "request N"
        assert started.startswith(f"{rid}: checkpoint of root(s) {sleeper.pid} -> {snap}")
        client.send_signal(signal.SIGINT)
        out, err = client.communicate(timeout=DEADLINE_S)
        res = json.loads(out)
        assert client.returncode == 7, (out, err)
        e = res["error"]
        assert (e["phase"], e["outcome"]) == ("agent", "cancelled"), res
        assert e["reason"].startswith(
            f"{server.address}: Checkpoint: cancelled by SIGINT during "
        ), e
        assert "the daemon stops the request at the end of that phase" in e["reason"], e
        assert "cancelling the request" in err, err
        assert "Aborted!" not in out + err
        cancelled = wait_log(caplog, "the client cancelled the call")
        assert cancelled.startswith(f"{rid}: checkpoint "), cancelled
        server.service.node_lock.release()
        held = False
        outcome = wait_log(caplog, f"{rid}: checkpoint of root(s) {sleeper.pid} -> {snap}: refused")
        assert outcome.endswith(
            "refused: request: interrupted by the client's cancellation before the checkpoint "
            "started; checkpoint cancelled, nothing was torn down, the workload keeps running"
        ), outcome
    finally:
        if held:
            server.service.node_lock.release()
        if client.poll() is None:
            client.kill()
            client.wait()
    assert sleeper.poll() is None  # untouched, still running
    assert not snap.exists()
    # the daemon is free again and counts nothing in flight
    deadline = time.monotonic() + DEADLINE_S
    while server.service.busy_with or server.service.node_lock.locked():
        assert time.monotonic() < deadline
        time.sleep(0.01)
