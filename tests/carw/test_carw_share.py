"""carw's share helpers that need no GPU: ``pidfd_getfd``."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from cuinterpose.workloads.carw.share import pidfd_getfd


def test_pidfd_getfd_duplicates_the_fd_with_a_shared_offset(tmp_path):
    """share.pidfd_getfd: the importer's FD is the creator's open file (same offset), as
    PyTorch's expandable-segment importer gets it."""
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    r, w = os.pipe()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); os.read(fd, 3); "
            "print(fd, flush=True); sys.stdin.read()",
            str(path),
        ],
        stdin=r,
        stdout=subprocess.PIPE,
        text=True,
    )
    os.close(r)
    try:
        fd_no = int(child.stdout.readline())
        fd = pidfd_getfd(child.pid, fd_no)
        try:
            assert os.lseek(fd, 0, os.SEEK_CUR) == 3
            assert os.read(fd, 4) == b"3456"
        finally:
            os.close(fd)
        with pytest.raises(OSError) as e:
            pidfd_getfd(child.pid, 999)
        assert e.value.errno == errno.EBADF
        assert (
            str(e.value) == f"[Errno 9] pidfd_getfd(pid {child.pid}, fd 999): Bad file descriptor"
        )
    finally:
        os.close(w)
        child.wait()
