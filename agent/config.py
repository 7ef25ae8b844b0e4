"""The node agent's YAML configuration file (the Helm chart's ConfigMap carries one).

``load_config(path_or_text) -> AgentConfig``. The document is read with ``yaml.safe_load`` and
validated strictly; every problem raises :class:`ConfigError` whose message starts with the
key path, e.g. ``kubernetes.nodeName: expected a string, got 5 (integer)`` or
``tls.certFile: unknown key (known: caFile, certFile, keyFile)``. An empty document gives
every default. Empty strings and null mean "not set here": the command line's and the
environment's defaults apply (``cuinterpose-agent serve --config`` lets its options win over
the file). Keys are camelCase in YAML and snake_case on the dataclasses; every key, its
default and its meaning are in docs/kubernetes.md, "Configuration" (the dataclasses below
declare the same, with their checks).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import typing
from typing import Any, Optional, Union

import yaml

from cuinterpose.agent.paths import DEFAULT_SNAPSHOT_DIR


class ConfigError(ValueError):
    """An invalid configuration: ``key`` is the dotted key path ("" for the whole document),
    ``reason`` what is wrong; ``str()`` is ``"key: reason"``."""

    def __init__(self, key: str, reason: str):
        self.key = key
        self.reason = reason
        super().__init__(f"{key or '(document)'}: {reason}")


def _field(key: str, default=dataclasses.MISSING, *, factory=None, check=None):
    """A dataclass field with its YAML ``key`` and an optional ``check(value) -> error or None``."""
    md = {"key": key, "check": check}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


def _positive(v):
    return None if v > 0 else f"must be > 0, got {v}"


def _port_or_zero(v):
    if v is None:
        return None
    return None if 0 <= v <= 65535 else f"must be a port number 0..65535, got {v}"


def _absolute(v):
    return None if v.startswith("/") else f"must be an absolute path, got {v!r}"


def _absolute_or_empty(v):
    return None if v == "" else _absolute(v)


def _absolute_or_location(v):
    """An absolute path, or an object-store location ``s3://BUCKET[/PREFIX]`` (its parts are
    checked where it is used: ``serve`` parses it at start)."""
    if "://" not in v:
        return _absolute(v)
    if not re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/\S*)?", v):
        return f"must be an absolute path or s3://BUCKET[/PREFIX], got {v!r}"
    return None


def _listen(v):
    if v == "" or re.fullmatch(r"unix:/\S+", v):
        return None
    m = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]*):(\d{1,5})", v)
    if not m or not 0 < int(m.group(2)) <= 65535:
        return f"expected HOST:PORT, [V6]:PORT or unix:/PATH (e.g. 0.0.0.0:7443), got {v!r}"
    return None


def _option(name: str):
    """The check of the agent option ``name`` (agent/options.py); "" and null: not set."""

    def check(v):
        from cuinterpose.agent.options import CheckpointOptions, OptionError

        if v is None or v == "":
            return None
        try:
            CheckpointOptions.check_one(name, v)
        except OptionError as e:
            return e.why + f", got {v!r}"
        return None

    return check


def _label_selector(v):
    # equality-based terms only: k=v, k==v, k!=v, k, !k, comma separated
    term = r"!?[A-Za-z0-9./_-]+((==|!=|=)[A-Za-z0-9._-]*)?"
    if v == "" or re.fullmatch(rf"{term}(,{term})*", v):
        return None
    return f"not an equality-based label selector (k=v,k!=v,k,!k): {v!r}"


def _url_or_empty(v):
    return (
        None
        if v == "" or re.fullmatch(r"https?://[^\s/@]+(/.*)?", v)
        else f"expected an http(s)://host[:port] URL without credentials, got {v!r}"
    )


def _dns_labels(v):
    for i, ns in enumerate(v):
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", ns):
            return f"[{i}] {ns!r} is not a namespace name (RFC 1123 label)"
    return None


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """PEM file paths for the gRPC server; all empty = plaintext. cert and key go together."""

    cert_file: str = _field("certFile", "", check=_absolute_or_empty)
    key_file: str = _field("keyFile", "", check=_absolute_or_empty)
    ca_file: str = _field("caFile", "", check=_absolute_or_empty)

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


@dataclasses.dataclass(frozen=True)
class KubernetesConfig:
    """The pod watcher (agent/kube). ``node_name`` defaults to ``$NODE_NAME``."""

    enabled: bool = _field("enabled", False)
    node_name: str = _field("nodeName", "")
    namespaces: tuple = _field("namespaces", factory=tuple, check=_dns_labels)
    label_selector: str = _field("labelSelector", "", check=_label_selector)
    watch_timeout_seconds: int = _field("watchTimeoutSeconds", 300, check=_positive)
    proc_root: str = _field("procRoot", "/proc", check=_absolute)
    leave_running: bool = _field("leaveRunning", False)
    kubeconfig: str = _field("kubeconfig", "", check=_absolute_or_empty)
    api_server: str = _field("apiServer", "", check=_url_or_empty)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """The whole configuration; see the module docstring for keys, units and defaults."""

    listen_address: str = _field("listenAddress", "", check=_listen)
    tls: TLSConfig = _field("tls", factory=TLSConfig)
    insecure_tcp: bool = _field("insecureTcp", False)
    control_dir: str = _field("controlDir", "", check=_absolute_or_empty)
    manifest_key_file: str = _field("manifestKeyFile", "", check=_absolute_or_empty)
    snapshot_dir: str = _field("snapshotDir", DEFAULT_SNAPSHOT_DIR, check=_absolute_or_location)
    staging_dir: str = _field("stagingDir", "", check=_absolute_or_empty)
    metrics_port: Optional[int] = _field("metricsPort", None, check=_port_or_zero)
    metrics_address: str = _field("metricsAddress", "")
    # the agent's options (agent/options.py): "" / null = not set here (the environment's, else
    # the option's default); each checked as the option is
    driver: str = _field("driver", "", check=_option("driver"))
    native_backend: str = _field("nativeBackend", "", check=_option("native_backend"))
    quiesce_timeout_ms: Optional[int] = _field(
        "quiesceTimeoutMs", None, check=_option("quiesce_timeout_ms")
    )
    lock_timeout_ms: Optional[int] = _field("lockTimeoutMs", None, check=_option("lock_timeout_ms"))
    phase_timeout_s: Optional[float] = _field(
        "phaseTimeoutS", None, check=_option("phase_timeout_s")
    )
    carrier_timeout_s: Optional[float] = _field(
        "carrierTimeoutS", None, check=_option("carrier_timeout_s")
    )
    group_lease_s: float = _field("groupLeaseS", 30.0, check=_positive)
    kubernetes: KubernetesConfig = _field("kubernetes", factory=KubernetesConfig)

    def option_values(self) -> dict:
        """The options this configuration sets (agent/options.py names; not set: absent):
        ``controlDir``, ``driver``, ``nativeBackend`` and the timeouts."""
        out = {
            "control_dir": self.control_dir,
            "driver": self.driver,
            "native_backend": self.native_backend,
            "quiesce_timeout_ms": self.quiesce_timeout_ms,
            "lock_timeout_ms": self.lock_timeout_ms,
            "phase_timeout_s": self.phase_timeout_s,
            "carrier_timeout_s": self.carrier_timeout_s,
        }
        return {k: v for k, v in out.items() if v not in (None, "")}

    # -- the names ``cuinterpose-agent serve`` reads (None when not set here) ----------------
    @property
    def listen(self) -> Optional[str]:
        return self.listen_address or None

    @property
    def node_name(self) -> Optional[str]:
        return self.kubernetes.node_name or None

    @property
    def tls_cert(self) -> Optional[str]:
        return self.tls.cert_file or None

    @property
    def tls_key(self) -> Optional[str]:
        return self.tls.key_file or None

    @property
    def tls_ca(self) -> Optional[str]:
        return self.tls.ca_file or None

    @property
    def metrics_addr(self) -> Optional[str]:
        return self.metrics_address or None


def _type_name(v) -> str:
    return {
        dict: "mapping",
        list: "list",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def _got(v) -> str:
    return f"got {v!r} ({_type_name(v)})"


def _convert(tp, value, key: str):
    """Check ``value`` (from YAML) against the annotation ``tp``; returns the converted value."""
    if typing.get_origin(tp) is Union and type(None) in typing.get_args(tp):
        if value is None:
            return None
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, {_got(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, {_got(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, {_got(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, {_got(value)}")
        return value
    if tp is tuple:  # list of strings
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list of strings, {_got(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{key}[{i}]", f"expected a string, {_got(item)}")
        return tuple(value)
    raise TypeError(f"unsupported config type {tp!r}")  # pragma: no cover


def _build(cls, data, prefix: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a mapping, {_got(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.metadata["key"]: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            where = f"{prefix}.{k}" if prefix else str(k)
            raise ConfigError(where, f"unknown key (known: {', '.join(sorted(fields))})")
    kw = {}
    for k, f in fields.items():
        if k not in data:
            continue
        where = f"{prefix}.{k}" if prefix else k
        v = _convert(hints[f.name], data[k], where)
        check = f.metadata.get("check")
        err = check(v) if check else None
        if err:
            raise ConfigError(where, err)
        kw[f.name] = v
    return cls(**kw)


def parse_config(doc: Any, env: Optional[dict] = None) -> AgentConfig:
    """Validate an already-parsed document (dict or None). ``env`` (default ``os.environ``)
    supplies ``NODE_NAME`` when ``kubernetes.nodeName`` is empty."""
    cfg = _build(AgentConfig, doc, "")
    env = os.environ if env is None else env
    k = cfg.kubernetes
    if not k.node_name and env.get("NODE_NAME"):
        k = dataclasses.replace(k, node_name=env["NODE_NAME"])
        cfg = dataclasses.replace(cfg, kubernetes=k)
    if k.enabled and not k.node_name:
        raise ConfigError(
            "kubernetes.nodeName",
            "required when kubernetes.enabled is true "
            "(set it, or the NODE_NAME environment variable)",
        )
    if bool(cfg.tls.cert_file) != bool(cfg.tls.key_file):
        missing = "tls.keyFile" if cfg.tls.cert_file else "tls.certFile"
        raise ConfigError(missing, "required: tls.certFile and tls.keyFile go together")
    if cfg.tls.ca_file and not cfg.tls.cert_file:
        raise ConfigError(
            "tls.caFile",
            "needs tls.certFile and tls.keyFile (client "
            "certificates are verified only on a TLS listener)",
        )
    return cfg


def load_config(path_or_text: Union[str, os.PathLike], env: Optional[dict] = None) -> AgentConfig:
    """Load and validate a configuration. A ``pathlib.Path`` (or a ``str`` naming an existing
    file) is read; any other ``str`` is the YAML text itself. Raises ``ConfigError``: YAML
    syntax errors (with line and column), a top level that is not a mapping, unknown keys,
    wrong types and bad values, each naming the key path."""
    if isinstance(path_or_text, os.PathLike) or (
        isinstance(path_or_text, str) and "\n" not in path_or_text and os.path.isfile(path_or_text)
    ):
        p = pathlib.Path(path_or_text)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError("", f"cannot read {p}: {e.strerror or e}") from None
    else:
        text = str(path_or_text)
        if (
            "\n" not in text
            and ":" not in text
            and (text.startswith(("/", "./")) or text.endswith((".yaml", ".yml")))
        ):
            raise ConfigError(
                "",
                f"{text}: no such file (a str that is not an existing file is read as YAML text)",
            )
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise ConfigError(
            "", f"not valid YAML{where}: {getattr(e, 'problem', None) or e}"
        ) from None
    return parse_config(doc, env=env)


def to_document(cfg: AgentConfig) -> dict:
    """The camelCase document that ``parse_config`` turns back into ``cfg``."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = to_document(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.metadata["key"]] = v
    return out
