"""What a CRIU images directory restores, and the PIDs it needs: :func:`image_pids` reads
``pstree.img``; :func:`wait_pids_free` waits for those PIDs to be free; :func:`wait_exit`
waits for a restored process that is not the caller's child.
"""

from __future__ import annotations

import os
import select
import struct
import time
from collections.abc import Iterable
from pathlib import Path

from cuinterpose.agent.mech import procfs
from cuinterpose.agent.mech.criu_binary import CriuError

__all__ = ["image_pids", "wait_pids_free", "wait_exit", "describe_pid"]

_IMG_MAGICS = (0x54564319, 0x55105940)  # CRIU "common" and "service" image magics
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
            entry = data[off : off + size]
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
                    chunk, i = entry[i : i + ln], i + ln
                    if field == 5:  # packed repeated threads
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
        raise CriuError(
            f"images dir {images_dir}: unreadable pstree.img ({e})", images_dir=images_dir
        ) from e


def describe_pid(pid: int) -> str:
    """``"NAME, state STATE, parent PPID"`` of a process holding a PID (``/proc/PID/status``),
    ``"gone"`` when it has none."""
    try:
        fields = procfs.status(pid)
    except OSError:
        return "gone"
    return (
        f"{fields.get('Name', '?')}, state {fields.get('State', '?')},"
        f" parent {fields.get('PPid', '?')}"
    )


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
