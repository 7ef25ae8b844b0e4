"""The C library functions the agent calls through ctypes (setns(2), unshare(2), syscall(2)
for pidfd_getfd(2)), from one handle with ``errno`` kept (``ctypes.get_errno()`` after a
failed call), and the flag values they take (include/uapi/linux/sched.h, asm/unistd.h).
"""

from __future__ import annotations

import ctypes

__all__ = ["fn", "CLONE_FS", "CLONE_NEWCGROUP", "CLONE_NEWNET", "SYS_pidfd_getfd"]

#: unshare(2) flag: the filesystem attributes (root, cwd, umask)
CLONE_FS = 0x00000200
#: setns(2) flag of a cgroup namespace
CLONE_NEWCGROUP = 0x02000000
#: setns(2) flag of a network namespace
CLONE_NEWNET = 0x40000000
#: pidfd_getfd(2)'s system call number (the same on x86_64 and arm64)
SYS_pidfd_getfd = 438

_libc = None


def fn(name: str):
    """The C library function ``name`` (``"setns"``, ``"unshare"``, ``"syscall"``) of this
    process's libc, loaded once with ``use_errno``."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return getattr(_libc, name)
