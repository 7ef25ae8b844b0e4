"""Fixtures of the S3 backend tests: one ``rclone serve s3`` for the session (its own temp
directory; each test gets its own bucket in it), the ``StorageOptions`` that reach it, and
the fault proxy (tests/s3/s3_kit.py); the agent daemon fixture of tests/service (loaded from
its conftest file by path, as tests/group does)."""

from __future__ import annotations

import importlib.util
import os
import uuid

import pytest
from s3_kit import TRANSFER, FaultProxy, Rclone, raw_client, settings_for

from cuinterpose.agent.snapshot.backends.api import StorageOptions


def _load(name, rel):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(os.path.abspath(__file__)), rel)
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


daemon = _load("_cui_service_conftest_s3", "../service/conftest.py").daemon


@pytest.fixture(scope="session")
def rclone(tmp_path_factory):
    d = tmp_path_factory.mktemp("rclone")
    srv = Rclone(d / "data", d / "rclone.log").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def raw(rclone):
    """A plain minio client of the session's server: what the tests put or remove behind the
    backend's back goes through the server (rclone caches its directory listings, so files
    written straight into its directory would not be seen; its own writes land on disk at
    once, so the tests read the bucket from there)."""
    return raw_client(rclone.endpoint)


@pytest.fixture
def bucket(raw) -> str:
    """A new, empty bucket of the session's server."""
    name = f"b-{uuid.uuid4().hex[:16]}"
    raw.make_bucket(name)
    return name


@pytest.fixture
def opts(rclone) -> StorageOptions:
    return StorageOptions(s3=settings_for(rclone.endpoint), transfer=TRANSFER)


@pytest.fixture
def proxy(rclone):
    p = FaultProxy(rclone.endpoint)
    yield p
    p.close()
