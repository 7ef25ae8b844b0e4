"""The daemon commands of ``cuinterpose-agent``: ``serve`` (the gRPC agent service, health,
metrics and, with a Kubernetes config, the pod watcher; docs/service.md) and ``health``."""

from __future__ import annotations

import json
import os
import sys

import click

from cuinterpose.agent import paths
from cuinterpose.agent.cli.common import (
    POSITIVE,
    client_tls,
    fail,
    flag_of,
    json_opt,
    option_flags,
    tls_ca_opt,
    tls_cert_opt,
    tls_key_opt,
    use_manifest_key,
)
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.options import CheckpointOptions, for_kinds, given_of


@click.command("health")
@click.option(
    "--agent",
    "agent_addr",
    default=None,
    metavar="ADDR",
    help="agent address (default $CUINTERPOSE_AGENT_ADDR or unix:/tmp/cuinterpose-agent.sock).",
)
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
        st = health(addr, service, tls=client_tls(tls_ca, tls_cert, tls_key))
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
    return {
        "listen": cfg.listen_address or None,
        "node": k.node_name or os.environ.get("NODE_NAME"),
        "snapshot_dir": cfg.snapshot_dir or None,
        "staging_dir": cfg.staging_dir or None,
        "metrics_port": cfg.metrics_port,
        "metrics_addr": cfg.metrics_address or None,
        "tls_cert": cfg.tls.cert_file or None,
        "tls_key": cfg.tls.key_file or None,
        "manifest_key": cfg.manifest_key_file or None,
        "tls_client_ca": cfg.tls.ca_file or None,
        "insecure_tcp": cfg.insecure_tcp or None,
        "group_lease_s": cfg.group_lease_s,
        "kubernetes": k if k.enabled else None,
        "_config": cfg,
    }


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
    is not a directory raises ``NotADirectoryError``. An object-store root (``s3://``) is
    left to the store (False)."""
    if "://" in d or os.path.isdir(d):
        return False
    if os.path.lexists(d):
        raise NotADirectoryError(20, "exists and is not a directory")
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)  # the umask may have narrowed it, never widened; be exact
    return True


def _root(d: str) -> str:
    """A snapshot root as the daemon keeps it: a local path canonical, an ``s3://`` location
    normalized (a malformed one is a usage error)."""
    if "://" not in d:
        return paths.canonical(d)
    from cuinterpose.agent.snapshot.backends.api import StorageError, parse_location

    try:
        return str(parse_location(d, root=True)).rstrip("/")
    except StorageError as e:
        raise click.UsageError(f"--snapshot-dir: {e.reason}") from None


def _storage(roots: list, as_json: bool):
    """The ``StorageOptions`` of the daemon's ``s3://`` roots (None without one): the S3
    settings resolved once, at start, from the AWS variables and files
    (agent/snapshot/backends/awsconf.py), and the node key; bad settings stop the start."""
    if not any("://" in r for r in roots):
        return None
    from cuinterpose.agent.snapshot import trust
    from cuinterpose.agent.snapshot.backends import awsconf
    from cuinterpose.agent.snapshot.backends.api import StorageOptions

    try:
        return StorageOptions(s3=awsconf.resolve(), node_key=trust.node_key())
    except AgentError as e:
        fail(AgentError("serve", str(e), outcome="usage"), as_json, command="serve")


@click.command()
@click.option(
    "--listen",
    default=None,
    metavar="ADDR",
    help="unix:/path (default $CUINTERPOSE_AGENT_ADDR or "
    "unix:/tmp/cuinterpose-agent.sock) or host:port (TCP; TLS with --tls-cert).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="YAML agent config; options given on the command line win.",
)
@click.option(
    "--node",
    default=None,
    help="this agent's name in group events (default: the "
    "config's kubernetes.nodeName, else $NODE_NAME, else the host name).",
)
@click.option(
    "--snapshot-dir",
    type=click.Path(file_okay=False),
    multiple=True,
    help="the directory requests are confined to: every images dir of a checkpoint "
    "or restore and every snapshots dir must resolve under it; ListSnapshots "
    "lists it by default. The CLI sends --images-dir/--dir as absolute paths "
    "(a relative one is taken from the CLI's working directory); a relative path "
    "in a request (a --group file's images_dir, another gRPC client) is taken "
    "relative to the first root. Repeat for more roots (the first is the "
    "default). Created at start (mode 0700) when missing. A root may be "
    "s3://BUCKET[/PREFIX]: snapshots in that object store (endpoint and keys from the "
    "standard AWS variables and files, read at start; local copies under --staging-dir). "
    "Default: the config's snapshotDir, else /var/lib/cuinterpose/snapshots.",
)
@click.option(
    "--staging-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="where the local copies of s3:// snapshots go while a checkpoint writes or a "
    "restore reads them (STAGING/checkpoint/BUCKET/PREFIX, STAGING/restore/...). Default: "
    "the config's stagingDir, else /var/lib/cuinterpose/staging.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="serve Prometheus metrics on this port (0: a free port the OS picks; "
    "not given: no metrics, unless the config's metricsPort).",
)
@click.option(
    "--metrics-addr",
    default=None,
    help="address of the metrics endpoint (default: the config's metricsAddress, else 127.0.0.1).",
)
@click.option(
    "--tls-cert",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="server certificate (PEM) for a TCP listener; also the client certificate "
    "a leader presents to members.",
)
@click.option("--tls-key", type=click.Path(dir_okay=False, exists=True), default=None)
@click.option(
    "--manifest-key",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="node key file: every manifest written gets an HMAC-SHA256 (mac) and a restore "
    "refuses a snapshot without a valid one (default: the config's manifestKeyFile, else "
    "none; docs/snapshot-format.md).",
)
@click.option(
    "--tls-client-ca",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="require client certificates signed by this CA (mutual TLS); also verifies "
    "members when leading a group.",
)
@click.option(
    "--insecure-tcp",
    is_flag=True,
    default=None,
    help="allow a non-loopback TCP listener without mutual TLS (plaintext, or TLS "
    "without --tls-client-ca): anyone who reaches it can checkpoint and restore "
    'as root. Logs a loud warning; the ready line says "insecure": true.',
)
@click.option(
    "--group-lease-s",
    type=POSITIVE,
    default=None,
    help="seconds a group member keeps a request's job past its leader's last "
    "RunPhase or Renew; then it undoes the job itself (default: the config's "
    "groupLeaseS, else 30).",
)
# every option of a checkpoint as the node's default, but one local copy for all requests
@option_flags(CheckpointOptions, only=[n for n in CheckpointOptions.names() if n != "local_dir"])
@json_opt
def serve(
    listen,
    config_file,
    node,
    snapshot_dir,
    staging_dir,
    metrics_port,
    metrics_addr,
    tls_cert,
    tls_key,
    manifest_key,
    tls_client_ca,
    insecure_tcp,
    group_lease_s,
    as_json,
    **flags,
):
    """Run the agent daemon: the gRPC Agent service (checkpoint, restore, inspect, snapshots,
    group phases), gRPC health checking and Prometheus metrics. Prints one line when ready
    (with --json: {"ok": true, "listen", "metrics_port", "node", "pid", "kubernetes",
    "insecure", "snapshot_dirs", "group_lease_s"}) and serves until SIGTERM, SIGINT or SIGHUP
    (then it finishes the requests already running and exits 0).

    The option flags (docs/agent.md "Options") are the daemon's own options: a request that
    leaves one unset takes it from these, else from the config, the environment, the
    default.

    Refuses (exit 2) a non-loopback TCP listener without mutual TLS unless --insecure-tcp,
    and a Unix socket another live process (a running daemon) listens on, naming its pid;
    confines every request's paths to the snapshot dir(s) (docs/service.md "Security"),
    creating a missing one (mode 0700; exit 2 when it cannot)."""
    import logging
    import signal
    import socket
    import threading

    from cuinterpose.agent.rpc.client import TLS, default_address
    from cuinterpose.agent.rpc.security import listener_security
    from cuinterpose.agent.rpc.service import DEFAULT_SNAPSHOT_DIR, ServeOptions, Server

    # the daemon's log (stderr): one line per request's start and outcome, with the time
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )

    given = dict(
        listen=listen,
        node=node,
        snapshot_dir=list(snapshot_dir) or None,
        staging_dir=staging_dir,
        metrics_port=metrics_port,
        metrics_addr=metrics_addr,
        tls_cert=tls_cert,
        tls_key=tls_key,
        manifest_key=manifest_key,
        tls_client_ca=tls_client_ca,
        insecure_tcp=insecure_tcp or None,
        group_lease_s=group_lease_s,
    )
    conf = _config_values(config_file) if config_file else {}
    v = {k: (given[k] if given[k] is not None else conf.get(k)) for k in given}
    metrics_addr = v["metrics_addr"] or "127.0.0.1"
    if bool(v["tls_cert"]) != bool(v["tls_key"]):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if v["tls_client_ca"] and not v["tls_cert"]:
        raise click.UsageError(
            "--tls-client-ca needs --tls-cert and --tls-key (client "
            "certificates are verified only on a TLS listener)"
        )
    cfg = conf.get("_config")
    # the daemon's own options, once: the environment, the config over it, the flags over that
    try:
        values = (cfg.option_values() if cfg is not None else {}) | given_of(
            CheckpointOptions, flags
        )
        node_options = for_kinds(values, os.environ, label=flag_of)
    except AgentError as e:
        fail(AgentError("serve", e.reason, outcome="usage"), as_json, command="serve")
    use_manifest_key(v["manifest_key"], remote=False)
    tls = TLS(cert=v["tls_cert"], key=v["tls_key"], ca=v["tls_client_ca"])
    sd = v["snapshot_dir"]
    roots = [
        _root(str(d))
        for d in (sd if isinstance(sd, list) else [sd] if sd else [DEFAULT_SNAPSHOT_DIR])
    ]
    storage = _storage(roots, as_json)
    addr = v["listen"] or default_address()
    try:
        security = listener_security(addr, tls if tls.enabled else None, bool(v["insecure_tcp"]))
    except ValueError as e:
        fail(AgentError("serve", str(e), outcome="usage"), as_json, command="serve")
    opts = ServeOptions(
        node=v["node"] or socket.gethostname(),
        options=node_options,
        snapshot_dir=roots[0],
        snapshot_roots=tuple(roots),
        staging_dir=paths.canonical(v["staging_dir"]) if v["staging_dir"] else None,
        storage=storage,
        tls=tls if tls.enabled else None,
        insecure_tcp=bool(v["insecure_tcp"]),
    )
    if v["group_lease_s"] is not None:
        opts.group_lease_s = float(v["group_lease_s"])
    # last check before binding: nothing is created for a start refused above
    for d in roots:
        try:
            if _make_snapshot_dir(d):
                click.echo(f"cuinterpose-agent: created the snapshot dir {d} (mode 0700)", err=True)
        except OSError as e:
            fail(
                AgentError(
                    "serve",
                    f"cannot create the snapshot dir {d}: {e.strerror or e}",
                    outcome="usage",
                ),
                as_json,
                command="serve",
            )
    if conf.get("kubernetes") is not None:
        # before any thread starts: the node's cgroup paths (agent/kube/hostcgroup.py)
        from cuinterpose.agent.kube.hostcgroup import join_and_log

        join_and_log()
    try:
        srv = Server(addr, opts, metrics_port=v["metrics_port"], metrics_addr=metrics_addr).start()
    except (OSError, RuntimeError, ValueError) as e:
        fail(
            AgentError(
                "serve",
                f"cannot listen on {v['listen'] or default_address()}: {e}",
                outcome="usage",
            ),
            as_json,
            command="serve",
        )
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
        click.echo(
            json.dumps(
                {
                    "ok": True,
                    "listen": srv.address,
                    "metrics_port": srv.metrics_port,
                    "node": opts.node,
                    "pid": os.getpid(),
                    "kubernetes": watcher is not None,
                    "insecure": security["insecure"],
                    "snapshot_dirs": roots,
                    "group_lease_s": opts.group_lease_s,
                },
                sort_keys=True,
            )
        )
    else:
        click.echo(
            f"cuinterpose-agent {opts.node} serving on {srv.address}"
            + (
                f", metrics on {metrics_addr}:{srv.metrics_port}"
                if srv.metrics_port is not None
                else ""
            )
            + (
                " (INSECURE: no client authentication, --insecure-tcp)"
                if security["insecure"]
                else ""
            )
        )
    sys.stdout.flush()
    while not stop.wait(0.5):
        if watcher is not None and not watcher[1].is_alive():
            click.echo("cuinterpose-agent: the pod watcher stopped; shutting down", err=True)
            srv.stop()
            sys.exit(1)
    srv.stop()  # a running pod request finishes first (Server.stop closes the watcher)
