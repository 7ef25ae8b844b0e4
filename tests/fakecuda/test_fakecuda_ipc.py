"""Legacy CUDA IPC on fakecuda, as strict as cuda.h documents it: two ``fcpeer`` processes pass
the 64-byte CUipcMemHandle over their socketpair; the importer sees the exporter's bytes and the
other way round; a second open returns the same VA and counts; opening in the exporting process,
VMM memory, interior and imported pointers are refused with exact codes; native checkpoint is
refused while an import is live on either side (the pre-r610 driver), and passes again after
the close; FAKECUDA_LAUNCH_JOB=1 models cuda-checkpoint --launch-job (private copies)."""

from __future__ import annotations

import os
import pathlib
import socket

import pytest
from fakecuda_helpers import GRAN, read_log

PATTERN = 0x5EED0000
SIZE = 3 * 4096 + 100  # not a page multiple: the handle carries the exact bytesize
OFFSETS = [0, 4096, 8192 + 12, SIZE - 4]

# cuda.h CUpointer_attribute values
CONTEXT, MEMORY_TYPE, DEVICE_POINTER, HOST_POINTER = 1, 2, 3, 4
P2P_TOKENS, SYNC_MEMOPS, BUFFER_ID, IS_MANAGED, DEVICE_ORDINAL = 5, 6, 7, 8, 9
IPC_CAPABLE, RANGE_START, RANGE_SIZE, MAPPED, HANDLE_TYPES = 10, 11, 12, 13, 14
RDMA, ACCESS_FLAGS, MEMPOOL, MAPPING_SIZE, MAPPING_BASE, BLOCK_ID = 15, 16, 17, 18, 19, 20
MEMORYTYPE_HOST, MEMORYTYPE_DEVICE = 1, 2


@pytest.fixture
def pair(any_peer):
    """Exporter a (malloc'd SIZE bytes with a pattern) and importer b, joined by a socketpair;
    both on the installed libcuda.so.1, or both fcpeer builds with fakecuda compiled in under
    ASan/UBSan."""
    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a = any_peer(sa.fileno())
    b = any_peer(sb.fileno())
    sa.close()
    sb.close()
    a.cmd("init 0")
    b.cmd("init 0")
    va = int(a.cmd(f"malloc {SIZE}")[0], 16)
    for i, off in enumerate(OFFSETS):
        a.cmd(f"write {va + off} {PATTERN + i}")
    return a, b, va


def send_open(a, b, va):
    a.cmd(f"ipcsend {va}")
    return int(b.cmd("ipcrecv")[0], 16)


def test_importer_and_exporter_see_each_others_writes(pair):
    a, b, va = pair
    vb = send_open(a, b, va)
    for i, off in enumerate(OFFSETS):
        assert b.cmd(f"read {vb + off}") == [str(PATTERN + i)]  # copy engine
        assert b.cmd(f"hostread {vb + off}") == [str(PATTERN + i)]  # plain CPU load
    b.cmd(f"write {vb + 4096} 77")
    b.cmd(f"hostwrite {vb + SIZE - 4} 78")
    assert a.cmd(f"read {va + 4096}") == ["77"]
    assert a.cmd(f"hostread {va + SIZE - 4}") == ["78"]
    # the import is one range of exactly the exported bytesize
    assert b.cmd(f"range {vb + 5000}") == [hex(vb), str(SIZE)]
    assert a.cmd(f"range {va + 5000}") == [hex(va), str(SIZE)]
    b.cmd(f"ipcclose {vb}")


def test_second_open_same_va_counts_references(pair):
    a, b, va = pair
    h = a.cmd(f"ipcget {va}")[0]
    assert len(h) == 128  # CU_IPC_HANDLE_SIZE bytes
    assert a.cmd(f"ipcget {va}") == [h]  # the same handle on every call
    v1 = int(b.cmd(f"ipcopen {h} 1")[0], 16)
    v2 = int(b.cmd(f"ipcopen {h} 1")[0], 16)
    v3 = int(b.cmd(f"ipcopen1 {h}")[0], 16)  # the v1 ELF name, same table
    assert v1 == v2 == v3
    b.cmd(f"ipcclose {v1}")
    b.cmd(f"ipcclose {v1}")
    assert b.cmd(f"read {v1}") == [str(PATTERN)]  # one reference left: still mapped
    b.cmd(f"ipcclose {v1}")
    assert b.err(f"ipcclose {v1}") == "CUDA_ERROR_INVALID_VALUE"
    assert b.err(f"read {v1}") == "CUDA_ERROR_INVALID_VALUE"  # unmapped: no device memory
    # opened again after the last close: mapped anew, same bytes
    v4 = int(b.cmd(f"ipcopen {h} 1")[0], 16)
    assert b.cmd(f"read {v4 + 4096}") == [str(PATTERN + 1)]
    b.cmd(f"ipcclose {v4}")


def test_refusals_have_exact_codes(pair, fake_env):
    a, b, va = pair
    h = a.cmd(f"ipcget {va}")[0]
    # opening in the allocating process: "invalid device context"
    assert a.err(f"ipcopen {h} 1") == "CUDA_ERROR_INVALID_CONTEXT"
    # flags must be CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    assert b.err(f"ipcopen {h} 0") == "CUDA_ERROR_INVALID_VALUE"
    assert b.err(f"ipcopen {h} 3") == "CUDA_ERROR_INVALID_VALUE"
    # not a fakecuda handle
    assert b.err(f"ipcopen {'00' * 64} 1") == "CUDA_ERROR_INVALID_HANDLE"
    # cuIpcGetMemHandle takes the base of a cuMemAlloc allocation only
    assert a.err(f"ipcget {va + 4096}") == "CUDA_ERROR_INVALID_VALUE"
    hv = int(a.cmd(f"create {GRAN} 1 0")[0])
    vv = int(a.cmd(f"reserve {GRAN}")[0], 16)
    a.cmd(f"map {vv} {GRAN} {hv}")
    a.cmd(f"access {vv} {GRAN} 0 3")
    assert a.err(f"ipcget {vv}") == "CUDA_ERROR_INVALID_VALUE"
    assert a.err("ipcget 4096") == "CUDA_ERROR_INVALID_VALUE"  # no device memory
    vb = int(b.cmd(f"ipcopen {h} 1")[0], 16)
    assert b.err(f"ipcget {vb}") == "CUDA_ERROR_INVALID_VALUE"  # an import is not re-exported
    assert b.err(f"free {vb}") == "CUDA_ERROR_INVALID_VALUE"  # closed by cuIpcCloseMemHandle
    log = read_log(fake_env)
    assert any(
        f"cuIpcGetMemHandle(0x{va + 4096:x}): not the base of its cuMemAlloc allocation" in l
        for l in log
    )
    assert any(f"cuIpcGetMemHandle(0x{vv:x}): VMM memory" in l for l in log)
    assert any(f"was exported by this process (pid {a.pid})" in l for l in log)
    b.cmd(f"ipcclose {vb}")


def test_exporter_frees_while_imported(pair):
    """cuda.h calls it undefined; fakecuda keeps the bytes for the importer until it closes, and
    the old handle no longer opens."""
    a, b, va = pair
    h = a.cmd(f"ipcget {va}")[0]
    vb = int(b.cmd(f"ipcopen {h} 1")[0], 16)
    a.cmd(f"free {va}")
    assert a.err(f"read {va}") == "CUDA_ERROR_INVALID_VALUE"
    assert b.cmd(f"read {vb + 8192 + 12}") == [str(PATTERN + 2)]
    b.cmd(f"ipcclose {vb}")
    assert b.err(f"ipcopen {h} 1") == "CUDA_ERROR_INVALID_HANDLE"


def test_pointer_attributes(pair, any_peer):
    a, b, va = pair
    h = a.cmd(f"ipcget {va}")[0]
    vb = int(b.cmd(f"ipcopen {h} 1")[0], 16)
    # exporter: a cuMemAlloc buffer
    assert a.cmd(f"attr {MEMORY_TYPE} {va + 100}") == [str(MEMORYTYPE_DEVICE)]
    assert a.cmd(f"attr {DEVICE_POINTER} {va + 100}") == [str(va + 100)]
    assert a.err(f"attr {HOST_POINTER} {va + 100}") == "CUDA_ERROR_INVALID_VALUE"
    assert a.cmd(f"attr {IPC_CAPABLE} {va + 100}") == ["1"]
    assert a.cmd(f"attr {RANGE_START} {va + 100}") == [str(va)]
    assert a.cmd(f"attr {RANGE_SIZE} {va + 100}") == [str(SIZE)]
    assert a.cmd(f"attr {MAPPING_BASE} {va + 100}") == [str(va)]
    assert a.cmd(f"attr {MAPPING_SIZE} {va + 100}") == [str(SIZE)]
    assert a.cmd(f"attr {MAPPED} {va}") == ["1"]
    assert a.cmd(f"attr {IS_MANAGED} {va}") == ["0"]
    assert a.cmd(f"attr {DEVICE_ORDINAL} {va}") == ["0"]
    assert a.cmd(f"attr {HANDLE_TYPES} {va}") == ["0"]
    assert a.cmd(f"attr {ACCESS_FLAGS} {va}") == ["3"]
    assert a.cmd(f"attr {MEMPOOL} {va}") == ["0"]
    assert a.cmd(f"attr {CONTEXT} {va}") != ["0"]
    bid = int(a.cmd(f"attr {BUFFER_ID} {va}")[0])
    va2 = int(a.cmd("malloc 4096")[0], 16)
    assert int(a.cmd(f"attr {BUFFER_ID} {va2}")[0]) > bid  # unique, never reused
    assert a.err(f"attr {P2P_TOKENS} {va}") == "CUDA_ERROR_INVALID_VALUE"  # not modelled
    assert a.err(f"attr 999 {va}") == "CUDA_ERROR_INVALID_VALUE"
    assert a.err(f"attr {MEMORY_TYPE} 4096") == "CUDA_ERROR_INVALID_VALUE"  # no CUDA pointer
    # importer: device memory, not IPC-capable itself, its own range
    assert b.cmd(f"attr {MEMORY_TYPE} {vb}") == [str(MEMORYTYPE_DEVICE)]
    assert b.cmd(f"attr {IPC_CAPABLE} {vb}") == ["0"]
    assert b.cmd(f"attr {RANGE_START} {vb + SIZE - 1}") == [str(vb)]
    assert b.cmd(f"attr {RANGE_SIZE} {vb}") == [str(SIZE)]
    # opened from a context on device 1: the memory still lives on the exporter's device 0, the
    # context is the opener's
    c = any_peer()
    c.cmd("init 1")
    vc = int(c.cmd(f"ipcopen {h} 1")[0], 16)
    assert c.cmd(f"attr {DEVICE_ORDINAL} {vc}") == ["0"]
    assert c.cmd(f"attr {CONTEXT} {vc}") != ["0"]
    assert c.cmd(f"read {vc + 4096}") == [str(PATTERN + 1)]
    c.cmd(f"ipcclose {vc}")
    # cuPointerGetAttributes: CONTEXT!=0, type, devptr, hostptr, managed, ordinal, ipc, start,
    # size, mapped, handle types, mempool; HOST_POINTER of device memory is zero, not an error
    assert a.cmd(f"attrs {va + 8}") == ["1", "0x2", hex(va + 8), "0", "0", "0", "0x1"] + [
        str(va),
        str(SIZE),
        "1",
        "0",
        "0",
    ]
    assert b.cmd(f"attrs {vb}") == ["1", "0x2", hex(vb), "0", "0", "0", "0x0"] + [
        str(vb),
        str(SIZE),
        "1",
        "0",
        "0",
    ]
    # not a CUDA pointer: every value NULL, CUDA_SUCCESS
    assert a.cmd("attrs 4096") == ["0", "0x0", "0x0", "0", "0", "0", "0x0", "0", "0", "0", "0", "0"]
    # VMM: the reservation is the range, the mapping is the mapping, not IPC-capable
    hv = int(a.cmd(f"create {GRAN} 1 1")[0])
    vv = int(a.cmd(f"reserve {4 * GRAN}")[0], 16)
    a.cmd(f"map {vv + GRAN} {GRAN} {hv}")
    assert a.cmd(f"attrs {vv + GRAN + 4}") == ["0", "0x2", "0x0", "0", "0", "1", "0x0"] + [
        str(vv),
        str(4 * GRAN),
        "1",
        "1",
        "0",
    ]
    assert a.cmd(f"attr {ACCESS_FLAGS} {vv + GRAN}") == ["0"]  # no access for device 0 yet
    assert a.err(f"attr {DEVICE_POINTER} {vv + GRAN}") == "CUDA_ERROR_INVALID_VALUE"
    a.cmd(f"access {vv + GRAN} {GRAN} 0 3")
    assert a.cmd(f"attr {ACCESS_FLAGS} {vv + GRAN}") == ["3"]
    assert a.cmd(f"attr {DEVICE_POINTER} {vv + GRAN}") == [str(vv + GRAN)]
    assert a.cmd(f"attr {MAPPING_BASE} {vv + GRAN + 4}") == [str(vv + GRAN)]
    assert a.cmd(f"attr {MAPPING_SIZE} {vv + GRAN + 4}") == [str(GRAN)]
    assert a.cmd(f"attr {DEVICE_ORDINAL} {vv + GRAN}") == ["1"]
    assert a.cmd(f"attr {HANDLE_TYPES} {vv + GRAN}") == ["1"]
    assert a.err(f"attr {CONTEXT} {vv + GRAN}") == "CUDA_ERROR_INVALID_VALUE"
    assert int(a.cmd(f"attr {BLOCK_ID} {vv + GRAN}")[0]) > 0
    # reserved but unmapped: only the range and MAPPED = 0
    assert a.cmd(f"attr {MAPPED} {vv}") == ["0"]
    assert a.cmd(f"attr {RANGE_START} {vv + 3 * GRAN}") == [str(vv)]
    assert a.err(f"attr {MEMORY_TYPE} {vv}") == "CUDA_ERROR_INVALID_VALUE"
    b.cmd(f"ipcclose {vb}")


def lock_checkpoint(ctl, pid):
    ctl.cmd(f"lock {pid} 0")
    return ctl.err(f"checkpoint {pid}")


def test_native_checkpoint_refused_with_a_live_import(pair, peer, fake_env):
    a, b, va = pair
    ctl = peer()
    ctl.cmd("init 0")
    vb = send_open(a, b, va)
    # the importer holds a live import
    assert lock_checkpoint(ctl, b.pid) == "CUDA_ERROR_NOT_SUPPORTED"
    assert ctl.cmd(f"state {b.pid}") == ["1"]  # LOCKED: nothing changed
    ctl.cmd(f"unlock {b.pid}")
    # the exporter's buffer is open in another process
    assert lock_checkpoint(ctl, a.pid) == "CUDA_ERROR_NOT_SUPPORTED"
    assert ctl.cmd(f"state {a.pid}") == ["1"]
    ctl.cmd(f"unlock {a.pid}")
    # memory intact and still shared
    b.cmd(f"write {vb} 4242")
    assert a.cmd(f"read {va}") == ["4242"]
    log = read_log(fake_env)
    assert any(
        f"checkpoint refused: pid {b.pid} holds 1 live CUDA IPC import(s) (0x{vb:x}, {SIZE} bytes, "
        f"buffer of pid {a.pid}, 1 reference(s))" in l
        for l in log
    )
    assert any(
        f"checkpoint refused: 1 cuMemAlloc buffer(s) of pid {a.pid} are open in other processes "
        f"through CUDA IPC (0x{va:x}, {SIZE} bytes, opened by pid {b.pid})" in l
        for l in log
    )
    # after the close both checkpoint and restore; the exporter keeps its bytes at its VA
    old_handle = a.cmd(f"ipcget {va}")[0]
    b.cmd(f"ipcclose {vb}")
    for pid in (a.pid, b.pid):
        ctl.cmd(f"lock {pid} 0")
        ctl.cmd(f"checkpoint {pid}")
        ctl.cmd(f"restore {pid}")
        ctl.cmd(f"unlock {pid}")
    assert a.cmd(f"read {va}") == ["4242"]
    assert a.cmd(f"read {va + 4096}") == [str(PATTERN + 1)]
    # the buffer has a new memfd: the old handle is stale, a new one shares it again
    assert b.err(f"ipcopen {old_handle} 1") == "CUDA_ERROR_INVALID_HANDLE"
    assert a.cmd(f"ipcget {va}") != [old_handle]
    vb2 = send_open(a, b, va)
    assert b.cmd(f"read {vb2 + 4096}") == [str(PATTERN + 1)]
    b.cmd(f"ipcclose {vb2}")


def test_an_exited_importer_does_not_block_the_exporter(pair, peer):
    a, b, va = pair
    ctl = peer()
    ctl.cmd("init 0")
    send_open(a, b, va)
    b.proc.kill()  # exits holding the import (its slot stays written)
    b.proc.wait()
    ctl.cmd(f"lock {a.pid} 0")
    ctl.cmd(f"checkpoint {a.pid}")
    ctl.cmd(f"restore {a.pid}")
    ctl.cmd(f"unlock {a.pid}")
    assert a.cmd(f"read {va + SIZE - 4}") == [str(PATTERN + 3)]


def test_launch_job_mode_checkpoints_private_copies(peer, fake_env):
    env = dict(fake_env, FAKECUDA_LAUNCH_JOB="1")
    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a = peer(sa.fileno(), env=env)
    b = peer(sb.fileno(), env=env)
    sa.close()
    sb.close()
    ctl = peer()
    for p in (a, b, ctl):
        p.cmd("init 0")
    va = int(a.cmd(f"malloc {SIZE}")[0], 16)
    a.cmd(f"write {va + 4096} 11")
    vb = send_open(a, b, va)
    for pid in (a.pid, b.pid):
        ctl.cmd(f"lock {pid} 0")
        ctl.cmd(f"checkpoint {pid}")
    # checkpointed: nothing CRIU could carry as sharing, both ranges bare reservations
    for pid, v in ((a.pid, va), (b.pid, vb)):
        maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
        assert "memfd:fakecuda-" not in maps
        fds = [os.readlink(f"/proc/{pid}/fd/{f}") for f in os.listdir(f"/proc/{pid}/fd")]
        assert not [f for f in fds if "memfd:fakecuda-" in f]
        assert perms_at(maps, v) == "---p"
    for pid in (a.pid, b.pid):
        ctl.cmd(f"restore {pid}")
        ctl.cmd(f"unlock {pid}")
    # same bytes at the same VAs on both sides, but each holds a private copy now
    assert a.cmd(f"read {va + 4096}") == ["11"]
    assert b.cmd(f"read {vb + 4096}") == ["11"]
    b.cmd(f"write {vb + 4096} 12")
    assert a.cmd(f"read {va + 4096}") == ["11"]
    assert perms_at(pathlib.Path(f"/proc/{b.pid}/maps").read_text(), vb) == "rw-p"  # private
    # a new handle of the restored buffer is a new import, shared again; the old copy stays
    vb2 = send_open(a, b, va)
    assert vb2 != vb
    b.cmd(f"write {vb2 + 4096} 13")
    assert a.cmd(f"read {va + 4096}") == ["13"]
    assert b.cmd(f"read {vb + 4096}") == ["12"]
    b.cmd(f"ipcclose {vb2}")
    b.cmd(f"ipcclose {vb}")
    assert b.err(f"read {vb}") == "CUDA_ERROR_INVALID_VALUE"


def perms_at(maps: str, va: int) -> str | None:
    for line in maps.splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= va < hi:
            return line.split()[1]
    return None


@pytest.mark.parametrize(
    "name,version,status,elf",
    [
        ("cuIpcGetMemHandle", 4010, "0", "cuIpcGetMemHandle"),
        ("cuIpcGetMemHandle", 4000, "2", "NULL"),
        ("cuIpcOpenMemHandle", 4010, "0", "cuIpcOpenMemHandle"),
        ("cuIpcOpenMemHandle", 10020, "0", "cuIpcOpenMemHandle"),
        ("cuIpcOpenMemHandle", 11000, "0", "cuIpcOpenMemHandle_v2"),
        ("cuIpcOpenMemHandle", 13010, "0", "cuIpcOpenMemHandle_v2"),
        ("cuIpcCloseMemHandle", 4010, "0", "cuIpcCloseMemHandle"),
        ("cuPointerGetAttribute", 4000, "0", "cuPointerGetAttribute"),
        ("cuPointerGetAttributes", 7000, "0", "cuPointerGetAttributes"),
        ("cuPointerGetAttributes", 6050, "2", "NULL"),
        ("cuMemGetAddressRange", 3020, "0", "cuMemGetAddressRange_v2"),
        ("cuMemAlloc", 3020, "0", "cuMemAlloc_v2"),
        ("cuMemFree", 3020, "0", "cuMemFree_v2"),
        ("cuIpcGetEventHandle", 4010, "0", "cuIpcGetEventHandle"),  # event.c (issue 24)
        ("cuIpcGetEventHandle", 4000, "2", "NULL"),  # VERSION_NOT_SUFFICIENT
    ],
)
def test_lookups(peer, name, version, status, elf):
    a = peer()
    assert a.cmd(f"lookup {name} {version}") == [status, elf]
