"""The pod watcher against the fake API server with the official kubernetes client:
annotations written for success, refusal and failure; idempotency; watch, 410 re-list."""

from __future__ import annotations

import pytest
from fakeapi import NODE, make_pod

from cuinterpose.agent.errors import AgentError, CensusError, CheckpointFailed

CK = "cuinterpose.io/checkpoint"
ST = "cuinterpose.io/checkpoint-status"
MSG = "cuinterpose.io/checkpoint-message"
HD = "cuinterpose.io/checkpoint-handled"
SNAP = "cuinterpose.io/snapshot"
RST = "cuinterpose.io/restore-status"
RMSG = "cuinterpose.io/restore-message"
RHD = "cuinterpose.io/restore-handled"


def ann_patches(api, name="p1"):
    """The annotation dicts of every PATCH to pod ``name``, in order."""
    return [p["metadata"]["annotations"] for ns, n, p in api.patches if n == name]


def test_checkpoint_success_writes_pending_running_succeeded(api, actions, make_watcher, tmp_path):
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    w = make_watcher()
    w.relist()
    snap = str(tmp_path / "snap" / "default" / "snap1")
    assert actions.calls == [("checkpoint", "default/p1", "snap1", [4242], snap, False)]
    assert ann_patches(api) == [
        {ST: "Pending", HD: "snap1@uid-p1", MSG: f"checkpoint snap1 accepted by node {NODE}"},
        {ST: "Running", MSG: f"checkpoint snap1: container main: roots 4242 -> {snap}"},
        {
            ST: "Succeeded",
            SNAP: snap,
            "cuinterpose.io/snapshot-node": NODE,
            MSG: f"snapshot q-snap1 of roots 4242 (CUDA pids 4243, 4244) in {snap}; "
            "the workload was stopped",
        },
    ]
    # the claim is conditional on the resourceVersion the watcher saw
    first = [p for ns, n, p in api.patches][0]
    assert first["metadata"]["resourceVersion"] == "101"
    assert w.stats["runs"] == 1


def test_leave_running_annotation(api, actions, make_watcher, tmp_path):
    api.add_pod(
        make_pod("p1", annotations={CK: "snap1", "cuinterpose.io/checkpoint-leave-running": "true"})
    )
    make_watcher().relist()
    assert actions.calls[0][5] is True
    assert api.annotations("default", "p1")[MSG].endswith("; the workload keeps running")


def test_refusal_no_process_in_cgroups(api, actions, make_watcher, tmp_path):
    """The real cgroup resolver on an empty /proc: Failed, naming the container; no action."""
    from cuinterpose.agent.kube.resolver import CgroupResolver

    proc = tmp_path / "proc"
    proc.mkdir()
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    w = make_watcher()
    w.resolver = CgroupResolver(proc)
    w.relist()
    assert actions.calls == []
    a = api.annotations("default", "p1")
    assert a[ST] == "Failed"
    assert a[MSG] == (
        f"resolve: no process of pod default/p1 found in the cgroups of its "
        f"containers main (abababababab) under {proc}; nothing was done"
    )
    assert SNAP not in a


def test_refusal_from_agent_names_phase_and_pid(api, actions, make_watcher):
    actions.fail = CensusError(
        "census",
        "no cuinterpose participant under root pid(s) 4242 "
        "(no process maps /x/libcuinterpose.so and has a socket in /c)",
    )
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    make_watcher().relist()
    a = api.annotations("default", "p1")
    assert (a[ST], a[HD]) == ("Failed", "snap1@uid-p1")
    assert a[MSG] == (
        "census: no cuinterpose participant under root pid(s) 4242 (no process "
        "maps /x/libcuinterpose.so and has a socket in /c) [outcome: refused]"
    )


def test_failure_rolled_back(api, actions, make_watcher):
    cause = AgentError(
        "native checkpoint", "cuCheckpointProcessCheckpoint: CUDA_ERROR_UNKNOWN", pid=4243
    )
    actions.fail = CheckpointFailed(cause, "rolled_back")
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    make_watcher().relist()
    a = api.annotations("default", "p1")
    assert a[ST] == "Failed"
    assert a[MSG] == (
        "native checkpoint: pid 4243 cuCheckpointProcessCheckpoint: "
        "CUDA_ERROR_UNKNOWN (rolled back: the workload continues with its memory "
        "intact) [outcome: rolled_back]"
    )


def test_failure_unexpected_exception(api, actions, make_watcher):
    actions.fail = RuntimeError("boom")
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    w = make_watcher()
    w.relist()
    a = api.annotations("default", "p1")
    assert (a[ST], a[MSG]) == ("Failed", "checkpoint: RuntimeError: boom")
    assert w.in_flight == set()


def test_same_annotation_twice_runs_once(api, actions, make_watcher):
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    w = make_watcher()
    w.relist()
    # the user applies the same request again; the watcher sees it again (re-list and event)
    api.update_pod("default", "p1", lambda p: p["metadata"]["annotations"].update({CK: "snap1"}))
    w.relist()
    w.handle(api.pod("default", "p1"))
    assert len(actions.calls) == 1
    assert len(ann_patches(api)) == 3


def test_restarted_watcher_does_not_rerun(api, actions, make_watcher):
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    make_watcher().relist()
    make_watcher().relist()  # a new agent process: only the annotations remember
    assert len(actions.calls) == 1
    assert api.annotations("default", "p1")[ST] == "Succeeded"


def test_agent_died_mid_run_is_failed_not_rerun(api, actions, make_watcher):
    api.add_pod(
        make_pod(
            "p1",
            annotations={
                CK: "snap1",
                ST: "Running",
                HD: "snap1@uid-p1",
                MSG: "checkpoint snap1: ...",
            },
        )
    )
    make_watcher().relist()
    assert actions.calls == []
    a = api.annotations("default", "p1")
    assert a[ST] == "Failed"
    assert a[MSG] == (
        "interrupted: the agent restarted while this checkpoint was Running; it "
        "is not retried (request a new snapshot name; the workload may be parked "
        "or stopped, see docs/agent.md)"
    )


def test_stale_annotation_copied_from_another_pod_is_skipped(api, actions, make_watcher):
    api.add_pod(
        make_pod(
            "p1",
            uid="uid-new",
            annotations={CK: "snap1", ST: "Succeeded", HD: "snap1@uid-old", SNAP: "/old/place"},
        )
    )
    make_watcher().relist()
    assert actions.calls == []
    a = api.annotations("default", "p1")
    assert (a[ST], a[HD]) == ("Failed", "snap1@uid-new")
    assert a[MSG] == (
        "stale request: cuinterpose.io/checkpoint=snap1 was handled for pod uid "
        "uid-old, not this pod (uid-new); the annotations were copied from another "
        "pod. Not run: set a new snapshot name to request a checkpoint"
    )


def test_new_name_after_a_handled_one_runs(api, actions, make_watcher):
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    w = make_watcher()
    w.relist()
    api.update_pod("default", "p1", lambda p: p["metadata"]["annotations"].update({CK: "snap2"}))
    w.relist()
    assert [c[2] for c in actions.calls] == ["snap1", "snap2"]
    assert api.annotations("default", "p1")[HD] == "snap2@uid-p1"


def test_claim_conflict_runs_nothing_then_the_newer_version_runs(api, actions, make_watcher):
    old = api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    api.update_pod("default", "p1", lambda p: p["metadata"]["labels"].update({"x": "1"}))
    w = make_watcher()
    w.handle(old)  # an event older than the pod: its claim gets 409
    assert (actions.calls, w.stats["conflicts"], api.patches) == ([], 1, [])
    w.relist()
    assert len(actions.calls) == 1


def test_invalid_name_and_terminal_pod(api, actions, make_watcher):
    api.add_pod(make_pod("p1", annotations={CK: "../etc"}))
    api.add_pod(make_pod("p2", annotations={CK: "snap1"}, phase="Succeeded"))
    make_watcher().relist()
    assert actions.calls == []
    assert api.annotations("default", "p1")[MSG] == (
        "request: '../etc' is not a snapshot name (lower-case letters, digits, '.', '_', '-'; "
        "one path component)"
    )
    assert api.annotations("default", "p2")[MSG] == (
        "request: pod is Succeeded, not Running; nothing was done"
    )


def test_pending_pod_waits_until_running(api, actions, make_watcher):
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}, phase="Pending"))
    w = make_watcher()
    w.relist()
    assert (actions.calls, api.patches) == ([], [])
    api.update_pod("default", "p1", lambda p: p["status"].update({"phase": "Running"}))
    w.relist()
    assert len(actions.calls) == 1


def test_only_own_node_namespaces_and_labels(api, actions, make_watcher):
    api.add_pod(make_pod("other-node", node="node-b", annotations={CK: "s"}))
    api.add_pod(
        make_pod("other-ns", namespace="kube-system", labels={"gpu": "yes"}, annotations={CK: "s"})
    )
    api.add_pod(make_pod("unlabelled", namespace="team", annotations={CK: "s"}))
    api.add_pod(make_pod("mine", namespace="team", labels={"gpu": "yes"}, annotations={CK: "s"}))
    make_watcher(namespaces=["team"], labelSelector="gpu=yes").relist()
    assert [c[1] for c in actions.calls] == ["team/mine"]
    lists = [p for m, p in api.requests if m == "GET"]
    assert lists == ["/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-a&labelSelector=gpu%3Dyes"]


def test_restore_into_placeholder(api, actions, make_watcher, tmp_path):
    snap = tmp_path / "snap" / "default" / "snap1"
    snap.mkdir(parents=True)
    (snap / "manifest.json").write_text("{}")
    api.add_pod(make_pod("p1", annotations={"cuinterpose.io/restore-from": "snap1"}))
    make_watcher().relist()
    # the placeholder's container init (FixedResolver: pid 4242 of container main)
    assert actions.calls == [("restore", "default/p1", "snap1", str(snap), 4242, 777)]
    where = "into container main (pid 4242)"
    assert ann_patches(api) == [
        {RST: "Pending", RHD: "snap1@uid-p1", RMSG: f"restore snap1 accepted by node {NODE}"},
        {RST: "Running", SNAP: str(snap), RMSG: f"restore of snap1 from {snap} {where}"},
        {RST: "Succeeded", RMSG: f"restored snapshot q-snap1 from {snap} {where}: roots 4242"},
    ]


def test_result_notes_and_warnings_reach_the_message(api, actions, make_watcher, tmp_path):
    snap = tmp_path / "snap" / "default" / "snap1"
    snap.mkdir(parents=True)
    (snap / "manifest.json").write_text("{}")
    actions.notes = ["fd 1 is a pipe to outside", "fd 0 reopened"]
    api.add_pod(make_pod("p1", annotations={"cuinterpose.io/restore-from": "snap1"}))
    api.add_pod(make_pod("p2", annotations={CK: "snap2"}))
    make_watcher().relist()
    assert api.annotations("default", "p1")[RMSG].endswith(
        ": roots 4242; note: fd 1 is a pipe to outside; note: fd 0 reopened"
    )
    assert api.annotations("default", "p2")[MSG].endswith(
        "; the workload was stopped; note: fd 1 is a pipe to outside; note: fd 0 reopened"
    )


def test_restore_into_a_placeholder_without_processes_is_refused(
    api, actions, resolver, make_watcher, tmp_path
):
    snap = tmp_path / "snap" / "default" / "snap1"
    snap.mkdir(parents=True)
    (snap / "manifest.json").write_text("{}")
    resolver.error = "no process of pod default/p1 found"
    api.add_pod(make_pod("p1", annotations={"cuinterpose.io/restore-from": "snap1"}))
    make_watcher().relist()
    assert actions.calls == []
    a = api.annotations("default", "p1")
    assert (a[RST], a[RMSG]) == (
        "Failed",
        "restore: placeholder: no process of pod default/p1 "
        "found; the restored processes join the cgroups and namespaces "
        "of the placeholder's running container; nothing was done",
    )
    assert (snap / "manifest.json").read_text() == "{}"


@pytest.mark.parametrize(
    "kind,key,what",
    [
        ("checkpoint", CK, "checkpointed"),
        ("restore", "cuinterpose.io/restore-from", "restored into"),
    ],
)
def test_a_pod_without_host_pid_is_refused(api, actions, make_watcher, tmp_path, kind, key, what):
    snap = tmp_path / "snap" / "default" / "snap1"
    snap.mkdir(parents=True)
    (snap / "manifest.json").write_text("{}")
    api.add_pod(make_pod("p1", annotations={key: "snap1"}, host_pid=False))
    make_watcher().relist()
    assert actions.calls == []
    a = api.annotations("default", "p1")
    assert a[f"cuinterpose.io/{kind}-status"] == "Failed"
    assert a[f"cuinterpose.io/{kind}-handled"] == "snap1@uid-p1"
    assert a[f"cuinterpose.io/{kind}-message"] == (
        f"request: pod default/p1 does not set spec.hostPID: true; a pod with its own PID "
        f"namespace cannot be {what} (the agent, CRIU and the shim's control files use host "
        "pids; see docs/kubernetes.md); nothing was done"
    )


def test_restore_of_missing_snapshot_is_refused(api, actions, make_watcher, tmp_path):
    api.add_pod(make_pod("p1", annotations={"cuinterpose.io/restore-from": "nope"}))
    make_watcher().relist()
    assert actions.calls == []
    a = api.annotations("default", "p1")
    snap = tmp_path / "snap" / "default" / "nope"
    assert (a[RST], a[RMSG]) == (
        "Failed",
        f"restore: no snapshot 'nope' on node {NODE} (no {snap}/manifest.json); nothing was done",
    )


def test_watch_events_and_410_relist(api, actions, make_watcher, run_in_thread):
    w = make_watcher()
    stop = run_in_thread(w, api)
    assert api.wait_for(lambda a: any("watch=true" in p for _, p in a.requests))
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    assert api.wait_for(lambda a: a.annotations("default", "p1").get(ST) == "Succeeded")
    assert (w.stats["lists"], w.stats["gone"]) == (1, 0)
    # history is compacted and the stream ends: the resumed watch gets 410 and re-lists
    api.compact()
    api.end_watches()
    assert api.wait_for(lambda a: w.stats["lists"] == 2)
    api.add_pod(make_pod("p2", annotations={CK: "snap2"}))
    assert api.wait_for(lambda a: a.annotations("default", "p2").get(ST) == "Succeeded")
    stop()
    assert w.stats["gone"] == 1
    assert [c[1:3] for c in actions.calls] == [("default/p1", "snap1"), ("default/p2", "snap2")]
    watches = [p for _, p in api.requests if "watch=true" in p]
    assert all("fieldSelector=spec.nodeName%3Dnode-a" in p for p in watches)


def test_watch_resumes_at_last_resource_version(api, actions, make_watcher, run_in_thread):
    api.add_pod(make_pod("p0"))
    w = make_watcher()
    stop = run_in_thread(w, api)
    assert api.wait_for(lambda a: any("watch=true" in p for _, p in a.requests))
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    assert api.wait_for(lambda a: a.annotations("default", "p1").get(ST) == "Succeeded")
    rv = api.pod("default", "p1")["metadata"]["resourceVersion"]
    assert api.wait_for(lambda a: w.resource_version == rv)
    api.end_watches()  # a server-side timeout: the next watch starts at rv, no re-list
    assert api.wait_for(lambda a: sum("watch=true" in p for _, p in a.requests) >= 2)
    stop()
    watches = [p for _, p in api.requests if "watch=true" in p]
    assert f"resourceVersion={rv}&" in watches[1] or watches[1].endswith(f"resourceVersion={rv}")
    assert (w.stats["lists"], len(actions.calls)) == (1, 1)


def test_result_write_is_retried(api, actions, make_watcher):
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    w = make_watcher()
    w.result_retry_s = 0.01

    def checkpoint(pod, name, **kw):
        api.fail_patches = 2  # the API server fails the next two writes
        return {"snapshot_id": "q1", "cuda_pids": [4243]}

    actions.checkpoint = checkpoint
    w.relist()
    a = api.annotations("default", "p1")
    assert (a[ST], api.fail_patches, len(ann_patches(api))) == ("Succeeded", 0, 3)


def test_result_write_gives_up_after_retries(api, actions, make_watcher):
    from kubernetes.client.exceptions import ApiException

    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    w = make_watcher()
    w.result_retries, w.result_retry_s = 1, 0.01

    def checkpoint(pod, name, **kw):
        api.fail_patches = 2
        return {"snapshot_id": "q1", "cuda_pids": [4243]}

    actions.checkpoint = checkpoint
    with pytest.raises(ApiException) as e:
        w.relist()
    assert e.value.status == 500
    assert api.annotations("default", "p1")[ST] == "Running"
    # the next agent (or re-list) reports it as interrupted rather than running it again
    make_watcher().relist()
    assert api.annotations("default", "p1")[ST] == "Failed"


def test_pod_deleted_before_the_result(api, actions, make_watcher):
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    w = make_watcher()

    def checkpoint(pod, name, **kw):
        with api.lock:
            del api.pods[("default", "p1")]
        return {"snapshot_id": "q1", "cuda_pids": [4243]}

    actions.checkpoint = checkpoint
    w.relist()
    assert (w.stats["runs"], w.in_flight) == (1, set())


def test_bookmark_moves_the_resume_point(api, actions, make_watcher, run_in_thread):
    w = make_watcher()
    stop = run_in_thread(w, api)
    assert api.wait_for(lambda a: any("watch=true" in p for _, p in a.requests))
    api.bookmark()
    rv = str(api.rv)
    assert api.wait_for(lambda a: w.resource_version == rv)
    api.end_watches()
    assert api.wait_for(lambda a: sum("watch=true" in p for _, p in a.requests) >= 2)
    stop()
    watches = [p for _, p in api.requests if "watch=true" in p]
    assert "allowWatchBookmarks=true" in watches[0]
    assert f"resourceVersion={rv}&" in watches[1]
    assert (w.stats["lists"], actions.calls) == (1, [])


def test_run_watcher_needs_enabled_and_a_node():
    from cuinterpose.agent.config import parse_config
    from cuinterpose.agent.kube import run_watcher

    with pytest.raises(ValueError) as e:
        run_watcher(parse_config({}, env={}))
    assert str(e.value) == "kubernetes.enabled is false: the pod watcher is off"


def test_close_cuts_the_watch_and_starts_no_request(api, actions, make_watcher):
    """``close()`` (what serve's SIGTERM does): the thread leaves its watch at once (the
    server timeout here is 300 s; the join's 30 s is a hang guard), and a pod handled after it
    is neither claimed nor run."""
    import threading

    w = make_watcher(watchTimeoutSeconds=300)
    stop = threading.Event()
    t = threading.Thread(target=w.run, args=(stop,), daemon=True)
    t.start()
    assert api.wait_for(lambda a: any("watch=true" in q for _, q in a.requests), 30)
    w.close()
    t.join(30)
    assert not t.is_alive() and w.closed and not stop.is_set()
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    w.handle(api.pod("default", "p1"))
    assert (actions.calls, api.patches) == ([], [])
    w.close()  # idempotent


def test_close_waits_for_the_running_request(api, actions, make_watcher):
    """A request running when ``close()`` is called finishes and its outcome is written
    before ``close()`` returns."""
    import threading

    entered, release = threading.Event(), threading.Event()
    orig = actions.checkpoint

    def slow(*a, **kw):
        entered.set()
        release.wait(30)
        return orig(*a, **kw)

    actions.checkpoint = slow
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    w = make_watcher()
    t = threading.Thread(target=w.relist, daemon=True)
    t.start()
    assert entered.wait(30)
    closed = threading.Event()
    c = threading.Thread(target=lambda: (w.close(), closed.set()), daemon=True)
    c.start()
    assert not closed.is_set()  # blocked on the running request
    release.set()
    c.join(30)
    assert closed.is_set()
    assert [a[ST] for a in ann_patches(api)] == ["Pending", "Running", "Succeeded"]


def test_an_object_store_snapshot_dir_names_locations_and_leaves_a_missing_one_to_the_restore(
    api, actions, make_watcher
):
    """snapshotDir s3://BUCKET/PREFIX: a pod's snapshot is the location
    s3://BUCKET/PREFIX/<namespace>/<name>; the watcher cannot look for its manifest on the
    node, so a restore goes to the action (whose download refuses a missing one)."""
    api.add_pod(make_pod("p1", annotations={CK: "snap1"}))
    api.add_pod(make_pod("p2", annotations={"cuinterpose.io/restore-from": "snap1"}))
    make_watcher({"snapshotDir": "s3://gpu-snapshots/cluster-a"}).relist()
    loc = "s3://gpu-snapshots/cluster-a/default/snap1"
    assert [(c[0], c[1], c[4] if c[0] == "checkpoint" else c[3]) for c in actions.calls] == [
        ("checkpoint", "default/p1", loc),
        ("restore", "default/p2", loc),
    ]
    assert api.annotations("default", "p1")[SNAP] == loc
    assert api.annotations("default", "p2")[SNAP] == loc
