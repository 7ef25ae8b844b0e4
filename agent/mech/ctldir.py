"""Whether a control directory may be trusted (docs/workload-contract.md "The control
directory").

The agent runs as root and writes ``quiesce-*`` files into the control directory and connects to
the sockets in it, so whoever controls that directory controls what root writes and whom root
believes. A directory is trusted when it (and a symlink naming it) is owned by root or by the
agent's own uid and is not writable by group or other. :func:`check` raises ``AgentError``
with the reason otherwise; :func:`ensure` creates a missing one with mode 0700 first. Census
(checkpoint), ``inspect``, ``release`` and ``doctor`` call them before touching anything.
"""

from __future__ import annotations

import os
import stat

from cuinterpose.agent.errors import AgentError
from cuinterpose.coordinator.protocol import default_control_dir

__all__ = ["check", "ensure", "trusted_uids"]


def trusted_uids() -> tuple[int, ...]:
    """The owners a control directory may have: root and the agent's effective uid."""
    return tuple(dict.fromkeys((0, os.geteuid())))


def _owners() -> str:
    return " or ".join("root (uid 0)" if u == 0 else f"uid {u}" for u in trusted_uids())


def check(
    control_dir=None, *, phase: str = "control dir", pid=None, missing_ok=True, retry=None
) -> str:
    """The absolute path of ``control_dir`` (None: the default) when it is trusted (or missing,
    with ``missing_ok``: there is nothing in it to believe); raises ``AgentError`` (outcome
    refused, nothing was done) naming the directory, its owner or mode, and what to do, when it
    is not a directory, a symlink or directory owned by another uid, or writable by group or
    other. ``retry``: the second half of what to do (default: "or pass another
    --control-dir"; a restore, whose control dir the snapshot records, says "and run restore
    again")."""
    d = os.path.abspath(os.fspath(control_dir) if control_dir else default_control_dir())
    todo = f"; make it yours with `chown {os.geteuid()} {d} && chmod 0700 {d}` " + (
        retry or "or pass another --control-dir"
    )

    def refuse(why: str) -> AgentError:
        return AgentError(
            phase,
            f"control directory {d} {why}: it is not trusted (the agent writes its files and "
            f"believes the sockets in it); refused, nothing was done{todo}",
            pid=pid,
            outcome="refused",
        )

    try:
        lst = os.lstat(d)
    except FileNotFoundError:
        if missing_ok:
            return d
        raise refuse("does not exist") from None
    except OSError as e:
        raise refuse(f"cannot be read ({e.strerror or e})") from None
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in trusted_uids():
        raise refuse(f"is a symlink owned by uid {lst.st_uid}, not {_owners()}")
    try:
        st = os.stat(d)
    except OSError as e:
        raise refuse(f"cannot be read ({e.strerror or e})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise refuse("is not a directory")
    if st.st_uid not in trusted_uids():
        raise refuse(f"is owned by uid {st.st_uid}, not {_owners()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise refuse(f"has mode {stat.S_IMODE(st.st_mode):04o}: writable by group or other")
    return d


def ensure(control_dir=None, *, phase: str = "control dir", pid=None, retry=None) -> str:
    """:func:`check` after creating a missing ``control_dir`` (and missing parents) with mode
    0700 (exactly: the umask is not trusted to narrow it). Returns the absolute path; raises
    ``AgentError`` (refused) when it cannot be created or is not trusted."""
    d = os.path.abspath(os.fspath(control_dir) if control_dir else default_control_dir())
    if not os.path.lexists(d):
        try:
            os.makedirs(d, mode=0o700)
            os.chmod(d, 0o700)
        except FileExistsError:
            pass  # created meanwhile: check() judges whoever made it
        except OSError as e:
            raise AgentError(
                phase,
                f"cannot create control directory {d}: {e.strerror or e}",
                pid=pid,
                outcome="refused",
            ) from None
    return check(d, phase=phase, pid=pid, missing_ok=False, retry=retry)
