"""Host-located VMM on fakecuda (cuMemCreate with CU_MEM_LOCATION_TYPE_HOST / _HOST_NUMA, as
NCCL's SHM transport uses it from driver 12.6): the creation rules cuda.h states, access for a
device and for the host location, CPU loads and stores through the mapping VA, and the memory
shared between two processes as a POSIX FD (bytes written by either seen by the other)."""

from __future__ import annotations

import socket

from fakecuda_helpers import GRAN

# cuda.h CUmemLocationType
DEVICE, HOST, HOST_NUMA, HOST_NUMA_CURRENT = 1, 2, 3, 4
HOST_NUMA_VMM_SUPPORTED, HOST_VMM_SUPPORTED = 141, 145
MEMORY_TYPE, HOST_POINTER, DEVICE_ORDINAL, RANGE_SIZE, HANDLE_TYPES = 2, 4, 9, 12, 14


def test_creation_rules(peer):
    a = peer()
    a.cmd("init 0")
    assert a.cmd(f"devattr {HOST_NUMA_VMM_SUPPORTED} 0") == ["1"]
    assert a.cmd(f"devattr {HOST_VMM_SUPPORTED} 0") == ["1"]
    # HOST: "not IPC capable": requestedHandleTypes must be 0; the id is ignored
    assert a.err(f"hcreate {GRAN} {HOST} 0 1") == "CUDA_ERROR_INVALID_VALUE"
    h = int(a.cmd(f"hcreate {GRAN} {HOST} 12345 0")[0])
    assert a.cmd(f"lprops {h}") == ["1", str(HOST), "12345", "0"]
    # HOST_NUMA: a NUMA node (0 on every machine); POSIX FD allowed
    assert a.err(f"hcreate {GRAN} {HOST_NUMA} 99999 1") == "CUDA_ERROR_INVALID_VALUE"
    # HOST_NUMA_CURRENT "will result in CUDA_ERROR_INVALID_VALUE"
    assert a.err(f"hcreate {GRAN} {HOST_NUMA_CURRENT} 0 1") == "CUDA_ERROR_INVALID_VALUE"
    assert a.err(f"hcreate {GRAN // 2} {HOST_NUMA} 0 1") == "CUDA_ERROR_INVALID_VALUE"
    hn = int(a.cmd(f"hcreate {GRAN} {HOST_NUMA} 0 1")[0])
    assert a.cmd(f"lprops {hn}") == ["1", str(HOST_NUMA), "0", "1"]
    a.cmd(f"release {h}")
    a.cmd(f"release {hn}")


def test_access_and_cpu_through_the_mapping(peer):
    a = peer()
    a.cmd("init 0")
    h = int(a.cmd(f"hcreate {2 * GRAN} {HOST_NUMA} 0 1")[0])
    va = int(a.cmd(f"reserve {2 * GRAN}")[0], 16)
    a.cmd(f"map {va} {2 * GRAN} {h}")
    # a host location is refused for device memory ...
    hd = int(a.cmd(f"create {GRAN} 1 0")[0])
    vd = int(a.cmd(f"reserve {GRAN}")[0], 16)
    a.cmd(f"map {vd} {GRAN} {hd}")
    assert a.err(f"laccess {vd} {GRAN} {HOST_NUMA} 0 3") == "CUDA_ERROR_INVALID_VALUE"
    assert a.err(f"laccess {vd} {GRAN} {HOST} 0 3") == "CUDA_ERROR_INVALID_VALUE"
    assert a.err(f"laccess {va} {GRAN} {HOST_NUMA_CURRENT} 0 3") == "CUDA_ERROR_INVALID_VALUE"
    # ... and granted per location on host memory (the HOST_NUMA id is ignored)
    a.cmd(f"laccess {va} {2 * GRAN} {HOST_NUMA} 7 3")
    assert a.cmd(f"lgetaccess {va} {HOST_NUMA} 0") == ["3"]
    assert a.cmd(f"lgetaccess {va + GRAN} {HOST} 0") == ["3"]
    assert a.cmd(f"lgetaccess {va} {DEVICE} 0") == ["0"]  # the device has none yet
    a.cmd(f"hostwrite {va + 64} 1234")  # a plain CPU store through the mapping VA
    assert a.cmd(f"hostread {va + 64}") == ["1234"]
    assert a.err(f"read {va + 64}") == "CUDA_ERROR_ILLEGAL_ADDRESS"  # the copy engine: device 0
    a.cmd(f"laccess {va} {2 * GRAN} {DEVICE} 0 1")
    assert a.cmd(f"read {va + 64}") == ["1234"]
    assert a.err(f"write {va + 64} 5") == "CUDA_ERROR_ILLEGAL_ADDRESS"  # read-only for device 0
    # pointer attributes: host memory, the host pointer is the VA
    assert a.cmd(f"attr {MEMORY_TYPE} {va + 64}") == ["1"]
    assert a.cmd(f"attr {HOST_POINTER} {va + 64}") == [str(va + 64)]
    assert a.err(f"attr {DEVICE_ORDINAL} {va}") == "CUDA_ERROR_INVALID_VALUE"
    assert a.cmd(f"attr {HANDLE_TYPES} {va}") == ["1"]
    assert a.cmd(f"attr {RANGE_SIZE} {va}") == [str(2 * GRAN)]


def test_shared_as_a_posix_fd_between_two_processes(any_peer, peer):
    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a, b = any_peer(sa.fileno()), any_peer(sb.fileno())
    sa.close()
    sb.close()
    a.cmd("init 0")
    b.cmd("init 0")
    size = 2 * GRAN
    h_a = int(a.cmd(f"hcreate {size} {HOST_NUMA} 0 1")[0])
    va_a = int(a.cmd(f"reserve {size}")[0], 16)
    a.cmd(f"map {va_a} {size} {h_a}")
    a.cmd(f"laccess {va_a} {size} {HOST_NUMA} 0 3")
    a.cmd(f"laccess {va_a} {size} {DEVICE} 0 3")
    a.cmd(f"hostwrite {va_a + GRAN + 8} 4321")
    fd = int(a.cmd(f"export {h_a}")[0])
    a.cmd(f"sendfd {fd}")
    a.cmd(f"close {fd}")
    rfd = int(b.cmd("recvfd")[0])
    h_b = int(b.cmd(f"import {rfd}")[0])
    b.cmd(f"close {rfd}")
    # the creator's properties, without requested handle types: an import (as on R580)
    assert b.cmd(f"lprops {h_b}") == ["1", str(HOST_NUMA), "0", "0"]
    va_b = int(b.cmd(f"reserve {size}")[0], 16)
    b.cmd(f"map {va_b} {size} {h_b}")
    b.cmd(f"laccess {va_b} {size} {HOST} 0 3")
    assert b.cmd(f"hostread {va_b + GRAN + 8}") == ["4321"]
    b.cmd(f"hostwrite {va_b + 16} 99")
    assert a.cmd(f"hostread {va_a + 16}") == ["99"]
    b.cmd(f"laccess {va_b} {size} {DEVICE} 0 3")
    b.cmd(f"write {va_b + 20} 100")  # through the copy engine, seen by the other CPU
    assert a.cmd(f"hostread {va_a + 20}") == ["100"]
    # native checkpoint carries host-located memory like device memory (after the teardown of
    # the sharing: no export fd is open)
    ctl = peer()
    ctl.cmd("init 0")
    for pid in (a.pid, b.pid):
        ctl.cmd(f"lock {pid} 0")
        ctl.cmd(f"checkpoint {pid}")
        ctl.cmd(f"restore {pid}")
        ctl.cmd(f"unlock {pid}")
    assert a.cmd(f"hostread {va_a + GRAN + 8}") == ["4321"]
    assert b.cmd(f"hostread {va_b + 20}") == ["100"]
    b.cmd(f"hostwrite {va_b + 16} 7")  # private copies now, as on the real driver
    assert a.cmd(f"hostread {va_a + 16}") == ["99"]
