"""The IPC adapter (docs/shim.md "IPC adapter"): cuMemAlloc_v2 backed by cuMemCreate, virtual
IPC handles opened in another process, the FETCH_FD secret (protocol.h "Secrets"), a full
in-place SAVE/PREPARE/LOAD/RESTORE cycle with the importer's VA and bytes unchanged, the
policy knob, and the refusal of driver IPC handles by INSPECT."""

from __future__ import annotations

import os
import subprocess

import pytest

from cuinterpose.coordinator.protocol import (
    IpcHandle,
    Op,
    Phase,
    RecordFlag,
    RecordKind,
    Role,
    Status,
)

from .conftest import C_DIR, GRAN, App, link_fakecuda
from .fetch import fetch_fd
from .test_sanitize import asan_build, sanitized_env  # noqa: F401 (asan_build is a fixture)

INVALID_VALUE, INVALID_CONTEXT = 1, 201
IPC_CAPABLE, RANGE_START, RANGE_SIZE, MEMORY_TYPE, DEVICE_ORDINAL = 10, 11, 12, 2, 9
MEMORYTYPE_DEVICE = 2
REQ = 3 << 20  # 3 MiB requested: rounded up to 4 MiB (2 granules)
MAPPED = 2 * GRAN


@pytest.fixture(scope="session")
def ipc_app(build_c, fakecuda_dir):
    return build_c([C_DIR / "ipc_app.c"], "shim_ipc_app", libs=link_fakecuda(fakecuda_dir))


@pytest.fixture
def ipc_apps(ipc_app, shim_env):
    started: list[App] = []

    def start(env=None, dev=0, **extra):
        e = dict(env or shim_env)
        e.update(extra)
        a = App(ipc_app, e)
        started.append(a)
        a.ok(f"init {dev}")
        return a

    yield start
    for a in started:
        a.close()


def inspect(ctl, app, phase=Phase.ACTIVE):
    resp = ctl(app).request(Op.INSPECT, txn_id=0, expected_phase=phase)
    assert resp.reply.status == Status.OK, resp.message
    return resp.records


def of_kind(records, kind):
    return [r for r in records if r.kind == kind]


def shared(ipc_apps):
    """Creator c with a 3 MiB cuMemAlloc_v2 at va holding pattern 5, its handle (hex and
    parsed, taken at va + 0x1000), and importer i with the handle opened at vi."""
    c, i = ipc_apps(), ipc_apps()
    va = c.val(f"alloc {REQ}")
    c.ok(f"fill {va} {REQ} 5")
    hx = c.ok(f"gethandle {va + 0x1000}")[0]
    vi = i.val(f"open {hx}")
    return c, i, va, hx, IpcHandle.unpack(bytes.fromhex(hx)), vi


def test_alloc_is_backed_by_cuMemCreate_with_driver_answers(ipc_apps, ctl, fake_log):
    c = ipc_apps()
    va = c.val(f"alloc {REQ}")
    # the driver saw cuMemCreate of the rounded size with POSIX FD handles, never cuMemAlloc_v2
    assert fake_log.calls(pid=c.pid, fn="cuMemAlloc_v2") == []
    creates = fake_log.calls(pid=c.pid, fn="cuMemCreate")
    assert [(a["size"], r) for _, a, r in creates] == [(str(MAPPED), "CUDA_SUCCESS")]
    # range and attributes as the driver answers for cuMemAlloc memory: the bytes requested
    assert c.ok(f"range {va + 12345}") == [hex(va), hex(REQ)]
    assert c.ok(f"attrs {va + 7}") == [hex(va), hex(REQ), "0x1", hex(MEMORYTYPE_DEVICE)]
    assert c.val(f"attr {va + REQ - 1} {IPC_CAPABLE}") == 1
    assert c.val(f"attr {va} {RANGE_START}") == va
    assert c.val(f"attr {va} {RANGE_SIZE}") == REQ
    assert c.val(f"attr {va} {DEVICE_ORDINAL}") == 0
    c.ok(f"fill {va} {REQ} 9")
    c.ok(f"check {va} {REQ} 9")
    recs = inspect(ctl, c)
    (alloc,) = of_kind(recs, RecordKind.ALLOCATION)
    assert (alloc.role, alloc.flags, alloc.size, alloc.reserved[0]) == (
        Role.PRIVATE,
        RecordFlag.ADAPTER,
        MAPPED,
        REQ,
    )
    assert [(m.va, m.size) for m in of_kind(recs, RecordKind.MAPPING)] == [(va, MAPPED)]
    assert [(r.va, r.size) for r in of_kind(recs, RecordKind.RESERVATION)] == [(va, MAPPED)]
    # cuMemFree_v2 of an inner pointer is refused, of the start undoes all three
    assert c.err(f"free {va + 16}") == INVALID_VALUE
    c.ok(f"free {va}")
    assert inspect(ctl, c) == []
    assert [r for _, _, r in fake_log.calls(pid=c.pid, fn="cuMemUnmap")] == ["CUDA_SUCCESS"]
    assert [r for _, _, r in fake_log.calls(pid=c.pid, fn="cuMemAddressFree")] == ["CUDA_SUCCESS"]


def test_two_processes_share_through_virtual_handle(ipc_apps, ctl, fake_log):
    c, i, va, hx, h, vi = shared(ipc_apps)
    assert (h.creator_pid, h.size, h.offset, h.mapped) == (c.pid, REQ, 0x1000, MAPPED)
    assert h.secret != 0
    # bytes both ways
    i.ok(f"check {vi} {REQ} 5")
    i.ok(f"fill {vi} {REQ} 6")
    c.ok(f"check {va} {REQ} 6")
    # the importer's range answers too; opened memory cannot be exported again (the driver's
    # INVALID_VALUE), and that refusal is no driver IPC handle for INSPECT
    assert i.ok(f"range {vi + 5}") == [hex(vi), hex(REQ)]
    assert i.err(f"gethandle {vi}") == INVALID_VALUE
    assert ctl(i).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).reply.status == (
        Status.OK
    )
    # a second open returns the same VA and counts; the first close keeps the mapping
    assert i.val(f"open {hx}") == vi
    assert i.val(f"open1 {hx}") == vi
    imported = of_kind(inspect(ctl, i), RecordKind.ALLOCATION)
    assert [
        (r.role, r.creator_pid, r.alloc_id, r.reserved[0], r.reserved[1]) for r in imported
    ] == [(Role.IMPORTER, c.pid, h.alloc_id, REQ, 3)]
    assert imported[0].flags & (RecordFlag.ADAPTER | RecordFlag.IPC) == (
        RecordFlag.ADAPTER | RecordFlag.IPC
    )
    assert [(m.va, m.size, m.role) for m in of_kind(inspect(ctl, i), RecordKind.MAPPING)] == [
        (vi, MAPPED, Role.IMPORTER)
    ]
    i.ok(f"close {vi}")
    i.ok(f"close {vi}")
    i.ok(f"check {vi} {REQ} 6")
    i.ok(f"close {vi}")
    assert inspect(ctl, i) == []
    # the creator: a creator allocation now, exported once into the cache
    (alloc,) = of_kind(inspect(ctl, c), RecordKind.ALLOCATION)
    assert alloc.role == Role.CREATOR and alloc.alloc_id == h.alloc_id
    assert alloc.flags == (
        RecordFlag.ADAPTER | RecordFlag.IPC | RecordFlag.EXPORTED | RecordFlag.SHARED
    )
    assert len(fake_log.calls(pid=c.pid, fn="cuMemExportToShareableHandle")) == 1
    # opening in the creating process fails with the driver's code, nothing recorded
    assert c.err(f"open {hx}") == INVALID_CONTEXT


def test_cycle_keeps_importer_va_and_bytes(ipc_apps, ctl):
    c, i, va, hx, h, vi = shared(ipc_apps)
    i.ok(f"fill {vi} {REQ} 11")
    before = {a.pid: inspect(ctl, a) for a in (c, i)}
    steps = (
        (Op.SAVE_ALLOCATIONS, Phase.ACTIVE),
        (Op.PREPARE_UNICAST, Phase.SAVED),
        (Op.LOAD_ALLOCATIONS, Phase.PREPARED),
        (Op.RESTORE_UNICAST, Phase.LOADED),
    )
    for txn, (op, phase) in enumerate(steps, start=1):
        for a in (c, i):
            r = ctl(a).request(op, txn_id=txn, expected_phase=phase)
            assert r.reply.status == Status.OK, (a.pid, op, r.message)
            if op == Op.SAVE_ALLOCATIONS:
                assert r.reply.bytes == (MAPPED if a is c else 0)
    after = {a.pid: inspect(ctl, a) for a in (c, i)}
    for a in (c, i):
        want = [(m.va, m.size, m.role) for m in of_kind(before[a.pid], RecordKind.MAPPING)]
        got = [(m.va, m.size, m.role) for m in of_kind(after[a.pid], RecordKind.MAPPING)]
        assert got == want
    assert [m.va for m in of_kind(after[i.pid], RecordKind.MAPPING)] == [vi]
    c.ok(f"check {va} {REQ} 11")
    i.ok(f"check {vi} {REQ} 11")
    # sharing works again, both ways, and the handle still opens at the same VA
    c.ok(f"fill {va} {REQ} 12")
    i.ok(f"check {vi} {REQ} 12")
    assert i.val(f"open {hx}") == vi
    i.ok(f"close {vi}")
    i.ok(f"fill {vi} {REQ} 13")
    c.ok(f"check {va} {REQ} 13")


def test_fetch_fd_needs_the_secret(ipc_apps, ctl, shim_env):
    c, i, va, hx, h, vi = shared(ipc_apps)
    cdir = shim_env["CUINTERPOSE_CONTROL_DIR"]
    wrong = h.secret ^ 1
    rep, msg, fd = fetch_fd(cdir, c.pid, h.alloc_id, wrong)
    assert (rep.status, fd) == (Status.REFUSED_PEER, None)
    assert msg == (
        f"FETCH_FD: pid {c.pid} refused allocation {h.alloc_id.hex()} to pid {os.getpid()} "
        f"(request names pid {os.getpid()}): the request does not carry the allocation's "
        "secret; only holders of its ticket or IPC handle may fetch it"
    )
    assert str(h.secret) not in msg and f"{h.secret:x}" not in msg
    rep, msg, fd = fetch_fd(cdir, c.pid, h.alloc_id, 0)
    assert (rep.status, fd) == (Status.REFUSED_PEER, None)
    rep, msg, fd = fetch_fd(cdir, c.pid, h.alloc_id, h.secret)
    assert rep.status == Status.OK and fd is not None, msg
    assert os.fstat(fd).st_size >= MAPPED
    os.close(fd)
    # not served while the creator is SAVED (its bytes are being carried); CANCEL gives it back
    r = ctl(c).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
    assert r.reply.status == Status.OK, r.message
    rep, msg, fd = fetch_fd(cdir, c.pid, h.alloc_id, h.secret)
    assert (rep.status, rep.phase, fd) == (Status.REFUSED_PHASE, Phase.SAVED, None)
    assert msg == (
        f"FETCH_FD: pid {c.pid} is in phase SAVED: allocation {h.alloc_id.hex()} is not served "
        f"to pid {os.getpid()} until the process is restored (FETCH_FD is served in ACTIVE and "
        "the restore phases); nothing was sent"
    )
    r = ctl(c).request(Op.CANCEL_CAPTURE, txn_id=2, expected_phase=Phase.SAVED)
    assert r.reply.status == Status.OK, r.message
    rep, msg, fd = fetch_fd(cdir, c.pid, h.alloc_id, h.secret)
    assert rep.status == Status.OK and fd is not None, msg
    os.close(fd)
    i.ok(f"check {vi} {REQ} 5")


def test_forged_handle_with_wrong_secret_is_refused(ipc_apps):
    c, i, va, hx, h, vi = shared(ipc_apps)
    third = ipc_apps()
    forged = IpcHandle(h.creator_pid, h.alloc_id, h.size, 0, h.secret ^ 0x55, h.mapped)
    assert third.err(f"open {forged.pack().hex()}") == INVALID_VALUE
    assert (
        f"cannot import allocation {h.alloc_id.hex()} from creator pid {c.pid}: creator replied "
        f"status {int(Status.REFUSED_PEER)}: FETCH_FD: pid {c.pid} refused allocation "
        f"{h.alloc_id.hex()} to pid {third.pid}"
    ) in third.stderr()
    # the genuine handle still opens there
    v3 = third.val(f"open {hx}")
    third.ok(f"check {v3} {REQ} 5")


def test_policy_off_and_min_bytes(ipc_apps, ctl, fake_log):
    off = ipc_apps(CUINTERPOSE_IPC_ADAPTER="off")
    va = off.val(f"alloc {REQ}")
    assert [r for _, _, r in fake_log.calls(pid=off.pid, fn="cuMemAlloc_v2")] == ["CUDA_SUCCESS"]
    assert fake_log.calls(pid=off.pid, fn="cuMemCreate") == []
    assert inspect(ctl, off) == []
    off.ok(f"free {va}")
    assert [r for _, _, r in fake_log.calls(pid=off.pid, fn="cuMemFree_v2")] == ["CUDA_SUCCESS"]

    big = ipc_apps(CUINTERPOSE_IPC_ADAPTER=str(REQ))
    small = big.val(f"alloc {REQ - 1}")
    large = big.val(f"alloc {REQ}")
    assert len(fake_log.calls(pid=big.pid, fn="cuMemAlloc_v2")) == 1
    recs = inspect(ctl, big)
    assert [(r.size, r.reserved[0]) for r in of_kind(recs, RecordKind.ALLOCATION)] == [
        (MAPPED, REQ)
    ]
    assert [m.va for m in of_kind(recs, RecordKind.MAPPING)] == [large]
    assert small not in (large,)


def test_bad_policy_refused_loud(ipc_apps, fake_log):
    a = ipc_apps(CUINTERPOSE_IPC_ADAPTER="sometimes")
    assert a.err(f"alloc {REQ}") == INVALID_VALUE
    assert a.err(f"alloc {GRAN}") == INVALID_VALUE
    line = (
        'CUINTERPOSE_IPC_ADAPTER="sometimes" is not all, off or a decimal byte count; every '
        "cuMemAlloc_v2 of this process fails with CUDA_ERROR_INVALID_VALUE until the variable "
        "is fixed"
    )
    assert a.stderr().count(line) == 1
    assert fake_log.calls(pid=a.pid, fn="cuMemAlloc_v2") == []
    assert fake_log.calls(pid=a.pid, fn="cuMemCreate") == []


def test_ipc_driver_plain(build_c, shim_env, fakecuda_dir):
    drv = build_c([C_DIR / "ipc_driver.c"], "shim_ipc_driver", libs=link_fakecuda(fakecuda_dir))
    res = subprocess.run([str(drv)], env=shim_env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == "ipc ok\n"


def test_ipc_driver_asan_ubsan(build_c, asan_build, fake_env):  # noqa: F811
    drv = build_c(
        [C_DIR / "ipc_driver.c"],
        "shim_ipc_driver_asan",
        sanitize=True,
        libs=link_fakecuda(asan_build[1]),
    )
    res = subprocess.run(
        [str(drv)],
        env=sanitized_env(asan_build, fake_env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    assert res.stdout == "ipc ok\n"
    assert "runtime error" not in res.stderr and "AddressSanitizer" not in res.stderr, res.stderr[
        -6000:
    ]


def test_driver_ipc_handles_make_inspect_refuse(ipc_apps, ctl):
    """Memory the adapter did not allocate (policy off) shared through the driver's own IPC:
    INSPECT (and so the coordinator's capture) refuses naming pid, pointer / handle and why,
    with the records still sent; closing and freeing lift the refusal."""
    c = ipc_apps(CUINTERPOSE_IPC_ADAPTER="off")
    i = ipc_apps()
    va = c.val(f"alloc {REQ}")
    assert inspect(ctl, c) == []
    hx = c.ok(f"gethandle {va}")[0]
    assert not bytes.fromhex(hx).startswith(b"CUIIPC01")
    r = ctl(c).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
    assert r.reply.status == Status.REFUSED_STATE
    assert r.message == (
        f"INSPECT: pid {c.pid} exported pointer {va:#x} through the driver's cuIpcGetMemHandle "
        "(memory not allocated under the IPC adapter); native checkpoint cannot carry IPC "
        "memory: free it, or allocate it with CUINTERPOSE_IPC_ADAPTER covering its size"
    )
    vi = i.val(f"open {hx}")
    c.ok(f"fill {va} {REQ} 4")
    i.ok(f"check {vi} {REQ} 4")
    r = ctl(i).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
    assert r.reply.status == Status.REFUSED_STATE
    assert r.message == (
        f"INSPECT: pid {i.pid} opened a driver CUDA IPC handle {hx[:16]}... at {vi:#x} (not a "
        "cuinterpose handle: its memory was not allocated under the IPC adapter); native "
        "checkpoint cannot carry IPC memory: close it, or run the exporter with the shim and "
        "CUINTERPOSE_IPC_ADAPTER=all"
    )
    # the shim's own objects still come with the refusal
    own = i.val(f"alloc {GRAN}")
    r = ctl(i).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
    assert r.reply.status == Status.REFUSED_STATE
    assert [m.va for m in of_kind(r.records, RecordKind.MAPPING)] == [own]
    i.ok(f"close {vi}")
    assert [m.va for m in of_kind(inspect(ctl, i), RecordKind.MAPPING)] == [own]
    c.ok(f"free {va}")
    assert inspect(ctl, c) == []


def test_agent_inspect_shows_adapter_stats(ipc_apps, shim_env):
    from cuinterpose.agent.inspect import inspect_pid

    c, i, va, hx, h, vi = shared(ipc_apps)
    c.val(f"alloc {GRAN}")  # exact: no rounding waste
    cdir = shim_env["CUINTERPOSE_CONTROL_DIR"]
    assert inspect_pid(c.pid, control_dir=cdir, timeout_s=30)["adapter"] == {
        "allocations": 2,
        "requested": REQ + GRAN,
        "mapped": MAPPED + GRAN,
        "waste": MAPPED - REQ,
        "ipc_exported": 1,
        "ipc_imports": 0,
        "ipc_opens": 0,
    }
    assert i.val(f"open {hx}") == vi
    assert inspect_pid(i.pid, control_dir=cdir, timeout_s=30)["adapter"] == {
        "allocations": 0,
        "requested": 0,
        "mapped": 0,
        "waste": 0,
        "ipc_exported": 0,
        "ipc_imports": 1,
        "ipc_opens": 2,
    }


def test_importer_attributes_as_the_driver(ipc_apps):
    c, i, va, hx, h, vi = shared(ipc_apps)
    assert i.ok(f"attrs {vi + 8}") == [hex(vi), hex(REQ), "0x0", hex(MEMORYTYPE_DEVICE)]
    assert c.val(f"attr {va} {IPC_CAPABLE}") == 1
    # an importer on device 1: DEVICE_ORDINAL is the exporter's (as the driver reports),
    # access was granted to the opener's device
    i1 = ipc_apps(dev=1)
    v1 = i1.val(f"open {hx}")
    assert i1.val(f"attr {v1} {DEVICE_ORDINAL}") == 0
    i1.ok(f"check {v1} {REQ} 5")
    # MAPPING_BASE_ADDR / MAPPING_SIZE answer the buffer, as for cuMemAlloc memory
    assert c.val(f"attr {va + 100} 19") == va
    assert c.val(f"attr {va + 100} 18") == REQ


LOOKUPS = {
    "cuMemAlloc@3020": "cuMemAlloc_v2",
    "cuMemFree@3020": "cuMemFree_v2",
    "cuMemGetAddressRange@3020": "cuMemGetAddressRange_v2",
    "cuPointerGetAttribute@4000": "cuPointerGetAttribute",
    "cuPointerGetAttributes@7000": "cuPointerGetAttributes",
    "cuIpcGetMemHandle@4010": "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle@11000": "cuIpcOpenMemHandle_v2",
    "cuIpcOpenMemHandle@4010": "cuIpcOpenMemHandle",
    "cuIpcCloseMemHandle@4010": "cuIpcCloseMemHandle",
}


@pytest.fixture(scope="module")
def ipc_lookup_bins(build_c, fakecuda_dir):
    linked = build_c(
        [C_DIR / "ipc_lookup.c"],
        "shim_ipc_lookup_linked",
        extra=("-DLINKED",),
        libs=link_fakecuda(fakecuda_dir),
    )
    plain = build_c([C_DIR / "ipc_lookup.c"], "shim_ipc_lookup")
    cudart = build_c(
        [C_DIR / "fake_cudart.c"],
        "libcudart.so.13",
        extra=("-shared", "-fPIC", "-Wl,-soname,libcudart.so.13"),
    )
    return linked, plain, cudart.parent


def ipc_lookup(bins, env, path):
    linked, plain, cudart_dir = bins
    env = dict(env, LD_LIBRARY_PATH=f"{env['LD_LIBRARY_PATH']}:{cudart_dir}")
    exe = linked if path == "elf" else plain
    res = subprocess.run([str(exe), path], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return {t[1]: (t[2], t[3]) for t in (ln.split() for ln in res.stdout.splitlines())}


@pytest.mark.parametrize(
    "path", ["elf", "dlsym", "dlsym_default", "gpa", "gpa2", "cudart", "cudart_ver"]
)
def test_adapter_lookups_reach_the_wrappers(ipc_lookup_bins, shim_env, path):
    got = ipc_lookup(ipc_lookup_bins, shim_env, path)
    want = {k: ("libcuinterpose.so", v) for k, v in LOOKUPS.items()}
    if path == "cudart":  # one version: the runtime's own; the v1 open is not asked for
        del want["cuIpcOpenMemHandle@4010"]
    assert got == want


def test_adapter_lookups_without_shim_are_the_drivers(ipc_lookup_bins, fake_env):
    got = ipc_lookup(ipc_lookup_bins, fake_env, "gpa2")
    assert got == {k: ("libcuda.so.1", v) for k, v in LOOKUPS.items()}


def test_concurrent_opens_share_one_mapping(ipc_apps, ctl):
    c = ipc_apps()
    i = ipc_apps()
    va = c.val(f"alloc {REQ}")
    c.ok(f"fill {va} {REQ} 8")
    hx = c.ok(f"gethandle {va}")[0]
    vas = {int(v, 16) for v in i.ok(f"open_threads {hx} 8")}
    assert len(vas) == 1
    (vi,) = vas
    (imp,) = of_kind(inspect(ctl, i), RecordKind.ALLOCATION)
    assert imp.reserved[1] == 8
    assert [m.va for m in of_kind(inspect(ctl, i), RecordKind.MAPPING)] == [vi]
    i.ok(f"check {vi} {REQ} 8")
    for _ in range(8):
        i.ok(f"close {vi}")
    assert inspect(ctl, i) == []


def test_ipc_driver_tsan(build_c, cuda_include, fake_env):
    """Races between the importer's 4 opening threads, the accept thread serving FETCH_FD (the
    secret table, the export cache) and INSPECT's fix-up (the state and foreign-handle locks)."""
    import shutil

    from .sanitize_build import TSAN, build_libs, runtime

    libtsan = runtime("libtsan.so")
    if not shutil.which("setarch"):
        pytest.skip("no setarch")
    shim, fake_dir = build_libs(TSAN, "shim-tsan", cuda_include)  # test_sanitize.py's build
    drv = build_c(
        [C_DIR / "ipc_driver.c"],
        "shim_ipc_driver_tsan",
        extra=("-fsanitize=thread",),
        libs=link_fakecuda(fake_dir),
    )
    env = dict(
        fake_env,
        LD_LIBRARY_PATH=str(fake_dir),
        LD_PRELOAD=f"{libtsan} {shim}",
        TSAN_OPTIONS="halt_on_error=1:exitcode=23",
    )
    res = subprocess.run(
        ["setarch", "-R", str(drv)], env=env, capture_output=True, text=True, timeout=300
    )
    if "ThreadSanitizer" in res.stderr and "unexpected memory mapping" in res.stderr:
        pytest.skip("TSan cannot start with this kernel's memory layout")
    assert "WARNING: ThreadSanitizer" not in res.stderr, res.stderr[-6000:]
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    assert res.stdout == "ipc ok\n"
