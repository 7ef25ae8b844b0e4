"""``cuinterpose-agent``: the node agent's command line (see docs/agent.md).

Exit codes: 0 success; 2 usage error; 3 refused (nothing was changed); 4 checkpoint failed and
was rolled back (the workload keeps running); 5 failed and could not be rolled back / the
restored tree was killed / the manifest could not be written (read the message).

``--json`` prints exactly one JSON object on stdout and nothing else (no rich output):
``{"ok": true, ...}`` or ``{"ok": false, "error": {"phase", "pid", "reason", "outcome",
"message"}}``.
"""
from __future__ import annotations

import json
import os
import sys

import click

from . import paths
from .errors import AgentError

EXIT = {"refused": 3, "rolled_back": 4, "rollback_failed": 5, "snapshot_incomplete": 5,
        "restore_failed": 5}


def _drop_shim_from_self() -> None:
    """The agent must never run under the shim: strip LD_PRELOAD for helpers, and re-exec once
    without it if the shim is mapped into this very process."""
    pre = os.environ.pop("LD_PRELOAD", None)
    if pre and paths.SHIM_NAME in pre and not os.environ.get("_CUINTERPOSE_AGENT_REEXEC"):
        with open("/proc/self/maps") as f:
            if paths.SHIM_NAME in f.read():
                os.environ["_CUINTERPOSE_AGENT_REEXEC"] = "1"
                os.execv(sys.executable, [sys.executable, "-m", "cuinterpose.agent.cli", *sys.argv[1:]])


def _emit_json(obj: dict) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def _fail(e: AgentError, as_json: bool, extra: dict | None = None, command: str = "checkpoint"):
    if as_json:
        _emit_json({"ok": False, "error": e.to_dict(), **(extra or {})})
    else:
        click.echo(f"error: {e}", err=True)
        refused = {"checkpoint": "nothing was torn down; the workload keeps running",
                   "restore": "nothing was changed; the snapshot is untouched",
                   "inspect": "nothing was changed (INSPECT is read-only)"}[command]
        hint = {"refused": refused,
                "rolled_back": "the workload was rebuilt and keeps running with its memory intact",
                "rollback_failed": "the workload could NOT be rebuilt; it needs an operator",
                "snapshot_incomplete": "the tree was dumped but the directory is not a snapshot",
                "restore_failed": "the restored tree was killed; the snapshot is untouched"}
        click.echo(f"outcome: {e.outcome}: {hint.get(e.outcome, '')}", err=True)
    sys.exit(EXIT.get(e.outcome, 5))


def _reporter(title: str, as_json: bool):
    from .report import Reporter, RichSink
    if as_json:
        return Reporter(), None
    sink = RichSink(title)
    return Reporter([sink]), sink


def _set_env(driver, control_dir):
    if driver:
        os.environ["CUINTERPOSE_DRIVER"] = driver
    if control_dir:
        os.environ["CUINTERPOSE_CONTROL_DIR"] = str(control_dir)


POSITIVE = click.FloatRange(min=0, min_open=True)

driver_opt = click.option("--driver", type=click.Choice(["real", "fake"]), default=None,
                          help="libcuda.so.1 to use: real (default) or fakecuda "
                               "(also $CUINTERPOSE_DRIVER).")
control_opt = click.option("--control-dir", type=click.Path(file_okay=False), default=None,
                           help="shim control directory (default $CUINTERPOSE_CONTROL_DIR or "
                                "/tmp/cuinterpose).")
json_opt = click.option("--json", "as_json", is_flag=True, help="machine-readable output only.")


class _Group(click.Group):
    """With ``--json`` anywhere on the command line, a usage error is one JSON object on stdout
    too (exit 2): ``{"ok": false, "error": {"phase": "usage", "pid": null, "reason",
    "outcome": "usage", "message"}}``."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        argv = list(sys.argv[1:] if args is None else args)
        if "--json" not in argv or not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            reason = e.format_message()
            _emit_json({"ok": False, "error": {"phase": "usage", "pid": None, "reason": reason,
                                               "outcome": "usage",
                                               "message": f"usage: {reason}"}})
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            _emit_json({"ok": False, "error": {"phase": "usage", "pid": None,
                                               "reason": "aborted", "outcome": "usage",
                                               "message": "usage: aborted"}})
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """cuinterpose node agent: checkpoint and restore multi-process CUDA jobs."""
    _drop_shim_from_self()


@main.command("shim-path")
def shim_path_cmd():
    """Print the absolute path of libcuinterpose.so (for LD_PRELOAD)."""
    try:
        click.echo(str(paths.shim_path()))
    except FileNotFoundError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)


@main.command()
@click.option("--pid", "pids", type=int, multiple=True, required=True,
              help="root of a process tree to checkpoint (repeatable).")
@click.option("--images-dir", type=click.Path(file_okay=False), required=True,
              help="new snapshot directory.")
@click.option("--quiesce-timeout-ms", type=click.IntRange(1), default=10_000, show_default=True)
@click.option("--lock-timeout-ms", type=click.IntRange(0), default=10_000, show_default=True,
              help="cuCheckpointProcessLock timeout per process (0 = none).")
@click.option("--phase-timeout-s", type=POSITIVE, default=60.0, show_default=True,
              help="deadline of each coordinator request (INSPECT, PREPARE_UNICAST, ...).")
@click.option("--carrier-timeout-s", type=POSITIVE, default=3600.0, show_default=True,
              help="deadline of SAVE_ALLOCATIONS (copying shared bytes to host carriers).")
@click.option("--leave-running", is_flag=True, help="keep the workload running after the dump.")
@driver_opt
@control_opt
@json_opt
def checkpoint(pids, images_dir, quiesce_timeout_ms, lock_timeout_ms, phase_timeout_s,
               carrier_timeout_s, leave_running, driver, control_dir, as_json):
    """Checkpoint the process tree(s) rooted at --pid into --images-dir."""
    from .checkpoint import Checkpoint
    _set_env(driver, control_dir)
    rep, sink = _reporter(f"checkpoint {' '.join(map(str, pids))} -> {images_dir}", as_json)
    cp = Checkpoint(pids, images_dir, control_dir=control_dir, quiesce_timeout_ms=quiesce_timeout_ms,
                    lock_timeout_ms=lock_timeout_ms, phase_timeout_s=phase_timeout_s,
                    carrier_timeout_s=carrier_timeout_s,
                    driver=driver, leave_running=leave_running, reporter=rep)
    try:
        if sink:
            with sink:
                m = cp.run()
        else:
            m = cp.run()
    except AgentError as e:
        _fail(e, as_json, {"phases": rep.to_list()})
    except Exception as e:  # a bug: say where it happened and that state is unknown
        phase = rep.phases[-1].name if rep.phases else "checkpoint"
        _fail(AgentError(phase, f"unexpected {type(e).__name__}: {e}; workload state unknown",
                         outcome="rollback_failed"), as_json, {"phases": rep.to_list()})
    if as_json:
        _emit_json({"ok": True, "images_dir": str(cp.images_dir), "snapshot_id": m["snapshot_id"],
                    "roots": m["roots"], "cuda_pids": m["cuda_pids"], "phases": rep.to_list(),
                    "totals": m["totals"], "shim_sha256": m["shim"]["sha256"]})
    else:
        click.echo(f"snapshot {m['snapshot_id']} written to {cp.images_dir}")


@main.command()
@click.option("--images-dir", type=click.Path(file_okay=False), required=True)
@click.option("--phase-timeout-s", type=POSITIVE, default=60.0, show_default=True,
              help="deadline of each coordinator request (INSPECT, RESTORE_UNICAST, ...).")
@click.option("--carrier-timeout-s", type=POSITIVE, default=3600.0, show_default=True,
              help="deadline of LOAD_ALLOCATIONS (copying the carried bytes back).")
@driver_opt
@json_opt
def restore(images_dir, phase_timeout_s, carrier_timeout_s, driver, as_json):
    """Restore the snapshot in --images-dir and let the workload continue."""
    from .restore import Restore
    _set_env(driver, None)
    rep, sink = _reporter(f"restore {images_dir}", as_json)
    rs = Restore(images_dir, driver=driver, phase_timeout_s=phase_timeout_s,
                 carrier_timeout_s=carrier_timeout_s, reporter=rep)
    try:
        if sink:
            with sink:
                res = rs.run()
        else:
            res = rs.run()
    except AgentError as e:
        _fail(e, as_json, {"phases": rep.to_list()}, command="restore")
    except Exception as e:
        phase = rep.phases[-1].name if rep.phases else "restore"
        _fail(AgentError(phase, f"unexpected {type(e).__name__}: {e}", outcome="restore_failed"),
              as_json, {"phases": rep.to_list()}, command="restore")
    if as_json:
        _emit_json({"ok": True, **res})
    else:
        click.echo(f"restored {res['snapshot_id']}: roots {', '.join(map(str, res['roots']))}")


@main.command()
@click.option("--pid", type=int, required=True)
@click.option("--phase-timeout-s", type=POSITIVE, default=10.0, show_default=True)
@control_opt
@json_opt
def inspect(pid, phase_timeout_s, control_dir, as_json):
    """INSPECT one process through its control socket (read-only)."""
    from .inspect import inspect_pid, render_table
    _set_env(None, control_dir)
    try:
        res = inspect_pid(pid, control_dir=control_dir, timeout_s=phase_timeout_s)
    except AgentError as e:
        _fail(e, as_json, command="inspect")
    if as_json:
        _emit_json({"ok": True, **res})
    else:
        render_table(res)


@main.command()
@driver_opt
@control_opt
@json_opt
def doctor(driver, control_dir, as_json):
    """Check CRIU, the driver's checkpoint API, the shim and the control directory."""
    from .doctor import run_checks, render
    _set_env(driver, control_dir)
    checks = run_checks(driver=driver, control_dir=control_dir)
    ok = all(c["ok"] for c in checks)
    if as_json:
        _emit_json({"ok": ok, "checks": checks})
    else:
        render(checks)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
