"""Two processes on fakecuda: FD sharing, native checkpoint without the shim, refusals."""

from __future__ import annotations

from fakecuda_helpers import GRAN, read_log, share_window

PATTERN_A, PATTERN_B = 0xA11CE, 0xB0B


def test_shared_window_by_fd_passing(peer_pair):
    a, b = peer_pair
    va_a, h_a, va_b, h_b = share_window(a, b)
    assert h_a == 0 and h_b == 0  # first handle value in each process is 0
    a.cmd(f"write {va_a + 64} {PATTERN_A}")
    assert b.cmd(f"read {va_b + 64}") == [str(PATTERN_A)]
    assert b.cmd(f"hostread {va_b + 64}") == [str(PATTERN_A)]
    b.cmd(f"write {va_b + 128} {PATTERN_B}")
    assert a.cmd(f"read {va_a + 128}") == [str(PATTERN_B)]
    # the importer sees the creator's properties, PINNED(1) on device 0, but no requested handle
    # types (0), as the real driver reports an import (R580, docs/gpu-validation.md)
    assert b.cmd(f"props {h_b}") == ["1", "0", "0"]


def test_native_checkpoint_loses_sharing(peer_pair, controller, fake_env):
    a, b = peer_pair
    va_a, h_a, va_b, h_b = share_window(a, b)
    a.cmd(f"write {va_a} {PATTERN_A}")
    b.cmd(f"write {va_b + 4} {PATTERN_B}")
    pa, pb = a.pid, b.pid
    res = controller(
        [
            f"lock:{pa}",
            f"lock:{pb}",
            f"state:{pa}",
            f"checkpoint:{pa}",
            f"checkpoint:{pb}",
            f"state:{pb}",
            f"restore:{pa}",
            f"restore:{pb}",
            f"state:{pa}",
            f"unlock:{pa}",
            f"unlock:{pb}",
            f"state:{pb}",
        ]
    )
    assert res == [
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS/1",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS/2",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS/1",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS/0",
    ]
    # each keeps its pre-checkpoint bytes at the same VA, through the same handle value
    for p, va in ((a, va_a), (b, va_b)):
        assert p.cmd(f"read {va}") == [str(PATTERN_A)]
        assert p.cmd(f"read {va + 4}") == [str(PATTERN_B)]
        assert p.cmd(f"hostread {va + 4}") == [str(PATTERN_B)]
    assert a.cmd(f"retain {va_a}") == [str(h_a)]
    assert b.cmd(f"retain {va_b}") == [str(h_b)]
    # ... but the window is no longer shared: writes stay private (as on the real driver)
    a.cmd(f"write {va_a} 111")
    b.cmd(f"write {va_b + 4} 222")
    assert b.cmd(f"read {va_b}") == [str(PATTERN_A)]
    assert a.cmd(f"read {va_a + 4}") == [str(PATTERN_B)]
    assert a.cmd(f"read {va_a}") == ["111"]
    assert b.cmd(f"read {va_b + 4}") == ["222"]
    log = read_log(fake_env)
    assert any(f"{pa} " in l and "control Checkpoint = CUDA_SUCCESS" in l for l in log)


def test_open_export_fd_blocks_checkpoint(peer_pair, controller, fake_env):
    a, b = peer_pair
    h = int(a.cmd(f"create {GRAN} 1 0")[0])
    va = int(a.cmd(f"reserve {GRAN}")[0], 16)
    a.cmd(f"map {va} {GRAN} {h}")
    a.cmd(f"access {va} {GRAN} 0 3")
    a.cmd(f"write {va + 8} {PATTERN_A}")
    fd = int(a.cmd(f"export {h}")[0])  # never closed
    pa = a.pid
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
    assert a.cmd(f"read {va + 8}") == [str(PATTERN_A)]
    a.cmd(f"write {va + 8} 5")
    assert a.cmd(f"hostread {va + 8}") == ["5"]
    log = read_log(fake_env)
    assert any(f"exported fd {fd} of allocation handle {h}" in l for l in log), log[-5:]
    # once closed, the same process checkpoints fine
    a.cmd(f"close {fd}")
    res = controller([f"lock:{pa}", f"checkpoint:{pa}", f"restore:{pa}", f"unlock:{pa}"])
    assert res == ["CUDA_SUCCESS"] * 4
    assert a.cmd(f"read {va + 8}") == ["5"]


def test_lock_timeout_on_waiting_stream(peer_pair, controller):
    a, b = peer_pair
    va_a, h_a, va_b, h_b = share_window(a, b)
    s = a.cmd("stream")[0]
    a.cmd(f"waitval {s} {va_a + 256} 1 1")  # EQ 1: b has not written it
    assert a.err(f"query {s}") == "CUDA_ERROR_NOT_READY"
    pa = a.pid
    res = controller([f"lock:{pa}:200", f"state:{pa}", f"checkpoint:{pa}"])
    assert res == ["CUDA_ERROR_NOT_READY", "CUDA_SUCCESS/0", "CUDA_ERROR_ILLEGAL_STATE"]
    a.cmd(f"write {va_a} 3")  # the gate is open again: calls proceed
    b.cmd(f"write {va_b + 256} 1")  # the peer finally writes
    a.cmd(f"sync {s}")
    res = controller([f"lock:{pa}:0", f"unlock:{pa}"])
    assert res == ["CUDA_SUCCESS", "CUDA_SUCCESS"]


def test_illegal_transitions_and_unknown_pid(peer, controller):
    a = peer()
    a.cmd("init 0")
    pa = a.pid
    res = controller(
        [
            f"checkpoint:{pa}",
            f"restore:{pa}",
            f"unlock:{pa}",
            f"lock:{pa}",
            f"lock:{pa}",
            f"restore:{pa}",
            f"checkpoint:{pa}",
            f"unlock:{pa}",
            f"checkpoint:{pa}",
            f"restore:{pa}",
            f"unlock:{pa}",
            f"tid:{pa}",
        ]
    )
    assert res[:11] == [
        "CUDA_ERROR_ILLEGAL_STATE",
        "CUDA_ERROR_ILLEGAL_STATE",
        "CUDA_ERROR_ILLEGAL_STATE",
        "CUDA_SUCCESS",
        "CUDA_ERROR_ILLEGAL_STATE",
        "CUDA_ERROR_ILLEGAL_STATE",
        "CUDA_SUCCESS",
        "CUDA_ERROR_ILLEGAL_STATE",
        "CUDA_ERROR_ILLEGAL_STATE",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
    ]
    assert res[11].startswith("CUDA_SUCCESS/") and int(res[11].split("/")[1]) not in (-1, pa)
    # a process without fakecuda initialised, and a pid that does not exist: the real driver's
    # answers (R580, docs/gpu-validation.md)
    b = peer()
    assert controller([f"state:{b.pid}", "state:2147483600", f"lock:{b.pid}"]) == [
        "CUDA_ERROR_NOT_INITIALIZED/-1",
        "CUDA_ERROR_OPERATING_SYSTEM/-1",
        "CUDA_ERROR_NOT_INITIALIZED",
    ]


def test_lock_blocks_api_calls_until_unlock(peer_pair, controller):
    a, b = peer_pair
    va_a, h_a, va_b, h_b = share_window(a, b)
    pa = a.pid
    assert controller([f"lock:{pa}"]) == ["CUDA_SUCCESS"]
    a.proc.stdin.write(f"write {va_a} 9\n")
    a.proc.stdin.flush()
    # the call is parked at the entry gate: it cannot have reached the copy engine
    assert b.cmd(f"read {va_b}") == ["0"]
    assert controller([f"state:{pa}", f"unlock:{pa}"]) == ["CUDA_SUCCESS/1", "CUDA_SUCCESS"]
    assert a.proc.stdout.readline().strip() == "ok"
    assert b.cmd(f"read {va_b}") == ["9"]


def test_reserve_hint_modes(peer, fake_env):
    """FAKECUDA_RESERVE_HINT: honor (default), ignore, fail: what real drivers do with an
    addr hint (cuMemAddressReserve: the address is a hint). A hint over a taken range is
    placed elsewhere in honor mode."""
    far = 0x100000000000  # free and far from where mmap places things
    got = {}
    for mode in ("honor", "ignore", "fail"):
        p = peer(env=dict(fake_env, FAKECUDA_RESERVE_HINT=mode))
        p.cmd("init 0")
        if mode == "fail":
            assert p.err(f"reserve {GRAN} {far}") == "CUDA_ERROR_OUT_OF_MEMORY"
            continue
        got[mode] = int(p.cmd(f"reserve {GRAN} {far}")[0], 16)
        taken = int(p.cmd(f"reserve {GRAN} {got[mode]}")[0], 16)
        assert taken != got[mode] and taken % GRAN == 0
    assert got["honor"] == far
    assert got["ignore"] != far and got["ignore"] % GRAN == 0
