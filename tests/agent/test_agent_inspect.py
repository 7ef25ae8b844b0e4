"""`inspect --pid` against the coordinator's mock shim (tests/coordinator/mockshim.py)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "coordinator"))
from mockshim import MockShim  # noqa: E402

from cuinterpose.agent.errors import AgentError  # noqa: E402
from cuinterpose.agent.inspect import inspect_pid  # noqa: E402
from cuinterpose.coordinator.protocol import Phase, Record, RecordKind, Role  # noqa: E402


def records():
    return [
        Record(
            kind=RecordKind.ALLOCATION,
            role=Role.CREATOR,
            alloc_id=b"\x11" * 16,
            creator_pid=4001,
            handle_refs=1,
            size=2 << 20,
            prop_type=1,
            prop_location_type=1,
            prop_handle_types=1,
            flags=3,
        ),
        Record(
            kind=RecordKind.MAPPING,
            role=Role.CREATOR,
            alloc_id=b"\x11" * 16,
            creator_pid=4001,
            size=2 << 20,
            va=0x7F0000000000,
        ),
        Record(
            kind=RecordKind.ALLOCATION,
            role=Role.IMPORTER,
            alloc_id=b"\x22" * 16,
            creator_pid=4002,
            handle_refs=1,
            size=2 << 20,
            prop_type=1,
            prop_location_type=1,
            prop_handle_types=1,
            flags=2,
        ),
    ]


@pytest.mark.parametrize("phase", [Phase.ACTIVE, Phase.PREPARED])
def test_inspect_any_phase(tmp_path, phase):
    m = MockShim(pid=4001, control_dir=str(tmp_path), records=records(), phase=phase)
    try:
        res = inspect_pid(4001, control_dir=tmp_path, timeout_s=5)
    finally:
        m.stop()
    assert res["pid"] == 4001 and res["phase"] == phase.name
    assert res["socket_path"] == str(tmp_path / "cuinterpose-4001.sock")
    assert res["roles"] == {"private": 0, "creator": 1, "importer": 1}
    assert [(r["kind"], r["role"], r["alloc_id"], r["va"]) for r in res["records"]] == [
        ("ALLOCATION", "CREATOR", "11" * 16, 0),
        ("MAPPING", "CREATOR", "11" * 16, 0x7F0000000000),
        ("ALLOCATION", "IMPORTER", "22" * 16, 0),
    ]


def test_inspect_without_socket_names_pid(tmp_path):
    import os

    with pytest.raises(AgentError) as ei:
        inspect_pid(os.getpid(), control_dir=tmp_path)  # alive, no socket
    assert ei.value.pid == os.getpid() and "no control socket" in ei.value.reason
