"""The recording world of the agent's ordering tests: a fake driver, census, coordinator and
CRIU that log every call (``World.log``), and the ``world`` fixture (re-exported by conftest.py)."""

from __future__ import annotations

import json
import pathlib
import signal
import sys
import types

import pytest

import cuinterpose.agent.mech as mech_pkg
from cuinterpose.agent.errors import NativeError
from cuinterpose.agent.mech import census as census_mod
from cuinterpose.agent.mech import native, quiesce
from cuinterpose.agent.run import checkpoint as cp_mod
from cuinterpose.coordinator.contract import quiesce_path, write_atomic

PIDS = [201, 202]
ROOT = 200
# the quiescence check: every CUDA process locked, then unlocked, before any teardown
PROBE = [
    ("native", "lock", 201),
    ("native", "lock", 202),
    ("native", "unlock", 201),
    ("native", "unlock", 202),
]


class World:
    """Records every call in ``log`` as (who, what, pid or None)."""

    def __init__(self, ctl, fail=None):
        self.log = []
        self.ctl = ctl
        self.fail = fail or {}
        self.state = {p: "RUNNING" for p in PIDS}
        self.coord_phase = "ACTIVE"
        self.capture_obj = None
        self.stopped = set()
        self.captured = False  # the coordinator's capture() was called (teardown may start)

    def maybe_fail(self, key, pid=None):
        """Fail ``key`` for ``pid``; a lock before the capture is the quiescence check's,
        failed by the key "probe_lock"."""
        match = "probe_lock" if key == "lock" and not self.captured else key
        if self.fail.get(match) == pid:
            raise NativeError(key, pid, "CUDA_ERROR_INVALID_VALUE")


@pytest.fixture
def world(tmp_path, monkeypatch):
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    w = World(ctl)
    monkeypatch.setattr(native, "load", lambda kind=None: native.DriverInfo("fake", 13000, "/fake"))

    def nat(action, frm, to):
        def fn(pid, *a):
            w.log.append(("native", action, pid))
            w.maybe_fail(action, pid)
            assert w.state[pid] == frm, (pid, action, w.state[pid])
            w.state[pid] = to

        return fn

    monkeypatch.setattr(native, "lock", nat("lock", "RUNNING", "LOCKED"))
    monkeypatch.setattr(native, "checkpoint", nat("checkpoint", "LOCKED", "CHECKPOINTED"))
    monkeypatch.setattr(native, "restore", nat("restore", "CHECKPOINTED", "LOCKED"))
    monkeypatch.setattr(native, "unlock", nat("unlock", "LOCKED", "RUNNING"))
    monkeypatch.setattr(native, "get_state", lambda pid: w.state[pid])

    shim = census_mod.ShimFile("/x/libcuinterpose.so", "ab" * 32, 1, 2, 3)
    procs = [census_mod.Process(ROOT, 1, "launcher", shim="installed")] + [
        census_mod.Process(
            p,
            ROOT,
            "rank",
            shim="installed",
            socket_path=str(ctl / f"cuinterpose-{p}.sock"),
            cuda_state="RUNNING",
        )
        for p in PIDS
    ]

    def fake_census(roots, **kw):
        return census_mod.Census(
            roots=list(roots), processes=procs, shim=shim, control_dir=str(ctl)
        )

    monkeypatch.setattr(census_mod, "take_census", fake_census)
    # the fake pids may be real processes of this machine: their open files are not ours
    monkeypatch.setattr(census_mod, "open_file_warnings", lambda census: [])

    class Capture:
        def to_dict(self):
            return {"participants": [{"pid": p, "records": []} for p in PIDS]}

    class Coordinator:
        def __init__(self, parts, timeout_s, on_event=None, carrier_timeout_s=None):
            w.log.append(("coord", "init", tuple(p.pid for p in parts)))
            w.timeouts = (timeout_s, carrier_timeout_s)

        phases = []

        def inspect(self, expected_phase=0, check_phase=False):
            w.log.append(("coord", "inspect", int(expected_phase)))
            if int(expected_phase) != {"ACTIVE": 0, "PREPARED": 3}[w.coord_phase]:
                raise RuntimeError(f"INSPECT: pid 201 is in phase {w.coord_phase}")

        last_txn_id = 0

        def validate(self, records_by_pid=None):
            """What the real capture validates first (its first INSPECT): no records here."""
            return {p: [] for p in PIDS}

        def capture(self):
            self.validate()  # the real capture's first INSPECT (the .lock records it)
            self.last_txn_id = 7
            w.captured = True
            w.coord_phase = "PREPARED"
            w.log.append(("coord", "capture", None))
            w.capture_obj = Capture()
            return w.capture_obj

        def restore(self, capture):
            assert isinstance(capture, Capture)
            w.log.append(("coord", "restore", None))
            w.coord_phase = "ACTIVE"

        def rollback(self, capture):
            assert capture is w.capture_obj, capture
            w.log.append(("coord", "rollback", None))
            if w.coord_phase == "FAILED":
                raise FakePhaseError(
                    "rollback: pid 201 is FAILED (a destructive op failed part-way); "
                    "it cannot be brought back to ACTIVE; nothing was rolled back "
                    "(fail-stop)",
                    "rollback",
                    201,
                    changed=True,
                )
            found = {p: w.coord_phase for p in PIDS}
            w.coord_phase = "ACTIVE"
            return types.SimpleNamespace(found=found)

    fake_phases = types.SimpleNamespace(
        Participant=lambda pid, sock: types.SimpleNamespace(pid=pid, socket_path=sock),
        Coordinator=Coordinator,
    )
    monkeypatch.setattr(cp_mod, "_coordinator_module", lambda: fake_phases)

    def dump(root, d, leave_running=False, extra_args=(), deleted_files=(), timeout_s=None):
        assert (leave_running, tuple(extra_args)) == (False, ("--leave-stopped",))
        assert timeout_s == 3600.0  # the run's criu_timeout_s
        w.log.append(("criu", "dump", root))
        if w.fail.get("dump") == root:
            raise RuntimeError("criu dump failed: (00.1) Error (criu/sk-unix.c): external socket")
        (d / "core.img").write_bytes(b"x")
        w.stopped.add(root)

    fake_criu = types.SimpleNamespace(dump=dump, version=lambda: "4.1")
    monkeypatch.setitem(sys.modules, "cuinterpose.agent.mech.criu", fake_criu)
    monkeypatch.setattr(mech_pkg, "criu", fake_criu, raising=False)

    # signals go to the recorded fake trees, never to real processes
    def kill(pid, sig):
        w.log.append(("signal", signal.Signals(sig).name, pid))
        if sig == signal.SIGCONT:
            w.stopped.discard(pid)

    monkeypatch.setattr(cp_mod, "_kill", kill)
    monkeypatch.setattr(cp_mod, "_tree_pids", lambda root: [root])
    # the fake trees are alive, and each dump's process tree image holds its root (case 010:
    # checked before the manifest; tests/cases/test_case_010.py checks it on real CRIU)
    from cuinterpose.agent.mech import criu_images

    monkeypatch.setattr(cp_mod, "_alive", lambda pid: True)
    monkeypatch.setattr(criu_images, "image_pids", lambda d: [int(pathlib.Path(d).name)])
    return w


def answer_quiesce(w):
    """A workload that answers the request as soon as it is written."""
    orig = quiesce.request

    def request(ctl, roots, qid, timeout_ms):
        orig(ctl, roots, qid, timeout_ms)
        for r in roots:
            write_atomic(
                quiesce_path(ctl, r, "ready"), {"id": qid, "ranks": [{"pid": p} for p in PIDS]}
            )
        w.log.append(("workload", "ready", None))

    return request


def resume_of(w):
    return json.loads((w.ctl / f"quiesce-{ROOT}.resume").read_text())


class FakePhaseError(Exception):
    def __init__(self, text, phase, pid, changed, capture=None):
        super().__init__(text)
        self.phase, self.pid, self.changed, self.capture = phase, pid, changed, capture


# -- a dead agent's checkpoint, for agent/run/recover.py ----------------------------------------
def mockshim_module():
    """tests/coordinator/mockshim.py (shims that answer the protocol from a record list)."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parent.parent / "coordinator" / "mockshim.py"
    spec = importlib.util.spec_from_file_location("cuinterpose_test_mockshim", path)
    mod = sys.modules.get(spec.name)
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def creator_importer_records() -> dict:
    """201 creates allocation A (2 MiB, exported) and maps it; 202 imports and maps it."""
    from cuinterpose.coordinator.protocol import Record, RecordFlag, RecordKind, Role

    aid, shared = bytes(range(16)), RecordFlag.SHARED
    alloc = dict(alloc_id=aid, creator_pid=201, size=2 << 20)
    props = dict(handle_refs=1, prop_type=1, prop_location_type=1, prop_handle_types=1)
    return {
        201: [
            Record(
                RecordKind.ALLOCATION, Role.CREATOR, shared | RecordFlag.EXPORTED, **alloc, **props
            ),
            Record(RecordKind.MAPPING, Role.CREATOR, shared, **alloc, va=0x7F0000000000),
        ],
        202: [
            Record(RecordKind.ALLOCATION, Role.IMPORTER, shared, **alloc, **props),
            Record(RecordKind.MAPPING, Role.IMPORTER, shared, **alloc, va=0x7F0000400000),
        ],
    }


def creator_chunk_files(images_dir) -> list:
    """The chunk file a finished SAVE_ALLOCATIONS of :func:`creator_importer_records` left in
    ``images_dir`` (``chunks/shared-201-<alloc_id>.bin``, 2 MiB, sparse: all zero): what a
    release's rollback hands the creator's LOAD_ALLOCATIONS. Returns the paths."""
    import pathlib

    d = pathlib.Path(images_dir) / "chunks"
    d.mkdir(parents=True, exist_ok=True)
    f = d / f"shared-201-{bytes(range(16)).hex()}.bin"
    with open(f, "wb") as out:
        out.truncate(2 << 20)
    return [f]


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def dead_agent_lock(ctl, root: int, qid: str, **fields) -> dict:
    """The pending ``.request`` of ``root`` and the ``.lock`` an agent left when it died
    (``fields``: the record, steps, ...). Returns the lock."""
    write_atomic(quiesce_path(ctl, root, "request"), {"id": qid, "timeout_ms": 1000})
    lk = {"id": qid, "pid": dead_pid(), "starttime": 1, "torn_down": False, **fields}
    write_atomic(quiesce_path(ctl, root, "lock"), lk)
    return lk
