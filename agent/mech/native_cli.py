"""The ``cuda-checkpoint`` CLI backend of native checkpoint (agent/mech/native.py ``Backend``).

Each hook runs NVIDIA's ``cuda-checkpoint`` utility (or fakecuda's, fakecuda/tools) once per
pid, the way CRIU's cuda plugin does (criu plugins/cuda/cuda_plugin.c):

- ``cuda-checkpoint --get-state --pid P``: prints ``running``, ``locked``, ``checkpointed`` or
  ``failed`` on stdout (NVIDIA/cuda-checkpoint README "--get-state"; the plugin parses those
  words), exit status 0;
- ``cuda-checkpoint --action lock --pid P --timeout MS`` (``--timeout`` in ms, lock only:
  README "Options");
- ``cuda-checkpoint --action checkpoint|unlock --pid P``;
- ``cuda-checkpoint --action restore --pid P [--device-map OLD=NEW,...]`` (GPU UUIDs, every
  checkpointed GPU listed; r580+, cuda-checkpoint issues #18 and #46).

Exit status 0 is success; anything else is a failure. NVIDIA's utility (and fakecuda's) then
prints ``Could not <operation> on process ID <pid>: "<cuGetErrorString text>"`` (or ``Error
initializing CUDA: "<text>"``) and exits with the CUresult as its status, of which the kernel
keeps the low 8 bits (criu PR #2540; NVIDIA/cuda-checkpoint #35, #47): the CUresult is read back
from the status (:func:`result_of_status`). An output that names the CUresult
(``CUDA_ERROR_...``) is taken as it is. It becomes the ``NativeError`` result, so the hints of
``errors.NATIVE_HINTS`` apply as for the driver API. Each run has the driver-call
deadline (``native.call_deadline_s()``; a lock its timeout plus that): past it the utility is
killed and the call fails CUDA_ERROR_TIMEOUT. The utility runs with ``LD_PRELOAD`` removed
(never under the shim), in the network namespace of the target (fakecuda's controller reaches
it through an abstract socket, which belongs to a network namespace: unix(7)).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Optional, Sequence

from cuinterpose.agent.errors import AgentError, NativeError

#: an explicit ``cuda-checkpoint`` to use (absolute path)
CLI_ENV = "CUINTERPOSE_CUDA_CHECKPOINT"
CLI_NAME = "cuda-checkpoint"
#: the CLI's state words (README "--get-state") -> our state names
STATES = {
    "running": "RUNNING",
    "locked": "LOCKED",
    "checkpointed": "CHECKPOINTED",
    "failed": "FAILED",
    "checkpointing": "CHECKPOINTING",  # custom storage in progress (cuda.h 13.4+)
    "restoring": "RESTORING",
}
_RESULT = re.compile(r"\bCUDA_(?:SUCCESS|ERROR_[A-Z0-9_]+)\b")
#: the refusal line of the utility: `Could not lock on process ID 42: "device not ready"`
_REFUSAL = re.compile(r'^(?:Could not .+ on process ID \d+|Error initializing CUDA): "(.*)"$', re.M)
#: where two CUresults share an exit status, the one the checkpoint functions return (cuda.h
#: "Checkpointing": 401 and 913 both exit 145, 400 and 912 both 144, 201 and 713 both 201)
_CHECKPOINT_RESULTS = frozenset(
    {
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_OUT_OF_MEMORY",
        "CUDA_ERROR_NOT_INITIALIZED",
        "CUDA_ERROR_NO_DEVICE",
        "CUDA_ERROR_INVALID_DEVICE",
        "CUDA_ERROR_INVALID_CONTEXT",
        "CUDA_ERROR_INVALID_HANDLE",
        "CUDA_ERROR_ILLEGAL_STATE",
        "CUDA_ERROR_NOT_FOUND",
        "CUDA_ERROR_NOT_READY",
        "CUDA_ERROR_OPERATING_SYSTEM",
        "CUDA_ERROR_NOT_PERMITTED",
        "CUDA_ERROR_NOT_SUPPORTED",
        "CUDA_ERROR_TIMEOUT",
        "CUDA_ERROR_UNKNOWN",
    }
)


def result_of_status(status: int) -> str:
    """The CUresult name behind the utility's exit status ``status`` (1-255: the CUresult's low
    8 bits). Ambiguous statuses resolve to the checkpoint functions' result; a status no CUresult
    ends in is ``"exit status N"``."""
    from cuda.bindings import driver  # the enum only: libcuda is not loaded

    names = [r.name for r in driver.CUresult if r.value and (r.value & 0xFF) == status]
    if len(names) > 1:
        names = [n for n in names if n in _CHECKPOINT_RESULTS] or names
    return " or ".join(names) if names else f"exit status {status}"


def fake_cli() -> Optional[str]:
    """fakecuda's ``cuda-checkpoint`` (``<fakecuda dir>/bin/cuda-checkpoint``), or None."""
    from cuinterpose.agent import paths

    try:
        p = paths.fakecuda_dir() / "bin" / CLI_NAME
    except FileNotFoundError:
        return None
    return str(p) if os.access(p, os.X_OK) else None


def find(fake: bool = False) -> tuple[Optional[str], str]:
    """(path, how it was found) of the ``cuda-checkpoint`` to run: ``$CUINTERPOSE_CUDA_CHECKPOINT``
    (must be executable), else fakecuda's own when ``fake`` (the driver is fakecuda: the real
    utility would talk to the real driver), else the first on ``$PATH``. (None, why not) when
    there is none."""
    env = os.environ.get(CLI_ENV)
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env, f"${CLI_ENV}={env}"
        return None, f"${CLI_ENV}={env} is not an executable file"
    if fake:
        p = fake_cli()
        if p:
            return p, f"fakecuda's {p}"
        return None, "fakecuda's cuda-checkpoint is not built (run `make build`)"
    p = shutil.which(CLI_NAME)
    if p:
        return p, f"{p} on $PATH"
    return None, "no cuda-checkpoint on $PATH"


def argv(cli: str, action: str, pid: int, **kw) -> list[str]:
    """The command line for one hook: ``action`` "get_state" | "lock" (``timeout_ms``) |
    "checkpoint" | "restore" (``gpu_pairs``: (old, new) UUID strings) | "unlock"."""
    if action == "get_state":
        return [cli, "--get-state", "--pid", str(pid)]
    out = [cli, "--action", action, "--pid", str(pid)]
    if action == "lock":
        out += ["--timeout", str(int(kw["timeout_ms"]))]
    pairs = kw.get("gpu_pairs") or ()
    if action == "restore" and pairs:
        out += ["--device-map", ",".join(f"{o}={n}" for o, n in pairs)]
    return out


def _env() -> dict:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # the utility itself never runs under the shim
    return env


def _error(action: str, pid: int, cmd: list[str], result: str) -> NativeError:
    """``NativeError`` whose reason names the command instead of the driver function."""
    e = NativeError(action, pid, result)
    fn = "cuCheckpointProcess" + {"get_state": "GetState"}.get(action, action.capitalize())
    shown = " ".join(cmd[1:3]) if action != "get_state" else "--get-state"
    e.reason = e.reason.replace(fn, f"cuda-checkpoint {shown}", 1)
    e.args = (f"{e.phase}: pid {pid} {e.reason}",)
    return e


def uuid_bytes(uuid: str) -> bytes:
    """The 16 bytes of a GPU UUID written as ``nvidia-smi -L`` and ``cuda-checkpoint
    --device-map`` write it (``"GPU-"`` then 32 hex digits in groups 8-4-4-4-12; the prefix
    and the dashes are optional here). Raises ``AgentError`` (phase "native restore") for
    anything else."""
    t = uuid.strip()
    hexd = (t[4:] if t.upper().startswith("GPU-") else t).replace("-", "")
    try:
        b = bytes.fromhex(hexd)
    except ValueError:
        b = b""
    if len(b) != 16:
        raise AgentError(
            "native restore", f"{uuid!r} is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-...)"
        )
    return b


def run(cmd: list[str], action: str, pid: int, deadline_s: float, in_netns=None) -> str:
    """Run ``cmd`` for ``pid`` within ``deadline_s`` seconds (through ``in_netns(pid, fn)``
    when given: native.in_netns); returns its stdout. Raises ``NativeError``:
    CUDA_ERROR_TIMEOUT past the deadline (the utility is killed), the CUresult its output
    names on a non-zero exit status, else the status and its last line."""

    def go():
        return subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=_env(),
            timeout=deadline_s,
            check=False,
        )

    try:
        res = in_netns(pid, go) if in_netns else go()
    except subprocess.TimeoutExpired:
        raise _error(
            action,
            pid,
            cmd,
            f"CUDA_ERROR_TIMEOUT (cuda-checkpoint gave no answer within {deadline_s:g} s and "
            "was killed; a stopped process: `kill -CONT` it, or `cuinterpose-agent release`)",
        ) from None
    except OSError as e:
        raise _error(action, pid, cmd, f"cannot run {cmd[0]}: {e.strerror or e}") from None
    if res.returncode == 0:
        return res.stdout
    text = (res.stdout + "\n" + res.stderr).strip()
    m = _RESULT.search(text)
    if m and m.group(0) != "CUDA_SUCCESS":
        raise _error(action, pid, cmd, m.group(0))
    said = _REFUSAL.search(text)
    if said and 0 < res.returncode < 256:
        raise _error(action, pid, cmd, result_of_status(res.returncode))
    last = text.splitlines()[-1] if text else "no output"
    how = (
        f"killed by signal {-res.returncode}"
        if res.returncode < 0
        else f"exit status {res.returncode}"
    )
    raise _error(action, pid, cmd, f"{how}: {last}")


def hooks(cli: str, deadline_s, in_netns=None) -> dict:
    """The hooks of ``native.Backend`` that run ``cli`` (an executable path): get_state, lock,
    checkpoint, restore, unlock. ``deadline_s()`` gives the driver-call deadline in seconds
    (native.call_deadline_s)."""

    def get_state(pid: int) -> str:
        cmd = argv(cli, "get_state", pid)
        out = run(cmd, "get_state", pid, deadline_s(), in_netns)
        word = out.strip().split()[0].lower() if out.strip() else ""
        if word not in STATES:
            raise _error("get_state", pid, cmd, f"unexpected output {out.strip()!r}")
        return STATES[word]

    def lock(pid: int, timeout_ms: int) -> None:
        # as the driver API backend: "no timeout" is the call deadline, handed to the utility
        ms = int(timeout_ms) or int(deadline_s() * 1000)
        run(argv(cli, "lock", pid, timeout_ms=ms), "lock", pid, ms / 1000 + deadline_s(), in_netns)

    def simple(action):
        def fn(pid: int) -> None:
            run(argv(cli, action, pid), action, pid, deadline_s(), in_netns)

        return fn

    def restore(pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        for o, n in gpu_pairs:  # refused here, before the utility runs
            uuid_bytes(o)
            uuid_bytes(n)
        cmd = argv(cli, "restore", pid, gpu_pairs=tuple(gpu_pairs))
        run(cmd, "restore", pid, deadline_s(), in_netns)

    return {
        "get_state": get_state,
        "lock": lock,
        "checkpoint": simple("checkpoint"),
        "restore": restore,
        "unlock": simple("unlock"),
    }
