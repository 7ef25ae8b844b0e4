"""workloads/mpcontract.py: the events of a tree's processes, all written to one log file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

EMITTER = """
import sys
from cuinterpose.workloads import mpcontract
for i in range(int(sys.argv[1])):
    mpcontract.emit(sys.argv[2], "tick", i=i, pad="x" * (i % 97))
"""


def test_lines_of_processes_sharing_one_log_never_interleave(tmp_path):
    """CI stop 31: unbuffered ``print`` wrote a line and its newline apart, so two ranks' events
    merged into one unparsable line and a harness waited for them forever. Four processes emit
    3000 lines each into one O_APPEND file at once: every line parses, each exactly once."""
    log = tmp_path / "log"
    n, procs = 3000, 4
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "ab") as out:
        ps = [
            subprocess.Popen([sys.executable, "-c", EMITTER, str(n), f"r{k}"], stdout=out, env=env)
            for k in range(procs)
        ]
        assert [p.wait(timeout=300) for p in ps] == [0] * procs
    lines = log.read_text().splitlines()
    events = [json.loads(line) for line in lines]  # raises on a merged line
    assert len(events) == n * procs
    for k in range(procs):
        assert [e["i"] for e in events if e["role"] == f"r{k}"] == list(range(n))
