"""The DaemonSet's code path: ``cuinterpose-agent serve --config FILE`` with the Helm chart's
ConfigMap document, the pod watcher running inside the daemon, against the fake API server.

The chart is rendered by helm (tests/chart/helm_kit.py) with values that only point it at this test's
world: the control and snapshot directories, a Unix socket, metrics on a free loopback port,
fakecuda, and the ``kubernetes`` settings (``apiServer`` = the fake API server, ``procRoot`` = a
laid-out /proc that puts the test's processes into the pods' containers, as in
test_kube_e2e.py). The daemon runs the DaemonSet container's command and args, with its
environment (``NODE_NAME`` from the downward API, ``CUINTERPOSE_CONTROL_DIR``).

One daemon, in order: ready line; health SERVING; a pod on another node is never touched; a
real afdwin on fakecuda is checkpointed through ``cuinterpose.io/checkpoint`` (CRIU) and
restored through a placeholder pod's ``cuinterpose.io/restore-from``, nothing lost; the
daemon's metrics count both; then a pod whose workload never quiesces keeps a request in
flight: health is SERVING, a gRPC checkpoint waits for the node (the same lock), SIGTERM lets
the request finish (Failed, the workload untouched), starts no other, and the daemon exits 0.
Uses the installed shim: run under ``flock -s /tmp/cuinterpose-build.lock``."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest
from fakeapi import NODE, make_pod
from metrics_kit import scrape
from placement_kit import not_placed
from proclayout import lay_proc

from cuinterpose.agent.kube.hostcgroup import join_host_cgroup_namespace
from cuinterpose.agent.mech.census import walk_tree
from cuinterpose.agent.rpc import client
from cuinterpose.agent.snapshot import pb
from cuinterpose.workloads.afdwin import demo

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "chart"))
import helm_kit  # noqa: E402

CID_JOB = "c0ffee" * 10 + "abcd"
CID_STUCK = "5bad" * 16
CID_PLACEHOLDER = "f" * 64
ST, MSG = "cuinterpose.io/checkpoint-status", "cuinterpose.io/checkpoint-message"
RST, RMSG = "cuinterpose.io/restore-status", "cuinterpose.io/restore-message"
CONFIG_PATH = "/etc/cuinterpose/config.yaml"  # where the DaemonSet mounts the ConfigMap


def render(values: dict) -> tuple[dict, str]:
    """(the DaemonSet's agent container, the ConfigMap's config.yaml) of the chart."""
    docs = helm_kit.render(values)
    (ds,) = docs["DaemonSet"]
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    (cm,) = docs["ConfigMap"]
    return agent, cm["data"]["config.yaml"]


def status_patches(api, name: str, key: str) -> list[str]:
    """The values the agent wrote to ``key`` on pod default/NAME, in order."""
    return [
        p["metadata"]["annotations"][key]
        for ns, n, p in api.patches
        if (ns, n) == ("default", name) and key in p["metadata"].get("annotations", {})
    ]


metrics = scrape  # {sample with labels: value} of the daemon's /metrics


def wait_path(p: pathlib.Path, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Block until ``p`` exists (``timeout_s`` is a hang guard, not an assertion on time)."""
    ev = threading.Event()
    for _ in range(int(timeout_s / 0.02)):
        if p.exists():
            return
        assert proc.poll() is None, f"the daemon exited {proc.returncode}"
        ev.wait(0.02)
    raise AssertionError(f"{p} did not appear")


@pytest.fixture
def agent_dir():
    d = tempfile.mkdtemp(prefix="cui-sw-")  # Unix socket paths stay short
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def stuck(subreaper):
    """stuck(control_dir) -> Popen: a process under the shim on fakecuda that initialised CUDA
    (so census counts it) and never answers a quiesce request."""
    procs = []

    def _start(ctl):
        p = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from cuda.bindings import driver as cu\n"
                "print(int(cu.cuInit(0)[0]), flush=True)\nimport time\ntime.sleep(600)\n",
            ],
            env=demo.workload_env(ctl),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        procs.append(p)
        assert p.stdout.readline() == "0\n"
        return p

    yield _start
    for p in procs:
        p.kill()
        p.wait()


def test_serve_config_from_the_chart_runs_the_pod_watcher(
    api, tmp_path, afdwin, stuck, agent_dir, placeholder, cgroup_dir
):
    steps = 1500
    # held at step 20 until the annotation's quiesce: the checkpoint lands mid-stream however
    # long the chart's rendering and the daemon's start take on a busy machine (case 014)
    a = afdwin(steps=steps, step_delay_ms=5, hold_at=(20,))
    a.wait_for(lambda ev: demo.received(ev) >= 20, 120, "20 messages")
    proc_root, snaps = tmp_path / "proc", tmp_path / "snap"
    lay_proc(proc_root, CID_JOB, [p for p, _, _ in walk_tree([a.pid])])
    sock = agent_dir / "agent.sock"

    agent, config_text = render(
        {
            "controlDir": {"hostPath": str(a.ctl)},
            "snapshots": {"mountPath": str(snaps)},
            "config": {
                "listenAddress": f"unix:{sock}",
                "metricsPort": 0,
                "metricsAddress": "127.0.0.1",
                "driver": "fake",
                "quiesceTimeoutMs": 5000,
                "kubernetes": {
                    "apiServer": api.host,
                    "procRoot": str(proc_root),
                    "watchTimeoutSeconds": 5,
                },
            },
        }
    )
    assert (agent["command"], agent["args"]) == (
        ["cuinterpose-agent"],
        ["serve", "--config", CONFIG_PATH],
    )
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config_text)
    exe = pathlib.Path(sys.executable).with_name("cuinterpose-agent")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "cuinterpose.agent.cli"]
    cmd += [str(cfg) if x == CONFIG_PATH else x for x in agent["args"]]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUINTERPOSE_DRIVER")}
    for e in agent["env"]:
        if e["name"] == "NODE_NAME":
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
            env["NODE_NAME"] = NODE
        elif e["name"] == "CUINTERPOSE_CONTROL_DIR":
            env[e["name"]] = e["value"]
        # CUINTERPOSE_LIB_DIR: the node's copy of the shim; here the installed one is used
    errlog = tmp_path / "agent.stderr"
    with open(errlog, "wb") as err:
        d = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env, text=True
        )
    try:
        # the restore's placeholder: its init in namespaces and a cgroup of its own
        ph = placeholder("job-restored", cgroup=cgroup_dir(), mount=True, stdout=False)
        _run(api, a, d, errlog, sock, snaps, proc_root, stuck, steps, ph)
    finally:
        if d.poll() is None:
            d.kill()
            d.wait()


def _run(api, a, d, errlog, sock, snaps, proc_root, stuck, steps, ph):
    line = d.stdout.readline()
    m = re.fullmatch(
        rf"cuinterpose-agent {NODE} serving on unix:{re.escape(str(sock))}, "
        r"metrics on 127\.0\.0\.1:(\d+)\n",
        line,
    )
    assert m, (line, errlog.read_text())
    mport, addr = int(m.group(1)), f"unix:{sock}"
    assert mport > 0  # metricsPort: 0 = a free port the OS picked
    # the watcher lists, then watches, this node's pods only
    assert api.wait_for(lambda x: any("watch=true" in q for _, q in x.requests), 60), (
        errlog.read_text()
    )
    assert (client.health(addr), client.health(addr, client.SERVICE_NAME)) == ("SERVING", "SERVING")

    # a pod on another node, asking for a checkpoint of the very same container
    other = {"cuinterpose.io/checkpoint": "elsewhere"}
    api.add_pod(
        make_pod(
            "other",
            node="node-b",
            annotations=other,
            containers=[("main", f"containerd://{CID_JOB}")],
        )
    )

    # checkpoint through the annotation
    api.add_pod(
        make_pod(
            "job",
            annotations={"cuinterpose.io/checkpoint": "snap1"},
            containers=[("main", f"containerd://{CID_JOB}")],
        )
    )
    assert api.wait_for(
        lambda x: x.annotations("default", "job").get(ST) in ("Succeeded", "Failed"), 300
    )
    ann = api.annotations("default", "job")
    snap = snaps / "default" / "snap1"
    assert (ann[ST], ann["cuinterpose.io/snapshot"], ann["cuinterpose.io/snapshot-node"]) == (
        "Succeeded",
        str(snap),
        NODE,
    ), ann[MSG]
    assert status_patches(api, "job", ST) == ["Pending", "Running", "Succeeded"]
    assert ann["cuinterpose.io/checkpoint-handled"] == "snap1@uid-job"
    assert a.wait_dumped() == -signal.SIGKILL
    man = json.loads((snap / "manifest.json").read_text())
    assert man["roots"] == [a.pid]
    got = metrics(mport)
    assert got['cuinterpose_snapshots_total{kind="checkpoint",result="succeeded"}'] == 1.0
    assert got['cuinterpose_requests_in_flight{kind="checkpoint"}'] == 0.0
    assert got['cuinterpose_phase_duration_seconds_count{kind="checkpoint",phase="census"}'] == 1.0
    assert (
        got['cuinterpose_phase_bytes_total{kind="checkpoint",phase="SAVE_ALLOCATIONS"}']
        == man["totals"]["carrier_bytes"]
    )

    # restore through a placeholder pod
    lay_proc(proc_root, CID_PLACEHOLDER, [ph.pid])
    api.add_pod(
        make_pod(
            "job-restored",
            annotations={"cuinterpose.io/restore-from": "snap1"},
            containers=[("main", f"containerd://{CID_PLACEHOLDER}")],
        )
    )
    assert api.wait_for(
        lambda x: x.annotations("default", "job-restored").get(RST) in ("Succeeded", "Failed"), 300
    )
    r = api.annotations("default", "job-restored")
    assert r[RST] == "Succeeded", r[RMSG]
    assert status_patches(api, "job-restored", RST) == ["Pending", "Running", "Succeeded"]
    assert r[RMSG] == (
        f"restored snapshot {man['snapshot_id']} from {snap} into container "
        f"main (pid {ph.pid}): roots {a.pid}"
    )
    assert not_placed(a.pid, ph.pid) == []
    assert a.wait_restored_exit(300) in (0, None)
    s = [e for e in a.events() if demo.kind(e) == "summary"][-1]
    assert (s["ok"], s["lost"], s["duplicated"], s["torn"], s["restores_seen"]) == (
        True,
        0,
        0,
        0,
        1,
    )
    assert demo.check_run(a.events(), steps) == []
    got = metrics(mport)
    assert got['cuinterpose_snapshots_total{kind="restore",result="succeeded"}'] == 1.0
    assert (
        got['cuinterpose_phase_bytes_total{kind="restore",phase="LOAD_ALLOCATIONS"}']
        == man["totals"]["carrier_bytes"]
    )

    # a request in flight: the workload never quiesces, the checkpoint waits quiesceTimeoutMs
    w = stuck(a.ctl)
    lay_proc(proc_root, CID_STUCK, [w.pid])
    api.add_pod(
        make_pod(
            "stuck",
            annotations={"cuinterpose.io/checkpoint": "snap2"},
            containers=[("main", f"containerd://{CID_STUCK}")],
        )
    )
    wait_path(a.ctl / f"quiesce-{w.pid}.request", d)
    assert api.annotations("default", "stuck")[ST] == "Running"
    assert (client.health(addr), client.health(addr, client.SERVICE_NAME)) == ("SERVING", "SERVING")
    got = metrics(mport)
    assert got['cuinterpose_requests_in_flight{kind="checkpoint"}'] == 1.0
    assert got['cuinterpose_snapshots_total{kind="checkpoint",result="succeeded"}'] == 1.0

    # a gRPC checkpoint meanwhile waits for the node (the lock the pod request holds); its
    # root is a process without the shim: census refuses it once it runs
    sleeper = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _grpc_waits_then_sigterm(api, a, d, errlog, addr, snaps, w, sleeper)
    finally:
        sleeper.kill()
        sleeper.wait()


def _grpc_waits_then_sigterm(api, a, d, errlog, addr, snaps, w, sleeper):
    apb, agrpc, _ = pb.modules()
    events: queue.Queue = queue.Queue()

    def grpc_checkpoint():
        ch = client.channel(addr)
        try:
            req = apb.CheckpointRequest(
                roots=[sleeper.pid],
                images_dir=str(snaps / "grpc"),
                options=apb.CheckpointOptions(control_dir=str(a.ctl), driver="fake"),
            )
            for ev in agrpc.AgentStub(ch).Checkpoint(req, timeout=120):
                events.put(ev)
        except Exception as e:  # noqa: BLE001 - reported below
            events.put(e)
        finally:
            ch.close()
            events.put(None)

    t = threading.Thread(target=grpc_checkpoint, daemon=True)
    t.start()
    first = events.get(timeout=60)
    assert (first.seq, first.progress.event, first.progress.text) == (
        1,
        "note",
        "waiting for the node: the checkpoint snap2 of pod default/stuck is running "
        "(one checkpoint or restore at a time per node)",
    )

    # a request that arrives now is left alone once the daemon is stopping
    api.add_pod(
        make_pod(
            "late",
            annotations={"cuinterpose.io/checkpoint": "snap3"},
            containers=[("main", f"containerd://{CID_STUCK}")],
        )
    )
    d.send_signal(signal.SIGTERM)
    assert d.wait(120) == 0, errlog.read_text()
    # the pod request finished before the daemon left, and its outcome is written
    st = api.annotations("default", "stuck")
    assert status_patches(api, "stuck", ST) == ["Pending", "Running", "Failed"]
    assert st[MSG] == (
        f"quiesce: pid {w.pid} workload did not write {a.ctl}/quiesce-{w.pid}.ready "
        "within 5000 ms; checkpoint refused, nothing was torn down, the workload "
        "keeps running [outcome: refused]"
    )
    assert w.poll() is None  # refused: untouched
    assert api.annotations("default", "late") == {"cuinterpose.io/checkpoint": "snap3"}
    # the waiting gRPC request ran after the pod request, to its result
    t.join(60)
    rest = []
    while (ev := events.get(timeout=1)) is not None:
        rest.append(ev)
    assert [str(e) for e in rest if not hasattr(e, "seq")] == [], rest
    assert [(e.progress.event, e.progress.phase, e.progress.status) for e in rest[:-1]] == [
        ("start", "driver", "running"),
        ("end", "driver", "ok"),
        ("start", "census", "running"),
        ("end", "census", "failed"),
        ("total", "total", "ok"),  # a stopped run's total: the sum of its rows
    ]
    res = rest[-1].result
    assert (rest[-1].seq, res.ok, res.error.phase, res.error.outcome) == (
        7,
        False,
        "census",
        "refused",
    )
    # the other node's pod was never listed, watched or written
    assert api.annotations("default", "other") == {"cuinterpose.io/checkpoint": "elsewhere"}
    assert [n for _, n, _ in api.patches if n == "other"] == []
    assert {
        q.split("fieldSelector=", 1)[1].split("&", 1)[0]
        for m_, q in api.requests
        if m_ == "GET" and q.startswith("/api/v1/pods")
    } == {"spec.nodeName%3Dnode-a"}
    # a clean exit: stderr holds the one warning about the refused pod request (no
    # traceback, no abort at exit); the socket is gone
    reason = (
        f"quiesce: pid {w.pid} workload did not write {a.ctl}/quiesce-{w.pid}.ready "
        "within 5000 ms; checkpoint refused, nothing was torn down, the workload keeps "
        "running"
    )
    # the first start made the chart's snapshot dir; the daemon says when it cannot work in
    # the node's cgroup namespace (here: pid 1's cannot be read); then only the failed request
    # is logged
    ns = join_host_cgroup_namespace()  # what the daemon found (this test process is in
    assert ns in ("same", "joined") or ns.startswith("unavailable")  # the same namespace)
    warn = (
        ""
        if not ns.startswith("unavailable")
        else f"cannot work in the node's cgroup namespace ({ns}); pods whose cgroups lie outside "
        "this agent's cgroup namespace cannot be resolved or restored into\n"
    )
    # the log's records carry a timestamp (asctime), left out here; the gRPC request logs its
    # start when it arrives (it then waits for the node) and its outcome after the pod request's
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
    lines = [stamp.sub("", ln, count=1) for ln in errlog.read_text().splitlines()]
    grpc = f"request 1: checkpoint of root(s) {sleeper.pid} -> {snaps / 'grpc'}"
    expect = [f"cuinterpose-agent: created the snapshot dir {snaps} (mode 0700)"]
    if warn:
        expect.append("cuinterpose.kube WARNING: " + warn.rstrip("\n"))
    expect.append(f"cuinterpose.service INFO: {grpc}: started (client unix:)")
    assert lines[: len(expect)] == expect, lines
    refused = f"cuinterpose.service WARNING: {grpc}: refused: census: no cuinterpose participant "
    tail = lines[len(expect) :]
    assert len(tail) == 2 and sum(ln.startswith(refused) for ln in tail) == 1, tail
    assert f"cuinterpose.kube WARNING: checkpoint snap2 on default/stuck failed: {reason}" in tail
    assert not pathlib.Path(addr[len("unix:") :]).exists()
    assert sleeper.poll() is None and not (snaps / "grpc").exists()
