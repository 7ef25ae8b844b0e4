"""``serve`` start-up as an operator meets it: a missing snapshot dir is created (0700) and
lists as empty, one that cannot be created stops the start (exit 2), the ready line's fields
are those ``serve --help`` names, SIGHUP stops the daemon like SIGTERM, and the CLI sends a
relative --dir/--images-dir as an absolute path of its own working directory. No CRIU."""

from __future__ import annotations

import json
import os
import signal
import stat
import tempfile

import pytest
from test_service import cli


def test_missing_snapshot_dir_is_created_0700_and_lists_empty(daemon, tmp_path):
    root = tmp_path / "var" / "lib" / "snaps"
    a = daemon("n1", "--snapshot-dir", str(root))
    assert a["snapshot_dirs"] == [str(root)]
    assert root.is_dir() and stat.S_IMODE(root.stat().st_mode) == 0o700
    assert f"created the snapshot dir {root} (mode 0700)" in open(a["stderr"]).read()
    rc, out, err = cli("snapshots", "--agent", a["listen"], "--json")
    assert rc == 0, err
    assert json.loads(out)["snapshots"] == []


def test_existing_snapshot_dir_is_left_as_it_is(daemon, tmp_path):
    root = tmp_path / "snaps"
    root.mkdir()
    root.chmod(0o755)
    a = daemon("n1", "--snapshot-dir", str(root))
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    assert "created the snapshot dir" not in open(a["stderr"]).read()


def test_snapshot_dir_that_cannot_be_created_stops_the_start(tmp_path):
    """Under a regular file (on the command line), or a regular file itself (from the config's
    snapshotDir: --snapshot-dir's own check refuses a file as a usage error already)."""
    f = tmp_path / "afile"
    f.write_text("x")
    d = tempfile.mkdtemp(prefix="cui-agent-")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"snapshotDir: {f}\n")
    for args, bad, why in (
        (["--snapshot-dir", str(f / "snaps")], f / "snaps", "Not a directory"),
        (["--config", str(cfg)], f, "exists and is not a directory"),
    ):
        rc, out, err = cli("serve", "--listen", f"unix:{d}/agent.sock", *args, "--json")
        assert rc == 2, err
        e = json.loads(out)["error"]
        assert (e["phase"], e["outcome"]) == ("serve", "usage")
        assert e["reason"] == f"cannot create the snapshot dir {bad}: {why}"
        assert not os.path.exists(f"{d}/agent.sock")
    assert f.read_text() == "x"
    os.rmdir(d)


def test_ready_line_fields_are_the_ones_help_names(daemon, tmp_path):
    a = daemon("n1")
    keys = sorted(k for k in a if k not in ("proc", "stderr"))
    assert keys == sorted(
        [
            "ok",
            "listen",
            "metrics_port",
            "node",
            "pid",
            "kubernetes",
            "insecure",
            "snapshot_dirs",
            "group_lease_s",
        ]
    )
    assert a["kubernetes"] is False
    rc, out, _ = cli("serve", "--help")
    assert rc == 0
    flat = " ".join(out.split())
    assert (
        "{"
        + ", ".join(
            ['"ok": true']
            + [
                f'"{k}"'
                for k in (
                    "listen",
                    "metrics_port",
                    "node",
                    "pid",
                    "kubernetes",
                    "insecure",
                    "snapshot_dirs",
                    "group_lease_s",
                )
            ]
        )
        + "}"
        in flat
    )


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT])
def test_serve_stops_on_sighup_sigterm_and_sigint(daemon, sig):
    a = daemon("n1")
    sock = a["listen"][len("unix:") :]
    assert os.path.exists(sock)
    a["proc"].send_signal(sig)
    assert a["proc"].wait(timeout=60) == 0
    assert not os.path.exists(sock)


def test_cli_sends_relative_paths_as_absolute_ones_of_its_working_directory(daemon, tmp_path):
    root = tmp_path / "snaps"
    (root / "sub").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    a = daemon("n1", "--snapshot-dir", str(root))
    # from inside the root, "sub" is root/sub
    rc, out, err = cli("snapshots", "--agent", a["listen"], "--dir", "sub", "--json", cwd=root)
    assert rc == 0, err
    assert json.loads(out)["dir"] == str(root / "sub")
    # from elsewhere it is elsewhere/sub (not root/sub): refused, naming that path
    rc, out, _ = cli("snapshots", "--agent", a["listen"], "--dir", "sub", "--json", cwd=elsewhere)
    e = json.loads(out)["error"]
    assert rc == 3 and e["outcome"] == "refused"
    assert e["reason"].startswith(
        f"snapshot dir {elsewhere / 'sub'} resolves to "
        f"{elsewhere / 'sub'}, outside the agent's snapshot directory"
    )
    rc, out, _ = cli(
        "checkpoint",
        "--agent",
        a["listen"],
        "--pid",
        str(os.getpid()),
        "--images-dir",
        "job1",
        "--json",
        cwd=elsewhere,
    )
    e = json.loads(out)["error"]
    assert rc == 3 and e["phase"] == "images dir"
    assert e["reason"].startswith(f"images dir {elsewhere / 'job1'} resolves to")
    assert not (root / "job1").exists() and not (elsewhere / "job1").exists()


def test_a_second_serve_on_a_live_socket_is_refused_naming_the_daemon(daemon, tmp_path):
    """A second ``serve`` on the socket a running daemon listens on does not take it over: exit
    2 naming that daemon's pid; the first keeps its socket (same inode) and answers. A stale
    socket (bound, nobody listening) is replaced."""
    import socket

    a = daemon("n1")
    path = a["listen"][len("unix:") :]
    ino = os.stat(path).st_ino
    rc, out, err = cli("serve", "--listen", a["listen"], "--snapshot-dir", str(tmp_path), "--json")
    assert rc == 2, err
    e = json.loads(out)["error"]
    assert (e["phase"], e["outcome"]) == ("serve", "usage")
    assert e["reason"] == (
        f"cannot listen on {a['listen']}: {path} is already served by pid {a['pid']} (it "
        "answered a connection); stop that daemon first, or --listen elsewhere; a stale socket "
        "(nobody listening) is replaced"
    )
    assert os.stat(path).st_ino == ino
    rc, out, err = cli("health", "--agent", a["listen"])
    assert (rc, out.strip()) == (0, "SERVING"), err

    stale = os.path.join(os.path.dirname(path), "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()  # bound, never listened on: a connection is refused
    b = daemon("n2", listen=f"unix:{stale}")
    assert b["listen"] == f"unix:{stale}"
    rc, out, err = cli("health", "--agent", b["listen"])
    assert (rc, out.strip()) == (0, "SERVING"), err
