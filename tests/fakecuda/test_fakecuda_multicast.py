"""Multicast across processes on fakecuda (fcpeer peers), and native checkpoint of private
cuMemAlloc memory. Single-process multicast rules are in c/fc_unit.c (test_fakecuda_unit.py)."""

from __future__ import annotations

import time

from fakecuda_helpers import GRAN, read_log

G = GRAN
PATTERN = 0xA11CE


def send(p, line):
    """Start a command without waiting for its reply (it may block)."""
    p.proc.stdin.write(line + "\n")
    p.proc.stdin.flush()


def reply(p):
    return p.proc.stdout.readline().split()


def wait_log(env, pid, text, limit_s=60):
    """Until fakecuda logged `text` for `pid` (a limit only so that a bug cannot hang the run)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if any(l.startswith(f"{pid} ") and text in l for l in read_log(env)):
            return
        time.sleep(0.005)
    raise AssertionError(f"{pid} never logged {text!r}")


def mc_team(a, b, size=4 * G):
    """a creates a shareable object for 2 devices and adds its device 0; b imports it by FD."""
    mc_a = int(a.cmd(f"mccreate 2 {size} 1")[0])
    a.cmd(f"mcadd {mc_a} 0")
    fd = int(a.cmd(f"export {mc_a}")[0])
    a.cmd(f"sendfd {fd}")
    a.cmd(f"close {fd}")
    rfd = int(b.cmd("recvfd")[0])
    mc_b = int(b.cmd(f"import {rfd}")[0])
    b.cmd(f"close {rfd}")
    return mc_a, mc_b


def member(p, size=2 * G, posix=1):
    """A device-0 allocation mapped read-write: (handle, va)."""
    h = int(p.cmd(f"create {size} {posix} 0")[0])
    va = int(p.cmd(f"reserve {size}")[0], 16)
    p.cmd(f"map {va} {size} {h}")
    p.cmd(f"access {va} {size} 0 3")
    return h, va


def mc_map(p, mc, size=4 * G):
    va = int(p.cmd(f"reserve {size}")[0], 16)
    p.cmd(f"map {va} {size} {mc}")
    p.cmd(f"access {va} {size} 0 3")
    return va


def test_team_shared_across_processes(peer_pair, fake_env):
    """One team in two processes (each adds its device 0: members are (pid, device)); a bind
    blocks until the other process adds the last device; writes through either process's
    multicast VA reach both members; reads through it are refused."""
    a, b = peer_pair
    mc_a, mc_b = mc_team(a, b)
    h_a, m_a = member(a)
    h_b, m_b = member(b)
    hn_b = int(b.cmd(f"create {2 * G} 0 0")[0])
    send(a, f"mcbind {mc_a} 0 {h_a} 0 {2 * G}")
    wait_log(fake_env, a.pid, "cuMulticastBindMem blocks until every device was added")
    b.cmd(f"mcadd {mc_b} 0")
    assert reply(a) == ["ok"]
    assert b.err(f"mcadd {mc_b} 0") == "CUDA_ERROR_INVALID_VALUE"  # duplicate
    assert b.err(f"mcadd {mc_b} 1") == "CUDA_ERROR_INVALID_VALUE"  # the team has its 2 devices
    assert b.err(f"mcbind {mc_b} 0 {hn_b} 0 {2 * G}") == "CUDA_ERROR_INVALID_VALUE"  # not shareable
    assert b.err(f"mcbind {mc_b} {3 * G} {h_b} 0 {2 * G}") == "CUDA_ERROR_INVALID_VALUE"  # capacity
    b.cmd(f"mcbind {mc_b} 0 {h_b} 0 {2 * G}")
    mva_a, mva_b = mc_map(a, mc_a), mc_map(b, mc_b)

    a.cmd(f"write {mva_a + 64} {PATTERN}")  # cuMemcpyHtoD
    assert a.cmd(f"read {m_a + 64}") == [str(PATTERN)]
    assert b.cmd(f"read {m_b + 64}") == [str(PATTERN)]
    b.cmd(f"memset32 {mva_b + G + 128} 4242 4")  # cuMemsetD32
    assert a.cmd(f"read {m_a + G + 140}") == ["4242"]
    assert b.cmd(f"hostread {m_b + G + 140}") == ["4242"]
    s = b.cmd("stream")[0]
    b.cmd(f"writeval {s} {mva_b + 256} 99")  # cuStreamWriteValue32
    b.cmd(f"sync {s}")
    assert a.cmd(f"hostread {m_a + 256}") == ["99"]
    assert b.cmd(f"read {m_b + 256}") == ["99"]
    assert a.err(f"read {mva_a + 64}") == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert a.err(f"write {mva_a + 2 * G} 1") == "CUDA_ERROR_ILLEGAL_ADDRESS"  # nothing bound there

    # b unbinds (exactly): a's writes then reach only a's member
    assert b.err(f"mcunbind {mc_b} 0 0 {G}") == "CUDA_ERROR_INVALID_VALUE"
    b.cmd(f"mcunbind {mc_b} 0 0 {2 * G}")
    a.cmd(f"write {mva_a + 64} 7")
    assert a.cmd(f"read {m_a + 64}") == ["7"]
    assert b.cmd(f"read {m_b + 64}") == [str(PATTERN)]
    # a member whose process exited is dropped: where it was the only one, nothing is bound
    b.cmd(f"mcbind {mc_b} 0 {h_b} 0 {2 * G}")
    b.cmd(f"mcbind {mc_b} {2 * G} {h_b} 0 {2 * G}")
    a.cmd(f"write {mva_a + 2 * G} 5")
    assert b.cmd(f"read {m_b}") == ["5"]
    pb = b.pid
    b.close()
    a.cmd(f"write {mva_a + 64} 8")
    assert a.cmd(f"read {m_a + 64}") == ["8"]
    assert a.err(f"write {mva_a + 2 * G} 6") == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert any(
        f"member (pid {pb}, device 0) is gone; its binding is dropped" in l
        for l in read_log(fake_env)
    )


def test_native_checkpoint_refused_with_multicast(peer_pair, controller, fake_env):
    """Native Checkpoint of a process holding a multicast object fails with NOT_SUPPORTED and a
    clear log line (the real driver hangs); the process unlocks and runs on; after teardown
    (unmap, unbind, release) it checkpoints."""
    a, b = peer_pair
    mc_a, mc_b = mc_team(a, b)
    b.cmd(f"mcadd {mc_b} 0")
    h_a, m_a = member(a)
    h_b, m_b = member(b)
    a.cmd(f"mcbind {mc_a} 0 {h_a} 0 {2 * G}")
    b.cmd(f"mcbind {mc_b} 0 {h_b} 0 {2 * G}")
    mva_a = mc_map(a, mc_a)
    pa, pb = a.pid, b.pid
    res = controller(
        [f"lock:{pa}", f"checkpoint:{pa}", f"state:{pa}", f"unlock:{pa}", f"state:{pa}"]
    )
    assert res == [
        "CUDA_SUCCESS",
        "CUDA_ERROR_NOT_SUPPORTED",
        "CUDA_SUCCESS/1",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS/0",
    ]
    assert any(
        l.startswith(f"{pa} ")
        and "checkpoint refused: the process holds 1 multicast object(s)" in l
        for l in read_log(fake_env)
    )
    a.cmd(f"write {mva_a + 4} {PATTERN}")  # still running, still one team
    assert b.cmd(f"read {m_b + 4}") == [str(PATTERN)]
    # b holds the object only through its import and binding: refused too
    assert controller([f"lock:{pb}", f"checkpoint:{pb}", f"unlock:{pb}"]) == [
        "CUDA_SUCCESS",
        "CUDA_ERROR_NOT_SUPPORTED",
        "CUDA_SUCCESS",
    ]
    a.cmd(f"unmap {mva_a} {4 * G}")
    a.cmd(f"mcunbind {mc_a} 0 0 {2 * G}")
    a.cmd(f"release {mc_a}")
    res = controller([f"lock:{pa}", f"checkpoint:{pa}", f"restore:{pa}", f"unlock:{pa}"])
    assert res == ["CUDA_SUCCESS"] * 4
    assert a.cmd(f"read {m_a + 4}") == [str(PATTERN)]


def test_watchdog_across_processes(peer, fake_env):
    """b imports the object but never adds its device: a's bind and map fail with
    CUDA_ERROR_TIMEOUT after FAKECUDA_MULTICAST_WATCHDOG_MS, loudly, instead of hanging."""
    import socket

    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(fake_env, FAKECUDA_MULTICAST_WATCHDOG_MS="150")
    a = peer(sa.fileno(), env=env)
    b = peer(sb.fileno(), env=env)
    sa.close()
    sb.close()
    a.cmd("init 0")
    b.cmd("init 0")
    mc_a, mc_b = mc_team(a, b)
    h_a, m_a = member(a)
    assert a.err(f"mcbind {mc_a} 0 {h_a} 0 {2 * G}") == "CUDA_ERROR_TIMEOUT"
    va = int(a.cmd(f"reserve {4 * G}")[0], 16)
    assert a.err(f"map {va} {4 * G} {mc_a}") == "CUDA_ERROR_TIMEOUT"
    log = [l for l in read_log(fake_env) if l.startswith(f"{a.pid} ")]
    assert any(
        "multicast watchdog: cuMulticastBindMem waited 150 ms, but only 1 of 2 devices" in l
        for l in log
    )
    assert any("multicast watchdog: cuMemMap waited 150 ms" in l for l in log)
    b.cmd(f"mcadd {mc_b} 0")  # now the team is complete
    a.cmd(f"mcbind {mc_a} 0 {h_a} 0 {2 * G}")
    a.cmd(f"map {va} {4 * G} {mc_a}")


def test_capacity_rounding_is_the_objects(peer, fake_env):
    """FAKECUDA_MULTICAST_CAPACITY_ROUNDING in the creator: the capacity lives in the object, so
    an importer without the knob binds and maps into the slack too (as NCCL does on r615)."""
    import socket

    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a = peer(sa.fileno(), env=dict(fake_env, FAKECUDA_MULTICAST_CAPACITY_ROUNDING=str(8 * G)))
    b = peer(sb.fileno())
    sa.close()
    sb.close()
    a.cmd("init 0")
    b.cmd("init 0")
    mc_a, mc_b = mc_team(a, b, size=G)
    b.cmd(f"mcadd {mc_b} 0")
    h_b, m_b = member(b)
    assert b.err(f"mcbind {mc_b} {7 * G} {h_b} 0 {2 * G}") == "CUDA_ERROR_INVALID_VALUE"
    b.cmd(f"mcbind {mc_b} {6 * G} {h_b} 0 {2 * G}")
    va = int(b.cmd(f"reserve {8 * G}")[0], 16)
    b.cmd(f"map {va} {8 * G} {mc_b}")
    b.cmd(f"access {va} {8 * G} 0 3")
    b.cmd(f"write {va + 7 * G + 8} 31")
    assert b.cmd(f"read {m_b + G + 8}") == ["31"]
    vb = int(a.cmd(f"reserve {2 * G}")[0], 16)
    assert a.err(f"mapoff {vb} {2 * G} {7 * G} {mc_a}") == "CUDA_ERROR_INVALID_VALUE"
    a.cmd(f"mapoff {vb} {2 * G} {6 * G} {mc_a}")


def maps_perms(pid, va):
    for line in open(f"/proc/{pid}/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= va < hi:
            return line.split()[1]
    return None


def test_native_checkpoint_carries_private_memory(peer, controller):
    """cuMemAlloc memory: Checkpoint copies it to host buffers and leaves a bare PROT_NONE
    reservation (CRIU never sees device memory as such); Restore brings the same bytes back at
    the same VA. The buffer is a shared memfd mapping before and after (CUDA IPC can share it)."""
    a = peer()
    a.cmd("init 0")
    size = 3 * 4096 + 100
    va = int(a.cmd(f"malloc {size}")[0], 16)
    offsets = [0, 4096, 8192 + 12, size - 4]
    for i, off in enumerate(offsets):
        a.cmd(f"write {va + off} {PATTERN + i}")
    assert maps_perms(a.pid, va) == "rw-s"
    pa = a.pid
    assert controller([f"lock:{pa}", f"checkpoint:{pa}"]) == ["CUDA_SUCCESS", "CUDA_SUCCESS"]
    assert maps_perms(pa, va) == "---p"
    assert maps_perms(pa, va + size - 1) == "---p"
    assert controller([f"restore:{pa}", f"unlock:{pa}"]) == ["CUDA_SUCCESS", "CUDA_SUCCESS"]
    assert maps_perms(pa, va) == "rw-s"
    for i, off in enumerate(offsets):
        assert a.cmd(f"read {va + off}") == [str(PATTERN + i)]
        assert a.cmd(f"hostread {va + off}") == [str(PATTERN + i)]
