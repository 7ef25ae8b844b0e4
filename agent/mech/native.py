"""Native CUDA checkpoint (``cuCheckpointProcess*``) through ``cuda.bindings.driver``.

The agent is an *external controller*: it calls ``cuInit(0)`` in its own process, then acts on
other processes by pid. Which ``libcuda.so.1`` the bindings use is decided by :func:`load`:

- ``"real"`` (default): whatever ``libcuda.so.1`` the dynamic loader finds.
- ``"fake"`` (``CUINTERPOSE_DRIVER=fake`` or ``--driver fake``): fakecuda, preloaded with
  ``ctypes.CDLL(path, RTLD_GLOBAL)`` *before* the bindings' first call. Changing
  ``LD_LIBRARY_PATH`` after process start would not work: the loader reads it once. The
  bindings then ``dlopen("libcuda.so.1")``, which returns the already-loaded object with that
  soname; :func:`load` verifies this in ``/proc/self/maps`` and refuses otherwise.

Ordering: :func:`lock_all` locks **every** process before
:func:`checkpoint_all` checkpoints any (locking one rank while its peers still spin can
deadlock). Restore is :func:`restore_all` then :func:`unlock_all`. :func:`rollback_all` brings
each process back to RUNNING from whatever state a failed checkpoint left it in.

Every failure raises :class:`~cuinterpose.agent.errors.NativeError` naming the pid, the driver
function and the CUresult name.

Backends: :func:`lock`, :func:`checkpoint`, :func:`restore`, :func:`unlock` and
:func:`get_state` go through one table of hook functions, :class:`Backend` (as CRIU's cuda
plugin has one), chosen once per process by :func:`backend` from ``--native-backend`` /
``$CUINTERPOSE_NATIVE_BACKEND``: ``driver-api`` (the ``cuCheckpointProcess*`` calls below),
``cuda-checkpoint`` (NVIDIA's CLI, or fakecuda's, run per pid: agent/mech/native_cli.py) or
``auto`` (the default: the driver API when the loaded ``libcuda.so.1`` exports every
``cuCheckpointProcess*`` entry point, else a ``cuda-checkpoint`` found by
:func:`native_cli.find`, else ``AgentError`` phase "native backend").

A driver call about another process is made in that process's network namespace and within
the run's driver-call deadline (agent/mech/native_call.py). Which driver, backend and deadline:
the run's options (agent/options.py ``DriverOptions``), set around its steps by
:func:`~cuinterpose.agent.mech.native_call.using`; this module never reads the environment.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import time
from typing import Callable, Iterable, Optional, Sequence

from cuinterpose.agent import paths
from cuinterpose.agent.errors import AgentError, NativeError
from cuinterpose.agent.mech import native_cli, native_storage, procfs, signal_at
from cuinterpose.agent.mech.native_call import (  # noqa: F401 (the native API's own names)
    call_deadline_s,
    current,
    in_netns,
    using,
    with_deadline,
)
from cuinterpose.agent.options import DRIVERS as DRIVER_KINDS
from cuinterpose.agent.options import NATIVE_BACKENDS as BACKEND_KINDS


@dataclasses.dataclass(frozen=True)
class DriverInfo:
    """The driver the agent talks to: ``kind`` ("real"|"fake"), ``version`` (``cuDriverGetVersion``,
    e.g. 13000), ``library`` (absolute path of the mapped ``libcuda.so.1``)."""

    kind: str
    version: int
    library: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_info: Optional[DriverInfo] = None


def loaded_info() -> Optional[DriverInfo]:
    """The driver :func:`load` loaded in this process (None: none yet; unlike :func:`info`,
    loads nothing)."""
    return _info


_driver = None


def driver_kind(kind: Optional[str] = None) -> str:
    """Resolve the driver kind: ``kind`` if given, else the run's ``driver`` option
    (:func:`current`), else "real". Raises ``AgentError`` for an unknown kind."""
    k = (kind or current().driver or "real").strip().lower()
    if k not in DRIVER_KINDS:
        raise AgentError("driver", f"unknown driver kind {k!r} (expected one of {DRIVER_KINDS})")
    return k


def _mapped_libcuda() -> list[tuple[str, int, int]]:
    """(path, dev, inode) of every file named libcuda.so* mapped into this process."""
    seen = []
    for entry in procfs.maps("self"):
        if os.path.basename(entry[0]).startswith("libcuda.so") and entry not in seen:
            seen.append(entry)
    return seen


def result_name(err) -> str:
    """CUresult name (``"CUDA_SUCCESS"``, ``"CUDA_ERROR_NOT_READY"``) or the integer as text."""
    name = getattr(err, "name", None)
    return name if name else str(int(err))


def load(kind: Optional[str] = None) -> DriverInfo:
    """Load the driver once per process and ``cuInit(0)`` it; later calls return the same
    :class:`DriverInfo` (asking for a different kind afterwards raises ``AgentError``).

    Raises ``AgentError`` (phase "driver") when the library cannot be loaded, the bindings resolve
    to a different ``libcuda.so.1`` than requested, or ``cuInit`` fails."""
    global _info, _driver
    k = driver_kind(kind)
    if _info is not None:
        if _info.kind != k:
            raise AgentError(
                "driver",
                f"driver already loaded as {_info.kind!r} "
                f"({_info.library}); cannot switch to {k!r} in one process",
            )
        return _info
    fake_lib = None
    if k == "fake":
        fake_lib = paths.fakecuda_dir() / paths.FAKECUDA_NAME
        if any(
            p for p, _, _ in _mapped_libcuda() if os.path.realpath(p) != str(fake_lib.resolve())
        ):
            raise AgentError(
                "driver",
                "another libcuda.so.1 is already loaded in this process; "
                f"cannot switch to fakecuda {fake_lib}",
            )
        try:
            ctypes.CDLL(str(fake_lib), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        except OSError as e:
            raise AgentError("driver", f"cannot load fakecuda {fake_lib}: {e}") from None
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - dependency missing
        raise AgentError("driver", f"cuda.bindings is not importable: {e}") from None
    try:
        (err,) = driver.cuInit(0)
    except RuntimeError as e:  # the bindings could not dlopen libcuda.so.1
        hint = (
            " (no NVIDIA driver on this machine? --driver fake uses fakecuda)"
            if k == "real"
            else ""
        )
        raise AgentError(
            "driver", f"cuda.bindings could not load libcuda.so.1: {e}{hint}"
        ) from None
    except KeyError as e:
        raise AgentError("driver", f"cuInit returned a CUresult outside the enum: {e}") from None
    mapped = _mapped_libcuda()
    if fake_lib is not None:
        want = os.stat(fake_lib)
        others = [p for p, dev, ino in mapped if (dev, ino) != (want.st_dev, want.st_ino)]
        if others or not mapped:
            raise AgentError(
                "driver",
                f"cuda.bindings resolved libcuda.so.1 to {others or 'nothing'}, "
                f"not fakecuda {fake_lib}",
            )
        library = str(fake_lib.resolve())
    else:
        library = mapped[0][0] if mapped else "libcuda.so.1"
        fake_dir = None
        try:
            fake_dir = paths.fakecuda_dir().resolve()
        except FileNotFoundError:
            pass
        if fake_dir is not None and any(
            pathlib.Path(p).resolve().parent == fake_dir for p, _, _ in mapped
        ):
            raise AgentError(
                "driver",
                f"real driver requested but fakecuda {library} is loaded "
                f"(LD_LIBRARY_PATH?); pass --driver fake or fix the environment",
            )
    if int(err) != 0:
        raise AgentError("driver", f"cuInit(0) on {library}: {result_name(err)}")
    err, version = driver.cuDriverGetVersion()
    if int(err) != 0:
        raise AgentError("driver", f"cuDriverGetVersion on {library}: {result_name(err)}")
    _driver = driver
    _info = DriverInfo(kind=k, version=int(version), library=library)
    return _info


def info() -> DriverInfo:
    """The loaded driver (loads the default kind if none is loaded yet)."""
    return _info if _info is not None else load()


def _call(action: str, pid: int, *args, deadline_s: Optional[float] = -1.0):
    drv = _driver if _driver is not None else (load() and _driver)
    fn = getattr(
        drv, "cuCheckpointProcess" + {"get_state": "GetState"}.get(action, action.capitalize())
    )
    if deadline_s is not None and deadline_s < 0:
        deadline_s = call_deadline_s()
    try:
        res = with_deadline(action, pid, lambda: in_netns(pid, lambda: fn(pid, *args)), deadline_s)
    except KeyError as e:  # CUresult outside the enum
        raise NativeError(action, pid, f"CUresult {e} (outside the enum)") from None
    err = res[0]
    if int(err) != 0:
        raise NativeError(action, pid, result_name(err))
    return res[1] if len(res) > 1 else None


def _api_get_state(pid: int) -> str:
    st = _call("get_state", pid)
    name = getattr(st, "name", None) or str(int(st))
    return name.replace("CU_PROCESS_STATE_", "")


def _api_lock(pid: int, timeout_ms: int) -> None:
    args = _driver.CUcheckpointLockArgs()
    ms = int(timeout_ms) or int(call_deadline_s() * 1000)
    args.timeoutMs = ms
    # the driver's own timeout bounds the lock; ours comes after it
    _call("lock", pid, args, deadline_s=ms / 1000 + call_deadline_s())


def _api_checkpoint(pid: int) -> None:
    if native_storage.wants_checkpoint(pid):  # custom storage (agent/mech/native_storage.py)
        native_storage.checkpoint(_driver, pid, _call, lambda: _driver.CUcheckpointRestoreArgs())
        return
    _call("checkpoint", pid, None)


def _restore_args(gpu_pairs: Sequence[tuple[str, str]]):
    """``CUcheckpointRestoreArgs`` with ``gpuPairs`` (``CUcheckpointGpuPair{oldUuid,
    newUuid}``, cuda.h 13.0) for ``gpu_pairs``; None when there are none."""
    if not gpu_pairs:
        return None
    pairs = []
    for old, new in gpu_pairs:
        p = _driver.CUcheckpointGpuPair()
        # CUuuid.bytes is read-only in the bindings: write the 32 bytes of the struct
        ctypes.memmove(p.getPtr(), native_cli.uuid_bytes(old) + native_cli.uuid_bytes(new), 32)
        pairs.append(p)
    args = _driver.CUcheckpointRestoreArgs()
    args.gpuPairs = pairs
    args.gpuPairsCount = len(pairs)
    return args


def _api_restore(pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
    if native_storage.wants_restore(pid):  # its GPU memory is in chunk files
        args = _restore_args(gpu_pairs) or _driver.CUcheckpointRestoreArgs()
        native_storage.restore(_driver, pid, _call, args)
        return
    _call("restore", pid, _restore_args(gpu_pairs))


def _api_unlock(pid: int) -> None:
    _call("unlock", pid, None)


API_SYMBOLS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One native-checkpoint backend: ``name`` ("driver-api"|"cuda-checkpoint"), ``why`` (one
    sentence: why it was chosen), ``detail`` (the library or the CLI's path) and its hooks,
    each raising ``NativeError`` naming the pid: ``get_state(pid) -> str``, ``lock(pid,
    timeout_ms)``, ``checkpoint(pid)``, ``restore(pid, gpu_pairs)``, ``unlock(pid)``."""

    name: str
    why: str
    detail: str
    get_state: Callable[[int], str]
    lock: Callable[[int, int], None]
    checkpoint: Callable[[int], None]
    restore: Callable[[int, Sequence[tuple[str, str]]], None]
    unlock: Callable[[int], None]

    def to_dict(self) -> dict:
        return {"name": self.name, "why": self.why, "detail": self.detail}


def _api_backend(why: str, detail: str) -> Backend:
    return Backend(
        "driver-api",
        why,
        detail,
        _api_get_state,
        _api_lock,
        _api_checkpoint,
        _api_restore,
        _api_unlock,
    )


def backend_kind(kind: Optional[str] = None) -> str:
    """``kind`` if given, else the run's ``native_backend`` option (:func:`current`). Raises
    ``AgentError`` (phase "native backend") for an unknown kind."""
    k = (kind or current().native_backend).strip().lower()
    if k not in BACKEND_KINDS:
        raise AgentError(
            "native backend", f"unknown native backend {k!r} (expected one of {BACKEND_KINDS})"
        )
    return k


def missing_api_symbols(library: str) -> list[str]:
    """The :data:`API_SYMBOLS` that ``library`` (a loaded ``libcuda.so.1``) does not export
    (``dlsym``); all of them when it cannot be opened."""
    try:
        lib = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        try:
            lib = ctypes.CDLL(library)
        except OSError:
            return list(API_SYMBOLS)
    return [s for s in API_SYMBOLS if not hasattr(lib, s)]


_backends: dict[str, Backend] = {}


def choose(kind: Optional[str] = None) -> Backend:
    """Pick the backend for ``kind`` (see :func:`backend_kind`) without caching it.

    ``driver-api`` loads the driver (:func:`load`); ``cuda-checkpoint`` finds the CLI
    (:func:`native_cli.find`); ``auto`` takes the driver API when the loaded library exports
    every :data:`API_SYMBOLS` entry, else the CLI. Raises ``AgentError`` (phase "native
    backend") naming what is missing and what to do."""
    k = backend_kind(kind)
    if k == "cuda-checkpoint":
        path, how = native_cli.find(_fake())
        if path is None:
            raise AgentError("native backend", f"--native-backend cuda-checkpoint: {how}")
        return _cli_backend(path, f"--native-backend cuda-checkpoint ({how})")
    why_not = ""
    if _info is None and _driver is not None:  # bindings loaded without load(): tests
        return _api_backend(f"--native-backend {k} (cuda.bindings already loaded)", "")
    try:
        inf = info()
    except AgentError as e:
        if k == "driver-api":
            raise
        why_not = f"the driver did not load ({e.reason})"
    else:
        missing = missing_api_symbols(inf.library)
        if not missing:
            why = (
                f"auto: {inf.library} exports cuCheckpointProcess*"
                if k == "auto"
                else f"--native-backend driver-api ({inf.library})"
            )
            return _api_backend(why, f"{inf.kind} driver {inf.version} at {inf.library}")
        why_not = f"{inf.library} lacks {', '.join(missing)}"
        if k == "driver-api":
            raise AgentError(
                "native backend",
                f"--native-backend driver-api: {why_not} (a driver older than r570?); "
                "use --native-backend cuda-checkpoint",
            )
    path, how = native_cli.find(_fake())
    if path is None:
        raise AgentError(
            "native backend",
            f"no native checkpoint backend: {why_not}, and {how}; install NVIDIA's "
            "cuda-checkpoint (or point $CUINTERPOSE_CUDA_CHECKPOINT at it)",
        )
    return _cli_backend(path, f"auto: {why_not}; using {how}")


def _fake() -> bool:
    try:
        return (_info.kind if _info is not None else driver_kind()) == "fake"
    except AgentError:
        return False


def _cli_backend(path: str, why: str) -> Backend:
    return Backend(
        "cuda-checkpoint", why, path, **native_cli.hooks(path, call_deadline_s, in_netns)
    )


def backend(kind: Optional[str] = None) -> Backend:
    """The backend of this process for ``kind`` (else the run's ``native_backend``): chosen
    once by :func:`choose` once the driver is loaded, then kept (one choice per kind)."""
    k = backend_kind(kind)
    b = _backends.get(k)
    if b is None:
        b = choose(k)
        if _info is not None:  # decided with the driver loaded: keep it
            _backends[k] = b
    return b


def get_state(pid: int) -> str:
    """The checkpoint state of ``pid`` as a name: "RUNNING", "LOCKED", "CHECKPOINTED",
    "FAILED" (``CU_PROCESS_STATE_`` stripped; the CLI's lower-case word upper-cased). Raises
    ``NativeError`` (e.g. for a process that never initialised CUDA)."""
    return backend().get_state(pid)


def lock(pid: int, timeout_ms: int) -> None:
    """RUNNING -> LOCKED within ``timeout_ms`` (the driver's ``CUcheckpointLockArgs.timeoutMs``,
    the CLI's ``--timeout``; NOT_READY/TIMEOUT on timeout, the process stays RUNNING).
    ``timeout_ms`` = 0 (the CLI's "none") does not wait forever: the driver gets the
    driver-call deadline (:func:`call_deadline_s`) as its timeout, so that the driver itself
    gives up and no lock completes after the agent stopped waiting (a lock that did would
    leave the process LOCKED behind a rollback). The agent waits for the call at most that
    timeout plus :func:`call_deadline_s`, then raises ``NativeError`` CUDA_ERROR_TIMEOUT."""
    backend().lock(pid, timeout_ms)


def checkpoint(pid: int) -> None:
    """LOCKED -> CHECKPOINTED (device memory moves to driver-owned host memory)."""
    backend().checkpoint(pid)


def restore(pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
    """CHECKPOINTED -> LOCKED (mappings come back at their original VAs). ``gpu_pairs``:
    (old UUID, new UUID) as ``"GPU-xxxxxxxx-..."`` strings, every checkpointed GPU listed
    (driver API: ``CUcheckpointRestoreArgs.gpuPairs``; CLI: ``--device-map OLD=NEW,...``);
    empty: the GPUs it had. A process checkpointed to custom storage is restored from its
    streams through the driver API whatever the backend (agent/mech/native_storage.py)."""
    if native_storage.wants_restore(pid):
        return _api_restore(pid, tuple(gpu_pairs))
    backend().restore(pid, tuple(gpu_pairs))


def unlock(pid: int) -> None:
    """LOCKED -> RUNNING."""
    backend().unlock(pid)


def _each(action, pids: Iterable[int], fn, phase: str) -> dict[int, int]:
    """Apply ``fn`` to every pid in order; returns {pid: elapsed_ns}. Re-raises the first
    NativeError with ``phase`` set."""
    out = {}
    for pid in pids:
        t0 = time.monotonic_ns()
        try:
            fn(pid)
        except NativeError as e:
            e.phase = phase
            e.args = (f"{phase}: pid {pid} {e.reason}",)
            raise
        out[pid] = time.monotonic_ns() - t0
        signal_at.signal_point("during")  # test only: the first call was issued
    return out


def lock_all(pids: Iterable[int], timeout_ms: int) -> dict[int, int]:
    """Lock every pid (in order) with ``timeout_ms`` each; returns {pid: elapsed_ns}.
    If one fails, the ones already locked are unlocked again (:func:`unlock_each`) and the
    ``NativeError`` for the failing pid is raised (phase "native lock") with ``left_locked``:
    the sorted pids whose unlock failed too (a process stopped meanwhile), which the driver
    still holds LOCKED."""
    pids = list(pids)
    locked = []
    try:
        out = {}
        for pid in pids:
            out.update(_each("lock", [pid], lambda p: lock(p, timeout_ms), "native lock"))
            locked.append(pid)
        return out
    except NativeError as e:
        e.left_locked = sorted(unlock_each(reversed(locked)))
        raise


def checkpoint_all(pids: Iterable[int]) -> dict[int, int]:
    """Checkpoint every pid (all must be LOCKED); returns {pid: elapsed_ns}. Raises the first
    ``NativeError`` (phase "native checkpoint"); use :func:`rollback_all` to undo."""
    return _each("checkpoint", pids, checkpoint, "native checkpoint")


def restore_all(pids: Iterable[int], gpu_pairs: Sequence[tuple[str, str]] = ()) -> dict[int, int]:
    """Native-restore every pid (CHECKPOINTED -> LOCKED) with ``gpu_pairs`` (see
    :func:`restore`); returns {pid: elapsed_ns}."""
    pairs = tuple(gpu_pairs)
    if not pairs:
        return _each("restore", pids, restore, "native restore")
    return _each("restore", pids, lambda p: restore(p, pairs), "native restore")


def unlock_all(pids: Iterable[int]) -> dict[int, int]:
    """Unlock every pid (LOCKED -> RUNNING); returns {pid: elapsed_ns}."""
    return _each("unlock", pids, unlock, "native unlock")


def unlock_each(pids: Iterable[int]) -> dict[int, NativeError]:
    """Unlock every pid (LOCKED -> RUNNING), each one tried even when another fails; returns
    {pid: its ``NativeError`` (phase "native unlock")} of those the driver still holds LOCKED,
    {} when every unlock succeeded (an unlock past its deadline, e.g. of a stopped process,
    is among them: the stopped process never saw it)."""
    failed: dict[int, NativeError] = {}
    for pid in pids:
        try:
            _each("unlock", [pid], unlock, "native unlock")
        except NativeError as e:
            failed[pid] = e
    return failed


def rollback_all(pids: Iterable[int]) -> dict[int, str]:
    """Bring every pid back to RUNNING from a failed checkpoint: CHECKPOINTED -> restore ->
    LOCKED -> unlock. Returns {pid: state it was found in}. Tries every pid, then raises the
    first ``NativeError`` (phase "rollback native") if any step failed."""
    found: dict[int, str] = {}
    first: Optional[NativeError] = None
    for pid in pids:
        try:
            st = get_state(pid)
            found[pid] = st
            if st == "CHECKPOINTED":
                restore(pid)
                st = "LOCKED"
            if st == "LOCKED":
                unlock(pid)
            elif st != "RUNNING":
                raise NativeError(
                    "get_state", pid, f"process is {st}, cannot bring it back to RUNNING"
                )
        except NativeError as e:
            e.phase = "rollback native"
            e.args = (f"rollback native: pid {pid} {e.reason}",)
            first = first or e
    if first is not None:
        raise first
    return found
