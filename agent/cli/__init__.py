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

from cuinterpose.agent import paths
from cuinterpose.agent.errors import AgentError
from cuinterpose.coordinator.protocol import default_control_dir

EXIT = {"refused": 3, "rolled_back": 4, "rollback_failed": 5, "snapshot_incomplete": 5,
        "restore_failed": 5, "usage": 2, "unreachable": 6}


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
        err = e.to_dict()
        if getattr(e, "node", None):
            err["node"] = e.node      # a group request: the member that failed
        _emit_json({"ok": False, "error": err, **(extra or {})})
    else:
        click.echo(f"error: {e}", err=True)
        refused = {"checkpoint": "nothing was torn down; the workload keeps running",
                   "restore": "nothing was changed; the snapshot is untouched",
                   "inspect": "nothing was changed (INSPECT is read-only)",
                   "snapshots": "nothing was changed (read-only)",
                   "serve": "the agent did not start"}.get(command, "")
        hint = {"refused": getattr(e, "hint", None) or refused,
                "rolled_back": "the workload was rebuilt and keeps running with its memory intact",
                "rollback_failed": "the workload could NOT be rebuilt; it needs an operator",
                "snapshot_incomplete": "the tree was dumped but the directory is not a snapshot",
                "restore_failed": "the restored tree was killed; the snapshot is untouched"}
        click.echo(f"outcome: {e.outcome}: {hint.get(e.outcome, '')}", err=True)
    sys.exit(EXIT.get(e.outcome, 5))


def _reporter(title: str, as_json: bool):
    from cuinterpose.agent.run.report import Reporter, RichSink
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


agent_opt = click.option("--agent", "agent_addr", default=None, metavar="ADDR",
                         help="run through the agent daemon at ADDR (unix:/path or host:port) "
                              "instead of in-process.")
tls_ca_opt = click.option("--tls-ca", type=click.Path(dir_okay=False), default=None,
                          help="with --agent over TCP: CA certificate to verify the agent.")
tls_cert_opt = click.option("--tls-cert", type=click.Path(dir_okay=False), default=None,
                            help="with --agent: client certificate (mutual TLS).")
tls_key_opt = click.option("--tls-key", type=click.Path(dir_okay=False), default=None,
                           help="with --agent: client key (mutual TLS).")
group_opt = click.option("--group", "group_file", type=click.Path(dir_okay=False, exists=True),
                         default=None, help="JSON file {\"members\": [{\"node\", \"address\", "
                         "\"images_dir\", \"roots\" (checkpoint), \"into_pid\" (restore, "
                         "optional: a placement on that node)}]}: one group request across these "
                         "agents, led by --agent (or by this process).")


def _tls(ca, cert, key):
    from cuinterpose.agent.rpc.client import TLS
    t = TLS(cert=cert, key=key, ca=ca)
    return t if t.enabled else None


def _load_members(group_file, kind: str):
    """Members of a --group file as ``Member`` messages; a bad file is a usage error."""
    from cuinterpose.agent.snapshot import pb
    apb, _, _ = pb.modules()
    try:
        with open(group_file) as f:
            spec = json.load(f)
        out = []
        for m in spec["members"]:
            roots = [int(r) for r in m.get("roots", [])]
            if kind == "checkpoint" and not roots:
                raise ValueError(f"member {m.get('node')!r} has no roots")
            into = int(m.get("into_pid") or 0)
            if into and kind != "restore":
                raise ValueError(f"member {m.get('node')!r}: into_pid is for a restore")
            if into < 0:
                raise ValueError(f"member {m.get('node')!r}: into_pid {into} is not a pid")
            out.append(apb.Member(node=str(m["node"]), address=str(m["address"]),
                                  images_dir=str(m["images_dir"]), roots=roots,
                                  into_pid=into))
        if not out:
            raise ValueError("no members")
        return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise click.UsageError(f"--group {group_file}: {type(e).__name__}: {e}") from None


class _RemoteRows:
    """Feeds Progress rows from the service into a local Reporter (and its live table):
    a "start" row opens a Phase, the matching "end" row completes it."""

    def __init__(self, rep):
        self.rep = rep
        self.open: dict = {}

    def __call__(self, row: dict) -> None:
        from cuinterpose.agent.run.report import Phase
        if row["event"] == "note":
            self.rep.note(row["text"])
            return
        name = f"{row['node']}: {row['phase']}" if row.get("node") else row["phase"]
        key = (row.get("node"), row["phase"])
        if row["event"] == "start":
            ph = Phase(name=name, detail=row["detail"])
            self.rep.phases.append(ph)
            self.open[key] = ph
            self.rep._emit("start", ph)
            return
        ph = self.open.pop(key, None)
        if ph is None:
            ph = Phase(name=name)
            self.rep.phases.append(ph)
            self.rep._emit("start", ph)
        ph.status, ph.elapsed_ns, ph.bytes, ph.detail = (row["status"], row["elapsed_ns"],
                                                         row["bytes"], row["detail"])
        self.rep._emit("end", ph)


def _remote(addr, method, request, rep, sink, tls):
    """Run ``method`` at the agent ``addr``; returns the CLI JSON object of a success, raises
    ``AgentError`` (what the agent reported, or outcome "unreachable") otherwise."""
    from cuinterpose.agent.run.ops import error_from_dict
    from cuinterpose.agent.rpc.client import call

    def go():
        return call(addr, method, request, tls=tls, on_progress=_RemoteRows(rep))
    if sink:
        with sink:
            res = go()
    else:
        res = go()
    obj = json.loads(res.json) if res.json else {}
    if res.ok:
        return obj
    e = res.error
    err = error_from_dict({"phase": e.phase, "pid": e.pid if e.has_pid else None,
                           "reason": e.reason, "outcome": e.outcome, "message": e.message,
                           "node": e.node})
    err.remote_phases = obj.get("phases", [])
    raise err


def _run_local(rep, sink, fn):
    if sink:
        with sink:
            return fn()
    return fn()


@main.command()
@click.option("--pid", "pids", type=int, multiple=True,
              help="root of a process tree to checkpoint (repeatable; not with --group).")
@click.option("--images-dir", type=click.Path(file_okay=False), default=None,
              help="new snapshot directory (not with --group; with --agent: sent as an "
                   "absolute path, which must lie under the daemon's --snapshot-dir).")
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
@agent_opt
@group_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def checkpoint(pids, images_dir, quiesce_timeout_ms, lock_timeout_ms, phase_timeout_s,
               carrier_timeout_s, leave_running, driver, control_dir, agent_addr, group_file,
               tls_ca, tls_cert, tls_key, as_json):
    """Checkpoint the process tree(s) rooted at --pid into --images-dir."""
    from cuinterpose.agent.run import ops
    if group_file:
        if pids or images_dir:
            raise click.UsageError("--group names each member's roots and images dir; "
                                   "do not pass --pid or --images-dir with it")
    elif not pids:
        raise click.UsageError("Missing option '--pid'.")
    elif not images_dir:
        raise click.UsageError("Missing option '--images-dir'.")
    tls = _tls(tls_ca, tls_cert, tls_key)
    title = (f"group checkpoint {group_file}" if group_file else
             f"checkpoint {' '.join(map(str, pids))} -> {images_dir}")
    rep, sink = _reporter(title, as_json)
    kw = dict(control_dir=control_dir, quiesce_timeout_ms=quiesce_timeout_ms,
              lock_timeout_ms=lock_timeout_ms, phase_timeout_s=phase_timeout_s,
              carrier_timeout_s=carrier_timeout_s, driver=driver, leave_running=leave_running)
    try:
        if agent_addr or group_file:
            from cuinterpose.agent.snapshot import pb
            apb, _, _ = pb.modules()
            req = apb.CheckpointRequest(
                roots=list(pids), images_dir=os.path.abspath(images_dir) if images_dir else "",
                options=apb.CheckpointOptions(
                    quiesce_timeout_ms=quiesce_timeout_ms, lock_timeout_ms=lock_timeout_ms,
                    phase_timeout_s=phase_timeout_s, carrier_timeout_s=carrier_timeout_s,
                    leave_running=leave_running, driver=driver or "",
                    control_dir=os.path.abspath(control_dir) if control_dir else ""),
                members=_load_members(group_file, "checkpoint") if group_file else [])
            if agent_addr:
                out = _remote(agent_addr, "Checkpoint", req, rep, sink, tls)
            else:
                from cuinterpose.agent.rpc.group import lead
                out = _run_local(rep, sink, lambda: lead(
                    "checkpoint", req, rep, _RemoteRows(rep), tls=tls)[0])
        else:
            _set_env(driver, control_dir)
            out = _run_local(rep, sink, lambda: ops.checkpoint(rep, pids, images_dir, **kw)[0])
    except AgentError as e:
        _fail(e, as_json, {"phases": getattr(e, "remote_phases", None) or rep.to_list()})
    if as_json:
        _emit_json(out)
    elif group_file:
        click.echo(f"group checkpoint {out['request_id']}: " + ", ".join(
            f"{m['node']} -> {m['images_dir']}" for m in out["members"]))
    else:
        click.echo(f"snapshot {out['snapshot_id']} written to {out['images_dir']}")


@main.command()
@click.option("--images-dir", type=click.Path(file_okay=False), default=None,
              help="the snapshot directory (with --agent: sent as an absolute path, which must "
                   "lie under the daemon's --snapshot-dir).")
@click.option("--phase-timeout-s", type=POSITIVE, default=60.0, show_default=True,
              help="deadline of each coordinator request (INSPECT, RESTORE_UNICAST, ...).")
@click.option("--carrier-timeout-s", type=POSITIVE, default=3600.0, show_default=True,
              help="deadline of LOAD_ALLOCATIONS (copying the carried bytes back).")
@click.option("--into-pid", type=click.IntRange(min=1), default=None, metavar="PID",
              help="restore into the cgroups, namespaces and stdio of this running process (a "
                   "placeholder container's init): CRIU joins its net, ipc and uts namespaces "
                   "(--join-ns) and runs inside its mount namespace (CRIU's child enters it), "
                   "pipes of the trees to outside them get its stdin/stdout/stderr, and files "
                   "they had opened outside their mount namespace get its fd of the same kind "
                   "(else their recorded path, reopened).")
@click.option("--driver", type=click.Choice(["real", "fake"]), default=None,
              help="libcuda.so.1 to use: real or fakecuda (default: $CUINTERPOSE_DRIVER, else "
                   "the driver the manifest records).")
@agent_opt
@group_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def restore(images_dir, phase_timeout_s, carrier_timeout_s, into_pid, driver, agent_addr,
            group_file, tls_ca, tls_cert, tls_key, as_json):
    """Restore the snapshot in --images-dir and let the workload continue. There is no
    --control-dir: the restore uses the control dir recorded in the snapshot's manifest."""
    from cuinterpose.agent.run import ops
    if group_file and images_dir:
        raise click.UsageError("--group names each member's images dir; do not pass --images-dir")
    if group_file and into_pid:
        raise click.UsageError("--into-pid places a single-node restore; in a group restore "
                               "each member of the --group file names its own \"into_pid\"")
    if not group_file and not images_dir:
        raise click.UsageError("Missing option '--images-dir'.")
    tls = _tls(tls_ca, tls_cert, tls_key)
    rep, sink = _reporter(f"group restore {group_file}" if group_file else
                          f"restore {images_dir}", as_json)
    try:
        if agent_addr or group_file:
            from cuinterpose.agent.snapshot import pb
            apb, _, _ = pb.modules()
            req = apb.RestoreRequest(
                images_dir=os.path.abspath(images_dir) if images_dir else "", driver=driver or "",
                phase_timeout_s=phase_timeout_s, carrier_timeout_s=carrier_timeout_s,
                members=_load_members(group_file, "restore") if group_file else [],
                into_pid=into_pid or 0)
            if agent_addr:
                res = _remote(agent_addr, "Restore", req, rep, sink, tls)
            else:
                from cuinterpose.agent.rpc.group import lead
                res = _run_local(rep, sink, lambda: lead(
                    "restore", req, rep, _RemoteRows(rep), tls=tls)[0])
        else:
            if not os.path.exists(images_dir):
                from cuinterpose.agent.errors import SnapshotError
                raise SnapshotError("manifest", f"{images_dir} does not exist")
            _set_env(driver, None)
            res = _run_local(rep, sink, lambda: ops.restore(
                rep, images_dir, driver=driver, phase_timeout_s=phase_timeout_s,
                carrier_timeout_s=carrier_timeout_s, placement=into_pid))
    except AgentError as e:
        _fail(e, as_json, {"phases": getattr(e, "remote_phases", None) or rep.to_list()},
              command="restore")
    if as_json:
        _emit_json(res)
    elif group_file:
        click.echo(f"group restore {res['request_id']}: " + ", ".join(
            m["node"] for m in res["members"]))
    else:
        click.echo(f"restored {res['snapshot_id']}: roots {', '.join(map(str, res['roots']))}")


@main.command()
@click.option("--pid", type=int, required=True)
@click.option("--phase-timeout-s", type=POSITIVE, default=10.0, show_default=True)
@control_opt
@agent_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def inspect(pid, phase_timeout_s, control_dir, agent_addr, tls_ca, tls_cert, tls_key, as_json):
    """INSPECT one process through its control socket (read-only)."""
    from cuinterpose.agent.run import ops
    from cuinterpose.agent.inspect import render_table
    try:
        if agent_addr:
            from cuinterpose.agent.snapshot import pb
            from cuinterpose.agent.run.report import Reporter
            apb, _, _ = pb.modules()
            req = apb.InspectRequest(pid=pid, timeout_s=phase_timeout_s,
                                     control_dir=os.path.abspath(control_dir) if control_dir else "")
            res = _remote(agent_addr, "Inspect", req, Reporter(), None,
                          _tls(tls_ca, tls_cert, tls_key))
        else:
            _set_env(None, control_dir)
            res = ops.inspect(pid, control_dir=control_dir, timeout_s=phase_timeout_s)
    except AgentError as e:
        _fail(e, as_json, command="inspect")
    res.pop("ok", None)
    if as_json:
        _emit_json({"ok": True, **res})
    else:
        render_table(res)


@main.command("snapshots")
@click.argument("path", required=False, type=click.Path(file_okay=False))
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="directory whose sub-directories are snapshots (with --agent: default the "
                   "agent's --snapshot-dir); also accepted as the argument PATH.")
@agent_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def snapshots_cmd(path, directory, agent_addr, tls_ca, tls_cert, tls_key, as_json):
    """List the snapshots (directories holding manifest.json) under PATH / --dir, or PATH
    itself when it is a snapshot."""
    from cuinterpose.agent.run import ops
    if path and directory and os.path.abspath(path) != os.path.abspath(directory):
        raise click.UsageError("give the directory either as PATH or as --dir, not both")
    directory = directory or path
    try:
        if agent_addr:
            from cuinterpose.agent.snapshot import pb
            from cuinterpose.agent.run.report import Reporter
            apb, _, _ = pb.modules()
            req = apb.ListSnapshotsRequest(dir=os.path.abspath(directory) if directory else "")
            res = _remote(agent_addr, "ListSnapshots", req, Reporter(), None,
                          _tls(tls_ca, tls_cert, tls_key))
        else:
            if not directory:
                raise click.UsageError("--dir is required without --agent")
            res = ops.list_snapshots(directory)
    except AgentError as e:
        _fail(e, as_json, command="snapshots")
    if as_json:
        _emit_json(res)
        return
    from cuinterpose.agent.run.report import render_snapshots
    render_snapshots(res)


@main.command("release")
@click.option("--pid", type=int, required=True, help="root pid whose pending request to answer.")
@click.option("--force", is_flag=True, help="release even though the agent that sent the "
              "request had started tearing shared memory down.")
@control_opt
@json_opt
def release_cmd(pid, force, control_dir, as_json):
    """Release a job parked by a quiesce request no live agent will answer (an agent killed
    mid-checkpoint, a stale .request): writes .resume {"id": <the request's id>, "restored":
    false, "cancelled": true}. Refused while a live agent owns the request."""
    from cuinterpose.agent.mech import quiesce
    cdir = os.path.abspath(control_dir or default_control_dir())
    try:
        res = quiesce.release(cdir, pid, force=force)
    except AgentError as e:
        e.hint = getattr(e, "hint", None) or "nothing was changed"
        _fail(e, as_json, command="release")
    if as_json:
        _emit_json({"ok": True, **res})
    else:
        click.echo(f"released pid {pid}: wrote {res['resume']} answering request "
                   f"{res['request_id']} (cancelled)"
                   + (" and removed the dead agent's lock" if res["removed_lock"] else ""))


@main.command("health")
@click.option("--agent", "agent_addr", default=None, metavar="ADDR",
              help="agent address (default $CUINTERPOSE_AGENT_ADDR or unix:/tmp/cuinterpose-agent.sock).")
@click.option("--service", default="", help="service name (default: the server as a whole).")
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
def health_cmd(agent_addr, service, tls_ca, tls_cert, tls_key):
    """gRPC health check of an agent daemon: prints SERVING (exit 0) or another status
    (exit 1); exit 6 when it cannot be reached."""
    import grpc
    from cuinterpose.agent.rpc.client import default_address, health
    addr = agent_addr or default_address()
    try:
        st = health(addr, service, tls=_tls(tls_ca, tls_cert, tls_key))
    except grpc.RpcError as e:
        click.echo(f"{addr}: unreachable: {e.code().name if hasattr(e, 'code') else e}", err=True)
        sys.exit(6)
    click.echo(st)
    sys.exit(0 if st == "SERVING" else 1)


def _config_values(path) -> dict:
    """Settings from the YAML agent config (``cuinterpose.agent.config.load_config``), under
    serve's option names; a bad file is a usage error naming the key. ``metricsPort`` means
    what ``--metrics-port`` means: null (absent) = no metrics, 0 = a free port the OS picks."""
    from cuinterpose.agent.config import ConfigError, load_config
    try:
        cfg = load_config(path)
    except ConfigError as e:
        raise click.UsageError(f"--config {path}: {e}") from None
    k = cfg.kubernetes
    return {"listen": cfg.listen_address or None,
            "node": k.node_name or os.environ.get("NODE_NAME"),
            "control_dir": cfg.control_dir or None, "snapshot_dir": cfg.snapshot_dir or None,
            "metrics_port": cfg.metrics_port, "metrics_addr": cfg.metrics_address or None,
            "driver": cfg.driver,
            "tls_cert": cfg.tls.cert_file or None, "tls_key": cfg.tls.key_file or None,
            "tls_client_ca": cfg.tls.ca_file or None, "insecure_tcp": cfg.insecure_tcp or None,
            "group_lease_s": cfg.group_lease_s,
            "kubernetes": k if k.enabled else None, "_config": cfg}


def _start_watcher(srv, cfg, stop):
    """Start the pod watcher (agent/kube) of ``cfg`` in the daemon ``srv`` (its requests take
    the node lock and count in the metrics); returns (watcher, thread). A bad Kubernetes
    setting is a usage error."""
    try:
        return srv.start_watcher(cfg, stop)
    except ValueError as e:
        raise click.UsageError(f"--config: {e}") from None


def _make_snapshot_dir(d: str) -> bool:
    """Create the snapshot root ``d`` (mode 0700; missing parents with the default mode) when it
    does not exist; True when it was created. An existing directory is left as it is; one that
    is not a directory raises ``NotADirectoryError``."""
    if os.path.isdir(d):
        return False
    if os.path.lexists(d):
        raise NotADirectoryError(20, "exists and is not a directory")
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)     # the umask may have narrowed it, never widened; be exact
    return True


@main.command()
@click.option("--listen", default=None, metavar="ADDR",
              help="unix:/path (default $CUINTERPOSE_AGENT_ADDR or "
                   "unix:/tmp/cuinterpose-agent.sock) or host:port (TCP; TLS with --tls-cert).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="YAML agent config; options given on the command line win.")
@click.option("--node", default=None, help="this agent's name in group events (default: the "
              "config's kubernetes.nodeName, else $NODE_NAME, else the host name).")
@click.option("--snapshot-dir", type=click.Path(file_okay=False), multiple=True,
              help="the directory requests are confined to: every images dir of a checkpoint "
                   "or restore and every snapshots dir must resolve under it; ListSnapshots "
                   "lists it by default. The CLI sends --images-dir/--dir as absolute paths "
                   "(a relative one is taken from the CLI's working directory); a relative path "
                   "in a request (a --group file's images_dir, another gRPC client) is taken "
                   "relative to the first root. Repeat for more roots (the first is the "
                   "default). Created at start (mode 0700) when missing. Default: the "
                   "config's snapshotDir, else /var/lib/cuinterpose/snapshots.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="serve Prometheus metrics on this port (0: a free port the OS picks; "
                   "not given: no metrics, unless the config's metricsPort).")
@click.option("--metrics-addr", default=None,
              help="address of the metrics endpoint (default: the config's metricsAddress, "
                   "else 127.0.0.1).")
@click.option("--tls-cert", type=click.Path(dir_okay=False, exists=True), default=None,
              help="server certificate (PEM) for a TCP listener; also the client certificate "
                   "a leader presents to members.")
@click.option("--tls-key", type=click.Path(dir_okay=False, exists=True), default=None)
@click.option("--tls-client-ca", type=click.Path(dir_okay=False, exists=True), default=None,
              help="require client certificates signed by this CA (mutual TLS); also verifies "
                   "members when leading a group.")
@click.option("--insecure-tcp", is_flag=True, default=None,
              help="allow a non-loopback TCP listener without mutual TLS (plaintext, or TLS "
                   "without --tls-client-ca): anyone who reaches it can checkpoint and restore "
                   "as root. Logs a loud warning; the ready line says \"insecure\": true.")
@click.option("--group-lease-s", type=POSITIVE, default=None,
              help="seconds a group member keeps a request's job past its leader's last "
                   "RunPhase or Renew; then it undoes the job itself (default: the config's "
                   "groupLeaseS, else 30).")
@driver_opt
@control_opt
@json_opt
def serve(listen, config_file, node, snapshot_dir, metrics_port, metrics_addr, tls_cert, tls_key,
          tls_client_ca, insecure_tcp, group_lease_s, driver, control_dir, as_json):
    """Run the agent daemon: the gRPC Agent service (checkpoint, restore, inspect, snapshots,
    group phases), gRPC health checking and Prometheus metrics. Prints one line when ready
    (with --json: {"ok": true, "listen", "metrics_port", "node", "pid", "kubernetes",
    "insecure", "snapshot_dirs", "group_lease_s"}) and serves until SIGTERM, SIGINT or SIGHUP
    (then it finishes the requests already running and exits 0).

    Refuses (exit 2) a non-loopback TCP listener without mutual TLS unless --insecure-tcp;
    confines every request's paths to the snapshot dir(s) (docs/service.md "Security"),
    creating a missing one (mode 0700; exit 2 when it cannot)."""
    import logging
    import signal
    import socket
    import threading
    from cuinterpose.agent.rpc.client import TLS, default_address
    from cuinterpose.agent.rpc.security import listener_security
    from cuinterpose.agent.rpc.service import DEFAULT_SNAPSHOT_DIR, Server, ServeOptions
    given = dict(listen=listen, node=node, snapshot_dir=list(snapshot_dir) or None,
                 metrics_port=metrics_port, metrics_addr=metrics_addr, tls_cert=tls_cert,
                 tls_key=tls_key, tls_client_ca=tls_client_ca, insecure_tcp=insecure_tcp or None,
                 group_lease_s=group_lease_s, driver=driver, control_dir=control_dir)
    conf = _config_values(config_file) if config_file else {}
    v = {k: (given[k] if given[k] is not None else conf.get(k)) for k in given}
    metrics_addr = v["metrics_addr"] or "127.0.0.1"
    if bool(v["tls_cert"]) != bool(v["tls_key"]):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if v["tls_client_ca"] and not v["tls_cert"]:
        raise click.UsageError("--tls-client-ca needs --tls-cert and --tls-key (client "
                               "certificates are verified only on a TLS listener)")
    _set_env(v["driver"], v["control_dir"])
    tls = TLS(cert=v["tls_cert"], key=v["tls_key"], ca=v["tls_client_ca"])
    sd = v["snapshot_dir"]
    roots = [os.path.abspath(str(d)) for d in
             (sd if isinstance(sd, list) else [sd] if sd else [DEFAULT_SNAPSHOT_DIR])]
    addr = v["listen"] or default_address()
    try:
        security = listener_security(addr, tls if tls.enabled else None,
                                     bool(v["insecure_tcp"]))
    except ValueError as e:
        _fail(AgentError("serve", str(e), outcome="usage"), as_json, command="serve")
    opts = ServeOptions(node=v["node"] or socket.gethostname(),
                        control_dir=str(v["control_dir"]) if v["control_dir"] else None,
                        driver=v["driver"], snapshot_dir=roots[0], snapshot_roots=tuple(roots),
                        tls=tls if tls.enabled else None,
                        insecure_tcp=bool(v["insecure_tcp"]))
    if v["group_lease_s"] is not None:
        opts.group_lease_s = float(v["group_lease_s"])
    cfg = conf.get("_config")
    if cfg is not None:
        opts.quiesce_timeout_ms = cfg.quiesce_timeout_ms
        opts.lock_timeout_ms = cfg.lock_timeout_ms
        opts.phase_timeout_s = cfg.phase_timeout_s
        opts.carrier_timeout_s = cfg.carrier_timeout_s
    # last check before binding: nothing is created for a start refused above
    for d in roots:
        try:
            if _make_snapshot_dir(d):
                click.echo(f"cuinterpose-agent: created the snapshot dir {d} (mode 0700)",
                           err=True)
        except OSError as e:
            _fail(AgentError("serve", f"cannot create the snapshot dir {d}: "
                                      f"{e.strerror or e}", outcome="usage"),
                  as_json, command="serve")
    if conf.get("kubernetes") is not None:
        # before any thread starts: the node's cgroup paths (agent/kube/hostcgroup.py)
        from cuinterpose.agent.kube.hostcgroup import join_and_log
        join_and_log()
    try:
        srv = Server(addr, opts, metrics_port=v["metrics_port"],
                     metrics_addr=metrics_addr).start()
    except (OSError, RuntimeError, ValueError) as e:
        _fail(AgentError("serve", f"cannot listen on {v['listen'] or default_address()}: {e}",
                         outcome="usage"), as_json, command="serve")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    watcher = None
    if conf.get("kubernetes") is not None:
        from cuinterpose.agent.run.checkpoint import strip_preload_env
        strip_preload_env()
        try:
            watcher = _start_watcher(srv, cfg, stop)
        except click.UsageError:
            srv.stop(0)
            raise
    if security["insecure"]:
        banner = "!" * 78
        click.echo(f"{banner}\ncuinterpose-agent: {security['warning']}\n{banner}", err=True)
        logging.getLogger("cuinterpose.service").warning("%s", security["warning"])
    if as_json:
        click.echo(json.dumps({"ok": True, "listen": srv.address, "metrics_port": srv.metrics_port,
                               "node": opts.node, "pid": os.getpid(),
                               "kubernetes": watcher is not None,
                               "insecure": security["insecure"],
                               "snapshot_dirs": roots,
                               "group_lease_s": opts.group_lease_s}, sort_keys=True))
    else:
        click.echo(f"cuinterpose-agent {opts.node} serving on {srv.address}"
                   + (f", metrics on {metrics_addr}:{srv.metrics_port}" if srv.metrics_port
                      is not None else "")
                   + (" (INSECURE: no client authentication, --insecure-tcp)"
                      if security["insecure"] else ""))
    sys.stdout.flush()
    while not stop.wait(0.5):
        if watcher is not None and not watcher[1].is_alive():
            click.echo("cuinterpose-agent: the pod watcher stopped; shutting down", err=True)
            srv.stop()
            sys.exit(1)
    srv.stop()     # a running pod request finishes first (Server.stop closes the watcher)


@main.command()
@driver_opt
@control_opt
@json_opt
def doctor(driver, control_dir, as_json):
    """Check CRIU, the driver's checkpoint API, the shim and the control directory."""
    from cuinterpose.agent.doctor import run_checks, render
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
