"""Census on synthetic trees of real processes (no CUDA needed: get_state is a stub)."""
from __future__ import annotations

import shutil

import pytest

from cuinterpose.agent import census
from cuinterpose.agent.errors import CensusError, NativeError


@pytest.fixture
def shim(tmp_path):
    """A stand-in shim file: any bytes, named libcuinterpose.so."""
    d = tmp_path / "lib"
    d.mkdir()
    p = d / "libcuinterpose.so"
    p.write_bytes(b"\x7fELF-not-really" * 512)
    return p


@pytest.fixture
def ctl(tmp_path):
    d = tmp_path / "ctl"
    d.mkdir()
    return d


def states(cuda: dict):
    def get_state(pid):
        if pid in cuda:
            return cuda[pid]
        raise NativeError("get_state", pid, "CUDA_ERROR_NOT_INITIALIZED")
    return get_state


def test_participants_and_tree_order(spawn_tree, shim, ctl):
    n = spawn_tree({"name": "root", "map": str(shim), "children": [
        {"name": "a", "map": str(shim), "sock": str(ctl)},
        {"name": "b", "map": str(shim), "sock": str(ctl), "children": [{"name": "helper"}]}]})
    c = census.take_census([n["root"]], control_dir=ctl, shim_path=shim,
                           get_state=states({n["a"]: "RUNNING", n["b"]: "RUNNING"}))
    assert [p.pid for p in c.participants] == sorted([n["a"], n["b"]])
    assert c.cuda_pids == sorted([n["a"], n["b"]])
    assert c.processes[0].pid == n["root"]
    assert {p.pid for p in c.processes} == set(n.values())
    by = {p.pid: p for p in c.processes}
    assert by[n["root"]].shim == "installed" and by[n["root"]].socket_path is None
    assert by[n["helper"]].shim is None
    assert by[n["a"]].socket_path == str(ctl.resolve() / f"cuinterpose-{n['a']}.sock")
    assert c.shim.sha256 == census.sha256_file(shim)
    assert c.shim.size == shim.stat().st_size


def test_cuda_process_without_shim_is_refused(spawn_tree, shim, ctl):
    n = spawn_tree({"name": "root", "children": [
        {"name": "a", "map": str(shim), "sock": str(ctl)}, {"name": "rogue"}]})
    with pytest.raises(CensusError) as ei:
        census.take_census([n["root"]], control_dir=ctl, shim_path=shim,
                           get_state=states({n["a"]: "RUNNING", n["rogue"]: "RUNNING"}))
    assert ei.value.pid == n["rogue"]
    assert f"pid {n['rogue']}" in str(ei.value) and "without the shim" in str(ei.value)


def test_cuda_process_without_socket_is_refused(spawn_tree, shim, ctl):
    n = spawn_tree({"name": "root", "children": [{"name": "a", "map": str(shim)}]})
    with pytest.raises(CensusError) as ei:
        census.take_census([n["root"]], control_dir=ctl, shim_path=shim,
                           get_state=states({n["a"]: "RUNNING"}))
    assert ei.value.pid == n["a"] and "no control socket" in ei.value.reason


def test_foreign_shim_build_is_refused(spawn_tree, shim, ctl, tmp_path):
    other = tmp_path / "other" / "libcuinterpose.so"
    other.parent.mkdir()
    shutil.copy(shim, other)  # same bytes, another inode: not the installed shim
    n = spawn_tree({"name": "root", "children": [
        {"name": "a", "map": str(shim), "sock": str(ctl)},
        {"name": "b", "map": str(other), "sock": str(ctl)}]})
    with pytest.raises(CensusError) as ei:
        census.take_census([n["root"]], control_dir=ctl, shim_path=shim,
                           get_state=states({n["a"]: "RUNNING", n["b"]: "RUNNING"}))
    assert ei.value.pid == n["b"] and str(other) in ei.value.reason


def test_socket_without_driver_state_is_refused(spawn_tree, shim, ctl):
    n = spawn_tree({"name": "root", "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}]})
    with pytest.raises(CensusError) as ei:
        census.take_census([n["root"]], control_dir=ctl, shim_path=shim, get_state=states({}))
    assert ei.value.pid == n["a"] and "CUDA_ERROR_NOT_INITIALIZED" in ei.value.reason


def test_locked_process_is_refused(spawn_tree, shim, ctl):
    n = spawn_tree({"name": "root", "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}]})
    with pytest.raises(CensusError) as ei:
        census.take_census([n["root"]], control_dir=ctl, shim_path=shim,
                           get_state=states({n["a"]: "LOCKED"}))
    assert ei.value.pid == n["a"] and "LOCKED" in ei.value.reason


def test_no_participant_is_refused(spawn_tree, shim, ctl):
    n = spawn_tree({"name": "root", "children": [{"name": "a"}]})
    with pytest.raises(CensusError) as ei:
        census.take_census([n["root"]], control_dir=ctl, shim_path=shim, get_state=states({}))
    assert "no cuinterpose participant" in ei.value.reason


def test_missing_root_is_refused(shim, ctl):
    with pytest.raises(CensusError) as ei:
        census.take_census([2 ** 22 + 7], control_dir=ctl, shim_path=shim, get_state=states({}))
    assert ei.value.pid == 2 ** 22 + 7 and "no such process" in ei.value.reason


def test_two_roots(spawn_tree, shim, ctl):
    n1 = spawn_tree({"name": "r1", "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}]})
    n2 = spawn_tree({"name": "r2", "children": [{"name": "b", "map": str(shim), "sock": str(ctl)}]})
    c = census.take_census([n1["r1"], n2["r2"]], control_dir=ctl, shim_path=shim,
                           get_state=states({n1["a"]: "RUNNING", n2["b"]: "RUNNING"}))
    assert c.roots == [n1["r1"], n2["r2"]]
    assert [p.pid for p in c.participants] == sorted([n1["a"], n2["b"]])


def test_shim_replaced_on_disk_is_refused(spawn_tree, shim, ctl):
    n = spawn_tree({"name": "root", "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}]})
    data = shim.read_bytes()
    shim.unlink()
    shim.write_bytes(data)  # a rebuild: same path, new inode; the process maps the deleted one
    with pytest.raises(CensusError) as ei:
        census.take_census([n["root"]], control_dir=ctl, shim_path=shim,
                           get_state=states({n["a"]: "RUNNING"}))
    assert ei.value.pid == n["a"]
    assert f"{shim} (deleted)" in ei.value.reason and "replaced on disk" in ei.value.reason
