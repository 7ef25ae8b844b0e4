"""Running CRIU: dump a process tree to an images directory, restore it detached.

Which CRIU (``criu_command``), in order:

1. ``$CUINTERPOSE_CRIU`` (an executable), if set: used when its ``criu check`` passes, else
   an error (an explicit choice never falls back silently);
2. the system ``criu`` on ``PATH``, if its ``criu check`` passes;
3. ``<repo>/.cache/criu/bin/criu`` (``$CUINTERPOSE_CRIU_CACHE/bin/criu``), the CRIU 4.x that
   ``scripts/install-criu.sh`` (``make criu``) unpacks from Debian trixie and runs through
   its own ld.so; used when its ``criu check`` passes.

The choice is made once per process (``reset()`` forgets it). CRIU always runs with
``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ``LD_AUDIT`` and ``CRIU_CONFIG_FILE`` removed from its
environment, ``--no-default-config`` (no ``/etc/criu/default.conf``) and ``--libdir`` set to
an empty directory (no CRIU plugins: the agent drives the native CUDA checkpoint itself, so a
CRIU CUDA plugin must not lock or checkpoint the tasks a second time).

Dump options (besides images, work dir, log, ``-v4``): none for the process model, see
``DUMP_OPTS``; restore adds ``--restore-detached --pidfile`` and ``--manage-cgroups=ignore``,
see ``RESTORE_OPTS``. docs/criu.md explains every option and the known limits.

Namespaces: ``dump`` runs CRIU in the tree root's uts, ipc and mount namespaces (so that none
is written into the images: CRIU would restore a dumped uts/ipc namespace *into* a namespace
joined with ``--join-ns``, overwriting its hostname, and would image a foreign mount
namespace's whole mount table; agent/mntns.py) and marks a network namespace that is not
the agent's external (``--external net[INODE]:cuinterpose-net``; CRIU would otherwise dump it,
which needs iptables); such images are restored with ``--inherit-fd fd[N]:cuinterpose-net``.
Files the tree holds on mounts outside its mount namespace are dumped as external too
(``dump(..., external_files=["file[MNT_ID:INODE]", ...])``) and restored from fds handed with
``--inherit-fd fd[N]:file[MNT_ID:INODE]``.
``restore`` takes ``--join-ns`` values, ``--inherit-fd`` descriptors and a :class:`ChildSetup`
(cgroups the CRIU child joins before CRIU starts) for restoring into a placement
(``agent/placement.py``).

Every failure raises ``CriuError``; its message names the command, its exit status, the images
directory and the last lines of the CRIU log.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import re
import select
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["CriuError", "criu_command", "version", "check", "dump", "restore",
           "image_pids", "wait_pids_free", "wait_exit", "reset", "DUMP_OPTS", "RESTORE_OPTS",
           "ChildSetup", "run_setup_probe", "ns_inode", "EXTERNAL_NET_KEY"]

REPO = pathlib.Path(__file__).resolve().parents[2]
ENV_CRIU = "CUINTERPOSE_CRIU"
ENV_CACHE = "CUINTERPOSE_CRIU_CACHE"
# Removed from CRIU's environment: a preload (e.g. the shim) would be injected into CRIU
# itself; a library path would mix the caller's libraries into CRIU's; CRIU_CONFIG_FILE
# would add options we did not choose.
STRIPPED_ENV = ("LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "CRIU_CONFIG_FILE")

LOG_LEVEL = "-v4"           # full debug log in the log file; CRIU prints nothing to stdout
LOG_TAIL_LINES = 25
# What `dump` adds for our process model: --file-locks, so a job holding a file lock (a
# cache or database lock, a pip/compile cache) can be dumped and gets the lock back on
# restore; without it CRIU refuses ("Some file locks are hold by dumping tasks"). Nothing
# else: a setsid launcher with no tty needs no --shell-job; Unix sockets whose peers are all
# inside the tree need no --ext-unix-sk; memfds, PROT_NONE/NORESERVE reservations, shared and
# private anonymous memory, threads and open regular files are handled by default. See
# docs/criu.md.
DUMP_OPTS: tuple[str, ...] = ("--file-locks",)
# What `restore` adds (besides --restore-detached and --pidfile):
#   --manage-cgroups=ignore  the restored tasks stay in the cgroup of the process running
#                            CRIU (the agent, or wherever it runs CRIU) instead of CRIU
#                            recreating/moving into the dump-time cgroup paths.
#   --file-locks             take back the file locks the dump recorded.
RESTORE_OPTS: tuple[str, ...] = ("--manage-cgroups=ignore", "--file-locks")

#: CRIU's label of a tree's network namespace dumped as external (``--external net[INO]:KEY``)
EXTERNAL_NET_KEY = "cuinterpose-net"
#: namespaces a dump enters (those of the tree root), so that CRIU does not image them; mnt:
#: CRIU would dump a foreign mount namespace's whole mount table and fail on every open file
#: whose mount is not in it (agent/mntns.py)
DUMP_ENTER_NS: tuple[str, ...] = ("uts", "ipc", "mnt")

_lock = threading.Lock()
_chosen: tuple[list[str], str] | None = None   # (argv prefix, `criu check` output)
_no_plugins_dir: Path | None = None


class CriuError(RuntimeError):
    """A CRIU command failed or could not be run.

    Attributes: ``cmd`` (argv, or None when CRIU was not run), ``returncode`` (or None),
    ``images_dir``, ``log_path`` (or None) and ``log_tail`` (last lines of the CRIU log).
    """

    def __init__(self, message: str, *, cmd: Sequence[str] | None = None,
                 returncode: int | None = None, images_dir: Path | None = None,
                 log_path: Path | None = None, log_tail: str = ""):
        self.cmd = list(cmd) if cmd is not None else None
        self.returncode = returncode
        self.images_dir = images_dir
        self.log_path = log_path
        self.log_tail = log_tail
        #: restore: files refused for "has bad size" (see :func:`bad_size_files`)
        self.bad_size: list[dict] = []
        parts = [message]
        if images_dir is not None and str(images_dir) not in message:
            parts.append(f"images dir: {images_dir}")
        if cmd is not None:
            parts.append(f"command: {shlex.join(str(c) for c in cmd)}")
        if returncode is not None:
            parts.append(f"exit code: {returncode}")
        if log_path is not None:
            parts.append(f"log: {log_path}")
        if log_tail:
            parts.append("log tail:\n" + log_tail)
        super().__init__("\n".join(parts))


# --------------------------------------------------------------------------- choosing CRIU

def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED_ENV}
    env["LC_ALL"] = "C"
    return env


def cache_dir() -> Path:
    """The folder scripts/install-criu.sh installs into (``$CUINTERPOSE_CRIU_CACHE``)."""
    return Path(os.environ.get(ENV_CACHE) or REPO / ".cache" / "criu")


def _run_check(prefix: list[str]) -> tuple[bool, str]:
    try:
        res = subprocess.run([*prefix, "check", "--no-default-config"], env=_env(),
                             stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{shlex.join(prefix)}: {e}"
    out = (res.stdout + res.stderr).strip()
    return res.returncode == 0 and "Looks good" in out, out


def _candidates() -> list[tuple[str, list[str] | None]]:
    explicit = os.environ.get(ENV_CRIU)
    if explicit:
        return [(f"${ENV_CRIU}={explicit}", [explicit])]
    system = shutil.which("criu", path=_env().get("PATH", os.defpath))
    wrapper = cache_dir() / "bin" / "criu"
    return [("system criu", [system] if system else None),
            (f"cached criu {wrapper}", [str(wrapper)] if os.access(wrapper, os.X_OK) else None)]


def _choose() -> tuple[list[str], str]:
    global _chosen
    with _lock:
        if _chosen is not None:
            return _chosen
        reasons = []
        for name, prefix in _candidates():
            if prefix is None:
                reasons.append(f"{name}: not found")
                continue
            ok, out = _run_check(prefix)
            if ok:
                _chosen = (prefix, out)
                return _chosen
            tail = "\n    ".join(out.splitlines()[-5:])
            reasons.append(f"{name}: `criu check` failed:\n    {tail}")
        raise CriuError("no working CRIU; install one with `make criu` "
                        "(bash scripts/install-criu.sh):\n" + "\n".join(reasons))


def reset() -> None:
    """Forget the CRIU chosen by ``criu_command`` (e.g. after installing one)."""
    global _chosen
    with _lock:
        _chosen = None


def criu_command() -> list[str]:
    """The argv prefix that runs a working CRIU (see the module docstring for the order).

    Raises ``CriuError`` listing every candidate and why it was rejected when none passes
    ``criu check``.
    """
    return list(_choose()[0])


def version() -> str:
    """CRIU's version, e.g. ``"4.1.1"``. Raises ``CriuError`` (no CRIU, or unparsable)."""
    cmd = [*criu_command(), "--version"]
    res = subprocess.run(cmd, env=_env(), stdin=subprocess.DEVNULL, capture_output=True,
                         text=True)
    for line in (res.stdout + res.stderr).splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise CriuError("cannot read the CRIU version", cmd=cmd, returncode=res.returncode,
                    log_tail=(res.stdout + res.stderr).strip())


def check() -> tuple[bool, str]:
    """``(ok, output)`` of ``criu check`` for the CRIU ``criu_command`` picks.

    Never raises: without a working CRIU it returns ``(False, <why each candidate failed>)``.
    """
    try:
        prefix, _ = _choose()
    except CriuError as e:
        return False, str(e)
    return _run_check(prefix)


# --------------------------------------------------------------------------- child set-up

_libc = None


#: unshare(2) flag: the filesystem attributes (root, cwd, umask)
CLONE_FS = 0x00000200


def _libc_fn(name: str):
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return getattr(_libc, name)


def _setns_fn():
    return _libc_fn("setns")


def ns_inode(pid: int | str, kind: str) -> int:
    """Inode of ``/proc/PID/ns/KIND`` (``pid`` may be ``"self"`` / ``"thread-self"``)."""
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


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


class _Opened:
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
                    raise CriuError(f"cannot join cgroup {os.path.dirname(path)}: open "
                                    f"{path}: {e.strerror or e}") from None
            for kind, path in setup.namespaces:
                try:
                    self.ns.append((kind, path, os.open(path, os.O_RDONLY | os.O_CLOEXEC)))
                except OSError as e:
                    raise CriuError(f"cannot enter the {kind} namespace {path}: "
                                    f"{e.strerror or e}") from None
            self.err_r, self.err_w = os.pipe2(os.O_CLOEXEC)
            self.setns = _setns_fn() if self.ns else None
            # setns(CLONE_NEWNS) fails with EINVAL while the fs_struct (root, cwd) is shared
            # with another task (setns(2)); a child forked by a process with gRPC's threads
            # can still share it, so the child unshares it first (unshare(2) CLONE_FS)
            self.unshare_fs = (_libc_fn("unshare") if any(k == "mnt" for k, _, _ in self.ns)
                               else None)
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
                os.write(self.err_w, (f"cannot join cgroup {os.path.dirname(path)}: write of "
                                      f"pid {os.getpid()} to {path} refused: "
                                      f"{e.strerror or e}").encode())
                raise
        if self.unshare_fs is not None and self.unshare_fs(CLONE_FS) != 0:
            err = ctypes.get_errno()
            os.write(self.err_w, f"cannot unshare the filesystem attributes (CLONE_FS) before "
                                 f"entering a mount namespace: {os.strerror(err)}".encode())
            raise OSError(err, os.strerror(err))
        for kind, path, fd in self.ns:
            if self.setns(fd, 0) != 0:
                err = ctypes.get_errno()
                os.write(self.err_w, f"cannot enter the {kind} namespace {path}: setns: "
                                     f"{os.strerror(err)}".encode())
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
        for fd in [fd for _, fd in self.cgroups] + [fd for _, _, fd in self.ns] + [
                self.err_r, self.err_w]:
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
        raise ValueError("run_setup_probe execs this Python by its path: it cannot run in "
                         "another mount namespace")
    opened = _Opened(setup)
    try:
        try:
            res = subprocess.run([sys.executable, "-S", "-I", "-c", "pass"],
                                 stdin=subprocess.DEVNULL, capture_output=True,
                                 preexec_fn=opened.preexec, env=_env())
        except subprocess.SubprocessError as e:
            raise CriuError(opened.failure() or f"the probe child failed before exec: {e}") \
                from None
        except OSError as e:
            why = opened.failure()
            raise CriuError(why or f"the probe child could not be started ({sys.executable}): "
                            f"{e.strerror or e}") from None
        if res.returncode != 0:
            raise CriuError(f"the probe child exited {res.returncode}: "
                            f"{(res.stdout + res.stderr).decode(errors='replace').strip()}")
    finally:
        opened.close()


# --------------------------------------------------------------------------- running CRIU

def _plugins_dir() -> Path:
    """An empty directory for ``--libdir``, so that no CRIU plugin is loaded."""
    global _no_plugins_dir
    if _no_plugins_dir is None or not _no_plugins_dir.is_dir():
        d = cache_dir() / "plugins"
        if not (d.is_dir() and not any(d.iterdir())):
            d = Path(tempfile.mkdtemp(prefix="cuinterpose-criu-noplugins-"))
        _no_plugins_dir = d
    return _no_plugins_dir


def _log_tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    # (CRIU logs failing to raise its own RLIMIT_NOFILE as an Error, and carries on.)
    errors = [ln for ln in lines if "Error" in ln and "RLIMIT_NOFILE for self" not in ln]
    tail = lines[-n:]
    # CRIU's first error is often the cause and may scroll out of the tail; keep it.
    extra = [ln for ln in errors[:5] if ln not in tail]
    return "\n".join((["..."] + extra + ["..."] if extra else []) + tail)


ENV_LOG_DIR = "CUINTERPOSE_CRIU_LOG_DIR"


def kept_logs_dir() -> Path:
    """Where the log of a failed dump is copied (``$CUINTERPOSE_CRIU_LOG_DIR``, default
    ``<tmp>/cuinterpose-agent/criu-logs``): a failed checkpoint removes the images directory
    the log was written to."""
    return Path(os.environ.get(ENV_LOG_DIR) or Path(tempfile.gettempdir()) / "cuinterpose-agent"
                / "criu-logs")


def keep_log(action: str, log_path: Path, images_dir: Path) -> Path:
    """Copy ``log_path`` to :func:`kept_logs_dir` when it lies inside ``images_dir`` (which a
    rollback removes); returns the path to report (the copy, or ``log_path`` when it is kept
    where it is or cannot be copied)."""
    try:
        if not Path(log_path).resolve().is_relative_to(Path(images_dir).resolve()):
            return log_path
        d = kept_logs_dir()
        d.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        dst = d / f"{action}-{stamp}-{os.getpid()}-{Path(images_dir).name}.log"
        n = 1
        while dst.exists():
            n += 1
            dst = d / f"{action}-{stamp}-{os.getpid()}-{Path(images_dir).name}.{n}.log"
        shutil.copyfile(log_path, dst)
        return dst
    except OSError:
        return log_path


_BAD_SIZE = re.compile(r"File (.+?) has bad size (\d+) \(expect (\d+)\)")


def bad_size_files(log_path: Path) -> list[dict]:
    """Files CRIU's restore refused because their size changed since the dump ("File PATH has
    bad size N (expect M)" in its log): ``[{"path" (absolute), "size", "expected"}]``."""
    out = []
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return out
    for m in _BAD_SIZE.finditer(text):
        path = m.group(1)
        row = {"path": path if path.startswith("/") else "/" + path, "size": int(m.group(2)),
               "expected": int(m.group(3))}
        if row not in out:
            out.append(row)
    return out


def _run(action: str, args: list[str], *, images_dir: Path, log_path: Path,
         setup: ChildSetup | None = None, pass_fds: Sequence[int] = ()) -> None:
    cmd = [*criu_command(), action, *args]
    root_fd = -1
    if setup and any(kind == "mnt" for kind, _ in setup.namespaces):
        # CRIU's child enters another mount namespace: reach CRIU and our paths through a
        # descriptor of our root (agent/mntns.py)
        from cuinterpose.agent.mech import mntns
        root_fd = mntns.open_root()
        try:
            cmd = mntns.rewrite(criu_command(), [action, *args], root_fd)
        except mntns.MountNsError as e:
            os.close(root_fd)
            raise CriuError(f"criu {action} cannot run in another mount namespace: {e}",
                            images_dir=images_dir) from None
        pass_fds = (*pass_fds, root_fd)
    try:
        opened = _Opened(setup) if setup else None
    except BaseException:
        if root_fd >= 0:
            os.close(root_fd)
        raise
    try:
        try:
            res = subprocess.run(cmd, env=_env(), stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True, pass_fds=tuple(pass_fds),
                                 preexec_fn=opened.preexec if opened else None)
        except subprocess.SubprocessError as e:
            why = opened.failure() if opened else ""
            raise CriuError(f"criu {action} not started: {why or e}", cmd=cmd,
                            images_dir=images_dir) from None
        except OSError as e:
            raise CriuError(f"criu {action} could not start: {e}", cmd=cmd,
                            images_dir=images_dir) from e
    finally:
        if opened:
            opened.close()
        if root_fd >= 0:
            os.close(root_fd)
    if res.returncode != 0:
        tail = _log_tail(log_path)
        out = (res.stdout + res.stderr).strip()
        if out:
            tail = out + "\n" + tail
        log_path = keep_log(action, log_path, images_dir)
        err = CriuError(f"criu {action} failed for images dir {images_dir}", cmd=cmd,
                        returncode=res.returncode, images_dir=images_dir, log_path=log_path,
                        log_tail=tail)
        err.bad_size = bad_size_files(log_path)
        raise err


def _common(images_dir: Path, work_dir: Path, log_name: str) -> list[str]:
    return ["--images-dir", str(images_dir), "--work-dir", str(work_dir),
            "--log-file", log_name, LOG_LEVEL, "--no-default-config",
            "--libdir", str(_plugins_dir())]


def tree_namespaces(root_pid: int) -> dict:
    """How ``dump`` treats the namespaces of the tree rooted at ``root_pid``:
    ``{"net", "uts", "ipc", "mnt"}`` (the root's namespace inodes), ``"enter"`` (the kinds among
    ``DUMP_ENTER_NS`` that differ from this process's: CRIU runs in the root's),
    ``"external_net"`` (``EXTERNAL_NET_KEY`` when the root's network namespace is not this
    process's, else ``""``) and ``"foreign_mnt"`` (the root's mount namespace is not this
    process's). Raises ``CriuError`` when ``/proc/ROOT/ns`` cannot be read."""
    try:
        out = {k: ns_inode(root_pid, k) for k in ("net", "uts", "ipc", "mnt")}
        mine = {k: ns_inode("self", k) for k in ("net", "uts", "ipc", "mnt")}
    except OSError as e:
        raise CriuError(f"cannot dump: namespaces of pid {root_pid} unreadable: {e}") from e
    out["enter"] = [k for k in DUMP_ENTER_NS if out[k] != mine[k]]
    out["external_net"] = EXTERNAL_NET_KEY if out["net"] != mine["net"] else ""
    out["foreign_mnt"] = out["mnt"] != mine["mnt"]
    return out


def dump(root_pid: int, images_dir: Path, *, leave_running: bool = False,
         log_name: str = "dump.log", extra_args: Iterable[str] = (),
         external_files: Iterable[str] = ()) -> dict:
    """Dump the process tree rooted at ``root_pid`` into ``images_dir`` (created if missing).

    The tree must be quiescent for CRIU: it is frozen (ptrace) for the dump and, unless
    ``leave_running``, **killed by CRIU** once the images are written (SIGKILL). The caller
    must then reap any of those processes that are its children (``Popen.wait()``), and the
    PIDs must be free again before ``restore`` (``wait_pids_free``).
    The log is ``images_dir/log_name``. Unix sockets connected to a process outside the tree,
    a tty, TCP connections and file locks make the dump fail (see docs/criu.md).

    Namespaces (:func:`tree_namespaces`, returned): CRIU runs in the root's uts and ipc
    namespaces, so the images hold neither; a network namespace other than the caller's is
    dumped as external (``--external net[INODE]:cuinterpose-net --network-lock skip``): its
    images restore only with ``restore(..., inherit_fds=[(fd of a netns, "cuinterpose-net")])``.

    ``external_files``: CRIU names ``file[MNT_ID:INODE]`` (hex, ``placement.external_file_key``)
    of files the tree holds on mounts that are not in its mount namespace (opened outside it:
    a container's /dev/null or log file from the runtime), dumped as external (``--external``;
    otherwise CRIU fails "Can't lookup mount=N for fd=M"); their images restore only with an
    fd for each (``inherit_fds=[(fd, "file[MNT_ID:INODE]")]``). ``checkpoint.external_files``
    finds them.

    Raises ``CriuError`` when ``root_pid`` does not exist, ``images_dir`` already holds
    images (``*.img``; images of two dumps must not mix), or CRIU fails (message: command,
    exit code, log tail).
    """
    images_dir = Path(images_dir).absolute()
    if root_pid <= 1 or not os.path.exists(f"/proc/{root_pid}"):
        raise CriuError(f"cannot dump: no process {root_pid}", images_dir=images_dir)
    images_dir.mkdir(parents=True, exist_ok=True)
    if any(images_dir.glob("*.img")):
        raise CriuError(f"cannot dump into {images_dir}: it already holds CRIU images",
                        images_dir=images_dir)
    ns = tree_namespaces(root_pid)
    args = ["--tree", str(root_pid), *_common(images_dir, images_dir, log_name), *DUMP_OPTS]
    if ns["external_net"]:
        # not dumped (CRIU would need iptables to lock it, and restores it from the images);
        # no network lock: we never dump TCP connections (those fail the dump)
        args += ["--external", f"net[{ns['net']}]:{ns['external_net']}",
                 "--network-lock", "skip"]
    for key in dict.fromkeys(external_files):
        args += ["--external", key]
    if leave_running:
        args.append("--leave-running")
    args += list(extra_args)
    setup = ChildSetup(namespaces=tuple((k, f"/proc/{root_pid}/ns/{k}") for k in ns["enter"]))
    _run("dump", args, images_dir=images_dir, log_path=images_dir / log_name, setup=setup)
    return ns


def restore(images_dir: Path, *, log_name: str = "restore.log",
            extra_args: Iterable[str] = (), work_dir: Path | None = None,
            pid_wait_s: float = 15.0, join_ns: Sequence[tuple[str, str]] = (),
            inherit_fds: Sequence[tuple[int, str]] = (),
            setup: ChildSetup | None = None, leave_stopped: bool = False) -> int:
    """Restore the tree dumped in ``images_dir``, detached; returns the restored root's PID.

    The tree comes back with its original PIDs/TIDs, so they must be free: zombies of the
    dumped tree are waited for up to ``pid_wait_s`` seconds (an init that reaps lazily).
    The restored root is **not a child of the caller**: CRIU forks it and exits, so it is
    re-parented to the caller's nearest child subreaper, else to init. Wait for it with
    ``wait_exit(pid)`` (a pidfd), not ``waitpid``.
    Listening Unix sockets are re-bound at their paths: stale socket files must be deleted
    before restore (bind fails on an existing path). Abstract names must be free.
    ``images_dir`` is only read: CRIU's log (``log_name``), pidfile and stats go to
    ``work_dir`` (default: a new ``cuinterpose-criu-restore-*`` temporary directory, removed
    after a successful restore and kept, with its log, when the restore fails).

    Placement (``agent/placement.py``): ``join_ns`` ``[(kind, /proc/PID/ns/KIND)]`` become
    ``--join-ns KIND:PATH``; ``inherit_fds`` ``[(fd, resource)]`` (fds of the caller, passed to
    CRIU) become ``--inherit-fd fd[FD]:RESOURCE`` (``pipe:[INODE]`` for a pipe fd of the tree,
    ``cuinterpose-net`` for an external network namespace); ``setup`` is applied by CRIU's
    child before CRIU starts (its cgroups are the restored tasks' under
    ``--manage-cgroups=ignore``). The caller keeps (and closes) its fds. ``leave_stopped``:
    ``--leave-stopped``, the restored tasks stay stopped (SIGSTOP) until the caller
    SIGCONTs each (``image_pids``), to change something of theirs first.

    Raises ``CriuError`` naming ``images_dir`` when it is missing, holds no images, its
    ``pstree.img`` is unreadable, a PID it needs is taken, ``setup`` cannot be applied (CRIU
    is then not started), or CRIU fails (message: command, exit code, log tail);
    ``images_dir`` is left untouched in every case.
    """
    images_dir = Path(images_dir).absolute()
    if not images_dir.is_dir():
        raise CriuError(f"cannot restore: images dir {images_dir} does not exist",
                        images_dir=images_dir)
    missing = [n for n in ("inventory.img", "pstree.img") if not (images_dir / n).is_file()]
    if missing:
        raise CriuError(f"cannot restore: images dir {images_dir} lacks {', '.join(missing)}"
                        " (not a CRIU dump, or an incomplete one)", images_dir=images_dir)
    pids = image_pids(images_dir)
    busy = wait_pids_free(pids, pid_wait_s)
    if busy:
        desc = ", ".join(f"{p} ({_describe_pid(p)})" for p in busy)
        raise CriuError(f"cannot restore images dir {images_dir}: PIDs still in use: {desc}",
                        images_dir=images_dir)
    own_work_dir = work_dir is None
    if own_work_dir:
        work_dir = Path(tempfile.mkdtemp(prefix="cuinterpose-criu-restore-"))
    else:
        work_dir = Path(work_dir).absolute()
        work_dir.mkdir(parents=True, exist_ok=True)
    if work_dir.resolve() == images_dir.resolve():
        raise CriuError("restore work_dir must differ from the images dir (kept read-only)",
                        images_dir=images_dir)
    pidfile = work_dir / "restore.pid"
    pidfile.unlink(missing_ok=True)
    args = [*_common(images_dir, work_dir, log_name), "--restore-detached",
            "--pidfile", str(pidfile), *RESTORE_OPTS]
    for kind, path in join_ns:
        args += ["--join-ns", f"{kind}:{path}"]
    for fd, resource in inherit_fds:
        args += ["--inherit-fd", f"fd[{int(fd)}]:{resource}"]
    if leave_stopped:
        args.append("--leave-stopped")
    args += list(extra_args)
    try:
        _run("restore", args, images_dir=images_dir, log_path=work_dir / log_name, setup=setup,
             pass_fds=[int(fd) for fd, _ in inherit_fds])
    except CriuError:
        if own_work_dir and not (work_dir / log_name).exists():
            shutil.rmtree(work_dir, ignore_errors=True)   # CRIU never started: nothing to keep
        raise
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError) as e:
        raise CriuError(f"criu restore of {images_dir} succeeded but left no pid in {pidfile}:"
                        f" {e}", images_dir=images_dir, log_path=work_dir / log_name,
                        log_tail=_log_tail(work_dir / log_name)) from e
    if own_work_dir:
        # kept only when the restore fails (its log is named in the error)
        shutil.rmtree(work_dir, ignore_errors=True)
    return pid


# --------------------------------------------------------------------------- images, PIDs

_IMG_MAGICS = (0x54564319, 0x55105940)     # CRIU "common" and "service" image magics
_PSTREE_MAGIC = 0x50273030


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = val = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        val |= (b & 0x7F) << shift
        if not b & 0x80:
            return val, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def image_pids(images_dir: Path) -> list[int]:
    """Every PID and TID the dump in ``images_dir`` restores (from ``pstree.img``).

    Raises ``CriuError`` naming ``images_dir`` when ``pstree.img`` is missing or corrupt.
    """
    images_dir = Path(images_dir)
    path = images_dir / "pstree.img"
    try:
        data = path.read_bytes()
        if len(data) < 8:
            raise ValueError("shorter than its header")
        m1, m2 = struct.unpack_from("<II", data, 0)
        if m1 not in _IMG_MAGICS or m2 != _PSTREE_MAGIC:
            raise ValueError(f"bad magic {m1:#x} {m2:#x}")
        pids: list[int] = []
        off = 8
        while off < len(data):
            if off + 4 > len(data):
                raise ValueError("truncated entry size")
            (size,) = struct.unpack_from("<I", data, off)
            off += 4
            entry = data[off:off + size]
            if len(entry) != size:
                raise ValueError("truncated entry")
            off += size
            i, pid, threads = 0, None, []
            while i < len(entry):
                key, i = _varint(entry, i)
                field, wire = key >> 3, key & 7
                if wire == 0:
                    val, i = _varint(entry, i)
                    if field == 1:
                        pid = val
                    elif field == 5:
                        threads.append(val)
                elif wire == 2:
                    ln, i = _varint(entry, i)
                    chunk, i = entry[i:i + ln], i + ln
                    if field == 5:                       # packed repeated threads
                        j = 0
                        while j < len(chunk):
                            val, j = _varint(chunk, j)
                            threads.append(val)
                else:
                    raise ValueError(f"unexpected wire type {wire}")
            if not pid:
                raise ValueError("entry without a pid")
            pids += [pid] + [t for t in threads if t != pid]
        if not pids:
            raise ValueError("no processes")
        return pids
    except (OSError, ValueError, struct.error) as e:
        raise CriuError(f"images dir {images_dir}: unreadable pstree.img ({e})",
                        images_dir=images_dir) from e


def _describe_pid(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "gone"
    fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
    return (f"{fields.get('Name', '?').strip()}, state {fields.get('State', '?').strip()},"
            f" parent {fields.get('PPid', '?').strip()}")


def wait_pids_free(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until no process or thread uses any of ``pids``; returns those still in use.

    A killed tree's processes stay as zombies until their parent (or init, or a subreaper)
    reaps them, and CRIU needs the exact PIDs back.
    """
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        busy = [p for p in pids if os.path.exists(f"/proc/{p}")]
        if not busy or time.monotonic() >= deadline:
            return busy
        time.sleep(0.05)


def wait_exit(pid: int, timeout: float | None = None) -> bool:
    """Wait until process ``pid`` (not necessarily a child) has exited; True if it has.

    Uses a pidfd, so it works for a restored tree that is not the caller's child. The exit
    status is not available this way (only the parent, or a subreaper, can collect it).
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)
