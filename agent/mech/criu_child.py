"""What the child that runs CRIU does before it executes CRIU (:class:`ChildSetup`: join
cgroups, enter namespaces), so that the tasks CRIU forks inherit it, and
:func:`run_setup_probe`, which tries such a setup on a no-op child first.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
import sys

from cuinterpose.agent.mech import libc
from cuinterpose.agent.mech.criu_binary import CriuError, env

__all__ = ["ChildSetup", "run_setup_probe", "Opened", "CriuError"]


@dataclasses.dataclass(frozen=True)
class ChildSetup:
    """What the child that runs CRIU does between fork and exec, so that what CRIU forks
    inherits it: write its own pid into each of ``cgroup_procs`` (``cgroup.procs`` files,
    cgroup(7)), then ``setns(2)`` into each of ``namespaces`` (``(kind, /proc/PID/ns/KIND)``).

    Files are opened by the parent first (a missing one fails before any fork); a refused
    write or setns stops the child before CRIU is executed, and the error names the file."""

    cgroup_procs: tuple[str, ...] = ()
    namespaces: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.cgroup_procs or self.namespaces)


class Opened:
    """A ChildSetup's files opened (close-on-exec) in the parent, and its error pipe."""

    def __init__(self, setup: ChildSetup):
        self.cgroups: list[tuple[str, int]] = []
        self.ns: list[tuple[str, str, int]] = []
        self.err_r = self.err_w = -1
        try:
            for path in setup.cgroup_procs:
                try:
                    self.cgroups.append((path, os.open(path, os.O_WRONLY | os.O_CLOEXEC)))
                except OSError as e:
                    raise CriuError(
                        f"cannot join cgroup {os.path.dirname(path)}: open "
                        f"{path}: {e.strerror or e}"
                    ) from None
            for kind, path in setup.namespaces:
                try:
                    self.ns.append((kind, path, os.open(path, os.O_RDONLY | os.O_CLOEXEC)))
                except OSError as e:
                    raise CriuError(
                        f"cannot enter the {kind} namespace {path}: {e.strerror or e}"
                    ) from None
            self.err_r, self.err_w = os.pipe2(os.O_CLOEXEC)
            self.setns = libc.fn("setns") if self.ns else None
            # setns(CLONE_NEWNS) fails with EINVAL while the fs_struct (root, cwd) is shared
            # with another task (setns(2)); a child forked by a process with gRPC's threads
            # can still share it, so the child unshares it first (unshare(2) CLONE_FS)
            self.unshare_fs = libc.fn("unshare") if any(k == "mnt" for k, _, _ in self.ns) else None
        except BaseException:
            self.close()
            raise

    def preexec(self) -> None:
        """Runs in the child (subprocess ``preexec_fn``): only writes, setns and raise."""
        pid = b"%d" % os.getpid()
        for path, fd in self.cgroups:
            try:
                os.write(fd, pid)
            except OSError as e:
                os.write(
                    self.err_w,
                    (
                        f"cannot join cgroup {os.path.dirname(path)}: write of "
                        f"pid {os.getpid()} to {path} refused: "
                        f"{e.strerror or e}"
                    ).encode(),
                )
                raise
        if self.unshare_fs is not None and self.unshare_fs(libc.CLONE_FS) != 0:
            err = ctypes.get_errno()
            os.write(
                self.err_w,
                f"cannot unshare the filesystem attributes (CLONE_FS) before "
                f"entering a mount namespace: {os.strerror(err)}".encode(),
            )
            raise OSError(err, os.strerror(err))
        for kind, path, fd in self.ns:
            if self.setns(fd, 0) != 0:
                err = ctypes.get_errno()
                os.write(
                    self.err_w,
                    f"cannot enter the {kind} namespace {path}: setns: {os.strerror(err)}".encode(),
                )
                raise OSError(err, os.strerror(err))

    def failure(self) -> str:
        """What the child wrote before it gave up (after it exited)."""
        if self.err_w >= 0:
            os.close(self.err_w)
            self.err_w = -1
        try:
            return os.read(self.err_r, 4096).decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        for fd in (
            [fd for _, fd in self.cgroups] + [fd for _, _, fd in self.ns] + [self.err_r, self.err_w]
        ):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.cgroups, self.ns, self.err_r, self.err_w = [], [], -1, -1


def run_setup_probe(setup: ChildSetup) -> None:
    """Run a no-op child (this Python, ``-S -I -c pass``) with ``setup`` applied, to learn
    whether CRIU's child could apply it: raises ``CriuError`` with the child's reason (the
    cgroup or namespace file and the errno). The probe child joins the cgroups and exits.

    The program is this Python by its path in *this* mount namespace: a ``setup`` that
    enters another mount namespace would exec whatever is (or is not) at that path there, so
    such a setup is refused (``ValueError``); probe the cgroups alone
    (``Placement.probe_cgroups``). A child that cannot be started at all (the exec fails) is
    a ``CriuError`` too."""
    if any(kind == "mnt" for kind, _ in setup.namespaces):
        raise ValueError(
            "run_setup_probe execs this Python by its path: it cannot run in "
            "another mount namespace"
        )
    opened = Opened(setup)
    try:
        try:
            res = subprocess.run(
                [sys.executable, "-S", "-I", "-c", "pass"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                preexec_fn=opened.preexec,
                env=env(),
            )
        except subprocess.SubprocessError as e:
            raise CriuError(
                opened.failure() or f"the probe child failed before exec: {e}"
            ) from None
        except OSError as e:
            why = opened.failure()
            raise CriuError(
                why or f"the probe child could not be started ({sys.executable}): {e.strerror or e}"
            ) from None
        if res.returncode != 0:
            raise CriuError(
                f"the probe child exited {res.returncode}: "
                f"{(res.stdout + res.stderr).decode(errors='replace').strip()}"
            )
    finally:
        opened.close()
