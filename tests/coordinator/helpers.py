"""Record builders and a mock-shim group for the coordinator tests."""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading

from cuinterpose.coordinator.carrierfiles import CarrierFiles, carried_streams
from cuinterpose.coordinator.phases import Participant
from cuinterpose.coordinator.protocol import Access, Op, Record, RecordFlag, RecordKind, Role

from .mockshim import EventLog, MockShim

MiB = 1 << 20
A = bytes.fromhex("9f3c" + "11" * 14)  # created by 4119, imported by 4121 and 4123
B = bytes.fromhex("b7e2" + "22" * 14)  # created by 4121, imported by 4119
P = bytes.fromhex("0a0b" + "33" * 14)  # private to 4123
BASE = 0x7F0000000000


def alloc(aid, role, creator, *, size=2 * MiB, refs=1, flags=None, handle_types=1):
    if flags is None:
        flags = (
            0
            if role == Role.PRIVATE
            else RecordFlag.SHARED | (RecordFlag.EXPORTED if role == Role.CREATOR else 0)
        )
    return Record(
        kind=RecordKind.ALLOCATION,
        role=role,
        flags=flags,
        alloc_id=aid,
        creator_pid=creator,
        handle_refs=refs,
        size=size,
        prop_type=1,
        prop_location_type=1,
        prop_location_id=0,
        prop_handle_types=handle_types,
    )


def mapping(aid, role, creator, va, *, size=2 * MiB, offset=0, flags=None):
    if flags is None:
        flags = 0 if role == Role.PRIVATE else RecordFlag.SHARED
    return Record(
        kind=RecordKind.MAPPING,
        role=role,
        flags=flags,
        alloc_id=aid,
        creator_pid=creator,
        size=size,
        va=va,
        offset=offset,
        access=(Access(1, 0, 3), Access(1, 1, 3)),
    )


def reservation(va, size):
    return Record(kind=RecordKind.RESERVATION, size=size, va=va, offset=2 * MiB)


def group_records():
    """Three processes: 4119 creates A and imports B, 4121 creates B and imports A,
    4123 imports A and holds a private allocation P."""
    C, I, X = Role.CREATOR, Role.IMPORTER, Role.PRIVATE
    return {
        4119: [
            reservation(BASE, 8 * MiB),
            alloc(A, C, 4119),
            mapping(A, C, 4119, BASE),
            alloc(B, I, 4121, size=4 * MiB),
            mapping(B, I, 4121, BASE + 2 * MiB, size=4 * MiB),
        ],
        4121: [
            reservation(BASE, 8 * MiB),
            alloc(B, C, 4121, size=4 * MiB),
            mapping(B, C, 4121, BASE, size=4 * MiB),
            alloc(A, I, 4119),
            mapping(A, I, 4119, BASE + 4 * MiB),
        ],
        4123: [
            alloc(A, I, 4119, refs=0),
            mapping(A, I, 4119, BASE + 6 * MiB, offset=MiB, size=MiB),
            alloc(P, X, 4123, handle_types=0),
            mapping(P, X, 4123, BASE + 8 * MiB),
        ],
    }


class Group:
    """Mocks for group_records() sharing one EventLog."""

    def __init__(self, ctl, records=None, **knobs):
        self.ctl = pathlib.Path(ctl)
        self.log = EventLog()
        records = records if records is not None else group_records()
        self.mocks = {
            pid: MockShim(
                pid,
                str(ctl),
                records=list(rs),
                log=self.log,
                bytes_per_op={
                    Op.SAVE_ALLOCATIONS: 2 * MiB * (i + 1),
                    Op.LOAD_ALLOCATIONS: 2 * MiB * (i + 1),
                },
                **knobs,
            )
            for i, (pid, rs) in enumerate(sorted(records.items()))
        }
        self.participants = [Participant(pid, m.path) for pid, m in sorted(self.mocks.items())]

    def gate(self, *ops):
        for op in ops:
            b = threading.Barrier(len(self.mocks))
            for m in self.mocks.values():
                m.gate[op] = b

    def chunk_files(self) -> CarrierFiles:
        """Chunk files (empty: the mocks carry no bytes) for every creator allocation of every
        mock, as a capture would have left them, for a rollback or restore from records."""
        files = CarrierFiles(self.ctl.parent / "chunks")
        os.makedirs(files.directory, exist_ok=True)
        for pid, m in self.mocks.items():
            for aid, _ in carried_streams(m.records):
                open(files.path(pid, aid), "ab").close()
        return files

    def ops_received(self, pid=None):
        return [(e.pid, Op(e.op).name) for e in self.log.of("recv", pid=pid)]

    def stop(self):
        for m in self.mocks.values():
            m.stop()


@contextlib.contextmanager
def group(ctl, **kw):
    g = Group(ctl, **kw)
    try:
        yield g
    finally:
        g.stop()
