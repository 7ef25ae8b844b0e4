"""Running CRIU inside another process's mount namespace (a container's, for a dump or a
restore into a placeholder): CRIU's child ``setns(2)``'s into it before exec
(``criu_child.ChildSetup``), and the agent's own files (CRIU, its ld.so and libraries, the
images, work and plugin directories) are reached there through an ``O_PATH`` descriptor of the
agent's root, ``/proc/self/fd/R/<path>`` (proc(5)).

``rewrite(prefix, args, root_fd)`` returns that command (CRIU started by its ELF interpreter
with ``--library-path``); ``open_root()`` the descriptor; ``is_foreign(pid)`` tells whether
``pid``'s mount namespace differs from this process's. docs/criu.md, "Mount namespace", says
why a dump runs in the tree's namespace and what was checked.
"""

from __future__ import annotations

import os
import shlex
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Iterable, Sequence

from cuinterpose.agent.mech import procfs

__all__ = ["MountNsError", "is_foreign", "mount_ns", "rewrite", "open_root", "PATH_FLAGS"]


class MountNsError(RuntimeError):
    """CRIU cannot be run in the mount namespace of a process; ``str()`` says which and why."""


def mount_ns(pid: int | str) -> int:
    """Inode number of the mount namespace of ``pid`` (``"self"`` for this process). Raises
    ``MountNsError`` naming the pid when ``/proc/PID/ns/mnt`` cannot be read (gone, or no
    permission)."""
    try:
        return procfs.ns_inode(pid, "mnt")
    except OSError as e:
        raise MountNsError(f"cannot read the mount namespace of pid {pid}: {e}") from e


def is_foreign(pid: int) -> bool:
    """True when ``pid`` lives in another mount namespace than this process."""
    return mount_ns(pid) != mount_ns("self")


def _interp(binary: str) -> str:
    """The ELF interpreter (``PT_INTERP``) of ``binary``: its dynamic loader's path."""
    with open(binary, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            raise MountNsError(f"{binary} is not a 64-bit ELF executable")
        end = "<" if head[5] == 1 else ">"
        (phoff,) = struct.unpack_from(end + "Q", head, 32)
        phentsize, phnum = struct.unpack_from(end + "HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        for i in range(phnum):
            (ptype,) = struct.unpack_from(end + "I", table, i * phentsize)
            if ptype == 3:  # PT_INTERP
                (off,) = struct.unpack_from(end + "Q", table, i * phentsize + 8)
                (size,) = struct.unpack_from(end + "Q", table, i * phentsize + 32)
                f.seek(off)
                return f.read(size).rstrip(b"\0").decode()
    raise MountNsError(f"{binary} has no ELF interpreter (a static binary needs no wrapping)")


def _library_dirs(interp: str, binary: str) -> list[str]:
    """The directories of the shared libraries ``binary`` loads (``ld.so --list``)."""
    res = subprocess.run(
        [interp, "--list", binary], capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    if res.returncode != 0:
        raise MountNsError(f"{interp} --list {binary} failed: {res.stderr.strip()}")
    dirs: list[str] = []
    for line in res.stdout.splitlines():
        parts = line.split("=>")
        path = (parts[1] if len(parts) > 1 else parts[0]).strip().split(" (")[0].strip()
        if path.startswith("/"):
            d = os.path.dirname(os.path.realpath(path))
            if d not in dirs:
                dirs.append(d)
    return dirs


def _exec_argv(prefix: Sequence[str]) -> list[str]:
    """Host argv that starts CRIU through its loader, no ``#!`` script and no PATH lookup: the
    generated wrapper of criu_install.sh is read for its ``exec`` line; an ELF binary
    gets its ``PT_INTERP`` loader with ``--inhibit-cache --library-path <its libraries' dirs>``."""
    if len(prefix) != 1:
        raise MountNsError(
            f"cannot run {shlex.join(prefix)} in another mount namespace (expected one executable)"
        )
    path = shutil.which(prefix[0]) or prefix[0]
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == b"#!":
        text = Path(path).read_text().replace("\\\n", " ")
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("exec "):
                argv = shlex.split(line)[1:]
                if argv and argv[-1] == "$@":
                    argv = argv[:-1]
                if argv and all("$" not in a for a in argv):
                    return argv
        raise MountNsError(
            f'{path} is a script without a plain `exec LOADER ... "$@"` line: '
            "cannot start it in another mount namespace"
        )
    interp = _interp(path)
    return [
        interp,
        "--inhibit-cache",
        "--library-path",
        ":".join(_library_dirs(interp, path)),
        path,
    ]


#: CRIU flags whose value is a path (rewritten by :func:`rewrite`)
PATH_FLAGS = (
    "--images-dir",
    "-D",
    "--work-dir",
    "-W",
    "--libdir",
    "-L",
    "--pidfile",
    "--log-file",
    "-o",
)


def rewrite(
    prefix: Sequence[str], args: Iterable[str], root_fd: int, path_flags: Iterable[str] = PATH_FLAGS
) -> list[str]:
    """The argv that starts ``prefix + args`` (CRIU) by the agent's paths from inside another
    mount namespace: every absolute path of the loader argv, the value of every flag in
    ``path_flags`` (``--flag VALUE`` form) and the path of a ``--join-ns NS:PATH[,EXTRA]``
    become ``/proc/self/fd/<root_fd>/<path>``, ``root_fd`` being an ``O_PATH`` descriptor of
    this process's ``/`` that the child inherits (``pass_fds``) and keeps across its exec.
    Relative paths stay relative (to CRIU's work dir). Raises ``MountNsError`` when CRIU
    cannot be started by its loader (a script without a plain ``exec`` line, not an ELF)."""
    loader = _exec_argv(prefix)

    def via(path: str) -> str:
        return f"/proc/self/fd/{root_fd}{path}" if path.startswith("/") else path

    cmd = [via(a) for a in loader]
    for i, a in enumerate(loader[:-1]):
        if a == "--library-path":
            cmd[i + 1] = ":".join(via(d) for d in loader[i + 1].split(":"))
    flags = set(path_flags)
    it = list(args)
    i = 0
    while i < len(it):
        a = it[i]
        if a in flags and i + 1 < len(it):
            cmd += [a, via(it[i + 1])]
            i += 2
        elif a == "--join-ns" and i + 1 < len(it) and ":" in it[i + 1]:
            ns, _, rest = it[i + 1].partition(":")
            path, sep, extra = rest.partition(",")
            cmd += [a, f"{ns}:{via(path)}{sep}{extra}"]
            i += 2
        else:
            cmd.append(a)
            i += 1
    return cmd


def open_root() -> int:
    """An ``O_PATH`` descriptor of this process's ``/`` for :func:`rewrite` (inheritable only
    through ``pass_fds``); the caller closes it."""
    return os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
