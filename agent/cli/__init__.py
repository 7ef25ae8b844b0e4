"""``cuinterpose-agent``: the node agent's command line (see docs/agent.md).

Exit codes: 0 success; 2 usage error; 3 refused (nothing was changed); 4 checkpoint failed and
was rolled back (the workload keeps running); 5 failed and could not be rolled back / the
restored tree was killed / the manifest could not be written (read the message); 6 the
``--agent`` daemon could not be reached; 7 ``--agent``: this client was interrupted and cancelled
its request; 1 ``doctor``/``health`` found a check failing, or click's ``Aborted!`` of a command
other than ``checkpoint``/``restore`` (docs/agent.md "Exit codes"). ``checkpoint`` and
``restore`` record SIGINT/SIGTERM/SIGHUP from their start until they exit (D73,
agent/run/interrupt.py ``hold``).

``--json`` prints exactly one JSON object on stdout and nothing else (no rich output):
``{"ok": true, ...}`` or ``{"ok": false, "error": {"phase", "pid", "reason", "outcome",
"message"}}``.
"""

from __future__ import annotations

import os
import pathlib
import sys

import click

from cuinterpose.agent import paths
from cuinterpose.agent.cli import daemon, jobs
from cuinterpose.agent.cli.common import (
    build_options,
    emit_json,
    fail,
    json_opt,
    option_flags,
    refuse_empty,
)
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.options import CheckpointOptions


def _drop_shim_from_self() -> None:
    """The agent must never run under the shim: strip LD_PRELOAD for helpers, and re-exec once
    without it if the shim is mapped into this very process."""
    pre = os.environ.pop("LD_PRELOAD", None)
    if pre and paths.SHIM_NAME in pre and not os.environ.get("_CUINTERPOSE_AGENT_REEXEC"):
        with open("/proc/self/maps") as f:
            if paths.SHIM_NAME in f.read():
                os.environ["_CUINTERPOSE_AGENT_REEXEC"] = "1"
                os.execv(
                    sys.executable, [sys.executable, "-m", "cuinterpose.agent.cli", *sys.argv[1:]]
                )


class _Group(click.Group):
    """With ``--json`` anywhere on the command line, a usage error is one JSON object on stdout
    too (exit 2): ``{"ok": false, "error": {"phase": "usage", "pid": null, "reason",
    "outcome": "usage", "message"}}``."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        argv = list(sys.argv[1:] if args is None else args)
        if not (standalone_mode and argv and argv[0] in RUNS and "--group" not in argv):
            return self._main(argv, prog_name, complete_var, standalone_mode, **extra)
        from cuinterpose.agent.mech import signal_at
        from cuinterpose.agent.run import interrupt

        interrupt.hold(argv[0])
        try:
            return self._main(argv, prog_name, complete_var, standalone_mode, **extra)
        finally:
            interrupt.settle()
            try:
                signal_at.signal_point("after", "result")  # test trigger: the result is out
            except AgentError:
                pass  # a malformed trigger: the run itself refused it and said so
            # args given: called in-process (CliRunner, a library), not the process's own exit
            interrupt.release_at_exit(exiting=args is None)

    def _main(self, argv, prog_name, complete_var, standalone_mode, **extra):
        if "--json" not in argv or not standalone_mode:
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            reason = e.format_message()
            emit_json(
                {
                    "ok": False,
                    "error": {
                        "phase": "usage",
                        "pid": None,
                        "reason": reason,
                        "outcome": "usage",
                        "message": f"usage: {reason}",
                    },
                }
            )
            sys.exit(e.exit_code)
        except click.exceptions.Abort:  # a Ctrl-C of a command other than checkpoint/restore
            emit_json(
                {
                    "ok": False,
                    "error": {
                        "phase": "request",
                        "pid": None,
                        "reason": "aborted (Ctrl-C)",
                        "outcome": "aborted",
                        "message": "request: aborted (Ctrl-C)",
                    },
                }
            )
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


#: the commands whose signals interrupt.hold records from their start (not a --group lead)
RUNS = ("checkpoint", "restore")


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
@option_flags(CheckpointOptions, only=("driver", "native_backend", "gpu_storage", "control_dir"))
@json_opt
def doctor(as_json, **flags):
    """Check CRIU, the driver's checkpoint API, the native backend and GPU storage a
    checkpoint would use, the shim and the control directory."""
    from cuinterpose.agent.doctor import render, run_checks

    try:
        opts = build_options(CheckpointOptions, flags)
    except AgentError as e:
        fail(e, as_json, command="doctor")
    checks = run_checks(opts)
    ok = all(c["ok"] for c in checks)
    if as_json:
        emit_json({"ok": ok, "checks": checks})
    else:
        render(checks)
    sys.exit(0 if ok else 1)


@main.command("install-criu")
@click.option(
    "--dir",
    "target",
    type=click.Path(file_okay=False, path_type=pathlib.Path),
    default=None,
    help="install folder (default: where the agent looks, $CUINTERPOSE_CRIU_CACHE, else "
    "<python prefix>/share/cuinterpose/criu)",
)
@click.option("--suite", default=None, help="release to take CRIU from (trixie; Ubuntu: resolute)")
@click.option("--force", is_flag=True, help="install even when the system's CRIU works")
def install_criu(target, suite, force):
    """Install CRIU 4.x where the agent finds it (Debian, Ubuntu; run as root).

    Unpacks CRIU and its libraries from the next Debian or Ubuntu release into a private
    folder (the system is not changed), then runs `criu check`. Exit status 0 when a working
    CRIU is there, 1 otherwise (the reason, or the manual way on other distributions)."""
    from cuinterpose.agent.mech import criu_binary as criu

    rc = criu.install(target, suite=suite, force=force)
    if rc == 0 and target is not None and target.resolve() != criu.cache_dir().resolve():
        click.echo(
            f"install-criu: the agent looks in {criu.cache_dir()}; to use {target}, set "
            f"{criu.ENV_CACHE}={target}",
            err=True,
        )
    elif rc == 0:
        try:
            found = " ".join(criu.criu_command())
            click.echo(f"install-criu: the agent uses {found} (criu {criu.version()})", err=True)
        except criu.CriuError as e:
            click.echo(f"install-criu: installed, but the agent finds no CRIU: {e}", err=True)
            rc = 1
    sys.exit(rc)


for _cmd in (
    jobs.checkpoint,
    jobs.restore,
    jobs.inspect,
    jobs.snapshots_cmd,
    jobs.delete_cmd,
    jobs.release_cmd,
    daemon.serve,
    daemon.health_cmd,
):
    main.add_command(_cmd)
for _cmd in main.commands.values():
    refuse_empty(_cmd)
