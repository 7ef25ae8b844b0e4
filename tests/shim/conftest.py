"""Fixtures for the shim (libcuinterpose.so) tests.

- ``_map_offsets`` (autouse): ``FAKECUDA_MAP_OFFSETS=1``, so mappings at an offset work.
- ``shim_env``: ``fake_env`` plus ``LD_PRELOAD=<shim>`` ($CUI_TEST_SHIM overrides the path).
- ``vmm_app``: path of tests/shim/c/vmm_app.c built against fakecuda's libcuda.so.1.
- ``App``: a running vmm_app driven line by line (see the command list in vmm_app.c);
  ``App.stderr()`` is what it wrote to stderr.
- ``FakeLog``: the fakecuda call log parsed into (pid, function, args, result) tuples.
- ``ctl``: ``ctl(app).request(op, txn_id=..., expected_phase=...)`` via the coordinator's client.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import claim_kit
import pytest

from cuinterpose.coordinator.carrierfiles import CarrierFiles, carried_streams
from cuinterpose.coordinator.client import ShimClient
from cuinterpose.coordinator.protocol import MUTATING_OPS, Op, Phase, socket_path

HERE = pathlib.Path(__file__).resolve().parent
C_BUILD_DIR = HERE.parent.parent / "build" / "tests"
C_DIR = HERE / "c"
GRAN = 2 << 20  # fakecuda's default granularity (FAKECUDA_GRANULARITY)
TAG = 0xC01E  # top 16 bits of a virtual allocation handle
POSIX = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
FABRIC = 8
RW = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


@pytest.fixture(autouse=True)
def _map_offsets(monkeypatch):
    """The shim keeps each mapping's offset into its allocation, so its tests map at offsets:
    FAKECUDA_MAP_OFFSETS=1 (R580 itself refuses a non-zero offset, docs/fakecuda.md)."""
    monkeypatch.setenv("FAKECUDA_MAP_OFFSETS", "1")


@pytest.fixture
def shim_env(fake_env, shim_path):
    env = dict(fake_env)
    # CUI_TEST_SHIM=<path> runs the suite against another build (e.g. to show a new test fails
    # on the previous shim); the default is the installed one.
    env["LD_PRELOAD"] = os.environ.get("CUI_TEST_SHIM") or str(shim_path)
    return env


def link_fakecuda(fakecuda_dir):
    return (f"-L{fakecuda_dir}", "-l:libcuda.so.1", "-ldl", "-lpthread")


@pytest.fixture(scope="session")
def vmm_app(build_c, fakecuda_dir):
    return build_c([C_DIR / "vmm_app.c"], "shim_vmm_app", libs=link_fakecuda(fakecuda_dir))


class App:
    """One vmm_app process, started through ``prefix`` (e.g. ``setarch -R`` for TSan) when one
    is given. ``cmd`` returns the reply tokens; ``ok`` asserts success."""

    def __init__(self, exe, env, prefix=()):
        import tempfile

        self.errfile = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [*prefix, str(exe)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errfile,
            env=env,
            text=True,
            bufsize=1,
        )
        self.env = env
        self.pid = self.proc.pid

    def stderr(self) -> str:
        """Everything the process wrote to stderr so far."""
        self.errfile.seek(0)
        return self.errfile.read().decode(errors="replace")

    def cmd(self, line: str) -> list[str]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        assert out, f"vmm_app {self.pid} exited on {line!r} (rc={self.proc.poll()})"
        return out.split()

    def ok(self, line: str) -> list[str]:
        toks = self.cmd(line)
        assert toks[0] == "ok", f"{line!r} -> {' '.join(toks)}"
        return toks[1:]

    def val(self, line: str) -> int:
        return int(self.ok(line)[0], 0)

    def err(self, line: str) -> int:
        toks = self.cmd(line)
        assert toks[0] == "err", f"{line!r} unexpectedly succeeded: {' '.join(toks)}"
        return int(toks[1])

    def close(self):
        if self.proc.poll() is None:
            try:
                self.cmd("quit")
            except (AssertionError, BrokenPipeError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.errfile):
            try:
                f.close()
            except OSError:
                pass


@pytest.fixture
def apps(vmm_app, shim_env):
    started: list[App] = []

    def start(env=None):
        a = App(vmm_app, env or shim_env)
        started.append(a)
        return a

    yield start
    for a in started:
        a.close()


LOG_RE = re.compile(r"^(\d+) (\d+) (\w+)\((.*)\) = (\w+)$")


class FakeLog:
    """fakecuda's FAKECUDA_LOG: ``calls(pid, fn)`` -> [(args dict, result name)]."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines() if self.path.exists() else []

    def mark(self) -> int:
        return len(self.lines())

    def calls(self, pid=None, fn=None, since=0):
        out = []
        for ln in self.lines()[since:]:
            m = LOG_RE.match(ln)
            if not m:
                continue
            if pid is not None and int(m.group(1)) != pid:
                continue
            if fn is not None and m.group(3) != fn:
                continue
            args = dict(kv.split("=", 1) for kv in m.group(4).split() if "=" in kv)
            out.append((m.group(3), args, m.group(5)))
        return out

    def lookups(self, pid=None):
        out = []
        for ln in self.lines():
            parts = ln.split()
            if len(parts) >= 8 and parts[2] == "lookup" and (pid is None or int(parts[0]) == pid):
                out.append((parts[3], parts[4], int(parts[5]), int(parts[6]), parts[8]))
        return out


@pytest.fixture
def fake_log(shim_env):
    return FakeLog(shim_env["FAKECUDA_LOG"])


class CarryingClient(ShimClient):
    """A ShimClient that brings the chunk files (protocol.h "Carriers") to SAVE_ALLOCATIONS and
    LOAD_ALLOCATIONS when the caller passes none: it INSPECTs the process, and opens one file per
    carried allocation in ``files`` (SAVE: the pid's old files are removed first)."""

    def __init__(self, path, files: CarrierFiles, **kw):
        super().__init__(path, claim=claim_kit.TOKEN, **kw)
        self.files = files

    def request(self, op, *, carriers=None, **kw):
        if op in MUTATING_OPS:  # the test drives the shim as an agent does: it holds a claim
            claim_kit.take(os.path.dirname(self.socket_path), [self.pid])
        if carriers is None and op in (Op.SAVE_ALLOCATIONS, Op.LOAD_ALLOCATIONS):
            recs = super().request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records
            if op == Op.SAVE_ALLOCATIONS:
                self.files.remove([self.pid])
            carriers = self.files.request(op, self.pid, carried_streams(recs))
            try:
                return super().request(op, carriers=carriers, **kw)
            finally:
                CarrierFiles.close(carriers)
        return super().request(op, carriers=carriers, **kw)


@pytest.fixture
def ctl(shim_env, tmp_path):
    """ShimClient factory (app or pid); SAVE/LOAD_ALLOCATIONS bring chunk files from
    ``ctl.files`` (one directory per test, 64 KiB chunks, a 256 KiB ring)."""
    files = CarrierFiles(tmp_path / "chunks", chunk_bytes=64 << 10, staging_bytes=256 << 10)

    def _client(app_or_pid) -> ShimClient:
        pid = app_or_pid.pid if isinstance(app_or_pid, App) else int(app_or_pid)
        return CarryingClient(
            socket_path(shim_env["CUINTERPOSE_CONTROL_DIR"], pid), files, timeout_s=30
        )

    _client.files = files
    return _client


@pytest.fixture
def chunk_files(ctl):
    """The chunk files of the ``ctl`` clients."""
    return ctl.files


REPO = HERE.parent.parent
SHIM_SRC = REPO / "interposer"
FAKECUDA_SRC = REPO / "fakecuda"


def build_shared(sources, out: pathlib.Path, flags, libs=("-ldl", "-lpthread")) -> pathlib.Path:
    """Compile ``sources`` into the shared library ``out`` unless an identical build exists
    (inputs and flags hashed into ``out``.sha256). Headers (and hooks.def) are hashed too."""
    import hashlib

    key = hashlib.sha256()
    for s in sources:
        key.update(pathlib.Path(s).read_bytes())
    for h in (
        sorted((SHIM_SRC / "src").glob("*.h"))
        + sorted((SHIM_SRC / "src").glob("*.def"))
        + sorted((SHIM_SRC / "include").rglob("*.h"))
        + sorted((FAKECUDA_SRC / "src").glob("*.h"))
        + sorted((FAKECUDA_SRC / "src").glob("*.inc"))
        + sorted((FAKECUDA_SRC / "src").glob("*.def"))
    ):
        key.update(h.read_bytes())
    key.update(" ".join(map(str, flags)).encode())
    stamp = out.with_name(out.name + ".sha256")
    if out.exists() and stamp.exists() and stamp.read_text() == key.hexdigest():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["cc", "-shared", "-fPIC", *map(str, flags), "-o", str(out), *map(str, sources), *libs]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{res.stderr}")
    stamp.write_text(key.hexdigest())
    return out
