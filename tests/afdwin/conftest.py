"""Fixtures for afdwin runs on fakecuda.

``afdwin``: a factory ``afdwin(*args)`` that starts the launcher
(``python -m cuinterpose.workloads.afdwin ARGS``) on fakecuda (``fake_env``, no shim) and
returns an ``AfdwinRun``: its stdout JSON events are collected by a reader thread;
``wait_for(pred)`` blocks until an event satisfies ``pred`` (a deadline only guards against a
hang, it is never asserted on).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

HANG_GUARD_S = 600  # only catches a hang: minutes, for a loaded machine


class AfdwinRun:
    def __init__(self, args, env, tmp_path: pathlib.Path):
        self.env = env
        self.ctl = pathlib.Path(env["CUINTERPOSE_CONTROL_DIR"])
        self.stderr_path = tmp_path / "afdwin.stderr"
        self._stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cuinterpose.workloads.afdwin", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            text=True,
        )
        self.events: list[dict] = []
        self.bad_lines: list[str] = []
        self._cv = threading.Condition()
        self._eof = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                ev = None
            with self._cv:
                if isinstance(ev, dict) and "event" in ev:
                    self.events.append(ev)
                else:
                    self.bad_lines.append(line)
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def wait_for(self, pred, what: str) -> dict:
        """First event (in order) satisfying ``pred``; fails the test on EOF or hang."""
        deadline = time.monotonic() + HANG_GUARD_S
        i = 0
        with self._cv:
            while True:
                while i < len(self.events):
                    if pred(self.events[i]):
                        return self.events[i]
                    i += 1
                if self._eof:
                    pytest.fail(f"afdwin exited before {what}; stderr:\n{self.stderr()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"hang guard: no {what}; stderr:\n{self.stderr()}")
                self._cv.wait(left)

    def wait_file(self, path: pathlib.Path, what: str) -> dict:
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            if path.exists():
                return json.loads(path.read_text())
            if self.proc.poll() is not None:
                pytest.fail(f"afdwin exited before {what}; stderr:\n{self.stderr()}")
            if time.monotonic() > deadline:
                pytest.fail(f"hang guard: no {what}")
            time.sleep(0.01)

    def finish(self) -> int:
        try:
            rc = self.proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"hang guard: afdwin did not exit; stderr:\n{self.stderr()}")
        self._thread.join(timeout=10)
        self._stderr.close()
        return rc

    def stderr(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text()

    def of(self, kind: str) -> list[dict]:
        with self._cv:
            return [e for e in self.events if e["event"] == kind]

    def write_control(self, suffix: str, obj: dict) -> pathlib.Path:
        path = self.ctl / f"quiesce-{self.proc.pid}.{suffix}"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(obj))
        os.rename(tmp, path)
        return path

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def afdwin(fake_env, tmp_path):
    runs = []

    def start(*args, env_extra=None):
        env = dict(fake_env, **(env_extra or {}))
        run = AfdwinRun(args, env, tmp_path)
        runs.append(run)
        return run

    yield start
    for r in runs:
        r.kill()
