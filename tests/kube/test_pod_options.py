"""Pod annotations set the same options as the command line (agent/kube/annotations.py
``option_values``; docs/kubernetes.md "Options"): ``cuinterpose.io/KIND-OPTION`` reaches the
request's options object, built by ``AgentActions`` over the node's options; an unknown or bad
annotation fails the request naming the annotation and the pod, before anything runs."""

from __future__ import annotations

import pytest
from fakeapi import make_pod

from cuinterpose.agent.config import parse_config
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.kube import annotations as A
from cuinterpose.agent.kube.actions import AgentActions
from cuinterpose.agent.options import CheckpointOptions, RestoreOptions, for_kinds

CK = "cuinterpose.io/checkpoint"
ST = "cuinterpose.io/checkpoint-status"
MSG = "cuinterpose.io/checkpoint-message"
RST = "cuinterpose.io/restore-status"
RMSG = "cuinterpose.io/restore-message"


def test_option_annotations_reach_the_checkpoint(api, actions, make_watcher):
    api.add_pod(
        make_pod(
            "p1",
            annotations={
                CK: "snap1",
                "cuinterpose.io/checkpoint-gpu-storage": "host",
                "cuinterpose.io/checkpoint-carrier-timeout-s": "600",
                "cuinterpose.io/checkpoint-chunk-bytes": "1MiB",
                "cuinterpose.io/checkpoint-incremental": "true",
                # a restore option on a checkpoint's pod is the restore's, not read here
                "cuinterpose.io/restore-criu-timeout-s": "5",
            },
        )
    )
    make_watcher().relist()
    assert api.annotations("default", "p1")[ST] == "Succeeded"
    assert actions.options == [
        {
            "gpu_storage": "host",
            "carrier_timeout_s": 600.0,
            "chunk_bytes": 1 << 20,
            "incremental": True,
            "leave_running": False,  # the config's kubernetes.leaveRunning
        }
    ]


def test_option_annotations_reach_the_restore(api, actions, make_watcher, tmp_path):
    snap = tmp_path / "snap" / "default" / "snap1"
    snap.mkdir(parents=True)
    (snap / "manifest.json").write_text("{}")
    api.add_pod(
        make_pod(
            "p1",
            annotations={
                "cuinterpose.io/restore-from": "snap1",
                "cuinterpose.io/restore-criu-timeout-s": "900",
                "cuinterpose.io/restore-phase-timeout-s": "30",
            },
        )
    )
    make_watcher().relist()
    assert api.annotations("default", "p1")[RST] == "Succeeded"
    assert actions.options == [{"criu_timeout_s": 900.0, "phase_timeout_s": 30.0}]


@pytest.mark.parametrize(
    "key,value,why",
    [
        (
            "cuinterpose.io/checkpoint-gpu-storage",
            "disk",
            "='disk': must be one of auto, custom, host",
        ),
        (
            "cuinterpose.io/checkpoint-leave-running",
            "yes",
            "='yes': must be 1 or true, 0 or false",
        ),
        (
            "cuinterpose.io/checkpoint-carrier-timeout-s",
            "1e9",
            "='1e9': must be a finite number of seconds above 0 and at most 86400",
        ),
        (
            "cuinterpose.io/checkpoint-driver",
            "fake",
            "='fake': is set by the agent's config, not by a pod",
        ),
        (
            "cuinterpose.io/checkpoint-chunk-size",
            "8MiB",
            "='8MiB': is not an option of a checkpoint (known: "
            "cuinterpose.io/checkpoint-driver-call-timeout-s, ",
        ),
    ],
)
def test_a_bad_option_annotation_fails_the_request_naming_it_and_the_pod(
    api, actions, make_watcher, key, value, why
):
    api.add_pod(make_pod("p1", annotations={CK: "snap1", key: value}))
    make_watcher().relist()
    a = api.annotations("default", "p1")
    assert a[ST] == "Failed"
    assert a[MSG].startswith(f"request: pod default/p1: annotation {key}{why}"), a[MSG]
    assert a[MSG].endswith("; nothing was done")
    assert actions.calls == []  # nothing ran: no claim, no resolve, no checkpoint


def test_a_bad_restore_option_annotation_fails_the_restore(api, actions, make_watcher, tmp_path):
    api.add_pod(
        make_pod(
            "p1",
            annotations={
                "cuinterpose.io/restore-from": "snap1",
                "cuinterpose.io/restore-leave-running": "true",
            },
        )
    )
    make_watcher().relist()
    a = api.annotations("default", "p1")
    assert a[RST] == "Failed"
    assert a[RMSG].startswith(
        "request: pod default/p1: annotation cuinterpose.io/restore-leave-running='true': is "
        "not an option of a restore (known: "
    )
    assert actions.calls == []


def test_the_default_actions_build_the_options_once_over_the_nodes():
    """``AgentActions`` (no daemon): the config's options over the environment, the pod's over
    those; a conflict of the pod's values with the node's names the annotation."""
    cfg = parse_config({"driver": "fake", "carrierTimeoutS": 1200.0, "controlDir": "/run/c"})
    acts = AgentActions(cfg, options=for_kinds(cfg.option_values(), {"CUINTERPOSE_WRITERS": "2"}))
    o = acts.request_options("checkpoint", {"gpu_storage": "host", "leave_running": True})
    assert o == CheckpointOptions(
        driver="fake",
        carrier_timeout_s=1200.0,
        control_dir="/run/c",
        writers=2,
        gpu_storage="host",
        leave_running=True,
    )
    assert acts.request_options("restore", {}) == RestoreOptions(
        driver="fake", carrier_timeout_s=1200.0
    )
    with pytest.raises(AgentError) as e:
        acts.request_options("checkpoint", {"staging_bytes": 1 << 20})
    assert e.value.reason.startswith(
        "cuinterpose.io/checkpoint-staging-bytes 1048576 must be at least chunk_bytes (the "
        "default) (8388608"
    )


def test_the_annotation_of_each_option_is_its_flag():
    assert A.option_key("checkpoint", "carrier_timeout_s") == (
        "cuinterpose.io/checkpoint-carrier-timeout-s"
    )
    assert A.LEAVE_RUNNING == "cuinterpose.io/checkpoint-leave-running"
    pod = make_pod("p", annotations={"cuinterpose.io/checkpoint-writers": " 8 "})
    assert A.option_values(pod, "checkpoint") == {"writers": 8}
    assert A.option_values(pod, "restore") == {}
