"""One checkpoint or restore at a time per node: ``AgentService.node_lock`` is held by gRPC
requests and by the pod watcher's (``run_local``), which count in the daemon's metrics. An
in-process ``Server`` on a Unix socket; no CRIU (census refuses a process without the shim)."""

from __future__ import annotations

import queue
import threading

import pytest

from cuinterpose.agent.config import parse_config
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.kube.actions import AgentActions
from cuinterpose.agent.rpc import client
from cuinterpose.agent.snapshot import pb


def samples(srv) -> dict:
    out = {}
    for line in srv.metrics.text().splitlines():
        if line.startswith("cuinterpose_") and "_created" not in line.split(" ")[0]:
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_a_grpc_checkpoint_waits_for_a_pod_request_and_both_are_counted(server, sleeper, tmp_path):
    entered, release = threading.Event(), threading.Event()
    order = []

    def pod_work(rep):
        with rep.phase("census"):
            entered.set()
            release.wait(60)
            order.append("pod done")
        return {"snapshot_id": "x"}

    pod = threading.Thread(
        target=lambda: order.append(
            server.service.run_local("checkpoint", "the checkpoint s1 of pod default/p", pod_work)
        )
    )
    pod.start()
    assert entered.wait(60)
    assert samples(server)['cuinterpose_requests_in_flight{kind="checkpoint"}'] == 1.0

    apb, agrpc, _ = pb.modules()
    events: queue.Queue = queue.Queue()

    def grpc():
        ch = client.channel(server.address)
        req = apb.CheckpointRequest(
            roots=[sleeper.pid],
            images_dir=str(tmp_path / "snap"),
            options=apb.CheckpointOptions(control_dir=str(tmp_path)),
        )
        for ev in agrpc.AgentStub(ch).Checkpoint(req, timeout=60):
            events.put(ev)
            if ev.seq == 2:
                order.append("grpc running")
        ch.close()
        events.put(None)

    g = threading.Thread(target=grpc)
    g.start()
    first = events.get(timeout=60)
    assert (first.seq, first.progress.event, first.progress.text) == (
        1,
        "note",
        "waiting for the node: the checkpoint s1 of pod default/p is running "
        "(one checkpoint or restore at a time per node)",
    )
    assert samples(server)['cuinterpose_requests_in_flight{kind="checkpoint"}'] == 2.0
    release.set()
    pod.join(60)
    g.join(60)
    rest = []
    while (ev := events.get(timeout=1)) is not None:
        rest.append(ev)
    assert order == ["pod done", {"snapshot_id": "x"}, "grpc running"]
    assert [(e.seq, e.progress.phase, e.progress.event) for e in rest[:-1]] == [
        (2, "driver", "start"),
        (3, "driver", "end"),
        (4, "census", "start"),
        (5, "census", "end"),
        (6, "total", "total"),  # a stopped run's total too: the sum of its rows
    ]
    assert (rest[-1].result.ok, rest[-1].result.error.phase) == (False, "census")
    m = samples(server)
    assert m['cuinterpose_requests_in_flight{kind="checkpoint"}'] == 0.0
    assert m['cuinterpose_snapshots_total{kind="checkpoint",result="succeeded"}'] == 1.0
    assert m['cuinterpose_snapshots_total{kind="checkpoint",result="failed"}'] == 1.0
    # the pod request's census and the gRPC request's
    assert m['cuinterpose_phase_duration_seconds_count{kind="checkpoint",phase="census"}'] == 2.0
    assert server.service.busy_with == "" and not server.service.node_lock.locked()


def test_pod_actions_run_through_the_daemon(server, sleeper, tmp_path):
    """``AgentActions(config, service=...)`` (what serve gives the watcher): the agent's own
    checkpoint and restore, under the node lock, counted; a failure is counted as failed and
    raised to the watcher as it is."""
    cfg = parse_config({"driver": "fake", "controlDir": str(tmp_path)}, env={})
    acts = AgentActions(cfg, service=server.service)
    pod = {"metadata": {"namespace": "default", "name": "p"}}
    with pytest.raises(AgentError) as e:
        acts.checkpoint(pod, "s1", roots=[sleeper.pid], images_dir=str(tmp_path / "s1"))
    assert (e.value.phase, e.value.outcome) == ("census", "refused")
    with pytest.raises(AgentError) as e:
        acts.restore(pod, "s1", images_dir=str(tmp_path / "none"))
    assert e.value.outcome == "refused"
    m = samples(server)
    assert m['cuinterpose_snapshots_total{kind="checkpoint",result="failed"}'] == 1.0
    assert m['cuinterpose_snapshots_total{kind="restore",result="failed"}'] == 1.0
    assert m['cuinterpose_phase_duration_seconds_count{kind="checkpoint",phase="driver"}'] == 1.0
    assert m['cuinterpose_phase_duration_seconds_count{kind="checkpoint",phase="census"}'] == 1.0
    assert (
        m['cuinterpose_requests_in_flight{kind="checkpoint"}'],
        m['cuinterpose_requests_in_flight{kind="restore"}'],
    ) == (0.0, 0.0)
    assert not server.service.node_lock.locked()
