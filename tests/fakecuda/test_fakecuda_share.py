"""What PyTorch and NCCL share besides memory, on fakecuda, as strict as the driver API documents
it (issue 24; docs/fakecuda.md "Events", "Peer access", "Memory pools", "Registered shared
memory"): events and IPC events between two processes, peer context access (legacy memory yes,
VMM memory no), memory pools shared by IPC, cuMemHostRegister of an unlinked /dev/shm mapping;
and native checkpoint refusing each IPC object with its exact line (the driver documentation is
silent on them; scripts/gpu_check_probe.py asks the hardware). Every process is ``fcshare``
(tests/fakecuda/c/fcshare.c), on the installed library and compiled with fakecuda's sources
under ASan/UBSan."""

from __future__ import annotations

import os
import pathlib
import socket

import pytest
from fakecuda_helpers import GRAN, Peer, read_log

HERE = pathlib.Path(__file__).resolve().parent
FAKECUDA_SRC = sorted((HERE.parent.parent / "fakecuda" / "src").glob("*.c"))

# cuda.h
EV_DEFAULT, EV_BLOCKING, EV_NO_TIMING, EV_IPC = 0, 1, 2, 4
HOSTREG_PORTABLE, HOSTREG_DEVICEMAP = 1, 2


@pytest.fixture(scope="session")
def fcshare_exe(build_c, fakecuda_dir):
    return build_c(
        [HERE / "c" / "fcshare.c"],
        "fcshare",
        libs=(f"-L{fakecuda_dir}", "-l:libcuda.so.1", "-ldl", "-lpthread"),
    )


@pytest.fixture(scope="session")
def fcshare_asan_exe(build_c):
    return build_c(
        [*FAKECUDA_SRC, HERE / "c" / "fcshare.c"],
        "fcshare-static",
        sanitize=True,
        extra=("-rdynamic",),
    )


@pytest.fixture(params=["libcuda", "asan"])
def proc(request, fake_env):
    """proc(sock_fd=None) starts an fcshare process; both builds."""
    if request.param == "asan":
        exe = request.getfixturevalue("fcshare_asan_exe")
        env = dict(
            fake_env,
            ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
            UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
        )
        env.pop("LD_LIBRARY_PATH")
    else:
        exe, env = request.getfixturevalue("fcshare_exe"), fake_env
    started = []

    def start(sock_fd=None):
        p = Peer(exe, env, sock_fd)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()
        assert p.proc.returncode == 0, f"fcshare {p.pid} exited {p.proc.returncode}"


@pytest.fixture
def pair(proc):
    """Two initialised processes joined by a socketpair, and a third one as the controller."""
    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a, b = proc(sa.fileno()), proc(sb.fileno())
    sa.close()
    sb.close()
    ctl = proc()
    for p in (a, b, ctl):
        p.cmd("init 0")
    return a, b, ctl


def h(x: str) -> int:
    return int(x, 16)


def checkpoint_refused(ctl, target, fake_env, want: str):
    """Lock, then Checkpoint refused with NOT_SUPPORTED and the exact line; unlock resumes."""
    ctl.cmd(f"lock {target.pid}")
    assert ctl.err(f"checkpoint {target.pid}") == "CUDA_ERROR_NOT_SUPPORTED"
    ctl.cmd(f"unlock {target.pid}")
    lines = [
        x
        for x in read_log(fake_env)
        if x.startswith(f"{target.pid} ") and "checkpoint refused" in x
    ]
    assert lines and lines[-1].split(" ", 2)[2] == want, lines


def checkpoint_cycle(ctl, target):
    for op in ("lock", "checkpoint", "restore", "unlock"):
        ctl.cmd(f"{op} {target.pid}")


# ---------------------------------------------------------------- events in one process


def test_event_rules(proc):
    a = proc()
    a.cmd("init 0")
    assert (
        a.err(f"evcreate {EV_IPC}") == "CUDA_ERROR_INVALID_VALUE"
    )  # INTERPROCESS needs DISABLE_TIMING
    assert a.err("evcreate 8") == "CUDA_ERROR_INVALID_VALUE"
    e = h(a.cmd(f"evcreate {EV_BLOCKING | EV_NO_TIMING}")[0])
    a.cmd(f"evquery {e}")  # never recorded: complete
    a.cmd(f"evsync {e}")
    s, t = (int(a.cmd("stream")[0]) for _ in range(2))
    flag = h(a.cmd("malloc 64")[0])
    a.cmd(f"write {flag} 0")
    a.cmd(f"waitval {s} {flag} 1")  # s blocks until the word is 1
    a.cmd(f"evrecord {e} {s}")
    assert a.err(f"evquery {e}") == "CUDA_ERROR_NOT_READY"
    a.cmd(f"evwait {t} {e}")  # t waits for the record on s
    a.cmd(f"writeval {t} {flag + 4} 9")
    assert a.err(f"query {t}") == "CUDA_ERROR_NOT_READY"
    assert a.cmd(f"read {flag + 4}") == ["0"]  # t's write has not run
    a.cmd(f"write {flag} 1")  # releases s, then t
    a.cmd(f"sync {t}")
    a.cmd(f"evquery {e}")
    assert a.cmd(f"read {flag + 4}") == ["9"]
    assert a.err(f"evrecordf {e} {s} 2") == "CUDA_ERROR_INVALID_VALUE"
    a.cmd(f"evrecordf {e} {s} 1")  # CU_EVENT_RECORD_EXTERNAL
    assert a.err(f"evwait {t} {e} 2") == "CUDA_ERROR_INVALID_VALUE"
    assert a.err(f"evget {e}") == "CUDA_ERROR_INVALID_HANDLE"  # not INTERPROCESS
    # an event of another context cannot be recorded on this context's stream
    a.cmd("ctx 1")
    e1 = h(a.cmd(f"evcreate {EV_DEFAULT}")[0])
    assert a.err(f"evrecord {e1} {s}") == "CUDA_ERROR_INVALID_HANDLE"
    a.cmd(f"evwait {s} {e1}")  # a wait may name an event of another context
    a.cmd(f"evdestroy {e}")
    assert a.err(f"evquery {e}") == "CUDA_ERROR_INVALID_HANDLE"
    assert a.err(f"evdestroy {e}") == "CUDA_ERROR_INVALID_HANDLE"
    a.cmd("noctx")
    assert a.err(f"evcreate {EV_DEFAULT}") == "CUDA_ERROR_INVALID_CONTEXT"


def test_destroyed_event_still_completes_its_waits(proc):
    a = proc()
    a.cmd("init 0")
    s, t = (int(a.cmd("stream")[0]) for _ in range(2))
    flag = h(a.cmd("malloc 64")[0])
    a.cmd(f"write {flag} 0")
    e = h(a.cmd(f"evcreate {EV_NO_TIMING}")[0])
    a.cmd(f"waitval {s} {flag} 1")
    a.cmd(f"evrecord {e} {s}")
    a.cmd(f"evwait {t} {e}")
    a.cmd(f"evdestroy {e}")  # cuda.h: released once complete
    assert a.err(f"query {t}") == "CUDA_ERROR_NOT_READY"
    a.cmd(f"write {flag} 1")
    a.cmd(f"sync {t}")


# ---------------------------------------------------------------- IPC events across processes


def test_ipc_event_orders_two_processes(pair, fake_env):
    a, b, ctl = pair
    e = h(a.cmd(f"evcreate {EV_IPC | EV_NO_TIMING | EV_BLOCKING}")[0])  # PyTorch's flags
    s = int(a.cmd("stream")[0])
    flag = h(a.cmd("malloc 64")[0])
    a.cmd(f"write {flag} 0")
    a.cmd(f"waitval {s} {flag} 1")
    a.cmd(f"evrecord {e} {s}")
    a.cmd(f"evsend {e}")
    eb = h(b.cmd("evrecv")[0])
    t = int(b.cmd("stream")[0])
    mark = h(b.cmd("malloc 64")[0])
    b.cmd(f"write {mark} 0")
    b.cmd(f"evwait {t} {eb}")  # b's stream waits for a's record
    b.cmd(f"writeval {t} {mark} 5")
    assert b.err(f"evquery {eb}") == "CUDA_ERROR_NOT_READY"
    assert b.err(f"query {t}") == "CUDA_ERROR_NOT_READY"
    assert b.cmd(f"read {mark}") == ["0"]
    a.cmd(f"write {flag} 1")  # a's stream reaches the record
    b.cmd(f"sync {t}")
    assert b.cmd(f"read {mark}") == ["5"]
    b.cmd(f"evsync {eb}")
    # a record in the opener is seen by the creator
    u = int(b.cmd("stream")[0])
    b.cmd(f"waitval {u} {mark} 6")
    b.cmd(f"evrecord {eb} {u}")
    assert a.err(f"evquery {e}") == "CUDA_ERROR_NOT_READY"
    b.cmd(f"write {mark} 6")
    a.cmd(f"evsync {e}")
    assert (
        b.err(f"evget {eb}") == "CUDA_ERROR_INVALID_HANDLE"
    )  # an opened event is no INTERPROCESS one
    hexa = a.cmd(f"evget {e}")[0]
    assert a.err(f"evopen {hexa}") == "CUDA_ERROR_INVALID_CONTEXT"  # its own handle
    assert b.err(f"evopen {'00' * 64}") == "CUDA_ERROR_INVALID_HANDLE"
    # native checkpoint refuses both sides until the events are gone
    checkpoint_refused(
        ctl,
        a,
        fake_env,
        f"fakecuda: checkpoint refused: pid {a.pid} holds 1 interprocess event(s) (event 1 created with "
        "CU_EVENT_INTERPROCESS); what native checkpoint does with an IPC event is undocumented, the fake refuses "
        "it (scripts/gpu_check_probe.py ipc_event_checkpoint): cuEventDestroy them first (nothing was changed; "
        "unlock resumes) -> CUDA_ERROR_NOT_SUPPORTED",
    )
    checkpoint_refused(
        ctl,
        b,
        fake_env,
        f"fakecuda: checkpoint refused: pid {b.pid} holds 1 interprocess event(s) (event 1 opened from pid "
        f"{a.pid}); what native checkpoint does with an IPC event is undocumented, the fake refuses it "
        "(scripts/gpu_check_probe.py ipc_event_checkpoint): cuEventDestroy them first (nothing was changed; "
        "unlock resumes) -> CUDA_ERROR_NOT_SUPPORTED",
    )
    b.cmd(f"evdestroy {eb}")
    a.cmd(f"evdestroy {e}")
    checkpoint_cycle(ctl, a)
    checkpoint_cycle(ctl, b)
    assert b.cmd(f"read {mark}") == ["6"]


# ---------------------------------------------------------------- peer access


def test_peer_access_extends_legacy_memory_only(proc):
    a = proc()
    ctx0 = h(a.cmd("init 0")[0])
    assert a.cmd("canpeer 0 1") == ["1"]
    assert a.cmd("canpeer 1 1") == ["0"]
    assert a.err("canpeer 0 99") == "CUDA_ERROR_INVALID_DEVICE"
    buf = h(a.cmd("malloc 4096")[0])  # device 0's legacy memory
    a.cmd(f"write {buf} 0")
    ctx1 = h(a.cmd("ctx 1")[0])
    s1 = int(a.cmd("stream")[0])  # a stream of device 1
    assert a.err(f"peeren {ctx0} 1") == "CUDA_ERROR_INVALID_VALUE"  # Flags must be 0
    assert a.err(f"peeren {ctx1}") == "CUDA_ERROR_INVALID_CONTEXT"  # the current context itself
    assert a.err(f"peerdis {ctx0}") == "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED"
    a.cmd(f"peeren {ctx0}")
    assert a.err(f"peeren {ctx0}") == "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"
    a.cmd(f"writeval {s1} {buf} 7")  # device 1 writes device 0's buffer
    a.cmd(f"sync {s1}")
    a.cmd("ctx 0")
    later = h(a.cmd("malloc 4096")[0])  # allocated after the grant
    a.cmd("ctx 1")
    a.cmd(f"writeval {s1} {later} 8")
    a.cmd(f"sync {s1}")
    a.cmd("ctx 0")
    assert a.cmd(f"read {buf}") == ["7"]
    assert a.cmd(f"read {later}") == ["8"]
    a.cmd(f"peeren {ctx1}")  # the other direction is its own grant
    a.cmd("ctx 1")
    a.cmd(f"peerdis {ctx0}")
    assert a.err(f"peerdis {ctx0}") == "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED"
    a.cmd(f"writeval {s1} {buf} 9")  # revoked: the device's access faults (sticky)
    assert a.err(f"sync {s1}") == "CUDA_ERROR_ILLEGAL_ADDRESS"


def test_peer_access_does_not_extend_vmm_memory(proc):
    a = proc()
    ctx0 = h(a.cmd("init 0")[0])
    va = h(a.cmd(f"vmm {GRAN} 0")[0])  # access for device 0 only
    a.cmd("ctx 1")
    s1 = int(a.cmd("stream")[0])
    a.cmd(f"peeren {ctx0}")
    assert a.err(f"read {va}") == "CUDA_ERROR_ILLEGAL_ADDRESS"  # a copy from device 1: no access
    a.cmd(f"writeval {s1} {va} 1")
    assert a.err(f"sync {s1}") == "CUDA_ERROR_ILLEGAL_ADDRESS"


# ---------------------------------------------------------------- pools shared by IPC


def test_pool_shared_between_processes(pair, fake_env):
    a, b, ctl = pair
    pool = h(a.cmd(f"poolcreate 0 1 {4 * GRAN}")[0])
    s = int(a.cmd("stream")[0])
    p1 = h(a.cmd(f"poolalloc {pool} 1000 {s}")[0])
    p2 = h(a.cmd(f"poolalloc {pool} 1000 {s}")[0])
    assert p2 - p1 == 1024  # 512-byte aligned blocks
    a.cmd(f"write {p2} 4242")
    fd = int(a.cmd(f"poolexport {pool}")[0])
    a.cmd(f"sendfd {fd}")
    a.cmd(f"ptrsend {p2}")
    rfd = int(b.cmd("recvfd")[0])
    bpool = h(b.cmd(f"poolimport {rfd}")[0])
    q2 = h(b.cmd(f"ptrrecv {bpool}")[0])
    assert b.cmd(f"read {q2}") == ["4242"]
    b.cmd(f"write {q2 + 4} 17")
    assert a.cmd(f"read {p2 + 4}") == ["17"]
    bs = int(b.cmd("stream")[0])
    assert (
        b.err(f"poolalloc {bpool} 64 {bs}") == "CUDA_ERROR_INVALID_VALUE"
    )  # imported pools only import
    checkpoint_refused(
        ctl,
        a,
        fake_env,
        f"fakecuda: checkpoint refused: pid {a.pid} holds memory pool 1 of pid {a.pid} exported by IPC "
        f"(0x{p1:x}, {4 * GRAN} bytes); what native checkpoint does with a pool shared between processes is "
        "undocumented, the fake refuses it (scripts/gpu_check_probe.py pool_ipc_checkpoint) -> "
        "CUDA_ERROR_NOT_SUPPORTED",
    )
    checkpoint_refused(
        ctl,
        b,
        fake_env,
        f"fakecuda: checkpoint refused: pid {b.pid} holds memory pool 1 of pid {a.pid} imported by IPC "
        f"(0x{q2 - 1024:x}, {4 * GRAN} bytes); what native checkpoint does with a pool shared between processes "
        "is undocumented, the fake refuses it (scripts/gpu_check_probe.py pool_ipc_checkpoint) -> "
        "CUDA_ERROR_NOT_SUPPORTED",
    )
    b.cmd(f"poolfree {q2} {bs}")
    a.cmd(f"poolfree {p1} {s}")
    a.cmd(f"sync {s}")
    assert h(a.cmd(f"poolalloc {pool} 900 {s}")[0]) == p1  # the freed block is reused


def test_private_pool_is_checkpointed(pair):
    a, _b, ctl = pair
    pool = h(a.cmd(f"poolcreate 0 0 {GRAN}")[0])
    s = int(a.cmd("stream")[0])
    p = h(a.cmd(f"poolalloc {pool} 4096 {s}")[0])
    a.cmd(f"write {p} 31337")
    assert (
        a.err(f"poolexport {pool}") == "CUDA_ERROR_INVALID_VALUE"
    )  # created without a handle type
    checkpoint_cycle(ctl, a)
    assert a.cmd(f"read {p}") == ["31337"]


# ---------------------------------------------------------------- registered shared memory


def test_hostregister_of_unlinked_shm_blocks_native_checkpoint(pair, fake_env):
    a, _b, ctl = pair
    path = f"/dev/shm/fcshare-{os.getpid()}-{a.pid}"
    size = 3 << 20
    va = h(a.cmd(f"shm {size} {path}")[0])
    assert not os.path.exists(path)  # unlinked once mapped, as NCCL does after the peer attached
    a.cmd(f"hostreg {va} {size} {HOSTREG_PORTABLE | HOSTREG_DEVICEMAP}")
    a.cmd(f"hostwrite {va + 64} 77")
    checkpoint_refused(
        ctl,
        a,
        fake_env,
        f"fakecuda: checkpoint refused: pid {a.pid} registered 0x{va:x} ({size} bytes) with cuMemHostRegister over "
        f"a shared mapping ({path} (deleted)); what native checkpoint does with a registration of shared memory is "
        "undocumented, the fake refuses it (scripts/gpu_check_probe.py hostregister_shared_checkpoint): "
        "cuMemHostUnregister it first (nothing was changed; unlock resumes) -> CUDA_ERROR_NOT_SUPPORTED",
    )
    a.cmd(f"hostunreg {va}")
    checkpoint_cycle(ctl, a)
    assert a.cmd(f"hostread {va + 64}") == ["77"]
