"""Census on synthetic trees of real processes (no CUDA needed: get_state is a stub)."""

from __future__ import annotations

import shutil

import pytest

from cuinterpose.agent.errors import CensusError, NativeError
from cuinterpose.agent.mech import census, procfs


def states(cuda: dict):
    def get_state(pid):
        if pid in cuda:
            return cuda[pid]
        raise NativeError("get_state", pid, "CUDA_ERROR_NOT_INITIALIZED")

    return get_state


def test_participants_and_tree_order(spawn_tree, shim, ctl):
    n = spawn_tree(
        {
            "name": "root",
            "map": str(shim),
            "children": [
                {"name": "a", "map": str(shim), "sock": str(ctl)},
                {"name": "b", "map": str(shim), "sock": str(ctl), "children": [{"name": "helper"}]},
            ],
        }
    )
    c = census.take_census(
        [n["root"]],
        control_dir=ctl,
        shim_path=shim,
        get_state=states({n["a"]: "RUNNING", n["b"]: "RUNNING"}),
    )
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
    n = spawn_tree(
        {
            "name": "root",
            "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}, {"name": "rogue"}],
        }
    )
    with pytest.raises(CensusError) as ei:
        census.take_census(
            [n["root"]],
            control_dir=ctl,
            shim_path=shim,
            get_state=states({n["a"]: "RUNNING", n["rogue"]: "RUNNING"}),
        )
    assert ei.value.pid == n["rogue"]
    assert f"pid {n['rogue']}" in str(ei.value) and "without the shim" in str(ei.value)


def test_cuda_process_without_socket_is_refused(spawn_tree, shim, ctl):
    n = spawn_tree({"name": "root", "children": [{"name": "a", "map": str(shim)}]})
    with pytest.raises(CensusError) as ei:
        census.take_census(
            [n["root"]], control_dir=ctl, shim_path=shim, get_state=states({n["a"]: "RUNNING"})
        )
    assert ei.value.pid == n["a"] and "no control socket" in ei.value.reason


def test_foreign_shim_build_is_refused(spawn_tree, shim, ctl, tmp_path):
    other = tmp_path / "other" / "libcuinterpose.so"
    other.parent.mkdir()
    shutil.copy(shim, other)  # same bytes, another inode: not the installed shim
    n = spawn_tree(
        {
            "name": "root",
            "children": [
                {"name": "a", "map": str(shim), "sock": str(ctl)},
                {"name": "b", "map": str(other), "sock": str(ctl)},
            ],
        }
    )
    with pytest.raises(CensusError) as ei:
        census.take_census(
            [n["root"]],
            control_dir=ctl,
            shim_path=shim,
            get_state=states({n["a"]: "RUNNING", n["b"]: "RUNNING"}),
        )
    assert ei.value.pid == n["b"] and str(other) in ei.value.reason


def test_socket_without_driver_state_is_refused(spawn_tree, shim, ctl):
    n = spawn_tree(
        {"name": "root", "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}]}
    )
    with pytest.raises(CensusError) as ei:
        census.take_census([n["root"]], control_dir=ctl, shim_path=shim, get_state=states({}))
    assert ei.value.pid == n["a"] and "CUDA_ERROR_NOT_INITIALIZED" in ei.value.reason


def test_locked_process_is_refused(spawn_tree, shim, ctl):
    n = spawn_tree(
        {"name": "root", "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}]}
    )
    with pytest.raises(CensusError) as ei:
        census.take_census(
            [n["root"]], control_dir=ctl, shim_path=shim, get_state=states({n["a"]: "LOCKED"})
        )
    assert ei.value.pid == n["a"] and "LOCKED" in ei.value.reason


def test_no_participant_is_refused(spawn_tree, shim, ctl):
    n = spawn_tree({"name": "root", "children": [{"name": "a"}]})
    with pytest.raises(CensusError) as ei:
        census.take_census([n["root"]], control_dir=ctl, shim_path=shim, get_state=states({}))
    assert "no cuinterpose participant" in ei.value.reason


def test_missing_root_is_refused(shim, ctl):
    with pytest.raises(CensusError) as ei:
        census.take_census([2**22 + 7], control_dir=ctl, shim_path=shim, get_state=states({}))
    assert ei.value.pid == 2**22 + 7 and "no such process" in ei.value.reason


def test_two_roots(spawn_tree, shim, ctl):
    n1 = spawn_tree({"name": "r1", "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}]})
    n2 = spawn_tree({"name": "r2", "children": [{"name": "b", "map": str(shim), "sock": str(ctl)}]})
    c = census.take_census(
        [n1["r1"], n2["r2"]],
        control_dir=ctl,
        shim_path=shim,
        get_state=states({n1["a"]: "RUNNING", n2["b"]: "RUNNING"}),
    )
    assert c.roots == [n1["r1"], n2["r2"]]
    assert [p.pid for p in c.participants] == sorted([n1["a"], n2["b"]])


def test_shim_replaced_on_disk_is_refused(spawn_tree, shim, ctl):
    n = spawn_tree(
        {"name": "root", "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}]}
    )
    data = shim.read_bytes()
    shim.unlink()
    shim.write_bytes(data)  # a rebuild: same path, new inode; the process maps the deleted one
    with pytest.raises(CensusError) as ei:
        census.take_census(
            [n["root"]], control_dir=ctl, shim_path=shim, get_state=states({n["a"]: "RUNNING"})
        )
    assert ei.value.pid == n["a"]
    assert f"{shim} (deleted)" in ei.value.reason and "replaced on disk" in ei.value.reason


def test_a_root_inside_another_roots_tree_is_refused(spawn_tree, shim, ctl):
    """--pid ROOT --pid RANK: the rank would be quiesced (and dumped) twice."""
    n = spawn_tree(
        {
            "name": "root",
            "map": str(shim),
            "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}],
        }
    )
    with pytest.raises(CensusError) as ei:
        census.take_census(
            [n["root"], n["a"]],
            control_dir=ctl,
            shim_path=shim,
            get_state=states({n["a"]: "RUNNING"}),
        )
    e = ei.value
    assert (e.phase, e.pid) == ("census", n["a"])
    assert e.reason == (
        f"(python) is inside the tree of --pid {n['root']}; pass only the root of "
        "each tree (its whole tree is checkpointed with it)"
    )


def test_job_root_hint_names_the_parent_that_runs_under_the_shim(spawn_tree, shim, ctl):
    n = spawn_tree(
        {
            "name": "root",
            "map": str(shim),
            "children": [
                {"name": "a", "map": str(shim), "sock": str(ctl)},
                {"name": "b", "map": str(shim)},
            ],
        }
    )
    s = census.ShimFile.of(shim)
    assert census.job_root_hint(n["a"], s) == (
        f"pid {n['a']} looks like a rank, not the root of its job: its parent pid {n['root']} "
        f"(python) runs under the shim too; pass --pid {n['root']}"
    )
    assert census.job_root_hint(n["root"], s) is None  # parent: pytest, no shim


def test_a_process_whose_maps_cannot_be_read_is_refused_by_name(spawn_tree, shim, ctl, monkeypatch):
    """A pid the agent does not own: /proc/PID/maps is unreadable. That must be said, not taken
    for "no shim mapped" (which blamed the workload: "a CUDA process without the shim")."""
    n = spawn_tree({"name": "root", "map": str(shim), "sock": str(ctl)})
    real_open = open

    def deny(path, *a, **kw):
        if str(path) == f"/proc/{n['root']}/maps":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(procfs, "open", deny, raising=False)  # census reads /proc there
    with pytest.raises(CensusError) as ei:
        census.take_census(
            [n["root"]], control_dir=ctl, shim_path=shim, get_state=states({n["root"]: "RUNNING"})
        )
    e = ei.value
    assert (e.phase, e.pid) == ("census", n["root"])
    assert e.reason == (
        f"cannot read /proc/{n['root']}/maps (Permission denied): run the agent "
        "as root or as the workload's user"
    )


def test_a_rank_using_another_control_dir_is_refused_naming_that_dir(
    spawn_tree, shim, ctl, tmp_path
):
    other = tmp_path / "other-ctl"
    other.mkdir()
    n = spawn_tree(
        {
            "name": "root",
            "map": str(shim),
            "children": [
                {
                    "name": "a",
                    "map": str(shim),
                    "sock": str(other),
                    "env": {"CUINTERPOSE_CONTROL_DIR": str(other)},
                }
            ],
        }
    )
    with pytest.raises(CensusError) as ei:
        census.take_census(
            [n["root"]], control_dir=ctl, shim_path=shim, get_state=states({n["a"]: "RUNNING"})
        )
    e = ei.value
    assert (e.phase, e.pid) == ("census", n["a"])
    assert e.reason == (
        f"(python) is a CUDA process with the shim mapped but no control socket "
        f"{ctl.resolve() / f'cuinterpose-{n[chr(97)]}.sock'}: its shim uses the "
        f"control dir {other} (CUINTERPOSE_CONTROL_DIR in its environment); pass "
        f"--control-dir {other}"
    )
