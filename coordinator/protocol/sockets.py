"""Control socket names (``<control_dir>/cuinterpose-<pid>.sock``), the default control dir,
and CUresult names. Part of :mod:`cuinterpose.coordinator.protocol`."""

from __future__ import annotations

import os

from .codes import (
    CONTROL_DIR_ENV,
    CUI_CLAIM_SUFFIX,
    CUI_DEFAULT_CONTROL_DIR,
    CUI_SOCKET_PREFIX,
    CUI_SOCKET_SUFFIX,
)

__all__ = [
    "socket_path",
    "claim_path",
    "default_control_dir",
    "pid_from_socket_path",
    "cuda_result_name",
]


# --- sockets --------------------------------------------------------------------------------
def default_control_dir() -> str:
    """``$CUINTERPOSE_CONTROL_DIR`` or :data:`CUI_DEFAULT_CONTROL_DIR`."""
    return os.environ.get(CONTROL_DIR_ENV) or CUI_DEFAULT_CONTROL_DIR


def socket_path(control_dir: str | os.PathLike | None, pid: int) -> str:
    """``<control_dir>/cuinterpose-<pid>.sock``; ``None`` means :func:`default_control_dir`."""
    base = os.fspath(control_dir) if control_dir is not None else default_control_dir()
    return os.path.join(base, f"{CUI_SOCKET_PREFIX}{int(pid)}{CUI_SOCKET_SUFFIX}")


def claim_path(control_dir: str | os.PathLike | None, pid: int) -> str:
    """``<control_dir>/cuinterpose-<pid>.claim`` (protocol.h "Claims"); ``None`` means
    :func:`default_control_dir`."""
    base = os.fspath(control_dir) if control_dir is not None else default_control_dir()
    return os.path.join(base, f"{CUI_SOCKET_PREFIX}{int(pid)}{CUI_CLAIM_SUFFIX}")


def pid_from_socket_path(path: str | os.PathLike) -> int | None:
    """The pid encoded in a ``cuinterpose-<pid>.sock`` name, or None if it does not match."""
    name = os.path.basename(os.fspath(path))
    if name.startswith(CUI_SOCKET_PREFIX) and name.endswith(CUI_SOCKET_SUFFIX):
        mid = name[len(CUI_SOCKET_PREFIX) : -len(CUI_SOCKET_SUFFIX)]
        if mid.isdigit():
            return int(mid)
    return None


def cuda_result_name(code: int) -> str:
    """``CUDA_ERROR_INVALID_VALUE`` for 1, ``CUDA_SUCCESS`` for 0; ``CUresult <n>`` if unknown."""
    try:
        from cuda.bindings import driver  # imported lazily; needs no libcuda to name codes

        return driver.CUresult(int(code)).name
    except Exception:
        return f"CUresult {int(code)}"
