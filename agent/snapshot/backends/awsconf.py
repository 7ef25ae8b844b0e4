"""The S3 settings value and its one resolver from the standard AWS variables and files.

:class:`S3Settings` is what the S3 backend uses (endpoint, region, static credentials, CA
bundle); nothing in agent/snapshot/backends reads the environment except :func:`resolve`,
which the caller (the CLI, the daemon) calls once and passes on in ``StorageOptions.s3``.

Sources and precedence, as the AWS SDKs and CLI document them (AWS SDKs and Tools Reference
Guide: "Standardized credential providers", "Service-specific endpoints", "Shared config and
credentials files"; the first that gives a value wins):

- **credentials**: ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY`` (+ ``AWS_SESSION_TOKEN``)
  from the environment (also when ``AWS_PROFILE`` is set: an environment variable names a
  profile, it does not turn the environment's keys off); then the profile in the shared
  credentials file (``AWS_SHARED_CREDENTIALS_FILE``, default ``~/.aws/credentials``, section
  ``[NAME]``); then the profile in the config file (``AWS_CONFIG_FILE``, default
  ``~/.aws/config``, section ``[profile NAME]``, ``[default]`` for "default"); the keys
  ``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``. The profile is
  ``AWS_PROFILE``, else ``default``. None found: anonymous requests. Not supported (refused
  nowhere, simply not read): SSO, ``credential_process``, role assumption, web identity and
  instance metadata.
- **endpoint**: ``AWS_ENDPOINT_URL_S3``; ``AWS_ENDPOINT_URL``; the profile's ``services``
  section (``[services NAME]`` with ``s3 =`` and an indented ``endpoint_url = URL``); the
  profile's ``endpoint_url``; else ``https://s3.<region>.amazonaws.com``. All four are
  skipped when ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` (or the profile's
  ``ignore_configured_endpoint_urls``) is ``true``. The URL is ``http(s)://host[:port]``
  without a path.
- **region**: ``AWS_REGION``; ``AWS_DEFAULT_REGION``; the profile's ``region``; else
  ``us-east-1``.
- **CA bundle** (TLS): ``AWS_CA_BUNDLE``; the profile's ``ca_bundle``; else the system's.

Errors: ``StorageError`` (phase "stat") naming the variable or file and what is wrong.
"""

from __future__ import annotations

import configparser
import dataclasses
import os
import urllib.parse
from typing import Mapping, Optional

from cuinterpose.agent.snapshot.backends.api import StorageError

DEFAULT_REGION = "us-east-1"
SERVICE = "s3"


@dataclasses.dataclass(frozen=True)
class S3Settings:
    """``endpoint`` (``http(s)://host[:port]``), ``region``, ``access_key``/``secret_key``/
    ``session_token`` (None: anonymous), ``ca_bundle`` (a PEM file, None: the system's),
    ``profile``, and ``sources``: where each value came from (``{"endpoint":
    "AWS_ENDPOINT_URL_S3", "credentials": "environment", ...}``, for messages; never the
    secrets themselves)."""

    endpoint: str
    region: str = DEFAULT_REGION
    access_key: Optional[str] = None
    secret_key: Optional[str] = dataclasses.field(default=None, repr=False)
    session_token: Optional[str] = dataclasses.field(default=None, repr=False)
    ca_bundle: Optional[str] = None
    profile: str = "default"
    sources: tuple = ()

    def __post_init__(self):
        u = urllib.parse.urlsplit(self.endpoint)
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
            raise StorageError(
                "stat",
                f"S3 endpoint {self.endpoint!r} ({self.source('endpoint')}) is not "
                "http(s)://host[:port] without a path",
            )
        if (self.access_key is None) != (self.secret_key is None):
            raise StorageError(
                "stat",
                f"S3 credentials ({self.source('credentials')}) have an access key without a "
                "secret key or the other way round",
            )

    @property
    def host(self) -> str:
        """``host[:port]`` of :attr:`endpoint` (what the client connects to)."""
        return urllib.parse.urlsplit(self.endpoint).netloc

    @property
    def secure(self) -> bool:
        return urllib.parse.urlsplit(self.endpoint).scheme == "https"

    def source(self, what: str) -> str:
        """Where ``what`` ("endpoint", "credentials", "region") came from ("" when unknown)."""
        return dict(self.sources).get(what, "")


def _truthy(v) -> bool:
    return str(v or "").strip().lower() == "true"


def _read_ini(path: str, what: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None, default_section="\0none")
    try:
        with open(path, encoding="utf-8") as f:
            cp.read_file(f, source=path)
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError, configparser.Error) as e:
        raise StorageError("stat", f"the AWS {what} file {path} cannot be read: {e}") from None
    return cp


def _section(cp: configparser.ConfigParser, name: str) -> Optional[dict]:
    return dict(cp[name]) if cp.has_section(name) else None


def _nested(value: str) -> dict:
    """The indented ``key = value`` lines of a config value such as ``s3 =\\n  endpoint_url = X``."""
    out = {}
    for line in (value or "").splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def resolve(
    environ: Optional[Mapping[str, str]] = None, *, home: Optional[str] = None
) -> S3Settings:
    """The :class:`S3Settings` from ``environ`` (None: ``os.environ``) and the AWS shared files
    (module docstring; ``home``: instead of ``~`` for the default file paths). Raises
    ``StorageError`` (phase "stat") for an unreadable file, a profile named by ``AWS_PROFILE``
    that neither file has, half a key pair, or a bad endpoint URL."""
    env = os.environ if environ is None else environ
    home = home if home is not None else os.path.expanduser("~")
    profile = env.get("AWS_PROFILE") or "default"
    cred_path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")
    conf_path = env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")
    creds_ini = _read_ini(cred_path, "shared credentials")
    conf_ini = _read_ini(conf_path, "config")
    in_creds = _section(creds_ini, profile)
    in_conf = _section(conf_ini, "default" if profile == "default" else f"profile {profile}")
    if env.get("AWS_PROFILE") and in_creds is None and in_conf is None:
        raise StorageError(
            "stat",
            f"AWS_PROFILE {profile!r} is in neither {cred_path} nor {conf_path}",
        )
    conf = in_conf or {}
    sources = {}

    key, secret, token = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY"), None
    if key or secret:
        if not (key and secret):
            raise StorageError(
                "stat", "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together"
            )
        token = env.get("AWS_SESSION_TOKEN") or None
        sources["credentials"] = "environment (AWS_ACCESS_KEY_ID)"
    else:
        conf_name = "default" if profile == "default" else f"profile {profile}"
        for sec, where in (
            (in_creds, f"{cred_path} [{profile}]"),
            (in_conf, f"{conf_path} [{conf_name}]"),
        ):
            if sec and (sec.get("aws_access_key_id") or sec.get("aws_secret_access_key")):
                key, secret = sec.get("aws_access_key_id"), sec.get("aws_secret_access_key")
                if not (key and secret):
                    raise StorageError(
                        "stat",
                        f"{where}: aws_access_key_id and aws_secret_access_key must be set "
                        "together",
                    )
                token = sec.get("aws_session_token") or None
                sources["credentials"] = where
                break
        else:
            key = secret = None
            sources["credentials"] = "none (anonymous requests)"

    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or conf.get("region")
    sources["region"] = (
        "AWS_REGION"
        if env.get("AWS_REGION")
        else "AWS_DEFAULT_REGION"
        if env.get("AWS_DEFAULT_REGION")
        else f"{conf_path} region"
        if conf.get("region")
        else "default"
    )
    region = region or DEFAULT_REGION

    ignore = _truthy(env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")) or _truthy(
        conf.get("ignore_configured_endpoint_urls")
    )
    endpoint, sources["endpoint"] = None, "default"
    if not ignore:
        svc = _section(conf_ini, f"services {conf['services']}") if conf.get("services") else None
        for value, where in (
            (env.get("AWS_ENDPOINT_URL_S3"), "AWS_ENDPOINT_URL_S3"),
            (env.get("AWS_ENDPOINT_URL"), "AWS_ENDPOINT_URL"),
            (
                _nested((svc or {}).get(SERVICE, "")).get("endpoint_url"),
                f"{conf_path} [services {conf.get('services')}] s3 endpoint_url",
            ),
            (conf.get("endpoint_url"), f"{conf_path} endpoint_url"),
        ):
            if value:
                endpoint, sources["endpoint"] = value.rstrip("/"), where
                break
    endpoint = endpoint or f"https://s3.{region}.amazonaws.com"
    ca = env.get("AWS_CA_BUNDLE") or conf.get("ca_bundle") or None
    return S3Settings(
        endpoint=endpoint,
        region=region,
        access_key=key,
        secret_key=secret,
        session_token=token,
        ca_bundle=ca,
        profile=profile,
        sources=tuple(sorted(sources.items())),
    )
