"""The command line as an operator meets it: --json on every path, exit codes, and helpers
(CRIU) started without the shim."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cuinterpose.agent import paths
from cuinterpose.workloads.afdwin import demo


def test_json_usage_error_is_one_json_object_exit_2(tmp_path):
    rc, out = demo.run_agent("checkpoint", "--images-dir", str(tmp_path / "snap"))
    assert rc == 2
    assert out == {
        "ok": False,
        "error": {
            "phase": "usage",
            "pid": None,
            "outcome": "usage",
            "reason": "Missing option '--pid'.",
            "message": "usage: Missing option '--pid'.",
        },
    }


def test_unusable_images_dir_is_refused_exit_3(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    rc, out = demo.run_agent(
        "checkpoint",
        "--pid",
        str(os.getpid()),
        "--images-dir",
        str(f / "snap"),
        "--driver",
        "fake",
        "--control-dir",
        str(tmp_path),
    )
    assert rc == 3 and out["ok"] is False
    e = out["error"]
    assert (e["phase"], e["pid"], e["outcome"]) == ("images dir", None, "refused")
    assert e["reason"] == f"{f / 'snap'} cannot be created: Not a directory"
    assert out["phases"] == []
    assert f.read_text() == "x"


def test_restore_refusal_hint_speaks_of_the_snapshot(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "cuinterpose.agent.cli",
            "restore",
            "--images-dir",
            str(tmp_path),
            "--driver",
            "fake",
        ],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
    )
    assert res.returncode == 3
    assert res.stderr.splitlines()[-1] == (
        "outcome: refused: nothing was changed; the snapshot is untouched"
    )


def test_helpers_run_without_ld_preload_and_the_agent_not_under_the_shim(tmp_path):
    """Started with LD_PRELOAD=<shim> (as from a preloaded shell), the agent re-executes itself
    without the shim (it opens no control socket of its own) and CRIU gets no LD_PRELOAD."""
    rec = tmp_path / "env"
    rec.mkdir()
    fake_criu = tmp_path / "criu"
    # records its environment and whether its parent (the agent) maps the shim
    fake_criu.write_text(
        f'#!/bin/sh\nenv > "{rec}/env.$$"\n'
        f'grep -c {paths.SHIM_NAME} /proc/$PPID/maps > "{rec}/maps.$$"\n'
        'echo "Version: 4.1.0"\necho "Looks good."\n'
    )
    fake_criu.chmod(0o755)
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    env = dict(
        os.environ,
        LD_PRELOAD=str(paths.shim_path()),
        CUINTERPOSE_CRIU=str(fake_criu),
        LD_LIBRARY_PATH=str(paths.fakecuda_dir()),
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "cuinterpose.agent.cli",
            "doctor",
            "--json",
            "--driver",
            "fake",
            "--control-dir",
            str(ctl),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    out = json.loads(res.stdout)
    checks = {c["name"]: c for c in out["checks"]}
    assert checks["criu version"]["ok"] and checks["criu check"]["ok"], out
    envs = [p.read_text().splitlines() for p in sorted(rec.glob("env.*"))]
    assert len(envs) >= 2  # `criu check` and `criu --version` at least
    assert {p.read_text().strip() for p in rec.glob("maps.*")} == {"0"}
    for lines in envs:
        assert not any(line.startswith(("LD_PRELOAD=", "LD_LIBRARY_PATH=")) for line in lines)
    assert sorted(p.name for p in ctl.iterdir()) == []


def test_doctor_lines_are_not_wrapped_when_stdout_is_not_a_tty(tmp_path):
    """A log or a pipe gets each check on one line: paths and hashes stay greppable. Without
    CRIU the CRIU checks fail and doctor exits 1."""
    from cuinterpose.agent.mech.census import ShimFile

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["CUINTERPOSE_CRIU"] = str(tmp_path / "no-criu-here")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "cuinterpose.agent.cli",
            "doctor",
            "--driver",
            "fake",
            "--control-dir",
            str(tmp_path / "ctl"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 1
    s = ShimFile.of(paths.shim_path())
    lines = res.stdout.splitlines()
    assert f"ok   shim: {s.path} sha256 {s.sha256}" in lines
    # a diagnostic creates nothing (helper review, stop 21: it made the directory it checked)
    assert f"ok   control dir: {tmp_path / 'ctl'} does not exist: no shim has bound a socket " in (
        "\n".join(lines)
    )
    assert not (tmp_path / "ctl").exists()
    (tmp_path / "ctl").mkdir(mode=0o700)
    res = subprocess.run(res.args, capture_output=True, text=True, env=env, timeout=120)
    assert f"ok   control dir: {tmp_path / 'ctl'} writable" in res.stdout.splitlines()
    assert lines[0] == "FAIL criu version: no working CRIU:"


def test_non_positive_timeouts_are_refused_naming_the_flag(tmp_path):
    """An option out of its range is refused as every source of it is (agent/options.py):
    exit 3, phase "request", naming the flag and the value; a value that is no number at all
    is a usage error of the command line (exit 2)."""
    rc, out = demo.run_agent("restore", "--images-dir", str(tmp_path), "--carrier-timeout-s", "0")
    assert rc == 3
    assert (out["error"]["phase"], out["error"]["outcome"], out["error"]["reason"]) == (
        "request",
        "refused",
        "--carrier-timeout-s=0.0: must be a finite number of seconds above 0 and at most 86400",
    )
    rc, out = demo.run_agent("restore", "--images-dir", str(tmp_path), "--carrier-timeout-s", "x")
    assert (rc, out["error"]["reason"]) == (
        2,
        "Invalid value for '--carrier-timeout-s': 'x' is not a valid float.",
    )


def _env(**extra):
    return {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, **extra}


def test_restore_of_a_missing_images_dir_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "nonexistent"
    rc, out = demo.run_agent("restore", "--images-dir", str(missing), "--driver", "fake")
    assert rc == 3
    e = out["error"]
    assert (e["phase"], e["outcome"]) == ("manifest", "refused")
    assert e["reason"] == f"{missing} does not exist"
    assert not missing.exists()


def test_census_refusal_says_the_job_has_not_initialized_cuda_or_is_not_under_the_shim(tmp_path):
    """A job checkpointed before its ranks called cuInit (the README's `checkpoint --pid $!`
    right after the launch), and one not started under the shim: the refusal says which."""
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    preload = _env(LD_PRELOAD=str(paths.shim_path()), LD_LIBRARY_PATH=str(paths.fakecuda_dir()))
    for env, want in (
        (
            preload,
            "map the shim but have no control socket: the job has probably "
            "not initialized CUDA (cuInit) yet",
        ),
        (
            _env(),
            "the job is not running under the shim (start it with "
            "LD_PRELOAD=$(cuinterpose-agent shim-path))",
        ),
    ):
        job = subprocess.Popen(
            ["setsid", "sleep", "60"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            rc, out = demo.run_agent(
                "checkpoint",
                "--pid",
                str(job.pid),
                "--images-dir",
                str(tmp_path / "snap"),
                "--driver",
                "fake",
                "--control-dir",
                str(ctl),
            )
        finally:
            job.kill()
            job.wait()
        assert rc == 3, out
        e = out["error"]
        assert (e["phase"], e["outcome"]) == ("census", "refused")
        assert e["reason"].startswith(
            f"no cuinterpose participant under root pid(s) {job.pid} "
            f"(no process maps {paths.shim_path()} and has a socket "
            f"in {ctl}): "
        ), e
        assert want in e["reason"], e
        assert not (tmp_path / "snap").exists()


def test_real_driver_missing_names_the_fake_driver(tmp_path):
    """Without libcuda.so.1 the driver error carries the doctor's hint, once, in both places."""
    probe = subprocess.run(
        [sys.executable, "-c", "from cuinterpose.agent.mech import native\nnative.load('real')"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    if probe.returncode == 0:
        import pytest

        pytest.skip("a real libcuda.so.1 loads here: no missing-driver error to check")
    hint = "(no NVIDIA driver on this machine? --driver fake uses fakecuda)"
    assert "cuda.bindings could not load libcuda.so.1" in probe.stderr, probe.stderr
    assert hint in probe.stderr
    rc, out = demo.run_agent(
        "checkpoint",
        "--pid",
        str(os.getpid()),
        "--images-dir",
        str(tmp_path / "snap"),
        "--driver",
        "real",
    )
    assert rc == 3 and out["error"]["phase"] == "driver"
    assert out["error"]["reason"].endswith(hint), out
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "cuinterpose.agent.cli",
            "doctor",
            "--json",
            "--driver",
            "real",
            "--control-dir",
            str(tmp_path / "ctl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(CUINTERPOSE_CRIU=str(tmp_path / "no-criu-here")),
    )
    drv = {c["name"]: c for c in json.loads(res.stdout)["checks"]}["driver"]
    assert not drv["ok"] and drv["detail"].count(hint) == 1, drv


def test_help_texts_match_the_code():
    def help_of(*cmd):
        r = subprocess.run(
            [sys.executable, "-m", "cuinterpose.agent.cli", *cmd, "--help"],
            capture_output=True,
            text=True,
            env=_env(COLUMNS="2000"),
            timeout=60,
        )
        assert r.returncode == 0
        return " ".join(r.stdout.split())

    serve = help_of("serve")
    assert (
        '{"ok": true, "listen", "metrics_port", "node", "pid", "kubernetes", "insecure", '
        '"snapshot_dirs", "group_lease_s"}'
    ) in serve
    assert "until SIGTERM, SIGINT or SIGHUP" in serve
    assert "Created at start (mode 0700) when missing" in serve
    assert "The CLI sends --images-dir/--dir as absolute paths" in serve
    restore = help_of("restore")
    assert "runs inside its mount namespace (CRIU's child enters it)" in restore
    assert "net, ipc and uts namespaces (--join-ns)" in restore
    assert "uses the control dir recorded in the snapshot's manifest" in restore
    assert "--control-dir" not in restore.split("Options:")[1]


def test_a_checkpoint_of_a_job_that_exited_says_so(tmp_path):
    """README: a job that exited before the checkpoint (a zombie root, or no process at the
    pid) is refused saying it exited, never "the workload keeps running"."""
    import free_kit

    ctl = tmp_path / "ctl"
    ctl.mkdir(mode=0o700)
    zombie = subprocess.Popen(["true"], start_new_session=True)
    while not open(f"/proc/{zombie.pid}/stat").read().rpartition(")")[2].split()[0] == "Z":
        os.sched_yield()
    [gone] = free_kit.free_pids(1)
    try:
        for pid, want in (
            (zombie.pid, f"nothing was done; the job has exited (pid {zombie.pid} is a zombie)"),
            (gone, f"nothing was done; no process has pid {gone}"),
        ):
            res = subprocess.run(
                [sys.executable, "-m", "cuinterpose.agent.cli", "checkpoint", "--pid", str(pid),
                 "--images-dir", str(tmp_path / f"s{pid}"), "--driver", "fake",
                 "--control-dir", str(ctl)],
                capture_output=True, text=True, env=_env(),
            )  # fmt: skip
            assert res.returncode == 3, res.stderr
            assert res.stderr.splitlines()[-1] == f"outcome: refused: {want}", res.stderr
            assert "keeps running" not in res.stderr
    finally:
        zombie.wait()


def _tree(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_an_empty_path_address_or_value_is_a_usage_error_and_removes_nothing(tmp_path):
    """`delete "$SNAP"` with SNAP unset, run inside a snapshot dir, must not delete it; an empty
    --agent must not run in-process; an empty --listen must not serve on the default socket:
    every empty value is a usage error (exit 2) naming the option, and nothing changes."""
    snap = tmp_path / "victim"
    snap.mkdir()
    (snap / "manifest.json").write_text('{"snapshot_id": "x"}')
    (snap / "criu").mkdir()
    (snap / "criu" / "core-1.img").write_bytes(b"\x00\x01\x02core")
    before = _tree(snap)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    res = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", "delete", ""],
        cwd=snap,
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 2
    assert res.stderr.splitlines()[-1] == (
        "Error: Invalid value for 'IMAGES_DIR': an empty value is not accepted (an unset "
        "variable?): give one"
    )
    assert _tree(snap) == before
    opt_err = (
        "an empty value is not accepted (an unset variable?): give one, or leave the option out"
    )
    cases = [
        (
            "--agent",
            ["checkpoint", "--pid", "1", "--images-dir", str(tmp_path / "n"), "--agent", ""],
        ),
        ("--images-dir", ["checkpoint", "--pid", "1", "--images-dir", ""]),
        ("--images-dir", ["restore", "--images-dir", ""]),
        ("--control-dir", ["release", "--pid", "1", "--control-dir", ""]),
        ("--dir", ["snapshots", "--dir", ""]),
        ("[PATH]", ["snapshots", ""]),
        ("--listen", ["serve", "--listen", ""]),
        ("--agent", ["inspect", "--pid", "1", "--agent", ""]),
        ("--device-map", ["restore", "--images-dir", str(snap), "--device-map", ""]),
    ]
    for name, argv in cases:
        rc, out = demo.run_agent(*argv)
        assert rc == 2, (argv, out)
        tail = opt_err if name.startswith("--") else opt_err.split(", or")[0]
        assert out["error"]["reason"] == f"Invalid value for '{name}': {tail}", argv
        assert out["error"]["outcome"] == "usage"
    res = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", "health", "--agent", ""],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 2
    assert res.stderr.splitlines()[-1] == f"Error: Invalid value for '--agent': {opt_err}"
    assert _tree(snap) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]


def test_store_delete_of_an_empty_path_is_refused(tmp_path, monkeypatch):
    from cuinterpose.agent.errors import AgentError
    from cuinterpose.agent.snapshot import store

    (tmp_path / "manifest.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    try:
        store.delete("")
    except AgentError as e:
        assert (e.phase, e.outcome) == ("delete", "refused")
        assert e.reason == "no snapshot directory given (an empty path); nothing removed"
    else:
        raise AssertionError("store.delete('') deleted the current directory")
    assert (tmp_path / "manifest.json").read_text() == "{}"


def test_custom_gpu_storage_with_the_cuda_checkpoint_backend_is_refused_before_any_step(tmp_path):
    """The two options contradict each other: refused in `request` (exit 3) from the options
    alone, whichever source gives each, before the census: no phase ran, nothing was created
    and the process keeps running (it used to be found after the teardown, exit 4)."""
    job = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
    try:
        snap = tmp_path / "snap"
        why = (
            "the cuda-checkpoint backend ({nb}='cuda-checkpoint') has no custom storage (host "
            "staging); use host (or auto), or the driver-api (or auto) native backend"
        )
        for args, env, label, nb in [
            (["--gpu-storage", "custom", "--native-backend", "cuda-checkpoint"], {},
             "--gpu-storage", "--native-backend"),
            (["--native-backend", "cuda-checkpoint"], {"CUINTERPOSE_GPU_STORAGE": "custom"},
             "$CUINTERPOSE_GPU_STORAGE", "--native-backend"),
            (["--gpu-storage", "custom"], {"CUINTERPOSE_NATIVE_BACKEND": "cuda-checkpoint"},
             "--gpu-storage", "$CUINTERPOSE_NATIVE_BACKEND"),
        ]:  # fmt: skip
            rc, out = demo.run_agent(
                "checkpoint", "--pid", str(job.pid), "--images-dir", str(snap), "--driver",
                "fake", "--control-dir", str(tmp_path), *args, env=env,
            )  # fmt: skip
            assert rc == 3, out
            e = out["error"]
            assert (e["phase"], e["outcome"], e["pid"]) == ("request", "refused", None)
            assert e["reason"] == f"{label}='custom': " + why.format(nb=nb)
            assert out["phases"] == []
            assert not snap.exists()
            assert job.poll() is None
    finally:
        job.kill()
        job.wait()


def test_release_of_a_pid_that_is_no_process_id_is_refused(tmp_path):
    for bad in ("0", "-1", "4194305"):
        rc, out = demo.run_agent("release", "--pid", bad, "--control-dir", str(tmp_path))
        assert rc == 3, out
        e = out["error"]
        assert (e["phase"], e["outcome"]) == ("request", "refused")
        assert e["reason"] == f"pid {bad} is not a process id (an integer from 1 to 4194304)"
    assert list(tmp_path.iterdir()) == []


def test_an_in_process_checkpoint_gives_back_the_callers_signal_handlers(tmp_path):
    """A one-shot run records SIGINT/SIGTERM/SIGHUP from its start and ignores them as the
    process exits; called in-process (click's CliRunner, a library) it must give the caller's
    handlers back instead: a caller left ignoring SIGINT passes SIG_IGN on to every child it
    starts (the suite's later Ctrl-C tests saw their agents ignore the signal)."""
    import signal

    from click.testing import CliRunner
    from free_kit import free_pids

    from cuinterpose.agent.cli import main

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = [signal.getsignal(s) for s in sigs]
    (pid,) = free_pids(1)
    res = CliRunner().invoke(
        main,
        ["checkpoint", "--pid", str(pid), "--images-dir", str(tmp_path / "s"), "--driver",
         "fake", "--control-dir", str(tmp_path), "--json"],
    )  # fmt: skip
    out = json.loads(res.output)
    assert (res.exit_code, out["ok"], out["error"]["outcome"]) == (3, False, "refused"), out
    assert [signal.getsignal(s) for s in sigs] == before
