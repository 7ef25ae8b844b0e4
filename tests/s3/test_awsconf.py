"""The S3 settings resolver (agent/snapshot/backends/awsconf.py) against the precedence the AWS
SDKs and CLI document: environment, then the shared credentials file, then the config file;
AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's services section, its endpoint_url."""

from __future__ import annotations

import pytest

from cuinterpose.agent.snapshot.backends.api import StorageError
from cuinterpose.agent.snapshot.backends.awsconf import S3Settings, resolve

CREDS = """
[default]
aws_access_key_id = FILEKEY
aws_secret_access_key = FILESECRET

[prod]
aws_access_key_id = PRODKEY
aws_secret_access_key = PRODSECRET
aws_session_token = PRODTOKEN
"""

CONFIG = """
[default]
region = eu-west-3
endpoint_url = http://profile-endpoint:9000

[profile prod]
region = us-west-2
services = onprem

[profile cfgonly]
aws_access_key_id = CFGKEY
aws_secret_access_key = CFGSECRET
endpoint_url = https://cfg-endpoint

[services onprem]
s3 =
  endpoint_url = https://minio.internal:9443
"""


@pytest.fixture
def home(tmp_path):
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text(CREDS)
    (tmp_path / ".aws" / "config").write_text(CONFIG)
    return str(tmp_path)


def _got(s: S3Settings) -> tuple:
    return (s.endpoint, s.region, s.access_key, s.secret_key, s.session_token)


def test_the_default_profile_comes_from_the_files(home):
    s = resolve({}, home=home)
    assert _got(s) == ("http://profile-endpoint:9000", "eu-west-3", "FILEKEY", "FILESECRET", None)
    assert (s.host, s.secure) == ("profile-endpoint:9000", False)
    assert s.source("credentials").endswith(".aws/credentials [default]")


def test_the_environment_wins_over_every_file_even_with_a_profile(home):
    env = {
        "AWS_ACCESS_KEY_ID": "ENVKEY",
        "AWS_SECRET_ACCESS_KEY": "ENVSECRET",
        "AWS_SESSION_TOKEN": "ENVTOKEN",
        "AWS_PROFILE": "prod",
        "AWS_REGION": "ap-south-1",
        "AWS_DEFAULT_REGION": "me-central-1",
        "AWS_ENDPOINT_URL": "http://global:1",
        "AWS_ENDPOINT_URL_S3": "http://s3-only:2/",
    }
    s = resolve(env, home=home)
    assert _got(s) == ("http://s3-only:2", "ap-south-1", "ENVKEY", "ENVSECRET", "ENVTOKEN")
    assert dict(s.sources) == {
        "credentials": "environment (AWS_ACCESS_KEY_ID)",
        "endpoint": "AWS_ENDPOINT_URL_S3",
        "region": "AWS_REGION",
    }
    del env["AWS_ENDPOINT_URL_S3"], env["AWS_REGION"]
    assert _got(resolve(env, home=home))[:2] == ("http://global:1", "me-central-1")


def test_a_named_profile_its_services_section_and_its_config_keys(home, tmp_path):
    s = resolve({"AWS_PROFILE": "prod"}, home=home)
    assert _got(s) == (
        "https://minio.internal:9443",
        "us-west-2",
        "PRODKEY",
        "PRODSECRET",
        "PRODTOKEN",
    )
    assert s.source("endpoint").endswith("[services onprem] s3 endpoint_url")
    s = resolve({"AWS_PROFILE": "cfgonly"}, home=home)
    assert _got(s) == ("https://cfg-endpoint", "us-east-1", "CFGKEY", "CFGSECRET", None)
    assert s.source("credentials").endswith(".aws/config [profile cfgonly]")
    # the files named by the environment, not ~/.aws
    (tmp_path / "c").write_text("[x]\naws_access_key_id = K\naws_secret_access_key = S\n")
    (tmp_path / "f").write_text("[profile x]\nregion = sa-east-1\n")
    env = {
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "c"),
        "AWS_CONFIG_FILE": str(tmp_path / "f"),
    }
    s = resolve({**env, "AWS_PROFILE": "x"}, home=home)
    assert _got(s) == ("https://s3.sa-east-1.amazonaws.com", "sa-east-1", "K", "S", None)


def test_ignoring_configured_endpoints_and_anonymous_requests(tmp_path):
    env = {"AWS_ENDPOINT_URL_S3": "http://s3-only:2", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}
    s = resolve(env, home=str(tmp_path))
    assert _got(s) == ("https://s3.us-east-1.amazonaws.com", "us-east-1", None, None, None)
    assert s.source("credentials") == "none (anonymous requests)"
    assert "secret" not in repr(S3Settings("http://h:1", access_key="k", secret_key="secret"))


@pytest.mark.parametrize(
    "env,message",
    [
        ({"AWS_PROFILE": "nope"}, "AWS_PROFILE 'nope' is in neither"),
        ({"AWS_ACCESS_KEY_ID": "K"}, "must be set together"),
        ({"AWS_ENDPOINT_URL": "http://h:1/path"}, "is not http(s)://host[:port] without a path"),
        ({"AWS_ENDPOINT_URL": "ftp://h"}, "is not http(s)://host[:port]"),
    ],
)
def test_bad_settings_are_refused_naming_the_source(home, env, message):
    with pytest.raises(StorageError) as e:
        resolve(env, home=home)
    assert e.value.phase == "stat" and message in e.value.reason


def test_only_the_resolver_reads_the_environment():
    """No module of agent/snapshot/backends but awsconf.py (its ``resolve``) reads the
    environment: the settings arrive as one value from the caller."""
    import pathlib
    import re

    import cuinterpose.agent.snapshot.backends as pkg

    readers = {
        p.name: re.findall(r"os\.environ|getenv\(|environ\[", p.read_text())
        for p in sorted(pathlib.Path(pkg.__file__).parent.glob("*.py"))
    }
    assert {k: len(v) for k, v in readers.items() if v} == {"awsconf.py": 2}  # doc + code
