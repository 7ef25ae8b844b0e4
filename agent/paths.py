"""Where the installed cuinterpose artifacts live.

The C libraries are built by scikit-build-core into the package directory
``cuinterpose/lib`` (shim) and ``cuinterpose/lib/fakecuda`` (fakecuda's ``libcuda.so.1``).
``CUINTERPOSE_LIB_DIR`` overrides the search (a directory holding ``libcuinterpose.so``).
Every function raises ``FileNotFoundError`` naming what was looked for and where.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

import cuinterpose

SHIM_NAME = "libcuinterpose.so"
#: the snapshot root of an agent that names none (``serve --snapshot-dir``, the config's
#: ``snapshotDir``, ``snapshots`` without ``--dir``)
DEFAULT_SNAPSHOT_DIR = "/var/lib/cuinterpose/snapshots"
FAKECUDA_NAME = "libcuda.so.1"


def canonical(path: os.PathLike | str) -> str:
    """The one canonical form of a path the operator gives (images dir, snapshot dir, control
    dir), used by every command and the daemon alike: absolute (relative to the working
    directory), symlinks and ``..`` resolved as the kernel does (``os.path.realpath``: a
    symlink is followed before the ``..`` after it; components that do not exist yet are kept
    as written). So ``p/a/../b/snap`` names the same directory for ``checkpoint``, ``restore``,
    ``snapshots``, ``delete`` and the daemon."""
    return os.path.realpath(os.fspath(path))


def absolute(path: os.PathLike | str) -> str:
    """``path`` made absolute against the working directory, nothing resolved (``..`` and
    symlinks left as written): what the CLI sends to a daemon, which resolves it on its own
    node with :func:`canonical`."""
    p = os.fspath(path)
    return p if os.path.isabs(p) else os.path.join(os.getcwd(), p)


def lib_dir() -> pathlib.Path:
    """Directory holding ``libcuinterpose.so`` (and ``fakecuda/libcuda.so.1``)."""
    override = os.environ.get("CUINTERPOSE_LIB_DIR")
    candidates = [pathlib.Path(override)] if override else []
    candidates += [pathlib.Path(p) / "lib" for p in cuinterpose.__path__]
    for cand in candidates:
        if (cand / SHIM_NAME).is_file():
            return cand.resolve()
    raise FileNotFoundError(
        f"{SHIM_NAME} not found in {', '.join(str(c) for c in candidates)}; "
        "build it with `make build` (pip install -e .)"
    )


def shim_path() -> pathlib.Path:
    """Absolute path of the LD_PRELOAD shim, ``libcuinterpose.so``."""
    return lib_dir() / SHIM_NAME


def fakecuda_dir() -> pathlib.Path:
    """Directory to put on ``LD_LIBRARY_PATH`` to load fakecuda as ``libcuda.so.1``."""
    d = lib_dir() / "fakecuda"
    if not (d / FAKECUDA_NAME).is_file():
        raise FileNotFoundError(f"fakecuda {FAKECUDA_NAME} not found in {d}; run `make build`")
    return d


def real_driver_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) for a child on the real driver: no
    ``LD_PRELOAD``, no ``CUINTERPOSE_DRIVER``, and ``LD_LIBRARY_PATH`` without fakecuda's
    directory and empty entries. The rest of ``LD_LIBRARY_PATH`` is kept: a GPU image may reach
    its ``libcuda.so.1`` only through it (e.g. ``/usr/local/nvidia/lib64``)."""
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if k not in ("LD_PRELOAD", "CUINTERPOSE_DRIVER")
    }
    try:
        fake = os.path.realpath(lib_dir() / "fakecuda")
    except FileNotFoundError:
        fake = None
    keep = [
        p for p in env.pop("LD_LIBRARY_PATH", "").split(":") if p and os.path.realpath(p) != fake
    ]
    if keep:
        env["LD_LIBRARY_PATH"] = ":".join(keep)
    return env


def missing_dirs(path: str) -> list[str]:
    """The components of absolute ``path`` that do not exist yet, outermost first."""
    out = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        out.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return out[::-1]
