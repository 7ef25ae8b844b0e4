"""What the ``cuinterpose-agent`` commands share: the exit codes, the JSON output and the
error report, the live reporter, the common options, and running a request through an agent
daemon (``--agent``: :func:`remote`, :class:`RemoteRows`) or leading a group from here."""

from __future__ import annotations

import json
import os
import sys

import click

from cuinterpose.agent import paths
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.units import parse_bytes

EXIT = {
    "refused": 3,
    "rolled_back": 4,
    "rollback_failed": 5,
    "snapshot_incomplete": 5,
    "restore_failed": 5,
    "usage": 2,
    "unreachable": 6,
    "cancelled": 7,
}


def emit_json(obj: dict) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def fail(e: AgentError, as_json: bool, extra: dict | None = None, command: str = "checkpoint"):
    if as_json:
        err = e.to_dict()
        if getattr(e, "node", None):
            err["node"] = e.node  # a group request: the member that failed
        emit_json({"ok": False, "error": err, **(extra or {})})
    else:
        click.echo(f"error: {e}", err=True)
        refused = {
            "checkpoint": "nothing was torn down; the workload keeps running",
            "restore": "nothing was changed; the snapshot is untouched",
            "inspect": "nothing was changed (INSPECT is read-only)",
            "snapshots": "nothing was changed (read-only)",
            "delete": "nothing was removed",
            "doctor": "nothing was changed",
            "serve": "the agent did not start",
        }.get(command, "")
        hint = {
            "refused": getattr(e, "hint", None) or refused,
            "rolled_back": "the workload was rebuilt and keeps running with its memory intact",
            "rollback_failed": "the workload could NOT be rebuilt; it needs an operator",
            "snapshot_incomplete": "the tree was dumped but the directory is not a snapshot",
            "restore_failed": "the restored tree was killed; the snapshot is untouched",
            "usage": refused,
            "unreachable": "no answer from the agent at that address (a request it had "
            "started may still run there)",
            "cancelled": "this client stopped waiting; the daemon's log has the request's "
            "outcome, `snapshots` lists a snapshot that completed",
        }
        text = hint.get(e.outcome, "")
        click.echo(f"outcome: {e.outcome}" + (f": {text}" if text else ""), err=True)
    sys.exit(EXIT.get(e.outcome, 5))


def reporter(title: str, as_json: bool):
    from cuinterpose.agent.run.report import Reporter, RichSink

    if as_json:
        return Reporter(), None
    sink = RichSink(title)
    return Reporter([sink]), sink


def flag_of(name: str) -> str:
    """The command-line flag of option ``name`` (agent/options.py): ``--carrier-timeout-s``."""
    return "--" + name.replace("_", "-")


def option_flags(cls, *, only=None):
    """click options for the options of ``cls`` (an agent/options.py class; ``only``: those
    names), one per field: its flag (:func:`flag_of`; a flag option is ``--X/--no-X``), its
    type, its help; every one defaults to None (not given: the environment's value, else the
    default, applies: ``cls.from_environ``; with ``--agent``, the daemon's own). The command
    receives each under the field's name."""
    import dataclasses

    fields = [f for f in dataclasses.fields(cls) if only is None or f.name in only]

    def one(f):
        sp = f.metadata["spec"]
        flag = flag_of(f.name)
        if sp.kind == "flag":
            return click.option(f"{flag}/--no-{flag[2:]}", f.name, default=None, help=sp.help)
        kind = {
            "seconds": click.FLOAT,
            "ms": click.INT,
            "count": click.INT,
            "bytes": BytesType(),
            "path": click.Path(file_okay=False),
            "choice": click.Choice([c for c in sp.choices if c]),
        }[sp.kind]
        return click.option(flag, f.name, type=kind, default=None, help=sp.help)

    def deco(fn):
        for f in reversed(fields):
            fn = one(f)(fn)
        return fn

    return deco


def build_options(cls, flags: dict):
    """The options of an in-process run: ``cls.from_environ`` with the options ``flags`` (a
    command's parameters) gives, their errors naming the flag. Raises ``OptionError``."""
    from cuinterpose.agent.options import given_of

    return cls.from_environ(os.environ, given_of(cls, flags), label=flag_of)


def remote_options(cls, flags: dict, msg):
    """The ``msg`` (agent.proto's options message) of a request to a daemon: only the options
    ``flags`` gives, each checked on its own here (the daemon completes and checks the rest
    with its own); a path is sent absolute. Raises ``OptionError`` naming the flag."""
    from cuinterpose.agent import paths
    from cuinterpose.agent.options import given_of

    given = given_of(cls, flags)
    for k, v in given.items():
        cls.check_one(k, v, flag_of(k))
        if cls.spec(k).kind == "path":
            given[k] = paths.absolute(v)
    return cls.to_proto(given, msg)


POSITIVE = click.FloatRange(min=0, min_open=True)


def refuse_empty(cmd: click.Command) -> click.Command:
    """Make an empty value (``""``, e.g. an unset shell variable in ``--agent "$ADDR"`` or
    ``delete "$SNAP"``) a usage error (exit 2) for every option and argument of ``cmd`` that
    takes a value, naming it: an empty path, address or pid never means "the default" or "the
    current directory". Returns ``cmd``."""

    def check(inner):
        def cb(ctx, param, value):
            vals = value if isinstance(value, (tuple, list)) else (value,)
            given = ctx.get_parameter_source(param.name) != click.core.ParameterSource.DEFAULT
            if given and any(isinstance(v, str) and v == "" for v in vals):
                out = "" if isinstance(param, click.Argument) else ", or leave the option out"
                raise click.BadParameter(
                    f"an empty value is not accepted (an unset variable?): give one{out}",
                    ctx=ctx,
                    param=param,
                )
            return inner(ctx, param, value) if inner else value

        return cb

    for p in cmd.params:
        if not getattr(p, "is_flag", False) and not getattr(p, "count", False):
            p.callback = check(p.callback)
    return cmd


class BytesType(click.ParamType):
    """A click option type for byte counts (:func:`parse_bytes`) within [min, max] bytes."""

    name = "bytes"

    def __init__(self, min: int = 0, max: int | None = None):
        self.min, self.max = min, max

    def convert(self, value, param, ctx):
        try:
            n = parse_bytes(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if n < self.min or (self.max is not None and n > self.max):
            upper = f" and at most {self.max}" if self.max is not None else ""
            self.fail(f"{n} bytes: must be at least {self.min}{upper} bytes", param, ctx)
        return n


def manifest_key_opt(help_text: str):
    """``--manifest-key FILE`` of the one-shot ``checkpoint``/``restore`` (the daemon's is
    ``serve --manifest-key``); ``help_text`` says what the command does with the key."""
    return click.option(
        "--manifest-key",
        "manifest_key",
        type=click.Path(dir_okay=False, exists=True),
        default=None,
        help=help_text + " (default: $CUINTERPOSE_MANIFEST_KEY_FILE, else no key; "
        "docs/snapshot-format.md). Not with --agent/--group: a daemon uses its own "
        "`serve --manifest-key`.",
    )


def use_manifest_key(path, *, remote: bool) -> None:
    """Sign and check the manifests of this process with the node key in ``path`` (None:
    nothing changes, the environment's key if any applies). Raises ``click.UsageError``
    (exit 2, before anything is done) when ``path`` is given with ``--agent``/``--group``
    (the daemons sign with their own key) or the key file cannot be read or is empty."""
    if not path:
        return
    if remote:
        raise click.UsageError(
            "--manifest-key signs and checks in this process; with --agent or --group each "
            "daemon uses its own `serve --manifest-key`: do not pass it here"
        )
    from cuinterpose.agent.errors import SnapshotError
    from cuinterpose.agent.snapshot import trust

    trust.set_key_file(str(path))
    os.environ[trust.KEY_ENV] = os.path.abspath(str(path))
    try:
        trust.node_key()
    except SnapshotError as e:
        raise click.UsageError(f"--manifest-key: {e.reason}") from None


control_opt = click.option(
    "--control-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="shim control directory (default $CUINTERPOSE_CONTROL_DIR or /tmp/cuinterpose).",
)
json_opt = click.option("--json", "as_json", is_flag=True, help="machine-readable output only.")
agent_opt = click.option(
    "--agent",
    "agent_addr",
    default=None,
    metavar="ADDR",
    help="run through the agent daemon at ADDR (unix:/path or host:port) instead of in-process.",
)
tls_ca_opt = click.option(
    "--tls-ca",
    type=click.Path(dir_okay=False),
    default=None,
    help="with --agent over TCP: CA certificate to verify the agent.",
)
tls_cert_opt = click.option(
    "--tls-cert",
    type=click.Path(dir_okay=False),
    default=None,
    help="with --agent: client certificate (mutual TLS).",
)
tls_key_opt = click.option(
    "--tls-key",
    type=click.Path(dir_okay=False),
    default=None,
    help="with --agent: client key (mutual TLS).",
)
group_opt = click.option(
    "--group",
    "group_file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help='JSON file {"members": [{"node", "address", '
    '"images_dir", "roots" (checkpoint), "into_pid" (restore, '
    'optional: a placement on that node), "device_map" (restore, optional: '
    '"OLD=NEW,..." of that node\'s GPUs)}]}: one group request across these '
    "agents, led by --agent (or by this process).",
)


def storage_options(location):
    """The ``StorageOptions`` for an ``s3://`` ``location`` (None for a local path): the S3
    settings from the standard AWS variables and files (agent/snapshot/backends/awsconf.py
    ``resolve``, read once, here) and the node key of ``--manifest-key`` or
    ``$CUINTERPOSE_MANIFEST_KEY_FILE``. Raises ``AgentError`` (refused) for a malformed
    location or bad settings."""
    from cuinterpose.agent.snapshot import backends, trust
    from cuinterpose.agent.snapshot.backends import awsconf
    from cuinterpose.agent.snapshot.backends.api import StorageOptions

    if not location or not backends.is_remote(str(location)):
        return None
    return StorageOptions(s3=awsconf.resolve(), node_key=trust.node_key())


def images_dir_arg(images_dir):
    """What a request to a daemon names: an ``s3://`` location as written, a path absolute."""
    from cuinterpose.agent.snapshot import backends

    if not images_dir:
        return ""
    return images_dir if backends.is_remote(images_dir) else paths.absolute(images_dir)


def client_tls(ca, cert, key):
    from cuinterpose.agent.rpc.client import TLS

    t = TLS(cert=cert, key=key, ca=ca)
    return t if t.enabled else None


def load_members(group_file, kind: str):
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
            dmap = m.get("device_map") or ""
            if dmap and kind != "restore":
                raise ValueError(f"member {m.get('node')!r}: device_map is for a restore")
            if not isinstance(dmap, str):
                raise ValueError(
                    f'member {m.get("node")!r}: device_map must be a string "OLD=NEW[,...]"'
                )
            out.append(
                apb.Member(
                    node=str(m["node"]),
                    address=str(m["address"]),
                    images_dir=str(m["images_dir"]),
                    roots=roots,
                    into_pid=into,
                    device_map=dmap,
                )
            )
        if not out:
            raise ValueError("no members")
        return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise click.UsageError(f"--group {group_file}: {type(e).__name__}: {e}") from None


class RemoteRows:
    """Feeds Progress rows from the service into a local Reporter (and its live table):
    a "start" row opens a Phase, "progress" rows update its bytes (and its total, rate and
    ETA where the row carries them; else their text is the row's ``detail``), the matching
    "end" row completes it."""

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
        if row["event"] == "progress":
            ph = self.open.get(key)
            if ph is None:  # a poller's row (SAVE_ALLOCATIONS): shown until its end row
                ph = self.open[key] = Phase(name=name)
                ph.transient = True
            ph.bytes, ph.detail = row["bytes"], row["detail"]
            if "total_bytes" in row:
                ph.total_bytes, ph.rate_bps = row["total_bytes"], row["rate_bytes_per_s"]
                ph.eta_ns = row["eta_ns"]
            self.rep._emit("progress", ph)
            return
        ph = self.open.pop(key, None)
        if ph is None or getattr(ph, "transient", False):
            ph = Phase(name=name)
            self.rep.phases.append(ph)
            self.rep._emit("start", ph)
        ph.status, ph.elapsed_ns, ph.bytes, ph.detail = (
            row["status"],
            row["elapsed_ns"],
            row["bytes"],
            row["detail"],
        )
        self.rep._emit("end", ph)


#: what a daemon does with a request its client cancelled (docs/agent.md "Interrupting")
CANCELLED_ENDS = {
    "Checkpoint": "before the capture it is refused and nothing changes; from the capture "
    "until the manifest it rolls back and the workload continues; after the manifest the "
    "snapshot completes",
    "Restore": "before CRIU restore it is refused and nothing changes; after it the restored "
    "tree is killed; at its last step it completes; the snapshot is untouched",
}


def remote(addr, method, request, rep, sink, tls):
    """Run ``method`` at the agent ``addr``; returns the CLI JSON object of a success, raises
    ``AgentError`` (what the agent reported, or outcome "unreachable") otherwise."""
    import threading

    from cuinterpose.agent.rpc.client import call
    from cuinterpose.agent.run import interrupt
    from cuinterpose.agent.run.ops import error_from_dict

    got: dict = {}

    def on_call(rpc):
        def stop(sig: str) -> None:  # in the signal handler: cancel from a thread
            got["sig"] = sig
            threading.Thread(target=rpc.cancel, daemon=True).start()

        interrupt.on_signal(stop)

    try:
        res = live(
            sink,
            lambda: call(
                addr, method, request, tls=tls, on_progress=RemoteRows(rep), on_call=on_call
            ),
        )
    except AgentError as e:
        if "sig" not in got:
            raise
        running = rep.phases[-1].name if rep.phases else "its start"
        err = AgentError(
            "agent",
            f"{addr}: {method}: cancelled by {got['sig']} during {running}: the daemon stops "
            f"the request at the end of that phase ({CANCELLED_ENDS.get(method, 'as a signal')})",
            outcome="cancelled",
        )
        err.remote_phases = rep.to_list()
        raise err from e
    finally:
        interrupt.on_signal(None)
    obj = json.loads(res.json) if res.json else {}
    if res.ok:
        return obj
    e = res.error
    err = error_from_dict(
        {
            "phase": e.phase,
            "pid": e.pid if e.has_pid else None,
            "reason": e.reason,
            "outcome": e.outcome,
            "message": e.message,
            "node": e.node,
        }
    )
    err.remote_phases = obj.get("phases", [])
    raise err


def live(sink, fn):
    """``fn()``, with the live table ``sink`` (a ``RichSink``; None with ``--json``) shown while
    it runs."""
    if sink:
        with sink:
            return fn()
    return fn()
