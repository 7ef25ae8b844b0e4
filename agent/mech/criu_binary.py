"""Which CRIU the agent runs, and how: :func:`criu_command` picks one, in order,

1. ``$CUINTERPOSE_CRIU`` (an executable), if set: used when its ``criu check`` passes, else
   an error (an explicit choice never falls back silently);
2. the system ``criu`` on ``PATH``, if its ``criu check`` passes;
3. ``<repo>/.cache/criu/bin/criu`` (``$CUINTERPOSE_CRIU_CACHE/bin/criu``), the CRIU 4.x that
   ``scripts/install-criu.sh`` (``make criu``) unpacks from Debian trixie and runs through
   its own ld.so; used when its ``criu check`` passes.

The choice is made once per process (:func:`reset` forgets it). Every CRIU the agent runs
gets :func:`env`: ``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ``LD_AUDIT`` and ``CRIU_CONFIG_FILE``
removed. :class:`CriuError` is the error of every ``criu*`` module.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import subprocess
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
    "env",
    "ENV_CRIU",
    "ENV_CACHE",
    "STRIPPED_ENV",
]

REPO = pathlib.Path(__file__).resolve().parents[2]
ENV_CRIU = "CUINTERPOSE_CRIU"
ENV_CACHE = "CUINTERPOSE_CRIU_CACHE"
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
    """The folder scripts/install-criu.sh installs into (``$CUINTERPOSE_CRIU_CACHE``)."""
    return Path(os.environ.get(ENV_CACHE) or REPO / ".cache" / "criu")


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
        raise CriuError(
            "no working CRIU; install one with `make criu` "
            "(bash scripts/install-criu.sh):\n" + "\n".join(reasons)
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
