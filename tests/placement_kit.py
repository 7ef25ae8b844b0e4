"""Placement helpers shared by the tests (tests/ is on sys.path: ``from placement_kit import
...``); the fixtures built on them (``cgroup_dir``, ``placeholder``) are in tests/conftest.py.

- ``cgroups_of(pid)``: the ``/proc/PID/cgroup`` text (every hierarchy's line);
- ``comm_of(pid)``: its ``/proc/PID/comm`` ("" once it is gone);
- ``Placeholder``: a placeholder container's init in new namespaces;
- ``hidden_python_dirs()``: this Python's directories, for a placeholder that lacks them;
- ``cgroup_bases()``, ``remove_cgroup(d)``: where test cgroups are made, and their removal.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

import pytest

from cuinterpose.agent.mech.census import walk_tree

CGROUP_FS = pathlib.Path("/sys/fs/cgroup")
#: v2 controllers that may be enabled for the children of a cgroup holding processes, and so do
#: not make it refuse them (cgroup-v2 "threaded" controllers)
THREADED_CONTROLLERS = frozenset({"cpu", "cpuset", "perf_event", "pids"})


def cgroups_of(pid: int) -> str:
    """``/proc/PID/cgroup`` (every hierarchy's line)."""
    return pathlib.Path(f"/proc/{pid}/cgroup").read_text()


def comm_of(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cgroup_bases() -> tuple[pathlib.Path, pathlib.Path]:
    """(base for a plain test cgroup, base for a refusing one): the v1 ``pids`` and ``cpuset``
    hierarchies when mounted (hybrid/legacy hosts), else the v2 hierarchy (``/sys/fs/cgroup``,
    or ``/sys/fs/cgroup/unified`` beside v1). Fails (not skips) when there is none: every
    machine the suite runs on has cgroups and runs it as root."""
    if (CGROUP_FS / "pids" / "cgroup.procs").is_file() and (
        CGROUP_FS / "cpuset" / "cgroup.procs"
    ).is_file():
        return CGROUP_FS / "pids", CGROUP_FS / "cpuset"
    for v2 in (CGROUP_FS, CGROUP_FS / "unified"):
        if (v2 / "cgroup.controllers").is_file():
            return v2, v2
    pytest.fail(f"no cgroup hierarchy to make test cgroups in under {CGROUP_FS}")


def cgroup_procs(d: pathlib.Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def remove_cgroup(d: pathlib.Path, timeout: float = 30) -> None:
    """SIGKILL what is left in cgroup ``d``, reap, and remove it (gone already: nothing)."""
    from cuinterpose.workloads.afdwin import demo

    deadline = time.monotonic() + timeout
    while True:
        for p in cgroup_procs(d):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        demo.reap_zombies()
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def hidden_python_dirs() -> list[str]:
    """The directories of this Python (``sys.executable`` and the file it resolves to) that a
    placeholder can hide under a tmpfs without hiding its own ``sh``, ``hostname`` and
    ``sleep``: a container's mount namespace that lacks the agent's interpreter."""
    import shutil
    import sys

    keep = {
        os.path.dirname(os.path.realpath(shutil.which(c) or "/"))
        for c in ("sh", "hostname", "sleep", "unshare", "mount")
    }
    keep |= {
        os.path.dirname(shutil.which(c) or "/")
        for c in ("sh", "hostname", "sleep", "unshare", "mount")
    }
    out = []
    for d in (os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))):
        if d not in out and d not in keep and d not in ("/", "/usr", "/bin", "/usr/bin"):
            out.append(d)
    return out


class Placeholder:
    """A placeholder container's init: ``unshare --net --uts --ipc [--mount] [--user
    --map-root-user]`` running ``sleep`` (hostname set in its uts namespace), optionally in
    ``cgroup``. ``stdout``: a pipe to a ``cat`` (``reader``) that appends it to ``out``
    (default ``TMP/placeholder-HOSTNAME.out``); ``stdout=False``: /dev/null, no reader;
    ``stdout_fd``/``stderr_fd``: an fd of the caller instead (e.g. a log file opened here).
    ``prepare``: shell commands run inside the namespaces first (e.g. a bind mount).
    ``user``: a user namespace of its own too. ``pid``, ``proc``; ``stop()``."""

    def __init__(
        self,
        tmp: pathlib.Path,
        hostname: str,
        *,
        cgroup: str | None = None,
        mount: bool = False,
        stdout: bool = True,
        prepare: str = "",
        out: pathlib.Path | None = None,
        stdout_fd: int | None = None,
        stderr_fd: int | None = None,
        user: bool = False,
    ):
        self.out = out or tmp / f"placeholder-{hostname}.out"
        self.hostname = hostname
        self.reader = None
        w = subprocess.DEVNULL
        if stdout_fd is not None:
            w, stdout = stdout_fd, False
        elif stdout:
            r, w = os.pipe()
            with open(self.out, "ab") as f:
                self.reader = subprocess.Popen(["cat"], stdin=r, stdout=f)
            os.close(r)
        ns = (
            ["--net", "--uts", "--ipc"]
            + (["--mount", "--propagation", "private"] if mount else [])
            + (["--user", "--map-root-user"] if user else [])
        )
        script = f"{prepare + ' && ' if prepare else ''}hostname {hostname} && exec sleep 600"
        self.proc = subprocess.Popen(
            ["unshare", *ns, "sh", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=w,
            stderr=stderr_fd,
            start_new_session=True,
        )
        if stdout:
            os.close(w)
        self.pid = self.proc.pid
        if cgroup:
            pathlib.Path(cgroup, "cgroup.procs").write_text(str(self.pid))
        deadline = time.monotonic() + 30
        while comm_of(self.pid) != "sleep":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"placeholder {hostname} did not start sleep (exit {self.proc.poll()})"
                )
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill and reap it; wait for its reader (killed after 30 s) to copy what is left."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.reader is not None:
            try:
                self.reader.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.reader.kill()
                self.reader.wait()


PLACED_NAMESPACES = ("net", "uts", "ipc", "mnt")


def not_placed(root: int, placeholder: int) -> list[str]:
    """What of the tree under ``root`` is not in the namespaces (net, uts, ipc, mnt: by inode)
    and cgroups (every ``/proc/PID/cgroup`` line) of process ``placeholder``; [] when every
    process of it is."""
    want_ns = {k: os.stat(f"/proc/{placeholder}/ns/{k}").st_ino for k in PLACED_NAMESPACES}
    want_cg = pathlib.Path(f"/proc/{placeholder}/cgroup").read_text()
    out = []
    for pid, _, _ in walk_tree([root]):
        for k in PLACED_NAMESPACES:
            got = os.stat(f"/proc/{pid}/ns/{k}").st_ino
            if got != want_ns[k]:
                out.append(f"pid {pid}: {k} [{got}] not [{want_ns[k]}]")
        cg = pathlib.Path(f"/proc/{pid}/cgroup").read_text()
        if cg != want_cg:
            out.append(f"pid {pid}: cgroups {cg!r} not {want_cg!r}")
    return out


def mount_id_of(path) -> int:
    """The mount ID of the mount ``path`` is on (in this mount namespace; fdinfo ``mnt_id``)."""
    fd = os.open(path, os.O_PATH)
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("mnt_id:"))
    finally:
        os.close(fd)
