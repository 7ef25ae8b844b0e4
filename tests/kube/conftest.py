"""Fixtures for the pod watcher: a fake API server, recording actions, a fixed resolver."""

from __future__ import annotations

import pathlib
import sys
import threading

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fakeapi import NODE, FakeKubeAPI  # noqa: E402

from cuinterpose.agent.config import parse_config  # noqa: E402
from cuinterpose.agent.kube.resolver import ContainerTree, ResolveError  # noqa: E402


class RecordingActions:
    """Records every call; ``fail`` (an exception) is raised instead of succeeding."""

    def __init__(self):
        self.calls = []
        #: the options (the pod's annotations) of each call, in call order
        self.options: list[dict] = []
        self.fail = None
        #: the result's restore ``notes`` / checkpoint ``warnings``
        self.notes: list = []

    def checkpoint(self, pod, snapshot_name, *, roots, images_dir, options):
        m = pod["metadata"]
        self.options.append(dict(options))
        self.calls.append(
            (
                "checkpoint",
                f"{m['namespace']}/{m['name']}",
                snapshot_name,
                list(roots),
                images_dir,
                options["leave_running"],
            )
        )
        if self.fail:
            raise self.fail
        return {
            "snapshot_id": "q-" + snapshot_name,
            "roots": list(roots),
            "cuda_pids": [4243, 4244],
            "warnings": [{"pid": 4242, "message": n} for n in self.notes],
        }

    def restore(
        self, pod, snapshot, *, images_dir, into_pid=None, into_start_time=None, options=None
    ):
        m = pod["metadata"]
        self.options.append(dict(options or {}))
        self.calls.append(
            (
                "restore",
                f"{m['namespace']}/{m['name']}",
                snapshot,
                images_dir,
                into_pid,
                into_start_time,
            )
        )
        if self.fail:
            raise self.fail
        return {
            "snapshot_id": "q-" + snapshot,
            "roots": [4242],
            "cuda_pids": [4243, 4244],
            "notes": list(self.notes),
        }


class FixedResolver:
    """resolve(pod) -> one container "main" with roots (4242,), or raises ``error``."""

    def __init__(self):
        self.error = None

    def resolve(self, pod):
        if self.error:
            raise ResolveError(self.error)
        return [ContainerTree("main", "ab" * 32, (4242, 4243, 4244), (4242,))]

    def placeholder(self, pod):
        return self.resolve(pod)[0], 4242, 777


@pytest.fixture
def api():
    with FakeKubeAPI() as a:
        yield a


@pytest.fixture
def actions():
    return RecordingActions()


@pytest.fixture
def resolver():
    return FixedResolver()


@pytest.fixture
def make_watcher(api, actions, resolver, tmp_path):
    """make_watcher(**kubernetes_overrides) -> PodWatcher against ``api``; snapshots in
    tmp_path/snap."""
    from kubernetes import client as kclient

    from cuinterpose.agent.kube.watcher import PodWatcher

    def _make(doc_extra=None, **kube):
        doc = {
            "snapshotDir": str(tmp_path / "snap"),
            "controlDir": str(tmp_path / "ctl"),
            "driver": "fake",
            "kubernetes": {
                "enabled": True,
                "nodeName": NODE,
                "apiServer": api.host,
                "watchTimeoutSeconds": 5,
                **kube,
            },
        }
        doc.update(doc_extra or {})
        cfg = parse_config(doc, env={})
        client = kclient.ApiClient(kclient.Configuration(host=api.host))
        return PodWatcher(cfg, NODE, client, actions, resolver=resolver)

    return _make


@pytest.fixture
def run_in_thread():
    """run_in_thread(watcher) -> stop(): runs watcher.run in a thread; stop() ends it."""
    started = []

    def _run(watcher, api):
        stop = threading.Event()
        t = threading.Thread(target=watcher.run, args=(stop,), kwargs={"retry_s": 0.1}, daemon=True)
        t.start()

        def _stop():
            stop.set()
            api.end_watches()
            t.join(10)
            assert not t.is_alive()

        started.append(_stop)
        return _stop

    yield _run
    for s in started:
        try:
            s()
        except AssertionError:
            pass
