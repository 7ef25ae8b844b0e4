"""A lock request its controller gave up on is not applied (found by the chaos suite,
tests/chaos/test_sigstop.py): a stopped process cannot answer cuCheckpointProcessLock, the
controller returns CUDA_ERROR_TIMEOUT past its deadline and the agent reports the checkpoint
refused with nothing changed; when the process continues it finds the request queued on its
control socket. fakecuda drops a mutating request whose controller has closed its end (and
undoes a lock taken while the controller left), so the process stays RUNNING, as the caller
was told, instead of being parked by a lock nobody will unlock (docs/fakecuda.md
"Checkpoint")."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess

from test_fakecuda_criu import HERE, wait_file

RUNNING, LOCKED = 0, 1  # CUprocessState (cuda.h)


def test_a_lock_abandoned_by_its_controller_is_not_applied(
    build_c, fakecuda_dir, fake_env, controller, tmp_path
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
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        cwd=tmp_path,
    )
    pid = proc.pid
    log = pathlib.Path(fake_env["FAKECUDA_LOG"])
    try:
        wait_file(out / "ready", lambda: proc.poll() is None, "ready")
        os.kill(pid, signal.SIGSTOP)
        fake_env["FAKECUDA_CONTROLLER_TIMEOUT_MS"] = "200"  # the controller's, not the target's
        assert controller([f"lock:{pid}:100"]) == ["CUDA_ERROR_TIMEOUT"]
        os.kill(pid, signal.SIGCONT)
        # served in order: the abandoned lock first (dropped), then this GetState
        assert controller([f"state:{pid}"]) == [f"CUDA_SUCCESS/{RUNNING}"]
        assert (
            "fakecuda: control Lock abandoned by its controller before it was served: not applied"
            in (log.read_text())
        )
        # a lock whose caller waits is applied as before
        assert controller([f"lock:{pid}:1000", f"state:{pid}", f"unlock:{pid}"]) == [
            "CUDA_SUCCESS",
            f"CUDA_SUCCESS/{LOCKED}",
            "CUDA_SUCCESS",
        ]
    finally:
        os.kill(pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
