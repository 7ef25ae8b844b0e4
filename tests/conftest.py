"""Shared fixtures. Each area keeps its own fixtures in tests/<area>/conftest.py.

- ``cuda_include``: the pinned wheel's CUDA include directory (cuda.h).
- ``build_c``: compile a C program against cuda.h and protocol.h into a cached build dir,
  optionally with ASan/UBSan (``sanitize=True``); returns the executable path.
- ``fake_env``: an environment dict that runs a child on fakecuda with a private control
  directory and call log: LD_LIBRARY_PATH=<fakecuda dir>, FAKECUDA_LOG, CUINTERPOSE_CONTROL_DIR.
  Add ``LD_PRELOAD=shim_path`` for the shim.
- ``subreaper``: this process adopts orphans (restored trees) while the test runs.
- ``cgroup_dir``: new test cgroups (plain, in a named v1 hierarchy, or refusing every
  process), removed at teardown.
- ``private_tmp``: the code's temporary files under pytest's tree (autouse in the areas
  that run the agent).
- ``criu_ok``: a working CRIU (installed once if missing) or a skip with the reason;
  ``afdwin``: reference-workload runs on fakecuda, killed at teardown.
- ``placeholder``: a placeholder container's init in new namespaces (net, uts, ipc, optionally
  mnt and user), optionally in a test cgroup, its stdout a pipe to a reader (or an fd given).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import signal
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))  # placement_kit, for every area
from cuda_include_dir import cuda_include_dir  # noqa: E402
from placement_kit import CGROUP_FS, THREADED_CONTROLLERS, Placeholder, cgroup_bases, remove_cgroup  # noqa: E402

from cuinterpose.agent import paths  # noqa: E402

C_BUILD = REPO / "build" / "tests"
SANITIZE_FLAGS = [
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
]


@pytest.fixture(scope="session")
def cuda_include() -> pathlib.Path:
    return cuda_include_dir()


@pytest.fixture(scope="session")
def shim_path() -> pathlib.Path:
    return paths.shim_path()


@pytest.fixture(scope="session")
def fakecuda_dir() -> pathlib.Path:
    return paths.fakecuda_dir()


def compile_c(
    sources, out_name, *, cuda_include, sanitize=False, extra=(), libs=("-ldl", "-lpthread")
):
    """Compile ``sources`` (paths) into build/tests/<out_name>[-asan]; rebuild when the sources,
    the headers they may include (interposer/include, the tests' .h files, cuda.h) or
    the flags change."""
    sources = [pathlib.Path(s) for s in sources]
    flags = [
        "-std=gnu11",
        "-O1",
        "-g",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        f"-I{cuda_include}",
        f"-I{REPO / 'interposer' / 'include'}",
        *extra,
    ]
    if sanitize:
        flags += SANITIZE_FLAGS
        out_name += "-asan"
    key = hashlib.sha256()
    # the sources and every header they can include (protocol.h, the drivers' own .h, cuda.h):
    # a changed header rebuilds too
    headers = sorted((REPO / "interposer" / "include").rglob("*.h"))
    headers += sorted((REPO / "tests").rglob("*.h"))
    headers.append(pathlib.Path(cuda_include) / "cuda.h")
    for s in [*sources, *headers]:
        key.update(str(s).encode() + b"\0" + s.read_bytes())
    key.update(" ".join(flags + list(libs)).encode())
    C_BUILD.mkdir(parents=True, exist_ok=True)
    exe = C_BUILD / out_name
    stamp = C_BUILD / (out_name + ".sha256")
    if exe.exists() and stamp.exists() and stamp.read_text() == key.hexdigest():
        return exe
    cmd = ["cc", *flags, "-o", str(exe), *map(str, sources), *libs]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{res.stderr}")
    stamp.write_text(key.hexdigest())
    return exe


@pytest.fixture(scope="session")
def build_c(cuda_include):
    def _build(sources, out_name, **kw):
        return compile_c(sources, out_name, cuda_include=cuda_include, **kw)

    return _build


@pytest.fixture
def fake_env(tmp_path, fakecuda_dir):
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["LD_LIBRARY_PATH"] = str(fakecuda_dir)
    env["FAKECUDA_LOG"] = str(tmp_path / "fakecuda.log")
    env["CUINTERPOSE_CONTROL_DIR"] = str(ctl)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def ctl(tmp_path) -> pathlib.Path:
    """An empty control directory (``tmp_path/ctl``)."""
    d = tmp_path / "ctl"
    d.mkdir()
    return d


@pytest.fixture
def private_tmp(tmp_path_factory, monkeypatch):
    """Whatever the code under test puts in the temporary directory (CRIU restore work dirs,
    kept CRIU logs, ...) goes under pytest's temporary tree, which pytest removes: no litter
    in /tmp. Subprocesses (the agent CLI) get it through TMPDIR. The areas that run the agent
    use it for every test (their conftest's autouse ``_private_tmp``); not global, since some
    tests need short /tmp paths for Unix sockets."""
    import tempfile

    d = tmp_path_factory.mktemp("tmp")
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    monkeypatch.setenv("TMPDIR", str(d))
    return d


@pytest.fixture
def subreaper():
    """This process adopts orphans (a CRIU-restored tree is not our child) while the test
    runs; zombies are reaped at teardown."""
    from cuinterpose.workloads.afdwin import demo

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(demo.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    yield
    libc.prctl(demo.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    demo.reap_zombies()


# --------------------------------------------------------------------------- placements
# helpers (cgroups_of, comm_of, Placeholder, ...) live in tests/placement_kit.py


@pytest.fixture
def cgroup_dir():
    """cgroup_dir(refusing=False, *, hierarchy=None) -> path (str) of a new test cgroup, removed
    at teardown after killing what is left in it.

    Plain: a child of the v1 ``pids`` hierarchy (or of the v2 one): any process may be moved
    into it. ``hierarchy``: a child of that v1 hierarchy instead (e.g. ``"cpu"``; fails when it
    is not mounted). ``refusing=True``: a cgroup whose ``cgroup.procs`` refuses every process
    (cgroup(7)), so no process can be in it either: v1 ``cpuset`` with no cpus and mems
    (ENOSPC), v2 one with a domain controller enabled for its children (EBUSY, the
    no-internal-processes rule). Never the memory hierarchy."""
    made: list[pathlib.Path] = []

    def make(refusing: bool = False, *, hierarchy: str | None = None) -> str:
        plain, refuse = cgroup_bases()
        if hierarchy is not None:
            assert hierarchy != "memory" and not refusing
            plain = CGROUP_FS / hierarchy
            if not (plain / "cgroup.procs").is_file():
                pytest.fail(f"no cgroup v1 {hierarchy} hierarchy at {plain}")
        base = refuse if refusing else plain
        d = base / f"cuinterpose-test-{os.getpid()}-{os.urandom(4).hex()}"
        d.mkdir()
        made.append(d)
        if refusing and base != plain:
            pass  # v1 cpuset: a new one has empty cpuset.cpus/mems
        elif refusing:
            (d / "leaf").mkdir()
            made.append(d / "leaf")
            ctrls = (d / "cgroup.controllers").read_text().split()
            for c in ctrls:
                if c in THREADED_CONTROLLERS:
                    continue  # allowed beside processes: would not refuse them
                try:
                    (d / "cgroup.subtree_control").write_text(f"+{c}")
                    break
                except OSError:
                    continue
            else:
                pytest.fail(
                    f"cannot make {d} refuse processes: no domain controller of "
                    f"{ctrls} can be enabled for its children"
                )
        return str(d)

    yield make
    for d in reversed(made):
        remove_cgroup(d)


@pytest.fixture
def placeholder(tmp_path):
    """placeholder(hostname, *, cgroup=None, mount=False, stdout=True, prepare="", out=None,
    stdout_fd=None, stderr_fd=None, user=False) -> :class:`placement_kit.Placeholder`;
    stopped at teardown."""
    made: list[Placeholder] = []

    def start(hostname: str, **kw) -> Placeholder:
        p = Placeholder(tmp_path, hostname, **kw)
        made.append(p)
        return p

    yield start
    for p in made:
        p.stop()


# --------------------------------------------------------------------------- CRIU, afdwin


@pytest.fixture(scope="session")
def criu_ok() -> list[str]:
    """The argv prefix of a working CRIU (``agent.criu.criu_command``). Without one, runs
    scripts/install-criu.sh once; if CRIU still cannot run on this machine, skips with the
    reason printed (the only allowed skip: a kernel or sandbox where CRIU cannot work)."""
    from cuinterpose.agent.mech import criu

    try:
        return criu.criu_command()
    except criu.CriuError as first:
        res = subprocess.run(
            ["bash", str(REPO / "scripts" / "install-criu.sh")], capture_output=True, text=True
        )
        criu.reset()
        try:
            return criu.criu_command()
        except criu.CriuError as e:
            reason = (
                f"CRIU cannot run on this machine.\n{first}\n"
                f"install-criu.sh exit {res.returncode}:\n{res.stderr[-3000:]}\n{e}"
            )
            print(reason)
            pytest.skip(reason)


@pytest.fixture
def afdwin(tmp_path, criu_ok, subreaper):
    """afdwin(steps=..., step_delay_ms=...) -> started demo.Afdwin; its whole tree (restored
    ones too) killed at teardown."""
    from cuinterpose.agent.mech.census import walk_tree
    from cuinterpose.workloads.afdwin import demo

    runs = []

    def _start(**kw):
        a = demo.Afdwin(tmp_path / f"run{len(runs)}", **kw).start()
        runs.append(a)
        return a

    yield _start
    for a in runs:
        if demo.pid_alive(a.pid):
            try:
                pids = [p for p, _, _ in walk_tree([a.pid])]
            except Exception:
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        a.kill()
