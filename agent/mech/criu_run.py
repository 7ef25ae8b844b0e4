"""Running one CRIU command (:func:`run`): its command line's common options
(:func:`common_args`: images and work dirs, log file and level, no default config, no
plugins), the child set-up and mount namespace it runs in, and on failure a
:class:`~cuinterpose.agent.mech.criu_binary.CriuError` with the tail of its log, the log kept
out of a rolled-back images dir (:func:`keep_log`) and the files its restore refused for
their size (:func:`bad_size_files`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from cuinterpose.agent.mech import libc, mntns, signal_at
from cuinterpose.agent.mech.criu_binary import CriuError, cache_dir, criu_command, env
from cuinterpose.agent.mech.criu_child import ChildSetup, Opened

__all__ = [
    "run",
    "common_args",
    "keep_log",
    "kept_logs_dir",
    "bad_size_files",
    "LOG_LEVEL",
    "LOG_TAIL_LINES",
    "ENV_LOG_DIR",
    "log_tail",
]

#: the umask of a CRIU dump: its images and log are created 0600 (a restore's CRIU keeps its
#: own: it gives each restored task the umask recorded in its images)
PRIVATE_UMASK = 0o077
LOG_LEVEL = "-v4"  # full debug log in the log file; CRIU prints nothing to stdout
LOG_TAIL_LINES = 25

_no_plugins_dir: Path | None = None


def _plugins_dir() -> Path:
    """An empty directory for ``--libdir``, so that no CRIU plugin is loaded: the agent drives
    the native CUDA checkpoint itself, so a CRIU CUDA plugin must not lock or checkpoint the
    tasks a second time."""
    global _no_plugins_dir
    if _no_plugins_dir is None or not _no_plugins_dir.is_dir():
        d = cache_dir() / "plugins"
        if not (d.is_dir() and not any(d.iterdir())):
            d = Path(tempfile.mkdtemp(prefix="cuinterpose-criu-noplugins-"))
        _no_plugins_dir = d
    return _no_plugins_dir


def log_tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
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
    return Path(
        os.environ.get(ENV_LOG_DIR)
        or Path(tempfile.gettempdir()) / "cuinterpose-agent" / "criu-logs"
    )


def keep_log(action: str, log_path: Path, images_dir: Path) -> Path:
    """Copy ``log_path`` to :func:`kept_logs_dir` when it lies inside ``images_dir`` (which a
    rollback removes); returns the path to report (the copy, or ``log_path`` when it is kept
    where it is or cannot be copied)."""
    try:
        if not Path(log_path).resolve().is_relative_to(Path(images_dir).resolve()):
            return log_path
        d = kept_logs_dir()
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        dst = d / f"{action}-{stamp}-{os.getpid()}-{Path(images_dir).name}.log"
        n = 1
        while dst.exists():
            n += 1
            dst = d / f"{action}-{stamp}-{os.getpid()}-{Path(images_dir).name}.{n}.log"
        shutil.copyfile(log_path, dst)
        os.chmod(dst, 0o600)  # a CRIU log names the job's files and sockets
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
        row = {
            "path": path if path.startswith("/") else "/" + path,
            "size": int(m.group(2)),
            "expected": int(m.group(3)),
        }
        if row not in out:
            out.append(row)
    return out


#: prctl(2) option (include/uapi/linux/prctl.h): the signal sent when the parent thread dies
PR_SET_PDEATHSIG = 1


def _child_preexec(opened, umask=None):
    """The ``preexec_fn`` of CRIU's child: first PR_SET_PDEATHSIG(SIGKILL), so CRIU dies with
    its agent instead of finishing a dump alone (case 009: a tree it leaves stopped is
    resumed by ``release``), ``umask`` when given (a dump: 077, so CRIU creates its images and
    log 0600, private as the whole snapshot, case 016), then ``opened``'s setup (cgroups,
    namespaces) when there is one."""
    prctl = libc.fn("prctl")
    agent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if umask is not None:
            os.umask(umask)
        if os.getppid() != agent:  # the agent died before prctl: do not run orphaned
            os._exit(137)
        if opened:
            opened.preexec()

    return preexec


def run(
    action: str,
    args: list[str],
    *,
    images_dir: Path,
    log_path: Path,
    setup: ChildSetup | None = None,
    pass_fds: Sequence[int] = (),
    timeout_s: float,
) -> None:
    """Run ``criu ACTION ARGS`` (with ``env()``, stdin from /dev/null), killed past
    ``timeout_s`` seconds (the run's ``criu_timeout_s`` option: a dump writes every page of the
    trees; a killed dump is rolled back: the tree CRIU had seized is detached by the kill and
    resumed by the rollback), from a child that
    applies ``setup`` first (entering another mount namespace through a descriptor of this
    process's root, agent/mech/mntns.py), passing it ``pass_fds``. Raises ``CriuError``: not
    started (naming what the child could not do), or failed (exit code, the tail of
    ``log_path``, which :func:`keep_log` copies out of ``images_dir``, and ``bad_size``)."""
    deadline_s = float(timeout_s)
    cmd = [*criu_command(), action, *args]
    root_fd = -1
    if setup and any(kind == "mnt" for kind, _ in setup.namespaces):
        # CRIU's child enters another mount namespace: reach CRIU and our paths through a
        # descriptor of our root (agent/mech/mntns.py)
        root_fd = mntns.open_root()
        try:
            cmd = mntns.rewrite(criu_command(), [action, *args], root_fd)
        except mntns.MountNsError as e:
            os.close(root_fd)
            raise CriuError(
                f"criu {action} cannot run in another mount namespace: {e}", images_dir=images_dir
            ) from None
        pass_fds = (*pass_fds, root_fd)
    try:
        opened = Opened(setup) if setup else None
    except BaseException:
        if root_fd >= 0:
            os.close(root_fd)
        raise
    try:
        try:
            signal_at.signal_point("during", after_exec=True)  # test only: once CRIU runs
            res = subprocess.run(
                cmd,
                env=env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                pass_fds=tuple(pass_fds),
                preexec_fn=_child_preexec(opened, PRIVATE_UMASK if action == "dump" else None),
                timeout=deadline_s,
            )
        except subprocess.TimeoutExpired:  # subprocess.run killed and reaped CRIU
            log_path = keep_log(action, log_path, images_dir)
            raise CriuError(
                f"criu {action} did not finish within {deadline_s:g} s (criu_timeout_s) "
                f"for images dir {images_dir}: it was killed",
                cmd=cmd,
                images_dir=images_dir,
                log_path=log_path,
                log_tail=log_tail(log_path),
            ) from None
        except subprocess.SubprocessError as e:
            why = opened.failure() if opened else ""
            raise CriuError(
                f"criu {action} not started: {why or e}", cmd=cmd, images_dir=images_dir
            ) from None
        except OSError as e:
            raise CriuError(
                f"criu {action} could not start: {e}", cmd=cmd, images_dir=images_dir
            ) from e
    finally:
        if opened:
            opened.close()
        if root_fd >= 0:
            os.close(root_fd)
    if res.returncode != 0:
        tail = log_tail(log_path)
        out = (res.stdout + res.stderr).strip()
        if out:
            tail = out + "\n" + tail
        log_path = keep_log(action, log_path, images_dir)
        err = CriuError(
            f"criu {action} failed for images dir {images_dir}",
            cmd=cmd,
            returncode=res.returncode,
            images_dir=images_dir,
            log_path=log_path,
            log_tail=tail,
        )
        err.bad_size = bad_size_files(log_path)
        raise err


def common_args(images_dir: Path, work_dir: Path, log_name: str) -> list[str]:
    """The options of every CRIU command: images and work dirs, log file and ``LOG_LEVEL``,
    ``--no-default-config`` (no ``/etc/criu/default.conf``), ``--libdir`` of no plugins."""
    return [
        "--images-dir",
        str(images_dir),
        "--work-dir",
        str(work_dir),
        "--log-file",
        log_name,
        LOG_LEVEL,
        "--no-default-config",
        "--libdir",
        str(_plugins_dir()),
    ]
