"""The one-shot commands of ``cuinterpose-agent``: ``checkpoint``, ``restore``, ``inspect``,
``snapshots`` and ``release``: in-process, through an agent daemon (``--agent``), or leading a
group (``--group``) (docs/agent.md, docs/service.md)."""

from __future__ import annotations

import os

import click

from cuinterpose.agent import paths
from cuinterpose.agent.cli.common import (
    POSITIVE,
    BytesType,
    RemoteRows,
    agent_opt,
    client_tls,
    control_opt,
    driver_opt,
    emit_json,
    fail,
    group_opt,
    json_opt,
    live,
    load_members,
    manifest_key_opt,
    remote,
    reporter,
    set_env,
    tls_ca_opt,
    tls_cert_opt,
    tls_key_opt,
    use_manifest_key,
)
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.snapshot.snapdir import SnapshotDir
from cuinterpose.coordinator.protocol import default_control_dir

NATIVE_BACKEND_OPT = click.option(
    "--native-backend",
    type=click.Choice(["auto", "driver-api", "cuda-checkpoint"]),
    default=None,
    help="how native checkpoint is driven: the driver API (cuCheckpointProcess*), the "
    "cuda-checkpoint CLI, or auto (the API when libcuda.so.1 has it, else a cuda-checkpoint "
    "on $PATH; default: $CUINTERPOSE_NATIVE_BACKEND, else auto). In-process only: a daemon "
    "(--agent) uses its own.",
)


GPU_STORAGE_OPT = click.option(
    "--gpu-storage",
    type=click.Choice(["auto", "custom", "host"]),
    default=None,
    help="where native checkpoint puts each process's GPU memory: custom (the driver's custom "
    "storage, CUDA 13.4+: streamed by the agent to chunks/gpu-<pid>-<ordinal>.bin, outside "
    "CRIU's images), host (the driver stages it in the process's host memory, which CRIU "
    "dumps), or auto (custom where the driver has it) [default: $CUINTERPOSE_GPU_STORAGE, "
    "else auto].",
)


def _use_native_backend(kind) -> None:
    """Put ``--native-backend`` into ``$CUINTERPOSE_NATIVE_BACKEND`` (agent/mech/native.py
    reads it when it picks the backend)."""
    if kind:
        os.environ["CUINTERPOSE_NATIVE_BACKEND"] = kind


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
    help="new snapshot directory (not with --group; with --agent: sent as an "
    "absolute path, which must lie under the daemon's --snapshot-dir).",
)
@click.option("--quiesce-timeout-ms", type=click.IntRange(1), default=10_000, show_default=True)
@click.option(
    "--lock-timeout-ms",
    type=click.IntRange(0),
    default=10_000,
    show_default=True,
    help="cuCheckpointProcessLock timeout per process "
    "(0 = the driver-call deadline, $CUINTERPOSE_DRIVER_CALL_TIMEOUT_S).",
)
@click.option(
    "--phase-timeout-s",
    type=POSITIVE,
    default=60.0,
    show_default=True,
    help="deadline of each coordinator request (INSPECT, PREPARE_UNICAST, ...).",
)
@click.option(
    "--carrier-timeout-s",
    type=POSITIVE,
    default=3600.0,
    show_default=True,
    help="deadline of SAVE_ALLOCATIONS (writing shared bytes to the chunk files); a stopped "
    "participant fails it after --phase-timeout-s.",
)
@click.option(
    "--chunk-bytes",
    type=BytesType(64 << 10, 1 << 30),
    default=None,
    help="chunk size of the shared carriers' chunk files, a power of two from 64 KiB to 1 GiB, "
    "in bytes or with KiB/MiB/GiB (8MiB) [default: 8 MiB, "
    "or $CUINTERPOSE_CHUNK_BYTES].",
)
@click.option(
    "--staging-bytes",
    type=BytesType(64 << 10),
    default=None,
    help="staging ring per process for the chunk writers, at least the chunk size and at most "
    "64 GiB, in bytes or with KiB/MiB/GiB [default: 64 MiB, or "
    "$CUINTERPOSE_STAGING_BYTES].",
)
@click.option(
    "--writers",
    type=click.IntRange(1, 64),
    default=None,
    help="chunk writer threads per process [default: 4, or $CUINTERPOSE_WRITERS].",
)
@click.option(
    "--incremental",
    is_flag=True,
    help="write the shared carriers into the chunk store of the snapshot root (the images "
    "dir's parent): only chunks no snapshot there holds yet are written; delete snapshots "
    "with `cuinterpose-agent delete`.",
)
@click.option("--leave-running", is_flag=True, help="keep the workload running after the dump.")
@manifest_key_opt("node key file: the manifest gets an HMAC-SHA256 (mac) with it")
@driver_opt
@NATIVE_BACKEND_OPT
@GPU_STORAGE_OPT
@control_opt
@agent_opt
@group_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def checkpoint(
    pids,
    images_dir,
    quiesce_timeout_ms,
    lock_timeout_ms,
    phase_timeout_s,
    carrier_timeout_s,
    chunk_bytes,
    staging_bytes,
    writers,
    incremental,
    leave_running,
    manifest_key,
    driver,
    native_backend,
    gpu_storage,
    control_dir,
    agent_addr,
    group_file,
    tls_ca,
    tls_cert,
    tls_key,
    as_json,
):
    """Checkpoint the process tree(s) rooted at --pid into --images-dir."""
    from cuinterpose.agent.run import carriers, ops

    chunks = {
        k: v
        for k, v in (
            ("chunk_bytes", chunk_bytes),
            ("staging_bytes", staging_bytes),
            ("writers", writers),
        )
        if v is not None
    }
    try:
        carriers.settings(**chunks)
    except Exception as e:
        raise click.UsageError(str(e)) from None
    if incremental:
        chunks["incremental"] = True

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
    kw = dict(
        control_dir=control_dir,
        quiesce_timeout_ms=quiesce_timeout_ms,
        lock_timeout_ms=lock_timeout_ms,
        phase_timeout_s=phase_timeout_s,
        carrier_timeout_s=carrier_timeout_s,
        driver=driver,
        leave_running=leave_running,
    )
    try:
        from cuinterpose.agent import validate

        validate.checkpoint_request(roots=pids, images_dir=images_dir, **kw)
        if agent_addr or group_file:
            from cuinterpose.agent.snapshot import pb

            apb, _, _ = pb.modules()
            req = apb.CheckpointRequest(
                roots=list(pids),
                images_dir=paths.absolute(images_dir) if images_dir else "",
                options=apb.CheckpointOptions(
                    quiesce_timeout_ms=quiesce_timeout_ms,
                    lock_timeout_ms=lock_timeout_ms,
                    phase_timeout_s=phase_timeout_s,
                    carrier_timeout_s=carrier_timeout_s,
                    leave_running=leave_running,
                    driver=driver or "",
                    control_dir=paths.absolute(control_dir) if control_dir else "",
                    chunk_bytes=chunks.get("chunk_bytes", 0),
                    staging_bytes=chunks.get("staging_bytes", 0),
                    writers=chunks.get("writers", 0),
                    gpu_storage=gpu_storage or "",
                    incremental=incremental,
                ),
                members=load_members(group_file, "checkpoint") if group_file else [],
            )
            if agent_addr:
                out = remote(agent_addr, "Checkpoint", req, rep, sink, tls)
            else:
                from cuinterpose.agent.rpc.group import lead

                out = live(sink, lambda: lead("checkpoint", req, rep, RemoteRows(rep), tls=tls)[0])
        else:
            set_env(driver, control_dir)
            _use_native_backend(native_backend)
            out = live(
                sink,
                lambda: ops.checkpoint(
                    rep, pids, images_dir, chunks=chunks, gpu_storage=gpu_storage, **kw
                )[0],
            )
    except AgentError as e:
        fail(e, as_json, {"phases": getattr(e, "remote_phases", None) or rep.to_list()})
    if as_json:
        emit_json(out)
    elif group_file:
        click.echo(
            f"group checkpoint {out['request_id']}: "
            + ", ".join(f"{m['node']} -> {m['images_dir']}" for m in out["members"])
        )
    else:
        click.echo(f"snapshot {out['snapshot_id']} written to {out['images_dir']}")


@click.command()
@click.option(
    "--images-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="the snapshot directory (with --agent: sent as an absolute path, which must "
    "lie under the daemon's --snapshot-dir).",
)
@click.option(
    "--phase-timeout-s",
    type=POSITIVE,
    default=60.0,
    show_default=True,
    help="deadline of each coordinator request (INSPECT, RESTORE_UNICAST, ...).",
)
@click.option(
    "--carrier-timeout-s",
    type=POSITIVE,
    default=3600.0,
    show_default=True,
    help="deadline of LOAD_ALLOCATIONS (copying the carried bytes back); a stopped "
    "participant fails it after --phase-timeout-s.",
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
@click.option(
    "--driver",
    type=click.Choice(["real", "fake"]),
    default=None,
    help="libcuda.so.1 to use: real or fakecuda (default: $CUINTERPOSE_DRIVER, else "
    "the driver the manifest records).",
)
@NATIVE_BACKEND_OPT
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
    phase_timeout_s,
    carrier_timeout_s,
    into_pid,
    device_map,
    driver,
    native_backend,
    manifest_key,
    agent_addr,
    group_file,
    tls_ca,
    tls_cert,
    tls_key,
    as_json,
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

        validate.restore_request(
            images_dir=images_dir,
            phase_timeout_s=phase_timeout_s,
            carrier_timeout_s=carrier_timeout_s,
            placement=into_pid,
        )
        if agent_addr or group_file:
            from cuinterpose.agent.snapshot import pb

            apb, _, _ = pb.modules()
            req = apb.RestoreRequest(
                images_dir=paths.absolute(images_dir) if images_dir else "",
                driver=driver or "",
                phase_timeout_s=phase_timeout_s,
                carrier_timeout_s=carrier_timeout_s,
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
            if not SnapshotDir.canonical(images_dir).exists():
                from cuinterpose.agent.errors import SnapshotError

                raise SnapshotError("manifest", f"{paths.canonical(images_dir)} does not exist")
            set_env(driver, None)
            _use_native_backend(native_backend)
            res = live(
                sink,
                lambda: ops.restore(
                    rep,
                    images_dir,
                    driver=driver,
                    phase_timeout_s=phase_timeout_s,
                    carrier_timeout_s=carrier_timeout_s,
                    placement=into_pid,
                    device_map=device_map,
                ),
            )
    except AgentError as e:
        fail(
            e,
            as_json,
            {"phases": getattr(e, "remote_phases", None) or rep.to_list()},
            command="restore",
        )
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
@click.option("--phase-timeout-s", type=POSITIVE, default=10.0, show_default=True)
@control_opt
@agent_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def inspect(pid, phase_timeout_s, control_dir, agent_addr, tls_ca, tls_cert, tls_key, as_json):
    """INSPECT one process through its control socket (read-only)."""
    from cuinterpose.agent.inspect import render_table
    from cuinterpose.agent.run import ops

    try:
        if agent_addr:
            from cuinterpose.agent.run.report import Reporter
            from cuinterpose.agent.snapshot import pb

            apb, _, _ = pb.modules()
            req = apb.InspectRequest(
                pid=pid,
                timeout_s=phase_timeout_s,
                control_dir=paths.absolute(control_dir) if control_dir else "",
            )
            res = remote(
                agent_addr, "Inspect", req, Reporter(), None, client_tls(tls_ca, tls_cert, tls_key)
            )
        else:
            set_env(None, control_dir)
            res = ops.inspect(pid, control_dir=control_dir, timeout_s=phase_timeout_s)
    except AgentError as e:
        fail(e, as_json, command="inspect")
    res.pop("ok", None)
    if as_json:
        emit_json({"ok": True, **res})
    else:
        render_table(res)


@click.command("snapshots")
@click.argument("path", required=False, type=click.Path(file_okay=False))
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False),
    default=None,
    help="directory whose sub-directories are snapshots (with --agent: default the "
    "agent's --snapshot-dir); also accepted as the argument PATH.",
)
@agent_opt
@tls_ca_opt
@tls_cert_opt
@tls_key_opt
@json_opt
def snapshots_cmd(path, directory, agent_addr, tls_ca, tls_cert, tls_key, as_json):
    """List the snapshots (directories holding manifest.json) under PATH / --dir, or PATH
    itself when it is a snapshot."""
    from cuinterpose.agent.run import ops

    if path and directory and paths.canonical(path) != paths.canonical(directory):
        raise click.UsageError("give the directory either as PATH or as --dir, not both")
    directory = directory or path
    try:
        if agent_addr:
            from cuinterpose.agent.run.report import Reporter
            from cuinterpose.agent.snapshot import pb

            apb, _, _ = pb.modules()
            req = apb.ListSnapshotsRequest(dir=paths.absolute(directory) if directory else "")
            res = remote(
                agent_addr,
                "ListSnapshots",
                req,
                Reporter(),
                None,
                client_tls(tls_ca, tls_cert, tls_key),
            )
        else:
            if not directory:
                raise click.UsageError("--dir is required without --agent")
            res = ops.list_snapshots(directory)
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
    With --agent, the daemon deletes it (IMAGES_DIR must lie under its --snapshot-dir)."""
    from cuinterpose.agent.snapshot import store

    try:
        if agent_addr:
            from cuinterpose.agent.run.report import Reporter
            from cuinterpose.agent.snapshot import pb

            apb, _, _ = pb.modules()
            req = apb.DeleteSnapshotRequest(images_dir=paths.absolute(images_dir))
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
            res = store.delete(images_dir)
    except AgentError as e:
        fail(e, as_json, command="delete")
    if as_json:
        emit_json({"ok": True, **res})
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
    from cuinterpose.agent.mech import ctldir
    from cuinterpose.agent.run import recover

    cdir = paths.canonical(control_dir or default_control_dir())
    try:
        ctldir.check(cdir, phase="release", pid=pid)
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
