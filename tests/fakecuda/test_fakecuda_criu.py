"""fakecuda under CRIU: native lock+checkpoint leaves a process CRIU can dump (no device
memfd open or mapped), and after CRIU restore + native restore + unlock it runs on with its
bytes, VAs and handle values."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def wait_file(path: pathlib.Path, proc_alive, what: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc_alive(), f"process died before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return path.read_text()


@pytest.fixture(scope="module")
def criu_mod():
    from cuinterpose.agent.mech import criu

    try:
        criu.criu_command()
    except criu.CriuError as e:  # the only allowed skip: CRIU cannot run here
        pytest.skip(f"CRIU cannot run on this machine: {e}")
    return criu


def test_native_checkpoint_then_criu_roundtrip(
    criu_mod, build_c, fakecuda_dir, fake_env, controller, tmp_path
):
    exe = build_c(
        [HERE / "c" / "fcsleeper.c"],
        "fcsleeper",
        libs=(f"-L{fakecuda_dir}", "-l:libcuda.so.1", "-ldl", "-lpthread"),
    )
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [str(exe), str(out)],
        env=fake_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "stderr", "wb"),
        start_new_session=True,
        cwd=tmp_path,
    )
    pid = proc.pid
    restored = None
    try:
        ready = wait_file(out / "ready", lambda: proc.poll() is None, "ready")
        assert not (out / "error").exists()
        dptr = int(ready.split()[1])  # the cuMemAlloc buffer
        assert controller([f"lock:{pid}", f"checkpoint:{pid}"]) == ["CUDA_SUCCESS"] * 2
        maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
        assert "memfd:fakecuda-" not in maps
        # the cuMemAlloc buffer is a bare PROT_NONE reservation: its bytes sit in host buffers
        perms = [
            l.split()[1]
            for l in maps.splitlines()
            if int(l.split()[0].split("-")[0], 16) <= dptr < int(l.split()[0].split("-")[1], 16)
        ]
        assert perms == ["---p"], perms
        fds = [os.readlink(f"/proc/{pid}/fd/{f}") for f in os.listdir(f"/proc/{pid}/fd")]
        assert not [f for f in fds if "memfd:fakecuda-" in f]
        criu_mod.dump(pid, tmp_path / "images")
        proc.wait(timeout=30)
        restored = criu_mod.restore(tmp_path / "images", work_dir=tmp_path / "restore")
        assert restored == pid
        assert controller([f"state:{pid}", f"restore:{pid}", f"unlock:{pid}", f"state:{pid}"]) == [
            "CUDA_SUCCESS/2",
            "CUDA_SUCCESS",
            "CUDA_SUCCESS",
            "CUDA_SUCCESS/0",
        ]
        os.kill(pid, signal.SIGUSR1)
        text = wait_file(out / "check0", lambda: os.path.exists(f"/proc/{pid}"), "check0")
        assert text.startswith("ok "), text
        assert text.split()[-1] == "1"  # the private allocation's handle value (created second)
    finally:
        for p in {pid, restored} - {None}:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.wait()
