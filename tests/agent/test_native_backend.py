"""The native-checkpoint backend table (agent/mech/native.py ``Backend``, ``choose``) and the
``cuda-checkpoint`` CLI backend (agent/mech/native_cli.py): the exact argv it runs, how exit
statuses and output map to ``NativeError`` (the driver API backend's phases and hints), the
deadline, the ``auto`` choice, the config key and the doctor row."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from cuinterpose.agent import paths
from cuinterpose.agent.config import ConfigError, load_config
from cuinterpose.agent.errors import AgentError, NativeError
from cuinterpose.agent.mech import native, native_cli
from cuinterpose.agent.options import DriverOptions

G0 = "GPU-66616b65-6375-6461-4750-552d75750000"
G2 = "GPU-66616b65-6375-6461-4750-552d75750002"


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    """A ``cuda-checkpoint`` stand-in at ``$CUINTERPOSE_CUDA_CHECKPOINT``: appends its argv
    (JSON) to a file, prints $REC_OUT, exits with $REC_RC. Returns (argv list reader, set)."""
    log = tmp_path / "argv.jsonl"
    exe = tmp_path / "cuda-checkpoint"
    exe.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "sys.stdout.write(os.environ.get('REC_OUT', ''))\n"
        "sys.stderr.write(os.environ.get('REC_ERR', ''))\n"
        "sys.exit(int(os.environ.get('REC_RC', '0')))\n"
    )
    exe.chmod(0o755)
    monkeypatch.setenv(native_cli.CLI_ENV, str(exe))
    monkeypatch.setattr(native, "_backends", {})

    def seen():
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines()]

    def reply(out="", rc=0, err=""):
        monkeypatch.setenv("REC_OUT", out)
        monkeypatch.setenv("REC_ERR", err)
        monkeypatch.setenv("REC_RC", str(rc))

    return exe, seen, reply


def test_the_cli_backend_runs_the_documented_command_lines(recorder, monkeypatch):
    exe, seen, reply = recorder
    b = native.choose("cuda-checkpoint")
    assert (b.name, b.detail) == ("cuda-checkpoint", str(exe))
    assert b.why == f"--native-backend cuda-checkpoint (${native_cli.CLI_ENV}={exe})"
    b.lock(41, 1500)
    b.lock(41, 0)  # "no timeout": the call deadline (60 s) handed to the utility
    b.checkpoint(41)
    b.restore(41, ())
    b.restore(41, ((G0, G2), (G2, G0)))
    b.unlock(41)
    reply("checkpointed\n")
    assert b.get_state(41) == "CHECKPOINTED"
    assert seen() == [
        ["--action", "lock", "--pid", "41", "--timeout", "1500"],
        ["--action", "lock", "--pid", "41", "--timeout", "60000"],
        ["--action", "checkpoint", "--pid", "41"],
        ["--action", "restore", "--pid", "41"],
        ["--action", "restore", "--pid", "41", "--device-map", f"{G0}={G2},{G2}={G0}"],
        ["--action", "unlock", "--pid", "41"],
        ["--get-state", "--pid", "41"],
    ]


@pytest.mark.parametrize(
    "out,want", [("running\n", "RUNNING"), ("locked", "LOCKED"), ("failed\n", "FAILED")]
)
def test_get_state_words(recorder, out, want):
    _, _, reply = recorder
    reply(out)
    assert native.choose("cuda-checkpoint").get_state(7) == want


def test_exit_statuses_become_named_errors_with_the_driver_api_hints(recorder):
    _, seen, reply = recorder
    b = native.choose("cuda-checkpoint")
    reply(err="cuda-checkpoint: lock of pid 9 failed: CUDA_ERROR_NOT_READY\n", rc=1)
    with pytest.raises(NativeError) as ei:
        b.lock(9, 200)
    e = ei.value
    assert (e.action, e.result, e.pid) == ("lock", "CUDA_ERROR_NOT_READY", 9)
    assert str(e) == (
        "native: pid 9 cuda-checkpoint --action lock: CUDA_ERROR_NOT_READY (work was still in "
        "flight when the lock timed out: the workload is not quiescent)"
    )
    reply(out="Could not checkpoint: CUDA_ERROR_NOT_SUPPORTED", rc=1)
    with pytest.raises(NativeError) as ei:
        b.checkpoint(9)
    assert ei.value.result == "CUDA_ERROR_NOT_SUPPORTED"
    assert ei.value.reason.startswith(
        "cuda-checkpoint --action checkpoint: CUDA_ERROR_NOT_SUPPORTED (the process holds sharing"
    )
    reply(err="something odd\nbad thing\n", rc=3)
    with pytest.raises(NativeError) as ei:
        b.unlock(9)
    assert ei.value.reason == "cuda-checkpoint --action unlock: exit status 3: bad thing"
    reply(out="sleeping\n")
    with pytest.raises(NativeError) as ei:
        b.get_state(9)
    assert ei.value.reason == "cuda-checkpoint --get-state: unexpected output 'sleeping'"


def test_the_all_functions_set_the_phase_through_the_table(recorder, monkeypatch):
    _, seen, reply = recorder
    b = native.choose("cuda-checkpoint")
    monkeypatch.setattr(native, "_backends", {"auto": b})
    reply()
    assert list(native.lock_all([5, 6], 100)) == [5, 6]
    reply(err="CUDA_ERROR_ILLEGAL_STATE", rc=1)
    with pytest.raises(NativeError) as ei:
        native.restore_all([5], gpu_pairs=[(G0, G2)])
    assert str(ei.value) == "native restore: pid 5 cuda-checkpoint --action restore: " + (
        "CUDA_ERROR_ILLEGAL_STATE"
    )
    assert seen()[-1] == ["--action", "restore", "--pid", "5", "--device-map", f"{G0}={G2}"]


def test_a_utility_past_its_deadline_is_killed_and_named(tmp_path, monkeypatch):
    exe = tmp_path / "cuda-checkpoint"
    fifo = tmp_path / "never"
    os.mkfifo(fifo)
    exe.write_text(f"#!/bin/sh\nexec cat {fifo}\n")  # blocks: nobody writes the fifo
    exe.chmod(0o755)
    monkeypatch.setenv(native_cli.CLI_ENV, str(exe))
    with pytest.raises(NativeError) as ei, native.using(DriverOptions(driver_call_timeout_s=0.3)):
        native.choose("cuda-checkpoint").checkpoint(12)
    assert ei.value.reason == (
        "cuda-checkpoint --action checkpoint: CUDA_ERROR_TIMEOUT (cuda-checkpoint gave no "
        "answer within 0.3 s and was killed; a stopped process: `kill -CONT` it, or "
        "`cuinterpose-agent release`)"
    )


def test_bad_device_map_uuid_is_refused_before_running(recorder):
    _, seen, _ = recorder
    with pytest.raises(AgentError) as ei:
        native.choose("cuda-checkpoint").restore(3, (("GPU-12", G2),))
    assert str(ei.value) == (
        "native restore: 'GPU-12' is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-...)"
    )
    assert seen() == []
    assert native_cli.uuid_bytes(G2) == b"fakecudaGPU-uu\x00\x02"


def test_auto_takes_the_api_when_the_library_exports_it(monkeypatch):
    lib = str(paths.fakecuda_dir() / paths.FAKECUDA_NAME)
    monkeypatch.setattr(native, "_info", native.DriverInfo("fake", 13000, lib))
    b = native.choose("auto")
    assert (b.name, b.why) == ("driver-api", f"auto: {lib} exports cuCheckpointProcess*")
    assert native.missing_api_symbols(lib) == []


def test_auto_falls_back_to_the_cli_then_refuses(recorder, monkeypatch):
    exe, _, _ = recorder
    libc = "libc.so.6"
    monkeypatch.setattr(native, "_info", native.DriverInfo("real", 12040, libc))
    lacks = f"{libc} lacks {', '.join(native.API_SYMBOLS)}"
    b = native.choose("auto")
    assert (b.name, b.why) == (
        "cuda-checkpoint",
        f"auto: {lacks}; using ${native_cli.CLI_ENV}={exe}",
    )
    with pytest.raises(AgentError) as ei:
        native.choose("driver-api")
    assert str(ei.value) == (
        f"native backend: --native-backend driver-api: {lacks} (a driver older than r570?); "
        "use --native-backend cuda-checkpoint"
    )
    monkeypatch.delenv(native_cli.CLI_ENV)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(AgentError) as ei:
        native.choose("auto")
    assert str(ei.value) == (
        f"native backend: no native checkpoint backend: {lacks}, and no cuda-checkpoint on "
        "$PATH; install NVIDIA's cuda-checkpoint (or point $CUINTERPOSE_CUDA_CHECKPOINT at it)"
    )


def test_unknown_kind_and_config_key(monkeypatch):
    with pytest.raises(AgentError) as ei:
        native.backend_kind("criu")
    assert str(ei.value) == (
        "native backend: unknown native backend 'criu' (expected one of "
        "('auto', 'driver-api', 'cuda-checkpoint'))"
    )
    assert native.backend_kind() == "auto"  # outside a run: the option's default
    opts = DriverOptions.from_environ({"CUINTERPOSE_NATIVE_BACKEND": "cuda-checkpoint"})
    with native.using(opts):
        assert native.backend_kind() == "cuda-checkpoint"
    assert load_config("nativeBackend: cuda-checkpoint\n").native_backend == "cuda-checkpoint"
    assert load_config("{}\n").native_backend == ""
    with pytest.raises(ConfigError) as ei:
        load_config("nativeBackend: cli\n")
    assert "nativeBackend" in str(ei.value)


@pytest.mark.parametrize("kind", ["auto", "cuda-checkpoint"])
def test_doctor_says_which_backend_and_why(tmp_path, kind):
    env = dict(os.environ, CUINTERPOSE_DRIVER="fake", CUINTERPOSE_NATIVE_BACKEND=kind)
    env.pop(native_cli.CLI_ENV, None)
    ctl = tmp_path / "ctl"
    res = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", "doctor", "--json", "--control-dir", ctl],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    lib = paths.fakecuda_dir().resolve()
    want = {
        "auto": f"driver-api: auto: {lib / 'libcuda.so.1'} exports cuCheckpointProcess*",
        "cuda-checkpoint": "cuda-checkpoint: --native-backend cuda-checkpoint (fakecuda's "
        f"{paths.fakecuda_dir() / 'bin' / 'cuda-checkpoint'})",
    }[kind]
    assert rows["native backend"] == {"name": "native backend", "ok": True, "detail": want}


def test_fake_cli_is_installed_next_to_fakecuda():
    p = pathlib.Path(native_cli.fake_cli())
    assert p == paths.fakecuda_dir() / "bin" / "cuda-checkpoint"
    assert native_cli.find(fake=True) == (str(p), f"fakecuda's {p}")


@pytest.mark.parametrize("command", ["checkpoint", "restore", "serve"])
def test_each_command_takes_the_option_and_refuses_an_unknown_backend(command):
    from click.testing import CliRunner

    from cuinterpose.agent.cli import main

    r = CliRunner()
    res = r.invoke(main, [command, "--help"])
    assert res.exit_code == 0 and "--native-backend [auto|driver-api|cuda-checkpoint]" in res.output
    res = r.invoke(main, [command, "--native-backend", "cli"])
    assert res.exit_code == 2
    assert "'cli' is not one of 'auto', 'driver-api', 'cuda-checkpoint'" in res.output


def test_serve_reads_native_backend_from_the_config(tmp_path):
    from cuinterpose.agent.cli.daemon import _config_values

    f = tmp_path / "config.yaml"
    f.write_text("nativeBackend: cuda-checkpoint\n")
    cfg = _config_values(str(f))["_config"]
    assert cfg.option_values() == {"native_backend": "cuda-checkpoint"}
    f.write_text("driver: fake\n")
    assert _config_values(str(f))["_config"].option_values() == {"driver": "fake"}


GPU_TARGET = """
import sys
from cuda.bindings import driver as cu
assert cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
err, ctx = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])
assert int(err) == 0 and int(cu.cuCtxSetCurrent(ctx)[0]) == 0
err, dptr = cu.cuMemAlloc(4096)
assert int(err) == 0
assert int(cu.cuMemsetD8(dptr, 0x5A, 4096)[0]) == 0
print("up", int(dptr), flush=True)
sys.stdin.readline()  # until the test asks: read the bytes back
buf = bytearray(4096)
assert int(cu.cuMemcpyDtoH(buf, dptr, 4096)[0]) == 0
print(buf.count(0x5A), flush=True)
"""

GPU_CONTROLLER = """
import json, os, sys
from cuinterpose.agent.mech import native
from cuinterpose.agent.errors import NativeError
from cuinterpose.agent.options import DriverOptions
native.load("fake")
pid, kind, old, new, bogus = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
run = native.using(DriverOptions(driver="fake", native_backend=kind))
run.__enter__()  # the rest of the script is one run with these options
out = {"backend": native.backend().name}
native.lock_all([pid], 5000)
native.checkpoint_all([pid])
try:
    native.restore_all([pid], [(old, bogus)])
except NativeError as e:
    out["bogus"] = str(e)
out["after_bogus"] = native.get_state(pid)
native.restore_all([pid], [(old, new), (new, old)])  # every GPU of the node, permuted
out["restored"] = native.get_state(pid)
native.unlock_all([pid])
out["end"] = native.get_state(pid)
print(json.dumps(out))
"""


@pytest.mark.parametrize("kind", ["driver-api", "cuda-checkpoint"])
def test_restore_onto_another_gpu_through_each_backend(tmp_path, kind):
    """gpu_pairs reach the driver: CUcheckpointRestoreArgs.gpuPairs (driver API) or
    --device-map (CLI); an unknown new GPU is the driver's INVALID_VALUE in phase "native
    restore" and leaves the process CHECKPOINTED; the right pair restores it, bytes intact."""
    from cuinterpose.workloads.afdwin import demo

    env = dict(demo.workload_env(tmp_path, shim=False), FAKECUDA_DEVICE_COUNT="2")
    t = subprocess.Popen(
        [sys.executable, "-c", GPU_TARGET],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert t.stdout.readline().split()[0] == "up"
        cenv = {k: v for k, v in env.items() if k not in ("LD_LIBRARY_PATH",)}
        cenv.pop(native_cli.CLI_ENV, None)
        cenv["CUINTERPOSE_DRIVER"] = "fake"
        bogus = G0[:-2] + "ff"
        res = subprocess.run(
            [sys.executable, "-c", GPU_CONTROLLER, str(t.pid), kind, G0, G0[:-1] + "1", bogus],
            capture_output=True,
            text=True,
            env=cenv,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        fn = (
            "cuCheckpointProcessRestore"
            if kind == "driver-api"
            else "cuda-checkpoint --action restore"
        )
        assert out == {
            "backend": kind,
            "bogus": f"native restore: pid {t.pid} {fn}: CUDA_ERROR_INVALID_VALUE",
            "after_bogus": "CHECKPOINTED",
            "restored": "LOCKED",
            "end": "RUNNING",
        }
        t.stdin.write("\n")
        t.stdin.flush()
        assert t.stdout.readline().strip() == "4096"
    finally:
        t.kill()
        t.wait()
