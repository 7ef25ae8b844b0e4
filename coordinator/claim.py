"""Claims: a mutating shim op only from the agent that holds the job's checkpoint (protocol.h
"Claims", docs/protocol.md, decisions D48).

:meth:`Claim.take` draws a 16-byte token (``secrets.token_bytes``) and writes
``<control dir>/cuinterpose-<pid>.claim`` for every participant pid: one line ``"<32 hex digits
of the token> <holder pid> <holder kind>\\n"``, mode 0600, created ``O_EXCL|O_NOFOLLOW`` beside
it and renamed into place (owned by the participant's effective uid when this process is root,
so that a shim of another uid can read it). A :class:`~cuinterpose.coordinator.barrier.Barrier`
given the claim (``claim=``, or :attr:`Barrier.claim` later) sends the token with every
mutating request; a shim refuses a mutating request whose token is not its file's
(``CUI_REFUSED_PEER``, nothing changed). INSPECT needs no claim. :meth:`Claim.drop` removes the
files that still hold the token (a file another holder took over is left alone).

A claim guards a job against a stray or buggy caller of the same uid (a script that runs
``Coordinator(...).capture()`` against a running job gets a refusal, and the job is
untouched), not against a hostile one: any process of that uid can read the file, or ptrace
the job.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from typing import Iterable, Optional

from .protocol import CLAIM_TOKEN_BYTES, claim_path

__all__ = ["Claim", "ClaimError", "read_claim"]


class ClaimError(Exception):
    """A claim that cannot be taken: ``pid`` (the participant), ``path`` (its claim file)."""

    def __init__(self, message: str, *, pid: int, path: str):
        super().__init__(message)
        self.pid = pid
        self.path = path


def read_claim(path: str | os.PathLike) -> Optional[tuple[bytes, int, str]]:
    """(token, holder pid, holder kind) of the claim file at ``path``; None when there is none
    or it cannot be read as one."""
    try:
        with open(path, "rb") as f:
            words = f.read(128).decode("ascii").split()
        return bytes.fromhex(words[0]), int(words[1]), words[2]
    except (OSError, UnicodeDecodeError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _euid_of(pid: int) -> Optional[int]:
    """The effective uid of ``pid`` (``/proc/PID/status`` ``Uid:``), None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except (OSError, IndexError, ValueError):
        pass
    return None


@dataclass
class Claim:
    """The claim of one holder (``kind``: "checkpoint", "restore", "release") on the shims of
    ``pids`` in ``control_dir``; ``token``: 16 bytes."""

    control_dir: str
    pids: list[int]
    token: bytes
    kind: str = "checkpoint"
    #: the files written, in pid order
    paths: list[str] = field(default_factory=list)

    @property
    def token_hex(self) -> str:
        return self.token.hex()

    @classmethod
    def take(
        cls,
        control_dir: str | os.PathLike,
        pids: Iterable[int],
        *,
        kind: str = "checkpoint",
        token: bytes | str | None = None,
    ) -> "Claim":
        """Write the claim file of every pid (``token``: a given one, bytes or hex, e.g. the
        token a dead agent's ``.lock`` recorded; else a new random one). A file whose holder
        is another live process with another token refuses (``ClaimError`` naming the pid, the
        file and its holder: two holders cannot drive one process); one of a holder that is
        gone is taken over. Any other failure removes what was written and raises
        ``ClaimError`` naming the file and the OS error."""
        if isinstance(token, str):
            token = bytes.fromhex(token)
        token = bytes(token) if token is not None else secrets.token_bytes(CLAIM_TOKEN_BYTES)
        if len(token) != CLAIM_TOKEN_BYTES:
            raise ValueError(f"a claim token is {CLAIM_TOKEN_BYTES} bytes, got {len(token)}")
        me = os.getpid()
        claim = cls(os.fspath(control_dir), [int(p) for p in pids], token, kind)
        try:
            for pid in claim.pids:
                path = claim_path(claim.control_dir, pid)
                old = read_claim(path)
                if old is not None and old[0] != token and old[1] != me and _alive(old[1]):
                    raise ClaimError(
                        f"pid {pid} is claimed by {old[2]} pid {old[1]} ({path}): another agent "
                        "holds this process's checkpoint; nothing was changed",
                        pid=pid,
                        path=path,
                    )
                claim._write(pid, path, me)
                claim.paths.append(path)
        except BaseException:
            claim.drop()
            raise
        return claim

    def _write(self, pid: int, path: str, me: int) -> None:
        line = f"{self.token_hex} {me} {self.kind}\n".encode()
        tmp = os.path.join(
            os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp"
        )
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, line)
                uid = _euid_of(pid) if os.geteuid() == 0 else None
                if uid:  # root writes it for a shim of another uid: that uid must read it
                    os.fchown(fd, uid, -1)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise ClaimError(
                f"pid {pid}: cannot write its claim file {path}: {e.strerror or e}; nothing was "
                "changed",
                pid=pid,
                path=path,
            ) from e

    def drop(self) -> None:
        """Remove every claim file that still holds this token (idempotent)."""
        for pid in self.pids:
            path = claim_path(self.control_dir, pid)
            old = read_claim(path)
            if old is not None and old[0] == self.token:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
