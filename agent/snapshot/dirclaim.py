"""One run at a time writes a snapshot directory (case 015; decisions D56).

A checkpoint claims its images directory before it writes anything there and holds the claim
for its whole life: ``DIR/.cuinterpose-claim``, a 0600 file holding {"pid", "host",
"run_id", "group", "started_at"} of the run, on which the run holds ``flock(LOCK_EX)``
(flock(2): the lock dies with the process, so a claim whose holder died is known as stale).
The file is built under a temporary name, locked, then ``link``\\ ed into place (link(2) fails
when the name exists), so any claim another run can see is already locked and two runs
cannot both win. :meth:`Claim.check`, called again before each step that writes into the
directory, proves the claim is still this run's file (same device and inode as the locked
descriptor). A second run is refused naming the holder; a stale claim is taken over only when
it is all the directory holds (its run wrote nothing else).

A restore, and a ``delete`` while it removes the directory, hold :class:`SnapshotLock`
instead (decisions D72): ``flock(LOCK_EX)`` on a descriptor of the snapshot directory itself,
so nothing is written into a snapshot a restore only reads (its files and the directory's
mtime stay as they are, and a read-only one can be locked too); a second restore or a delete
of it is refused naming the holder's pid, read from /proc/locks (proc(5)).

The names (``.cuinterpose-claim``, the temporary ``..cuinterpose-claim.<hex>.tmp``) are the
snapshot directory's (agent/snapshot/snapdir.py): every function here takes its
:class:`~cuinterpose.agent.snapshot.snapdir.SnapshotDir` (``snap.take_claim``,
``snap.claim_holder``, ``snap.remove_stale_claim`` call them).

Errors: :class:`~cuinterpose.agent.errors.SnapshotError` of phase ``images dir`` (or the
phase given), naming the directory and the other run.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import pathlib
import secrets
import socket
from typing import Optional

from cuinterpose.agent.errors import SnapshotError

PHASE = "images dir"


def _read(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 65536) or b"{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def describe(rec: dict) -> str:
    """A claim record in words: ``agent pid 4121 on node-a (run 3f2c…, started at …)``."""
    who = f"agent pid {rec.get('pid', '?')}"
    if rec.get("host"):
        who += f" on {rec['host']}"
    extra = [f"request id {rec['run_id']}"] if rec.get("run_id") else []
    if rec.get("group"):
        extra.append(f"group request {rec['group']}")
    if rec.get("started_at"):
        extra.append(f"started at {rec['started_at']}")
    return who + (f" ({', '.join(extra)})" if extra else "")


def _try_lock(snap, how: int) -> tuple[int, bool]:
    """Open the claim of ``snap`` (never through a symlink) and try its flock ``how``
    (``LOCK_SH``/``LOCK_EX``) without waiting: (fd, True) when taken (its run is gone), (fd,
    False) when a live run holds it. OSError when it cannot be opened; the caller closes fd."""
    fd = snap.open(snap.CLAIM, os.O_RDWR | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return fd, True
    except BlockingIOError:
        return fd, False


def _same_file(fd: int, path) -> bool:
    """``path`` is still the file open at ``fd`` (same device and inode)."""
    try:
        st, now = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def holder(snap) -> Optional[dict]:
    """The record of the live run that holds a claim on the snapshot directory ``snap`` (its
    flock is taken), else None (no claim, or a stale one). Takes nothing."""
    try:
        fd, free = _try_lock(snap, fcntl.LOCK_SH)
    except OSError:
        return None
    try:
        return None if free else _read(fd)
    finally:
        os.close(fd)


class DirClaim:
    """This run's claim on the snapshot directory ``snap`` (a SnapshotDir of an existing
    directory). ``run_id``: the run's
    request id (the quiesce request and snapshot id); ``group``: its group request id, if any.
    Raises ``SnapshotError`` (phase :data:`PHASE`) when another live run holds the directory,
    or a stale claim lies beside other files (the dead run's partial snapshot)."""

    def __init__(self, snap, run_id: str = "", group: str = "", phase: str = PHASE):
        self.snap = snap
        self.dir = snap.path
        self.path = snap.claim_path
        self.phase = phase
        self.record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "run_id": run_id,
            "group": group,
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
        }
        self.fd = -1
        for _ in range(16):  # a stale claim taken over; another run may race for it
            if self._try_link():
                return
            self._take_stale()
        raise SnapshotError(phase, f"{self.dir}: could not claim it after 16 tries (contended)")

    def _try_link(self) -> bool:
        tmp = self.snap.claim_tmp(secrets.token_hex(8))
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = self.snap.open(tmp, flags, 0o600)
        except OSError as e:
            raise SnapshotError(
                self.phase, f"{self.dir} is not writable: {e.strerror or e}"
            ) from None
        linked = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it
            os.write(fd, json.dumps(self.record).encode())
            os.link(self.snap.file(tmp), self.path)
            linked = True
        except FileExistsError:
            pass
        except OSError as e:
            raise SnapshotError(self.phase, f"cannot claim {self.dir}: {e.strerror or e}") from None
        finally:
            os.unlink(self.snap.file(tmp))
            if not linked:
                os.close(fd)
        if not linked:
            return False
        self.fd = fd
        return True

    def _take_stale(self) -> None:
        """The claim file exists: refuse when its run is alive or it lies beside other files;
        remove it when it is stale and alone (under its own lock, checked to still be the
        file at the name, so a racing run never removes a fresh claim)."""
        try:
            fd, free = _try_lock(self.snap, fcntl.LOCK_EX)
        except FileNotFoundError:
            return  # released meanwhile: try again
        except OSError as e:
            raise SnapshotError(
                self.phase, f"{self.path} cannot be opened: {e.strerror or e}"
            ) from None
        try:
            if not free:
                raise SnapshotError(
                    self.phase,
                    f"{self.dir} is being written by another checkpoint: "
                    f"{describe(_read(fd))}; one run at a time writes a snapshot directory: "
                    "checkpoint refused, nothing was changed; choose another --images-dir",
                )
            if not _same_file(fd, self.path):
                return  # removed or replaced meanwhile: look again
            others = self.snap.foreign()
            if others:
                raise SnapshotError(
                    self.phase,
                    f"{self.dir} holds what a checkpoint left when its agent died "
                    f"({describe(_read(fd))}; {', '.join(others[:5])}): checkpoint refused, "
                    "nothing was changed; `cuinterpose-agent release --pid ROOT` finishes that "
                    "checkpoint's rollback, or remove the directory",
                )
            os.unlink(self.path)
        finally:
            os.close(fd)

    def check(self, phase: Optional[str] = None) -> None:
        """Before writing: the claim file at the name must still be this run's (same device
        and inode). Raises ``SnapshotError`` (``phase``) when it was removed or replaced:
        something else changed the directory, so nothing more is written there."""
        if self.fd < 0 or not _same_file(self.fd, self.path):
            raise SnapshotError(
                phase or self.phase,
                f"the claim {self.path} of this checkpoint was removed or replaced while it ran: "
                "another run may be writing the directory, so this one stops writing there",
            )

    def release(self) -> None:
        """Remove the claim file (only while it is still this run's) and drop the lock;
        idempotent."""
        if self.fd < 0:
            return
        try:
            if _same_file(self.fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def remove_stale(snap, run_id: str) -> bool:
    """Remove the claim of the snapshot directory ``snap`` left by run ``run_id`` whose agent
    died (a ``release`` finishing its rollback); a live run's claim or another run's is left.
    True when one was removed."""
    path = snap.claim_path
    try:
        fd, free = _try_lock(snap, fcntl.LOCK_EX)
    except OSError:
        return False
    try:
        if not free or _read(fd).get("run_id") != run_id or not _same_file(fd, path):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def lock_holders(path) -> list[int]:
    """The pids holding a ``flock`` on the file or directory ``path`` (/proc/locks lines
    ``N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF``, device numbers in hex; waiters,
    ``->`` lines, left out), sorted; [] when none or unreadable."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    out = set()
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or "->" in parts or parts[1] != "FLOCK":
            continue
        try:
            maj, mnr, ino = parts[5].split(":")
            if (int(maj, 16), int(mnr, 16), int(ino)) == want:
                out.add(int(parts[4]))
        except ValueError:
            continue
    return sorted(out)


class SnapshotLock:
    """``flock(LOCK_EX)`` on the snapshot directory ``images_dir`` (an existing directory),
    held by a restore (``kind`` "restore") for its whole run and by a delete ("delete") while
    it removes it; nothing is written. Raises ``SnapshotError`` (``phase``) naming the pid(s)
    that hold it when another run does (a restore, or a delete, of that snapshot)."""

    def __init__(self, images_dir, *, phase: str, kind: str):
        self.dir = pathlib.Path(images_dir)
        try:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise SnapshotError(phase, f"{self.dir} cannot be opened: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = ", ".join(map(str, lock_holders(self.dir))) or "?"
            os.close(fd)
            then = (
                "restore refused, nothing was changed, the snapshot is untouched; restore it "
                "once that run has finished"
                if kind == "restore"
                else "nothing removed"
            )
            raise SnapshotError(
                phase, f"{self.dir} is in use by a restore or delete of it: agent pid {who}; {then}"
            ) from None
        self.fd = fd

    def release(self) -> None:
        """Drop the lock; idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
