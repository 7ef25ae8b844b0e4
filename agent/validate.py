"""Validation of what a request works on (its pids and paths) before anything happens (case
013), shared by the CLI and the gRPC service (a request's options are checked by
agent/options.py): each refusal is an ``AgentError`` (phase "request", outcome "refused",
exit 3) naming the field and the allowed range, never a Python error text from deep inside a
phase (``Invalid value NaN``, ``timestamp out of range``, ``[Errno 36] File name too long``).
"""

from __future__ import annotations

import math
import os
from typing import Optional

from cuinterpose.agent.errors import AgentError

#: the longest timeout a request may ask for, in seconds (one day)
MAX_TIMEOUT_S = 86400.0
#: Linux's PATH_MAX (with its NUL) and NAME_MAX (limits.h)
PATH_MAX = 4096
NAME_MAX = 255


def refuse(field: str, why: str) -> AgentError:
    return AgentError("request", f"{field} {why}")


def seconds(field: str, value, *, allow_zero: bool = False) -> None:
    """A timeout in seconds: a finite number in (0, MAX_TIMEOUT_S] ([0, ...] with
    ``allow_zero``)."""
    lo = "0" if allow_zero else "more than 0"
    rng = f"must be a finite number of seconds, {lo} and at most {MAX_TIMEOUT_S:g}"
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise refuse(field, f"{value!r} is not a number: {rng}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero) or v > MAX_TIMEOUT_S:
        raise refuse(field, f"{value!r} is out of range: {rng}")


def milliseconds(field: str, value, *, allow_zero: bool = False) -> None:
    """A timeout in milliseconds: an integer in [1, MAX_TIMEOUT_S * 1000] ([0, ...] with
    ``allow_zero``: 0 = no timeout of its own: the driver-call deadline applies)."""
    hi = int(MAX_TIMEOUT_S * 1000)
    lo = 0 if allow_zero else 1
    rng = f"must be an integer from {lo} to {hi} (milliseconds{'; 0 = the driver-call deadline' if lo == 0 else ''})"
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise refuse(field, f"{value!r} is out of range: {rng}")


def path(field: str, value: Optional[str]) -> None:
    """A path: under PATH_MAX bytes in all, each component at most NAME_MAX bytes, no NUL."""
    if not value:
        return
    b = os.fsencode(os.path.abspath(value))
    if b"\0" in b:
        raise refuse(field, "contains a NUL byte")
    if len(b) >= PATH_MAX:
        raise refuse(
            field, f"is {len(b)} bytes long (absolute): the limit is {PATH_MAX - 1} (PATH_MAX)"
        )
    for part in b.split(b"/"):
        if len(part) > NAME_MAX:
            raise refuse(
                field,
                f"has a component of {len(part)} bytes ({os.fsdecode(part[:24])}…): the limit "
                f"is {NAME_MAX} (NAME_MAX)",
            )


def pids(field: str, values) -> None:
    """Process ids: integers from 1 to 2^22 (the kernel's PID_MAX_LIMIT)."""
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 4194304:
            raise refuse(field, f"{v!r} is not a process id (an integer from 1 to 4194304)")


def checkpoint_request(*, roots=(), images_dir: Optional[str] = None) -> None:
    """Validate what a checkpoint works on (its options are checked when they are built,
    agent/options.py); raises ``AgentError``."""
    pids("pid", list(roots))
    path("images_dir", images_dir)


def restore_request(*, images_dir=None, placement=None, device_map=None) -> None:
    """Validate what a restore works on and into (its options are checked when they are
    built, agent/options.py); raises ``AgentError``."""
    path("images_dir", images_dir)
    if placement:
        pids("into_pid", [placement])
        from cuinterpose.agent.mech.census_checks import check_process_id

        check_process_id(int(placement), "placement")


def inspect_request(*, pid) -> None:
    """Validate the process an inspect asks about; raises ``AgentError``."""
    pids("pid", [pid])
