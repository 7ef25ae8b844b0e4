"""join_host_cgroup_namespace: a process in a cgroup namespace of its own (as a DaemonSet
container on a cgroup v2 node) moves into another process's, and then reads other processes'
cgroup paths as that namespace shows them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cuinterpose.agent.kube.hostcgroup import join_host_cgroup_namespace

PROBE = """
import json, os, sys
from cuinterpose.agent.kube.hostcgroup import join_host_cgroup_namespace
target = int(sys.argv[1])
before = open("/proc/self/cgroup").read()
ino0 = os.stat("/proc/self/ns/cgroup").st_ino
res = join_host_cgroup_namespace(target)
print(json.dumps({"res": res, "ino0": ino0, "ino1": os.stat("/proc/self/ns/cgroup").st_ino,
                  "before": before, "after": open("/proc/self/cgroup").read(),
                  "again": join_host_cgroup_namespace(target)}))
"""


def test_a_process_in_its_own_cgroup_namespace_joins_the_nodes(cgroup_dir):
    cg = cgroup_dir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LD_")}
    # move the child into a test cgroup first, then into a cgroup namespace rooted there
    out = subprocess.run(
        [
            "sh",
            "-c",
            f'echo $$ > {cg}/cgroup.procs && exec unshare --cgroup "$@"',
            "sh",
            sys.executable,
            "-c",
            PROBE,
            str(os.getpid()),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    r = json.loads(out)
    mine = os.stat("/proc/self/ns/cgroup").st_ino
    name = os.path.basename(cg)
    assert (r["res"], r["ino1"], r["again"]) == ("joined", mine, "same")
    assert r["ino0"] != mine
    # inside its own namespace its cgroup reads as the namespace root ("/"); joined, as
    # ours shows it ("/<test cgroup>")
    hier = next(ln.split(":")[0] for ln in r["after"].splitlines() if ln.endswith(f"/{name}"))
    line = {ln.split(":")[0]: ln for ln in r["before"].splitlines()}[hier]
    assert line.endswith(":/") and name not in r["before"]
    assert f":/{name}\n" in r["after"]


def test_same_namespace_and_unreadable_ones_change_nothing():
    ino = os.stat("/proc/self/ns/cgroup").st_ino
    assert join_host_cgroup_namespace(os.getpid()) == "same"
    assert join_host_cgroup_namespace(2**22 + 12345).startswith(
        f"unavailable: /proc/{2**22 + 12345}/ns/cgroup: No such file or directory"
    )
    assert os.stat("/proc/self/ns/cgroup").st_ino == ino
