"""fakecuda's ``cuda-checkpoint`` utility (fakecuda/tools/cuda-checkpoint.c): NVIDIA's flags
(``--get-state``, ``--action lock|checkpoint|restore|unlock``, ``--timeout``, ``--toggle``,
``--get-restore-tid``, ``--device-map|-d``, ``--launch-job|-j``), its output words, its refusal
lines (``Could not <op> on process ID <pid>: "<error string>"``) and exit status (the CUresult),
the job file's lock, over fakecuda's checkpoint API. Every test runs the installed binary and the
same source built together with fakecuda's sources under ASan/UBSan. tests/conformance checks the
same against NVIDIA's documents, on any driver."""

from __future__ import annotations

import fcntl
import os
import pathlib
import subprocess
import time

import pytest

from cuinterpose.agent.mech import native_cli

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FAKECUDA_SRC = sorted((ROOT / "fakecuda" / "src").glob("*.c"))


@pytest.fixture(scope="session")
def cli_asan_exe(build_c):
    return build_c(
        [*FAKECUDA_SRC, ROOT / "fakecuda" / "tools" / "cuda-checkpoint.c"],
        "cuda-checkpoint-asan",
        sanitize=True,
        extra=("-rdynamic",),
    )


@pytest.fixture(params=["installed", "asan"])
def cli(request, fake_env):
    """cli(*args, env=None) -> (exit status, stdout, stderr) of one run."""
    if request.param == "installed":
        exe = native_cli.fake_cli()
        assert exe, "fakecuda's cuda-checkpoint is not installed (make build)"
        env = dict(fake_env)
    else:
        exe = str(request.getfixturevalue("cli_asan_exe"))
        env = dict(fake_env, ASAN_OPTIONS="detect_leaks=1:abort_on_error=1")
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
        env.pop("LD_LIBRARY_PATH")

    def run(*args, extra_env=None, background=False):
        cmd, e = [exe, *map(str, args)], dict(env, **(extra_env or {}))
        if background:
            return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        res = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=120)
        return res.returncode, res.stdout, res.stderr

    return run


def fake_uuid(d: int) -> str:
    """fakecuda's UUID of device ``d`` (device.c dev_uuid) as ``GPU-xxxxxxxx-...``."""
    b = bytearray(b"fakecudaGPU-uuid")
    b[14], b[15] = (d >> 8) & 0xFF, d & 0xFF
    h = b.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def test_lock_checkpoint_restore_unlock_cycle_keeps_the_bytes(peer, cli):
    a = peer()
    a.cmd("init 0")
    va = a.cmd("malloc 4096")[0]
    a.cmd(f"write {va} 77")
    p = a.pid
    assert cli("--get-state", "--pid", p) == (0, "running\n", "")
    assert cli("--action", "lock", "--pid", p, "--timeout", 5000) == (0, "", "")
    assert cli("--get-state", "-p", p) == (0, "locked\n", "")
    assert cli("--action", "checkpoint", "--pid", p) == (0, "", "")
    assert cli("--get-state", "--pid", p) == (0, "checkpointed\n", "")
    assert cli("--action", "restore", "--pid", p) == (0, "", "")
    assert cli("--get-state", "--pid", p) == (0, "locked\n", "")
    assert cli("--action", "unlock", "--pid", p) == (0, "", "")
    assert cli("--get-state", "--pid", p) == (0, "running\n", "")
    assert a.cmd(f"read {va}") == ["77"]


def test_toggle_and_restore_tid(peer, cli):
    a = peer()
    a.cmd("init 0")
    p = a.pid
    rc, out, err = cli("--get-restore-tid", "--pid", p)
    assert (rc, err) == (0, "") and int(out) > 0
    assert cli("--toggle", "--pid", p) == (0, "", "")
    assert cli("--get-state", "--pid", p) == (0, "checkpointed\n", "")
    assert cli("--toggle", "--pid", p) == (0, "", "")
    assert cli("--get-state", "--pid", p) == (0, "running\n", "")


ILLEGAL_STATE = "the operation cannot be performed in the present state"


def test_refusals_name_the_operation_pid_and_exit_with_the_curesult(peer, cli):
    a = peer()
    a.cmd("init 0")
    p = a.pid
    # CUDA_ERROR_ILLEGAL_STATE is 401: the exit status keeps its low 8 bits, 145
    assert cli("--action", "checkpoint", "--pid", p) == (
        145,
        "",
        f'Could not checkpoint on process ID {p}: "{ILLEGAL_STATE}"\n',
    )
    assert cli("--action", "unlock", "--pid", p) == (
        145,
        "",
        f'Could not unlock on process ID {p}: "{ILLEGAL_STATE}"\n',
    )
    # a pid above pid_max: no process: the real driver's OPERATING_SYSTEM (304 -> 48)
    none = int(pathlib.Path("/proc/sys/kernel/pid_max").read_text()) + 1
    assert cli("--get-state", "--pid", none) == (
        48,
        "",
        f'Could not get state on process ID {none}: "OS call failed or operation not supported '
        'on this OS"\n',
    )
    assert cli("--get-state", "--pid", p) == (0, "running\n", "")


def test_the_agent_reads_the_curesult_back_from_the_exit_status():
    assert native_cli.result_of_status(145) == "CUDA_ERROR_ILLEGAL_STATE"
    assert native_cli.result_of_status(48) == "CUDA_ERROR_OPERATING_SYSTEM"
    assert native_cli.result_of_status(1) == "CUDA_ERROR_INVALID_VALUE"
    assert native_cli.result_of_status(144) == "CUDA_ERROR_INVALID_HANDLE"
    assert native_cli.result_of_status(250) == "exit status 250"


@pytest.mark.parametrize(
    "args,msg",
    [
        (
            (),
            "give exactly one of --get-state, --action, --toggle, --get-restore-tid, --launch-job",
        ),
        (
            ("--get-state", "--pid", 5, "-j", "true"),
            "--launch-job takes no other operation or option",
        ),
        (("--launch-job",), "--launch-job needs a program to run"),
        (("--get-state",), "--pid is required"),
        (
            ("--action", "checkpoint", "--pid", 5, "--timeout", 10),
            "--timeout applies to --action lock only",
        ),
        (
            ("--action", "lock", "--pid", 5, "--timeout", "-1"),
            "--timeout wants milliseconds (a non-negative integer)",
        ),
        (
            ("--action", "freeze", "--pid", 5),
            "--action must be lock, checkpoint, restore or unlock",
        ),
        (
            ("--action", "unlock", "--pid", 5, "--device-map", "a=b"),
            "--device-map applies to --action restore only",
        ),
        (
            ("--action", "lock", "--pid", 5, "-d", "a=b"),
            "--device-map applies to --action restore only",
        ),
        (("--get-state", "--pid", "x"), "--pid wants a positive process id"),
        (("--get-state", "--pid"), "a flag is missing its value"),
    ],
)
def test_usage_errors_exit_2(cli, args, msg):
    assert cli(*args) == (2, "", f"cuda-checkpoint: {msg} (see --help)\n")


def test_help_lists_the_flags(cli):
    rc, out, err = cli("--help")
    assert (rc, err) == (0, "")
    for flag in (
        "--get-state",
        "--action lock | checkpoint | restore | unlock",
        "--timeout",
        "--toggle",
        "--get-restore-tid",
        "--device-map|-d",
        "--launch-job|-j",
        "--pid|-p",
        "--timeout|-t",
    ):
        assert flag in out, flag


def test_restore_with_device_map(peer, cli, fake_env):
    env = dict(fake_env, FAKECUDA_DEVICE_COUNT="2")
    a = peer(env=env)
    a.cmd("init 0")
    va = a.cmd("malloc 4096")[0]
    a.cmd(f"write {va} 91")
    p = a.pid
    two = {"FAKECUDA_DEVICE_COUNT": "2"}
    assert cli("--action", "lock", "--pid", p, "--timeout", 5000, extra_env=two)[0] == 0
    assert cli("--action", "checkpoint", "--pid", p, extra_env=two)[0] == 0
    # malformed map: a usage error, nothing sent; a GPU the node does not have, or a map that
    # leaves a GPU of the node out: the driver's INVALID_VALUE (1)
    assert cli("--action", "restore", "--pid", p, "-d", "GPU-1=GPU-2", extra_env=two)[0] == 2
    bogus = fake_uuid(0)[:-2] + "ff"
    refused = (1, "", f'Could not restore on process ID {p}: "invalid argument"\n')
    for dm in (
        f"{fake_uuid(0)}={bogus},{fake_uuid(1)}={fake_uuid(0)}",
        f"{fake_uuid(0)}={fake_uuid(1)}",
    ):
        assert cli("--action", "restore", "--pid", p, "--device-map", dm, extra_env=two) == refused
    assert cli("--get-state", "--pid", p, extra_env=two) == (0, "checkpointed\n", "")
    dm = f"{fake_uuid(0)}={fake_uuid(1)},{fake_uuid(1)}={fake_uuid(0)}"
    assert cli("--action", "restore", "--pid", p, "-d", dm, extra_env=two) == (0, "", "")
    assert cli("--action", "unlock", "--pid", p, extra_env=two) == (0, "", "")
    assert a.cmd(f"read {va}") == ["91"]


@pytest.mark.parametrize("flag", ["--launch-job", "-j"])
def test_launch_job_runs_the_program_with_a_memfd_job_file(cli, flag):
    script = 'echo "$$ $CUDA_CHECKPOINT_JOB_FILE"; readlink "$CUDA_CHECKPOINT_JOB_FILE"'
    rc, out, err = cli(flag, "sh", "-c", script)
    assert (rc, err) == (0, "")
    first, link = out.splitlines()
    pid, path = first.split(" ")
    # the program runs in the utility's process: the job file is its own fd
    assert path.startswith(f"/proc/{pid}/fd/") and path.rsplit("/", 1)[1].isdigit()
    assert link == "/memfd:cuda-checkpoint-job (deleted)"
    assert cli(flag, "/nonexistent/program") == (
        127,
        "",
        "Could not launch /nonexistent/program: No such file or directory\n",
    )


def test_operations_of_one_job_run_one_at_a_time(peer, cli, tmp_path):
    """With CUDA_CHECKPOINT_JOB_FILE set, an operation waits for the job file's flock."""
    a = peer()
    a.cmd("init 0")
    job = tmp_path / "job"
    job.write_bytes(b"")
    holder = open(job, "rb")
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        proc = cli(
            "--get-state",
            "--pid",
            a.pid,
            extra_env={"CUDA_CHECKPOINT_JOB_FILE": str(job)},
            background=True,
        )
        ino = os.stat(job).st_ino
        deadline = time.monotonic() + 60
        while not any(
            ln.split()[1] == "->" and f":{ino} " in ln
            for ln in pathlib.Path("/proc/locks").read_text().splitlines()
        ):  # its flock waits behind ours (a "->" line of /proc/locks on the job file)
            assert proc.poll() is None and time.monotonic() < deadline, "it did not wait"
            time.sleep(0.01)
    finally:
        fcntl.flock(holder, fcntl.LOCK_UN)
        holder.close()
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (0, b"running\n", b"")
    missing = {"CUDA_CHECKPOINT_JOB_FILE": str(tmp_path / "gone")}
    assert cli("--get-state", "--pid", a.pid, extra_env=missing) == (
        1,
        "",
        f"Could not open the job file CUDA_CHECKPOINT_JOB_FILE={tmp_path / 'gone'}: No such file or "
        "directory\n",
    )
