"""fakecuda's ``cuda-checkpoint`` utility (fakecuda/tools/cuda-checkpoint.c): NVIDIA's flags
(``--get-state``, ``--action lock|checkpoint|restore|unlock``, ``--timeout``, ``--toggle``,
``--get-restore-tid``, ``--device-map``), its output words and exit status, over fakecuda's
checkpoint API. Every test runs the installed binary and the same source built together with
fakecuda's sources under ASan/UBSan."""

from __future__ import annotations

import pathlib
import subprocess

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

    def run(*args, extra_env=None):
        res = subprocess.run(
            [exe, *map(str, args)],
            env=dict(env, **(extra_env or {})),
            capture_output=True,
            text=True,
            timeout=120,
        )
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


def test_refusals_name_the_operation_pid_and_curesult(peer, cli):
    a = peer()
    a.cmd("init 0")
    p = a.pid
    assert cli("--action", "checkpoint", "--pid", p) == (
        1,
        "",
        f"cuda-checkpoint: checkpoint of pid {p} failed: CUDA_ERROR_ILLEGAL_STATE\n",
    )
    assert cli("--action", "unlock", "--pid", p)[0] == 1
    # a pid above pid_max: no process: the real driver's OPERATING_SYSTEM (docs/gpu-validation.md)
    none = int(pathlib.Path("/proc/sys/kernel/pid_max").read_text()) + 1
    assert cli("--get-state", "--pid", none) == (
        1,
        "",
        f"cuda-checkpoint: get-state of pid {none} failed: CUDA_ERROR_OPERATING_SYSTEM\n",
    )
    assert cli("--get-state", "--pid", p) == (0, "running\n", "")


@pytest.mark.parametrize(
    "args,msg",
    [
        ((), "give exactly one of --get-state, --action, --toggle, --get-restore-tid"),
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
        "--device-map",
        "--pid|-p",
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
    # malformed map: a usage error, nothing sent; a GPU the driver does not have: refused
    assert (
        cli("--action", "restore", "--pid", p, "--device-map", "GPU-1=GPU-2", extra_env=two)[0] == 2
    )
    bogus = fake_uuid(0)[:-2] + "ff"
    assert cli(
        "--action", "restore", "--pid", p, "--device-map", f"{fake_uuid(0)}={bogus}", extra_env=two
    ) == (1, "", f"cuda-checkpoint: restore of pid {p} failed: CUDA_ERROR_INVALID_VALUE\n")
    assert cli("--get-state", "--pid", p, extra_env=two) == (0, "checkpointed\n", "")
    dm = f"{fake_uuid(0)}={fake_uuid(1)}"
    assert cli("--action", "restore", "--pid", p, "--device-map", dm, extra_env=two) == (0, "", "")
    assert cli("--action", "unlock", "--pid", p, extra_env=two) == (0, "", "")
    assert a.cmd(f"read {va}") == ["91"]
