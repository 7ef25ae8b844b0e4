"""The checkpoint lifecycle as the CUDA driver API documents it ("CUDA Checkpointing" of the
Driver API reference, cuda.h 12.8+) and as NVIDIA's own clients use it: cuda-python's
``cuda_core/tests/test_checkpoint.py`` (cuda.core ``checkpoint.Process``: a controller that never
calls cuInit), NVIDIA/cuda-checkpoint ``src/r570-features.c`` (the parent asks the state of its
child without cuInit) and CRIU's driver-API cuda plugin (``plugins/cuda/cuda_plugin_driver.c``:
cuInit only before a restore). Every test names the line it checks. States: RUNNING 0, LOCKED 1,
CHECKPOINTED 2 (cuda.h ``CUprocessState``)."""

from __future__ import annotations

import pathlib
import subprocess

RUNNING, LOCKED, CHECKPOINTED = "CUDA_SUCCESS/0", "CUDA_SUCCESS/1", "CUDA_SUCCESS/2"


def test_initial_state_is_running_and_the_restore_thread_id_is_positive(target, ctl):
    """cuda.core test_checkpoint ``initial_state_is_running``, ``restore_thread_id_is_positive``:
    ``cuCheckpointProcessGetState`` "Returns the process state of a CUDA process" (RUNNING is
    "Default process state"); ``cuCheckpointProcessGetRestoreThreadId`` "Returns the restore
    thread ID for a CUDA process". The controller never calls cuInit."""
    t = target()
    state, tid = ctl(f"state:{t.pid}", f"tid:{t.pid}")
    assert state == RUNNING
    name, value = tid.split("/")
    assert name == "CUDA_SUCCESS" and int(value) > 0
    # the restore thread is a thread of the target (CRIU resumes it by ptrace)
    assert pathlib.Path(f"/proc/{t.pid}/task/{value}").is_dir()


def test_full_cycle_keeps_the_memory(target, ctl):
    """cuda.core ``full_cycle_no_migration``: lock -> LOCKED, checkpoint -> CHECKPOINTED, restore
    -> LOCKED ("restore leaves process locked"), unlock -> RUNNING; the driver API: Lock "Upon
    successful return the process will be in the LOCKED state", Checkpoint "The process must be
    in the CU_PROCESS_STATE_LOCKED state", Restore "Process must be in the
    CU_PROCESS_STATE_CHECKPOINTED state", Unlock "Upon successful return the process will be in
    the RUNNING state"; the README: device memory "is copied back to the GPU, and GPU memory
    mappings are restored at their original addresses". No cuInit before lock and checkpoint;
    cuInit before restore ("CUDA process restore requires persistence mode to be enabled or cuInit
    to have been called before execution")."""
    t = target()
    p = t.pid
    got = ctl(
        f"lock:{p}:5000",
        f"state:{p}",
        f"checkpoint:{p}",
        f"state:{p}",
        "init",
        f"restore:{p}",
        f"state:{p}",
        f"unlock:{p}",
        f"state:{p}",
    )
    assert got == [
        "CUDA_SUCCESS",
        LOCKED,
        "CUDA_SUCCESS",
        CHECKPOINTED,
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
        LOCKED,
        "CUDA_SUCCESS",
        RUNNING,
    ]
    assert t.cmd("check") == ["1"]


def test_lock_with_and_without_timeout(target, ctl):
    """cuda.core ``lock_default_timeout`` / ``lock_with_timeout``; CUcheckpointLockArgs.timeoutMs
    "Timeout in milliseconds to attempt to lock the process, 0 indicates no timeout"; CRIU
    passes its own timeout times 1000."""
    t = target()
    p = t.pid
    assert ctl(f"lock:{p}", f"state:{p}", f"unlock:{p}", f"lock:{p}:10000", f"unlock:{p}") == [
        "CUDA_SUCCESS",
        LOCKED,
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
    ]


def test_wrong_states_are_illegal_state(target, ctl):
    """Each call names the one state it accepts (Lock: "Process must be in the RUNNING state";
    Checkpoint: LOCKED; Restore: CHECKPOINTED; Unlock: "Process must be in the LOCKED state"); the
    driver answers CUDA_ERROR_ILLEGAL_STATE otherwise (cuda.h "This indicates that a resource
    required by the API call is not in a valid state to perform the requested operation";
    NVIDIA/cuda-checkpoint #44: unlock of a CHECKPOINTED process "returns
    CUDA_ERROR_ILLEGAL_STATE (401)"). Nothing changes."""
    t = target()
    p = t.pid
    illegal = "CUDA_ERROR_ILLEGAL_STATE"
    assert ctl(f"checkpoint:{p}", f"restore:{p}", f"unlock:{p}", f"state:{p}") == [
        illegal,
        illegal,
        illegal,
        RUNNING,
    ]
    assert ctl(f"lock:{p}", f"lock:{p}", f"restore:{p}", f"state:{p}") == [
        "CUDA_SUCCESS",
        illegal,
        illegal,
        LOCKED,
    ]
    assert ctl(f"checkpoint:{p}", f"unlock:{p}", f"checkpoint:{p}", f"state:{p}") == [
        "CUDA_SUCCESS",
        illegal,
        illegal,
        CHECKPOINTED,
    ]
    assert ctl("init", f"restore:{p}", f"unlock:{p}", f"state:{p}") == [
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
        RUNNING,
    ]
    assert t.cmd("check") == ["1"]


def test_pids_that_are_no_cuda_process(ctl, driver_env):
    """What R580 answered on an H200 (docs/gpu-validation.md, finding 4): a pid with no process
    is CUDA_ERROR_OPERATING_SYSTEM, a live process that never initialised CUDA
    CUDA_ERROR_NOT_INITIALIZED; CRIU's driver plugin takes INVALID_VALUE or NOT_INITIALIZED from
    GetRestoreThreadId as "no CUDA restore thread" and skips the process."""
    none = int(pathlib.Path("/proc/sys/kernel/pid_max").read_text()) + 1
    sleeper = subprocess.Popen(["sleep", "600"], env=driver_env)
    try:
        got = ctl(f"state:{none}", f"state:{sleeper.pid}", f"tid:{sleeper.pid}", mode="dlsym")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert got[:2] == ["CUDA_ERROR_OPERATING_SYSTEM/-1", "CUDA_ERROR_NOT_INITIALIZED/-1"]
    assert got[2] in ("CUDA_ERROR_INVALID_VALUE/-1", "CUDA_ERROR_NOT_INITIALIZED/-1")


def test_a_thread_id_names_its_process(target, ctl):
    """NVIDIA/cuda-checkpoint #41 (the maintainer): the utility reaches the process through /proc,
    where a thread of it "also exists ... and can be used to checkpoint the process too"; CRIU's
    CLI plugin (``cuda_plugin_pause_devices``) asks ``--get-state`` of the pid that
    ``--get-restore-tid`` returned."""
    t = target()
    tid = ctl(f"tid:{t.pid}")[0].split("/")[1]
    assert ctl(
        f"state:{tid}", f"lock:{t.pid}", f"state:{tid}", f"unlock:{tid}", f"state:{t.pid}"
    ) == [
        RUNNING,
        "CUDA_SUCCESS",
        LOCKED,
        "CUDA_SUCCESS",
        RUNNING,
    ]


def test_criu_driver_plugin_sequence(target, ctl):
    """CRIU ``plugins/cuda/cuda_plugin_driver.c`` through dlopen("libcuda.so.1") and its ELF
    names, no cuInit until the restore ("Defer cuInit() until the first restore"): PAUSE_DEVICES
    (restore tid, state, lock with a timeout, state), CHECKPOINT_DEVICES (restore tid, checkpoint,
    state), RESUME_DEVICES_LATE (restore tid, state, cuInit, restore with zeroed args, state,
    unlock, state)."""
    t = target()
    p = t.pid
    got = ctl(
        f"tid:{p}",
        f"state:{p}",
        f"lock:{p}:10000",
        f"state:{p}",
        f"tid:{p}",
        f"checkpoint:{p}",
        f"state:{p}",
        f"tid:{p}",
        f"state:{p}",
        "init",
        f"restore:{p}",
        f"state:{p}",
        f"unlock:{p}",
        f"state:{p}",
        mode="dlsym",
    )
    tids = {got[0], got[4], got[7]}
    assert len(tids) == 1 and next(iter(tids)).startswith("CUDA_SUCCESS/")
    assert [g for i, g in enumerate(got) if i not in (0, 4, 7)] == [
        RUNNING,
        "CUDA_SUCCESS",
        LOCKED,
        "CUDA_SUCCESS",
        CHECKPOINTED,
        CHECKPOINTED,
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
        LOCKED,
        "CUDA_SUCCESS",
        RUNNING,
    ]
    assert t.cmd("check") == ["1"]


def test_r570_sample_parent_and_child(target, ctl):
    """NVIDIA/cuda-checkpoint ``src/r570-features.c``: the child calls cuInit and builds its PCI
    bus id from CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, _BUS_ID and _DEVICE_ID ("%08X:%02X:%02X.0",
    for nvmlDeviceGetHandleByPciBusId); the parent, which never called cuInit, asserts
    ``cuCheckpointProcessGetState(child)`` succeeds with CU_PROCESS_STATE_RUNNING. Two GPUs are
    two PCI devices: their bus ids differ."""
    t = target()
    assert ctl(f"state:{t.pid}", mode="dlsym") == [RUNNING]
    n = int(t.cmd("count")[0])
    ids = {tuple(t.cmd(f"pci {d}")) for d in range(n)}
    assert len(ids) == n
