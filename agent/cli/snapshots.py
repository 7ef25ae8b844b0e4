"""The snapshot-store commands of ``cuinterpose-agent``: ``snapshots`` (list) and ``delete``,
on a local snapshot root or an object store (``s3://BUCKET/PREFIX``), in-process or through an
agent daemon (``--agent``) (docs/agent.md "Listing and deleting snapshots")."""

from __future__ import annotations

import click

from cuinterpose.agent import paths
from cuinterpose.agent.cli.common import (
    agent_opt,
    client_tls,
    emit_json,
    fail,
    images_dir_arg,
    json_opt,
    remote,
    storage_options,
    tls_ca_opt,
    tls_cert_opt,
    tls_key_opt,
)
from cuinterpose.agent.errors import AgentError


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
    "variables and files). With --agent: default the agent's --snapshot-dir. Also accepted as "
    "the argument PATH.",
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
            if not directory:
                raise click.UsageError("--dir is required without --agent")
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
