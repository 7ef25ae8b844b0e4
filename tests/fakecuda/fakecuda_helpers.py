"""Helpers shared by the fakecuda tests (a unique module name: other areas have conftest.py too)."""

from __future__ import annotations

import pathlib
import subprocess

GRAN = 2 << 20


class CudaError(Exception):
    def __init__(self, name: str, command: str):
        super().__init__(f"{command!r} -> {name}")
        self.name = name


class Peer:
    def __init__(self, exe, env, sock_fd=None):
        args = [str(exe)]
        pass_fds = ()
        if sock_fd is not None:
            args.append(str(sock_fd))
            pass_fds = (sock_fd,)
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            pass_fds=pass_fds,
        )
        self.pid = self.proc.pid

    def cmd(self, line: str) -> list[str]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(f"fcpeer {self.pid} died on {line!r} (rc={self.proc.poll()})")
        words = out.split()
        if words[0] == "err":
            raise CudaError(words[1], line)
        assert words[0] == "ok", out
        return words[1:]

    def err(self, line: str) -> str:
        """Run a command that must fail; return the CUresult name."""
        try:
            words = self.cmd(line)
        except CudaError as e:
            return e.name
        raise AssertionError(f"{line!r} unexpectedly succeeded: {words}")

    def close(self):
        if self.proc.poll() is None:
            try:
                self.cmd("quit")
            except Exception:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def share_window(a: Peer, b: Peer, size: int = GRAN):
    """a creates a POSIX-exportable allocation, maps it RW; sends a fresh export fd to b,
    closes its copy; b imports, closes the received fd, maps RW. Returns (va_a, h_a, va_b, h_b)."""
    h_a = int(a.cmd(f"create {size} 1 0")[0])
    va_a = int(a.cmd(f"reserve {size}")[0], 16)
    a.cmd(f"map {va_a} {size} {h_a}")
    a.cmd(f"access {va_a} {size} 0 3")
    fd = int(a.cmd(f"export {h_a}")[0])
    a.cmd(f"sendfd {fd}")
    a.cmd(f"close {fd}")
    rfd = int(b.cmd("recvfd")[0])
    h_b = int(b.cmd(f"import {rfd}")[0])
    b.cmd(f"close {rfd}")
    va_b = int(b.cmd(f"reserve {size}")[0], 16)
    b.cmd(f"map {va_b} {size} {h_b}")
    b.cmd(f"access {va_b} {size} 0 3")
    return va_a, h_a, va_b, h_b


def read_log(env) -> list[str]:
    p = pathlib.Path(env["FAKECUDA_LOG"])
    return p.read_text().splitlines() if p.exists() else []
