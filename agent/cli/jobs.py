"""The one-shot commands of ``cuinterpose-agent``: ``checkpoint``, ``restore``, ``inspect``,
``snapshots`` and ``release``: in-process, through an agent daemon (``--agent``), or leading a
group (``--group``) (docs/agent.md, docs/service.md)."""

from __future__ import annotations

import click

from cuinterpose.agent import paths
from cuinterpose.agent.cli.common import (
    RemoteRows,
    agent_opt,
    build_options,
    client_tls,
    control_opt,
    emit_json,
    fail,
    group_opt,
    images_dir_arg,
    json_opt,
    live,
    load_members,
    manifest_key_opt,
    option_flags,
    remote,
    remote_options,
    reporter,
    storage_options,
    tls_ca_opt,
    tls_cert_opt,
    tls_key_opt,
    use_manifest_key,
)
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.options import (
    CheckpointOptions,
    DriverOptions,
    InspectOptions,
    RestoreOptions,
)
from cuinterpose.agent.run import interrupt
from cuinterpose.agent.snapshot.snapdir import SnapshotDir
from cuinterpose.coordinator.protocol import default_control_dir


@click.command()
@click.option(
    "--pid",
    "pids",
    type=int,
    multiple=True,
    help="root of a process tree to checkpoint (repeatable; not with --group).",
)
@click.option(
    "--images-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="new snapshot directory, or s3://BUCKET/PREFIX: the snapshot goes into that object "
    "store (written locally first, see --local-dir; endpoint and keys from the standard AWS "
    "variables and files). Not with --group; with --agent: sent as an absolute path (an "
    "s3:// location as written), which must lie under the daemon's --snapshot-dir.",
)
@option_flags(CheckpointOptions)
@manifest_key_opt("node key file: the manifest gets an HMAC-SHA256 (mac) with it")
@agent_opt
@group_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def checkpoint(
    pids,
    images_dir,
    manifest_key,
    agent_addr,
    group_file,
    tls_ca,
    tls_cert,
    tls_key,
    as_json,
    **flags,
):
    """Checkpoint the process tree(s) rooted at --pid into --images-dir. Every option
    (docs/agent.md "Options") not given takes its environment variable, else its default; with
    --agent or --group, the daemon's own."""
    from cuinterpose.agent.run import ops

    if group_file:
        if pids or images_dir:
            raise click.UsageError(
                "--group names each member's roots and images dir; "
                "do not pass --pid or --images-dir with it"
            )
    elif not pids:
        raise click.UsageError("Missing option '--pid'.")
    elif not images_dir:
        raise click.UsageError("Missing option '--images-dir'.")
    use_manifest_key(manifest_key, remote=bool(agent_addr or group_file))
    tls = client_tls(tls_ca, tls_cert, tls_key)
    title = (
        f"group checkpoint {group_file}"
        if group_file
        else f"checkpoint {' '.join(map(str, pids))} -> {images_dir}"
    )
    rep, sink = reporter(title, as_json)
    try:
        from cuinterpose.agent import validate

        validate.checkpoint_request(roots=pids, images_dir=images_dir)
        before_run("checkpoint", "nothing was torn down, the workload keeps running")
        if agent_addr or group_file:
            from cuinterpose.agent.snapshot import pb

            apb, _, _ = pb.modules()
            req = apb.CheckpointRequest(
                roots=list(pids),
                images_dir=images_dir_arg(images_dir),
                options=remote_options(CheckpointOptions, flags, apb.CheckpointOptions()),
                members=load_members(group_file, "checkpoint") if group_file else [],
            )
            if agent_addr:
                out = remote(agent_addr, "Checkpoint", req, rep, sink, tls)
            else:
                from cuinterpose.agent.rpc.group import lead

                out = live(sink, lambda: lead("checkpoint", req, rep, RemoteRows(rep), tls=tls)[0])
        else:
            opts = build_options(CheckpointOptions, flags)
            where = remote_of(images_dir, opts, "checkpoint")
            out = live(sink, lambda: ops.checkpoint(rep, pids, images_dir, opts, where)[0])
    except AgentError as e:
        interrupt.settle()
        fail(e, as_json, {"phases": getattr(e, "remote_phases", None) or rep.to_list()})
    interrupt.settle()
    if as_json:
        emit_json(out)
    elif group_file:
        click.echo(
            f"group checkpoint {out['request_id']}: "
            + ", ".join(f"{m['node']} -> {m['images_dir']}" for m in out["members"])
        )
    elif "upload" in out:
        u = out["upload"]
        click.echo(
            f"snapshot {out['snapshot_id']} uploaded to {out['images_dir']}: "
            f"{u['chunks_uploaded']} chunks ({u['chunk_bytes_uploaded']} bytes) sent, "
            f"{u['chunks_present']} already there, {u['images']} images ({u['image_bytes']} "
            f"bytes); local copy {out['local_dir']} " + ("kept" if out["local_kept"] else "removed")
        )
    else:
        click.echo(f"snapshot {out['snapshot_id']} written to {out['images_dir']}")


def before_run(what: str, effect: str) -> None:
    """Right before a one-shot run starts: a signal that came since the command started
    (agent/run/interrupt.py ``hold``) refuses it (phase "request", exit 3; ``effect``: what
    was left, in the command's words). ``before:request`` is the test trigger's point here."""
    from cuinterpose.agent.mech import signal_at
    from cuinterpose.agent.run import checkpoint, restore

    signal_at.register_steps(s.name for s in (*checkpoint.Checkpoint.STEPS, *restore.Restore.STEPS))

    signal_at.signal_point("before", "request")
    interrupt.refuse_if_stopped(what, effect)


def remote_of(images_dir, opts, kind: str):
    """The agent/run/remote.py ``Remote`` of an in-process run into or from ``images_dir``
    (None for a local path): the options' ``local_dir`` and ``keep_local``, the S3 settings
    read here, once (common.py ``storage_options``)."""
    from cuinterpose.agent.run import remote as remote_mod

    return remote_mod.make(
        images_dir,
        storage_options(images_dir),
        kind=kind,
        local_dir=opts.local_dir,
        keep_local=opts.keep_local,
    )


@click.command()
@click.option(
    "--images-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="the snapshot directory, or s3://BUCKET/PREFIX: a snapshot in that object store, "
    "downloaded first (see --local-dir; endpoint and keys from the standard AWS variables and "
    "files). With --agent: sent as an absolute path (an s3:// location as written), which "
    "must lie under the daemon's --snapshot-dir.",
)
@click.option(
    "--into-pid",
    type=click.IntRange(min=1),
    default=None,
    metavar="PID",
    help="restore into the cgroups, namespaces and stdio of this running process (a "
    "placeholder container's init): CRIU joins its net, ipc and uts namespaces "
    "(--join-ns) and runs inside its mount namespace (CRIU's child enters it), "
    "pipes of the trees to outside them get its stdin/stdout/stderr, and files "
    "they had opened outside their mount namespace get its fd of the same kind "
    "(else their recorded path, reopened).",
)
@click.option(
    "--device-map",
    default=None,
    metavar="OLD=NEW[,...]",
    help="restore onto other GPUs: each GPU of the snapshot (UUID, or the ordinal its "
    "processes saw) onto a GPU this agent sees (UUID or ordinal); every checkpointed GPU "
    "must be listed, each onto one of the same model with at least its memory. Default: "
    "the processes' own GPUs, or when those are absent an automatic mapping "
    '(docs/agent.md "Restore onto other GPUs"). With --agent the daemon\'s GPUs; with '
    '--group each member names its own "device_map" instead.',
)
@option_flags(RestoreOptions)
@manifest_key_opt(
    "node key file: a snapshot whose manifest has no valid HMAC-SHA256 (mac) with it is refused"
)
@agent_opt
@group_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def restore(
    images_dir,
    into_pid,
    device_map,
    manifest_key,
    agent_addr,
    group_file,
    tls_ca,
    tls_cert,
    tls_key,
    as_json,
    **flags,
):
    """Restore the snapshot in --images-dir and let the workload continue. There is no
    --control-dir: the restore uses the control dir recorded in the snapshot's manifest."""
    from cuinterpose.agent.run import ops

    if group_file and images_dir:
        raise click.UsageError("--group names each member's images dir; do not pass --images-dir")
    if group_file and into_pid:
        raise click.UsageError(
            "--into-pid places a single-node restore; in a group restore "
            'each member of the --group file names its own "into_pid"'
        )
    if not group_file and not images_dir:
        raise click.UsageError("Missing option '--images-dir'.")
    if device_map and group_file:
        raise click.UsageError(
            "--device-map maps one node's GPUs; in a group restore each member of the --group "
            'file names its own "device_map"'
        )
    use_manifest_key(manifest_key, remote=bool(agent_addr or group_file))
    tls = client_tls(tls_ca, tls_cert, tls_key)
    rep, sink = reporter(
        f"group restore {group_file}" if group_file else f"restore {images_dir}", as_json
    )
    try:
        from cuinterpose.agent import validate

        validate.restore_request(images_dir=images_dir, placement=into_pid)
        before_run("restore", "nothing was changed, the snapshot is untouched")
        if agent_addr or group_file:
            from cuinterpose.agent.snapshot import pb

            apb, _, _ = pb.modules()
            req = apb.RestoreRequest(
                images_dir=images_dir_arg(images_dir),
                options=remote_options(RestoreOptions, flags, apb.RestoreOptions()),
                members=load_members(group_file, "restore") if group_file else [],
                into_pid=into_pid or 0,
                device_map=device_map or "",
            )
            if agent_addr:
                res = remote(agent_addr, "Restore", req, rep, sink, tls)
            else:
                from cuinterpose.agent.rpc.group import lead

                res = live(sink, lambda: lead("restore", req, rep, RemoteRows(rep), tls=tls)[0])
        else:
            opts = build_options(RestoreOptions, flags)
            where = remote_of(images_dir, opts, "restore")
            if where is None and not SnapshotDir.canonical(images_dir).exists():
                from cuinterpose.agent.errors import SnapshotError

                raise SnapshotError("manifest", f"{paths.canonical(images_dir)} does not exist")
            res = live(
                sink,
                lambda: ops.restore(
                    rep, images_dir, opts, where, placement=into_pid, device_map=device_map
                ),
            )
    except AgentError as e:
        interrupt.settle()
        fail(
            e,
            as_json,
            {"phases": getattr(e, "remote_phases", None) or rep.to_list()},
            command="restore",
        )
    interrupt.settle()
    if as_json:
        emit_json(res)
    elif group_file:
        click.echo(
            f"group restore {res['request_id']}: " + ", ".join(m["node"] for m in res["members"])
        )
    else:
        click.echo(f"restored {res['snapshot_id']}: roots {', '.join(map(str, res['roots']))}")


@click.command()
@click.option("--pid", type=int, required=True)
@option_flags(InspectOptions)
@agent_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def inspect(pid, agent_addr, tls_ca, tls_cert, tls_key, as_json, **flags):
    """INSPECT one process through its control socket (read-only), and ask the driver
    (--driver) for its checkpoint state."""
    from cuinterpose.agent.inspect import render_table
    from cuinterpose.agent.run import ops

    try:
        if agent_addr:
            from cuinterpose.agent.run.report import Reporter
            from cuinterpose.agent.snapshot import pb

            apb, _, _ = pb.modules()
            req = apb.InspectRequest(
                pid=pid, options=remote_options(InspectOptions, flags, apb.InspectOptions())
            )
            res = remote(
                agent_addr, "Inspect", req, Reporter(), None, client_tls(tls_ca, tls_cert, tls_key)
            )
        else:
            res = ops.inspect(pid, build_options(InspectOptions, flags))
    except AgentError as e:
        fail(e, as_json, command="inspect")
    res.pop("ok", None)
    if as_json:
        emit_json({"ok": True, **res})
    else:
        render_table(res)


def _same(path: str) -> str:
    """What two spellings of one snapshot dir (or location) compare as."""
    from cuinterpose.agent.snapshot import backends

    return path.rstrip("/") if backends.is_remote(path) else paths.canonical(path)


@click.command("snapshots")
@click.argument("path", required=False, type=click.Path(file_okay=False))
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False),
    default=None,
    help="directory whose sub-directories are snapshots, or s3://BUCKET[/PREFIX] (the "
    "snapshots under that prefix of an object store; endpoint and keys from the standard AWS "
    "variables and files), also accepted as the argument PATH [default: the agent's "
    f"--snapshot-dir: with --agent the daemon's, else {paths.DEFAULT_SNAPSHOT_DIR}, serve's "
    "default].",
)
@agent_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def snapshots_cmd(path, directory, agent_addr, tls_ca, tls_cert, tls_key, as_json):
    """List the snapshots (directories holding manifest.json) under PATH / --dir, or PATH
    itself when it is a snapshot; the same with and without --agent."""
    from cuinterpose.agent.run import ops

    if path and directory and _same(path) != _same(directory):
        raise click.UsageError("give the directory either as PATH or as --dir, not both")
    directory = directory or path
    try:
        if agent_addr:
            from cuinterpose.agent.run.report import Reporter
            from cuinterpose.agent.snapshot import pb

            apb, _, _ = pb.modules()
            req = apb.ListSnapshotsRequest(dir=images_dir_arg(directory))
            res = remote(
                agent_addr,
                "ListSnapshots",
                req,
                Reporter(),
                None,
                client_tls(tls_ca, tls_cert, tls_key),
            )
        else:
            directory = directory or paths.DEFAULT_SNAPSHOT_DIR
            res = ops.list_snapshots(directory, storage_options(directory))
    except AgentError as e:
        fail(e, as_json, command="snapshots")
    if as_json:
        emit_json(res)
        return
    from cuinterpose.agent.run.report import render_snapshots

    render_snapshots(res)


@click.command("delete")
@click.argument("images_dir", type=click.Path(file_okay=False))
@agent_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def delete_cmd(images_dir, agent_addr, tls_ca, tls_cert, tls_key, as_json):
    """Delete the snapshot IMAGES_DIR and free the chunk store packs of its root that no
    other snapshot there uses (incremental snapshots; a plain snapshot is just removed).
    IMAGES_DIR may be s3://BUCKET/PREFIX: its objects go, then the bucket's chunks that no
    other snapshot (and no upload in progress) refers to. With --agent, the daemon deletes it
    (IMAGES_DIR must lie under its --snapshot-dir)."""
    from cuinterpose.agent.run import ops

    try:
        if agent_addr:
            from cuinterpose.agent.run.report import Reporter
            from cuinterpose.agent.snapshot import pb

            apb, _, _ = pb.modules()
            req = apb.DeleteSnapshotRequest(images_dir=images_dir_arg(images_dir))
            res = remote(
                agent_addr,
                "DeleteSnapshot",
                req,
                Reporter(),
                None,
                client_tls(tls_ca, tls_cert, tls_key),
            )
            res.pop("ok", None)
        else:
            res = ops.delete_snapshot(images_dir, storage_options(images_dir))
            res.pop("ok", None)
    except AgentError as e:
        fail(e, as_json, command="delete")
    if as_json:
        emit_json({"ok": True, **res})
    elif "chunks_removed" in res:
        click.echo(
            f"deleted {res['deleted']} ({res['objects_removed']} objects); chunks: "
            f"{res['chunks_removed']} removed, {res['chunks_kept']} kept, "
            f"{res['chunk_bytes_freed']} bytes freed"
        )
    else:
        click.echo(
            f"deleted {res['deleted']}; chunk store: {res['packs_removed']} packs removed, "
            f"{res['packs_kept']} kept, {res['pack_bytes_freed']} bytes freed"
        )


@click.command("release")
@click.option("--pid", type=int, required=True, help="root pid whose pending request to answer.")
@click.option(
    "--force",
    is_flag=True,
    help="resume without rebuilding: for a lock without records (an older agent's) or one "
    "whose rollback already failed, where the shared memory may be torn down.",
)
@control_opt
@json_opt
def release_cmd(pid, force, control_dir, as_json):
    """Release a job parked by a quiesce request no live agent will answer (an agent killed
    mid-checkpoint, a stale .request). When the dead agent's lock says its checkpoint had
    started (native lock, capture, dump), first finish the rollback it would have done (kill a
    leftover CRIU, SIGCONT, native restore + unlock, the shims back to ACTIVE) and remove the
    partial images (a complete snapshot is kept); then write .resume {"id": <the request's
    id>, "restored": false, ...}. Refused while a live agent owns the request."""
    from cuinterpose.agent.mech import ctldir, native_call
    from cuinterpose.agent.run import recover

    cdir = paths.canonical(control_dir or default_control_dir())
    try:
        from cuinterpose.agent import validate

        validate.pids("pid", [pid])
        ctldir.check(cdir, phase="release", pid=pid)
        # the driver the dead agent's lock records; the backend and the call deadline: ours
        with native_call.using(DriverOptions.from_environ()):
            res = recover.release(cdir, pid, force=force)
    except AgentError as e:
        e.hint = getattr(e, "hint", None) or (
            "the workload stays parked" if e.outcome == "rollback_failed" else "nothing was changed"
        )
        fail(e, as_json, command="release")
    if as_json:
        emit_json({"ok": True, **res})
    elif res.get("recovered"):
        click.echo(recover.render(res))
    else:
        click.echo(
            f"released pid {pid}: wrote {res['resume']} answering request "
            f"{res['request_id']} (cancelled)"
            + (" and removed the dead agent's lock" if res["removed_lock"] else "")
        )
