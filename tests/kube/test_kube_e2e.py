"""``python -m cuinterpose.agent.kube`` (the standalone watcher, default actions: the agent's
own checkpoint/restore in-process) against the fake API server, on real processes.

Pods have no real cgroups here: the watcher's ``procRoot`` is a directory laid out like /proc
whose ``PID/cgroup`` puts the test's processes into the pod's container; ``PID/stat`` is the
real one. Everything after the resolver (census, quiesce, CRIU, restore) uses the real /proc.
The restore's placeholder pod is a real process in namespaces of its own (net, uts, ipc, mnt)
and a test cgroup: the restored job must end up in them.
Uses the installed shim: run under ``flock -s /tmp/cuinterpose-build.lock``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import yaml
from fakeapi import NODE, make_pod
from placement_kit import not_placed
from proclayout import lay_proc

from cuinterpose.agent import paths
from cuinterpose.agent.mech.census import walk_tree
from cuinterpose.workloads.afdwin import demo

CID = "c0ffee" * 10 + "abcd"
PCID = "f" * 64  # the placeholder pod's container
ST = "cuinterpose.io/checkpoint-status"
MSG = "cuinterpose.io/checkpoint-message"
RST = "cuinterpose.io/restore-status"
RMSG = "cuinterpose.io/restore-message"


@pytest.fixture
def watcher_proc(api, tmp_path):
    """watcher_proc(control_dir) -> Popen of the standalone watcher; SIGTERM at teardown."""
    procs = []

    def _start(control_dir):
        cfg = tmp_path / "config.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "controlDir": str(control_dir),
                    "snapshotDir": str(tmp_path / "snap"),
                    "driver": "fake",
                    "quiesceTimeoutMs": 20000,
                    "phaseTimeoutS": 60,
                    "kubernetes": {
                        "enabled": True,
                        "nodeName": NODE,
                        "apiServer": api.host,
                        "procRoot": str(tmp_path / "proc"),
                        "watchTimeoutSeconds": 5,
                    },
                }
            )
        )
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        log = open(tmp_path / "watcher.log", "wb")
        p = subprocess.Popen(
            [sys.executable, "-m", "cuinterpose.agent.kube", "--config", str(cfg), "-v"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
        )
        procs.append(p)
        # wait until it watches (the list came first)
        assert api.wait_for(lambda a: any("watch=true" in q for _, q in a.requests), 60), (
            tmp_path / "watcher.log"
        ).read_text()
        return p

    yield _start
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_standalone_watcher_refuses_a_pod_without_cuda(api, tmp_path, watcher_proc):
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        lay_proc(tmp_path / "proc", CID, [sleeper.pid])
        ctl = tmp_path / "ctl"
        ctl.mkdir()
        w = watcher_proc(ctl)
        api.add_pod(
            make_pod(
                "p1",
                annotations={"cuinterpose.io/checkpoint": "snap1"},
                containers=[("main", f"containerd://{CID}")],
            )
        )
        assert api.wait_for(lambda a: a.annotations("default", "p1").get(ST) == "Failed", 120)
        a = api.annotations("default", "p1")
        assert a[MSG] == (
            f"census: no cuinterpose participant under root pid(s) {sleeper.pid} "
            f"(no process maps {paths.shim_path()} and has a socket in {ctl}): "
            "the job is not running under the shim (start it with "
            "LD_PRELOAD=$(cuinterpose-agent shim-path)), or has not started its "
            "CUDA processes or initialized CUDA (cuInit) yet; retry once "
            "cuinterpose-<pid>.sock appears in the control dir [outcome: refused]"
        )
        assert sleeper.poll() is None  # untouched
        assert not (tmp_path / "snap" / "default" / "snap1").exists()
        w.send_signal(signal.SIGTERM)
        assert w.wait(30) == 0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_afdwin_checkpoint_and_restore_through_annotations(
    api, tmp_path, watcher_proc, criu_ok, subreaper, placeholder, cgroup_dir
):
    # the run holds at step 20 until the checkpoint's quiesce: the cut lands there, however
    # long the watcher takes to act on the annotation
    steps, hold = 300, 20
    a = demo.Afdwin(tmp_path / "run", steps=steps, step_delay_ms=5, hold_at=(hold,)).start()
    try:
        a.wait_hold()
        pids = [p for p, _, _ in walk_tree([a.pid])]
        lay_proc(tmp_path / "proc", CID, pids)
        watcher_proc(a.ctl)
        api.add_pod(
            make_pod(
                "job",
                annotations={"cuinterpose.io/checkpoint": "snap1"},
                containers=[("main", f"containerd://{CID}")],
            )
        )
        assert api.wait_for(
            lambda x: x.annotations("default", "job").get(ST) in ("Succeeded", "Failed"), 300
        )
        ann = api.annotations("default", "job")
        snap = tmp_path / "snap" / "default" / "snap1"
        assert (ann[ST], ann["cuinterpose.io/snapshot"]) == ("Succeeded", str(snap)), ann[MSG]
        assert a.wait_dumped() == -signal.SIGKILL
        assert (snap / "manifest.json").is_file()
        assert demo.cut_seqs(a.events()) == {(0, 1): hold}

        # a placeholder pod on the same node asks for the restore: its container's init runs
        # in namespaces of its own (the mount namespace a private copy of ours: same image,
        # same volumes) and in a cgroup of its own
        ph = placeholder("job-restored", cgroup=cgroup_dir(), mount=True, stdout=False)
        lay_proc(tmp_path / "proc", PCID, [ph.pid])
        api.add_pod(
            make_pod(
                "job-restored",
                annotations={"cuinterpose.io/restore-from": "snap1"},
                containers=[("main", f"containerd://{PCID}")],
            )
        )
        assert api.wait_for(
            lambda x: x.annotations("default", "job-restored").get(RST) in ("Succeeded", "Failed"),
            300,
        )
        r = api.annotations("default", "job-restored")
        assert r[RST] == "Succeeded", r[RMSG]
        assert r[RMSG].endswith(f"from {snap} into container main (pid {ph.pid}): roots {a.pid}")
        assert not_placed(a.pid, ph.pid) == []
        assert a.wait_restored_exit(300) in (0, None)
        evs = a.events()
        s = [e for e in evs if demo.kind(e) == "summary"][-1]
        assert (s["ok"], s["lost"], s["duplicated"], s["torn"], s["restores_seen"]) == (
            True,
            0,
            0,
            0,
            1,
        )
    finally:
        if demo.pid_alive(a.pid):
            for pid in [p for p, _, _ in walk_tree([a.pid])] if demo.pid_alive(a.pid) else []:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        a.kill()
