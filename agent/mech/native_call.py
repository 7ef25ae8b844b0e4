"""How the agent makes a driver call about another process: in that process's network
namespace (:func:`in_netns`) and within a deadline (:func:`with_deadline`, the run's
``driver_call_timeout_s``: :func:`call_deadline_s`). Both native backends use it
(agent/mech/native.py, agent/mech/native_cli.py).

Network namespaces: a driver call about a process in another network namespace than the agent
(a container, or a tree restored into a placement, agent/mech/placement.py) is made from a
short-lived thread that first joins that process's network namespace (``setns(2)`` on
``/proc/PID/ns/net``; a thread's network namespace is its own, namespaces(7)). fakecuda's
controller reaches the target through the abstract Unix socket ``\\0fakecuda-<pid>``, and abstract
socket names belong to a network namespace (unix(7)); the real driver's calls are made the same
way.

The options: :func:`using` sets the driver options (agent/options.py ``DriverOptions``) of the
run in this thread; :func:`current` reads them (the defaults outside a run).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
import threading
from typing import Callable, Optional, TypeVar

from cuinterpose.agent.errors import NativeError
from cuinterpose.agent.mech import libc, procfs
from cuinterpose.agent.options import DriverOptions

_T = TypeVar("_T")
_setns = None


def _netns_of(pid: int) -> Optional[tuple[int, int]]:
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _setns_error(pid: int, reason: str) -> NativeError:
    e = NativeError("setns", pid, reason)
    e.reason = reason
    e.args = (f"{e.phase}: pid {pid} {reason}",)
    return e


def in_netns(pid: int, fn: Callable[[], _T]) -> _T:
    """``fn()`` run in the network namespace of process ``pid``: directly when it is this
    thread's (or ``pid``'s cannot be read: the call then fails on its own, e.g. a process that
    is gone), else in a new thread that ``setns(2)``s into ``/proc/PID/ns/net`` first and
    exits afterwards (so no thread of the agent stays in it). ``fn``'s exception is re-raised
    here; a namespace that cannot be joined raises ``NativeError`` (action "setns")."""
    global _setns
    target = _netns_of(pid)
    if target is None or target == _netns_of("thread-self"):
        return fn()
    if _setns is None:
        _setns = libc.fn("setns")
    box: dict = {}

    def run():
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            box["exc"] = _setns_error(pid, f"cannot open /proc/{pid}/ns/net: {e.strerror or e}")
            return
        try:
            if _setns(fd, libc.CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                box["exc"] = _setns_error(
                    pid, f"cannot join its network namespace (setns): {os.strerror(err)}"
                )
                return
        finally:
            os.close(fd)
        try:
            box["ret"] = fn()
        except BaseException as e:  # handed to the caller
            box["exc"] = e

    t = threading.Thread(target=run, name=f"cuinterpose-netns-{pid}", daemon=True)
    t.start()
    t.join()
    if "exc" in box:
        raise box["exc"]
    return box["ret"]


_options: contextvars.ContextVar[DriverOptions] = contextvars.ContextVar(
    "cuinterpose-driver-options"
)
_DEFAULTS = DriverOptions()


def current() -> DriverOptions:
    """The driver options of the run this thread is in (:func:`using`), else the defaults."""
    return _options.get(_DEFAULTS)


@contextlib.contextmanager
def using(opts: DriverOptions):
    """Within the block, this thread's driver calls take ``opts``' driver, native backend and
    call deadline (a checkpoint's or restore's options: the run sets them around its steps; a
    thread started inside gets the defaults unless it enters the block again)."""
    token = _options.set(opts)
    try:
        yield opts
    finally:
        _options.reset(token)


def call_deadline_s() -> float:
    """Seconds a driver call about another process may take before the agent gives up on it
    (the run's ``driver_call_timeout_s``, :func:`current`); a lock's own timeout is added."""
    return current().driver_call_timeout_s


def with_deadline(action: str, pid: int, fn: Callable[[], _T], deadline_s: Optional[float]) -> _T:
    """``fn()`` run in a worker thread that the caller waits for at most ``deadline_s``
    seconds (None: no deadline); past it, ``NativeError`` CUDA_ERROR_TIMEOUT naming the pid
    (the thread is left to finish on its own: a daemon thread). The wait is interruptible:
    SIGINT/SIGTERM handlers run in the caller meanwhile."""
    if deadline_s is None:
        return fn()
    box: dict = {}

    def run():
        try:
            box["ret"] = fn()
        except BaseException as e:  # handed to the caller
            box["exc"] = e

    t = threading.Thread(target=run, name=f"cuinterpose-driver-{pid}", daemon=True)
    t.start()
    t.join(deadline_s)
    if t.is_alive():
        st = _proc_state(pid)
        raise NativeError(
            action,
            pid,
            f"CUDA_ERROR_TIMEOUT (no answer from the driver within {deadline_s:g} s"
            + (f"; the process is in state {st}" if st else "")
            + "; a stopped process: `kill -CONT` it, or `cuinterpose-agent release`)",
        )
    if "exc" in box:
        raise box["exc"]
    return box["ret"]


def _proc_state(pid: int) -> Optional[str]:
    try:
        return procfs.stat_fields(pid)[1][procfs.STAT_STATE]
    except (OSError, ValueError, IndexError):
        return None
