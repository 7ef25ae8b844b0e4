"""``cuinterpose-agent doctor``: is this node ready to checkpoint and restore?

Each check is ``{"name", "ok" (bool), "detail" (str)}``: CRIU version and ``criu check``, the
driver's checkpoint API through cuda.bindings (and its version), the shim's path and SHA-256,
fakecuda's path (when selected), the native-checkpoint backend that will be used and why
(``$CUINTERPOSE_NATIVE_BACKEND``: auto | driver-api | cuda-checkpoint; agent/mech/native.py
``choose``), the GPU storage a native checkpoint would use (custom storage where the driver
has it, else host staging, and why: ``$CUINTERPOSE_GPU_STORAGE``), and whether the control
directory is writable and short enough for ``DIR/cuinterpose-<pid_max>.sock`` to fit in a
Unix socket address (107 bytes).
"""

from __future__ import annotations

import os
import pathlib
import tempfile

from cuinterpose.agent.mech import ctldir

#: what a failing real driver check adds (also in native.load's "could not load" error)
NO_DRIVER_HINT = "no NVIDIA driver on this machine? --driver fake uses fakecuda"


def _check(name, fn) -> dict:
    try:
        detail = fn()
        return {"name": name, "ok": True, "detail": detail}
    except Exception as e:
        why = str(e)
        return {"name": name, "ok": False, "detail": why.removeprefix(f"{name}: ")}


def run_checks(opts=None) -> list[dict]:
    """Run every check with the options ``opts`` (agent/options.py ``CheckpointOptions``: the
    driver, native backend, GPU storage and control directory a checkpoint would use; default
    the defaults); never raises."""
    from cuinterpose.agent.mech import native_call
    from cuinterpose.agent.options import CheckpointOptions

    opts = opts or CheckpointOptions()
    with native_call.using(opts):
        return _run_checks(opts)


def _run_checks(opts) -> list[dict]:
    driver, control_dir, native_kind = opts.driver or None, opts.control_dir, opts.native_backend
    from cuinterpose.agent import paths
    from cuinterpose.agent.mech import native
    from cuinterpose.agent.mech.census import ShimFile

    def criu_version():
        from cuinterpose.agent.mech import criu

        return f"criu {criu.version()} ({' '.join(criu.criu_command())})"

    def criu_check():
        from cuinterpose.agent.mech import criu

        ok, out = criu.check()
        last = out.strip().splitlines()[-1] if out.strip() else ""
        if not ok:
            raise RuntimeError(out.strip())
        return last or "Looks good."

    def drv():
        try:
            info = native.load(driver)
        except Exception as e:
            # native.load names the hint itself when libcuda.so.1 cannot be loaded
            if native.driver_kind(driver) == "real" and NO_DRIVER_HINT not in str(e):
                raise RuntimeError(f"{e} ({NO_DRIVER_HINT})") from None
            raise
        from cuda.bindings import driver as d

        for fn in (
            "cuCheckpointProcessGetState",
            "cuCheckpointProcessLock",
            "cuCheckpointProcessCheckpoint",
            "cuCheckpointProcessRestore",
            "cuCheckpointProcessUnlock",
        ):
            if not hasattr(d, fn):
                raise RuntimeError(f"cuda.bindings lacks {fn}")
        # GetState of ourselves: the API must answer (an error code is fine, a missing entry
        # point raises); our own process is not a checkpoint target.
        try:
            native.get_state(os.getpid())
        except Exception:
            pass
        return (
            f"{info.kind} driver {info.version} at {info.library}; cuCheckpointProcess* reachable"
        )

    def backend():
        b = native.choose(native_kind)
        return f"{b.name}: {b.why}"

    def gpu_storage():
        from cuinterpose.agent.mech import native_storage

        requested = native_storage.mode(opts.gpu_storage)
        b = native.choose(native_kind)
        if b.name == "driver-api":
            inf = native.load(driver)
            avail, why = native_storage.probe(b.name, inf.library, inf.version)
        else:
            avail, why = native_storage.probe(b.name, "", 0)
        if requested == "custom" and not avail:
            raise RuntimeError(f"--gpu-storage custom: {why}")
        if requested == "host":
            return "host (--gpu-storage host): GPU memory staged in host memory, CRIU dumps it"
        if avail:
            return f"custom ({requested}): {why}; GPU memory streamed to chunks/, not into CRIU"
        return f"host ({requested}): {why}; GPU memory staged in host memory, CRIU dumps it"

    def shim():
        s = ShimFile.of(paths.shim_path())
        return f"{s.path} sha256 {s.sha256}"

    def ctl():
        from cuinterpose.agent.mech.census_checks import socket_dir_problem

        d = pathlib.Path(control_dir)
        why = socket_dir_problem(d)
        if why:
            raise RuntimeError(why)
        if not os.path.lexists(d):  # a diagnostic changes nothing: say who creates it
            parent = next(p for p in d.absolute().parents if p.exists())
            if not os.access(parent, os.W_OK | os.X_OK):
                raise RuntimeError(f"{d} does not exist, and {parent} is not writable to create it")
            return (
                f"{d} does not exist: no shim has bound a socket there yet (a shim creates it, "
                f"0700, at its cuInit; so does a restore); {parent} is writable"
            )
        ctldir.check(d)  # refused when not trusted
        with tempfile.NamedTemporaryFile(dir=d, prefix=".doctor-"):
            pass
        return f"{d} writable"

    rows = [
        _check("criu version", criu_version),
        _check("criu check", criu_check),
        _check("driver", drv),
        _check("native backend", backend),
        _check("gpu storage", gpu_storage),
        _check("shim", shim),
        _check("control dir", ctl),
    ]
    return _said_once(rows)


def _said_once(rows: list[dict]) -> list[dict]:
    """A failure another row already states in full (the driver's load error inside the
    native backend's and the GPU storage's) is named by that row instead of repeated."""
    for i, r in enumerate(rows):
        for earlier in rows[:i]:
            cause = earlier["detail"]
            if r["ok"] or earlier["ok"] or len(cause) < 40:
                continue
            for rest in (cause, cause.split(": ", 1)[-1]):
                if len(rest) >= 40 and rest in r["detail"]:
                    r["detail"] = r["detail"].replace(rest, f"see the {earlier['name']} line")
                    break
    return rows


def render(checks: list[dict]) -> None:
    from rich.console import Console
    from rich.markup import escape

    c = Console()
    for ch in checks:
        mark = "[green]ok[/]  " if ch["ok"] else "[red]FAIL[/]"
        # soft_wrap: never break a path or a hash across lines (logs, grep, non-tty)
        c.print(f"{mark} {escape(ch['name'])}: {escape(str(ch['detail']))}", soft_wrap=True)
