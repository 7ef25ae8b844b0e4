"""Which CRIU the agent runs, and how: :func:`criu_command` picks one, in order,

1. ``$CUINTERPOSE_CRIU`` (an executable), if set: used when it is CRIU 4.x or later and its
   ``criu check`` passes, else an error (an explicit choice never falls back silently);
2. the system ``criu`` on ``PATH``, if it is 4.x or later and its ``criu check`` passes;
3. ``<cache_dir()>/bin/criu``, the CRIU 4.x that ``criu_install.sh`` (``cuinterpose-agent
   install-criu``, or ``make criu`` from a checkout) unpacks from the next Debian or Ubuntu
   release and runs through its own ld.so; used when its ``criu check`` passes.

A CRIU older than :data:`MIN_MAJOR` is passed over (bookworm's 3.17 fails ``criu check`` on
6.x kernels, docs/criu.md). The choice is made once per process (:func:`reset` forgets it).
Every CRIU the agent runs gets :func:`env`: ``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ``LD_AUDIT``
and ``CRIU_CONFIG_FILE`` removed. :class:`CriuError` is the error of every ``criu*`` module;
without a usable CRIU its message ends with :func:`install_hint`.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "CriuError",
    "criu_command",
    "version",
    "check",
    "reset",
    "cache_dir",
    "installer",
    "install",
    "install_hint",
    "env",
    "ENV_CRIU",
    "ENV_CACHE",
    "STRIPPED_ENV",
    "MIN_MAJOR",
]

REPO = pathlib.Path(__file__).resolve().parents[2]
ENV_CRIU = "CUINTERPOSE_CRIU"
ENV_CACHE = "CUINTERPOSE_CRIU_CACHE"
#: the oldest CRIU major version the agent runs (criu_install.sh's MIN_MAJOR)
MIN_MAJOR = 4
# Removed from CRIU's environment: a preload (e.g. the shim) would be injected into CRIU
# itself; a library path would mix the caller's libraries into CRIU's; CRIU_CONFIG_FILE
# would add options we did not choose.
STRIPPED_ENV = ("LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "CRIU_CONFIG_FILE")

_lock = threading.Lock()
_chosen: tuple[list[str], str] | None = None  # (argv prefix, `criu check` output)


class CriuError(RuntimeError):
    """A CRIU command failed or could not be run.

    Attributes: ``cmd`` (argv, or None when CRIU was not run), ``returncode`` (or None),
    ``images_dir``, ``log_path`` (or None) and ``log_tail`` (last lines of the CRIU log).
    """

    def __init__(
        self,
        message: str,
        *,
        cmd: Sequence[str] | None = None,
        returncode: int | None = None,
        images_dir: Path | None = None,
        log_path: Path | None = None,
        log_tail: str = "",
    ):
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


def env() -> dict[str, str]:
    """The environment CRIU runs with: this process's less ``STRIPPED_ENV``, ``LC_ALL=C``."""
    out = {k: v for k, v in os.environ.items() if k not in STRIPPED_ENV}
    out["LC_ALL"] = "C"
    return out


def cache_dir() -> Path:
    """The folder ``install-criu`` installs CRIU into and the agent looks in:
    ``$CUINTERPOSE_CRIU_CACHE``; else, run from a checkout (``make build``: an editable
    install), ``<repo>/.cache/criu``; else ``<sys.prefix>/share/cuinterpose/criu``, beside the
    installed package (a virtual environment's own folder, or e.g. /usr/local/share)."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    if (REPO / "pyproject.toml").is_file() and (REPO / "agent" / "mech").is_dir():
        return REPO / ".cache" / "criu"
    return Path(sys.prefix) / "share" / "cuinterpose" / "criu"


def installer() -> Path:
    """The CRIU installer the package ships (``criu_install.sh`` beside this module)."""
    return Path(__file__).with_name("criu_install.sh")


def install(target: Path | None = None, *, suite: str | None = None, force: bool = False) -> int:
    """Run :func:`installer` into ``target`` (default :func:`cache_dir`, where the agent looks),
    its progress and errors on this process's stderr; ``suite`` overrides the release CRIU comes
    from, ``force`` installs even when the system's CRIU works. Returns its exit status: 0 when a
    CRIU >= MIN_MAJOR passes ``criu check``, 1 otherwise (the reason printed). Downloads are
    bounded by apt's own timeouts; Ctrl-C stops them. Forgets the chosen CRIU (:func:`reset`)."""
    run_env = {k: v for k, v in os.environ.items() if k not in STRIPPED_ENV}
    run_env[ENV_CACHE] = str(target or cache_dir())
    if suite:
        run_env["CRIU_SUITE"] = suite
    if force:
        run_env["CRIU_FORCE_CACHE"] = "1"
    try:
        return subprocess.run(
            ["bash", str(installer())], env=run_env, stdin=subprocess.DEVNULL
        ).returncode
    finally:
        reset()


def install_hint() -> str:
    """How to get a CRIU the agent uses, for this machine: ``cuinterpose-agent install-criu``
    on Debian and Ubuntu (``make criu`` from a checkout), the manual way elsewhere."""
    ids = ""
    try:  # CRIU_OS_RELEASE: as criu_install.sh reads it
        with open(os.environ.get("CRIU_OS_RELEASE") or "/etc/os-release") as f:
            for line in f:
                k, _, v = line.strip().partition("=")
                if k in ("ID", "ID_LIKE"):
                    ids += " " + v.strip("\"'")
    except OSError:
        pass
    manual = (
        f"install CRIU >= {MIN_MAJOR}.0 yourself (your distribution's criu package where it is "
        f"{MIN_MAJOR}.x, else built from CRIU's source release), then put it on PATH or set "
        f"{ENV_CRIU}=/path/to/criu"
    )
    if not {"debian", "ubuntu"} & set(ids.split()):
        return manual
    where = cache_dir()
    how = "make criu" if where == REPO / ".cache" / "criu" else "cuinterpose-agent install-criu"
    return f"run `{how}` (CRIU {MIN_MAJOR}.x into {where}, found there by the agent); or {manual}"


def _run_check(prefix: list[str]) -> tuple[bool, str]:
    try:
        res = subprocess.run(
            [*prefix, "check", "--no-default-config"],
            env=env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{shlex.join(prefix)}: {e}"
    out = (res.stdout + res.stderr).strip()
    return res.returncode == 0 and "Looks good" in out, out


def _candidates() -> list[tuple[str, list[str] | None]]:
    explicit = os.environ.get(ENV_CRIU)
    if explicit:
        return [(f"${ENV_CRIU}={explicit}", [explicit])]
    system = shutil.which("criu", path=env().get("PATH", os.defpath))
    wrapper = cache_dir() / "bin" / "criu"
    return [
        ("system criu", [system] if system else None),
        (f"cached criu {wrapper}", [str(wrapper)] if os.access(wrapper, os.X_OK) else None),
    ]


def _version_of(prefix: list[str]) -> str:
    """``criu --version``'s version (e.g. ``"4.1.1"``), or "" when it does not say one."""
    try:
        res = subprocess.run(
            [*prefix, "--version"],
            env=env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    for line in (res.stdout + res.stderr).splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return ""


def _too_old(version: str) -> bool:
    major = version.split(".", 1)[0]
    return not major.isdigit() or int(major) < MIN_MAJOR


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
            ver = _version_of(prefix)
            if _too_old(ver):
                reasons.append(f"{name}: version {ver or '?'} is older than {MIN_MAJOR}.0")
                continue
            ok, out = _run_check(prefix)
            if ok:
                _chosen = (prefix, out)
                return _chosen
            tail = "\n    ".join(out.splitlines()[-5:])
            reasons.append(f"{name}: `criu check` failed:\n    {tail}")
        raise CriuError(
            "no working CRIU:\n" + "\n".join(reasons) + f"\nTo install one: {install_hint()}"
        )


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
    res = subprocess.run(cmd, env=env(), stdin=subprocess.DEVNULL, capture_output=True, text=True)
    for line in (res.stdout + res.stderr).splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise CriuError(
        "cannot read the CRIU version",
        cmd=cmd,
        returncode=res.returncode,
        log_tail=(res.stdout + res.stderr).strip(),
    )


def check() -> tuple[bool, str]:
    """``(ok, output)`` of ``criu check`` for the CRIU ``criu_command`` picks.

    Never raises: without a working CRIU it returns ``(False, <why each candidate failed>)``.
    """
    try:
        prefix, _ = _choose()
    except CriuError as e:
        return False, str(e)
    return _run_check(prefix)
