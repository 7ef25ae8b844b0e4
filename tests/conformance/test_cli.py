"""The ``cuda-checkpoint`` utility as NVIDIA documents it and as CRIU's CLI cuda plugin
(``plugins/cuda/cuda_plugin_cli.c``, and ``cuda_plugin.c`` before it) drives it: the README's
``--help`` (r570), the r580 help quoted in NVIDIA/cuda-checkpoint #18 and #46 (``--device-map|-d``),
the r590 help quoted in #43 (``--launch-job|-j``: "Initialize a memfd to become a job file, set
CUDA_CHECKPOINT_JOB_FILE to point to that memfd and launch the specified command"), the refusal
lines quoted in #35 and #47 (``Could not restore on process ID N: "invalid argument"``) and
criu PR #2540 ("When cuda-checkpoint fails an operation it always returns the positive CUDA error
code")."""

from __future__ import annotations

import pytest

#: cuGetErrorString(CUDA_ERROR_ILLEGAL_STATE) (cuda.h: 401)
ILLEGAL_STATE = 401


def test_help_names_the_flags_criu_probes(cli_help):
    """CRIU's plugin runs ``cuda-checkpoint -h`` and needs "--action" in it (r555+); the r570
    README lists --get-state, --toggle, --get-restore-tid, --pid|-p, --timeout|-t."""
    for flag in (
        "--action",
        "--get-state",
        "--toggle",
        "--get-restore-tid",
        "--pid|-p",
        "--timeout|-t",
    ):
        assert flag in cli_help, flag


def test_criu_cli_plugin_sequence(target, cli):
    """CRIU's CLI plugin: ``--get-restore-tid --pid P`` (a number alone on stdout), ``--get-state
    --pid <that tid>`` (the older plugin asks the restore thread's state: "running"), ``--action
    lock --pid P --timeout MS``, ``--action checkpoint``, ``--get-state`` ("checkpointed"),
    ``--action restore``, ``--action unlock``: exit status 0 each, the state words on stdout."""
    t = target()
    p = t.pid
    rc, out, err = cli("--get-restore-tid", "--pid", p)
    assert rc == 0 and out.strip().isdigit() and int(out) > 0, (rc, out, err)
    tid = int(out)
    assert cli("--get-state", "--pid", tid)[:2] == (0, "running\n")
    assert cli("--action", "lock", "--pid", p, "--timeout", 10000)[0] == 0
    assert cli("--get-state", "--pid", p)[:2] == (0, "locked\n")
    assert cli("--action", "checkpoint", "--pid", p)[0] == 0
    assert cli("--get-state", "--pid", tid)[:2] == (0, "checkpointed\n")
    assert cli("--action", "restore", "--pid", p)[0] == 0
    assert cli("--action", "unlock", "--pid", p)[0] == 0
    assert cli("--get-state", "-p", p)[:2] == (0, "running\n")
    assert t.cmd("check") == ["1"]


def test_a_process_without_cuda_has_no_restore_thread(cli, driver_env):
    """CRIU reads a non-zero exit of ``--get-restore-tid`` as "PID has no CUDA restore thread"."""
    import subprocess

    sleeper = subprocess.Popen(["sleep", "600"], env=driver_env)
    try:
        rc, out, _ = cli("--get-restore-tid", "--pid", sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert rc != 0 and out == ""


def test_a_refusal_names_the_pid_and_exits_with_the_curesult(target, cli, ctl):
    """``Could not <action> on process ID <pid>: "<error string>"`` and the CUresult as the exit
    status (its low 8 bits: 401 -> 145): a checkpoint of a RUNNING process is ILLEGAL_STATE."""
    t = target()
    rc, out, err = cli("--action", "checkpoint", "--pid", t.pid)
    assert (rc, out) == (ILLEGAL_STATE & 0xFF, "")
    assert err.startswith(f'Could not checkpoint on process ID {t.pid}: "') and err.endswith('"\n')
    assert cli("--get-state", "--pid", t.pid)[:2] == (0, "running\n")


def test_toggle(target, cli):
    """README: ``--toggle`` "Toggles the CUDA state in the specified process between the running
    and checkpointed states"."""
    t = target()
    assert cli("--toggle", "--pid", t.pid)[0] == 0
    assert cli("--get-state", "--pid", t.pid)[:2] == (0, "checkpointed\n")
    assert cli("--toggle", "--pid", t.pid)[0] == 0
    assert cli("--get-state", "--pid", t.pid)[:2] == (0, "running\n")
    assert t.cmd("check") == ["1"]


def test_device_map_short_flag(target, cli, cli_help, ctl):
    """r580: ``--device-map|-d <deviceUuids>`` "comma delimited list in the format
    oldUuid1=newUuid1,..." "Must contain all checkpointed devices if specified": the identity
    map of every GPU of the node is accepted, with either spelling."""
    if "--device-map" not in cli_help:
        pytest.skip("this cuda-checkpoint predates --device-map (r580)")
    t = target()
    identity = ",".join(f"{u}={u}" for u, _ in ctl("init", "devices")[1])
    for flag in ("--device-map", "-d"):
        assert cli("--action", "lock", "--pid", t.pid)[0] == 0
        assert cli("--action", "checkpoint", "--pid", t.pid)[0] == 0
        assert cli("--action", "restore", "--pid", t.pid, flag, identity)[0] == 0
        assert cli("--action", "unlock", "--pid", t.pid)[0] == 0
    assert t.cmd("check") == ["1"]


def test_launch_job_points_the_job_file_at_a_memfd(cli, cli_help, tmp_path):
    """r590 ``--launch-job|-j <program> [<arg1> ... [<argn>]]``: the program runs with
    CUDA_CHECKPOINT_JOB_FILE naming a memfd (the path form, /proc/<pid>/fd/<n>, is fakecuda's
    reading of "point to that memfd"; the probe records the real one)."""
    if "--launch-job" not in cli_help:
        pytest.skip("this cuda-checkpoint predates --launch-job (r590)")
    out = tmp_path / "seen"
    script = (
        f'readlink "$CUDA_CHECKPOINT_JOB_FILE" > {out}; echo "$CUDA_CHECKPOINT_JOB_FILE" >> {out}'
    )
    for flag in ("--launch-job", "-j"):
        rc, _, err = cli(flag, "sh", "-c", script)
        assert rc == 0, err
        link, path = out.read_text().splitlines()
        assert link.startswith("/memfd:"), link
        assert path.startswith("/proc/"), path
