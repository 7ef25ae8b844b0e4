"""Case 007 (shared/cases/007-long-control-dir): a control dir too long for a Unix socket path
was reported as fine by doctor and blamed wrongly by checkpoint and inspect.

Kind: a limit of the socket address (sun_path, 108 bytes with its NUL) not checked where the
control dir is taken. Fixed: doctor, the census and inspect check that
``DIR/cuinterpose-<pid_max - 1>.sock`` fits in 107 bytes and name the limit.
"""

from __future__ import annotations

import os

from cuinterpose.agent.mech import census_checks
from cuinterpose.workloads.afdwin import demo


def long_dir(tmp_path):
    """A directory whose socket path for the longest pid is 108 bytes (one over)."""
    longest = len(f"/cuinterpose-{census_checks.pid_max() - 1}.sock")
    base = str(tmp_path)
    d = base + "/" + "d" * (108 - longest - len(base) - 1)
    os.makedirs(d, mode=0o700)
    assert len(f"{d}/cuinterpose-{census_checks.pid_max() - 1}.sock") == 108
    return d


def reason(d):
    pm = census_checks.pid_max()
    return (
        f"control dir {d} is too long for a Unix socket: {d}/cuinterpose-{pm - 1}.sock is 108 "
        "bytes, over the limit of 107 (sockaddr_un.sun_path is 108 bytes with its NUL; the "
        f"longest pid is pid_max - 1, /proc/sys/kernel/pid_max {pm}), so the shim cannot bind "
        "its control socket there; use a shorter CUINTERPOSE_CONTROL_DIR / --control-dir"
    )


def test_doctor_names_the_limit(tmp_path):
    d = long_dir(tmp_path)
    rc, out = demo.run_agent("doctor", "--driver", "fake", "--control-dir", d)
    assert rc != 0 and out["ok"] is False, out
    (ctl,) = [c for c in out["checks"] if c["name"] == "control dir"]
    assert ctl == {"name": "control dir", "ok": False, "detail": reason(d)}


def test_checkpoint_and_inspect_name_the_limit(tmp_path):
    d = long_dir(tmp_path)
    pid = os.getpid()
    rc, out = demo.run_agent(
        "checkpoint",
        "--pid",
        str(os.getppid() if os.getppid() > 1 else pid),
        "--images-dir",
        str(tmp_path / "snap"),
        "--driver",
        "fake",
        "--control-dir",
        d,
    )
    assert rc == 3, out
    assert (out["error"]["phase"], out["error"]["reason"]) == ("census", reason(d))
    assert not (tmp_path / "snap").exists()
    rc, out = demo.run_agent("inspect", "--pid", str(pid), "--control-dir", d)
    assert rc == 3, out
    assert (out["error"]["phase"], out["error"]["reason"]) == ("INSPECT", reason(d))


def test_one_byte_shorter_is_fine(tmp_path):
    d = long_dir(tmp_path)[:-1]
    assert census_checks.socket_dir_problem(d) is None
