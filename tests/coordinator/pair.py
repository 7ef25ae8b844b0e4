"""Drive a creator/importer pair of ``cuipair`` processes (tests/coordinator/c/cuipair.c).

Used by the integration test and by bench/phases.py (which imports this file by path).
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import time

HERE = pathlib.Path(__file__).resolve().parent
CUIPAIR_C = HERE / "c" / "cuipair.c"


class PairProc:
    """One cuipair process; ``cmd`` sends a line and returns the answer tokens after "ok"."""

    def __init__(self, exe, env, sock_fd: int):
        self.proc = subprocess.Popen(
            [str(exe), str(sock_fd)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            pass_fds=(sock_fd,),
        )
        self.pid = self.proc.pid
        first = self._line("start")
        assert first == ["ok", str(self.pid)], first

    def _line(self, what: str) -> list[str]:
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(f"cuipair {self.pid} exited during {what!r} (rc={self.proc.poll()})")
        return out.split()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self, line: str) -> list[str]:
        toks = self._line(line)
        if toks[0] != "ok":
            raise RuntimeError(f"cuipair {self.pid}: {line!r} -> {' '.join(toks)}")
        return toks[1:]

    def cmd(self, line: str) -> list[str]:
        self.send(line)
        return self.answer(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("quit")
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()


class Pair:
    """Creator and importer sharing ``k`` allocations of ``size`` bytes each."""

    def __init__(self, exe, env, k: int, size: int):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.creator = PairProc(exe, env, a.fileno())
            self.importer = PairProc(exe, env, b.fileno())
        finally:
            a.close()
            b.close()
        self.k, self.size = k, size
        self.creator_base = int(self.creator.cmd(f"create {k} {size}")[0], 0)
        self.importer.send(f"recv {k} {size}")
        self.creator.cmd("send")
        self.importer_base = int(self.importer.answer("recv")[0], 0)

    @property
    def pids(self) -> list[int]:
        return [self.creator.pid, self.importer.pid]

    def sums(self) -> tuple[str, str]:
        return self.creator.cmd("sum")[0], self.importer.cmd("sum")[0]

    def close(self) -> None:
        self.creator.close()
        self.importer.close()


def wait_sockets(paths, timeout_s: float = 10.0) -> None:
    """Wait until every control socket exists (the shim creates it after cuInit)."""
    deadline = time.monotonic() + timeout_s
    for p in paths:
        while not os.path.exists(p):
            if time.monotonic() > deadline:
                raise TimeoutError(f"control socket {p} did not appear within {timeout_s} s")
            time.sleep(0.01)
