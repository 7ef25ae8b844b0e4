"""``python enospc_agent.py N ARGS...``: ``cuinterpose-agent ARGS`` whose N-th ``write(2)`` to a
``manifest.json.tmp`` fails with ENOSPC (a full filesystem at exactly that write; every other
write goes through). For case 013's manifest rewrite (N=2: the final rewrite with the totals)."""

from __future__ import annotations

import errno
import os
import runpy
import sys

_real_write = os.write
_seen = 0
_fail_at = int(sys.argv.pop(1))


def _write(fd, data):
    global _seen
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = ""
    if target.endswith("/manifest.json.tmp"):
        _seen += 1
        if _seen == _fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _real_write(fd, data)


os.write = _write
sys.argv[0] = "cuinterpose-agent"
runpy.run_module("cuinterpose.agent.cli", run_name="__main__")
